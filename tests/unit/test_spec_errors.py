"""Malformed task files, run through the real CLI: every one must be refused with exit code 2,
a short message that names the field (and the line, where the YAML has one), no traceback,
and nothing created under CLOUDTRAIN_HOME."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path

import pytest

MAX_MESSAGE = 600

# The local provider's check looks for OpenSSH's sshd even for a dry run.
needs_sshd = pytest.mark.skipif(
    shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists(),
    reason="OpenSSH server not installed")


@dataclass(frozen=True)
class Case:
    id: str
    yaml: str | None
    """The task file's text; None: pass a path that does not exist."""
    field: str | None = None
    """The dotted field the message must name (quoted, as the CLI prints it)."""
    line: int | None = None
    """The 1-based line the message must point at; None: the YAML has no single line for it."""
    says: tuple[str, ...] = ()
    """Further words the message must contain (a suggestion, the bad value ...)."""
    any_of: tuple[str, ...] = ()
    """At least one of these must appear."""
    command: tuple[str, ...] = ("launch",)
    files: dict[str, str] = dc_field(default_factory=dict)
    """Extra files next to the task file (relative path -> content)."""
    names_file: bool = True
    """The message names the task file (spec errors do; a provider's own checks need not)."""
    never: tuple[str, ...] = ()
    """Words that must not appear anywhere in the output (a secret from the task file)."""


DRY = ("up", "--dry-run")
BOMB = "a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [" + ",".join([f"*{p}"] * 10) + "]\n" for p, c in zip("abcdefg", "bcdefgh"))

