"""What ``launch --recover`` watches while a job runs (issue 13, issue 21): the cloud's word
on the nodes (``provider.node_health``, every ``recovery.poll_seconds``) and a node's silence
on SSH. Only the cloud's word is a loss at once; a node the cloud says runs but that does not
answer SSH is waited for up to the unresponsive window (``CLOUDTRAIN_UNRESPONSIVE_WINDOW``,
600 s by default: the log follower keeps reconnecting meanwhile and the other nodes' job
parts keep running), then replaced as "unresponsive". Each loss says what the restarted job
can resume from (``Loss.resumes_from``: "restarted from step 0" when nothing can)."""

from __future__ import annotations

import shlex
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from cloudtrain import budget
from cloudtrain.cluster import Handle
from cloudtrain.connection import seconds_setting
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, UserError
from cloudtrain.provider.contract import NodeHealth, ReportsNodeHealth
from cloudtrain.remote import Group, bash
from cloudtrain.connection import NodeLost

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import

UNRESPONSIVE_WINDOW_ENV = "CLOUDTRAIN_UNRESPONSIVE_WINDOW"
DEFAULT_UNRESPONSIVE_WINDOW = 600.0
STEP_ZERO = "restarted from step 0"
RECOVERY_HOLD_ENV = "CLOUDTRAIN_RECOVERY_HOLD"
DEFAULT_RECOVERY_HOLD = 1800.0


def unresponsive_window() -> float:
    """How long ``--recover`` waits for a node that the cloud says runs but that does not
    answer SSH before replacing it: CLOUDTRAIN_UNRESPONSIVE_WINDOW seconds, 600 by default."""
    return seconds_setting(UNRESPONSIVE_WINDOW_ENV, DEFAULT_UNRESPONSIVE_WINDOW)


def recovery_hold() -> float:
    """How long the surviving nodes of a ``launch --recover --down`` wait for the replacement
    after a loss stopped the job, before its end stops them as a ``--down`` job's end does
    (the laptop gone mid-recovery): CLOUDTRAIN_RECOVERY_HOLD seconds, 1800 by default."""
    return seconds_setting(RECOVERY_HOLD_ENV, DEFAULT_RECOVERY_HOLD)


def no_checkpoints_warning() -> str:
    """The one line ``--recover`` prints before anything starts when the task has no
    ``checkpoints:``."""
    return ("--recover without 'checkpoints:' in the task: after a replacement the job restarts "
            "from step 0 (at best from a checkpoint the surviving head kept on its disk); add "
            "'checkpoints: s3://BUCKET/PATH' (or gs://, az://) to the task to resume from the "
            "newest one uploaded (docs/storage.md).")


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def resumes_from(task: Task, ranks: list[int], ckpt: float | None) -> str:
    """What the restarted job can resume from, as the ledger records it: the bucket's newest
    checkpoint (``checkpoints:``), the surviving head's (a file under its
    CLOUDTRAIN_CHECKPOINT_DIR, written at ``ckpt``), or nothing: step 0."""
    if task.checkpoints:
        seen = f" (one reached it by {_clock(ckpt)})" if ckpt else ""
        return f"the newest checkpoint in the bucket{seen}"
    if 0 in ranks:
        return STEP_ZERO          # the head's disk went with it; no bucket holds a checkpoint
    if ckpt:
        return f"the surviving head's checkpoint of {_clock(ckpt)}"
    return f"{STEP_ZERO} unless the job keeps its own checkpoint on the surviving head"


@dataclass
class Loss:
    """What the cloud said it took (or the node that stayed unresponsive past the window),
    and when the controller saw it."""

    ranks: list[int]
    reason: str
    last_running_at: float
    detected_at: float
    work_since: float
    """The job's start or its last checkpoint, whichever is later: work after it is lost."""
    resumes_from: str = STEP_ZERO
    held: bool = False
    """The job's ``--down`` rule is held on the survivors (recover.py ``Controller.hold``)."""


