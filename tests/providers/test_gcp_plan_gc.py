"""``up --dry-run`` on GCP (the plan: firewall rules, instances, price; nothing created, no API
call) and garbage collection of resources with cloudtrain's marks that no live cluster owns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("google.cloud.compute_v1")

from click.testing import CliRunner  # noqa: E402

from cloudtrain_provisioners.gcp import tags as L  # noqa: E402
from gce_fake import TEST_CALLER_IP, GCEFake, Harness, fake_offers, hermetic_env  # noqa: E402


@pytest.fixture
def gcp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch, tmp_path)
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("cloudtrain.planner.catalog_offers", lambda home: fake_offers())
    with GCEFake() as fake:
        fake.guard_env(monkeypatch)
        yield Harness(fake, tmp_path / "home")
        # nothing tried to leave loopback (google-auth's own boundary lookup aside)
        assert not [h for h in fake.outside if not h.startswith("iamcredentials.")], fake.outside


def _base(name: str = "demo", owner: str = "alice@laptop.example") -> str:
    return L.base_name(name, owner)


def test_plan_lists_the_rules_the_instances_and_the_price_and_calls_nothing(gcp: Harness) -> None:
    p = gcp.provider()
    plan = p.plan(gcp.request(ports=[6006], use_spot=True, ssh_cidr="198.51.100.0/24"))
    base = _base()
    assert plan.provider == "gcp" and plan.region == "us-central1"
    assert plan.instance_type == "n1-standard-8" and plan.use_spot
    assert plan.hourly_price_per_node == pytest.approx(0.25)
    text = "\n".join(plan.creates)
    assert f"firewall rule {base}-ssh on network {base}-net: tcp 22 from 198.51.100.0/24 to " \
           f"instances tagged {base}" in text
    assert f"firewall rule {base}-internal on network {base}-net: all traffic from instances " \
           f"tagged {base}" in text
    assert f"firewall rule {base}-ports on network {base}-net: tcp 6006 from 198.51.100.0/24" in text
    assert "0.0.0.0/0" not in text
    assert "2 x n1-standard-8 + 1 x nvidia-tesla-t4 attached spot (provisioningModel SPOT, " \
           "termination action DELETE)" in text
    assert "onHostMaintenance TERMINATE" in text and "Deep Learning VM" in text
    assert any("us-central1-a, us-central1-b, us-central1-c" in n for n in plan.notes)
    assert gcp.fake.requests == []


def test_plan_without_ssh_cidr_uses_the_cached_address_or_says_when(gcp: Harness) -> None:
    plan = gcp.provider().plan(gcp.request())
    assert "looked up when up runs" in "\n".join(plan.creates)
    (gcp.home).mkdir(parents=True, exist_ok=True)
    (gcp.home / "caller-ip.json").write_text(json.dumps({"ip": TEST_CALLER_IP, "at": 9e18}))
    plan = gcp.provider().plan(gcp.request())
    assert f"tcp 22 from {TEST_CALLER_IP}/32" in "\n".join(plan.creates)


def _task(tmp: Path, body: str) -> Path:
    f = tmp / "task.yaml"
    f.write_text("name: demo\nnum_nodes: 2\nrun: echo hi\nresources:\n  provider: gcp\n" + body)
    return f


def _cli(gcp: Harness, *args: str) -> tuple[int, str]:
    from cloudtrain.commands.main import cli

    r = CliRunner().invoke(cli, list(args), catch_exceptions=False, obj={"gcp": gcp.provider()})
    return r.exit_code, r.output + (r.stderr if r.stderr_bytes is not None else "")


def test_up_dry_run_through_the_cli_creates_nothing(gcp: Harness, tmp_path: Path) -> None:
    task = _task(tmp_path, "  region: us-central1\n  accelerators: T4:1\n  ports: [6006]\n"
                           "  ssh_cidr: 198.51.100.7/32\n")
    code, out = _cli(gcp, "up", str(task), "--dry-run")
    assert code == 0, out
    assert "dry run: nothing is created" in out
    assert f"firewall rule {_base()}-ssh" in out and "tcp 22 from 198.51.100.7/32" in out
    assert f"firewall rule {_base()}-ports" in out
    assert "$0.73/h per node, $1.46/h for the cluster" in out
    assert gcp.fake.requests == []
    assert not (gcp.home / "clusters" / "demo").exists()


def test_up_dry_run_with_the_planner_shows_the_failover_order(gcp: Harness, tmp_path: Path) -> None:
    task = _task(tmp_path, "  accelerators: T4:1\n  use_spot: true\n  ssh_cidr: 198.51.100.7/32\n")
    code, out = _cli(gcp, "up", str(task), "--dry-run")
    assert code == 0, out
    assert "us-central1" in out and "failover order" in out and "us-east1" in out
    assert "$0.25/h per node" in out
    assert gcp.fake.requests == []


# --- gc ---------------------------------------------------------------------------------------

def _orphan_setup(gcp: Harness) -> None:
    """'old' lost its local state; 'live' is known here; bob's 'old' is someone else's."""
    gcp.up(gcp.request(name="old"))
    gcp.up(gcp.request(name="live", num_nodes=1))
    gcp.up(gcp.request(name="old"), gcp.provider(owner="bob@desktop"))
    shutil.rmtree(gcp.home / "clusters" / "old")


def test_orphans_are_what_no_live_cluster_owns_and_remove_takes_them(gcp: Harness) -> None:
    _orphan_setup(gcp)
    p = gcp.provider()
    found = p.orphans({"live"})
    base = _base("old")
    assert sorted((r.kind, r.id) for r in found) == [
        ("firewall", f"{base}-internal"), ("firewall", f"{base}-ssh"),
        ("instance", f"{base}-0"), ("instance", f"{base}-1"), ("network", f"{base}-net")]
    assert {r.cluster for r in found} == {"old"} and {r.project for r in found} == {"test-project"}
    assert all(r.text().startswith(("us-central1-a instance", "global firewall",
                                    "global network")) for r in found)
    everyone = p.orphans({"live"}, any_owner=True)
    assert {r.owner for r in everyone} == {L.owner_value("alice@laptop.example"),
                                           L.owner_value("bob@desktop")}
    p.remove(found)
    assert p.orphans({"live"}) == []
    left = gcp.fake.ours()
    assert f"us-central1-a/{_base('live')}-0" in left["instances"]
    assert f"us-central1-a/{_base('old', 'bob@desktop')}-0" in left["instances"]
    assert not [x for v in left.values() for x in v if base in x]


def test_a_live_cluster_is_never_an_orphan(gcp: Harness) -> None:
    gcp.up(gcp.request(name="live", num_nodes=1))
    assert gcp.provider().orphans({"live"}) == []
    assert {r.cluster for r in gcp.provider().orphans(set())} == {"live"}


def test_gc_command_through_the_cli(gcp: Harness) -> None:
    """The generic ``cloudtrain gc`` (where it is wired) takes GCP through the same methods."""
    from cloudtrain.commands.main import cli

    if "gc" not in cli.commands:
        cmd_gc = pytest.importorskip("cloudtrain.commands.gc")
        import click

        group = click.Group()
        cmd_gc.register(group)
    else:
        group = cli
    from cloudtrain.context import open_env
    from cloudtrain.pipeline.provision import provision
    from cloudtrain.spec import parse_task
    from cloudtrain.ui import UI

    providers = {"gcp": gcp.provider()}
    # 'live' is a cluster this machine knows (in its state); the rest are not
    provision(open_env(UI(quiet=True), providers), parse_task(
        "name: live\nrun: echo hi\nresources:\n  provider: gcp\n  region: us-central1\n"
        "  accelerators: T4:1\n"), "live")
    gcp.up(gcp.request(name="old"))
    gcp.up(gcp.request(name="old"), gcp.provider(owner="bob@desktop"))
    shutil.rmtree(gcp.home / "clusters" / "old")
    r = CliRunner().invoke(group, ["gc", "--provider", "gcp", "--json"], catch_exceptions=False,
                           obj=providers)
    assert r.exit_code == 0, r.output
    listed = json.loads(r.stdout[r.stdout.index("["):])
    assert {(x["kind"], x["cluster"], x["removed"]) for x in listed} == {
        ("instance", "old", False), ("firewall", "old", False), ("network", "old", False)}
    assert len(gcp.fake.ours()["instances"]) == 5         # listing removes nothing
    r = CliRunner().invoke(group, ["gc", "--provider", "gcp", "--force", "-y", "--json"],
                           catch_exceptions=False, obj=providers)
    assert r.exit_code == 0, r.output
    listed = json.loads(r.stdout[r.stdout.index("["):])
    assert listed and all(x["removed"] for x in listed)
    assert not [i for i in gcp.fake.ours()["instances"] if _base("old") in i]
