"""What was spent: costs computed from the usage intervals in the state database, and nothing
else.

The cost of an interval is ``hours x hourly_price_per_node x num_nodes``, where the price is
the one recorded when the interval opened (the cluster's launch, or its restart after a stop).
The catalog is never consulted here, so a newer catalog with other prices cannot change what
a past cluster cost. An interval with no recorded price has an unknown cost: it is shown as
such and left out of the totals, never guessed.

A report may cover a window (the last N days): each interval's hours are then clipped to the
window. Open intervals (clusters still running) count up to now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from typing import Iterable

from cloudtrain.schema import RecoveryRow, UsageRow
from cloudtrain.state import State

DAY = 86400.0


@dataclass(frozen=True)
class IntervalCost:
    usage_id: int
    started_at: float
    ended_at: float | None          # None: still open (running)
    end_reason: str | None
    hourly_price_per_node: float | None
    num_nodes: int
    hours: float                    # within the report's window
    cost: float | None              # None: the price is unknown


@dataclass
class ClusterCost:
    """One cluster's life (created -> terminated, with any stop/start in between)."""

    cluster: str
    provider: str
    region: str | None
    zone: str | None
    instance_type: str | None
    accelerators: str | None
    num_nodes: int
    use_spot: bool
    price_at_launch: float | None   # per node-hour, as recorded when the cluster was created
    started_at: float
    ended_at: float | None
    status: str                     # running | stopped | terminated
    end_reason: str | None
    max_cost_usd: float | None
    hours: float = 0.0
    cost: float | None = 0.0        # None when any counted interval has no price
    intervals: list[IntervalCost] = field(default_factory=list)
    confirmed: bool = True          # False: running in the state, its provider not asked
    gpu_hours: float | None = None  # a scheduler's accounting (Slurm's sacct): schedledger.py
    node_hours: float | None = None
    jobs: list[str] = field(default_factory=list)   # the scheduler's allocation job ids


@dataclass
class Report:
    since: float | None             # window start (None: everything recorded)
    until: float                    # "now" of the report
    days: float | None
    clusters: list[ClusterCost]
    total_cost: float               # clusters of known cost only
    total_hours: float
    by_provider: dict[str, float]   # known costs only
    unknown: list[str]              # clusters whose cost is unknown (excluded from totals)

    @property
    def notes(self) -> list[str]:
        out = []
        if self.unknown:
            out.append(f"{len(self.unknown)} cluster(s) with no recorded price are excluded from "
                       f"the totals: {', '.join(self.unknown)}. Their cost is unknown; cloudtrain "
                       "does not re-price past usage from today's catalog.")
        if any(c.status == "running" for c in self.clusters):
            out.append("Running clusters are counted up to now.")
        loose = [c.cluster for c in self.clusters if not c.confirmed]
        if loose:
            out.append(f"Not confirmed with the provider (--offline, or it could not be asked): "
                       f"{', '.join(loose)}; a cluster whose recorded rules stopped it is "
                       "counted up to then ('probably stopped').")
        return out


def interval_window(row: UsageRow, since: float | None, until: float) -> tuple[float, float] | None:
    """The part of ``row`` inside [since, until]; None when they do not overlap. An open
    interval counts up to ``until``."""
    end = until if row.ended_at is None else min(row.ended_at, until)
    start = row.started_at if since is None else max(row.started_at, since)
    if row.ended_at is not None and since is not None and row.ended_at < since:
        return None
    if row.started_at > until:
        return None
    return start, max(start, end)


def cost_of(row: UsageRow, start: float, end: float) -> float | None:
    if row.hourly_price_per_node is None:
        return None
    return (end - start) / 3600.0 * row.hourly_price_per_node * row.num_nodes


def _group_key(row: UsageRow) -> tuple[str, str]:
    # Intervals of one cluster share its creation time; a row from before that was recorded
    # (an old database) stands alone.
    if row.cluster_created_at is not None:
        return row.cluster, repr(row.cluster_created_at)
    return row.cluster, f"u{row.id}"


