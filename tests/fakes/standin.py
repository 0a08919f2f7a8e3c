"""Stand-in nodes: local sshd servers that play a fake cloud's instances, reached the way a
user reaches nodes in a private subnet (through ``resources.ssh_proxy``), with nothing in the
product that knows it is being tested.

- **Reaching them**: the task's ``resources.ssh_proxy`` is :func:`proxy_command`, a
  ProxyCommand (tests/fakes/standin_proxy.py) that looks the address the fake invented up in
  the test's own map file (:class:`ProxyMap`) and relays to the stand-in's sshd on loopback;
  it refuses any address the map does not give.
- **Their folder**: each stand-in's sshd gives its sessions ``HOME=<node>/root`` and starts
  them there (the local provider's sshd config), so the product's relative root_dir
  ``cloudtrain`` lands in the node's own folder.
- **Their environment** (:func:`prepare`, the sshd's SetEnv): ``PATH`` starts with
  ``<node>/bin``, which holds ``python3`` (the test's Python) and emulations of ``sudo``,
  ``shutdown``, ``poweroff``, ``halt``, ``reboot``, ``systemctl``, ``init`` and ``telinit``;
  ``CLOUDTRAIN_PYTHON`` (bootstrap uses the test's environment); plus what a test adds (e.g.
  Azure's managed-identity endpoint variables).
- **Their login user**: this machine's user, except where the cloud refuses it as a login
  (Azure refuses ``root``): then ``azureuser``, an alias of this machine's user that exists
  only in the stand-in's own view of ``/etc/passwd`` (its sshd runs in a mount namespace of
  its own with a copy that adds the line; :func:`login_user`, :func:`start`).
- **Their guest shutdown**: the product runs its real command (``sudo -n shutdown -P now ||
  ...``); the emulations run tests/fakes/guest_shutdown.py, which tells the fake cloud about
  the instance the test bound to the node (:func:`bind`) and stops the node. SAFETY (the test
  machine may be root): :func:`check_shadowed` refuses to start a stand-in whose PATH would
  find any real power command before the emulation, and the emulations never call one.
"""

from __future__ import annotations

import getpass
import json
import os
import pwd
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

FAKES = Path(__file__).resolve().parent
PROXY = FAKES / "standin_proxy.py"
GUEST = FAKES / "guest_shutdown.py"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
POWER = ("shutdown", "poweroff", "halt", "reboot", "systemctl", "init", "telinit")
"""Every command that could power the machine off: each is shadowed on a stand-in's PATH."""


def proxy_command(mapfile: Path, wait: float = 60.0) -> str:
    """The ``resources.ssh_proxy`` of a task whose nodes are stand-ins mapped in ``mapfile``."""
    return " ".join(shlex.quote(str(a)) for a in (sys.executable, PROXY, mapfile)) + \
        f" %h %p {wait:g}"


def use_proxy(task: Path, mapfile: Path, cloud: str, user: str, *,
              master_port: int | None = None, wait: float = 60.0) -> Path:
    """Rewrite the task file so that its SSH reaches the stand-ins mapped in ``mapfile``, as
    ``user`` (``resources.ssh_proxy`` and ``resources.<cloud>.ssh_user``), and, when it
    trains, torch's rendezvous uses ``master_port`` (``train.master_port``: a port free on
    the head stand-in's address)."""
    import yaml

    data = yaml.safe_load(task.read_text())
    res = data.setdefault("resources", {})
    res["ssh_proxy"] = proxy_command(mapfile, wait)
    res[cloud] = {**(res.get(cloud) or {}), "ssh_user": user}
    if master_port and isinstance(data.get("train"), dict):
        data["train"].setdefault("master_port", master_port)
    task.write_text(yaml.safe_dump(data, sort_keys=False))
    return task


class ProxyMap:
    """The test's map file: invented address -> stand-in (host, port) on loopback."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def add(self, entries: dict[str, tuple[str, int]]) -> None:
        data = self.read()
        data.update({a: {"host": h, "port": p} for a, (h, p) in entries.items()})
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)

    @property
    def relayed(self) -> list[tuple[str, str]]:
        """(asked ``HOST:PORT``, connected ``ADDR:PORT``) of every relay so far."""
        log = Path(str(self.path) + ".log")
        lines = log.read_text().splitlines() if log.exists() else []
        return [(asked, to) for asked, _, to in (line.partition(" -> ") for line in lines)]

    def only_loopback(self) -> bool:
        import ipaddress

        return all(ipaddress.ip_address(to.rsplit(":", 1)[0]).is_loopback
                   for _, to in self.relayed)


def node_path(node_dir: Path) -> str:
    return f"{node_dir / 'bin'}:{SYSTEM_PATH}"


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def write_emulations(node_dir: Path) -> None:
    """``<node>/bin``: python3, sudo and every power command, as on an instance of the fake."""
    b = node_dir / "bin"
    b.mkdir(parents=True, exist_ok=True)
    node = shlex.quote(str(node_dir))
    off = f"exec {shlex.quote(sys.executable)} {shlex.quote(str(GUEST))} --node {node}\n"
    refuse = 'echo "stand-in node: \'$0 $*\' is not emulated" >&2; exit 1\n'
    _script(b / "python3", f'exec {shlex.quote(sys.executable)} "$@"\n')
    for name in ("shutdown", "poweroff", "halt"):
        _script(b / name, "# the guest powers off: the fake cloud reacts\n" + off)
    _script(b / "reboot", refuse)
    _script(b / "systemctl", 'case " $* " in *" poweroff "*|*" halt "*) ;; *) ' + refuse.rstrip()
            + " ;; esac\n" + off)
    for name in ("init", "telinit"):
        _script(b / name, 'case "$1" in 0) ;; *) ' + refuse.rstrip() + " ;; esac\n" + off)
    # sudo: drop its options and run the command as this user, PATH kept (so that the power
    # commands are the emulations above); the serial console is a file of the node's
    _script(b / "sudo", (
        "while [ $# -gt 0 ]; do case $1 in -n|-E|-H|-S) shift ;; --) shift; break ;; "
        "-*) echo \"stand-in sudo: option $1 not emulated\" >&2; exit 1 ;; *) break ;; "
        "esac; done\n"
        'if [ "$1" = tee ]; then case "$2" in /dev/ttyS0|/dev/console) '
        f"exec tee -a {shlex.quote(str(node_dir / 'console.log'))} ;; esac; fi\n"
        'exec "$@"\n'))


def check_shadowed(node_dir: Path) -> None:
    """Refuse (RuntimeError) when the node's PATH would find a real power command (or sudo)."""
    for name in (*POWER, "sudo"):
        found = subprocess.run(["/bin/sh", "-c", f"command -v {name}"], capture_output=True,
                               text=True, env={"PATH": node_path(node_dir)}).stdout.strip()
        if found != str(node_dir / "bin" / name):
            raise RuntimeError(f"stand-in {node_dir}: '{name}' on its PATH is {found or 'none'},"
                               " not the emulation: refusing to start it")


