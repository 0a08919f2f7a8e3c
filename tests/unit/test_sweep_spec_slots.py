"""The spec the CLI starts the driver with carries each node's GPU slots (docs/sweep.md, "The
spec the driver reads"): a node's worker runs ``slots // gpus_per_trial`` trials at once, and
without the key it ran one trial per node, leaving the other slots idle (found by
bench/bench_sweep.py: 4 trials on 1 node x 4 slots ran one after another in slot 0)."""

from __future__ import annotations

import json
from pathlib import Path

from cloudtrain.pipeline.sweep import load, spec_json
from cloudtrain.schema import NodeRow

TASK = """\
name: exp
num_nodes: 2
resources: {provider: local, local: {gpus: 4}}
run: echo hi
"""

SWEEP = """\
task: task.yaml
params:
  x: {uniform: [0.0, 1.0]}
objective: {metric: score}
trials: 8
gpus_per_trial: GPUS
sampler: random
pruner: none
"""


def spec(tmp_path: Path, gpus: int) -> dict:
    (tmp_path / "task.yaml").write_text(TASK)
    f = tmp_path / "s.yaml"
    f.write_text(SWEEP.replace("GPUS", str(gpus)))
    head = NodeRow("exp", 0, "i", "127.0.0.1", 22, "u", "127.0.0.1", "running", "/r")
    return json.loads(spec_json(load(str(f), None), [head]))


def test_the_driver_spec_says_each_nodes_gpu_slots(tmp_path: Path) -> None:
    doc = spec(tmp_path, 1)
    assert doc["slots"] == 4 and doc["gpus_per_trial"] == 1


def test_the_slots_are_the_nodes_not_the_trials(tmp_path: Path) -> None:
    doc = spec(tmp_path, 2)            # 2 trials of 2 GPUs at once on each node
    assert doc["slots"] == 4 and doc["gpus_per_trial"] == 2
