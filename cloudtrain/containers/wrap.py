"""A job's body run inside the node's container with ``docker exec`` from the host
(docs/containers.md).

The host script (run.py ``script()``) keeps its exports, so the host side carries the job's
markers as today; its body becomes a ``docker exec`` that passes every exported variable by
name (``-e NAME``: the value comes from the client's environment, never from its command line)
plus HOME, USER and LOGNAME, as the SSH user's uid:gid, in the same workdir. The image's PATH
and python are used, not the host's.

The cloudtrain markers (``CLOUDTRAIN_JOB_ID`` ... ``CLOUDTRAIN_CLUSTER_ID`` and a provider's
own ``CLOUDTRAIN_*``) go in with their values and are taken out of the docker client's own
environment, and the client runs in a session of its own (``ctcontainer.sh exec``): a stop
(ctkill.sh, the node guard, ``down``) signals the job's processes in the container (visible on
the host: ``--pid host``) and never the client, which stays to stream their last lines and
returns their exit code."""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath
from typing import Iterable

from cloudtrain.pipeline import bootstrap, sync
from cloudtrain.schema import NodeRow

# In the container: bash where the image has it, else its /bin/sh.
_INNER = 'command -v bash >/dev/null 2>&1 && exec bash -c "$1" || exec sh -c "$1"'
# Besides the job's own exports: who the job runs as, and the GPU slots the node's queue gave
# it (set when the job starts, not in its script).
ALWAYS = ("HOME", "USER", "LOGNAME", "CUDA_VISIBLE_DEVICES")


def _node_path(p: str) -> str:
    """A node path for the job's shell, which runs in the workdir: one under $HOME made so."""
    return shlex.quote(p) if p.startswith("/") else f'"$HOME"/{shlex.quote(p)}'


def _script(node: NodeRow) -> str:
    return _node_path(str(PurePosixPath(bootstrap.script_dir(node)) / "ctcontainer.sh"))


def inside(node: NodeRow, container: str, names: Iterable[str], command: str) -> str:
    """Host-side bash that runs ``command`` (bash) in ``container`` and ends with its exit
    code; it outlives a SIGTERM to the job's group until the command itself has ended (a
    checkpoint written in its stop_grace comes back through it)."""
    passed = [n for n in dict.fromkeys([*ALWAYS, *names]) if not n.startswith("CLOUDTRAIN_")]
    keeper = _node_path(str(PurePosixPath(node.root_dir) / ".container"))
    return "\n".join([
        ': "${USER:=$(id -un 2>/dev/null)}" "${LOGNAME:=$USER}"; export USER LOGNAME',
        f"ct_i={shlex.quote(_INNER)}",
        "ct_e=(" + " ".join(f"-e {shlex.quote(n)}" for n in passed) + "); ct_m=()",
        'for ct_v in $(compgen -e); do case $ct_v in CLOUDTRAIN_*) '
        'ct_e+=(-e "$ct_v=${!ct_v}"); ct_m+=("$ct_v") ;; esac; done',
        # the keeper, the user, the image's shell, the API version (ctcontainer.sh ensure)
        f"ct_k= ct_u= ct_s= ct_a=; read -r _ _ ct_k _ _ ct_u ct_s ct_a _ 2>/dev/null < {keeper}",
        '[ -n "$ct_u" ] || ct_u=$(id -u):$(id -g)',
        'case $ct_s in bash|sh) ct_c=("$ct_s" -c) ;; *) ct_c=(sh -c "$ct_i" _) ;; esac',
        f'( unset "${{ct_m[@]}}"; exec setsid bash {_script(node)} exec "$ct_k" "$ct_a" '
        f'-u "$ct_u" -w "$PWD" "${{ct_e[@]}}" {shlex.quote(container)} '
        f'"${{ct_c[@]}}" {shlex.quote(command)} ) < /dev/null &',
        "ct_x=$!; trap ':' TERM INT",
        'while kill -0 "$ct_x" 2>/dev/null; do wait "$ct_x"; done',
        'wait "$ct_x"',
    ])


def maybe(node: NodeRow, container: str | None, names: Iterable[str], command: str) -> str:
    """``command`` run in ``container`` (:func:`inside`), or as it is when there is none."""
    return command if container is None else inside(node, container, names, command)


def shell_command(node: NodeRow, container: str) -> str:
    """``cloudtrain ssh NAME --container``: a login shell in the node's container, as the SSH
    user, in the workdir (a terminal when the session has one)."""
    name = shlex.quote(container)
    wd = _node_path(sync.workdir_on(node))
    return ("bash -c " + shlex.quote(
        f"docker inspect -f '{{{{.State.Running}}}}' {name} 2>/dev/null | grep -q true || "
        f"{{ echo 'cloudtrain: no container runs on node {node.rank}: launch a task with "
        "container: first' >&2; exit 2; }; "
        ': "${USER:=$(id -un 2>/dev/null)}" "${LOGNAME:=$USER}"; export USER LOGNAME; '
        "t=; [ -t 0 ] && t=-t; "
        f'mkdir -p {wd} 2>/dev/null; cd {wd} 2>/dev/null || cd; '
        f'exec docker exec -i $t -u "$(id -u):$(id -g)" -w "$PWD" -e HOME -e USER -e LOGNAME '
        f"-e TERM {name} sh -c {shlex.quote('command -v bash >/dev/null 2>&1 && exec bash || exec sh')}"))

