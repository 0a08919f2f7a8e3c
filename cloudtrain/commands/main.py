"""The command line: a thin layer over cluster / launch.

Only click is imported at module level so that ``cloudtrain --help`` starts fast and never
imports a cloud SDK; each command imports what it needs when it runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import click

if TYPE_CHECKING:
    from cloudtrain.cluster import Env
    from cloudtrain.ui import UI

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _fail(exc: BaseException) -> NoReturn:
    from cloudtrain.errors import CloudtrainError

    if isinstance(exc, CloudtrainError):
        text = exc.message + (f"\n{exc.hint}" if exc.hint else "")
        prefix = "error: " if exc.exit_code != 130 else ""
        click.echo(prefix + text, err=True)
        sys.exit(exc.exit_code)
    raise exc


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our errors into a one-paragraph message and the right exit code; Ctrl-C into 130."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from cloudtrain.errors import CloudtrainError, Interrupted

        try:
            return fn(*args, **kwargs)
        except CloudtrainError as exc:
            _fail(exc)
        except KeyboardInterrupt:
            _fail(Interrupted("Interrupted."))

    return wrapper


def _env(quiet: bool = False) -> Env:
    from cloudtrain.cluster import open_env
    from cloudtrain.remote import node_timeout
    from cloudtrain.ui import UI

    node_timeout()   # a bad CLOUDTRAIN_NODE_TIMEOUT is refused before anything is created
    return open_env(UI(quiet=quiet))


def _load(task_file: str):  # type: ignore[no-untyped-def]
    from cloudtrain.provider.options import load_checked

    return load_checked(task_file)


# The signals that stop a command the way Ctrl-C does (exit 130, after the same cleanup:
# the job stopped on every node, outputs pulled back where possible, --down tearing down).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _silence_lost_terminal() -> None:
    """After SIGHUP the terminal is gone and writing to it fails (EIO), which would abort the
    cleanup half-way: what would have gone to it goes to /dev/null (the logs keep it)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if os.isatty(fd):
                    os.dup2(devnull, fd)
            except OSError:
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _sigterm_as_interrupt() -> None:
    """SIGTERM and SIGHUP (the terminal was closed) are handled like Ctrl-C."""
    def handler(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            _silence_lost_terminal()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


class _Shielded:
    """While inside, SIGINT/SIGTERM/SIGHUP are ignored: a teardown or rollback is not cut off
    half-way (a SIGHUP still silences the lost terminal)."""

    def __enter__(self) -> None:
        def on_hup(signum: int, frame: object) -> None:
            _silence_lost_terminal()

        self.previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            signal.signal(s, on_hup if s == signal.SIGHUP else signal.SIG_IGN)

    def __exit__(self, *exc: object) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


def _parse_env(pairs: tuple[str, ...]) -> dict[str, str]:
    from cloudtrain.errors import UserError

    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.isidentifier():
            raise UserError(f"--env '{p}' is not KEY=VALUE.", "Write e.g. --env LR=0.1")
        out[k] = v
    return out


def _confirm_cost(env: Env, plan: Any, yes: bool) -> None:
    from cloudtrain.errors import Interrupted

    price = plan.hourly_price_per_node
    if yes or not price or not sys.stdin.isatty():
        return
    total = price * plan.num_nodes
    if not click.confirm(f"This cluster costs about ${total:.2f}/hour while it runs. Continue?",
                         default=True, err=True):
        raise Interrupted("Cancelled; nothing was created.")


def _print_plan(ui: UI, plan: Any, name: str) -> None:
    ui.info(f"Plan for cluster '{name}' (dry run: nothing is created)")
    rows = [("provider", plan.provider), ("region", plan.region or "-"), ("zone", plan.zone or "-"),
            ("instance", plan.instance_type or "-"), ("accelerators", plan.accelerators or "none"),
            ("nodes", str(plan.num_nodes)), ("spot", "yes" if plan.use_spot else "no")]
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


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="cloudtrain", prog_name="cloudtrain")
def cli() -> None:
    """cloudtrain: run a training job on N GPU machines (AWS, GCP, Azure, your own hosts or
    local nodes), know what it costs, and leave nothing running.

    \b
    Quick start:
      cloudtrain launch task.yaml --down     provision, sync, train, tear down
      cloudtrain status                      what is running
      cloudtrain down NAME                   tear a cluster down

    State lives in $CLOUDTRAIN_HOME (default: your user data directory).
    """


