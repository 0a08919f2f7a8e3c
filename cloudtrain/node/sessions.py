"""What the node guard (guard.py, beside this file on the node) counts as a user's activity:
the SSH sessions of the node's user, read from /proc (Python standard library only, shipped
with the guard by bootstrap/ctguard.sh)."""

from __future__ import annotations

import os
import re
from typing import NamedTuple


def proc_env(pid: str) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def proc_pids() -> list[str]:
    try:
        return [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


# --- the user's SSH sessions -------------------------------------------------------------------
# A session is one SSH connection of the node's user, seen as its sshd process ("sshd: USER",
# "sshd: USER@notty", "sshd: USER@pts/3"; "sshd-session: ..." from OpenSSH 9.8). It counts when
# it runs something that is not cloudtrain's (a shell, VS Code's server, sftp, scp), or runs
# nothing at all and is not one of cloudtrain's connections (a port forward, internal-sftp).
# cloudtrain marks its own commands: each starts with ``CONTROL_PREFIX`` (cloudtrain/connection.py
# sends it), which exports CLOUDTRAIN_CONTROL and records the connection it came over in
# ``$HOME/.cloudtrain/control/<pid of its sshd>``, so an idle persistent master is known too.

CONTROL_ENV = "CLOUDTRAIN_CONTROL"
_TITLE = re.compile(rb"^sshd(?:-session)?: ([^\s@\[\]]+)(?:@(\S+))?$")


class Sessions(NamedTuple):
    """The SSH connections of the node's user that count as activity."""
    tty: int = 0         # with a terminal (ssh, cloudtrain ssh)
    notty: int = 0       # without one (ssh -T, VS Code, sftp/scp, port forwards)


def control_dir() -> str:
    return os.path.join(os.environ.get("HOME", "/"), ".cloudtrain", "control")


def _proc_stat(pid: str) -> tuple[int, int, int] | None:
    """(parent pid, tty_nr, start time in clock ticks since boot)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[1]), int(rest[4]), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: str | int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _boot_epoch() -> float:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0.0


def _own_sshd_config() -> bytes | None:
    """A node with an sshd of its own (the local provider: ``<node>/sshd_config`` next to its
    home) counts only that sshd's sessions; None: every sshd of this machine is the node's."""
    home = os.environ.get("HOME", "").rstrip("/")
    cfg = os.path.join(os.path.dirname(home), "sshd_config") if home else ""
    return cfg.encode() if cfg and os.path.isfile(cfg) else None


def _ours(pid: int, procs: dict[int, tuple[int, int, int]], config: bytes | None) -> bool:
    """Does session ``pid`` descend from this node's sshd?"""
    if config is None:
        return True
    seen = 0
    while pid > 1 and seen < 64:
        words = _cmdline(pid).replace(b"\0", b" ").split()
        if config in words:
            return True
        pid, seen = procs.get(pid, (0, 0, 0))[0], seen + 1
    return False


def _is_control(pid: int) -> bool:
    """A command cloudtrain itself sent (its command line or environment carries the mark)."""
    mark = f"{CONTROL_ENV}=".encode()
    return mark in _cmdline(pid) or any(e.startswith(mark) for e in proc_env(str(pid)))


def _controls(live: dict[int, float]) -> set[int]:
    """The sessions recorded as cloudtrain's connections (``live``: pid -> start epoch);
    records of ended ones (or of a reused pid: older than the process) are removed."""
    d, found = control_dir(), set[int]()
    try:
        names = os.listdir(d)
    except OSError:
        return found
    for name in names:
        path = os.path.join(d, name)
        pid = int(name) if name.isdigit() else -1
        try:
            if pid in live and os.stat(path).st_mtime >= live[pid] - 2:
                found.add(pid)
            else:
                os.unlink(path)
        except OSError:
            pass
    return found


def ssh_sessions() -> Sessions:
    """The SSH connections of this node's user that count as activity (see above)."""
    import pwd

    try:
        user = pwd.getpwuid(os.getuid()).pw_name.encode()
    except KeyError:
        return Sessions()
    stats = {int(p): _proc_stat(p) for p in proc_pids()}
    procs = {p: st for p, st in stats.items() if st is not None}
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    config, boot, tick = _own_sshd_config(), _boot_epoch(), os.sysconf("SC_CLK_TCK") or 100
    sessions: dict[int, int] = {}        # pid -> start time (clock ticks since boot)
    for pid in procs:
        m = _TITLE.match(_cmdline(pid).rstrip(b"\0"))
        if m and m.group(1) == user and _ours(pid, procs, config):
            sessions[pid] = procs[pid][2]
    controls = _controls({p: boot + t / tick for p, t in sessions.items()})
    tty = notty = 0
    for pid in sessions:
        if any(k in sessions for k in kids.get(pid, [])):
            continue                   # a privilege-separation monitor: its child is counted
        theirs = [k for k in kids.get(pid, []) if not _is_control(k)]
        if not theirs and (pid in controls or kids.get(pid)):
            continue                   # cloudtrain's connection, or only cloudtrain's commands
        if any(procs[k][1] != 0 for k in theirs) or b"@pts/" in _cmdline(pid):
            tty += 1
        else:
            notty += 1
    return Sessions(tty, notty)
