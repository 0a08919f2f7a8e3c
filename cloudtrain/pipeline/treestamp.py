"""A cheap stamp of a local folder, so a launch with nothing changed skips rsync's listing.

The workdir fingerprint (``sync.SyncPlan.fingerprint``) hashes what ``rsync --list-only``
lists, so it follows rsync's filters exactly; starting rsync costs 25-45 ms on every launch.
The stamp here is every entry under the folder (name, type, size, mtime in ns, mode, a
link's target), filters not applied: when it equals the stamp taken with the last listing,
nothing rsync could list has changed (the ignore files are entries too), and that listing's
digest is used again. Any change, a folder too big to walk quickly (over MAX_ENTRIES
entries) or a missing cache means rsync lists it, as before.

Kept in ``$CLOUDTRAIN_HOME/cache/listings`` (one small file per folder and filter list, and
beside it the listed paths, ``KEY.paths``, for the sync's list of what it sent); a home that
does not exist yet is never created for it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Callable

MAX_ENTRIES = 5000


def stamp(root: Path) -> str | None:
    """The folder's stamp, or None when it holds more than MAX_ENTRIES entries (or cannot be
    read). The top-level ``.git`` is left out: the sync never sends it (``--exclude=/.git/``)
    and rsync reads nothing in it."""
    h = hashlib.sha256()
    count = 0
    todo = [b""]
    rootb = os.fsencode(root)
    try:
        while todo:
            rel = todo.pop()
            with os.scandir(rootb + b"/" + rel if rel else rootb) as it:
                entries = sorted(it, key=lambda e: e.name)
            for e in entries:
                name = rel + b"/" + e.name if rel else e.name
                if name == b".git":
                    continue
                count += 1
                if count > MAX_ENTRIES:
                    return None
                st = e.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    h.update(b"l\0%s\0%s\0" % (name, os.readlink(e.path)))
                    continue
                h.update(b"%s\0%d\0%d\0%d\0" % (name, st.st_mode, st.st_size, st.st_mtime_ns))
                if stat.S_ISDIR(st.st_mode):
                    todo.append(name)
    except OSError:
        return None
    return h.hexdigest()


def _cache_file(root: Path, filters: list[str]) -> Path:
    from cloudtrain.paths import home_path

    key = hashlib.sha256("\0".join([str(root.resolve()), *filters]).encode()).hexdigest()[:32]
    return home_path() / "cache" / "listings" / key


def digest(root: Path, filters: list[str], listing: Callable[[], str]) -> str:
    """``listing()`` (rsync's, hashed), or the one taken when the folder's stamp was the same
    as now."""
    f = _cache_file(root, filters)
    before = stamp(root)
    if before is not None:
        try:
            seen, known = f.read_text().split()
            if seen == before:
                return known
        except (OSError, ValueError):
            pass
    got = listing()
    _keep(root, before, f, f"{before} {got}\n".encode())
    return got


def listed(root: Path, filters: list[str], listing: Callable[[], list[bytes]]) -> list[bytes]:
    """``listing()`` (the relative paths rsync lists), or the ones listed when the folder's
    stamp was the same as now: the fingerprint's listing serves the sync's list of what it
    sends (:mod:`cloudtrain.pipeline.sent`) without a second rsync."""
    f = _cache_file(root, filters).with_suffix(".paths")
    before = stamp(root)
    if before is not None:
        try:
            seen, _, rest = f.read_bytes().partition(b"\n")
            if seen == before.encode():
                return [p for p in rest.split(b"\0") if p]
        except OSError:
            pass
    got = listing()
    _keep(root, before, f, before.encode() + b"\n" + b"\0".join(got) if before else b"")
    return got


def _keep(root: Path, before: str | None, f: Path, data: bytes) -> None:
    """Keep ``data`` in ``f`` only when nothing changed while rsync listed (the stamp is the
    same after), in a home that exists."""
    from cloudtrain.paths import home_path, private_dir

    if before is not None and home_path().is_dir() and stamp(root) == before:
        try:
            private_dir(f.parent)
            tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, f)
        except OSError:
            pass
