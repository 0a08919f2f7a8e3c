#!/usr/bin/env python3
"""How long pricing takes: the planner alone over every offer of the catalog, ``cloudtrain
cost`` end to end, and loading the catalog.

(a) planner, in process: ``ranking.rank`` over every offer of the shipped snapshot, for
    queries that make it look at all of them (``any:8``: every GPU model, 8 per node; with a
    memory fit; and a query where nothing fits, so the relaxations are ranked too). Each
    query is run once to warm up, then N times. Target: median <= 50 ms per query.
(b) ``cloudtrain cost TASK`` as a subprocess (interpreter start, imports, catalog load,
    planner, output), on a task asking for ``any:8`` so the whole catalog is considered;
    wall time, 1 warm-up then M runs; ``python -c pass`` for the interpreter's floor.
    The same steps timed one by one in a fresh interpreter say where that time goes.
(c) catalog load: in a fresh interpreter (what every ``cost`` pays once), in process with a
    cold cache (read CSV + overrides + sanity rules), and a cache hit.

Everything runs against a temporary CLOUDTRAIN_HOME (no user-local catalog: the shipped
snapshot). Nothing is created anywhere; no network.

    python bench/bench_cost.py [-n 200] [-m 10] [--target-ms 50]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cloudtrain_cmd, fmt, machine_line, median, percentile, table, verdict  # noqa: E402 - imported after the sys.path set-up above

TASK = "name: bench\nnum_nodes: 2\nresources:\n  accelerators: any:8\nrun: 'true'\n"


def timed(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds per call: 1 warm-up, then ``n`` calls (GC left on, as in the CLI)."""
    fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def ms_row(label: str, ts: list[float], extra: list[object]) -> list[object]:
    return [label, fmt(median(ts) * 1e3, 2), fmt(percentile(ts, 90) * 1e3, 2),
            fmt(min(ts) * 1e3, 2), fmt(max(ts) * 1e3, 2), *extra]


def wall(cmd: list[str], env: dict[str, str], cwd: str, runs: int,
         ok_codes: tuple[int, ...] = (0,)) -> list[float]:
    def once() -> float:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        dt = time.perf_counter() - t0
        if proc.returncode not in ok_codes:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: "
                               f"{proc.stderr.decode(errors='replace')[-500:]}")
        return dt

    once()
    return [once() for _ in range(runs)]


def bench_planner(n: int, target_ms: float) -> tuple[str, list[tuple[str, float]]]:
    from cloudtrain import planner
    from cloudtrain import ranking
    from cloudtrain.catalog.load import load_catalog
    from cloudtrain.commands.cost import Pick, cost_document
    from cloudtrain.memfit import MemoryEstimate
    from cloudtrain.spec import parse_task
    from cloudtrain.taskmodel import Resources

    cat = load_catalog(None)
    offers = cat.offers

    def res(acc: str) -> Resources:
        return Resources.model_validate({"accelerators": acc})

    queries: list[tuple[str, Callable[[], ranking.PlanResult], bool]] = [
        ("any:8 x 2, on-demand", lambda: ranking.rank(res("any:8"), 2, offers), True),
        ("any:8 x 2, spot", lambda: ranking.rank(res("any:8"), 2, offers, spot=True), True),
        ("any:8 x 2, 7e9 bf16 adamw fsdp (memory fit)",
         lambda: ranking.rank(res("any:8"), 2, offers, fit=MemoryEstimate(7e9, strategy="fsdp")),
         True),
        ("any:8 x 1, 70e9 ddp: nothing fits (+ relaxations)",
         lambda: ranking.rank(res("any:8"), 1, offers, fit=MemoryEstimate(70e9)), True),
        ("any:1 x 4, 13e9 ddp, max $20/h: nothing fits (+ relaxations)",
         lambda: ranking.rank(res("any:1"), 4, offers, max_hourly_cost=20.0,
                              fit=MemoryEstimate(13e9)), True),
        ("A100:8 x 2 (one model, for comparison)",
         lambda: ranking.rank(res("A100:8"), 2, offers), False),
    ]
    rows = []
    judged: list[tuple[str, float]] = []
    for label, fn, is_target in queries:
        r = fn()
        ts = timed(fn, n)
        looked = len(r.ranked) + sum(j.count for j in r.rejected)
        assert looked == len(offers), (label, looked, len(offers))
        med = median(ts) * 1e3
        rows.append(ms_row(label, ts, [looked, len(r.ranked),
                                       verdict(med <= target_ms) if is_target else "info"]))
        if is_target:
            judged.append((label, med))

    # What `cost --json` does in process after loading: rank, the up-pick, the JSON document.
    task = parse_task(TASK)
    avail = planner.availability()

    def cost_in_process() -> object:
        result = ranking.rank_task(task, offers)
        return cost_document(task, result, 1.0, Pick(None, ""), avail, cat, None, None)

    ts = timed(cost_in_process, n)
    rows.append(ms_row("rank + cost --json document (any:8 x 2)", ts,
                       [len(offers), len(ranking.rank_task(task, offers).ranked), "info"]))
    text = table(["planner query (in process)", "median ms", "p90 ms", "min ms", "max ms",
                  "offers looked at", "feasible", f"<= {target_ms:g} ms"], rows)
    return text, judged


