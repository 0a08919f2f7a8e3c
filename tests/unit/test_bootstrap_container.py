"""bootstrap/node.sh for a task with ``container:`` (CLOUDTRAIN_CONTAINER=1, bootstrap/runtime.sh):
the host gets the driver, the Docker Engine and, with a GPU, the NVIDIA Container Toolkit;
no virtualenv, no PyTorch, no CUDA toolkit. On the fake nodes of test_bootstrap_scripts.py,
with stubs for docker (its CLI, its Engine's answers and runtimes), systemctl, usermod,
nvidia-ctk, install and id: each case checks the steps chosen, what was installed, and what
the user is told."""

from __future__ import annotations

from pathlib import Path

from test_bootstrap_scripts import A100, H100, STUBS, FakeNode, Run

from cloudtrain.pipeline.bootstrap import node_env, stamp_path
from cloudtrain.schema import NodeRow
from cloudtrain.taskmodel import BootstrapSpec

DEBIAN_12 = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n'

# Who may reach the Engine: root, sudo, or a session in group docker (STUB_STATE/session-docker).
ACCESS = r"""
if [ -f "$STUB_STATE/socket-root-only" ] && [ -z "${STUB_SUDO:-}" ] && [ "${STUB_UID:-0}" != 0 ] \
    && [ ! -f "$STUB_STATE/session-docker" ]; then
  echo "permission denied while trying to connect to the Docker daemon socket" >&2; exit 1
fi
"""
DOCKER_STUBS = {
    "docker": r"""
echo "docker $*" >> "$STUB_LOG"
[ -f "$STUB_STATE/docker-installed" ] || { echo "bash: docker: command not found" >&2; exit 127; }
case "$1" in
  --version) echo "Docker version 20.10.24+dfsg1, build 297e128" ;;
  version|info)
    if [ ! -f "$STUB_STATE/engine-up" ]; then
      echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock." >&2; exit 1
    fi
""" + ACCESS + r"""
    if [ "$1" = version ]; then echo "20.10.24+dfsg1"
    elif [ -f "$STUB_STATE/nvidia-loaded" ]; then
      echo '{"nvidia":{"path":"nvidia-container-runtime"},"runc":{"path":"runc"}}'
    else echo '{"runc":{"path":"runc"}}'; fi ;;
  *) echo "unexpected docker $*" >&2; exit 2 ;;
esac
""",
    "dockerd": 'echo "dockerd $*" >> "$STUB_LOG"\n',
    "systemctl": r"""
echo "systemctl $*" >> "$STUB_LOG"
case "$1" in
  start|restart)
    [ -f "$STUB_STATE/engine-broken" ] && exit 1
    touch "$STUB_STATE/engine-up"
    [ -f "$STUB_STATE/nvidia-configured" ] && touch "$STUB_STATE/nvidia-loaded"
    exit 0 ;;
esac
""",
    "service": 'echo "service $*" >> "$STUB_LOG"\nexit 1\n',
    "usermod": 'echo "usermod $*" >> "$STUB_LOG"\n',
    "install": 'echo "install $*" >> "$STUB_LOG"\n',
    "id": r"""
[ -n "${STUB_UID:-}" ] || exec /usr/bin/id "$@"
case "$1" in
  -u) echo "$STUB_UID" ;; -un|-nG) echo alice ;; *) echo "uid=$STUB_UID(alice)" ;;
esac
""",
    # sudo marks what it runs, so that the docker stub can tell root's calls from the user's
    "sudo": 'echo "sudo $*" >> "$STUB_LOG"\n[ "$1" = -n ] && shift\nSTUB_SUDO=1 exec "$@"\n',
    "apt-get": STUBS["apt-get"] + r"""
case "$*" in *" docker.io"*) touch "$STUB_STATE/docker-installed" ;; esac
case "$*" in *nvidia-container-toolkit*) cp "$STUB_STATE/nvidia-ctk" "$(dirname "$0")/nvidia-ctk" ;; esac
""",
}
NVIDIA_CTK = r"""#!/usr/bin/env bash
echo "nvidia-ctk $*" >> "$STUB_LOG"
case "$*" in
  --version) echo "NVIDIA Container Toolkit CLI version 1.17.3"; echo "commit: 16f37fcafcbdaf" ;;
  "runtime configure --runtime=docker") touch "$STUB_STATE/nvidia-configured" ;;
esac
"""


