"""The training template (templates/train/train.py) run for real: under torchrun with two CPU
processes (gloo), and as a plain `python train.py`, each run in its own temporary directory.

Every wait is bounded, and whatever a test started (torchrun, its workers, their DataLoader
workers) is killed when the test ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

TRAIN = Path(__file__).resolve().parents[2] / "templates" / "train" / "train.py"
RUN_TIMEOUT = 120  # seconds for one run; a normal one takes about 10 on a 2-core machine

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch not installed"),
    pytest.mark.timeout(300),
]

# Small and quick: a 2-process run of 40 steps takes a few seconds beyond interpreter start-up.
FAST = ["--num-workers", "0", "--eval-batches", "4"]


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _parent_map() -> dict[int, int]:
    """pid -> parent pid for every process now (from /proc/<pid>/stat)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name may hold spaces and parentheses: the fields follow the last ')'.
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int) -> list[int]:
    parents = _parent_map()
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        todo += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


class Launcher:
    """Starts train.py (under torchrun when nproc is given) with its output in a log file."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, workdir: Path, *args: str, nproc: int | None = 2) -> subprocess.Popen[bytes]:
        workdir.mkdir(parents=True, exist_ok=True)
        if nproc:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), "--monitor-interval", "0.2", str(TRAIN), *args]
        else:
            cmd = [sys.executable, str(TRAIN), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        with open(workdir / "log.txt", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, workdir: Path, *args: str, nproc: int | None = 2,
            timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
        proc = self.start(workdir, *args, nproc=nproc)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"train.py did not finish in {timeout}s:\n{log_of(workdir)[-4000:]}")
        return rc, log_of(workdir)

    def kill_all(self) -> None:
        for proc in self.procs:
            # torchrun puts each worker in a session of its own: find them through /proc.
            victims = [proc.pid, *descendants(proc.pid)] if proc.poll() is None else []
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def launcher():  # type: ignore[no-untyped-def]
    la = Launcher()
    yield la
    la.kill_all()


def log_of(workdir: Path) -> str:
    return (workdir / "log.txt").read_text(errors="replace")


def result_of(workdir: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((workdir / "outputs" / "result.json").read_text())


def metrics_of(workdir: Path) -> list[dict]:  # type: ignore[type-arg]
    path = workdir / "outputs" / "metrics.jsonl"
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written right now
                pass
    return records


def load_ckpt(path: Path) -> dict:  # type: ignore[type-arg]
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def latest_ckpt(workdir: Path) -> Path:
    ckpt_dir = workdir / "outputs" / "checkpoints"
    return ckpt_dir / (ckpt_dir / "latest").read_text().strip()


def wait_for(pred: Callable[[], bool], timeout: float, what: str,
             proc: subprocess.Popen[bytes], workdir: Path) -> None:
    """Poll ``pred`` until it holds; fail early if the run has ended without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if pred():
            return
        time.sleep(0.1)
    if not pred():
        why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not in {timeout}s"
        pytest.fail(f"waiting for {what}: {why}\n{log_of(workdir)[-4000:]}")


# ----------------------------------------------------------------------------------------------
# A 2-process run shared by several tests (each test copies what it modifies)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """40 steps, 2 processes, grad accum 2, a DataLoader worker each, a checkpoint every 10."""
    workdir = tmp_path_factory.mktemp("trained")
    la = Launcher()
    try:
        rc, log = la.run(workdir, "--max-steps", "40", "--grad-accum", "2", "--eval-every", "10",
                         "--ckpt-every", "10", "--keep-ckpts", "2", "--log-every", "5",
                         "--num-workers", "1", "--eval-batches", "4")
    finally:
        la.kill_all()
    assert rc == 0, log[-4000:]
    return workdir


