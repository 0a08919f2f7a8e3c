#!/usr/bin/env python3
"""Sweeps on warm local clusters (issue 23): trials per hour through ``cloudtrain sweep``
against the same trials launched one after another with ``cloudtrain launch`` (the shell-loop
way), and the time from a trial's end to the next trial's start in the same GPU slot.

For each node count N (default 2):

1. a cluster of N local sshd nodes with ``resources.local.gpus: SLOTS`` (default 4) GPU slots
   each is brought up (``cloudtrain up``, timed on its own) and warmed with a 1-trial sweep
   (the driver's first start installs Optuna on the node when it is missing);
2. a sweep of T trials (default 16), sampler ``random``, pruner ``none``, ``gpus_per_trial: 1``,
   ``parallel: auto``: each trial is a ``run:`` that stamps its start, sleeps S seconds (default
   5), appends the metric to ``$CLOUDTRAIN_METRICS_FILE`` and stamps its end, its node
   (``$HOME`` of the local node) and ``$CUDA_VISIBLE_DEVICES`` into a file on this machine;
   timed from just before ``cloudtrain sweep FILE -y`` to the last trial's end stamp;
3. the same T trials as a shell loop would run them: ``cloudtrain launch TASK -c CLUSTER -y
   --env CLOUDTRAIN_PARAM_X=..`` attached, one after another, on the same warm cluster (each
   launch holds the whole cluster: every node, all its slots);
4. from the stamps, the driver's results (``sweep results --json``: when the worker submitted
   each trial and when it saw it end) and the node queues' job records (started_at; ended_at =
   when the job's rc file was written): per slot, the gap from one trial's end to the next
   trial's start, median and max, and where the gap goes.

Reported: trials per hour (sweep, launch loop, their ratio, and the ideal
``slots used x 3600 / S``), the slots the sweep used, the gap table and its split.
Target (issue 23): trial end -> next trial start in the same slot, median <= 1 s on a warm
cluster (the max is shown; on a shared 2-CPU machine it is a figure, not a target).

Everything runs under a fresh temporary CLOUDTRAIN_HOME; every cluster is torn down in a
``finally`` (``cloudtrain down -a -y``), on Ctrl-C and SIGTERM too.

    python bench/bench_sweep.py [--nodes 2] [--slots 4] [--trials 16] [--trial-seconds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (begin, cloudtrain_cmd, ct_env, fmt, iter_csv_ints, median, run_counts,
                     table, verdict)

TASK = """\
name: {name}
num_nodes: {nodes}
stop_grace: 5
resources: {{provider: local, local: {{gpus: {slots}}}}}
run: |
  t0=$(date +%s.%N)
  sleep {seconds}
  m=${{CLOUDTRAIN_METRICS_FILE:-/dev/null}}
  echo "{{\\"step\\": 0, \\"score\\": ${{CLOUDTRAIN_PARAM_X:-0}}}}" >> "$m"
  who="${{CLOUDTRAIN_SWEEP:-launch}} ${{CLOUDTRAIN_TRIAL:-$CT_LAUNCH}}"
  echo "$who $HOME ${{CUDA_VISIBLE_DEVICES:--}} $t0 $(date +%s.%N)" >> {stamps}
"""

SWEEP = """\
task: task.yaml
cluster: {cluster}
params:
  x: {{uniform: [0.0, 1.0]}}
objective: {{metric: score, goal: minimize}}
trials: {trials}
parallel: auto
gpus_per_trial: 1
sampler: random
pruner: none
down: false
seed: 1
"""


@dataclass(frozen=True)
class Stamp:
    """One trial's run on one node, as the trial itself wrote it."""
    kind: str          # the sweep's name, or "launch"
    trial: str         # the trial number, or the launch's index
    node: str          # the local node's $HOME
    gpus: str          # $CUDA_VISIBLE_DEVICES ("-" when unset)
    start: float
    end: float


@dataclass(frozen=True)
class Gap:
    """From one trial's end to the next trial's start in the same slot, and its split."""
    slot: str
    gap: float
    to_rc: float | None          # script's end stamp -> rc written (queue ended_at)
    to_seen: float | None        # rc -> the worker saw the job end (driver's 'ended')
    to_submit: float | None      # seen -> the next trial submitted (driver's 'started')
    to_queue: float | None       # submitted -> the queue started the job (started_at)
    to_script: float | None      # queue started -> the script's start stamp


