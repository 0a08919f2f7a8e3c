"""A worker wakes as soon as one of its trials' jobs ends (cloudtrain/node/sweepwork.py,
``Worker.nap``): the slot takes the next trial without waiting out the poll. Through the
node's real queue.py, with a poll far longer than the trials: before the wake-up, each trial
cost at least one whole poll."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from cloudtrain.node import queue, sweepstudy, sweepwork
from cloudtrain.node.sweepwork import Worker

TRIAL = """\
sleep 0.2
echo '{"step": 1, "score": 0.5}' >> "$CLOUDTRAIN_METRICS_FILE"
"""

SPEC = {"params": {"x": {"kind": "uniform", "low": 0.0, "high": 1.0}},
        "objective": {"metric": "score", "goal": "minimize"}, "trials": 3,
        "parallel": "auto", "gpus_per_trial": 1, "sampler": "random", "pruner": "none",
        "seed": 1, "slots": 1, "script": TRIAL, "stop_grace": 1}


def test_a_trial_that_ends_wakes_the_worker_before_the_poll(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / ".cloudtrain").mkdir(parents=True)
    (root / ".cloudtrain" / "slots").write_text("1")
    shutil.copy(queue.__file__, tmp_path / "queue.py")
    study = sweepstudy.open_study(sweepstudy.journal(str(root), "w1"), "w1", SPEC)
    dispatch = sweepwork.QueueDispatch(str(root), "sweep:w1", 1.0)
    dispatch.queue_py = str(tmp_path / "queue.py")
    t0 = time.monotonic()
    Worker(str(root), study, dispatch, "node0").run(poll_s=10.0)
    took = time.monotonic() - t0
    rep = sweepstudy.report(sweepstudy.read_study(str(root), "w1"), with_trials=True)
    assert rep["counts"]["complete"] == 3, rep
    # 3 trials one after another in one slot: without the wake-up, 3 polls of 10 s (>= 30 s)
    assert took < 15, took
    spans = sorted((t["started"], t["ended"]) for t in rep["trials_list"])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))     # one slot: one at a time


def test_an_rc_file_wakes_the_worker_once_only(tmp_path: Path) -> None:
    # A job whose rc exists while the queue still shows it running (whatever the reason)
    # wakes the worker once; the next nap sleeps its whole poll instead of spinning.
    root = tmp_path / "root"
    study = sweepstudy.open_study(sweepstudy.journal(str(root), "w2"), "w2", SPEC)
    w = Worker(str(root), study, sweepwork.QueueDispatch(str(root), "sweep:w2", 1.0), "node0")
    w.running[0] = sweepwork.Running(trial=None, job_id="j0", metrics="")
    (root / "jobs" / "j0").mkdir(parents=True)
    (root / "jobs" / "j0" / "rc").write_text("0")
    t0 = time.monotonic()
    w.nap(5.0)
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    w.nap(0.5)
    assert time.monotonic() - t0 >= 0.5


def test_a_trial_too_short_to_be_seen_running_still_records_its_gpus(tmp_path: Path) -> None:
    # The queue keeps the slots an ended job held (its record's ran_on): a trial that starts
    # and ends between two looks of the worker still has its GPUs in the results.
    root = tmp_path / "root"
    (root / ".cloudtrain").mkdir(parents=True)
    (root / ".cloudtrain" / "slots").write_text("2")
    shutil.copy(queue.__file__, tmp_path / "queue.py")
    spec = dict(SPEC, slots=2, trials=4, script="""\
echo '{"step": 1, "score": 0.5}' >> "$CLOUDTRAIN_METRICS_FILE"
""")
    study = sweepstudy.open_study(sweepstudy.journal(str(root), "w3"), "w3", spec)
    dispatch = sweepwork.QueueDispatch(str(root), "sweep:w3", 1.0)
    dispatch.queue_py = str(tmp_path / "queue.py")
    Worker(str(root), study, dispatch, "node0").run(poll_s=1.0)
    rep = sweepstudy.report(sweepstudy.read_study(str(root), "w3"), with_trials=True)
    assert rep["counts"]["complete"] == 4, rep
    assert all(len(t["gpus"]) == 1 and t["gpus"][0] in ("0", "1")
               for t in rep["trials_list"]), rep["trials_list"]
    recs = {r["id"]: r for r in queue.records(str(root))}
    assert all(r["held"] == [] and len(r["ran_on"]) == 1 for r in recs.values()), recs