class Node(FakeNode):
    """A fake node with Docker's stubs: ``docker`` installed or not, its Engine up or not,
    the toolkit there (and configured) or not, the socket root's only or not."""

    def __init__(self, root: Path, os_name: str = "ubuntu-22.04", *, docker: bool = True,
                 engine: bool = True, toolkit: bool = False, root_only: bool = False,
                 debian: bool = False, **kw: object) -> None:
        super().__init__(root, os_name, **kw)  # type: ignore[arg-type]
        for name, body in DOCKER_STUBS.items():
            p = self.bin / name
            p.write_text("#!/usr/bin/env bash\n" + body)
            p.chmod(0o755)
        (self.state / "nvidia-ctk").write_text(NVIDIA_CTK)
        (self.state / "nvidia-ctk").chmod(0o755)
        if debian:
            (root / "os-release").write_text(DEBIAN_12)
        marks = {"docker-installed": docker, "engine-up": engine, "socket-root-only": root_only}
        for mark, on in marks.items():
            if on:
                (self.state / mark).touch()
        if toolkit:
            (self.bin / "nvidia-ctk").write_text(NVIDIA_CTK)
            (self.bin / "nvidia-ctk").chmod(0o755)
            for mark in ("nvidia-configured", "nvidia-loaded"):
                (self.state / mark).touch()

    def container(self, **env: str) -> Run:
        return self.run(CLOUDTRAIN_CONTAINER="1", **env)


def steps(r: Run) -> list[str]:
    return r.lines("::step")


def host_installs(r: Run) -> list[str]:
    return [c for c in r.calls if c.startswith(("apt-get", "dnf", "pip", "python -m venv", "curl",
                                                "usermod", "nvidia-ctk runtime", "systemctl"))]


def test_without_a_container_no_docker_step_runs_and_pytorch_is_installed(tmp_path: Path) -> None:
    node = Node(tmp_path, pci=[H100] * 2, driver="550.90.07", docker=False, engine=False)
    r = node.run()
    assert r.rc == 0, r.out
    assert "docker" not in steps(r) and "container-toolkit" not in steps(r)
    assert not [c for c in r.calls if c.startswith(("docker", "systemctl", "nvidia-ctk"))], r.calls
    assert r.result("installed") == "venv,torch"


def test_container_on_a_node_with_docker_installs_nothing_and_skips_python_packages(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    r = node.container()
    assert r.rc == 0, r.out
    assert steps(r) == ["os", "gpu", "driver", "docker", "container-toolkit", "cuda-toolkit",
                        "python", "torch", "cuda-check", "rclone", "network"]
    assert r.outcome("docker") == "found Docker Engine 20.10.24+dfsg1"
    assert r.outcome("container-toolkit") == "skip no GPU"
    assert r.outcome("cuda-toolkit").startswith("skip the task runs in a container")
    assert r.outcome("torch") == ("skip the task runs in a container: its image brings its own "
                                  "PyTorch")
    assert r.outcome("cuda-check").startswith("skip the task runs in a container")
    # a host Python for cloudtrain's node scripts, found as it is: no venv, no pip
    assert r.outcome("python").startswith(f"found {node.bin / 'python3'} (Python 3.10.12, for "
                                          "cloudtrain's node scripts")
    assert r.result("python_bin") == str(node.bin)
    assert host_installs(r) == [], r.calls
    assert (r.result("docker"), r.result("docker_sudo"), r.result("torch")) == \
        ("20.10.24+dfsg1", "0", "")
    assert r.result("installed") == ""


def test_container_on_debian_without_docker_installs_docker_io_and_starts_it(tmp_path: Path) -> None:
    node = Node(tmp_path, docker=False, engine=False, debian=True)
    r = node.container()
    assert r.rc == 0, r.out
    assert r.result("os") == "debian-12"
    apt = [c for c in r.calls if c.startswith("apt-get install")]
    assert len(apt) == 1 and apt[0].endswith(" docker.io"), r.calls
    assert "systemctl start docker" in r.calls
    assert r.outcome("docker") == "installed Docker Engine 20.10.24+dfsg1 (docker.io)"
    assert r.result("installed") == "docker"
    assert not [c for c in r.calls if c.startswith(("pip", "python -m venv"))]


def test_container_on_a_gpu_node_gets_driver_docker_and_the_toolkit_in_that_order(
        tmp_path: Path) -> None:
    node = Node(tmp_path, pci=[A100] * 8, docker=False, engine=False)
    r = node.container()
    assert r.rc == 0, r.out
    assert r.outcome("driver") == "installed NVIDIA driver 580.95.05 (branch 580)"
    assert r.outcome("docker") == "installed Docker Engine 20.10.24+dfsg1 (docker.io)"
    assert r.outcome("container-toolkit") == ("installed NVIDIA Container Toolkit 1.17.3: "
                                              "Docker runtime 'nvidia' registered")
    calls = r.calls

    def at(needle: str) -> int:
        return next(i for i, c in enumerate(calls) if needle in c)
    # NVIDIA's libnvidia-container repository (key and list), then the package, then the
    # runtime registered with Docker, which is restarted to load it
    assert any(c.startswith("curl") and "libnvidia-container/gpgkey" in c for c in calls), calls
    listed = [c for c in calls if c.startswith("install") and "nvidia-container-toolkit.list" in c]
    assert listed, calls
    assert at(" cuda-drivers-580") < at("--no-install-recommends docker.io") \
        < at("--no-install-recommends nvidia-container-toolkit") \
        < at("nvidia-ctk runtime configure --runtime=docker") < at("systemctl restart docker")
    assert r.result("installed") == "driver,docker,container-toolkit"
    assert r.result("container_toolkit") == "1.17.3"
    assert not [c for c in calls if c.startswith(("pip", "python -m venv", "python -c cuda"))]


def test_container_on_a_ready_gpu_node_installs_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path, pci=[H100] * 4, driver="550.90.07", toolkit=True)
    r = node.container()
    assert r.rc == 0, r.out
    assert r.outcome("container-toolkit") == ("found NVIDIA Container Toolkit 1.17.3 (Docker "
                                              "runtime 'nvidia')")
    assert host_installs(r) == [], r.calls
    assert r.result("installed") == ""


