"""The workdir fingerprint skips rsync's listing only while nothing under the folder changed:
an edit, a new file (even an ignored one) or a folder too big to stamp means rsync lists it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cloudtrain.pipeline import sync, treestamp

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    calls: list[Path] = []
    real = sync._listing_digest

    def listing(root: Path, filters: list[str]) -> str:
        calls.append(root)
        return real(root, filters)

    monkeypatch.setattr(sync, "_listing_digest", listing)
    return calls


def _plan(wd: Path) -> sync.SyncPlan:
    return sync.SyncPlan(workdir=wd, mounts=(), protect=(), exclude=())


def test_unchanged_folder_reuses_the_listing_and_any_change_lists_again(
        tmp_path: Path, counted: list[Path]) -> None:
    wd = tmp_path / "wd"
    (wd / "pkg").mkdir(parents=True)
    (wd / "pkg" / "train.py").write_text("print(1)\n")
    (wd / ".gitignore").write_text("data/\n")
    first = _plan(wd).fingerprint()
    assert _plan(wd).fingerprint() == first and len(counted) == 1   # no second listing

    (wd / "pkg" / "train.py").write_text("print(22)\n")             # an edit
    edited = _plan(wd).fingerprint()
    assert edited != first and len(counted) == 2

    (wd / "data").mkdir()
    (wd / "data" / "big.bin").write_bytes(b"x" * 10)                # ignored, but new
    assert _plan(wd).fingerprint() == edited and len(counted) == 3  # listed; same content

    os.utime(wd / "pkg" / "train.py", ns=(1, 1))                    # only the mtime
    assert _plan(wd).fingerprint() != edited and len(counted) == 4


def test_a_folder_too_big_to_stamp_is_listed_by_rsync_every_time(
        tmp_path: Path, counted: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(treestamp, "MAX_ENTRIES", 3)
    wd = tmp_path / "wd"
    wd.mkdir()
    for i in range(5):
        (wd / f"f{i}.py").write_text(str(i))
    assert _plan(wd).fingerprint() == _plan(wd).fingerprint()
    assert len(counted) == 2
