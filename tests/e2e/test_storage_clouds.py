"""Buckets on the cloud fakes, through the real CLI (issue 13): a task with a bucket
``file_mounts`` source and ``checkpoints:`` runs on 2 nodes of a cloud's fake, whose instances
are local sshd nodes reached through the tests' ssh_proxy (nothing ever connects to an address
the fake invented), while the bucket lives in that cloud's storage emulator on loopback. The nodes reach
it with the task's ``envs`` (a local sshd node has no instance identity to use), so:

- the nodes fetch the mount from the emulator themselves (its request log: one content GET per
  node, none from the laptop), and complete checkpoints (objects, then a manifest) land there;
- the cluster's instances carry the identity cloudtrain minted for exactly that bucket (AWS: an
  instance profile whose role's policy names the bucket), removed at ``down``."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import storage_emulators as emus
from cloud_storage_helpers import CORPUS, RUN_BODY, complete_manifests, object_gets
from conftest import needs_sshd
from providers.test_aws_cli import (LocalNodes, _cloudtrain, _guard_log, _map_when_running,
                                    _moto, _tagged, aws_task, guarded, moto_server,
                                    relayed_only_to_loopback)

boto3 = pytest.importorskip("boto3")
pytestmark = [needs_sshd, pytest.mark.e2e]
__all__ = ["guarded", "moto_server"]    # fixtures, reused

AWS_TASK = """
name: {name}
num_nodes: 2
resources:
  provider: aws
  region: us-east-1
  instance_type: g4dn.xlarge
  ssh_cidr: 127.0.0.1/32
  aws: {{host_key_wait: 0}}
workdir: .
envs: {envs}
file_mounts:
  data: {data}