CASES = [
    # --- YAML itself --------------------------------------------------------------------------
    Case("yaml-bad-indentation",
         "name: job\nnum_nodes: 1\n  run: echo hi\n",
         line=3, says=("not valid YAML",)),
    Case("yaml-bad-indentation-dry-run",
         "num_nodes: 1\n  run: echo hi\n",
         line=2, says=("not valid YAML",), command=DRY),
    Case("yaml-unclosed-bracket-points-at-opening",
         "num_nodes: 1\nrun: [echo hi\nsetup: true\n",
         line=2, says=("not valid YAML",)),
    Case("yaml-unclosed-flow-mapping-points-at-opening",
         "name: job\nresources: {provider: local,\n  ports: [8080]\nrun: echo hi\n",
         line=2, says=("not valid YAML",)),
    Case("yaml-unclosed-quote-at-end-of-file-points-at-opening",
         "name: job\nnum_nodes: 1\nrun: \"echo hi\n",
         line=3, says=("not valid YAML",)),
    Case("yaml-duplicate-key",
         "num_nodes: 1\nrun: echo hi\nnum_nodes: 2\n",
         field="num_nodes", line=3, says=("twice",)),
    Case("yaml-duplicate-nested-key-dry-run",
         "resources:\n  provider: local\n  provider: local\nrun: echo hi\n",
         field="resources.provider", line=3, says=("twice",), command=DRY),
    Case("empty-file", "", says=("empty",)),
    Case("only-a-comment", "# nothing here\n", says=("empty",)),
    Case("top-level-list-instead-of-mapping",
         "- num_nodes: 1\n- run: echo hi\n",
         line=1, says=("mapping",)),
    Case("task-file-does-not-exist", None, says=("does not exist",)),
    # --- unknown and misspelt fields ----------------------------------------------------------
    Case("misspelt-top-level-num_node-suggests-num_nodes",
         "name: job\nnum_node: 2\nrun: echo hi\n",
         field="num_node", line=2, says=("num_nodes", "unknown field")),
    Case("misspelt-nested-acelerators-suggests-accelerators",
         "num_nodes: 1\nresources:\n  acelerators: A100:1\nrun: echo hi\n",
         field="resources.acelerators", line=3, says=("Did you mean 'accelerators'",)),
    Case("misspelt-train-field-suggests-script",
         "workdir: .\ntrain:\n  scrpit: train.py\n",
         field="train.scrpit", line=3, says=("'script'",)),
    # --- wrong types and values ---------------------------------------------------------------
    Case("num_nodes-is-a-word",
         "num_nodes: two\nrun: echo hi\n",
         field="num_nodes", line=1, says=("two",)),
    Case("num_nodes-is-zero",
         "run: echo hi\nnum_nodes: 0\n",
         field="num_nodes", line=2, says=("1",)),
    Case("accelerators-count-is-a-word",
         "resources:\n  provider: local\n  accelerators: A100:three\nrun: echo hi\n",
         field="resources.accelerators", line=3, says=("three",)),
    Case("ssh_cidr-is-not-a-network",
         "resources:\n  ssh_cidr: 10.0.0.300/32\nrun: echo hi\n",
         field="resources.ssh_cidr", line=2, says=("10.0.0.300/32",)),
    Case("port-out-of-range",
         "run: echo hi\nresources:\n  ports: [8080, 70000]\n",
         field="resources.ports", line=3, says=("70000",)),
    Case("bad-cluster-name",
         "name: 9_Job\nrun: echo hi\n",
         field="name", line=1, says=("starting with a letter",)),
    Case("outputs-absolute-path",
         "run: echo hi\noutputs: [ckpt/, /etc]\n",
         field="outputs", line=2, says=("/etc",)),
    # --- run / train --------------------------------------------------------------------------
    Case("run-and-train-both",
         "workdir: .\nrun: echo hi\ntrain:\n  script: train.py\n",
         says=("'run'", "'train'", "not both"), files={"train.py": "print(1)\n"}),
    Case("neither-run-nor-train",
         "num_nodes: 1\nname: job\n",
         says=("'run'", "'train'")),
    Case("train-script-and-module-both",
         "workdir: .\ntrain:\n  script: train.py\n  module: pkg.train\n",
         field="train", line=2, says=("script", "module"), files={"train.py": "print(1)\n"}),
    Case("train-script-missing-from-workdir",
         "workdir: .\ntrain:\n  script: missing.py\n",
         field="train.script", line=3, says=("missing.py",)),
    Case("workdir-directory-missing",
         "num_nodes: 1\nworkdir: ./no-such-dir\nrun: echo hi\n",
         field="workdir", line=2, says=("no-such-dir",)),
    # --- what the YAML reader builds (finding 15): bounded, and never a traceback ---------------
    Case("yaml-recursive-alias",
         "name: job\nenvs: &a [*a]\nrun: echo hi\n",
         line=2, says=("'*a'", "loop")),
    Case("yaml-500-levels-of-nesting",
         "run: echo hi\nenvs: " + "[" * 500 + "]" * 500 + "\n",
         line=2, says=("nested more than 32 levels",)),
    Case("yaml-500-levels-of-block-nesting-cost",
         "run: echo hi\nenvs:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(500)),
         line=34, says=("nested more than 32 levels",), command=("cost",)),
    Case("yaml-alias-bomb-7-levels-of-10",
         "run: echo hi\n" + BOMB,
         line=6, says=("aliases expanded", "20000 values")),
    Case("yaml-alias-bomb-dry-run",
         "run: echo hi\n" + BOMB, line=6, says=("aliases expanded",), command=DRY),
    Case("yaml-tag-int-abc",
         "num_nodes: !!int abc\nrun: echo hi\n",
         line=1, says=("'abc' cannot be read as int", "Quote")),
    Case("yaml-tag-bool-maybe",
         "run: echo hi\nresources:\n  use_spot: !!bool maybe\n",
         line=3, says=("'maybe' cannot be read as bool",)),
    Case("yaml-tag-timestamp-2001-13-45",
         "run: echo hi\nsetup: !!timestamp 2001-13-45\n",
         line=2, says=("timestamp", "not supported")),
    Case("yaml-custom-tag",
         "run: !custom x\n",
         line=1, says=("'!custom'", "not supported")),
    Case("yaml-tag-directive-shorthand",
         "%TAG !e! tag:example.com,2000:\n---\nrun: !e!foo x\n",
         line=3, says=("tag:example.com,2000:foo", "not supported")),
    Case("yaml-merge-key",
         "envs: &e {A: '1'}\nresources:\n  <<: {provider: local}\nrun: echo hi\n",
         line=3, says=("merge keys",)),
    Case("yaml-nul-in-workdir",
         "workdir: \"pro\\0ject\"\nrun: echo hi\n",
         line=1, says=("NUL",)),
    Case("yaml-raw-control-character",
         "name: job\nrun: echo \x07hi\n",
         line=2, says=("not valid YAML", "#x0007")),
    Case("task-file-over-256-kB",
         "run: echo hi\n# " + "x" * 300_000 + "\n",
         says=("larger than 256 kB",), command=("cost",)),
    # --- paths (finding 16) -------------------------------------------------------------------
    Case("workdir-5000-characters",
         "run: echo hi\nworkdir: " + "a" * 5000 + "\n",
         field="workdir", line=2, says=("5000 bytes",)),
    Case("file-mount-target-5000-characters",
         "run: echo hi\nfile_mounts:\n  ? " + "d/" * 2500 + "x\n  : ./d\n",
         field="file_mounts", line=2, says=("5001 bytes",), files={"d/x": "x\n"}),
    Case("file-mount-local-path-with-nul",
         "run: echo hi\nfile_mounts:\n  data: \"./d\\0\"\n",
         line=3, says=("NUL",), files={"d/x": "x\n"}),
    Case("file-mount-target-climbs-out-of-the-workdir",
         "workdir: .\nfile_mounts:\n  ../../../../tmp/ct-escape: ./d\nrun: echo hi\n",
         field="file_mounts", line=2, says=("'..'",), files={"d/x": "x\n"}),
    Case("file-mount-target-climbs-out-dry-run",
         "file_mounts:\n  a/../../x: ./d\nrun: echo hi\n",
         field="file_mounts", line=1, says=("'..'",), files={"d/x": "x\n"}, command=DRY),
    Case("file-mount-target-in-home-dir",
         "file_mounts:\n  ~/x: ./d\nrun: echo hi\n",
         field="file_mounts", line=1, says=("'~'",), files={"d/x": "x\n"}),
    Case("file-mount-target-is-the-workdir",
         "file_mounts:\n  ./: ./d\nrun: echo hi\n",
         field="file_mounts", line=1, says=("workdir itself",), files={"d/x": "x\n"}),
    # --- numbers that are not (finding 18) ----------------------------------------------------
    Case("max_hours-inf-cost",
         "run: echo hi\nmax_hours: .inf\n",
         field="max_hours", line=2, says=("finite",), command=("cost",)),
    Case("max_hours-nan-launch",
         "run: echo hi\nmax_hours: .nan\n",
         field="max_hours", line=2, says=("finite",)),
    Case("max_hours-absurd",
         "run: echo hi\nmax_hours: 1.0e9\n",
         field="max_hours", line=2, says=("8784",), command=("cost",)),
    Case("max_cost_usd-inf",
         "run: echo hi\nmax_cost_usd: .inf\n",
         field="max_cost_usd", line=2, says=("finite",), command=DRY),
    Case("max_hourly_cost-nan",
         "run: echo hi\nresources:\n  max_hourly_cost: .nan\n",
         field="resources.max_hourly_cost", line=3, says=("finite",), command=("cost",)),
    Case("envs-value-nan",
         "run: echo hi\nenvs:\n  A: .nan\n",
         field="envs.A", line=3, says=("nan", "finite"), command=("cost",)),
    Case("local-price-per-hour-minus-inf",
         "run: echo hi\nresources:\n  local:\n    price_per_hour: -.inf\n",
         field="resources.local.price_per_hour", line=4, says=("finite",), command=DRY),
    Case("num_nodes-inf",
         "run: echo hi\nnum_nodes: .inf\n",
         field="num_nodes", line=2, command=("cost",)),
    # --- providers and their options ----------------------------------------------------------
    Case("unknown-provider-awz",
         "resources:\n  provider: awz\nrun: echo hi\n",
         field="resources.provider", line=2, says=("awz",), any_of=("'aws'", "local, ssh")),
    Case("unknown-provider-awz-dry-run",
         "run: echo hi\nresources:\n  provider: awz\n",
         field="resources.provider", line=3, says=("awz",), any_of=("'aws'", "local, ssh"),
         command=DRY),
    Case("ssh-options-under-local-provider",
         "resources:\n  provider: local\n  ssh:\n    hosts: [{address: 10.0.0.1}]\nrun: echo hi\n",
         field="resources.ssh", line=3, says=("provider: ssh",)),
    Case("local-network-option-bogus-dry-run",
         "resources:\n  provider: local\n  local:\n    network: bogus\nrun: echo hi\n",
         field="resources.local.network", line=4, says=("netns",), command=DRY),
    Case("local-option-misspelt-suggests-network",
         "run: echo hi\nresources:\n  local:\n    netwrk: netns\n",
         field="resources.local.netwrk", line=4, says=("'network'",)),
    Case("accelerators-on-local-provider-dry-run",
         "resources:\n  accelerators: A100:8\nrun: echo hi\n",
         says=("resources.accelerators", "A100:8"), command=DRY, names_file=False),
]


