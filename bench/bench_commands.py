#!/usr/bin/env python3
"""What the everyday commands cost, end to end (a fresh ``cloudtrain`` process each time, wall
clock), on local sshd nodes, against the targets of issue 15:

* ``status`` (no --refresh) with 5 clusters in the state (four 1-node, one 4-node) <= 0.15 s
* ``status NAME --refresh`` on the 4-node cluster (providers and every node asked)  <= 0.3 s
* ``exec NAME -- true`` on the warm 4-node cluster                                   <= 0.3 s
* ``up TASK --dry-run`` and ``cost TASK`` (a 4-node local task)                      <= 0.3 s

and, for context, ``cloudtrain --help``. The clusters come up with ``cloudtrain up`` (local
provider) in a fresh temporary CLOUDTRAIN_HOME; each command then runs once to warm up, then
N times, round robin (load drifts hit every command alike). Everything is torn down in a
``finally``, on Ctrl-C and SIGTERM too.

    python bench/bench_commands.py [-n 11] [--before SRC]

``--before SRC`` (a source tree of older code, e.g. ``git archive 444d8c8 cloudtrain
provisioners bootstrap templates | tar -x -C /tmp/before``) adds each command run by that
code (through PYTHONPATH) on the same clusters, in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import begin, cloudtrain_cmd, ct_env, fmt, median, table, teardown, verdict  # noqa: E402 - imported after the sys.path set-up above

SMALL = ("bc-a", "bc-b", "bc-c", "bc-d")
BIG = "bc-big"


def once(cmd: list[str], env: dict[str, str], must: str) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    if p.returncode != 0 or must not in p.stdout + p.stderr:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}, {must!r} not in output:\n"
                           f"{p.stdout[-800:]}{p.stderr[-800:]}")
    return dt


def task(root: Path, name: str, nodes: int) -> Path:
    p = root / f"{name}.yaml"
    p.write_text(f"name: {name}\nnum_nodes: {nodes}\nresources:\n  provider: local\n"
                 "run: 'true'\n")
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--runs", type=int, default=11)
    ap.add_argument("--before", type=Path, help="source tree of older code to compare with")
    args = ap.parse_args()
    root, home = begin("ct-bench-commands-", "everyday commands: status, status --refresh, "
                       "exec, up --dry-run, cost (local nodes)")
    env = ct_env(home)
    ct = cloudtrain_cmd()
    try:
        t0 = time.monotonic()
        for name, nodes in [(n, 1) for n in SMALL] + [(BIG, 4)]:
            p = subprocess.run(ct + ["up", str(task(root, name, nodes)), "-y"], env=env,
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"up {name} failed:\n{p.stdout[-800:]}{p.stderr[-800:]}")
        print(f"# 5 clusters up (4 x 1 node, 1 x 4 nodes) in {time.monotonic() - t0:.1f} s")
        big = str(root / f"{BIG}.yaml")
        # (label, command, a word the output must hold, target in s or None)
        variants = [
            ("status (5 clusters, no --refresh)", ct + ["status"], BIG, 0.15),
            ("status bc-big --refresh (4 nodes)", ct + ["status", BIG, "--refresh"], BIG, 0.3),
            ("exec bc-big -- true (4 nodes, warm)", ct + ["exec", BIG, "--", "true"], "", 0.3),
            ("up bc-big.yaml --dry-run", ct + ["up", big, "--dry-run"], "dry run", 0.3),
            ("cost bc-big.yaml", ct + ["cost", big], "local", 0.3),
            ("--help (context)", ct + ["--help"], "Usage", None),
        ]
        runs = [(label, cmd, must, target, env) for label, cmd, must, target in variants]
        if args.before is not None:
            src = args.before.resolve()
            old = dict(env, PYTHONPATH=f"{src}:{src / 'provisioners'}")
            runs += [(f"{label} [before]", cmd, must, None, old)
                     for label, cmd, must, _ in variants[:-1]]
        times: dict[str, list[float]] = {v[0]: [] for v in runs}
        for i in range(args.runs + 1):
            for label, cmd, must, _, e in runs:
                dt = once(cmd, e, must)
                if i:                            # the first round warms up
                    times[label].append(dt)
        rows, verdicts = [], []
        for label, _, _, target, _ in runs:
            t = times[label]
            rows.append((label, fmt(median(t)), fmt(min(t)), fmt(max(t)), len(t),
                         "-" if target is None else f"<= {target:g}"))
            if target is not None:
                verdicts.append(f"{verdict(median(t) <= target)}  {label}: median "
                                f"{median(t):.3f} s (target <= {target:g} s)")
        print(table(["command", "median s", "min s", "max s", "runs", "target"], rows))
        print(f"# load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for v in verdicts:
            print(v)
        return 0
    except KeyboardInterrupt:
        print("\n[bench] interrupted: tearing everything down...", file=sys.stderr, flush=True)
        return 130
    finally:
        t_down = time.monotonic()
        teardown(home, root)
        print(f"# teardown done in {time.monotonic() - t_down:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
