"""``cloudtrain up``, ``status`` and ``down``: a cluster's life outside of a job.

Only click is imported at module level; each command imports what it needs when it runs.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from cloudtrain.commands.access import ssh_config_choice
from cloudtrain.commands.base import (CONTEXT, check_name, confirm_cost, guard, open_env,
                                      show_notes)
from cloudtrain.commands.overrideopts import override_options, overrides_from, show_changes

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.overrides import Change
    from cloudtrain.provider.contract import Plan
    from cloudtrain.schema import ClusterRow
    from cloudtrain.ui import UI


@click.command(context_settings=CONTEXT)
@click.argument("task_file", type=click.Path(dir_okay=False))
@click.option("-c", "--cluster", "cluster_name", help="Cluster name (default: the task's name).")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before spending money.")
@click.option("--dry-run", is_flag=True, help="Print the plan; create nothing.")
@click.option("--no-bootstrap", is_flag=True, help="Stop once the nodes run and accept SSH.")
@click.option("--keep-on-failure", is_flag=True,
              help="Keep a new cluster whose provisioning failed (default: roll it back).")
@override_options
@ssh_config_choice(ask=True)
@click.option("--json", "as_json", is_flag=True,
              help="At the end print one JSON object on stdout: the cluster, its nodes and every "
                   "placement attempt with its outcome and reason (also when up fails: then with "
                   "'error', and the exit code is the failure's).")
@guard
def up(task_file: str, cluster_name: str | None, yes: bool, dry_run: bool, no_bootstrap: bool,
       keep_on_failure: bool, as_json: bool, **flags: Any) -> None:
    """Provision a cluster for TASK_FILE (adopting what exists), wait for SSH, bootstrap.
    --gpus, --num-nodes, --use-spot, --provider, --region: over the task (the plan shows)."""
    from cloudtrain import overrides
    from cloudtrain.cluster import resolve_name
    from cloudtrain.pipeline import plan
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    task, changes = overrides.load(task_file, overrides_from(flags))
    show_notes(task)
    env = open_env(contact=not dry_run)
    name = resolve_name(task, cluster_name, task_file)
    planned = plan.plan(env, task, name)
    if dry_run:
        return print_plan(env.ui, planned, name, changes,
                          task.container.image if task.container else None)
    show_changes(env.ui, changes, in_plan=False)
    from cloudtrain.errors import CloudtrainError
    from cloudtrain.pipeline import job
    from cloudtrain.pipeline.provision import attempts

    if env.state.get_cluster(name) is None:
        confirm_cost(planned, yes)
    try:
        handle = job.up(env, task, name, bootstrap=not no_bootstrap,
                        keep_on_failure=keep_on_failure, planned=planned)
    except CloudtrainError as exc:
        if as_json:
            click.echo(json.dumps({"cluster": name, "ok": False, "error": exc.message,
                                   "hint": exc.hint, "attempts": attempts(env, name, planned)},
                                  indent=2))
        raise
    if as_json:
        click.echo(json.dumps(up_json(handle, attempts(env, name, planned)), indent=2))
        return
    env.ui.ok(f"Cluster '{name}' is up: {len(handle.nodes)} node(s) on {handle.row.provider}. "
              f"Next: cloudtrain launch {task_file} -c {name}")


def up_json(handle: Handle, attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """``up --json`` when the cluster is up."""
    r = handle.row
    return {
        "cluster": r.name, "ok": True, "provider": r.provider, "region": r.region,
        "zone": r.zone, "instance_type": r.instance_type, "use_spot": r.use_spot,
        "price_hourly_usd": r.hourly_price,
        "nodes": [{"rank": n.rank, "instance_id": n.instance_id, "host": n.host,
                   "internal_ip": n.internal_ip} for n in handle.nodes],
        "attempts": attempts}


def print_plan(ui: UI, plan: Plan, name: str, changes: list[Change] | None = None,
               image: str | None = None) -> None:
    """``up --dry-run``'s (and ``launch --dry-run``'s) plan, with what the command line
    overrode, the task's container image, and one warning line when the provider is not usable
    here (``cloudtrain check``)."""
    ui.info(f"Plan for cluster '{name}' (dry run: nothing is created)")
    rows = [("provider", plan.provider), ("region", plan.region or "-"), ("zone", plan.zone or "-"),
            ("instance", plan.instance_type or "-"), ("accelerators", plan.accelerators or "none"),
            ("nodes", str(plan.num_nodes)), ("spot", "yes" if plan.use_spot else "no")]
    if plan.network is not None:
        rows.append(("network", plan.network))
    if image is not None:
        rows.append(("container", f"{image} (setup, run and exec run in it on every node)"))
    if plan.hourly_price_per_node is not None:
        rows.append(("price", f"${plan.hourly_price_per_node:.2f}/h per node, "
                              f"${plan.hourly_price_per_node * plan.num_nodes:.2f}/h for the cluster"))
    for k, v in rows:
        ui.info(f"  {k:<13}{v}")
    ui.info("  would create:")
    for c in plan.creates:
        ui.info(f"    - {c}")
    for n in plan.notes:
        ui.info(f"  note: {n}")
    show_changes(ui, changes or [])
    from cloudtrain.check import warning

    if (line := warning(plan.provider)) is not None:   # SDK and credentials only: no network
        ui.warn(line)


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--refresh", is_flag=True,
              help="Ask every provider (cloud APIs included) and every node (the guard's state, "
                   "the GPUs with nvidia-smi, the lease renewed): one round trip per node.")
@guard
def status(cluster_name: str | None, as_json: bool, refresh: bool) -> None:
    """Show clusters and their nodes, with each cluster's price per node-hour and for the
    cluster, as recorded at launch, and what it has cost so far (from the spend ledger, as
    'cost-report' counts it: never re-priced from the catalog; a running cluster counts up
    to now). Without --refresh it reaches no node and no provider: the local state, and the
    node guards and GPUs as the last contact saw them, with its age.

    --json: a list of clusters, each with name, provider, status, num_nodes, region,
    instance_type, accelerators, use_spot, price_hourly_usd (per node), cluster_hourly_usd,
    cost_so_far_usd (null: no price was recorded), created_at, live (whether this command
    asked the nodes), nodes (each with host_key: "pinned at creation", "the user's
    known_hosts" or "learned on first contact"), autostop, guard (with as_of, age_s, live)
    and gpus: per node the GPU count, models, utilisation, memory, temperature, power, the
    idle GPUs and every GPU's record, as of gpus_at (null: never asked), rules: the
    budget and the job-end stops in force, each with the command that set it, and image:
    the container image and digest of the cluster's last launch with one (null: none)."""
    if cluster_name is not None:
        check_name(cluster_name)
    env = open_env(quiet=as_json, contact=refresh)
    rows, spent, pins, gone, guards = (gather_live if refresh else gather)(env, cluster_name)
    if as_json:
        from cloudtrain.containers.recorded import with_images

        from cloudtrain.preflight.recorded import with_preflight

        click.echo(json.dumps(with_preflight(env.state, with_images(env.state, with_rules(
            env, status_json(rows, spent, pins, guards, refresh)))) + gone, indent=2))
        return
    for g in gone:
        click.echo(f"{g['name']}: {g['status']} (its nodes stopped themselves: {g['reason']})")
    if not rows:
        if not gone:
            click.echo("No clusters.")
        return
    status_table(rows, spent, pins)
    status_lines(env, rows, guards, refresh)


def status_lines(env: Env, rows: list[ClusterRow], guards: dict[str, dict[str, Any]],
                 refresh: bool) -> None:
    """Under the table: recoveries, each guard's policy and state, each node's GPU use."""
    import time

    from cloudtrain.ledger import recovery_line
    from cloudtrain.pipeline import rules
    from cloudtrain.pipeline.lastseen import HINT, ago, saved

    from cloudtrain.containers.recorded import image_line
    from cloudtrain.preflight.recorded import preflight_line

    for r in rows:
        for rec in env.state.recoveries(r.name):
            click.echo(recovery_line(rec))
        if (img := image_line(env.state, r.name)) is not None:
            click.echo(img)
        if (pre := preflight_line(env.state, r.name)) is not None:
            click.echo(pre)
        for line in allocation_lines(env, r) if refresh else []:
            click.echo(line)
        g = guards.get(r.name) or {}
        if r.status == "PROBABLY_STOPPED":
            click.echo(f"{r.name}: {g['expected_stop']['words']}")
        elif g:
            words = (g.get("guard") or {}).get("words")
            click.echo(f"{r.name}: {g['policy']}" + (f"; {words}" if words else ""))
            click.echo(f"{r.name}: {rules.words(saved(env, r.name))}")
        if "gpus" in g:
            if not refresh or g.get("stale"):
                click.echo(f"{r.name}: GPUs as of {ago(time.time() - g['gpus_at'])} ({HINT}):")
            gpu_lines(r.name, g)
    if not refresh:
        click.echo("(the local state, as of each cluster's last contact; "
                   "'cloudtrain status --refresh' asks the providers and the nodes)", err=True)


def allocation_lines(env: Env, r: ClusterRow) -> list[str]:
    """A scheduler's word on the cluster's allocation (job id, state, time left), asked now
    (``status --refresh``: a plain status asks no provider)."""
    from cloudtrain.errors import CloudtrainError
    from cloudtrain.provider.contract import Allocates

    if r.provider not in env.provider_names() \
            or not issubclass(env.provider_class(r.provider), Allocates):
        return []
    provider = env.provider(r.provider)
    try:
        words = provider.allocation_words(r.name) if isinstance(provider, Allocates) else None
    except CloudtrainError as exc:
        words = f"allocation not known now ({exc.message})"
    return [f"{r.name}: {words or 'no allocation in the scheduler'}"]


def with_rules(env: Env, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cluster's rules in force and which command set each (pipeline/rules.py)."""
    from cloudtrain.pipeline import rules
    from cloudtrain.pipeline.lastseen import saved

    for e in entries:
        pol = saved(env, e["name"])
        e["rules"] = rules.view(pol) if pol else None
    return entries


def gpu_lines(name: str, live: dict[str, Any]) -> None:
    """Each node's GPU use (cloudtrain.gpuuse), one line a node."""
    if "gpus" not in live:
        return
    from cloudtrain.gpuuse import node_line

    for n in live["gpus"]:
        click.echo(f"{name}: {node_line(n)}")


def gather(env: Env, name: str | None) -> tuple[Any, ...]:
    """What a plain ``status`` shows, offline: the rows as recorded, their spend, host-key
    pinning, and the node guards' policy, idle time and GPUs as the last contact saw them."""
    from cloudtrain import cluster
    from cloudtrain.pipeline import lastseen

    rows, views, until = lastseen.offline_rows(env, cluster.listed(env, name))
    spent, pins = spend_and_pins(env, name, rows, until)
    return rows, spent, pins, [], {k: v.as_dict() if v else {} for k, v in views.items()}


def gather_live(env: Env, name: str | None) -> tuple[Any, ...]:
    """``status --refresh``: reconcile clusters that stopped themselves, ask every provider
    and every node (guard state, GPUs, the lease renewed, in one round trip per node; the
    clusters at once)."""
    from concurrent.futures import ThreadPoolExecutor

    from cloudtrain import cluster
    from cloudtrain.pipeline import guard

    gone = guard.reconcile_all(env, name)
    if name is not None and any(g["name"] == name and g["status"] == "GONE" for g in gone):
        return [], {}, {}, gone, {}
    rows = cluster.status(env, name, refresh_all=True)
    cluster.probe_hosts(env, rows)
    spent, pins = spend_and_pins(env, name, rows)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(rows)))) as pool:
        seen = list(pool.map(lambda r: guard.live(env, r.name), rows))
    return rows, spent, pins, gone, {r.name: s.as_dict() if s else {} for r, s in zip(rows, seen)}