def build(rows: Iterable[UsageRow], *, now: float | None = None,
          days: float | None = None, unconfirmed: dict[str, float | None] | None = None
          ) -> Report:
    """The report over ``rows`` for the last ``days`` days (None: all of them) ending ``now``.
    ``unconfirmed``: running clusters whose provider was not asked, each with when its rules
    stopped it (its open interval ends there) or None (counted up to now)."""
    until = time.time() if now is None else now
    loose = unconfirmed or {}
    since = None if days is None else until - days * DAY
    groups: dict[tuple[str, str], list[UsageRow]] = {}
    for r in sorted(rows, key=lambda r: (r.started_at, r.id)):
        groups.setdefault(_group_key(r), []).append(r)

    clusters: list[ClusterCost] = []
    for members in groups.values():
        first, last = members[0], members[-1]
        running = any(m.ended_at is None for m in members)
        entry = ClusterCost(
            cluster=first.cluster, provider=first.provider, region=first.region, zone=first.zone,
            instance_type=first.instance_type, accelerators=first.accelerators,
            num_nodes=first.num_nodes, use_spot=first.use_spot,
            price_at_launch=first.hourly_price_per_node, started_at=first.started_at,
            ended_at=None if running else max(m.ended_at or 0.0 for m in members),
            status="running" if running else ("stopped" if last.end_reason == "stopped"
                                              else "terminated"),
            end_reason=None if running else (last.end_reason or "terminated"),
            max_cost_usd=next((m.max_cost_usd for m in reversed(members)
                               if m.max_cost_usd is not None), None))
        stop = loose.get(first.cluster) if running else None
        if running and first.cluster in loose:
            entry.confirmed = False
            if stop is not None:
                entry.status, entry.ended_at = "probably stopped", stop
        for m in members:
            win = interval_window(m, since, until if stop is None or m.ended_at is not None
                                  else min(until, stop))
            if win is None:
                continue
            c = cost_of(m, *win)
            hours = (win[1] - win[0]) / 3600.0
            entry.intervals.append(IntervalCost(
                usage_id=m.id, started_at=m.started_at, ended_at=m.ended_at,
                end_reason=m.end_reason, hourly_price_per_node=m.hourly_price_per_node,
                num_nodes=m.num_nodes, hours=hours, cost=c))
            entry.hours += hours
            if c is None or entry.cost is None:
                entry.cost = None
            else:
                entry.cost += c
        if entry.intervals:
            clusters.append(entry)

    by_provider: dict[str, float] = {}
    unknown = []
    for cc in clusters:
        if cc.cost is None:
            unknown.append(cc.cluster)
            continue
        by_provider[cc.provider] = by_provider.get(cc.provider, 0.0) + cc.cost
    return Report(since=since, until=until, days=days, clusters=clusters,
                  total_cost=sum(by_provider.values()),
                  total_hours=sum(c.hours for c in clusters), by_provider=by_provider,
                  unknown=unknown)


def report(state: State, *, days: float | None = None, now: float | None = None) -> Report:
    # Every row, not only those in the window: a cluster's launch price and start are those of
    # its first interval even when the window cuts it.
    return build(state.usage(), now=now, days=days)


def cluster_spend(state: State, name: str, now: float | None = None) -> float | None:
    """What the cluster called ``name`` (the one that exists now, or the latest of that name)
    has cost so far, every interval of it included; None when a price is unknown."""
    row = state.get_cluster(name)
    return spend_of(name, row.created_at if row is not None else None,
                    state.usage(cluster=name), now=now)


def spend_of(name: str, created_at: float | None, rows: Iterable[UsageRow],
             now: float | None = None) -> float | None:
    """:func:`cluster_spend` over usage rows already read (``rows`` may hold every cluster's):
    ``created_at`` is the creation time of the cluster of that name that exists now (None:
    none exists, the latest one counts)."""
    rows = [r for r in rows if r.cluster == name]
    if not rows:
        return 0.0
    if created_at is not None:
        mine = [r for r in rows if r.cluster_created_at == created_at]
        rows = mine or [r for r in rows if r.ended_at is None]
    else:
        rows = [r for r in rows if _group_key(r) == _group_key(rows[-1])]
    if not rows:
        return 0.0
    rep = build(rows, now=now)
    return rep.clusters[0].cost if rep.clusters else 0.0


# --- spend per day ---------------------------------------------------------------------------

