"""A failing job reads in a few lines, through the real CLI on local nodes: the training
template with a bad flag in train.args (2 nodes x 2 processes) fails on every rank at once;
the terminal names the failing rank (node and local rank) with one exit code (the command's
own), that rank's last lines once, and where the logs are. torchrun's tracebacks and the
other ranks' echoes are in the log files, and ``-v`` shows them; ``logs --node`` shows a
node's log, and refuses a node that does not exist naming those that do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, needs_torch

pytestmark = [needs_sshd, needs_torch, pytest.mark.e2e]

BAD = "--no-such-flag"


def _task(proj: Path) -> Path:
    p = proj / "bad.yaml"
    p.write_text(
        "name: failing\nnum_nodes: 2\nresources:\n  provider: local\nworkdir: .\n"
        "envs:\n  OMP_NUM_THREADS: '1'\n"
        "train:\n  script: train.py\n  nproc_per_node: 2\n"
        f"  args: ['--max-steps', '2', '{BAD}']\n")
    return p


def _after_start(stderr: str) -> list[str]:
    """The terminal's lines from the job's start on (stdout carries none on a failure)."""
    lines = stderr.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("» Running job"))
    return lines[start:]


def test_failed_template_reads_in_ten_lines_with_one_code(cli: CLI, tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    assert cli.run("init", str(proj)).returncode == 0
    task = _task(proj)

    r = cli.run("launch", str(task), "-y", timeout=400)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    # Nothing of the workers on stdout: their echoes and torchrun's tracebacks stay in the logs.
    assert r.stdout.strip() == "", r.stdout[-3000:]
    said = _after_start(r.stderr)
    assert len(said) <= 10, "\n".join(said)
    job_id = said[0].split()[3]
    # line by line: the start, the stop naming the failing rank, the report, its last lines
    # (argparse's error once), and where the full logs are
    assert said[0] == f"» Running job {job_id} on 2 node(s)"
    stop = re.fullmatch(r"! rank (\d) \(node (\d), local rank (\d)\) failed: stopping the job on "
                        r"every node \(SIGTERM, then SIGKILL after 60 s: stop_grace\)", said[1])
    assert stop, said[1]
    rank, node, local = (int(x) for x in stop.groups())
    assert rank == node * 2 + local   # static rendezvous: 2 processes per node
    assert said[2] == (f"error: The job failed: rank {rank} (node {node}, local rank {local}) "
                       "exited with code 2; the other ranks were stopped. Its last lines:")
    tail = said[3:-1]
    assert 1 <= len(tail) <= 6 and all(ln.startswith("  | ") for ln in tail), tail
    assert tail[-1] == f"  | train.py: error: unrecognized arguments: {BAD}"
    log = cli.home / "logs" / "failing" / job_id / f"node-{node}.log"
    assert said[-1] == (f"Full logs: {log}, or 'cloudtrain logs failing --node {node}'; every "
                        "rank's output live: launch -v.")
    # One exit code everywhere, and it is the command's.
    assert set(re.findall(r"code (\d+)", r.stderr)) == {"2"}, r.stderr
    assert r.stderr.count("unrecognized arguments") == 1
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
    # The log files have it all: every local rank's echo and torchrun's traceback.
    text = log.read_text()
    assert text.count(f"unrecognized arguments: {BAD}") == 2 and "ChildFailedError" in text
    assert "[ct-rank" not in text   # torchrun's rank prefix is taken off

    # logs --node N shows that node's log; a node that does not exist is refused, naming those
    # that do and the job.
    shown = cli.run("logs", "failing", "--node", str(node))
    assert shown.returncode == 0, shown.stderr
    assert f"(node-{node}) train.py: error: unrecognized arguments: {BAD}" in shown.stdout
    assert f"(node-{1 - node})" not in shown.stdout
    missing = cli.run("logs", "failing", "--node", "7")
    assert missing.returncode == 2 and missing.stdout == ""
    assert "has no node 7" in missing.stderr and "Nodes: 0, 1." in missing.stderr
    assert job_id in missing.stderr and "Traceback" not in missing.stderr
    nojob = cli.run("logs", "failing", "--job", "20200101-000000-abcdef")
    assert nojob.returncode == 2 and "has no job" in nojob.stderr and job_id in nojob.stderr

    # -v: every rank's output live, as before (argparse's usage from all four, the tracebacks).
    v = cli.run("launch", str(task), "-y", "-v", timeout=400)
    assert v.returncode == 2, v.stderr[-3000:]
    assert v.stdout.count(f"unrecognized arguments: {BAD}") == 4, v.stdout[-3000:]
    assert "ChildFailedError" in v.stdout

    assert cli.run("down", "failing", "-y").returncode == 0
    assert_nothing_left(cli.home)
