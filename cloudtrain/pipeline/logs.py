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


def show(env: Env, name: str, *, node: int | None, follow: bool, job_id: str | None) -> None:
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
    running = launch is not None and launch.status == "RUNNING" and known is not None
    if (follow and running) or (known is not None and not _node_files(folder, node)):
        _stream_from_nodes(env, name, job, node, follow and running)
        return
    if not folder.is_dir():
        raise UserError(f"No logs for job '{job}' of '{name}'.", "List jobs with 'cloudtrain status'.")
    for key, f in _node_files(folder, node):
        rank = key // 2
        with open(f, errors="replace") as fh:
            for line in fh:
                env.ui.node_line(rank, line.rstrip("\n"))
    if launch is not None and launch.exit_code not in (None, 0):
        env.ui.warn(f"job {job} ended with exit code {launch.exit_code}"
                    + (f" (node {launch.failed_node})" if launch.failed_node is not None else ""))


def _stream_from_nodes(env: Env, name: str, job: str, node: int | None, follow: bool) -> None:
    handle = get_handle(env, name)
    ranks = [n.rank for n in handle.nodes if node is None or n.rank == node]
    group = connect(env, handle, timeout=30)
    sink = LogSink(env, env.logs_dir(name) / job, "", echo=True)

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
        sink.close()
        group.close()
