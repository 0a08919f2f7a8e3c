"""GPU use through the real CLI on 2 local sshd nodes with a stub nvidia-smi
(tests/fakes/nvidia_smi) on the nodes' PATH: ``status --refresh`` (table and --json) and
``top`` (--once, and live over one connection per node until Ctrl-C)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "nvidia_smi"


@pytest.fixture
def gpu_cluster(cli: CLI, tmp_path: Path) -> tuple[CLI, Path, list[Path]]:
    """A 2-node local cluster whose Python folder holds the stub nvidia-smi: node 0 answers
    with the 8x A100 file (GPU 5 idle), node 1 has no file (no nvidia-smi)."""
    import sys

    bin_dir = tmp_path / "gpuenv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "nvidia-smi").symlink_to(FAKE / "nvidia-smi")
    task = tmp_path / "gpus.yaml"
    task.write_text("name: gpus\nnum_nodes: 2\nresources:\n  provider: local\n"
                    f"  local: {{python: {bin_dir / 'python'}}}\nrun: sleep 60\n")
    r = cli.run("up", str(task), "-y")
    assert r.returncode == 0, r.stderr + r.stdout
    homes = sorted(cli.home.glob("clusters/gpus/local/nodes/*/root"))
    assert len(homes) == 2
    (homes[0] / ".fake-nvidia-smi").write_text("a100_8x_idle.csv\n")
    return cli, task, homes


def status_json(cli: CLI) -> dict:  # type: ignore[type-arg]
    r = cli.run("status", "gpus", "--refresh", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]


def test_status_refresh_shows_gpus_and_flags_idle_during_a_job(gpu_cluster) -> None:  # type: ignore[no-untyped-def]
    cli, task, homes = gpu_cluster
    r = cli.run("status", "gpus", "--refresh")
    assert r.returncode == 0, r.stderr
    assert "gpus: node 0: 8 GPUs (8x NVIDIA A100-SXM4-80GB), util 85% mean / 99% max, " \
           "mem 486.9/640.0 GiB, temp 69 C max, power 2545 W of 3200 W" in r.stdout
    assert "gpus: node 1: no GPU (no nvidia-smi on this node)" in r.stdout
    assert "IDLE" not in r.stdout                      # no job runs: nothing is called idle
    # A plain status reaches no node: with every node's sshd frozen (a connection would hang)
    # it answers at once with what that --refresh saw, and its age.
    pids = [int(p.read_text()) for p in cli.home.glob("clusters/gpus/local/nodes/*/sshd.pid")]
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        plain = cli.run("status", "gpus", timeout=60)
        took = time.monotonic() - t0
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert plain.returncode == 0 and took < 8, (took, plain.stderr)
    assert "gpus: GPUs as of " in plain.stdout and " s ago (--refresh for live):" in plain.stdout
    assert "gpus: node 0: 8 GPUs (8x NVIDIA A100-SXM4-80GB), util 85% mean" in plain.stdout
    assert "(as of " in plain.stdout and "--refresh" in plain.stderr

    js = status_json(cli)
    n0, n1 = js["gpus"]
    assert (n0["rank"], n0["state"], n0["count"], n0["models"]) == \
        (0, "ok", 8, "8x NVIDIA A100-SXM4-80GB")
    assert n0["gpus"][0] == {"index": "0", "name": "NVIDIA A100-SXM4-80GB", "util_pct": 98.0,
                             "mem_used_mib": 71234.0, "mem_total_mib": 81920.0, "temp_c": 66.0,
                             "power_w": 352.41, "power_limit_w": 400.0, "idle": False}
    assert (n1["state"], n1["count"], n1["gpus"]) == ("no-gpu", 0, [])
    (cached,) = json.loads(cli.run("status", "gpus", "--json").stdout)   # offline
    assert cached["live"] is False and js["live"] is True
    assert cached["gpus"] == js["gpus"], (cached["gpus"], js["gpus"])
    assert abs(cached["gpus_at"] - js["gpus_at"]) < 5

    # node 1 becomes an 8x H100 node; a job starts: GPU 5 of node 0 is flagged idle
    (homes[1] / ".fake-nvidia-smi").write_text("h100_8x.csv\n")
    job = cli.popen("launch", str(task), "-c", "gpus", CLOUDTRAIN_GUARD_POLL="0.3")
    try:
        assert wait_until(lambda: status_json(cli)["gpus"][0]["idle_gpus"] == ["5"], 60), \
            status_json(cli)
        js = status_json(cli)
        assert js["gpus"][1]["models"] == "8x NVIDIA H100 80GB HBM3"
        assert js["gpus"][1]["idle_gpus"] == [] and js["gpus"][0]["job_running"] is True
        r = cli.run("status", "gpus", "--refresh")
        assert "node 0: 8 GPUs" in r.stdout and "IDLE during the job: GPU 5 (idle: " in r.stdout
        assert "node 1: 8 GPUs (8x NVIDIA H100 80GB HBM3), util 94% mean / 96% max" in r.stdout
        top = cli.run("top", "gpus", "--once")
        assert top.returncode == 0, top.stderr
        rows = [ln.split() for ln in top.stdout.splitlines() if ln[:2] in ("0 ", "1 ")]
        assert len(rows) == 16
        idle = [r for r in rows if r[-1] == "IDLE"]
        assert [r[:2] for r in idle] == [["0", "5"]]
        assert "IDLE = idle: utilisation <= 1 %" in top.stdout
    finally:
        job.send_signal(signal.SIGINT)
        job.communicate(timeout=120)


def _ssh_sockets(pid: int, ports: set[int], home: Path) -> set[str]:
    """Inodes of the established TCP connections to the nodes' ports held by ``pid`` or by
    the OpenSSH masters this home's commands use (the connections live there)."""
    from conftest import processes_with

    masters = [p for p in processes_with(str(home))
               if b"ControlPersist" in Path(f"/proc/{p}/cmdline").read_bytes()]
    mine = set()
    for holder in [pid, *masters]:
        for fd in Path(f"/proc/{holder}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                mine.add(link[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) in ports and f[9] in mine:
                out.add(f[9])
    return out


def test_top_once_and_live_over_one_connection_per_node(gpu_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli, _, homes = gpu_cluster
    r = cli.run("top", "gpus", "--once")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("NVIDIA A100-SXM4-80GB") >= 8 and "no GPU" in r.stdout
    assert "node 1: no GPU" in r.stdout

    ports = {int(n["port"]) for n in status_json(cli)["nodes"]}
    out = tmp_path / "top.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen([*cli_cmd(), "top", "gpus", "--interval", "0.5"], stdout=sink,
                                stderr=subprocess.STDOUT, env=cli.env())
    try:
        assert wait_until(lambda: out.read_text().count("GPU use at") >= 2, 60), out.read_text()
        first = _ssh_sockets(proc.pid, ports, cli.home)
        frames = out.read_text().count("GPU use at")
        assert wait_until(lambda: out.read_text().count("GPU use at") >= frames + 3, 60)
        assert len(first) == 2 and _ssh_sockets(proc.pid, ports, cli.home) == first   # the same 2
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    assert rc == 0, out.read_text()[-2000:]
    assert "Traceback" not in out.read_text()


def cli_cmd() -> list[str]:
    import sys

    return [sys.executable, "-m", "cloudtrain"]


def test_a_node_printing_garbage_does_not_break_status(gpu_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli, _, homes = gpu_cluster
    junk = tmp_path / "junk.csv"
    junk.write_bytes(b"\xff\xfe\x00garbage\x1b[2J, , ,\n" + b"A" * 300_000 + b"\n")
    (homes[1] / ".fake-nvidia-smi").write_text(f"{junk}\n")
    r = cli.run("status", "gpus", "--refresh")
    assert r.returncode == 0, r.stderr
    assert "gpus: node 0: 8 GPUs (8x NVIDIA A100-SXM4-80GB)" in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("gpus: node 1:"))
    assert "GPU query failed (nvidia-smi printed nothing usable" in line and len(line) < 400
    js = status_json(cli)["gpus"][1]
    assert js["state"] == "error" and js["count"] == 0 and js["dropped_lines"] == 2


def test_a_hanging_nvidia_smi_is_cut_off_and_status_answers(gpu_cluster) -> None:  # type: ignore[no-untyped-def]
    cli, _, homes = gpu_cluster
    (homes[1] / ".fake-nvidia-smi").write_text("hang.csv\n")      # sleeps 60 s first
    t0 = time.monotonic()
    r = cli.run("status", "gpus", "--refresh")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "gpus: node 1: GPU query failed (nvidia-smi did not answer in time" in r.stdout
    assert "gpus: node 0: 8 GPUs" in r.stdout
    assert 9 < took < 25, took          # the 10 s cut, not the stub's 60 s
