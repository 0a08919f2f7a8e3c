"""A task's provider, checked against the installed providers: the name in
``resources.provider`` and the options under ``resources.<provider>``.

``spec`` parses a task without looking providers up; this module adds what needs the
registry, with the same kind of errors (a :class:`SpecError` naming the field and the line):

- ``check_task(task)``: right after parsing, before anything is created: options written
  for another provider, and a provider name that is not installed;
- ``provider_options(task)``: the provider's own options model, validated;
- ``check_options(task)``: that check where the provider is installed, before anything is
  opened (``load_checked`` runs it, so ``cost`` refuses what ``up`` refuses);
- ``load_checked(path)`` / ``parse_checked(text)``: ``spec``'s loading plus ``check_task``,
  in the order a user sees the errors (the file, its fields, its provider, its local paths).

This module imports ``spec``; ``spec`` never imports it.
"""

from __future__ import annotations

from difflib import get_close_matches
from pathlib import Path

from pydantic import BaseModel, ValidationError

from cloudtrain import skytask
from cloudtrain.errors import SpecError, UserError
from cloudtrain.provider import registry
from cloudtrain.taskmodel import Resources, Task
from cloudtrain.spec import (check_paths, clean_loc, non_finite_error, non_finite_path, one_line,
                             parse_task, read_task_file)


def check_task(task: Task, known_providers: tuple[str, ...] = ()) -> Task:
    """Refuse options under ``resources.<name>`` for a provider the task does not use, and a
    provider name that is not installed (``known_providers``: names accepted even when not
    installed, e.g. ``cost`` prices clouds whose provider is not installed yet). Returns the
    task, so a caller can write ``check_task(parse_task(...))``."""
    extras = task.resources.provider_options_raw()
    known = registry.names()
    for key in extras:
        if key != task.resources.provider:
            fields = list(Resources.model_fields)
            close = get_close_matches(key, fields + known, n=1, cutoff=0.6)
            if key in known:
                uses = f"'{task.resources.provider}'" if task.resources.provider else "none"
                hint = f"Options for '{key}' apply only with 'provider: {key}'; this task names {uses}."
            else:
                hint = f"Did you mean '{close[0]}'?" if close else \
                    f"Known fields here: {', '.join(fields)}."
            raise SpecError("unknown field", hint=hint, field=f"resources.{key}",
                            line=task.line_of("resources", key), source=task.source)
    # Unknown provider names are reported now, before anything is created.
    if task.resources.provider is None or task.resources.provider in known_providers:
        return task
    try:
        registry.provider_class(task.resources.provider)
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - UserError from the registry (unknown, or not loadable)
        raise skytask.as_written(SpecError(
            getattr(exc, "message", str(exc)), hint=getattr(exc, "hint", ""),
            field="resources.provider", line=task.line_of("resources", "provider"),
            source=task.source), task.renamed) from None
    return task


def parse_checked(text: str, source: str = "task.yaml", base_dir: Path | None = None, *,
                  known_providers: tuple[str, ...] = ()) -> Task:
    """:func:`cloudtrain.spec.parse_task`, then :func:`check_task`."""
    return check_task(parse_task(text, source=source, base_dir=base_dir), known_providers)


def load_checked(path: str | Path, *, known_providers: tuple[str, ...] = ()) -> Task:
    """The task file at ``path``: read, parsed, its provider and the provider's options
    checked, then its local paths (:func:`cloudtrain.spec.load_task` with :func:`check_task`
    and :func:`check_options` in between): every command that reads a task refuses the same
    input, before it opens the home or creates anything."""
    p = Path(path)
    task = parse_checked(read_task_file(p), source=str(p), base_dir=p.parent,
                         known_providers=known_providers)
    check_options(task)
    check_paths(task, source=str(p))
    return task


def check_options(task: Task) -> None:
    """``resources.<provider>`` checked by the provider's own model (as ``provider_options``),
    for every command that reads a task, before it opens anything. A provider that cannot be
    loaded here has no model to check against: skipped (``cost`` prices clouds whose provider
    is not installed; ``up`` says what to install)."""
    name = task.resources.provider
    if name is None:
        return
    try:
        registry.provider_class(name)
    except UserError:
        return
    provider_options(task)


def provider_options(task: Task) -> BaseModel | None:
    """Validate ``resources.<provider>`` with the provider's own options model."""
    name = task.resources.provider
    if name is None:  # not resolved yet (the planner picks it): nothing to validate against
        return None
    cls = registry.provider_class(name)
    model = getattr(cls, "options_model", None)
    raw = task.resources.provider_options_raw().get(name, {})
    source, line = task.source, task.line_of("resources", name)
    if model is None:
        if raw:
            raise SpecError(f"provider '{name}' takes no options", field=f"resources.{name}",
                            hint="Remove the section.", line=line, source=source)
        return None
    if raw is None:
        raw = {}
    try:
        opts = model.model_validate(raw)
    except ValidationError as exc:
        e = exc.errors()[0]
        clean = clean_loc(tuple(e["loc"]))
        loc = ".".join(str(p) for p in clean)
        field = f"resources.{name}" + (f".{loc}" if loc else "")
        line = task.line_of("resources", name, *clean)
        msg = one_line(e["msg"].removeprefix("Value error, "))
        if e["type"] == "extra_forbidden":
            known = list(model.model_fields)
            close = get_close_matches(str(e["loc"][-1]), known, n=1)
            hint = f"Did you mean '{close[0]}'?" if close else f"Known fields: {', '.join(known)}."
            raise SpecError("unknown field", field=field, hint=hint, line=line,
                            source=source) from None
        raise SpecError(msg, field=field, hint="Fix it and run again.", line=line,
                        source=source) from None
    bad = non_finite_path(opts.model_dump())    # "1.0e400" or "nan" read by a float field
    if bad is not None:
        raise non_finite_error(("resources", name, *bad), task.line_of("resources", name, *bad),
                               task.source)
    return opts