def test_two_process_run_learns_and_writes_its_outputs(trained: Path) -> None:
    res = result_of(trained)
    assert (res["stop_reason"], res["start_step"], res["final_step"]) == ("completed", 0, 40)
    assert (res["world_size"], res["backend"], res["device"]) == (2, "gloo", "cpu")
    assert res["resumed_from"] is None and res["precision"] == "fp32" and res["compile"] is False
    assert res["last_val_loss"] < 0.85 * res["first_val_loss"], res["val_losses"]
    assert [s for s, _ in res["val_losses"]] == [0, 10, 20, 30, 40]
    assert res["best_val_loss"] == min(v for _, v in res["val_losses"])
    assert res["samples_per_sec"] > 0 and res["peak_mem_mb"] is None

    ckpts = trained / "outputs" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*.pt")) == ["step-000030.pt", "step-000040.pt"]
    assert (ckpts / "latest").read_text().strip() == "step-000040.pt"
    assert not list(ckpts.glob("*.tmp"))
    final = load_ckpt(ckpts / "step-000040.pt")
    assert (final["step"], final["reason"], final["world_size"]) == (40, "final", 2)
    assert len(final["rng"]) == 2 and not any(k.startswith("module.") for k in final["model"])
    best = load_ckpt(ckpts / "best.pt")
    assert best["best_val_loss"] == pytest.approx(res["best_val_loss"])

    assert list((trained / "outputs" / "tb").glob("events.out.tfevents.*"))
    records = metrics_of(trained)
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert all(r["lr"] > 0 and r["samples_per_sec"] > 0 for r in train)
    assert [r["step"] for r in val] == [0, 10, 20, 30, 40]

    log = log_of(trained)
    assert "world size 2" in log and "global batch 128" in log
    assert "step 40/40 loss" in log


def test_gradient_accumulation_sets_the_global_batch(trained: Path) -> None:
    res = result_of(trained)
    assert res["grad_accum"] == 2 and res["batch_size"] == 32
    assert res["global_batch"] == 32 * 2 * 2
    # Two micro-batches per step: 40 steps consumed 80 of the 128 per epoch on each rank.
    assert res["final_position"] == {"epoch": 0, "batch_in_epoch": 80}


def test_resume_continues_steps_and_data_order(trained: Path, tmp_path: Path, launcher: Launcher) -> None:
    workdir = tmp_path / "resumed"
    shutil.copytree(trained / "outputs", workdir / "outputs")
    rc, log = launcher.run(workdir, "--max-steps", "80", "--grad-accum", "2", "--eval-every", "10",
                           "--ckpt-every", "10", "--keep-ckpts", "2", "--log-every", "5", *FAST)
    assert rc == 0, log[-4000:]
    first, res = result_of(trained), result_of(workdir)
    assert res["start_step"] == first["final_step"] == 40
    assert res["final_step"] == res["max_steps"] == 80 and res["stop_reason"] == "completed"
    assert res["resumed_from"].endswith("step-000040.pt")
    assert "resumed from" in log and "at step 40" in log
    # The data position carries on from where the first run stopped, across an epoch boundary.
    assert res["start_position"] == first["final_position"] == {"epoch": 0, "batch_in_epoch": 80}
    assert res["final_position"] == {"epoch": 1, "batch_in_epoch": 32}
    final = load_ckpt(latest_ckpt(workdir))
    assert (final["step"], final["epoch"], final["batch_in_epoch"]) == (80, 1, 32)
    # Metrics continue the same file; this run's evaluations start at the resumed step.
    assert [s for s, _ in res["val_losses"]] == [40, 50, 60, 70, 80]
    assert max(r["step"] for r in metrics_of(workdir)) == 80
    assert res["val_losses"][-1][1] < first["first_val_loss"]

    # Started again once it is done: nothing to do, and nothing is overwritten.
    before = (workdir / "outputs" / "result.json").read_text()
    rc, log = launcher.run(workdir, "--max-steps", "80", *FAST, nproc=None)
    assert rc == 0, log[-4000:]
    assert "nothing left to do" in log
    assert (workdir / "outputs" / "result.json").read_text() == before