@cli.command(context_settings=CONTEXT)
@click.argument("directory", default=".", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Overwrite files the template would replace.")
@_guard
def init(directory: str, force: bool) -> None:
    """Start a project in DIRECTORY from the training template: a DDP training script and
    example tasks (local 2-node demo, AWS 2 x A100:8)."""
    from pathlib import Path

    from cloudtrain.scaffold import scaffold
    from cloudtrain.ui import UI

    ui = UI()
    dest = Path(directory)
    written = scaffold(dest, force=force)
    for p in written:
        ui.info(f"  {p}")
    where = "" if dest.resolve() == Path.cwd().resolve() else f"{directory.rstrip('/')}/"
    ui.ok(f"Project ready ({len(written)} files). Next:\n"
          f"  cloudtrain launch {where}task.yaml --down        # 2 local nodes x 2 processes\n"
          f"  cloudtrain up {where}task-aws.yaml --dry-run     # 2 x A100:8 on AWS: the plan first")


@cli.command(context_settings=CONTEXT)
@click.argument("task_file", type=click.Path(dir_okay=False))
@click.option("-c", "--cluster", "cluster_name", help="Cluster name (default: the task's name).")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before spending money.")
@click.option("--dry-run", is_flag=True, help="Print the plan; create nothing.")
@click.option("--no-bootstrap", is_flag=True, help="Stop once the nodes run and accept SSH.")
@click.option("--keep-on-failure", is_flag=True,
              help="Keep a new cluster whose provisioning failed (default: roll it back).")
@click.option("--json", "as_json", is_flag=True,
              help="At the end print one JSON object on stdout: the cluster, its nodes and every "
                   "placement attempt with its outcome and reason (also when up fails: then with "
                   "'error', and the exit code is the failure's).")
@_guard
def up(task_file: str, cluster_name: str | None, yes: bool, dry_run: bool, no_bootstrap: bool,
       keep_on_failure: bool, as_json: bool) -> None:
    """Provision a cluster for TASK_FILE (adopting what exists), wait for SSH, bootstrap."""
    from cloudtrain import cluster as cl
    from cloudtrain.errors import CloudtrainError

    _sigterm_as_interrupt()
    task = _load(task_file)
    env = _env()
    name = cl.resolve_name(task, cluster_name, task_file)
    plan = cl.plan(env, task, name)
    if dry_run:
        _print_plan(env.ui, plan, name)
        return
    if env.state.get_cluster(name) is None:
        _confirm_cost(env, plan, yes)
    try:
        handle = cl.up(env, task, name, bootstrap=not no_bootstrap,
                       keep_on_failure=keep_on_failure, planned=plan)
    except CloudtrainError as exc:
        if as_json:
            click.echo(json.dumps({"cluster": name, "ok": False, "error": exc.message,
                                   "hint": exc.hint, "attempts": _attempts(env, name, plan)},
                                  indent=2))
        raise
    if as_json:
        r = handle.row
        click.echo(json.dumps({
            "cluster": name, "ok": True, "provider": r.provider, "region": r.region,
            "zone": r.zone, "instance_type": r.instance_type, "use_spot": r.use_spot,
            "price_hourly_usd": r.hourly_price,
            "nodes": [{"rank": n.rank, "instance_id": n.instance_id, "host": n.host,
                       "internal_ip": n.internal_ip} for n in handle.nodes],
            "attempts": _attempts(env, name, plan)}, indent=2))
        return
    env.ui.ok(f"Cluster '{name}' is up: {len(handle.nodes)} node(s) on {handle.row.provider}. "
              f"Next: cloudtrain launch {task_file} -c {name}")


def _attempts(env: Env, name: str, plan: Any) -> list[dict[str, Any]]:
    """Every placement attempt the providers involved remember for ``name``, in order, each
    with its provider (providers without ``attempts`` contribute nothing)."""
    from cloudtrain.provider import ReportsAttempts, registry

    names = [plan.provider] + [a.provider for a in getattr(plan, "alternatives", [])]
    out: list[dict[str, Any]] = []
    for p in dict.fromkeys(n for n in names if n):
        provider = registry.get(p, env.pctx)
        if isinstance(provider, ReportsAttempts):
            out += [{"provider": p, **a} for a in provider.attempts(name)]
    return out


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """Option callback: reject nan and inf, which click's FloatRange lets through."""
    import math

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number.", ctx, param)
    return value


@cli.command(context_settings=CONTEXT)
@click.argument("task_file", type=click.Path(dir_okay=False))
@click.option("-c", "--cluster", "cluster_name", help="Cluster name (default: the task's name).")
@click.option("--down", "down_after", is_flag=True,
              help="Tear the cluster down after the run, whatever happened.")
@click.option("-d", "--detach", is_flag=True, help="Start the job and return; see 'logs --follow'.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask before spending money.")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Extra environment (repeatable).")
@click.option("--max-cost", "max_cost", type=click.FloatRange(min=0, min_open=True), metavar="USD",
              callback=_finite,
              help="Budget for the cluster in USD (overrides the task's max_cost_usd).")
@click.option("--hours", "hours", type=click.FloatRange(min=0, min_open=True), metavar="H",
              callback=_finite,
              help="Hours the run may take, for the budget's estimate (overrides max_hours).")
@click.option("--no-budget", is_flag=True, help="Ignore max_cost_usd: no estimate, no watch.")
@_guard
def launch(task_file: str, cluster_name: str | None, down_after: bool, detach: bool, yes: bool,
           envs: tuple[str, ...], max_cost: float | None, hours: float | None,
           no_budget: bool) -> None:
    """Run TASK_FILE on a cluster: up if needed, sync, setup, run on every node, stream logs.

    With a budget (max_cost_usd, or --max-cost), launch refuses (exit 2, nothing created)
    when what the cluster has cost so far plus its $/h x hours (--hours, or max_hours)
    exceeds it, or when no hours are given. While the job runs it warns at 80% of the budget
    and, at 100%, stops the job everywhere, tears the cluster down and exits 3. The budget
    covers the whole cluster, earlier launches on it included. -d cannot be watched: it is
    refused with a budget (use --no-budget to launch detached without one).

    Exits with the job's exit code (the first failing node's), 3 when the budget was
    reached, 130 on Ctrl-C."""
    from cloudtrain import budget as bg
    from cloudtrain import cluster as cl
    from cloudtrain.pipeline import run as ln
    from cloudtrain.errors import CloudtrainError, UserError

    _sigterm_as_interrupt()
    task = _load(task_file)
    overrides = _parse_env(envs)
    if detach and down_after:
        raise UserError("--detach and --down do not go together: the job would be torn down "
                        "right after it starts.", "Drop one of them.")
    budget = bg.resolve(task.max_cost_usd, task.max_hours, max_cost=max_cost, hours=hours,
                        no_budget=no_budget)
    if budget is not None and detach:
        raise UserError(
            f"A budget of ${budget.max_cost_usd:.2f} is set, and only a launch that stays in the "
            "foreground can watch it (-d returns right away; nothing would stop the job at 100%).",
            "Drop -d, or pass --no-budget to launch detached without the guard.")
    env = _env()
    name = cl.resolve_name(task, cluster_name, task_file)
    plan = cl.plan(env, task, name)
    existing = env.state.get_cluster(name)
    if budget is not None:
        from cloudtrain.ledger import cluster_spend

        estimate = bg.check_before_launch(
            budget, cluster=name,
            price_per_node=existing.hourly_price if existing else plan.hourly_price_per_node,
            num_nodes=existing.num_nodes if existing else plan.num_nodes,
            spent=cluster_spend(env.state, name) if existing else 0.0)
        env.ui.info(f"Estimate for {budget.hours:g} h: ${estimate:.4f} of the "
                    f"${budget.max_cost_usd:.4f} budget.")
    if existing is None:
        _confirm_cost(env, plan, yes)
    over: bg.BudgetExceeded | None = None
    interrupted: list[str] = []
    try:
        try:
            with cl.opened(env, task, name, planned=plan) as (handle, group, fresh):
                if fresh:
                    _bootstrap_or_roll_back(env, handle, group, task, name)
                guard = None if budget is None else bg.Watch(env.state, name,
                                                             budget.max_cost_usd, env.ui)
                outcome = ln.run_task(env, handle, group, task, detach=detach,
                                      overrides=overrides, guard=guard)
                if outcome.exit_code != 0 and handle.row.use_spot:
                    interrupted = _interruptions(handle, name)
        except bg.BudgetExceeded as exc:
            over = exc
            env.state.mark_usage_end(name, exc.reason)   # the ledger's reason, once it is down
    finally:
        if down_after or over is not None:
            try:
                _teardown_shielded(env, name, plan.provider or task.resources.provider or "local")
            except CloudtrainError:
                if over is not None:
                    env.ui.error(f"The budget was reached ({over.reason}) and the job stopped, "
                                 f"but the cluster is still up: run 'cloudtrain down {name}'.")
                raise
    if over is not None:
        raise over
    if outcome.detached:
        env.ui.ok(f"Job {outcome.job_id} started on every node. Follow it: "
                  f"cloudtrain logs {name} --follow")
        return
    if outcome.exit_code != 0:
        from cloudtrain.errors import JobFailed

        if interrupted:
            raise JobFailed(outcome.exit_code, outcome.failed_node,
                            "The job stopped because the cloud took back spot capacity: "
                            + "; ".join(interrupted) + ". This is a spot interruption, not a "
                            "crash in your code.",
                            f"Run the launch again: up replaces the missing node(s), and a job "
                            f"that checkpoints (like the template) resumes where it stopped.")
        who = f"global rank {outcome.failed_rank} on node {outcome.failed_node}" \
            if outcome.failed_rank is not None else f"node {outcome.failed_node}"
        raise JobFailed(outcome.exit_code, outcome.failed_node,
                        f"The job failed: {who} exited with code {outcome.exit_code}; the other "
                        "nodes were stopped.",
                        f"See 'cloudtrain logs {name} --node {outcome.failed_node}'.")
    env.ui.ok(f"Job {outcome.job_id} succeeded on every node")


def _bootstrap_or_roll_back(env: Env, handle: Any, group: Any, task: Any, name: str) -> None:
    """A cluster this launch created is bootstrapped here; when that fails or is interrupted,
    what was created is removed again (as 'up' does), before the error is reported."""
    from cloudtrain import cluster as cl

    env.ui.step("Bootstrapping")
    try:
        cl.run_bootstrap(env, handle, group, task.bootstrap)
    except BaseException:
        with _Shielded():
            group.close()
            cl._rollback(env, handle.provider, name)
        raise


def _interruptions(handle: Any, name: str) -> list[str]:
    """What the provider says it took back (spot interruptions), in words; [] when it cannot
    tell."""
    from cloudtrain.errors import CloudtrainError
    from cloudtrain.provider import ReportsInterruptions

    if not isinstance(handle.provider, ReportsInterruptions):
        return []
    try:
        return [str(x) for x in handle.provider.interruptions(name)]
    except CloudtrainError:
        return []


def _teardown_shielded(env: Env, name: str, provider_name: str) -> None:
    """Teardown after --down: Ctrl-C cannot interrupt it halfway. ``provider_name`` (the
    task's) finds what a half-built cluster left when no state row was written."""
    from cloudtrain import cluster as cl
    from cloudtrain.errors import CloudtrainError

    with _Shielded():
        try:
            if env.state.get_cluster(name) is not None or os.path.isdir(env.pctx.cluster_dir(name)):
                cl.down(env, name, provider_name=provider_name)
        except CloudtrainError as exc:
            env.ui.error(f"teardown of '{name}' failed: {exc}")
            raise


@cli.command(name="exec", context_settings=CONTEXT)
@click.argument("cluster_name")
@click.argument("command", nargs=-1, required=True)
@click.option("--node", "node", type=int, help="Only this node (rank); default: every node.")
@_guard
def exec_(cluster_name: str, command: tuple[str, ...], node: int | None) -> None:
    """Run COMMAND on the cluster's nodes (after '--'), with the job environment."""
    from cloudtrain import cluster as cl
    from cloudtrain.pipeline import run as ln

    _sigterm_as_interrupt()
    _check_name(cluster_name)
    env = _env()
    handle = cl.get_handle(env, cluster_name)
    ranks = _ranks(handle, node)
    group = cl.connect(env, handle, timeout=30)
    try:
        code, failed = ln.run_command(env, handle, group, " ".join(command), ranks)
    finally:
        group.close()
    if code != 0:
        from cloudtrain.errors import JobFailed

        raise JobFailed(code, failed, f"The command exited with code {code} on node {failed}.")


def _check_name(name: str, what: str = "CLUSTER_NAME") -> None:
    """The one cluster-name rule, before the name reaches a path, a filter or a provider."""
    from cloudtrain.names import check

    check(name, what)


def _ranks(handle: Any, node: int | None) -> list[int]:
    from cloudtrain.errors import UserError

    ranks = [n.rank for n in handle.nodes]
    if node is None:
        return ranks
    if node not in ranks:
        raise UserError(f"Cluster '{handle.name}' has no node {node}.",
                        f"Its nodes are 0..{len(ranks) - 1}.")
    return [node]


@cli.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--node", "node", type=int, help="Only this node (rank).")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming while the job runs.")
@click.option("--job", "job_id", help="A job id (default: the latest).")
@_guard
def logs(cluster_name: str, node: int | None, follow: bool, job_id: str | None) -> None:
    """Replay the logs of the cluster's latest job (or --job), prefixed by node."""
    from cloudtrain.pipeline import logs as lg

    _sigterm_as_interrupt()
    _check_name(cluster_name)
    env = _env()
    lg.show(env, cluster_name, node=node, follow=follow, job_id=job_id)


