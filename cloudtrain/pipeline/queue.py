"""The job queue from the CLI's side (docs/queue.md): a launch's job is submitted to the
queue of every node (cloudtrain/node/queue.py: part of the bootstrap bundle for the launch's
own commands, shipped inline by the others, which may meet a node bootstrapped by an older
version); it starts
at once on an idle cluster, else it waits there and the nodes start it when the job before it
ends (with -d, with no CLI connected). ``queue`` lists the head's records; ``cancel`` removes
a queued job or stops a running one through the usual stop path (stop_grace)."""

from __future__ import annotations

import base64
import getpass
import json
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from cloudtrain.cluster import Handle, cluster_uid
from cloudtrain.context import Env
from cloudtrain.errors import JobFailed, RemoteError, UserError
from cloudtrain.pipeline import bootstrap
from cloudtrain.pipeline.remote_job import job_dir
from cloudtrain.pipeline.teardown import stop_processes
from cloudtrain.remote import Group, bash
from cloudtrain.connection import Result
from cloudtrain.schema import NodeRow

WAIT_POLL_S = 1.0


def _source() -> str:
    return base64.b64encode((Path(__file__).resolve().parent.parent / "node" / "queue.py")
                            .read_bytes()).decode()


def node_command(handle: Handle, node: NodeRow, cmd: str, *args: str, marker: str = "",
                 bundled: bool = False) -> str:
    """``queue.py CMD ROOT ARGS`` on ``node``, run by the node's Python (the one the guard
    uses). ``bundled``: the copy the bootstrap bundle put in script_dir(node) (a launch, once
    its nodes are bootstrapped with this version); otherwise the file travels in the command
    (written to ROOT/.cloudtrain/queue when it changed). ``marker``: the cluster's id, which
    the waiter carries so that 'down' stops it with the cluster."""
    python = bootstrap.provider_node_env(handle).get("CLOUDTRAIN_PYTHON", "python3")
    rest = " ".join(shlex.quote(a) for a in args)
    mark = f"export CLOUDTRAIN_CLUSTER_ID={shlex.quote(marker)}; " if marker else ""
    if bundled:
        where = f"q={shlex.quote(bootstrap.script_dir(node) + '/queue.py')}; "
    else:
        where = (
            "d=$r/.cloudtrain/queue; mkdir -p \"$d\" && chmod 700 \"$d\" || exit 1; "
            f"echo {_source()} | base64 -d > \"$d/queue.py.$$\" || exit 1; "
            "if cmp -s \"$d/queue.py.$$\" \"$d/queue.py\"; then rm -f \"$d/queue.py.$$\"; "
            "else mv \"$d/queue.py.$$\" \"$d/queue.py\" || exit 1; fi; q=$d/queue.py; ")
    return bash(
        mark + f"r={shlex.quote(node.root_dir)}; case $r in /*) ;; *) r=$HOME/$r ;; esac; "
        + where +
        f"py={shlex.quote(python)}; [ -x \"$py\" ] || py=$(command -v \"$py\" || command -v python3); "
        f"exec \"$py\" \"$q\" {shlex.quote(cmd)} \"$r\" {rest}")


def submitter() -> str:
    """Who submitted a job: user@host of this machine."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


def records(handle: Handle, group: Group, rank: int = 0) -> list[dict[str, Any]]:
    """The queue's records on one node (the head by default), oldest first."""
    res = group.run(lambda n: node_command(handle, n, "list"), ranks=[rank], timeout=60)
    r = res[rank]
    if not r.ok:
        raise RemoteError(f"Could not read the job queue on node {rank}: "
                          f"{(r.stderr or r.stdout or str(r.error)).strip()[-300:]}",
                          f"Check the node with 'cloudtrain status {handle.name} --refresh'.")
    try:
        data = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        data = []
    return [x for x in data if isinstance(x, dict)]


