"""The wheel is what users get: build it, install it into a fresh venv, and check that the
shipped data files, the provider entry points and the package layout come from that venv,
not from this checkout. Takes a few seconds (no network: the venv sees the system's deps)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    env = dict(os.environ)
    # Nothing from this checkout may leak into the venv's imports.
    env.pop("PYTHONPATH", None)
    env.update({"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_NO_INDEX": "1"})
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, **kw)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(out), str(REPO)], cwd=out)
    wheels = list(out.glob("cloudtrain-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv") / "v"
    # System site-packages: the dependencies (click, pydantic, ...) resolve offline. No pip of
    # its own: the system's pip, run by the venv's python, installs into the venv.
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root)
    py = root / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "--no-deps", "--force-reinstall", "-q", str(wheel)],
         cwd=root)
    return py


def _probe(py: Path, code: str) -> dict:  # type: ignore[type-arg]
    """Run ``code`` (which sets ``out``) in the venv, from a directory outside the checkout."""
    script = "import json\n" + code + "\nprint(json.dumps(out))\n"
    r = _run([str(py), "-c", script], cwd=py.parent)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _site_packages(py: Path) -> Path:
    out = _probe(py, "import sysconfig\nout = sysconfig.get_paths()['purelib']")
    return Path(out).resolve()  # type: ignore[arg-type]


def _inside(path: str | Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root)


def test_venv_imports_the_wheel_not_the_checkout(venv_python: Path) -> None:
    sp = _site_packages(venv_python)
    assert _inside(sp, venv_python.parent.parent)
    out = _probe(venv_python, "import cloudtrain, cloudtrain_provisioners, cloudtrain.spec\n"
                              "out = [cloudtrain.__file__, cloudtrain_provisioners.__file__, "
                              "cloudtrain.__version__]")
    assert _inside(out[0], sp) and _inside(out[1], sp), out
    assert not _inside(out[0], REPO) and not _inside(out[1], REPO), out


def test_wheel_bootstrap_and_templates_live_in_site_packages(venv_python: Path) -> None:
    sp = _site_packages(venv_python)
    out = _probe(venv_python, "from cloudtrain import paths\n"
                              "b, t = paths.bootstrap_dir(), paths.templates_dir()\n"
                              "out = {'b': str(b), 't': str(t),\n"
                              "       'bf': sorted(p.name for p in b.iterdir()),\n"
                              "       'tf': sorted(str(p.relative_to(t)) for p in t.rglob('*'))}")
    assert Path(out["b"]).resolve() == sp / "cloudtrain" / "_data" / "bootstrap", out
    assert Path(out["t"]).resolve() == sp / "cloudtrain" / "_data" / "templates", out
    for name in ("node.sh", "lib.sh", "versions.tsv", "cuda_drivers.tsv", "ctjob.sh", "ctkill.sh",
                 "ctworker.sh"):
        assert name in out["bf"], out["bf"]
        assert (sp / "cloudtrain" / "_data" / "bootstrap" / name).stat().st_size > 0
    for rel in ("train/train.py", "train/task.yaml", "train/task-aws.yaml", "train/README.md"):
        assert rel in out["tf"], out["tf"]
    # The shipped example task is itself a valid task file.
    task = sp / "cloudtrain" / "_data" / "templates" / "train" / "task.yaml"
    out = _probe(venv_python, f"from cloudtrain.spec import load_task\n"
                              f"t = load_task({str(task)!r})\n"
                              f"out = [t.num_nodes, t.train.script, t.train.nproc_per_node]")
    assert out == [2, "train.py", 2]


def test_wheel_provider_entry_points_load_from_the_venv(venv_python: Path) -> None:
    sp = _site_packages(venv_python)
    out = _probe(venv_python, "import sys\n"
                              "from importlib.metadata import entry_points\n"
                              "out = {}\n"
                              "for ep in entry_points(group='cloudtrain.providers'):\n"
                              "    cls = ep.load()\n"
                              "    out[ep.name] = [ep.value, sys.modules[cls.__module__].__file__,\n"
                              "                    cls.name]")
    assert {"local", "ssh"} <= set(out), out
    for name in ("local", "ssh"):
        value, module_file, cls_name = out[name]
        assert value.startswith("cloudtrain_provisioners."), value
        assert cls_name == name
        assert _inside(module_file, sp / "cloudtrain_provisioners"), module_file
        assert not _inside(module_file, REPO / "provisioners"), module_file


def test_wheel_layout_has_no_stray_top_level_packages(wheel: Path, venv_python: Path) -> None:
    sp = _site_packages(venv_python)
    assert not (sp / "provisioners").exists()
    assert not (sp / "tests").exists()
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"cloudtrain", "cloudtrain_provisioners", "cloudtrain-0.1.0.dist-info"}, tops
    assert "cloudtrain/_data/bootstrap/node.sh" in names
    eps = zipfile.ZipFile(wheel).read("cloudtrain-0.1.0.dist-info/entry_points.txt").decode()
    assert "[cloudtrain.providers]" in eps and "cloudtrain = cloudtrain.commands.main:main" in eps


def test_wheel_console_script_runs(venv_python: Path) -> None:
    script = venv_python.parent / "cloudtrain"
    assert script.exists()
    r = _run([str(script), "--version"], cwd=venv_python.parent)
    assert "0.1.0" in r.stdout


def test_wheel_ships_no_gitignored_files(wheel: Path) -> None:
    """bootstrap/ and templates/ are force-included: a demo run's cloudtrain-outputs/ (or a
    __pycache__) in the checkout must not end up in the wheel."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    shipped = []
    for n in zipfile.ZipFile(wheel).namelist():
        for d in ("bootstrap", "templates"):
            prefix = f"cloudtrain/_data/{d}/"
            if n.startswith(prefix):
                shipped.append(f"{d}/{n[len(prefix):]}")
    assert shipped
    r = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], input="\n".join(shipped),
                       capture_output=True, text=True, cwd=REPO, timeout=30)
    ignored = r.stdout.split()
    assert ignored == [], f"the wheel ships git-ignored files: {ignored}"


def test_editable_install_finds_data_at_repo_root() -> None:
    import cloudtrain

    if Path(cloudtrain.__file__).resolve().parent != REPO / "cloudtrain":
        pytest.skip("cloudtrain is not installed editable from this checkout")
    # A fresh interpreter, as a user would start it, from outside the checkout.
    code = ("import json, cloudtrain_provisioners\nfrom cloudtrain import paths\n"
            "print(json.dumps([str(paths.bootstrap_dir()), str(paths.templates_dir()), "
            "cloudtrain_provisioners.__file__]))")
    r = _run([sys.executable, "-c", code], cwd="/")
    b, t, prov = json.loads(r.stdout)
    assert Path(b).resolve() == REPO / "bootstrap"
    assert Path(t).resolve() == REPO / "templates"
    assert Path(prov).resolve().is_relative_to(REPO / "provisioners" / "cloudtrain_provisioners")