@cli.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--node", "node", type=int, default=0, show_default=True, help="Node rank.")
@_guard
def ssh(cluster_name: str, node: int) -> None:
    """Open an SSH session on a node, with the cluster's key and pinned host key."""
    import shutil

    from cloudtrain import cluster as cl
    from cloudtrain.errors import UserError
    from cloudtrain.keys import ssh_command_options

    _check_name(cluster_name)
    env = _env(quiet=True)
    handle = cl.get_handle(env, cluster_name)
    n = handle.nodes[_ranks(handle, node)[0]]
    exe = shutil.which("ssh")
    if exe is None:
        raise UserError("The 'ssh' client is not installed.", "Install OpenSSH's client.")
    args = ["ssh", *ssh_command_options(handle.keys, n.port, n.identity_file), "-t",
            f"{n.user}@{n.host}"]
    sys.stdout.flush()
    os.execv(exe, args)


@cli.command(context_settings=CONTEXT)
@click.argument("cluster_name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--refresh", is_flag=True, help="Ask every provider (cloud APIs included).")
@_guard
def status(cluster_name: str | None, as_json: bool, refresh: bool) -> None:
    """Show clusters and their nodes (local state, refreshed from cheap providers), with each
    cluster's price per node-hour and for the cluster, as recorded at launch, and what it has
    cost so far (from the spend ledger, as 'cost-report' counts it: never re-priced from the
    catalog; a running cluster counts up to now).

    --json: a list of clusters, each with name, provider, status, num_nodes, region,
    instance_type, accelerators, use_spot, price_hourly_usd (per node), cluster_hourly_usd,
    cost_so_far_usd (null: no price was recorded), created_at and nodes (each with host_key:
    how its SSH host key was pinned: "pinned at creation", "the user's known_hosts" or
    "learned on first contact")."""
    import time

    from cloudtrain import cluster as cl
    from cloudtrain.keys import pinning
    from cloudtrain.ledger import money, spend_of

    if cluster_name is not None:
        _check_name(cluster_name)
    env = _env(quiet=as_json)
    rows = cl.status(env, cluster_name, refresh_all=refresh)
    _probe_hosts(env, rows)
    now = time.time()
    usage = env.state.usage(cluster=cluster_name) if rows else []
    spent = {r.name: spend_of(r.name, r.created_at, usage, now=now) for r in rows}
    pins = {r.name: pinning(env.pctx.cluster_dir(r.name)) for r in rows}

    def cluster_price(r: Any) -> float | None:
        return None if r.hourly_price is None else r.hourly_price * r.num_nodes

    if as_json:
        out = [{
            "name": r.name, "provider": r.provider, "status": r.status, "num_nodes": r.num_nodes,
            "region": r.region, "instance_type": r.instance_type, "accelerators": r.accelerators,
            "use_spot": r.use_spot, "price_hourly_usd": r.hourly_price,
            "cluster_hourly_usd": cluster_price(r),
            "cost_so_far_usd": None if spent[r.name] is None else round(spent[r.name], 6),
            "hourly_price_per_node": r.hourly_price,
            "created_at": r.created_at,
            "nodes": [{"rank": n.rank, "host": n.host, "port": n.port, "internal_ip": n.internal_ip,
                       "instance_id": n.instance_id, "status": n.status,
                       "host_key": pins[r.name].get(n.rank, "unknown")} for n in r.nodes],
        } for r in rows]
        click.echo(json.dumps(out, indent=2))
        return
    if not rows:
        click.echo("No clusters.")
        return
    from rich.console import Console
    from rich.table import Table

    from cloudtrain.ui import color_ok

    table = Table(box=None, pad_edge=False)
    for col in ("NAME", "PROVIDER", "STATUS", "NODES", "INSTANCE", "$/H NODE", "$/H CLUSTER",
                "COST SO FAR", "HOST KEYS", "NODE ADDRESSES"):
        table.add_column(col, justify="right" if col.startswith(("$", "COST")) else "left")
    for r in rows:
        node = "-" if r.hourly_price is None else f"{r.hourly_price:.2f}"
        whole = cluster_price(r)
        addrs = ", ".join(f"{n.rank}:{n.host}:{n.port}({n.status})" for n in r.nodes)
        table.add_row(r.name, r.provider, r.status, str(r.num_nodes), r.instance_type or "-",
                      node, "-" if whole is None else f"{whole:.2f}", money(spent[r.name]),
                      ", ".join(sorted({pins[r.name].get(n.rank, "unknown") for n in r.nodes}))
                      or "-", addrs)
    Console(no_color=not color_ok(sys.stdout), highlight=False,
            color_system="auto" if color_ok(sys.stdout) else None, width=200).print(table)