def bench_cli(runs: int, home: str, cwd: str) -> str:
    task = Path(cwd) / "task.yaml"
    task.write_text(TASK)
    env = dict(os.environ, CLOUDTRAIN_HOME=home, NO_COLOR="1")
    ct = cloudtrain_cmd()
    variants = [
        ("python -c pass (floor)", [sys.executable, "-c", "pass"]),
        ("cloudtrain --help (start-up, reference)", ct + ["--help"]),
        ("cloudtrain cost task.yaml (any:8, table)", ct + ["cost", str(task)]),
        ("cloudtrain cost task.yaml --json", ct + ["cost", str(task), "--json"]),
        ("cloudtrain cost task.yaml --json --model-params 7e9 --strategy fsdp",
         ct + ["cost", str(task), "--json", "--model-params", "7e9", "--strategy", "fsdp"]),
        ("cloudtrain gpus --json (every offer)", ct + ["gpus", "--json"]),
    ]
    rows = []
    for label, cmd in variants:
        try:
            ts = wall(cmd, env, cwd, runs)
        except (OSError, RuntimeError) as exc:
            rows.append([label, "error", "-", "-", "-", str(exc)[:60]])
            continue
        rows.append([label, fmt(median(ts)), fmt(percentile(ts, 90)), fmt(min(ts)),
                     fmt(max(ts)), ""])
    return table(["command (subprocess, wall)", "median s", "p90 s", "min s", "max s", ""], rows)


# In a fresh interpreter, the steps `cloudtrain cost task.yaml --json` takes, timed one by one.
PHASES = """
import json, sys, time
t = [time.perf_counter()]
import cloudtrain.commands.main, cloudtrain.commands.cost; t.append(time.perf_counter())
from cloudtrain.commands.cost import load_cost_task
task = load_cost_task(sys.argv[1], None); t.append(time.perf_counter())
from cloudtrain.catalog.load import load_catalog; cat = load_catalog(None); t.append(time.perf_counter())
from cloudtrain import planner; avail = planner.availability(); t.append(time.perf_counter())
r = ranking.rank_task(task, cat.offers); t.append(time.perf_counter())
from cloudtrain.commands.cost import Pick, cost_document
text = json.dumps(cost_document(task, r, 1.0, Pick(None, ""), avail, cat, None, None), indent=2)
t.append(time.perf_counter())
print(" ".join(f"{b - a:.6f}" for a, b in zip(t, t[1:])))
"""
PHASE_NAMES = ("import cloudtrain.commands.main + commands.cost (click)", "read the task (imports pydantic)",
               "load the catalog (import + parse)", "which clouds are usable (registry)",
               "ranking.rank_task", "JSON document + dumps")


