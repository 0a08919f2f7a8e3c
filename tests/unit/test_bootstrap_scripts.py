"""bootstrap/node.sh on fake nodes: stub commands on PATH (nvidia-smi, lspci, apt-get, dnf,
dpkg, curl, modprobe, sudo, python3 with pip and venv) record every call and keep a little
state, so a "driver install" makes nvidia-smi answer and a "pip install" makes torch appear.
Each case checks what the script installed, what it left alone, and what it told the user."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BOOT = REPO / "bootstrap"

STUBS = {
    "nvidia-smi": r"""
echo "nvidia-smi $*" >> "$STUB_LOG"
[ -f "$STUB_STATE/driver" ] || { echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2; exit 9; }
drv=$(cat "$STUB_STATE/driver")
case "$*" in
  *name,driver_version*) while IFS= read -r g; do echo "$g, $drv"; done < "$STUB_STATE/gpus" ;;
  *driver_version*) while IFS= read -r g; do echo "$drv"; done < "$STUB_STATE/gpus" ;;
  *) echo "unexpected nvidia-smi $*" >&2; exit 2 ;;
esac
""",
    "lspci": r"""
echo "lspci $*" >> "$STUB_LOG"
echo "00:01.0 ISA bridge [0601]: Intel Corporation 82371SB PIIX3 ISA [8086:7000]"
i=0
if [ -f "$STUB_STATE/pci" ]; then
  while IFS= read -r g; do
    i=$((i + 1)); echo "00:1$i.0 3D controller [0302]: NVIDIA Corporation $g [10de:20b0] (rev a1)"
  done < "$STUB_STATE/pci"
fi
""",
    "apt-get": r"""
echo "apt-get $*" >> "$STUB_LOG"
case "$*" in *cuda-drivers-*) echo "580.95.05" > "$STUB_STATE/driver" ;; esac
case "$*" in *python3-venv*) rm -f "$STUB_STATE/no-venv" ;; esac
""",
    "dnf": 'echo "dnf $*" >> "$STUB_LOG"\n',
    "dpkg": 'echo "dpkg $*" >> "$STUB_LOG"\n',
    "modprobe": 'echo "modprobe $*" >> "$STUB_LOG"\n',
    "sudo": 'echo "sudo $*" >> "$STUB_LOG"\n[ "$1" = -n ] && shift\nexec "$@"\n',
    "curl": r"""
echo "curl $*" >> "$STUB_LOG"
while [ $# -gt 0 ]; do [ "$1" = -o ] && { : > "$2"; shift; }; shift; done
""",
    # A Python with venv and pip. Its environment root is two levels above the executable;
    # "torch" there holds the installed version, "torch_cuda" its CUDA build.
    "python3": r"""
me="$0"; envroot=$(cd "$(dirname "$me")/.." && pwd)
case "$1" in
  -c)
    if [[ "$2" == *cuda.is_available* ]]; then
      echo "python -c cuda-check ($envroot)" >> "$STUB_LOG"
      [ -f "$STUB_STATE/cuda-broken" ] && { echo "AssertionError: torch.cuda.is_available() is False"; exit 1; }
      grep -c . "$STUB_STATE/gpus"; exit 0
    fi
    echo "python=${STUB_PYVER:-3.10.12}"
    if [ -f "$envroot/torch" ]; then echo "torch=$(cat "$envroot/torch")"; echo "torch_cuda=$(cat "$envroot/torch_cuda" 2>/dev/null)"; else echo "torch="; fi ;;
  -m)
    case "$2" in
      venv)
        [ "$3" = --help ] && { [ -f "$STUB_STATE/no-venv" ] && exit 1; exit 0; }
        echo "python -m venv $3" >> "$STUB_LOG"
        mkdir -p "$3/bin" && cp "$me" "$3/bin/python" && chmod +x "$3/bin/python" ;;
      pip)
        echo "pip $* ($envroot)" >> "$STUB_LOG"
        idx=$(printf '%s\n' "$@" | grep -A1 -x -- --index-url | tail -n1)
        case "$idx" in
          */cpu) echo "2.13.0+cpu" > "$envroot/torch"; : > "$envroot/torch_cuda" ;;
          */cu*) c=${idx##*/cu}; echo "2.13.0+cu$c" > "$envroot/torch"; echo "${c:0:2}.${c:2}" > "$envroot/torch_cuda" ;;
        esac ;;
    esac ;;
  *) echo "python3 $*" >> "$STUB_LOG" ;;
