"""The laptop side of a sweep without nodes (docs/sweep.md): the budget's estimate and what
fits, the driver's document as typed records with each trial's cost, the table/CSV/JSON, the
progress line and the plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cloudtrain.pipeline.sweep import Estimate
from cloudtrain.pipeline.sweepdoc import parsed
from cloudtrain.pipeline.sweepread import bar, csv_text, status_lines, table
from cloudtrain.schema import SweepEnd, SweepRow

REC = SweepRow("search", "exp", {"trials": 4, "gpus_per_trial": 1,
                               "objective": {"metric": "val_loss", "goal": "minimize"}},
             1000.0, 4.0, 2)      # $4/h a node of 2 slots: $2/h a slot


def doc() -> dict[str, Any]:
    # the keys node/sweep.py writes: started/ended, intermediate, the list in trials_list
    t = [{"number": 0, "state": "COMPLETE", "params": {"lr": 0.01, "bs": 32}, "value": 0.5,
          "intermediate": 3, "started": 1000.0, "ended": 4600.0, "gpus": ["0"], "node": "n0"},
         {"number": 1, "state": "PRUNED", "params": {"lr": 0.1, "bs": 64}, "value": 0.9,
          "intermediate": 1, "started": 1000.0, "ended": 2800.0, "gpus": ["1"], "node": "n0"},
         {"number": 2, "state": "COMPLETE", "params": {"lr": 0.001, "bs": 32}, "value": 0.3,
          "intermediate": 3, "started": 1000.0, "ended": 4600.0, "gpus": ["0", "1"],
          "node": "n1"}]
    return {"trials": 4, "trials_list": t, "best": {"number": 2, "value": 0.3},
            "finished": False}


def test_the_estimate_counts_rounds_of_parallel_trials_and_says_what_fits() -> None:
    est = Estimate(trials=40, parallel=4, hours=0.5, rate=8.0)
    assert est.waves == 10 and est.usd == pytest.approx(40.0)
    assert est.trials_within(10.0) == 8          # 2 rounds of 4
    assert Estimate(5, 4, 1.0, 1.0).waves == 2


def test_each_trial_costs_its_gpus_share_for_its_duration() -> None:
    res = parsed(REC, doc())
    costs = {t.number: t.cost_usd for t in res.trials}
    assert costs == {0: pytest.approx(2.0), 1: pytest.approx(1.0), 2: pytest.approx(4.0)}
    assert res.spent_usd == pytest.approx(7.0)
    assert res.best == 2
    assert res.count("complete") == 2 and res.count("pruned") == 1
    # one trial left at the mean (1 h x 2/3 + 0.5 h x 1/3 = 5/6 h) on one slot ($2/h)
    assert res.estimate_usd == pytest.approx(7.0 + 5 / 6 * 2.0, abs=1e-5)
    assert json.loads(json.dumps(res.as_dict()))["trials"][2]["gpus"] == ["0", "1"]


def test_the_table_and_the_csv_mark_the_best() -> None:
    res = parsed(REC, doc())
    assert "2*" in table(res).splitlines()[3]
    lines = csv_text(res).splitlines()
    assert lines[0].startswith("trial,state,value") and lines[3].startswith("2*,complete,0.3")


def test_status_has_a_progress_bar_the_best_and_the_money() -> None:
    text = "\n".join(status_lines(parsed(REC, doc())))
    assert bar(3, 4) in text and "3/4" in text
    assert "best: trial 2 = 0.3" in text and "spent: $7.0000" in text


def test_the_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("optuna")
    from cloudtrain.pipeline.sweepplot import importances, plot

    res = parsed(REC, doc())
    assert set(importances(list(res.trials), True)) == {"lr", "bs"}
    out = plot(res, str(tmp_path / "s.png"))
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_the_ledger_keeps_the_sweep_and_its_trials(tmp_path: Path) -> None:
    from cloudtrain.pipeline.sweepdoc import from_ledger, ledger_rows
    from cloudtrain.state import open_state

    state = open_state(tmp_path)
    state.add_sweep(REC)
    res = parsed(REC, doc())
    state.set_sweep_trials("search", res.spent_usd, ledger_rows(res))
    row = state.get_sweep("search")
    assert row is not None and row.spent_usd == pytest.approx(7.0) and row.slots_per_node == 2
    kept = from_ledger(row, state.sweep_trials("search"), "the cluster went down")
    assert kept.best == 2
    assert [t.as_dict() for t in kept.trials] == [
        {**t.as_dict(), "intermediates": 0} for t in res.trials]
    # That reading was not the sweep's end (a trial still to run): never shown as final.
    assert not kept.finished and kept.incomplete and kept.as_dict()["incomplete"]
    lines = status_lines(kept)
    assert "(INCOMPLETE)" in lines[0] and "(finished)" not in lines[0]
    assert "before its end was read" in lines[-1] and "went with the nodes" in lines[-1]
    # A reading that was the end (here: stopped on its budget) is kept as final, with why.
    state.set_sweep_trials("search", res.spent_usd, ledger_rows(res),
                           SweepEnd(True, "the cluster's budget (max_cost_usd) was spent", 2000.0))
    row = state.get_sweep("search")
    assert row is not None and row.finished and row.updated_at == 2000.0
    final = from_ledger(row, state.sweep_trials("search"), "the cluster went down (budget)")
    assert final.finished and not final.incomplete
    lines = status_lines(final)
    assert "(finished)" in lines[0] and "stopped: the cluster's budget" in lines[3]
    assert "final results" in lines[-1]
    state.add_sweep(REC)                   # the same name started again: a fresh entry
    assert state.sweep_trials("search") == []


def test_cost_report_lists_the_sweep_as_one_entry_with_its_trials(tmp_path: Path) -> None:
    from cloudtrain.ledger import sweeps_json
    from cloudtrain.pipeline.sweepdoc import ledger_rows
    from cloudtrain.state import open_state

    state = open_state(tmp_path)
    state.add_sweep(REC)
    res = parsed(REC, doc())
    state.set_sweep_trials("search", res.spent_usd, ledger_rows(res))
    (entry,) = sweeps_json(state)
    assert entry["name"] == "search" and entry["cluster"] == "exp"
    assert entry["spent_usd"] == pytest.approx(7.0)
    trials = entry["trials"]
    assert isinstance(trials, list) and [t["number"] for t in trials] == [0, 1, 2]
    assert trials[2]["gpus"] == ["0", "1"] and trials[2]["cost_usd"] == pytest.approx(4.0)
    assert trials[0]["params"] == {"lr": 0.01, "bs": 32}


def test_cancel_says_the_drivers_reason_and_the_trials_it_stops() -> None:
    from cloudtrain.pipeline.sweepread import cancel_words

    said = json.dumps({"name": "s", "stopped": "cancelled (sweep cancel)",
                       "counts": {"running": 2}})
    assert cancel_words("s", said) == ("Sweep s stopped: cancelled (sweep cancel); 2 running "
                                       "trial(s) get SIGTERM and their stop_grace.")
    assert cancel_words("s", "") == "Sweep s cancelled."
    assert cancel_words("s", "not json") == "not json"


def test_keep_final_reads_the_heads_results_only_from_a_local_node_and_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a self-stopped local head left is kept before the cluster is removed; the file is
    # untrusted: only under the cluster's folder, a JSON object, at most MAX_DOC bytes.
    from types import SimpleNamespace

    from cloudtrain.pipeline import sweepdoc
    from cloudtrain.schema import ClusterRow, NodeRow
    from cloudtrain.state import open_state

    home = tmp_path / "home"
    state = open_state(home)
    cdir = home / "clusters" / "exp"
    root = cdir / "local" / "nodes" / "0" / "root"
    node = NodeRow("exp", 0, "i0", "127.0.0.1", 22, "u", "127.0.0.1", "running", str(root))
    state.upsert_cluster(ClusterRow("exp", "local", "UP", 1, 900.0, 900.0))
    state.replace_nodes("exp", [node])
    state.add_sweep(REC)
    env = SimpleNamespace(state=state, cluster_dir=lambda name: home / "clusters" / name)
    f = root / ".cloudtrain" / "sweeps" / "search" / "results.json"
    f.parent.mkdir(parents=True)
    out = tmp_path / "elsewhere.json"                            # a path outside the cluster
    out.write_text(json.dumps(dict(doc(), finished=True)))
    f.symlink_to(out)
    assert sweepdoc.keep_final(env, "exp") == []
    f.unlink()
    assert sweepdoc.keep_final(env, "exp") == []                 # nothing left: nothing kept
    f.write_text("[1, 2]")
    assert sweepdoc.keep_final(env, "exp") == []                 # not an object
    monkeypatch.setattr(sweepdoc, "MAX_DOC", 100)
    f.write_text(json.dumps(dict(doc(), finished=True)))
    assert sweepdoc.keep_final(env, "exp") == []                 # too large
    monkeypatch.setattr(sweepdoc, "MAX_DOC", 1 << 20)
    f.write_text(json.dumps(dict(doc(), finished=True, stopped="budget words",
                                 written_at=float("inf"))))
    assert sweepdoc.keep_final(env, "exp") == ["search"]
    row = state.get_sweep("search")
    assert row is not None and row.finished and row.stopped == "budget words"
    assert row.updated_at is not None and row.updated_at < 1e10  # an absurd time is not kept
    assert [t.number for t in state.sweep_trials("search")] == [0, 1, 2]
    assert sweepdoc.keep_final(env, "exp") == []                 # its end is kept already
    # On a cloud the head's disk is not here: nothing is read.
    state.upsert_cluster(ClusterRow("exp", "aws", "UP", 1, 900.0, 900.0))
    state.add_sweep(REC)
    assert sweepdoc.keep_final(env, "exp") == []
