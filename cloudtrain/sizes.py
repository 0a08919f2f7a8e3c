"""Size requests in SkyPilot's form: ``resources.cpus`` (vCPUs) and ``resources.memory`` (GB).

``4`` asks for exactly 4, ``4+`` for at least 4 (SkyPilot's meaning of both). Memory may
carry a unit (``32GB+``, ``32GiB``); GB and GiB are taken as the same unit, as SkyPilot's
catalog does. The ranking keeps the offers whose vCPUs and memory the request admits
(``ranking``); on local and ssh nodes (machines the user already has) nothing is checked and
the task file says so in a note (``skytask``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

MAX_CPUS = 4096
MAX_MEMORY_GB = 65536

_RE = re.compile(r"\A\s*([0-9]+(?:\.[0-9]+)?)\s*(gb|gib|g)?\s*(\+)?\s*\Z", re.IGNORECASE)


class SizeAsk(BaseModel):
    """``amount`` (vCPUs or GB), exactly or (``at_least``) at least."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    amount: float
    at_least: bool = False

    def __str__(self) -> str:
        return f"{self.amount:g}{'+' if self.at_least else ''}"

    def admits(self, have: float) -> bool:
        if self.at_least:
            return have >= self.amount - 1e-9
        return math.isclose(have, self.amount, rel_tol=1e-6, abs_tol=1e-6)

    def reject(self, have: float | None, unit: str, field: str) -> str | None:
        """Why an offer with ``have`` (vCPUs or GiB; None: unknown) does not fit, or None."""
        if have is None:
            return f"{unit} unknown (resources.{field} is {self})"
        if self.admits(have):
            return None
        return f"{have:g} {unit} (resources.{field} is {self})"


def parse(value: Any, field: str) -> Any:
    """``4``, ``4+``, ``"32GB+"`` ... as the mapping SizeAsk takes (None stays None);
    ValueError (naming the form to write) for anything else. ``field``: cpus or memory."""
    if value is None or isinstance(value, (dict, SizeAsk)):
        return value
    example = "4 (exactly 4 vCPUs) or 4+ (at least 4)" if field == "cpus" else \
        "32+ (at least 32 GB) or 64 (exactly 64 GB)"
    unit_ok = field == "memory"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"write a number, e.g. {example}")
    m = _RE.match(str(value))
    if m is None or (m.group(2) and not unit_ok):
        raise ValueError(f"'{str(value)[:40]}' is not a size; write e.g. {example}")
    amount = float(m.group(1))
    top = MAX_CPUS if field == "cpus" else MAX_MEMORY_GB
    if not 0 < amount <= top:
        raise ValueError(f"{amount:g} is not more than 0 and at most {top}; write e.g. {example}")
    return {"amount": amount, "at_least": bool(m.group(3))}