COST = ("cost",)
RUN = "run: echo hi\n"


def _ckpt(url: str, bucket: str, *, command: tuple[str, ...] = ("launch",), says: str = "",
          cid: str = "") -> Case:
    """A checkpoints URL whose bucket breaks its cloud's naming rules."""
    return Case(cid or f"bucket-name-{bucket}-{command[0]}", f"{RUN}checkpoints: {url}\n",
                field="checkpoints", line=2, command=command,
                says=(f"'{bucket}' is not a valid", says) if says else (f"'{bucket}' is not a valid",))


# Issue 21, generated bad input: each was accepted (or leaked) before.
CASES += [
    _ckpt("s3://xn--abc/run", "xn--abc", says="'xn--'"),
    _ckpt("s3://sthree-data/run", "sthree-data", says="'sthree-'", command=DRY),
    _ckpt("s3://sthree-configurator-x", "sthree-configurator-x", says="'sthree-'", command=COST),
    _ckpt("s3://amzn-s3-demo-bucket", "amzn-s3-demo-bucket", says="'amzn-s3-demo-'"),
    _ckpt("s3://data-s3alias/x", "data-s3alias", says="'-s3alias'", command=DRY),
    _ckpt("s3://data--ol-s3/x", "data--ol-s3", says="'--ol-s3'", command=COST),
    _ckpt("s3://data.mrap/x", "data.mrap", says="'.mrap'"),
    _ckpt("s3://data--x-s3/x", "data--x-s3", says="'--x-s3'", command=DRY),
    _ckpt("s3://data--table-s3/x", "data--table-s3", says="'--table-s3'"),
    _ckpt("s3://192.168.5.4/x", "192.168.5.4", says="IP address", command=COST),
    _ckpt("gs://goog-data/x", "goog-data", says="'goog'"),
    _ckpt("gs://my-google-data/x", "my-google-data", says="'google'", command=DRY),
    _ckpt("gs://my-g00gle-data/x", "my-g00gle-data", says="'g00gle'", command=COST),
    _ckpt("gs://" + "a" * 64, "a" * 64, says="at most 63", cid="bucket-name-gs-64-chars"),
    _ckpt("gs://" + "a" * 64 + ".example.com", "a" * 64 + ".example.com",
          says="longer than 63", cid="bucket-name-gs-dotted-part-64-chars"),
    Case("bucket-prefix-empty-segment", f"{RUN}checkpoints: s3://my-bucket//x\n",
         field="checkpoints", line=2, says=("empty path segment",)),
    Case("bucket-prefix-empty-segment-mount-cost",
         f"{RUN}file_mounts:\n  data: gs://my-bucket/a//b\n", field="file_mounts", line=2,
         says=("empty path segment",), command=COST),
    Case("mount-source-file-scheme", f"{RUN}file_mounts:\n  data: file:///etc\n",
         field="file_mounts", line=2, says=("is not a bucket URL",)),
    Case("mount-source-unknown-scheme-dry-run", f"{RUN}file_mounts:\n  data: ftp://host/x\n",
         field="file_mounts", line=2, says=("is not a bucket URL",), command=DRY),
    Case("bucket-url-credentials-not-echoed",
         f"{RUN}checkpoints: s3://AKIAEXAMPLEKEY:wJalrXUtnFEMIK7MDENGbPxRfiCYSECRET@my-bucket/x\n",
         field="checkpoints", line=2, says=("carries credentials", "s3://***@my-bucket/x"),
         never=("wJalrXUtnFEMIK7MDENGbPxRfiCYSECRET", "AKIAEXAMPLEKEY")),
    Case("bucket-url-credentials-not-echoed-cost",
         f"{RUN}file_mounts:\n  d: gs://key:TOPSECRET1@my-bucket/x\n", field="file_mounts",
         line=2, says=("carries credentials",), never=("TOPSECRET1", "key:"), command=COST),
    Case("bucket-url-sas-token-not-echoed",
         f"{RUN}checkpoints: https://acct1.blob.core.windows.net/c1/x?sv=2022&sig=SASSECRET9\n",
         field="checkpoints", line=2, says=("'?' or '#'",), never=("SASSECRET9", "sv=2022")),
    Case("bucket-url-credentials-with-space-not-echoed",
         f"{RUN}checkpoints: 's3://KEY:SPACESECRET@my-bucket/a b'\n", field="checkpoints",
         line=2, says=("spaces",), never=("SPACESECRET",), command=DRY),
    Case("bootstrap-python-over-path-limit",
         f"{RUN}bootstrap:\n  python: /{'p/' * 2500}python\n", field="bootstrap.python",
         line=3, says=("4096",)),
    Case("bootstrap-python-over-path-limit-cost",
         f"{RUN}bootstrap:\n  python: /{'p/' * 2500}python\n", field="bootstrap.python",
         line=3, says=("4096",), command=COST),
    Case("ssh-host-read-as-option",
         f"{RUN}resources:\n  provider: ssh\n  ssh:\n    hosts: ['-oProxyCommand=touch PWNED']\n",
         field="resources.ssh.hosts.0.address", says=("not starting with '-'",)),
    Case("ssh-host-read-as-option-dry-run",
         f"{RUN}resources:\n  provider: ssh\n  ssh:\n"
         "    hosts: [{address: -oProxyCommand=x, user: ubuntu}]\n",
         field="resources.ssh.hosts.0.address", command=DRY),
    Case("ssh-host-read-as-option-cost",
         f"{RUN}resources:\n  provider: ssh\n  ssh:\n    hosts: [ubuntu@-oProxyCommand=x]\n",
         field="resources.ssh.hosts.0.address", command=COST),
    Case("ssh-user-read-as-option",
         f"{RUN}resources:\n  provider: ssh\n  ssh:\n    hosts: [{{address: h1, user: -oX=y}}]\n",
         field="resources.ssh.hosts.0.user", says=("login name",)),
    Case("ssh-internal-ip-with-newline",
         f"{RUN}resources:\n  provider: ssh\n  ssh:\n"
         "    hosts: [{address: h1, internal_ip: \"h2\\n  ProxyCommand x\"}]\n",
         field="resources.ssh.hosts.0.internal_ip", command=DRY),
    Case("train-module-read-as-option",
         "train:\n  module: -cimport os\n", field="train.module", line=2,
         says=("not a Python module name",)),
    Case("train-script-outside-workdir",
         "workdir: .\ntrain:\n  script: /etc/passwd\n", field="train.script", line=3,
         says=("inside workdir",)),
]


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1"})
    return env


