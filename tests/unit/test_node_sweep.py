"""The node-side sweep driver (cloudtrain/node/sweep.py), run in-process with a tiny stand-in
queue: real bash trials that write metrics lines, a real Optuna study in a journal file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import node_bundle

from cloudtrain.node import sweep, sweepstudy, sweepwork
from cloudtrain.node.sweepwork import JobView, Worker

# A trial: 6 steps of val_loss = (lr - 0.003)^2 * 1e4 + 1/step, except the trial whose number
# is $HOPELESS, which reports 100 every step and runs long (the median pruner stops it).
TRIAL = r"""
python3 - "$@" <<'PY'
import json, os, sys, time
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
lr = float(os.environ["CLOUDTRAIN_PARAM_LR"])
assert float(args["--lr"]) == lr and args["--bs"] == os.environ["CLOUDTRAIN_PARAM_BS"]
hopeless = os.environ["CLOUDTRAIN_TRIAL"] == os.environ.get("HOPELESS", "-1")
with open(os.environ["CLOUDTRAIN_METRICS_FILE"], "a") as f:
    for step in range(1, 7 if not hopeless else 200):
        loss = 100.0 if hopeless else (lr - 0.003) ** 2 * 1e4 + 1 / step
        f.write(json.dumps({"step": step, "@OBJ@": loss}) + "\n")
        f.flush()
        time.sleep(0.03)
PY
"""


class StandInQueue:
    """The queue's three calls, each job a bash process in its own session."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.cancelled: set[str] = set()
        self.gpus_asked: list[int] = []

    def submit(self, job_id: str, script: str, gpus: int) -> None:
        self.gpus_asked.append(gpus)
        self.procs[job_id] = subprocess.Popen(["bash", "-c", script], start_new_session=True,
                                              env={**os.environ, **self.env})

    def jobs(self) -> dict[str, JobView]:
        out = {}
        for job_id, p in self.procs.items():
            rc = p.poll()
            state = "running" if rc is None else "cancelled" if job_id in self.cancelled \
                else "succeeded" if rc == 0 else "failed"
            out[job_id] = JobView(state, rc, ("0",))
        return out

    def cancel(self, job_id: str) -> None:
        self.cancelled.add(job_id)
        os.killpg(self.procs[job_id].pid, signal.SIGTERM)


def _spec(**over: Any) -> dict:
    spec = {"params": {"lr": {"kind": "loguniform", "low": 1e-4, "high": 1e-1},
                       "bs": {"kind": "choice", "choices": [16, 32]}},
            "objective": {"metric": "val_loss", "goal": "minimize"}, "trials": 6,
            "parallel": "auto", "gpus_per_trial": 1, "sampler": "random", "pruner": "none",
            "seed": 7, "slots": 2, "script": TRIAL.replace("@OBJ@", "val_loss")}
    spec.update(over)
    return spec


def _run(tmp_path: Path, spec: dict, hopeless: int = -1) -> tuple[dict, StandInQueue]:
    study = sweepstudy.open_study(sweepstudy.journal(str(tmp_path), "s1"), "s1", spec)
    queue = StandInQueue(tmp_path, {"HOPELESS": str(hopeless)})
    Worker(str(tmp_path), study, queue, "node0").run(poll_s=0.02)
    return sweepstudy.report(sweepstudy.read_study(str(tmp_path), "s1"), with_trials=True), queue


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_six_trial_sweep_runs_to_the_end_and_names_the_best(tmp_path: Path,
                                                              sampler: str) -> None:
    rep, queue = _run(tmp_path, _spec(sampler=sampler))
    assert rep["finished"] and rep["stopped"] is None
    assert rep["counts"]["complete"] == 6 and len(rep["trials_list"]) == 6
    values = [t["value"] for t in rep["trials_list"]]
    assert rep["best"]["value"] == min(values)
    for t in rep["trials_list"]:
        assert t["intermediate"] == 6 and t["node"] == "node0" and t["gpus"] == ["0"]
        assert t["duration_s"] > 0 and set(t["params"]) == {"lr", "bs"}
        lines = (tmp_path / ".cloudtrain/sweeps/s1/trials" / str(t["number"]) / "metrics.jsonl")
        assert json.loads(lines.read_text().splitlines()[-1])["val_loss"] == t["value"]
    assert queue.gpus_asked == [1] * 6