def daily_spend(rows: Iterable[UsageRow], *, now: float | None = None,
                days: float | None = None) -> dict[date, dict[str, float]]:
    """Spend per UTC calendar day and provider, over the same window as :func:`build` (each
    interval split at midnight UTC). Intervals with no price are left out, as from the totals.
    Every day of the window is present, with {} on days nothing was spent."""
    until = time.time() if now is None else now
    since = None if days is None else until - days * DAY
    out: dict[date, dict[str, float]] = {}
    first_day: date | None = None
    for r in rows:
        win = interval_window(r, since, until)
        if win is None:
            continue
        start, end = win
        d0 = _utc_day(start)
        first_day = d0 if first_day is None else min(first_day, d0)
        if r.hourly_price_per_node is None:
            continue
        t = start
        while t < end:
            day = _utc_day(t)
            next_midnight = datetime(day.year, day.month, day.day,
                                     tzinfo=timezone.utc).timestamp() + DAY
            seg_end = min(end, next_midnight)
            c = cost_of(r, t, seg_end) or 0.0
            bucket = out.setdefault(day, {})
            bucket[r.provider] = bucket.get(r.provider, 0.0) + c
            t = seg_end
    if since is not None:
        first_day = _utc_day(since)
    if first_day is not None:
        d, last = first_day, _utc_day(until)
        while d <= last:
            out.setdefault(d, {})
            d += timedelta(days=1)
    return dict(sorted(out.items()))


def _utc_day(ts: float) -> date:
    return datetime.fromtimestamp(ts, tz=timezone.utc).date()


# --- output shapes ---------------------------------------------------------------------------

def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


def to_json(rep: Report) -> dict[str, object]:
    """``cost-report --json``. The contract (docs/cost.md): ``clusters``, each with ``name``,
    ``provider``, ``region``, ``instance_type``, ``nodes``, ``spot``, ``hours``,
    ``price_hourly_usd`` (per node-hour, recorded at launch) and ``cost_usd`` (null: unknown),
    and ``total_usd`` (the clusters of known cost)."""
    return {
        "window": {"days": rep.days, "since": _iso(rep.since), "until": _iso(rep.until)},
        "clusters": [{
            "name": c.cluster, "provider": c.provider, "region": c.region, "zone": c.zone,
            "instance_type": c.instance_type, "accelerators": c.accelerators,
            "nodes": c.num_nodes, "spot": c.use_spot, "hours": _r(c.hours),
            "price_hourly_usd": c.price_at_launch, "cost_usd": _r(c.cost),
            "status": c.status, "end_reason": c.end_reason,
            "max_cost_usd": c.max_cost_usd, "started_at": _iso(c.started_at),
            "ended_at": _iso(c.ended_at), "confirmed": c.confirmed,
            "gpu_hours": _r(c.gpu_hours), "node_hours": _r(c.node_hours),
            "scheduler_jobs": c.jobs,
            "intervals": [{
                "started_at": _iso(i.started_at), "ended_at": _iso(i.ended_at),
                "end_reason": i.end_reason, "price_hourly_usd": i.hourly_price_per_node,
                "nodes": i.num_nodes, "hours": _r(i.hours), "cost_usd": _r(i.cost),
            } for i in c.intervals],
        } for c in rep.clusters],
        "total_usd": _r(rep.total_cost),
        "totals": {"hours": _r(rep.total_hours),
                   "by_provider": {k: _r(v) for k, v in sorted(rep.by_provider.items())},
                   "unknown_cost_clusters": rep.unknown},
        "notes": rep.notes,
    }


CSV_COLUMNS = ("name", "provider", "region", "instance_type", "accelerators", "nodes", "spot",
               "price_hourly_usd", "hours", "cost_usd", "status", "end_reason", "started_at",
               "ended_at", "gpu_hours", "node_hours")
"""The same names as the JSON's clusters (``gpu_hours``/``node_hours``: a scheduler's
accounting, Slurm's sacct; empty elsewhere)."""


def csv_rows(rep: Report) -> list[list[str]]:
    """One row per cluster (header first). An unknown cost is the word "unknown"."""
    def num(x: float | None) -> str:
        return "unknown" if x is None else f"{x:.6f}".rstrip("0").rstrip(".")

    out = [list(CSV_COLUMNS)]
    for c in rep.clusters:
        out.append([c.cluster, c.provider, c.region or "", c.instance_type or "",
                    c.accelerators or "", str(c.num_nodes), "yes" if c.use_spot else "no",
                    num(c.price_at_launch), f"{c.hours:.6f}", num(c.cost), c.status,
                    c.end_reason or "", _iso(c.started_at) or "", _iso(c.ended_at) or "",
                    "" if c.gpu_hours is None else f"{c.gpu_hours:.6f}",
                    "" if c.node_hours is None else f"{c.node_hours:.6f}"])
    return out


