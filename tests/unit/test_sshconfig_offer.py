"""Offering the ~/.ssh/config Include line after a command creates nothing when no cluster
file was written: a command refused for bad input leaves no trace, even in a process where an
earlier command wrote a cluster's file (the in-process record is consumed, not leaked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloudtrain import sshconfig
from cloudtrain.commands.access import offer_include


def test_no_cluster_file_means_nothing_created_and_nothing_remembered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    sshconfig.WRITTEN.add("from-an-earlier-command")
    offer_include(None, ask=False)
    assert not (tmp_path / "home").exists()
    assert not (tmp_path / "user").exists()
    assert not sshconfig.WRITTEN