def active(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [x for x in recs if x.get("state") in ("queued", "running")]


def why_not_now(handle: Handle, group: Group, gpus: int) -> str | None:
    """Why a job of ``gpus`` slots per node (``gpus_per_job``) submitted now would not start
    at once on every node (None: it would): a job waits there (jobs start in submission
    order), or too few of its slots are free. A node's answer is read as untrusted."""
    res = group.run(lambda n: node_command(handle, n, "room"), timeout=60)
    for rank, r in sorted(res.items()):
        try:
            room = json.loads(r.stdout.strip().splitlines()[-1]) if r.ok else None
        except (ValueError, IndexError):
            room = None
        if not isinstance(room, dict) or not isinstance(room.get("free"), list):
            return f"node {rank} did not say its free GPU slots"
        if room.get("queued") != 0:
            return f"a job waits on node {rank}, and jobs start in submission order"
        if len(room["free"]) < gpus:
            return (f"node {rank} has {len(room['free'])} free GPU slot(s) of "
                    f"{room.get('slots')}, and this job's gpus_per_job is {gpus}")
    return None


def refuse_if_busy(handle: Handle, group: Group, gpus: int | None = None) -> None:
    """``launch --now``: exit 2 (nothing queued) unless the job starts at once: no job runs
    or waits on the cluster, or (``gpus``: the job's ``gpus_per_job``) no job waits and each
    node has ``gpus`` free slots beside the jobs that run there."""
    busy = active(records(handle, group))
    if not busy:
        return
    why = why_not_now(handle, group, gpus) if gpus is not None else None
    if gpus is not None and why is None:
        return
    first = busy[0]
    raise UserError(
        f"--now: cluster '{handle.name}' is busy: job {first['id']} ({first.get('task')}, "
        f"submitted by {first.get('submitter')}) is {first.get('state')}"
        + (f", {len(busy) - 1} more queued" if len(busy) > 1 else "")
        + (f"; {why}" if why else "") + ".",
        f"Launch without --now to wait its turn, or stop it: "
        f"cloudtrain cancel {handle.name} {first['id']}")


def refuse_changes_while_busy(handle: Handle, group: Group, what: str) -> None:
    """A launch that would change ``what`` on the nodes (sync their workdir, run a changed
    setup) while a job runs or waits there is refused (exit 2, nothing changed): the running
    job would see files replaced or deleted under it, and a queued one would start on content
    it was not submitted with. A launch with the same workdir and setup (e.g. another --env)
    queues as usual."""
    busy = active(records(handle, group))
    if busy:
        first = busy[0]
        raise UserError(
            f"Cluster '{handle.name}' is busy: job {first['id']} ({first.get('task')}) is "
            f"{first.get('state')}, and this launch would change {what} on its nodes while it "
            "runs or waits there.",
            f"Wait for it ('cloudtrain queue {handle.name}'), stop it ('cloudtrain cancel "
            f"{handle.name} {first['id']}'), launch on another cluster (-c), or queue a job "
            "that keeps the same workdir and setup (e.g. other --env values).")


class Turn:
    """A launch's turn in the queue, for :class:`~cloudtrain.pipeline.remote_job.RemoteJob`:
    the command that submits the job on each node, the wait (attached) until every node has
    started it, and its withdrawal when the launch is stopped (Ctrl-C)."""

    def __init__(self, env: Env, handle: Handle, group: Group, job_id: str, task: str,
                 gpus: int | None = None) -> None:
        self.env, self.handle, self.group = env, handle, group
        self.job_id, self.task = job_id, task
        # resources.gpus_per_job: the job's GPU slots on each node (None: each node whole)
        self.gpus_args = ("--gpus", str(gpus)) if gpus is not None else ()
        self.at = f"{time.time():.6f}"
        self.who = submitter()
        self.queued = False   # set by wait(): some node queued the job behind another
        self._turn_said = False
        self._lock = threading.Lock()

    def command(self, node: NodeRow) -> str:
        """Submit (``-d``): "::started PID" or "::queued POSITION FIRST_AHEAD" ("::refused
        WHY", exit 2, when the job asks for more GPU slots than the node has)."""
        return node_command(self.handle, node, "submit", self.job_id, self.who, self.at,
                            self.task, *self.gpus_args,
                            marker=cluster_uid(self.env, self.handle.name), bundled=True)

    def run_command(self, node: NodeRow, offset: int) -> str:
        """Submit once and follow, in one session (the framed script on stdin): exits with
        the job's code, or 253 with "::ctjob queued POSITION FIRST_AHEAD" when it waits."""
        return node_command(self.handle, node, "run", self.job_id, self.who, self.at,
                            self.task, str(offset), *self.gpus_args,
                            marker=cluster_uid(self.env, self.handle.name), bundled=True)

    def _say_queued(self, words: list[str], detach: bool) -> None:
        with self._lock:
            if self.queued:
                return
            self.queued = True
        pos, before = (words + ["?", "?"])[:2]
        self.env.ui.info(f"Job {self.job_id} queued behind job {before} (position {pos}): "
                         + ("the nodes start it when its turn comes." if detach else "waiting..."))

    def wait(self, res: Mapping[int, Result], detach: bool) -> None:
        # Each node says "::started PID" or "::queued POSITION FIRST_AHEAD"; the head's word
        # is the one shown, but the launch waits while any node's part is queued.
        refused = [ln[10:] for x in res.values() for ln in x.stdout.splitlines()
                   if ln.startswith("::refused ")]
        if refused:
            raise self.refuse(refused[0])
        said = {rank: ln.split() for rank, x in sorted(res.items(), reverse=True)
                for ln in x.stdout.splitlines() if ln.startswith("::queued ") and x.ok}
        if not said:
            return
        self._say_queued(said[min(said)][1:3], detach)
        if detach:
            return
        ranks = [r for r, x in res.items() if x.ok]
        while True:
            states = {}
            for rank in ranks:
                mine = [x for x in records(self.handle, self.group, rank) if x["id"] == self.job_id]
                states[rank] = mine[0].get("state") if mine else "unknown"
            if "cancelled" in states.values() or "unknown" in states.values():
                self.env.state.finish_launch(self.job_id, "CANCELLED", None, None)
                raise JobFailed(1, None, f"Job {self.job_id} was cancelled before it started.",
                                f"See 'cloudtrain queue {self.handle.name}'.")
            if "queued" not in states.values():
                self.env.ui.info(f"Job {self.job_id}: its turn came, it runs now")
                return
            time.sleep(WAIT_POLL_S)

    def queued_on(self, res: Result) -> bool:
        """Did the run command say the job waits its turn on this node (exit 253), or that
        the node refused it (exit 2: more GPU slots asked than it has; wait_node raises)?"""
        return ((res.exit_code == 253 and "::ctjob queued" in res.stderr)
                or self._refusal(res) is not None)

    def _refusal(self, res: Result) -> str | None:
        said = [ln.split(": ", 1)[1] for ln in res.stderr.splitlines()
                if ln.startswith("::ctjob bad-input: gpus_per_job ")]
        return said[0] if res.exit_code == 2 and said else None

    def refuse(self, why: str) -> UserError:
        """The node refused the job (gpus_per_job above its slots): withdrawn everywhere,
        the launch recorded as failed, and the error (exit 2) naming the field."""
        self.withdraw()
        self.env.state.finish_launch(self.job_id, "FAILED", 2, None)
        return UserError(f"resources.gpus_per_job: {why}.",
                         "Ask for at most that many (gpus_per_job), or launch on a cluster "
                         "whose nodes have more GPUs (-c).")

    def wait_node(self, res: Result) -> None:
        """A node whose part waits its turn (run_command exited 253): say so (once), then
        wait until that node has started it. Raises JobFailed when it was cancelled first,
        UserError when the node refused it (see queued_on)."""
        why = self._refusal(res)
        if why is not None:
            raise self.refuse(why)
        words = next((ln.split()[2:] for ln in res.stderr.splitlines()
                      if ln.startswith("::ctjob queued ")), [])
        self._say_queued(words, False)
        while not self.group.stop.is_set():
            mine = [x for x in records(self.handle, self.group, res.rank) if x["id"] == self.job_id]
            state = mine[0].get("state") if mine else "unknown"
            if state in ("cancelled", "unknown"):
                self.env.state.finish_launch(self.job_id, "CANCELLED", None, None)
                raise JobFailed(1, None, f"Job {self.job_id} was cancelled before it started.",
                                f"See 'cloudtrain queue {self.handle.name}'.")
            if state != "queued":
                with self._lock:
                    first, self._turn_said = not self._turn_said, True
                if first:
                    self.env.ui.info(f"Job {self.job_id}: its turn came, it runs now")
                return
            time.sleep(WAIT_POLL_S)

    def withdraw(self) -> None:
        mark(self.handle, self.group, self.job_id)


def mark(handle: Handle, group: Group, job_id: str) -> dict[int, str]:
    """Cancel ``job_id`` in every node's queue: what it was on each ("queued", "running", an
    ended state, or "None" when unknown)."""
    res = group.run(lambda n: node_command(handle, n, "cancel", job_id), timeout=60)
    out = {}
    for rank, r in res.items():
        said = [ln for ln in r.stdout.splitlines() if ln.startswith("::was ")]
        out[rank] = said[-1][6:] if said else "unknown"
    return out


def cancel(env: Env, handle: Handle, group: Group, job_id: str, grace: float) -> str:
    """Remove a queued job, or stop a running one on every node (SIGTERM, SIGKILL after
    ``grace``): what it was ("queued", "running", or its end state)."""
    was = mark(handle, group, job_id)
    if "running" in was.values():
        jdirs = {n.rank: job_dir(n, job_id) for n in handle.nodes}
        stop_processes(env, handle, f"CLOUDTRAIN_JOB_ID={job_id}", jdirs, grace=grace,
                       group=group,
                       node_markers={r: f"CLOUDTRAIN_JOB_DIR={d}" for r, d in jdirs.items()})
        launch = next((x for x in env.state.launches(handle.name) if x.job_id == job_id), None)
        if launch is not None and launch.status == "RUNNING" and launch.detached:
            env.state.finish_launch(job_id, "CANCELLED", None, None)
        return "running"
    if "queued" in was.values():
        env.state.finish_launch(job_id, "CANCELLED", None, None)
        return "queued"
    return was.get(0, "unknown")


def cancel_jobs(env: Env, handle: Handle, group: Group, job_id: str | None) -> None:
    """``cloudtrain cancel``: ``job_id``, or (None) every queued and running job, queued
    ones first (none of them starts when a running one is stopped), saying what was done."""
    from cloudtrain.pipeline import guard as node_guard
    from cloudtrain.pipeline.remote_job import STOP_GRACE

    recs = records(handle, group)
    if job_id is not None and job_id not in [r["id"] for r in recs]:
        raise UserError(f"JOB_ID '{job_id}' is not in the queue of '{handle.name}'.",
                        f"List the jobs: cloudtrain queue {handle.name}")
    state = {r["id"]: r.get("state") for r in recs}
    ids = sorted([r["id"] for r in active(recs)] if job_id is None else [job_id],
                 key=lambda i: state.get(i) != "queued")
    grace = float(node_guard.saved(env, handle.name).get("grace_s") or STOP_GRACE)
    words = {"queued": "removed from the queue",
             "running": f"stopped on every node (SIGTERM, SIGKILL after {grace:g} s: stop_grace)"}
    for jid in ids:
        was = cancel(env, handle, group, jid, grace)
        env.ui.ok(f"Job {jid}: " + words.get(was, f"not cancelled: it had already {was}"))
    if not ids:
        env.ui.info(f"No queued or running job on '{handle.name}'.")
