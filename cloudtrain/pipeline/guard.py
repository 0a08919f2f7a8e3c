"""The node guard from the CLI's side (docs/guard.md): install and start it on every node at
``up`` (bootstrap/ctguard.sh ships ``cloudtrain/node/guard.py``), write its policy (the
task's autostop, the launch's job-end stop and budget, the lifetime from ``max_hours``, and
the provider's self-stop command), renew the lease on every CLI contact and restart a guard
that died, read what the guards see, and reconcile a cluster whose nodes stopped themselves
(torn down at the next contact, the ledger closed when the nodes stopped)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from cloudtrain import paths
from cloudtrain.cluster import Handle, cluster_uid
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError
from cloudtrain.pipeline import bootstrap, outputs
from cloudtrain.pipeline.lastseen import (View, contacted, describe, idle_words, policy_file,
                                          saved)
from cloudtrain.pipeline.policy import Policy, guard_poll
from cloudtrain.pipeline.rules import budget_change, budget_words
from cloudtrain.provider.contract import Node, SelfStops
from cloudtrain.remote import Group, GroupResult
from cloudtrain.connection import Result
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.gpuuse import NodeGPUs
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import

# The idle stop's default where cloudtrain owns the machines and they bill (the clouds).
CLOUD_IDLE_MINUTES = 60.0
OFF_BY_DEFAULT = ("local", "ssh")


def guard_source() -> bytes:
    """What ctguard.sh reads on stdin: guard.py, a NUL, sessions.py (which guard.py imports)."""
    node = Path(__file__).resolve().parent.parent / "node"
    return (node / "guard.py").read_bytes() + b"\0" + (node / "sessions.py").read_bytes()


def save(env: Env, name: str, pol: Policy) -> None:
    f = policy_file(env, name)
    paths.private_dir(f.parent)
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")     # two CLIs on one cluster: one file each
    with open(tmp, "w", opener=paths.private_opener) as out:
        json.dump(pol.as_dict(), out, indent=1)
    tmp.replace(f)


def autostop_of(task: Task | None, provider: str) -> tuple[float | None, bool]:
    """(idle minutes or None for off, down) from the task, or the provider's default."""
    if task is None or task.autostop is None:
        return (None if provider in OFF_BY_DEFAULT else CLOUD_IDLE_MINUTES), True
    return task.autostop.idle_minutes, task.autostop.down


def desired(env: Env, handle: Handle, task: Task | None, **changes: Any) -> Policy:
    """The cluster's policy: what was saved, the task's rules (autostop only when the task
    sets it, or when nothing was saved yet), then ``changes`` (Policy's field names)."""
    from cloudtrain.ledger import cluster_spend

    row = handle.row
    kept = saved(env, row.name)
    pol = Policy.from_dict(kept)
    if not kept or (task is not None and task.autostop is not None):
        idle, down = autostop_of(task, row.provider)
        pol = pol.changed(idle_minutes=idle, down=down)
    if task is not None:
        pol = pol.changed(max_hours=task.max_hours, grace_s=task.stop_grace)
    pol = pol.changed(**changes)
    poll = guard_poll()
    if poll is not None:
        pol = pol.changed(poll_s=poll)
    now = time.time()
    return pol.changed(cluster=row.name, started_at=row.created_at or now, lease_at=now,
                       cluster_hourly_usd=None if row.hourly_price is None
                       else row.hourly_price * row.num_nodes,
                       spent_usd=cluster_spend(env.state, row.name, now=now) or 0.0,
                       spent_at=now)


def as_node(n: NodeRow) -> Node:
    return Node(rank=n.rank, instance_id=n.instance_id, host=n.host, port=n.port, user=n.user,
                internal_ip=n.internal_ip, status="running", root_dir=n.root_dir,
                identity_file=n.identity_file)


def node_policy(handle: Handle, pol: Policy, n: NodeRow) -> str:
    """Node ``n``'s policy.json: the cluster's, with its rank and its self-stop command."""
    stop = handle.provider.self_stop_command(handle.name, as_node(n)) \
        if isinstance(handle.provider, SelfStops) else None
    return json.dumps(dict(pol.as_dict(), rank=n.rank, self_stop=stop))


