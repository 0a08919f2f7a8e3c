"""The sweep driver's answer (``sweep results``: ~300 bytes a trial) comes back whole from a
real node however many trials it has, and a node that answers without end cannot grow the
laptop's memory past a stated bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import needs_sshd

pytestmark = [needs_sshd, pytest.mark.e2e]


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    from cloudtrain.cluster import connect
    from cloudtrain.context import open_env
    from cloudtrain.pipeline.provision import provision
    from cloudtrain.pipeline.teardown import down
    from cloudtrain.spec import parse_task
    from cloudtrain.ui import UI

    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    env = open_env(UI(quiet=True))
    handle, _ = provision(env, parse_task("name: answer\nnum_nodes: 1\nrun: 'true'\n"), "answer")
    group = connect(env, handle, timeout=30)
    try:
        yield handle, group
    finally:
        group.close()
        down(env, "answer")


def _answering(monkeypatch: pytest.MonkeyPatch, doc_file: Path) -> None:
    """The head's driver, answering with what ``doc_file`` holds."""
    from cloudtrain.pipeline import sweepnode

    monkeypatch.setattr(sweepnode, "node_command",
                        lambda *a, **k: f"cat {doc_file}")


def test_the_results_of_a_2000_trial_sweep_come_back_whole(
        node: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.pipeline import sweepnode

    handle, group = node
    trials = [{"number": i, "state": "COMPLETE", "value": 1.0 / (i + 1),
               "params": {"lr": 1e-3 * (i + 1), "batch": 32}, "gpus": "0",
               "started_at": 1795700000.0 + i, "ended_at": 1795700100.0 + i,
               "workdir": f"trials/trial-{i}"} for i in range(2000)]
    doc = {"name": "big", "trials": trials}
    f = tmp_path / "results.json"
    f.write_text(json.dumps(doc))
    assert f.stat().st_size > 64 * 1024 * 4          # well past any stream tail
    _answering(monkeypatch, f)
    assert sweepnode.document(handle, group, "results", "big") == doc


def test_an_endless_answer_is_cut_at_the_bound_and_said(
        node: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.errors import RemoteError
    from cloudtrain.pipeline import sweepnode

    handle, group = node
    monkeypatch.setattr(sweepnode, "ANSWER_MAX_BYTES", 100_000)
    f = tmp_path / "flood"
    f.write_bytes(b"x" * 1_000_000)
    _answering(monkeypatch, f)
    with pytest.raises(RemoteError, match="answered more than 100,000 bytes"):
        sweepnode.document(handle, group, "results", "big")
