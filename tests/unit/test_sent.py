"""The deletion rules of a workdir sync (pipeline/sent.py), run through a local rsync: only
the paths the last sync sent that the workdir no longer has are deleted; what the job wrote
(even inside a removed folder) and every other path stays; wildcard names are literal."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cloudtrain.pipeline import sent, sync

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def test_a_sync_deletes_only_what_it_sent_before_and_is_gone(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    for rel in ("keep.py", "old.py", "a*b.py", "ab.py", "lib/gone.py", "lib/deep/x.py"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("laptop\n")
    plan = sync.SyncPlan(workdir=src, mounts=(), protect=(), exclude=())
    before = set(sent.manifest(plan))
    assert b"a*b.py" in before and b"lib/deep/x.py" in before
    subprocess.run(["rsync", "-a", f"{src}/", f"{dst}/"], check=True)
    for rel in ("snapshot.pt", "lib/state.json", "lib/deep/cache.bin", "ac*b.py"):
        (dst / rel).write_text("job\n")                      # what the job wrote
    for rel in ("old.py", "a*b.py", "lib/gone.py", "lib/deep/x.py"):
        (src / rel).unlink()
    shutil.rmtree(src / "lib")
    text, skipped = sent.rules(before - set(sent.manifest(plan)))
    assert skipped == [] and text.endswith("P *\n")
    rules = tmp_path / "rules"
    rules.write_text(text)
    subprocess.run(["rsync", "-a", *plan.workdir_filters(), "--delete", f"--filter=merge {rules}",
                    f"{src}/", f"{dst}/"], check=True, capture_output=True)
    assert _files(dst) == {"keep.py", "ab.py", "snapshot.pt", "ac*b.py", "lib",
                           "lib/state.json", "lib/deep", "lib/deep/cache.bin"}


def test_names_a_filter_file_cannot_hold_are_left_and_reported() -> None:
    text, skipped = sent.rules({b"ok.py", b"new\nline.py", b"a/../b"})
    assert text == "R /ok.py\nP *\n"
    assert sorted(skipped) == [b"a/../b", b"new\nline.py"]


def test_the_list_of_what_a_sync_sends_reuses_the_fingerprints_listing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The list costs no second rsync when the folder did not change since the fingerprint;
    any change lists again (never a stale list)."""
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    calls: list[Path] = []
    real = sync.listed

    def counted(root: Path, filters: list[str]):  # type: ignore[no-untyped-def]
        calls.append(root)
        return real(root, filters)

    monkeypatch.setattr(sync, "listed", counted)
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "train.py").write_text("v1\n")
    plan = sync.SyncPlan(workdir=wd, mounts=(), protect=(), exclude=())
    plan.fingerprint()
    assert len(calls) == 1
    assert sent.manifest(plan) == [b"train.py"] and len(calls) == 1
    (wd / "new.py").write_text("x\n")
    assert sorted(sent.manifest(plan)) == [b"new.py", b"train.py"] and len(calls) == 2
