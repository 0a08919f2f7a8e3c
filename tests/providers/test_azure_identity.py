"""The nodes' identity for Azure Blob containers, against the ARM fake through the real SDK
clients: each VM's managed identity gets Storage Blob Data Contributor on exactly the named
containers (found through the subscription's storage accounts), also with self_stop: false;
down removes those assignments and nothing else; an account the subscription lacks is
refused before anything is made; the plan says it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("azure.mgmt.compute")
pytest.importorskip("azure.mgmt.network")
pytest.importorskip("azure.mgmt.resource")

from arm_fake import BLOB_CONTRIBUTOR, VM_CONTRIBUTOR, ArmFake, Harness, hermetic_env  # noqa: E402

from cloudtrain.errors import UserError  # noqa: E402
from cloudtrain.storage.url import parse  # noqa: E402

URL = "https://ckptacct.blob.core.windows.net/ckpt/runs/r1"


@pytest.fixture
def az(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch)
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield Harness(fake, tmp_path / "home")
    finally:
        fake.stop()


def _req(az: Harness, *urls: str, **kw):  # type: ignore[no-untyped-def]
    return dataclasses.replace(az.request(**kw), buckets=tuple(parse(u) for u in urls))


def _role(a: dict) -> str:  # type: ignore[type-arg]
    return a["properties"]["roleDefinitionId"].rsplit("/", 1)[-1]


def test_blob_role_on_the_container_only_and_removed_at_down(az: Harness) -> None:
    acct = az.fake.add_storage_account("data-rg", "ckptacct")
    scope = f"{acct}/blobServices/default/containers/ckpt"
    other_scope = f"{acct}/blobServices/default/containers/other"
    p, nodes = az.up(_req(az, URL, "s3://foreign/x", azure={"self_stop": False}))
    principals = {az.fake.vm(f"{n.instance_id.rsplit('/', 1)[-1]}")["identity"]["principalId"]
                  for n in nodes}
    assert len(principals) == 2 and all(principals)
    at = az.fake.assignments_at(scope)
    assert {(a["properties"]["principalId"], _role(a)) for a in at} == {
        (pid, BLOB_CONTRIBUTOR) for pid in principals}
    # nothing else: no VM Contributor (self_stop: false), nothing on another container
    every = list(az.fake.role_assignments.values())
    assert not [a for a in every if _role(a) == VM_CONTRIBUTOR]
    assert {a["properties"]["scope"].lower() for a in every} == {scope.lower()}
    assert az.fake.assignments_at(other_scope) == []
    # someone else's assignment on the same container stays at down
    az.fake.role_assignments[f"{scope}/providers/microsoft.authorization/roleassignments/x".lower()] = {
        "id": f"{scope}/providers/Microsoft.Authorization/roleAssignments/x", "name": "x",
        "properties": {"principalId": "someone", "roleDefinitionId": BLOB_CONTRIBUTOR,
                       "scope": scope, "description": "theirs"}}
    p.terminate("demo")
    assert [a["name"] for a in az.fake.assignments_at(scope)] == ["x"]


def test_an_account_outside_the_subscription_is_refused_before_anything_exists(az: Harness) -> None:
    p = az.provider()
    req = _req(az, "https://elsewhere.blob.core.windows.net/ckpt")
    with pytest.raises(UserError, match="elsewhere.*not in subscription"):
        p.ensure_network(req)
    assert az.fake.tagged() == []


def test_plan_names_the_role_and_the_containers(az: Harness) -> None:
    plan = az.provider().plan(_req(az, URL, "gs://foreign/x"))
    (line,) = [c for c in plan.creates if "Storage Blob Data Contributor" in c]
    assert "ckptacct/ckpt" in line
    assert any("gs://foreign/x" in n and "envs" in n for n in plan.notes)


def test_no_credential_of_this_machine_reaches_a_node(az: Harness,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import base64
    import json

    az.fake.add_storage_account("data-rg", "ckptacct")
    secrets = {"AWS_SECRET_ACCESS_KEY": "awssecret-9c1e", "GOOGLE_OAUTH_ACCESS_TOKEN":
               "ya29.laptop-4be2", "AZURE_CLIENT_SECRET": "azsecret-51e0d",
               "AZURE_STORAGE_KEY": "c3RvcmFnZWtleQ=="}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    az.up(_req(az, URL))
    data = [base64.b64decode(v).decode() for v in az.fake.custom_data.values()]
    assert data and all("ssh" in d for d in data)   # what is sent: the host key only
    bodies = json.dumps([r.body for r in az.fake.ops_of("PUT", "virtualmachines")])
    for k, v in secrets.items():
        assert all(v not in d and k not in d for d in data) and v not in bodies


def test_no_containers_no_storage_call_and_no_identity_without_self_stop(az: Harness) -> None:
    p, _ = az.up(az.request(azure={"self_stop": False}))
    assert az.fake.ops_of("GET", "storageaccounts") == []
    assert all("identity" not in r.body for r in az.fake.ops_of("PUT", "virtualmachines"))
    assert az.fake.role_assignments == {}
