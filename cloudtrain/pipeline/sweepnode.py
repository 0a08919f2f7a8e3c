"""The sweep driver (cloudtrain/node/sweep.py) from the laptop: the command that runs it on
the head, the workdir sent before it starts, and the sweep's rules on the node guards.

The driver travels in the bootstrap bundle (pipeline/bootstrap.py), beside the node's queue
(node/queue.py) that it submits the trials to. Optuna is installed into the node's Python
when it is missing, before ``start`` on the head and ``worker`` on every other node (with
grpcio and protobuf on a cluster of several nodes: the workers reach the head's study
through Optuna's gRPC storage proxy, which the head serves on its internal address only).

The driver's own process is the sweep's job on the head: once ``start`` says its pid, the
laptop writes it to ``ROOT/jobs/sweep-NAME/pid``, so the guard counts the driver as work and
stops it with the jobs when the budget is reached; the driver writes ``jobs/sweep-NAME/rc``
when it exits, the end of the job ``sweep-NAME``, which ``down: true`` adds to the cluster's
``down_on_end`` (docs/guard.md): the nodes go down once it has ended and nothing runs or
waits. Each other node runs a worker (its own job ``sweep-NAME.worker``), which marks the
same end on its node once it saw the sweep end."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloudtrain.errors import RemoteError
from cloudtrain.pipeline import bootstrap
from cloudtrain.remote import Group, bash
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


def driver_job(name: str) -> str:
    """The sweep's job id on the head (its driver's job folder ``ROOT/jobs/sweep-NAME``)."""
    return f"sweep-{name}"


def node_command(handle: Handle, node: NodeRow, cmd: str, *args: str, optuna: bool = False,
                 grpc: bool = False) -> str:
    """``sweep.py CMD ROOT ARGS`` on ``node`` with the node's Python: the copy the bootstrap
    bundle put in script_dir(node), beside the queue it submits trials to (``sweep`` runs
    the launch chain's ``up`` first, which bootstraps a node of an older version).
    ``optuna``: install Optuna into that Python first when it is missing (``grpc``: with
    grpcio and protobuf, for the storage proxy a sweep on several nodes shares)."""
    python = bootstrap.provider_node_env(handle).get("CLOUDTRAIN_PYTHON", "python3")
    rest = " ".join(shlex.quote(a) for a in args)
    mods, pkgs = ("optuna, grpc", "optuna grpcio protobuf") if grpc else ("optuna", "optuna")
    install = (f"\"$py\" -c 'import {mods}' 2>/dev/null || \"$py\" -m pip install -q {pkgs} "
               ">&2 || exit 1; ") if optuna else ""
    where = shlex.quote(bootstrap.script_dir(node) + "/sweep.py")
    return bash(
        f"r={shlex.quote(node.root_dir)}; case $r in /*) ;; *) r=$HOME/$r ;; esac; "
        f"s={where}; case $s in /*) ;; *) s=$HOME/$s ;; esac; "
        "[ -f \"$s\" ] || { echo \"the sweep driver is not on this node ($s): run "
        "'cloudtrain up' on the cluster to bootstrap it with this version\" >&2; exit 2; }; "
        f"py={shlex.quote(python)}; [ -x \"$py\" ] || py=$(command -v \"$py\" || command -v python3); "
        + install + f"exec \"$py\" \"$s\" {shlex.quote(cmd)} \"$r\" {rest}")


def head_group(env: Env, handle: Handle, timeout: float = 30) -> Group:
    """A connection to the head alone: reading or cancelling a sweep needs nothing else
    (with ``down: true`` the other nodes go down as soon as their workers saw the end,
    while the head still waits for the final results to be read)."""
    from cloudtrain.cluster import connect

    return connect(env, handle, timeout, nodes=handle.nodes[:1])


ANSWER_MAX_BYTES = 64 * 1024 * 1024
"""The most of the driver's answer the laptop reads (a node is untrusted input): a results
document is ~300 bytes per trial, so this holds sweeps of ~200,000 trials."""


def on_head(handle: Handle, group: Group, cmd: str, *args: str, optuna: bool = False,
            stdin: bytes | None = None) -> str:
    """Run ``sweep.py CMD`` on the head; its stdout, or RemoteError naming what it said."""
    head = handle.nodes[0]
    line = node_command(handle, head, cmd, *args, optuna=optuna, grpc=len(handle.nodes) > 1)
    res = group.run(line, timeout=600, stdin=stdin, ranks=[head.rank],
                    keep=ANSWER_MAX_BYTES + 1)[head.rank]
    if not res.ok:
        said = res.stderr.strip()[-600:] or res.stdout.strip()[-600:] or str(res.error or "")
        raise RemoteError(f"The sweep driver's '{cmd}' failed on the head "
                          f"(exit {res.exit_code}): {said}")
    if len(res.stdout.encode()) > ANSWER_MAX_BYTES:
        raise RemoteError(f"The sweep driver's '{cmd}' answered more than "
                          f"{ANSWER_MAX_BYTES:,} bytes; the laptop reads no more from a node.",
                          "Check the head with 'cloudtrain ssh CLUSTER': its sweep folder may be "
                          "damaged.")
    return res.stdout


@dataclass(frozen=True)
class Started:
    """The driver as started: the head's pid and its storage proxy (``host:port``, the
    head's internal address; None on one node), and each other node's worker pid."""

    pid: int
    host: str | None
    port: int | None
    workers: dict[int, int]


def start_driver(handle: Handle, group: Group, name: str, spec_json: str) -> Started:
    """Write the sweep's spec on the head, start the driver there (detached: it goes on with
    this laptop gone), then a worker on every other node, reaching the head's proxy at the
    head's internal address and the port the head picked."""
    path = f".cloudtrain/sweep/{name}.spec.json"
    head = handle.nodes[0]
    write = bash(f"r={shlex.quote(head.root_dir)}; case $r in /*) ;; *) r=$HOME/$r ;; esac; "
                 "umask 077; mkdir -p \"$r/.cloudtrain/sweep\" && cat > \"$r/\"" + shlex.quote(path))
    res = group.run(write, timeout=60, stdin=spec_json.encode(), ranks=[head.rank])[head.rank]
    if not res.ok:
        raise RemoteError(f"Could not write the sweep's spec on the head: {res.stderr.strip()}")
    said = on_head(handle, group, "start", name, f"{head.root_dir}/{path}", optuna=True)
    pid = said_int(said, "pid", "start")
    mark_job(handle, group, name, pid)
    others = handle.nodes[1:]
    if not others:
        return Started(pid, None, None, {})
    port = said_int(said, "port", "start")
    host = head.internal_ip
    got = group.run(lambda n: node_command(handle, n, "worker", name, host, str(port),
                                           str(n.rank), optuna=True, grpc=True),
                    timeout=600, ranks=[n.rank for n in others])
    got.raise_on_failure("Starting the sweep's worker",
                         "The head's driver runs on; 'cloudtrain sweep cancel' stops it.")
    return Started(pid, host, port,
                   {r: said_int(res.stdout, "pid", "worker") for r, res in got.items()})


