"""cloudtrain.gpuuse: the nvidia-smi answer of each recorded-format fixture parsed into
records, the idle rule, and untrusted output (garbage, oversized, a hang) never failing."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cloudtrain import gpuuse

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "nvidia_smi"


def node_answer(fixture: str | None, *, bin_dir: str | None = str(FAKE), timeout_s: float = 10,
                home: Path | None = None) -> str:
    """What a node prints for the GPU part of the status round trip, with the stub on PATH."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home or "/nonexistent")}
    if fixture is not None:
        env["CT_FAKE_NVIDIA_SMI"] = str(FAKE / fixture)
    return subprocess.run(["bash", "-c", gpuuse.remote_script(bin_dir, timeout_s)],
                          capture_output=True, text=True, env=env, timeout=60).stdout


def parsed(fixture: str | None, job: bool = False, **kw: object) -> gpuuse.NodeGPUs:
    return gpuuse.parse(gpuuse.split_output(node_answer(fixture, **kw))[1], 3, job_running=job)


def test_a100_node_with_an_idle_gpu_during_a_job() -> None:
    n = parsed("a100_8x_idle.csv", job=True)
    assert n.state == "ok" and n.rank == 3 and len(n.gpus) == 8
    assert {g.name for g in n.gpus} == {"NVIDIA A100-SXM4-80GB"}
    assert n.idle == ["5"]
    g0 = n.gpus[0]
    assert (g0.index, g0.util_pct, g0.mem_used_mib, g0.mem_total_mib, g0.temp_c) == \
        ("0", 98.0, 71234.0, 81920.0, 66.0)
    assert g0.power_w == pytest.approx(352.41) and g0.power_limit_w == 400.0
    assert n.total("mem_total_mib") == 8 * 81920
    line = gpuuse.node_line(n)
    assert "8 GPUs (8x NVIDIA A100-SXM4-80GB)" in line and "99% max" in line
    assert "IDLE during the job: GPU 5" in line and gpuuse.IDLE_RULE in line
    js = n.as_json()
    assert js["count"] == 8 and js["idle_gpus"] == ["5"] and len(js["gpus"]) == 8
    assert js["gpus"][5]["idle"] is True and js["gpus"][0]["idle"] is False


def test_no_job_no_idle_flag() -> None:
    n = parsed("a100_8x_idle.csv", job=False)
    assert n.idle == [] and "IDLE" not in gpuuse.node_line(n)


def test_h100_node() -> None:
    n = parsed("h100_8x.csv", job=True)
    assert n.state == "ok" and len(n.gpus) == 8 and n.idle == []
    assert n.models == "8x NVIDIA H100 80GB HBM3"
    assert n.mean_util() == pytest.approx(94.0) and n.max_util() == 96.0
    assert "power 4974 W of 5600 W" in gpuuse.node_line(n)


def test_power_not_available() -> None:
    n = parsed("h100_8x_na_power.csv", job=True)
    assert len(n.gpus) == 8 and all(g.power_w is None and g.power_limit_w is None for g in n.gpus)
    assert n.dropped_lines == 0 and "power n/a" in gpuuse.node_line(n)


def test_mig_gpus_have_no_utilisation_and_are_never_called_idle() -> None:
    n = parsed("a100_8x_mig.csv", job=True)
    assert len(n.gpus) == 8 and all(g.util_pct is None for g in n.gpus)
    assert n.gpus[2].mem_used_mib == 39936 and n.idle == []
    assert "util -" in gpuuse.node_line(n)


def test_no_nvidia_smi_and_no_devices() -> None:
    n = parsed(None, bin_dir=None)           # nothing on PATH (the stub's folder is not there)
    assert n.state == "no-gpu" and gpuuse.node_line(n) == "node 3: no GPU (no nvidia-smi on this node)"
    n = parsed(None)                         # the stub with no file: exit 127 like no nvidia-smi
    assert n.state == "no-gpu"
    n = parsed("no_devices.csv")
    assert n.state == "no-gpu" and "found no GPU" in n.detail