esac
""",
}

OS_RELEASES = {
    "ubuntu-22.04": 'ID=ubuntu\nVERSION_ID="22.04"\nID_LIKE=debian\n',
    "rocky-9": 'ID="rocky"\nVERSION_ID="9.3"\nID_LIKE="rhel centos fedora"\n',
    "alpine": 'ID=alpine\nVERSION_ID=3.19.1\n',
}


@dataclass
class Run:
    rc: int
    out: str
    calls: list[str]
    seconds: float

    def lines(self, tag: str) -> list[str]:
        return [ln[len(tag) + 1:] for ln in self.out.splitlines() if ln.startswith(tag + " ")]

    def result(self, key: str) -> str:
        for ln in self.lines("::result"):
            k, _, v = ln.partition("=")
            if k == key:
                return v
        raise KeyError(key)

    def outcome(self, step: str) -> str:
        """The first word the step said (found / installed / skip), and its text."""
        cur = None
        for ln in self.out.splitlines():
            tag, _, rest = ln.partition(" ")
            if tag == "::step":
                cur = rest
            elif cur == step and tag in ("::found", "::installed", "::skip"):
                if tag == "::installed":  # "KEY TEXT": the key is for the results
                    rest = rest.partition(" ")[2]
                return f"{tag[2:]} {rest}"
        return ""

    def installs(self) -> list[str]:
        return [c for c in self.calls if re.match(r"(apt-get|dnf|dpkg|curl|pip|python -m venv)\b", c)]


class FakeNode:
    def __init__(self, root: Path, os_name: str = "ubuntu-22.04", *, pci: list[str] = (),
                 driver: str | None = None, system_torch: str | None = None,
                 image_env: tuple[str, str] | None = None, no_venv: bool = False) -> None:
        self.root = root
        self.bin = root / "bin"
        self.state = root / "state"
        self.home = root / "home"
        for d in (self.bin, self.state, self.home):
            d.mkdir(parents=True, exist_ok=True)
        for name, body in STUBS.items():
            p = self.bin / name
            p.write_text("#!/usr/bin/env bash\n" + body)
            p.chmod(0o755)
        (root / "os-release").write_text(OS_RELEASES[os_name])
        if pci:
            (self.state / "pci").write_text("".join(f"{g}\n" for g in pci))
        gpus = pci if driver is None else [f"NVIDIA {g.split('[')[-1].rstrip(']')}" for g in pci]
        (self.state / "gpus").write_text("".join(f"{g}\n" for g in gpus))
        if driver:
            (self.state / "driver").write_text(driver + "\n")
        if system_torch:  # the "system" python3 is bin/python3, its env root is root/
            (root / "torch").write_text(system_torch + "\n")
        self.image_python = ""
        if image_env:
            env = root / "opt" / "conda" / "envs" / "pytorch"
            (env / "bin").mkdir(parents=True)
            shutil.copy(self.bin / "python3", env / "bin" / "python")
            (env / "torch").write_text(image_env[0] + "\n")
            (env / "torch_cuda").write_text(image_env[1] + "\n")
            self.image_python = str(env / "bin" / "python")
        if no_venv:
            (self.state / "no-venv").touch()
        self.log = root / "calls.log"

    def run(self, **env: str) -> Run:
        self.log.write_text("")
        full = {
            "PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.home),
            "STUB_LOG": str(self.log), "STUB_STATE": str(self.state),
            "CLOUDTRAIN_ROOT": str(self.root / "ct"),
            "CLOUDTRAIN_OS_RELEASE": str(self.root / "os-release"),
            "CLOUDTRAIN_CUDA_HOME": str(self.root / "no-cuda"),
            "CLOUDTRAIN_PYTHON_CANDIDATES": self.image_python or str(self.root / "nowhere" / "python"),
            **env,
        }
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(BOOT / "node.sh")], env=full, capture_output=True,
                           text=True, timeout=60)
        secs = time.monotonic() - t0
        calls = [c for c in self.log.read_text().splitlines() if c]
        return Run(r.returncode, r.stdout + r.stderr, calls, secs)


A100 = "GA100 [A100 SXM4 80GB]"
H100 = "GH100 [H100 SXM5 80GB]"


def test_no_gpu_gets_a_cpu_pytorch_in_its_own_virtualenv(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    r = node.run()
    assert r.rc == 0, r.out
    assert r.outcome("gpu") == "found no NVIDIA GPU"
    assert r.outcome("driver").startswith("skip")
    assert r.result("gpus") == "0"
    # No OS packages: python3 -m venv works, and no driver is needed.
    assert not [c for c in r.calls if c.startswith(("apt-get", "dpkg", "curl", "modprobe"))], r.calls
    pip = [c for c in r.calls if c.startswith("pip ")]
    assert len(pip) == 1 and "--index-url https://download.pytorch.org/whl/cpu torch" in pip[0], pip
    assert r.result("python_bin") == str(tmp_path / "ct" / "venv" / "bin")
    assert r.result("torch") == "2.13.0+cpu"
    assert r.result("installed") == "venv,torch"


def test_gpu_without_driver_installs_driver_then_a_matching_pytorch(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[A100] * 8)
    r = node.run()
    assert r.rc == 0, r.out
    assert r.outcome("gpu") == f"found 8x {A100} (ampere)"
    # NVIDIA's repository for this OS, then the table's driver branch for this generation.
    curl = [c for c in r.calls if c.startswith("curl")]
    assert curl and "repos/ubuntu2204/x86_64/cuda-keyring" in curl[0], r.calls
    apt_install = [c for c in r.calls if c.startswith("apt-get") and " install " in c]
    assert any("cuda-drivers-580" in c for c in apt_install), r.calls
    assert r.calls.index(next(c for c in r.calls if c.startswith("dpkg -i"))) < \
        r.calls.index(apt_install[0]), "the repository must be added before the install"
    assert "modprobe nvidia" in r.calls
    assert r.outcome("driver") == "installed NVIDIA driver 580.95.05 (branch 580)"
    pip = [c for c in r.calls if c.startswith("pip ")]
    assert len(pip) == 1 and "https://download.pytorch.org/whl/cu126" in pip[0], pip
    assert r.result("torch") == "2.13.0+cu126" and r.result("torch_cuda") == "12.6"
    # CUDA is checked for real before any training gets to find out.
    assert any(c.startswith("python -c cuda-check") for c in r.calls)
    assert r.outcome("cuda-check") == "found PyTorch 2.13.0+cu126 sees 8 GPU(s)"
    assert r.result("installed") == "driver,venv,torch"


def test_second_run_installs_nothing_and_takes_under_a_second(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[A100] * 2)
    first = node.run()
    assert first.rc == 0, first.out
    assert first.installs()
    second = node.run()
    assert second.rc == 0, second.out
    assert second.installs() == [], second.calls
    assert second.result("installed") == ""
    # The CUDA check stamp holds for the same torch, driver and GPU count.
    assert not any(c.startswith("python -c cuda-check") for c in second.calls)
    for step in ("driver", "python", "torch", "cuda-check"):
        assert second.outcome(step).startswith("found"), (step, second.out)
    assert second.seconds < 1.0, second.seconds


def test_gpu_with_driver_but_no_torch_installs_only_torch(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[H100] * 8, driver="550.90.07")
    r = node.run()
    assert r.rc == 0, r.out
    assert r.outcome("driver") == "found NVIDIA driver 550.90.07"
    assert not [c for c in r.calls if c.startswith(("apt-get", "dpkg", "curl", "modprobe"))], r.calls
    pip = [c for c in r.calls if c.startswith("pip ")]
    assert len(pip) == 1 and "whl/cu126" in pip[0]
    assert r.result("gpu_gen") == "hopper"
    assert r.result("installed") == "venv,torch"


def test_driver_too_old_for_the_wanted_pytorch_stops_before_installing(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[A100], driver="470.82.01")
    r = node.run()
    assert r.rc == 5, r.out
    fail = r.lines("::fail")
    assert fail and "470.82.01 is older than 525.60.13" in fail[0] and "CUDA would be unavailable" in fail[0]
    assert not [c for c in r.calls if c.startswith("pip ")], "nothing installed that cannot work"


def test_image_with_everything_costs_no_installs(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[A100] * 4, driver="535.183.01",
                    image_env=("2.13.0+cu126", "12.6"))
    r = node.run()
    assert r.rc == 0, r.out
    assert r.installs() == [], r.calls
    assert r.result("python_bin") == str(Path(node.image_python).parent)
    assert r.outcome("torch") == "found PyTorch 2.13.0+cu126 (CUDA 12.6)"
    assert r.outcome("cuda-toolkit").startswith("skip not asked for")
    assert r.result("installed") == ""


@pytest.mark.parametrize("torch, cuda, driver, needle", [
    ("2.13.0+cpu", "", "550.90.07", "CPU-only build"),
    ("2.13.0+cu130", "13.0", "550.90.07", "CUDA 13.0 needs driver 580.65.06 or newer"),
])
def test_installed_pytorch_that_cannot_use_the_gpus_is_caught(tmp_path: Path, torch: str, cuda: str,
                                                               driver: str, needle: str) -> None:
    node = FakeNode(tmp_path, pci=[A100], driver=driver, image_env=(torch, cuda))
    r = node.run()
    assert r.rc == 5, r.out
    assert needle in r.lines("::fail")[0]
    assert r.installs() == []


def test_cuda_unavailable_at_runtime_is_reported_not_stamped(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[A100], driver="550.90.07", image_env=("2.13.0+cu126", "12.6"))
    (node.state / "cuda-broken").touch()
    r = node.run()
    assert r.rc == 5 and "cannot use the GPUs" in r.lines("::fail")[0], r.out
    (node.state / "cuda-broken").unlink()
    r2 = node.run()
    assert r2.rc == 0, "a failed check must not leave a stamp that hides the problem"
    assert any(c.startswith("python -c cuda-check") for c in r2.calls)


def test_unsupported_os_that_needs_a_driver_fails_with_a_fix_and_installs_nothing(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, "alpine", pci=[A100])
    r = node.run()
    assert r.rc == 4, r.out
    fail = r.lines("::fail")[0]
    assert "alpine 3.19.1" in fail and "no NVIDIA driver" in fail and "Ubuntu" in fail
    assert r.installs() == [] and "modprobe nvidia" not in r.calls


def test_unsupported_os_with_everything_present_is_fine(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, "alpine", pci=[A100], driver="550.90.07",
                    image_env=("2.13.0+cu126", "12.6"))
    r = node.run()
    assert r.rc == 0, r.out
    assert r.installs() == []


def test_missing_venv_module_is_installed_from_the_os(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, no_venv=True)
    r = node.run()
    assert r.rc == 0, r.out
    assert any(c.startswith("apt-get") and "python3-venv" in c for c in r.calls), r.calls


def test_rhel_family_uses_dnf_and_the_rhel_repository(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, "rocky-9", pci=[A100])
    r = node.run()
    # The dnf stub installs no driver, so nvidia-smi stays silent: the script must say a
    # reboot is needed rather than carry on without a driver.
    assert r.rc == 75, r.out
    assert any("repos/rhel9/x86_64/cuda-rhel9.repo" in c for c in r.calls), r.calls
    assert any(c.startswith("dnf module install") and "nvidia-driver:580-dkms" in c for c in r.calls)
    assert "needs a reboot" in r.lines("::fail")[0]


def test_cuda_toolkit_only_when_asked(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[H100], driver="550.90.07", image_env=("2.13.0+cu126", "12.6"))
    r = node.run(CLOUDTRAIN_CUDA_TOOLKIT="1")
    assert r.rc == 0, r.out
    assert any(c.startswith("apt-get") and "cuda-toolkit-12-6" in c for c in r.calls), r.calls


def test_pinned_torch_and_index_are_passed_to_pip(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    r = node.run(CLOUDTRAIN_TORCH="torch==2.13.0", CLOUDTRAIN_TORCH_INDEX="https://mirror.example/whl/cpu")
    assert r.rc == 0, r.out
    pip = [c for c in r.calls if c.startswith("pip ")][0]
    assert "--index-url https://mirror.example/whl/cpu torch==2.13.0" in pip


# --- the version table ----------------------------------------------------------------------

def _table(name: str) -> list[list[str]]:
    rows = [ln.split("\t") for ln in (BOOT / name).read_text().splitlines()
            if ln and not ln.startswith("#")]
    return rows[1:]


def _gen_of(name: str) -> str:
    """The generation node.sh's own matcher (lib.sh gpu_row) picks for a GPU name."""
    r = subprocess.run(["bash", "-c", 'TABLES="$1"; . "$1/lib.sh"; gpu_row "$2"', "_", str(BOOT), name],
                       capture_output=True, text=True, timeout=10, env={"PATH": os.environ["PATH"]})
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0] if r.stdout.strip() else ""


