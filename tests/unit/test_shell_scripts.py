from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "bootstrap").glob("*.sh")) + sorted((REPO / "scripts").glob("*.sh")) \
    + [REPO / ".ci" / "run"]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script: Path) -> None:
    r = subprocess.run(["shellcheck", "-x", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ctkill_stops_a_process_that_left_the_job_group(tmp_path: Path) -> None:
    """A worker in its own session escapes a process-group kill; the marker still finds it."""
    env = {"PATH": "/usr/bin:/bin", "CLOUDTRAIN_JOB_ID": f"t-{tmp_path.name}"}
    p = subprocess.Popen(["setsid", "sleep", "300"], env=env)
    try:
        r = subprocess.run(["bash", str(REPO / "bootstrap" / "ctkill.sh"), "",
                            f"CLOUDTRAIN_JOB_ID=t-{tmp_path.name}", "2"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0
        assert "::left 0" in r.stdout
        assert p.wait(timeout=5) != 0
    finally:
        if p.poll() is None:
            p.kill()


CTJOB = REPO / "bootstrap" / "ctjob.sh"


def _zombie(code: int) -> tuple[subprocess.Popen[str], int]:
    """A parent that never waits for its child: the child, once exited, stays a zombie (as a
    job's wrapper does under a PID 1 that reaps orphans late). Returns (parent, child pid)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\n"
         f"p = os.fork()\nif p == 0:\n    os._exit({code})\n"
         "print(p, flush=True)\ntime.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    for _ in range(200):
        stat = Path(f"/proc/{child}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.01)
    return parent, child


@pytest.mark.parametrize("rc", [3, None], ids=["rc-written", "no-rc"])
def test_ctjob_follower_ends_when_the_job_is_a_zombie(tmp_path: Path, rc: int | None) -> None:
    """The job's wrapper exited but nobody reaps it (a zombie that 'kill -0' takes for alive):
    the follower prints the whole log and exits with the job's code (137 without rc) at once,
    while the session (its stdin) is still open."""
    parent, child = _zombie(3)
    try:
        jd = tmp_path / "job"
        jd.mkdir()
        (jd / "pid").write_text(f"{child}\n")
        (jd / "node.log").write_bytes(b"one\ntwo\nthree\n")
        if rc is not None:
            (jd / "rc").write_text(f"{rc}\n")
        f = subprocess.Popen(["bash", str(CTJOB), str(jd), "--follow", "4"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            code = f.wait(timeout=5)
            assert f.stdout is not None
            assert (code, f.stdout.read()) == (137 if rc is None else rc, b"two\nthree\n")
        finally:
            if f.poll() is None:
                f.kill()
    finally:
        parent.kill()
        parent.wait()


def _held(args: list[str], data: bytes) -> subprocess.CompletedProcess[bytes]:
    """Run with ``data`` on stdin, then stdin held open (as the CLI's session holds it)."""
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    p.stdin.write(data)
    p.stdin.flush()
    try:
        code = p.wait(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
    return subprocess.CompletedProcess(args, code, p.stdout.read(), p.stderr.read())


def test_ctjob_run_starts_once_and_a_repeat_follows_from_its_offset(tmp_path: Path) -> None:
    """--run: the script on stdin after its length; the same command again (a reconnect) does
    not start the job a second time, it streams the log from the offset it is given."""
    jd = tmp_path / "jobs" / "j1"
    body = b"echo start >> " + str(tmp_path / "starts").encode() + b"\necho a\necho b\nexit 4\n"
    stdin = str(len(body)).encode() + b"\n" + body
    first = _held(["bash", str(CTJOB), str(jd), "--run", "0"], stdin)
    assert (first.returncode, first.stdout) == (4, b"a\nb\n"), first.stderr
    again = _held(["bash", str(CTJOB), str(jd), "--run", "2"], stdin)
    assert (again.returncode, again.stdout) == (4, b"b\n"), again.stderr
    assert (tmp_path / "starts").read_text() == "start\n"


def test_ctjob_follows_with_tail_where_the_node_has_no_python(tmp_path: Path) -> None:
    """A node without Python (nor CT_PYTHON_BIN) still gets its job started and followed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "tail", "sleep", "seq", "setsid", "mkdir", "chmod", "dirname",
                 "ls", "head", "rm", "mv", "kill"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    body = b"echo hi\nexit 6\n"
    args = ["bash", str(CTJOB), str(tmp_path / "jobs" / "j"), "--run", "0"]
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={"PATH": str(bin_dir)})
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(str(len(body)).encode() + b"\n" + body)
    p.stdin.flush()
    try:
        assert (p.wait(timeout=20), p.stdout.read()) == (6, b"hi\n")
    finally:
        if p.poll() is None:
            p.kill()
