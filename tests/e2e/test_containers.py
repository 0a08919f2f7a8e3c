"""Containers as the runtime, through the real CLI on local nodes with the machine's Docker
Engine: the training template as a 2-node x 2-process DDP job inside a locally built torch
image, its files the SSH user's; the next launch reuses the containers, a changed image or
option replaces them; exec and ssh --container run inside; Ctrl-C, a failing rank, the node
guard and down stop the processes inside; down leaves no container of the cluster."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import storage_emulators as emus
from conftest import CLI, assert_nothing_left, needs_sshd, processes_with, wait_until
from dockerkit import docker

pytestmark = [needs_sshd, pytest.mark.e2e, pytest.mark.usefixtures("docker_engine")]

FAST = {"CLOUDTRAIN_GUARD_POLL": "0.3", "CLOUDTRAIN_GUARD_ATTACHED_GRACE": "2"}
COMMON = ["--batch-size", "32", "--eval-every", "5", "--log-every", "1", "--num-workers", "1",
          "--warmup-steps", "3", "--patience", "0"]


def _docker(*args: str, check: bool = True) -> str:
    return docker(*args, check=check).stdout.strip()


@pytest.fixture(scope="module")
def variant_image(torch_image: str) -> Iterator[str]:
    """The torch image with one more file (/ct-variant): a changed image, made in ~1 s."""
    tag = f"ct-test/run-variant:{os.getpid()}"
    box = f"ct-test-run-variant-{os.getpid()}"
    _docker("run", "--name", box, "--network", "none", "--entrypoint", "/bin/sh", torch_image,
            "-c", "echo variant > /ct-variant")
    try:
        _docker("commit", box, tag)
    finally:
        _docker("rm", "-f", box, check=False)
    yield tag
    _docker("rmi", "-f", tag, check=False)


def _uid(cli: CLI, name: str) -> str:
    return hashlib.sha256(f"{cli.home.resolve()}:{name}".encode()).hexdigest()[:12]


@pytest.fixture
def boxes(cli: CLI) -> Iterator[list[str]]:
    """Cluster names a test uses: whatever happens, their containers are gone after it."""
    names: list[str] = []
    yield names
    for name in names:
        ids = _docker("ps", "-aq", "--filter", f"label=cloudtrain-cluster-id={_uid(cli, name)}",
                      check=False).split()
        if ids:
            _docker("rm", "-f", *ids, check=False)


def _containers(cli: CLI, name: str, all_: bool = True) -> dict[str, str]:
    """The cluster's containers, by its label: id -> rank label."""
    out = _docker("ps", *(["-a"] if all_ else []), "--no-trunc", "--filter",
                  f"label=cloudtrain-cluster-id={_uid(cli, name)}",
                  "--format", '{{.ID}} {{.Label "cloudtrain-node-rank"}}')
    return dict(line.split() for line in out.splitlines() if line.strip())


def _task(path: Path, name: str, image: str, body: str, extra: str = "") -> Path:
    path.write_text(f"name: {name}\nnum_nodes: 2\nresources:\n  provider: local\nworkdir: .\n"
                    f"stop_grace: 5\ncontainer:\n  image: {image}\n{extra}{body}")
    return path


SETUP = ("envs:\n  OMP_NUM_THREADS: '1'\n"
         "setup: |\n  test -e /.dockerenv && echo setup-inside; id -u > setup-uid\n")


def _train(proj: Path, file: str, image: str, args: list[str], extra: str = "") -> Path:
    return _task(proj / file, "tmplc", image, SETUP +
                 "train:\n  script: train.py\n  nproc_per_node: 2\n"
                 f"  args: {json.dumps(args + COMMON)}\noutputs: [outputs/]\n", extra)


def _node_root(cli: CLI, name: str, rank: int) -> Path:
    return cli.home / "clusters" / name / "local" / "nodes" / str(rank) / "root"


def _inside(pid: int) -> bool:
    """The process runs in a container (its root has Docker's /.dockerenv)."""
    return os.path.exists(f"/proc/{pid}/root/.dockerenv")


