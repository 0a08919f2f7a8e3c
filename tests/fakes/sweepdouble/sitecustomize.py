"""Test double for helper "cli" of issue 23: a minimal, typed placeholder of
``cloudtrain.sweepspec`` (``SweepSpec``, ``load_sweep``), installed only when the real module
(written by helper "driver") is not in this tree. It is put on PYTHONPATH by
tests/e2e/test_sweep_cli.py and never ships in the product. Once cloudtrain/sweepspec.py
exists, this file does nothing and the tests run against the real one."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, Literal


def _install() -> None:
    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    from cloudtrain.errors import SpecError

    class Objective(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        metric: str
        goal: Literal["minimize", "maximize"] = "minimize"

    class SweepSpec(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        task: str
        cluster: str | None = None
        params: dict[str, dict[str, Any]]
        objective: Objective
        trials: int = Field(ge=1)
        parallel: int | Literal["auto"] = "auto"
        gpus_per_trial: int = Field(1, ge=1)
        sampler: Literal["tpe", "nsga2", "random", "grid"] = "tpe"
        pruner: Literal["median", "hyperband", "none"] = "median"
        max_cost_usd: float | None = Field(None, gt=0)
        trial_hours: float | None = Field(None, gt=0)
        down: bool = False

    def load_sweep(path: str) -> SweepSpec:
        import yaml

        with open(path) as f:
            doc = yaml.safe_load(f)
        try:
            return SweepSpec.model_validate(doc)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise SpecError(str(err["msg"]), "See docs/sweep.md.",
                            field=".".join(str(p) for p in err["loc"]), source=path) from None

    mod = types.ModuleType("cloudtrain.sweepspec")
    mod.SweepSpec = SweepSpec  # type: ignore[attr-defined]  # a module built at run time
    mod.load_sweep = load_sweep  # type: ignore[attr-defined]  # a module built at run time
    sys.modules["cloudtrain.sweepspec"] = mod


try:
    if importlib.util.find_spec("cloudtrain.sweepspec") is None:
        _install()
except ImportError:
    pass
