"""Generated malformed task files (tests/fakes/malformed_gen.py: 1800 files, fixed seed; each a valid
task with one defect, every field of the task with its own defects) through `launch`,
`up --dry-run` and `cost`: every one is refused with exit 2 and a one-paragraph error that
names the task file (and, for a bad field value, the field), no traceback, and nothing is
created: no CLOUDTRAIN_HOME, no process started, no connection opened (so no bucket object
either), no file written or changed anywhere under the test's directory.

The bulk runs the real click command group in this process (click's CliRunner with
catch_exceptions=False, so any exception other than the CLI's own exit fails the test, and with
process creation and connections trapped); a sample of 40 runs as real subprocesses of the
installed CLI."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

import malformed_gen as gen
from conftest import processes_with

CASES = gen.generate()
COMMANDS: list[tuple[str, ...]] = [("launch",), ("up", "--dry-run"), ("cost",)]
MAX_MESSAGE = 600
SUBPROCESS_SAMPLE = 40


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root (links not followed) with its size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _field_named(defect: str, err: str) -> bool:
    """A bad value's message names its field: the dotted path, or (for a value the field's
    own model refuses as a whole) a path that starts with it or that it starts with."""
    field = defect.split(":", 1)[1]
    named = [m.split("'")[1] for m in err.split("field ")[1:] if m.startswith("'")]
    named += ["resources." + m.split(":")[0] for m in err.split("resources.")[1:]]
    return any(n == field or n.startswith(field + ".") or field.startswith(n + ".")
               for n in named)


def _problems(code: int, out: str, err: str, task_file: Path, defect: str = "") -> list[str]:
    bad = []
    if defect.startswith("bad-value:") and not _field_named(defect, err):
        bad.append(f"the message does not name the field {defect.split(':', 1)[1]}")
    if code != 2:
        bad.append(f"exit {code}, not 2")
    if "Traceback" in out or "Traceback" in err:
        bad.append("a traceback")
    if not err.startswith("error: "):
        bad.append("stderr does not start with 'error: '")
    if len(err) >= MAX_MESSAGE:
        bad.append(f"a {len(err)}-character message")
    if err.rstrip("\n").count("\n") > 1:
        bad.append("more than one paragraph (message and hint)")
    if str(task_file) not in err:
        bad.append("the message does not name the task file")
    if out.strip():
        bad.append("output on stdout")
    return bad


def test_generated_set_is_large_fixed_and_covers_every_defect() -> None:
    assert len(CASES) >= 1500
    assert len({c.id for c in CASES}) == len(CASES) and len({c.text for c in CASES}) == len(CASES)
    assert [c.text for c in gen.generate()] == [c.text for c in CASES]  # fixed seed
    kinds = Counter(c.defect.split(":")[0] for c in CASES)
    for kind in ("bad-value", "unknown-field", "bomb", "deep", "loop", "tag", "tag-directive",
                 "merge", "control-char", "quoted-nul", "huge-file", "structural", "syntax"):
        assert kinds[kind] >= 10, kinds
    fields = {c.defect.split(":")[1] for c in CASES if c.defect.startswith("bad-value:")}
    assert fields == set(gen.BAD_VALUES), set(gen.BAD_VALUES) - fields


def test_every_field_of_the_task_has_its_own_defects_in_the_set() -> None:
    """Each field of the model (top level, nested, and each installed provider's options) has
    bad values of its own, and files with them are in the set."""
    drawn = {c.defect.split(":", 1)[1] for c in CASES if c.defect.startswith("bad-value:")}
    for path in gen.field_paths():
        assert any(k == path or k.startswith(path + ".") for k in gen.BAD_VALUES), path
        assert any(k == path or k.startswith(path + ".") for k in drawn), path
    urls = " ".join(c.text for c in CASES)
    for hostile in ("s3://../x", "file:///etc", "unknown://", "s3://xn--", "gs://goog-",
                    "--ol-s3", "-s3alias", "-oProxyCommand"):
        assert hostile in urls, hostile


def test_the_valid_bases_the_defects_start_from_are_accepted(tmp_path: Path) -> None:
    """So a refusal below is the defect's doing: the same pool of fields, without a defect,
    loads cleanly (every file, in this process) and `cost` accepts a sample through the CLI."""
    from cloudtrain.commands.main import cli
    from cloudtrain.provider.options import load_checked

    proj = gen.make_project(tmp_path / "proj", tmp_path / "outside")
    for i, text in enumerate(gen.bases(200)):
        f = proj / f"base-{i}.yaml"
        f.write_text(text, encoding="utf-8")
        load_checked(f)
    runner = CliRunner()
    home = tmp_path / "home"
    for i in range(0, 200, 20):
        r = runner.invoke(cli, ["cost", str(proj / f"base-{i}.yaml")], catch_exceptions=False,
                          env={"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"})
        assert r.exit_code == 0, r.output


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Any attempt to start a process fails the test (and is recorded)."""
    started: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        started.append(repr(args)[:200])
        raise AssertionError(f"a process was started: {args!r:.200}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "system", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    monkeypatch.setattr(os, "execv", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield started


def test_every_generated_file_is_refused_by_every_command_in_process(
        tmp_path: Path, no_processes: list[str]) -> None:
    from cloudtrain.commands.main import cli

    proj = gen.make_project(tmp_path / "proj", tmp_path / "outside")
    home = tmp_path / "home"
    task_file = proj / "task.yaml"
    task_file.write_text("")
    before = _tree(tmp_path)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    runner = CliRunner()
    env = {"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"}
    failures: list[str] = []
    started = time.monotonic()
    try:
        for case in CASES:
            task_file.write_text(case.text, encoding="utf-8")
            for cmd in COMMANDS:
                r = runner.invoke(cli, [*cmd, str(task_file)], env=env, catch_exceptions=False)
                bad = _problems(r.exit_code, r.stdout, r.stderr, task_file, case.defect)
                if bad:
                    failures.append(f"{case.id} ({' '.join(cmd)}): {', '.join(bad)}\n"
                                    f"    stderr: {r.stderr[:300]!r}\n    file: {case.text[:200]!r}")
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    elapsed = time.monotonic() - started
    print(f"\n{len(CASES)} files x {len(COMMANDS)} commands in process: {elapsed:.1f} s")
    assert not failures, f"{len(failures)} refusals went wrong:\n" + "\n".join(failures[:15])
    assert no_processes == []
    assert not home.exists(), sorted(p.name for p in home.rglob("*"))[:20]
    after = _tree(tmp_path)
    after.pop("proj/task.yaml"), before.pop("proj/task.yaml")
    assert after == before, "files changed: " + repr(
        sorted(set(after.items()) ^ set(before.items()))[:10])


def _sample() -> list[gen.Malformed]:
    """30 files for the real subprocesses: at least one of every defect kind, the rest drawn."""
    rng = random.Random(gen.SEED)
    by_kind: dict[str, list[gen.Malformed]] = {}
    for c in CASES:
        by_kind.setdefault(c.defect.split(":")[0], []).append(c)
    picked = [rng.choice(v) for _, v in sorted(by_kind.items())]
    rest = [c for c in CASES if c not in picked]
    return picked + rng.sample(rest, SUBPROCESS_SAMPLE - len(picked))


SAMPLE = _sample()


def test_a_sample_is_refused_by_the_installed_cli_in_subprocesses(tmp_path: Path) -> None:
    proj = gen.make_project(tmp_path / "proj", tmp_path / "outside")
    home = tmp_path / "home"
    env = dict(os.environ, CLOUDTRAIN_HOME=str(home), NO_COLOR="1")
    for i, case in enumerate(SAMPLE):
        (proj / f"sample-{i}.yaml").write_text(case.text, encoding="utf-8")
    before = _tree(tmp_path)
    failures = []
    for i, case in enumerate(SAMPLE):
        task_file = proj / f"sample-{i}.yaml"
        cmd = COMMANDS[i % len(COMMANDS)]
        r = subprocess.run([sys.executable, "-m", "cloudtrain", *cmd, str(task_file)],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
                           stdin=subprocess.DEVNULL)
        bad = _problems(r.returncode, r.stdout, r.stderr, task_file, case.defect)
        if bad:
            failures.append(f"{case.id} ({' '.join(cmd)}): {', '.join(bad)}: {r.stderr[:300]!r}")
    assert len(SAMPLE) == SUBPROCESS_SAMPLE
    assert not failures, "\n".join(failures)
    assert not home.exists()
    assert processes_with(str(home)) == []
    assert _tree(tmp_path) == before