def command(env: Env, handle: Handle, mode: str,
            pol: Policy | None) -> Callable[[NodeRow], str]:
    """ctguard.sh MODE on a node, as a command (it travels inline); in the modes that take it,
    guard.py comes on stdin (guard_source())."""
    python = bootstrap.provider_node_env(handle).get("CLOUDTRAIN_PYTHON", "python3")
    uid = cluster_uid(env, handle.name)

    # A systemd unit only on machines cloudtrain owns (clouds), never on this machine (local
    # nodes) or the user's own hosts (ssh).
    owned_by_user = handle.row.provider in OFF_BY_DEFAULT

    def cmd(n: NodeRow) -> str:
        args = [n.root_dir, python, uid, str(n.rank), mode]
        if pol is not None:
            args.append(node_policy(handle, pol, n))
        line = bootstrap.inline("ctguard.sh", *args)
        return f"CT_GUARD_NO_SYSTEMD=1 {line}" if owned_by_user else line
    return cmd


@dataclass(frozen=True)
class Pushed:
    """What one ``ctguard.sh`` contact gave back: each node's word ("guard
    process|systemd|stopped", or "failed: ..."), and the whole session's results (with
    ``then``: the other command's output is in them)."""

    said: dict[int, str]
    session: GroupResult


def push(env: Env, handle: Handle, group: Group, mode: str,
         pol: Policy | None = None, *, then: Callable[[NodeRow], str] | None = None,
         ranks: Iterable[int] | None = None) -> Pushed:
    """Run ctguard.sh MODE on every node (guard.py on stdin); save ``pol`` locally. ``then``:
    a command run after it in the same session (one round trip for both)."""
    src = guard_source()
    cmd = command(env, handle, mode, pol)
    run = cmd if then is None else (lambda n: f"{cmd(n)}; {then(n)}")
    res = group.run(run, stdin=lambda n: src, timeout=60, ranks=ranks)
    if pol is not None:
        save(env, handle.name, pol)
    if any(r.error is None for r in res.values()):
        # "install" with a policy: up or launch (a job may start); "policy" (autostop) and
        # "touch" change nothing the nodes run.
        contacted(env, handle.name, idle=False if mode == "install" else None)
    out = {}
    for rank, r in res.items():
        said = [ln for ln in r.stdout.splitlines() if ln.startswith("::guard")]
        ok = r.error is None and (r.ok or then is not None)
        out[rank] = said[-1][2:] if ok and said else f"failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return Pushed(out, res)


def install(env: Env, handle: Handle, group: Group, task: Task | None,
            fresh: bool = False) -> None:
    """At up: the guard on every node, with the task's policy; ``up`` says what it is.
    ``fresh``: the cluster was created by this up (nothing of the user's runs on it)."""
    pol = desired(env, handle, task)
    said = push(env, handle, group, "install", pol).said
    if fresh:
        contacted(env, handle.name, idle=True)
    bad = {r: s for r, s in said.items() if s.startswith("failed")}
    for rank, s in bad.items():
        env.ui.warn(f"node guard on node {rank} did not start ({s}); the CLI retries at its "
                    "next contact")
    env.ui.info("Node guard: " + describe(pol.as_dict()) + self_stop_note(handle))
    env.ui.info(f"Budget in force on '{handle.name}': {budget_words(pol.as_dict())}")


def self_stop_note(handle: Handle) -> str:
    if not isinstance(handle.provider, SelfStops):
        return " (this provider's nodes are never powered off: only cloudtrain's processes stop)"
    return f". After a self-stop: {handle.provider.what_still_bills()}"


@dataclass(frozen=True)
class Written:
    """A policy written on every node: the policy, and the session's results (with
    ``then``: the other command's output is in them)."""

    policy: Policy
    session: GroupResult


