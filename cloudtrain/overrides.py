"""Command-line overrides of a task (``--gpus A100:8``, ``--num-nodes``, ``--use-spot``,
``--provider``, ``--region``, ``-- CMD``), applied once, to the task's raw document,
before it is validated: ``up``, ``launch`` and ``cost`` read a task through :func:`load`.

A bad value is reported against its flag (exit 2), before the task file is read; what the
task file then makes of the overridden values is checked as if the file said them.
"""

from __future__ import annotations

import copy
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloudtrain.errors import SpecError, UserError

if TYPE_CHECKING:
    from cloudtrain.context import Env
    from cloudtrain.taskmodel import Task

# Each flag and the field of the task document it sets.
FIELDS = {
    "--gpus": ("resources", "accelerators"),
    "--num-nodes": ("num_nodes",),
    "--use-spot": ("resources", "use_spot"),
    "--no-use-spot": ("resources", "use_spot"),
    "--provider": ("resources", "provider"),
    "--region": ("resources", "region"),
    "-- CMD": ("run",),
}

COMMAND_LINE = "the command line"


@dataclass(frozen=True)
class Overrides:
    """What the command line sets over the task file (None / empty: the file's value)."""

    gpus: str | None = None
    num_nodes: int | None = None
    use_spot: bool | None = None
    provider: str | None = None
    region: str | None = None
    run: tuple[str, ...] | None = None      # the words after '--'

    def values(self) -> dict[str, Any]:
        """Each given flag and the value it puts in the document."""
        out: dict[str, Any] = {}
        if self.gpus is not None:
            out["--gpus"] = self.gpus
        if self.num_nodes is not None:
            out["--num-nodes"] = self.num_nodes
        if self.use_spot is not None:
            out["--use-spot" if self.use_spot else "--no-use-spot"] = self.use_spot
        if self.provider is not None:
            out["--provider"] = self.provider
        if self.region is not None:
            out["--region"] = self.region
        if self.run is not None:
            out["-- CMD"] = shlex.join(self.run)
        return out

    def __bool__(self) -> bool:
        return bool(self.values())


