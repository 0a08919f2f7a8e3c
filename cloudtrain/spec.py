"""The task file: read, typed and validated, with errors that name the field and the line.

``parse_task`` turns YAML text into a :class:`Task` (the model lives in ``taskmodel``);
``load_task`` reads the file and checks the local paths it names. Parsing never looks up
providers: the provider name and the ``resources.<provider>`` options are checked by
``cloudtrain.provider.options`` (``load_checked`` = load_task + those checks).
"""

from __future__ import annotations

import math
import re
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from cloudtrain import skytask
from cloudtrain.errors import SpecError
from cloudtrain.taskmodel import Accelerators, Resources, Task, Train
from cloudtrain.yamlsrc import MAX_BYTES, LocatedYaml, load_located


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] | None = Task
    for part in loc:
        if model is None:
            return []
        f = model.model_fields.get(str(part))
        if f is None:
            return []
        ann = f.annotation
        model = None
        for cand in (Resources, Train, Accelerators):
            if ann is cand or (hasattr(ann, "__args__") and cand in getattr(ann, "__args__", ())):
                model = cand
    return [n for n in (model.model_fields if model else {}) if n != "base_dir"]


# Control characters as Python writes them in a string ('\n', '\x1b'): a value quoted in an
# error message stays on its line, and cannot move the cursor or recolour the terminal.
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(32), 127)}


def one_line(text: str) -> str:
    """``text`` with its control characters written as escapes (a message stays one line)."""
    return text.translate(_ESCAPES)


def non_finite_path(value: Any, path: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """The path of the first float in ``value`` (a dump of a validated model) that is inf or
    nan, or None: a string such as "1.0e400" or "nan" that a float field parsed."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        found = non_finite_path(v, path + (k,))
        if found is not None:
            return found
    return None


def non_finite_error(path: tuple[Any, ...], line: int | None, source: str) -> SpecError:
    return SpecError("is not a finite number", hint="Write a finite number.",
                     field=".".join(str(p) for p in path if not isinstance(p, int)),
                     line=line, source=source)


def clean_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic error location without the union-branch names it inserts."""
    # pydantic inserts union-branch names ("int", "literal['auto']", "function-after[...]")
    return tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"int", "str"})))


def _error_from_validation(exc: ValidationError, located: LocatedYaml, source: str) -> SpecError:
    errors = exc.errors()
    # Prefer "unknown field" errors: they usually explain the rest.
    errors.sort(key=lambda e: 0 if e["type"] == "extra_forbidden" else 1)
    e = errors[0]
    loc = clean_loc(tuple(e["loc"]))
    line = located.line_of(loc)
    dotted = ".".join(str(p) for p in loc)
    if e["type"] == "extra_forbidden":
        known = _fields_at(loc[:-1])
        close = get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"Did you mean '{close[0]}'?" if close else (
            f"Known fields here: {', '.join(known)}." if known else "Remove it.")
        return SpecError("unknown field", hint=hint, field=dotted, line=line, source=source)
    if not dotted:   # the file's top level (a rule between fields): name them
        return top_error(e, len(errors), list(Task.model_fields), located, source)
    return value_error(e, len(errors), dotted, line, source)


def top_error(e: Any, count: int, known: list[str], located: LocatedYaml,
              source: str, named: list[str] | None = None) -> SpecError:
    """An error about the file's top level (a rule between fields, e.g. 'run' and 'train'
    both given) named by the fields its message quotes (or ``named``), at the first one's
    line."""
    if named is None:
        named = list(dict.fromkeys(n for n in re.findall(r"'([A-Za-z_]+)'", str(e["msg"]))
                                   if n in known))
    err = value_error(e, count, "", None, "")
    given = [n for n in named if isinstance(located.data, dict) and n in located.data]
    line = located.line_of((given[0],)) if given else 1
    what = ("field" if len(named) == 1 else "fields") + " " + \
        " and ".join(f"'{n}'" for n in named) if named else "the top level"
    return SpecError(f"{what}: {err.message}", hint=err.hint, line=line, source=source)


