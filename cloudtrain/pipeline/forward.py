"""Ports through SSH: ``cloudtrain forward`` and ``cloudtrain tensorboard``.

A forward is the system OpenSSH client, ``ssh -N -L 127.0.0.1:LOCAL:127.0.0.1:PORT``, reading
only the cluster's own config file (``-F $CLOUDTRAIN_HOME/ssh/<cluster>.conf``: the cluster's
key, its pinned known_hosts, ``StrictHostKeyChecking yes``), so it works whether or not the
user's ``~/.ssh/config`` includes it. Both ends are bound to loopback and no firewall rule is
opened. A background forward is recorded under ``$CLOUDTRAIN_HOME/forwards/`` (pid, ports),
listed and stopped from there; ``down`` stops a cluster's forwards.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cloudtrain import sshconfig
from cloudtrain.cluster import Handle, cluster_uid, connect
from cloudtrain.context import Env
from cloudtrain.errors import RemoteError, UserError
from cloudtrain.names import check

Pair = tuple[int, int]   # (remote port on the node, local port on this machine)


def parse_port(spec: str, what: str) -> Pair:
    """``PORT`` or ``PORT:LOCAL`` (the node's port, then this machine's) as (remote, local)."""
    remote, _, local = spec.partition(":")
    try:
        pair = (int(remote), int(local or remote))
    except ValueError:
        pair = (0, 0)
    if not all(1 <= p <= 65535 for p in pair) or spec.count(":") > 1:
        raise UserError(f"{what} '{spec}' is not PORT or PORT:LOCAL (ports 1-65535).",
                        "e.g. 6006 (the node's port 6006 on local port 6006) or 8888:18888. "
                        "Nothing was started.")
    return pair


def check_free(pairs: list[Pair]) -> None:
    """Every local port must be free on 127.0.0.1 (UserError, exit 2, naming the port)."""
    locals_ = [local for _, local in pairs]
    dup = {p for p in locals_ if locals_.count(p) > 1}
    if dup:
        raise UserError(f"Local port {min(dup)} is given twice.", "Give each forward its own "
                        "local port (PORT:LOCAL). Nothing was started.")
    for remote, local in pairs:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # as ssh binds its listener: a port only in TIME_WAIT (a forward just stopped) is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", local))
            except OSError as exc:
                raise UserError(f"Local port {local} on 127.0.0.1 is in use ({exc.strerror}).",
                                f"Pick another local port: PORT:LOCAL, e.g. {remote}:{local + 1}"
                                " (see 'cloudtrain forward --list'). Nothing was started.") from None


def ssh_args(home: Path, handle: Handle, rank: int, pairs: list[Pair]) -> list[str]:
    conf = sshconfig.write_cluster(home, handle)   # also for clusters older than the file
    args = ["ssh", "-F", str(conf), "-N", "-o", "ExitOnForwardFailure=yes",
            "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
    for remote, local in pairs:
        args += ["-L", f"127.0.0.1:{local}:127.0.0.1:{remote}"]
    return args + [f"{handle.name}-{rank}"]


def ssh_exe() -> str:
    import shutil

    exe = shutil.which("ssh")
    if exe is None:
        raise UserError("The 'ssh' client is not installed.", "Install OpenSSH's client.")
    return exe


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def foreground(env: Env, handle: Handle, rank: int, pairs: list[Pair],
               release: Callable[[], None] = lambda: None) -> None:
    """Forward until Ctrl-C (SIGTERM and SIGHUP alike). ``release`` is called at the end (the
    command's keep-alive: the cluster's idle stop waits while a forward lasts). A forward
    that ends by itself (the node went away, ssh refused it) is a RemoteError."""
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt

    try:
        check_free(pairs)
        stop_signals_as_interrupt()
        proc = subprocess.Popen(ssh_args(env.home, handle, rank, pairs), executable=ssh_exe())
        try:
            if wait_listening(proc, pairs):
                for remote, local in pairs:
                    env.ui.ok(f"http://127.0.0.1:{local}/ -> node {rank} port {remote} "
                              "(Ctrl-C stops)")
            code = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            return
    finally:
        release()
    raise RemoteError(f"The forward to '{handle.name}' node {rank} ended (ssh exited with "
                      f"{code}).", f"Check the node: cloudtrain status {handle.name}")


def wait_listening(proc: subprocess.Popen[bytes], pairs: list[Pair], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if all(listening(local) for _, local in pairs):
            return True
        time.sleep(0.1)
    return False


# --- background forwards ------------------------------------------------------------------------

def forwards_dir(home: Path) -> Path:
    d = home / "forwards"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class Forward:
    """One background forward, as recorded in ``$CLOUDTRAIN_HOME/forwards/<...>.json``:
    the cluster and node, the ssh's pid, when it started, its (node port, local port) pairs,
    the cluster file its command line names, its log, and the record's own path."""

    cluster: str
    node: int
    pid: int
    started_at: float
    ports: tuple[Pair, ...]
    conf: str
    log: str
    record: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"cluster": self.cluster, "node": self.node, "pid": self.pid,
                "started_at": self.started_at,
                "ports": [{"remote": r, "local": loc} for r, loc in self.ports],
                "conf": self.conf, "log": self.log}

    @classmethod
    def read(cls, path: Path) -> Forward | None:
        """The record at ``path``; None when it cannot be read as one."""
        try:
            raw = json.loads(path.read_text())
            return cls(str(raw["cluster"]), int(raw["node"]), int(raw["pid"]),
                       float(raw["started_at"]),
                       tuple((int(p["remote"]), int(p["local"])) for p in raw["ports"]),
                       str(raw["conf"]), str(raw["log"]), str(path))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def background(env: Env, handle: Handle, rank: int, pairs: list[Pair]) -> Forward:
    """Start the forward detached (its own session, no ControlMaster); record and return it."""
    check_free(pairs)
    args = ssh_args(env.home, handle, rank, pairs)
    d = forwards_dir(env.home)
    log = d / f"{handle.name}-{os.getpid()}-{time.time_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, executable=ssh_exe(), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, start_new_session=True)
    if not wait_listening(proc, pairs):
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
        tail = log.read_text(errors="replace").strip()
        log.unlink(missing_ok=True)
        raise RemoteError(f"The forward to '{handle.name}' node {rank} did not start"
                          + (f": {tail}" if tail else "."),
                          f"Check the node: cloudtrain ssh {handle.name} --node {rank}")
    record = log.with_suffix(".json")
    rec = Forward(handle.name, rank, proc.pid, time.time(), tuple(pairs), args[2], str(log),
                  str(record))
    sshconfig.write_private(record, json.dumps(rec.as_dict()))
    return rec


