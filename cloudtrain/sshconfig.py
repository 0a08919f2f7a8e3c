"""The SSH config integration: one OpenSSH config file per cluster under
``$CLOUDTRAIN_HOME/ssh/<cluster>.conf`` (a ``Host`` entry per node: ``<cluster>`` is the head,
``<cluster>-<rank>`` every rank), and the one ``Include`` line in ``~/.ssh/config`` that makes
plain ``ssh``, ``scp``, ``rsync`` and VS Code Remote-SSH read them.

Each entry names the cluster's key and its pinned known_hosts file with
``StrictHostKeyChecking yes``: a node presenting another host key is refused, as in cloudtrain.
The Include line is added only with the user's consent (a flag, a question on an interactive
``up``, or ``cloudtrain ssh-config install``), at the top of the file (an Include inside a
``Host`` block would apply to that block only), and removed byte for byte by ``uninstall``.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from cloudtrain import sshproxy
from cloudtrain.errors import CloudtrainError, UserError
from cloudtrain.names import check, inside

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle

MARK = "# cloudtrain: 'cloudtrain ssh-config uninstall' removes this line and the next one"
# Values written into a config file: no whitespace the parser would split on, no quotes.
SAFE_VALUE = re.compile(r"\A[A-Za-z0-9._:@\[\]-]+\Z")


def conf_dir(home: Path) -> Path:
    d = home / "ssh"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def conf_path(home: Path, name: str) -> Path:
    return inside(conf_dir(home), f"{check(name)}.conf")


def written_here(home: Path) -> bool:
    """Whether this process wrote a cluster's file that still exists (a rolled-back cluster's
    is gone); forgets what it remembered, and creates nothing (bad input creates nothing)."""
    names, d = set(WRITTEN), home / "ssh"
    WRITTEN.clear()
    return any((d / f"{n}.conf").is_file() for n in names)


def quoted_path(path: Path | str, what: str) -> str:
    """A file path as an ssh_config argument: quoted when it has spaces, '%' escaped (tokens)."""
    text = str(path)
    if any(c in text for c in "\"\n\r\t") or not text.startswith("/"):
        raise UserError(f"{what} {text!r} cannot be written into an OpenSSH config file "
                        "(it has a quote or a control character, or is not absolute).",
                        "Set CLOUDTRAIN_HOME to a plain absolute folder.")
    text = text.replace("%", "%%")
    return f'"{text}"' if " " in text else text


def safe_value(value: object, what: str) -> str:
    text = str(value)
    if not SAFE_VALUE.fullmatch(text):
        raise UserError(f"The node's {what} {text!r} cannot be written into an OpenSSH config "
                        "file (whitespace, quotes or pattern characters).",
                        "Check the cluster's nodes with 'cloudtrain status'.")
    return text


def proxy_lines(proxy: str | None) -> list[str]:
    """The ``ProxyCommand`` line of a cluster with ``resources.ssh_proxy`` (none without):
    ``ssh NAME`` and VS Code go through the same jump host as cloudtrain; a jump host is
    reached as the user's own ``ssh HOP`` reaches it (their config, agent and keys), and may
    prompt (no BatchMode: a person is at the terminal)."""
    if not proxy:
        return []
    return [f"    ProxyCommand {sshproxy.proxy_command(proxy, batch=False)}"]


def render(handle: Handle) -> str:
    """The cluster's config file: one Host entry for the head (the cluster's name) and one per
    rank (``<cluster>-<rank>``)."""
    name = check(handle.name)
    lines = [f"# cloudtrain cluster '{name}': written by cloudtrain, removed at 'cloudtrain down'.",
             "# Do not edit: it is rewritten whenever the cluster's nodes change.", ""]
    for n in handle.nodes:
        aliases = [f"{name}-{n.rank}"] + ([name] if n.rank == handle.head.rank else [])
        lines += [f"Host {' '.join(aliases)}",
                  f"    HostName {safe_value(n.host, 'address')}",
                  f"    Port {int(n.port)}",
                  f"    User {safe_value(n.user, 'user')}",
                  f"    IdentityFile {quoted_path(n.identity_file or handle.keys.private_key, 'key')}",
                  "    IdentitiesOnly yes",
                  f"    UserKnownHostsFile {quoted_path(handle.keys.known_hosts, 'known_hosts')}",
                  "    GlobalKnownHostsFile /dev/null",
                  "    StrictHostKeyChecking yes",
                  "    ServerAliveInterval 15",
                  *proxy_lines(handle.keys.proxy),
                  ""]
    return "\n".join(lines)


def write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``text`` atomically; the new file has ``mode`` from the start.
    (Bytes the user's file had that are not UTF-8 are written back as they were.)"""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8", "surrogateescape"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


WRITTEN: set[str] = set()
"""Clusters whose file this process wrote (``up``/``launch`` offer the Include line after)."""


def write_cluster(home: Path, handle: Handle) -> Path:
    """Write (or rewrite, when its nodes changed) the cluster's config file, mode 600."""
    path = conf_path(home, handle.name)
    text = render(handle)
    if not path.exists() or path.read_text() != text:
        write_private(path, text)
    WRITTEN.add(handle.name)
    return path


