"""The checkpoint protocol of cloudtrain/node/store.py, run as the nodes run it (``python3
store.py ...``, rclone underneath) against moto's S3 server on loopback:

- a checkpoint is complete only when its manifest exists: objects uploaded without one (an
  upload killed before the manifest) are never restored; the previous complete one is;
- a newest manifest with a missing object, or an object that does not match its sha256, is
  skipped for the previous one; a manifest naming a path outside DIR is never used;
- partial files (*.tmp) are never uploaded; nothing cloudtrain did not write is touched;
- ``watch`` uploads each settled change, ignores SIGTERM until the job's process ends, then
  makes a last pass (the checkpoint a stopped job writes on its way out)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import storage_emulators as emus
from conftest import wait_until

STORE = Path(__file__).resolve().parents[2] / "cloudtrain" / "node" / "store.py"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    emu = emus.start("s3", tmp_path_factory.mktemp("s3emu"))
    yield emu
    emu.stop()


def _env(emu: emus.Emulator, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **emu.envs, **(extra or {})}


def store(emu: emus.Emulator, *args: str, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(STORE), *args], capture_output=True, text=True,
                          timeout=120, env=env or _env(emu))


def ckpt(d: Path, step: int, size: int = 50_000) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"step-{step:06d}.pt").write_bytes(os.urandom(size))
    (d / "latest").write_text(f"step-{step:06d}.pt\n")


def manifests(emu: emus.Emulator, prefix: str) -> list[str]:
    return sorted(k for k in emu.keys(prefix + "/manifests"))


def test_only_complete_checkpoints_are_restored(s3: emus.Emulator, tmp_path: Path) -> None:
    url, pre = s3.url("proto/a"), "proto/a"
    s3.put("proto/a-other/keep.txt", b"not ours")
    src = tmp_path / "src"
    ckpt(src, 10)
    (src / "step-000020.pt.host-1.tmp").write_bytes(b"half written")
    r = store(s3, "upload", url, str(src))
    assert r.returncode == 0 and "Uploaded checkpoint step-000010" in r.stdout, r.stderr
    first = manifests(s3, pre)
    assert len(first) == 1 and first[0].endswith("-step-000010.json")
    man = json.loads(s3.cat(f"{pre}/manifests/{first[0]}"))
    assert sorted(f["path"] for f in man["files"]) == ["latest", "step-000010.pt"], man
    assert man["step"] == 10 and man["node"] and man["time"] > 0

    # An upload killed before its manifest: rclone 'rcat' (the manifest write) fails, so the
    # objects of step 20 are in the bucket and no manifest names them.
    ckpt(src, 20)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "rclone").write_text('#!/bin/sh\nfor a; do [ "$a" = rcat ] && exit 9; done\n'
                                 'exec /usr/bin/rclone "$@"\n')
    (fake / "rclone").chmod(0o755)
    r = store(s3, "upload", url, str(src),
              env=_env(s3, {"PATH": f"{fake}:{os.environ['PATH']}"}))
    assert r.returncode == 1 and "rclone rcat failed" in r.stderr, r.stdout + r.stderr
    sha20 = hashlib.sha256((src / "step-000020.pt").read_bytes()).hexdigest()
    assert f"objects/{sha20}" in s3.keys(pre), "the objects went up before the failure"
    assert manifests(s3, pre) == first

    dest = tmp_path / "dest"
    r = store(s3, "restore", url, str(dest))
    assert r.returncode == 0 and "Resuming from checkpoint step-000010" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["latest", "step-000010.pt"]
    assert (dest / "step-000010.pt").read_bytes() == (src / "step-000010.pt").read_bytes()

    # A newer manifest whose object is missing, one whose object does not match its sha256
    # (same size), and one that names a path outside DIR: all skipped for step 10.
    good = json.loads(s3.cat(f"{pre}/manifests/{first[0]}"))
    fake_sha = "ab" * 32
    bad_missing = {**good, "step": 30, "files": [{"path": "step-000030.pt", "size": 5, "sha256": fake_sha}]}
    s3.put(f"{pre}/objects/{'cd' * 32}", b"12345")
    bad_sha = {**good, "step": 40, "files": [{"path": "step-000040.pt", "size": 5, "sha256": "cd" * 32}]}
    s3.put(f"{pre}/objects/{sha20}", (src / "step-000020.pt").read_bytes())
    bad_path = {**good, "step": 50, "files": [{"path": "../escaped.pt", "size": 50_000, "sha256": sha20}]}
    for i, m in enumerate((bad_missing, bad_sha, bad_path)):
        s3.put(f"{pre}/manifests/29990101T00000{i}000000Z-x-step-0000{3 + i}0.json", json.dumps(m).encode())
    dest2 = tmp_path / "dest2"
    r = store(s3, "restore", url, str(dest2))
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Resuming from checkpoint step-000010" in out, out
    assert "missing or of another size" in out and "did not match its sha256" in out, out
    assert "leaves the directory" in out, out
    assert not (tmp_path / "escaped.pt").exists()
    assert sorted(p.name for p in dest2.iterdir()) == ["latest", "step-000010.pt"]
    assert s3.keys("proto/a-other") == {"keep.txt": 8}, "cloudtrain touched what it did not write"


def test_restore_with_nothing_and_watch_final_pass(s3: emus.Emulator, tmp_path: Path) -> None:
    url, pre = s3.url("proto/w"), "proto/w"
    r = store(s3, "restore", url, str(tmp_path / "none"))
    assert r.returncode == 3 and "No checkpoint" in r.stdout, r.stdout + r.stderr

    d = tmp_path / "ck"
    d.mkdir()
    job = subprocess.Popen(["sleep", "600"])
    w = subprocess.Popen([sys.executable, str(STORE), "watch", url, str(d), "--pid", str(job.pid),
                          "--interval", "0.3"], env=_env(s3), stdout=subprocess.PIPE, text=True)
    try:
        ckpt(d, 5)
        assert wait_until(lambda: any(k.endswith("step-000005.json") for k in manifests(s3, pre)), 30)
        w.send_signal(signal.SIGTERM)          # a stop: the watch waits for the job
        time.sleep(1.0)
        assert w.poll() is None, "the watch ended before the job"
        ckpt(d, 6)                              # what the job writes on its way out
        job.kill()
        job.wait()
        assert w.wait(timeout=60) == 0
    finally:
        for p in (job, w):
            if p.poll() is None:
                p.kill()
    assert any(k.endswith("step-000006.json") for k in manifests(s3, pre)), manifests(s3, pre)


def test_fetch_copies_skips_unchanged_and_refuses_escaping_names(s3: emus.Emulator,
                                                                  tmp_path: Path) -> None:
    s3.put("proto/f/a.txt", b"a")
    s3.put("proto/f/sub/b.txt", b"bb")
    dest = tmp_path / "mnt"
    r = store(s3, "fetch", s3.url("proto/f"), str(dest))
    assert r.returncode == 0 and "fetched" in r.stdout, r.stdout + r.stderr
    assert (dest / "sub" / "b.txt").read_bytes() == b"bb"
    r = store(s3, "fetch", s3.url("proto/f"), str(dest))
    assert r.returncode == 0 and "unchanged" in r.stdout, r.stdout + r.stderr

    s3.put("proto/g/ok.txt", b"ok")
    import boto3   # a raw key with '..' segments (rclone itself would clean the name)

    boto3.client("s3", endpoint_url=s3.envs["AWS_ENDPOINT_URL"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").put_object(
        Bucket=emus.BUCKET, Key="proto/g/../../escaped.txt", Body=b"evil")
    dest = tmp_path / "deep" / "er" / "mnt"
    r = store(s3, "fetch", s3.url("proto/g"), str(dest))
    # rclone lists such a key with its '..' segments encoded (as fullwidth dots), so the file,
    # if written at all, stays inside DEST; store.py refuses real '..' names itself as well.
    assert r.returncode == 0, r.stdout + r.stderr
    assert (dest / "ok.txt").read_bytes() == b"ok"
    for hit in tmp_path.rglob("escaped.txt"):
        assert dest.resolve() in hit.resolve().parents, hit


def test_no_access_is_an_error_never_a_fresh_start(s3: emus.Emulator, tmp_path: Path) -> None:
    """A restore that cannot list the bucket (here: the endpoint refuses connections) fails
    with exit 1 and rclone's reason; it must not say "starting fresh" (the job would then
    train from scratch over a checkpoint it could not see)."""
    env = _env(s3, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{emus.free_port()}"})
    r = store(s3, "restore", s3.url("proto/a"), str(tmp_path / "d"), env=env)
    assert r.returncode == 1 and "cannot list" in r.stderr, r.stdout + r.stderr
    assert "fresh" not in r.stdout


@pytest.mark.parametrize("verb", ["copy", "lsjson"])
def test_an_upload_the_jobs_stop_interrupts_is_sent_again_and_not_called_failed(
        s3: emus.Emulator, tmp_path: Path, verb: str) -> None:
    """The job's stop SIGTERMs every process of the job, rclone among them (its Go runtime
    unblocks the signal): the transfer in flight ends, and the watcher's last pass sends the
    same state again. Once said 'upload failed' and '1 upload(s) failed', which the user read
    as a lost checkpoint. The stop may land on the upload's listing as well as on its copy
    (CI saw 'cannot list ...: exit -15' once the copy was covered)."""
    url, pre = s3.url("proto/int"), "proto/int"
    fake = tmp_path / "bin"
    fake.mkdir()
    once = tmp_path / "interrupted"
    (fake / "rclone").write_text(
        '#!/bin/sh\nfor a; do\n  if [ "$a" = ' + verb + ' ] && [ ! -e ' + str(once) + ' ]; then\n'
        '    touch ' + str(once) + '; kill -TERM $$\n  fi\ndone\nexec /usr/bin/rclone "$@"\n')
    (fake / "rclone").chmod(0o755)
    d = tmp_path / "ck"
    d.mkdir()
    job = subprocess.Popen(["sleep", "600"])
    w = subprocess.Popen([sys.executable, str(STORE), "watch", url, str(d), "--pid", str(job.pid),
                          "--interval", "0.3"], stdout=subprocess.PIPE, text=True,
                         env=_env(s3, {"PATH": f"{fake}:{os.environ['PATH']}"}))
    try:
        ckpt(d, 7)
        assert wait_until(once.exists, 30), "no upload was attempted"
        job.kill()
        job.wait()
        out, _ = w.communicate(timeout=60)
    finally:
        for p in (job, w):
            if p.poll() is None:
                p.kill()
    assert w.returncode == 0
    assert "interrupted by the job's stop" in out and "failed" not in out, out
    assert any(k.endswith("step-000007.json") for k in manifests(s3, pre)), manifests(s3, pre)
