#!/usr/bin/env python3
"""Launch overhead on warm local clusters: from typing ``cloudtrain launch`` to the user's
``run`` command running on every node.

For each node count N (default 1, 4, 8, 16):

1. write a temp workdir whose task's ``run`` writes ``date +%s.%N`` to a stamp file per node;
2. a first ("cold") launch provisions N local sshd nodes, bootstraps and syncs: timed on its
   own, not part of the overhead;
3. R warm launches of the same task on the now-warm cluster. For each:
       overhead = latest stamp written on any node - time.time() just before starting the
                  ``cloudtrain launch`` subprocess
   and also the wall time of the whole launch (until the CLI exits);
4. the cluster is torn down before the next N.

Reported: the median per N, the 16-node / 1-node ratio, and where the time goes (when each
progress line of the CLI appeared, median over the warm runs).

Targets (issue 15): overhead <= 0.35 s at 4 nodes; overhead at 16 nodes <= 1.2 x overhead at
1 node.

Everything runs under a fresh temporary CLOUDTRAIN_HOME; every cluster is torn down in a
``finally`` (``cloudtrain down -a -y``), on Ctrl-C and SIGTERM too.

    python bench/bench_launch_overhead.py [--nodes 1,4,8,16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (begin, cloudtrain_cmd, ct_env, fmt, iter_csv_ints, median, run_counts,
                     table, timed_lines, verdict)

# Progress lines of `cloudtrain launch` (stderr), in the order they appear on a warm launch.
PHASES = [
    ("first output", None),
    ("'Waiting for SSH'", "Waiting for SSH"),
    ("'Nodes ready'", "Nodes ready"),
    ("'Running job'", "Running job"),
]


@dataclass
class Run:
    code: int
    overhead: float | None        # latest stamp - t0
    first_start: float | None     # earliest stamp - t0
    wall: float                   # CLI exit - t0
    cpu: float = 0.0              # CPU s of the CLI and the processes it waited for (its ssh)
    phases: dict[str, float] = field(default_factory=dict)
    tail: str = ""
    lines: list[tuple[float, str]] = field(default_factory=list)  # (s since start, line)


@dataclass
class CountResult:
    nodes: int
    cold: Run | None = None
    warm: list[Run] = field(default_factory=list)

    def ok_warm(self) -> list[Run]:
        return [r for r in self.warm if r.code == 0 and r.overhead is not None]


def overheads(runs: list[Run]) -> list[float]:
    """The overheads of the runs that have one."""
    return [r.overhead for r in runs if r.overhead is not None]


def first_starts(runs: list[Run]) -> list[float]:
    return [r.first_start for r in runs if r.first_start is not None]


def write_task(wd: Path, name: str, nodes: int, stamps: Path) -> Path:
    wd.mkdir(parents=True, exist_ok=True)
    stamps.mkdir(parents=True, exist_ok=True)
    task = wd / "task.yaml"
    task.write_text(
        f"name: {name}\n"
        f"num_nodes: {nodes}\n"
        "workdir: .\n"
        "run: |\n"
        f"  date +%s.%N > {stamps}/started-$CLOUDTRAIN_NODE_RANK\n")
    return task


def one_launch(task: Path, home: Path, stamps: Path, nodes: int) -> Run:
    for f in stamps.glob("started-*"):
        f.unlink()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code, t0, t1, lines = timed_lines(cloudtrain_cmd() + ["launch", str(task), "-y"],
                                      ct_env(home), cwd=task.parent)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    vals = []
    for f in stamps.glob("started-*"):
        try:
            vals.append(float(f.read_text().strip()))
        except ValueError:
            pass
    complete = len(vals) == nodes
    phases: dict[str, float] = {}
    if lines:
        phases["first output"] = lines[0][0] - t0
    for label, needle in PHASES[1:]:
        for t, text in lines:
            if needle is not None and needle in text:
                phases[label] = t - t0
                break
    tail = "\n".join(text for _, text in lines[-15:])
    if code == 0 and not complete:
        tail += f"\n[bench] only {len(vals)} of {nodes} node(s) wrote a stamp"
    return Run(code=code if complete or code != 0 else -1,
               overhead=(max(vals) - t0) if complete else None,
               first_start=(min(vals) - t0) if complete else None,
               wall=t1 - t0, cpu=cpu, phases=phases, tail=tail,
               lines=[(t - t0, text) for t, text in lines])


def bench_count(root: Path, home: Path, nodes: int, repeats: int) -> CountResult:
    name = f"bl-n{nodes}"
    stamps = root / "stamps" / str(nodes)
    task = write_task(root / f"wd-{nodes}", name, nodes, stamps)
    res = CountResult(nodes)
    print(f"[{nodes:>2} node(s)] cold launch (provision + bootstrap + sync + run)...", flush=True)
    res.cold = one_launch(task, home, stamps, nodes)
    if res.cold.code != 0:
        print(f"[{nodes:>2} node(s)] cold launch failed (exit {res.cold.code}):\n{res.cold.tail}",
              flush=True)
        return res
    print(f"[{nodes:>2} node(s)] cold launch {res.cold.wall:.2f} s; {repeats} warm launch(es):",
          end="", flush=True)
    for _ in range(repeats):
        r = one_launch(task, home, stamps, nodes)
        res.warm.append(r)
        print(f" {fmt(r.overhead, 2)}" if r.overhead is not None else " fail", end="", flush=True)
        if r.code != 0:
            print(f"\n[{nodes:>2} node(s)] warm launch failed (exit {r.code}):\n{r.tail}", flush=True)
    print(flush=True)
    # Outliers: show what the CLI printed, with timestamps, to see where the time went.
    ok = res.ok_warm()
    if len(ok) >= 2:
        med = median(overheads(ok))
        for i, r in enumerate(res.warm):
            if r.overhead is not None and r.overhead > max(2 * med, med + 1.0):
                print(f"[{nodes:>2} node(s)] warm launch {i + 1} is an outlier "
                      f"({r.overhead:.2f} s vs median {med:.2f} s); its output:")
                for t, text in r.lines:
                    print(f"    {t:7.3f}s  {text}")
    return res


def report(results: list[CountResult], target4: float, target_ratio: float, repeats: int) -> None:
    print()
    print(f"## Warm launch overhead (median of up to {repeats} warm launches per node count)")
    rows = []
    med: dict[int, float] = {}
    for r in results:
        ok = r.ok_warm()
        if ok:
            med[r.nodes] = median(overheads(ok))
        rows.append([
            r.nodes,
            fmt(r.cold.wall, 2) if r.cold else "-",
            f"{len(ok)}/{len(r.warm)}",
            fmt(med.get(r.nodes)),
            fmt(min(overheads(ok))) if ok else "-",
            fmt(max(overheads(ok))) if ok else "-",
            fmt(median(first_starts(ok))) if ok else "-",
            fmt(median([x.wall for x in ok])) if ok else "-",
            fmt(median([x.cpu for x in ok])) if ok else "-",
        ])
    print(table(["nodes", "cold launch s", "ok", "overhead med s", "min s", "max s",
                 "first node s", "launch wall med s", "laptop CPU med s"], rows))
    print("  overhead     = latest per-node start stamp - time just before `cloudtrain launch`")
    print("  first node   = earliest per-node start stamp - the same start time")
    print("  launch wall  = until the CLI exited (job done, logs closed, state written)")
    print("  laptop CPU   = user+sys CPU of the CLI and its ssh clients (the nodes' own work not")
    print("                 counted: on this machine local nodes share its CPUs with the CLI)")

    print()
    print("## Where a warm launch spends its time (median seconds since the CLI was started)")
    labels = [p[0] for p in PHASES] + ["last node started", "CLI exited"]
    prow = []
    for r in results:
        ok = r.ok_warm()
        if not ok:
            continue
        row: list[object] = [r.nodes]
        for label, _ in PHASES:
            vals = [x.phases[label] for x in ok if label in x.phases]
            row.append(fmt(median(vals)) if vals else "-")
        row.append(fmt(median(overheads(ok))))
        row.append(fmt(median([x.wall for x in ok])))
        prow.append(row)
    if prow:
        print(table(["nodes"] + labels, prow))
        print("  first output     ~ interpreter start + imports + task/state load + provider check")
        print("  'Waiting for SSH' -> 'Nodes ready': SSH connect to every node + bootstrap check")
        print("  'Nodes ready' -> 'Running job': sync check (fingerprint, one round trip), state")
        print("  'Running job' -> last node started: job start over SSH on every node")

    print()
    print("## Targets")
    if 4 in med:
        print(f"overhead at 4 nodes <= {target4:.2f} s: {fmt(med[4])} s -> {verdict(med[4] <= target4)}")
    else:
        print(f"overhead at 4 nodes <= {target4:.2f} s: not measured "
              "(needs 4 in --nodes and a completed run)")
    cpu = {r.nodes: median([x.cpu for x in r.ok_warm()]) for r in results if r.ok_warm()}
    if 1 in cpu and 16 in cpu:
        print(f"(figure) laptop CPU per launch, 16 nodes / 1 node: {cpu[16] / cpu[1]:.2f}x "
              f"({fmt(cpu[16])} s / {fmt(cpu[1])} s)")
    if 1 in med and 16 in med:
        ratio = med[16] / med[1]
        print(f"overhead 16 nodes / 1 node <= {target_ratio:.2f}x: {ratio:.2f}x "
              f"({fmt(med[16])} s / {fmt(med[1])} s) -> {verdict(ratio <= target_ratio)}")
    else:
        lo, hi = (min(med), max(med)) if med else (None, None)
        extra = (f" (measured {hi}/{lo}: {med[hi] / med[lo]:.2f}x)"
                 if lo is not None and hi is not None and lo != hi else "")
        print(f"overhead 16 nodes / 1 node <= {target_ratio:.2f}x: not measured (needs 1 and 16 "
              f"in --nodes){extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,4,8,16", help="comma-separated node counts (default 1,4,8,16)")
    ap.add_argument("--repeats", type=int, default=5, help="warm launches per node count (default 5)")
    ap.add_argument("--target-4", type=float, default=0.35, help="target overhead at 4 nodes, s")
    ap.add_argument("--target-ratio", type=float, default=1.2, help="target 16-node/1-node ratio")
    ap.add_argument("--keep-files", action="store_true", help="keep the temp dir (logs) afterwards")
    args = ap.parse_args()
    counts = list(iter_csv_ints(args.nodes))

    root, home = begin("ctbench-launch-", f"cloudtrain launch overhead, local provider, node "
                       f"counts {counts}, {args.repeats} warm launch(es) each")
    results, interrupted = run_counts(root, home, counts,
                                      lambda n: bench_count(root, home, n, args.repeats),
                                      lambda n: f"bl-n{n}", keep_files=args.keep_files)
    report(results, args.target_4, args.target_ratio, args.repeats)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