def spend_and_pins(env: Env, name: str | None, rows: list[ClusterRow],
                   until: dict[str, float] | None = None) -> tuple[Any, Any]:
    """Each row's spend up to now (or to ``until[name]``: when it probably stopped)."""
    import time

    from cloudtrain.keys import pinning
    from cloudtrain.ledger import spend_of

    now = time.time()
    usage = env.state.usage(cluster=name) if rows else []
    spent = {r.name: spend_of(r.name, r.created_at, usage, now=(until or {}).get(r.name, now))
             for r in rows}
    return spent, {r.name: pinning(env.cluster_dir(r.name)) for r in rows}


def cluster_price(r: ClusterRow) -> float | None:
    return None if r.hourly_price is None else r.hourly_price * r.num_nodes


def status_json(rows: list[ClusterRow], spent: dict[str, float | None],
                pins: dict[str, dict[int, str]], guards: dict[str, dict[str, Any]],
                live: bool = False) -> list[dict[str, Any]]:
    return [{
        "name": r.name, "provider": r.provider, "status": r.status, "num_nodes": r.num_nodes,
        "region": r.region, "instance_type": r.instance_type, "accelerators": r.accelerators,
        "use_spot": r.use_spot, "price_hourly_usd": r.hourly_price,
        "cluster_hourly_usd": cluster_price(r),
        "cost_so_far_usd": None if (so_far := spent[r.name]) is None else round(so_far, 6),
        "hourly_price_per_node": r.hourly_price,
        "created_at": r.created_at,
        "live": live,
        "nodes": [{"rank": n.rank, "host": n.host, "port": n.port, "internal_ip": n.internal_ip,
                   "instance_id": n.instance_id, "status": n.status,
                   "host_key": pins[r.name].get(n.rank, "unknown")} for n in r.nodes],
        "autostop": guards.get(r.name, {}).get("autostop"),
        "guard": guards.get(r.name, {}).get("guard"),
        "gpus": [n.as_json() for n in guards[r.name]["gpus"]]
        if "gpus" in guards.get(r.name, {}) else None,
        "gpus_at": guards.get(r.name, {}).get("gpus_at"),
        **stop_fields(guards.get(r.name, {})),
    } for r in rows]


