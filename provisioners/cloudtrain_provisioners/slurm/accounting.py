"""The ledger's Slurm figures, from Slurm's own accounting: ``sacct -X`` on the allocation job
gives its elapsed seconds, its node count and its AllocTRES (``gres/gpu=N``: the GPUs of the
whole allocation), so node-hours and GPU-hours are what the site itself will charge, not our
wall clock. Each read is kept as one JSON record per allocation under
``<home>/ledger/slurm/`` (the cluster's own folder goes at ``down``); ``cost-report`` reads
them (cloudtrain.ledger.slurm_usage) and prices GPU-hours at ``price_per_gpu_hour``."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from cloudtrain.errors import ProviderError

from cloudtrain_provisioners.slurm.login import Login

FIELDS = "JobID,ElapsedRaw,NNodes,AllocTRES,State,Start,End"
_GPUS = re.compile(r"(?:^|,)gres/gpu=(\d+)(?:,|$)")


@dataclass(frozen=True)
class AllocationUsage:
    """One allocation as sacct accounts it (``end`` None: still running, counted to
    ``read_at``); ``cost`` None when no price is set (price 0 gives 0.0)."""

    cluster: str
    job_id: str
    login: str
    state: str
    nodes: int
    gpus: int                 # of the whole allocation (AllocTRES gres/gpu)
    start: float
    end: float | None
    elapsed_s: int
    node_hours: float
    gpu_hours: float
    price_per_gpu_hour: float
    cost: float
    read_at: float


def _when(text: str) -> float | None:
    """sacct's Start/End (the login node's local time; 'Unknown' or 'None' while unset)."""
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def gpus_of(tres: str) -> int:
    """The GPU count in AllocTRES (``billing=2,cpu=2,gres/gpu=2,node=2``; 0: none)."""
    m = _GPUS.search(tres)
    return int(m.group(1)) if m else 0


def read(login: Login, cluster: str, job_id: str, price: float) -> AllocationUsage | None:
    """The allocation's usage as sacct has it now (None: sacct has no line for the job yet)."""
    r = login.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", FIELDS])
    if not r.ok:
        raise ProviderError(f"sacct -j {job_id} on {login.where} failed: {r.words()}",
                            "Slurm accounting (slurmdbd) must answer for the ledger; check "
                            "'sacct' there, then run 'cloudtrain cost-report' again.")
    for line in r.out.splitlines():
        f = line.split("|")
        if len(f) < 7 or f[0].strip() != job_id:
            continue
        elapsed = int(f[1]) if f[1].strip().isdigit() else 0
        nodes = int(f[2]) if f[2].strip().isdigit() else 0
        gpus = gpus_of(f[3].strip())
        gpu_hours = elapsed * gpus / 3600.0
        return AllocationUsage(cluster=cluster, job_id=job_id, login=login.spec,
                               state=f[4].split()[0] if f[4].strip() else "UNKNOWN",
                               nodes=nodes, gpus=gpus, start=_when(f[5]) or time.time(),
                               end=_when(f[6]), elapsed_s=elapsed,
                               node_hours=elapsed * nodes / 3600.0, gpu_hours=gpu_hours,
                               price_per_gpu_hour=price, cost=gpu_hours * price,
                               read_at=time.time())
    return None


def folder(home: Path) -> Path:
    return home / "ledger" / "slurm"


def record(home: Path, usage: AllocationUsage) -> Path:
    """Keep the latest read of the allocation (one file a cluster and job, replaced
    atomically)."""
    d = folder(home)
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"{usage.cluster}-{usage.job_id}.json"
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(usage), indent=1))
    os.replace(tmp, f)
    return f


def read_and_record(home: Path, login: Login, cluster: str, job_id: str, price: float,
                    wait_s: float = 0.0) -> AllocationUsage | None:
    """Read the allocation's usage and keep it. ``wait_s``: how long to wait for sacct to
    show the job ended (it lags the scheduler by a second or two)."""
    deadline = time.time() + wait_s
    while True:
        usage = read(login, cluster, job_id, price)
        if usage is not None and (usage.end is not None or time.time() >= deadline):
            break
        if time.time() >= deadline:
            return None
        time.sleep(0.5)
    record(home, usage)
    return usage