def update(env: Env, handle: Handle, group: Group, task: Task | None = None, *,
           mode: str = "policy", then: Callable[[NodeRow], str] | None = None,
           ranks: Iterable[int] | None = None, **changes: Any) -> Written:
    """A CLI contact that changes the policy (launch, autostop): write it on every node (or
    ``ranks``), renew the lease, restart a guard that is gone (``mode`` "install": also clear
    an old stop). ``then``: another command in the same round trip (see push)."""
    pol = desired(env, handle, task, **changes)
    pushed = push(env, handle, group, mode, pol, then=then, ranks=ranks)
    for rank, s in pushed.said.items():
        if s.startswith("failed"):
            env.ui.warn(f"node guard on node {rank}: {s}")
    return Written(pol, pushed.session)


def touch(env: Env, handle: Handle, group: Group, ranks: Iterable[int] | None = None) -> None:
    """A CLI contact (logs, status --refresh; exec folds its own into the job's session):
    renew the lease, restart a dead guard, on every node (or ``ranks``). Never fails the
    command it is part of."""
    try:
        push(env, handle, group, "touch", ranks=ranks)
    except CloudtrainError as exc:
        env.ui.warn(f"could not renew the node guard's lease: {exc}")


@dataclass(frozen=True)
class Seen:
    """What one contact read from the nodes: each node's guard state (state.json,
    stopped.json, whether the guard runs; {} when the node did not say), and each node's GPUs
    when they were asked (rank order)."""

    nodes: dict[int, dict[str, Any]]
    gpus: list[NodeGPUs] | None = None


def states(env: Env, handle: Handle, group: Group, *, gpus: bool = False,
           renew: bool = False) -> Seen:
    """What each node's guard last saw (state.json), stopped.json, and whether it runs. With
    ``gpus`` the same command also asks nvidia-smi (cloudtrain.gpuuse); with ``renew`` it
    first renews the lease and restarts a dead guard (a CLI contact, as :func:`touch`): one
    round trip per node for all of it. What the nodes said is kept (cloudtrain.pipeline.
    lastseen) for the next plain ``status``."""
    from cloudtrain import gpuuse
    from cloudtrain.pipeline import lastseen
    from cloudtrain.remote import bash

    state_cmd = command(env, handle, "state", None)
    touch_cmd = command(env, handle, "touch", None) if renew else None
    bins = {n.rank: n.python_bin or os.path.dirname(bootstrap.provider_node_env(handle).get(
        "CLOUDTRAIN_PYTHON", "")) or None for n in handle.nodes}

    def run(n: NodeRow) -> str:
        line = state_cmd(n) if touch_cmd is None else f"{touch_cmd(n)}; {state_cmd(n)}"
        return line if not gpus else f"{line}; {bash(gpuuse.remote_script(bins.get(n.rank)))}"
    renewed_at = time.time()
    if renew:
        src = guard_source()
        res = group.run(run, stdin=lambda n: src, timeout=30)
    else:
        res = group.run(run, timeout=30)
    out: dict[int, dict[str, Any]] = {}
    read: dict[int, NodeGPUs] = {}
    for rank, r in res.items():
        before, block = gpuuse.split_output(r.stdout)
        out[rank] = _state_of(env, rank, r, before, renew, renewed_at)
        if gpus:
            read[rank] = _gpus_of(r, rank, block, out[rank])
    answered = {rank: s for rank, s in out.items() if s}
    if renew and answered:
        busy = [s.get("state", {}).get("busy") for s in answered.values()
                if isinstance(s.get("state"), dict)]
        contacted(env, handle.name, idle=None if not busy else not any(busy), at=renewed_at)
    seen = Seen(out, [read[r] for r in sorted(read)] if gpus else None)
    if answered:
        lastseen.remember(env, handle.name, answered, seen.gpus)
    return seen


def _state_of(env: Env, rank: int, r: Result, before: str, renew: bool,
              renewed_at: float) -> dict[str, Any]:
    """One node's answer to ``states``: its guard's state, {} when it said none."""
    ok = r.error is None and "::guard " in before
    if renew and not ok:
        env.ui.warn(f"could not renew the node guard's lease on node {rank}: "
                    f"{str(r.error or r.stderr or r.stdout or 'no answer').strip()[-300:]}")
    try:
        got = json.loads(before.strip().splitlines()[-1])
    except (ValueError, IndexError):
        got = {}
    if not isinstance(got, dict):
        got = {}
    st = got.get("state")
    if renew and ok and isinstance(st, dict) and not st.get("busy"):
        # The lease was renewed just now: the guard counts idle from here (its state.json
        # says so at its next loop).
        st.update(idle_for_s=0.0, at=renewed_at, lease_at=renewed_at)
    return got


