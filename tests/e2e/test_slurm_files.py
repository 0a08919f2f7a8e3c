"""outputs: and file_mounts: on provider: slurm, through the real CLI against the test cluster.
Every file moves through the login node (here: local) and the shared filesystem (here: a
folder of this machine that both slurmd nodes see): the nodes' outputs arrive in the outputs
folder after the job (also a failing one's), `cloudtrain outputs` pulls them on demand, `down`
leaves the workdir on the shared filesystem, a link the job leaves cannot make the pull write
outside the outputs folder, local file_mounts are seen by the job on both nodes, and a bucket
mount is fetched from the S3 emulator by rclone on the login node."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import CLI, needs_sshd
from slurmkit import SlurmCluster, needs_slurm, slurm, slurm_cluster  # noqa: F401
from test_slurm_login_ssh import LoginNode

pytestmark = [needs_slurm, pytest.mark.e2e]


def task(tmp_path: Path, run: str, **extra: object) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    doc = {"name": "files", "num_nodes": 2, "max_hours": 0.25, "workdir": ".",
           "resources": {"provider": "slurm", "accelerators": "H100:1",
                         "slurm": {"workdir": str(tmp_path / "shared" / "files")}},
           "outputs": ["out/"], "run": run, **extra}
    f = proj / "job.yaml"
    f.write_text(json.dumps(doc))          # JSON is YAML
    return f


def test_outputs_of_both_nodes_arrive_also_when_the_job_fails_and_stay_after_down(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "proj" / "data" / "x.txt").write_text("mounted\n")
    (tmp_path / "cfg.json").write_text('{"lr": 1}\n')
    absolute = tmp_path / "site" / "cfg.json"
    f = task(tmp_path, 'mkdir -p out\n'
             'echo "$(cat inputs/x.txt) $(cat conf/cfg.json) $(cat ' + str(absolute) + ')" '
             '> out/from-$CLOUDTRAIN_NODE_RANK-$SLURMD_NODENAME.txt\n'
             'if [ -n "$FAIL" ] && [ "$CLOUDTRAIN_NODE_RANK" = 1 ]; then exit 3; fi\n'
             # node 0 still runs when node 1 fails: srun ends it (--kill-on-bad-exit)
             'if [ -n "$FAIL" ]; then sleep 60; fi\n',
             file_mounts={"inputs": "./data", "conf/cfg.json": "../cfg.json",
                          str(absolute): "../cfg.json"})
    got = tmp_path / "proj" / "cloudtrain-outputs" / "out"
    r = cli.run("launch", str(f), "-y")
    assert r.returncode == 0, r.stderr
    want = 'mounted {"lr": 1} {"lr": 1}\n'
    assert {p.name: p.read_text() for p in got.iterdir()} == {
        "from-0-n1.txt": want, "from-1-n2.txt": want}, r.stderr
    assert "Outputs: " in r.stderr

    # The cause is node 1's exit code, not that of node 0, which srun ended because of it
    # (CI under load: node 0 was still running, and its 137 was said first).
    failed = cli.run("launch", str(f), "--env", "FAIL=2")
    assert failed.returncode == 3, failed.stderr
    assert "failed on node 1 (exit code 3; node 0 ended after it" in failed.stderr, failed.stderr
    assert (got / "from-1-n2.txt").exists()
    assert "Outputs: " in failed.stderr           # pulled although the job failed

    # On demand: what the job (or anyone) wrote since comes back with `outputs`, also once
    # the allocation has ended behind cloudtrain's back (the files stay on the shared fs).
    (alloc,) = [j["id"] for j in slurm.jobs()]
    slurm.run("scancel", alloc)
    deadline = time.time() + 30
    while slurm.jobs() and time.time() < deadline:
        time.sleep(0.5)
    assert slurm.jobs() == []
    (tmp_path / "shared" / "files" / "out" / "late.txt").write_text("late\n")
    pulled = cli.run("outputs", "files")
    assert pulled.returncode == 0, pulled.stderr
    assert (got / "late.txt").read_text() == "late\n"

    down = cli.run("down", "files")
    assert down.returncode == 0, down.stderr
    assert slurm.jobs() == []
    # down deletes nothing the job wrote on the shared filesystem
    assert (tmp_path / "shared" / "files" / "out" / "from-0-n1.txt").read_text() == want


def test_a_link_left_by_the_job_cannot_write_outside_the_outputs_folder(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine\n")
    f = task(tmp_path, 'mkdir -p out/sub\n'
             'echo ok > out/ok.txt\n'
             f'ln -sfn {victim} out/escape\n'             # a link to a folder outside
             'ln -sfn ../../.. out/sub/up\n'              # a link climbing out
             f'ln -sfn {victim} whole\n',                 # an output that IS a link
             outputs=["out/", "whole"])
    r = cli.run("launch", str(f), "-y")
    assert r.returncode == 0, r.stderr
    outs = tmp_path / "proj" / "cloudtrain-outputs"
    assert (outs / "out" / "ok.txt").read_text() == "ok\n"
    for link in (outs / "out" / "escape", outs / "out" / "sub" / "up", outs / "whole"):
        assert not link.exists() and not link.is_symlink(), link
    assert "not copied" in r.stderr
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (victim / "keep.txt").read_text() == "mine\n"


def test_outputs_climbing_out_and_an_unwritable_mount_exit_2_leaving_nothing_queued(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    f = task(tmp_path, "true", outputs=["../elsewhere"])
    r = cli.run("launch", str(f), "-y")
    assert r.returncode == 2, r.stderr
    assert "outputs" in r.stderr and "Traceback" not in r.stderr
    assert slurm.jobs() == []

    (tmp_path / "d").mkdir()
    (tmp_path / "a-file").write_text("")
    bad = f"{tmp_path}/a-file/d"                  # under a file: no user can write there
    f = task(tmp_path, "true", file_mounts={bad: "../d"})
    r = cli.run("launch", str(f), "-y")
    assert r.returncode == 2, r.stderr
    assert f"file_mounts target '{bad}'" in r.stderr and "is not a folder" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert slurm.jobs() == []


def test_a_bucket_mount_is_fetched_on_the_login_node_and_seen_by_both_nodes(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    import storage_emulators as emus

    emu = emus.start("s3", tmp_path / "emulator")
    try:
        emu.put("datasets/d1/corpus.txt", b"from the bucket\n")
        f = task(tmp_path, 'mkdir -p out\n'
                 'cat data/corpus.txt > out/seen-$CLOUDTRAIN_NODE_RANK.txt\n',
                 file_mounts={"data": emu.url("datasets/d1")}, envs=emu.envs)
        r = cli.run("launch", str(f), "-y", "--down")
        assert r.returncode == 0, r.stderr
        got = tmp_path / "proj" / "cloudtrain-outputs" / "out"
        assert [(got / f"seen-{k}.txt").read_text() for k in (0, 1)] == ["from the bucket\n"] * 2
        assert "fetched " + emu.url("datasets/d1") in r.stderr
        assert len([ln for ln in emu.requests("/datasets/d1/corpus.txt") if "GET " in ln]) == 1
    finally:
        emu.stop()


def test_no_rclone_on_the_login_node_exits_2(slurm: SlurmCluster, cli: CLI,
                                             tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"        # this machine's programs, less rclone
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        for p in Path(d).glob("*") if Path(d).is_dir() else []:
            if p.name != "rclone" and not (bin_dir / p.name).exists():
                (bin_dir / p.name).symlink_to(p)
    f = task(tmp_path, "true", file_mounts={"data": "s3://bucket/x"})
    r = cli.run("launch", str(f), "-y", PATH=str(bin_dir))
    assert r.returncode == 2, r.stderr
    assert "has no rclone" in r.stderr and "Traceback" not in r.stderr
    assert slurm.jobs() == []


def test_ctrl_c_pulls_what_the_job_wrote_so_far(slurm: SlurmCluster, cli: CLI,
                                                tmp_path: Path) -> None:
    f = task(tmp_path, 'mkdir -p out\necho "part $CLOUDTRAIN_NODE_RANK" > '
             'out/part-$CLOUDTRAIN_NODE_RANK.txt\necho "started"\nsleep 300\n')
    proc = cli.popen("launch", str(f), "-y")
    try:
        assert proc.stdout is not None
        seen = ""
        deadline = time.time() + 90
        while seen.count("started") < 2 and time.time() < deadline:
            seen += proc.stdout.readline()
        assert seen.count("started") == 2, seen
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    got = tmp_path / "proj" / "cloudtrain-outputs" / "out"
    assert sorted(p.read_text() for p in got.iterdir()) == ["part 0\n", "part 1\n"], err
    assert cli.run("down", "files").returncode == 0
    assert slurm.jobs() == []


def test_down_pulls_the_outputs_a_launch_could_not_pull(slurm: SlurmCluster, cli: CLI,
                                                        tmp_path: Path) -> None:
    outs = tmp_path / "proj" / "cloudtrain-outputs"
    # The job runs on this machine here: it blocks the local outputs folder with a file, as a
    # full or unmounted disk would make the pull after the job fail.
    f = task(tmp_path, f'mkdir -p out\necho kept > out/a.txt\nrm -rf {outs}\n'
             f'echo blocker > {outs}\n')
    r = cli.run("launch", str(f), "-y")
    assert r.returncode == 0, r.stderr
    assert "is not a plain directory" in r.stderr, r.stderr
    outs.unlink()
    down = cli.run("down", "files")
    assert down.returncode == 0, down.stderr
    assert "were never pulled: pulling them before the teardown" in down.stderr, down.stderr
    assert (outs / "out" / "a.txt").read_text() == "kept\n"
    assert slurm.jobs() == []


@needs_sshd
def test_over_ssh_to_the_login_node_mounts_go_and_outputs_come_back(
        slurm: SlurmCluster, cli: CLI, tmp_path: Path) -> None:
    login = LoginNode(tmp_path / "login", slurm)
    login.start()
    try:
        (tmp_path / "proj" / "data").mkdir(parents=True)
        (tmp_path / "proj" / "data" / "x.txt").write_text("over ssh\n")
        f = task(tmp_path, 'mkdir -p out\ncp inputs/x.txt out/x-$CLOUDTRAIN_NODE_RANK.txt\n'
                 'ln -sfn / out/root\n', file_mounts={"inputs": "./data"})
        doc = json.loads(f.read_text())
        doc["resources"]["slurm"].update(login=f"root@127.0.0.1:{login.port}",
                                         identity_file=str(login.key))
        f.write_text(json.dumps(doc))
        # Slurm is reached only through the login node: this process's SLURM_CONF is hidden
        hidden = {"SLURM_CONF": str(tmp_path / "no-such-slurm.conf")}
        r = cli.run("launch", str(f), "-y", "--down", **hidden)
        assert r.returncode == 0, r.stderr
        got = tmp_path / "proj" / "cloudtrain-outputs" / "out"
        assert sorted(p.name for p in got.iterdir()) == ["x-0.txt", "x-1.txt"], r.stderr
        assert (got / "x-1.txt").read_text() == "over ssh\n"
        assert slurm.jobs() == []
    finally:
        login.stop()
