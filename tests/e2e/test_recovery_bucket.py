"""Recovery that resumes from the BUCKET (issue 13), through the real CLI on 2 local nodes with
``checkpoints:`` in moto's S3 server: the local "cloud" takes the HEAD (rank 0: its sshd and
every process under it die, and with its folder go its local checkpoints), so the replacement
can only resume from what reached the bucket. The run must end like an uninterrupted run of the
same task (same final step, same place in the data order, same losses) with one recovery in
``cost-report --json``; and a checkpoint the lost head had only half uploaded (its objects are
in the bucket, its manifest never came) is never resumed from."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import storage_emulators as emus
from cloud_storage_helpers import (CORPUS, assert_like_uninterrupted, complete_manifests,
                                   object_gets)
from conftest import CLI, needs_sshd, needs_torch, processes_with, wait_until

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

STEPS = 40
PRICE = 3600.0      # $ per node-hour: $1 per node-second, so the ledger's dollars read as seconds
ARGS = ["--max-steps", str(STEPS), "--ckpt-every", "5", "--batch-size", "16", "--eval-every",
        "10", "--log-every", "1", "--num-workers", "0", "--warmup-steps", "3", "--patience", "0",
        "--sleep-per-step", "0.25"]

# An rclone in front of the real one: once the test creates HOLD, the next manifest upload
# (store.py writes it after the checkpoint's objects) hangs, so the head is taken with a
# checkpoint half uploaded exactly as a real loss would leave it.
RCLONE_SHIM = """#!/bin/sh
case "$*" in
  *rcat*manifests/*) if [ -e {hold} ]; then echo "$*" > {held}; exec sleep 3600; fi ;;
esac
exec {rclone} "$@"
"""


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[emus.Emulator]:
    emu = emus.start("s3", tmp_path_factory.mktemp("emulator"))
    emu.put("datasets/d1/corpus.txt", CORPUS)
    yield emu
    emu.stop()


def _cleanup(cli: CLI) -> None:
    subprocess.run([sys.executable, "-m", "cloudtrain", "down", "-a", "-y"], env=cli.env(),
                   capture_output=True, timeout=120)
    for pid in processes_with(str(cli.home)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _project(cli: CLI, d: Path, name: str, emu: emus.Emulator, prefix: str,
             extra_envs: dict[str, str] | None = None) -> Path:
    r = cli.run("init", str(d))
    assert r.returncode == 0, r.stderr
    envs = {"OMP_NUM_THREADS": "1", "CLOUDTRAIN_CHECKPOINT_INTERVAL": "0.3", **emu.envs,
            **(extra_envs or {})}
    doc = {"name": name, "num_nodes": 2, "workdir": ".",
           "resources": {"provider": "local", "local": {"price_per_hour": PRICE}},
           "envs": envs, "stop_grace": 5, "checkpoints": emu.url(prefix),
           "recovery": {"poll_seconds": 1, "max_recoveries": 1},
           "train": {"script": "train.py", "nproc_per_node": 1, "args": ARGS},
           "outputs": ["outputs/"]}
    # The training data too comes from the bucket, onto every node (the replacement included).
    doc["file_mounts"] = {"data": emu.url("datasets/d1")}
    doc["train"]["args"] = [*ARGS, "--data", "data"]  # type: ignore[index]
    p = d / f"{name}.yaml"
    p.write_text(json.dumps(doc))
    return p


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, s3: emus.Emulator) -> Iterator[Path]:
    """The same task, uninterrupted (its own bucket prefix)."""
    base = tmp_path_factory.mktemp("ref")
    cli = CLI(base / "home")
    cli.home.mkdir()
    try:
        r = cli.run("launch", str(_project(cli, base / "proj", "bref", s3, "ckpt/ref")), "-y",
                    "--recover", "--down", timeout=400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        yield base / "proj"
    finally:
        _cleanup(cli)


def _node(cli: CLI, name: str, rank: int) -> Path:
    return cli.home / "clusters" / name / "local" / "nodes" / str(rank)


def _take(cli: CLI, name: str, rank: int) -> None:
    """The local 'preemption': the node's sshd and everything under it die at once."""
    node = _node(cli, name, rank)
    for p in [int((node / "sshd.pid").read_text())] + processes_with(f"HOME={node / 'root'}"):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _steps(emu: emus.Emulator, prefix: str) -> list[int]:
    return [int(m["step"]) for m in complete_manifests(emu, prefix) if m["step"] is not None]


def _recoveries(cli: CLI, name: str) -> list[dict[str, object]]:
    r = cli.run("cost-report", "--json")
    assert r.returncode == 0, r.stderr
    return [x for x in json.loads(r.stdout).get("recoveries", []) if x["cluster"] == name]


def _check_recovered(cli: CLI, name: str, proc: subprocess.Popen[str], reference: Path,
                     proj: Path) -> tuple[str, dict]:
    out, err = proc.communicate(timeout=400)
    text = out + err
    assert proc.returncode == 0, out[-4000:] + err[-4000:]
    assert "the cloud took node 0" in text, text[-4000:]
    got = assert_like_uninterrupted(reference, proj, STEPS, head_lost=True)
    recs = _recoveries(cli, name)
    assert len(recs) == 1, recs
    rec = recs[0]
    assert rec["ranks"] == [0] and rec["status"] == "RECOVERED", rec
    assert isinstance(rec["restart_s"], float) and rec["restart_s"] >= 0, rec
    assert str(rec["resumed_from"]).startswith("the newest checkpoint in the bucket"), rec
    assert "without 'checkpoints:'" not in err, err[-3000:]       # the task has them
    return text, got


def _lost_from(newest: float, taken_at: float, lost_s: float, rec: dict[str, object]) -> None:
    """The work lost runs from the newest complete checkpoint in the bucket to the loss's
    detection, as recorded (detection comes after the node was taken; how long after depends
    on the machine's load, so the bound is the recorded detection, not a fixed delay)."""
    detected = float(rec["detected_at_unix"])                    # type: ignore[arg-type]
    assert detected >= taken_at - 0.5, (detected, taken_at, rec)
    # The checkpoint's own time and its manifest's differ by the upload (about a second).
    assert abs(lost_s - (detected - newest)) <= 2.5, (lost_s, detected - newest, rec)


def test_lost_head_resumes_from_the_bucket_like_an_uninterrupted_run(
        cli: CLI, tmp_path: Path, s3: emus.Emulator, reference: Path) -> None:
    proj = tmp_path / "proj"
    task = _project(cli, proj, "bhead", s3, "ckpt/head")
    gets = len(object_gets(s3))
    proc = cli.popen("launch", str(task), "-y", "--recover", "--down",
                     CLOUDTRAIN_NODE_TIMEOUT="20")
    try:
        assert wait_until(lambda: max(_steps(s3, "ckpt/head") or [0]) >= 20, 300), \
            "no checkpoint of step 20 reached the bucket"
        _take(cli, "bhead", 0)
        taken_at = time.time()
        newest = max(m["time"] for m in complete_manifests(s3, "ckpt/head"))
        text, got = _check_recovered(cli, "bhead", proc, reference, proj)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The new head had nothing local: it restored the newest complete checkpoint from the bucket.
    # Both nodes fetched the data from the bucket, then the new head did; the survivor's copy
    # was unchanged.
    assert len(object_gets(s3)) - gets == 3, object_gets(s3)
    resumed = re.findall(r"Resuming from checkpoint step-(\d+)", text)
    assert resumed and int(resumed[-1]) >= 20, text[-4000:]
    assert got["start_step"] == int(resumed[-1]) and got["resumed_from"], got
    # The work lost is what came after the newest checkpoint in the BUCKET (the head's own
    # disk went with it): 2 nodes x $1/s from that checkpoint to the loss's detection (one
    # poll after it, plus slack), not from the job's start.
    (rec,) = _recoveries(cli, "bhead")
    lost_s = float(rec["lost_work_usd"]) / 2          # type: ignore[arg-type]
    _lost_from(newest, taken_at, lost_s, rec)
    print("recovery", {k: rec[k] for k in ("detect_s", "replace_s", "bootstrap_s", "sync_s",
                                           "restart_s", "lost_work_usd")},
          "since newest bucket checkpoint", round(taken_at - newest, 2))


def test_a_half_uploaded_checkpoint_of_the_lost_head_is_not_resumed_from(
        cli: CLI, tmp_path: Path, s3: emus.Emulator, reference: Path) -> None:
    import shutil

    shim = tmp_path / "shim"
    shim.mkdir()
    hold, held = tmp_path / "hold", tmp_path / "held"
    (shim / "rclone").write_text(RCLONE_SHIM.format(
        hold=hold, held=held, rclone=shutil.which("rclone") or "/usr/bin/rclone"))
    (shim / "rclone").chmod(0o755)
    proj = tmp_path / "proj"
    task = _project(cli, proj, "bhalf", s3, "ckpt/half",
                    {"PATH": f"{shim}:{os.environ['PATH']}"})
    proc = cli.popen("launch", str(task), "-y", "--recover", "--down",
                     CLOUDTRAIN_NODE_TIMEOUT="20")
    try:
        assert wait_until(lambda: max(_steps(s3, "ckpt/half") or [0]) >= 10, 300), \
            "no checkpoint of step 10 reached the bucket"
        hold.touch()
        assert wait_until(held.exists, 120), "the head's watch never uploaded again"
        complete = _steps(s3, "ckpt/half")
        # The cut checkpoint's objects are in the bucket; no manifest names them.
        keys = s3.keys("ckpt/half")
        named = {f"objects/{f['sha256']}" for m in complete_manifests(s3, "ckpt/half")
                 for f in m["files"]}
        assert {k for k in keys if k.startswith("objects/")} - named, keys
        newest = max(m["time"] for m in complete_manifests(s3, "ckpt/half"))
        time.sleep(3)        # training goes on, its checkpoints stay on the head's disk
        hold.unlink()
        _take(cli, "bhalf", 0)
        taken_at = time.time()
        text, got = _check_recovered(cli, "bhalf", proc, reference, proj)
    finally:
        if proc.poll() is None:
            proc.kill()
    resumed = re.findall(r"Resuming from checkpoint step-(\d+)", text)
    assert resumed and int(resumed[-1]) == max(complete), (resumed, complete, text[-4000:])
    assert got["start_step"] == max(complete), (got, complete)
    # Lost work runs from the newest COMPLETE checkpoint in the bucket, not from the cut one
    # nor from what the head had on its disk.
    (rec,) = _recoveries(cli, "bhalf")
    lost_s = float(rec["lost_work_usd"]) / 2          # type: ignore[arg-type]
    _lost_from(newest, taken_at, lost_s, rec)