def _gpus_of(r: Result, rank: int, block: str | None, seen: dict[str, Any]) -> NodeGPUs:
    """One node's GPUs from its answer to ``states``."""
    from cloudtrain import gpuuse

    st = seen.get("state")
    jobs = st.get("jobs") if isinstance(st, dict) else 0
    got = gpuuse.parse(block if r.error is None else None, rank,
                       job_running=isinstance(jobs, int) and jobs > 0)
    if r.error is not None:
        got.detail = f"no answer from the node ({r.error})"[:300]
    return got


def reconcile(env: Env, name: str) -> dict[str, Any] | None:
    """A cluster whose nodes all stopped themselves: close the ledger at the moment they
    stopped (with the reason), then remove what is left (terminate) and forget it; or, with
    ``down: false``, record it as STOPPED. Returns what happened (None: nothing to do)."""
    row = env.state.get_cluster(name)
    if row is None or row.status == "STOPPED":   # recorded stopped already ('stop', down: false)
        return None
    provider = env.provider(row.provider)
    if not isinstance(provider, SelfStops):
        return None
    stops = provider.self_stopped(name)
    if not stops:
        return None
    if any(n.status == "running" for n in provider.list_nodes(name)):
        return None        # some nodes still run (they stop on their own, or at 'down')
    at = max(s.stopped_at for s in stops)
    reason = next((s.reason for s in sorted(stops, key=lambda s: s.stopped_at) if s.reason),
                  "self-stop")
    down = saved(env, name).get("down", True)
    from cloudtrain.pipeline.sweepdoc import keep_final
    keep_final(env, name)      # a sweep's results the head left, before its disk goes
    if down:   # the nodes are gone: what was never pulled went with them (ledger, status)
        lost = outputs.gone(env, outputs.unpulled(env, name),
                            f"the cluster stopped itself: {reason}")
        reason += f"; {lost}" if lost else ""
    env.state.mark_usage_end(name, reason)
    env.state.close_usage(name, when=at, reason=reason)
    stamp = time.strftime("%H:%M:%S", time.localtime(at))
    env.ui.info(f"'{name}': its nodes stopped themselves at {stamp} (reason: {reason})")
    if down:
        from cloudtrain.pipeline import teardown

        teardown.down(env, name, unpulled="discard")
        return {"name": name, "status": "GONE", "reason": reason, "stopped_at": at}
    env.state.set_cluster_status(name, "STOPPED")
    return {"name": name, "status": "STOPPED", "reason": reason, "stopped_at": at}


# --- the commands' side -------------------------------------------------------------------------

def _connected(env: Env, name: str, timeout: float = 30) -> tuple[Handle, Group]:
    from cloudtrain.cluster import connect, get_handle

    handle = get_handle(env, name)
    return handle, connect(env, handle, timeout=timeout)


def set_autostop(env: Env, name: str, idle_minutes: float | None, down: bool | None,
                 off: bool) -> dict[str, Any]:
    """``cloudtrain autostop``: change the idle stop on every node of a live cluster."""
    from cloudtrain.cluster import cluster_lock

    changes: dict[str, Any] = {}
    if off:
        changes["idle_minutes"] = None
    elif idle_minutes is not None:
        changes["idle_minutes"] = idle_minutes
    if down is not None:
        changes["down"] = down
    with cluster_lock(env, name):
        handle, group = _connected(env, name)
        try:
            pol = update(env, handle, group, None, **changes).policy.as_dict()
        finally:
            group.close()
    return pol


def set_budget(env: Env, name: str, max_cost: float | None) -> dict[str, Any]:
    """``cloudtrain budget``: the cluster's budget changed on purpose (None: lifted), on every
    node of the live cluster and in the local state (the ledger's budget too)."""
    from cloudtrain.cluster import cluster_lock

    with cluster_lock(env, name):
        handle, group = _connected(env, name)
        try:
            pol = update(env, handle, group, None,
                         **budget_change(saved(env, name), max_cost)).policy.as_dict()
        finally:
            group.close()
    env.state.set_budget(name, max_cost)
    return pol


