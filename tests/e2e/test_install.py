"""The README's install, as a new user does it: the wheel ``python -m build`` makes, installed
into a clean venv without any cloud extra (tests/corevenv.py), used through that venv's own
``bin/cloudtrain`` from a directory outside the checkout: help, ``init``, planning a local
task, a cloud task whose SDK is missing (exit 2 with the pip line), the node bootstrap bundle
from the shipped files, and the extras the README's pip lines name.

The venv costs 15-50 s once per session (shared with test_core_install); each test then takes
a second or two, the dry-run resolution of the cloud extras 10-40 s (pip waiting on the index)."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

from conftest import REPO
from corevenv import clean_env, core_venv  # noqa: F401  (core_venv: the session's fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]   # the first test builds the venv

CLOUD_TASK = """\
name: {name}
resources:
  provider: {provider}
  accelerators: A100:8
  ssh_cidr: 10.0.0.0/8
run: echo hi
"""


class Venv:
    """``bin/cloudtrain`` (and ``bin/python``) of the core venv, with a home of its own."""

    def __init__(self, bin_dir: Path, home: Path, cwd: Path) -> None:
        self.bin, self.home, self.cwd = bin_dir, home, cwd

    def run(self, *args: str, exe: str = "cloudtrain", timeout: float = 180,
            **extra: str) -> subprocess.CompletedProcess[str]:
        env = clean_env(CLOUDTRAIN_HOME=str(self.home), **extra)
        return subprocess.run([str(self.bin / exe), *args], capture_output=True, text=True,
                              cwd=self.cwd, env=env, timeout=timeout)

    def python(self, code: str) -> str:
        r = self.run("-c", code, exe="python")
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def clusters(self) -> list[str]:
        r = self.run("status", "--json")
        assert r.returncode == 0, r.stderr
        return [c["name"] for c in json.loads(r.stdout)]


@pytest.fixture
def venv(core_venv: Path, tmp_path: Path) -> Venv:  # noqa: F811
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    return Venv(core_venv, tmp_path / "home", tmp_path / "work")


def _no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    for bad in ("Traceback", "ModuleNotFoundError", "ImportError"):
        assert bad not in r.stdout + r.stderr, r.stdout + r.stderr


def test_help_and_version_run_from_the_wheel(venv: Venv) -> None:
    where = venv.python("import cloudtrain, cloudtrain_provisioners as p\n"
                        "print(cloudtrain.__file__); print(p.__file__)").split()
    site = venv.bin.parent / "lib"
    for f in where:   # the venv's copy, not this checkout's
        assert Path(f).resolve().is_relative_to(site.resolve()), where
        assert not Path(f).resolve().is_relative_to(REPO), where
    r = venv.run("--help")
    assert r.returncode == 0, r.stderr
    _no_traceback(r)
    for cmd in ("init", "launch", "up", "cost", "down", "status"):
        assert re.search(rf"^\s+{cmd}\s", r.stdout, re.M), r.stdout
    r = venv.run("--version")
    assert r.returncode == 0 and "0.1.0" in r.stdout, r.stdout + r.stderr


def test_init_writes_the_shipped_template(venv: Venv) -> None:
    r = venv.run("init", "proj")
    assert r.returncode == 0, r.stdout + r.stderr
    proj = venv.cwd / "proj"
    written = sorted(p.name for p in proj.iterdir())
    assert written == ["README.md", "requirements.txt", "task-aws.yaml", "task.yaml", "train.py"]
    for name in written:   # byte for byte the checkout's template, through the wheel's _data
        assert (proj / name).read_bytes() == (REPO / "templates" / "train" / name).read_bytes()
    assert "cloudtrain launch proj/task.yaml" in r.stdout + r.stderr


def test_a_local_task_is_costed_and_planned_without_any_cloud_sdk(venv: Venv) -> None:
    assert venv.run("init", "proj").returncode == 0
    r = venv.run("cost", "proj/task.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    _no_traceback(r)
    assert "$0.00/h for 2 node(s)" in r.stdout, r.stdout
    r = venv.run("up", "proj/task.yaml", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    _no_traceback(r)
    plan = r.stdout + r.stderr
    assert "dry run: nothing is created" in plan and "local-cpu" in plan, plan
    assert venv.clusters() == []
    assert not (venv.home / "clusters").exists() or not any((venv.home / "clusters").iterdir())


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_cloud_task_without_its_sdk_exits_2_with_the_pip_line(venv: Venv, provider: str) -> None:
    task = venv.cwd / f"{provider}.yaml"
    task.write_text(CLOUD_TASK.format(name=f"core-{provider}", provider=provider))
    r = venv.run("up", task.name, "-y", AWS_ACCESS_KEY_ID="testing",
                 AWS_SECRET_ACCESS_KEY="testing", AWS_EC2_METADATA_DISABLED="true")
    assert r.returncode == 2, r.stdout + r.stderr
    _no_traceback(r)
    assert f"pip install 'cloudtrain[{provider}]'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 3, r.stderr   # one paragraph
    assert venv.clusters() == []
    assert not (venv.home / "clusters" / f"core-{provider}").exists()


def test_the_template_aws_task_names_the_aws_extra(venv: Venv) -> None:
    """The step after ``init`` the README suggests for a cloud, with the core install only."""
    assert venv.run("init", "proj").returncode == 0
    r = venv.run("launch", "proj/task-aws.yaml", "-y", AWS_ACCESS_KEY_ID="testing",
                 AWS_SECRET_ACCESS_KEY="testing", AWS_EC2_METADATA_DISABLED="true")
    assert r.returncode == 2, r.stdout + r.stderr
    _no_traceback(r)
    assert "pip install 'cloudtrain[aws]'" in r.stderr, r.stderr
    assert venv.clusters() == []


def test_the_node_bootstrap_bundle_is_built_from_the_shipped_files(venv: Venv) -> None:
    out = venv.python(
        "import base64, sys\n"
        "from cloudtrain.pipeline import bootstrap\n"
        "from cloudtrain import paths\n"
        "v, blob = bootstrap._bundle()\n"
        "print(paths.bootstrap_dir()); print(v); print(base64.b64encode(blob).decode())")
    where, version, blob = out.split()
    assert Path(where).resolve().is_relative_to(venv.bin.parent.resolve()), where
    import base64

    with tarfile.open(fileobj=BytesIO(base64.b64decode(blob)), mode="r:gz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    for name in ("node.sh", "lib.sh", "versions.tsv", "cuda_drivers.tsv", "ctjob.sh"):
        assert files.get(name) == (REPO / "bootstrap" / name).read_bytes(), name
    for name in ("store.py", "queue.py", "sweep.py"):
        assert files.get(name) == (REPO / "cloudtrain" / "node" / name).read_bytes(), name
    # The same bundle (the same version stamp on the nodes) as a checkout's install sends.
    from cloudtrain.pipeline import bootstrap

    assert version == bootstrap.version()


def _readme_extras() -> set[str]:
    text = (REPO / "README.md").read_text()
    lines = [ln for ln in text.splitlines() if "pip install" in ln]
    found = (re.findall(r"(?:cloudtrain|whl|\.)\[([a-z0-9_,]+)\]", ln) for ln in lines)
    return {x for groups in found for grp in groups for x in grp.split(",")}


def test_the_extras_the_readme_and_errors_name_exist(venv: Venv) -> None:
    meta = json.loads(venv.python(
        "import json\nfrom importlib.metadata import metadata, entry_points\n"
        "m = metadata('cloudtrain')\n"
        "print(json.dumps({'extras': m.get_all('Provides-Extra'),\n"
        "                  'providers': [e.name for e in entry_points(group='cloudtrain.providers')]}))"))
    extras = set(meta["extras"])
    named = _readme_extras()
    assert {"aws", "gcp", "azure"} <= named, named   # the README names every cloud's extra
    assert named <= extras, f"the README names extras the package lacks: {named - extras}"
    clouds = set(meta["providers"]) - {"local", "ssh", "slurm"}   # no SDK: no extra
    assert clouds and clouds <= extras, f"providers without an extra: {clouds - extras}"


def test_the_cloud_extras_resolve_from_the_index(venv: Venv, tmp_path: Path) -> None:
    """``pip install 'dist/cloudtrain-0.1.0-py3-none-any.whl[aws]'`` (and gcp, azure): pip
    finds every SDK the extras ask for (a dry run: nothing is installed)."""
    wheel = next((venv.bin.parent.parent / "dist").glob("cloudtrain-*.whl"))
    report = tmp_path / "report.json"
    r = venv.run("-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                 f"{wheel}[aws,gcp,azure]", exe="python", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    for sdk in ("boto3", "google-cloud-compute", "azure-identity", "azure-mgmt-compute",
                "azure-mgmt-network", "azure-mgmt-resource"):
        assert sdk in names, sorted(names)
    # The line a command prints when an SDK is missing works although cloudtrain is on no
    # index: pip keeps the installed cloudtrain and adds only the extra's SDK.
    r = venv.run("-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                 "cloudtrain[aws]", exe="python", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "boto3" in names and "cloudtrain" not in names, sorted(names)
