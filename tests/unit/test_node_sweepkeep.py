"""The sweep's study kept in the checkpoints bucket (cloudtrain/node/sweepkeep.py), against
moto's S3 server on loopback with the real store.py and rclone: the spec's ``keep`` is put
aside (never in the study), the journal is pushed as a complete snapshot, a head with no
journal restores the newest complete copy (never a half-written one), and the bucket keeps
only the newest copies."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

import pytest

import storage_emulators as emus
from conftest import wait_until
from cloudtrain.node import sweepkeep, sweepstudy

pytestmark = pytest.mark.skipif(shutil.which("rclone") is None, reason="rclone not installed")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[emus.Emulator]:
    pytest.importorskip("moto")
    emu = emus.start("s3", tmp_path_factory.mktemp("emulator"))
    yield emu
    emu.stop()


def _spec(emu: emus.Emulator, prefix: str) -> dict:
    return {"trials": 3, "objective": {"metric": "val_loss", "goal": "minimize"},
            "params": {"lr": {"kind": "uniform", "low": 0.0, "high": 1.0}},
            "sampler": "random", "pruner": "none",
            "keep": {"url": emu.url(prefix), "env": dict(emu.envs)}}


def _journal(root: Path) -> Path:
    return root / ".cloudtrain/sweeps/s1/journal.log"


def _study_with(root: Path, spec: dict, done: int) -> object:
    from optuna.trial import TrialState
    study = sweepstudy.open_study(sweepstudy.journal(str(root), "s1"), "s1", spec)
    for i in range(done):
        t = study.ask({"lr": sweepstudy.distributions(spec)["lr"]})
        study.tell(t, float(i), state=TrialState.COMPLETE)
    return study


def test_keep_is_put_aside_private_and_out_of_the_study(tmp_path: Path, s3: emus.Emulator) -> None:
    spec = _spec(s3, "ck/a")
    rest = sweepkeep.put_aside(str(tmp_path), "s1", spec)
    assert "keep" not in rest and rest["trials"] == 3
    path = tmp_path / ".cloudtrain/sweeps/s1/keep.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keep = sweepkeep.read_keep(str(tmp_path), "s1")
    assert keep is not None and keep.at("s1") == spec["keep"]["url"] + "/sweeps/s1"
    assert dict(keep.env)["AWS_ACCESS_KEY_ID"] == "testing"
    sweepkeep.put_aside(str(tmp_path), "s1", rest)          # a spec without keep: none kept
    assert sweepkeep.read_keep(str(tmp_path), "s1") is None and not path.exists()


def test_a_pushed_journal_is_restored_on_a_head_that_has_none(tmp_path: Path, s3: emus.Emulator) -> None:
    spec = _spec(s3, "ck/b")
    old, new = tmp_path / "old", tmp_path / "new"
    rest = sweepkeep.put_aside(str(old), "s1", spec)
    _study_with(old, rest, 2)
    assert sweepkeep.transfer(str(old), "s1", "push") == 0
    keys = s3.keys("ck/b/sweeps/s1")
    assert sum(k.startswith("manifests/") for k in keys) == 1
    assert sum(k.startswith("objects/") for k in keys) == 1
    sweepkeep.put_aside(str(new), "s1", spec)
    assert sweepkeep.restored(str(new), "s1")
    assert _journal(new).read_bytes() == _journal(old).read_bytes()
    study = sweepstudy.read_study(str(new), "s1")
    assert [t.value for t in study.get_trials()] == [0.0, 1.0]
    assert not sweepkeep.restored(str(new), "s1")           # it has one now: left alone


def test_nothing_kept_nothing_restored(tmp_path: Path, s3: emus.Emulator) -> None:
    sweepkeep.put_aside(str(tmp_path), "s1", _spec(s3, "ck/empty"))
    assert not sweepkeep.restored(str(tmp_path), "s1")
    assert not _journal(tmp_path).exists()
    assert sweepkeep.transfer(str(tmp_path / "other"), "s1", "push") == sweepkeep.NOTHING


def test_a_half_written_copy_is_never_restored(tmp_path: Path, s3: emus.Emulator) -> None:
    """A copy whose object reached the bucket but whose manifest never came (the head was
    lost mid-push), and a last line the journal had half written: the restored journal is the
    last complete copy, with whole lines only."""
    spec = _spec(s3, "ck/c")
    old, new = tmp_path / "old", tmp_path / "new"
    rest = sweepkeep.put_aside(str(old), "s1", spec)
    _study_with(old, rest, 1)
    with _journal(old).open("ab") as f:
        f.write(b'{"op_code": 4, "half')                     # a write in progress
    assert sweepkeep.transfer(str(old), "s1", "push") == 0
    good = _journal(old).read_bytes()
    good = good[:good.rfind(b"\n") + 1]
    s3.put("ck/c/sweeps/s1/objects/" + "0" * 64, b"a newer copy, its manifest never written\n")
    sweepkeep.put_aside(str(new), "s1", spec)
    assert sweepkeep.restored(str(new), "s1")
    assert _journal(new).read_bytes() == good
    assert len(sweepstudy.read_study(str(new), "s1").get_trials()) == 1


def test_keeping_pushes_when_a_trial_starts_or_ends_and_keeps_the_newest_copies(
        tmp_path: Path, s3: emus.Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    from optuna.trial import TrialState
    spec = _spec(s3, "ck/d")
    rest = sweepkeep.put_aside(str(tmp_path), "s1", spec)
    study = _study_with(tmp_path, rest, 0)
    pushes: list[int] = []
    real = sweepkeep.transfer

    def counted(root: str, name: str, cmd: str) -> int:
        now = sweepstudy.settled(study)
        code = real(root, name, cmd)
        pushes.append(now)
        return code

    def pushed() -> bool:
        return bool(pushes) and pushes[-1] == sweepstudy.settled(study)

    monkeypatch.setattr(sweepkeep, "transfer", counted)
    with sweepkeep.keeping(str(tmp_path), "s1", lambda: sweepstudy.settled(study), poll_s=0.05):
        assert wait_until(pushed, 60)            # the first push, at once
        for i in range(3):
            t = study.ask({"lr": sweepstudy.distributions(rest)["lr"]})
            assert wait_until(pushed, 60)        # the keeper pushes this start...
            study.tell(t, float(i), state=TrialState.COMPLETE)
            assert wait_until(pushed, 60)        # ...and this end
    # once per change (0: at once; 1, 3, 5: starts; 2, 4, 6: ends), and the last at the end
    assert sorted(set(pushes)) == list(range(7)) and len(pushes) == 8, pushes
    keys = s3.keys("ck/d/sweeps/s1")
    manifests = sorted(k for k in keys if k.startswith("manifests/"))
    assert len(manifests) == sweepkeep.KEEP
    newest = json.loads(s3.cat("ck/d/sweeps/s1/" + manifests[-1]))
    assert {f"objects/{f['sha256']}" for f in newest["files"]} <= set(keys)
    assert sum(k.startswith("objects/") for k in keys) <= sweepkeep.KEEP
    new = tmp_path / "new"
    sweepkeep.put_aside(str(new), "s1", spec)
    assert sweepkeep.restored(str(new), "s1")
    assert [t.state for t in sweepstudy.read_study(str(new), "s1").get_trials()] == \
        [TrialState.COMPLETE] * 3


def test_the_command_line(tmp_path: Path) -> None:
    assert sweepkeep.main(["sweepkeep.py"]) == sweepkeep.USAGE
    assert sweepkeep.main(["sweepkeep.py", "push", str(tmp_path), "s1"]) == sweepkeep.NOTHING
    assert os.path.basename(sweepkeep.__file__) == "sweepkeep.py"


def test_an_unreadable_bucket_stops_the_head_rather_than_start_afresh(
        tmp_path: Path, s3: emus.Emulator) -> None:
    """A replacement head that cannot read the bucket must not start the sweep afresh: its
    first push would become the newest copy and the kept ones would be pruned."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]                 # nothing listens there once closed
    spec = _spec(s3, "ck/e")
    spec["keep"]["env"] = {**spec["keep"]["env"],
                           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed}",
                           "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{closed}"}
    sweepkeep.put_aside(str(tmp_path), "s1", spec)
    with pytest.raises(sweepkeep.KeepError, match="not starting it afresh"):
        sweepkeep.restored(str(tmp_path), "s1")
    assert not _journal(tmp_path).exists()
