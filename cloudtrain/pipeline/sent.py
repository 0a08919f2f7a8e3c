"""What the last workdir sync sent to a node, so that a later sync deletes only that.

A sync never deletes what a job wrote on the node (a checkpoint in its workdir, say). Files
removed from the laptop's workdir must still go from the node's copy (stale code must not
run), so every sync keeps the list of the workdir paths it sent, under the fingerprint the
node records (``.sync-fp``): ``$CLOUDTRAIN_HOME/clusters/NAME/sent/<fingerprint>``, one
NUL-separated list per fingerprint still on some node. The next sync to a node deletes the
paths of that node's list that the workdir no longer has, and nothing else: rsync's own
``--delete``, with a filter file that risks (``R``) exactly those paths and protects (``P *``)
every other path. The workdir's own rules come first, so outputs, mount targets and ignored
files stay protected as before. rsync deletes inside the node's workdir only; a folder that
still holds files the job wrote is kept (rsync says it "cannot delete non-empty directory").

A node whose list is not kept here (synced by an older cloudtrain or another home) has
nothing deleted, and the launch says so.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.pipeline import sync
from cloudtrain.schema import NodeRow

_FP = re.compile(r"^[0-9a-f]{32}$")


def _folder(env: Env, name: str) -> Path:
    return env.cluster_dir(name) / "sent"


def manifest(plan: sync.SyncPlan) -> list[bytes]:
    """The workdir paths this sync sends (rsync's own listing, with the push's filters; the
    fingerprint's, when the folder has not changed since)."""
    if plan.workdir is None:
        return []
    return sync.sent_paths(plan.workdir, plan.workdir_filters())


def load(env: Env, name: str, fp: str) -> set[bytes] | None:
    """The paths the sync with fingerprint ``fp`` sent (None: not kept here)."""
    if not _FP.match(fp):
        return None
    try:
        data = (_folder(env, name) / fp).read_bytes()
    except OSError:
        return None
    return {p for p in data.split(b"\0") if p}


def save(env: Env, name: str, fp: str, paths: list[bytes], keep: set[str]) -> None:
    """Keep ``paths`` under ``fp``; drop the lists of fingerprints not in ``keep``."""
    from cloudtrain.paths import private_dir

    folder = _folder(env, name)
    private_dir(folder)
    tmp = folder / f".{fp}.{os.getpid()}.tmp"
    tmp.write_bytes(b"\0".join(paths))
    os.replace(tmp, folder / fp)
    for f in folder.iterdir():
        if f.name not in keep | {fp} and not f.name.startswith("."):
            f.unlink(missing_ok=True)


def _pattern(path: bytes) -> str | None:
    """An anchored rsync pattern for exactly ``path`` (None: a name a filter file cannot
    hold, with a newline or a CR in it, or a path with a ".." component)."""
    text = os.fsdecode(path)
    if "\n" in text or "\r" in text or b".." in path.split(b"/"):
        return None
    return "/" + sync.literal(text)


def rules(gone: set[bytes]) -> tuple[str, list[bytes]]:
    """The filter file's text that lets rsync delete exactly ``gone`` (deepest first) and
    protects everything else; and the paths it cannot name (left on the node)."""
    lines, skipped = [], []
    for p in sorted(gone, key=lambda x: (-x.count(b"/"), x)):
        pattern = _pattern(p)
        if pattern is None:
            skipped.append(p)
        else:
            lines.append(f"R {pattern}")
    return "\n".join(lines + ["P *"]) + "\n", skipped


def push_all(env: Env, handle: Handle, plan: sync.SyncPlan, stale: list[NodeRow],
             node_fps: dict[int, str], fp: str) -> dict[int, BaseException | None]:
    """``sync.push_all`` to the ``stale`` nodes (``node_fps``: the fingerprint each one
    reported), deleting on each only what its last sync sent that the workdir no longer has;
    then keep this sync's list."""
    if plan.workdir is None:   # file mounts only: nothing is deleted there
        return sync.push_all(plan, stale, handle.keys)
    now = manifest(plan)
    current = set(now)
    with tempfile.TemporaryDirectory(prefix="cloudtrain-sent-") as tmp:
        deletions = {}
        for n in stale:
            gone = _gone(env, handle.name, node_fps.get(n.rank, ""), current, n.rank)
            if gone:
                text, skipped = rules(gone)
                for p in skipped:
                    env.ui.warn(f"node {n.rank}: '{os.fsdecode(p)!r}' was removed from the "
                                "workdir but its name cannot go in an rsync filter: left there")
                f = Path(tmp) / f"node-{n.rank}"
                f.write_text(text, errors="surrogateescape")
                deletions[n.rank] = f
        errors = sync.push_all(plan, stale, handle.keys, deletions)
    save(env, handle.name, fp, now, {node_fps.get(r, "") for r, e in errors.items() if e})
    return errors


def _gone(env: Env, name: str, old_fp: str, current: set[bytes], rank: int) -> set[bytes]:
    if not old_fp:
        return set()   # a node never synced: nothing of the laptop's is there
    before = load(env, name, old_fp)
    if before is None:
        env.ui.warn(f"node {rank}: this home does not know what the node's last sync sent (an "
                    "older cloudtrain, or another home, synced it): files removed from the "
                    "workdir since are left on the node")
        return set()
    return before - current