@dataclass
class HealthWatch:
    """A thread asking the provider about the nodes every ``poll`` seconds while a job runs;
    it also carries the launch's budget watch (``run_task`` takes one watch: this one, a
    :class:`~cloudtrain.budget.JobWatch`). On a loss it
    stops the job (the surviving ranks get SIGTERM and stop_grace) and ends the log follow."""

    env: Env
    handle: Handle
    group: Group
    poll: float
    task: Task
    watch: budget.Watch | None = None
    head_log: Callable[[], object] | None = None
    """The head's job log on this machine: its ``store.py watch`` says there when a checkpoint
    reached the bucket, which is all that survives the loss of the head."""
    on_loss: Callable[[Loss], None] | None = None
    """Called with a loss the cloud reported, before the job is stopped on the survivors (the
    controller holds a ``--down`` job's rule there: its end is no job end)."""
    loss: Loss | None = None
    uploaded_at: float | None = None
    _log_offset: int = 0
    started_at: float = field(default_factory=time.time)
    last_running_at: float = field(default_factory=time.time)
    exceeded: threading.Event = field(default_factory=threading.Event)
    _stop: Callable[[str], None] | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        if self.watch is not None:
            self.exceeded = self.watch.exceeded

    def error(self) -> budget.BudgetExceeded:
        assert self.watch is not None
        return self.watch.error()

    def start(self) -> None:
        if self.watch is not None:
            self.watch.start()
        self._thread = threading.Thread(target=self._loop, name="health-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self.watch is not None:
            self.watch.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def attach(self, stop: Callable[[str], None]) -> None:
        self._stop = stop
        self.started_at = time.time()
        if self.watch is not None:
            self.watch.attach(stop)

    def detach(self) -> None:
        self._stop = None
        if self.watch is not None:
            self.watch.detach()

    def _loop(self) -> None:
        while not self._done.wait(self.poll):
            try:
                health = ask(self.handle)
            except CloudtrainError as exc:   # the cloud could not be asked: not a loss
                self.env.ui.warn(f"recovery: could not ask the cloud about the nodes: {exc}")
                continue
            lost = [h for h in health if h.state == "lost"]
            if not lost:
                before, self.last_running_at = self.last_running_at, time.time()
                self._note_uploads(before)
                continue
            if self._stop is None:
                continue    # between steps: run_task fails on its own, or the next job sees it
            self.loss = self.lost([h.rank for h in lost],
                                  "; ".join(f"node {h.rank}: {h.reason}" for h in lost))
            self.env.ui.warn(f"recovery: the cloud took {self.loss.reason}")
            if self.on_loss is not None:
                self.on_loss(self.loss)
            self._stop(f"the cloud took node(s) {self.loss.ranks}")
            self.group.stop.set()   # the lost node's follow ends now, not at the node timeout
            return

    def lost(self, ranks: list[int], reason: str, last_seen: float | None = None) -> Loss:
        """The loss of ``ranks``, seen now (``last_seen``: when they last answered, the last
        poll that saw them running by default): the work since the last checkpoint anything
        that survives holds (the bucket's when the head is among them) is lost."""
        ckpt = None
        if 0 in ranks:     # the head's disk is gone: only the bucket's
            ckpt = self.uploaded_at if self.task.checkpoints else None
        else:
            try:
                ckpt = last_checkpoint_at(self.group, self.handle, self.task)
            except CloudtrainError:
                ckpt = None
        return Loss(ranks, reason, last_seen or self.last_running_at, time.time(),
                    max(self.started_at, ckpt or 0.0), resumes_from(self.task, ranks, ckpt))

    def unresponsive(self, err: NodeLost, window: float) -> Loss:
        """Node ``err.rank`` did not answer SSH for the whole window while the cloud did not
        say it was lost: it is replaced as unresponsive."""
        self.env.ui.warn(f"recovery: node {err.rank} has not answered SSH for {window:.0f} s "
                         f"({UNRESPONSIVE_WINDOW_ENV}) while the cloud reports it running: "
                         "replacing it")
        return self.lost([err.rank], f"node {err.rank}: unresponsive (no SSH answer for "
                                     f"{err.silent:.0f} s while the cloud reported it running)",
                         last_seen=time.time() - err.silent)

    def _note_uploads(self, before: float) -> None:
        """When the head's log (read on from where the last poll stopped) says a checkpoint
        was uploaded, count it from the poll before (the upload ended after that one)."""
        from pathlib import Path

        path = self.head_log() if self.head_log is not None else None
        if not self.task.checkpoints or not isinstance(path, Path):
            return
        try:
            with path.open("rb") as f:
                f.seek(self._log_offset)
                new = f.read()
        except OSError:
            return
        cut = new.rfind(b"\n") + 1
        self._log_offset += cut
        if b"[store] Uploaded checkpoint " in new[:cut]:
            self.uploaded_at = before


def ask(handle: Handle) -> list[NodeHealth]:
    provider = handle.provider
    if not isinstance(provider, ReportsNodeHealth):
        raise UserError(f"The {provider.name} provider cannot tell which nodes the cloud took, "
                        "so --recover cannot run on it.", "Launch without --recover.")
    return provider.node_health(handle.name)


def lost_now(handle: Handle, health: HealthWatch) -> Loss | None:
    """A step failed (sync, setup, or the job's follow gave up on a node): was it the cloud
    taking a node? Asked once, so that the loss, not the failed step, decides what happens."""
    try:
        lost = [h for h in ask(handle) if h.state == "lost"]
    except CloudtrainError:
        return None
    if not lost:
        return None
    return health.lost([h.rank for h in lost],
                       "; ".join(f"node {h.rank}: {h.reason}" for h in lost))


def last_checkpoint_at(group: Group, handle: Handle, task: Task) -> float | None:
    """When the surviving head last wrote a checkpoint: the newest file under its
    CLOUDTRAIN_CHECKPOINT_DIR (``checkpoints:``'s directory, or the task envs' value) on
    rank 0, or None."""
    from cloudtrain.pipeline import storage

    where = (storage.checkpoint_dir(handle.nodes[0]) if task.checkpoints
             else task.envs.get("CLOUDTRAIN_CHECKPOINT_DIR"))
    if not where or 0 not in group.conns:
        return None
    d = shlex.quote(where)
    res = group.run(bash(f"cd {shlex.quote(handle.nodes[0].root_dir)}/workdir 2>/dev/null; "
                         f"find {d} -type f -printf '%T@\\n' 2>/dev/null | sort -n | tail -1"),
                    ranks=[0], timeout=15)
    try:
        return float(res[0].stdout.strip())
    except (ValueError, KeyError):
        return None


