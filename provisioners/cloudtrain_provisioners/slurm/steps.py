"""A job as one step of the cluster's allocation: the workdir synced to the shared filesystem
through the login node (rsync), a step script written there, and ``srun --jobid`` running it
once on every node (one task a node, labelled with its rank, so Slurm tracks and accounts
every process and ``scancel`` ends them all). Each node's exit code comes from srun's own
report ("task N: Exited with exit code C", or the signal that ended it), in the order srun
reported them: the first failure first."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Callable, Mapping

from cloudtrain.errors import ProviderError

from cloudtrain_provisioners.slurm.login import Login

_LABELLED = re.compile(r"^\s*(\d+): ?(.*)$")
_TASK_END = re.compile(r"srun: error: \S+: tasks? ([\d,\-]+): (?:Exited with exit code (\d+)|"
                       r"(Killed|Terminated|[A-Z][a-z]+ ?\w*))")
_SIGNALS = {"Killed": signal.SIGKILL, "Terminated": signal.SIGTERM, "Aborted": signal.SIGABRT,
            "Segmentation fault": signal.SIGSEGV, "Bus error": signal.SIGBUS}


def step_script(job_id: str, workdir: str, env: Mapping[str, str], modules: list[str],
                python: str | None, body: str) -> str:
    lines = ["#!/usr/bin/env bash", f"# written by cloudtrain: job {job_id}, one task a node"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += ['export CLOUDTRAIN_NODE_RANK="$SLURM_NODEID"',
              f"export CLOUDTRAIN_WORKDIR={shlex.quote(workdir)}"]
    lines += [f"module load {shlex.quote(m)} || exit 1" for m in modules]
    if python:
        lines.append(f"export PATH={shlex.quote(str(Path(python).parent))}:\"$PATH\"")
    lines.append(f"cd {shlex.quote(workdir)} || exit 1")
    lines.append(body)
    return "\n".join(lines) + "\n"


def sync(login: Login, local: Path, workdir: str, filters: list[str]) -> None:
    """rsync the local workdir's contents into the remote workdir (nothing there deleted;
    ``filters``: rsync's, what is never sent: .git, the outputs folder, cloudtrain's home)."""
    if not local.is_dir():
        raise ProviderError(f"the workdir {local} is not a folder.", "Fix workdir in the task.")
    r = login.run(["mkdir", "-p", "--", workdir])
    if not r.ok:
        raise ProviderError(f"cannot create {workdir} on the login node: {r.words()}",
                            "Give resources.slurm.workdir a folder on the shared filesystem "
                            "that you can write.")
    argv = ["rsync", "-a", *filters, f"{local}/", login.rsync_dest(workdir) + "/"]
    if login.spec != "local":
        argv[1:1] = ["-e", login.rsync_shell()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise ProviderError(f"rsync to the login node failed: {done.stderr.strip()[:300]}",
                            "Check the login node and the workdir's space, then run again.")


def run(login: Login, allocation: str, num_nodes: int, job_id: str, workdir: str, script: str,
        line: Callable[[int, str], None], share: list[str]) -> dict[int, int]:
    """Write the step script into the workdir and run it with srun on every node (``share``:
    srun's options for the step's part of each node; []: whole nodes); each node's exit
    code by rank, the ranks srun reported in its order first (128 + the signal for a task a
    signal ended: a node srun ended after another's bad exit says 143)."""
    path = f"{workdir}/.cloudtrain/steps/{job_id}.sh"
    r = login.run(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", path],
                  stdin=script)
    if not r.ok:
        raise ProviderError(f"cannot write the step script on the login node: {r.words()}",
                            "Check the workdir on the shared filesystem, then run again.")
    argv = ["srun", f"--jobid={allocation}", "-N", str(num_nodes), "--ntasks-per-node=1",
            "--label", "--kill-on-bad-exit=1", "-J", step_name(job_id), *share, "bash", path]
    proc = subprocess.Popen(login.argv(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    codes = {rank: 0 for rank in range(num_nodes)}
    reported: list[int] = []
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            text = raw.rstrip("\n")
            end = _TASK_END.search(text)
            if end:
                for rank in _ranks(end.group(1)):
                    codes[rank] = int(end.group(2)) if end.group(2) else \
                        128 + _SIGNALS.get(end.group(3), signal.SIGKILL)
                    reported += [] if rank in reported else [rank]
                continue
            m = _LABELLED.match(text)
            if m:
                line(int(m.group(1)), m.group(2))
            elif text.strip():
                line(-1, text)                   # srun's own words
        rc = proc.wait()
    except BaseException:
        _cancel_step(login, allocation, job_id)
        proc.wait(60)
        raise
    if rc != 0 and not reported:
        return {rank: rc for rank in codes}
    return {r: codes[r] for r in reported + [r for r in codes if r not in reported]}


def step_name(job_id: str) -> str:
    """A step's Slurm name: ``ct-job-<id>`` for a job or an exec (what the guard, ``queue``
    and ``cancel`` count as jobs), ``ct-bootstrap-<alloc>`` for bootstrap's probe."""
    return f"ct-{job_id}" if job_id.startswith("bootstrap-") else f"ct-job-{job_id}"


def _ranks(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _cancel_step(login: Login, allocation: str, job_id: str) -> None:
    """scancel this job's step (the allocation stays)."""
    r = login.run(["squeue", "-h", "-s", "-j", allocation, "-o", "%i %j"])
    steps = [ln.split()[0] for ln in r.out.splitlines()
             if ln.split()[1:] == [step_name(job_id)]] if r.ok else []
    if steps:
        login.run(["scancel", *steps])
