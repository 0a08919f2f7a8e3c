"""The nodes' identity on AWS against moto: an IAM role + instance profile per cluster, allowed
on exactly the task's S3 buckets, attached to the instances, removed at down (found by path and
tags), collected by gc; a role not tagged for the cluster is never touched; the user's own
profile is used as-is; no credential of this machine reaches a node."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("boto3")

from cloudtrain.errors import UserError  # noqa: E402
from cloudtrain.storage.url import parse  # noqa: E402
from cloudtrain_provisioners.aws import identity  # noqa: E402
from cloudtrain_provisioners.aws import tags as T  # noqa: E402
from aws_moto import Harness  # noqa: E402

REGION = "us-east-1"




def _req(h: Harness, *urls: str, name: str = "demo", **kw):  # type: ignore[no-untyped-def]
    return dataclasses.replace(h.request(name=name, **kw),
                               buckets=tuple(parse(u) for u in urls))


def _up(h: Harness, req):  # type: ignore[no-untyped-def]
    p = h.provider()
    return p, p.create_nodes(req, p.ensure_network(req))


def _roles(h: Harness) -> dict[str, dict]:  # type: ignore[type-arg]
    iam = h.clients.raw_iam()
    return {r["RoleName"]: r for r in iam.list_roles()["Roles"]}


def _profiles(h: Harness) -> dict[str, dict]:  # type: ignore[type-arg]
    iam = h.clients.raw_iam()
    return {p["InstanceProfileName"]: p for p in iam.list_instance_profiles()["InstanceProfiles"]}


def _plant_other_role(h: Harness, name: str, cluster: str | None) -> None:
    """A role (and profile) of the same path that is not this cluster's."""
    iam = h.clients.raw_iam()
    marks = [{"Key": T.CLUSTER, "Value": cluster}, {"Key": T.OWNER, "Value": "someone@else"}] \
        if cluster else [{"Key": "team", "Value": "ml"}]
    iam.create_role(RoleName=name, Path="/cloudtrain/", Tags=marks,
                    AssumeRolePolicyDocument=json.dumps(identity.TRUST))
    iam.put_role_policy(RoleName=name, PolicyName="theirs", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*",
                                                 "Resource": "*"}]}))
    iam.create_instance_profile(InstanceProfileName=name, Path="/cloudtrain/", Tags=marks)
    iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)


