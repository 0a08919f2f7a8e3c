"""The task file: typed, validated, with errors that name the field and the line."""

from __future__ import annotations

import ipaddress
import math
import re
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError,
                      field_validator, model_validator)

from cloudtrain.errors import SpecError
from cloudtrain.yamlsrc import MAX_BYTES, LocatedYaml, load_located

from cloudtrain.names import NAME_RE  # noqa: E402,F401 - the one cluster-name rule (\A...\Z)

# Upper bounds for the task's money and time fields: a number past these is a typo (or .inf),
# and would turn estimates and budget checks into nonsense.
MAX_HOURS = 24 * 366            # max_hours: a year
MAX_USD = 10_000_000            # max_cost_usd
MAX_USD_PER_HOUR = 100_000      # resources.max_hourly_cost
MAX_PATH = 4096                 # a path in the task (bytes, as Linux's PATH_MAX)
MAX_PATH_PART = 255             # one component of it (NAME_MAX)


def _check_path_text(p: str) -> None:
    """Length rules every path in a task follows (NUL is refused by the reader)."""
    size = len(p.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH:
        raise ValueError(f"the path is {size} bytes long; paths are at most {MAX_PATH}")
    long_part = next((part for part in p.split("/")
                      if len(part.encode("utf-8", "surrogatepass")) > MAX_PATH_PART), None)
    if long_part is not None:
        raise ValueError(f"the path has a name longer than {MAX_PATH_PART} bytes "
                         f"('{long_part[:20]}...')")
    if not p.strip():
        raise ValueError("the path is empty")


def _check_mount_target(target: str) -> None:
    """A file_mounts target (the path on the node): relative ones are under the node's
    workdir, absolute ones are paths on the node's own disk (refused where nodes share this
    machine, see check_mounts). Neither may climb with '..' or start with '~'."""
    _check_path_text(target)
    parts = target.split("/")
    if ".." in parts:
        raise ValueError(f"the node path '{target}' climbs out with '..'; write it relative to "
                         "the workdir without '..' (e.g. 'data') or as an absolute path")
    if target.startswith("~"):
        raise ValueError(f"the node path '{target}' starts with '~'; write it relative to the "
                         "workdir (e.g. 'data') or as an absolute path")
    if not target.startswith("/") and all(part in ("", ".") for part in parts):
        raise ValueError(f"the node path '{target}' is the workdir itself; name a file or "
                         "directory under it (e.g. 'data')")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Accelerators(_Strict):
    name: str
    count: int = Field(ge=1, le=64)

    def __str__(self) -> str:
        return f"{self.name}:{self.count}"


def _parse_accelerators(value: Any) -> Any:
    if value is None or value == "none" or value == "":
        return None
    if isinstance(value, str):
        name, _, count = value.partition(":")
        name = name.strip()
        if not name:
            raise ValueError("expected NAME[:COUNT], e.g. A100:8")
        if count == "":
            return {"name": name, "count": 1}
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"the count '{count}' is not a whole number; write e.g. {name}:8") from None
        return {"name": name, "count": n}
    if isinstance(value, dict):
        if set(value) <= {"name", "count"} and "name" in value:
            return value
        if len(value) != 1:
            raise ValueError("give one GPU model, e.g. {A100: 8} or A100:8")
        (name, count), = value.items()
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"the count '{count}' is not a whole number; write e.g. {{{name}: 8}}")
        return {"name": str(name), "count": count}
    raise ValueError("expected NAME[:COUNT] (e.g. A100:8) or {NAME: COUNT}")