@dataclass
class CountResult:
    nodes: int
    up_s: float | None = None
    sweep_s: float | None = None        # `cloudtrain sweep` start -> last end stamp
    sweep_cli_s: float | None = None    # the `cloudtrain sweep` command's own wall time
    sweep_steady_s: float | None = None  # first start stamp -> last end stamp
    sweep_done: int = 0
    slots_used: int = 0
    loop_s: float | None = None
    loop_done: int = 0
    launch_walls: list[float] = field(default_factory=list)
    launch_gaps: list[float] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    error: str = ""


def ct(home: Path, cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cloudtrain_cmd() + list(args), env=ct_env(home), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def read_stamps(path: Path) -> list[Stamp]:
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) != 6:
            continue
        try:
            out.append(Stamp(parts[0], parts[1], parts[2], parts[3], float(parts[4]),
                             float(parts[5])))
        except ValueError:
            continue
    return out


def wait_stamps(path: Path, kind: str, count: int, timeout: float) -> list[Stamp]:
    """The stamps of ``kind`` once ``count`` trials wrote theirs (or what there is at the
    timeout). Reads a local file every 50 ms: nothing that loads the machine."""
    deadline = time.time() + timeout
    while True:
        got = [s for s in read_stamps(path) if s.kind == kind]
        if len(got) >= count or time.time() > deadline:
            return got
        time.sleep(0.05)


