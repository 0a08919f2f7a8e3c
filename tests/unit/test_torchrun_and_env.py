from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cloudtrain.pipeline import torchrun
from cloudtrain.spec import parse_task
from cloudtrain.taskmodel import Train


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse with torchrun's own argument parser, so a flag it does not know fails here."""
    run = pytest.importorskip("torch.distributed.run")
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    return run.get_args_parser().parse_args(argv[3:])


def _worker(ns: argparse.Namespace) -> list[str]:
    """The command line each worker runs: torchrun starts 'bash -c STRING' (--no-python), and
    STRING is 'exec' and the worker's arguments quoted for the shell."""
    assert ns.no_python is True and ns.training_script == "bash"
    assert ns.training_script_args[0] == "-c" and len(ns.training_script_args) == 2
    words = shlex.split(ns.training_script_args[1])
    assert words[0] == "exec"
    return words[1:]


NODE1 = torchrun.NodeInfo(rank=1, num_nodes=2, node_ip="10.0.0.11", head_ip="10.0.0.10",
                          master_port=29555, gpus=0)


def test_static_rendezvous_names_rank_head_and_local_address() -> None:
    t = Train(script="train.py", args=["--epochs", "3"], nproc_per_node=2)
    ns = _parse(torchrun.command(t, NODE1, "job1"))
    assert ns.node_rank == 1
    assert ns.master_addr == "10.0.0.10" and ns.master_port == 29555
    assert ns.local_addr == "10.0.0.11"
    assert ns.nnodes == "2" and ns.nproc_per_node == "2"
    assert _worker(ns) == ["python", "-u", "train.py", "--epochs", "3"]


@pytest.mark.parametrize("rank,is_host", [(0, "1"), (1, "0")])
def test_c10d_rendezvous_sets_endpoint_local_addr_and_is_host(rank: int, is_host: str) -> None:
    t = Train(module="pkg.train", rendezvous="c10d", max_restarts=2)
    node = torchrun.NodeInfo(rank=rank, num_nodes=2, node_ip=f"10.0.0.1{rank}", head_ip="10.0.0.10",
                             master_port=29500, gpus=8)
    ns = _parse(torchrun.command(t, node, "job-42"))
    assert ns.rdzv_backend == "c10d"
    assert ns.rdzv_endpoint == "10.0.0.10:29500"
    assert ns.rdzv_id == "job-42"
    assert ns.rdzv_conf == f"is_host={is_host}"
    assert ns.local_addr == f"10.0.0.1{rank}"
    assert ns.nproc_per_node == "8"  # auto = the node's GPUs
    assert ns.max_restarts == 2
    assert _worker(ns) == ["python", "-u", "-m", "pkg.train"]


def test_worker_wrapper_keeps_script_and_args() -> None:
    t = Train(script="train.py", args=["--lr", "0.1"], nproc_per_node=1)
    argv = torchrun.command(t, NODE1, "j", worker_wrapper="/n/ctworker.sh")
    ns = _parse(argv)
    assert ns.no_python is True
    assert ns.training_script == "bash"
    assert _worker(ns) == ["bash", "/n/ctworker.sh", "python", "-u", "train.py", "--lr", "0.1"]


HOSTILE_ARGS = ["--n", "3", "--max", "2", "--nnodes", "9", "--node-rank=5", "-m", "x", "--",
                "--master", "it's", "a b", "$HOME", "`id`", "--rdzv", "--no"]


def test_script_args_that_abbreviate_torchrun_options_reach_the_script_unchanged() -> None:
    # torchrun's parser took '--n' / '--max' in train.args ("ambiguous option"): they must
    # reach the script untouched, whatever they look like.
    t = Train(script="train.py", args=HOSTILE_ARGS, nproc_per_node=1)
    for wrapper in (None, "/n/ctworker.sh"):
        ns = _parse(torchrun.command(t, NODE1, "j", worker_wrapper=wrapper))
        assert ns.nnodes == "2" and ns.node_rank == 1 and ns.max_restarts == 0
        assert _worker(ns)[-len(HOSTILE_ARGS):] == HOSTILE_ARGS