def test_at_most_the_slots_run_at_once(tmp_path: Path) -> None:
    rep, _ = _run(tmp_path, _spec(slots=4, gpus_per_trial=2))
    spans = sorted((t["started"], t["ended"]) for t in rep["trials_list"])
    overlap = max(sum(1 for s, e in spans if s <= at < e) for at, _ in spans)
    assert overlap == 2


def test_the_median_pruner_stops_a_hopeless_trial(tmp_path: Path) -> None:
    rep, queue = _run(tmp_path, _spec(pruner="median", slots=1), hopeless=5)
    states = {t["number"]: t["state"] for t in rep["trials_list"]}
    assert states == {0: "complete", 1: "complete", 2: "complete", 3: "complete",
                      4: "complete", 5: "pruned"}
    assert queue.cancelled == {"sweep-s1-t5"}
    lines = (tmp_path / ".cloudtrain/sweeps/s1/trials/5/metrics.jsonl").read_text().splitlines()
    assert len(lines) < 199                      # SIGTERM ended it early
    assert rep["best"]["number"] != 5 and rep["finished"]


def test_a_metric_the_trials_never_report_stops_the_sweep_with_the_reason(tmp_path: Path) -> None:
    rep, _ = _run(tmp_path, _spec(script=TRIAL.replace("@OBJ@", "loss"), slots=1))
    assert rep["stopped"] and "never" not in rep["stopped"]
    assert "trial 0 ended without reporting the metric 'val_loss'" in rep["stopped"]
    assert len(rep["trials_list"]) == 1 and rep["counts"]["fail"] == 1 and rep["best"] is None


def test_failing_trials_stop_the_sweep_after_three_in_a_row(tmp_path: Path) -> None:
    rep, _ = _run(tmp_path, _spec(script="exit 3", slots=1))
    assert rep["counts"]["fail"] == 3 and "3 trials in a row failed" in rep["stopped"]
    assert "exit code 3" in rep["stopped"]


def test_cancel_stops_running_trials(tmp_path: Path) -> None:
    spec = _spec(slots=2, script="sleep 30")
    study = sweepstudy.open_study(sweepstudy.journal(str(tmp_path), "s1"), "s1", spec)
    queue = StandInQueue(tmp_path, {})
    w = Worker(str(tmp_path), study, queue, "node0")
    w.poll()
    assert len(w.running) == 2
    assert sweep.main(["sweep.py", "cancel", str(tmp_path), "s1"]) == 0
    w.run(poll_s=0.02)
    rep = sweepstudy.report(sweepstudy.read_study(str(tmp_path), "s1"), with_trials=True)
    assert rep["counts"]["fail"] == 2 and rep["stopped"] == "cancelled (sweep cancel)"
    assert queue.cancelled == {"sweep-s1-t0", "sweep-s1-t1"}


def test_grid_runs_each_point_once(tmp_path: Path) -> None:
    spec = _spec(sampler="grid", trials=10, slots=2,
                 params={"lr": {"kind": "choice", "choices": [0.001, 0.003]},
                         "bs": {"kind": "int", "low": 16, "high": 32, "log": False, "step": 16}})
    rep, _ = _run(tmp_path, spec)
    assert sorted((t["params"]["lr"], t["params"]["bs"]) for t in rep["trials_list"]) == \
        [(0.001, 16), (0.001, 32), (0.003, 16), (0.003, 32)]
    assert rep["best"]["params"]["lr"] == 0.003


