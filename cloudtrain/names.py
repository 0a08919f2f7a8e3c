"""The one cluster-name rule, and paths derived from names that stay inside their parent.

Every cluster name that reaches a provider (tag filters, resource names), a path (cluster
directory, logs, lock files, keys, local node roots) or the state database is checked here,
at the CLI and again at those boundaries (defense in depth): a name such as ``*``, ``''``,
``../x`` or ``job\\n`` never gets that far.
"""

from __future__ import annotations

import re
from pathlib import Path

from cloudtrain.errors import UserError

RULE = "1-40 lowercase letters, digits and '-', starting with a letter and not ending with '-'"
# \A ... \Z: '$' would also match before a trailing newline ("job\n").
NAME_RE = re.compile(r"\A(?:[a-z][a-z0-9-]{0,38}[a-z0-9]|[a-z])\Z")


# A task's ``name:`` may be wider than a cluster name (SkyPilot allows capitals, '_' and '.'):
# it is kept as the job's name, and the cluster name is derived from it (:func:`derive`).
TASK_NAME_RULE = "1-63 letters, digits, '-', '_' and '.', starting with a letter"
TASK_NAME_RE = re.compile(r"\A[A-Za-z][A-Za-z0-9._-]{0,62}\Z")


def derive(name: str) -> str:
    """The cluster name for a task name that follows TASK_NAME_RULE: lowercase, each run of
    '_', '.' and '-' one '-', at most 40 characters, no '-' at the end ('My_Job.v2' ->
    'my-job-v2'). A valid cluster name is returned as it is."""
    if is_valid(name):
        return name
    out = re.sub(r"[._-]+", "-", name.lower())[:40].rstrip("-")
    if not is_valid(out):   # not reached for a name that follows TASK_NAME_RULE
        raise UserError(f"{name!r} gives no valid cluster name: use {RULE}.", "e.g. 'train-1'.")
    return out


def is_valid(name: object) -> bool:
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def check(name: object, what: str = "cluster name") -> str:
    """``name`` when it follows the cluster-name rule; otherwise a UserError (exit 2) naming
    ``what`` (the argument or field) and the rule."""
    if is_valid(name):
        return str(name)
    raise UserError(f"{what} {name!r} is not a valid cluster name: use {RULE}.",
                    "e.g. 'train-1'. Nothing was changed.")


def inside(parent: Path, *parts: str) -> Path:
    """``parent / parts...``, refusing (UserError) a result that does not resolve inside
    ``parent`` (an absolute part, '..', an empty part or a symbolic link leading out)."""
    if not parts or any(not p or p in (".", "..") or "/" in p or "\0" in p for p in parts):
        raise UserError(f"{'/'.join(parts)!r} is not a name under {parent}.",
                        "Use a valid cluster name (e.g. 'train-1').")
    path = parent.joinpath(*parts)
    base = parent.resolve()
    real = path.resolve()
    if real == base or base not in real.parents:
        raise UserError(f"{path} resolves to {real}, outside {base}.",
                        f"Remove the link that leads out of {base}.")
    return path