@dataclass(frozen=True)
class Change:
    """One override as the plan shows it: the flag, the field, the file's value and ours."""

    flag: str
    field: str
    before: Any
    after: Any

    def words(self) -> str:
        over = "" if self.before is None else f", was {_show(self.before)}"
        return f"{self.field} = {_show(self.after)} ({self.flag}{over})"


    def as_json(self) -> dict[str, Any]:
        return {"flag": self.flag, "field": self.field, "value": self.after,
                "task_file_value": self.before}


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return ", ".join(f"{k}=..." for k in value) if value else "{}"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_env(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--env K=V`` options (launch's: the job's environment over the task's envs)."""
    out: dict[str, str] = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.isidentifier():
            raise UserError(f"--env '{p}' is not KEY=VALUE.", "Write e.g. --env LR=0.1")
        out[k] = v
    return out


def apply(doc: dict[str, Any], ov: Overrides) -> tuple[dict[str, Any], list[Change]]:
    """A copy of the task document ``doc`` with ``ov`` applied, and what changed."""
    new = copy.deepcopy(doc)
    changes: list[Change] = []
    for flag, value in ov.values().items():
        path = FIELDS[flag]
        here = new
        for part in path[:-1]:
            if here.get(part) is None:
                here[part] = {}
            here = here[part]
            if not isinstance(here, dict):     # e.g. 'resources: 3': the file's own error
                break
        else:
            before = here.get(path[-1])
            here[path[-1]] = value
            changes.append(Change(flag, ".".join(path), before, value))
    return new, changes


def check_flags(ov: Overrides, known_providers: tuple[str, ...] = ()) -> None:
    """Each override's value validated on its own (as the task file's field would be), so that
    a bad one is refused naming its flag, before any file is read."""
    from cloudtrain.provider.options import check_task
    from cloudtrain.spec import parse_located
    from cloudtrain.yamlsrc import LocatedYaml

    for flag, value in ov.values().items():
        if flag == "-- CMD":
            continue
        # the flag's field alone, with a placeholder run: (a task needs run: or train:)
        doc, _ = apply({"run": "true"}, Overrides(**{_ATTR[flag]: getattr(ov, _ATTR[flag])}))
        try:
            check_task(parse_located(LocatedYaml(doc, {}), COMMAND_LINE), known_providers)
        except SpecError as exc:
            msg = exc.message.split(": ", 2)[-1]
            more = "" if not exc.hint or exc.hint.startswith("Fix it") else f" {exc.hint}"
            raise UserError(f"{flag} '{value}': {msg}", _FIX[flag] + more) from None


_ATTR = {"--gpus": "gpus", "--num-nodes": "num_nodes", "--use-spot": "use_spot",
         "--no-use-spot": "use_spot",
         "--provider": "provider", "--region": "region"}
_FIX = {"--gpus": "Write NAME:COUNT, e.g. --gpus A100:8.",
        "--num-nodes": "Give a whole number of nodes, e.g. --num-nodes 2.",
        "--use-spot": "",
        "--no-use-spot": "",
        "--provider": "See 'cloudtrain catalog' or the README for the providers.",
        "--region": "Give a region name, e.g. --region us-east-1."}


def load(task_file: str | None, ov: Overrides, *, known_providers: tuple[str, ...] = (),
         name: str | None = None, workdir: str = ".",
         base: dict[str, Any] | None = None) -> tuple[Task, list[Change]]:
    """The task ``up``/``launch``/``cost`` run: the task file (or, with None, a task made from
    the flags: ``name``, ``workdir``, ``run: CMD`` and the fields in ``base``, e.g. an existing
    cluster's resources and node count) with ``ov`` applied, then checked as
    :func:`cloudtrain.provider.options.load_checked` checks a file. Returns the Task and the
    changes the plan shows."""
    from cloudtrain.provider.options import check_options, check_task
    from cloudtrain.spec import check_paths, parse_located, read_task_file
    from cloudtrain.yamlsrc import LocatedYaml, load_located

    check_flags(ov, known_providers)
    if task_file is None:
        if ov.run is None:
            raise UserError("launch needs a task file or a command after '--'.",
                            "e.g. cloudtrain launch task.yaml, or cloudtrain launch --gpus A100:1 "
                            "-- python train.py")
        source, base_dir = COMMAND_LINE, Path(".")
        located = LocatedYaml({**(base or {}), "workdir": workdir,
                               **({"name": name} if name else {})}, {})
    else:
        source, base_dir = task_file, Path(task_file).parent
        located = load_located(read_task_file(task_file), task_file)
    if isinstance(located.data, dict):
        data, changes = apply(located.data, ov)
        if ov.run is not None:
            data.pop("train", None)    # '-- CMD' is what runs, instead of the task's train:
        located = LocatedYaml(data, located.lines)
    else:
        changes = []
    task = check_task(parse_located(located, source, base_dir), known_providers)
    check_options(task)
    check_paths(task, source=source)
    return task, changes


def cluster_base(env: Env, name: str | None) -> dict[str, Any] | None:
    """For a launch without a task file on an existing cluster: the cluster's node count and
    resources (what ``up`` created it with), so that it is reused as it is."""
    from cloudtrain.names import is_valid

    row = env.state.get_cluster(name) if name and is_valid(name) else None
    if row is None:
        return None
    return {"num_nodes": row.num_nodes, "resources": row.resources or {"provider": row.provider}}


def derived_name(workdir: str) -> str:
    """A cluster name for a task made from the flags: the workdir's directory name, made safe
    (the same project reuses its cluster)."""
    from cloudtrain.names import is_valid

    stem = Path(workdir).resolve().name.lower().replace("_", "-").replace(".", "-")
    name = "".join(c for c in stem if c.isascii() and (c.isalnum() or c == "-"))
    name = name.lstrip("0123456789-")[:40].rstrip("-") or "cloudtrain"
    return name if is_valid(name) else "cloudtrain"