checkpoints: {ckpt}
run: {run}
"""


def _watch_identity(endpoint: str, nodes: LocalNodes, cluster: str, map_file: Path,
                    seen: dict[str, object], stop: threading.Event) -> None:
    """Maps the instances once moto runs them, then reads what the cloud says about their
    identity while the cluster is up: each instance's profile, and its role's policies."""
    ec2 = _moto(endpoint)
    _map_when_running(ec2, nodes, cluster, map_file, seen, stop)
    if stop.is_set():
        return
    iam = boto3.client("iam", region_name="us-east-1", endpoint_url=endpoint,
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    insts = _tagged(ec2, cluster)["instances"]
    seen["profiles"] = sorted({i.get("IamInstanceProfile", {}).get("Arn", "") for i in insts})
    name = str(seen["profiles"][0]).rsplit("/", 1)[-1]     # type: ignore[index]
    try:
        prof = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]
    except Exception as e:  # noqa: BLE001 - the assertion below says what was missing
        seen["profile_error"] = repr(e)
        return
    policies = {}
    for role in prof["Roles"]:
        for pname in iam.list_role_policies(RoleName=role["RoleName"])["PolicyNames"]:
            doc = iam.get_role_policy(RoleName=role["RoleName"], PolicyName=pname)["PolicyDocument"]
            policies[pname] = doc if isinstance(doc, dict) else json.loads(doc)
    seen["roles"] = [r["RoleName"] for r in prof["Roles"]]
    seen["policies"] = policies


def _resources(stmt: dict) -> list[str]:
    res = stmt.get("Resource", [])
    return [res] if isinstance(res, str) else list(res)


def test_s3_mount_and_checkpoints_on_the_aws_fake(guarded: dict[str, str], moto_server: str,
                                                  tmp_path: Path) -> None:
    emu = emus.start("s3", tmp_path / "emulator")
    nodes = LocalNodes(tmp_path / "nodes")
    stop = threading.Event()
    seen: dict[str, object] = {}
    try:
        emu.put("datasets/d1/corpus.txt", CORPUS)
        proj = tmp_path / "proj"
        proj.mkdir()
        task = proj / "task.yaml"
        task.write_text(AWS_TASK.format(
            name="awsst", envs=json.dumps({**emu.envs, "CLOUDTRAIN_CHECKPOINT_INTERVAL": "0.5"}),
            data=emu.url("datasets/d1"), ckpt=emu.url("ckpt/aws"), run=json.dumps(RUN_BODY)))
        map_file = tmp_path / "proxy-map.json"
        aws_task(task, map_file, nodes)
        env = {**guarded, "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        nodes.start()
        watcher = threading.Thread(target=_watch_identity,
                                   args=(moto_server, nodes, "awsst", map_file, seen, stop),
                                   daemon=True)
        watcher.start()
        try:
            r = _cloudtrain(env, "launch", str(task), "--down", "-y", cwd=proj, timeout=400)
        finally:
            stop.set()
            watcher.join(timeout=30)
        out = r.stderr + r.stdout
        assert r.returncode == 0, out[-5000:]

        # The nodes fetched the object from the emulator themselves; the laptop never did.
        assert len(object_gets(emu)) == 2, object_gets(emu)
        assert out.count("read 18000 bytes") == 2, out[-4000:]
        # Complete checkpoints (every object the manifest names, then the manifest) landed.
        mans = complete_manifests(emu, "ckpt/aws")
        assert mans and mans[-1]["step"] == 2, mans
        assert {f["path"] for f in mans[-1]["files"]} == {"latest", "step-000001.txt",
                                                          "step-000002.txt"}, mans[-1]
        assert "Uploaded checkpoint step-000002" in out, out[-4000:]

        # While up, both instances ran with the cluster's profile, whose role may touch only
        # that bucket's prefix.
        assert "profile_error" not in seen, seen
        (arn,) = seen["profiles"]  # type: ignore[misc]
        assert arn.split(":instance-profile/", 1)[1].startswith("cloudtrain/cloudtrain-awsst-"), arn
        stmts = [s for doc in seen["policies"].values() for s in doc["Statement"]]  # type: ignore[attr-defined]
        named = {res for s in stmts for res in _resources(s)}
        assert named == {f"arn:aws:s3:::{emus.BUCKET}", f"arn:aws:s3:::{emus.BUCKET}/ckpt/aws/*",
                         f"arn:aws:s3:::{emus.BUCKET}/datasets/d1/*"}, named
        assert not any("Delete" in a for s in stmts for a in
                       ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])), stmts

        # down removed the role and the profile; nothing of the cluster is left in moto.
        iam = boto3.client("iam", region_name="us-east-1", endpoint_url=moto_server,
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        assert iam.list_instance_profiles(PathPrefix="/cloudtrain/")["InstanceProfiles"] == []
        assert iam.list_roles(PathPrefix="/cloudtrain/")["Roles"] == []
        assert {k: len(v) for k, v in _tagged(_moto(moto_server), "awsst").items()} == {
            "instances": 0, "security_groups": 0, "key_pairs": 0, "placement_groups": 0,
            "volumes": 0}
        # No connection to an address moto invented, from cloudtrain or from ssh (which went
        # through the proxy, and the proxy only to the nodes on loopback).
        assert _guard_log(env) == ""
        assert Path(env["CT_TEST_SSH_LOG"]).read_text(), "ssh went through the recorder"
        relayed_only_to_loopback(map_file, seen["invented"])  # type: ignore[arg-type]
        for address in seen["invented"]:  # type: ignore[attr-defined]
            assert address not in out
    finally:
        stop.set()
        nodes.stop()
        emu.stop()


# --- GCP: the GCE fake (instances, service accounts, bucket IAM) + gcp-storage-emulator ----

from providers.test_gcp_e2e import world  # noqa: E402  (fixture, reused)

__all__ += ["world"]


def test_gcs_mount_and_checkpoints_on_the_gce_fake(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli, env, fake, nodes, _ = world
    emu = emus.start("gs", tmp_path / "emulator")
    try:
        fake.add_bucket(emus.BUCKET)          # the bucket's IAM lives in the fake, its data in
        emu.put("datasets/d1/corpus.txt", CORPUS)   # the emulator: the same name in both
        seen: dict[str, object] = {}

        def while_running(inst: dict) -> None:  # type: ignore[type-arg]
            seen.setdefault("accounts", []).append(  # type: ignore[union-attr]
                [sa["email"] for sa in inst.get("serviceAccounts") or []])
            seen["bindings"] = json.loads(json.dumps(fake.buckets[emus.BUCKET]["policy"]["bindings"]))
        fake.on_running.append(while_running)

        proj = tmp_path / "proj"
        proj.mkdir()
        task = proj / "task.yaml"
        task.write_text(json.dumps({
            "name": "gcpst", "num_nodes": 2,
            "resources": {"provider": "gcp", "region": "us-central1", "accelerators": "T4:1",
                          "ssh_cidr": "198.51.100.7/32"},
            "workdir": ".", "envs": {**emu.envs, "CLOUDTRAIN_CHECKPOINT_INTERVAL": "0.5"},
            "file_mounts": {"data": emu.url("datasets/d1")}, "checkpoints": emu.url("ckpt/gcp"),
            "run": RUN_BODY}))
        nodes.use(task)
        r = cli.run("launch", str(task), "--down", "-y", timeout=420, **env)
        out = r.stderr + r.stdout
        assert r.returncode == 0, out[-5000:]

        assert len(object_gets(emu)) == 2, object_gets(emu)
        assert out.count("read 18000 bytes") == 2, out[-4000:]
        mans = complete_manifests(emu, "ckpt/gcp")
        assert mans and mans[-1]["step"] == 2, mans
        assert "Uploaded checkpoint step-000002" in out, out[-4000:]

        # Both instances ran as the cluster's own service account, which held a binding on the
        # bucket while the cluster was up; down removed the binding and the account.
        accounts = seen["accounts"]
        assert len(accounts) == 2 and len({a[0] for a in accounts}) == 1, accounts  # type: ignore[arg-type,index]
        email = accounts[0][0]  # type: ignore[index]
        assert email.startswith("ct-gcpst-") and email.endswith("@test-project.iam.gserviceaccount.com")
        mine = [b for b in seen["bindings"] if f"serviceAccount:{email}" in b["members"]]  # type: ignore[attr-defined]
        assert {b["role"] for b in mine} == {"roles/storage.objectAdmin"}, seen["bindings"]
        # one binding per URL, each with a condition limiting it to that prefix
        conds = sorted(b["condition"]["expression"] for b in mine)
        assert len(conds) == 2 and "/objects/ckpt/gcp/" in conds[0] \
            and "/objects/datasets/d1/" in conds[1], conds
        for b in fake.inserted_instances():
            assert [sa["email"] for sa in b["serviceAccounts"]] == [email]
            assert b["serviceAccounts"][0]["scopes"] == [
                "https://www.googleapis.com/auth/cloud-platform"], b["serviceAccounts"]
        assert not any(f"serviceAccount:{email}" in b["members"]
                       for b in fake.buckets[emus.BUCKET]["policy"]["bindings"])
        assert email not in fake.service_accounts
        assert fake.empty(), fake.ours()
    finally:
        emu.stop()


# --- Azure: the ARM fake (VMs, managed identities, role assignments) + Azurite ---------------
#
# One URL cannot carry both halves here. An Azurite URL (http://127.0.0.1:PORT/ACCOUNT/C/P)
# has no ARM storage account behind it, so it gets no role (docs/identities.md); and a
# https://ACCOUNT.blob.core.windows.net URL cannot be pointed at Azurite on the node: rclone
# 1.60's azureblob 'endpoint' is a domain suffix joined as https://ACCOUNT.SUFFIX, and its
# use_emulator is fixed to 127.0.0.1:10000 with the emulator account, while the node's managed
# identity token comes from 169.254.169.254, which a test never reaches. So: the data path runs
# with an Azurite URL, and the identity is checked with `up`/`down` of an account URL (no job
# runs, so no node ever dials the real blob endpoint).

from providers.test_azure_e2e import world as az_world  # noqa: E402  (fixture, reused)

__all__ += ["az_world"]
BLOB_CONTRIBUTOR = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"


def _azure_task(proj: Path, name: str, envs: dict[str, str], data: str | None, ckpt: str) -> Path:
    doc: dict[str, object] = {
        "name": name, "num_nodes": 2,
        "resources": {"provider": "azure", "region": "eastus",
                      "instance_type": "Standard_NC4as_T4_v3", "ssh_cidr": "127.0.0.1/32"},
        "workdir": ".", "envs": envs, "checkpoints": ckpt, "run": RUN_BODY}
    if data:
        doc["file_mounts"] = {"data": data}
    proj.mkdir(exist_ok=True)
    task = proj / f"{name}.yaml"
    task.write_text(json.dumps(doc))
    return task


def test_azurite_mount_and_checkpoints_on_the_arm_fake(az_world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from providers.test_azure_e2e import _cloudtrain as az_cloudtrain

    fake, nodes, booter, env = az_world
    emu = emus.start("az", tmp_path / "emulator")
    try:
        emu.put("datasets/d1/corpus.txt", CORPUS)
        task = nodes.use(_azure_task(tmp_path / "proj", "azst",
                                     {**emu.envs, "CLOUDTRAIN_CHECKPOINT_INTERVAL": "0.5"},
                                     emu.url("datasets/d1"), emu.url("ckpt/az")))
        r = az_cloudtrain(env, "launch", str(task), "--down", "-y", timeout=400)
        out = r.stderr + r.stdout
        assert r.returncode == 0, out[-5000:]
        assert len(object_gets(emu, f"{emus.AZURITE_ACCOUNT}/{emus.BUCKET}/datasets/d1/corpus.txt")) \
            == 2, emu.requests("corpus")
        assert out.count("read 18000 bytes") == 2, out[-4000:]
        mans = complete_manifests(emu, "ckpt/az")
        assert mans and mans[-1]["step"] == 2, mans
        assert "Uploaded checkpoint step-000002" in out, out[-4000:]
        assert fake.role_assignments == {}          # an emulator URL: nothing granted in ARM
        guard_log = Path(env["CT_AZ_GUARD_LOG"])      # nothing tried to leave loopback
        assert not guard_log.exists() or guard_log.read_text() == ""
    finally:
        emu.stop()


def test_vm_identity_gets_the_container_role_and_down_removes_it(az_world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from providers.test_azure_e2e import _cloudtrain as az_cloudtrain

    fake, nodes, _, env = az_world
    acct = fake.add_storage_account("data-rg", "ctstore")
    scope = f"{acct}/blobServices/default/containers/{emus.BUCKET}"
    task = nodes.use(_azure_task(tmp_path / "proj", "azid", {}, None,
                                 f"https://ctstore.blob.core.windows.net/{emus.BUCKET}/ckpt/az"))
    r = az_cloudtrain(env, "up", str(task), "-y", timeout=400)
    assert r.returncode == 0, (r.stderr + r.stdout)[-5000:]
    try:
        vms = [v for v in fake.resources.values()
               if v.get("type") == "Microsoft.Compute/virtualMachines"]
        principals = {(v.get("identity") or {}).get("principalId") for v in vms}
        assert len(vms) == 2 and len(principals) == 2 and None not in principals, vms
        assert {v["identity"]["type"] for v in vms} == {"SystemAssigned"}
        at = fake.assignments_at(scope)
        assert {(a["properties"]["principalId"],
                 a["properties"]["roleDefinitionId"].rsplit("/", 1)[-1]) for a in at} == {
            (p, BLOB_CONTRIBUTOR) for p in principals}, at
        # the blob role nowhere but on that container
        assert {a["properties"]["scope"].lower() for a in fake.role_assignments.values()
                if a["properties"]["roleDefinitionId"].endswith(BLOB_CONTRIBUTOR)} == {scope.lower()}
    finally:
        d = az_cloudtrain(env, "down", "azid", "-y", timeout=300)
    assert d.returncode == 0, (d.stderr + d.stdout)[-3000:]
    assert fake.assignments_at(scope) == []