def stop_fields(view: dict[str, Any]) -> dict[str, Any]:
    """``expected_stop_at`` (epoch) and ``expected_stop_reason``: when the recorded rules
    stop the cluster at the latest (null: no rule tells)."""
    stop = view.get("expected_stop") or {}
    return {"expected_stop_at": stop.get("at"), "expected_stop_reason": stop.get("reason")}


def status_table(rows: list[ClusterRow], spent: dict[str, float | None],
                 pins: dict[str, dict[int, str]]) -> None:
    from cloudtrain.ledger import money
    from cloudtrain.ui import columns

    heads = ["NAME", "PROVIDER", "STATUS", "NODES", "INSTANCE", "$/H NODE", "$/H CLUSTER",
             "COST SO FAR", "HOST KEYS", "NODE ADDRESSES"]
    cells = []
    for r in rows:
        node = "-" if r.hourly_price is None else f"{r.hourly_price:.2f}"
        whole = cluster_price(r)
        addrs = ", ".join(f"{n.rank}:{n.host}:{n.port}({n.status})" for n in r.nodes)
        cells.append([r.name, r.provider, r.status, str(r.num_nodes), r.instance_type or "-",
                      node, "-" if whole is None else f"{whole:.2f}", money(spent[r.name]),
                      ", ".join(sorted({pins[r.name].get(n.rank, "unknown") for n in r.nodes}))
                      or "-", addrs])
    click.echo(columns(heads, cells, right={"$/H NODE", "$/H CLUSTER", "COST SO FAR"}))


