"""A sweep's results as records (docs/sweep.md, "Reading a sweep"): the driver's JSON document
(``sweep.py results`` on the head, or the ``results.json`` the head left) turned into typed,
frozen records with the money (each trial's share of the cluster's price: its GPUs' share of
the node's slots for its duration), the ledger's rows, and what is kept of a sweep whose
cluster goes down (:func:`keep_final`). Reading from the head is pipeline/sweepread.py."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloudtrain.schema import SweepEnd, SweepRow, SweepTrialRow

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
    stopped: str | None = None
    """Why the sweep stopped early (the driver's words), when it did."""
    as_of: float | None = None
    """When this reading was made (None: read from the head just now)."""
    gone: str | None = None
    """The cluster is gone (why, as the ledger says): the reading is the ledger's."""

    @property
    def incomplete(self) -> bool:
        """The cluster went down before the sweep's end was read: what happened after this
        reading went with the nodes."""
        return self.gone is not None and not self.finished

    def count(self, state: str) -> int:
        return sum(1 for t in self.trials if t.state == state)

    def as_dict(self) -> dict[str, Any]:
        return {"sweep": self.record.name, "cluster": self.record.cluster,
                "trials_asked": self.record.spec.get("trials"),
                "counts": {s: self.count(s) for s in STATES}, "best": self.best,
                "spent_usd": self.spent_usd, "estimate_usd": self.estimate_usd,
                "finished": self.finished, "stopped": self.stopped, "as_of": self.as_of,
                "cluster_gone": self.gone, "incomplete": self.incomplete,
                "trials": [t.as_dict() for t in self.trials]}


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


def ledger_rows(res: Results) -> list[SweepTrialRow]:
    return [SweepTrialRow(res.record.name, t.number, t.state, t.value, t.started_at, t.ended_at,
                          ",".join(t.gpus), t.node, t.cost_usd, t.params) for t in res.trials]


def from_ledger(rec: SweepRow, rows: list[SweepTrialRow], gone: str) -> Results:
    """The sweep as the ledger last saw it (its cluster is gone, ``gone`` says why): final
    when that reading was the sweep's end, else :attr:`Results.incomplete`."""
    trials = tuple(Trial(r.number, r.state, r.params, r.value, 0, r.started_at, r.ended_at,
                         None if r.started_at is None or r.ended_at is None
                         else r.ended_at - r.started_at,
                         tuple(g for g in r.gpus.split(",") if g), r.node, r.cost_usd)
                   for r in rows)
    done = [t for t in trials if t.state == "complete" and t.value is not None]
    goal = str((rec.spec.get("objective") or {}).get("goal", "minimize"))
    pick = min if goal.startswith("min") else max
    best = pick(done, key=lambda t: t.value or 0.0).number if done else None
    return Results(rec, trials, best, rec.spent_usd, rec.spent_usd, rec.finished, rec.stopped,
                   rec.updated_at, gone)


def parsed(rec: SweepRow, doc: dict[str, Any]) -> Results:
    now, price = time.time(), slot_price(rec)
    listed = doc.get("trials_list", doc.get("trials"))
    trials = tuple(trial_of(d, price, now) for d in (listed if isinstance(listed, list) else [])
                   if isinstance(d, dict))
    best = doc.get("best")
    best_n = best.get("number") if isinstance(best, dict) else best
    spent = sweep_spend(rec, trials)
    stopped = doc.get("stopped")
    return Results(rec, trials, best_n if isinstance(best_n, int) else None, spent,
                   estimate_to_end(rec, trials, spent), bool(doc.get("finished")),
                   str(stopped)[:1000] if stopped else None)


def keep(env: Env, res: Results, as_of: float | None = None) -> None:
    """A reading into the ledger: the sweep's spend, its per-trial rows, whether it was the
    end."""
    env.state.set_sweep_trials(res.record.name, res.spent_usd, ledger_rows(res),
                               SweepEnd(res.finished, res.stopped, as_of))


# -- what is kept when the cluster goes down -------------------------------------------------

MAX_DOC = 16 * 1024 * 1024      # a node's results.json is untrusted: read at most this much


def keep_final(env: Env, cluster: str) -> list[str]:
    """Before a cluster whose nodes stopped themselves is removed (pipeline/guard.py
    ``reconcile``): for each sweep on it whose end was never read, the ``results.json`` its
    head driver left (at each trial's end and at its own end), into the ledger. Only where the
    head's disk is on this machine (the local provider); on a cloud the disk goes with the
    node and ``sweep status`` says the end was not read. Returns the sweeps kept."""
    out = []
    for rec in env.state.sweeps():
        if rec.cluster != cluster or rec.finished:
            continue
        doc = head_file(env, cluster, rec.name)
        if doc is None:
            continue
        written = _num(doc, "written_at")          # untrusted: a time up to now, or none
        keep(env, parsed(rec, doc), written if written is not None
             and rec.started_at <= written <= time.time() + 60 else None)
        out.append(rec.name)
    return out


def head_file(env: Env, cluster: str, name: str) -> dict[str, Any] | None:
    """The head's ``.cloudtrain/sweeps/NAME/results.json`` when its folder is on this machine
    (a local node, under ``CLOUDTRAIN_HOME/clusters/CLUSTER``); None otherwise or when it is
    missing, too large, or not a JSON object."""
    row = env.state.get_cluster(cluster)
    if row is None or row.provider != "local" or not row.nodes:
        return None
    head = min(row.nodes, key=lambda n: n.rank)
    mine = env.cluster_dir(cluster).resolve()
    path = (Path(head.root_dir) / ".cloudtrain" / "sweeps" / name / "results.json").resolve()
    if mine not in path.parents or not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_DOC + 1)
        doc = json.loads(raw) if len(raw) <= MAX_DOC else None
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