def alive(rec: Forward) -> bool:
    """The recorded ssh still runs (and is ours: its command line names the cluster's file)."""
    try:
        cmd = Path(f"/proc/{rec.pid}/cmdline").read_bytes()
    except OSError:
        try:
            os.kill(rec.pid, 0)
            return True
        except OSError:
            return False
    return rec.conf.encode() in cmd


def listed(home: Path, name: str | None = None) -> list[Forward]:
    """The background forwards (of ``name``), oldest first; records of dead ones are
    removed (one that cannot be read is left alone)."""
    out = []
    for path in sorted(forwards_dir(home).glob("*.json")):
        rec = Forward.read(path)
        if rec is None:
            continue
        if not alive(rec):
            forget(path)
            continue
        if name is None or rec.cluster == name:
            out.append(rec)
    return sorted(out, key=lambda r: r.started_at)


def forget(record: Path) -> None:
    record.unlink(missing_ok=True)
    record.with_suffix(".log").unlink(missing_ok=True)


def stop(home: Path, name: str | None) -> int:
    """Stop the background forwards of cluster ``name`` (every one with None); how many."""
    recs = listed(home, name)
    for rec in recs:
        try:
            os.kill(rec.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        forget(Path(rec.record))
    return len(recs)


def forget_cluster(home: Path, name: str) -> None:
    """At ``down`` (and rollback): stop the cluster's forwards and remove its config file."""
    stop(home, check(name))
    sshconfig.remove_cluster(home, name)


# --- TensorBoard on the head --------------------------------------------------------------------

TB_SCRIPT = r"""
root=$1; bin=$2; logdir=$3; port=$4; d="$root/tensorboard"; py=$bin/python
[ -x "$py" ] || py=$bin/python3
mkdir -p "$d" || exit 90
if [ -f "$d/pid" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; then
    echo "::running $(cat "$d/port")"; exit 0
fi
[ -n "$bin" ] && [ -x "$py" ] || { echo ::nopython; exit 0; }
"$py" -c 'import tensorboard' 2>/dev/null || { echo ::missing; exit 0; }
cd "$root/workdir" 2>/dev/null || cd "$root" || exit 91
port=$("$py" -c "
import socket
for p in ($port, 0):
    try:
        s = socket.socket(); s.bind(('127.0.0.1', p)); print(s.getsockname()[1]); break
    except OSError:
        pass")
mkdir -p "$logdir" 2>/dev/null
nohup "$py" -m tensorboard.main --logdir "$logdir" --host 127.0.0.1 --port "$port" \
    > "$d/log" 2>&1 < /dev/null &
echo $! > "$d/pid"; echo "$port" > "$d/port"
for _ in $(seq 1 240); do
    "$py" -c "import socket,sys; socket.create_connection(('127.0.0.1', $port), 1)" \
        2>/dev/null && { echo "::started $port"; exit 0; }
    kill -0 "$(cat "$d/pid")" 2>/dev/null || { rm -f "$d/pid"; echo ::failed; tail -n 15 "$d/log"; exit 0; }
    sleep 0.5
done
echo ::failed; tail -n 15 "$d/log"
"""


def tensorboard(env: Env, handle: Handle, logdir: str, port: int = 6006) -> int:
    """Start TensorBoard on the head (from the node's Python, bound to its 127.0.0.1, on
    ``port`` or a free one when that is taken) unless it runs there already; returns the
    node's port it listens on."""
    head = handle.head
    group = connect(env, handle, timeout=30)
    try:
        args = [head.root_dir, head.python_bin or "", logdir, str(port)]
        command = (f"CLOUDTRAIN_CLUSTER_ID={cluster_uid(env, handle.name)} bash -c "
                   f"{shlex.quote(TB_SCRIPT)} _ " + " ".join(shlex.quote(a) for a in args))
        res = group.run(command, ranks=[head.rank], timeout=150)[head.rank]
    finally:
        group.close()
    out = res.stdout.strip().splitlines()
    word = out[0].split() if out else [""]
    if res.error is not None or not out:
        raise RemoteError(f"Could not start TensorBoard on '{handle.name}': "
                          f"{res.error or res.stderr.strip() or 'no answer'}.",
                          f"Check the head: cloudtrain ssh {handle.name}")
    if word[0] in ("::running", "::started"):
        return int(word[1])
    if word[0] == "::nopython":
        raise UserError(f"'{handle.name}' node {head.rank} has no Python recorded (it was not "
                        "bootstrapped): TensorBoard runs from the node's environment.",
                        "Bootstrap it ('cloudtrain up TASK_FILE' without --no-bootstrap), with "
                        "tensorboard in the task's setup or requirements.")
    if word[0] == "::missing":
        where = head.python_bin
        raise UserError(f"TensorBoard is not installed in the Python of '{handle.name}' node "
                        f"{head.rank} ({where}).",
                        "Add it to the task's setup ('pip install tensorboard') or to your "
                        f"requirements, then launch again (or 'cloudtrain exec {handle.name} "
                        "-- pip install tensorboard').")
    raise RemoteError(f"TensorBoard did not start on '{handle.name}': " + " | ".join(out[1:]),
                      f"Its log on the node: {head.root_dir}/tensorboard/log")
