#!/usr/bin/env python3
"""Throughput of the training template (templates/train/train.py) on this machine.

Runs the template with torchrun (``--standalone``) for each process count in ``--nprocs``,
with a fixed per-process batch, and reads its own ``result.json``: samples/s (global,
warm-up steps excluded), and peak memory: the GPU's ``torch.cuda.max_memory_allocated`` where
there is a GPU, else the largest resident set of any training process (``ru_maxrss``).

On a GPU machine: NCCL, ``--precision bf16`` (autocast), one process per GPU up to the count
asked. On CPU: gloo, fp32, OMP_NUM_THREADS=1 per process. Prints a table and the scaling
ratio (samples/s at N processes / samples/s at 1), the figure that means something on a noisy
machine.

    python bench/bench_template.py [--nprocs 1,2] [--steps 60] [--dataset synthetic|tiny-text]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, iter_csv_ints, table  # noqa: E402 - imported after the sys.path set-up above

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "templates" / "train" / "train.py"


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_once(nproc: int, args: argparse.Namespace, gpus: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ct-bench-tmpl-") as tmp:
        out = Path(tmp) / "out"
        precision = "bf16" if gpus else "fp32"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), str(TRAIN), "--out", str(out),
               "--dataset", args.dataset, "--max-steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--precision", precision,
               "--num-workers", str(args.workers), "--ckpt-every", "0", "--eval-every", "0",
               "--patience", "0", "--log-every", "0", "--resume", "never"]
        if args.hidden:
            cmd += ["--hidden", str(args.hidden)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        # A fresh wrapper process per run, so its children's peak RSS is this run's alone.
        wrapper = ("import resource, subprocess, sys\n"
                   "rc = subprocess.run(sys.argv[1:]).returncode\n"
                   "print('maxrss_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,"
                   " file=sys.stderr)\n"
                   "sys.exit(rc)")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", wrapper, *cmd], env=env, capture_output=True,
                           text=True, timeout=args.timeout)
        wall = time.monotonic() - t0
        kb = [ln.split()[1] for ln in r.stderr.splitlines() if ln.startswith("maxrss_kb ")]
        rss_mb = int(kb[-1]) / 1024 if kb else None
        if r.returncode != 0:
            raise SystemExit(f"train.py with {nproc} process(es) failed ({r.returncode}):\n"
                             f"{r.stderr[-3000:]}")
        res = json.loads((out / "result.json").read_text())
        return {"nproc": nproc, "backend": res["backend"], "precision": res["precision"],
                "samples_per_sec": float(res["samples_per_sec"]),
                "gpu_peak_mb": res.get("peak_mem_mb"),
                "rss_peak_mb": rss_mb, "wall": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", default=None, help="process counts (default: 1,2 on CPU; 1,N on N GPUs)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=64, help="per-process micro-batch")
    ap.add_argument("--dataset", default="synthetic", choices=["synthetic", "tiny-text"])
    ap.add_argument("--hidden", type=int, default=0, help="model width (default: the template's)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    gpus = gpu_count()
    if args.nprocs:
        nprocs = list(iter_csv_ints(args.nprocs))
    else:
        nprocs = [1, gpus] if gpus > 1 else [1, 2] if not gpus else [1]
    print(f"training template: {args.dataset}, {args.steps} steps, batch {args.batch_size}/process, "
          f"{f'{gpus} GPU(s), NCCL, bf16' if gpus else 'CPU, gloo, fp32'}")
    rows = []
    base = None
    for n in nprocs:
        m = run_once(n, args, gpus)
        base = base or m["samples_per_sec"]
        rows.append([n, m["backend"], m["precision"], fmt(m["samples_per_sec"], 0),
                     fmt(m["samples_per_sec"] / base, 2),
                     fmt(m["gpu_peak_mb"], 0) if m["gpu_peak_mb"] is not None else "-",
                     fmt(m["rss_peak_mb"], 0) if m["rss_peak_mb"] is not None else "-",
                     fmt(m["wall"], 1)])
        print(f"  {n} process(es): {m['samples_per_sec']:.0f} samples/s", flush=True)
    print()
    print(table(["processes", "backend", "precision", "samples/s", "x 1 proc", "GPU peak MB",
                 "RSS peak MB", "wall s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
