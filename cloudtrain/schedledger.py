"""The ledger of a scheduler's clusters (provider: slurm) from the scheduler's own accounting.

The Slurm provider keeps, for each allocation, what ``sacct`` said of it last (elapsed time,
nodes, GPUs from AllocTRES) as a JSON record under ``<home>/ledger/slurm/``. Here those
records replace, for a Slurm cluster, the wall-clock figures of the usage intervals: its
node-hours and GPU-hours are sacct's, and its cost is GPU-hours x the price per GPU-hour
recorded at ``up`` (``resources.slurm.price_per_gpu_hour``). A Slurm cluster with no record
(sacct never answered) keeps the interval figures, priced the same way per node."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cloudtrain.context import Env
    from cloudtrain.ledger import ClusterCost, Report

SLACK_S = 120.0
"""An allocation belongs to a cluster's life if it started within this much of it (the
cluster's row is created around the sbatch; clocks of the login node and here differ)."""


@dataclass(frozen=True)
class Allocation:
    """One allocation's accounting as last read from sacct (``end`` None: it was running at
    ``read_at``)."""

    cluster: str
    job_id: str
    state: str
    nodes: int
    gpus: int
    start: float
    end: float | None
    read_at: float
    node_hours: float
    gpu_hours: float
    price_per_gpu_hour: float

    def share(self, since: float | None, until: float) -> float:
        """The part of its elapsed time inside [since, until] (1.0: all of it)."""
        if since is None:
            return 1.0
        end = self.end if self.end is not None else self.read_at
        if end <= self.start:
            return 1.0 if since <= self.start <= until else 0.0
        lo, hi = max(self.start, since), min(end, until)
        return max(0.0, hi - lo) / (end - self.start)


def load(home: Path) -> list[Allocation]:
    """Every record kept (a record that cannot be read is skipped: it will be read again)."""
    out = []
    for f in sorted((home / "ledger" / "slurm").glob("*.json")):
        try:
            d = json.loads(f.read_text())
            out.append(Allocation(
                cluster=str(d["cluster"]), job_id=str(d["job_id"]), state=str(d["state"]),
                nodes=int(d["nodes"]), gpus=int(d["gpus"]), start=float(d["start"]),
                end=None if d.get("end") is None else float(d["end"]),
                read_at=float(d["read_at"]), node_hours=float(d["node_hours"]),
                gpu_hours=float(d["gpu_hours"]),
                price_per_gpu_hour=float(d.get("price_per_gpu_hour") or 0.0)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _mine(c: ClusterCost, allocs: list[Allocation]) -> list[Allocation]:
    end = c.ended_at
    return [a for a in allocs if a.cluster == c.cluster and a.start >= c.started_at - SLACK_S
            and (end is None or a.start <= end + SLACK_S)]


def apply(rep: Report, allocs: list[Allocation]) -> Report:
    """The report with each Slurm cluster's hours and cost taken from its allocations'
    accounting (clipped to the report's window); totals recomputed."""
    for c in rep.clusters:
        if c.provider != "slurm":
            continue
        mine = _mine(c, allocs)
        if not mine:
            continue
        shares = [(a, a.share(rep.since, rep.until)) for a in mine]
        c.gpu_hours = sum(a.gpu_hours * s for a, s in shares)
        c.node_hours = sum(a.node_hours * s for a, s in shares)
        c.jobs = [a.job_id for a in mine]
        c.cost = sum(a.gpu_hours * s * a.price_per_gpu_hour for a, s in shares)
    rep.by_provider = {}
    rep.unknown = []
    for c in rep.clusters:
        if c.cost is None:
            rep.unknown.append(c.cluster)
        else:
            rep.by_provider[c.provider] = rep.by_provider.get(c.provider, 0.0) + c.cost
    rep.total_cost = sum(rep.by_provider.values())
    return rep


def refresh(env: Env, offline: bool) -> None:
    """Ask sacct now for the running Slurm clusters (as ``status --refresh`` does), so a
    running allocation counts up to now; a failure is a warning, the last record stays."""
    from cloudtrain.errors import CloudtrainError

    if offline:
        return
    for row in env.state.list_clusters():
        if row.provider != "slurm" or row.status not in ("UP", "DEGRADED", "INIT"):
            continue
        try:
            provider = env.provider(row.provider)
            account = getattr(provider, "account", None)
            if callable(account):
                account(row.name)
        except (CloudtrainError, ImportError) as exc:
            env.ui.warn(f"'{row.name}': sacct could not be asked ({exc}); its Slurm figures "
                        "are those last read")
