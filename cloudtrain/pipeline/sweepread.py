"""Reading a sweep from the laptop (docs/sweep.md): ``sweep status``, ``sweep results``,
``sweep cancel``. The head's driver (cloudtrain/node/sweep.py) answers one JSON document
(``status``/``results``); this module turns it into typed, frozen records, adds the money
(each trial's share of the cluster's price: its GPUs' share of the cluster's slots for its
duration) and renders it (table, JSON, CSV; the plot is pipeline/sweepplot.py)."""

from __future__ import annotations

import csv
import io
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloudtrain.pipeline import sweepnode
from cloudtrain.pipeline.sweep import find_record
from cloudtrain.schema import SweepRow, SweepTrialRow

if TYPE_CHECKING:
    from cloudtrain.context import Env

STATES = ("running", "complete", "pruned", "fail", "waiting")


def _num(d: dict[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` that holds a number."""
    for key in keys:
        v = d.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


@dataclass(frozen=True)
class Trial:
    """One trial as the driver reports it, with its cost."""

    number: int
    state: str
    params: dict[str, Any]
    value: float | None
    intermediates: int
    started_at: float | None
    ended_at: float | None
    duration_s: float | None
    gpus: tuple[str, ...]
    node: str | None
    """The node (its host name, as the driver names it) the trial ran on."""
    cost_usd: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"number": self.number, "state": self.state, "params": self.params,
                "value": self.value, "intermediates": self.intermediates,
                "started_at": self.started_at, "ended_at": self.ended_at,
                "duration_s": self.duration_s, "gpus": list(self.gpus), "node": self.node,
                "cost_usd": self.cost_usd}


def slot_price(rec: SweepRow) -> float | None:
    """$/h of one GPU slot: the node's price over its slots."""
    return None if rec.hourly_price is None else rec.hourly_price / max(1, rec.slots_per_node)


def trial_of(d: dict[str, Any], price: float | None, now: float) -> Trial:
    started, ended = _num(d, "started", "started_at"), _num(d, "ended", "ended_at")
    dur = _num(d, "duration_s")
    if dur is None and started is not None:
        dur = (ended or now) - started
    gpus = tuple(str(g) for g in d.get("gpus") or [])
    cost = None if price is None or dur is None else price * max(1, len(gpus)) * dur / 3600
    node = d.get("node")
    return Trial(int(d.get("number", -1)), str(d.get("state") or "?").lower(),
                 dict(d.get("params") or {}), _num(d, "value"),
                 int(_num(d, "intermediate", "intermediates") or 0),
                 started, ended, dur, gpus, None if node is None else str(node),
                 None if cost is None else round(cost, 6))


@dataclass(frozen=True)
class Results:
    """A sweep's trials, its best, its money."""

    record: SweepRow
    trials: tuple[Trial, ...]
    best: int | None
    spent_usd: float | None
    estimate_usd: float | None
    finished: bool

    def count(self, state: str) -> int:
        return sum(1 for t in self.trials if t.state == state)

    def as_dict(self) -> dict[str, Any]:
        return {"sweep": self.record.name, "cluster": self.record.cluster,
                "trials_asked": self.record.spec.get("trials"),
                "counts": {s: self.count(s) for s in STATES}, "best": self.best,
                "spent_usd": self.spent_usd, "estimate_usd": self.estimate_usd,
                "finished": self.finished, "trials": [t.as_dict() for t in self.trials]}


def estimate_to_end(rec: SweepRow, trials: tuple[Trial, ...], spent: float | None) -> float | None:
    """Spend so far plus the trials left, at the mean duration of the ended ones, on their
    share of the cluster."""
    price = slot_price(rec)
    ended = [t for t in trials if t.ended_at is not None and t.duration_s is not None]
    if price is None or spent is None or not ended:
        return spent
    left = max(0, int(rec.spec.get("trials") or 0) - len(ended))
    mean_h = sum(t.duration_s or 0.0 for t in ended) / len(ended) / 3600
    per = int(rec.spec.get("gpus_per_trial") or 1)
    return round(spent + left * mean_h * price * per, 6)


def sweep_spend(rec: SweepRow, trials: tuple[Trial, ...]) -> float | None:
    """What the sweep has cost: its trials' costs (None when the price is unknown)."""
    costs = [t.cost_usd for t in trials if t.cost_usd is not None]
    return round(math.fsum(costs), 6) if slot_price(rec) is not None else None


def read(env: Env, name: str, cmd: str = "results") -> Results:
    """Sweep ``name``: the driver's document, read from the head and kept in the ledger (the
    sweep's spend and its per-trial rows); once its cluster is gone (``down: true``), the
    ledger's last reading."""
    from cloudtrain.cluster import get_handle

    from cloudtrain.pipeline.guard import reconcile

    rec = find_record(env, name)
    reconcile(env, rec.cluster)          # nodes that went down by themselves (down: true)
    if env.state.get_cluster(rec.cluster) is None:
        return from_ledger(rec, env.state.sweep_trials(name))
    handle = get_handle(env, rec.cluster)
    group = sweepnode.head_group(handle)
    try:
        doc = sweepnode.document(handle, group, "results", name)   # status counts trials too
    finally:
        group.close()
    res = parsed(rec, doc)
    env.state.set_sweep_trials(name, res.spent_usd, ledger_rows(res))
    return res


def ledger_rows(res: Results) -> list[SweepTrialRow]:
    return [SweepTrialRow(res.record.name, t.number, t.state, t.value, t.started_at, t.ended_at,
                          ",".join(t.gpus), t.node, t.cost_usd, t.params) for t in res.trials]


def from_ledger(rec: SweepRow, rows: list[SweepTrialRow]) -> Results:
    """The sweep as the ledger last saw it (its cluster is gone: nothing runs any more)."""
    trials = tuple(Trial(r.number, r.state, r.params, r.value, 0, r.started_at, r.ended_at,
                         None if r.started_at is None or r.ended_at is None
                         else r.ended_at - r.started_at,
                         tuple(g for g in r.gpus.split(",") if g), r.node, r.cost_usd)
                   for r in rows)
    done = [t for t in trials if t.state == "complete" and t.value is not None]
    goal = str((rec.spec.get("objective") or {}).get("goal", "minimize"))
    pick = min if goal.startswith("min") else max
    best = pick(done, key=lambda t: t.value or 0.0).number if done else None
    return Results(rec, trials, best, rec.spent_usd, rec.spent_usd, True)


def parsed(rec: SweepRow, doc: dict[str, Any]) -> Results:
    now, price = time.time(), slot_price(rec)
    listed = doc.get("trials_list", doc.get("trials"))
    trials = tuple(trial_of(d, price, now) for d in (listed if isinstance(listed, list) else [])
                   if isinstance(d, dict))
    best = doc.get("best")
    best_n = best.get("number") if isinstance(best, dict) else best
    spent = sweep_spend(rec, trials)
    return Results(rec, trials, best_n if isinstance(best_n, int) else None, spent,
                   estimate_to_end(rec, trials, spent), bool(doc.get("finished")))


def cancel(env: Env, name: str) -> str:
    """Stop the sweep on the head (running trials get SIGTERM and their grace)."""
    from cloudtrain.cluster import get_handle

    rec = find_record(env, name)
    handle = get_handle(env, rec.cluster)
    group = sweepnode.head_group(handle)
    try:
        said = sweepnode.on_head(handle, group, "cancel", name).strip()
    finally:
        group.close()
    return cancel_words(name, said)


def cancel_words(name: str, said: str) -> str:
    """What ``sweep cancel`` says: the driver's stop reason and the trials it stops (its
    JSON answer), or its words as they are."""
    import json

    try:
        doc = json.loads(said.splitlines()[-1]) if said else {}
    except json.JSONDecodeError:
        return said
    if not isinstance(doc, dict) or not doc.get("stopped"):
        return said or f"Sweep {name} cancelled."
    running = (doc.get("counts") or {}).get("running") if isinstance(doc.get("counts"), dict) \
        else None
    tail = f"; {running} running trial(s) get SIGTERM and their stop_grace" if running else ""
    return f"Sweep {name} stopped: {doc['stopped']}{tail}."


def bar(done: int, total: int, width: int = 30) -> str:
    total = max(total, 1)
    filled = min(width, round(width * done / total))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def status_lines(res: Results) -> list[str]:
    """``sweep status``: the counts, the progress bar, the best, the money."""
    total = int(res.record.spec.get("trials") or len(res.trials))
    ended = res.count("complete") + res.count("pruned") + res.count("fail")
    lines = [f"Sweep {res.record.name} on cluster {res.record.cluster}"
             + (" (finished)" if res.finished else ""),
             bar(ended, total),
             "  ".join(f"{s}: {res.count(s)}" for s in ("running", "complete", "pruned", "fail"))]
    best = next((t for t in res.trials if t.number == res.best), None)
    if best is not None:
        lines.append(f"best: trial {best.number} = {best.value} with {best.params}")
    lines.append(f"spent: {money(res.spent_usd)}, estimate to the end: {money(res.estimate_usd)}")
    return lines


def money(x: float | None) -> str:
    return "unknown" if x is None else f"${x:.4f}"


COLUMNS = ("trial", "state", "value", "duration_s", "gpus", "node", "cost_usd", "params")


def rows(res: Results) -> list[list[str]]:
    """One row per trial (the best marked), for the table and the CSV."""
    out = []
    for t in res.trials:
        mark = "*" if t.number == res.best else ""
        out.append([f"{t.number}{mark}", t.state, "" if t.value is None else f"{t.value:g}",
                    "" if t.duration_s is None else f"{t.duration_s:.1f}", ",".join(t.gpus),
                    t.node or "",
                    "" if t.cost_usd is None else f"{t.cost_usd:.6f}",
                    " ".join(f"{k}={v}" for k, v in sorted(t.params.items()))])
    return out


def table(res: Results) -> str:
    body = [list(COLUMNS)] + rows(res)
    widths = [max(len(r[i]) for r in body) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body)


def csv_text(res: Results) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    w.writerows(rows(res))
    return buf.getvalue()
