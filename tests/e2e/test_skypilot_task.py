"""A SkyPilot task from SkyPilot's own repository (tests/fixtures/skypilot, unchanged) runs
through ``cloudtrain launch`` on two local nodes, with only ``cloud:`` set; a SkyPilot-style
``run:`` and ``exec`` read SkyPilot's node variables with our values, and a ``run:`` that
reads the GPU count on CPU nodes is warned about before its job starts
(docs/migrating-from-skypilot.md)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from conftest import CLI, REPO, needs_sshd

pytestmark = [needs_sshd, pytest.mark.e2e]

FIXTURE = REPO / "tests" / "fixtures" / "skypilot" / "multi_hostname.yaml"
WARNING = "reads $SKYPILOT_NUM_GPUS_PER_NODE, which is 0 here"


def _lines(out: str, node: int) -> list[str]:
    return [ln.split(") ", 1)[1] for ln in out.splitlines() if ln.startswith(f"(node-{node}) ")]


def test_skypilot_example_runs_with_only_cloud_set(cli: CLI, tmp_path: Path) -> None:
    original = FIXTURE.read_text()
    task = tmp_path / "multi_hostname.yaml"
    task.write_text(original + "resources:\n  cloud: local\n")   # the one change: cloud
    assert task.read_text().replace("resources:\n  cloud: local\n", "") == original

    r = cli.run("launch", str(task))
    assert r.returncode == 0, r.stderr
    host = socket.gethostname()
    # "Should see two lines: My hostname: <host1> / <host2>" (the example's own comment)
    assert _lines(r.stdout, 0) == [f"My hostname: {host}"], r.stdout
    assert _lines(r.stdout, 1) == [f"My hostname: {host}"], r.stdout
    assert "note: resources.cloud: read as resources.provider: local" in r.stderr
    # SkyPilot's name (an underscore) stays the job's name; the cluster gets the safe one
    assert "the cluster is named 'multi-hostname'" in r.stderr
    assert [c["name"] for c in cli.status()] == ["multi-hostname"]
    assert WARNING not in r.stderr      # its run: does not read the GPU count

    # A SkyPilot run: on the same cluster reads SKYPILOT_* with the values of ours; it reads
    # the GPU count on CPU nodes, so one warning line with the fix comes before the job.
    sky = tmp_path / "vars.yaml"
    sky.write_text(
        "name: multi_hostname\nnum_nodes: 2\nresources:\n  infra: local\n"
        "run: |\n"
        "  echo \"rank $SKYPILOT_NODE_RANK $CLOUDTRAIN_NODE_RANK\"\n"
        "  echo \"nodes $SKYPILOT_NUM_NODES $CLOUDTRAIN_NUM_NODES\"\n"
        "  echo \"gpus $SKYPILOT_NUM_GPUS_PER_NODE $CLOUDTRAIN_GPUS_PER_NODE\"\n"
        "  echo \"task $SKYPILOT_TASK_ID $CLOUDTRAIN_JOB_ID\"\n"
        "  echo \"ips $(echo \"$SKYPILOT_NODE_IPS\" | paste -sd,) "
        "$(echo \"$CLOUDTRAIN_NODE_IPS\" | paste -sd,)\"\n"
        "  echo \"nproc $(( SKYPILOT_NUM_GPUS_PER_NODE > 0 ? SKYPILOT_NUM_GPUS_PER_NODE : 1 ))\"\n")
    r = cli.run("launch", str(sky))
    assert r.returncode == 0, r.stderr
    assert "note: resources.infra: read as resources provider local" in r.stderr
    warned = [ln for ln in r.stderr.splitlines() if WARNING in ln]
    assert len(warned) == 1, r.stderr
    assert "$(( SKYPILOT_NUM_GPUS_PER_NODE > 0 ? SKYPILOT_NUM_GPUS_PER_NODE : 1 ))" in warned[0]
    assert r.stderr.index(WARNING) < r.stderr.index("Running job")
    for node in (0, 1):
        got = dict(ln.split(" ", 1) for ln in _lines(r.stdout, node))
        assert got["rank"] == f"{node} {node}"
        assert got["nodes"] == "2 2"
        assert got["gpus"] == "0 0"
        task_id, job_id = got["task"].split()
        assert task_id == job_id and task_id
        sky_ips, our_ips = got["ips"].split()
        assert sky_ips == our_ips and len(sky_ips.split(",")) == 2
        assert got["nproc"] == "1"

    # exec: the same variables, its own task id, and the warning for its command
    r = cli.run("exec", "multi-hostname", "--",
                "echo \"exec $SKYPILOT_NODE_RANK $SKYPILOT_TASK_ID "
                "n=$SKYPILOT_NUM_GPUS_PER_NODE\"")
    assert r.returncode == 0, r.stderr
    assert any("the command " + WARNING in ln for ln in r.stderr.splitlines()), r.stderr
    for node in (0, 1):
        (line,) = _lines(r.stdout, node)
        word, rank, task_id, n = line.split()
        assert (word, rank, n) == ("exec", str(node), "n=0")
        assert task_id.startswith("exec-")

    # A task that does not read the GPU count is not warned about
    r = cli.run("exec", "multi-hostname", "--", "echo quiet")
    assert r.returncode == 0 and WARNING not in r.stderr, r.stderr

    r = cli.run("down", "multi-hostname", "-y")
    assert r.returncode == 0, r.stderr
