"""The node guard's policy (docs/guard.md), as the CLI builds and writes it: a frozen record
whose :meth:`Policy.as_dict` is the JSON each node's guard reads (``policy.json``, with the
node's ``rank`` and ``self_stop`` added) and the CLI keeps (``guard-policy.json``,
pipeline/lastseen.py). Written by pipeline/guard.py; the rules that compose across launches
are pipeline/rules.py's. Only the standard library is imported here."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class Policy:
    """What the node guards enforce on a cluster, and what they need to know for it."""

    cluster: str = ""
    idle_minutes: float | None = None
    """The idle stop (None: off)."""
    down: bool = True
    """What a stop does: tear down (True) or power off."""
    max_hours: float | None = None
    """The lifetime, from ``started_at``."""
    grace_s: float | None = None
    """The task's stop_grace: SIGTERM to SIGKILL when the guard stops the jobs."""
    down_on_end: tuple[str, ...] = ()
    """The ``--down`` jobs: the nodes go down once one ended and nothing runs or waits."""
    followed: Mapping[str, float] = field(default_factory=dict)
    """The ``--down`` jobs an attached launch follows, with the grace it leaves itself."""
    recovering: Mapping[str, float] = field(default_factory=dict)
    """``--down`` jobs a ``launch --recover`` stopped on a loss: their end stops the nodes only
    after this time (the CLI replaces the lost nodes meanwhile; its next job takes the rule
    over, pipeline/rules.py ``compose``)."""
    set_by: Mapping[str, Any] = field(default_factory=dict)
    """Which command set each rule (pipeline/rules.py)."""
    max_cost_usd: float | None = None
    budget_grace_s: float | None = None
    """The time the nodes leave an attached launch after the budget was reached."""
    poll_s: float | None = None
    """The guard's loop, seconds (the user's CLOUDTRAIN_GUARD_POLL, else the node's 2 s)."""
    started_at: float | None = None
    lease_at: float | None = None
    """The last CLI contact that wrote it."""
    cluster_hourly_usd: float | None = None
    spent_usd: float = 0.0
    spent_at: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys this version does not know (a policy written by another), kept as they were."""

    def as_dict(self) -> dict[str, Any]:
        """The policy as JSON: what the nodes read and guard-policy.json keeps."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out["down_on_end"] = list(self.down_on_end)
        out["followed"], out["set_by"] = dict(self.followed), asdict_deep(self.set_by)
        out["recovering"] = dict(self.recovering)
        return {**self.extra, **out}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """A policy read back (guard-policy.json): a field of the wrong type is left out."""
        known = {f.name for f in fields(cls)} - {"extra"}
        got: dict[str, Any] = {"extra": {k: v for k, v in data.items() if k not in known}}
        for name in ("idle_minutes", "max_hours", "grace_s", "max_cost_usd", "budget_grace_s",
                     "poll_s", "started_at", "lease_at", "cluster_hourly_usd", "spent_at"):
            got[name] = _num(data.get(name))
        got["spent_usd"] = _num(data.get("spent_usd")) or 0.0
        got["cluster"] = str(data.get("cluster") or "")
        got["down"] = data.get("down", True) is not False
        ends = data.get("down_on_end")
        got["down_on_end"] = tuple(j for j in ends if isinstance(j, str)) \
            if isinstance(ends, list) else ()
        for name in ("followed", "set_by", "recovering"):
            v = data.get(name)
            got[name] = dict(v) if isinstance(v, dict) else {}
        return cls(**got)

    def changed(self, **changes: Any) -> Policy:
        """This policy with ``changes`` (field names; ``down_on_end`` as any sequence)."""
        if "down_on_end" in changes:
            changes["down_on_end"] = tuple(changes["down_on_end"] or ())
        for name in ("followed", "set_by", "recovering"):
            if name in changes:
                changes[name] = dict(changes[name] or {})
        return replace(self, **changes)


def asdict_deep(v: Any) -> Any:
    """Mappings as plain dicts, all the way down (JSON)."""
    if isinstance(v, Mapping):
        return {k: asdict_deep(x) for k, x in v.items()}
    return v


GUARD_POLL_VAR = "CLOUDTRAIN_GUARD_POLL"


def guard_poll() -> float | None:
    """The guard's loop the user set (``CLOUDTRAIN_GUARD_POLL``, seconds), None: the node's
    own 2 s. Bad input (exit 2 naming the variable) is refused when a command opens its
    environment, before anything is created."""
    import os

    from cloudtrain.connection import seconds_setting

    if not os.environ.get(GUARD_POLL_VAR, "").strip():
        return None
    return seconds_setting(GUARD_POLL_VAR, 2.0)
