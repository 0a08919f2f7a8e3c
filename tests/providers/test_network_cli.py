"""``resources.network`` where the user meets it: ``up --dry-run`` (the plan's network row),
``cost`` (the NETWORK column, and the offers ``network: fast`` allows), and the refusal of
``network: fast`` on a type without a fast network (exit 2, nothing created, no cloud asked:
the endpoints point where nothing listens)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from cloudtrain.provider.fabric import fabric_of, with_fabric
from conftest import CLI

TASK = """name: fab
num_nodes: {nodes}
resources:
  provider: {provider}
  region: {region}
  instance_type: {itype}
  ssh_cidr: 127.0.0.1/32
{extra}run: echo hi
"""


def _dead_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _env() -> dict[str, str]:
    dead = _dead_port()
    return {"AWS_ENDPOINT_URL": dead, "AWS_ACCESS_KEY_ID": "unused",
            "AWS_SECRET_ACCESS_KEY": "unused", "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true", "CLOUDTRAIN_GCP_API_ENDPOINT": dead,
            "NO_COLOR": "1"}


def _task(tmp_path: Path, provider: str, region: str, itype: str, nodes: int = 2,
          extra: str = "") -> Path:
    p = tmp_path / f"{provider}-{itype}.yaml"
    p.write_text(TASK.format(provider=provider, region=region, itype=itype, nodes=nodes,
                             extra=extra))
    return p


@pytest.mark.parametrize("provider,region,itype,row", [
    ("aws", "us-east-1", "p4d.24xlarge", "fast: EFA 4x100 Gb/s (400 Gb/s)"),
    ("aws", "us-east-1", "p5.48xlarge", "fast: EFA 32x100 Gb/s (3200 Gb/s)"),
    ("gcp", "us-central1", "a3-highgpu-8g", "fast: GPUDirect-TCPX 4x200 Gb/s (800 Gb/s)"),
    ("gcp", "us-central1", "a3-megagpu-8g", "fast: GPUDirect-TCPXO 8x200 Gb/s (1600 Gb/s)"),
    ("azure", "eastus", "Standard_ND96isr_H100_v5", "fast: InfiniBand 8x400 Gb/s (3200 Gb/s)"),
    ("azure", "eastus", "Standard_ND96asr_v4", "fast: InfiniBand 8x200 Gb/s (1600 Gb/s)"),
    ("aws", "us-east-1", "g4dn.xlarge", "plain (the instance type has no fast network)"),
])
def test_dry_run_shows_the_network(cli: CLI, tmp_path: Path, provider: str, region: str,
                                   itype: str, row: str) -> None:
    r = cli.run("up", str(_task(tmp_path, provider, region, itype)), "--dry-run", **_env())
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"  network      {row}" in r.stdout + r.stderr
    # what GCP's GPUDirect needs that cloudtrain does not set up is said in the plan
    assert ("receive-datapath daemon" in r.stdout + r.stderr) == ("GPUDirect" in row)


def test_dry_run_one_node_and_plain_say_why_not_fast(cli: CLI, tmp_path: Path) -> None:
    one = cli.run("up", str(_task(tmp_path, "aws", "us-east-1", "p4d.24xlarge", nodes=1)),
                  "--dry-run", **_env())
    assert "network      plain (one node; the type has EFA 4x100 Gb/s" in one.stdout + one.stderr
    plain = cli.run("up", str(_task(tmp_path, "gcp", "us-central1", "a3-highgpu-8g",
                                    extra="  network: plain\n")), "--dry-run", **_env())
    assert "network      plain (resources.network: plain" in plain.stdout + plain.stderr


@pytest.mark.parametrize("provider,region,itype", [
    ("aws", "us-east-1", "g4dn.xlarge"), ("gcp", "us-central1", "a2-highgpu-8g"),
    ("azure", "eastus", "Standard_NC24ads_A100_v4")])
def test_fast_on_a_type_without_one_is_refused_and_nothing_is_made(
        cli: CLI, tmp_path: Path, provider: str, region: str, itype: str) -> None:
    task = _task(tmp_path, provider, region, itype, extra="  network: fast\n")
    for args in (("--dry-run",), ("-y",)):
        r = cli.run("up", str(task), *args, **_env())
        assert r.returncode == 2, r.stderr + r.stdout
        assert "Traceback" not in r.stderr
        assert "resources.network: fast" in r.stderr and itype in r.stderr
        assert ", ".join(with_fabric(provider)) in r.stderr   # the types that have one
    assert json.loads(cli.run("status", "--json").stdout) == []


def test_cost_shows_the_network_and_fast_keeps_only_fabric_types(cli: CLI,
                                                                 tmp_path: Path) -> None:
    task = tmp_path / "t.yaml"
    task.write_text("name: c\nnum_nodes: 2\nresources:\n  accelerators: A100:8\nrun: echo\n")
    doc = json.loads(cli.run("cost", str(task), "--json").stdout)
    nets = {(o["provider"], o["instance_type"]): o["network"] for o in doc["offers"]}
    assert any(v is None for v in nets.values()) and any(v for v in nets.values())
    for (prov, itype), net in nets.items():
        fab = fabric_of(prov, itype)
        assert net == (fab.to_dict() if fab else None)
    table = cli.run("cost", str(task), "--top", "50", **_env())
    assert "NETWORK" in table.stdout and "efa 4x100G" in table.stdout
    fast = tmp_path / "f.yaml"
    fast.write_text(task.read_text().replace("  accelerators", "  network: fast\n  accelerators"))
    doc = json.loads(cli.run("cost", str(fast), "--json").stdout)
    assert doc["offers"] and all(o["network"] for o in doc["offers"])
    assert {o["instance_type"] for o in doc["offers"]} <= {
        "p4d.24xlarge", "Standard_ND96asr_v4"}


def test_fast_on_a_provider_that_sets_no_fabric_up_is_refused(cli: CLI, tmp_path: Path) -> None:
    task = tmp_path / "local.yaml"
    task.write_text("name: l\nnum_nodes: 2\nresources:\n  provider: local\n  network: fast\n"
                    "run: echo hi\n")
    r = cli.run("up", str(task), "--dry-run")
    assert r.returncode == 2 and "resources.network: fast" in r.stderr, r.stderr
    assert "the local provider sets no fast network up" in r.stderr
    (tmp_path / "plain.yaml").write_text(task.read_text().replace("fast", "plain"))
    assert cli.run("up", str(tmp_path / "plain.yaml"), "--dry-run").returncode == 0