def test_template_ddp_in_the_image_reused_replaced_removed(
        cli: CLI, tmp_path: Path, torch_image: str, variant_image: str,
        boxes: list[str]) -> None:
    boxes.append("tmplc")
    proj = tmp_path / "proj"
    assert cli.run("init", str(proj)).returncode == 0

    # Every task file first: the workdir's content (and so the setup's hash) stays the same.
    first = _train(proj, "first.yaml", torch_image, ["--max-steps", "10", "--ckpt-every", "5"])
    second = _train(proj, "second.yaml", torch_image, ["--max-steps", "15", "--ckpt-every", "5"])
    probe = "run: test -e /.dockerenv && cat /ct-variant 2>/dev/null || echo plain\n"
    opt = _task(proj / "opt.yaml", "tmplc", torch_image, SETUP + probe + "outputs: [outputs/]\n",
                "  run_options: [--shm-size=256m]\n")
    var = _task(proj / "var.yaml", "tmplc", variant_image, probe)

    # 1. the template, 2 nodes x 2 processes, in the image: it trains, checkpoints come back
    r = cli.run("launch", str(first), "-y", timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("setup-inside") == 2, r.stdout[-3000:]
    # torchrun's rank prefixes came through docker exec: rank 0's lines, once, from node 0
    done = [ln for ln in r.stdout.splitlines() if re.search(r"\bstep 10/10\b", ln)]
    assert len(done) == 1 and "node-0" in done[0], done
    out = proj / "cloudtrain-outputs" / "outputs"
    res = json.loads((out / "result.json").read_text())
    assert res["world_size"] == 4 and res["final_step"] == 10, res
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*.pt")) == \
        ["step-000005.pt", "step-000010.pt"]
    # Written inside the container, on the node: the SSH user's files, not root's.
    for rank in (0, 1):
        root = _node_root(cli, "tmplc", rank)
        assert (root / "workdir" / "setup-uid").read_text().strip() == str(os.getuid())
        assert (root / "workdir" / "setup-uid").stat().st_uid == os.getuid()
    ck = _node_root(cli, "tmplc", 0) / "workdir" / "outputs" / "checkpoints" / "step-000010.pt"
    assert ck.stat().st_uid == os.getuid() and ck.stat().st_gid == os.getgid()
    first_ids = _containers(cli, "tmplc")
    assert sorted(first_ids.values()) == ["0", "1"], first_ids
    assert _containers(cli, "tmplc", all_=False) == first_ids, "both run"
    for cid in first_ids:   # the keeper too runs as the SSH user, never as the image's root
        assert _docker("inspect", "-f", "{{.Config.User}}", cid) == f"{os.getuid()}:{os.getgid()}"

    # 2. the next launch resumes in the same containers, without asking docker about them
    # (the container step, which rewrites each node's .container, is skipped)
    marks = {rank: (_node_root(cli, "tmplc", rank) / ".container").stat().st_mtime_ns
             for rank in (0, 1)}
    r = cli.run("launch", str(second), "-y", timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "setup-inside" not in r.stdout and "Setup unchanged" in r.stdout + r.stderr
    res2 = json.loads((out / "result.json").read_text())
    assert res2["start_step"] == 10 and res2["final_step"] == 15, res2
    assert _containers(cli, "tmplc") == first_ids, "the running containers were reused"
    assert marks == {rank: (_node_root(cli, "tmplc", rank) / ".container").stat().st_mtime_ns
                     for rank in (0, 1)}, "a warm launch ran the container step"

    # 3. exec and ssh --container run inside, as the SSH user, in the workdir
    r = cli.run("exec", "tmplc", "--", "test -e /.dockerenv && echo in-$CLOUDTRAIN_NODE_RANK "
                "$(id -u) $PWD")
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert f"in-{rank} {os.getuid()} {_node_root(cli, 'tmplc', rank)}/workdir" in r.stdout, \
            r.stdout
    sh = subprocess.run([sys.executable, "-m", "cloudtrain", "ssh", "tmplc", "--container",
                         "--node", "1"], input="test -e /.dockerenv && echo shell-inside $PWD\n",
                        capture_output=True, text=True, timeout=120, env=cli.env())
    assert sh.returncode == 0, sh.stderr
    assert f"shell-inside {_node_root(cli, 'tmplc', 1)}/workdir" in sh.stdout, sh.stdout
    r = cli.run("exec", "tmplc", "--node", "0", "--", "echo groups: $(id -G)")
    assert r.returncode == 0, r.stderr
    groups = r.stdout.split("groups:", 1)[1].split()
    assert {int(g) for g in groups} == {os.getgid(), *os.getgroups()}, r.stdout
    r = cli.run("exec", "tmplc", "--node", "0", "--", "exit 3")
    assert r.returncode == 3, r.stderr

    # 4. a changed option, then a changed image: the containers are replaced, and the same
    # setup runs again in the new ones (what it did in the old ones is gone)
    r = cli.run("launch", str(opt), "-y", timeout=300)
    assert r.returncode == 0 and r.stdout.count("plain") == 2, r.stdout + r.stderr
    assert r.stdout.count("setup-inside") == 2, r.stdout
    opt_ids = _containers(cli, "tmplc")
    assert len(opt_ids) == 2 and not set(opt_ids) & set(first_ids), (first_ids, opt_ids)
    r = cli.run("launch", str(var), "-y", timeout=300)
    assert r.returncode == 0 and r.stdout.count("variant") == 2, r.stdout + r.stderr
    var_ids = _containers(cli, "tmplc")
    assert len(var_ids) == 2 and not set(var_ids) & set(opt_ids), (opt_ids, var_ids)

    # 5. down: no container of the cluster, running or exited; nothing else left
    r = cli.run("down", "tmplc", "-y")
    assert r.returncode == 0, r.stderr
    assert _containers(cli, "tmplc") == {}
    assert_nothing_left(cli.home)


_SLEEPER = ("run: |\n  echo $$ > \"$HOME/pid\"\n  echo started-$CLOUDTRAIN_NODE_RANK\n"
            "  if [ \"$CLOUDTRAIN_NODE_RANK\" = \"$FAIL_ON\" ]; then sleep 1; exit 7; fi\n"
            "  exec sleep 300\n")


def _pids(cli: CLI, name: str) -> list[int]:
    out = []
    for rank in (0, 1):
        try:
            out.append(int((_node_root(cli, name, rank) / "pid").read_text()))
        except (OSError, ValueError):
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_ctrl_c_a_failing_rank_and_down_stop_the_processes_inside(
        cli: CLI, tmp_path: Path, tiny_image: str, boxes: list[str]) -> None:
    """In an image with a shell and coreutils only (no Python, nothing of cloudtrain's)."""
    boxes.append("stopc")
    task = _task(tmp_path / "s.yaml", "stopc", tiny_image, "envs: {FAIL_ON: none}\n" + _SLEEPER)

    # Ctrl-C: the job's processes inside the containers end; the containers stay for the next
    proc = cli.popen("launch", str(task), "-y")
    try:
        assert wait_until(lambda: len(_pids(cli, "stopc")) == 2, 180), "the job did not start"
        pids = _pids(cli, "stopc")
        assert all(_inside(p) for p in pids), pids
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, proc.stderr.read() if proc.stderr else ""
    assert wait_until(lambda: not any(_alive(p) for p in pids), 15), pids
    kept = _containers(cli, "stopc", all_=False)
    assert len(kept) == 2, kept

    # A failing rank: its exit code comes back, the other node's job inside is stopped
    for rank in (0, 1):
        (_node_root(cli, "stopc", rank) / "pid").unlink()
    r = cli.run("launch", str(task), "-y", "--env", "FAIL_ON=1", timeout=300)
    assert r.returncode == 7, r.stdout[-2000:] + r.stderr[-2000:]
    assert "node 1" in r.stdout + r.stderr
    assert wait_until(lambda: not any(_alive(p) for p in _pids(cli, "stopc")), 15)
    assert _containers(cli, "stopc", all_=False) == kept, "reused, and still running"

    # down with a detached job inside: stopped, the containers removed
    for rank in (0, 1):
        (_node_root(cli, "stopc", rank) / "pid").unlink()
    r = cli.run("launch", str(task), "-y", "-d")
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: len(_pids(cli, "stopc")) == 2, 60)
    pids = _pids(cli, "stopc")
    r = cli.run("down", "stopc", "-y")
    assert r.returncode == 0, r.stderr
    assert not any(_alive(p) for p in pids)
    assert _containers(cli, "stopc") == {}
    assert_nothing_left(cli.home)


def test_the_guard_stop_ends_the_container(cli: CLI, tmp_path: Path, tiny_image: str,
                                          boxes: list[str]) -> None:
    """launch -d --down: when the job ends, each node's guard stops the node; the keeper
    carries the node's marks, so it ends with the node, and the container is removed, not
    left exited."""
    boxes.append("guardc")
    task = _task(tmp_path / "g.yaml", "guardc", tiny_image, "run: echo hi; sleep 2\n")
    r = cli.run("launch", str(task), "-y", "-d", "--down", **FAST)
    assert r.returncode == 0, r.stderr
    assert len(_containers(cli, "guardc")) == 2
    assert wait_until(lambda: not processes_with(f"{cli.home}/clusters/guardc/"), 90), \
        "the guard did not stop the nodes"
    assert wait_until(lambda: _containers(cli, "guardc") == {}, 15), _containers(cli, "guardc")


def test_on_an_ssh_host_the_guard_stop_removes_the_container(
        cli: CLI, tmp_path: Path, tiny_image: str, boxes: list[str]) -> None:
    """An ``ssh`` host stays on when its guard stops the cluster (launch -d --down): the guard
    stops cloudtrain's jobs and removes the cluster's containers too, so nothing of ours is
    left running on the user's machine; the host's own sshd (the user's) lives on."""
    boxes.append("sshc")
    (tmp_path / "hosts.yaml").write_text("name: hosts\nresources: {provider: local}\nrun: 'true'\n")
    assert cli.run("up", str(tmp_path / "hosts.yaml"), "--no-bootstrap", "-y").returncode == 0
    (host,) = [c for c in cli.status() if c["name"] == "hosts"][0]["nodes"]  # type: ignore[index]
    key = cli.home / "clusters" / "hosts" / "ssh" / "id_ed25519"
    task = tmp_path / "s.yaml"
    task.write_text("name: sshc\nresources:\n  provider: ssh\n  ssh:\n    hosts:\n      - "
                    f"{{address: {host['host']}, port: {host['port']}, identity_file: {key}}}\n"
                    f"bootstrap: {{python: {sys.executable}}}\nstop_grace: 5\n"
                    f"container:\n  image: {tiny_image}\nrun: echo in-$(id -u); sleep 2\n")
    try:
        r = cli.run("launch", str(task), "-y", "-d", "--down", **FAST)
        assert r.returncode == 0, r.stderr
        assert len(_containers(cli, "sshc")) == 1
        assert wait_until(lambda: _containers(cli, "sshc") == {}, 90), \
            f"the guard left the container: {_containers(cli, 'sshc')}"
        assert [c for c in cli.status() if c["name"] == "hosts"][0]["status"] == "UP"
    finally:
        cli.run("down", "sshc", "-y")
        cli.run("down", "hosts", "-y")


def test_stop_ends_the_containers_and_start_brings_new_ones(
        cli: CLI, tmp_path: Path, tiny_image: str, boxes: list[str]) -> None:
    """``cloudtrain stop`` powers a local node off: the keeper ends with the node's other
    processes and its container is removed; the next launch after ``start`` starts new ones."""
    boxes.append("stopstartc")
    task = _task(tmp_path / "ss.yaml", "stopstartc", tiny_image, "run: echo in-$(id -u)\n")
    assert cli.run("launch", str(task), "-y").returncode == 0
    before = _containers(cli, "stopstartc")
    assert len(before) == 2
    r = cli.run("stop", "stopstartc", "-y")
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: _containers(cli, "stopstartc") == {}, 15), \
        _containers(cli, "stopstartc")
    r = cli.run("start", "stopstartc", "-y")
    assert r.returncode == 0, r.stderr
    r = cli.run("exec", "stopstartc", "--", "true")   # no container yet: said so
    assert r.returncode == 125 and "launch the task again" in r.stdout + r.stderr, \
        r.stdout + r.stderr
    r = cli.run("launch", str(task), "-y")
    assert r.returncode == 0 and r.stdout.count(f"in-{os.getuid()}") == 2, r.stdout + r.stderr
    after = _containers(cli, "stopstartc", all_=False)
    assert len(after) == 2 and not set(after) & set(before)
    r = cli.run("down", "stopstartc", "-y")
    assert r.returncode == 0, r.stderr
    assert _containers(cli, "stopstartc") == {}


