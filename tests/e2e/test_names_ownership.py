"""Findings 1, 2, 16 and 18 (names and ownership), as a user meets them through the CLI.

- one cluster-name rule at every door: bad names (``*``, ``''``, ``a/b``, ``../x``, ``job\\n``)
  are exit 2 with a one-line error, and nothing anywhere is created or deleted;
- a ``down`` that cannot find a cluster whose record was lost says so (and how to look for it
  with --provider), never "is down"; nodes whose files were deleted are still stopped;
- the owner mark tells CLOUDTRAIN_HOMEs apart: gc in one home leaves another home's live
  cluster alone (and pre-home-id resources), and never terminates a running instance
  without --force;
- gc without --provider looks at every installed cloud, skipping those without credentials.

Local-provider cases run real sshd nodes on loopback; AWS cases run against moto in-process
through the click command line.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until

RULE_WORDS = "is not a valid cluster name"

LOCAL_TASK = """
name: {name}
num_nodes: 1
run: echo hi
resources:
  provider: local
"""


# --- the name rule, without any cluster --------------------------------------------------------

BAD = [
    ("down", "*", "--provider", "aws", "-y"),
    ("down", "--provider", "local", "-y", "--", ""),
    ("down", "--provider", "local", "-y", "--", "a/b"),
    ("down", "../../victim", "--provider", "local", "-y"),
    ("down", "job\n", "-y"),
    ("logs", "../x"),
    ("logs", "../x", "--job", "j1"),
    ("exec", "../x", "--", "true"),
    ("ssh", "*"),
    ("status", "job\n"),
]


@pytest.mark.parametrize("args", BAD, ids=[" ".join(a).replace("\n", "\\n") or "empty"
                                            for a in BAD])
def test_a_bad_cluster_name_is_exit_2_one_error_and_touches_nothing(cli: CLI, tmp_path: Path,
                                                                     args: tuple[str, ...]) -> None:
    # What a bad name could reach: a directory next to the home, another cluster's files,
    # a folder outside the logs folder holding "logs".
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    other = cli.home / "clusters" / "other"
    (other / "ssh").mkdir(parents=True)
    (other / "ssh" / "id_ed25519").write_text("key")
    outside = cli.home / "x" / "j1"
    outside.mkdir(parents=True)
    (outside / "node-0.log").write_text("SECRET-OUTSIDE-LOGS\n")
    before = sorted(str(p) for p in tmp_path.rglob("*"))

    r = cli.run(*args, timeout=60, AWS_ENDPOINT_URL="http://127.0.0.1:9",
                AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x")

    assert r.returncode == 2, r.stdout + r.stderr
    assert RULE_WORDS in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "lowercase letters" in r.stderr                       # the rule is named
    assert "SECRET-OUTSIDE-LOGS" not in r.stdout + r.stderr
    after = sorted(str(p) for p in tmp_path.rglob("*"))
    assert after == before                                       # nothing created or deleted
    assert (victim / "precious.txt").read_text() == "keep me"


def test_a_task_name_with_a_trailing_newline_is_refused(cli: CLI, tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text('name: "job\\n"\nrun: echo hi\nresources:\n  provider: local\n')
    r = cli.run("up", str(task), "--dry-run", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "name" in r.stderr and "Traceback" not in r.stderr
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())


def test_dash_c_is_checked_by_the_same_rule(cli: CLI, tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(LOCAL_TASK.format(name="fine"))
    for bad in ("job\n", "../x", "*", "Upper"):
        r = cli.run("up", str(task), "-c", bad, "--dry-run", timeout=60)
        assert r.returncode == 2 and "-c/--cluster" in r.stderr and RULE_WORDS in r.stderr, \
            r.stderr


def test_name_rule_and_paths_inside_their_parent(tmp_path: Path) -> None:
    from cloudtrain.errors import UserError
    from cloudtrain.names import check, inside
    from cloudtrain.provider import ProviderContext

    for good in ("a", "train-1", "a" * 40):
        assert check(good) == good
    for bad in ("", "*", "job\n", "a" * 41, "-a", "a-", "../x", "a/b", "A", "a?", "a b"):
        with pytest.raises(UserError):
            check(bad)
    (tmp_path / "clusters").mkdir()
    os.symlink(tmp_path, tmp_path / "clusters" / "link")     # a link that leads out
    with pytest.raises(UserError):
        inside(tmp_path / "clusters", "link")
    with pytest.raises(UserError):
        ProviderContext(tmp_path).cluster_dir("..")
    assert ProviderContext(tmp_path).cluster_dir("ok") == tmp_path / "clusters" / "ok"


def test_filter_values_are_escaped() -> None:
    from cloudtrain.errors import UserError
    from cloudtrain_provisioners.aws import tags as T
    from cloudtrain_provisioners.gcp import tags as L

    assert T.escape("a*b?c\\") == "a\\*b\\?c\\\\"
    flt = T.filters("train", "me@host*")
    assert {"Name": f"tag:{T.OWNER}", "Values": ["me@host\\*"]} in flt
    with pytest.raises(UserError):
        T.filters("*", None)
    with pytest.raises(UserError):
        L.instance_filter('x" OR labels.a:*', None)


# --- the local provider: lost records, deleted files ---------------------------------------------

def _up_local(cli: CLI, tmp_path: Path, name: str) -> None:
    task = tmp_path / f"{name}.yaml"
    task.write_text(LOCAL_TASK.format(name=name))
    r = cli.run("up", str(task), "-y", "--no-bootstrap", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


def _sshd_of(cli: CLI, name: str) -> list[int]:
    return processes_with(str(cli.home / "clusters" / name))


@needs_sshd
def test_down_of_an_empty_name_corrupts_nothing_and_a_later_down_stops_the_nodes(
        cli: CLI, tmp_path: Path) -> None:
    _up_local(cli, tmp_path, "alpha")
    assert _sshd_of(cli, "alpha")
    r = cli.run("down", "--provider", "local", "-y", "--", "", timeout=60)
    assert r.returncode == 2 and RULE_WORDS in r.stderr and "Traceback" not in r.stderr
    assert [c["name"] for c in cli.status()] == ["alpha"]       # state intact
    assert (cli.home / "clusters" / "alpha" / "ssh").is_dir()    # keys intact
    assert _sshd_of(cli, "alpha")

    r = cli.run("down", "alpha", "-y", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_nothing_left(cli.home)


@needs_sshd
def test_down_after_the_clusters_files_were_deleted_still_stops_its_sshd(
        cli: CLI, tmp_path: Path) -> None:
    """Old behaviour: "'alpha' is down; local lists none of its nodes", exit 0, sshd alive."""
    _up_local(cli, tmp_path, "alpha")
    pids = _sshd_of(cli, "alpha")
    assert pids
    shutil.rmtree(cli.home / "clusters" / "alpha")               # layout, pid files, keys gone
    r = cli.run("down", "alpha", "-y", timeout=120)
    alive = [p for p in pids if Path(f"/proc/{p}").exists()]
    assert r.returncode != 0 or wait_until(lambda: not [p for p in pids
                                                       if Path(f"/proc/{p}").exists()], 10), \
        f"down said {r.stderr!r} but sshd {alive} still run"
    assert r.returncode == 0, r.stdout + r.stderr
    assert_nothing_left(cli.home)


@needs_sshd
def test_with_the_state_deleted_down_points_to_provider_and_finds_it_by_tag(
        cli: CLI, tmp_path: Path) -> None:
    _up_local(cli, tmp_path, "alpha")
    (cli.home / "state.db").unlink()
    r = cli.run("down", "alpha", "-y", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--provider PROVIDER" in r.stderr and "finds it by its tag" in r.stderr
    assert _sshd_of(cli, "alpha")                                # nothing was touched

    r = cli.run("down", "alpha", "--provider", "local", "-y", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "found by tag" in r.stdout + r.stderr
    assert_nothing_left(cli.home)


def test_down_by_tag_that_finds_nothing_does_not_claim_success(cli: CLI) -> None:
    r = cli.run("down", "ghost", "--provider", "local", "-y", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is down" not in r.stdout + r.stderr
    assert "Found no node of cluster 'ghost'" in r.stderr and "--provider" in r.stderr


# --- AWS (moto, in-process): filters, homes, gc -------------------------------------------------

moto = pytest.importorskip("moto")
pytest.importorskip("boto3")

from cloudtrain.provider import registry  # noqa: E402
from cloudtrain.context import open_env  # noqa: E402
from cloudtrain.pipeline.provision import provision  # noqa: E402
from cloudtrain.spec import parse_task  # noqa: E402
from cloudtrain.ui import UI  # noqa: E402
from aws_moto import Harness, add_images_to_moto, hermetic_env  # noqa: E402

REGION = "us-east-1"
AWS_TASK = """
name: {name}
num_nodes: {n}
run: echo hi
resources:
  provider: aws
  region: us-east-1
  accelerators: A100:8
  aws: {{host_key_wait: 0}}
