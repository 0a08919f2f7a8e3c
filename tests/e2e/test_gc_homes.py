"""Finding 2 on the GCE and ARM fakes: two CLOUDTRAIN_HOMEs of the same user@host share a
project / subscription; ``gc -y`` in one leaves the other's running cluster alone, and a
running orphan of its own is terminated only with ``--force``. Through the click command
line, in-process, like tests/providers/test_gcp_plan_gc.py and tests/providers/test_azure_teardown.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cloudtrain.ownership import home_id

OWNER = "alice@laptop.example"


def _owner(home: Path) -> str:
    """What the provider writes by default: user@host/home-<this home's id>."""
    return f"{OWNER}/home-{home_id(home)}"


def _gc(providers: dict[str, Any], *args: str):  # type: ignore[no-untyped-def]
    from cloudtrain.commands.main import cli

    return CliRunner().invoke(cli, ["gc", *args], obj=providers)


def _listed(out: str) -> list[dict]:  # type: ignore[type-arg]
    return json.loads(out[out.index("["):])


# --- GCP --------------------------------------------------------------------------------------

@pytest.fixture
def gce(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from gce_fake import GCEFake, hermetic_env

    hermetic_env(monkeypatch, tmp_path)
    with GCEFake() as fake:
        fake.guard_env(monkeypatch)
        yield fake


def test_gcp_gc_in_one_home_leaves_another_homes_running_cluster_alone(
        gce, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from gce_fake import Harness

    a, b = Harness(gce, tmp_path / "a"), Harness(gce, tmp_path / "b")
    pa, pb = a.provider(owner=_owner(a.home)), b.provider(owner=_owner(b.home))
    b.up(b.request(name="train"), pb)                        # home b's live cluster
    a.up(a.request(name="old"), pa)                          # home a's orphan (no state row)
    legacy = a.provider(owner=OWNER)                         # an older cloudtrain's
    a.up(a.request(name="legacy"), legacy)

    monkeypatch.setenv("CLOUDTRAIN_HOME", str(a.home))
    mine = {"gcp": a.provider(owner=_owner(a.home))}
    r = _gc(mine, "--provider", "gcp", "-y")
    assert r.exit_code == 0, r.output
    instances = gce.ours()["instances"]
    assert len([i for i in instances if "ct-train-" in i]) == 2
    assert len([i for i in instances if "ct-old-" in i]) == 2      # running: needs --force
    assert "another home's, left alone" in r.output
    assert "older cloudtrain without a home id" in r.output
    assert "cloudtrain gc --provider gcp --force -y" in r.output

    r = _gc(mine, "--provider", "gcp", "--force", "-y", "--json")
    assert r.exit_code == 0, r.output
    assert {x["cluster"] for x in _listed(r.stdout) if x["removed"]} == {"old"}
    instances = gce.ours()["instances"]
    assert not [i for i in instances if "ct-old-" in i]
    assert len([i for i in instances if "ct-train-" in i]) == 2
    assert len([i for i in instances if "ct-legacy-" in i]) == 2


def test_gcp_owner_label_keeps_the_home_id() -> None:
    from cloudtrain_provisioners.gcp import tags as L

    long = "x" * 80 + "@host/home-0123456789ab"
    v = L.owner_value(long)
    assert len(v) <= 63 and v.endswith("-home-0123456789ab")
    assert L.owner_value("x" * 80 + "@host/home-ba9876543210") != v


# --- Azure ------------------------------------------------------------------------------------

@pytest.fixture
def arm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from arm_fake import ArmFake, hermetic_env

    hermetic_env(monkeypatch)
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield fake
    finally:
        fake.stop()


def test_azure_gc_in_one_home_leaves_another_homes_running_cluster_alone(
        arm, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from arm_fake import Harness

    a, b = Harness(arm, tmp_path / "a"), Harness(arm, tmp_path / "b")
    b.up(b.request(name="train", num_nodes=1), b.provider(owner=_owner(b.home)))
    a.up(a.request(name="old", num_nodes=1), a.provider(owner=_owner(a.home)))

    def vms(cluster: str) -> int:
        return len([r for r in arm.tagged(cluster)
                    if str(r.get("type", "")).lower() == "microsoft.compute/virtualmachines"])

    monkeypatch.setenv("CLOUDTRAIN_HOME", str(a.home))
    mine = {"azure": a.provider(owner=_owner(a.home))}
    r = _gc(mine, "--provider", "azure", "-y")
    assert r.exit_code == 0, r.output
    assert vms("train") == 1 and vms("old") == 1
    assert "another home's, left alone" in r.output
    assert "cloudtrain gc --provider azure --force -y" in r.output

    r = _gc(mine, "--provider", "azure", "--force", "-y")
    assert r.exit_code == 0, r.output
    assert vms("old") == 0 and vms("train") == 1
