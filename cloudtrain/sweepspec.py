"""The sweep file: read, typed and validated, with errors that name the field and the line.

``parse_sweep`` turns YAML text into a :class:`Sweep`; ``load_sweep`` reads the file. The
search space (``params:``) is normalised into :class:`Param` records, the form the node-side
driver (``cloudtrain/node/sweep.py``) turns into Optuna distributions: ``Sweep.as_dict()`` is
the JSON the driver reads (docs/sweep.md, "The spec the driver reads").
"""

from __future__ import annotations

import math
import re
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cloudtrain.errors import SpecError
from cloudtrain.names import NAME_RE
from cloudtrain.spec import one_line, top_error, value_error
from cloudtrain.taskmodel import MAX_USD
from cloudtrain.yamlsrc import MAX_BYTES, LocatedYaml, load_located

KINDS = ("loguniform", "uniform", "int", "choice")
SAMPLERS = ("tpe", "nsga2", "random", "grid")
PRUNERS = ("median", "hyperband", "none")
MAX_TRIALS = 100_000
MAX_GRID = 100_000          # the most points a grid may have (an int range counts each value)
_PARAM_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_EXAMPLE = "e.g. lr: {loguniform: [1.0e-5, 1.0e-2]} or batch_size: {choice: [32, 64]}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _bounds(kind: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"{kind} takes two bounds [low, high], e.g. {{{kind}: [0, 1]}}")
    low, high = value
    for b in (low, high):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ValueError(f"the bound {b!r:.40} of {kind} is not a finite number")
    if low > high:
        raise ValueError(f"low {low} is above high {high}; write [low, high] with low <= high")
    return low, high


def _int_param(low: float, high: float, extra: dict[str, Any]) -> dict[str, Any]:
    if not (isinstance(low, int) and isinstance(high, int)):
        raise ValueError(f"int takes whole-number bounds (got [{low}, {high}])")
    log, step = extra.get("log", False), extra.get("step", 1)
    if not isinstance(log, bool):
        raise ValueError(f"log is true or false (got {log!r:.40})")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step is a whole number of at least 1 (got {step!r:.40})")
    if log and low < 1:
        raise ValueError(f"an int range with log: true starts at 1 or above (got low {low})")
    if log and step != 1:
        raise ValueError("an int range takes log: true or a step, not both (Optuna's rule)")
    return {"kind": "int", "low": low, "high": high, "log": log, "step": step}


def _choices(value: Any) -> dict[str, Any]:
    if not isinstance(value, list) or not value:
        raise ValueError("choice takes a non-empty list of values, e.g. {choice: [32, 64, 128]}")
    for v in value:
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise ValueError(f"the choice {v!r:.40} is not a number, string, boolean or null")
    if len({(type(v), v) for v in value}) != len(value):
        raise ValueError("the choice list names a value twice")
    return {"kind": "choice", "choices": tuple(value)}


def _normalise(raw: Any) -> dict[str, Any]:
    """The user's ``{KIND: [...], log:, step:}`` as the fields of :class:`Param`."""
    if not isinstance(raw, dict):
        raise ValueError(f"write a distribution, {_EXAMPLE}")
    kinds = [k for k in raw if k in KINDS]
    unknown = [k for k in raw if k not in KINDS and k not in ("log", "step")]
    if unknown:
        close = get_close_matches(str(unknown[0]), KINDS, n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(f"unknown distribution '{one_line(str(unknown[0]))[:40]}'{hint}; "
                         f"known: {', '.join(KINDS)}")
    if len(kinds) != 1:
        raise ValueError(f"give exactly one distribution ({', '.join(KINDS)}), {_EXAMPLE}")
    kind = kinds[0]
    if kind != "int" and ("log" in raw or "step" in raw):
        raise ValueError(f"log and step go with int only; {kind} takes its bounds alone")
    if kind == "choice":
        return _choices(raw[kind])
    low, high = _bounds(kind, raw[kind])
    if kind == "int":
        return _int_param(low, high, raw)
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"loguniform needs low > 0 (got {low}); use uniform for a range from 0")
    return {"kind": kind, "low": float(low), "high": float(high)}