def recoveries_json(rows: Iterable[RecoveryRow]) -> list[dict[str, object]]:
    """Each replacement of lost nodes (docs/recovery.md): when (``lost_at``: the last poll
    that saw the nodes running; ``detected_at_unix``: when the cloud said lost), which ranks, the cloud's
    reason, the seconds lost by phase, the dollars (lost work, replacement), and what the
    restarted job could resume from ("restarted from step 0" when nothing). The
    replacement's node-hours are in the cluster's usage intervals like any node's."""
    return [{
        "cluster": r.cluster, "launch_job": r.launch_job, "old_job": r.old_job,
        "new_job": r.new_job, "lost_at": _iso(r.lost_at),
        "detected_at_unix": _r(r.lost_at + (r.detect_s or 0.0), 3), "ranks": r.ranks, "reason": r.reason,
        "status": r.status, "detect_s": _r(r.detect_s, 3), "replace_s": _r(r.replace_s, 3),
        "bootstrap_s": _r(r.bootstrap_s, 3), "sync_s": _r(r.sync_s, 3),
        "restart_s": _r(r.restart_s, 3), "seconds_lost": _r(r.seconds_lost, 3),
        "lost_work_usd": _r(r.lost_work_usd), "replacement_usd": _r(r.replacement_usd),
        "resumed_from": r.resumed_from,
    } for r in rows]


def sweeps_json(state: State) -> list[dict[str, object]]:
    """Each sweep (docs/sweep.md) as one entry: its cluster, when it started, its spend as
    last read (``finished``: that reading was its end; ``stopped``: why it stopped early), and
    one row per trial (state, objective, times, GPUs, node, cost). A trial's
    cost is its GPUs' share of the node's price; the cluster's own cost is in ``clusters``."""
    return [{
        "name": s.name, "cluster": s.cluster, "started_at": _iso(s.started_at),
        "spent_usd": _r(s.spent_usd), "as_of": _iso(s.updated_at),
        "finished": s.finished, "stopped": s.stopped,
        "trials": [{"number": t.number, "state": t.state, "value": t.value, "params": t.params,
                    "started_at": _iso(t.started_at), "ended_at": _iso(t.ended_at),
                    "gpus": [g for g in t.gpus.split(",") if g], "node": t.node,
                    "cost_usd": _r(t.cost_usd)} for t in state.sweep_trials(s.name)],
    } for s in state.sweeps()]


SWEEP_COLUMNS = ("name", "cluster", "started_at", "trials", "complete", "pruned", "fail",
                 "running", "spent_usd", "as_of")
"""``cost-report --csv --sweeps`` and the table's sweeps: one row per sweep, from the same
entries as the JSON's ``sweeps`` (its names; the counts are of its ``trials`` by state)."""


def sweep_rows(sweeps: list[dict[str, object]]) -> list[list[str]]:
    """One row per entry of :func:`sweeps_json` (header first). A spend never read is
    "unknown"."""
    out = [list(SWEEP_COLUMNS)]
    for s in sweeps:
        trials = s.get("trials")
        states = [str(t.get("state")) for t in trials if isinstance(t, dict)] \
            if isinstance(trials, list) else []
        spent = s.get("spent_usd")
        out.append([str(s.get("name")), str(s.get("cluster")), str(s.get("started_at") or ""),
                    str(len(states)), *(str(states.count(k)) for k in
                                        ("complete", "pruned", "fail", "running")),
                    "unknown" if not isinstance(spent, (int, float))
                    else f"{spent:.6f}".rstrip("0").rstrip("."), str(s.get("as_of") or "")])
    return out


def recovery_line(r: RecoveryRow) -> str:
    """One recovery, in words, for ``status`` and ``cost-report``."""
    when = _iso(r.lost_at)
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in (
        ("detect", r.detect_s), ("replace", r.replace_s), ("bootstrap", r.bootstrap_s),
        ("sync", r.sync_s), ("restart", r.restart_s)) if v is not None)
    cost = f"lost work {money(r.lost_work_usd)}, replacement {money(r.replacement_usd)}"
    return (f"{r.cluster}: recovery {r.status.lower()} at {when}: node(s) "
            f"{','.join(map(str, r.ranks))} ({r.reason}); {r.seconds_lost:.1f}s lost"
            + (f" ({phases})" if phases else "") + f"; {cost}; job {r.old_job} -> "
            f"{r.new_job or '-'}" + (f"; {r.resumed_from}" if r.resumed_from else ""))


def money(x: float | None) -> str:
    if x is None:
        return "unknown"
    if abs(x) < 1:
        return f"${x:.4f}"
    return f"${x:,.2f}"
