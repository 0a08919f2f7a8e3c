#!/usr/bin/env python3
"""Warm launch overhead with and without a container, on local nodes.

Two warm clusters of N local nodes (default 4) run the same task, one on the host and one
with ``container: {image: IMAGE}`` (the container already running: started by a first
launch, not timed). Their warm launches alternate, so both see the same machine load. For
each launch:

    overhead = latest per-node start stamp (``date +%s.%N`` written by the job) - time just
               before the ``cloudtrain launch`` subprocess started
    wall     = until the CLI exited

Reported: the medians, and the container's extra overhead (goal: within 0.1 s: a warm
container launch runs no docker process but the job's own ``docker exec``).

Everything runs under a fresh temporary CLOUDTRAIN_HOME and is torn down at the end (the
clusters' containers with them), on Ctrl-C and SIGTERM too.

    python bench/bench_container.py [--nodes 4] [--repeats 7] [--image ct-test/tiny:TAG]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (begin, cloudtrain_cmd, ct_env, down, fmt, median, table, teardown,
                     timed_lines, verdict)


def default_image() -> str | None:
    """A ct-test image on this machine (the tests' tiny image first), else None."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    out = subprocess.run([docker, "images", "--format", "{{.Repository}}:{{.Tag}}"],
                         capture_output=True, text=True, timeout=60).stdout.split()
    for prefix in ("ct-test/tiny:", "ct-test/torch:"):
        for tag in out:
            if tag.startswith(prefix):
                return tag
    return None


def write_task(wd: Path, name: str, nodes: int, image: str | None) -> Path:
    """The job writes its start time into the node's $HOME (bind-mounted into a container at
    the same path; a local node's $HOME is its folder under CLOUDTRAIN_HOME)."""
    wd.mkdir(parents=True, exist_ok=True)
    task = wd / "task.yaml"
    box = f"container:\n  image: {image}\n" if image else ""
    task.write_text(f"name: {name}\nnum_nodes: {nodes}\nworkdir: .\n{box}run: |\n"
                    "  date +%s.%N > \"$HOME/started\"\n")
    return task


def one_launch(task: Path, home: Path, name: str, nodes: int) -> tuple[float, float] | None:
    """(overhead, wall) of one launch; None when it failed."""
    stamps = list((home / "clusters" / name / "local" / "nodes").glob("*/root/started"))
    for f in stamps:
        f.unlink()
    code, t0, t1, lines = timed_lines(cloudtrain_cmd() + ["launch", str(task), "-y"],
                                      ct_env(home), cwd=task.parent)
    vals = [float(f.read_text().strip() or 0)
            for f in (home / "clusters" / name / "local" / "nodes").glob("*/root/started")]
    if code != 0 or len(vals) != nodes:
        print(f"\n[bench] launch of {task} failed (exit {code}):\n"
              + "\n".join(text for _, text in lines[-15:]), flush=True)
        return None
    return max(vals) - t0, t1 - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4, help="nodes per cluster (default 4)")
    ap.add_argument("--repeats", type=int, default=7, help="warm launches of each (default 7)")
    ap.add_argument("--image", default=None, help="the container image (default: a ct-test "
                    "image on this machine, the tests' tiny one first)")
    ap.add_argument("--goal", type=float, default=0.1, help="allowed extra overhead, s")
    args = ap.parse_args()
    image = args.image or default_image()
    if image is None:
        print("bench_container: no image: pass --image (e.g. one built by "
              "'python tests/dockerkit.py tiny')", file=sys.stderr)
        return 2
    root, home = begin("ctbench-box-", f"warm launch with and without a container, local "
                       f"provider, {args.nodes} node(s), {args.repeats} warm launch(es) each, "
                       f"image {image}")
    runs: dict[str, list[tuple[float, float]]] = {"host": [], "container": []}
    names = {"host": "bc-host", "container": "bc-box"}
    tasks = {"host": write_task(root / "wd-host", "bc-host", args.nodes, None),
             "container": write_task(root / "wd-box", "bc-box", args.nodes, image)}
    interrupted = False
    try:
        for kind, task in tasks.items():
            print(f"[{kind}] cold launch (not timed)...", flush=True)
            if one_launch(task, home, names[kind], args.nodes) is None:
                return 1
        for i in range(args.repeats):
            for kind, task in tasks.items():
                r = one_launch(task, home, names[kind], args.nodes)
                if r is not None:
                    runs[kind].append(r)
            print(f"[bench] round {i + 1}: host {fmt(runs['host'][-1][0] if runs['host'] else None)}"
                  f" s, container {fmt(runs['container'][-1][0] if runs['container'] else None)} s",
                  flush=True)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for name in ("bc-host", "bc-box"):
            down(home, name)
        teardown(home, root)
    if not runs["host"] or not runs["container"]:
        return 130 if interrupted else 1
    med = {k: (median([o for o, _ in v]), median([w for _, w in v])) for k, v in runs.items()}
    print()
    print(f"## Warm launch, {args.nodes} local node(s) (median of {args.repeats})")
    print(table(["runtime", "ok", "overhead med s", "wall med s"],
                [[k, len(runs[k]), fmt(med[k][0]), fmt(med[k][1])] for k in runs]))
    extra = med["container"][0] - med["host"][0]
    print(f"container extra overhead: {extra:+.3f} s (goal: within {args.goal} s) "
          f"{verdict(extra <= args.goal)}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