@pytest.mark.parametrize("name, gen", [
    ("NVIDIA A100-SXM4-80GB", "ampere"), ("NVIDIA A10G", "ampere"), ("GA100 [A100 SXM4 40GB]", "ampere"),
    ("NVIDIA H100 80GB HBM3", "hopper"), ("GH100 [H100 SXM5 80GB]", "hopper"), ("NVIDIA H200", "hopper"),
    ("NVIDIA L4", "ada"), ("NVIDIA L40S", "ada"), ("Tesla T4", "turing"),
    ("Tesla V100-SXM2-16GB", "volta"), ("NVIDIA B200", "blackwell"), ("Tesla P100-PCIE-16GB", "pascal"),
    ("Some Future Accelerator", ""),
])
def test_table_maps_real_gpu_names_to_their_generation(name: str, gen: str) -> None:
    assert _gen_of(name) == gen


def test_table_rows_are_consistent() -> None:
    cuda = {r[0]: r for r in _table("cuda_drivers.tsv")}
    gens = _table("versions.tsv")
    assert {g[0] for g in gens} >= {"blackwell", "hopper", "ada", "ampere", "turing", "volta"}
    for gen, _match, min_driver, cuda_v, index, branch in gens:
        assert cuda_v in cuda, f"{gen}: CUDA {cuda_v} missing from cuda_drivers.tsv"
        assert index == cuda[cuda_v][2], f"{gen}: index {index} is not the CUDA {cuda_v} index"

        def key(v: str) -> tuple[int, ...]:
            return tuple(int(x) for x in v.split("."))
        assert key(min_driver) >= key(cuda[cuda_v][1]), f"{gen}: driver floor below CUDA's"
        assert int(branch) >= key(min_driver)[0], f"{gen}: installs a driver older than it needs"


