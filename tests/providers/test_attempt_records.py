"""``up --json`` shows the same attempt records on every cloud. Through the real CLI, on AWS
(a moto server), GCP (the GCE fake) and Azure (the ARM fake), each reached as in its own
end-to-end test (local sshd nodes reached through the tests' ssh_proxy: nothing ever connects to an address a
fake invented), with a capacity failure injected in the first zone: each cloud's attempts are
the capacity one, then the ok one in the next zone, with the same keys everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from conftest import needs_sshd

pytestmark = [needs_sshd, pytest.mark.e2e]

KEYS = ["provider", "region", "zone", "instance_type", "outcome", "code", "message", "at"]


def _borrowed(fixture: Any, *args: Any) -> Iterator[Any]:
    """Run another test module's generator fixture (its set-up and clean-up) from here."""
    gen = fixture.__wrapped__(*args)
    try:
        yield next(gen)
    finally:
        next(gen, None)


def _cloudtrain(env: dict[str, str], *args: str, timeout: float = 300
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cloudtrain", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _up_json(env: dict[str, str], task_file: Path, text: str,
             use: Callable[[Path], Path]) -> dict[str, Any]:
    """``up --json`` of the task ``text``, reaching the stand-in nodes as ``use`` says."""
    task_file.write_text(text)
    use(task_file)
    try:
        r = _cloudtrain(env, "up", str(task_file), "--json", "--no-bootstrap", "-y")
        assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
        return dict(json.loads(r.stdout))
    finally:
        _cloudtrain(env, "down", "-a", "-y")


