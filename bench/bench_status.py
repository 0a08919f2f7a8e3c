#!/usr/bin/env python3
"""What the GPU query costs ``cloudtrain status NAME --refresh`` on 2 local nodes.

One 2-node local cluster whose Python folder holds the stub nvidia-smi
(tests/fakes/nvidia_smi); each variant is warmed up once, then timed N times, wall clock:

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
from _common import begin, cloudtrain_cmd, ct_env, fmt, median, percentile, table, teardown  # noqa: E402

FAKE = Path(__file__).resolve().parent.parent / "tests" / "fakes" / "nvidia_smi"


def timed(cmd: list[str], env: dict[str, str], n: int, must: str) -> list[float]:
    def once() -> float:
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if p.returncode != 0 or must not in p.stdout:
            raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}, {must!r} not in output:\n"
                               f"{p.stdout[-800:]}{p.stderr[-800:]}")
        return dt

    once()
    return [once() for _ in range(n)]


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
        rows = []

        def variant(label: str, cmd: list[str], must: str, e: dict[str, str] = env) -> None:
            t = timed(cmd, e, args.runs, must)
            rows.append((label, fmt(median(t)), fmt(percentile(t, 90)), len(t)))

        variant("status (no --refresh)", ct + ["status", "bstat"], "bstat")
        variant("status --refresh, no nvidia-smi", ct + ["status", "bstat", "--refresh"], "no GPU")
        for h in homes:
            (h / ".fake-nvidia-smi").write_text("a100_8x_idle.csv\n")
        variant("status --refresh, 8x A100 per node", ct + ["status", "bstat", "--refresh"],
                "8 GPUs")
        if args.before is not None:
            src = args.before.resolve()
            old = dict(env, PYTHONPATH=f"{src}:{src / 'provisioners'}")
            variant(f"status --refresh, code before the query ({src.name})",
                    [sys.executable, "-m", "cloudtrain", "status", "bstat", "--refresh"], "bstat",
                    old)
        print(table(["variant", "median s", "p90 s", "runs"], rows))
        print(f"# load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return 0
    finally:
        teardown(home, root)


if __name__ == "__main__":
    sys.exit(main())
