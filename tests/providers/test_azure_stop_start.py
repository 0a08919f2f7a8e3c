"""``cloudtrain stop`` / ``start`` on Azure against the ARM fake: stop (through the CLI, the
fake's provider handed in) deallocates only the cluster's own VMs, so their compute no longer
bills, and records STOPPED with the ledger's interval closed "stopped"; starting (up's
provisioning from the cluster's record) starts the same VMs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("azure.mgmt.compute")

from arm_fake import ArmFake, Harness, hermetic_env  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from cloudtrain.context import Env, open_env  # noqa: E402
from cloudtrain.pipeline import stopstart  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402

TASK = ("name: {name}\nnum_nodes: {n}\nrun: echo hi\nresources:\n  provider: azure\n"
        "  region: eastus\n  accelerators: A100:8\n")


@pytest.fixture
def az(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch)
    home = tmp_path / "home"
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(home))
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield Harness(fake, home)
    finally:
        fake.stop()


def _env(az: Harness) -> Env:
    return open_env(UI(quiet=True), {"azure": az.provider()})


def _cli(az: Harness, *args: str) -> Any:
    from cloudtrain.commands.main import cli

    return CliRunner().invoke(cli, list(args), obj={"azure": az.provider()})


def test_stop_deallocates_only_the_clusters_vms_and_start_brings_them_back(az: Harness) -> None:
    env = _env(az)
    demo, _ = provision(env, parse_task(TASK.format(name="demo", n=2)), "demo")
    provision(env, parse_task(TASK.format(name="other", n=1)), "other")
    names = {r.name for r in az.fake.ops_of("PUT", "virtualmachines")}
    ours = {n for n in names if az.fake.vm(n)["id"].lower() in  # type: ignore[index]
            {x.instance_id.lower() for x in demo.nodes}}
    assert len(ours) == 2 and len(names) == 3
    assert all(az.fake.billing(n) for n in names)

    r = _cli(az, "stop", "demo", "-y", "--force")
    assert r.exit_code == 0, r.output
    assert "static public IP still bill" in r.output
    assert {n for n in names if not az.fake.billing(n)} == ours
    assert {az.fake.power_of(n) for n in ours} == {"deallocated"}
    assert {x.name for x in az.fake.ops_of("POST", "deallocate")} == ours
    st = {c["name"]: c for c in json.loads(_cli(az, "status", "--json").output)}
    assert st["demo"]["status"] == "STOPPED" and st["other"]["status"] == "UP"
    assert _env(az).state.usage("demo")[-1].end_reason == "stopped"

    env = _env(az)
    row = env.state.get_cluster("demo")
    assert row is not None
    handle, fresh = provision(env, stopstart.task_of(row), "demo")
    assert not fresh and [n.instance_id for n in handle.nodes] == [
        n.instance_id for n in demo.nodes]
    assert all(az.fake.billing(n) for n in names)
    assert {x.name for x in az.fake.ops_of("POST", "start")} == ours
    assert len(az.fake.ops_of("PUT", "virtualmachines")) == 3      # nothing created again
    assert env.state.get_cluster("demo").status == "UP"  # type: ignore[union-attr]
