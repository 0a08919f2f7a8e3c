"""``cost-report`` shows the sweeps in its table and, with ``--sweeps``, as CSV: one row per
sweep (its trials by state, its spend as last read), the same entries as ``--json``'s
``sweeps`` (docs/cost.md)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from click.testing import CliRunner, Result

from cloudtrain import ledger
from cloudtrain.commands.main import cli
from cloudtrain.schema import ClusterRow, SweepRow, SweepTrialRow
from cloudtrain.state import State, open_state

T0 = 1_780_000_000.0


def _cli(home: Path, *args: str) -> Result:
    return CliRunner().invoke(cli, ["cost-report", "--offline", *args],
                              env={"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"})


def _trial(sweep: str, n: int, state: str, cost: float | None) -> SweepTrialRow:
    return SweepTrialRow(sweep, n, state, 0.5 if state == "complete" else None, T0 + n,
                         None if state == "running" else T0 + n + 60, "0", "node0", cost,
                         {"lr": 0.1 * (n + 1)})


def _filled(state: State) -> None:
    row = ClusterRow(name="exp", provider="aws", status="UP", num_nodes=1, created_at=T0,
                     updated_at=T0, region="us-east-1", instance_type="p4d.24xlarge",
                     accelerators="A100:8", use_spot=False, hourly_price=8.0)
    state.open_usage(row, when=T0)
    state.close_usage("exp", when=T0 + 3600, reason="terminated")
    for name, price in (("search", 8.0), ("grid", None)):
        state.add_sweep(SweepRow(name, "exp", {"trials": 5}, T0, price, 8))
    state.set_sweep_trials("search", 0.0425, [
        _trial("search", 0, "complete", 0.02), _trial("search", 1, "complete", 0.0125),
        _trial("search", 2, "pruned", 0.005), _trial("search", 3, "fail", 0.005),
        _trial("search", 4, "running", None)])


def test_the_table_csv_and_json_show_each_sweep_alike(tmp_path: Path) -> None:
    _filled(open_state(tmp_path))
    doc = json.loads(_cli(tmp_path, "--json").stdout)
    by_json = {s["name"]: s for s in doc["sweeps"]}
    assert by_json["search"]["spent_usd"] == 0.0425 and by_json["grid"]["spent_usd"] is None

    r = _cli(tmp_path, "--csv", "--sweeps")
    assert r.exit_code == 0, r.output
    rows = {x["name"]: x for x in csv.DictReader(io.StringIO(r.stdout))}
    assert set(rows) == set(by_json)
    s = rows["search"]
    assert (s["cluster"], s["trials"], s["complete"], s["pruned"], s["fail"], s["running"],
            s["spent_usd"]) == ("exp", "5", "2", "1", "1", "1", "0.0425")
    assert s["started_at"] == by_json["search"]["started_at"] and s["as_of"]
    assert (rows["grid"]["trials"], rows["grid"]["spent_usd"]) == ("0", "unknown")

    r = _cli(tmp_path, "--csv")                   # the clusters' CSV stays summable
    assert [x["name"] for x in csv.DictReader(io.StringIO(r.stdout))] == ["exp"]

    r = _cli(tmp_path)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "exp" in out and "Total for everything recorded" in out
    line = next(x for x in out.splitlines() if x.startswith("search"))
    assert line.split() == ["search", "exp", by_json["search"]["started_at"], "5", "2", "1", "1",
                            "1", "$0.0425", by_json["search"]["as_of"]]
    assert "SWEEP" in out and "SPENT USD" in out

    alone = _cli(tmp_path, "--sweeps").stdout
    assert "Total for" not in alone and "search" in alone


def test_no_sweep_shows_no_sweeps_table(tmp_path: Path) -> None:
    assert "SWEEP" not in _cli(tmp_path).stdout
    assert "No sweep recorded." in _cli(tmp_path, "--sweeps").stdout
    assert ledger.sweep_rows([]) == [list(ledger.SWEEP_COLUMNS)]