"""


class Homes:
    """Two CLOUDTRAIN_HOMEs of the same user@host sharing one (moto) AWS account."""

    def __init__(self, mp: pytest.MonkeyPatch, base: Path) -> None:
        self.mp = mp
        self.a = Harness(base / "home-a")
        self.b = Harness(base / "home-b", clients=self.a.clients)
        self.b.faults = self.a.faults
        self.providers: dict[str, Any] = {}
        """What the commands run in-process are handed (the home in use's provider)."""

    def use(self, h: Harness) -> Harness:
        """Commands from now on run in ``h``'s home (a new process: a new provider)."""
        self.mp.setenv("CLOUDTRAIN_HOME", str(h.home))
        self.providers = {"aws": h.provider()}
        return h

    def up(self, h: Harness, name: str, n: int = 1) -> None:
        self.use(h)
        provision(open_env(UI(quiet=True), self.providers), parse_task(AWS_TASK.format(name=name, n=n)), name)

    def running(self, cluster: str) -> int:
        return len([i for i in self.a.tagged(cluster=cluster)["instances"]
                    if i["State"]["Name"] in ("pending", "running")])


@pytest.fixture
def homes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    from moto import mock_aws

    hermetic_env(monkeypatch)
    with mock_aws():
        add_images_to_moto(REGION)
        yield Homes(monkeypatch, tmp_path)


def _invoke(homes: Homes, *args: str):  # type: ignore[no-untyped-def]
    from cloudtrain.commands.main import cli

    return CliRunner().invoke(cli, list(args), obj=homes.providers)


def test_down_star_on_aws_is_refused_and_both_clusters_keep_running(homes: Homes) -> None:
    homes.up(homes.a, "one")
    homes.up(homes.a, "two")
    homes.use(homes.a)
    r = _invoke(homes, "down", "*", "--provider", "aws", "-y")
    assert r.exit_code == 2, r.output
    assert RULE_WORDS in r.output
    assert homes.running("one") == 1 and homes.running("two") == 1
    assert {c.name for c in open_env(UI(quiet=True)).state.list_clusters()} == {"one", "two"}


def test_owner_mark_carries_this_homes_id(homes: Homes) -> None:
    from cloudtrain.ownership import HOME_ID_FILE, base_owner

    homes.up(homes.a, "one")
    homes.up(homes.b, "one")                 # same name, same user@host, another home
    owners = {t["Value"] for i in homes.a.tagged(cluster="one")["instances"]
              for t in i["Tags"] if t["Key"] == "cloudtrain:owner"}
    ids = {(h.home / HOME_ID_FILE).read_text().strip() for h in (homes.a, homes.b)}
    assert len(ids) == 2
    assert owners == {f"{base_owner()}/home-{i}" for i in ids}
    assert homes.running("one") == 2         # home b did not adopt home a's instance


def test_gc_in_one_home_leaves_another_homes_running_cluster_alone(homes: Homes) -> None:
    """Old behaviour: the owner tag was user@host for both homes, and gc -y in home a
    terminated home b's live cluster 'train'."""
    import getpass
    import socket

    homes.up(homes.b, "train", 2)                               # home b's live job
    homes.up(homes.a, "old")                                    # home a's orphan ...
    homes.use(homes.a)
    open_env(UI(quiet=True)).state.delete_cluster("old")        # ... whose record was lost
    legacy = homes.a.provider(owner=f"{getpass.getuser()}@{socket.gethostname()}")  # older version
    req = homes.a.request(name="legacy", num_nodes=1)
    legacy.create_nodes(req, legacy.ensure_network(req))

    homes.use(homes.a)
    r = _invoke(homes, "gc", "--provider", "aws", "-y")
    assert r.exit_code == 0, r.output
    assert homes.running("train") == 2
    assert "another home's, left alone" in r.output and "train" in r.output
    assert "older cloudtrain without a home id, left alone" in r.output
    # a running instance is not terminated without --force; the exact command is shown
    assert homes.running("old") == 1
    assert "cloudtrain gc --provider aws --force -y" in r.output

    r = _invoke(homes, "gc", "--provider", "aws", "--force", "-y", "--json")
    assert r.exit_code == 0, r.output
    listed = json.loads(r.stdout[r.stdout.index("["):])
    assert {x["cluster"] for x in listed if x["removed"]} == {"old"}
    assert {x["left_alone"] for x in listed if x["cluster"] == "train"} == {"other-home"}
    assert homes.running("old") == 0
    assert homes.running("train") == 2 and homes.running("legacy") == 1

    r = _invoke(homes, "gc", "--provider", "aws", "--any-owner", "--json")   # the explicit widening
    assert {x["cluster"] for x in json.loads(r.stdout[r.stdout.index("["):])} >= \
        {"train", "legacy"}


def test_a_cluster_made_before_home_ids_is_still_found_by_down(homes: Homes) -> None:
    """A cluster this home created with an older version (owner tag user@host, provider
    record without the home-id mark) is torn down by ``down``, not forgotten."""
    from cloudtrain.ownership import RECORD_MARK

    homes.up(homes.a, "before", 1)
    rec = homes.a.home / "clusters" / "before" / "aws.json"
    # rewrite it as the old version had it: plain owner tags, no mark in the record
    from cloudtrain.ownership import base_owner
    raw = homes.a.clients.raw(REGION)
    ids = [i["InstanceId"] for i in homes.a.tagged(cluster="before")["instances"]]
    raw.create_tags(Resources=ids, Tags=[{"Key": "cloudtrain:owner", "Value": base_owner()}])
    data = json.loads(rec.read_text())
    data.pop(RECORD_MARK)
    rec.write_text(json.dumps(data))
    homes.use(homes.a)
    r = _invoke(homes, "down", "before", "-y")
    assert r.exit_code == 0, r.output
    assert homes.running("before") == 0


def test_gc_without_provider_looks_at_every_cloud_and_names_those_skipped(
        homes: Homes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Old behaviour: the first cloud without credentials ended gc with an error, and the
    clouds after it were never looked at."""
    for k in list(os.environ):
        if k.startswith(("AZURE_", "GOOGLE_", "CLOUDSDK_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "user-home"))     # no gcloud / az files
    homes.up(homes.a, "old")
    homes.use(homes.a)
    open_env(UI(quiet=True)).state.delete_cluster("old")
    r = _invoke(homes, "gc")
    assert r.exit_code == 0, r.output
    for cloud in ("azure", "gcp"):
        if cloud in registry.names():
            assert f"{cloud}: skipped, no credentials" in r.output
    assert "aws: 3 resource(s) tagged by cloudtrain" in r.output     # aws was still searched
    assert "(cluster old," in r.output


def test_state_db_is_not_touched_by_a_refused_name(cli: CLI) -> None:
    r = cli.run("status", timeout=60)
    assert r.returncode == 0
    db = cli.home / "state.db"
    before = sqlite3.connect(db).execute("SELECT count(*) FROM clusters").fetchone()
    r = cli.run("down", "--provider", "local", "-y", "--", "", timeout=60)
    assert r.returncode == 2
    assert sqlite3.connect(db).execute("SELECT count(*) FROM clusters").fetchone() == before