PROBE_TIMEOUT = 5.0


def _probe_hosts(env: Env, rows: list[Any]) -> None:
    """Nodes of providers that never power anything off (the ``ssh`` provider: the user's own
    machines, with no API to ask) are checked live: does each answer with an SSH banner within
    PROBE_TIMEOUT s? All at once, so the wait is bounded whatever the number of hosts. A node
    that does not is shown as 'unreachable' and its cluster as DEGRADED (UNREACHABLE when no
    node answers)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from cloudtrain.provider import registry

    def probe(host: str, port: int) -> str:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT) as s:
                s.settimeout(PROBE_TIMEOUT)
                return "running" if s.recv(64).startswith(b"SSH-") else "unreachable"
        except OSError:
            return "unreachable"

    live = [r for r in rows if not getattr(registry.provider_class(r.provider), "powers_off", True)]
    nodes = [n for r in live for n in r.nodes]
    if not nodes:
        return
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        found = list(pool.map(lambda n: probe(n.host, n.port), nodes))
    for n, st in zip(nodes, found):
        n.status = st
    for r in live:
        down = [n for n in r.nodes if n.status != "running"]
        if down:
            r.status = "UNREACHABLE" if len(down) == len(r.nodes) else "DEGRADED"
            for n in down:
                env.ui.warn(f"'{r.name}' node {n.rank} ({n.user}@{n.host}:{n.port}) does not "
                            f"answer SSH within {PROBE_TIMEOUT:g} s")


@cli.command(context_settings=CONTEXT)
@click.argument("names", nargs=-1)
@click.option("-a", "--all", "all_", is_flag=True, help="Every cluster.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@click.option("--provider", "provider_name",
              help="Tear down by tag on this provider even with no local state.")
@_guard
def down(names: tuple[str, ...], all_: bool, yes: bool, provider_name: str | None) -> None:
    """Tear clusters down and check with the provider that nothing is left."""
    from cloudtrain import cluster as cl
    from cloudtrain.cluster import lost_record_hint
    from cloudtrain.errors import CloudtrainError, UserError

    _sigterm_as_interrupt()
    for n in names:
        _check_name(n, "NAME")
    env = _env()
    if all_ and names:
        raise UserError("Give cluster names or -a, not both.", "e.g. cloudtrain down my-job")
    targets = [c.name for c in env.state.list_clusters()] if all_ else list(names)
    if not targets:
        if all_:
            env.ui.info("No clusters.")
            return
        raise UserError("Name the cluster(s) to tear down, or -a for all.", "e.g. cloudtrain down my-job")
    if not all_:
        known = {c.name for c in env.state.list_clusters()}
        for n in targets:
            if n not in known and provider_name is None:
                from cloudtrain.errors import ClusterNotFound

                raise lost_record_hint(ClusterNotFound(n, sorted(known)), n)
    if not yes:
        if not sys.stdin.isatty():
            if all_:
                raise UserError("'down -a' tears down every cluster.", "Add -y to confirm.")
        elif not click.confirm(f"Tear down {', '.join(targets)}?", default=True, err=True):
            return
    failed: list[BaseException] = []
    for n in targets:
        try:
            cl.down(env, n, provider_name=provider_name, require_found=True)
        except CloudtrainError as exc:
            env.ui.error(f"{n}: {exc}")
            failed.append(exc)
    if failed:
        sys.exit(max(getattr(e, "exit_code", 1) for e in failed))


def _register_commands() -> None:
    """Commands kept in their own modules (each imports only click at module level)."""
    from cloudtrain.commands import catalog, cost, gc, report

    for mod in (catalog, cost, report, gc):
        mod.register(cli)


_register_commands()


def main() -> None:
    cli(prog_name="cloudtrain")


if __name__ == "__main__":
    main()
