"""The small truths of issue 24, through the real CLI: errors about a task file's top level
name the fields; 'H100x8' is answered with 'H100:8'; `gpus` hides slices of a GPU behind
--fractional and folds an offer sold at the same price in several regions into one row;
durations carry a unit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import CLI
from cloudtrain.units import duration


@pytest.mark.parametrize("body,fields", [
    ("run: echo hi\ntrain:\n  script: t.py\n", "fields 'run' and 'train'"),
    ("num_nodes: 1\n", "fields 'run' and 'train'"),
])
def test_top_level_errors_name_the_fields(cli: CLI, tmp_path: Path, body: str, fields: str) -> None:
    task = tmp_path / "task.yaml"
    task.write_text("name: t\n" + body)
    r = cli.run("cost", str(task))
    assert r.returncode == 2, r.stdout + r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith(f"error: {task}, line ") and f": {fields}: give " in first, first
    assert "(top)" not in r.stderr and "Traceback" not in r.stderr
    if "run:" in body:   # at the first named field's line
        assert first.startswith(f"error: {task}, line 2: "), first


def test_sweep_top_level_error_names_the_fields(cli: CLI, tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text("name: t\nrun: echo\n")
    sweep = tmp_path / "grid.yaml"
    sweep.write_text("task: task.yaml\nparams:\n  lr: {uniform: [0.1, 0.2]}\n"
                     "objective: {metric: loss, goal: minimize}\nsampler: grid\ntrials: 4\n")
    r = cli.run("sweep", str(sweep), "-y")
    assert r.returncode == 2, r.stdout + r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith(f"error: {sweep}, line 5: fields 'sampler' and 'params': "), first
    assert "(top)" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("spelled", ["H100x8", "8xH100", "8 x h100", "H100*8"])
def test_gpu_count_spelled_otherwise_suggests_name_colon_count(cli: CLI, spelled: str) -> None:
    r = cli.run("gpus", spelled)
    assert r.returncode == 2
    assert "Did you mean 'H100:8' (NAME:COUNT)?" in r.stderr, r.stderr
    assert cli.run("gpus", "H100:8").returncode == 0


def test_task_accelerators_h100x8_suggests_h100_8(cli: CLI, tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text("name: t\nresources:\n  accelerators: H100x8\nrun: echo\n")
    r = cli.run("cost", str(task))
    assert r.returncode == 2
    assert "unknown GPU 'H100x8'" in r.stderr and "Did you mean 'H100:8'" in r.stderr


def _rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    assert lines[0].split()[:3] == ["PROVIDER", "INSTANCE", "GPU"], lines[:2]
    return [re.split(r"\s{2,}", ln.strip()) for ln in lines[1:]]


def test_gpus_hides_fractional_offers_behind_a_flag(cli: CLI) -> None:
    every = json.loads(cli.run("gpus", "--json").stdout)
    slices = [o for o in every if not float(o["accelerator_count"]).is_integer()]
    assert slices, "the snapshot has slices of a GPU (e.g. AWS g6f)"
    r = cli.run("gpus")
    assert r.returncode == 0
    counts = " ".join(ln.split("  ")[0] + ln for ln in r.stdout.splitlines()[1:])
    assert "0.125" not in counts and "0.25" not in counts
    assert f"{len(slices)} offers with a fraction of a GPU per node" in r.stderr
    assert "--fractional shows them" in r.stderr
    shown = cli.run("gpus", "--fractional")
    assert "0.125" in shown.stdout and "fraction of a GPU" not in shown.stderr
    # one model: the same
    model = slices[0]["accelerator"]
    r = cli.run("gpus", model, "--all")
    assert all(float(row[2].split(":")[1]).is_integer() for row in _rows(r.stdout))
    r = cli.run("gpus", model, "--all", "--fractional")
    assert any(not float(row[2].split(":")[1]).is_integer() for row in _rows(r.stdout))


def test_gpus_folds_an_offer_sold_alike_in_several_regions(cli: CLI) -> None:
    every = json.loads(cli.run("gpus", "L4:1", "--provider", "gcp", "--json").stdout)
    r = cli.run("gpus", "L4:1", "--provider", "gcp", "--all")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    # no two rows the same offer at the same price; the '+N' rows account for every region
    keys = [(row[0], row[1], row[2], row[7]) for row in rows]
    assert len(keys) == len(set(keys)), keys
    more = [int(m.group(1)) for row in rows if (m := re.search(r" \+(\d+)$", row[6]))]
    assert more, r.stdout
    assert len(rows) + sum(more) == len(every)
    assert f"{len(every)} with their regions" in r.stderr


def test_durations_carry_a_unit() -> None:
    assert duration(8.24) == "8.2 s"
    assert duration(245) == "4 min 05 s"
    assert duration(2 * 3600 + 3 * 60) == "2 h 03 min"
    assert duration(3 * 86400 + 4 * 3600) == "3 d 04 h"
