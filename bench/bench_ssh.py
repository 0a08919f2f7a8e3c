#!/usr/bin/env python3
"""What a persistent SSH connection saves per node: a command on a warm local cluster, with
and without OpenSSH multiplexing (cloudtrain/sshmux.py).

For each node count (default 1, 4, 16) one local cluster is brought up, then, in process
with the library calls every command makes (``cluster.connect`` + ``Group.run``), R times
each, round robin:

* ``paramiko: connect + run``  what every command paid before issue 15: a handshake per node
  (key exchange, auth), then ``true`` on every node (CLOUDTRAIN_SSH_PERSIST=0);
* ``master: open + run``       the first command after the masters expired (each master opened,
  then ``true``); the masters are ended before each repetition;
* ``master: run``              every later command: ``true`` on every node over the masters
  (one session each, no handshake);
* ``ssh true`` (1 node)        a bare ``ssh node true`` of the system client, for scale.

Printed: medians (s) per node count, and the handshake saved per command (paramiko - warm).
Runs in a fresh temporary CLOUDTRAIN_HOME; every cluster is torn down in a finally.

    python bench/bench_ssh.py [--nodes 1,4,16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from typing import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (begin, cloudtrain_cmd, ct_env, fmt, iter_csv_ints, median, run_counts,  # noqa: E402 - imported after the sys.path set-up above
                     table)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_count(root: Path, home: Path, nodes: int, repeats: int) -> list[object]:
    name = f"bs-n{nodes}"
    task = root / f"{name}.yaml"
    task.write_text(f"name: {name}\nnum_nodes: {nodes}\nrun: 'true'\n")
    subprocess.run(cloudtrain_cmd() + ["up", str(task), "-y"], env=ct_env(home), check=True,
                   capture_output=True)
    os.environ["CLOUDTRAIN_HOME"] = str(home)
    from cloudtrain import sshmux
    from cloudtrain.cluster import connect, get_handle
    from cloudtrain.context import open_env
    from cloudtrain.ui import UI

    env = open_env(UI(quiet=True))
    handle = get_handle(env, name)

    def command(persist: str, fresh_masters: bool) -> None:
        os.environ[sshmux.PERSIST_ENV] = persist
        if fresh_masters:
            sshmux.end_cluster(handle.keys)
        group = connect(env, handle, timeout=60)
        try:
            res = group.run("true")
            assert all(r.ok for r in res.values()), res
        finally:
            group.close()

    kinds = {"paramiko: connect + run": ("0", False), "master: open + run": ("300", True),
             "master: run": ("300", False)}
    got: dict[str, list[float]] = {k: [] for k in kinds}
    command("300", False)   # warm-up (opens the masters)
    for _ in range(repeats):
        for k, (persist, fresh) in kinds.items():
            got[k].append(timed(functools.partial(command, persist, fresh)))
    os.environ[sshmux.PERSIST_ENV] = "300"
    node = handle.nodes[0]
    from cloudtrain.keys import ssh_command_options

    bare = [timed(lambda: subprocess.run(
        ["ssh", *ssh_command_options(handle.keys, node.port, node.identity_file), "-l",
         node.user, node.host, "true"], check=True, capture_output=True))
        for _ in range(repeats)]
    meds = {k: median(v) for k, v in got.items()}
    print(f"[{nodes:>2} node(s)] " + ", ".join(f"{k} {fmt(v)}" for k, v in meds.items()),
          flush=True)
    return [nodes, *(fmt(meds[k]) for k in kinds), fmt(median(bare)),
            fmt(meds["paramiko: connect + run"] - meds["master: run"]),
            f"{meds['paramiko: connect + run'] / meds['master: run']:.1f}x"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    counts = list(iter_csv_ints(args.nodes))
    root, home = begin("ctbench-ssh-", f"SSH per command, with and without a persistent "
                       f"master, node counts {counts}, {args.repeats} repetitions")
    rows, interrupted = run_counts(root, home, counts,
                                   lambda n: bench_count(root, home, n, args.repeats),
                                   lambda n: f"bs-n{n}")
    print()
    print(table(["nodes", "paramiko: connect + run s", "master: open + run s", "master: run s",
                 "bare ssh true s (1 node)", "saved per command s", "speed-up"], rows))
    print("  saved per command = paramiko (a handshake per node, what every command paid "
          "before) - a session over the warm master")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