def test_a_hanging_nvidia_smi_is_cut_off() -> None:
    t0 = time.monotonic()
    n = parsed("hang.csv", timeout_s=1)
    assert time.monotonic() - t0 < 10
    assert n.state == "error" and "did not answer in time" in n.detail and not n.gpus


def test_the_idle_rule() -> None:
    g = gpuuse.GPU("0", "x", util_pct=0.0, mem_used_mib=3.0)
    assert gpuuse.is_idle(g)
    assert not gpuuse.is_idle(gpuuse.GPU("0", "x", util_pct=0.0, mem_used_mib=40000.0))
    assert not gpuuse.is_idle(gpuuse.GPU("0", "x", util_pct=35.0, mem_used_mib=3.0))
    assert not gpuuse.is_idle(gpuuse.GPU("0", "x", util_pct=None, mem_used_mib=3.0))


def test_garbage_is_dropped_not_fatal() -> None:
    block = ("0, NVIDIA H100 80GB HBM3, 93, 76012, 81559, 58, 612.34, 700.00\n"
             "\x1b[31mhello, world\n"
             "1, NVIDIA H100 80GB HBM3, nan, -5, inf, 1e400, abc, [Not Supported]\n"
             "2, \x00\x07weird\u202ename, 101, 1, 2, 3, 4, 5\n"
             "x, y\n,,,,,,,\n"
             "rc=0\n")
    n = gpuuse.parse(block, 0, job_running=True)
    assert n.state == "ok" and [g.index for g in n.gpus] == ["0", "1", "2"]
    bad = n.gpus[1]
    assert (bad.util_pct, bad.mem_used_mib, bad.mem_total_mib, bad.temp_c, bad.power_w,
            bad.power_limit_w) == (None, None, None, None, None, None)
    assert n.gpus[2].util_pct == 100.0 and n.gpus[2].name.isprintable()
    assert n.dropped_lines == 3
    assert "3 unreadable line(s) dropped" in gpuuse.node_line(n)
    only_garbage = gpuuse.parse("Failed to initialize NVML: Driver/library version mismatch\nrc=18\n")
    assert only_garbage.state == "error" and "exit 18" in only_garbage.detail
    assert "version mismatch" in only_garbage.detail
    assert gpuuse.parse(None).state == "error"


def test_oversized_output_is_capped(tmp_path: Path) -> None:
    big = tmp_path / "big.csv"
    line = "0, NVIDIA H100 80GB HBM3, 93, 76012, 81559, 58, 612.34, 700.00\n"
    big.write_text(line * 200_000)           # ~13 MB from an untrusted node
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "CT_FAKE_NVIDIA_SMI": str(big)}
    out = subprocess.run(["bash", "-c", gpuuse.remote_script(str(FAKE))], capture_output=True,
                         text=True, env=env, timeout=60).stdout
    assert len(out) <= gpuuse.MAX_BYTES + 200          # cut on the node
    n = gpuuse.parse(gpuuse.split_output(out)[1])
    assert n.state == "ok" and len(n.gpus) == gpuuse.MAX_GPUS
    assert n.dropped_lines > 0
    # and cut here too, whatever the node sends
    n = gpuuse.parse(line * 100_000)
    assert len(n.gpus) == gpuuse.MAX_GPUS and n.dropped_lines < gpuuse.MAX_BYTES // 60 + 2


def test_the_stub_refuses_another_query() -> None:
    r = subprocess.run([str(FAKE / "nvidia-smi"), "--query-gpu=name", "--format=csv"],
                       capture_output=True, text=True,
                       env=dict(os.environ, CT_FAKE_NVIDIA_SMI=str(FAKE / "h100_8x.csv")))
    assert r.returncode == 2 and "unexpected arguments" in r.stderr


def test_the_query_matches_the_stub() -> None:
    text = (FAKE / "nvidia-smi").read_text()
    assert "--query-gpu=" + ",".join(gpuuse.FIELDS) in text and gpuuse.QUERY.startswith("nvidia-smi ")
