#!/usr/bin/env python3
"""Incremental workdir sync: one small file changed in a 200 MB workdir.

1. write a temp workdir: ``--files`` x ``--file-mb`` MB of random bytes under data/ (default
   200 x 1 MB) plus a few small .py files;
2. a first ``cloudtrain launch`` provisions a local cluster of N node(s) and syncs everything
   (its own "Synced in X s" line is reported as the full sync);
3. then, calling the library directly (what ``launch`` calls):
       plan  = cloudtrain.pipeline.run.sync_plan(cloudtrain.spec.load_task(task_file))
       handle = cloudtrain.cluster.get_handle(cloudtrain.context.open_env(UI(quiet=True)), name)
       cloudtrain.pipeline.sync.push_all(plan, handle.nodes, handle.keys)
   * one-file sync: touch/modify one small .py file, time push_all; ``--repeats`` times;
   * no-change sync: push_all with nothing changed (rsync still walks both sides);
   * plan.fingerprint(): the local walk launch uses to skip rsync altogether;
4. the launch path: ``cloudtrain launch`` with one small file changed (its "Synced in" line and
   its wall time) and with nothing changed (rsync skipped by the fingerprint), both timed as
   whole CLI runs.

Target: one-file incremental sync (push_all, median) <= 0.5 s.

Runs under a fresh temporary CLOUDTRAIN_HOME; every cluster is torn down in a ``finally``
(``cloudtrain down -a -y``), on Ctrl-C and SIGTERM too.

    python bench/bench_sync.py [--nodes 1[,4]] [--repeats 5] [--files 200] [--file-mb 1]
    python bench/bench_sync.py --fingerprint-tree 50000     # the fingerprint alone, no cluster
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (begin, cloudtrain_cmd, ct_env, fmt, iter_csv_ints, median, run_counts,
                     table, timed_lines, verdict)

SYNCED_RE = re.compile(r"Synced in ([0-9.]+)s")


def make_workdir(wd: Path, files: int, file_mb: float) -> int:
    (wd / "data").mkdir(parents=True, exist_ok=True)
    (wd / "src").mkdir(parents=True, exist_ok=True)
    size = int(file_mb * 1024 * 1024)
    total = 0
    for i in range(files):
        with open(wd / "data" / f"shard-{i:04d}.bin", "wb") as f:
            f.write(os.urandom(size))
        total += size
    for i in range(5):
        p = wd / "src" / f"mod{i}.py"
        p.write_text(f'"""module {i}"""\n\nVALUE = {i}\n')
        total += p.stat().st_size
    (wd / "train.py").write_text("from src.mod0 import VALUE\nprint(VALUE)\n")
    return total


def write_task(wd: Path, name: str, nodes: int) -> Path:
    task = wd / "task.yaml"
    task.write_text(f"name: {name}\nnum_nodes: {nodes}\nworkdir: .\nrun: |\n  true\n")
    return task


def touch_small(wd: Path, i: int) -> None:
    p = wd / "src" / "mod0.py"
    p.write_text(p.read_text() + f"# edit {i} at {time.time()}\n")


def launch(task: Path, home: Path) -> tuple[int, float, float | None, str]:
    """(exit code, wall s, the CLI's own 'Synced in' seconds or None, output tail)."""
    code, t0, t1, lines = timed_lines(cloudtrain_cmd() + ["launch", str(task), "-y"],
                                      ct_env(home), cwd=task.parent)
    synced = None
    for _, text in lines:
        m = SYNCED_RE.search(text)
        if m:
            synced = float(m.group(1))
    return code, t1 - t0, synced, "\n".join(t for _, t in lines[-15:])


def bench_nodes(root: Path, home: Path, wd: Path, nodes: int, repeats: int) -> dict[str, object]:
    from cloudtrain import cluster, context
    from cloudtrain.pipeline import sync
    from cloudtrain.pipeline.run import sync_plan
    from cloudtrain.spec import load_task
    from cloudtrain.ui import UI

    name = f"bs-n{nodes}"
    task_file = write_task(wd, name, nodes)
    out: dict[str, object] = {"nodes": nodes}

    print(f"[{nodes} node(s)] first launch (provision + bootstrap + full sync)...", flush=True)
    code, wall, synced, tail = launch(task_file, home)
    if code != 0:
        print(f"[{nodes} node(s)] first launch failed (exit {code}):\n{tail}", flush=True)
        out["error"] = f"first launch exit {code}"
        return out
    out["cold_wall"], out["full_sync"] = wall, synced
    print(f"[{nodes} node(s)] first launch {wall:.2f} s (full sync {fmt(synced, 2)} s)", flush=True)

    task = load_task(str(task_file))
    plan = sync_plan(task)
    env = context.open_env(UI(quiet=True))
    handle = cluster.get_handle(env, name)

    def push() -> float:
        t0 = time.perf_counter()
        errors = sync.push_all(plan, handle.nodes, handle.keys)
        dt = time.perf_counter() - t0
        bad = {r: e for r, e in errors.items() if e is not None}
        if bad:
            raise RuntimeError(f"push_all failed: {bad}")
        return dt

    # The floor under every rsync: one fresh `ssh node true` with the same options (no
    # connection sharing), which each rsync pays before comparing any file.
    from cloudtrain.keys import ssh_command_options

    n0 = handle.nodes[0]
    ssh_cmd = ["ssh", *ssh_command_options(handle.keys, n0.port, n0.identity_file),
               f"{n0.user}@{n0.host}", "true"]
    ssh_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(ssh_cmd, stdin=subprocess.DEVNULL, capture_output=True, check=True)
        ssh_times.append(time.perf_counter() - t0)
    out["ssh_true"] = ssh_times

    push()  # settle: the first launch already synced; this one should find nothing to do
    one, none, fps = [], [], []
    for i in range(repeats):
        touch_small(wd, i)
        one.append(push())
        none.append(push())
        t0 = time.perf_counter()
        plan.fingerprint()
        fps.append(time.perf_counter() - t0)
    out["one_file"], out["no_change"], out["fingerprint"] = one, none, fps
    print(f"[{nodes} node(s)] push_all one file: {' '.join(f'{x:.3f}' for x in one)}", flush=True)
    print(f"[{nodes} node(s)] push_all no change: {' '.join(f'{x:.3f}' for x in none)}", flush=True)

    # The launch path. The library pushes above did not record the sync fingerprint on the
    # nodes, so the next launch re-syncs (incrementally); launches after that see no change.
    launch(task_file, home)
    changed_wall, changed_sync, same_wall = [], [], []
    for i in range(max(1, repeats // 2 + 1)):
        touch_small(wd, 100 + i)
        code, wall, synced, tail = launch(task_file, home)
        if code == 0:
            changed_wall.append(wall)
            if synced is not None:
                changed_sync.append(synced)
        code, wall, synced, tail = launch(task_file, home)
        if code == 0:
            same_wall.append(wall)
            if synced is not None:
                print(f"[{nodes} node(s)] note: an unchanged launch synced ({synced:.2f} s)")
    out["launch_changed_wall"], out["launch_changed_sync"] = changed_wall, changed_sync
    out["launch_same_wall"] = same_wall
    return out


def bench_fingerprint(root: Path, files: int, repeats: int) -> list[float]:
    """``--fingerprint-tree N``: no cluster, just SyncPlan.fingerprint() over a source tree of
    N small files in nested packages, plus an ignored build/ folder (2,000 files, ``/build`` in
    .gitignore) that rsync, and so the fingerprint, skips."""
    from cloudtrain.pipeline.sync import SyncPlan

    wd = root / "tree"
    t = time.monotonic()
    for i in range(files):
        d = wd / "src" / f"pkg{i // 500}" / f"sub{(i // 50) % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"m{i}.py").write_text(f"X = {i}\n")
    (wd / "build").mkdir(parents=True, exist_ok=True)
    for i in range(2000):
        (wd / "build" / f"o{i}.o").write_text("x")
    (wd / ".gitignore").write_text("/build\n*.pyc\n")
    print(f"# tree {wd}: {files} source files + 2000 ignored, written in "
          f"{time.monotonic() - t:.1f} s", flush=True)
    plan = SyncPlan(workdir=wd, mounts=(), protect=(), exclude=("cloudtrain-outputs",))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan.fingerprint()
        times.append(time.perf_counter() - t0)
    print(f"fingerprint of {files} files: {' '.join(f'{x:.3f}' for x in times)} s; "
          f"median {median(times):.3f} s", flush=True)
    return times


def report(results: list[dict[str, Any]], repeats: int, target: float, size: int) -> None:
    print()
    print(f"## Sync of a {size / 1e6:.0f} MB workdir (medians; push_all: {repeats} runs each)")
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["nodes"], r["error"]] + ["-"] * 8)
            continue

        def m(key: str, r: dict[str, Any] = r) -> str:
            v = r.get(key) or []
            return fmt(median(v)) if v else "-"

        rows.append([r["nodes"], fmt(r.get("full_sync"), 2),
                     m("one_file"), m("no_change"), m("ssh_true"), m("fingerprint"),
                     m("launch_changed_sync"), m("launch_changed_wall"), m("launch_same_wall"),
                     fmt(r.get("cold_wall"), 2)])
    print(table(["nodes", "full sync s", "1-file push s", "no-change push s", "ssh true s",
                 "fingerprint s",
                 "launch 'Synced in' s", "launch 1-file wall s", "launch unchanged wall s",
                 "first launch s"], rows))
    print("  full sync           : the first launch's own 'Synced in' (rsync of everything)")
    print("  1-file push         : sync.push_all after one small .py file changed (the target)")
    print("  no-change push      : sync.push_all with nothing changed (rsync's own walk)")
    print("  ssh true            : one fresh `ssh node true`, the connection cost each rsync pays")
    print("  fingerprint         : SyncPlan.fingerprint(), the local walk that lets launch skip rsync")
    print("  launch 'Synced in'  : what `cloudtrain launch` prints after one file changed")
    print("  launch ... wall     : whole `cloudtrain launch` runs (run: true), one file changed / nothing")
    print()
    print("## Target")
    for r in results:
        one = r.get("one_file") or []
        if not one:
            print(f"one-file incremental sync <= {target:.2f} s ({r['nodes']} node(s)): FAIL (not measured)")
            continue
        v = median(one)
        print(f"one-file incremental sync <= {target:.2f} s ({r['nodes']} node(s)): {fmt(v)} s -> "
              f"{verdict(v <= target)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1", help="comma-separated node counts (default 1; e.g. 1,4)")
    ap.add_argument("--repeats", type=int, default=5, help="one-file syncs per node count (default 5)")
    ap.add_argument("--files", type=int, default=200, help="number of random data files (default 200)")
    ap.add_argument("--file-mb", type=float, default=1.0, help="size of each data file in MB (default 1)")
    ap.add_argument("--target", type=float, default=0.5, help="target one-file sync, s (default 0.5)")
    ap.add_argument("--keep-files", action="store_true", help="keep the temp dir afterwards")
    ap.add_argument("--fingerprint-tree", type=int, default=0, metavar="N",
                    help="only time SyncPlan.fingerprint() over a tree of N small files (no cluster)")
    args = ap.parse_args()
    if args.fingerprint_tree:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="ctbench-fp-") as tmp:
            bench_fingerprint(Path(tmp), args.fingerprint_tree, args.repeats)
        return 0
    counts = list(iter_csv_ints(args.nodes))

    root, home = begin("ctbench-sync-", f"cloudtrain workdir sync, local provider, node counts {counts}")
    # Before cloudtrain is imported: the library reads CLOUDTRAIN_HOME when it opens its state.
    os.environ["CLOUDTRAIN_HOME"] = str(home)
    os.environ["NO_COLOR"] = "1"
    wd = root / "wd"
    sizes: list[int] = []

    def prepare() -> None:
        t = time.monotonic()
        sizes.append(make_workdir(wd, args.files, args.file_mb))
        print(f"# workdir {wd}: {args.files} x {args.file_mb:g} MB random + 6 small .py "
              f"({sizes[0] / 1e6:.0f} MB) written in {time.monotonic() - t:.1f} s", flush=True)

    results, interrupted = run_counts(root, home, counts,
                                      lambda n: bench_nodes(root, home, wd, n, args.repeats),
                                      lambda n: f"bs-n{n}", keep_files=args.keep_files,
                                      prepare=prepare)
    size = sizes[0] if sizes else 0
    report(results, args.repeats, args.target, size)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