def wait_finished(home: Path, wd: Path, name: str, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = ct(home, wd, "sweep", "status", name)
        if r.returncode == 0 and "(finished)" in r.stdout:
            return True
        time.sleep(1.0)
    return False


def node_roots(home: Path, cluster: str) -> list[Path]:
    """The local nodes' root folders (where each node keeps its queue)."""
    return sorted(home.glob(f"clusters/{cluster}/local/nodes/*/root"))


def queue_records(home: Path, cluster: str, prefix: str) -> dict[str, dict]:
    """Every node's queue records of the jobs whose id starts with ``prefix``, by job id."""
    out: dict[str, dict] = {}
    for root in node_roots(home, cluster):
        for f in (root / ".cloudtrain" / "queue").glob(f"{prefix}*.json"):
            try:
                rec = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                out[rec["id"]] = rec
    return out


def _num(d: dict | None, key: str) -> float | None:
    v = (d or {}).get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def gaps_of(stamps: list[Stamp], driver: dict[str, dict], queue: dict[str, dict],
            name: str) -> list[Gap]:
    """Per slot (node, CUDA_VISIBLE_DEVICES), each trial's end to the next trial's start,
    split with the driver's and the queue's times."""
    by_slot: dict[str, list[Stamp]] = {}
    for s in stamps:
        by_slot.setdefault(f"{Path(s.node).parent.name}:{s.gpus}", []).append(s)
    out = []
    for slot, runs in sorted(by_slot.items()):
        runs.sort(key=lambda s: s.start)
        for prev, nxt in zip(runs, runs[1:]):
            pj, nj = f"sweep-{name}-t{prev.trial}", f"sweep-{name}-t{nxt.trial}"
            rc = _num(queue.get(pj), "ended_at")
            seen = _num(driver.get(prev.trial), "ended_at")
            asked = _num(driver.get(nxt.trial), "started_at")
            qstart = _num(queue.get(nj), "started_at")
            out.append(Gap(slot, nxt.start - prev.end, _diff(prev.end, rc), _diff(rc, seen),
                           _diff(seen, asked), _diff(asked, qstart), _diff(qstart, nxt.start)))
    return out


def write_files(wd: Path, cluster: str, nodes: int, slots: int, seconds: float,
                stamps: Path) -> Path:
    wd.mkdir(parents=True, exist_ok=True)
    task = wd / "task.yaml"
    task.write_text(TASK.format(name=cluster, nodes=nodes, slots=slots, seconds=seconds,
                                stamps=stamps))
    return task


def sweep_file(wd: Path, name: str, cluster: str, trials: int) -> Path:
    f = wd / f"{name}.yaml"
    f.write_text(SWEEP.format(cluster=cluster, trials=trials))
    return f


def run_sweep(res: CountResult, home: Path, wd: Path, cluster: str, stamps: Path,
              trials: int, seconds: float) -> None:
    name = "sw"
    f = sweep_file(wd, name, cluster, trials)
    t0 = time.time()
    r = ct(home, wd, "sweep", str(f), "-y")
    res.sweep_cli_s = time.time() - t0
    if r.returncode != 0:
        res.error = f"sweep exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}"
        return
    got = wait_stamps(stamps, name, trials, timeout=trials * (seconds + 30) + 120)
    res.sweep_done = len(got)
    if got:
        res.sweep_s = max(s.end for s in got) - t0
        res.sweep_steady_s = max(s.end for s in got) - min(s.start for s in got)
        res.slots_used = len({(s.node, s.gpus) for s in got})
    if not wait_finished(home, wd, name, 120):
        print(f"[{res.nodes} node(s)] the sweep did not say finished within 120 s", flush=True)
    r = ct(home, wd, "sweep", "results", name, "--json")
    driver: dict[str, dict] = {}
    if r.returncode == 0:
        driver = {str(t["number"]): t for t in json.loads(r.stdout).get("trials", [])}
    res.gaps = gaps_of(got, driver, queue_records(home, cluster, f"sweep-{name}-t"), name)


def run_loop(res: CountResult, home: Path, wd: Path, task: Path, cluster: str, stamps: Path,
             trials: int) -> None:
    rng = random.Random(1)
    t0 = time.time()
    for i in range(trials):
        t = time.time()
        r = ct(home, wd, "launch", str(task), "-c", cluster, "-y",
               "--env", f"CLOUDTRAIN_PARAM_X={rng.random():.6f}", "--env", f"CT_LAUNCH={i}")
        res.launch_walls.append(time.time() - t)
        if r.returncode != 0:
            res.error = f"launch {i} exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}"
            break
        res.loop_done += 1
    res.loop_s = time.time() - t0
    per: dict[str, list[Stamp]] = {}
    for s in read_stamps(stamps):
        if s.kind == "launch":
            per.setdefault(s.trial, []).append(s)
    runs = sorted((min(s.start for s in v), max(s.end for s in v)) for v in per.values())
    res.launch_gaps = [b[0] - a[1] for a, b in zip(runs, runs[1:])]


def bench_count(root: Path, home: Path, nodes: int, slots: int, trials: int,
                seconds: float) -> CountResult:
    cluster = f"bs-n{nodes}"
    wd = root / f"wd-{nodes}"
    stamps = root / f"stamps-{nodes}.log"
    task = write_files(wd, cluster, nodes, slots, seconds, stamps)
    res = CountResult(nodes)
    tag = f"[{nodes} node(s) x {slots} slot(s)]"
    print(f"{tag} up (provision + bootstrap)...", flush=True)
    t = time.time()
    r = ct(home, wd, "up", str(task), "-y")
    res.up_s = time.time() - t
    if r.returncode != 0:
        res.error = f"up exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}"
        return res
    print(f"{tag} up in {res.up_s:.1f} s; warm-up sweep (1 trial)...", flush=True)
    r = ct(home, wd, "sweep", str(sweep_file(wd, "warm", cluster, 1)), "-y")
    if r.returncode != 0 or not wait_finished(home, wd, "warm", 300):
        res.error = f"warm-up sweep failed ({r.returncode}): {(r.stdout + r.stderr)[-1500:]}"
        return res
    print(f"{tag} sweep of {trials} trial(s) x {seconds:g} s...", flush=True)
    run_sweep(res, home, wd, cluster, stamps, trials, seconds)
    if res.error:
        return res
    print(f"{tag} sweep: {res.sweep_done} trial(s) in {fmt(res.sweep_s, 1)} s; "
          f"launch loop of {trials}...", flush=True)
    run_loop(res, home, wd, task, cluster, stamps, trials)
    print(f"{tag} launch loop: {res.loop_done} trial(s) in {fmt(res.loop_s, 1)} s", flush=True)
    return res


def per_hour(n: int, s: float | None) -> float | None:
    return n * 3600 / s if s else None


def _med(xs: list[float | None]) -> str:
    vals = [x for x in xs if x is not None]
    return fmt(median(vals)) if vals else "-"


def report(results: list[CountResult], slots: int, trials: int, seconds: float,
           target: float) -> None:
    for r in results:
        if r.error:
            print(f"\n[{r.nodes} node(s)] ERROR: {r.error}")
    print()
    print(f"## Trials per hour ({trials} trial(s) of {seconds:g} s, {slots} slot(s) per node)")
    rows = []
    for r in results:
        sweep_h, loop_h = per_hour(r.sweep_done, r.sweep_s), per_hour(r.loop_done, r.loop_s)
        rows.append([f"{r.nodes} x {slots}", f"{r.slots_used}/{r.nodes * slots}",
                     fmt(r.up_s, 1), fmt(r.sweep_cli_s, 2), fmt(r.sweep_s, 1),
                     fmt(sweep_h, 0), fmt(per_hour(r.sweep_done, r.sweep_steady_s), 0),
                     fmt(r.loop_s, 1), fmt(loop_h, 0),
                     f"{sweep_h / loop_h:.2f}x" if sweep_h and loop_h else "-",
                     fmt(r.slots_used * 3600 / seconds, 0)])
    print(table(["nodes x slots", "slots used", "up s", "sweep CLI s", "sweep s", "sweep /h",
                 "steady /h", "launch loop s", "loop /h", "sweep/loop", "ideal /h"], rows))
    print("  sweep s     = `cloudtrain sweep FILE -y` started -> the last trial's end stamp")
    print("  steady /h   = trials / (the first trial's start -> the last trial's end)")
    print("  launch loop = the same trials, `cloudtrain launch -c CLUSTER -y` attached, one after")
    print("                another (each launch holds every node and all their slots)")
    print("  ideal /h    = slots used x 3600 / trial seconds (no gap, no start-up)")
    print()
    print("## Launch loop: one launch's wall time, and its trial's end -> the next one's start")
    print(table(["nodes", "launch wall med s", "min s", "max s", "end -> next start med s",
                 "max s"],
                [[r.nodes, _med(list(r.launch_walls)),
                  fmt(min(r.launch_walls)) if r.launch_walls else "-",
                  fmt(max(r.launch_walls)) if r.launch_walls else "-",
                  _med(list(r.launch_gaps)),
                  fmt(max(r.launch_gaps)) if r.launch_gaps else "-"] for r in results]))
    print()
    print("## Sweep: a trial's end -> the next trial's start in the same slot (warm cluster)")
    grows: list[list[object]] = []
    for r in results:
        g = [x.gap for x in r.gaps]
        grows.append([r.nodes, len(g), fmt(median(g)) if g else "-", fmt(max(g)) if g else "-",
                     _med([x.to_rc for x in r.gaps]), _med([x.to_seen for x in r.gaps]),
                     _med([x.to_submit for x in r.gaps]), _med([x.to_queue for x in r.gaps]),
                     _med([x.to_script for x in r.gaps])])
    print(table(["nodes", "gaps", "median s", "max s", "end->rc", "rc->seen", "seen->submit",
                 "submit->queued start", "start->script"], grows))
    print("  end->rc       = the script's last stamp -> its rc file (queue record's ended_at)")
    print("  rc->seen      = -> the worker saw the job end (woken by the rc file, else its")
    print("                  poll; then `queue.py list`): the trial's 'ended' attribute")
    print("  seen->submit  = -> the next trial asked of Optuna and its attributes written (its")
    print("                  'started' attribute, set just before `queue.py submit`)")
    print("  submit->queued start = -> the queue started the job (record's started_at)")
    print("  start->script = -> the job's bash wrote its first stamp")
    print("  (medians of each part; the parts of one gap add up to it)")
    print()
    print("## Target")
    for r in results:
        g = [x.gap for x in r.gaps]
        if g:
            print(f"{r.nodes} node(s): end -> next start median <= {target:g} s: "
                  f"{fmt(median(g))} s -> {verdict(median(g) <= target)} (max {fmt(max(g))} s)")
        else:
            print(f"{r.nodes} node(s): end -> next start: not measured")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2", help="comma-separated node counts (default 2)")
    ap.add_argument("--slots", type=int, default=4, help="GPU slots per node (default 4)")
    ap.add_argument("--trials", type=int, default=16, help="trials per sweep (default 16)")
    ap.add_argument("--trial-seconds", type=float, default=5.0,
                    help="how long each trial sleeps (default 5)")
    ap.add_argument("--target", type=float, default=1.0,
                    help="target median end -> next start, s (default 1)")
    ap.add_argument("--keep-files", action="store_true", help="keep the temp dir afterwards")
    args = ap.parse_args()
    counts = list(iter_csv_ints(args.nodes))
    root, home = begin("ctbench-sweep-", f"cloudtrain sweep vs a launch loop, local provider, "
                       f"node counts {counts} x {args.slots} slot(s), {args.trials} trial(s) of "
                       f"{args.trial_seconds:g} s")
    results, interrupted = run_counts(
        root, home, counts,
        lambda n: bench_count(root, home, n, args.slots, args.trials, args.trial_seconds),
        lambda n: f"bs-n{n}", keep_files=args.keep_files)
    report(results, args.slots, args.trials, args.trial_seconds, args.target)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