def test_a_jobs_gpu_slots_reach_inside(cli: CLI, tmp_path: Path, tiny_image: str,
                                      boxes: list[str]) -> None:
    """The node's queue pins a gpus_per_job job to its slots (CUDA_VISIBLE_DEVICES, set when
    the job starts): two jobs at once, each sees its own slot inside the container."""
    boxes.append("slotc")
    task = tmp_path / "slot.yaml"
    task.write_text("name: slotc\nnum_nodes: 1\n"
                    "resources: {provider: local, local: {gpus: 2}, gpus_per_job: 1}\n"
                    f"container: {{image: {tiny_image}}}\n"
                    "run: test -e /.dockerenv && echo \"cvd=$CUDA_VISIBLE_DEVICES\" && sleep 3\n")
    first = cli.popen("launch", str(task), "-y")
    try:
        assert wait_until(lambda: len(_containers(cli, "slotc", all_=False)) == 1, 120)
        r = cli.run("launch", str(task), "-y")
        first.wait(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and r.returncode == 0, r.stdout + r.stderr
    seen = {ln.split("cvd=", 1)[1].strip() for ln in
            (first.stdout.read() if first.stdout else "").splitlines() + r.stdout.splitlines()
            if "cvd=" in ln}
    assert seen == {"0", "1"}, seen
    assert cli.run("down", "slotc", "-y").returncode == 0


def test_no_container_to_ssh_into_is_a_clear_error(cli: CLI, tmp_path: Path) -> None:
    task = tmp_path / "h.yaml"
    task.write_text("name: hostc\nnum_nodes: 1\nresources: {provider: local}\nrun: echo on-host\n")
    r = cli.run("launch", str(task), "-y")
    assert r.returncode == 0, r.stderr
    r = cli.run("ssh", "hostc", "--container")
    assert r.returncode == 2, r.stderr
    assert "container:" in r.stderr and "Traceback" not in r.stderr
    assert cli.run("down", "hostc", "-y").returncode == 0


def test_gpus_without_the_nvidia_toolkit_start_nothing(tmp_path: Path, tiny_image: str) -> None:
    """The node side of the check: a node with GPUs whose Docker has no NVIDIA runtime (this
    machine's) refuses before any container exists (exit 4, which the CLI turns into exit 2
    naming the NVIDIA Container Toolkit)."""
    if "nvidia" in _docker("info", "--format", "{{json .Runtimes}}"):
        pytest.skip("this machine's Docker has the NVIDIA runtime")
    name = f"ct-test-run-gpu-{os.getpid()}"
    script = Path(__file__).resolve().parents[2] / "bootstrap" / "ctcontainer.sh"
    r = subprocess.run(["bash", str(script), "ensure", str(tmp_path), name, "spec", "req",
                        "digest", "1", tiny_image, "gpuc", "0123456789ab", "0", "", "--"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 4, r.stderr
    assert _docker("ps", "-aq", "--filter", f"name={name}") == ""
    assert not (tmp_path / ".container").exists()


def test_checkpoints_go_up_from_the_host_around_the_job_inside(
        cli: CLI, tmp_path: Path, tiny_image: str, boxes: list[str]) -> None:
    """``checkpoints:`` with a container: the restore and the upload run on the host (the
    image has no Python, no rclone); the job inside writes into $CLOUDTRAIN_CHECKPOINT_DIR
    (bind-mounted at the same path); node 0 fails first, the stop's SIGTERM reaches node 1's
    job inside, and the launch ends with the failing job's own exit code."""
    boxes.append("ckptc")
    emu = emus.start("s3", tmp_path / "emulator")
    try:
        doc = {"name": "ckptc", "num_nodes": 2, "resources": {"provider": "local"},
               "container": {"image": tiny_image},
               "envs": {**emu.envs, "CLOUDTRAIN_CHECKPOINT_INTERVAL": "0.5"},
               "checkpoints": emu.url("ckpt/box"),
               "run": 'test -e /.dockerenv || exit 8\n'
                      'test -n "$CLOUDTRAIN_CHECKPOINT_DIR" || exit 9\n'
                      'mkdir -p "$CLOUDTRAIN_CHECKPOINT_DIR"\n'
                      'echo "$CLOUDTRAIN_NODE_RANK" > "$CLOUDTRAIN_CHECKPOINT_DIR/step-000004.txt"\n'
                      '[ "$CLOUDTRAIN_NODE_RANK" = 0 ] || sleep 30\n'
                      'exit 3'}
        task = tmp_path / "c.yaml"
        task.write_text(json.dumps(doc))
        r = cli.run("launch", str(task), "-y", timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode == 3, out[-3000:]
        assert "Uploaded checkpoint step-000004" in out, out[-3000:]
        got = sorted(emu.keys("ckpt/box/manifests"))
        assert len(got) == 1 and got[0].endswith("-step-000004.json"), got
        man = json.loads(emu.cat("ckpt/box/manifests/" + got[0]))
        assert emu.cat(f"ckpt/box/objects/{man['files'][0]['sha256']}") == b"0\n"
        ck = next(_node_root(cli, "ckptc", 0).rglob("step-000004.txt"))
        assert ck.stat().st_uid == os.getuid()
        assert cli.run("down", "ckptc", "-y").returncode == 0
        assert _containers(cli, "ckptc") == {}
    finally:
        emu.stop()


def test_a_sweep_of_a_container_task_is_refused_creating_nothing(cli: CLI, tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text("name: sw\nnum_nodes: 1\nresources: {provider: local}\n"
                                        "container: {image: ct-test/tiny:x}\nrun: echo x\n")
    (tmp_path / "s.yaml").write_text("task: task.yaml\nparams:\n  lr: {loguniform: [1.0e-5, 1.0e-2]}\n"
                                     "objective: {metric: val_loss, goal: minimize}\ntrials: 2\n")
    r = cli.run("sweep", str(tmp_path / "s.yaml"), "-y", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "container" in r.stderr and "Traceback" not in r.stderr
    assert not (cli.home / "clusters").exists() or not any((cli.home / "clusters").iterdir())