class Param(_Strict):
    """One searched parameter, normalised: ``kind`` and its bounds or its choices."""

    kind: Literal["loguniform", "uniform", "int", "choice"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: int = 1
    choices: tuple[str | int | float | bool | None, ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_file(cls, raw: Any) -> Any:
        return raw if isinstance(raw, dict) and "kind" in raw else _normalise(raw)

    @property
    def continuous(self) -> bool:
        return self.kind in ("loguniform", "uniform")

    def grid_size(self) -> int:
        if self.choices is not None:
            return len(self.choices)
        assert self.low is not None and self.high is not None
        return int((self.high - self.low) // self.step) + 1

    def as_dict(self) -> dict[str, Any]:
        if self.kind == "choice":
            return {"kind": "choice", "choices": list(self.choices or ())}
        out: dict[str, Any] = {"kind": self.kind, "low": self.low, "high": self.high}
        if self.kind == "int":
            out.update(low=int(self.low or 0), high=int(self.high or 0), log=self.log, step=self.step)
        return out


class Objective(_Strict):
    metric: str = Field(min_length=1, max_length=128)
    goal: Literal["minimize", "maximize"] = "minimize"

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if v.strip() != v or re.search(r"[\x00-\x1f\x7f]", v):
            raise ValueError("the metric is a key of the trial's JSON lines, e.g. val_loss")
        return v


class Sweep(_Strict):
    """A sweep file, validated field by field."""

    task: str = Field(min_length=1, max_length=4096)
    cluster: str | None = None
    params: dict[str, Param]
    objective: Objective
    trials: int = Field(ge=1, le=MAX_TRIALS)
    parallel: Any = "auto"
    gpus_per_trial: int = Field(default=1, ge=1, le=64)
    sampler: Literal["tpe", "nsga2", "random", "grid"] = "tpe"
    pruner: Literal["median", "hyperband", "none"] = "median"
    max_cost_usd: float | None = Field(default=None, gt=0, le=MAX_USD)
    trial_hours: float | None = Field(default=None, gt=0, le=24 * 365, allow_inf_nan=False)
    """How long one trial may take, for the budget's estimate (else the task's max_hours)."""
    down: bool = False
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, v: str | None) -> str | None:
        if v is not None and not NAME_RE.match(v):
            raise ValueError(f"'{one_line(v)[:40]}' is not a cluster name (letters, digits, '-')")
        return v

    @field_validator("params")
    @classmethod
    def _params(cls, v: dict[str, Param]) -> dict[str, Param]:
        if not v:
            raise ValueError(f"name at least one parameter to search, {_EXAMPLE}")
        bad = [k for k in v if not _PARAM_RE.match(str(k))]
        if bad:
            raise ValueError(f"the parameter name '{one_line(str(bad[0]))[:40]}' is not a name "
                             "(letters, digits and '_', not starting with a digit): it becomes "
                             "--NAME and CLOUDTRAIN_PARAM_NAME")
        if len({k.upper() for k in v}) != len(v):
            raise ValueError("two parameter names differ only in case: their "
                             "CLOUDTRAIN_PARAM_ variables would be the same")
        return v

    @field_validator("parallel", mode="before")
    @classmethod
    def _parallel(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 10_000:
            raise ValueError(f"parallel is 'auto' or a whole number from 1 (got {v!r:.40})")
        return v

    @model_validator(mode="after")
    def _grid(self) -> Sweep:
        if self.sampler != "grid":
            return self
        cont = [k for k, p in self.params.items() if p.continuous]
        if cont:
            raise ValueError(f"the grid sampler needs choice or int parameters; '{cont[0]}' is "
                             f"{self.params[cont[0]].kind} (continuous): give it a choice list, "
                             "or use sampler: tpe or random")
        size = math.prod(p.grid_size() for p in self.params.values())
        if size > MAX_GRID:
            raise ValueError(f"the grid has {size} points, over {MAX_GRID}: narrow the ranges")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The JSON the node-side driver reads (with the fields the CLI adds, docs/sweep.md)."""
        return {"task": self.task, "cluster": self.cluster,
                "params": {k: p.as_dict() for k, p in self.params.items()},
                "objective": {"metric": self.objective.metric, "goal": self.objective.goal},
                "trials": self.trials, "parallel": self.parallel,
                "gpus_per_trial": self.gpus_per_trial, "sampler": self.sampler,
                "pruner": self.pruner, "max_cost_usd": self.max_cost_usd, "down": self.down,
                "seed": self.seed}


def _where(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic error location without the union-branch names it inserts."""
    return tuple(p for p in loc if not (isinstance(p, str) and "[" in p))


def _error(exc: ValidationError, located: LocatedYaml, source: str) -> SpecError:
    errors = sorted(exc.errors(), key=lambda e: 0 if e["type"] == "extra_forbidden" else 1)
    e = errors[0]
    loc = _where(tuple(e["loc"]))
    dotted = ".".join(str(p) for p in loc)
    line = located.line_of(loc) if loc else 1
    if e["type"] == "extra_forbidden":
        known = [n for n in Sweep.model_fields] if len(loc) == 1 else list(Objective.model_fields)
        close = get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"Did you mean '{close[0]}'?" if close else f"Known fields here: {', '.join(known)}."
        return SpecError("unknown field", hint=hint, field=dotted, line=line, source=source)
    if not dotted:   # the sweep's one rule between fields: the grid's (_grid)
        return top_error(e, len(errors), list(Sweep.model_fields), located, source,
                         named=["sampler", "params"])
    return value_error(e, len(errors), dotted, line, source)


def parse_sweep(text: str, source: str = "sweep.yaml") -> Sweep:
    """The sweep in ``text``, typed and validated (the task file it names is not read here)."""
    located = load_located(text, source)
    if not isinstance(located.data, dict):
        raise SpecError("the sweep file must be a mapping of fields (task:, params:, "
                        "objective:, trials: ...)", source=source, line=1,
                        hint="See docs/sweep.md for the file format.")
    try:
        return Sweep.model_validate(located.data)
    except ValidationError as exc:
        raise _error(exc, located, source) from None


def load_sweep(path: Path) -> Sweep:
    """The sweep file at ``path``; ``task:`` is resolved against the file's folder."""
    try:
        raw = path.read_bytes()[:MAX_BYTES + 1]
        text = raw.decode("utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read the sweep file: {exc.strerror}", source=str(path),
                        hint="Check the path.") from None
    except UnicodeDecodeError:
        raise SpecError("the sweep file is not UTF-8 text", source=str(path),
                        hint="Save it as UTF-8.") from None
    sweep = parse_sweep(text, str(path))
    task = Path(sweep.task)
    if not task.is_absolute():
        task = (path.parent / task).resolve()
    return sweep.model_copy(update={"task": str(task)})
