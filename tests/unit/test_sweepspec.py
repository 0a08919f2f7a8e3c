"""The sweep file (cloudtrain/sweepspec.py): typed, validated, errors naming field and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from cloudtrain.errors import SpecError
from cloudtrain.sweepspec import load_sweep, parse_sweep

GOOD = """\
task: task.yaml
cluster: exp
params:
  lr: {loguniform: [1.0e-5, 1.0e-2]}
  batch_size: {choice: [32, 64, 128]}
  warmup_steps: {int: [0, 500]}
objective: {metric: val_loss, goal: minimize}
trials: 40
parallel: auto
gpus_per_trial: 1
sampler: tpe
pruner: median
max_cost_usd: 30
down: true
"""


def _bad(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_sweep(text)
    assert info.value.exit_code == 2
    assert "\n" not in info.value.message
    return info.value


def _with(param_line: str, **extra: str) -> str:
    text = GOOD.replace("  warmup_steps: {int: [0, 500]}", param_line)
    for k, v in extra.items():
        text = text.replace(f"{k}: ", f"{k}: {v} #", 1)
    return text


def test_the_issue_example_parses_into_typed_records() -> None:
    s = parse_sweep(GOOD)
    assert s.trials == 40 and s.parallel == "auto" and s.sampler == "tpe" and s.down is True
    assert s.params["lr"].kind == "loguniform" and s.params["lr"].low == 1.0e-5
    assert s.params["batch_size"].choices == (32, 64, 128)
    d = s.as_dict()
    assert d["params"]["warmup_steps"] == {"kind": "int", "low": 0, "high": 500, "log": False,
                                           "step": 1}
    assert d["objective"] == {"metric": "val_loss", "goal": "minimize"}
    assert parse_sweep(_with("  w: {int: [1, 64], log: true}")).params["w"].log is True
    assert parse_sweep(_with("  w: {int: [0, 100], step: 10}")).params["w"].step == 10


def test_an_unknown_distribution_is_named_with_its_line() -> None:
    e = _bad(_with("  warmup_steps: {lognormal: [0, 500]}"))
    assert e.field == "params.warmup_steps" and e.line == 6
    assert "unknown distribution 'lognormal'" in e.message and "loguniform" in e.message


def test_an_empty_choice_list_is_refused() -> None:
    e = _bad(_with("  opt: {choice: []}"))
    assert e.field == "params.opt" and "non-empty list" in e.message


def test_low_above_high_is_refused() -> None:
    e = _bad(_with("  warmup_steps: {int: [500, 0]}"))
    assert e.field == "params.warmup_steps" and "low 500 is above high 0" in e.message
    assert "above high" in _bad(_with("  d: {uniform: [0.9, 0.1]}")).message


def test_loguniform_needs_a_positive_low() -> None:
    e = _bad(_with("  wd: {loguniform: [0, 0.1]}"))
    assert e.field == "params.wd" and "low > 0" in e.message


@pytest.mark.parametrize("line, words", [
    ("  w: {int: [0.5, 3]}", "whole-number bounds"),
    ("  w: {int: [0, 64], log: true}", "starts at 1"),
    ("  w: {int: [1, 64], log: true, step: 2}", "not both"),
    ("  w: {uniform: [0, 1], step: 2}", "int only"),
    ("  w: {uniform: [0, 1], choice: [1]}", "exactly one distribution"),
    ("  w: {uniform: [0]}", "two bounds"),
    ("  w: {uniform: [0, .inf]}", "not a finite number"),
    ("  w: 0.1", "write a distribution"),
    ("  w: {choice: [1, 1]}", "twice"),
    ("  w: {choice: [[1]]}", "not a number"),
    ("  2w: {choice: [1]}", "not a name"),
])
def test_other_bad_distributions_name_the_parameter(line: str, words: str) -> None:
    e = _bad(_with(line))
    assert e.field.startswith("params") and words in e.message, e.message


def test_grid_refuses_a_continuous_distribution() -> None:
    e = _bad(GOOD.replace("sampler: tpe", "sampler: grid"))
    assert "grid sampler" in e.message and "'lr'" in e.message
    ok = parse_sweep(_with("  warmup_steps: {int: [0, 4]}").replace("sampler: tpe", "sampler: grid")
                     .replace("{loguniform: [1.0e-5, 1.0e-2]}", "{choice: [0.1, 0.01]}"))
    assert ok.sampler == "grid"


@pytest.mark.parametrize("old, new, field, words", [
    ("sampler: tpe", "sampler: cmaes", "sampler", "'tpe'"),
    ("pruner: median", "pruner: sometimes", "pruner", "'median'"),
    ("goal: minimize", "goal: lower", "objective.goal", "'minimize'"),
    ("trials: 40", "trials: 0", "trials", "greater than or equal to 1"),
    ("parallel: auto", "parallel: many", "parallel", "'auto'"),
    ("gpus_per_trial: 1", "gpus_per_trial: 0", "gpus_per_trial", "greater than or equal"),
    ("max_cost_usd: 30", "max_cost_usd: -1", "max_cost_usd", "greater than 0"),
    ("cluster: exp", "cluster: 'a b'", "cluster", "not a cluster name"),
    ("down: true", "downn: true", "downn", "unknown field"),
    ("trials: 40\n", "", "trials", "is required"),
])
def test_bad_fields_exit_2_naming_the_field(old: str, new: str, field: str, words: str) -> None:
    e = _bad(GOOD.replace(old, new))
    assert e.field == field and words in e.message, e.message


def test_an_unknown_field_offers_the_close_name_and_its_line() -> None:
    e = _bad(GOOD.replace("down: true", "downn: true"))
    assert e.line == 14 and "'down'" in e.hint


def test_the_file_must_be_a_mapping() -> None:
    assert "mapping" in _bad("- a\n- b\n").message


def test_load_resolves_the_task_beside_the_file(tmp_path: Path) -> None:
    f = tmp_path / "sweep.yaml"
    f.write_text(GOOD)
    assert load_sweep(f).task == str(tmp_path / "task.yaml")
    with pytest.raises(SpecError, match="cannot read"):
        load_sweep(tmp_path / "nope.yaml")