@click.command(context_settings=CONTEXT)
@click.argument("names", nargs=-1)
@click.option("-a", "--all", "all_", is_flag=True, help="Every cluster.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@click.option("--provider", "provider_name",
              help="Tear down by tag on this provider even with no local state.")
@click.option("--forget", is_flag=True,
              help="When the provider cannot be asked (its SDK or credentials missing), "
                   "forget the cluster here without asking.")
@click.option("--discard-outputs", is_flag=True,
              help="Tear down even when a job's outputs were never pulled and cannot be now.")
@guard
def down(names: tuple[str, ...], all_: bool, yes: bool, provider_name: str | None,
         forget: bool, discard_outputs: bool) -> None:
    """Tear clusters down and check with the provider that nothing is left. Outputs of a
    job that were never pulled are pulled first (exit 2 when they cannot be)."""
    from cloudtrain.errors import CloudtrainError
    from cloudtrain.pipeline import forget as forgetting
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    stop_signals_as_interrupt()
    for n in names:
        check_name(n, "NAME")
    env = open_env()
    targets = down_targets(env, names, all_, provider_name)
    if not targets:
        env.ui.info("No clusters.")
        return
    if not yes:
        if not sys.stdin.isatty():
            if all_:
                from cloudtrain.errors import UserError

                raise UserError("'down -a' tears down every cluster.", "Add -y to confirm.")
        elif not click.confirm(f"Tear down {', '.join(targets)}?", default=True, err=True):
            return
    failed: list[CloudtrainError] = []
    for n in targets:
        try:
            forgetting.down(env, n, provider_name, forget=forget,
                            unpulled="discard" if discard_outputs else "pull")
        except CloudtrainError as exc:
            env.ui.error(f"{n}: {exc}")
            failed.append(exc)
    if failed:
        sys.exit(max(e.exit_code for e in failed))