def test_a_toolkit_installed_but_not_registered_is_configured(tmp_path: Path) -> None:
    node = Node(tmp_path, pci=[H100], driver="550.90.07", toolkit=True)
    (node.state / "nvidia-loaded").unlink()
    (node.state / "nvidia-configured").unlink()
    r = node.container()
    assert r.rc == 0, r.out
    assert not [c for c in r.calls if c.startswith("apt-get")], r.calls
    assert "nvidia-ctk runtime configure --runtime=docker" in r.calls
    assert "systemctl restart docker" in r.calls
    assert r.outcome("container-toolkit") == ("installed NVIDIA Container Toolkit 1.17.3 (was "
                                              "there): Docker runtime 'nvidia' registered")


def test_a_user_outside_group_docker_is_added_and_this_session_uses_sudo(tmp_path: Path) -> None:
    node = Node(tmp_path, root_only=True)
    r = node.container(STUB_UID="1000")
    assert r.rc == 0, r.out
    assert "sudo -n env PATH=" in "\n".join(r.calls)
    assert any(c == "usermod -aG docker alice" for c in r.calls), r.calls
    assert r.outcome("docker") == ("found Docker Engine 20.10.24+dfsg1; alice added to group "
                                   "docker; this session uses sudo for docker")
    assert r.result("docker_sudo") == "1"


def test_a_user_already_in_group_docker_needs_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path, root_only=True)
    (node.state / "session-docker").touch()
    r = node.container(STUB_UID="1000")
    assert r.rc == 0, r.out
    assert r.result("docker_sudo") == "0" and "usermod" not in "\n".join(r.calls)


def test_local_and_ssh_nodes_are_only_checked_and_told_the_fix(tmp_path: Path) -> None:
    node = Node(tmp_path, docker=False, engine=False)
    r = node.container(CLOUDTRAIN_DOCKER="check")
    assert r.rc == 7, r.out
    fail = r.lines("::fail")[0]
    assert "there is no Docker Engine" in fail and "sudo apt-get install docker.io" in fail, fail
    assert "installs nothing system-wide on a local or ssh node" in fail
    assert host_installs(r) == [], r.calls

    gpu = Node(tmp_path / "gpu", pci=[H100], driver="550.90.07")
    r = gpu.container(CLOUDTRAIN_DOCKER="check")
    assert r.rc == 7, r.out
    fail = r.lines("::fail")[0]
    assert "no 'nvidia' runtime" in fail and "nvidia-ctk runtime configure" in fail, fail
    assert host_installs(r) == [], r.calls


def test_an_engine_that_will_not_start_is_reported_with_where_to_look(tmp_path: Path) -> None:
    node = Node(tmp_path, engine=False)
    (node.state / "engine-broken").touch()
    r = node.container()
    assert r.rc == 7, r.out
    fail = r.lines("::fail")[0]
    assert "does not start" in fail and "journalctl -u docker" in fail, fail


def test_rhel_without_docker_is_told_where_to_get_it(tmp_path: Path) -> None:
    node = Node(tmp_path, "rocky-9", docker=False, engine=False)
    r = node.container()
    assert r.rc == 7, r.out
    fail = r.lines("::fail")[0]
    assert "rocky 9.3" in fail and "https://docs.docker.com/engine/install/" in fail, fail
    assert not [c for c in r.calls if c.startswith("dnf")], r.calls


def test_the_runner_tells_node_sh_and_a_container_task_has_its_own_stamp() -> None:
    row = NodeRow("c", 0, "i", "h", 22, "u", "10.0.0.1", "UP", "/r")
    plain = node_env(BootstrapSpec(), row, {})
    boxed = node_env(BootstrapSpec(), row, {}, container=True)
    assert "CLOUDTRAIN_CONTAINER" not in plain and boxed["CLOUDTRAIN_CONTAINER"] == "1"
    assert stamp_path(row, plain) != stamp_path(row, boxed)
