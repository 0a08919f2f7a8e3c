"""When a cluster's recorded rules must have stopped it, from this machine's files alone (for a
plain ``status`` and ``cost-report --offline``: no SSH, no provider call; docs/guard.md). The
node guard (cloudtrain/node/guard.py) applies the same rules on the nodes:

- lifetime: ``started_at + max_hours``;
- budget: when ``spent_usd`` at ``spent_at`` plus ``cluster_hourly_usd`` since reaches
  ``max_cost_usd`` (plus ``budget_grace_s``, the time the nodes leave an attached launch);
- job end (``launch --down``): ``job_end_grace_s`` after the end the CLI saw of a job in
  ``down_on_end`` (``logs`` followed it to its end), when no other launch of the cluster is
  still running or queued;
- idle: ``idle_minutes`` after the later of the last contact and the last moment the CLI knew
  nothing was running (``idle_at``: a fresh up, or guards seen idle; a launch since clears
  it: work may have started), or the end of the last launch when none is running or queued
  (an attached launch that returned, a ``-d`` job followed to its end). A session the user
  opened outside cloudtrain (plain ssh, VS Code) is not known here: the words say "probably".

Only the standard library."""

from __future__ import annotations

from typing import Any


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def lifetime(pol: dict[str, Any]) -> float | None:
    hours, start = _num(pol.get("max_hours")), _num(pol.get("started_at"))
    return None if hours is None or start is None else start + hours * 3600


def budget(pol: dict[str, Any]) -> float | None:
    cap, hourly = _num(pol.get("max_cost_usd")), _num(pol.get("cluster_hourly_usd"))
    if cap is None or not hourly:
        return None
    spent, at = _num(pol.get("spent_usd")) or 0.0, _num(pol.get("spent_at"))
    if at is None:
        return None
    return at + max(0.0, cap - spent) / hourly * 3600 + (_num(pol.get("budget_grace_s")) or 0.0)


def idle(pol: dict[str, Any], contact: dict[str, Any], ended: dict[str, float]) -> float | None:
    """``ended``: the launches' ends the CLI saw, when none runs or waits: after the last one
    nothing of cloudtrain's ran (an attached launch that returned, a job followed to its end)."""
    minutes = _num(pol.get("idle_minutes"))
    known = [t for t in (_num(contact.get("idle_at")), max(ended.values(), default=None))
             if t is not None]
    if not minutes or not known:
        return None
    idle_at = max(known)
    lease = max(_num(contact.get("at")) or 0.0, _num(pol.get("lease_at")) or 0.0)
    return max(idle_at, lease) + minutes * 60


def job_end(pol: dict[str, Any], ended: dict[str, float]) -> float | None:
    """``ended``: job id -> when the CLI saw it end (only when nothing else runs or waits)."""
    seen = [ended[j] for j in pol.get("down_on_end") or [] if isinstance(j, str) and j in ended]
    return min(seen) + (_num(pol.get("job_end_grace_s")) or 0.0) if seen else None


def expected(pol: dict[str, Any], contact: dict[str, Any], ended: dict[str, float] | None = None,
             powers_off: bool = True) -> tuple[float, str] | None:
    """(epoch, reason) of the earliest stop the rules make certain, or None."""
    if not pol or not powers_off:
        return None                 # the ssh provider's hosts are never powered off
    found = [(t, why) for t, why in ((lifetime(pol), "lifetime"), (budget(pol), "budget"),
                                     (job_end(pol, ended or {}), "job-end"),
                                     (idle(pol, contact, ended or {}), "idle"))
             if t is not None]
    return min(found) if found else None
