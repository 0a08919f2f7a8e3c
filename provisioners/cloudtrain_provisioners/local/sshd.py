"""Start, probe and stop one private OpenSSH server per local node."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from cloudtrain.errors import ProviderError, UserError

MARKER = "CLOUDTRAIN_LOCAL_CLUSTER"
START_WAIT_S = 15.0   # how long a started sshd may take to write its pid file


def find_sshd() -> str:
    for cand in (shutil.which("sshd"), "/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise UserError(
        "The local provider needs OpenSSH's server (sshd), and none was found.",
        "Install it: 'apt-get install openssh-server' (Debian/Ubuntu) or 'brew install openssh'.",
    )


@lru_cache(maxsize=1)
def openssh_version() -> tuple[int, int]:
    try:
        out = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=5).stderr
    except (OSError, subprocess.SubprocessError):
        return (0, 0)
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def write_host_key(path: Path) -> str:
    """Generate an ed25519 host key; return its public line ("ssh-ed25519 AAAA...")."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if path.exists() and path.with_suffix(".pub").exists():
        return " ".join(path.with_suffix(".pub").read_text().split()[:2])
    key = Ed25519PrivateKey.generate()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                  serialization.NoEncryption()))
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                        serialization.PublicFormat.OpenSSH).decode()
    path.with_suffix(".pub").write_text(pub + "\n")
    return pub


def write_config(node_dir: Path, *, address: str, port: int, user: str, marker: str,
                 home: Path, env: dict[str, str] | None = None) -> Path:
    """The node's sshd_config. ``env``: more variables every session starts with (after the
    node's marker and HOME; values without spaces or double quotes)."""
    env = env or {}
    bad = [k for k, v in env.items() if any(c.isspace() or c in '"\\' for c in k + v)]
    if bad:
        raise ValueError(f"sshd SetEnv cannot carry spaces, quotes or backslashes: {bad}")
    extra = "".join(f" {k}={v}" for k, v in env.items())
    cfg = node_dir / "sshd_config"
    lines = [
        f"ListenAddress {address}:{port}" if ":" not in address else f"ListenAddress [{address}]:{port}",
        f"HostKey {node_dir / 'ssh_host_ed25519_key'}",
        f"PidFile {node_dir / 'sshd.pid'}",
        f"AuthorizedKeysFile {node_dir / 'authorized_keys'}",
        f"AllowUsers {user}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "PermitUserEnvironment no",
        "X11Forwarding no",
        "AllowTcpForwarding yes",
        "MaxStartups 256:30:512",
        "MaxSessions 128",
        "LoginGraceTime 30",
        "ClientAliveInterval 30",
        "Subsystem sftp internal-sftp",
        # Each node gets its own home (its own ~, no login dotfiles of this machine's user).
        f"SetEnv {MARKER}={marker} HOME={home}{extra}",
        # ...and starts there, as a login on a separate machine would (rsync's relative
        # paths, ~, and scripts' relative paths all land in the node's own directory).
        'ForceCommand cd "$HOME" || exit 1; if [ -n "$SSH_ORIGINAL_COMMAND" ]; then '
        'exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"; else exec "${SHELL:-/bin/sh}" -l; fi',
        "LogLevel ERROR",
    ]
    if openssh_version() >= (9, 8):
        lines.append("PerSourcePenalties no")
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def start(node_dir: Path, netns: str | None = None) -> None:
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    cmd = [find_sshd(), "-f", str(node_dir / "sshd_config"), "-E", str(node_dir / "sshd.log")]
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    # sshd's parent exits as soon as it has forked the daemon, which writes the pid file
    # after that: a node is not up (list_nodes would call it 'stopped') until it has.
    deadline = time.monotonic() + START_WAIT_S
    while proc.returncode == 0 and pid(node_dir) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.returncode != 0 or pid(node_dir) is None:
        log = (node_dir / "sshd.log")
        detail = (proc.stderr.strip() or (log.read_text().strip() if log.exists() else "")
                  or f"no running sshd wrote {node_dir / 'sshd.pid'} in {START_WAIT_S:.0f} s")
        raise ProviderError(f"sshd for local node {node_dir.name} did not start: {detail[-500:]}",
                            "Check that the address and port are free and that sshd is installed.")


def stop_node_command(marker: str, node_dir: Path) -> str:
    """A shell command, run on the node, that ends the node's sshd and every process of the
    cluster on that node (the cluster's marker and the node's HOME in its environment),
    itself last."""
    import shlex

    mark = shlex.quote(f"{MARKER}={marker}")
    home = shlex.quote(f"HOME={node_dir / 'root'}")
    pidfile = shlex.quote(str(node_dir / "sshd.pid"))
    # The listener's children are the open SSH sessions (a laptop's persistent connection
    # among them): a machine that powers off ends them too.
    return (f"p=$(cat {pidfile} 2>/dev/null) && {{ pkill -TERM -P \"$p\" 2>/dev/null; "
            "kill -TERM \"$p\" 2>/dev/null; }; "
            "mine() { for e in /proc/[0-9]*/environ; do q=${e#/proc/}; q=${q%/environ}; "
            f"[ \"$q\" = $$ ] && continue; grep -qzxF {mark} \"$e\" 2>/dev/null && "
            f"grep -qzxF {home} \"$e\" 2>/dev/null && echo \"$q\"; done; }}; "
            "for s in TERM KILL; do l=$(mine); [ -n \"$l\" ] && kill -$s $l 2>/dev/null; "
            "sleep 0.5; done; exit 0")


def pid(node_dir: Path) -> int | None:
    try:
        p = int((node_dir / "sshd.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(p, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return p
    # A recycled pid would not be our sshd: check its command line names our config.
    try:
        cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
    except OSError:
        return p
    return p if str(node_dir / "sshd_config").encode() in cmdline else None


def stop(node_dir: Path) -> None:
    """End the node's sshd and its open sessions (as a machine that powers off would), also
    when they are frozen (SIGSTOP, an unresponsive node): SIGCONT delivers the SIGTERM."""
    p = pid(node_dir)
    if p is None:
        return
    for q in [*children(p), p]:
        try:
            os.kill(q, signal.SIGTERM)
            os.kill(q, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass


def children(parent: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def sshd_under(folder: Path) -> list[int]:
    """sshd processes started with a config file under ``folder`` (found by command line:
    what is left of a node whose pid file was deleted). sshd rewrites its command line into
    one string ("sshd: /usr/sbin/sshd -f CONFIG ..."), so the config is found as a word."""
    import re

    word = re.compile(rb"(?:^|[\s\0])" + re.escape(str(folder).rstrip("/").encode() + b"/")
                      + rb"[^\s\0]*/sshd_config(?=[\s\0]|$)")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and word.search(cmdline):
            found.append(int(entry.name))
    return found


def marked_processes(marker: str, home: Path | None = None) -> list[int]:
    """Processes whose environment carries our marker: everything started through the nodes'
    sshd (shells, jobs, their children), however they daemonised; with ``home``, only those
    of the node whose HOME that is."""
    needle = f"{MARKER}={marker}".encode()
    at = None if home is None else f"HOME={home}".encode()
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        words = env.split(b"\0")
        if needle in words and (at is None or at in words):
            found.append(int(entry.name))
    return found


def kill_marked(marker: str, grace: float = 3.0, home: Path | None = None) -> list[int]:
    import time

    pids = marked_processes(marker, home)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return []
            time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _alive(p: int) -> bool:
    try:
        os.kill(p, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{p}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
