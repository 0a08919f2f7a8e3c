"""The cluster's rules, composed across launches (docs/guard.md, "Rules that compose").

The budget and the job-end stops are the cluster's, kept in its saved guard policy
(``CLOUDTRAIN_HOME/clusters/NAME/guard-policy.json``, written by pipeline/guard.py ``save``),
so they compose across CLI invocations:

- **budget** (``max_cost_usd``): a launch without one keeps it; a launch with one takes the
  stricter (lower) of the two; only ``launch --no-budget`` or ``cloudtrain budget NAME
  --max-cost X | --off`` lift or raise it;
- **job end** (``down_on_end``): every ``--down`` job is added, none removed by a later
  launch: the nodes go down once such a job has ended and nothing runs or waits in the queue;
- ``recovering``: a ``--down`` job that ``launch --recover`` stopped on a loss, held until a
  time (:func:`held`): the survivors wait for the replacement instead of going down at its end;
  the recovery's next job **supersedes** it (``LaunchRules.supersedes``: the stopped job's
  rules go, the new job's come);
- ``followed``: the ``--down`` jobs an attached launch follows, with the grace it leaves the
  CLI (``job_end_grace_s``) before the nodes act alone (see :mod:`cloudtrain.pipeline.follower`);
- ``set_by``: for each rule, which command set it (``{"max_cost_usd": Origin, "down_on_end":
  {job: Origin}}``, an Origin being ``{"command", "job", "at"}``).

Only the standard library is imported here (a plain ``status`` reads it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloudtrain.budget import Budget


COMPOSED = ("max_cost_usd", "down_on_end", "followed", "set_by", "recovering")  # compose() writes


@dataclass(frozen=True)
class LaunchRules:
    """What one launch asks of the cluster's rules."""
    job_id: str
    budget_usd: float | None      # the launch's own budget (task or --max-cost), if any
    budget_from: str              # "--max-cost" / "max_cost_usd" / ""
    no_budget: bool               # --no-budget: lift the cluster's budget
    down: bool                    # --down
    attached_grace_s: float | None  # the grace an attached launch leaves itself; None with -d
    supersedes: str | None = None   # launch --recover: the job this one restarts after a loss


def origin(command: str, job: str | None = None) -> dict[str, Any]:
    return {"command": command, "job": job, "at": time.time()}


def compose(pol: dict[str, Any], launch: LaunchRules) -> dict[str, Any]:
    """The changes a launch makes to the saved policy ``pol`` (see the module's rules)."""
    set_by = dict(pol.get("set_by") or {})
    old = pol.get("max_cost_usd")
    changes: dict[str, Any] = {}
    if launch.no_budget:
        changes["max_cost_usd"] = None
        set_by["max_cost_usd"] = origin("launch --no-budget", launch.job_id)
    elif launch.budget_usd is not None and (old is None or launch.budget_usd < old):
        changes["max_cost_usd"] = launch.budget_usd
        set_by["max_cost_usd"] = origin(f"launch ({launch.budget_from})", launch.job_id)
    gone = launch.supersedes
    downs = [j for j in pol.get("down_on_end") or [] if isinstance(j, str) and j != gone]
    followed = {j: g for j, g in dict(pol.get("followed") or {}).items() if j != gone}
    by_job = {j: o for j, o in dict(set_by.get("down_on_end") or {}).items() if j != gone}
    recovering = {j: t for j, t in dict(pol.get("recovering") or {}).items() if j != gone}
    if launch.down:
        downs.append(launch.job_id)
        by_job[launch.job_id] = origin("launch --down" + ("" if launch.attached_grace_s
                                                          is not None else " -d"), launch.job_id)
        if launch.attached_grace_s is not None:
            followed[launch.job_id] = launch.attached_grace_s
    set_by["down_on_end"] = by_job
    changes.update(down_on_end=downs, followed=followed, set_by=set_by, recovering=recovering)
    return changes


def held(pol: dict[str, Any], job_id: str, until: float) -> dict[str, Any]:
    """The changes that hold a ``--down`` job a recovery stops: its end stops the nodes only
    after ``until`` (nothing when it is no ``--down`` job)."""
    if job_id not in (pol.get("down_on_end") or []):
        return {}
    return {"recovering": {**dict(pol.get("recovering") or {}), job_id: until}}


def budget_change(pol: dict[str, Any], max_cost: float | None) -> dict[str, Any]:
    """``cloudtrain budget NAME --max-cost X`` (or ``--off``: None): the changes."""
    set_by = dict(pol.get("set_by") or {})
    set_by["max_cost_usd"] = origin("budget --off" if max_cost is None
                                    else f"budget --max-cost {max_cost:g}")
    return {"max_cost_usd": max_cost, "set_by": set_by}


def in_force(pol: dict[str, Any], limit: Budget | None, no_budget: bool) -> Budget | None:
    """The budget a launch runs under: the stricter of the cluster's and the launch's; the
    cluster's when the launch has none; none with --no-budget."""
    from dataclasses import replace

    from cloudtrain.budget import Budget

    kept = pol.get("max_cost_usd")
    if no_budget or not isinstance(kept, (int, float)):
        return None if no_budget else limit
    if limit is None:
        return Budget(float(kept), None, "")
    return limit if limit.max_cost_usd <= kept else replace(limit, max_cost_usd=float(kept))


def _who(o: Any) -> str:
    if not isinstance(o, dict):
        return "set before rules were recorded"
    job = f" {o['job']}" if o.get("job") else ""
    cmd = str(o.get("command") or "?")
    return f"set by {cmd.split(' ', 1)[0]}{job}" + (f" {cmd.split(' ', 1)[1]}"
                                                    if " " in cmd else "")


def view(pol: dict[str, Any]) -> dict[str, Any]:
    """The rules in force and who set each, for ``status --json``."""
    set_by = pol.get("set_by") or {}
    by_job = set_by.get("down_on_end") or {}
    cap = pol.get("max_cost_usd")
    return {
        "budget": None if cap is None else {"max_cost_usd": cap,
                                            "set_by": set_by.get("max_cost_usd")},
        "down_on_end": [{"job": j, "set_by": by_job.get(j),
                         "attached": j in (pol.get("followed") or {})}
                        for j in pol.get("down_on_end") or []],
        "idle_minutes": pol.get("idle_minutes"),
        "max_hours": pol.get("max_hours"),
    }


def budget_words(pol: dict[str, Any]) -> str:
    cap = pol.get("max_cost_usd")
    if cap is None:
        return "no budget"
    return f"budget ${cap:.4f} ({_who((pol.get('set_by') or {}).get('max_cost_usd'))})"


def words(pol: dict[str, Any]) -> str:
    """The rules in one line, for a plain ``status``."""
    by_job = (pol.get("set_by") or {}).get("down_on_end") or {}
    parts = [budget_words(pol)]
    for j in pol.get("down_on_end") or []:
        parts.append(f"down once job {j} has ended and nothing runs or waits "
                     f"({_who(by_job.get(j))})")
    return "rules: " + "; ".join(parts)