def contact(env: Env, name: str) -> None:
    """A CLI contact that has no connection of its own (logs): renew the lease, restart a dead
    guard. Never fails the command."""
    try:
        handle, group = _connected(env, name, timeout=15)
    except Exception:  # noqa: BLE001 - a node that does not answer is the command's business
        return
    try:
        touch(env, handle, group)
    finally:
        group.close()


def show_log(env: Env, name: str, node: int | None) -> None:
    """``cloudtrain logs NAME --guard``: each node's guard.log."""
    import shlex

    from cloudtrain.remote import bash

    handle, group = _connected(env, name)
    try:
        ranks = [n.rank for n in handle.nodes if node is None or n.rank == node]
        # Streamed line by line (a node's log is untrusted: its size must not reach memory),
        # one node after the other so that each node's lines stay together.
        for rank in ranks:
            group.run(lambda n: bash(
                f"cat {shlex.quote(n.root_dir)}/.cloudtrain/guard/guard.log 2>/dev/null "
                "|| echo '(no guard log on this node)'"), ranks=[rank], timeout=60,
                on_line=env.ui.node_line)
    finally:
        group.close()


def live(env: Env, name: str) -> View | None:
    """For ``status --refresh`` (a contact): the policy, what the guards see now ("idle for X
    min, stops in Y min") and each node's GPUs, with the lease renewed, in one round trip per
    node. None when no guard was installed. A plain ``status`` reads lastseen.view instead."""
    from dataclasses import replace

    from cloudtrain.pipeline import lastseen

    pol = saved(env, name)
    if not pol:
        return None
    out = View.of(pol)
    row = env.state.get_cluster(name)
    if row is None or row.status not in ("UP", "DEGRADED"):
        return out
    try:
        handle, group = _connected(env, name, timeout=10)
    except Exception:  # noqa: BLE001 - status shows the rest, as of the last contact
        last = lastseen.view(env, name) or out
        return replace(last, stale=True)
    try:
        now = time.time()
        seen = states(env, handle, group, gpus=True, renew=True)
        return replace(out, guard=dict(idle_words(pol, seen.nodes, now), as_of=now, age_s=0.0,
                                       live=True), gpus=seen.gpus, gpus_at=now)
    except CloudtrainError:
        return out
    finally:
        group.close()


def reconcile_all(env: Env, name: str | None) -> list[dict[str, Any]]:
    """``status --refresh``: reconcile every cluster (or ``name``) whose nodes stopped
    themselves. A provider that cannot be asked now is left for later."""
    out = []
    for row in env.state.list_clusters():
        if name is not None and row.name != name:
            continue
        try:
            done = reconcile(env, row.name)
        except CloudtrainError as exc:
            # neutral: the provider may not even have been asked (reconcile said so if it
            # saw the nodes stop before the removal failed)
            env.ui.warn(f"'{row.name}': checking with {row.provider} failed: {exc}")
            continue
        if done is not None:
            out.append(done)
    return out


def keep_alive(env: Env, name: str) -> Callable[[], None]:
    """For ``cloudtrain ssh``: a session on one node keeps every node of the cluster alive
    (the other guards see no session of their own): while the session lasts, renew the lease
    on every node at a third of the idle limit (at most every 30 s). Returns a function that
    ends the renewals; a no-op when the cluster has no idle stop."""
    import threading

    idle = saved(env, name).get("idle_minutes")
    if not idle:
        return lambda: None
    every = max(1.0, min(30.0, float(idle) * 60 / 3))
    done = threading.Event()

    def loop() -> None:
        try:
            handle, group = _connected(env, name, timeout=15)
        except Exception:  # noqa: BLE001 - the session itself still counts on its node
            return
        try:
            while not done.wait(every):
                push(env, handle, group, "touch")
        except Exception:  # noqa: BLE001 - a keep-alive touch that fails: the next one, or the session, still counts
            pass
        finally:
            group.close()

    def release() -> None:
        done.set()
        contacted(env, name)     # the session kept the nodes busy until now

    threading.Thread(target=loop, daemon=True).start()
    return release
