"""Files of a Slurm cluster, moved through the login node only (cloudtrain never reaches a
compute node): ``file_mounts`` from this machine rsynced to their targets on the shared
filesystem, bucket ``file_mounts`` fetched there with rclone run on the login node (the
credentials stay on the login node: no compute node gets them), and the source that pulls a
job's outputs back (the workdir on the shared filesystem, read with rsync through the login
node; the laptop side stages and checks what arrives: cloudtrain/pipeline/sync.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath
from typing import Callable, Mapping

from cloudtrain.errors import ProviderError, UserError

from cloudtrain_provisioners.slurm.login import Login


def rsync_source(login: Login) -> Callable[[str], list[str]]:
    """rsync's arguments naming ``path`` on the login node as a source."""
    def source(path: str) -> list[str]:
        shell = [] if login.spec == "local" else ["-e", login.rsync_shell()]
        return [*shell, login.rsync_dest(path)]
    return source


def target_path(login: Login, workdir: str, target: str) -> str:
    """A mount target on the shared filesystem: relative ones under the workdir, ``~/x``
    under the login's home, absolute ones as they are."""
    if target.startswith("~"):
        home = (login.run(["sh", "-c", 'printf %s "$HOME"']).out.strip()
                if login.spec != "local" else str(Path.home()))
        return str(PurePosixPath(home) / target[1:].lstrip("/"))
    if target.startswith("/"):
        return target
    return str(PurePosixPath(workdir) / target)


# The nearest folder of "$1" that exists must be a folder the user can write (nothing made).
_WRITABLE = ('d="$1"; while [ ! -e "$d" ] && [ ! -L "$d" ]; do d=$(dirname -- "$d"); done; '
             'if [ ! -d "$d" ] || [ -L "$d" ]; then echo "$d is not a folder"; exit 1; fi; '
             '[ -w "$d" ] || { echo "$d is not writable by $(id -un)"; exit 1; }')


def _writable(login: Login, target: str, where: str) -> None:
    """The target's folder can be made by the user (its nearest existing folder is one the
    user can write), else exit 2; nothing is created."""
    parent = str(PurePosixPath(where).parent)
    r = login.run(["sh", "-c", _WRITABLE, "sh", parent])
    if not r.ok:
        raise UserError(f"file_mounts target '{target}': cannot write {parent} on the login "
                        f"node ({r.words()}).",
                        "Give a target relative to the workdir (e.g. 'data: ./data'), or an "
                        "absolute path on the shared filesystem that you can write.")


def check(login: Login, workdir: str, targets: list[str], buckets: bool) -> None:
    """Before anything is created: every file_mounts target writable, and rclone on the login
    node when there are bucket mounts (exit 2 otherwise)."""
    for target in targets:
        _writable(login, target, target_path(login, workdir, target))
    if buckets:
        _rclone_there(login)


def _made(login: Login, target: str, folder: str) -> None:
    r = login.run(["mkdir", "-p", "--", folder])
    if not r.ok:
        raise UserError(f"file_mounts target '{target}': cannot create {folder} on the login "
                        f"node ({r.words()}).",
                        "Give an absolute target on the shared filesystem that you can write.")


def push_mounts(login: Login, workdir: str, mounts: Mapping[str, Path],
                say: Callable[[str], None]) -> None:
    """rsync each local file or folder to its target (nothing there deleted)."""
    for target, local in mounts.items():
        if not local.exists():
            raise UserError(f"file_mounts '{target}': {local} does not exist on this machine.",
                            "Fix the local path in file_mounts (relative to the task file).")
        where = target_path(login, workdir, target)
        _writable(login, target, where)
        _made(login, target, str(PurePosixPath(where).parent))
        src = f"{local}/" if local.is_dir() else str(local)
        dest = login.rsync_dest(where + ("/" if local.is_dir() else ""))
        argv = ["rsync", "-a", src, dest]
        if login.spec != "local":
            argv[1:1] = ["-e", login.rsync_shell()]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise ProviderError(f"rsync of file_mounts '{target}' to the login node failed: "
                                f"{done.stderr.strip()[:300]}",
                                "Check the login node and the target's space, then run again.")
        say(f"file_mounts: {local} -> {where}")


# python3 -c: the environment from stdin's first line, then the agent (the rest) as __main__.
_LOADER = ("import sys, os, json; os.environ.update(json.loads(sys.stdin.readline())); "
           "src = sys.stdin.read(); sys.argv = ['store.py'] + sys.argv[1:]; "
           "exec(compile(src, 'store.py', 'exec'), {'__name__': '__main__'})")


def fetch_buckets(login: Login, workdir: str, buckets: Mapping[str, str], program: str,
                  say: Callable[[str], None]) -> None:
    """Fetch each bucket into its target on the shared filesystem with ``program`` (the
    task's environment as a line of JSON, then cloudtrain's storage agent, on stdin: no
    credential on a command line or in a file) run on the login node, where rclone must be."""
    if not buckets:
        return
    _rclone_there(login)
    for target, url in buckets.items():
        where = target_path(login, workdir, target)
        _writable(login, target, where + "/x")
        _made(login, target, where)
        got = login.run(["python3", "-c", _LOADER, "fetch", url, where], stdin=program,
                        timeout=3600)
        for line in (got.out + got.err).splitlines():
            if line.startswith("[store] "):
                say(f"file_mounts: {line[8:]}")
        if not got.ok:
            raise ProviderError(f"fetching bucket file_mounts '{target}' ({url}) on the login "
                                f"node failed: {got.words()}",
                                "Check the URL and the credentials in the task's envs (or the "
                                "login node's own), then launch again.")


def _rclone_there(login: Login) -> None:
    r = login.run(["sh", "-c", "command -v rclone >/dev/null && command -v python3 >/dev/null"
                   " || exit 3"])               # (dash's command -v exits 127: 'not installed')
    if not r.ok:
        raise UserError(f"the task has bucket file_mounts, and the login node ({login.where}) "
                        "has no rclone (or no python3), which fetch them into the shared "
                        "filesystem there.",
                        "Install rclone on the login node ('sudo apt-get install rclone', or "
                        "a module), or copy the data to the shared filesystem and mount it "
                        "as a local path.")
