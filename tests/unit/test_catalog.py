"""The GPU offer catalog: the shipped snapshot and its provenance, the documented overrides
(each pinned here), the sanity rules, user-local vs snapshot, ``catalog info`` and ``gpus``.

Expectations are computed from the raw snapshot CSV with the csv module, independently of the
loader. No network: the CLI runs offline against files in the package and in a temp home."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cloudtrain.catalog import load as L
from cloudtrain.catalog.gpus import canonical_gpu, suggest_gpu
from cloudtrain.catalog.model import CatalogInfo, Offer
from cloudtrain.catalog.store import write_meta, write_offers

REPO = Path(__file__).resolve().parents[2]
SNAP = REPO / "cloudtrain" / "catalog" / "snapshot"
SOURCE = REPO.parent / "shared" / "catalog"

pytestmark = pytest.mark.timeout(120)


def _raw() -> list[dict[str, str]]:
    with (SNAP / "gpu_offers.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _f(v: str) -> float | None:
    return float(v) if v else None


@pytest.fixture(autouse=True)
def _fresh_cache():  # type: ignore[no-untyped-def]
    L.clear_cache()
    yield
    L.clear_cache()


@pytest.fixture(scope="module")
def snap() -> L.Catalog:
    L.clear_cache()
    return L.load_catalog(None)


def _one(cat: L.Catalog, provider: str, instance_type: str, region: str) -> Offer:
    found = [o for o in cat.offers if (o.provider, o.instance_type, o.region)
             == (provider, instance_type, region)]
    assert len(found) == 1, found
    return found[0]


def _run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CLOUDTRAIN_HOME=str(home), NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "cloudtrain", *args], capture_output=True,
                          text=True, timeout=60, env=env, cwd=home)


def _user_catalog(home: Path, offers: list[Offer], as_of: str) -> Path:
    folder = home / "catalog"
    write_offers(folder / "gpu_offers.csv", offers)
    write_meta(folder, CatalogInfo(kind="user", path=str(folder), as_of=as_of,
                                   source="test refresh", providers=("aws", "azure")))
    return folder


def _days_ago(n: float) -> str:
    return (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=n)).isoformat(timespec="seconds")


def _offer(**kw: object) -> Offer:
    base: dict[str, object] = dict(provider="aws", instance_type="p4d.24xlarge", accelerator="A100",
                                   accelerator_count=8.0, gpu_memory_gib=40.0, vcpus=96.0,
                                   memory_gib=1152.0, region="us-east-1", zones=("use1-az1",),
                                   price=20.0, spot_price=8.0, arch="x86_64")
    base.update(kw)
    return Offer(**base)  # type: ignore[arg-type]


# --- the snapshot ---------------------------------------------------------------------------

def test_snapshot_loads_offline_with_provenance(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*a: object, **k: object) -> None:
        raise AssertionError("the catalog must load without the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    cat = L.load_catalog(None)
    assert cat.info.kind == "snapshot" and Path(cat.info.path) == SNAP
    assert cat.info.providers == ("aws", "azure", "gcp")
    assert set(cat.per_provider()) == {"aws", "azure", "gcp"} and len(cat.offers) > 1000
    assert L.parse_as_of(cat.info.as_of) is not None and cat.age_days() is not None
    assert "skypilot-catalog" in cat.info.source and "Apache-2.0" in cat.info.source
    assert "unknown" in cat.note   # the upstream price date is unknown, and says so
    prov = (SNAP / "PROVENANCE.md").read_text()
    for commit in ("e385a0d348eda9cefd9806423e7725944dc249e4",
                   "8427bbff988abdd050a9f51addd314ef31cb4e85",
                   "098741e70562f65d7af1cceb81e33b284f742604"):
        assert commit in prov
    assert "catalogs/v6/azure/vms.csv" in prov and "Apache-2.0" in prov
    assert "n1-standard" in prov and "tools/build_catalog.py" in prov


def test_snapshot_loads_fast() -> None:
    times = []
    for _ in range(3):
        L.clear_cache()
        t = time.perf_counter()
        L.load_catalog(None)
        times.append(time.perf_counter() - t)
    # ~20 ms on an idle machine; the bound leaves room for a busy CI box.
    assert min(times) < 0.25, times
    t = time.perf_counter()
    assert L.load_catalog(None) is L.load_catalog(None)   # cached per process
    assert time.perf_counter() - t < 0.01


def test_overrides_json_matches_yaml() -> None:
    """overrides.json is the fast path for overrides.yaml and is used only while in sync;
    a stale one would silently fall back to the YAML (slower), so keep them in sync."""
    import hashlib

    compiled = json.loads((SNAP / "overrides.json").read_text())
    yaml_path = SNAP / "overrides.yaml"
    assert compiled["yaml_sha256"] == hashlib.sha256(yaml_path.read_bytes()).hexdigest()
    assert L.overrides_from_doc(compiled["doc"]) == L.parse_overrides(yaml_path.read_text())


def test_every_override_applies_to_the_snapshot(snap: L.Catalog) -> None:
    ids = [ov.id for ov in L.load_overrides()]
    assert len(ids) == len(set(ids))
    applied = {line.split(":")[0] for line in snap.info.corrections}
    assert set(ids) <= applied, set(ids) - applied


@pytest.mark.skipif(not (SOURCE / "gpu_offers.csv").is_file(), reason="../shared/catalog absent")
def test_snapshot_is_what_the_build_produces() -> None:
    r = subprocess.run([sys.executable, str(REPO / "tools" / "build_catalog.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_gcp_n1_attachables_are_real_offers(snap: L.Catalog) -> None:
    gcp = [o for o in snap.offers if o.provider == "gcp"]
    assert all(o.instance_type for o in gcp)
    t4 = snap.find("T4", 1, provider="gcp", region="us-central1")
    assert len(t4) == 1
    o = t4[0]
    assert o.instance_type == o.host_type == "n1-standard-8" and o.vcpus == 8
    hosts = {(r["instance_type"], r["region"]): r for r in csv.DictReader(
        (SOURCE / "gcp_n1_standard_hosts.csv").open())} if SOURCE.is_dir() else {}
    if hosts:
        gpu = 0.35   # T4 in us-central1, ../shared/catalog/gpu_offers.csv
        host = 4 * float(hosts[("n1-standard-2", "us-central1")]["price_hourly_usd"])
        assert o.price == pytest.approx(host + gpu, abs=1e-4)
    assert snap.find("V100", 8, provider="gcp")[0].instance_type == "n1-standard-32"


# --- each override, pinned ------------------------------------------------------------------

def test_azure_nd96isr_h100_v5_has_8_gpus(snap: L.Catalog) -> None:
    raw = [r for r in _raw() if r["instance_type"] == "Standard_ND96isr_H100_v5"]
    assert raw and all(r["accelerator_count"] == "12" for r in raw)   # the source's fault
    nd = [o for o in snap.offers if o.instance_type == "Standard_ND96isr_H100_v5"]
    assert len(nd) == len(raw) and all(o.accelerator_count == 8 for o in nd)
    assert all(o.gpu_memory_gib == 80 for o in nd)
    assert any(o.instance_type == "Standard_ND96isr_H100_v5"
               for o in snap.find("H100", 8, provider="azure"))
    nc = [o for o in snap.offers if o.instance_type == "Standard_NC40ads_H100_v5"]
    assert nc and all(o.gpu_memory_gib == 94 for o in nc)


def test_gcp_h100x8_us_central1_is_at_the_consistent_level(snap: L.Catalog) -> None:
    raw = {r["region"]: float(r["price"]) for r in _raw()
           if r["instance_type"] == "a3-highgpu-8g" and r["price"]}
    lo = min(raw.values())
    high = [p for p in raw.values() if p > 1.5 * lo]       # the other level, from the data
    assert raw["us-central1"] == lo and len(high) >= 5      # the fault is in the source
    got = _one(snap, "gcp", "a3-highgpu-8g", "us-central1").price
    assert got is not None and min(high) * 0.9 <= got <= max(high) * 1.1
    # every region now sits on one level, for H100 and A100 alike
    for it in ("a3-highgpu-8g", "a3-highgpu-1g", "a2-highgpu-8g", "a2-highgpu-1g",
               "a3-megagpu-8g", "a3-ultragpu-8g", "a2-ultragpu-8g"):
        prices = [o.price for o in snap.offers if o.instance_type == it and o.price]
        assert max(prices) / min(prices) < 1.6, (it, min(prices), max(prices))
    # the corrected 8 x H100 on GCP costs more than AWS's p5 (as it did in the high regions)
    assert got > snap.find("H100", 8, provider="aws")[0].price  # type: ignore[operator]


def test_gcp_a100_80gb_no_longer_cheaper_than_a100_40gb(snap: L.Catalog) -> None:
    for region in ("us-central1",):
        a40 = _one(snap, "gcp", "a2-highgpu-1g", region).price
        a80 = _one(snap, "gcp", "a2-ultragpu-1g", region).price
        assert a40 is not None and a80 is not None and a80 > a40


def test_spot_above_on_demand_is_dropped(snap: L.Catalog) -> None:
    rows = [r for r in _raw() if r["provider"] == "aws" and r["price"] and r["spot_price"]
            and float(r["spot_price"]) > float(r["price"])]
    assert rows
    for r in rows:
        o = _one(snap, "aws", r["instance_type"], r["region"])
        assert o.spot_price is None and o.price == float(r["price"])
        assert o not in snap.find(o.accelerator, spot=True)
    # spot equal to on-demand (Azure H100 v5) is no saving either
    nc = _one(snap, "azure", "Standard_NC40ads_H100_v5", "eastus")
    assert nc.price and nc.spot_price is None
    assert all(o.spot_price is None or o.spot_price < o.price
               for o in snap.offers if o.price is not None)
    assert any("spot-not-below-on-demand" in c for c in snap.info.corrections)


def test_missing_on_demand_is_spot_only(snap: L.Catalog) -> None:
    rows = [r for r in _raw() if not r["price"] and r["spot_price"]]
    assert rows   # p5e.48xlarge in the source
    for r in rows:
        o = _one(snap, r["provider"], r["instance_type"], r["region"])
        assert o.price is None and o.spot_price == float(r["spot_price"])
        assert o not in snap.find(o.accelerator, o.accelerator_count)
        assert o in snap.find(o.accelerator, o.accelerator_count, spot=True)
    none = [r for r in _raw() if not r["price"] and not r["spot_price"]]
    assert none and not any((o.provider, o.instance_type, o.region)
                            == (r["provider"], r["instance_type"], r["region"])
                            for r in none for o in snap.offers)


def test_every_offer_is_sane(snap: L.Catalog) -> None:
    from cloudtrain.catalog.gpus import gpu_info

    keys = set()
    for o in snap.offers:
        assert o.price is None or o.price > 0
        assert o.spot_price is None or o.spot_price > 0
        assert o.price is not None or o.spot_price is not None
        info = gpu_info(o.accelerator or "")
        assert info is not None and o.accelerator == info.name, o
        assert o.accelerator_count in info.counts, o
        assert o.gpu_memory_gib is not None
        full = o.gpu_memory_gib / min(o.accelerator_count, 1)
        assert info.memory_range[0] <= full <= info.memory_range[1], o
        key = (o.provider, o.instance_type, o.region, o.accelerator, o.accelerator_count)
        assert key not in keys
        keys.add(key)


# --- find / names ---------------------------------------------------------------------------

def test_canonical_gpu_names() -> None:
    assert canonical_gpu("A100-40GB") == "A100"
    assert canonical_gpu("a100") == "A100"
    assert canonical_gpu("H100-SXM") == "H100"
    assert canonical_gpu("nvidia h100 80gb") == "H100"
    assert canonical_gpu("a100_80gb") == "A100-80GB"
    assert canonical_gpu("t4G") == "T4g"
    assert canonical_gpu("radeon pro v520") == "Radeon Pro V520"
    assert canonical_gpu("RTX4090") is None and canonical_gpu("") is None
    assert suggest_gpu("A1000") == "A100"
    assert L.canonical_gpu is canonical_gpu


def test_find_filters_and_order(snap: L.Catalog) -> None:
    res = snap.find("a100-40gb", 8, provider="AWS", region="US-EAST-1")
    assert res and all(o.accelerator == "A100" and o.accelerator_count == 8
                       and o.region == "us-east-1" for o in res)
    spot = snap.find("H100", spot=True)
    prices = [o.spot_price or 0.0 for o in spot]
    assert prices == sorted(prices)
    assert all(o.spot_price is not None for o in spot)
    assert snap.find(instance_type="P5.48XLARGE") and \
        {o.instance_type for o in snap.find(instance_type="p5.48xlarge")} == {"p5.48xlarge"}
    assert snap.find("A100", 3) == []


# --- user-local catalogs --------------------------------------------------------------------

def test_sanity_rules_on_a_user_local_catalog(tmp_path: Path) -> None:
    offers = [
        _offer(),                                                       # fine
        _offer(region="us-west-2", price=10.0, spot_price=12.0),        # spot above on-demand
        _offer(region="eu-west-1", price=None, spot_price=9.0),         # spot-only
        _offer(region="eu-west-2", price=-1.0, spot_price=7.0),         # price <= 0 -> spot-only
        _offer(region="eu-west-3", price=None, spot_price=None),        # no price at all
        _offer(region="ap-south-1", accelerator_count=3.0),             # no such GPU count
        _offer(region="ap-south-2", gpu_memory_gib=40960.0),            # MiB, not GiB
        _offer(region="ap-south-2", gpu_memory_gib=40960.0, price=99.0),  # duplicate
        _offer(region="sa-east-1", accelerator="a100-40gb"),            # alias name
        _offer(instance_type="dl1.24xlarge", accelerator="Gaudi", gpu_memory_gib=32.0),
        _offer(provider="azure", instance_type="Standard_ND96isr_H100_v5", accelerator="H100",
               accelerator_count=12.0, gpu_memory_gib=None, region="eastus", price=98.32,
               spot_price=30.0),                                        # override applies too
    ]
    _user_catalog(tmp_path, offers, _days_ago(3))
    cat = L.load_catalog(tmp_path)
    assert cat.info.kind == "user" and cat.info.source == "test refresh" and not cat.warnings
    by = {(o.provider, o.instance_type, o.region): o for o in cat.offers}
    assert by[("aws", "p4d.24xlarge", "us-west-2")].spot_price is None
    assert by[("aws", "p4d.24xlarge", "eu-west-1")].price is None
    eu2 = by[("aws", "p4d.24xlarge", "eu-west-2")]
    assert eu2.price is None and eu2.spot_price == 7.0
    assert ("aws", "p4d.24xlarge", "eu-west-3") not in by
    assert ("aws", "p4d.24xlarge", "ap-south-1") not in by
    ap2 = by[("aws", "p4d.24xlarge", "ap-south-2")]
    assert ap2.gpu_memory_gib == 40 and ap2.price == 20.0     # first row kept, memory fixed
    assert by[("aws", "p4d.24xlarge", "sa-east-1")].accelerator == "A100"
    assert by[("aws", "dl1.24xlarge", "us-east-1")].accelerator == "Gaudi"
    nd = by[("azure", "Standard_ND96isr_H100_v5", "eastus")]
    assert nd.accelerator_count == 8 and nd.gpu_memory_gib == 80
    assert len(cat.offers) == 8
    rules = {c.split(":")[0] for c in cat.info.corrections}
    assert rules == {"azure-nd96isr-h100-v5-gpu-count", "rule gpu-name", "rule price-not-positive",
                     "rule no-price", "rule spot-not-below-on-demand", "rule spot-only",
                     "rule gpu-count", "rule gpu-memory-filled", "rule gpu-memory-range",
                     "rule unknown-gpu", "rule duplicate"}
    counts = {c.split(":")[0]: c for c in cat.info.corrections}
    assert "2 offers without an on-demand price" in counts["rule spot-only"]
    assert "1 offer " in counts["rule duplicate"]
    assert cat.age_days() == pytest.approx(3, abs=0.01)


def test_cache_sees_a_rewritten_user_catalog(tmp_path: Path) -> None:
    _user_catalog(tmp_path, [_offer()], _days_ago(1))
    first = L.load_catalog(tmp_path)
    assert L.load_catalog(tmp_path) is first
    _user_catalog(tmp_path, [_offer(), _offer(region="us-west-2")], _days_ago(0))
    os.utime(tmp_path / "catalog" / "gpu_offers.csv", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert len(L.load_catalog(tmp_path).offers) == 2


def test_corrupt_user_catalogs_fall_back_to_the_snapshot(tmp_path: Path) -> None:
    cases = {
        "bad-columns": ("provider,price\naws,1\n", '{"as_of": "2026-01-01"}'),
        "bad-number": (None, '{"as_of": "2026-01-01"}'),
        "bad-meta": ("", "{not json"),
        "no-as-of": ("", "{}"),
        "no-offers": (None, None),
        "short-row": (None, None),
    }
    for name, (csv_text, meta) in cases.items():
        home = tmp_path / name
        folder = _user_catalog(home, [_offer()], "2026-01-01")
        if name == "bad-number":
            text = (folder / "gpu_offers.csv").read_text().replace("20,8", "twenty,8")
            (folder / "gpu_offers.csv").write_text(text)
        elif name == "short-row":
            text = (folder / "gpu_offers.csv").read_text()
            (folder / "gpu_offers.csv").write_text(text + "aws,p4d.24xlarge,A100\n")
        elif name == "no-offers":
            (folder / "gpu_offers.csv").write_text((folder / "gpu_offers.csv").read_text()
                                                   .splitlines()[0] + "\n")
        elif csv_text:
            (folder / "gpu_offers.csv").write_text(csv_text)
        if meta is not None:
            (folder / "meta.json").write_text(meta)
        cat = L.load_catalog(home)
        assert cat.info.kind == "snapshot", name
        assert len(cat.warnings) == 1 and "cannot be used" in cat.warnings[0], name
        assert str(folder) in cat.warnings[0]
    # the snapshot itself is untouched by a fallback's warning
    assert L.load_catalog(None).warnings == ()


# --- the CLI --------------------------------------------------------------------------------

def test_catalog_info_snapshot_and_user_local(tmp_path: Path) -> None:
    r = _run(tmp_path, "catalog", "info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kind"] == "snapshot" and Path(info["path"]) == SNAP
    assert set(info["offers_per_provider"]) == {"aws", "azure", "gcp"}
    assert any(c.startswith("azure-nd96isr-h100-v5-gpu-count") for c in info["corrections"])
    assert info["age_days"] is not None and "skypilot" in info["source"].lower()

    _user_catalog(tmp_path, [_offer(), _offer(provider="azure", instance_type="Standard_ND96asr_v4",
                                              region="eastus")], _days_ago(10))
    r = _run(tmp_path, "catalog", "info")
    assert r.returncode == 0, r.stderr
    assert "user-local" in r.stdout and str(tmp_path / "catalog") in r.stdout
    assert "10 days old" in r.stdout and "aws 1, azure 1" in r.stdout
    info = json.loads(_run(tmp_path, "catalog", "info", "--json").stdout)
    assert info["kind"] == "user" and info["age_days"] == pytest.approx(10, abs=0.01)


def test_catalog_info_corrupt_user_local(tmp_path: Path) -> None:
    (tmp_path / "catalog").mkdir()
    (tmp_path / "catalog" / "gpu_offers.csv").write_text("garbage\n")
    r = _run(tmp_path, "catalog", "info")
    assert r.returncode == 0, r.stderr
    assert "snapshot (shipped with cloudtrain)" in r.stdout
    assert "cannot be used" in r.stderr and "Traceback" not in r.stderr


def test_gpus_a100x8_on_aws_cheapest_first(tmp_path: Path) -> None:
    rows = [r for r in _raw() if r["provider"] == "aws" and r["accelerator"] == "A100"
            and float(r["accelerator_count"]) == 8 and r["price"]]
    best = min(float(r["price"]) for r in rows)
    best_regions = {r["region"] for r in rows if float(r["price"]) == best}

    r = _run(tmp_path, "gpus", "A100:8", "--provider", "aws", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert len(got) == len(rows)
    assert got[0]["price_hourly_usd"] == best and got[0]["region"] in best_regions
    assert [o["price_hourly_usd"] for o in got] == sorted(o["price_hourly_usd"] for o in got)
    assert {o["provider"] for o in got} == {"aws"}
    assert {"instance_type", "gpu_memory_gib", "vcpus", "memory_gib",
            "spot_price_hourly_usd"} <= set(got[0])

    r = _run(tmp_path, "gpus", "a100-40gb:8", "--provider", "aws")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["PROVIDER", "INSTANCE", "GPU"]
    first = lines[1].split()
    assert first[:3] == ["aws", got[0]["instance_type"], "A100:8"]
    assert got[0]["region"] in first and f"{best:.2f}" in first
    assert "40" in first   # per-GPU memory


def test_gpus_spot_sorted_and_json_parses(tmp_path: Path) -> None:
    r = _run(tmp_path, "gpus", "h100:8", "--spot", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got and all(o["spot_price_hourly_usd"] is not None for o in got)
    assert [o["spot_price_hourly_usd"] for o in got] == \
        sorted(o["spot_price_hourly_usd"] for o in got)
    r = _run(tmp_path, "gpus", "--models", "--json")
    models = json.loads(r.stdout)
    assert r.returncode == 0 and {"A100", "H100", "T4"} <= {m["accelerator"] for m in models}
    r = _run(tmp_path, "gpus", "A100", "--models")
    assert r.returncode == 2 and "takes no NAME" in r.stderr


# The JSON contract of `gpus --json`: these names, these types (None where the catalog has no
# value: a price the offer is not sold at, memory the source does not list).
OFFER_CONTRACT: dict[str, tuple[type, ...]] = {
    "provider": (str,), "instance_type": (str,), "accelerator": (str,),
    "accelerator_count": (int, float), "gpu_memory_gib": (int, float, type(None)),
    "vcpus": (int, float, type(None)), "memory_gib": (int, float, type(None)),
    "region": (str,), "price_hourly_usd": (int, float, type(None)),
    "spot_price_hourly_usd": (int, float, type(None)),
}


def test_the_contract_fields_are_the_documented_ones() -> None:
    from cloudtrain.catalog.model import OFFER_FIELDS, offer_json

    assert tuple(OFFER_CONTRACT) == OFFER_FIELDS
    assert set(OFFER_FIELDS) <= set(offer_json(_offer()))


def assert_offer_contract(o: dict[str, object]) -> None:
    for key, types in OFFER_CONTRACT.items():
        assert key in o, f"{key} missing from {sorted(o)}"
        assert isinstance(o[key], types) and not isinstance(o[key], bool), (key, o[key])
    assert o["provider"] in ("aws", "gcp", "azure")
    assert o["price_hourly_usd"] is not None or o["spot_price_hourly_usd"] is not None


def test_gpus_json_contract_every_offer_of_the_snapshot(tmp_path: Path) -> None:
    """`gpus --json` (no NAME) is a list of every GPU offer, each with the contract's fields."""
    r = _run(tmp_path, "gpus", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    snap = L.load_catalog(None)
    assert isinstance(got, list) and len(got) == sum(1 for o in snap.offers if o.price is not None)
    for o in got:
        assert_offer_contract(o)
    assert [o["price_hourly_usd"] for o in got] == sorted(o["price_hourly_usd"] for o in got)
    # the meanings: per-node USD/h on demand and spot, per-GPU memory, as in the catalog
    by = {(o.provider, o.instance_type, o.region, o.accelerator, o.accelerator_count): o
          for o in snap.offers}
    for o in got:
        src = by[(o["provider"], o["instance_type"], o["region"], o["accelerator"],
                  o["accelerator_count"])]
        assert (o["price_hourly_usd"], o["spot_price_hourly_usd"], o["gpu_memory_gib"],
                o["accelerator_count"]) == (src.price, src.spot_price, src.gpu_memory_gib,
                                            src.accelerator_count)
    spot = json.loads(_run(tmp_path, "gpus", "--json", "--spot", "--provider", "gcp").stdout)
    assert spot and all(o["provider"] == "gcp" and o["spot_price_hourly_usd"] is not None
                        for o in spot)
    for o in spot:
        assert_offer_contract(o)
    # a query that matches nothing is an empty list
    none = _run(tmp_path, "gpus", "A100:3", "--provider", "aws", "--json")
    assert none.returncode == 0 and json.loads(none.stdout) == []


def test_gpus_unknown_name_and_no_offers(tmp_path: Path) -> None:
    r = _run(tmp_path, "gpus", "A1000:8")
    assert r.returncode == 2
    assert "Unknown GPU 'A1000'" in r.stderr and "Did you mean 'A100'?" in r.stderr
    assert "Traceback" not in r.stderr
    r = _run(tmp_path, "gpus", "A100:3", "--provider", "aws")
    assert r.returncode == 0 and "No offers for A100:3 on aws" in r.stdout
    assert "comes with 8 per node" in r.stdout
    r = _run(tmp_path, "gpus", "H100:x")
    assert r.returncode == 2 and "positive number" in r.stderr