def down_targets(env: Env, names: tuple[str, ...], all_: bool,
                 provider_name: str | None) -> list[str]:
    """The clusters ``down`` tears down: every one with -a (maybe none), else the names, each
    known here unless --provider looks for it by tag."""
    from cloudtrain.cluster import lost_record_hint
    from cloudtrain.errors import ClusterNotFound, UserError

    if all_ and names:
        raise UserError("Give cluster names or -a, not both.", "e.g. cloudtrain down my-job")
    if all_:
        return [c.name for c in env.state.list_clusters()]
    if not names:
        raise UserError("Name the cluster(s) to tear down, or -a for all.", "e.g. cloudtrain down my-job")
    known = {c.name for c in env.state.list_clusters()}
    for n in names:
        if n not in known and provider_name is None:
            raise lost_record_hint(ClusterNotFound(n, sorted(known)), n)
    return list(names)


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--idle-minutes", "idle_minutes", type=float, metavar="N",
              help="Stop after N minutes with no job and no SSH session (fractions allowed).")
@click.option("--down/--stop", "down", default=None,
              help="When it stops: tear the cluster down (default) or only stop it.")
@click.option("--off", is_flag=True, help="No idle stop.")
@guard
def autostop(cluster_name: str, idle_minutes: float | None, down: bool | None, off: bool) -> None:
    """Change the idle stop of a live cluster: the node guards read the new policy at once.

    The other guard rules (job end, budget, lifetime) come from launch and the task; see
    'cloudtrain status NAME' for the policy and how long the cluster has been idle."""
    from cloudtrain.pipeline import guard as node_guard

    check_name(cluster_name)
    check_autostop(idle_minutes, down, off)
    env = open_env()
    pol = node_guard.set_autostop(env, cluster_name, idle_minutes, down, off)
    env.ui.ok(f"'{cluster_name}': {node_guard.describe(pol)}")


def check_autostop(idle_minutes: float | None, down: bool | None, off: bool) -> None:
    import math

    from cloudtrain.errors import UserError
    from cloudtrain.taskmodel import MAX_HOURS

    if off and (idle_minutes is not None or down is not None):
        raise UserError("--off turns the idle stop off; it does not go with --idle-minutes, "
                        "--down or --stop.", "Give --off alone, or --idle-minutes N [--down|--stop].")
    if not off and idle_minutes is None and down is None:
        raise UserError("autostop needs --idle-minutes N, --down/--stop, or --off.",
                        "e.g. cloudtrain autostop NAME --idle-minutes 30 --down")
    if idle_minutes is not None and not (math.isfinite(idle_minutes)
                                         and 0 < idle_minutes <= MAX_HOURS * 60):
        raise UserError(f"--idle-minutes {idle_minutes:g} is not a number of minutes above 0 "
                        f"(at most {MAX_HOURS * 60}).",
                        "Give e.g. --idle-minutes 30 (0.25 is 15 s), or --off for no idle stop.")


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    for command in (up, status, down, autostop):
        cli.add_command(command)
