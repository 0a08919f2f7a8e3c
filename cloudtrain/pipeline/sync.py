"""rsync the workdir and file_mounts to every node in parallel, and pull outputs back.

A fingerprint of what would be sent (paths, sizes, mtimes, modes, the filter rules) is kept on
each node after a successful sync; a later launch whose local fingerprint matches skips rsync
for that node altogether. The same fingerprint keys the "setup once" check.

Which files are sent is decided by rsync alone: the fingerprint asks rsync itself for the list
(``--list-only`` with the very filter arguments the push uses), so an ignore rule can never
hide a change from the fingerprint while the push would send it, or the other way round.

Outputs come back from a node that is treated as untrusted: into a fresh private staging
folder inside the outputs folder, with no links, devices or special files, then moved into
place one path component at a time without following any link on this side.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

from cloudtrain.errors import RemoteError, UserError
from cloudtrain import sshmux
from cloudtrain.pipeline import treestamp
from cloudtrain.keys import ClusterKeys, ssh_command_options
from cloudtrain.schema import NodeRow

IGNORE_FILES = (".gitignore", ".cloudtrainignore")
FILTER_VERSION = "3"


@dataclass(frozen=True)
class Mount:
    local: Path
    remote: str  # absolute, or relative to the node's workdir


@dataclass(frozen=True)
class SyncPlan:
    workdir: Path | None
    mounts: tuple[Mount, ...]
    protect: tuple[str, ...]   # paths under workdir never deleted on the node (outputs, mounts)
    exclude: tuple[str, ...]   # paths under workdir never sent (outputs folder, CLOUDTRAIN_HOME)

    def workdir_filters(self) -> list[str]:
        """The rsync filter arguments of the workdir sync: the one list both the push and the
        fingerprint use."""
        filters = ["--exclude=/.git/"]
        for name in IGNORE_FILES:
            filters.append(f"--filter=:- {name}")
        for p in self.protect:
            filters.append(f"--filter=P /{literal(p.strip('/'))}")
        for p in self.exclude:
            filters.append(f"--exclude=/{literal(p.strip('/'))}")
        return filters

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"filters:{FILTER_VERSION}:{self.workdir_filters()}".encode())
        if self.workdir is not None:
            h.update(b"workdir\0")
            _hash_listing(h, self.workdir, self.workdir_filters())
        for m in self.mounts:
            h.update(f"mount\0{m.remote}\0".encode())
            if m.local.is_dir():
                _hash_listing(h, m.local, [])
            else:
                _hash_entry(h, os.fsencode(m.local.name), os.fsencode(m.local))
        return h.hexdigest()[:32]


def literal(path: str) -> str:
    """An rsync filter pattern that matches ``path`` literally (rsync treats * ? [ as
    wildcards, and then a backslash as an escape)."""
    if not any(c in path for c in "*?["):
        return path
    return re.sub(r"([*?\[\\])", r"\\\1", path)


def _escaped(name: bytes) -> str:
    """A name as rsync prints it under LC_ALL=C: bytes outside printable ASCII as \\#ooo, and
    a backslash too where it would read as such an escape (followed by # and 3 digits)."""
    out = []
    for i, b in enumerate(name):
        if b == 0x5C and re.match(rb"#[0-9]{3}", name[i + 1:i + 5]):
            out.append("\\#134")
        else:
            out.append(chr(b) if 0x20 <= b < 0x7F else f"\\#{b:03o}")
    return "".join(out)


def _hash_entry(h: hashlib._Hash, rel: bytes, path: bytes) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        return  # gone between rsync's listing and now: the next launch sees it
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        h.update(b"l\0" + rel + b"\0" + os.readlink(path) + b"\0")
    elif stat.S_ISDIR(mode):
        h.update(b"d\0%s\0%d\0" % (rel, mode & 0o7777))
    else:
        h.update(b"f\0%s\0%d:%d:%d\0" % (rel, st.st_size, st.st_mtime_ns, mode & 0o7777))


# rsync --list-only: "PERMS SIZE YYYY/MM/DD HH:MM:SS NAME" (NAME as is after one space)
_LIST_LINE = re.compile(rb"^(\S{10}) +[\d,.]+ \S+ \S+ (.*?)\n?$", re.DOTALL)


def _hash_listing(h: hashlib._Hash, root: Path, filters: list[str]) -> None:
    """Hash what ``rsync -a FILTERS root/ DEST`` would send (rsync's listing, or the one of
    the last launch when the folder has not changed since: :mod:`treestamp`)."""
    h.update(treestamp.digest(root, filters, lambda: _listing_digest(root, filters)).encode())


def _listing_digest(root: Path, filters: list[str]) -> str:
    """rsync lists the files (read as it walks), this hashes each one's name, type, size,
    mtime (ns) and mode (and a link's target)."""
    h = hashlib.sha256()
    rootb = os.fsencode(root)
    for rel in sent_paths(root, filters):
        _hash_entry(h, rel, rootb + b"/" + rel)
    return h.hexdigest()


def sent_paths(root: Path, filters: list[str]) -> list[bytes]:
    """What ``rsync -a FILTERS root/ DEST`` sends: rsync's listing, or the one taken when
    the folder was as it is now (:func:`treestamp.listed`)."""
    return treestamp.listed(root, filters, lambda: list(listed(root, filters)))


def listed(root: Path, filters: list[str]) -> Iterator[bytes]:
    """The real relative path of every entry ``rsync -a FILTERS root/ DEST`` would send, in
    rsync's order (rsync lists them, read as it walks)."""
    rootb = os.fsencode(root)
    real: dict[str, bytes] = {".": b""}  # rsync's printed dir path -> real relative path
    with tempfile.TemporaryFile() as errf, \
            subprocess.Popen([_rsync_bin(), "-a", "--list-only", *filters, f"{root}/"],
                             stdout=subprocess.PIPE, stderr=errf,
                             env={**os.environ, "LC_ALL": "C"}) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            m = _LIST_LINE.match(raw)
            if m is None or m.group(2) == b".":
                continue
            perms, shown_b = m.group(1), m.group(2)
            kind = perms[:1]
            rel = shown_b
            if b"\\#" in shown_b or kind == b"l":
                found = _real_name(rootb, real, shown_b.decode("ascii", "replace"), kind == b"l")
                if found is None:
                    continue
                rel = found
            if kind == b"d" and b"\\#" in shown_b:  # its entries are looked up through it
                real[shown_b.decode("ascii", "replace")] = rel
            yield rel
        proc.wait()
        errf.seek(0)
        err = errf.read()
    if proc.returncode not in (0, 24):  # 24: a file vanished while listing
        raise UserError(f"Listing '{root}' for the sync failed (rsync exit {proc.returncode}): "
                        + err.decode(errors="replace").strip()[-300:],
                        "Check that every file under it is readable.")


def _real_name(rootb: bytes, real: dict[str, bytes], shown: str, is_link: bool) -> bytes | None:
    """The real relative path of a listed entry. rsync escapes odd bytes and shows a link as
    'name -> target', so anything not plain is matched against the entries of its parent (a
    directory listed earlier, whose printed path is a prefix of this line)."""
    if "\\#" not in shown and not is_link:
        return shown.encode()
    cuts = [i for i, c in enumerate(shown) if c == "/"]
    for head in [shown[:i] for i in reversed(cuts)] + ["."]:
        parent = real.get(head, head.encode() if "\\#" not in head else None)
        if parent is None:
            continue
        tail = shown[len(head) + 1:] if head != "." else shown
        try:
            names = os.listdir(os.path.join(rootb, parent) if parent else rootb)
        except OSError:
            continue
        for name in names:
            full = os.path.join(parent, name) if parent else name
            want = _escaped(name)
            if is_link:
                try:
                    want += " -> " + _escaped(os.readlink(os.path.join(rootb, full)))
                except OSError:
                    continue
            if want == tail:
                return full
    return None


def remote_path(node: NodeRow, sub: str) -> str:
    return str(PurePosixPath(node.root_dir) / sub)


def workdir_on(node: NodeRow) -> str:
    return remote_path(node, "workdir")


def mount_target(node: NodeRow, remote: str) -> str:
    return remote if remote.startswith("/") else str(PurePosixPath(workdir_on(node)) / remote)


def _rsync_bin() -> str:
    path = shutil.which("rsync")
    if path is None:
        raise UserError("rsync is needed to sync files to the nodes, and it is not installed here.",
                        "Install it: 'apt-get install rsync' or 'brew install rsync'.")
    return path


def _ssh_e(keys: ClusterKeys, node: NodeRow) -> str:
    """rsync's ssh: strict, our key and known_hosts; over the node's master when one answers
    (no second handshake)."""
    opts = ssh_command_options(keys, node.port, node.identity_file)
    return " ".join(shlex.quote(a) for a in ["ssh", *sshmux.reuse_options(keys, node), *opts])


def _dest(node: NodeRow, path: str) -> str:
    host = f"[{node.host}]" if ":" in node.host else node.host
    return f"{node.user}@{host}:{path}"


_live: set[subprocess.Popen[str]] = set()   # rsyncs of push_all now running (Ctrl-C ends them)
_live_lock = threading.Lock()


def _run(cmd: list[str], what: str, node: NodeRow) -> None:
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        with _live_lock:
            _live.add(p)
        try:
            stdout, stderr = p.communicate()
        finally:
            with _live_lock:
                _live.discard(p)
    proc = subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()[-3:]
        hint = "Check the node with 'cloudtrain status'."
        if proc.returncode == 127 or "command not found" in proc.stderr:
            hint = "Install rsync on the node (bootstrap does this on cloud images)."
        raise RemoteError(f"{what} to node {node.rank} failed (rsync exit {proc.returncode}): "
                          + " | ".join(err), hint)


# rsync's quick check compares whole seconds by default: a same-size edit within the second
# of the last sync would be skipped although the fingerprint (nanoseconds) saw it.
PUSH_OPTIONS = ("-a", "--modify-window=-1")


def push(plan: SyncPlan, node: NodeRow, keys: ClusterKeys, deletions: Path | None = None) -> None:
    """Send the workdir and the file mounts. Nothing on the node is deleted, except, with
    ``deletions`` (an rsync filter file: :mod:`cloudtrain.pipeline.sent`), the paths it risks:
    those the last sync sent that the workdir no longer has (every other path is protected)."""
    base = [_rsync_bin(), *PUSH_OPTIONS, "-e", _ssh_e(keys, node)]
    if plan.workdir is not None:
        delete = [] if deletions is None else ["--delete", f"--filter=merge {deletions}"]
        _run(base + plan.workdir_filters() + delete
             + [f"{plan.workdir}/", _dest(node, workdir_on(node) + "/")], "syncing workdir", node)
    for m in plan.mounts:
        target = mount_target(node, m.remote)
        src = f"{m.local}/" if m.local.is_dir() else str(m.local)
        dst = target + "/" if m.local.is_dir() else target
        parent = shlex.quote(str(PurePosixPath(target).parent))
        _run([_rsync_bin(), *PUSH_OPTIONS, "-e", _ssh_e(keys, node),
              f"--rsync-path=mkdir -p {parent} && rsync", src, _dest(node, dst)],
             f"syncing {m.local}", node)


def push_all(plan: SyncPlan, nodes: list[NodeRow], keys: ClusterKeys,
             deletions: dict[int, Path] | None = None) -> dict[int, BaseException | None]:
    """Push to every node at once (``deletions``: each node's, see :func:`push`); returns
    each node's error (None when fine)."""
    if not nodes:
        return {}
    out: dict[int, BaseException | None] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        futs = {n.rank: pool.submit(push, plan, n, keys, (deletions or {}).get(n.rank))
                for n in nodes}
        try:
            for fut in futs.values():
                wait([fut], timeout=None)
        except KeyboardInterrupt:
            # Ctrl-C: end the rsyncs at once and report an interruption, not a sync failure.
            pool.shutdown(wait=False, cancel_futures=True)
            with _live_lock:
                for p in _live:
                    p.terminate()
            raise
        for rank, fut in futs.items():
            try:
                fut.result()
                out[rank] = None
            except BaseException as exc:  # noqa: BLE001 - kept per node
                out[rank] = exc
    return out


# --- pulling outputs back from an untrusted node ---------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

# Regular files and directories only: symlinks, devices, fifos and sockets are never created
# here; no owner/group, no setuid/setgid bits.
PULL_OPTIONS = ("-rtp", "--no-links", "--no-devices", "--no-specials", "--chmod=ug-s")


@dataclass
class Pulled:
    """What one pull brought back: ``found`` is False when the output is not on the node;
    ``skipped`` lists what was left out (links, special files, paths that would not stay
    inside the outputs folder)."""
    found: bool
    skipped: list[str]


def _open_dir(name: str, dir_fd: int, create: bool, mode: int = 0o755, shown: str = "") -> int:
    """Open (creating if asked) the directory ``name`` inside ``dir_fd`` without following a
    link: a link or a file in its place raises :class:`RemoteError`."""
    if create:
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise _unsafe(shown or name, exc) from None


def _unsafe(name: str, exc: OSError) -> RemoteError:
    return RemoteError(f"'{name}' in the outputs folder is not a plain directory "
                       f"({exc.strerror or exc}); outputs are never written through a link or "
                       f"over a file.", f"Move '{name}' out of the outputs folder and pull again.")


def _merge(src_fd: int, dst_fd: int, where: str, skipped: list[str]) -> None:
    """Move every entry of the staging dir ``src_fd`` into ``dst_fd``: directories merged
    (created without following links), regular files replacing what was there (a link in the
    way is replaced, never followed); anything else is skipped."""
    for entry in os.scandir(src_fd):
        rel = f"{where}/{entry.name}" if where else entry.name
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            try:
                sub_dst = _open_dir(entry.name, dst_fd, create=True, mode=stat.S_IMODE(st.st_mode) | 0o700)
            except RemoteError:
                skipped.append(f"{rel}/ (a link or a file is in its place in the outputs folder; "
                               "outputs are never written through a link)")
                continue
            sub_src = os.open(entry.name, _DIR_FLAGS, dir_fd=src_fd)
            try:
                _merge(sub_src, sub_dst, rel, skipped)
            finally:
                os.close(sub_src)
                os.close(sub_dst)
        elif stat.S_ISREG(st.st_mode):
            try:
                os.replace(entry.name, entry.name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
            except OSError as exc:
                skipped.append(f"{rel} ({exc.strerror})")
        else:
            skipped.append(f"{rel} (not a regular file)")


def _check_staging(staging: Path) -> None:
    """Every path under the staging dir is a plain file or directory that resolves inside it."""
    top = staging.resolve()
    for dirpath, dirnames, filenames in os.walk(staging, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            bad = not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode))
            if bad or not p.resolve().is_relative_to(top):
                raise RemoteError(f"the node sent '{p.relative_to(staging)}', which is not a plain "
                                  "file or directory inside the outputs folder; nothing of it was kept.",
                                  "Check what the job writes into its outputs.")


def pull(node: NodeRow, keys: ClusterKeys, rel: str, dest: Path, base: str | None = None,
         via: Callable[[str], list[str]] | None = None) -> Pulled:
    """Copy ``workdir/rel`` (``base/rel``: another folder on the node, a sweep trial's own
    workdir) from the node into ``dest/rel``, treating the node as untrusted: nothing can
    land outside ``dest``. ``via``: rsync's arguments naming the source another way (a
    scheduler's shared filesystem through its login node) instead of over SSH to the node."""
    parts = [p for p in PurePosixPath(rel).parts if p not in ("", ".", "/")]
    if ".." in parts:
        raise RemoteError(f"output '{rel}' is not a path inside the workdir.",
                          "List outputs as paths inside workdir, e.g. checkpoints/")
    try:
        dest.mkdir(parents=True, exist_ok=True)
        dst_fd = os.open(dest, _DIR_FLAGS)
    except OSError as exc:
        raise _unsafe(str(dest), exc) from None
    # no parts: the whole workdir ("." in outputs), its contents straight into dest
    src = str(PurePosixPath(base or workdir_on(node), *parts)) + ("" if parts else "/")
    skipped: list[str] = []
    try:
        staging = Path(tempfile.mkdtemp(prefix=".cloudtrain-pull-", dir=dest))
    except OSError:
        os.close(dst_fd)
        raise
    try:
        into = staging.joinpath(*parts[:-1])
        into.mkdir(parents=True, exist_ok=True)
        source = via(src) if via else ["-e", _ssh_e(keys, node), _dest(node, src)]
        proc = subprocess.run([_rsync_bin(), *PULL_OPTIONS, *source, str(into) + "/"],
                              capture_output=True, text=True)
        if proc.returncode == 23 and "No such file" in proc.stderr:
            return Pulled(False, [])
        if proc.returncode != 0:
            raise RemoteError(f"pulling '{rel}' from node {node.rank} failed: "
                              f"{proc.stderr.strip()[-300:]}", "Check the path in 'outputs'.")
        if not staging.joinpath(*parts).exists():
            # rsync skipped it: the output itself is a link or a special file on the node
            return Pulled(False, [f"{'/'.join(parts)} (not a regular file or directory on the node)"])
        _check_staging(staging)
        skipped += [line.split('"')[1] + " (a link or special file on the node)"
                    for line in proc.stdout.splitlines() + proc.stderr.splitlines()
                    if line.startswith("skipping non-regular file") and line.count('"') >= 2]
        # The folders leading to the output must be plain folders here (no link left by an
        # earlier pull, say): checked (and made) one component at a time.
        fd = os.dup(dst_fd)
        try:
            for i, comp in enumerate(parts[:-1]):
                nfd = _open_dir(comp, fd, create=True, shown="/".join(parts[:i + 1]))
                os.close(fd)
                fd = nfd
        finally:
            os.close(fd)
        src_fd = os.open(staging, _DIR_FLAGS)
        try:
            _merge(src_fd, dst_fd, "", skipped)
        finally:
            os.close(src_fd)
        return Pulled(True, skipped)
    finally:
        os.close(dst_fd)
        shutil.rmtree(staging, ignore_errors=True)