def test_role_policy_attachment_and_removal_at_down(aws: Harness) -> None:
    _plant_other_role(aws, "cloudtrain-other-cluster", "other")
    req = _req(aws, "s3://ckpt-bucket/runs/r1", "s3://data-bucket", "gs://foreign/x")
    p, nodes = _up(aws, req)
    name = T.base_name("demo", p._owner("demo"))
    roles = _roles(aws)
    assert set(roles) == {name, "cloudtrain-other-cluster"}
    role = roles[name]
    assert role["Path"] == "/cloudtrain/"
    iam = aws.clients.raw_iam()
    marks = T.as_dict(iam.list_role_tags(RoleName=name)["Tags"])
    assert marks[T.CLUSTER] == "demo" and marks[T.OWNER] == p._owner("demo")
    trust = role["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    (stmt,) = trust["Statement"]
    assert stmt["Principal"] == {"Service": "ec2.amazonaws.com"}
    doc = iam.get_role_policy(RoleName=name, PolicyName=identity.POLICY)["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    by_res = {s["Resource"]: s for s in doc["Statement"]}
    assert set(by_res) == {"arn:aws:s3:::ckpt-bucket", "arn:aws:s3:::ckpt-bucket/runs/r1/*",
                           "arn:aws:s3:::data-bucket", "arn:aws:s3:::data-bucket/*"}
    assert by_res["arn:aws:s3:::ckpt-bucket"]["Condition"] == {
        "StringLike": {"s3:prefix": ["runs/r1", "runs/r1/*"]}}
    assert "Condition" not in by_res["arn:aws:s3:::data-bucket"]
    actions = {a for s in doc["Statement"] for a in s["Action"]}
    assert "s3:PutObject" in actions and not any("Delete" in a for a in actions)
    assert "foreign" not in json.dumps(doc)
    prof = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]
    assert [r["RoleName"] for r in prof["Roles"]] == [name] and prof["Path"] == "/cloudtrain/"
    # attached to every instance at launch
    for inst in aws.tagged()["instances"]:
        assert inst["IamInstanceProfile"]["Arn"].endswith(f"/cloudtrain/{name}")
    assert len(nodes) == 2

    # a second up adopts the role and sets the policy to the task's buckets again
    p2, _ = _up(aws, _req(aws, "s3://ckpt-bucket/runs/r1"))
    doc = iam.get_role_policy(RoleName=name, PolicyName=identity.POLICY)["PolicyDocument"]
    assert "data-bucket" not in json.dumps(doc)
    assert len(_roles(aws)) == 2 and len(_profiles(aws)) == 2

    p2.terminate("demo")
    assert set(_roles(aws)) == {"cloudtrain-other-cluster"}
    assert set(_profiles(aws)) == {"cloudtrain-other-cluster"}
    assert iam.list_role_policies(RoleName="cloudtrain-other-cluster")["PolicyNames"] == ["theirs"]
    p2.terminate("demo")   # twice is fine


def test_a_role_of_that_name_not_tagged_for_the_cluster_is_refused_and_kept(aws: Harness) -> None:
    p = aws.provider()
    name = T.base_name("demo", p._owner("demo"))
    _plant_other_role(aws, name, None)
    req = _req(aws, "s3://ckpt-bucket/r1")
    with pytest.raises(UserError, match="not tagged for this cluster"):
        p.create_nodes(req, p.ensure_network(req))
    iam = aws.clients.raw_iam()
    assert iam.list_role_policies(RoleName=name)["PolicyNames"] == ["theirs"]
    assert aws.tagged()["instances"] == []
    p.terminate("demo")
    assert name in _roles(aws) and name in _profiles(aws)


def test_no_buckets_no_identity_and_own_profile_used_as_is(aws: Harness) -> None:
    p, _ = _up(aws, aws.request())
    assert _roles(aws) == {} and "IamInstanceProfile" not in aws.tagged()["instances"][0]
    p.terminate("demo")
    iam = aws.clients.raw_iam()
    iam.create_instance_profile(InstanceProfileName="mine")
    req = _req(aws, "s3://ckpt-bucket/r1", name="own", aws={"iam_instance_profile": "mine"})
    plan = p.plan(req)
    assert not any("IAM role" in c for c in plan.creates)
    assert any("your instance profile mine" in n for n in plan.notes)
    p.create_nodes(req, p.ensure_network(req))
    (run,) = {json.dumps(o.get("IamInstanceProfile")) for o in aws.faults.ops("RunInstances")
              if o["TagSpecifications"][0]["Tags"][0]["Value"] == "own"}
    assert json.loads(run) == {"Name": "mine"}
    assert _roles(aws) == {}
    p.terminate("own")
    assert set(_profiles(aws)) == {"mine"}


def test_plan_says_which_identity_for_which_buckets(aws: Harness) -> None:
    p = aws.provider()
    plan = p.plan(_req(aws, "s3://ckpt-bucket/r1", "gs://foreign/x"))
    (line,) = [c for c in plan.creates if "IAM role" in c]
    assert "s3://ckpt-bucket/r1" in line and "gs://" not in line and "/cloudtrain/" in line
    assert any("gs://foreign/x" in n and "envs" in n for n in plan.notes)
    assert _roles(aws) == {}   # a plan creates nothing


def test_gc_finds_an_orphaned_role_and_leaves_others(aws: Harness) -> None:
    _plant_other_role(aws, "cloudtrain-other-cluster", "other")
    p, _ = _up(aws, _req(aws, "s3://ckpt-bucket/r1"))
    name = T.base_name("demo", p._owner("demo"))
    assert not [r for r in p.orphans({"demo"}) if r.kind in ("role", "instance-profile")]
    found = [r for r in p.orphans(set()) if r.kind in ("role", "instance-profile")]
    assert {(r.kind, r.name) for r in found} == {("role", name), ("instance-profile", name)}
    p.remove(p.orphans(set()))
    assert set(_roles(aws)) == {"cloudtrain-other-cluster"}
    assert set(_profiles(aws)) == {"cloudtrain-other-cluster"}


def test_no_credential_of_this_machine_reaches_a_node(aws: Harness,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {"AWS_SESSION_TOKEN": "tok-3f9a1c-laptop", "GOOGLE_APPLICATION_CREDENTIALS":
               "/home/me/gcp-key-77b1.json", "AZURE_CLIENT_SECRET": "azsecret-51e0d"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    _up(aws, _req(aws, "s3://ckpt-bucket/r1", aws={"inject_host_key": True}))
    sent = json.dumps(aws.faults.ops("RunInstances"), default=str)
    assert "UserData" in sent
    for v in secrets.values():
        assert v not in sent
    assert "AWS_SECRET_ACCESS_KEY" not in sent and "AWS_ACCESS_KEY_ID" not in sent


DRY_TASK = """
name: dry
num_nodes: 2
resources:
  provider: aws
  region: us-east-1
  instance_type: g4dn.xlarge
  ssh_cidr: 127.0.0.1/32
  aws: {host_key_wait: 0}
checkpoints: s3://ckpt-bucket/runs/r1
file_mounts:
  /data: gs://foreign-bucket/set
workdir: .
train:
  script: train.py
"""


def test_up_dry_run_says_which_identity_for_which_buckets(tmp_path: Path) -> None:
    """Through the CLI, with no credentials and an endpoint where nothing listens."""
    import os
    import socket
    import subprocess
    import sys

    (tmp_path / "task.yaml").write_text(DRY_TASK)
    (tmp_path / "train.py").write_text("print('hi')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CLOUDTRAIN_"))}
    env.update({"CLOUDTRAIN_HOME": str(tmp_path / "home"), "NO_COLOR": "1",
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                "AWS_EC2_METADATA_DISABLED": "true"})
    r = subprocess.run([sys.executable, "-m", "cloudtrain", "up", str(tmp_path / "task.yaml"),
                        "--dry-run"], capture_output=True, text=True, env=env, timeout=120,
                       cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "IAM role and instance profile" in out and "s3://ckpt-bucket/runs/r1" in out
    assert "no AWS identity for gs://foreign-bucket/set" in out
