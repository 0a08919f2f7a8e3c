"""A sweep of the training template through the real CLI (docs/sweep.md, "A worked example"):
12 trials on 2 local nodes x 2 GPU slots, TPE and the median pruner, ``down: true``.

The trials run the template's ``train.py`` (``train:``) through a small wrapper that records,
outside the nodes, the CUDA_VISIBLE_DEVICES each trial saw, its node (the root its working
directory is under: every local node has its own) and when it started and ended. The sweep must run 4
trials at once at some point and never two at once on one (node, slot), prune at least one
hopeless trial, finish, name the best, plot, and take the cluster down by itself.

The pruning is deterministic: ``seed: 2509`` fixes each node's draws (the head samples with
the seed, the other node with seed + 1). Every node's first 4 learning rates are below 0.03
(the validation loss falls below its starting value, the same for every trial: the model's
seed is fixed), and each node's 5th is above 0.15 (the loss climbs far above it from the
first evaluation on). The 5th trial of a node starts once 3 of its first 4 ended, so Optuna's
MedianPruner (5 finished trials first) finds its best value, the starting one, above the
median of the finished trials at its first evaluation, and prunes it. ``--sleep-per-step``
spreads the 30 steps over a few seconds, so the driver (polling every 0.5 s) sees each
evaluation while the trial still runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, needs_sshd, needs_torch, processes_with, wait_until

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "train"
FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3"}

RECORD = """\
# The trial, as train.script: the template's train.py in a child process, and one line of
# what this trial saw (its slot, its node, its times) in $TRIAL_LOG, outside the nodes.
import json, os, signal, subprocess, sys, time

rec = {"trial": int(os.environ["CLOUDTRAIN_TRIAL"]), "node": os.getcwd().split("/.cloudtrain/")[0],
       "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": time.time()}
child = subprocess.Popen([sys.executable, "-u", "train.py", *sys.argv[1:]])
signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
rc = child.wait()
rec.update(end=time.time(), rc=rc)
with open(os.environ["TRIAL_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\\n")
sys.exit(rc if rc >= 0 else 128 - rc)
"""

TASK = """\
name: tpl
num_nodes: 2
stop_grace: 20
resources:
  provider: local
  local: {{gpus: 2}}
workdir: .
envs:
  OMP_NUM_THREADS: "1"
  TRIAL_LOG: {log}
train:
  script: record.py
  nproc_per_node: 1
  args: [--max-steps, "30", --eval-every, "5", --eval-batches, "2", --log-every, "0",
         --ckpt-every, "0", --num-workers, "0", --warmup-steps, "0", --patience, "0",
         --seed, "1", --sleep-per-step, "0.15"]
"""

SWEEP = """\
task: task.yaml
params:
  lr: {loguniform: [1.0e-4, 1.0]}
objective: {metric: val_loss, goal: minimize}
trials: 12
parallel: auto
gpus_per_trial: 1
sampler: tpe
pruner: median
seed: 2509
down: true
"""


def project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    shutil.copytree(TEMPLATE, proj)
    (proj / "record.py").write_text(RECORD)
    (proj / "task.yaml").write_text(TASK.format(log=json.dumps(str(tmp_path / "trials.jsonl"))))
    (proj / "search.yaml").write_text(SWEEP)
    return proj


def most_at_once(recs: list[dict[str, Any]]) -> int:
    """The most trials that ran at one moment (each from its start to its end)."""
    edges = sorted([(r["start"], 1) for r in recs] + [(r["end"], -1) for r in recs])
    now = best = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return best


def shared_slots(recs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Pairs of trials that overlapped in time on the same node and GPU slot."""
    return [(a["trial"], b["trial"]) for i, a in enumerate(recs) for b in recs[i + 1:]
            if (a["node"], a["cuda"]) == (b["node"], b["cuda"])
            and a["start"] < b["end"] and b["start"] < a["end"]]


def test_a_template_sweep_packs_the_slots_prunes_names_the_best_and_tears_down(
        cli: CLI, tmp_path: Path) -> None:
    proj = project(tmp_path)
    r = cli.run("sweep", "search.yaml", "-y", cwd=proj, timeout=600, **FAST)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = r.stdout + r.stderr
    assert "Sweep search started on cluster tpl" in said, said
    assert "workers: node 1 pid" in said and "(the head's internal address)" in said, said

    docs: list[dict[str, Any]] = []

    def finished() -> bool:
        got = cli.run("sweep", "results", "search", "--json", cwd=proj)
        assert got.returncode == 0, got.stdout + got.stderr
        docs.append(json.loads(got.stdout))
        return bool(docs[-1]["finished"])

    assert wait_until(finished, 900, step=1), docs[-1:]
    doc = docs[-1]
    counts = doc["counts"]
    assert len(doc["trials"]) == 12 and counts["complete"] + counts["pruned"] == 12, doc
    assert counts["pruned"] >= 1, doc
    values = {t["number"]: t["value"] for t in doc["trials"] if t["state"] == "complete"}
    assert doc["best"] == min(values, key=lambda n: values[n]), doc
    hopeless = [t for t in doc["trials"] if t["params"]["lr"] > 0.15]
    assert len(hopeless) >= 2 and all(t["state"] == "pruned" for t in hopeless), doc
    # The driver's own record: every trial held one slot, on both nodes.
    assert all(len(t["gpus"]) == 1 for t in doc["trials"]), doc
    assert len({t["node"] for t in doc["trials"]}) == 2, doc

    # What the trials saw: 4 at once, never two on one (node, slot).
    recs = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert sorted(r["trial"] for r in recs) == list(range(12)), recs
    assert {r["cuda"] for r in recs} == {"0", "1"} and len({r["node"] for r in recs}) == 2, recs
    assert most_at_once(recs) == 4, recs
    assert shared_slots(recs) == [], recs
    by_number = {t["number"]: t for t in doc["trials"]}
    for rec in recs:   # the slot the trial saw is the one the driver says it held
        assert by_number[rec["trial"]]["gpus"] == [rec["cuda"]], (rec, by_number[rec["trial"]])
    # A hopeless trial is pruned at its first evaluation: SIGTERM, train.py saves and exits 143.
    assert all(rec["rc"] == 143 for rec in recs if by_number[rec["trial"]] in hopeless), recs

    # down: true: the nodes stop by themselves once the final results were read.
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/tpl/"), 240, step=1), \
        processes_with(f"{cli.home}/clusters/tpl/")
    refreshed = cli.run("status", "--refresh", "--json")
    assert refreshed.returncode == 0, refreshed.stderr
    assert [e["status"] for e in json.loads(refreshed.stdout) if e["name"] == "tpl"] in \
        ([], ["GONE"]), refreshed.stdout
    assert cli.status() == []

    # Read afterwards, from the ledger: the best named, the plot written.
    st = cli.run("sweep", "status", "search", cwd=proj)
    assert st.returncode == 0, st.stderr
    assert f"best: trial {doc['best']} = " in st.stdout and "(finished)" in st.stdout, st.stdout
    assert f"pruned: {counts['pruned']}" in st.stdout, st.stdout
    png = tmp_path / "search.png"
    pl = cli.run("sweep", "results", "search", "--plot", str(png), cwd=proj)
    assert pl.returncode == 0, pl.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
