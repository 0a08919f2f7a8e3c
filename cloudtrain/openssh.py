"""A node's connection over OpenSSH's multiplexing (:mod:`cloudtrain.sshmux`): each command is
an ``ssh`` client that asks the node's master for a session (one round trip, no handshake),
its stdin fed, its stdout and stderr streamed. What a command sees is what the paramiko
:class:`~cloudtrain.connection.Connection` gives: the exit code, output as it comes, a node
silent past the node timeout (no output, no answer to a probe) raised as ``ChannelLost``.

:func:`connect` is the one door: a master where multiplexing is on (``ssh`` installed,
``CLOUDTRAIN_SSH_PERSIST`` not 0, a private socket folder), paramiko otherwise.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from cloudtrain import sshmux
from cloudtrain.connection import PLAIN, ChannelLost, Exchange, Transport, Watch, controlled
from cloudtrain.connection import connect as connect_paramiko
from cloudtrain.keys import ClusterKeys

if TYPE_CHECKING:
    from cloudtrain.schema import NodeRow

SSH_FAILED = 255


class MuxConnection(Transport):
    """Commands to one node over its master on ``path``."""

    def __init__(self, node: NodeRow, keys: ClusterKeys, path: Path) -> None:
        self.node, self.keys, self.path = node, keys, path
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self._broken = False

    @property
    def active(self) -> bool:
        return not self._broken and sshmux.listening(self.path)

    def _spawn(self, command: str, stderr: int) -> subprocess.Popen[bytes]:
        # Its own session: the terminal's Ctrl-C reaches this process only, which stops the
        # command on every node the way it chooses (SIGTERM, stop_grace), not ssh.
        proc = subprocess.Popen(sshmux.client_argv(self.keys, self.node, self.path,
                                                    controlled(command)),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                start_new_session=True)
        with self._lock:
            self._procs.add(proc)
        return proc

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        with self._lock:
            self._procs.discard(proc)

    def probe(self, timeout: float) -> bool:
        """Does the node's sshd still answer? (a session over the master, ``true``)"""
        if not sshmux.listening(self.path):
            return False
        proc = self._spawn("true", subprocess.DEVNULL)
        try:
            return proc.wait(timeout=max(0.5, timeout)) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            self._reap(proc)

    def exchange(self, command: str, *, on_data: Callable[[bytes], None],
                 on_err: Callable[[bytes], None],
                 how: Exchange = PLAIN) -> tuple[int | None, str]:
        """As :meth:`cloudtrain.connection.Connection.exchange`. ``how.combine``: the node
        merges stderr into stdout (``exec 2>&1`` before the command), so ssh's own messages
        stay apart and tell a lost connection from the command's exit code 255."""
        if not sshmux.listening(self.path):
            self._broken = True
            raise ChannelLost("the SSH connection was closed", 0.0)
        combine, limit = how.combine, how.limit
        proc = self._spawn(("exec 2>&1; " + command) if combine else command, subprocess.PIPE)
        ssh_err = bytearray()
        try:
            writer = _feed(proc, how.stdin, how.hold_stdin)
            sel = selectors.DefaultSelector()
            assert proc.stdout is not None and proc.stderr is not None
            for f in (proc.stdout, proc.stderr):
                os.set_blocking(f.fileno(), False)
                sel.register(f, selectors.EVENT_READ)
            watch = Watch(how.timeout, how.stop, limit, self.probe)
            while sel.get_map():
                why = watch.cut_short()
                if why:
                    return None, why
                got = False
                for key, _ in sel.select(0.2):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    got = True
                    if key.fileobj is proc.stdout:
                        on_data(chunk)
                    else:
                        ssh_err += chunk          # with combine, only ssh itself writes here
                        if not combine:
                            on_err(chunk)
                try:
                    watch.heard(got)
                except ChannelLost:
                    self._broken = True
                    raise
            sel.close()
            try:
                code = proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                self._broken = True
                raise ChannelLost("its session did not end", limit) from None
            if writer is not None:
                writer.join(timeout=1)
            if code == SSH_FAILED and not sshmux.listening(self.path):
                self._broken = True   # the master went away: the connection, not the command
                raise ChannelLost(_said(ssh_err) or "the SSH connection was closed",
                                  watch.silent())
            if code < 0:
                raise ChannelLost(f"ssh ended by signal {-code}", watch.silent())
            return code, ""
        finally:
            self._reap(proc)

    def close(self) -> None:
        """Ends this command's sessions; the master stays for the next command (it ends
        by itself when idle). A master that stopped answering is ended now."""
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except OSError:
                pass
        if self._broken:
            sshmux.end_master(self.path)


def _said(err: bytes | bytearray) -> str:
    lines = [ln.strip() for ln in bytes(err).decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _feed(proc: subprocess.Popen[bytes], data: bytes | None,
          hold: bool) -> threading.Thread | None:
    """Write ``data`` to the command's stdin (in a thread: a node that does not read must not
    block the reader), then close it unless ``hold``: a held stdin reaches EOF on the node
    when this session ends."""
    assert proc.stdin is not None
    stdin = proc.stdin
    if not data:
        if not hold:
            stdin.close()
        return None

    def write() -> None:
        try:
            stdin.write(data)
            stdin.flush()
            if not hold:
                stdin.close()
        except (OSError, ValueError):
            pass

    t = threading.Thread(target=write, daemon=True, name="ct-ssh-stdin")
    t.start()
    return t


def connect(node: NodeRow, keys: ClusterKeys, *, deadline: float, learn: bool = False,
            stop: threading.Event | None = None) -> Transport:
    """A connection to ``node``: over its master (opened now unless one answers already),
    or with paramiko where multiplexing is off."""
    d = sshmux.mux_dir() if sshmux.enabled() else None
    if d is None:
        return connect_paramiko(node, keys, deadline=deadline, learn=learn, stop=stop)
    path = sshmux.socket_path(d, keys, node)
    if not sshmux.listening(path):
        sshmux.start_master(keys, node, path, deadline=deadline, learn=learn, stop=stop)
    return MuxConnection(node, keys, path)
