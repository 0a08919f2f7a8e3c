#!/usr/bin/env python3
"""What the GPU query costs ``cloudtrain status NAME --refresh`` on 2 local nodes.

One 2-node local cluster whose Python folder holds the stub nvidia-smi
(tests/fakes/nvidia_smi); the variants run round robin (a warm-up round, then N rounds), wall
clock:

* ``status --refresh``, nodes answer with 8x A100 (the query parses 8 GPUs per node)
* ``status --refresh``, nodes without nvidia-smi (the query finds nothing: "no GPU")
* ``status`` (no --refresh: no query, no lease renewal)
* with ``--before SRC`` (a checkout of the code before the GPU query, e.g.
  ``git archive c6131d4 | tar -x -C /tmp/before``): ``status --refresh`` of that code on the
  same cluster, i.e. the cost before the query existed.

    python bench/bench_status.py [-n 15] [--before /tmp/before]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import begin, cloudtrain_cmd, ct_env, fmt, median, percentile, table, teardown  # noqa: E402 - imported after the sys.path set-up above

FAKE = Path(__file__).resolve().parent.parent / "tests" / "fakes" / "nvidia_smi"


def once(cmd: list[str], env: dict[str, str], must: str) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0 or must not in p.stdout:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}, {must!r} not in output:\n"
                           f"{p.stdout[-800:]}{p.stderr[-800:]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--runs", type=int, default=15)
    ap.add_argument("--before", type=Path, help="source tree of the code before the query")
    args = ap.parse_args()
    root, home = begin("ct-bench-status-", "status --refresh with the GPU query, 2 local nodes")
    try:
        bin_dir = root / "env" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
        (bin_dir / "python").chmod(0o755)
        (bin_dir / "nvidia-smi").symlink_to(FAKE / "nvidia-smi")
        task = root / "task.yaml"
        task.write_text("name: bstat\nnum_nodes: 2\nresources:\n  provider: local\n"
                        f"  local: {{python: {bin_dir / 'python'}}}\nrun: 'true'\n")
        env = ct_env(home)
        subprocess.run(cloudtrain_cmd() + ["up", str(task), "-y"], env=env, check=True,
                       capture_output=True)
        homes = sorted(home.glob("clusters/bstat/local/nodes/*/root"))
        ct = cloudtrain_cmd()
        gpu_on = [h / ".fake-nvidia-smi" for h in homes]

        def gpus(on: bool) -> None:
            for f in gpu_on:
                if on:
                    f.write_text("a100_8x_idle.csv\n")
                elif f.exists():
                    f.unlink()

        variants = [("status (no --refresh)", ct + ["status", "bstat"], "bstat", env, False),
                    ("status --refresh, no nvidia-smi", ct + ["status", "bstat", "--refresh"],
                     "no GPU", env, False),
                    ("status --refresh, 8x A100 per node (stub)",
                     ct + ["status", "bstat", "--refresh"], "8 GPUs", env, True)]
        if args.before is not None:
            src = args.before.resolve()
            old = dict(env, PYTHONPATH=f"{src}:{src / 'provisioners'}")
            variants.append((f"status --refresh, code before the query ({src.name})",
                             ct + ["status", "bstat", "--refresh"], "bstat", old, False))
        times: dict[str, list[float]] = {v[0]: [] for v in variants}
        for i in range(args.runs + 1):           # round robin: load drifts hit every variant
            for label, cmd, must, e, on in variants:
                gpus(on)
                dt = once(cmd, e, must)
                if i:                            # the first round warms up
                    times[label].append(dt)
        rows = [(k, fmt(median(t)), fmt(percentile(t, 90)), len(t)) for k, t in times.items()]
        print(table(["variant", "median s", "p90 s", "runs"], rows))
        print(f"# load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return 0
    finally:
        teardown(home, root)


if __name__ == "__main__":
    sys.exit(main())