def refresh(home: Path, handle: Handle, warn: Callable[[str], None]) -> None:
    """:func:`write_cluster` when a cluster comes up or its nodes change; a node that cannot
    be written is a warning (the cluster itself is fine; 'cloudtrain ssh' still works)."""
    try:
        write_cluster(home, handle)
    except CloudtrainError as exc:
        warn(f"no SSH config entry for '{handle.name}': {exc.message}")


def remove_cluster(home: Path, name: str) -> None:
    conf_path(home, name).unlink(missing_ok=True)


# --- the Include line in ~/.ssh/config --------------------------------------------------------

def user_config() -> Path:
    return Path.home() / ".ssh" / "config"


def include_block(home: Path) -> str:
    return f"{MARK}\nInclude {quoted_path(conf_dir(home), 'CLOUDTRAIN_HOME')}/*.conf\n"


def record_path(home: Path) -> Path:
    return conf_dir(home) / "include.json"


def remembered(home: Path) -> dict[str, object]:
    try:
        data = json.loads(record_path(home).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def remember(home: Path, **values: object) -> None:
    write_private(record_path(home), json.dumps({**remembered(home), **values}))


def editable_target(cfg: Path, block: str) -> Path:
    """The file to edit: ``cfg``, or the regular file a symlinked ``cfg`` points to when it
    can be written; otherwise a UserError saying what to add by hand."""
    if not cfg.is_symlink():
        return cfg
    target = cfg.resolve()
    if target.is_file() and os.access(target, os.W_OK) and os.access(target.parent, os.W_OK):
        return target
    raise UserError(f"{cfg} is a link to {target}, which is not a regular file cloudtrain can "
                    "write: it was left as it is.",
                    "Add these two lines at the top of your SSH config by hand:\n" + block.rstrip())


def installed(home: Path, cfg: Path | None = None) -> bool:
    cfg = cfg or user_config()
    line = include_block(home).splitlines()[1]
    try:
        return line in cfg.read_text().splitlines()
    except OSError:
        return False


def by_hand(cfg: Path, block: str, exc: OSError) -> UserError:
    return UserError(f"Could not write {cfg}: {exc.strerror or exc}. It was left as it is.",
                     "Add these two lines at the top of your SSH config by hand:\n"
                     + block.rstrip())


def install(home: Path) -> str:
    """Add the Include line at the top of ~/.ssh/config once (created 600 in a 700 ~/.ssh
    when missing). Returns what was done, in words."""
    cfg = user_config()
    block = include_block(home)
    if installed(home, cfg):
        return f"{cfg} already includes cloudtrain's clusters; nothing was changed."
    ssh_dir = cfg.parent
    if not ssh_dir.exists():
        ssh_dir.mkdir(mode=0o700, parents=True)
    target = editable_target(cfg, block)
    try:
        if target.exists():
            data = target.read_bytes()
            write_private(target, block + data.decode("utf-8", "surrogateescape"),
                          stat.S_IMODE(target.stat().st_mode))
            remember(home, created=False)
        else:
            write_private(target, block)
            remember(home, created=True)
    except OSError as exc:
        raise by_hand(cfg, block, exc) from None
    remember(home, answer="yes")
    return f"Added 'Include {conf_dir(home)}/*.conf' at the top of {cfg}."


def uninstall(home: Path) -> str:
    """Remove what :func:`install` added, leaving the file as it was before (removed when
    install created it and nothing else was added since)."""
    cfg = user_config()
    block = include_block(home)
    if not installed(home, cfg):
        return f"{cfg} has no cloudtrain Include line; nothing was changed."
    target = editable_target(cfg, block)
    text = target.read_bytes().decode("utf-8", "surrogateescape")
    if block in text:
        text = text.replace(block, "", 1)
    else:  # the marker was edited away: remove the Include line alone
        line = block.splitlines()[1] + "\n"
        text = text.replace(line, "", 1) if line in text else text.replace(line[:-1], "", 1)
    try:
        if not text and remembered(home).get("created"):
            target.unlink()
        else:
            write_private(target, text, stat.S_IMODE(target.stat().st_mode))
    except OSError as exc:
        raise UserError(f"Could not write {cfg}: {exc.strerror or exc}. It was left as it is.",
                        "Remove these two lines from it by hand:\n" + block.rstrip()) from None
    remember(home, created=False, answer="no")
    return f"Removed cloudtrain's Include line from {cfg}."


def after_up(home: Path, choice: bool | None, ask: Callable[[str], bool] | None) -> str | None:
    """Once a cluster is up: add the Include line with ``--ssh-config`` (``choice`` True); not
    with ``--no-ssh-config``; with neither, ask once when ``ask`` is given (an interactive
    ``up``) and remember the answer. Returns what to tell the user, or None."""
    if choice is False or installed(home):
        return None
    if choice is True:
        return install(home)
    if ask is None or remembered(home).get("answer") in ("yes", "no"):
        return None
    yes = ask(f"Add one Include line to {user_config()} so that 'ssh CLUSTER', scp, rsync and "
              "VS Code Remote-SSH reach your clusters (asked once)?")
    remember(home, answer="yes" if yes else "no")
    if yes:
        return install(home)
    return "Not added. Later: cloudtrain ssh-config install"
