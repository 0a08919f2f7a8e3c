"""rsync the workdir and file_mounts to every node in parallel, and pull outputs back.

A fingerprint of what would be sent (paths, sizes, mtimes, the filter rules) is kept on each
node after a successful sync; a later launch whose local fingerprint matches skips rsync for
that node altogether. The same fingerprint keys the "setup once" check.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shlex
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import RemoteError, UserError
from .keys import ClusterKeys, ssh_command_options
from .state import NodeRow

IGNORE_FILES = (".gitignore", ".cloudtrainignore")
FILTER_VERSION = "1"


@dataclass(frozen=True)
class Mount:
    local: Path
    remote: str  # absolute, or relative to the node's workdir


@dataclass(frozen=True)
class SyncPlan:
    workdir: Path | None
    mounts: tuple[Mount, ...]
    protect: tuple[str, ...]   # paths under workdir never deleted on the node (outputs)
    exclude: tuple[str, ...]   # paths under workdir never sent (the local outputs folder)

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"filters:{FILTER_VERSION}:{self.protect}:{self.exclude}".encode())
        if self.workdir is not None:
            h.update(b"workdir\0")
            _walk_into(h, self.workdir, self.exclude)
        for m in self.mounts:
            h.update(f"mount\0{m.remote}\0".encode())
            _walk_into(h, m.local, ())
        return h.hexdigest()[:32]


def _top_level_skips(root: Path) -> list[str] | None:
    """Simple name patterns from top-level ignore files that are safe to skip in the walk;
    None when a negation makes skipping unsafe."""
    pats: list[str] = []
    for name in IGNORE_FILES:
        f = root / name
        if not f.is_file():
            continue
        for line in f.read_text(errors="replace").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("!"):
                return None
            core = line.rstrip("/")
            if "/" not in core.lstrip("/") and core:
                pats.append(core.lstrip("/"))
    return pats


def _walk_into(h: hashlib._Hash, root: Path, exclude: tuple[str, ...]) -> None:
    if root.is_file():
        st = root.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_mode}\0".encode())
        return
    skips = _top_level_skips(root) or []
    excl = {e.strip("/") for e in exclude}
    stack = [root]
    entries: list[str] = []
    while stack:
        d = stack.pop()
        try:
            it = list(os.scandir(d))
        except OSError:
            continue
        for e in it:
            rel = os.path.relpath(e.path, root)
            if e.name == ".git" or rel in excl or any(fnmatch.fnmatch(e.name, p) for p in skips):
                continue
            try:
                if e.is_symlink():
                    entries.append(f"l:{rel}:{os.readlink(e.path)}")
                elif e.is_dir():
                    stack.append(Path(e.path))
                    entries.append(f"d:{rel}")
                else:
                    st = e.stat()
                    entries.append(f"f:{rel}:{st.st_size}:{st.st_mtime_ns}:{st.st_mode & 0o777}")
            except OSError:
                continue
    entries.sort()
    h.update("\0".join(entries).encode())


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
    return " ".join(shlex.quote(a) for a in ["ssh", *ssh_command_options(keys, node.port,
                                                                         node.identity_file)])


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


def push(plan: SyncPlan, node: NodeRow, keys: ClusterKeys) -> None:
    base = [_rsync_bin(), "-a", "--delete", "-e", _ssh_e(keys, node)]
    if plan.workdir is not None:
        filters = ["--exclude=/.git/"]
        for name in IGNORE_FILES:
            filters.append(f"--filter=:- {name}")
        for p in plan.protect:
            filters.append(f"--filter=P /{p.strip('/')}")
        for p in plan.exclude:
            filters.append(f"--exclude=/{p.strip('/')}")
        _run(base + filters + [f"{plan.workdir}/", _dest(node, workdir_on(node) + "/")],
             "syncing workdir", node)
    for m in plan.mounts:
        target = mount_target(node, m.remote)
        src = f"{m.local}/" if m.local.is_dir() else str(m.local)
        dst = target + "/" if m.local.is_dir() else target
        parent = shlex.quote(str(PurePosixPath(target).parent))
        _run([_rsync_bin(), "-a", "-e", _ssh_e(keys, node),
              f"--rsync-path=mkdir -p {parent} && rsync", src, _dest(node, dst)],
             f"syncing {m.local}", node)


def push_all(plan: SyncPlan, nodes: list[NodeRow], keys: ClusterKeys) -> dict[int, BaseException | None]:
    """Push to every node at once; returns each node's error (None when fine)."""
    if not nodes:
        return {}
    out: dict[int, BaseException | None] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        futs = {n.rank: pool.submit(push, plan, n, keys) for n in nodes}
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


def pull(node: NodeRow, keys: ClusterKeys, rel: str, dest: Path) -> bool:
    """Copy ``workdir/rel`` from the node into ``dest/rel``. False when it is not there."""
    dest.mkdir(parents=True, exist_ok=True)
    src = str(PurePosixPath(workdir_on(node)) / rel.rstrip("/"))
    target = dest / rel.rstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([_rsync_bin(), "-a", "-e", _ssh_e(keys, node), _dest(node, src),
                           str(target.parent) + "/"], capture_output=True, text=True)
    if proc.returncode == 23 and "No such file" in proc.stderr:
        return False
    if proc.returncode != 0:
        raise RemoteError(f"pulling '{rel}' from node {node.rank} failed: "
                          f"{proc.stderr.strip()[-300:]}", "Check the path in 'outputs'.")
    return True
