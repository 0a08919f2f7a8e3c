"""The nodes' identity on GCP, against the GCE fake (which also serves the IAM and Cloud Storage
IAM JSON APIs) through the real client libraries: a service account per cluster, marked in
its description, bound on exactly the task's gs:// buckets (a prefix: an IAM condition),
attached to the instances; removed from the buckets and deleted at down; an account of that
name not marked for the cluster is refused and kept; the user's own is used as-is."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.compute_v1")

from cloudtrain.errors import UserError  # noqa: E402
from cloudtrain.storage.url import parse  # noqa: E402
from cloudtrain_provisioners.gcp import identity  # noqa: E402
from gce_fake import GCEFake, Harness, hermetic_env  # noqa: E402

OWNER = "alice@laptop.example"


@pytest.fixture
def gcp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch, tmp_path)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    with GCEFake() as fake:
        fake.guard_env(monkeypatch)
        fake.add_bucket("ckpt-bucket")
        fake.add_bucket("data-bucket", uniform=False)
        yield Harness(fake, tmp_path / "home")


def _req(h: Harness, *urls: str, **kw):  # type: ignore[no-untyped-def]
    return dataclasses.replace(h.request(**kw), buckets=tuple(parse(u) for u in urls))


def _members(h: Harness, bucket: str) -> list[tuple[str, str, str]]:
    return sorted((x["role"], m, (x.get("condition") or {}).get("expression", ""))
                  for x in h.fake.buckets[bucket]["policy"]["bindings"] for m in x["members"])


def test_account_bound_on_the_buckets_attached_and_removed_at_down(gcp: Harness) -> None:
    email = identity.email_of("demo", OWNER, gcp.fake.project)
    p, nodes = gcp.up(_req(gcp, "gs://ckpt-bucket/runs/r1", "gs://data-bucket",
                           "s3://foreign/x"))
    sa = gcp.fake.service_accounts[email]
    assert "cloudtrain-cluster=demo" in sa["description"]
    ckpt = [m for m in _members(gcp, "ckpt-bucket") if m[1] == f"serviceAccount:{email}"]
    assert ckpt == [(identity.ROLE, f"serviceAccount:{email}",
                     'resource.name.startsWith("projects/_/buckets/ckpt-bucket/objects/runs/r1/")'
                     ' || resource.type == "storage.googleapis.com/Bucket"')]
    assert (identity.ROLE, f"serviceAccount:{email}", "") in _members(gcp, "data-bucket")
    for body in gcp.fake.inserted_instances():
        (acct,) = body["serviceAccounts"]
        assert acct["email"] == email
    # the default bindings stay as they were
    assert ("roles/storage.legacyBucketOwner", f"projectOwner:{gcp.fake.project}", "") in \
        _members(gcp, "ckpt-bucket")

    p.terminate("demo")
    assert email not in gcp.fake.service_accounts
    for bucket in ("ckpt-bucket", "data-bucket"):
        assert not [m for m in _members(gcp, bucket) if email in m[1]]
    assert gcp.fake.empty(), gcp.fake.ours()


def test_an_unmarked_account_of_that_name_is_refused_and_kept(gcp: Harness) -> None:
    aid = identity.account_id("demo", OWNER)
    gcp.fake.service_accounts[f"{aid}@{gcp.fake.project}.iam.gserviceaccount.com"] = \
        gcp.fake._sa_res(gcp.fake.project, aid, {"description": "the data team's"})
    with pytest.raises(UserError, match="not marked as this cluster's"):
        gcp.up(_req(gcp, "gs://ckpt-bucket/r1"))
    assert len(gcp.fake.service_accounts) == 1 and gcp.fake.inserted_instances() == []
    gcp.provider().terminate("demo")
    assert len(gcp.fake.service_accounts) == 1


def test_own_account_used_and_plan_says_what(gcp: Harness) -> None:
    p = gcp.provider()
    plan = p.plan(_req(gcp, "gs://ckpt-bucket/r1", "s3://foreign/x"))
    (line,) = [c for c in plan.creates if "service account" in c]
    assert "gs://ckpt-bucket/r1" in line and identity.ROLE in line
    assert any("s3://foreign/x" in n and "envs" in n for n in plan.notes)
    req = _req(gcp, "gs://ckpt-bucket/r1", gcp={"service_account": "mine@p.iam.gserviceaccount.com"})
    assert not [c for c in p.plan(req).creates if "service account" in c]
    gcp.up(req)
    assert gcp.fake.service_accounts == {}
    assert {b["serviceAccounts"][0]["email"] for b in gcp.fake.inserted_instances()} == {
        "mine@p.iam.gserviceaccount.com"}


def test_no_credential_of_this_machine_reaches_a_node(gcp: Harness,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    secrets = {"AWS_SECRET_ACCESS_KEY": "awssecret-9c1e", "GOOGLE_OAUTH_ACCESS_TOKEN":
               "ya29.laptop-4be2", "AZURE_CLIENT_SECRET": "azsecret-51e0d"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    gcp.up(_req(gcp, "gs://ckpt-bucket/r1"))
    sent = json.dumps(gcp.fake.inserted_instances())
    assert "metadata" in sent
    for k, v in secrets.items():
        assert v not in sent and k not in sent


def test_gc_finds_an_orphaned_account_and_leaves_others(gcp: Harness) -> None:
    theirs = "team-data@test-project.iam.gserviceaccount.com"
    gcp.fake.service_accounts[theirs] = gcp.fake._sa_res(gcp.fake.project, "team-data",
                                                         {"description": "the data team's"})
    p, _ = gcp.up(_req(gcp, "gs://ckpt-bucket/r1"))
    email = identity.email_of("demo", OWNER, gcp.fake.project)
    assert not [r for r in p.orphans({"demo"}) if r.kind == "service-account"]
    found = [r for r in p.orphans(set()) if r.kind == "service-account"]
    assert [(r.id, r.cluster) for r in found] == [(email, "demo")]
    p.remove(p.orphans(set()))
    assert set(gcp.fake.service_accounts) == {theirs}
