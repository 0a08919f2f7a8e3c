#!/usr/bin/env python3
"""Recovery: the time from the loss of a node to training again (issue 13).

A 2-node local cluster runs a deterministic job (rank 0 checkpoints every 4 steps and on
SIGTERM) under ``cloudtrain launch --recover`` (recovery.poll_seconds: ``--poll``); once it has
trained a few steps, node 1's sshd and every process under it are SIGKILLed (the local
"preemption"). The controller detects the loss from the provider's node_health, stops node 0
(SIGTERM, it checkpoints), discards node 1, provisions it again, bootstraps, syncs and restarts
the job, which resumes from the checkpoint. Reported per repeat, from the ledger
(``cost-report --json`` recoveries) and the kill time:

    detect     kill -> the controller saw the loss (the bench knows the kill time; the ledger
               only knows the last poll that saw the node running)
    replace    stop the survivors + discard + provision + SSH up
    bootstrap  the replacement's bootstrap (an existing Python environment on local nodes)
    sync       prep round trip, workdir sync to the new node, setup
    restart    job start on every node -> its first output line on node 0

Runs under a fresh temporary CLOUDTRAIN_HOME; everything is torn down in a ``finally``.

    python bench/bench_recovery.py [--repeats 3] [--poll 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import begin, cloudtrain_cmd, ct_env, down, fmt, median, table, teardown

TRAIN = '''
import os, signal, sys, time
rank = int(os.environ["CLOUDTRAIN_NODE_RANK"])
d = os.path.join(os.environ["HOME"], "trainstate"); os.makedirs(d, exist_ok=True)
ck = os.path.join(d, "ckpt")
start = int(open(ck).read()) if os.path.exists(ck) else 0
print(f"rank {rank} resumed from step {start}", flush=True)
step = start
def save(*_):
    if rank == 0:
        open(ck + ".tmp", "w").write(str(step)); os.replace(ck + ".tmp", ck)
def term(*_):
    save(); sys.exit(143)
signal.signal(signal.SIGTERM, term)
while step < 80:
    time.sleep(0.25); step += 1
    if step % 4 == 0:
        save()
    if rank == 0:
        open(os.path.join(d, "steps"), "w").write(str(step))
'''


def one(root: Path, home: Path, i: int, poll: float) -> dict[str, float]:
    name = f"rec{i}"
    proj = root / "proj"
    proj.mkdir(exist_ok=True)
    (proj / "steps.py").write_text(TRAIN)
    task = root / f"{name}.yaml"
    task.write_text(f"name: {name}\nnum_nodes: 2\nresources: {{provider: local}}\nworkdir: proj\n"
                    f"stop_grace: 5\nrecovery: {{poll_seconds: {poll}, max_recoveries: 1}}\n"
                    "run: python steps.py\n")
    nodes = home / "clusters" / name / "local" / "nodes"
    env = ct_env(home)
    proc = subprocess.Popen(cloudtrain_cmd() + ["launch", str(task), "-y", "--recover"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    steps = nodes / "0" / "root" / "trainstate" / "steps"
    deadline = time.monotonic() + 180
    while not (steps.exists() and steps.read_text().strip().isdigit()
               and int(steps.read_text()) >= 8):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the job did not train")
        time.sleep(0.1)
    home1 = f"HOME={nodes / '1' / 'root'}".encode()
    pids = [int((nodes / "1" / "sshd.pid").read_text())]
    for e in Path("/proc").iterdir():
        try:
            if e.name.isdigit() and home1 in (e / "environ").read_bytes().split(b"\0"):
                pids.append(int(e.name))
        except OSError:
            continue
    killed = time.time()
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out, _ = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"launch exited {proc.returncode}:\n{out}")
    rep = subprocess.run(cloudtrain_cmd() + ["cost-report", "--json"], env=env,
                         capture_output=True, text=True, check=True)
    [r] = [x for x in json.loads(rep.stdout)["recoveries"] if x["cluster"] == name]
    detected = r["detected_at_unix"]
    got = {"detect": detected - killed, "replace": r["replace_s"], "bootstrap": r["bootstrap_s"],
           "sync": r["sync_s"], "restart": r["restart_s"]}
    got["total"] = sum(got.values())
    down(home, name)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--poll", type=float, default=1.0, help="recovery.poll_seconds")
    args = ap.parse_args()
    root, home = begin("ct-bench-recovery-", "recovery: loss -> training again, 2 local nodes")
    rows: list[dict[str, float]] = []
    try:
        for i in range(args.repeats):
            rows.append(one(root, home, i, args.poll))
            print(f"# repeat {i + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in rows[-1].items()),
                  flush=True)
    except KeyboardInterrupt:
        print("[bench] interrupted", file=sys.stderr)
        return 130
    finally:
        teardown(home, root)
    keys = ["detect", "replace", "bootstrap", "sync", "restart", "total"]
    print(table(["phase", "median s", "min s", "max s"],
                [[k, fmt(median([r[k] for r in rows]), 2), fmt(min(r[k] for r in rows), 2),
                  fmt(max(r[k] for r in rows), 2)] for k in keys]))
    print(f"# poll_seconds {args.poll:g}; {len(rows)} repeat(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
