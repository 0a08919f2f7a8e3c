"""``resources.accelerators``: the GPU model and count per node (``A100:8``, ``{A100: 8}``),
parsed and typed. Used by the task model (``taskmodel``) and ``cost --accelerators``."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


class Accelerators(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    count: int = Field(ge=1, le=64)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip() or v.startswith("-") or len(v) > 64 or _CONTROL_RE.search(v):
            raise ValueError(f"'{v[:40]}' is not a GPU model name; write e.g. A100 or H100")
        return v

    def __str__(self) -> str:
        return f"{self.name}:{self.count}"


def parse_accelerators(value: Any) -> Any:
    """``A100:8``, ``A100`` (one), ``{A100: 8}`` or ``{name: A100, count: 8}`` as the mapping
    :class:`Accelerators` takes; None for none. ValueError names what is wrong."""
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
            raise ValueError("give one GPU model, e.g. {A100: 8} or A100:8 (alternatives are "
                             "not read: any:8 lets the planner pick the model)")
        (name, count), = value.items()
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"the count '{count}' is not a whole number; write e.g. {{{name}: 8}}")
        return {"name": str(name), "count": count}
    if isinstance(value, (list, tuple, set)):
        raise ValueError("give one GPU model, e.g. A100:8 (SkyPilot's list of alternatives is "
                         "not read: any:8 lets the planner pick the model)")
    raise ValueError("expected NAME[:COUNT] (e.g. A100:8) or {NAME: COUNT}")
