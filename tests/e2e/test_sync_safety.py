"""What syncs, what comes back, secrets at rest: through the real CLI on the local provider
(real sshd nodes, real rsync).

- outputs pulled from a hostile node never land outside the outputs folder (finding 3);
- the workdir fingerprint is rsync's own file list: anchored and nested ignore rules and
  negations agree with what is sent, and an edit under src/build/ re-syncs (finding 9);
- job folders on the node are private, old ones pruned; CLOUDTRAIN_HOME, state.db and logs
  are private here (finding 12);
- a CLOUDTRAIN_HOME inside the workdir is never synced (finding 13).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLI, assert_nothing_left, needs_sshd, processes_with


def e2e(f):  # type: ignore[no-untyped-def]
    return needs_sshd(pytest.mark.e2e(f))


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def _links_under(root: Path) -> list[Path]:
    return [Path(d) / n for d, dirs, files in os.walk(root) for n in dirs + files
            if (Path(d) / n).is_symlink()]


def _all_files(root: Path) -> list[Path]:
    return sorted(Path(d) / n for d, dirs, files in os.walk(root) for n in dirs + files)


# --- finding 3 --------------------------------------------------------------------------------

@e2e
def test_outputs_from_a_hostile_node_stay_inside_the_outputs_folder(cli: CLI, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine\n")
    proj = tmp_path / "p"
    proj.mkdir()
    outputs = proj / "cloudtrain-outputs"
    # A link left in the local outputs folder (by an earlier pull of an older version, say).
    outputs.mkdir()
    (outputs / "run1").symlink_to(victim)
    (outputs / "out2").symlink_to(victim)
    (proj / "task.yaml").write_text(f"""
name: hostile
num_nodes: 1
workdir: .
envs:
  VICTIM: {victim}
outputs: [out/, top/, run1/ckpt/, out2/]
run: |
  mkdir -p out/sub run1/ckpt
  echo ok > out/sub/ok.txt
  ln -s "$VICTIM" out/abs                          # absolute link out
  ln -s ../../../../../../../../../../"$VICTIM" out/rel   # relative link out
  ln -s "$VICTIM" out/sub/deeper
  ln -s "$VICTIM" top                              # the output itself is a link
  echo written-through > run1/ckpt/escaped.txt
  mkdir -p out2 && echo written-through > out2/escaped.txt
  mkfifo out/fifo
  echo job-done
""")
    r = cli.run("launch", str(proj / "task.yaml"), "--down", cwd=proj)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "job-done" in r.stdout
    # Nothing written outside the outputs folder: the victim is as it was.
    assert _all_files(victim) == [victim / "precious.txt"]
    assert (victim / "precious.txt").read_text() == "mine\n"
    # The regular file came back; no link did (only the one planted here remains, untouched).
    assert (outputs / "out" / "sub" / "ok.txt").read_text() == "ok\n"
    assert sorted(_links_under(outputs)) == [outputs / "out2", outputs / "run1"]
    assert not (outputs / "top").exists() and not (outputs / "out" / "fifo").exists()
    assert not list(outputs.glob(".cloudtrain-pull-*"))
    # The user is told what was left out and why.
    assert "out/abs" in r.stderr and "out/rel" in r.stderr and "out/sub/deeper" in r.stderr
    assert "output 'top/'" in r.stderr
    assert "'run1'" in r.stderr and "never written through a link" in r.stderr
    assert "out2/ (a link or a file is in its place" in r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_left(cli.home)


# --- finding 9 --------------------------------------------------------------------------------

PROBE = """
name: fp
num_nodes: 1
workdir: .
run: |
  echo "gen=$(cat src/build/gen.py)"
  for f in build/out.o src/local_only.txt local_only.txt src/tmp/t.txt a.log src/keep.tmp; do
    if [ -e "$f" ]; then echo "has:$f"; else echo "not:$f"; fi
  done
