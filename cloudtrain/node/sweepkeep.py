"""A sweep's study kept in the task's ``checkpoints:`` bucket (docs/sweep.md, "Resuming after
the head is lost"). Standard library only; shipped beside sweep.py and store.py.

The head's study is one file, ROOT/.cloudtrain/sweeps/NAME/journal.log. While the sweep runs,
the head pushes a copy of it to CHECKPOINTS/sweeps/NAME after every trial that ends (and once
at the start and at the end), through store.py's snapshots: the copy's object first, its
manifest LAST, so a copy half written when the head was lost is never restored (store.py
restores the newest manifest whose object is complete and matches its sha256). Only the
newest ``KEEP`` copies stay in the bucket. A head that starts with no journal of its own
(a replacement node) restores the newest complete copy first.

The transfers run as ``python3 sweepkeep.py push|restore ROOT NAME`` in a child process whose
environment adds the task's ``envs`` (a local store's endpoint and keys; on a cloud the
node's own identity needs none), read from keep.json (0600, beside the journal, written by
``sweep.py start`` from the spec's ``keep``: never stored in the study itself).

    python3 sweepkeep.py push ROOT NAME      one copy of the journal into the bucket
    python3 sweepkeep.py restore ROOT NAME   the newest complete copy, when there is no journal
Exit codes: 0 done; 3 nothing to restore (or a journal is already there); 2 bad arguments;
1 other failure (store.py's codes otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

if __package__:
    from cloudtrain.node import store
    from cloudtrain.node.sweepstudy import sdir
else:  # on a node: run as a script, store.py and sweepstudy.py beside it
    import store  # type: ignore[no-redef]  # the shipped sibling
    from sweepstudy import sdir  # type: ignore[no-redef]  # the shipped sibling

KEEP_FILE = "keep.json"
JOURNAL = "journal.log"
KEEP = 3                     # copies kept in the bucket (the newest first)
POLL_S = float(os.environ.get("CLOUDTRAIN_SWEEP_KEEP_POLL", "1"))
TIMEOUT_S = 600.0            # one transfer, at most
NOTHING, USAGE, FAILED = 3, 2, 1
MAX_KEEP_FILE = 1 << 20      # bytes read of keep.json


@dataclass(frozen=True)
class Keep:
    """Where a sweep's journal is kept: the task's ``checkpoints:`` URL and the environment
    its transfers add (the task's ``envs``)."""

    url: str
    env: tuple[tuple[str, str], ...] = ()

    def at(self, name: str) -> str:
        """The sweep's own prefix in the bucket: CHECKPOINTS/sweeps/NAME."""
        return f"{self.url.rstrip('/')}/sweeps/{name}"


def put_aside(root: str, name: str, spec: dict) -> dict:
    """The spec without its ``keep`` (``{"url": .., "env": {..}}``), which goes to keep.json
    (0600) beside the journal, so the bucket's URL and the task's envs never enter the study
    (the journal that is itself pushed to the bucket)."""
    keep = spec.get("keep")
    rest = {k: v for k, v in spec.items() if k != "keep"}
    path = os.path.join(sdir(root, name), KEEP_FILE)
    if not isinstance(keep, dict) or not isinstance(keep.get("url"), str):
        if os.path.exists(path):
            os.unlink(path)
        return rest
    os.makedirs(sdir(root, name), exist_ok=True)
    env = keep.get("env")
    env = env if isinstance(env, dict) else {}
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": keep["url"], "env": {str(k): str(v) for k, v in env.items()}}, f)
    os.replace(path + ".tmp", path)
    return rest


def read_keep(root: str, name: str) -> Keep | None:
    """keep.json, or None (the sweep's task has no ``checkpoints:``)."""
    try:
        with open(os.path.join(sdir(root, name), KEEP_FILE)) as f:
            doc = json.loads(f.read(MAX_KEEP_FILE))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("url"), str):
        return None
    env = doc.get("env")
    env = env if isinstance(env, dict) else {}
    return Keep(doc["url"], tuple(sorted((str(k), str(v)) for k, v in env.items())))


# -- in the driver: the commands below, in a child process --------------------------------------