class Resources(BaseModel):
    """Where and on what the nodes run. Provider-specific options sit under a key named
    after the provider (``local:``, ``ssh:``, ...), validated by that provider's model."""

    model_config = ConfigDict(extra="allow", frozen=True)

    # None: the planner picks the cheapest cloud with credentials (only when accelerators or
    # instance_type are given; without them the default stays "local", see _default_provider).
    provider: str | None = None
    region: str | None = None
    zone: str | None = None
    accelerators: Accelerators | None = None
    instance_type: str | None = None
    use_spot: bool = False
    disk_size_gb: int = Field(200, ge=8, le=65536)
    image: str | None = None
    ports: list[int] = Field(default_factory=list)
    ssh_cidr: str | None = None
    max_hourly_cost: float | None = Field(None, gt=0, le=MAX_USD_PER_HOUR,   # whole cluster
                                          allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _default_provider(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("provider") is None:
            if data.get("accelerators") in (None, "", "none") and not data.get("instance_type"):
                return {**data, "provider": "local"}
        return data

    @field_validator("accelerators", mode="before")
    @classmethod
    def _acc(cls, v: Any) -> Any:
        return _parse_accelerators(v)

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        for p in v:
            if not 1 <= p <= 65535:
                raise ValueError(f"port {p} is outside 1-65535")
            if p == 22:
                raise ValueError("port 22 is always open to ssh_cidr; list only extra ports")
        return v

    @field_validator("ssh_cidr")
    @classmethod
    def _cidr(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            return str(ipaddress.ip_network(v, strict=False))
        except ValueError:
            raise ValueError(f"'{v}' is not an address range; write e.g. 203.0.113.7/32") from None

    def provider_options_raw(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class Train(_Strict):
    script: str | None = None
    module: str | None = None
    args: list[str] = Field(default_factory=list)
    nproc_per_node: int | Literal["auto"] = "auto"
    rendezvous: Literal["static", "c10d"] = "static"
    max_restarts: int = Field(0, ge=0, le=100)
    master_port: int | None = Field(None, ge=1024, le=65535)

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a for a in v]
        return v

    @field_validator("script")
    @classmethod
    def _script(cls, v: str | None) -> str | None:
        if v is not None:
            _check_path_text(v)
        return v

    @field_validator("nproc_per_node")
    @classmethod
    def _nproc(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 64:
            raise ValueError("must be 'auto' or between 1 and 64")
        return v

    @model_validator(mode="after")
    def _one_entry(self) -> Train:
        if bool(self.script) == bool(self.module):
            raise ValueError("give exactly one of 'script' (a file in workdir) or 'module' (pkg.mod)")
        return self


_REQ_RE = re.compile(r"^torch(\s*(==|>=|<=|~=|<|>|!=)\s*[0-9][0-9A-Za-z.+*]*)?(\s*,\s*(==|>=|<=|~=|<|>|!=)\s*[0-9][0-9A-Za-z.+*]*)*$")


class BootstrapSpec(_Strict):
    """What bootstrap installs where a node lacks it (nothing is reinstalled where present)."""

    torch: str = "torch"
    torch_index: str | None = None
    cuda_toolkit: bool = False
    python: str | None = None  # a Python on the nodes to use first (e.g. a conda env)

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("give the absolute path of a python on the nodes, e.g. /opt/conda/bin/python")
        return v

    @field_validator("torch")
    @classmethod
    def _torch(cls, v: str) -> str:
        if not _REQ_RE.match(v.strip()):
            raise ValueError("write a pip requirement for torch, e.g. 'torch' or 'torch==2.13.0'")
        return v.strip()

    @field_validator("torch_index")
    @classmethod
    def _index(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^\s'\"]+$", v):
            raise ValueError("write the wheel index URL, e.g. https://download.pytorch.org/whl/cu126")
        return v


class Task(_Strict):
    name: str | None = None
    num_nodes: int = Field(1, ge=1, le=512)
    resources: Resources = Field(default_factory=Resources)
    workdir: str | None = None
    file_mounts: dict[str, str] = Field(default_factory=dict)
    envs: dict[str, str] = Field(default_factory=dict)
    setup: str | None = None
    run: str | None = None
    train: Train | None = None
    bootstrap: BootstrapSpec = Field(default_factory=BootstrapSpec)
    outputs: list[str] = Field(default_factory=list)
    outputs_from: Literal["head", "all"] = "head"
    outputs_dir: str = "cloudtrain-outputs"
    max_cost_usd: float | None = Field(None, gt=0, le=MAX_USD,          # this cluster's budget
                                       allow_inf_nan=False)
    max_hours: float | None = Field(None, gt=0, le=MAX_HOURS,           # expected/allowed run
                                    allow_inf_nan=False)
    # Seconds from SIGTERM to SIGKILL when a job is stopped (a failure elsewhere, Ctrl-C, the
    # budget): the time the job has to write its checkpoint.
    stop_grace: float = Field(60, gt=0, le=3600, allow_inf_nan=False)

    # Set by load_task, not by the user: where relative paths start.
    base_dir: Path = Field(default=Path("."), exclude=True)
    # Set by parse_task: the file's name and key lines, so later checks can name the line.
    _located: LocatedYaml | None = PrivateAttr(default=None)
    _source: str = PrivateAttr(default="")

    def line_of(self, *path: Any) -> int | None:
        return self._located.line_of(path) if self._located is not None else None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.match(v):
            raise ValueError("use 1-40 lowercase letters, digits and '-', starting with a letter, "
                             "e.g. my-job")
        return v

    @field_validator("workdir", "outputs_dir")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        if v is not None:
            _check_path_text(v)
        return v

    @field_validator("file_mounts")
    @classmethod
    def _mounts(cls, v: dict[str, str]) -> dict[str, str]:
        for target, local in v.items():
            _check_mount_target(target)
            try:
                _check_path_text(local)
            except ValueError as exc:
                raise ValueError(f"the local path for '{target}': {exc}") from None
        return v

    @field_validator("envs", mode="before")
    @classmethod
    def _envs(cls, v: Any) -> Any:
        if isinstance(v, dict):
            out = {}
            for k, val in v.items():
                if not isinstance(k, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                    raise ValueError(f"'{k}' is not a valid environment variable name")
                if isinstance(val, bool):
                    val = "true" if val else "false"
                elif isinstance(val, (int, float)):
                    val = str(val)
                elif val is None:
                    val = ""
                out[k] = val
            return out
        return v

    @field_validator("outputs")
    @classmethod
    def _outputs(cls, v: list[str]) -> list[str]:
        for p in v:
            _check_path_text(p)
            if p.startswith("/") or ".." in Path(p).parts:
                raise ValueError(f"'{p}': outputs are paths inside workdir, e.g. checkpoints/")
        return v

    @model_validator(mode="after")
    def _run_or_train(self) -> Task:
        if self.run and self.train:
            raise ValueError("give either 'run' or 'train', not both")
        if not self.run and not self.train:
            raise ValueError("give 'run' (a shell script) or 'train' (cloudtrain builds torchrun)")
        return self

    # --- resolved paths -------------------------------------------------------------------

    def workdir_path(self) -> Path | None:
        if self.workdir is None:
            return None
        return (self.base_dir / self.workdir).resolve()

    def outputs_path(self) -> Path:
        return (self.base_dir / self.outputs_dir).resolve()


# ------------------------------------------------------------------------------------------
# Loading and error messages


_MODELS: dict[str, type[BaseModel]] = {"": Task, "resources": Resources, "train": Train}


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


def _clean_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    # pydantic inserts union-branch names ("int", "literal['auto']", "function-after[...]")
    return tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"int", "str"})))


def _error_from_validation(exc: ValidationError, located: LocatedYaml, source: str) -> SpecError:
    errors = exc.errors()
    # Prefer "unknown field" errors: they usually explain the rest.
    errors.sort(key=lambda e: 0 if e["type"] == "extra_forbidden" else 1)
    e = errors[0]
    loc = _clean_loc(tuple(e["loc"]))
    line = located.line_of(loc)
    dotted = ".".join(str(p) for p in loc)
    if e["type"] == "extra_forbidden":
        known = _fields_at(loc[:-1])
        close = get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"Did you mean '{close[0]}'?" if close else (
            f"Known fields here: {', '.join(known)}." if known else "Remove it.")
        return SpecError("unknown field", hint=hint, field=dotted, line=line, source=source)
    msg = e["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if e["type"] == "missing":
        msg = "is required"
    got = e.get("input")
    if e["type"] not in ("missing", "value_error") and not isinstance(got, (dict, list)):
        msg += f" (got {got!r})"
    more = f" ({len(errors) - 1} more problem(s) after this one.)" if len(errors) > 1 else ""
    return SpecError(msg, hint=("Fix it and run again." + more).strip(), field=dotted or "(top)",
                     line=line, source=source)


def parse_task(text: str, source: str = "task.yaml", base_dir: Path | None = None, *,
               known_providers: tuple[str, ...] = ()) -> Task:
    """``known_providers``: names accepted even when not installed (``cost`` prices clouds
    whose provider is not installed yet)."""
    located = load_located(text, source)
    if not isinstance(located.data, dict):
        raise SpecError("the task file must be a mapping of fields (name:, num_nodes:, run: ...)",
                        source=source, line=1, hint="See the task-file reference in the README.")
    _refuse_non_finite(located, source)
    try:
        task = Task.model_validate(located.data)
    except ValidationError as exc:
        raise _error_from_validation(exc, located, source) from None
    task = task.model_copy(update={"base_dir": (base_dir or Path(".")).resolve()})
    task._located, task._source = located, source
    _check_provider_options(task, located, source, known_providers)
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


def _check_provider_options(task: Task, located: LocatedYaml, source: str,
                            known_providers: tuple[str, ...] = ()) -> None:
    from cloudtrain.provider import registry

    extras = task.resources.provider_options_raw()
    known = registry.names()
    for key in extras:
        if key != task.resources.provider:
            line = located.line_of(("resources", key))
            fields = [f for f in Resources.model_fields]
            close = get_close_matches(key, fields + known, n=1, cutoff=0.6)
            if key in known:
                uses = f"'{task.resources.provider}'" if task.resources.provider else "none"
                hint = f"Options for '{key}' apply only with 'provider: {key}'; this task names {uses}."
            else:
                hint = f"Did you mean '{close[0]}'?" if close else \
                    f"Known fields here: {', '.join(fields)}."
            raise SpecError("unknown field", hint=hint, field=f"resources.{key}", line=line,
                            source=source)
    # Unknown provider names are reported now, before anything is created.
    if task.resources.provider is None or task.resources.provider in known_providers:
        return
    try:
        registry.provider_class(task.resources.provider)
    except SpecError:
        raise
    except Exception as exc:  # UserError from the registry
        raise SpecError(getattr(exc, "message", str(exc)), hint=getattr(exc, "hint", ""),
                        field="resources.provider", line=located.line_of(("resources", "provider")),
                        source=source) from None


def provider_options(task: Task) -> BaseModel | None:
    """Validate ``resources.<provider>`` with the provider's own options model."""
    from cloudtrain.provider import registry

    name = task.resources.provider
    if name is None:  # not resolved yet (the planner picks it): nothing to validate against
        return None
    cls = registry.provider_class(name)
    model = getattr(cls, "options_model", None)
    raw = task.resources.provider_options_raw().get(name, {})
    where = {"source": task._source, "line": task.line_of("resources", name)}
    if model is None:
        if raw:
            raise SpecError(f"provider '{name}' takes no options",
                            field=f"resources.{name}", hint="Remove the section.", **where)
        return None
    if raw is None:
        raw = {}
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        e = exc.errors()[0]
        clean = _clean_loc(tuple(e["loc"]))
        loc = ".".join(str(p) for p in clean)
        field = f"resources.{name}" + (f".{loc}" if loc else "")
        where["line"] = task.line_of("resources", name, *clean)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            known = list(model.model_fields)
            close = get_close_matches(str(e["loc"][-1]), known, n=1)
            return_hint = f"Did you mean '{close[0]}'?" if close else f"Known fields: {', '.join(known)}."
            raise SpecError("unknown field", field=field, hint=return_hint, **where) from None
        raise SpecError(msg, field=field, hint="Fix it and run again.", **where) from None


def load_task(path: str | Path, *, known_providers: tuple[str, ...] = ()) -> Task:
    p = Path(path)
    if not p.exists():
        raise SpecError(f"task file '{p}' does not exist",
                        hint="Check the path, or create one with 'cloudtrain init'.")
    if p.is_dir():
        raise SpecError(f"'{p}' is a directory, not a task file", hint="Pass the YAML file itself.")
    try:
        with p.open() as f:     # bounded: a huge file (or /dev/zero) is refused, not read whole
            text = f.read(MAX_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read task file '{p}' ({exc})", hint="Check the file.") from None
    task = parse_task(text, source=str(p), base_dir=p.parent, known_providers=known_providers)
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
    for remote, local in task.file_mounts.items():
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
