"""The spend ledger and ``cost-report``: costs from usage rows written with known timestamps and
prices into a temporary state database (no nodes, no network)."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import sys
from datetime import date, datetime, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from cloudtrain import ledger
from cloudtrain.commands.main import cli
from cloudtrain.schema import SCHEMA_VERSION, ClusterRow
from cloudtrain.state import State, open_state
from cloudtrain.testing import MemoryProvider

H = 3600.0
DAY = 86400.0
# A fixed midnight (UTC) and "now" two and a half days later.
MID = datetime(2026, 3, 10, tzinfo=timezone.utc).timestamp()
NOW = MID + 2.5 * DAY


def add(state: State, name: str, start: float, end: float | None = None, *, price: float | None = 2.0,
        nodes: int = 2, provider: str = "aws", created: float | None = None,
        reason: str = "terminated", spot: bool = False) -> None:
    """One usage interval, as provision / down would write it, at the given times."""
    row = ClusterRow(name=name, provider=provider, status="UP", num_nodes=nodes,
                     created_at=created if created is not None else start, updated_at=start,
                     region="us-east-1", instance_type="p4d.24xlarge", accelerators="A100:8",
                     use_spot=spot, hourly_price=price)
    state.open_usage(row, when=start)
    if end is not None:
        state.close_usage(name, when=end, reason=reason)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


@pytest.fixture
def state(home: Path) -> State:
    return open_state(home)


def one(rep: ledger.Report, name: str) -> ledger.ClusterCost:
    found = [c for c in rep.clusters if c.cluster == name]
    assert len(found) == 1, [c.cluster for c in rep.clusters]
    return found[0]


# --- the computation ----------------------------------------------------------------------------

def test_cost_is_hours_times_price_at_launch_times_nodes(state: State) -> None:
    add(state, "a", MID, MID + 3 * H, price=2.5, nodes=4)                   # 3 h x 2.5 x 4 = 30
    add(state, "b", MID + H, MID + 1.5 * H, price=1.0, nodes=1, provider="gcp", spot=True)
    rep = ledger.report(state, now=NOW)
    a, b = one(rep, "a"), one(rep, "b")
    assert a.hours == pytest.approx(3.0) and a.cost == pytest.approx(30.0)
    assert (a.provider, a.region, a.instance_type, a.num_nodes, a.use_spot, a.price_at_launch) == \
        ("aws", "us-east-1", "p4d.24xlarge", 4, False, 2.5)
    assert a.status == "terminated" and a.end_reason == "terminated"
    assert b.cost == pytest.approx(0.5) and b.use_spot
    assert rep.by_provider == pytest.approx({"aws": 30.0, "gcp": 0.5})
    assert rep.total_cost == pytest.approx(30.5)
    assert rep.total_hours == pytest.approx(3.5)
    assert rep.unknown == [] and not rep.notes


def test_window_clips_hours_to_the_last_n_days(state: State) -> None:
    # NOW - 1 day = MID + 1.5 days. "old" ended before the window; "across" straddles its start.
    add(state, "old", MID, MID + 10 * H)
    add(state, "across", MID + 1.5 * DAY - 4 * H, MID + 1.5 * DAY + 6 * H, price=1.0, nodes=1)
    add(state, "inside", MID + 2 * DAY, MID + 2 * DAY + H, price=1.0, nodes=1)
    rep = ledger.report(state, now=NOW, days=1)
    assert [c.cluster for c in rep.clusters] == ["across", "inside"]
    assert one(rep, "across").hours == pytest.approx(6.0)      # not 10: clipped at the start
    assert one(rep, "across").cost == pytest.approx(6.0)
    assert rep.total_cost == pytest.approx(7.0)
    # Without a window everything counts.
    full = ledger.report(state, now=NOW)
    assert one(full, "across").hours == pytest.approx(10.0)
    assert one(full, "old").cost == pytest.approx(40.0)


def test_open_interval_counts_up_to_now_and_is_running(state: State) -> None:
    add(state, "live", NOW - 2 * H, None, price=3.0, nodes=2)
    rep = ledger.report(state, now=NOW)
    live = one(rep, "live")
    assert live.status == "running" and live.ended_at is None and live.end_reason is None
    assert live.hours == pytest.approx(2.0) and live.cost == pytest.approx(12.0)
    assert any("up to now" in n for n in rep.notes)
    later = ledger.report(state, now=NOW + H)
    assert one(later, "live").cost == pytest.approx(18.0)
    # An open interval inside a window is clipped at its start only.
    assert one(ledger.report(state, now=NOW, days=1 / 24), "live").hours == pytest.approx(1.0)


def test_unknown_price_is_shown_as_unknown_and_left_out_of_totals(state: State) -> None:
    add(state, "priced", MID, MID + H, price=1.0, nodes=1)
    add(state, "mystery", MID, MID + 5 * H, price=None, nodes=8)
    rep = ledger.report(state, now=NOW)
    assert one(rep, "mystery").cost is None
    assert one(rep, "mystery").hours == pytest.approx(5.0)
    assert rep.total_cost == pytest.approx(1.0) and rep.unknown == ["mystery"]
    assert any("mystery" in n and "unknown" in n for n in rep.notes)
    js = ledger.to_json(rep)
    by = {c["name"]: c for c in js["clusters"]}  # type: ignore[union-attr,index]
    assert by["mystery"]["cost_usd"] is None and by["mystery"]["price_hourly_usd"] is None
    assert js["total_usd"] == 1.0
    assert js["totals"]["unknown_cost_clusters"] == ["mystery"]  # type: ignore[index]
    rows = ledger.csv_rows(rep)
    col = rows[0].index("cost_usd")
    assert {r[0]: r[col] for r in rows[1:]} == {"priced": "1", "mystery": "unknown"}
    # Nor does it reach the daily chart.
    daily = ledger.daily_spend(state.usage(), now=NOW)
    assert sum(sum(v.values()) for v in daily.values()) == pytest.approx(1.0)


def test_stopped_and_started_cluster_is_one_entry_with_two_intervals(state: State) -> None:
    created = MID
    add(state, "s", MID, MID + 2 * H, price=1.0, nodes=2, created=created, reason="stopped")
    rep = ledger.report(state, now=NOW)
    assert one(rep, "s").status == "stopped"
    # Started again later, at the price in force then: its own interval, its own price.
    add(state, "s", MID + 10 * H, MID + 11 * H, price=1.5, nodes=2, created=created)
    rep = ledger.report(state, now=NOW)
    s = one(rep, "s")
    assert len(s.intervals) == 2
    assert [i.end_reason for i in s.intervals] == ["stopped", "terminated"]
    assert s.hours == pytest.approx(3.0)                       # the 8 stopped hours cost nothing
    assert s.cost == pytest.approx(2 * 1.0 * 2 + 1 * 1.5 * 2)
    assert s.price_at_launch == 1.0 and s.status == "terminated"
    assert s.started_at == MID and s.ended_at == MID + 11 * H


def test_a_cluster_recreated_under_the_same_name_is_a_separate_entry(state: State) -> None:
    add(state, "job", MID, MID + H, price=1.0, nodes=1)
    add(state, "job", MID + DAY, MID + DAY + 2 * H, price=1.0, nodes=1)
    rep = ledger.report(state, now=NOW)
    assert [(c.cluster, c.hours) for c in rep.clusters] == [("job", pytest.approx(1.0)),
                                                             ("job", pytest.approx(2.0))]


def test_cluster_spend_is_that_of_the_cluster_that_exists_now(state: State) -> None:
    add(state, "c", MID, MID + H, price=10.0, nodes=1)                  # an earlier 'c'
    row = ClusterRow(name="c", provider="aws", status="UP", num_nodes=2, created_at=NOW - 2 * H,
                     updated_at=NOW, hourly_price=1.0)
    state.upsert_cluster(row)
    state.open_usage(row, when=NOW - 2 * H)
    assert ledger.cluster_spend(state, "c", now=NOW) == pytest.approx(4.0)
    assert ledger.cluster_spend(state, "nothing", now=NOW) == 0.0


def test_daily_spend_splits_at_utc_midnight_and_lists_every_day(state: State) -> None:
    add(state, "x", MID + DAY - 2 * H, MID + DAY + 3 * H, price=1.0, nodes=1)
    add(state, "y", MID + 12 * H, MID + 13 * H, price=4.0, nodes=1, provider="gcp")
    daily = ledger.daily_spend(state.usage(), now=NOW)
    d0 = date(2026, 3, 10)
    assert list(daily) == [d0, date(2026, 3, 11), date(2026, 3, 12)]
    assert daily[d0] == pytest.approx({"aws": 2.0, "gcp": 4.0})
    assert daily[date(2026, 3, 11)] == pytest.approx({"aws": 3.0})
    assert daily[date(2026, 3, 12)] == {}
    rep = ledger.report(state, now=NOW)
    assert sum(sum(v.values()) for v in daily.values()) == pytest.approx(rep.total_cost)


OLD_SCHEMA = """
CREATE TABLE clusters (name TEXT PRIMARY KEY, provider TEXT NOT NULL, status TEXT NOT NULL,
    num_nodes INTEGER NOT NULL, region TEXT, zone TEXT, instance_type TEXT, accelerators TEXT,
    use_spot INTEGER NOT NULL DEFAULT 0, hourly_price REAL,
    master_port INTEGER NOT NULL DEFAULT 29500, options_json TEXT NOT NULL DEFAULT '{}',
    resources_json TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE launches (id INTEGER PRIMARY KEY AUTOINCREMENT, cluster TEXT NOT NULL,
    job_id TEXT NOT NULL UNIQUE, task_name TEXT, status TEXT NOT NULL,
    detached INTEGER NOT NULL DEFAULT 0, started_at REAL NOT NULL, ended_at REAL,
    exit_code INTEGER, failed_node INTEGER);
CREATE TABLE usage (id INTEGER PRIMARY KEY AUTOINCREMENT, cluster TEXT NOT NULL,
    provider TEXT NOT NULL, region TEXT, zone TEXT, instance_type TEXT, accelerators TEXT,
    num_nodes INTEGER NOT NULL, use_spot INTEGER NOT NULL DEFAULT 0, hourly_price_per_node REAL,
    started_at REAL NOT NULL, ended_at REAL);
INSERT INTO clusters (name, provider, status, num_nodes, hourly_price, created_at, updated_at)
    VALUES ('a', 'aws', 'UP', 1, 1.0, 1000, 1000);
INSERT INTO launches (cluster, job_id, status, started_at) VALUES ('a', 'j1', 'SUCCEEDED', 1100);
INSERT INTO usage (cluster, provider, num_nodes, hourly_price_per_node, started_at, ended_at)
    VALUES ('a', 'aws', 1, 1.0, 100, 460),      -- an earlier cluster named 'a'
           ('b', 'gcp', 2, 0.5, 200, 3800),
           ('a', 'aws', 1, 1.0, 1000, NULL);    -- the 'a' that exists now
"""


def test_an_old_database_is_migrated_in_place(home: Path) -> None:
    db = sqlite3.connect(home / "state.db")
    db.executescript(OLD_SCHEMA)
    db.close()
    state = open_state(home)
    open_state(home)                                   # a second open changes nothing
    rows = state.usage()
    assert [(r.cluster, r.end_reason, r.cluster_created_at) for r in rows] == [
        ("a", "terminated", None), ("b", "terminated", None), ("a", None, 1000.0)]
    with sqlite3.connect(home / "state.db") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    c = state.get_cluster("a")
    assert c is not None and c.max_cost_usd is None
    assert state.launches("a")[0].end_reason is None
    state.set_budget("a", 5.0)
    assert state.get_cluster("a").max_cost_usd == 5.0  # type: ignore[union-attr]
    rep = ledger.report(state, now=4600)
    assert [(c.cluster, c.status) for c in rep.clusters] == [
        ("a", "terminated"), ("b", "terminated"), ("a", "running")]
    assert [c.cost for c in rep.clusters] == pytest.approx([0.1, 1.0, 1.0])
    assert ledger.cluster_spend(state, "a", now=4600) == pytest.approx(1.0)


def test_a_reason_marked_before_teardown_survives_it(state: State) -> None:
    add(state, "g", MID, None, price=1.0, nodes=1)
    state.mark_usage_end("g", "budget: $1.0000 of $1.0000")
    state.close_usage("g", when=MID + H)                 # what down() does
    c = one(ledger.report(state, now=NOW), "g")
    assert c.end_reason == "budget: $1.0000 of $1.0000" and c.status == "terminated"


# --- the command --------------------------------------------------------------------------------

def _cli(home: Path, *args: str, providers: dict[str, MemoryProvider] | None = None) -> Result:
    return CliRunner().invoke(cli, ["cost-report", *args], obj=providers,
                              env={"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"})


def _filled(state: State) -> None:
    add(state, "a", MID, MID + 3 * H, price=2.5, nodes=4)
    add(state, "b", MID + DAY, MID + DAY + 2 * H, price=1.25, nodes=2, provider="gcp")
    add(state, "m", MID, MID + H, price=None, nodes=1, provider="azure")


def test_json_csv_and_table_output(home: Path, state: State) -> None:
    _filled(state)
    r = _cli(home, "--json")
    assert r.exit_code == 0, r.output
    js = json.loads(r.stdout)
    assert {c["name"]: c["cost_usd"] for c in js["clusters"]} == {"a": 30.0, "b": 5.0, "m": None}
    assert js["total_usd"] == 35.0
    assert js["totals"]["by_provider"] == {"aws": 30.0, "gcp": 5.0}
    assert js["clusters"][0]["end_reason"] == "terminated"

    r = _cli(home, "--csv")
    assert r.exit_code == 0
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [(x["name"], x["provider"], x["nodes"], x["hours"], x["cost_usd"]) for x in rows] == [
        ("a", "aws", "4", "3.000000", "30"), ("m", "azure", "1", "1.000000", "unknown"),
        ("b", "gcp", "2", "2.000000", "5")]
    assert {x["gpu_hours"] for x in rows} == {""}     # no scheduler accounts for them

    r = _cli(home)
    assert r.exit_code == 0
    out = r.stdout
    assert "$30.00" in out and "unknown" in out and "Total for everything recorded: $35.00" in out
    assert "excluded from the totals" in out


@pytest.mark.parametrize("days", ["0", "-1", "abc", "nan"])
def test_bad_days_exit_2(home: Path, days: str) -> None:
    r = _cli(home, "--days", days)
    assert r.exit_code == 2, r.output
    assert "--days" in r.output


def test_json_and_csv_together_exit_2(home: Path) -> None:
    r = _cli(home, "--json", "--csv")
    assert r.exit_code == 2 and "pick one" in r.output


def test_a_newer_catalog_does_not_change_past_costs(home: Path, state: State,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _filled(state)

    def costs() -> dict[str, object]:
        r = _cli(home, "--json")
        assert r.exit_code == 0, r.output
        js = json.loads(r.stdout)
        return {"clusters": js["clusters"], "totals": js["totals"], "total_usd": js["total_usd"]}

    before = costs()
    # A user-local catalog (what 'catalog refresh' writes) where every price is different.
    from cloudtrain.catalog import store

    cat = home / "catalog"
    cat.mkdir()
    row = {"provider": "aws", "instance_type": "p4d.24xlarge", "accelerator": "A100",
           "accelerator_count": "8", "gpu_memory_gib": "40", "vcpus": "96", "memory_gib": "1152",
           "region": "us-east-1", "zones": "us-east-1a", "price": "99.99", "spot_price": "9.99",
           "arch": "x86_64", "host_type": "vm"}
    lines = [",".join(store.COLUMNS), ",".join(row.get(c, "") for c in store.COLUMNS)]
    lines.append(",".join({**row, "provider": "gcp", "price": "0.01"}.get(c, "") for c in store.COLUMNS))
    lines.append(",".join({**row, "provider": "azure", "price": "3.0"}.get(c, "") for c in store.COLUMNS))
    (cat / store.OFFERS_FILE).write_text("\n".join(lines) + "\n")
    (cat / store.META_FILE).write_text(json.dumps({"as_of": "2030-01-01", "source": "test",
                                                   "providers": ["aws", "gcp", "azure"]}))
    assert costs() == before
    # By construction: the report works with the catalog package unimportable.
    monkeypatch.setitem(sys.modules, "cloudtrain.catalog", None)
    monkeypatch.setitem(sys.modules, "cloudtrain.catalog.load", None)
    assert costs() == before


def test_chart_png_matches_the_ledger(home: Path, state: State, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from cloudtrain.commands.report import render_chart

    _filled(state)
    add(state, "late", MID + DAY - H, MID + DAY + H, price=1.0, nodes=1, provider="gcp")
    png = tmp_path / "charts" / "spend.png"
    r = _cli(home, "--chart", str(png))
    assert r.exit_code == 0, r.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # What is drawn, bar by bar, is what the ledger says per day, and adds up to its total.
    rows = state.usage()
    daily = ledger.daily_spend(rows, now=NOW)
    drawn = render_chart(daily, tmp_path / "again.png")
    assert drawn == pytest.approx({d: sum(v.values()) for d, v in daily.items()})
    assert drawn[date(2026, 3, 10)] == pytest.approx(30.0 + 1.0)
    assert drawn[date(2026, 3, 11)] == pytest.approx(5.0 + 1.0)
    assert sum(drawn.values()) == pytest.approx(ledger.report(state, now=NOW).total_cost)


def test_chart_without_matplotlib_exits_2(home: Path, state: State, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _filled(state)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = _cli(home, "--chart", str(tmp_path / "x.png"))
    assert r.exit_code == 2
    assert "pip install 'cloudtrain[chart]'" in r.output
    assert not (tmp_path / "x.png").exists()


# --- the JSON contract ----------------------------------------------------------------------------

# `cost-report --json` -> {"clusters": [{these}], "total_usd"}: the names scripts rely on.
REPORT_CONTRACT: dict[str, tuple[type, ...]] = {
    "name": (str,), "provider": (str,), "region": (str, type(None)),
    "instance_type": (str, type(None)), "nodes": (int,), "spot": (bool,),
    "hours": (int, float), "price_hourly_usd": (int, float, type(None)),
    "cost_usd": (int, float, type(None)),
}


def assert_report_contract(js: dict[str, object]) -> None:
    assert isinstance(js["clusters"], list)
    assert isinstance(js["total_usd"], (int, float)) and not isinstance(js["total_usd"], bool)
    for c in js["clusters"]:
        for key, types in REPORT_CONTRACT.items():
            assert key in c, f"{key} missing from {sorted(c)}"
            ok = isinstance(c[key], types) and (bool in types or not isinstance(c[key], bool))
            assert ok, (key, c[key])
        if c["price_hourly_usd"] is not None:
            assert c["cost_usd"] == pytest.approx(c["hours"] * c["price_hourly_usd"] * c["nodes"],
                                                  abs=1e-5)
    known = [c["cost_usd"] for c in js["clusters"] if c["cost_usd"] is not None]
    assert js["total_usd"] == pytest.approx(sum(known), abs=1e-5)


def test_cost_report_json_contract(home: Path, state: State) -> None:
    _filled(state)
    add(state, "sp", MID, MID + 2 * H, price=0.75, nodes=3, spot=True)
    r = _cli(home, "--json")
    assert r.exit_code == 0, r.output
    js = json.loads(r.stdout)
    assert_report_contract(js)
    by = {c["name"]: c for c in js["clusters"]}
    assert (by["a"]["nodes"], by["a"]["spot"], by["a"]["hours"], by["a"]["price_hourly_usd"],
            by["a"]["cost_usd"]) == (4, False, 3.0, 2.5, 30.0)
    assert (by["sp"]["spot"], by["sp"]["price_hourly_usd"], by["sp"]["cost_usd"]) == \
        (True, 0.75, 4.5)                                        # 2 h x 0.75 x 3 nodes
    assert by["m"]["price_hourly_usd"] is None and by["m"]["cost_usd"] is None
    assert js["total_usd"] == 39.5                               # 30 + 5 + 4.5, m unknown
    # Nothing recorded: the same shape, empty.
    r = _cli(home.parent / "empty", "--json")
    js = json.loads(r.stdout)
    assert (js["clusters"], js["total_usd"]) == ([], 0.0)


# --- spot, stop/start --------------------------------------------------------------------------

def test_spot_cluster_is_billed_at_its_spot_price_across_stop_and_start(state: State) -> None:
    """The planner prices a spot task at the offer's spot price; that is what the ledger
    records and bills, interval by interval, and nothing while the cluster is stopped."""
    from cloudtrain import ranking
    from cloudtrain.taskmodel import Resources
    from test_planner import OFFERS

    pick = ranking.rank(Resources.model_validate({"accelerators": "A100:8"}), 2, OFFERS,
                        spot=True).require()
    assert (pick.offer.provider, pick.per_node, pick.offer.price) == ("azure", 3.0, 27.20)
    row = ClusterRow(name="sp", provider=pick.offer.provider, status="UP", num_nodes=2,
                     created_at=MID, updated_at=MID, region=pick.offer.region,
                     instance_type=pick.offer.instance_type, accelerators="A100:8",
                     use_spot=True, hourly_price=pick.per_node)
    state.open_usage(row, when=MID)
    state.close_usage("sp", when=MID + 1.5 * H, reason="stopped")    # 1.5 h x $3.00 x 2 = $9
    mid = one(ledger.report(state, now=MID + 4 * H), "sp")
    assert (mid.status, mid.hours, mid.cost) == ("stopped", pytest.approx(1.5), pytest.approx(9.0))
    # Started again 4 h later, when the spot price had moved to $3.60: that interval is billed
    # at $3.60, the first one keeps $3.00. 2 h x $3.60 x 2 = $14.40.
    state.open_usage(ClusterRow(**{**row.__dict__, "hourly_price": 3.6}), when=MID + 5.5 * H)
    running = one(ledger.report(state, now=MID + 6.5 * H), "sp")
    assert running.status == "running" and running.cost == pytest.approx(9.0 + 7.2)
    state.close_usage("sp", when=MID + 7.5 * H)
    done = one(ledger.report(state, now=NOW), "sp")
    assert done.use_spot and done.price_at_launch == 3.0
    assert [(i.hourly_price_per_node, i.hours, i.end_reason) for i in done.intervals] == [
        (3.0, pytest.approx(1.5), "stopped"), (3.6, pytest.approx(2.0), "terminated")]
    assert done.hours == pytest.approx(3.5)                          # the 4 stopped hours: $0
    assert done.cost == pytest.approx(9.0 + 14.4)                    # never at on-demand 27.20
    js = ledger.to_json(ledger.report(state, now=NOW))
    (c,) = js["clusters"]  # type: ignore[misc]
    assert (c["spot"], c["price_hourly_usd"], c["cost_usd"], c["hours"]) == (True, 3.0, 23.4, 3.5)
    assert [i["price_hourly_usd"] for i in c["intervals"]] == [3.0, 3.6]


# --- launched through the planner, then the catalog changes ------------------------------------

@pytest.fixture
def fake_clouds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, MemoryProvider]:
    """aws and gcp stand-ins, with credentials for both; handed in through the Env (or the
    command line's context object)."""
    from test_planner import CRED_VARS

    user = tmp_path / "userhome"
    adc = user / ".config" / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir(parents=True)
    adc.write_text("{}")
    monkeypatch.setenv("HOME", str(user))
    for v in CRED_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("AWS_PROFILE", "p")
    return {"aws": MemoryProvider.named("aws"), "gcp": MemoryProvider.named("gcp")}


def _catalog(home: Path, scale: float) -> None:
    """A user-local catalog (what 'catalog refresh' writes) with every price x ``scale``."""
    from cloudtrain.catalog.model import CatalogInfo, Offer
    from cloudtrain.catalog.store import write_meta, write_offers

    def o(provider: str, itype: str, acc: str, count: float, mem: float, region: str,
          price: float, spot: float) -> Offer:
        return Offer(provider=provider, instance_type=itype, accelerator=acc,
                     accelerator_count=count, gpu_memory_gib=mem, vcpus=96, memory_gib=1152,
                     region=region, price=round(price * scale, 4),
                     spot_price=round(spot * scale, 4))

    folder = home / "catalog"
    write_offers(folder / "gpu_offers.csv", [
        o("aws", "p4d.24xlarge", "A100", 8, 40, "us-east-1", 32.77, 12.0),
        o("gcp", "a2-highgpu-8g", "A100", 8, 40, "us-central1", 29.39, 8.8),
        o("aws", "g5.xlarge", "A10G", 1, 22.35, "us-east-1", 1.006, 0.45),
        o("gcp", "g2-standard-4", "L4", 1, 24, "us-central1", 0.71, 0.25),
    ])
    write_meta(folder, CatalogInfo(kind="user", path=str(folder), as_of="2026-03-01",
                                   source=f"test, prices x {scale}", providers=("aws", "gcp")))


def test_report_over_clusters_launched_before_the_catalog_changed_keeps_launch_prices(
        fake_clouds: dict[str, MemoryProvider], home: Path, state: State,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.context import Env
    from cloudtrain.pipeline.plan import plan
    from cloudtrain.pipeline.provision import provision
    from cloudtrain.pipeline.teardown import down
    from cloudtrain.spec import parse_task
    from cloudtrain.ui import UI

    monkeypatch.setenv("CLOUDTRAIN_HOME", str(home))
    _catalog(home, 1.0)
    env = Env(home, state, UI(quiet=True), providers=fake_clouds)
    tasks = {   # name: (task, what the planner takes from the first catalog, $/node-h, nodes)
        "train": ("num_nodes: 2\nresources: {accelerators: A100:8}\n",
                  ("gcp", "a2-highgpu-8g"), 29.39, 2),
        "spotty": ("resources: {accelerators: A100:8, use_spot: true}\n",
                   ("gcp", "a2-highgpu-8g"), 8.8, 1),
        "small": ("num_nodes: 3\nresources: {provider: aws, accelerators: A10G:1}\n",
                  ("aws", "g5.xlarge"), 1.006, 3),
        "live": ("num_nodes: 4\nresources: {accelerators: L4:1, use_spot: true}\n",
                 ("gcp", "g2-standard-4"), 0.25, 4),
    }
    for name, (text, (prov, itype), price, nodes) in tasks.items():
        task = parse_task(f"name: {name}\n{text}run: x\n")
        handle, fresh = provision(env, task, name, planned=plan(env, task, name))
        assert fresh and (handle.row.provider, handle.row.instance_type) == (prov, itype)
        assert handle.row.hourly_price == price and handle.row.num_nodes == nodes
    for name in ("train", "spotty", "small"):
        down(env, name)
    # Give the finished intervals known lengths: 3 h, 10 h, 0.5 h; "live" started 2 h ago.
    import time

    hours = {"train": 3.0, "spotty": 10.0, "small": 0.5}
    with sqlite3.connect(home / "state.db") as db:
        for name, h in hours.items():
            db.execute("UPDATE usage SET started_at=?, ended_at=? WHERE cluster=?",
                       (MID, MID + h * H, name))
        db.execute("UPDATE usage SET started_at=? WHERE cluster='live'", (time.time() - 2 * H,))

    def report() -> dict[str, dict[str, object]]:
        r = _cli(home, "--json", providers=fake_clouds)
        assert r.exit_code == 0, r.output
        js = json.loads(r.stdout)
        assert_report_contract(js)
        return {c["name"]: c for c in js["clusters"]}

    def live_status() -> dict[str, object]:
        r = CliRunner().invoke(cli, ["status", "live", "--json"], obj=fake_clouds,
                               env={"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"})
        assert r.exit_code == 0, r.output
        (row,) = json.loads(r.stdout)
        return row  # type: ignore[no-any-return]

    before = report()
    expected = {"train": 3.0 * 29.39 * 2, "spotty": 10.0 * 8.8, "small": 0.5 * 1.006 * 3}
    for name, cost in expected.items():
        c = before[name]
        assert (c["price_hourly_usd"], c["nodes"], c["hours"]) == \
            (tasks[name][2], tasks[name][3], hours[name])
        assert c["cost_usd"] == pytest.approx(cost, abs=1e-5)
    assert before["spotty"]["spot"] is True and before["train"]["spot"] is False
    st = live_status()
    assert (st["price_hourly_usd"], st["cluster_hourly_usd"]) == (0.25, 1.0)
    assert st["cost_so_far_usd"] == pytest.approx(2 * 0.25 * 4, abs=0.01)

    # The catalog is refreshed: every price is three times what it was.
    _catalog(home, 3.0)
    replan = plan(env, parse_task("name: t2\nnum_nodes: 2\nresources: {accelerators: A100:8}"
                                     "\nrun: x\n"), "t2")
    assert replan.hourly_price_per_node == pytest.approx(3 * 29.39)     # the new catalog is in use
    after = report()
    for name in expected:
        assert after[name]["price_hourly_usd"] == before[name]["price_hourly_usd"]
        assert after[name]["cost_usd"] == before[name]["cost_usd"]
    assert after["live"]["price_hourly_usd"] == 0.25
    st = live_status()
    assert (st["price_hourly_usd"], st["cluster_hourly_usd"]) == (0.25, 1.0)
    assert st["cost_so_far_usd"] == pytest.approx(2 * 0.25 * 4, abs=0.01)
    down(env, "live")


def test_status_shows_the_launch_price_and_the_cost_so_far_from_the_ledger(
        fake_clouds: dict[str, MemoryProvider], home: Path, state: State) -> None:
    """State rows written directly: a cluster stopped once and started again, and one with
    no recorded price."""
    import time

    now = time.time()
    row = ClusterRow(name="s", provider="gcp", status="UP", num_nodes=2, created_at=now - 5 * H,
                     updated_at=now, region="us-central1", instance_type="a2-highgpu-8g",
                     accelerators="A100:8", hourly_price=2.0)
    state.upsert_cluster(row)
    state.open_usage(row, when=now - 5 * H)
    state.close_usage("s", when=now - 4 * H, reason="stopped")       # 1 h x $2 x 2 = $4
    state.open_usage(row, when=now - H)                              # 1 h so far: $4 more
    nop = ClusterRow(name="n", provider="aws", status="UP", num_nodes=1, created_at=now - H,
                     updated_at=now, hourly_price=None)
    state.upsert_cluster(nop)
    state.open_usage(nop, when=now - H)
    env = {"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"}
    r = CliRunner().invoke(cli, ["status", "--json"], env=env, obj=fake_clouds)
    assert r.exit_code == 0, r.output
    by = {c["name"]: c for c in json.loads(r.stdout)}
    s = by["s"]
    assert (s["price_hourly_usd"], s["cluster_hourly_usd"]) == (2.0, 4.0)
    assert s["cost_so_far_usd"] == pytest.approx(8.0, abs=0.01)
    assert s["cost_so_far_usd"] == pytest.approx(ledger.cluster_spend(state, "s"), abs=0.01)
    n = by["n"]
    assert (n["price_hourly_usd"], n["cluster_hourly_usd"], n["cost_so_far_usd"]) == \
        (None, None, None)
    r = CliRunner().invoke(cli, ["status"], env=env, obj=fake_clouds)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split()[:9] == ["NAME", "PROVIDER", "STATUS", "NODES", "INSTANCE", "$/H",
                                    "NODE", "$/H", "CLUSTER"]
    assert "COST SO FAR" in lines[0]
    srow = next(ln.split() for ln in lines if ln.startswith("s "))
    assert srow[5:8] == ["2.00", "4.00", "$8.00"]
    nrow = next(ln.split() for ln in lines if ln.startswith("n "))
    assert nrow[4:7] == ["-", "-", "-"] and "unknown" in nrow
    r = CliRunner().invoke(cli, ["status", "s", "--json"], env=env, obj=fake_clouds)
    assert [c["name"] for c in json.loads(r.stdout)] == ["s"]
