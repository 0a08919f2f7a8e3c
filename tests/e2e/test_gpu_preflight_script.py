"""bench/gpu_preflight.sh, the script run on a lent GPU machine, on its CPU path here (no
nvidia-smi on PATH): every part runs with only Python + torch and writes its figures under
$OUT, so that the first run on the GPU machine is not its first run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, needs_torch

pytestmark = [needs_torch]


def test_the_cpu_path_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "out"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"}
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_preflight.sh")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    for part in ("(a) node checks: exit 0", "(b) all-reduce, 2 process(es): exit 0",
                 "(c) train.py bf16, 2 process(es)", "(d) bootstrap/node.sh check-only: exit 0"):
        assert part in summary, summary
    assert "nvidia-smi: not found: the CPU path" in summary
    assert "(b2) verdict: Preflight of 'this machine' passed: 1 CPU node(s), 2 rank(s)" in summary
    assert json.loads((out / "verdict.json").read_text())["ok"] is True
    node = json.loads((out / "node.json").read_text())
    assert node["nvidia_smi"]["gpus"] == [] and node["matmul"][0]["gflops"] > 0
    ar = json.loads((out / "allreduce.json").read_text())
    assert ar["backend"] == "gloo" and ar["world_size"] == 2
    assert ar["allreduce"][-1]["bytes"] == 16 << 20 and ar["transport"]["via"] == ["gloo/tcp"]
    train = json.loads((out / "train" / "result.json").read_text())
    assert train["precision"] == "bf16" and train["world_size"] == 2
    assert train["samples_per_sec"] > 0
    assert "::result gpus=0" in (out / "d_node_sh.log").read_text()
    assert "::fail" not in (out / "d_node_sh.log").read_text()
    assert not list(out.glob("train/checkpoints"))     # the checkpoints stay out of $OUT
