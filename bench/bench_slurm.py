#!/usr/bin/env python3
"""Launch overhead on Slurm: a job of one line on 2 nodes, three ways, from starting the
command to the line running on every node.

1. ``cloudtrain launch`` into a running 2-node allocation (warm: ``up`` and the bootstrap
   check done once before, not counted);
2. ``sbatch --wait -N2 --gres=gpu:1`` of the same line run by ``srun`` from a shell, as a new
   job each time (how users do it by hand; the scheduler places it on idle nodes);
3. ``cloudtrain launch`` of the same task on today's SSH path: the ``local`` provider's 2
   nodes, real sshd processes on this machine, reached over SSH as the ``ssh`` provider's
   hosts are (warm: the cluster is up and bootstrapped).

Each run's line writes ``date +%s.%N`` to a stamp file per node; overhead = the latest stamp -
the time just before the command started; wall = until the command exited. Medians are
printed, with the range. The Slurm cluster is the tests' own (tests/slurmkit.py: a private
munged, slurmdbd on MariaDB, slurmctld and two slurmd under a temp dir; it never touches the
machine's Slurm), started and stopped here.

    python bench/bench_slurm.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _common import (begin, cloudtrain_cmd, ct_env, fmt, median, table,  # noqa: E402
                     teardown, timed_lines)

LINE = 'date +%s.%N > {stamps}/started-$SLURM_NODEID'


def stamps_after(stamps: Path, t0: float, nodes: int) -> float | None:
    vals = []
    for f in stamps.glob("started-*"):
        try:
            vals.append(float(f.read_text().strip()))
        except ValueError:
            pass
    return max(vals) - t0 if len(vals) == nodes else None


def clear(stamps: Path) -> None:
    stamps.mkdir(parents=True, exist_ok=True)
    for f in stamps.glob("started-*"):
        f.unlink()


def task_file(root: Path, name: str, provider: str, stamps: Path) -> Path:
    wd = root / name
    wd.mkdir(parents=True, exist_ok=True)
    extra = (f"  accelerators: H100:1\n  slurm:\n    workdir: {root / 'shared' / name}\n"
             if provider == "slurm" else "")
    rank = "$SLURM_NODEID" if provider == "slurm" else "$CLOUDTRAIN_NODE_RANK"
    f = wd / "task.yaml"
    f.write_text(f"name: {name}\nnum_nodes: 2\nmax_hours: 0.5\nworkdir: .\n"
                 f"resources:\n  provider: {provider}\n{extra}"
                 f"run: date +%s.%N > {stamps}/started-{rank}\n")
    return f


def launches(home: Path, task: Path, stamps: Path, repeats: int) -> list[tuple[float, float]]:
    """One cold launch (not counted), then ``repeats`` warm ones: (overhead, wall) each."""
    out = []
    for i in range(repeats + 1):
        clear(stamps)
        code, t0, t1, lines = timed_lines(cloudtrain_cmd() + ["launch", str(task), "-y"],
                                          ct_env(home), cwd=task.parent)
        over = stamps_after(stamps, t0, 2)
        if code != 0 or over is None:
            raise SystemExit(f"launch failed ({code}):\n" + "\n".join(t for _, t in lines[-15:]))
        if i:
            out.append((over, t1 - t0))
    return out


def by_hand(env: dict[str, str], stamps: Path, repeats: int) -> list[tuple[float, float]]:
    """``sbatch --wait`` of the same line, a new job each time."""
    out = []
    for _ in range(repeats):
        clear(stamps)
        t0 = time.time()
        r = subprocess.run(["sbatch", "--wait", "-N2", "--gres=gpu:1", "-t", "5",
                            "-o", "/dev/null", "--wrap",
                            "srun --ntasks-per-node=1 bash -c " + repr(LINE.format(
                                stamps=stamps))], env=env, capture_output=True, text=True,
                           timeout=300)
        t1 = time.time()
        over = stamps_after(stamps, t0, 2)
        if r.returncode != 0 or over is None:
            raise SystemExit(f"sbatch --wait failed ({r.returncode}): {r.stdout}{r.stderr}")
        out.append((over, t1 - t0))
    return out


def row(what: str, runs: list[tuple[float, float]]) -> list[str]:
    o, w = [r[0] for r in runs], [r[1] for r in runs]
    return [what, fmt(median(o)), f"{fmt(min(o))}..{fmt(max(o))}", fmt(median(w)),
            f"{fmt(min(w))}..{fmt(max(w))}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from slurmkit import SlurmCluster, _why_not

    if _why_not():
        print(f"[bench] no Slurm here: {_why_not()}", file=sys.stderr)
        return 2
    import tempfile

    root, home = begin("ctbench-slurm-", "launch overhead on 2 nodes: Slurm allocation vs "
                                         "sbatch by hand vs the SSH path")
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="ct-slurm-")))
    rows = []
    try:
        t = time.monotonic()
        cluster.start()
        print(f"# test Slurm cluster started in {time.monotonic() - t:.1f} s", flush=True)
        os.environ["SLURM_CONF"] = str(cluster.conf)
        stamps = root / "stamps"
        rows.append(row("cloudtrain launch into the running allocation (slurm)",
                        launches(home, task_file(root, "sl", "slurm", stamps), stamps,
                                 args.repeats)))
        subprocess.run(cloudtrain_cmd() + ["down", "sl", "-y"], env=ct_env(home),
                       capture_output=True, timeout=300)
        cluster.wait_idle()
        rows.append(row("sbatch --wait -N2 --gres=gpu:1 (srun inside), by hand",
                        by_hand(cluster.env(), stamps, args.repeats)))
        rows.append(row("cloudtrain launch over SSH (local sshd nodes)",
                        launches(home, task_file(root, "ss", "local", stamps), stamps,
                                 args.repeats)))
    except KeyboardInterrupt:
        print("\n[bench] interrupted", file=sys.stderr)
    finally:
        teardown(home, root)
        cluster.cancel_all()
        cluster.stop()
    print(table([f"way (2 nodes, median of {args.repeats})", "overhead s", "range",
                 "wall s", "range"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
