"""Buckets as sources and sinks, end to end through the real CLI on 2 local nodes, against each
cloud's storage emulator on loopback (moto's S3 server, gcp-storage-emulator, Azurite):

- a bucket file_mounts source that exists ONLY in the emulator is fetched by the nodes
  themselves (the emulator's request log shows one GET per node, none from the laptop);
- ``checkpoints:`` makes the template write into $CLOUDTRAIN_CHECKPOINT_DIR, and complete
  checkpoints (objects, then a manifest) appear in the bucket while the job runs;
- ``launch --down`` and a new launch with the same ``checkpoints:`` on a NEW cluster resume
  where the first stopped (result.json's start_step), restored from the bucket, passing over a
  newer half-uploaded checkpoint."""

from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path

import pytest

import storage_emulators as emus
from conftest import CLI, needs_sshd, needs_torch, wait_until

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

CORPUS = ("the quick brown fox jumps over the lazy dog. " * 400).encode()
COMMON = ["--batch-size", "16", "--eval-every", "5", "--log-every", "1", "--num-workers", "0",
          "--warmup-steps", "2", "--patience", "0", "--data", "data", "--ckpt-every", "5"]


@pytest.fixture(params=["s3", "gs", "az"])
def emulator(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    emu = emus.start(request.param, tmp_path / "emulator")
    yield emu
    emu.stop()


def task_file(proj: Path, name: str, emu: emus.Emulator, steps: int) -> Path:
    envs = {"OMP_NUM_THREADS": "1", "CLOUDTRAIN_CHECKPOINT_INTERVAL": "0.5", **emu.envs}
    doc = {
        "name": f"st-{emu.kind}", "num_nodes": 2, "resources": {"provider": "local"},
        "workdir": ".", "envs": envs,
        "file_mounts": {"data": emu.url("datasets/d1")},
        "checkpoints": emu.url("ckpt/run1"),
        "train": {"script": "train.py", "nproc_per_node": 1,
                  "args": ["--max-steps", str(steps), *COMMON]},
        "outputs": ["outputs/"],
    }
    p = proj / name
    p.write_text(json.dumps(doc))     # JSON is YAML
    return p


def _result(proj: Path) -> dict:
    return json.loads((proj / "cloudtrain-outputs" / "outputs" / "result.json").read_text())


def _object_gets(emu: emus.Emulator) -> list[str]:
    """Requests that read the corpus object's CONTENT (not listings or HEADs)."""
    lines = [ln for ln in emu.requests("/datasets/d1/corpus.txt") if "GET " in ln]
    if emu.kind == "gs":
        lines = [ln for ln in lines if "alt=media" in ln]
    return lines


def test_bucket_mounts_and_checkpoints_resume_on_a_new_cluster(
        cli: CLI, tmp_path: Path, emulator: emus.Emulator) -> None:
    emu = emulator
    proj = tmp_path / "proj"
    assert cli.run("init", str(proj)).returncode == 0
    emu.put("datasets/d1/corpus.txt", CORPUS)
    assert not list(proj.rglob("corpus.txt")), "the mount's source exists only in the bucket"

    # 1. first cluster: fetch the mount on both nodes, train 10 steps, checkpoints to the bucket
    r = cli.run("launch", str(task_file(proj, "a.yaml", emu, 10)), "-y", "--down", timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert len(re.findall(r"node [01]: fetched .*corpus|node [01]: fetched ", out)) == 2, out[-4000:]
    # Each node read the object itself; the laptop never did (it would be a third GET).
    assert len(_object_gets(emu)) == 2, _object_gets(emu)
    assert "No checkpoint in" in out and "Uploaded checkpoint step-000010" in out, out[-4000:]
    keys = emu.keys("ckpt/run1")
    manifests = sorted(k for k in keys if k.startswith("manifests/"))
    assert manifests and manifests[-1].endswith("-step-000010.json"), keys
    newest = json.loads(emu.cat("ckpt/run1/" + manifests[-1]))
    assert {f["path"] for f in newest["files"]} >= {"latest", "step-000010.pt"}
    for f in newest["files"]:   # every object the manifest names is there, with its size
        assert keys.get(f"objects/{f['sha256']}") == f["size"], f
    res = _result(proj)
    assert res["start_step"] == 0 and res["final_step"] == 10, res

    # A half-uploaded newer checkpoint: its object is in the bucket, and a manifest naming a
    # second object that never arrived; and objects of a step 20 without any manifest.
    emu.put("ckpt/run1/objects/" + "ef" * 32, b"x" * 100)
    half = {**newest, "step": 20, "files": [
        {"path": "step-000020.pt", "size": 100, "sha256": "ef" * 32},
        {"path": "latest", "size": 15, "sha256": "01" * 32}]}
    emu.put("ckpt/run1/manifests/29990101T000000000000Z-gone-step-000020.json",
            json.dumps(half).encode())

    # 2. a NEW cluster with the same checkpoints: resumes at step 10 from the bucket
    r = cli.run("launch", str(task_file(proj, "b.yaml", emu, 15)), "-y", "--down", timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Resuming from checkpoint step-000010" in out, out[-4000:]
    assert "skipping manifest 29990101T000000000000Z-gone-step-000020.json" in out, out[-4000:]
    res = _result(proj)
    assert res["start_step"] == 10 and res["final_step"] == 15, res
    assert "step-000010.pt" in (res.get("resumed_from") or ""), res
    assert any(k.endswith("-step-000015.json") for k in emu.keys("ckpt/run1/manifests")), \
        emu.keys("ckpt/run1")


def test_stopped_job_uploads_its_last_checkpoint_and_the_next_launch_resumes(
        cli: CLI, tmp_path: Path) -> None:
    """Ctrl-C on a launch: every node gets SIGTERM, the template saves a checkpoint at that step
    and exits; the watch on the head node uploads it after the job ended (within stop_grace),
    and a new cluster resumes from exactly that step."""
    emu = emus.start("s3", tmp_path / "emulator")
    try:
        proj = tmp_path / "proj"
        assert cli.run("init", str(proj)).returncode == 0
        emu.put("datasets/d1/corpus.txt", CORPUS)
        task = task_file(proj, "slow.yaml", emu, 1000)
        doc = json.loads(task.read_text())
        doc["train"]["args"] += ["--sleep-per-step", "0.3", "--ckpt-every", "1000"]
        doc["stop_grace"] = 60
        task.write_text(json.dumps(doc))
        proc = cli.popen("launch", str(task), "-y", "--down")
        seen: list[int] = []
        lines: list[str] = []

        def reader() -> None:
            assert proc.stdout is not None
            for ln in proc.stdout:
                lines.append(ln)
                m = re.search(r"\bstep (\d+)/1000\b", ln)
                if m:
                    seen.append(int(m.group(1)))

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        try:
            assert wait_until(lambda: seen and seen[-1] >= 8, 240), "".join(lines)[-3000:]
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
        t.join(timeout=10)
        out = "".join(lines)
        store_lines = "".join(ln for ln in lines if "[store]" in ln)
        assert "failed" not in store_lines, store_lines
        got = sorted(emu.keys("ckpt/run1/manifests"))
        step = int(re.search(r"step-(\d+)\.json$", got[-1]).group(1))  # type: ignore[union-attr]
        assert 8 <= step < 1000, (step, out[-3000:])
        assert f"Uploaded checkpoint step-{step:06d}" in out, out[-3000:]

        r = cli.run("launch", str(task_file(proj, "more.yaml", emu, step + 3)), "-y", "--down",
                    timeout=400)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        assert f"Resuming from checkpoint step-{step:06d}" in r.stdout, r.stdout[-4000:]
        res = _result(proj)
        assert res["start_step"] == step and res["final_step"] == step + 3, res
    finally:
        emu.stop()


def test_run_body_with_checkpoints_keeps_its_exit_code(cli: CLI, tmp_path: Path) -> None:
    """A plain ``run:`` body with ``checkpoints:``: it sees $CLOUDTRAIN_CHECKPOINT_DIR, what it
    leaves there goes up after it ends, and the launch fails with the body's own exit code."""
    emu = emus.start("s3", tmp_path / "emulator")
    try:
        proj = tmp_path / "proj"
        proj.mkdir()
        doc = {"name": "st-run", "num_nodes": 2, "resources": {"provider": "local"},
               "envs": {**emu.envs, "CLOUDTRAIN_CHECKPOINT_INTERVAL": "0.5"},
               "checkpoints": emu.url("ckpt/run-body"),
               # Node 0 fails first: the stop's SIGTERM then reaches its last upload too
               # (node 1 is stopped while it sleeps), which must still complete.
               "run": 'test -n "$CLOUDTRAIN_CHECKPOINT_DIR" || exit 9\n'
                      'mkdir -p "$CLOUDTRAIN_CHECKPOINT_DIR"\n'
                      'echo "$CLOUDTRAIN_NODE_RANK" > "$CLOUDTRAIN_CHECKPOINT_DIR/step-000007.txt"\n'
                      '[ "$CLOUDTRAIN_NODE_RANK" = 0 ] || sleep 5\n'
                      'exit 3'}
        task = proj / "t.yaml"
        task.write_text(json.dumps(doc))
        r = cli.run("launch", str(task), "-y", "--down", timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 3, out[-3000:]
        assert "Uploaded checkpoint step-000007" in out, out[-3000:]
        got = sorted(emu.keys("ckpt/run-body/manifests"))
        assert len(got) == 1 and got[0].endswith("-step-000007.json"), got
        man = json.loads(emu.cat("ckpt/run-body/manifests/" + got[0]))
        assert [f["path"] for f in man["files"]] == ["step-000007.txt"]
        assert emu.cat(f"ckpt/run-body/objects/{man['files'][0]['sha256']}") == b"0\n"   # the head's
    finally:
        emu.stop()


def test_a_node_without_rclone_stops_a_bucket_task_before_it_runs(cli: CLI, tmp_path: Path) -> None:
    """Bootstrap reports rclone on every node (the `rclone` step's result); a local node that
    has none stops a task with buckets before anything runs, exit 2, naming the node and the
    fix. (The node's answer is set in the state: this machine's nodes all have rclone.)"""
    import sqlite3

    proj = tmp_path / "proj"
    proj.mkdir()
    plain = proj / "plain.yaml"
    plain.write_text(json.dumps({"name": "st-norc", "num_nodes": 2,
                                 "resources": {"provider": "local"}, "run": "echo ok"}))
    r = cli.run("launch", str(plain), "-y", timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    db = cli.home / "state.db"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT rank, bootstrap_json FROM nodes WHERE cluster='st-norc'").fetchall()
        assert {json.loads(b).get("rclone", "") not in ("", "missing") for _, b in rows} == {True}, rows
        info = json.loads(dict(rows)[1])
        info["rclone"] = "missing"
        conn.execute("UPDATE nodes SET bootstrap_json=? WHERE cluster='st-norc' AND rank=1",
                     (json.dumps(info),))
    marker = tmp_path / "ran"
    bucket = proj / "bucket.yaml"
    bucket.write_text(json.dumps({"name": "st-norc", "num_nodes": 2,
                                  "resources": {"provider": "local"},
                                  "checkpoints": "s3://ct-bucket/x", "run": f"touch {marker}"}))
    r = cli.run("launch", str(bucket), "-y", timeout=300)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert "node(s) [1]" in r.stderr and "apt-get install rclone" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not marker.exists()
    assert cli.run("down", "st-norc", "-y").returncode == 0
