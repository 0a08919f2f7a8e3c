"""State never invents a cluster (issue 21), through the real CLI on the GCE and ARM fakes:
an ``up`` without credentials leaves nothing in the state and reports no rollback; a cluster
the provider has nothing of is forgotten by ``down`` (the provider confirms), or by
``down --forget`` when the provider cannot be asked; ``status --refresh`` never says that
such a cluster stopped itself. Nothing here starts a node: nothing gets that far."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import CLI

TASK = """\
name: {name}
resources:
  provider: {provider}
  instance_type: {itype}
  region: {region}
  ssh_cidr: 10.0.0.0/8
run: echo hi
"""


def _task(tmp: Path, provider: str, name: str) -> Path:
    itype, region = {"gcp": ("n1-standard-8", "us-central1"),
                     "azure": ("Standard_NC4as_T4_v3", "eastus")}[provider]
    p = tmp / f"{name}.yaml"
    p.write_text(TASK.format(name=name, provider=provider, itype=itype, region=region))
    return p


def _phantom(home: Path, name: str, provider: str) -> None:
    """A state row of a cluster its provider has nothing of: what an up of an earlier
    cloudtrain left when it failed without credentials (INIT, priced, no node)."""
    from cloudtrain.schema import ClusterRow
    from cloudtrain.state import open_state

    now = time.time()
    open_state(home).upsert_cluster(ClusterRow(
        name=name, provider=provider, status="INIT", num_nodes=1, created_at=now,
        updated_at=now, region="us-central1", instance_type="n1-standard-8", hourly_price=0.73))
    (home / "clusters" / name).mkdir(parents=True)


def _out(r: subprocess.CompletedProcess[str]) -> str:
    return r.stdout + r.stderr


class World:
    def __init__(self, cli: CLI, creds: dict[str, str], nocreds: dict[str, str]) -> None:
        self.cli, self.creds, self.nocreds = cli, creds, nocreds

    def run(self, *args: str, creds: bool) -> subprocess.CompletedProcess[str]:
        return self.cli.run(*args, timeout=180, **(self.creds if creds else self.nocreds))

    def names(self) -> list[str]:
        r = self.run("status", "--json", creds=False)
        assert r.returncode == 0, _out(r)
        return [c["name"] for c in json.loads(r.stdout)]


@pytest.fixture
def gcp_world(tmp_path: Path) -> Iterator[tuple[World, Any]]:
    pytest.importorskip("google.cloud.compute_v1")
    from gce_fake import GCEFake

    fake = GCEFake(require_auth=True).start()
    gcloud = tmp_path / "gcloud-config"
    gcloud.mkdir()
    base = {"CLOUDTRAIN_GCP_API_ENDPOINT": fake.url, "NO_GCE_CHECK": "true",
            "CLOUDSDK_CONFIG": str(gcloud), "GOOGLE_CLOUD_PROJECT": fake.project,
            "GOOGLE_APPLICATION_CREDENTIALS": "", "CLOUDTRAIN_GCP_PROJECT": "",
            "HTTPS_PROXY": fake.url, "HTTP_PROXY": fake.url, "https_proxy": fake.url,
            "http_proxy": fake.url, "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost"}
    key = fake.service_account_key(tmp_path / "key.json")
    home = tmp_path / "home"
    home.mkdir()
    world = World(CLI(home), {**base, "GOOGLE_APPLICATION_CREDENTIALS": str(key)}, base)
    try:
        yield world, fake
    finally:
        world.run("down", "-a", "-y", "--forget", creds=True)
        fake.stop()


@pytest.fixture
def azure_world(tmp_path: Path) -> Iterator[tuple[World, Any]]:
    pytest.importorskip("azure.mgmt.compute")
    from arm_fake import SUBSCRIPTION, ArmFake

    fake = ArmFake(tmp_path / "arm").start()
    base = {k: "" for k in os.environ if k.startswith(("AZURE_", "CLOUDTRAIN_AZURE_", "MSI_",
                                                       "IDENTITY_"))}
    base.update({"CLOUDTRAIN_AZURE_ARM_ENDPOINT": fake.url,
                 "CLOUDTRAIN_AZURE_CA_BUNDLE": str(fake.cert_file),
                 "CLOUDTRAIN_AZURE_POLL_INTERVAL": "0", "AZURE_SUBSCRIPTION_ID": SUBSCRIPTION,
                 "AZURE_CONFIG_DIR": str(tmp_path / "no-azure-cli")})
    home = tmp_path / "home"
    home.mkdir()
    world = World(CLI(home), {**base, "CLOUDTRAIN_AZURE_ACCESS_TOKEN": fake.token}, base)
    try:
        yield world, fake
    finally:
        world.run("down", "-a", "-y", "--forget", creds=True)
        fake.stop()


def test_gcp_up_without_credentials_leaves_nothing(gcp_world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    world, fake = gcp_world
    r = world.run("up", str(_task(tmp_path, "gcp", "nocred")), "-y", creds=False)
    out = _out(r)
    assert r.returncode != 0 and "No GCP credentials found" in out, out[-3000:]
    assert "Traceback" not in out and "Rollback" not in out and "Rolling back" not in out, out
    assert world.names() == []
    assert not (world.cli.home / "clusters" / "nocred").exists()
    assert not [c for c in fake.requests if c["method"] != "GET"], "nothing was asked to be made"
    # no ledger interval either: the cost report has no cluster to bill
    r = world.run("cost-report", "--json", creds=False)
    assert r.returncode == 0 and "nocred" not in r.stdout, _out(r)


def test_gcp_cluster_the_provider_lacks_is_forgotten(gcp_world) -> None:  # type: ignore[no-untyped-def]
    world, fake = gcp_world
    home = world.cli.home
    _phantom(home, "ghost", "gcp")
    _phantom(home, "ghost2", "gcp")
    # status --refresh without credentials: it cannot ask, and does not say it stopped itself
    r = world.run("status", "--refresh", creds=False)
    assert r.returncode == 0 and "stopped itself" not in _out(r), _out(r)
    # down cannot ask gcp: it fails, keeps the row, and names --forget
    r = world.run("down", "ghost", "-y", creds=False)
    assert r.returncode != 0 and "--forget" in r.stderr and "Traceback" not in r.stderr, _out(r)
    assert world.names() == ["ghost", "ghost2"]
    # --forget: forgotten here, saying that gcp was not asked
    r = world.run("down", "ghost", "-y", "--forget", creds=False)
    assert r.returncode == 0, _out(r)
    assert "was not asked" in _out(r) and "gc --provider gcp" in _out(r)
    assert world.names() == ["ghost2"] and not (home / "clusters" / "ghost").exists()
    # with credentials, the provider confirms it has nothing of it: a plain down forgets it
    r = world.run("status", "--refresh", creds=True)
    assert r.returncode == 0 and "stopped itself" not in _out(r), _out(r)
    r = world.run("down", "ghost2", "-y", creds=True)
    assert r.returncode == 0 and "lists none of its nodes" in _out(r), _out(r)
    assert world.names() == [] and not (home / "clusters" / "ghost2").exists()


def test_azure_up_without_credentials_or_subscription_leaves_nothing(azure_world,  # type: ignore[no-untyped-def]
                                                                     tmp_path: Path) -> None:
    world, fake = azure_world
    task = str(_task(tmp_path, "azure", "aznocred"))
    for what, extra in (("no usable Azure credentials", {}),
                        ("No Azure subscription", {"AZURE_SUBSCRIPTION_ID": ""})):
        r = world.cli.run("up", task, "-y", timeout=180, **{**world.nocreds, **extra})
        out = _out(r)
        assert r.returncode != 0 and what in out, out[-3000:]
        assert "Traceback" not in out and "Rollback" not in out and "Rolling back" not in out
        assert world.names() == []
        assert not (world.cli.home / "clusters" / "aznocred").exists()
    assert fake.everything() == []


def test_azure_cluster_the_provider_lacks_is_forgotten(azure_world) -> None:  # type: ignore[no-untyped-def]
    world, fake = azure_world
    _phantom(world.cli.home, "azghost", "azure")
    _phantom(world.cli.home, "azghost2", "azure")
    r = world.run("status", "--refresh", creds=False)
    assert r.returncode == 0 and "stopped itself" not in _out(r), _out(r)
    r = world.run("down", "azghost", "-y", creds=False)
    assert r.returncode != 0 and "--forget" in r.stderr, _out(r)
    r = world.run("down", "azghost", "-y", "--forget", creds=False)
    assert r.returncode == 0 and "was not asked" in _out(r), _out(r)
    r = world.run("down", "azghost2", "-y", creds=True)
    assert r.returncode == 0 and "lists none of its nodes" in _out(r), _out(r)
    assert world.names() == []
    assert fake.everything() == []
