"""Build the torchrun command for ``train:`` — the only launcher we use; we never write our
own rendezvous or collectives.

Works across machines with separate network stacks: static rendezvous gets the node's rank
and the head's address; c10d gets the rendezvous endpoint, ``--local-addr`` (the node's own
cluster address, so workers do not advertise an unreachable hostname) and ``is_host`` (so
exactly the head hosts the store, even when every node resolves to the same machine). The
socket-interface variables are set in the job's environment by the launcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import shlex
from dataclasses import dataclass

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Train  # annotations only: no pydantic at import



@dataclass(frozen=True)
class NodeInfo:
    rank: int
    num_nodes: int
    node_ip: str
    head_ip: str
    master_port: int
    gpus: int


def nproc(train: Train, gpus: int) -> int:
    if train.nproc_per_node == "auto":
        return max(1, gpus)
    return int(train.nproc_per_node)


# Every line a worker writes reaches the node's log through torchrun's ``--tee`` with this
# prefix (torchrun's own TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE): the CLI knows each line's
# global and local rank, strips the prefix, and keeps each rank's last lines for the failure
# report (pipeline/ranklog.py). torchrun's ``--log-dir`` keeps each rank's stdout/stderr files
# on the node as well.
PREFIX_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PREFIX_TEMPLATE = "[ct-rank ${rank} ${local_rank}] "


def command(train: Train, node: NodeInfo, job_id: str, worker_wrapper: str | None = None,
            nproc_per_node: int | None = None, log_dir: str | None = None) -> list[str]:
    n = nproc_per_node if nproc_per_node is not None else nproc(train, node.gpus)
    port = train.master_port or node.master_port
    argv = ["python", "-m", "torch.distributed.run",
            f"--nnodes={node.num_nodes}", f"--nproc-per-node={n}",
            f"--max-restarts={train.max_restarts}", "--monitor-interval=0.5",
            f"--local-addr={node.node_ip}"]
    if log_dir is not None:   # each rank's own output in its files there, and on the console
        argv += [f"--log-dir={log_dir}", "--tee=3"]
    if train.rendezvous == "static":
        argv += [f"--node-rank={node.rank}", f"--master-addr={node.head_ip}",
                 f"--master-port={port}"]
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={node.head_ip}:{port}",
                 f"--rdzv-id={job_id}", f"--rdzv-conf=is_host={1 if node.rank == 0 else 0}"]
    # The worker's own command line goes to torchrun as ONE string for 'bash -c', never as
    # separate arguments: torchrun's parser (argparse, with allow_abbrev) reads every argument,
    # also those after the script, and fails on an abbreviation of its own options
    # ('--n', '--max': "ambiguous option"), so the script's arguments must not reach it.
    worker = ["python", "-u", train.script] if train.script else \
        ["python", "-u", "-m", str(train.module)]
    if worker_wrapper:
        worker = ["bash", worker_wrapper, *worker]
    argv += ["--no-python", "bash", "-c", "exec " + shell(worker + list(train.args))]
    return argv


def shell(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
