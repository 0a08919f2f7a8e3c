"""A node's worker fills all of the node's GPU slots (docs/sweep.md, "What runs where"): on one
local node with 2 declared slots, a 2-trial sweep runs both trials at once, one per slot. Before
the CLI put ``slots`` in the driver's spec, the worker ran one trial at a time in slot 0
(found by bench/bench_sweep.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, wait_until

TASK = """\
name: fill
num_nodes: 1
resources: {provider: local, local: {gpus: 2}}
run: |
  echo "$CUDA_VISIBLE_DEVICES $(date +%s.%N)" >> SEEN/start
  sleep 3
  echo '{"step": 0, "score": 1}' >> "$CLOUDTRAIN_METRICS_FILE"
  echo "$CUDA_VISIBLE_DEVICES $(date +%s.%N)" >> SEEN/end
"""

SWEEP = """\
task: task.yaml
params:
  x: {uniform: [0.0, 1.0]}
objective: {metric: score}
trials: 2
sampler: random
pruner: none
"""


@pytest.mark.e2e
@needs_sshd
def test_two_trials_run_at_once_on_a_node_with_two_slots(cli: CLI, tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    seen.mkdir()
    (tmp_path / "task.yaml").write_text(TASK.replace("SEEN", str(seen)))
    (tmp_path / "fill.yaml").write_text(SWEEP)
    r = cli.run("sweep", str(tmp_path / "fill.yaml"), "-y", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

    def ended() -> bool:
        return (seen / "end").exists() and len((seen / "end").read_text().splitlines()) >= 2

    assert wait_until(ended, 240, step=0.5)
    starts = dict(line.split() for line in (seen / "start").read_text().splitlines())
    ends = dict(line.split() for line in (seen / "end").read_text().splitlines())
    assert sorted(starts) == ["0", "1"], starts          # one trial per slot
    # both ran at once: each started before the other ended
    assert max(float(t) for t in starts.values()) < min(float(t) for t in ends.values())

    def told() -> bool:
        r = cli.run("sweep", "results", "fill", "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        trials = json.loads(r.stdout)["trials"]
        return sorted(g for t in trials for g in t["gpus"]) == ["0", "1"]

    assert wait_until(told, 60, step=1)
