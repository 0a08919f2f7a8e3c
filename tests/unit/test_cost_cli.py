"""``cloudtrain cost``: the real command line in a subprocess (CLOUDTRAIN_HOME=tmp, a small
user-local catalog so the numbers are known), plus an in-process run with fake cloud
providers for the "up would pick" mark and ``up --dry-run``. Nothing leaves loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cloudtrain.catalog.model import CatalogInfo, Offer
from cloudtrain.catalog.store import write_meta, write_offers
from cloudtrain.memfit import GIB
from cloudtrain.testing import MemoryProvider


def off(provider: str, itype: str, acc: str, count: float, mem: float, region: str,
        price: float, spot: float | None) -> Offer:
    return Offer(provider=provider, instance_type=itype, accelerator=acc, accelerator_count=count,
                 gpu_memory_gib=mem, vcpus=96, memory_gib=1152, region=region, price=price,
                 spot_price=spot)


OFFERS = [
    off("aws", "p4d.24xlarge", "A100", 8, 40, "us-east-1", 32.77, 12.0),
    off("aws", "p4de.24xlarge", "A100-80GB", 8, 80, "us-east-1", 40.97, 16.0),
    off("gcp", "a2-highgpu-8g", "A100", 8, 40, "us-central1", 29.39, 8.8),
    off("gcp", "a2-highgpu-4g", "A100", 4, 40, "us-central1", 14.69, 4.4),
    off("gcp", "a2-ultragpu-8g", "A100-80GB", 8, 80, "us-central1", 40.55, 12.1),
    off("azure", "Standard_ND96asr_v4", "A100", 8, 40, "eastus", 27.20, 3.0),
    off("aws", "g5.xlarge", "A10G", 1, 22.35, "us-east-1", 1.006, 0.45),
]
AS_OF = "2026-01-15"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    folder = h / "catalog"
    write_offers(folder / "gpu_offers.csv", OFFERS)
    write_meta(folder, CatalogInfo(kind="user", path=str(folder), as_of=AS_OF,
                                   source="test fixture", providers=("aws", "azure", "gcp")))
    return h


def write(tmp_path: Path, text: str, name: str = "task.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def cost(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update({"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1", "HOME": str(home.parent)})
    return subprocess.run([sys.executable, "-m", "cloudtrain", "cost", *args], capture_output=True,
                          text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


def created(home: Path) -> list[str]:
    """What a cost command must never leave behind."""
    return [str(p) for p in (home / "clusters", home / "state.db") if p.exists()]


A100_TASK = "name: big\nnum_nodes: 2\nresources:\n  accelerators: A100:8\nrun: echo hi\n"


def test_table_ranks_offers_and_names_the_pick_and_the_catalog(home: Path, tmp_path: Path) -> None:
    r = cost(home, str(write(tmp_path, A100_TASK)), "--hours", "10")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    rows = [w for w in map(str.split, out.splitlines())
            if len(w) > 5 and w[0].isdigit() and w[1] in ("aws", "gcp", "azure")]
    assert [(w[1], w[3]) for w in rows] == [("azure", "Standard_ND96asr_v4"),
                                            ("gcp", "a2-highgpu-8g"), ("aws", "p4d.24xlarge")]
    # azure: $27.20/h per node, $54.40/h for 2 nodes, $544.00 for 10 h, spot 2 x 3.00, saving 89%
    # its fabric (the NETWORK column): InfiniBand, 8 links of 200 Gb/s
    assert rows[0][5:7] == ["infiniband", "8x200G"]
    assert rows[0][7:] == ["27.20", "54.40", "544.00", "6.00", f"{100 * (1 - 3.0 / 27.2):.0f}%"]
    assert "A100:8 x 2 nodes, on-demand: 3 feasible offer(s)" in out
    # HOME has no credentials for any cloud: up would pick none, and says why
    assert "up would pick none" in out and ("no credentials" in out or "not installed" in out), out
    assert "1 offer: not 8 GPUs per node" in out
    assert f"Prices: user catalog as of {AS_OF}" in out
    assert created(home) == []


def test_json_is_a_stable_object_with_totals_spot_and_rejections(home: Path, tmp_path: Path) -> None:
    task = write(tmp_path, A100_TASK.replace("run:", "max_hours: 5\nrun:"))
    r = cost(home, str(task), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {"hours", "choice", "offers", "rejected", "catalog", "memory"} <= set(doc)
    assert doc["hours"] == 5                          # the task's max_hours
    assert [(o["provider"], o["rank"]) for o in doc["offers"]] == \
        [("azure", 1), ("gcp", 2), ("aws", 3)]
    gcp = doc["offers"][1]
    assert gcp["price_hourly_usd"] == 29.39 and gcp["cluster_hourly_usd"] == pytest.approx(58.78)
    assert gcp["node_hourly_usd"] == 29.39 and gcp["nodes"] == 2
    assert gcp["total_usd"] == pytest.approx(58.78 * 5)
    assert gcp["spot_price_hourly_usd"] == 8.8
    assert gcp["spot_cluster_hourly_usd"] == pytest.approx(17.6)
    assert gcp["spot_saving_pct"] == pytest.approx(100 * (1 - 8.8 / 29.39), abs=0.05)
    assert doc["choice"] is None and not any(o["up_would_pick"] for o in doc["offers"])
    assert "fits" not in gcp and "reason" not in gcp        # no --model-params
    assert {(j["constraint"], j["count"]) for j in doc["rejected"]} == {("gpu", 3), ("count", 1)}
    assert doc["catalog"]["kind"] == "user" and doc["catalog"]["as_of"] == AS_OF
    assert doc["memory"] is None
    assert set(doc["providers"]) == {"aws", "azure", "gcp"}


def test_budget_and_market_options(home: Path, tmp_path: Path) -> None:
    task = write(tmp_path, A100_TASK.replace("A100:8\n", "A100:8\n  max_hourly_cost: 55\n"))
    doc = json.loads(cost(home, str(task), "--json").stdout)
    assert [o["provider"] for o in doc["offers"]] == ["azure"]          # 54.40 <= 55 < 58.78
    assert any(j["constraint"] == "max_hourly_cost" and j["count"] == 2 for j in doc["rejected"])
    spot = json.loads(cost(home, str(task), "--json", "--spot", "--top", "2").stdout)
    assert [(o["provider"], o["cluster_hourly_usd"]) for o in spot["offers"]] == \
        [("azure", 6.0), ("gcp", 17.6)]
    assert spot["offers"][0]["price_hourly_usd"] == 27.20      # on-demand, as in the catalog


def test_memory_fit_keeps_offers_that_hold_the_model(home: Path, tmp_path: Path) -> None:
    # any 8-GPU node: 3e9 params, bf16 + AdamW (16 B/param), ddp -> 80 GiB GPUs only
    need = 3e9 * 16 / GIB * 1.2 + 1
    r = cost(home, str(write(tmp_path, A100_TASK)), "--json", "--accelerators", "any:8",
             "--model-params", "3e9")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    fits = [o for o in doc["offers"] if o["fits"]]
    assert [o["instance_type"] for o in fits] == ["a2-ultragpu-8g", "p4de.24xlarge"]
    # the offers that do not hold the model follow, cheapest first, each with why
    misfits = doc["offers"][len(fits):]
    assert [(o["instance_type"], o["fits"], o["rank"]) for o in misfits] == [
        ("Standard_ND96asr_v4", False, None), ("a2-highgpu-8g", False, None),
        ("p4d.24xlarge", False, None)]
    assert {o["reason"] for o in misfits} == \
        {f"40 GiB per GPU: 36 GiB usable < {need:.1f} GiB needed"}
    assert all("reason" not in o for o in fits)
    assert misfits[0]["cluster_hourly_usd"] == pytest.approx(54.40)
    mem = doc["memory"]
    assert mem["needed_gib"] == pytest.approx(need, abs=0.01)
    assert mem["bytes_per_param"] == {"weights": 6, "gradients": 2, "optimizer": 8}
    assert [(j["reason"], j["count"]) for j in doc["rejected"] if j["constraint"] == "memory"] == \
        [(f"40 GiB per GPU: 36 GiB usable < {need:.1f} GiB needed", 3)]
    # the table shows the arithmetic
    t = cost(home, str(write(tmp_path, A100_TASK)), "--accelerators", "any:8",
             "--model-params", "3B", "--strategy", "fsdp")
    assert t.returncode == 0, t.stderr
    assert "/ 16 GPUs (fsdp)" in t.stdout and "needed per GPU" in t.stdout


def test_nothing_fits_exits_2_with_the_nearest_relaxation(home: Path, tmp_path: Path) -> None:
    r = cost(home, str(write(tmp_path, A100_TASK)), "--model-params", "3e9")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: No offer fits A100:8 x 2 nodes")
    assert "A100-80GB:8 fits: $81.10/h on gcp" in r.stderr
    assert "Traceback" not in r.stderr and created(home) == []


def test_local_and_explicit_cloud_tasks(home: Path, tmp_path: Path) -> None:
    local = cost(home, str(write(tmp_path, "num_nodes: 2\nrun: echo hi\n")), "--hours", "3")
    assert local.returncode == 0, local.stderr
    assert "local: $0.00/h per node" in local.stdout and "no cloud price applies" in local.stdout
    doc = json.loads(cost(home, str(write(tmp_path, "run: echo hi\n")), "--json").stdout)
    assert doc["choice"]["provider"] == "local" and doc["choice"]["price_hourly_usd"] == 0
    assert doc["choice"]["cluster_hourly_usd"] == 0 and doc["choice"]["total_usd"] == 0
    assert doc["offers"] == [] and doc["catalog"] is None
    # a cloud whose provider is not installed can still be priced
    aws = write(tmp_path, A100_TASK.replace("resources:\n", "resources:\n  provider: aws\n"))
    d = json.loads(cost(home, str(aws), "--json").stdout)
    assert [o["provider"] for o in d["offers"]] == ["aws"]
    assert d["choice"]["instance_type"] == "p4d.24xlarge" and "names aws" in d["choice_note"]


# The JSON contract of `cost --json`: every offer has the catalog fields of `gpus --json` plus
# these; "fits" with --model-params, and "reason" where it does not fit.
COST_CONTRACT: dict[str, tuple[type, ...]] = {
    "nodes": (int,), "cluster_hourly_usd": (int, float), "total_usd": (int, float),
}


def assert_cost_offer(o: dict[str, Any], hours: float, with_fit: bool) -> None:
    from test_catalog import assert_offer_contract

    assert_offer_contract(o)
    for key, types in COST_CONTRACT.items():
        assert key in o and isinstance(o[key], types) and not isinstance(o[key], bool), (key, o)
    per = o["spot_price_hourly_usd"] if o["market"] == "spot" else o["price_hourly_usd"]
    assert o["cluster_hourly_usd"] == pytest.approx(per * o["nodes"], abs=1e-4)
    assert o["total_usd"] == pytest.approx(o["cluster_hourly_usd"] * hours, abs=0.01)
    if with_fit:
        assert isinstance(o["fits"], bool)
        assert ("reason" in o) == (not o["fits"])
        if not o["fits"]:
            assert isinstance(o["reason"], str) and o["reason"]
    else:
        assert "fits" not in o and "reason" not in o


def test_cost_json_contract(home: Path, tmp_path: Path) -> None:
    # A named provider: the choice is its cheapest offer, whatever is installed here.
    aws = write(tmp_path, A100_TASK.replace("A100:8", "any:8").replace(
        "resources:\n", "resources:\n  provider: aws\n"))
    r = cost(home, str(aws), "--json", "--hours", "4", "--model-params", "3e9")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {"offers", "choice"} <= set(doc) and isinstance(doc["offers"], list)
    for o in doc["offers"]:
        assert_cost_offer(o, 4, with_fit=True)
    assert [(o["instance_type"], o["fits"]) for o in doc["offers"]] == [
        ("p4de.24xlarge", True), ("p4d.24xlarge", False)]
    choice = doc["choice"]
    assert_cost_offer(choice, 4, with_fit=True)
    assert (choice["instance_type"], choice["nodes"], choice["fits"]) == ("p4de.24xlarge", 2, True)
    assert choice["cluster_hourly_usd"] == pytest.approx(2 * 40.97)
    assert choice["total_usd"] == pytest.approx(2 * 40.97 * 4, abs=0.01)
    # Without --model-params: no "fits", no "reason"; spot prices the spot market.
    plain = json.loads(cost(home, str(aws), "--json", "--spot").stdout)
    for o in plain["offers"] + [plain["choice"]]:
        assert_cost_offer(o, 1, with_fit=False)
    assert plain["choice"]["cluster_hourly_usd"] == pytest.approx(2 * 12.0)


def test_cost_json_when_nothing_fits_prints_the_object_and_exits_2(home: Path,
                                                                   tmp_path: Path) -> None:
    need = 3e9 * 16 / GIB * 1.2 + 1
    r = cost(home, str(write(tmp_path, A100_TASK)), "--json", "--model-params", "3e9",
             "--hours", "2")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: No offer fits A100:8 x 2 nodes")
    doc = json.loads(r.stdout)
    assert doc["choice"] is None and doc["feasible"] == 0
    assert [(o["provider"], o["fits"]) for o in doc["offers"]] == \
        [("azure", False), ("gcp", False), ("aws", False)]
    for o in doc["offers"]:
        assert_cost_offer(o, 2, with_fit=True)
        assert o["reason"] == f"40 GiB per GPU: 36 GiB usable < {need:.1f} GiB needed"
    assert any("A100-80GB:8 fits" in x for x in doc["suggestions"])
    assert doc["error"].startswith("No offer fits") and doc["memory"]["needed_gib"] == \
        pytest.approx(need, abs=0.01)
    # Nothing feasible for another reason: the object too, with no offers and choice null.
    capped = write(tmp_path, A100_TASK.replace("A100:8\n", "A100:8\n  max_hourly_cost: 10\n"))
    r = cost(home, str(capped), "--json")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["choice"] is None and doc["offers"] == []
    assert any(j["constraint"] == "max_hourly_cost" for j in doc["rejected"])
    assert created(home) == []


BAD: list[tuple[str, str, list[str], str]] = [
    ("missing-task", "", ["--hours", "1"], "does not exist"),
    ("unknown-gpu", A100_TASK.replace("A100:8", "A1000:8"), [], "unknown GPU 'A1000'"),
    ("negative-hours", A100_TASK, ["--hours", "-1"], "--hours"),
    ("zero-hours", A100_TASK, ["--hours", "0"], "--hours"),
    ("bad-params", A100_TASK, ["--model-params", "lots"], "--model-params"),
    ("bad-top", A100_TASK, ["--top", "0"], "--top"),
    ("bad-accelerators", A100_TASK, ["--accelerators", "A100:x"], "--accelerators"),
    ("bad-task-field", "resources:\n  acelerators: A100:8\nrun: x\n", [], "accelerators"),
    ("unknown-provider", "resources:\n  provider: awz\n  accelerators: A100:8\nrun: x\n", [],
     "awz"),
    ("cap-too-low", A100_TASK.replace("A100:8\n", "A100:8\n  max_hourly_cost: 10\n"), [],
     "cheapest without max_hourly_cost: $54.40/h on azure"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_exits_2_with_one_paragraph(case: Any, home: Path, tmp_path: Path) -> None:
    _, text, args, says = case
    task = tmp_path / "absent.yaml" if not text else write(tmp_path, text)
    r = cost(home, str(task), *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) <= 2
    assert created(home) == []


# --- in process, with fake clouds: what up would pick -----------------------------------------

@pytest.fixture
def fake_clouds(home: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, MemoryProvider]:
    """aws and gcp stand-ins, handed to the command line as its context object."""
    from test_planner import CRED_VARS

    for v in CRED_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HOME", str(home.parent))
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(home))
    monkeypatch.setenv("NO_COLOR", "1")
    return {"aws": MemoryProvider.named("aws"), "gcp": MemoryProvider.named("gcp")}


def _invoke(providers: dict[str, MemoryProvider], *args: str) -> Any:
    from click.testing import CliRunner

    from cloudtrain.commands.main import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False, obj=providers)


def test_pick_is_the_cheapest_offer_on_a_cloud_with_credentials(
        fake_clouds: dict[str, MemoryProvider], home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    task = write(tmp_path, A100_TASK)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    r = _invoke(fake_clouds, "cost", str(task), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    # azure (cheapest) is not installed, gcp has no credentials: up would take aws, rank 3
    assert [o["up_would_pick"] for o in doc["offers"]] == [False, False, True]
    assert doc["choice"]["provider"] == "aws" and doc["choice"]["rank"] == 3
    assert doc["choice"] == doc["offers"][2]
    assert doc["providers"]["gcp"] == {"usable": False, "why_not": "no credentials found"}

    table = _invoke(fake_clouds, "cost", str(task))
    marked = [ln for ln in table.stdout.splitlines() if ln.startswith("*")]
    assert len(marked) == 1 and "p4d.24xlarge" in marked[0]
    assert "up would pick (*): aws p4d.24xlarge in us-east-1, $65.54/h" in table.stdout

    dry = _invoke(fake_clouds, "up", "--dry-run", str(task))
    assert dry.exit_code == 0, dry.output
    text = dry.output
    assert "provider     aws" in text and "instance     p4d.24xlarge" in text
    assert "$32.77/h per node, $65.54/h for the cluster" in text
    assert "picked by the planner" in text
    assert not (home / "clusters").exists() or not any((home / "clusters").iterdir())


CLOUD_OPTIONS = [
    ("aws", "efa: maybe", "resources.aws.efa"),
    ("aws", "vpcid: vpc-1", "resources.aws.vpcid"),
    ("gcp", "public_ip: [1]", "resources.gcp.public_ip"),
    ("gcp", "projcet: x", "resources.gcp.projcet"),
    ("azure", "host_key_wait: soon", "resources.azure.host_key_wait"),
    ("azure", "sizes: [a]", "resources.azure.sizes"),
]


@pytest.mark.parametrize("cloud,option,field", CLOUD_OPTIONS,
                         ids=[f"{c}-{o.split(':')[0]}" for c, o, _ in CLOUD_OPTIONS])
def test_cost_refuses_cloud_options_as_up_does(cloud: str, option: str, field: str, home: Path,
                                               tmp_path: Path) -> None:
    """A wrong type or an unknown field under resources.aws/gcp/azure: cost exits 2 naming
    the field, exactly as 'up --dry-run' does (cost used to price the task and exit 0)."""
    task = write(tmp_path, f"resources:\n  provider: {cloud}\n  accelerators: A100:8\n"
                           f"  {cloud}: {{{option}}}\nrun: echo hi\n")
    env = dict(os.environ, CLOUDTRAIN_HOME=str(home), NO_COLOR="1", HOME=str(home.parent))
    up = subprocess.run([sys.executable, "-m", "cloudtrain", "up", "--dry-run", str(task)],
                        capture_output=True, text=True, timeout=60, env=env,
                        stdin=subprocess.DEVNULL)
    r = cost(home, str(task))
    for got in (up, r):
        assert got.returncode == 2, got.stdout + got.stderr
        assert f"field '{field}'" in got.stderr, got.stderr
        assert got.stderr.startswith("error: ") and "Traceback" not in got.stderr
        assert got.stdout == "" and len(got.stderr.strip().splitlines()) <= 2
    assert r.stderr == up.stderr
    assert created(home) == []