@pytest.mark.parametrize("make, says", [
    (None, "does not exist on this node"),
    ("dir", "is not an executable file"),
    ("text", "is not an executable file"),
    ("old", "is Python 3.8.10; cloudtrain needs 3.9 or newer"),
], ids=["missing", "directory", "not-executable", "too-old"])
def test_asked_python_that_cannot_serve_is_named_and_nothing_is_installed(
        tmp_path: Path, make: str | None, says: str) -> None:
    """bootstrap.python names a Python the node lacks (or one that cannot serve): the python
    step fails naming the field and the path, before any virtualenv or PyTorch install."""
    node = FakeNode(tmp_path)
    asked = tmp_path / "opt" / "env" / "bin" / "python"
    extra: dict[str, str] = {}
    if make == "dir":
        asked.mkdir(parents=True)
    elif make == "text":
        asked.parent.mkdir(parents=True)
        asked.write_text("not a program\n")
    elif make == "old":
        asked.parent.mkdir(parents=True)
        shutil.copy(node.bin / "python3", asked)
        extra["STUB_PYVER"] = "3.8.10"
    r = node.run(CLOUDTRAIN_PYTHON=str(asked), CLOUDTRAIN_PYTHON_FIELD="bootstrap.python", **extra)
    assert r.rc == 6, r.out
    fail = r.lines("::fail")
    assert fail and fail[0].startswith(f"bootstrap.python: '{asked}'") and says in fail[0], r.out
    assert "remove bootstrap.python" in fail[0]
    assert r.installs() == [], r.calls
    assert "::step torch" not in r.out


