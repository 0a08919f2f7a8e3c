"""``cloudtrain stop`` / ``start`` on GCP against the GCE fake: stop (through the CLI, the
fake's provider handed in) stops only the cluster's own instances (its labels and its owner's)
and records STOPPED, with the ledger's interval closed "stopped"; a later contact does not take
the stopped instances for a guard's self-stop (which would tear the cluster down); starting
(up's provisioning from the cluster's record) starts the same instances."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("google.cloud.compute_v1")

from click.testing import CliRunner  # noqa: E402

from cloudtrain.context import Env, open_env  # noqa: E402
from cloudtrain.pipeline import guard, stopstart  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402
from gce_fake import Harness  # noqa: E402

TASK = ("name: {name}\nnum_nodes: {n}\nrun: echo hi\nresources:\n  provider: gcp\n"
        "  region: us-central1\n  accelerators: T4:1\n  gcp: {{host_key_wait: 0}}\n")


def _env(h: Harness) -> Env:
    return open_env(UI(quiet=True), {"gcp": h.provider()})


def _cli(h: Harness, *args: str) -> Any:
    from cloudtrain.commands.main import cli

    return CliRunner().invoke(cli, list(args), obj={"gcp": h.provider()})


def _status(h: Harness) -> dict[str, str]:
    return {n: i["status"] for (_, n), i in h.fake.instances.items()}


def test_stop_and_start_only_the_clusters_own_instances(gcp: Harness, tmp_path: Path) -> None:
    env = _env(gcp)
    demo, _ = provision(env, parse_task(TASK.format(name="demo", n=2)), "demo")
    provision(env, parse_task(TASK.format(name="other", n=1)), "other")
    # another user's cluster of the same name, in the same project
    gcp.up(gcp.request(name="demo", num_nodes=1), gcp.provider(owner="bob@desk.example"))
    ours = [n.instance_id.split("/")[0] for n in demo.nodes]
    before = _status(gcp)
    assert len(before) == 4 and set(before.values()) == {"RUNNING"}

    r = _cli(gcp, "stop", "demo", "-y", "--force")
    assert r.exit_code == 0, r.output
    assert "boot disk still bills" in r.output
    after = _status(gcp)
    assert {n for n, s in after.items() if s == "TERMINATED"} == set(ours)
    assert sorted(c["path"].split("/")[-2] for c in gcp.fake.calls("POST", r"/stop$")) == \
        sorted(ours)
    st = {c["name"]: c for c in json.loads(_cli(gcp, "status", "--json").output)}
    assert st["demo"]["status"] == "STOPPED" and st["other"]["status"] == "UP"
    assert _env(gcp).state.usage("demo")[-1].end_reason == "stopped"
    # the next contact leaves it alone: not a guard's self-stop (which tears down)
    assert guard.reconcile(_env(gcp), "demo") is None
    assert _status(gcp) == after

    env = _env(gcp)
    row = env.state.get_cluster("demo")
    assert row is not None
    handle, fresh = provision(env, stopstart.task_of(row), "demo")
    assert not fresh and [n.instance_id for n in handle.nodes] == [
        n.instance_id for n in demo.nodes]
    assert set(_status(gcp).values()) == {"RUNNING"}
    assert sorted(c["path"].split("/")[-2] for c in gcp.fake.calls("POST", r"/start$")) == \
        sorted(ours)
    assert env.state.get_cluster("demo").status == "UP"  # type: ignore[union-attr]
    assert len(env.state.usage("demo")) == 2 and env.state.usage("demo")[-1].ended_at is None