def value_error(e: Any, count: int, field: str, line: int | None, source: str) -> SpecError:
    """A pydantic error other than an unknown field (the first of ``count``) as the paragraph
    that names ``field``: what is wrong, what was given, how many problems follow."""
    msg = one_line(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if e["type"] == "missing":
        msg = "is required"
    got = e.get("input")
    if e["type"] not in ("missing", "value_error") and not isinstance(got, (dict, list)):
        msg += f" (got {got!r:.80})"
    more = f" ({count - 1} more problem(s) after this one.)" if count > 1 else ""
    return SpecError(msg, hint=("Fix it and run again." + more).strip(), field=field,
                     line=line, source=source)


def parse_task(text: str, source: str = "task.yaml", base_dir: Path | None = None) -> Task:
    """The task in ``text``, typed and validated field by field (providers not looked up)."""
    return parse_located(load_located(text, source), source, base_dir)


def parse_located(located: LocatedYaml, source: str, base_dir: Path | None = None) -> Task:
    """:func:`parse_task` from the loaded document (which command-line overrides may edit)."""
    if not isinstance(located.data, dict):
        raise SpecError("the task file must be a mapping of fields (name:, num_nodes:, run: ...)",
                        source=source, line=1, hint="See the task-file reference in the README.")
    _refuse_non_finite(located, source)
    read = skytask.translate(located, source)   # SkyPilot's field names, read as ours
    located = read.located
    try:
        task = Task.model_validate(located.data)
    except ValidationError as exc:
        raise skytask.as_written(_error_from_validation(exc, located, source),
                                 read.renamed) from None
    bad = non_finite_path(task.model_dump())
    if bad is not None:
        raise non_finite_error(bad, located.line_of(bad), source)
    task = task.model_copy(update={"base_dir": (base_dir or Path(".")).resolve()})
    task.attach_source(located, source, read.notes, read.renamed)
    return task


def _refuse_non_finite(located: LocatedYaml, source: str) -> None:
    """No field of a task, a provider's options included, takes .inf or .nan: refused here,
    whatever the field's own model says."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), located.data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((path + (k,), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((path + (i,), v) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            fields = [str(p) for p in path if not isinstance(p, int)]
            raise SpecError(f"{value} is not a number cloudtrain can use",
                            field=".".join(fields) or "(top)", line=located.line_of(path),
                            source=source, hint="Write a finite number (or quote it, where the "
                                                "field is text).")


def read_task_file(path: str | Path) -> str:
    """The text of the task file at ``path`` (bounded: a huge file or /dev/zero is refused)."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"task file '{p}' does not exist",
                        hint="Check the path, or create one with 'cloudtrain init'.")
    if p.is_dir():
        raise SpecError(f"'{p}' is a directory, not a task file", hint="Pass the YAML file itself.")
    try:
        with p.open() as f:     # bounded: a huge file (or /dev/zero) is refused, not read whole
            return f.read(MAX_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read task file '{p}' ({exc})", hint="Check the file.") from None


def load_task(path: str | Path) -> Task:
    """The task file at ``path``, parsed, with its local paths checked. The provider name and
    options are not checked here: see ``cloudtrain.provider.options.load_checked``."""
    p = Path(path)
    task = parse_task(read_task_file(p), source=str(p), base_dir=p.parent)
    check_paths(task, source=str(p))
    return task


def check_paths(task: Task, source: str = "task.yaml") -> None:
    """Local files the task refers to must exist; checked before anything is created."""
    try:
        _check_paths(task, source)
    except OSError as exc:  # a path the OS refuses to look at (too long, a loop of links ...)
        raise SpecError(f"cannot look at '{exc.filename}' ({exc.strerror or exc})", source=source,
                        hint="Fix the path in the task file (relative to the task file).") from None


def _check_mount_links(task: Task, wd: Path, source: str) -> None:
    """A relative file_mounts target lands in the node's copy of the workdir, which rsync makes
    from this one with its links as links: a target under a link to elsewhere would be written
    wherever the link points (on the local provider, anywhere on this machine)."""
    for remote in task.file_mounts:
        if remote.startswith("/"):
            continue
        here = wd
        for part in [p for p in remote.split("/") if p not in ("", ".")][:-1]:
            here = here / part
            if here.is_symlink():
                raise SpecError(f"the node path '{remote}' goes through '{here.relative_to(wd)}', "
                                "a symbolic link in the workdir, so the mount would land "
                                "wherever that link points", field=f"file_mounts.{remote}",
                                source=source, line=task.line_of("file_mounts", remote),
                                hint="Mount to a path that does not go through a link.")
            if not here.exists():
                break


def _check_paths(task: Task, source: str) -> None:
    wd = task.workdir_path()
    if task.workdir is not None and (wd is None or not wd.is_dir()):
        raise SpecError(f"the directory '{task.workdir}' does not exist (resolved to {wd})",
                        field="workdir", source=source, line=task.line_of("workdir"),
                        hint="Point workdir at your project directory, relative to the task file.")
    for remote, local in task.local_mounts().items():   # bucket URLs: the nodes fetch
        lp = (task.base_dir / local).resolve()
        if not lp.exists():
            raise SpecError(f"the local path '{local}' does not exist (resolved to {lp})",
                            field=f"file_mounts.{remote}", source=source,
                            line=task.line_of("file_mounts", remote),
                            hint="Fix the path (relative to the task file) or remove the mount.")
    if wd is not None and task.workdir is not None:
        _check_mount_links(task, wd, source)
    if task.train and task.train.script:
        if wd is None:
            raise SpecError("train.script needs a workdir to find the script in", field="workdir",
                            source=source, line=task.line_of("train", "script"),
                            hint="Add 'workdir: .' (the task file's directory).")
        if not (wd / task.train.script).is_file():
            raise SpecError(f"the script '{task.train.script}' is not in workdir ({wd})",
                            field="train.script", source=source,
                            line=task.line_of("train", "script"),
                            hint="Give the path relative to workdir.")