def _cloudtrain(home: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cloudtrain", *args], capture_output=True,
                          text=True, timeout=60, env=_env(home), cwd=cwd, stdin=subprocess.DEVNULL)


def _created(home: Path) -> list[str]:
    """What a refused command must not have left behind."""
    found = []
    clusters = home / "clusters"
    if clusters.exists():
        found += [str(p) for p in clusters.rglob("*")]
    db = home / "state.db"
    if db.exists():
        with sqlite3.connect(db) as conn:
            rows = conn.execute("SELECT name FROM clusters").fetchall()
        found += [f"clusters row {r[0]!r}" for r in rows]
    return found


@pytest.fixture
def home(tmp_path: Path):  # type: ignore[no-untyped-def]
    h = tmp_path / "home"
    yield h
    # Should a case ever be accepted by mistake, take down whatever it started.
    if _created(h):
        subprocess.run([sys.executable, "-m", "cloudtrain", "down", "-a", "-y"], env=_env(h),
                       capture_output=True, timeout=120)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_task_is_refused_cleanly(case: Case, tmp_path: Path, home: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    for rel, content in case.files.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(content)
    task_file = proj / "task.yaml"
    if case.yaml is not None:
        task_file.write_text(case.yaml)

    r = _cloudtrain(home, *case.command, str(task_file), cwd=tmp_path)
    err = r.stderr
    context = f"\n--- stdout:\n{r.stdout}\n--- stderr:\n{err}"

    assert r.returncode == 2, context
    assert "Traceback" not in err and "Traceback" not in r.stdout, context
    assert err.startswith("error: "), context
    assert len(err) < MAX_MESSAGE, f"message is {len(err)} chars{context}"
    if case.names_file:
        assert str(task_file) in err, f"the message should name the task file{context}"
    if case.field is not None:
        assert f"field '{case.field}'" in err, context
    if case.line is not None:
        lines = re.findall(r"\bline (\d+)\b", err)
        assert lines == [str(case.line)], f"expected 'line {case.line}'{context}"
    for word in case.says:
        assert word in err, f"expected {word!r}{context}"
    if case.any_of:
        assert any(w in err for w in case.any_of), f"expected one of {case.any_of}{context}"
    for word in case.never:
        assert word not in err + r.stdout, f"{word!r} must not be shown{context}"
    assert _created(home) == [], context


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 14


@needs_sshd
def test_valid_minimal_task_dry_run_plans_local_and_creates_nothing(tmp_path: Path,
                                                                    home: Path) -> None:
    task_file = tmp_path / "hello.yaml"
    task_file.write_text("num_nodes: 1\nrun: echo hi\n")
    r = _cloudtrain(home, "up", "--dry-run", str(task_file), cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Traceback" not in out
    assert "dry run" in out
    assert re.search(r"provider\s+local\b", out), out
    assert "cluster 'hello'" in out, out
    assert re.search(r"nodes\s+1\b", out), out
    assert _created(home) == []


@needs_sshd
def test_valid_task_with_local_options_dry_run(tmp_path: Path, home: Path) -> None:
    """The options a provider does accept get through, and show up in the plan."""
    task_file = tmp_path / "two.yaml"
    task_file.write_text("name: two-nodes\nnum_nodes: 2\nresources:\n  local:\n"
                         "    network: loopback\nrun: echo hi\n")
    r = _cloudtrain(home, "up", "--dry-run", str(task_file), cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "cluster 'two-nodes'" in out and re.search(r"nodes\s+2\b", out), out
    assert "loopback" in out, out
    assert _created(home) == []