"""


@e2e
def test_fingerprint_is_what_rsync_sends(cli: CLI, tmp_path: Path) -> None:
    proj = tmp_path / "p"
    (proj / "src" / "build").mkdir(parents=True)
    (proj / "src" / "tmp").mkdir()
    (proj / "build").mkdir()
    (proj / ".gitignore").write_text("/build\n*.log\n")          # anchored, glob
    # nested, anchored to src/; a negation
    (proj / "src" / ".gitignore").write_text("/local_only.txt\ntmp/\n*.tmp\n!keep.tmp\n")
    (proj / "src" / "build" / "gen.py").write_text("v1\n")
    (proj / "build" / "out.o").write_text("obj\n")
    (proj / "src" / "local_only.txt").write_text("x\n")
    (proj / "local_only.txt").write_text("x\n")
    (proj / "src" / "tmp" / "t.txt").write_text("x\n")
    (proj / "a.log").write_text("x\n")
    (proj / "src" / "keep.tmp").write_text("x\n")
    task = proj / "task.yaml"
    task.write_text(PROBE)

    r1 = cli.run("launch", str(task), cwd=proj)
    assert r1.returncode == 0, r1.stderr + r1.stdout
    assert "gen=v1" in r1.stdout
    # What rsync sent: the anchored /build only at the top, the nested rules only under src/.
    for line in ("not:build/out.o", "not:src/local_only.txt", "has:local_only.txt",
                 "not:src/tmp/t.txt", "not:a.log"):
        assert line in r1.stdout, r1.stdout
    # rsync's per-directory ignore files take no '!' negation: keep.tmp stays excluded, and
    # the fingerprint agrees (below: editing it does not re-sync).
    assert "not:src/keep.tmp" in r1.stdout

    # An edit under src/build/ (same size, same second) re-syncs and the node runs the new code.
    gen = proj / "src" / "build" / "gen.py"
    st = gen.stat()
    gen.write_text("v2\n")
    os.utime(gen, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    r2 = cli.run("launch", str(task), cwd=proj)
    assert r2.returncode == 0, r2.stderr
    assert "Syncing" in r2.stderr and "gen=v2" in r2.stdout, r2.stderr + r2.stdout

    # Edits to files that are not sent leave the fingerprint alone: no sync.
    for f in ("build/out.o", "src/local_only.txt", "src/tmp/t.txt", "a.log", "src/keep.tmp"):
        (proj / f).write_text("changed\n")
    r3 = cli.run("launch", str(task), "--down", cwd=proj)
    assert r3.returncode == 0, r3.stderr
    assert "Syncing" not in r3.stderr and "gen=v2" in r3.stdout
    assert_nothing_left(cli.home)


KEEPER = """
name: keeper
num_nodes: 1
workdir: .
run: |
  echo "code=$(cat train.py)"
  for f in snapshot.pt old.py lib/gone.py lib/state.json 'we*ird [1].py'; do
    if [ -e "$f" ]; then echo "has:$f"; else echo "not:$f"; fi
  done
  echo "epoch 3" > snapshot.pt
  echo '{}' > lib/state.json
"""


@e2e
def test_a_sync_never_deletes_what_the_job_wrote(cli: CLI, tmp_path: Path) -> None:
    """A checkpoint the job writes in its workdir survives the next launch's sync, while
    files removed from the laptop's workdir are removed from the node's copy."""
    proj = tmp_path / "p"
    (proj / "lib").mkdir(parents=True)
    (proj / "train.py").write_text("v1\n")
    (proj / "old.py").write_text("stale\n")
    (proj / "lib" / "gone.py").write_text("stale\n")
    (proj / "we*ird [1].py").write_text("stale\n")
    task = proj / "task.yaml"
    task.write_text(KEEPER)
    r1 = cli.run("launch", str(task), cwd=proj)
    assert r1.returncode == 0, r1.stderr + r1.stdout
    assert "not:snapshot.pt" in r1.stdout and "has:old.py" in r1.stdout
    assert "has:we*ird [1].py" in r1.stdout

    # The user edits one file and removes others (lib/ as a whole, where the job wrote too).
    (proj / "train.py").write_text("v2\n")
    (proj / "old.py").unlink()
    (proj / "we*ird [1].py").unlink()
    (proj / "lib" / "gone.py").unlink()
    (proj / "lib").rmdir()
    r2 = cli.run("launch", str(task), "--down", cwd=proj)
    assert r2.returncode == 0, r2.stderr + r2.stdout
    assert "Syncing" in r2.stderr and "code=v2" in r2.stdout
    for line in ("has:snapshot.pt", "has:lib/state.json", "not:old.py", "not:lib/gone.py",
                 "not:we*ird [1].py"):
        assert line in r2.stdout, r2.stdout
    assert_nothing_left(cli.home)


ODD_NAMES = [" lead space", "new\nline", "back\\#012slash", "caf\u00e9", "tab\there", "a -> b",
             "sub dir/ inner", "we\\#ird dir/x\ny"]


def test_fingerprint_sees_every_file_rsync_sends_whatever_its_name(tmp_path: Path) -> None:
    """rsync prints odd bytes escaped and links as 'name -> target': every file it would send,
    however named, is in the fingerprint (a change to any of them changes it)."""
    from cloudtrain.pipeline.sync import SyncPlan

    wd = tmp_path / "wd"
    wd.mkdir()
    for n in ODD_NAMES:
        (wd / n).parent.mkdir(parents=True, exist_ok=True)
        (wd / n).write_text("1")
    (wd / "link -> x").symlink_to("t -> u/v")
    (wd / ".gitignore").write_text("/ignored*\n")
    (wd / "ignored \\#1").write_text("1")
    plan = SyncPlan(workdir=wd, mounts=(), protect=(), exclude=())
    before = plan.fingerprint()
    assert plan.fingerprint() == before
    for n in ODD_NAMES:
        (wd / n).write_text("22")
        after = plan.fingerprint()
        assert after != before, n
        before = after
    (wd / "link -> x").unlink()
    (wd / "link -> x").symlink_to("t -> u/w")
    assert plan.fingerprint() != before
    before = plan.fingerprint()
    (wd / "ignored \\#1").write_text("22")   # not sent, not in the fingerprint
    assert plan.fingerprint() == before


# --- finding 13 -------------------------------------------------------------------------------

@e2e
@pytest.mark.parametrize("home_as", ["./.cloudtrain", "absolute"])
def test_cloudtrain_home_inside_the_workdir_is_never_synced(tmp_path: Path, home_as: str) -> None:
    proj = tmp_path / "p"
    proj.mkdir()
    (proj / "train.txt").write_text("code\n")
    (proj / "task.yaml").write_text("""