def said_int(said: str, key: str, cmd: str) -> int:
    """A positive number ``key`` from what ``sweep.py CMD`` printed (one JSON line last)."""
    try:
        value = json.loads(said.strip().splitlines()[-1]).get(key)
    except (json.JSONDecodeError, IndexError, AttributeError):
        value = None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RemoteError(f"The sweep driver's '{cmd}' did not say its {key}: {said[:200]!r}")
    return value


def mark_job(handle: Handle, group: Group, name: str, pid: int) -> None:
    """``ROOT/jobs/sweep-NAME/pid`` on the head: the guard counts the driver as work; the
    driver marks the end of the sweep's job (``down_on_end``) in ``jobs/sweep-NAME/rc`` when
    it exits. (A worker on another node records its own pid, under the job id
    ``sweep-NAME.worker``, which no ``down_on_end`` names; it marks ``jobs/sweep-NAME/rc`` on
    its node once the sweep has ended: node/sweep.py.)"""
    head = handle.nodes[0]
    d = f"jobs/{driver_job(name)}"
    line = bash(f"r={shlex.quote(head.root_dir)}; case $r in /*) ;; *) r=$HOME/$r ;; esac; "
                f"mkdir -p \"$r/{d}\" && echo {pid} > \"$r/{d}/pid\"")
    res = group.run(line, timeout=60, ranks=[head.rank])[head.rank]
    if not res.ok:
        raise RemoteError(f"Could not record the sweep's driver on the head: {res.stderr.strip()}")


def document(handle: Handle, group: Group, cmd: str, name: str) -> dict[str, Any]:
    """``status``/``results`` of the driver: its one JSON document."""
    out = on_head(handle, group, cmd, name)
    try:
        doc = json.loads(out)
    except json.JSONDecodeError as exc:
        raise RemoteError(f"The sweep driver's '{cmd}' did not answer JSON: {out[:200]!r}") from exc
    if not isinstance(doc, dict):
        raise RemoteError(f"The sweep driver's '{cmd}' answered {type(doc).__name__}, not an object.")
    return doc


@dataclass(frozen=True)
class Rules:
    """What a sweep asks of the cluster's rules: its job, its budget, ``down:``."""

    job_id: str
    budget_usd: float | None
    down: bool
    attached_grace_s: float | None = None
    """``sweep --recover``: the seconds the guards leave the attached controller after the
    driver ended before ``down:`` (the controller tears down itself; a teardown by the guards
    would read as the cloud taking the nodes)."""


def put_rules(env: Env, handle: Handle, group: Group, task: Task, asked: Rules) -> None:
    """The sweep's budget and its job-end stop on every node guard, composed with the
    cluster's rules (pipeline/rules.py), so they hold with the laptop closed."""
    from cloudtrain.pipeline import guard as node_guard, rules
    from cloudtrain.pipeline.lastseen import saved

    launch = rules.LaunchRules(asked.job_id, asked.budget_usd, "sweep max_cost_usd", False,
                               asked.down, asked.attached_grace_s)
    pol = node_guard.update(env, handle, group, task, mode="install",
                            **rules.compose(saved(env, handle.name), launch)).policy
    env.state.set_budget(handle.name, pol.max_cost_usd)
    env.ui.info(f"Budget in force on '{handle.name}': {rules.budget_words(pol.as_dict())}")