def login_user(cloud: str) -> str:
    """The user a task of ``cloud`` logs in to the stand-ins as (its ``ssh_user``)."""
    me = getpass.getuser()
    return "azureuser" if cloud == "azure" and me in ("root", "admin", "administrator") else me


def _exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def prepare(node_dir: Path, *, address: str, port: int, user: str, marker: str,
            env: dict[str, str] | None = None) -> None:
    """The stand-in's sshd config (HOME ``<node>/root``, the PATH and variables above) and
    its emulations; checked with :func:`check_shadowed`. A ``user`` this machine does not
    have is an alias of this machine's user in the stand-in's own passwd file."""
    write_emulations(node_dir)
    (node_dir / "root").mkdir(parents=True, exist_ok=True)
    if not _exists(user):
        line = f"{user}:x:{os.getuid()}:{os.getgid()}:stand-in login:{node_dir / 'root'}:/bin/sh"
        (node_dir / "passwd").write_text(Path("/etc/passwd").read_text().rstrip("\n") + "\n"
                                         + line + "\n")
    settings = {"address": address, "port": port, "user": user, "marker": marker,
                "env": env or {}}
    (node_dir / "standin.json").write_text(json.dumps(settings))
    _write_config(node_dir)
    check_shadowed(node_dir)


def _write_config(node_dir: Path) -> None:
    from cloudtrain_provisioners.local import sshd

    st = json.loads((node_dir / "standin.json").read_text())
    sshd.write_config(node_dir, address=st["address"], port=st["port"], user=st["user"],
                      marker=st["marker"], home=node_dir / "root",
                      env={"PATH": node_path(node_dir), "CLOUDTRAIN_PYTHON": sys.executable,
                           **st["env"]})


def set_env(node_dir: Path, env: dict[str, str]) -> None:
    """More variables for the node's new sessions (e.g. what its cloud's metadata service
    tells it once its instance exists): its sshd rereads its config (SIGHUP)."""
    from cloudtrain_provisioners.local import sshd

    st = json.loads((node_dir / "standin.json").read_text())
    st["env"] = {**st["env"], **env}
    (node_dir / "standin.json").write_text(json.dumps(st))
    _write_config(node_dir)
    pid = sshd.pid(node_dir)
    if pid is not None:
        os.kill(pid, signal.SIGHUP)


def start(node_dir: Path) -> None:
    """Start the stand-in's sshd, once its power commands are checked to be emulations; with
    its own passwd file (a login alias), in a mount namespace that shows it as /etc/passwd."""
    from cloudtrain.errors import ProviderError
    from cloudtrain_provisioners.local import sshd

    check_shadowed(node_dir)
    alias = node_dir / "passwd"
    if not alias.exists():
        sshd.start(node_dir)
        return
    script = 'mount --bind "$1" /etc/passwd && exec "$2" -f "$3" -E "$4"'
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, "standin", str(alias),
                           sshd.find_sshd(), str(node_dir / "sshd_config"),
                           str(node_dir / "sshd.log")],
                          capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise ProviderError(f"stand-in {node_dir.name}: sshd did not start with its own "
                            f"passwd: {proc.stderr.strip()[-500:]}")


def bind(node_dir: Path, *argv: str) -> None:
    """The instance the node stands in for: ``argv`` for guest_shutdown.py (e.g. ``aws
    --endpoint URL --region R --instance ID``), what its power-off tells the fake cloud."""
    tmp = node_dir / "cloud.json.tmp"
    tmp.write_text(json.dumps({"argv": list(argv)}))
    tmp.replace(node_dir / "cloud.json")
    try:
        (node_dir / "powered-off").unlink()
    except FileNotFoundError:
        pass


def environ_of(node_dir: Path) -> dict[str, str]:
    """The variables the node's sshd gives its sessions (for tests that check them)."""
    for line in (node_dir / "sshd_config").read_text().splitlines():
        if line.startswith("SetEnv "):
            return dict(kv.split("=", 1) for kv in line.split()[1:])
    return {}


__all__ = ["GUEST", "POWER", "PROXY", "ProxyMap", "bind", "check_shadowed", "environ_of",
           "login_user", "node_path", "prepare", "proxy_command", "set_env", "start",
           "use_proxy",
           "write_emulations"]