def test_resume_from_a_checkpoint_file_reproduces_the_uninterrupted_run(
        trained: Path, tmp_path: Path, launcher: Launcher) -> None:
    """Steps 30-40 again from step-000030.pt (--resume PATH) give the same model as the first
    run: same batches in the same order, same optimizer, schedule and RNG state."""
    ckpt = tmp_path / "from-elsewhere.pt"
    shutil.copy(trained / "outputs" / "checkpoints" / "step-000030.pt", ckpt)
    workdir = tmp_path / "replay"
    rc, log = launcher.run(workdir, "--resume", str(ckpt), "--max-steps", "40", "--grad-accum", "2",
                           "--eval-every", "10", "--log-every", "5", *FAST)
    assert rc == 0, log[-4000:]
    res, first = result_of(workdir), result_of(trained)
    assert res["resumed_from"] == str(ckpt) and res["start_step"] == 30
    assert res["start_position"] == {"epoch": 0, "batch_in_epoch": 60}
    assert res["last_val_loss"] == pytest.approx(first["last_val_loss"], rel=1e-6, abs=1e-7)
    loss_at_40 = [r["loss"] for r in metrics_of(trained) if r.get("step") == 40 and "loss" in r]
    replay_40 = [r["loss"] for r in metrics_of(workdir) if r.get("step") == 40 and "loss" in r]
    assert replay_40 == pytest.approx(loss_at_40, rel=1e-6, abs=1e-7)


# ----------------------------------------------------------------------------------------------
# SIGTERM
# ----------------------------------------------------------------------------------------------

SLOW = ["--max-steps", "1000", "--sleep-per-step", "0.3", "--ckpt-every", "1000", "--log-every", "1",
        "--eval-every", "1000", "--eval-batches", "2"]


def _workers(proc: subprocess.Popen) -> dict[int, int]:  # type: ignore[type-arg]
    """local rank -> pid of torchrun's training processes."""
    found = {}
    for pid, parent in _parent_map().items():
        if parent == proc.pid and str(TRAIN) in _cmdline(pid) and "LOCAL_RANK" in (env := _environ(pid)):
            found[int(env["LOCAL_RANK"])] = pid
    return found


def _assert_stopped_by_sigterm(workdir: Path, signalled_at_step: int) -> None:
    ckpt_path = latest_ckpt(workdir)
    ckpt = load_ckpt(ckpt_path)
    assert ckpt["reason"] == "sigterm"
    assert ckpt["step"] >= max(3, signalled_at_step) and ckpt["step"] < 1000
    # The only step checkpoint is the one SIGTERM wrote (none was due with --ckpt-every 1000).
    assert [p.name for p in (workdir / "outputs" / "checkpoints").glob("step-*.pt")] == [ckpt_path.name]
    res = result_of(workdir)
    assert res["stop_reason"] == "sigterm" and res["final_step"] == ckpt["step"]
    assert res["world_size"] == 2
    log = log_of(workdir)
    assert "SIGTERM: stopping at step" in log and "stopped by SIGTERM" in log


def _wait_for_step(workdir: Path, proc: subprocess.Popen, step: int) -> int:  # type: ignore[type-arg]
    wait_for(lambda: any(r.get("step", 0) >= step and "loss" in r for r in metrics_of(workdir)),
             RUN_TIMEOUT, f"step {step} in metrics.jsonl", proc, workdir)
    return max(r["step"] for r in metrics_of(workdir) if "loss" in r)


