"""The stop of a job's processes runs to its end even while the group's follows are being
ended: a loss (recovery's health watch) sets the group's stop event to end the follows, and
the stop that ran over the same group was cut short with them, so a surviving node's job
kept running into the next attempt, whose launch then found the cluster busy ("Cluster
'trec' is busy: job ... is running", seen in CI on
test_recovery_template::test_template_resumes_after_a_lost_node_like_an_uninterrupted_run)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_stop_is_not_cut_short_by_the_groups_stop(cli: CLI, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    task = tmp_path / "t.yaml"
    task.write_text("name: cut\nrun: 'true'\n")
    assert cli.run("up", str(task), "-y").returncode == 0
    monkeypatch.setenv("CLOUDTRAIN_HOME", str(cli.home))
    from cloudtrain.cluster import connect, get_handle
    from cloudtrain.context import open_env
    from cloudtrain.pipeline.teardown import stop_processes
    from cloudtrain.ui import UI

    env = open_env(UI(quiet=True))
    handle = get_handle(env, "cut")
    group = connect(env, handle)
    pid = 0
    try:
        # A job process that takes its stop_grace (it ignores SIGTERM), as a job saving a
        # checkpoint does; it carries the job's marker like every process of a job.
        r = group.run("CLOUDTRAIN_JOB_ID=cut-job setsid nohup bash -c "
                      "'trap \"\" TERM; while :; do sleep 1; done' >/dev/null 2>&1 & echo $!")
        pid = int(r[0].stdout.strip())
        assert wait_until(lambda: _alive(pid), 10)
        group.stop.set()          # a loss ends the group's follows
        left = stop_processes(env, handle, "CLOUDTRAIN_JOB_ID=cut-job", grace=1, group=group)
        assert left == {0: 0}, left
        assert wait_until(lambda: not _alive(pid), 5), "the job survived its stop"
    finally:
        group.close()
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        cli.run("down", "cut", "-y")