name: inhome
num_nodes: 2
workdir: .
run: |
  cat train.txt
  if [ -e .cloudtrain ]; then echo HOME-SYNCED; else echo home-not-synced; fi
""")
    inner = CLI(proj / ".cloudtrain")
    # a per-project home, as a user would set it
    rel = {"CLOUDTRAIN_HOME": home_as if home_as != "absolute" else str(inner.home)}
    try:
        r1 = inner.run("launch", "task.yaml", cwd=proj, **rel)
        assert r1.returncode == 0, r1.stderr + r1.stdout
        assert r1.stdout.count("home-not-synced") == 2 and "HOME-SYNCED" not in r1.stdout
        # The home changed (state, logs) but it is not part of the workdir: nothing to sync.
        r2 = inner.run("launch", "task.yaml", "--down", cwd=proj, **rel)
        assert r2.returncode == 0, r2.stderr + r2.stdout
        assert "Syncing" not in r2.stderr and r2.stdout.count("code") == 2
        assert_nothing_left(inner.home)
    finally:
        subprocess.run([sys.executable, "-m", "cloudtrain", "down", "-a", "-y"], cwd=proj,
                       env=inner.env(**rel), capture_output=True, timeout=120)
        for pid in processes_with(str(inner.home)):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


# --- finding 12 -------------------------------------------------------------------------------

@e2e
def test_secrets_at_rest_are_private_and_old_jobs_pruned(cli: CLI, tmp_path: Path) -> None:
    cli.home.chmod(0o755)  # a home made by an older version
    proj = tmp_path / "p"
    proj.mkdir()
    (proj / "task.yaml").write_text("""
name: secrets
num_nodes: 1
workdir: .
envs:
  API_TOKEN: s3cret-value
run: |
  touch made-by-job
  echo ran
""")
    r = cli.run("launch", str(proj / "task.yaml"), cwd=proj)
    assert r.returncode == 0, r.stderr + r.stdout

    # Here: the home, the state database and the logs are private.
    assert _mode(cli.home) == 0o700
    for f in cli.home.glob("state.db*"):
        assert _mode(f) == 0o600, f
    logs = cli.home / "logs"
    log_files = [p for p in _all_files(logs) if p.is_file()]
    assert log_files
    for p in _all_files(logs):
        assert _mode(p) == (0o700 if p.is_dir() else 0o600), p
    assert _mode(logs) == 0o700

    # On the node: the job folder and the files holding the environment are private; the
    # job's own files keep the usual umask.
    (root,) = list(cli.home.glob("clusters/*/*/nodes/0/root"))
    jobs = root / "jobs"
    (jdir,) = [d for d in jobs.iterdir() if d.is_dir()]
    assert "s3cret-value" in (jdir / "run.sh").read_text()
    assert _mode(jobs) == 0o700 and _mode(jdir) == 0o700
    assert _mode(jdir / "run.sh") == 0o600 and _mode(jdir / "node.log") == 0o600
    assert _mode(root / "workdir" / "made-by-job") & 0o044 == 0o044

    # Pruning: 25 old finished jobs and one old job that still runs.
    now = time.time()
    fakes = []
    for i in range(25):
        d = jobs / f"20200101-0000{i:02d}-aaaaaa"
        d.mkdir()
        (d / "rc").write_text("0\n")
        os.utime(d, (now - 1000 - i, now - 1000 - i))
        fakes.append(d)
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        running = jobs / "20190101-000000-bbbbbb"
        running.mkdir()
        (running / "pid").write_text(f"{sleeper.pid}\n")
        os.utime(running, (now - 5000, now - 5000))
        e = cli.run("exec", "secrets", "--", "echo", "pruned")
        assert e.returncode == 0, e.stderr
        left = {d for d in jobs.iterdir() if d.is_dir()}
        # The 20 newest (this exec, the launch, the 18 newest fakes) and the running one.
        assert jdir in left and running in left
        assert set(fakes[:18]) <= left and not (set(fakes[18:]) & left)
        assert len(left) == 21
    finally:
        sleeper.kill()
        sleeper.wait()
    d = cli.run("down", "secrets", "-y")
    assert d.returncode == 0, d.stderr
    assert_nothing_left(cli.home)