def bench_phases(runs: int, home: str, cwd: str) -> str:
    task = Path(cwd) / "task.yaml"
    env = dict(os.environ, CLOUDTRAIN_HOME=home)
    cmd = [sys.executable, "-c", PHASES, str(task)]
    subprocess.run(cmd, env=env, cwd=cwd, capture_output=True)
    samples: list[list[float]] = [[] for _ in PHASE_NAMES]
    for _ in range(runs):
        out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                             check=True).stdout.split()
        for i, v in enumerate(out):
            samples[i].append(float(v))
    rows = [[name, fmt(median(ts) * 1e3, 1), fmt(percentile(ts, 90) * 1e3, 1)]
            for name, ts in zip(PHASE_NAMES, samples)]
    total = [sum(x) for x in zip(*samples)]
    rows.append(["sum (after the interpreter started)", fmt(median(total) * 1e3, 1),
                 fmt(percentile(total, 90) * 1e3, 1)])
    return table(["where `cost --json` spends its time (fresh interpreter)", "median ms",
                  "p90 ms"], rows)


def bench_load(n: int, runs: int, home: str, cwd: str) -> str:
    from cloudtrain.catalog import load as L
    from cloudtrain.catalog.load import Catalog

    def cold() -> Catalog:
        L.clear_cache()
        return L.load_catalog(None)

    rows = [ms_row("load_catalog, cold cache (in process)", timed(cold, max(5, n // 10)),
                   [len(cold().offers)])]
    L.load_catalog(Path(home))
    rows.append(ms_row("load_catalog, cache hit", timed(lambda: L.load_catalog(Path(home)), n),
                       [len(L.load_catalog(Path(home)).offers)]))
    # A fresh interpreter: the import of the catalog modules and the first load, timed inside.
    probe = ("import time; t=time.perf_counter(); from cloudtrain.catalog.load import load_catalog;"
             " c=load_catalog(None); print(time.perf_counter()-t, len(c.offers))")
    env = dict(os.environ, CLOUDTRAIN_HOME=home)
    fresh = []
    count = 0
    subprocess.run([sys.executable, "-c", probe], env=env, cwd=cwd, capture_output=True)
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=cwd,
                             capture_output=True, text=True, check=True).stdout.split()
        fresh.append(float(out[0]))
        count = int(out[1])
    rows.append(ms_row("import + first load, fresh interpreter", fresh, [count]))
    return table(["catalog load", "median ms", "p90 ms", "min ms", "max ms", "offers"], rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--repeats", type=int, default=200,
                    help="in-process repetitions per planner query (default 200)")
    ap.add_argument("-m", "--cli-runs", type=int, default=10,
                    help="subprocess runs per command (default 10)")
    ap.add_argument("--target-ms", type=float, default=50.0,
                    help="target median for the planner over every offer (default 50 ms)")
    args = ap.parse_args()

    print(f"# cloudtrain cost and the planner ({args.repeats} in-process repetitions, "
          f"{args.cli_runs} subprocess runs, each after 1 warm-up)")
    print(f"# machine: {machine_line()}")
    print(f"# cloudtrain: {' '.join(cloudtrain_cmd())}")
    with tempfile.TemporaryDirectory(prefix="ctbench-cost-") as tmp:
        home = os.path.join(tmp, "home")
        os.environ["CLOUDTRAIN_HOME"] = home      # the in-process part too: no user catalog
        from cloudtrain.catalog.load import load_catalog

        cat = load_catalog(None)
        print(f"# catalog: {cat.info.kind} as of {cat.info.as_of}, {len(cat.offers)} offers")
        gc.collect()
        planner_text, judged = bench_planner(args.repeats, args.target_ms)
        cli_text = bench_cli(args.cli_runs, home, tmp)
        phase_text = bench_phases(args.cli_runs, home, tmp)
        load_text = bench_load(args.repeats, args.cli_runs, home, tmp)

    print()
    print(planner_text)
    print()
    print(cli_text)
    print()
    print(phase_text)
    print()
    print(load_text)
    print()
    worst = max(judged, key=lambda x: x[1])
    print(f"target: planner over every offer, median <= {args.target_ms:g} ms per query: "
          f"slowest {worst[1]:.2f} ms ({worst[0]}) -> {verdict(worst[1] <= args.target_ms)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
