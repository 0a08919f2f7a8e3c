"""Run the node program (cloudtrain/node/preflight.py) on every node of a cluster the way a
``train:`` job runs: the launch chain's job environment (the cluster's addresses, the
socket interface for gloo/NCCL), its torchrun line and rendezvous (pipeline/torchrun.py), one
process per GPU (one on a CPU node), started, followed and stopped everywhere on a failure
by :class:`~cloudtrain.pipeline.remote_job.RemoteJob`. The program travels inside the job's
script (a here-document), so nothing is uploaded beforehand and the workdir is untouched.
Its lines go to the cluster's logs (``preflight-...``); node 0's last line carries the
figures."""

from __future__ import annotations

import json
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.errors import UserError
from cloudtrain.pipeline import torchrun
from cloudtrain.pipeline.remote_job import JobParts, LogSink, RemoteJob, job_dir, new_job_id
from cloudtrain.pipeline.run import job_env, script
from cloudtrain.preflight.report import Measured, parse
from cloudtrain.remote import Group
from cloudtrain.schema import NodeRow

MARKER = "CT-PREFLIGHT "
PROGRAM = Path(__file__).resolve().parent.parent / "node" / "preflight.py"
EOF_WORD = "CT_PREFLIGHT_PROGRAM_END"
EXIT_FAILED = 4
"""``cloudtrain preflight``'s (and a launch stopped by its preflight's) exit code: a check
failed or a figure is below its threshold. Unused by the CLI otherwise (1: an error, 2: bad
input, 3: the budget, 130: Ctrl-C; a job's own codes pass through launch)."""


class PreflightFailed(UserError):
    """The preflight found a problem (or could not finish): exit 4, not 2 (a UserError so
    that a launch it stops is refused like one: pipeline/attempt.py)."""

    exit_code = EXIT_FAILED


@dataclass(frozen=True)
class Options:
    max_size: int | None = None      # bytes; None: the node program's default (1 GiB / 64 MiB)
    iters: int = 5
    time_limit_s: float = 300.0


@dataclass(frozen=True)
class Ran:
    job_id: str
    measured: Measured
    took_s: float
    logs: Path


class _Sink:
    """Every line to the job's log files; node 0's marker line kept."""

    def __init__(self, plain: LogSink) -> None:
        self.plain = plain
        self.found: str | None = None
        self.tail: dict[int, list[str]] = {}
        self.lock = threading.Lock()

    def __call__(self, rank: int, line: str) -> None:
        self.plain.write(rank, line)
        with self.lock:
            last = self.tail.setdefault(rank, [])
            last.append(line)
            del last[:-8]
        at = line.find(MARKER)
        if rank == 0 and at >= 0:
            self.found = line[at + len(MARKER):]
        else:
            self.plain.echo(rank, line)


def body(handle: Handle, node: NodeRow, job_id: str, opts: Options) -> str:
    """The node's job body: the program written into the job's folder, then torchrun."""
    head = handle.nodes[0]
    gpus = min((n.gpus or 0) for n in handle.nodes)
    info = torchrun.NodeInfo(rank=node.rank, num_nodes=len(handle.nodes),
                             node_ip=node.internal_ip, head_ip=head.internal_ip,
                             master_port=handle.row.master_port, gpus=gpus)
    path = str(PurePosixPath(job_dir(node, job_id)) / "preflight.py")
    args = ["run", "--out", str(PurePosixPath(job_dir(node, job_id)) / "preflight.json"),
            "--iters", str(opts.iters)]
    if opts.max_size is not None:
        args += ["--max-size", str(opts.max_size)]
    from cloudtrain.taskmodel import Train

    train = Train.model_construct(script=path, args=args, nproc_per_node="auto",
                                  rendezvous="static", max_restarts=0, master_port=None,
                                  module=None)
    cmd = torchrun.shell(torchrun.command(train, info, job_id))
    q = shlex.quote(path)
    return (f"mkdir -p {shlex.quote(job_dir(node, job_id))} && cat > {q} <<'{EOF_WORD}'\n"
            f"{PROGRAM.read_text()}\n{EOF_WORD}\n"
            f"exec timeout --kill-after=10 {int(opts.time_limit_s)} {cmd}")


def run(env: Env, handle: Handle, group: Group, opts: Options) -> Ran:
    """The node program on every node at once; raises PreflightFailed when it did not finish
    on every node (with the failing node's last lines)."""
    job_id = "preflight-" + new_job_id()
    logs = env.logs_dir(handle.name) / job_id
    plain = LogSink(env, logs, "", echo=env.ui.verbose)
    sink = _Sink(plain)
    scripts = {n.rank: script(n, job_env(env, handle, n, {}, job_id, {}),
                              body(handle, n, job_id, opts)) for n in handle.nodes}
    job = RemoteJob(env, handle, group, JobParts(job_id, scripts, sink,
                                                 [n.rank for n in handle.nodes], grace=10))
    t0 = time.monotonic()
    try:
        job.run()
    finally:
        plain.close()
    took = time.monotonic() - t0
    first = job.first_failure()
    if first is not None or sink.found is None:
        rank, code = first if first is not None else (0, 0)
        last = "\n".join(sink.tail.get(rank, [])[-6:]) or "(no output)"
        raise PreflightFailed(
            f"The preflight did not finish on node {rank} of '{handle.name}' (exit code "
            f"{code}), so the cluster is not proven: its last lines:\n{last}",
            f"All its lines: cloudtrain logs {handle.name} --job {job_id}. A node that cannot "
            "run it (no PyTorch, a broken GPU, an unreachable peer) would fail a job too; "
            f"fix it, or take the cluster down (cloudtrain down {handle.name}).")
    try:
        measured = parse(json.loads(sink.found))
    except (ValueError, KeyError, TypeError) as exc:
        raise PreflightFailed(f"The preflight's figures from node 0 could not be read ({exc}).",
                              f"See cloudtrain logs {handle.name} --job {job_id}.") from exc
    return Ran(job_id, measured, took, logs)