def transfer(root: str, name: str, cmd: str) -> int:
    """``sweepkeep.py CMD ROOT NAME`` in a child process with the task's envs; its exit code
    (NOTHING when the sweep keeps no copy)."""
    keep = read_keep(root, name)
    if keep is None:
        return NOTHING
    try:
        return subprocess.run([sys.executable, os.path.abspath(__file__), cmd, root, name],
                              env={**os.environ, **dict(keep.env)}, stdin=subprocess.DEVNULL,
                              timeout=TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        print(f"[sweepkeep] {cmd} of sweep {name}: no answer in {TIMEOUT_S:.0f} s", flush=True)
        return FAILED


class KeepError(RuntimeError):
    """The bucket holding the sweep's study could not be read: the head must not start the
    sweep afresh (its next push would bury the copies it could not read)."""


def restored(root: str, name: str) -> bool:
    """A head with no journal of its own (a replacement node): the bucket's newest complete
    copy first. True when one was restored, False when there is none (or a journal is
    here); KeepError when the bucket could not be read."""
    if os.path.exists(os.path.join(sdir(root, name), JOURNAL)):
        return False
    code = transfer(root, name, "restore")
    if code not in (0, NOTHING):
        raise KeepError(f"the study of sweep {name} could not be restored from the "
                        f"checkpoints bucket (exit {code}; said above): not starting it afresh")
    return code == 0


@contextmanager
def keeping(root: str, name: str, settled: Callable[[], int],
            poll_s: float | None = None) -> Iterator[None]:
    """While the body runs, a thread pushes the journal whenever ``settled()`` (the count of
    trials that ended, plus one once the sweep is stopped) has changed since the last push
    (at once, too); after the body, a last push. Nothing when the sweep keeps no copy."""
    if read_keep(root, name) is None:
        yield
        return
    done = threading.Event()
    last: list[int | None] = [None]

    def once() -> None:
        now = settled()
        if now != last[0] and transfer(root, name, "push") == 0:
            last[0] = now

    def loop() -> None:
        while True:
            once()
            if done.wait(POLL_S if poll_s is None else poll_s):
                return

    thread = threading.Thread(target=loop, name="sweepkeep", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(TIMEOUT_S)
        last[0] = None
        once()


# -- the commands (the child process): store.py's snapshots -------------------------------------

def push(root: str, name: str) -> int:
    """One copy of the journal, up to its last complete line, as a store.py snapshot (its
    object, then its manifest); then only the newest KEEP copies are left."""
    keep = read_keep(root, name)
    src = os.path.join(sdir(root, name), JOURNAL)
    if keep is None or not os.path.exists(src):
        return NOTHING
    stage = tempfile.mkdtemp(prefix=".keep-", dir=sdir(root, name))
    try:
        with open(src, "rb") as f:
            data = f.read()
        with open(os.path.join(stage, JOURNAL), "wb") as f:
            f.write(data[:data.rfind(b"\n") + 1])
        rc = store.Rclone(keep.at(name))
        code = store.upload(keep.at(name), stage, rc, quiet_empty=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    prune(rc)
    return code


def prune(rc: store.Rclone) -> None:
    """Only the newest KEEP manifests stay, and the objects they name."""
    names = sorted((i["Path"] for i in rc.lsjson("manifests") if i["Path"].endswith(".json")),
                   reverse=True)
    if len(names) <= KEEP:
        return
    kept: set[str] = set()
    for n in names[:KEEP]:
        try:
            doc = json.loads(rc.run("cat", "--count", str(store.MAX_MANIFEST),
                                    store.remote_path(rc.url, "manifests", n)))
        except (ValueError, store.StoreError):
            return          # an unreadable kept copy: delete nothing
        files = doc.get("files") if isinstance(doc, dict) else None
        kept |= {str(f.get("sha256")) for f in files or [] if isinstance(f, dict)}
    for n in names[KEEP:]:
        rc.run("deletefile", store.remote_path(rc.url, "manifests", n))
    for obj in rc.lsjson("objects"):
        if obj["Path"] not in kept:
            rc.run("deletefile", store.remote_path(rc.url, "objects", obj["Path"]), check=False)


def restore(root: str, name: str) -> int:
    """The newest complete copy into the sweep's folder, when it has no journal."""
    keep = read_keep(root, name)
    dst = os.path.join(sdir(root, name), JOURNAL)
    if keep is None or os.path.exists(dst):
        return NOTHING
    stage = tempfile.mkdtemp(prefix=".keep-", dir=sdir(root, name))
    try:
        code = store.restore(keep.at(name), stage)
        got = os.path.join(stage, JOURNAL)
        if code == 0 and os.path.isfile(got) and not os.path.islink(got):
            os.replace(got, dst)
            print(f"[sweepkeep] the study of sweep {name} restored from {keep.at(name)}",
                  flush=True)
            return 0
        return code or NOTHING
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[1] not in ("push", "restore"):
        print(__doc__, file=sys.stderr)
        return USAGE
    cmd, root, name = argv[1], os.path.abspath(argv[2]), argv[3]
    t0 = time.monotonic()
    try:
        code = push(root, name) if cmd == "push" else restore(root, name)
    except store.StoreError as exc:     # said; the sweep goes on
        print(f"[sweepkeep] {cmd} of sweep {name} failed: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except OSError as exc:
        print(f"[sweepkeep] {cmd} of sweep {name} failed: {exc}", file=sys.stderr, flush=True)
        return FAILED
    if code == 0 and cmd == "push":
        print(f"[sweepkeep] journal of sweep {name} kept ({time.monotonic() - t0:.1f} s)",
              flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