def test_asked_python_that_works_is_used(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    asked = tmp_path / "opt" / "env" / "bin" / "python"
    asked.parent.mkdir(parents=True)
    shutil.copy(node.bin / "python3", asked)
    r = node.run(CLOUDTRAIN_PYTHON=str(asked), CLOUDTRAIN_PYTHON_FIELD="bootstrap.python")
    assert r.rc == 0, r.out
    assert r.result("python_bin") == str(asked.parent)
    assert not [c for c in r.calls if c.startswith("python -m venv")], r.calls


def test_a_provider_python_hint_that_is_missing_is_passed_over(tmp_path: Path) -> None:
    """Without the field (a provider's own hint, not the user's choice) a missing
    CLOUDTRAIN_PYTHON is only one candidate among others, as before; the field is set only
    for the task's bootstrap.python."""
    from cloudtrain.pipeline.bootstrap import node_env
    from cloudtrain.schema import NodeRow
    from cloudtrain.taskmodel import BootstrapSpec

    row = NodeRow("c", 0, "i", "h", 22, "u", "10.0.0.1", "UP", "/r")
    hint = {"CLOUDTRAIN_PYTHON": "/provider/python"}
    assert "CLOUDTRAIN_PYTHON_FIELD" not in node_env(BootstrapSpec(), row, hint)
    env = node_env(BootstrapSpec(python="/opt/x/python"), row, hint)
    assert env["CLOUDTRAIN_PYTHON"] == "/opt/x/python"
    assert env["CLOUDTRAIN_PYTHON_FIELD"] == "bootstrap.python"
    r = FakeNode(tmp_path).run(CLOUDTRAIN_PYTHON=str(tmp_path / "nowhere" / "python"))
    assert r.rc == 0, r.out
    assert r.result("python_bin") == str(tmp_path / "ct" / "venv" / "bin")