def _aws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    pytest.importorskip("moto")
    import test_aws_cli as aws
    from aws_moto import FAIL_RUN_ENV

    monkeypatch.setenv(FAIL_RUN_ENV, "us-east-1a=InsufficientInstanceCapacity")
    guarded = aws.guarded.__wrapped__(tmp_path)
    server = _borrowed(aws.moto_server, tmp_path)
    endpoint = next(server)
    map_file = tmp_path / "proxy-map.json"
    env = {**guarded, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    nodes = aws.LocalNodes(tmp_path / "nodes")
    nodes.start()
    stop = threading.Event()
    mapper = threading.Thread(target=aws._map_when_running, daemon=True,
                              args=(aws._moto(endpoint), nodes, "rec", map_file, {}, stop))
    mapper.start()
    try:
        yield _up_json(env, tmp_path / "task.yaml", (
            "name: rec\nnum_nodes: 2\nrun: 'true'\nresources:\n  provider: aws\n"
            "  region: us-east-1\n  instance_type: g4dn.xlarge\n  ssh_cidr: 127.0.0.1/32\n"
            "  aws: {host_key_wait: 0}\n"), lambda t: aws.aws_task(t, map_file, nodes))
    finally:
        stop.set()
        nodes.stop()
        next(server, None)


def _gcp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    pytest.importorskip("google.cloud.compute_v1")
    import test_gcp_e2e as gcp

    world = _borrowed(gcp.world, tmp_path)
    cli, extra, fake, nodes, _ = next(world)
    fake.fail_operation("ZONE_RESOURCE_POOL_EXHAUSTED", zone="us-central1-a")
    try:
        yield _up_json(cli.env(**extra), tmp_path / "task.yaml", (
            "name: rec\nnum_nodes: 2\nrun: 'true'\nresources:\n  provider: gcp\n"
            "  region: us-central1\n  accelerators: T4:1\n  ssh_cidr: 198.51.100.7/32\n"),
            nodes.use)
    finally:
        next(world, None)


def _azure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    pytest.importorskip("azure.mgmt.compute")
    import test_azure_e2e as az

    world = _borrowed(az.world, tmp_path)
    fake, nodes, _, env = next(world)
    fake.fail("PUT", "virtualmachines", "ZonalAllocationFailed", mode="async", times=None,
              when=lambda r: r.zone == "1")
    try:
        yield _up_json(env, tmp_path / "task.yaml", (
            "name: rec\nnum_nodes: 2\nrun: 'true'\nresources:\n  provider: azure\n"
            "  region: eastus\n  instance_type: Standard_NC4as_T4_v3\n"
            "  ssh_cidr: 127.0.0.1/32\n"), nodes.use)
    finally:
        next(world, None)


CLOUDS: dict[str, tuple[Callable[..., Iterator[dict[str, Any]]], str, str]] = {
    # cloud: (its run, the zone that has no capacity, the zone that has)
    "aws": (_aws, "us-east-1a", "us-east-1b"),
    "gcp": (_gcp, "us-central1-a", "us-central1-b"),
    "azure": (_azure, "1", "2"),
}


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    return {}


@pytest.mark.parametrize("cloud", list(CLOUDS))
def test_up_json_records_the_capacity_attempt_then_the_ok_one(
        cloud: str, docs: dict[str, dict[str, Any]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, full, free = CLOUDS[cloud]
    doc = _recorded(cloud, tmp_path, monkeypatch)
    assert doc["ok"] is True and doc["provider"] == cloud and len(doc["nodes"]) == 2
    attempts = doc["attempts"]
    assert [(a["provider"], a["zone"], a["outcome"]) for a in attempts] == [
        (cloud, full, "capacity"), (cloud, free, "ok")], attempts
    assert all(list(a) == KEYS for a in attempts), attempts
    assert attempts[0]["code"] in ("InsufficientInstanceCapacity",
                                   "ZONE_RESOURCE_POOL_EXHAUSTED", "ZonalAllocationFailed")
    assert attempts[0]["instance_type"] == attempts[1]["instance_type"] == doc["instance_type"]
    docs[cloud] = doc


def _recorded(cloud: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``up --json``'s document on ``cloud`` whose first zone is full."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    gen = CLOUDS[cloud][0](tmp_path, monkeypatch)
    try:
        return next(gen)
    finally:
        next(gen, None)


def test_every_cloud_has_the_same_attempt_fields(docs: dict[str, dict[str, Any]], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The clouds the tests above did not record in this process (pytest-xdist spreads them
    # over workers, or one was deselected) are run here.
    for cloud in CLOUDS:
        if cloud not in docs:
            with monkeypatch.context() as m:
                docs[cloud] = _recorded(cloud, tmp_path / cloud, m)
    shapes = {cloud: {tuple(a) for a in doc["attempts"]} for cloud, doc in docs.items()}
    assert len({frozenset(s) for s in shapes.values()}) == 1, shapes


def test_the_record_file_reads_back_as_a_frozen_record(tmp_path: Path) -> None:
    """The cloud record file crosses a boundary (written by one run, read by the next): it is
    read as a frozen CloudRecord, attempts as Attempt records, the cloud's own keys kept as
    written, and ``as_dict()`` is the JSON the file holds; an Azure record written before the
    fields were the same everywhere (``size``) reads with ``instance_type``."""
    import dataclasses

    from cloudtrain.provider import ProviderContext
    from cloudtrain.provider.failover import Attempt
    from cloudtrain.provider.record import CloudRecord, ClusterRecord

    records = ClusterRecord(ProviderContext(tmp_path), "azure")
    tried = Attempt("eastus", "1", "Standard_NC24ads_A100_v4", "capacity",
                    "ZonalAllocationFailed", "no room", "2026-01-01T00:00:00Z")
    records.update("c", {"subscription_id": "sub"}, attempts=[tried.as_dict()], num_nodes=2,
                   size="Standard_NC24ads_A100_v4", user="azureuser", public_ip=False)
    note = records.note("c")
    assert note.attempts == (tried,) and note.num_nodes == 2 and note.user == "azureuser"
    assert note.instance_type == "Standard_NC24ads_A100_v4" and note.public_ip is False
    assert note.own["subscription_id"] == "sub" and "attempts" not in note.own
    with pytest.raises(dataclasses.FrozenInstanceError):
        note.user = "root"  # type: ignore[misc]
    again = CloudRecord.from_dict(json.loads(json.dumps(note.as_dict())))
    assert again == note
    assert records.note("missing") == CloudRecord()
