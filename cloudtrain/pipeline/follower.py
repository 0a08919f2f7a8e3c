"""An attached ``launch --down`` says to the node guards that its CLI is still there
(docs/guard.md, "A lost laptop"): while it follows the job, pulls the outputs and until it
has torn the cluster down, it touches ``ROOT/.cloudtrain/guard/followers/JOB_ID`` on every
node every ``BEAT_S`` seconds (one short command per node, over the launch's connections).
The guard (cloudtrain/node/guard.py ``job_end_stop_at``) leaves the CLI the job-end grace
(300 s) only while the heartbeat is fresh: once none came for its window (30 s) plus one beat,
the nodes act alone, at the job's end at the earliest. A dropped connection that comes back
within the window changes nothing (a beat that fails is simply tried again)."""

from __future__ import annotations

import shlex
import threading
from types import TracebackType

from cloudtrain.cluster import Handle
from cloudtrain.remote import Group, bash
from cloudtrain.schema import NodeRow

BEAT_S = 5.0          # the guard's FOLLOWER_BEAT_S


def beat_command(node: NodeRow, job_id: str) -> str:
    """Bash builtins only, except the folder's first ``mkdir`` (a beat starts no process)."""
    return bash(f"r={shlex.quote(node.root_dir)}; case $r in /*) ;; *) r=$HOME/$r ;; esac; "
                "d=$r/.cloudtrain/guard/followers; [ -d \"$d\" ] || mkdir -p \"$d\" && "
                f"true > \"$d\"/{shlex.quote(job_id)}")


class Heartbeat:
    """``with Heartbeat(handle, group, job_id, on):`` beats while the block runs (nothing
    when ``on`` is false: a detached launch, or no ``--down``)."""

    def __init__(self, handle: Handle, group: Group, job_id: str, on: bool) -> None:
        self.handle, self.group, self.job_id, self.on = handle, group, job_id, on
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def beat(self) -> None:
        try:
            self.group.run(lambda n: beat_command(n, self.job_id), timeout=BEAT_S * 2)
        except Exception:  # noqa: BLE001 - a missed beat is tried again; the window allows it
            pass

    def loop(self) -> None:
        self.beat()
        while not self.done.wait(BEAT_S):
            self.beat()

    def __enter__(self) -> Heartbeat:
        if self.on:
            self.thread = threading.Thread(target=self.loop, name="ct-follower-beat",
                                           daemon=True)
            self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Not joined: a beat to a node that does not answer must not hold up what follows
        # (the teardown); a beat after the group closed fails and is dropped.
        self.done.set()
