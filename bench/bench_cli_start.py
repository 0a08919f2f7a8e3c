#!/usr/bin/env python3
"""How long ``cloudtrain --help`` takes, wall clock, from process start to exit.

Measured three (or four) ways, each warmed up once and then run N times:

* ``python -c pass``           the interpreter's own floor on this machine (for context)
* ``python -m cloudtrain``     the same interpreter, module entry point
* ``<scripts>/cloudtrain``     the real console script from sysconfig's scripts dir (the target)
* ``cloudtrain`` on PATH / the pyenv shim, when they differ from the above: for information
  (a pyenv shim runs bash and ``pyenv exec`` first, which costs more than cloudtrain itself)

Target: the real console script's median <= 0.15 s.

    python bench/bench_cli_start.py [-n 20] [--target 0.15]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, machine_line, median, percentile, real_script, table, verdict  # noqa: E402 - imported after the sys.path set-up above


def time_runs(cmd: list[str], n: int, env: dict[str, str], cwd: str) -> list[float]:
    def once() -> float:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        dt = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: "
                               f"{proc.stderr.decode(errors='replace')[-500:]}")
        return dt

    once()  # warm-up: page cache, .pyc files
    return [once() for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--runs", type=int, default=20, help="timed runs per variant (default 20)")
    ap.add_argument("--target", type=float, default=0.15, help="target median in seconds (default 0.15)")
    args = ap.parse_args()

    print(f"# cloudtrain --help start-up time ({args.runs} runs each, after 1 warm-up)")
    print(f"# machine: {machine_line()}")

    variants: list[tuple[str, list[str], bool]] = [
        ("python -c pass (floor)", [sys.executable, "-c", "pass"], False),
        ("python -m cloudtrain --help", [sys.executable, "-m", "cloudtrain", "--help"], False),
    ]
    script = real_script()
    if script:
        variants.append((f"{script} --help", [script, "--help"], True))
    # What a shell would run: the PATH entry (under `pyenv exec`, PATH already starts with the
    # real bin dir) and, if pyenv is installed, its shim, which adds bash start-up on top.
    seen = {os.path.realpath(script)} if script else set()
    shim_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    for label, cand in (("PATH", shutil.which("cloudtrain")),
                        ("pyenv shim", os.path.join(shim_root, "shims", "cloudtrain"))):
        if cand and os.access(cand, os.X_OK) and os.path.realpath(cand) not in seen:
            seen.add(os.path.realpath(cand))
            variants.append((f"{cand} --help ({label}, info)", [cand, "--help"], False))
    if script is None:
        # No console script installed next to this interpreter: judge the module entry point.
        variants[1] = (variants[1][0], variants[1][1], True)
        print("# note: no console script next to this interpreter; judging 'python -m cloudtrain'")

    env = dict(os.environ)
    # A scratch home: --help must not need one, but make sure no real state is touched.
    with tempfile.TemporaryDirectory(prefix="ctbench-cli-") as tmp:
        env["CLOUDTRAIN_HOME"] = tmp
        rows = []
        judged: float | None = None
        floor: float | None = None
        for label, cmd, is_target in variants:
            try:
                ts = time_runs(cmd, args.runs, env, tmp)
            except (OSError, RuntimeError) as exc:
                rows.append([label, "error", "-", "-", "-", str(exc)[:60]])
                continue
            med = median(ts)
            rows.append([label, fmt(med), fmt(percentile(ts, 90)), fmt(min(ts)), fmt(max(ts)),
                         "<- target" if is_target else ""])
            if is_target:
                judged = med
            if cmd[1:] == ["-c", "pass"]:
                floor = med

    print()
    print(table(["command", "median s", "p90 s", "min s", "max s", ""], rows))
    print()
    if judged is None:
        print(f"target: cloudtrain --help median <= {args.target:.2f} s: FAIL (not measured)")
    else:
        print(f"target: cloudtrain --help median <= {args.target:.2f} s: "
              f"{fmt(judged)} s -> {verdict(judged <= args.target)}")
        if floor is not None:
            print(f"cloudtrain's own share (median minus the 'python -c pass' floor): "
                  f"{fmt(judged - floor)} s  (the floor moves with machine load; compare runs "
                  "on an idle machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