@pytest.mark.timeout(120)
def test_real_torchrun_passes_abbreviated_args_to_the_script(tmp_path: Path) -> None:
    """The command as built, run by the installed torchrun on this machine (one node, one
    process): the script prints the arguments it got."""
    pytest.importorskip("torch.distributed.run")
    (tmp_path / "train.py").write_text(
        "import json, sys\nprint('ARGV=' + json.dumps(sys.argv[1:]))\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    (tmp_path / "bin" / "python").chmod(0o755)
    t = Train(script="train.py", args=HOSTILE_ARGS, nproc_per_node=1)
    node = torchrun.NodeInfo(rank=0, num_nodes=1, node_ip="127.0.0.1", head_ip="127.0.0.1",
                             master_port=0, gpus=0)
    argv = torchrun.command(t, node, "j")
    argv = [a.replace("--master-port=0", "--master-port=29731") for a in argv]
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=110, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = [ln for ln in r.stdout.splitlines() if ln.startswith("ARGV=")]
    import json

    assert got and json.loads(got[0][len("ARGV="):]) == HOSTILE_ARGS, r.stdout + r.stderr


def test_auto_nproc_is_one_on_cpu_nodes() -> None:
    assert torchrun.nproc(Train(script="t.py"), gpus=0) == 1
    assert torchrun.nproc(Train(script="t.py"), gpus=4) == 4
    assert torchrun.nproc(Train(script="t.py", nproc_per_node=3), gpus=8) == 3


def test_job_env_has_every_contract_variable(tmp_path: Path) -> None:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.keys import ClusterKeys
    from cloudtrain.pipeline.run import job_env, script
    from cloudtrain.schema import ClusterRow, NodeRow
    from cloudtrain.state import open_state
    from cloudtrain.ui import UI

    nodes = [NodeRow("c", r, f"i{r}", f"h{r}", 22, "u", f"10.1.0.{r + 10}", "running", "/r",
                     iface="eth0", python_bin="/opt/venv/bin", gpus=4) for r in range(3)]
    row = ClusterRow("c", "local", "UP", 3, 0, 0, master_port=29511, nodes=nodes)
    env = Env(tmp_path, open_state(tmp_path), UI(quiet=True))
    handle = Handle(row, provider=None, keys=ClusterKeys(tmp_path))  # type: ignore[arg-type]
    task = parse_task("num_nodes: 3\nrun: echo\nenvs: {LR: 0.1, CLOUDTRAIN_JOB_ID: nope}\n")
    e = job_env(env, handle, nodes[2], task.envs, "job9", {"EXTRA": "1"})
    assert e["CLOUDTRAIN_CLUSTER"] == "c"
    assert e["CLOUDTRAIN_NODE_RANK"] == "2"
    assert e["CLOUDTRAIN_NUM_NODES"] == "3"
    assert e["CLOUDTRAIN_NODE_IPS"] == "10.1.0.10\n10.1.0.11\n10.1.0.12"
    assert e["CLOUDTRAIN_HEAD_IP"] == e["MASTER_ADDR"] == "10.1.0.10"
    assert e["MASTER_PORT"] == "29511"
    assert e["CLOUDTRAIN_GPUS_PER_NODE"] == "4"
    assert e["GLOO_SOCKET_IFNAME"] == e["NCCL_SOCKET_IFNAME"] == "eth0"
    assert e["LR"] == "0.1" and e["EXTRA"] == "1"
    assert e["CLOUDTRAIN_JOB_ID"] == "job9"  # the stop marker cannot be overridden
    text = script(nodes[2], e, "python train.py")
    lines = text.splitlines()
    assert "export PATH=/opt/venv/bin:\"$PATH\"" in lines
    assert lines.index("export PATH=/opt/venv/bin:\"$PATH\"") < lines.index("python train.py")