def test_the_commands_read_a_sweep_from_the_journal(tmp_path: Path) -> None:
    _run(tmp_path, _spec())
    out = subprocess.run([sys.executable, sweep.__file__, "results", str(tmp_path), "s1"],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    assert doc["counts"]["complete"] == 6 and doc["best"]["number"] in range(6)
    out = subprocess.run([sys.executable, sweep.__file__, "status", str(tmp_path), "s1"],
                         capture_output=True, text=True, check=True).stdout
    assert "trials_list" not in json.loads(out)
    missing = subprocess.run([sys.executable, sweep.__file__, "status", str(tmp_path), "nope"],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "no such sweep" in missing.stdout
    assert subprocess.run([sys.executable, sweep.__file__, "bogus"]).returncode == 2


def test_a_worker_on_another_node_shares_the_study_through_the_grpc_proxy(
        tmp_path: Path) -> None:
    """The head keeps the journal and serves it with Optuna's gRPC storage proxy; a second
    worker (here a thread, as another node) reaches the same study through GrpcStorageProxy.
    Together they run exactly the spec's trials, each node filling its own slots."""
    pytest.importorskip("grpc")
    import socket
    import threading

    import optuna
    from optuna.storages import GrpcStorageProxy
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    storage = sweepstudy.journal(str(tmp_path), "s1")
    head = sweepstudy.open_study(storage, "s1", _spec(trials=8, slots=2))
    threading.Thread(target=optuna.storages.run_grpc_proxy_server, args=(storage,),
                     kwargs={"host": "127.0.0.1", "port": port}, daemon=True).start()
    proxy = GrpcStorageProxy(host="127.0.0.1", port=port)
    proxy.wait_server_ready(timeout=30)
    other = Worker(str(tmp_path / "n1"), sweepstudy.open_study(proxy, "s1"), StandInQueue(tmp_path, {}),
                   "node1")
    t = threading.Thread(target=other.run, kwargs={"poll_s": 0.02})
    t.start()
    Worker(str(tmp_path), head, StandInQueue(tmp_path, {}), "node0").run(poll_s=0.02)
    t.join(timeout=120)
    rep = sweepstudy.report(sweepstudy.read_study(str(tmp_path), "s1"), with_trials=True)
    assert rep["finished"] and rep["counts"]["complete"] == 8 and len(rep["trials_list"]) == 8
    assert {t["node"] for t in rep["trials_list"]} == {"node0", "node1"}


def _shipped(tmp_path: Path, slots: int = 2) -> Path:
    """sweep.py as the nodes hold it: a plain file beside the node's real queue.py (with
    ``slots`` GPU slots on the node ROOT = tmp_path/root), run with python3."""

    node = tmp_path / "node"
    node.mkdir()
    node_bundle(node)
    (tmp_path / "root" / ".cloudtrain").mkdir(parents=True)
    (tmp_path / "root" / ".cloudtrain" / "slots").write_text(str(slots))
    return node / "sweep.py"


def _cmd(script: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_start_runs_the_sweep_detached_through_the_queue_and_prunes_with_sigterm(
        tmp_path: Path) -> None:
    import time
    script, root = _shipped(tmp_path), tmp_path / "root"
    trial = TRIAL.replace("@OBJ@", "val_loss").replace(
        '"-1")', '"5")').replace("python3 - ", "exec python3 - ")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(pruner="median", slots=1, script=trial, stop_grace=1)))
    env_poll = {**os.environ, "CLOUDTRAIN_SWEEP_POLL": "0.05"}
    started = subprocess.run([sys.executable, str(script), "start", str(root), "s1", str(spec)],
                             capture_output=True, text=True, env=env_poll, check=True)
    assert json.loads(started.stdout)["pid"] > 0
    deadline = time.time() + 120
    while not (doc := _cmd(script, "results", str(root), "s1") if (
            root / ".cloudtrain/sweeps/s1/journal.log").exists() else {}).get("finished"):
        assert time.time() < deadline, doc
        time.sleep(0.3)
    states = [t["state"] for t in doc["trials_list"]]
    assert states == ["complete"] * 5 + ["pruned"], doc
    assert doc["trials_list"][0]["gpus"] == ["0"] and doc["trials_list"][0]["job_id"] == "sweep-s1-t0"
    pruned = json.loads((root / ".cloudtrain/queue/sweep-s1-t5.json").read_text())
    assert pruned.get("cancel") is True      # the queue was told, and the trial got SIGTERM
    lines = (root / ".cloudtrain/sweeps/s1/trials/5/metrics.jsonl").read_text().splitlines()
    assert len(lines) < 199


def test_a_pruned_trial_that_ignores_sigterm_is_killed_after_its_grace(tmp_path: Path) -> None:
    import time
    script = _shipped(tmp_path)
    q = sweepwork.QueueDispatch(str(tmp_path / "root"), "sweep:s1", 0.5)
    q.queue_py = str(script.with_name("queue.py"))
    q.submit("j1", "trap '' TERM; sleep 30", 2)
    time.sleep(0.3)
    assert q.jobs()["j1"] == JobView("running", None, ("0", "1"))
    t0 = time.time()
    q.cancel("j1")
    while q.jobs()["j1"].state == "running":
        assert time.time() - t0 < 10
        time.sleep(0.1)
    assert 0.4 < time.time() - t0 < 5 and q.jobs()["j1"].state == "cancelled"


def test_a_restarted_head_resumes_the_journal_and_fails_the_trials_it_lost(tmp_path: Path) -> None:
    """Recovery: the journal comes back (from the checkpoints bucket) with a trial the lost
    head left running; the new head tells it FAIL and runs the rest of the sweep."""
    import time
    script, root = _shipped(tmp_path), tmp_path / "root"
    spec = _spec(trials=3, slots=2)
    sweepstudy.open_study(sweepstudy.journal(str(root), "s1"), "s1", spec).ask()
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([sys.executable, str(script), "start", str(root), "s1",
                    str(tmp_path / "spec.json")], check=True, capture_output=True,
                   env={**os.environ, "CLOUDTRAIN_SWEEP_POLL": "0.05"})
    deadline = time.time() + 120
    while not (doc := _cmd(script, "results", str(root), "s1"))["finished"]:
        assert time.time() < deadline, doc
        time.sleep(0.3)
    assert [t["state"] for t in doc["trials_list"]] == ["fail", "complete", "complete"]
    assert doc["lost"] == [0]


def test_two_workers_passing_room_for_the_last_trial_run_exactly_the_total(
        tmp_path: Path) -> None:
    """The race on the last trial: two workers (two nodes) share one storage, both find room
    for it (``room`` counts before ``ask``), both ask. The storage numbers trials in the order
    asked, so the second is one too many: it never runs, and the sweep reports exactly
    ``trials`` trials."""
    spec = _spec(trials=3, slots=8)
    storage = sweepstudy.journal(str(tmp_path), "s1")
    queues = [StandInQueue(tmp_path, {}), StandInQueue(tmp_path, {})]
    workers = [Worker(str(tmp_path), sweepstudy.open_study(storage, "s1", spec), q, f"node{i}")
               for i, q in enumerate(queues)]
    workers[0].launch()
    workers[0].launch()
    assert workers[0].room() and workers[1].room()      # both see one trial left
    workers[0].launch()
    workers[1].launch()
    while any([w.poll() for w in workers]):
        time.sleep(0.02)
    rep = sweepstudy.report(sweepstudy.read_study(str(tmp_path), "s1"), with_trials=True)
    assert rep["finished"] and len(rep["trials_list"]) == 3
    assert rep["counts"] == {"running": 0, "complete": 3, "pruned": 0, "fail": 0, "waiting": 0}
    assert sum(len(q.procs) for q in queues) == 3 and not workers[1].running
