"""Cluster lifecycle: provision (idempotent, adopting what exists), wait for SSH, bootstrap,
tear down (verified against the provider), status. The CLI is a thin layer over these."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from cloudtrain.pipeline import bootstrap as bootstrap_mod
from cloudtrain.provider import registry
from cloudtrain.catalog.model import Offer
from cloudtrain.errors import CapacityError, ClusterNotFound, ProviderError, QuotaError, UserError
from cloudtrain.keys import (FIRST_CONTACT, PINNED_AT_CREATION, ClusterKeys, ensure_keys, is_pinned,
                   pin_host_keys, record_pinning)
from cloudtrain.provider.contract import (ClusterRequest, CollectsOrphans, HasHostKeySource, HasMasterPort,
                                          HasNodeEnv, Node, Plan, Provider, ProviderContext)
from cloudtrain.remote import Group
from cloudtrain.provider.options import provider_options
from cloudtrain.spec import BootstrapSpec, Task
from cloudtrain.state import ClusterRow, NodeRow, State, open_state
from cloudtrain.ui import UI

SSH_TIMEOUT = float(os.environ.get("CLOUDTRAIN_SSH_TIMEOUT", "300"))


@dataclass
class Env:
    home: Path
    state: State
    ui: UI

    @property
    def pctx(self) -> ProviderContext:
        return ProviderContext(self.home)

    def logs_dir(self, cluster: str) -> Path:
        from cloudtrain.names import check, inside

        return inside(self.home / "logs", check(cluster))


def open_env(ui: UI) -> Env:
    from cloudtrain.paths import home

    h = home()
    return Env(h, open_state(h), ui)


@dataclass
class Handle:
    row: ClusterRow
    provider: Provider
    keys: ClusterKeys
    learn: frozenset[int] = frozenset()
    """Ranks whose host key may be learned on first contact (new nodes with none reported)."""

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def nodes(self) -> list[NodeRow]:
        return self.row.nodes

    @property
    def head(self) -> NodeRow:
        return self.row.nodes[0]


def cluster_uid(env: Env, name: str) -> str:
    """Unique across CLOUDTRAIN_HOMEs on one machine: marks the processes of this cluster."""
    return hashlib.sha256(f"{env.home.resolve()}:{name}".encode()).hexdigest()[:12]


def resolve_name(task: Task, override: str | None, task_path: str | None) -> str:
    from cloudtrain.names import check

    name = override or task.name
    if not name and task_path:
        stem = Path(task_path).stem.lower().replace("_", "-")
        name = "".join(c for c in stem if c.isalnum() or c == "-").strip("-") or None
    if not name:
        raise UserError("The cluster has no name.", "Give one with -c NAME or 'name:' in the task.")
    return check(name, "-c/--cluster" if override else "cluster name")


@contextmanager
def cluster_lock(env: Env, name: str) -> Iterator[None]:
    from cloudtrain.names import check, inside

    d = env.home / "locks"
    d.mkdir(parents=True, exist_ok=True)
    with open(inside(d, f"{check(name)}.lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            env.ui.info(f"Waiting for another cloudtrain command working on '{name}'...")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _node_rows(cluster: str, nodes: list[Node]) -> list[NodeRow]:
    return [NodeRow(cluster=cluster, rank=n.rank, instance_id=n.instance_id, host=n.host,
                    port=n.port, user=n.user, internal_ip=n.cluster_ip, status=n.status,
                    root_dir=n.root_dir, identity_file=n.identity_file)
            for n in sorted(nodes, key=lambda n: n.rank)]


def _request(task: Task, name: str, public_key: str) -> ClusterRequest:
    return ClusterRequest(name=name, num_nodes=task.num_nodes, resources=task.resources,
                          options=provider_options(task), public_key=public_key)


def plan(env: Env, task: Task, name: str, *, offers: list[Offer] | None = None) -> Plan:
    """What ``up`` would do. Creates nothing, anywhere. A task with GPUs (or an instance type)
    that names no provider, or a cloud but no region, gets the planner's cheapest feasible
    offer (from ``offers``, or the catalog when None)."""
    from cloudtrain import planner

    existing = env.state.get_cluster(name)
    picked = None
    if planner.needs_pick(task):
        picked = planner.pick_for_up(task, offers, existing,
                                     load=lambda: planner.catalog_offers(env.home))
        task = planner.resolved(task, picked[0])
    provider = registry.get(str(task.resources.provider), env.pctx)
    request = _request(task, name, public_key="")
    provider.check(request)
    p = provider.plan(request)
    if picked is not None:
        planner.fill(p, *picked)
    cap = task.resources.max_hourly_cost
    if cap is not None and existing is None and p.hourly_price_per_node is not None \
            and p.hourly_price_per_node * p.num_nodes > cap:
        raise UserError(
            f"{p.provider} {p.instance_type or ''} in {p.region or '-'} costs "
            f"${p.hourly_price_per_node * p.num_nodes:.2f}/h for {p.num_nodes} node(s), over "
            f"resources.max_hourly_cost ${cap:.2f}/h. Nothing was created.",
            "Raise max_hourly_cost, use fewer or smaller nodes, or leave out the provider/region "
            "so the planner can look for a cheaper offer ('cloudtrain cost TASK' lists them).")
    if existing is not None:
        p.notes.insert(0, f"cluster '{name}' exists ({existing.status}); up adopts its nodes")
    return p


def check_mounts(task: Task, provider: Provider) -> None:
    if provider.allows_absolute_mounts:
        return
    for remote in task.file_mounts:
        if remote.startswith("/") or remote.startswith("~"):
            raise UserError(
                f"file_mounts target '{remote}' is an absolute path, and provider "
                f"'{provider.name}' nodes share this machine's file system.",
                "Use a path relative to the workdir on the node (e.g. 'data: ./data'), which works "
                "on every provider.")


def provision(env: Env, task: Task, name: str, *, keep_on_failure: bool = False,
              planned: Plan | None = None) -> tuple[Handle, bool]:
    """Make sure the cluster's nodes exist and run; adopt what exists. Returns the handle and
    whether this call created the cluster (so a failure afterwards can roll it back).
    ``planned``: the result of :func:`plan` for this task, when the caller has it already
    (the provider's check and plan are then not asked again)."""
    from cloudtrain import planner

    if planner.needs_pick(task):  # the planner picks, and fails over down its ranked list
        return _provision_picked(env, task, name, keep_on_failure=keep_on_failure,
                                 planned=planned)
    return _provision(env, task, name, keep_on_failure=keep_on_failure, planned=planned)


def _provision(env: Env, task: Task, name: str, *, keep_on_failure: bool,
               planned: Plan | None) -> tuple[Handle, bool]:
    existing = env.state.get_cluster(name)
    if existing is not None and existing.provider != task.resources.provider:
        raise UserError(
            f"Cluster '{name}' already exists on provider '{existing.provider}'; the task asks for "
            f"'{task.resources.provider}'.",
            f"Use another name (-c) or take it down first: cloudtrain down {name}")
    if existing is not None and existing.num_nodes != task.num_nodes:
        raise UserError(
            f"Cluster '{name}' has {existing.num_nodes} node(s); the task asks for {task.num_nodes}.",
            f"Use another name (-c) or take it down first: cloudtrain down {name}")
    provider = registry.get(task.resources.provider, env.pctx)
    check_mounts(task, provider)
    keys = ensure_keys(env.pctx.cluster_dir(name), comment=f"cloudtrain-{name}")
    request = _request(task, name, keys.public_key())
    if planned is None:
        provider.check(request)

    with cluster_lock(env, name):
        live = provider.list_nodes(name)
        fresh = existing is None and not live
        if (existing is not None and existing.status == "UP" and len(live) == task.num_nodes
                and all(n.status == "running" for n in live)
                and [n.instance_id for n in live] == [n.instance_id for n in existing.nodes]):
            return Handle(existing, provider, keys), False

        p = planned or provider.plan(request)
        row = ClusterRow(
            name=name, provider=provider.name, status="INIT", num_nodes=task.num_nodes,
            created_at=existing.created_at if existing else time.time(), updated_at=time.time(),
            region=p.region, zone=p.zone, instance_type=p.instance_type,
            accelerators=str(task.resources.accelerators) if task.resources.accelerators else None,
            use_spot=task.resources.use_spot, hourly_price=p.hourly_price_per_node,
            options=request.options.model_dump(mode="json") if request.options else {},
            resources=task.resources.model_dump(mode="json"),
        )
        env.state.upsert_cluster(row)
        try:
            env.ui.step(f"Provisioning {task.num_nodes} node(s) on {provider.name} for '{name}'")
            net = provider.ensure_network(request)
            nodes = provider.create_nodes(request, net)
            if len(nodes) != task.num_nodes:
                raise ProviderError(f"the provider returned {len(nodes)} node(s) for "
                                    f"{task.num_nodes} requested.", "Run 'cloudtrain up' again.")
        except BaseException:
            if fresh and not keep_on_failure:
                _rollback(env, provider, name)
            raise
        old_ids = {n.rank: n.instance_id for n in (existing.nodes if existing else [])}
        for n in nodes:
            if n.host_keys:
                pin_host_keys(keys.known_hosts, n.host, n.port, n.host_keys)
        row.nodes = _node_rows(name, nodes)
        env.state.replace_nodes(name, row.nodes)
        row.master_port = int(provider.master_port(name)) if isinstance(provider, HasMasterPort) else 29500
        row.status = "UP"
        env.state.upsert_cluster(row)
        env.state.open_usage(row)
        stored = env.state.get_cluster(name)
        assert stored is not None
        # Nodes that are new (not the instance we knew) may have their host key learned.
        learn = frozenset(n.rank for n in nodes
                          if not n.host_keys and old_ids.get(n.rank) != n.instance_id
                          and not is_pinned(keys.known_hosts, n.host, n.port))
        source = provider.host_key_source if isinstance(provider, HasHostKeySource) else PINNED_AT_CREATION
        record_pinning(keys, {n.rank: source for n in nodes if n.host_keys}
                       | {r: FIRST_CONTACT for r in learn})
        return Handle(stored, provider, keys, learn), fresh


def _provision_picked(env: Env, task: Task, name: str, *, keep_on_failure: bool,
                      planned: Plan | None) -> tuple[Handle, bool]:
    """Provision on the planner's pick; when that offer has no capacity or quota, roll back
    and take the next one of the same ranked list."""
    from cloudtrain import planner

    planned = planned or plan(env, task, name)
    choices = [planned, *planned.alternatives]
    for i, choice in enumerate(choices):
        resolved = planner.resolved(task, choice)
        p = choice if i == 0 else planner.fill(plan(env, resolved, name), choice, [], [])
        try:
            return _provision(env, resolved, name, keep_on_failure=keep_on_failure, planned=p)
        except (CapacityError, QuotaError) as exc:
            if keep_on_failure or i + 1 == len(choices) or env.state.get_cluster(name) is not None:
                raise
            nxt = choices[i + 1]
            env.ui.warn(f"{choice.provider} {choice.instance_type} in {choice.region}: "
                        f"{exc.message} Failing over to {nxt.provider} {nxt.instance_type} in "
                        f"{nxt.region}.")
    raise AssertionError("unreachable")


def _rollback(env: Env, provider: Provider, name: str) -> None:
    env.ui.warn(f"Rolling back: removing what was created for '{name}'.")
    try:
        provider.terminate(name)
        env.state.close_usage(name)
        env.state.delete_cluster(name)
        shutil.rmtree(env.pctx.cluster_dir(name), ignore_errors=True)
    except Exception as exc:  # noqa: BLE001 - report, keep the original error
        env.ui.error(f"Rollback of '{name}' failed: {exc}. Run 'cloudtrain down {name}'.")


def connect(env: Env, handle: Handle, timeout: float = SSH_TIMEOUT) -> Group:
    group = Group(handle.nodes, handle.keys)
    try:
        group.connect(timeout=timeout, learn=handle.learn)
    except BaseException:
        group.close()
        raise
    return group


def node_env(handle: Handle) -> dict[str, str]:
    return dict(handle.provider.node_env(handle.name)) if isinstance(handle.provider, HasNodeEnv) else {}


def bootstrap_env(handle: Handle, cfg: BootstrapSpec) -> Callable[[NodeRow], dict[str, str]]:
    extra = node_env(handle)
    return lambda n: bootstrap_mod.node_env(cfg, n, extra)


def run_bootstrap(env: Env, handle: Handle, group: Group, cfg: BootstrapSpec,
                  force: bool = False) -> None:
    t0 = time.monotonic()
    reports = bootstrap_mod.run(group, bootstrap_env(handle, cfg), force=force)
    for rank, rep in sorted(reports.items()):
        r = rep.results
        env.state.set_node_bootstrap(
            handle.name, rank, version=bootstrap_mod.version(), iface=r.get("iface") or None,
            python_bin=r.get("python_bin") or None,
            gpus=int(r["gpus"]) if r.get("gpus", "").isdigit() else None, info=r)
        _show_report(env, rep)
    fresh = env.state.get_cluster(handle.name)
    if fresh is not None:
        handle.row.nodes = fresh.nodes
    env.ui.ok(f"Nodes ready in {time.monotonic() - t0:.1f}s")


def _show_report(env: Env, rep: bootstrap_mod.NodeReport) -> None:
    """Per node: what each step found or installed, and how long it took."""
    if rep.skipped:
        env.ui.info(f"  node {rep.rank}: already bootstrapped with these scripts; found "
                    + "; ".join(f"{s.name}: {s.detail}" for s in rep.steps
                                if s.outcome == "found" and s.name in ("gpu", "python", "torch")))
        return
    what = ", ".join(s.name for s in rep.installed) or "nothing"
    env.ui.info(f"  node {rep.rank}: bootstrapped in {rep.seconds:.1f}s, installed {what}")
    width = max((len(s.name) for s in rep.steps), default=0)
    for s in rep.steps:
        word = {"found": "found", "installed": "INSTALLED", "skip": "skipped"}.get(s.outcome, "done")
        env.ui.info(f"    {s.name:<{width}}  {s.seconds:6.2f}s  {word:<9}  {s.detail}".rstrip())


@contextmanager
def opened(env: Env, task: Task, name: str, *, keep_on_failure: bool = False,
           planned: Plan | None = None) -> Iterator[tuple[Handle, Group, bool]]:
    """Provision and connect to every node; yields (handle, connections, created by this
    call). A cluster this call created is rolled back when it cannot be reached."""
    handle, fresh = provision(env, task, name, keep_on_failure=keep_on_failure, planned=planned)
    try:
        with env.ui.status("Waiting for SSH on every node"):
            group = connect(env, handle)
    except BaseException:
        if fresh and not keep_on_failure:
            _rollback(env, handle.provider, name)
        raise
    try:
        yield handle, group, fresh
    finally:
        group.close()


def up(env: Env, task: Task, name: str, *, bootstrap: bool = True,
       keep_on_failure: bool = False, planned: Plan | None = None) -> Handle:
    with opened(env, task, name, keep_on_failure=keep_on_failure, planned=planned) as (
            handle, group, fresh):
        env.ui.ok(f"SSH up on {len(handle.nodes)} node(s)")
        if bootstrap:
            env.ui.step("Bootstrapping")
            try:
                run_bootstrap(env, handle, group, task.bootstrap)
            except BaseException:
                if fresh and not keep_on_failure:
                    _rollback(env, handle.provider, name)
                raise
    return handle


def get_handle(env: Env, name: str) -> Handle:
    row = env.state.get_cluster(name)
    if row is None:
        raise ClusterNotFound(name, [c.name for c in env.state.list_clusters()])
    provider = registry.get(row.provider, env.pctx)
    keys = ClusterKeys(env.pctx.cluster_dir(name) / "ssh")
    return Handle(row, provider, keys)


# --- stopping jobs and tearing down ----------------------------------------------------------

def kill_command(job_dir: str, marker: str, grace: float = 5) -> str:
    seconds = f"{grace:.3f}".rstrip("0").rstrip(".") or "0"
    return bootstrap_mod.inline("ctkill.sh", job_dir, marker, seconds)


def stop_processes(env: Env, handle: Handle, marker: str, job_dirs: dict[int, str] | None = None,
                   grace: float = 5, group: Group | None = None,
                   node_markers: dict[int, str] | None = None) -> dict[int, int]:
    """Stop every process carrying ``marker`` (KEY=VALUE in its environment) on every node:
    SIGTERM, then SIGKILL to what is left after ``grace`` seconds (a task's stop_grace).
    ``node_markers``: a marker per node instead of ``marker`` (nodes that share one machine,
    like local ones, must not stop each other's processes). Returns how many were left per
    node (0 when clean)."""
    own = group is None
    if group is None:
        try:
            group = connect(env, handle, timeout=15)
        except Exception as exc:  # noqa: BLE001 - unreachable nodes cannot run anything
            env.ui.warn(f"Could not reach every node to stop processes: {exc}")
            return {}
    try:
        res = group.run(lambda n: kill_command((job_dirs or {}).get(n.rank, ""),
                                               (node_markers or {}).get(n.rank, marker), grace),
                        timeout=grace + 30)
    finally:
        if own:
            group.close()
    left = {}
    for rank, r in res.items():
        for line in r.stdout.splitlines():
            if line.startswith("::left "):
                left[rank] = int(line.split()[1])
    return left


def lost_record_hint(exc: ClusterNotFound, name: str) -> ClusterNotFound:
    """Add to 'no such cluster' that a cluster whose local record was lost is found by tag."""
    exc.hint += (f" If it exists but this CLOUDTRAIN_HOME lost its record (state deleted, "
                 f"another machine), 'cloudtrain down {name} --provider PROVIDER' finds it by "
                 "its tag (PROVIDER: aws, gcp, azure, local).")
    return exc


def down(env: Env, name: str, provider_name: str | None = None, *,
         require_found: bool = False) -> None:
    """Tear ``name`` down and verify with the provider. Without a local record,
    ``provider_name`` finds it by tag; ``require_found`` (the ``down`` command) makes finding
    nothing at all an error instead of a note (the launch --down path stays quiet)."""
    from cloudtrain.names import check

    check(name)
    row = env.state.get_cluster(name)
    if row is None and provider_name is None:
        raise lost_record_hint(ClusterNotFound(name, [c.name for c in env.state.list_clusters()]),
                               name)
    pname = row.provider if row is not None else str(provider_name)
    provider = registry.get(pname, env.pctx)
    with cluster_lock(env, name):
        if row is None:
            _down_by_tag(env, provider, pname, name, require_found)
            return
        if row is not None and row.nodes and not provider.powers_off:
            # Machines we do not own: stop what we started on them before forgetting them.
            handle = Handle(row, provider, ClusterKeys(env.pctx.cluster_dir(name) / "ssh"))
            left = stop_processes(env, handle, f"CLOUDTRAIN_CLUSTER_ID={cluster_uid(env, name)}")
            for rank, n in left.items():
                if n:
                    env.ui.warn(f"node {rank}: {n} process(es) of the cluster survived SIGKILL")
        env.ui.step(f"Tearing down '{name}' on {pname}")
        _terminate_verified(provider, pname, name,
                            f"Run 'cloudtrain down {name}' again; nothing was forgotten locally.")
        env.state.close_usage(name)
        for launch in env.state.launches(name):
            if launch.status == "RUNNING":
                env.state.finish_launch(launch.job_id, "CANCELLED", None, None)
        env.state.delete_cluster(name)
        shutil.rmtree(env.pctx.cluster_dir(name), ignore_errors=True)
    env.ui.ok(f"'{name}' is down; {pname} lists none of its nodes")


def _terminate_verified(provider: Provider, pname: str, name: str, hint: str) -> None:
    """Terminate, then list the provider again: the cluster is down only when it lists none
    of its nodes."""
    provider.terminate(name)
    remaining = [n for n in provider.list_nodes(name) if n.status != "terminated"]
    if remaining:
        raise ProviderError(
            f"after teardown, {pname} still lists {len(remaining)} node(s) of '{name}': "
            + ", ".join(n.instance_id for n in remaining) + ".", hint)


def _down_by_tag(env: Env, provider: Provider, pname: str, name: str,
                 require_found: bool) -> None:
    """``down NAME --provider P`` with no local record: tear down what the provider finds by
    tag. Finding no node is not a success: say so (exit 2), and how to look elsewhere."""
    cdir = env.pctx.cluster_dir(name)
    had_files = cdir.exists()
    found = [n for n in provider.list_nodes(name) if n.status != "terminated"]
    env.ui.step(f"Tearing down '{name}' on {pname} (no local record: found by tag)")
    # also what a half-built cluster left (groups, keys, files)
    _terminate_verified(provider, pname, name,
                        f"Run 'cloudtrain down {name} --provider {pname}' again.")
    env.state.close_usage(name)
    shutil.rmtree(cdir, ignore_errors=True)
    if found:
        env.ui.ok(f"'{name}' is down: {len(found)} node(s) found by tag on {pname} were "
                  f"removed; {pname} lists none of its nodes now")
    elif had_files:
        env.ui.ok(f"'{name}' had no node running on {pname}; its local leftovers were removed")
    elif any(u.provider == pname for u in env.state.usage(cluster=name)):
        # This home's ledger knows it: a cluster this home tore down before.
        env.ui.ok(f"'{name}' was already down; {pname} lists none of its nodes")
    elif not require_found:
        env.ui.info(f"Found nothing of '{name}' on {pname}; nothing to tear down.")
    else:
        listing = (f", or list everything cloudtrain tagged with 'cloudtrain gc --provider "
                   f"{pname} --any-owner'" if isinstance(provider, CollectsOrphans) else "")
        raise UserError(
            f"Found no node of cluster '{name}' on {pname}, and this CLOUDTRAIN_HOME has no "
            "record of it: nothing was torn down.",
            f"Check the name and the provider (--provider PROVIDER looks for it by its tag on "
            f"PROVIDER). A cluster created under another CLOUDTRAIN_HOME is that home's: run "
            f"'cloudtrain down {name} --provider PROVIDER' there{listing}.")


def refresh(env: Env, row: ClusterRow) -> ClusterRow:
    """Ask the provider what exists now and update the cached node statuses."""
    provider = registry.get(row.provider, env.pctx)
    live = {n.rank: n for n in provider.list_nodes(row.name)}
    for n in row.nodes:
        ln = live.get(n.rank)
        n.status = ln.status if ln is not None and ln.instance_id == n.instance_id else "terminated"
    if row.nodes:
        env.state.replace_nodes(row.name, row.nodes)
    if row.status == "UP" and any(n.status != "running" for n in row.nodes):
        row.status = "DEGRADED"
    return row


def status(env: Env, name: str | None = None, refresh_all: bool = False) -> list[ClusterRow]:
    rows = env.state.list_clusters()
    if name is not None:
        rows = [r for r in rows if r.name == name]
        if not rows:
            raise ClusterNotFound(name, [c.name for c in env.state.list_clusters()])
    out = []
    for row in rows:
        cls = registry.provider_class(row.provider)
        if refresh_all or getattr(cls, "list_is_cheap", False):
            try:
                row = refresh(env, row)
            except Exception as exc:  # noqa: BLE001 - status must still show the rest
                env.ui.warn(f"could not refresh '{row.name}' from {row.provider}: {exc}")
        out.append(row)
    return out
