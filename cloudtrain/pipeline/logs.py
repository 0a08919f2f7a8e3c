"""``cloudtrain logs``: replay a job's per-node logs, or follow them live from the nodes."""

from __future__ import annotations

import shlex
from pathlib import Path, PurePosixPath

from cloudtrain.cluster import connect, get_handle
from cloudtrain.context import Env
from cloudtrain.errors import RemoteError, UserError
from cloudtrain.pipeline.remote_job import LogSink, follow_command, job_dir
from cloudtrain.remote import bash
from cloudtrain.schema import NodeRow


def _latest_job(env: Env, name: str) -> str | None:
    launches = [r for r in env.state.launches(name) if not r.job_id.startswith("exec-")]
    if launches:
        return launches[-1].job_id
    folder = env.logs_dir(name)
    if folder.is_dir():
        jobs = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("exec-"))
        if jobs:
            return jobs[-1]
    return None


def _node_files(folder: Path, node: int | None) -> list[tuple[int, Path]]:
    out = []
    for f in folder.glob("node-*.log"):
        stem = f.name[len("node-"):-len(".log")]
        rank_s, _, kind = stem.partition(".")
        if not rank_s.isdigit() or (node is not None and int(rank_s) != node):
            continue
        out.append((int(rank_s) * 2 + (0 if kind == "setup" else 1), f))
    return sorted(out)


def _jobs(env: Env, name: str) -> list[str]:
    """The cluster's jobs with logs here, oldest first (exec sessions left out)."""
    folder = env.logs_dir(name)
    jobs = {r.job_id for r in env.state.launches(name) if not r.job_id.startswith("exec-")}
    if folder.is_dir():
        jobs |= {p.name for p in folder.iterdir()
                 if p.is_dir() and not p.name.startswith("exec-") and _node_files(p, None)}
    return sorted(jobs)


def _what_exists(env: Env, name: str, nodes: list[int]) -> str:
    """'Its nodes: 0, 1. Jobs: A, B (the latest last): cloudtrain logs NAME --job ID.'"""
    jobs = _jobs(env, name)
    shown = ", ".join(jobs[-5:]) + (f" and {len(jobs) - 5} older" if len(jobs) > 5 else "")
    said = f"Nodes: {', '.join(map(str, nodes))}. " if nodes else ""
    if jobs:
        said += f"Jobs (the latest last): {shown}; pick one with --job ID."
    else:
        said += "No job has logs yet."
    return said


def show(env: Env, name: str, *, node: int | None, follow: bool, job_id: str | None) -> None:
    """A job's logs (the latest, or ``job_id``), every node's or ``node``'s. A job or node
    that does not exist, or a node with no log, is refused (exit 2) naming what exists."""
    from cloudtrain.names import check, inside

    check(name)
    if job_id is not None:
        inside(env.logs_dir(name), job_id)   # a job id is one name under the cluster's logs
    known = env.state.get_cluster(name)
    job = job_id or _latest_job(env, name)
    if job is None:
        if known is None:
            from cloudtrain.errors import ClusterNotFound

            raise ClusterNotFound(name, [c.name for c in env.state.list_clusters()])
        raise UserError(f"Cluster '{name}' has run no job yet.",
                        f"Start one: cloudtrain launch TASK -c {name}")
    launch = next((r for r in env.state.launches(name) if r.job_id == job), None)
    folder = env.logs_dir(name) / job
    logged = sorted({k // 2 for k, _ in _node_files(folder, None)})
    nodes = list(range(known.num_nodes)) if known is not None else logged
    if launch is None and not logged:
        raise UserError(f"'{name}' has no job '{job}'.", _what_exists(env, name, nodes))
    if node is not None and node not in nodes:
        raise UserError(f"'{name}' has no node {node}" + (" now" if known is not None else
                                                           f" in the logs of job {job}") + ".",
                        _what_exists(env, name, nodes))
    running = launch is not None and launch.status == "RUNNING" and known is not None
    if (follow and running) or (known is not None and not _node_files(folder, node)):
        shown = _stream_from_nodes(env, name, job, node, follow and running)
    else:
        shown = 0
        for key, f in _node_files(folder, node):
            rank = key // 2
            with open(f, errors="replace") as fh:
                for line in fh:
                    env.ui.node_line(rank, line.rstrip("\n"))
                    shown += 1
    where = f"node {node}" if node is not None else "any node"
    if shown == 0 and running and follow:
        env.ui.warn(f"Job {job} of '{name}' printed nothing on {where}.")
    elif shown == 0 and running:
        env.ui.warn(f"Job {job} of '{name}' runs and has printed nothing yet on {where}; "
                    f"follow it: cloudtrain logs {name} -f")
    elif shown == 0:
        raise UserError(f"Job {job} of '{name}' has no log lines from {where}"
                        + (f" (nodes with logs: {', '.join(map(str, logged))})." if logged
                           else " (it printed nothing, or its nodes are gone)."),
                        _what_exists(env, name, nodes))
    if launch is not None and launch.exit_code not in (None, 0):
        env.ui.warn(f"job {job} ended with exit code {launch.exit_code}"
                    + (f" (node {launch.failed_node})" if launch.failed_node is not None else ""))


def _stream_from_nodes(env: Env, name: str, job: str, node: int | None, follow: bool) -> int:
    """The job's log from the nodes themselves (written here as it comes). Returns how many
    lines came."""
    handle = get_handle(env, name)
    ranks = [n.rank for n in handle.nodes if node is None or n.rank == node]
    group = connect(env, handle, timeout=30)
    logs = LogSink(env, env.logs_dir(name) / job, "", echo=True)
    count = [0]

    def sink(rank: int, line: str) -> None:
        count[0] += 1
        logs(rank, line)

    def cmd(n: NodeRow) -> str:
        log = str(PurePosixPath(job_dir(n, job)) / "node.log")
        return bash(f"cat {shlex.quote(log)} 2>/dev/null")

    try:
        if not follow:
            group.run(cmd, on_line=sink, combine=True, ranks=ranks)
        else:
            # ctjob.sh's follower: resumes after a dropped connection, ends with its SSH
            # session, and exits with the job's code once the job has ended.
            res = group.follow_all(lambda n, off: follow_command(job_dir(n, job), off), sink, ranks,
                                   on_note=env.ui.warn)
            lost = [r.error for r in res.values() if r.error is not None]
            if lost:
                raise lost[0] if isinstance(lost[0], RemoteError) else RemoteError(str(lost[0]))
            codes = {r: x.exit_code for r, x in res.items() if x.exit_code is not None}
            if len(codes) == len(ranks):
                bad = [(r, c) for r, c in sorted(codes.items()) if c != 0]
                env.state.finish_launch(job, "FAILED" if bad else "SUCCEEDED",
                                        bad[0][1] if bad else 0, bad[0][0] if bad else None)
    finally:
        logs.close()
        group.close()
    return count[0]