def test_sigterm_to_one_worker_stops_all_ranks_at_the_same_step(tmp_path: Path, launcher: Launcher) -> None:
    workdir = tmp_path / "sigterm-worker"
    proc = launcher.start(workdir, *SLOW, "--num-workers", "0")
    step = _wait_for_step(workdir, proc, 3)
    workers = _workers(proc)
    assert sorted(workers) == [0, 1], workers
    # Only rank 1 hears about it (as if only its node got the notice): rank 0 must still stop at
    # the same step, and rank 0 is the one that saves.
    os.kill(workers[1], signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun still running 60s after SIGTERM:\n{log_of(workdir)[-4000:]}")
    _assert_stopped_by_sigterm(workdir, step)
    # Both training processes exited with 143; torchrun reports the failure of its workers.
    assert "143" in log_of(workdir)


def test_sigterm_to_torchrun_is_passed_on_and_checkpointed(tmp_path: Path, launcher: Launcher) -> None:
    workdir = tmp_path / "sigterm-torchrun"
    # DataLoader workers too: torchrun signals each worker's whole process group, them included.
    proc = launcher.start(workdir, *SLOW, "--num-workers", "1")
    step = _wait_for_step(workdir, proc, 3)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun still running 60s after SIGTERM:\n{log_of(workdir)[-4000:]}")
    _assert_stopped_by_sigterm(workdir, step)
    # The DataLoader workers got the signal as well, and ignored it: no loader error.
    assert "DataLoader worker" not in log_of(workdir)


# ----------------------------------------------------------------------------------------------
# Early stopping
# ----------------------------------------------------------------------------------------------


def test_early_stopping_when_validation_stops_improving(tmp_path: Path, launcher: Launcher) -> None:
    workdir = tmp_path / "early"
    # No improvement can be larger than --min-delta 100: the first evaluation after the start
    # uses up a patience of 1.
    rc, log = launcher.run(workdir, "--max-steps", "200", "--eval-every", "5", "--patience", "1",
                           "--min-delta", "100", "--log-every", "5", *FAST)
    assert rc == 0, log[-4000:]
    res = result_of(workdir)
    assert res["stop_reason"] == "early-stop"
    assert res["final_step"] == 5 < res["max_steps"]
    assert [s for s, _ in res["val_losses"]] == [0, 5]
    ckpt = load_ckpt(latest_ckpt(workdir))
    assert (ckpt["reason"], ckpt["step"], ckpt["evals_without_improvement"]) == ("early-stop", 5, 1)
    assert (workdir / "outputs" / "checkpoints" / "best.pt").exists()
    assert "early stop at step 5" in log


# ----------------------------------------------------------------------------------------------
# Single process, text data, errors
# ----------------------------------------------------------------------------------------------


def test_single_process_tiny_text(tmp_path: Path, launcher: Launcher) -> None:
    rc, log = launcher.run(tmp_path, "--dataset", "tiny-text", "--max-steps", "4", "--batch-size", "8",
                           "--eval-every", "2", "--eval-batches", "2", "--log-every", "2",
                           "--num-workers", "0", nproc=None)
    assert rc == 0, log[-4000:]
    res = result_of(tmp_path)
    assert (res["dataset"], res["world_size"], res["backend"], res["final_step"]) == ("tiny-text", 1, None, 4)
    assert res["global_batch"] == 8
    assert "CharTransformer" in log


def test_single_process_text_file(tmp_path: Path, launcher: Launcher) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the cat sat on mat number {i * 7 % 13}.\n" for i in range(60)))
    rc, log = launcher.run(tmp_path, "--data", str(text), "--context", "16", "--max-steps", "3",
                           "--batch-size", "8", "--eval-batches", "2", "--num-workers", "0",
                           nproc=None)
    assert rc == 0, log[-4000:]
    res = result_of(tmp_path)
    assert (res["dataset"], res["data_path"], res["final_step"]) == ("text", str(text), 3)
    assert res["last_val_loss"] > 0


def test_missing_data_path_and_bad_arguments_exit_2(tmp_path: Path, launcher: Launcher) -> None:
    missing = tmp_path / "no-such-corpus.txt"
    rc, log = launcher.run(tmp_path / "a", "--data", str(missing), nproc=None, timeout=60)
    assert rc == 2 and str(missing) in log, log
    rc, log = launcher.run(tmp_path / "b", "--max-steps", "0", nproc=None, timeout=60)
    assert rc == 2 and "--max-steps" in log, log


def test_resume_never_starts_fresh_and_keeps_the_old_checkpoints(tmp_path: Path, launcher: Launcher) -> None:
    common = ["--max-steps", "4", "--batch-size", "8", "--ckpt-every", "2", "--eval-batches", "2",
              "--num-workers", "0"]
    rc, log = launcher.run(tmp_path, *common, nproc=None)
    assert rc == 0, log[-4000:]
    old = {p.name: p.read_bytes() for p in (tmp_path / "outputs" / "checkpoints").glob("*.pt")}
    assert "step-000004.pt" in old
    rc, log = launcher.run(tmp_path, *common, "--resume", "never", nproc=None)
    assert rc == 0, log[-4000:]
    assert result_of(tmp_path)["start_step"] == 0, "never means a fresh start"
    aside = list((tmp_path / "outputs" / "checkpoints").glob("previous-*"))
    assert len(aside) == 1, aside
    # Nothing lost: every old file is there, byte for byte.
    assert {p.name: p.read_bytes() for p in aside[0].glob("*.pt")} == old
