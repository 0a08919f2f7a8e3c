"""What the recovery tests share (issue 13; tests/e2e/test_recovery.py on local nodes,
tests/providers/test_recovery_clouds.py on the cloud fakes): a job that checkpoints every 4
steps (and on SIGTERM) and writes which sample each step trained on, the order an
uninterrupted run writes, taking a node the way a cloud does (its sshd and every process
under it die at once), and the ledger's recoveries of a cluster."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Callable

from conftest import processes_with, wait_until

STEPS = 40

TRAIN = '''
import hashlib, os, signal, sys, time
rank = int(os.environ["CLOUDTRAIN_NODE_RANK"])
d = os.path.join(os.environ["HOME"], "trainstate")
os.makedirs(d, exist_ok=True)
ck, order = os.path.join(d, "ckpt"), os.path.join(d, "order.txt")
def sample(step):   # the data order: which sample each step trains on
    return int(hashlib.sha256(f"seed-{step}".encode()).hexdigest()[:8], 16) % 1000
start = int(open(ck).read()) if os.path.exists(ck) else 0
print(f"rank {rank} resumed from step {start}", flush=True)
if rank == 0:
    kept = open(order).read().splitlines()[:start] if os.path.exists(order) else []
    open(order, "w").write("".join(x + "\\n" for x in kept))
step = start
def save(*_):
    if rank == 0:
        open(ck + ".tmp", "w").write(str(step))
        os.replace(ck + ".tmp", ck)
def term(*_):
    save()
    print(f"rank {rank} checkpointed at step {step} on SIGTERM", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, term)
while step < STEPS:
    time.sleep(0.25)
    if rank == 0:
        with open(order, "a") as f:
            f.write(f"{step} {sample(step)}\\n")
    step += 1
    if step % 4 == 0:
        save()
print(f"rank {rank} done at step {step}", flush=True)
'''.replace("STEPS", str(STEPS))


def uninterrupted_order() -> list[str]:
    """The lines an uninterrupted run of TRAIN leaves in order.txt (step, sample): the same
    function the job uses (tests/e2e/test_recovery.py checks a real uninterrupted run)."""
    return [f"{s} {int(hashlib.sha256(f'seed-{s}'.encode()).hexdigest()[:8], 16) % 1000}"
            for s in range(STEPS)]


def write_job(proj: Path) -> Path:
    proj.mkdir(parents=True, exist_ok=True)
    (proj / "steps.py").write_text(TRAIN)
    return proj


def wait_or_fail(proc: subprocess.Popen[str], pred: Callable[[], bool], timeout: float,
                 what: str = "the job did not train") -> None:
    """Wait for ``pred``; when it does not come, stop the launch and fail with its output."""
    if wait_until(pred, timeout):
        return
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"{what}; the launch said:\n{(out + err)[-6000:]}")


def order(home: Path) -> list[str]:
    """The data order the head (whose HOME is ``home``) has trained on so far."""
    f = home / "trainstate" / "order.txt"
    try:
        return f.read_text().splitlines()
    except OSError:
        return []


def resumed_steps(text: str) -> list[int]:
    """Where rank 0 started each time (0, then the checkpoint it resumed from)."""
    return [int(x.rsplit(" ", 1)[1]) for x in text.splitlines() if "rank 0 resumed from step" in x]


def take(node_dir: Path) -> None:
    """The node dies at once: its sshd (pid in ``node_dir/sshd.pid``) and every process
    started through it (their environment carries HOME=node_dir/root)."""
    pids = [int((node_dir / "sshd.pid").read_text())]
    pids += processes_with(f"HOME={node_dir / 'root'}")
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sshd_processes(node_dir: Path) -> list[int]:
    """The node's SSH: its listening sshd and every sshd under it (the sessions the CLI has
    open to the node: the job's, the log follower's), not the job's own processes."""
    parent: dict[int, int] = {}
    comm: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        parent[int(entry.name)] = int(rest.split()[1])
        comm[int(entry.name)] = name
    found = processes_with(str(node_dir / "sshd_config"))
    todo = list(found)
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and comm[c].startswith("sshd")]
        found += kids
        todo += kids
    return sorted(set(found))


def recoveries(run: Callable[..., subprocess.CompletedProcess[str]],
               name: str) -> list[dict[str, object]]:
    """The ledger's recoveries of cluster ``name`` (``cost-report --json``)."""
    r = run("cost-report", "--json")
    assert r.returncode == 0, r.stderr
    return [x for x in json.loads(r.stdout).get("recoveries", []) if x["cluster"] == name]
