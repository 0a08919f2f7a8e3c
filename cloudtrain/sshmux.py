"""OpenSSH connection multiplexing: one authenticated connection per node (a ControlMaster)
that outlives the command that opened it for ``ControlPersist`` seconds, so the next command
reaches the node with one round trip instead of a handshake. No daemon of ours: the master is
OpenSSH's own process, it exits by itself when idle, and ``down`` ends it at once.

Where the sockets live: ``$CLOUDTRAIN_HOME/mux`` (0700), or, where that path is too long for a
Unix socket, ``/tmp/cloudtrain-mux-UID/<hash of the home>`` (0700, owned by this user, checked).

A socket's name says which connection it is: ``<cluster>-<rank>-<node>`` where ``cluster``
hashes the cluster's key folder (its home and name) and ``node`` hashes everything that makes
the connection trustworthy: user, address, port, instance id, the identity file, the proxy
it goes through (``resources.ssh_proxy``) and the host key(s) pinned for that address. A node
replaced (new instance or new pinned key) gets a new name, so an old master is never reused
for it; the old one is ended when the new one starts.

``CLOUDTRAIN_SSH_PERSIST``: seconds an idle master stays (default 300; 0 turns multiplexing
off: every command connects on its own with paramiko, as before).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cloudtrain.errors import HostKeyMismatch, SSHTimeout, UserError
from cloudtrain.keys import ClusterKeys, host_entry_name, ssh_command_options

if TYPE_CHECKING:
    import threading

    from cloudtrain.schema import NodeRow

PERSIST_ENV = "CLOUDTRAIN_SSH_PERSIST"
DEFAULT_PERSIST = 300
SOCKET_ROOM = 100   # sun_path is 108 bytes; OpenSSH binds "<path>.<16 random chars>" first


def persist_seconds() -> int:
    raw = os.environ.get(PERSIST_ENV, "").strip()
    if not raw:
        return DEFAULT_PERSIST
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"{PERSIST_ENV}={raw!r} is not a whole number of seconds.",
                        f"Set it to e.g. {DEFAULT_PERSIST} (how long an idle SSH connection to a "
                        "node is kept for the next command), 0 to connect anew every time, or "
                        "unset it.")
    return value


def enabled() -> bool:
    """Multiplexing is used when persisting is not turned off and OpenSSH is installed."""
    return persist_seconds() > 0 and shutil.which("ssh") is not None


def _private(d: Path) -> bool:
    """``d`` exists (created 0700 if missing), is a real folder, owned by us, private."""
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def mux_dir() -> Path | None:
    """The folder of this home's sockets, or None when no safe folder is available (then
    nothing is multiplexed)."""
    from cloudtrain.paths import home_path

    home = home_path()
    local = home / "mux"
    if len(str(local)) + 40 <= SOCKET_ROOM:
        return local if _private(local) else None
    base = Path("/tmp") / f"cloudtrain-mux-{os.getuid()}"   # short on every platform
    short = base / hashlib.sha256(str(home).encode()).hexdigest()[:12]
    return short if _private(base) and _private(short) else None


def cluster_tag(keys: ClusterKeys) -> str:
    return hashlib.sha256(str(keys.dir.resolve()).encode()).hexdigest()[:10]


def pinned_lines(keys: ClusterKeys, host: str, port: int) -> list[str]:
    name = host_entry_name(host, port)
    try:
        text = keys.known_hosts.read_text()
    except OSError:
        return []
    return sorted(ln.strip() for ln in text.splitlines() if ln.split(" ", 1)[0] == name)


def socket_path(d: Path, keys: ClusterKeys, node: NodeRow) -> Path:
    ident = node.identity_file or str(keys.private_key)
    h = hashlib.sha256("\0".join([node.user, node.host, str(node.port), node.instance_id or "",
                                  ident, keys.proxy or "",
                                  *pinned_lines(keys, node.host, node.port)]).encode())
    return d / f"{cluster_tag(keys)}-{node.rank}-{h.hexdigest()[:12]}"


def listening(path: Path) -> bool:
    """Does a master answer on this socket? (a connect, no process started)"""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def base_options(keys: ClusterKeys, node: NodeRow, path: Path, connect_timeout: int = 10,
                 learn: bool = False) -> list[str]:
    return [*ssh_command_options(keys, node.port, node.identity_file, connect_timeout, learn),
            "-o", "ControlPath=" + str(path).replace("%", "%%"), "-l", node.user]


def client_argv(keys: ClusterKeys, node: NodeRow, path: Path, command: str) -> list[str]:
    """``ssh`` that runs ``command`` over the master (or, when the master is gone, connects on
    its own with the same strict options)."""
    return ["ssh", *base_options(keys, node, path), "-o", "ControlMaster=no", "-T", "--",
            node.host, command]


def reuse_options(keys: ClusterKeys, node: NodeRow) -> list[str]:
    """Options that let another ``ssh`` (rsync's, ``cloudtrain ssh``) ride on the node's
    master when one answers; none otherwise (it then connects on its own)."""
    d = mux_dir() if enabled() else None
    if d is None:
        return []
    path = socket_path(d, keys, node)
    if not listening(path):
        return []
    return ["-o", "ControlPath=" + str(path).replace("%", "%%"), "-o", "ControlMaster=no"]


def end_master(path: Path) -> None:
    """End the master on ``path`` (it closes its connection and removes the socket); a stale
    socket file is removed."""
    if listening(path):
        subprocess.run(["ssh", "-F", "/dev/null", "-o", "ControlPath=" + str(path).replace("%", "%%"),
                        "-O", "exit", "cloudtrain-mux"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10,
                       check=False)
    for p in (path, path.with_name(path.name + ".lock")):
        try:
            p.unlink()
        except OSError:
            pass


def end_cluster(keys: ClusterKeys, ranks: set[int] | None = None,
                keep: Path | None = None) -> int:
    """End every master of this cluster (of ``ranks`` only when given; never ``keep``).
    Returns how many sockets were found."""
    d = mux_dir()
    if d is None or not d.is_dir():
        return 0
    tag = cluster_tag(keys)
    found = 0
    for p in d.glob(f"{tag}-*"):
        if p.name.endswith(".lock") or p == keep:
            continue
        parts = p.name.split("-")
        if ranks is not None and (len(parts) != 3 or not parts[1].isdigit()
                                  or int(parts[1]) not in ranks):
            continue
        found += 1
        try:
            end_master(p)
        except (OSError, subprocess.SubprocessError):
            pass
    if d.parent.name.startswith("cloudtrain-mux-"):
        try:
            d.rmdir()           # the shared folder keeps no empty folder of a home
        except OSError:
            pass                # other clusters' sockets are still there
    return found


class _Locked:
    """An flock on ``<socket>.lock``: one process at a time starts a given master."""

    def __init__(self, path: Path) -> None:
        self.path = path.with_name(path.name + ".lock")

    def __enter__(self) -> _Locked:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _failure(node: NodeRow, text: str, learn: bool) -> Exception | None:
    """A host-key refusal in ssh's words becomes ours; anything else is retried."""
    from cloudtrain.connection import node_address

    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or "Host key for" in text and \
            "has changed" in text:
        return HostKeyMismatch(
            f"node {node.rank} ({host_entry_name(node.host, node.port)}) presented a host key "
            "different from the one pinned when it was created.",
            "Someone may be intercepting the connection, or the node was replaced outside "
            "cloudtrain. If you replaced it, run 'cloudtrain down' then 'cloudtrain up'.")
    if "Host key verification failed" in text and not learn:
        return HostKeyMismatch(
            f"{node_address(node)} presented a host key cloudtrain has not pinned.",
            "cloudtrain pins each node's key when the node is created. If this node was "
            "re-created outside cloudtrain, run 'cloudtrain down' and 'cloudtrain up' again.")
    return None


def start_master(keys: ClusterKeys, node: NodeRow, path: Path, *, deadline: float,
                 learn: bool, stop: threading.Event | None) -> None:
    """Open the master connection to ``node`` on ``path``, retrying until ``deadline``
    (time.monotonic) while sshd comes up; learns the host key only where ``learn``."""
    persist = persist_seconds()
    delay, last = 0.05, ""
    with _Locked(path):
        if listening(path):
            return                      # another command opened it meanwhile
        end_cluster(keys, {node.rank}, keep=path)    # a replaced node's old master
        try:
            path.unlink()               # a stale socket file (its master was killed)
        except OSError:
            pass
        while True:
            left = deadline - time.monotonic()
            argv = ["ssh", *base_options(keys, node, path, max(1, min(int(left), 10)), learn),
                    "-M", "-N", "-f", "-o", f"ControlPersist={persist}s",
                    "-o", "ServerAliveCountMax=4", "--", node.host]
            # The master daemonizes and keeps its stdout/stderr: never a pipe of ours (a
            # reader would wait for it to exit); its errors go to a file read here.
            with tempfile.TemporaryFile() as err:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=err, start_new_session=True)
                code = _wait(proc, deadline, stop)
                err.seek(0)
                last = err.read()[-2000:].decode(errors="replace").strip()
            if code == 0 and listening(path):
                return
            bad = _failure(node, last, learn)
            if bad is not None:
                raise bad
            if stop is not None and stop.is_set():
                raise SSHTimeout(f"stopped while connecting to node {node.rank}.", "")
            if time.monotonic() + delay > deadline:
                raise SSHTimeout(
                    f"node {node.rank} ({node.user}@{node.host}:{node.port}) did not accept SSH "
                    f"in time (last error: {last or 'none'}).",
                    "Check that the node is running ('cloudtrain status') and that your address "
                    "may reach port 22 (resources.ssh_cidr).")
            if stop is not None:
                if stop.wait(delay):
                    raise SSHTimeout(f"stopped while connecting to node {node.rank}.", "")
            else:
                time.sleep(delay)
            delay = min(delay * 2, 1.0)


def _wait(proc: subprocess.Popen[bytes], deadline: float, stop: threading.Event | None) -> int | None:
    """The foreground ssh's exit code; killed (None) at the deadline or on ``stop``."""
    while True:
        try:
            return proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline or (stop is not None and stop.is_set()):
            proc.kill()
            proc.wait()
            return None




