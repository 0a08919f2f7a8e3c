"""``cost-report`` on the AWS emulator (moto): before it sums, it asks the provider about the
clusters the state says are running (the reconcile of ``status --refresh``), so a cluster
whose nodes stopped themselves is counted up to when they stopped, not up to now;
``--offline`` asks nothing and marks the row unconfirmed (docs/cost.md)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from click.testing import CliRunner  # noqa: E402

from cloudtrain.context import open_env  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402
from aws_moto import (MOTO_ACCOUNT, Harness, add_images_to_moto, guest_shutdown,  # noqa: E402
                      hermetic_env)

REGION = "us-east-1"
TASK = """
name: {name}
num_nodes: 2
run: echo hi
resources:
  provider: aws
  region: us-east-1
  accelerators: A100:8
  aws: {{host_key_wait: 0}}
"""


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from moto import mock_aws

    hermetic_env(monkeypatch)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with mock_aws():
        add_images_to_moto(REGION)
        yield Harness(tmp_path / "home")


def _report(aws: Harness, *args: str) -> dict[str, dict]:  # type: ignore[type-arg]
    from cloudtrain.commands.main import cli

    r = CliRunner().invoke(cli, ["cost-report", "--json", *args], obj={"aws": aws.provider()})
    assert r.exit_code == 0, r.output
    return {c["name"]: c for c in json.loads(r.stdout)["clusters"]}


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_cost_report_counts_a_self_stopped_cluster_up_to_its_stop(aws: Harness) -> None:
    from moto.ec2.models import ec2_backends

    env = open_env(UI(quiet=True), {"aws": aws.provider()})
    for name in ("gone", "live"):
        provision(env, parse_task(TASK.format(name=name)), name)
    nodes = aws.provider().list_nodes("gone")
    for n in nodes:
        aws.faults.console_output(n.instance_id, "cloudtrain-guard: stop: idle\n")
    stopped = time.time()
    guest_shutdown(ec2_backends[MOTO_ACCOUNT][REGION], [n.instance_id for n in nodes], "idle")
    time.sleep(2.5)                   # the report comes later than the nodes stopped
    # each report below is handed a new provider, as a new process: nothing cached

    offline = _report(aws, "--offline")    # no provider asked: both still "running", unconfirmed
    assert {k: (c["status"], c["confirmed"]) for k, c in offline.items()} == {
        "gone": ("running", False), "live": ("running", False)}

    rep = _report(aws)
    gone, live = rep["gone"], rep["live"]
    assert (gone["status"], gone["end_reason"], gone["confirmed"]) == ("terminated", "idle", True)
    assert abs(_ts(gone["ended_at"]) - stopped) < 1.5, (gone, stopped)
    assert gone["cost_usd"] < offline["gone"]["cost_usd"]       # not the hours since
    # hours and cost are each rounded to 6 decimals in the report: over an interval this short
    # (moto creates the nodes in milliseconds) that rounding bounds how well they agree
    rounding = 0.5e-6 * gone["price_hourly_usd"] * 2 + 0.5e-6
    assert gone["cost_usd"] == pytest.approx(
        gone["hours"] * gone["price_hourly_usd"] * 2, rel=1e-6, abs=rounding)
    assert (live["status"], live["confirmed"]) == ("running", True)   # still up: to now
    assert env.state.get_cluster("gone") is None and env.state.get_cluster("live") is not None
    assert aws.counts(REGION, "gone")["instances"] == 0
