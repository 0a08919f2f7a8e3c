"""The fault matrix, signal part, on the clouds (docs/reliability.md, "Signals"): AWS on a moto
server, GCP and Azure on their loopback fakes, each reached as in its own end-to-end test
(local sshd nodes reached through the tests' ssh_proxy: nothing ever connects to an address a
fake invented).
The cases that apply to clouds: a signal while provisioning (the provider has created the
instances, tests/fakes/fault_cli.py holds create_nodes), SIGKILL of the CLI then `down`, and SIGKILL
with the local state lost, then `down --provider` or `gc`. For every case: the message, the
exit code, and nothing of the cluster left in the cloud (instances, groups/firewalls, keys)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from conftest import needs_sshd, processes_with, wait_until

pytestmark = [needs_sshd, pytest.mark.e2e]

FAULT_CLI = Path(__file__).resolve().parents[1] / "fakes" / "fault_cli.py"


class Cloud:
    """One cloud fake, ready for a CLI run: its environment, a task for it, and what of the
    cluster it still holds."""

    def __init__(self, provider: str, env: dict[str, str], task: str,
                 left: Callable[[str], Any], tmp: Path, use: Callable[[Path], Path],
                 prepare: Callable[[str], None] = lambda name: None) -> None:
        self.provider, self.env, self.task_text, self.left, self.tmp = provider, env, task, left, tmp
        self.use = use            # the task reaching the stand-in nodes (ssh_proxy, user)
        self.prepare = prepare
        self.home = Path(env["CLOUDTRAIN_HOME"])

    def task(self, name: str) -> Path:
        p = self.tmp / f"{name}.yaml"
        p.write_text(self.task_text.replace("NAME", name))
        return self.use(p)

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cloudtrain", *args], capture_output=True,
                              text=True, env=self.env, timeout=timeout)

    def held_launch(self, name: str) -> subprocess.Popen[str]:
        """`launch --down` held in provisioning, once the instances exist."""
        marker = self.tmp / f"{name}.reached"
        self.prepare(name)
        env = {**self.env, "CT_FAULT_PHASE": "provision", "CT_FAULT_MARKER": str(marker)}
        proc = subprocess.Popen([sys.executable, str(FAULT_CLI), "launch", str(self.task(name)),
                                 "--down", "-y"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
        if not wait_until(lambda: marker.exists() or proc.poll() is not None, 120) or \
                proc.poll() is not None:
            out, err = proc.communicate(timeout=60) if proc.poll() is None else proc.communicate()
            pytest.fail(f"provisioning was never reached:\n{err[-3000:]}")
        assert self.left(name), "the held launch had created nothing yet"
        return proc

    def status(self) -> list[Any]:
        r = self.run("status", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


def _send(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    if sig == signal.SIGTERM:
        proc.send_signal(sig)
    else:
        os.killpg(proc.pid, sig)


def _finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"the CLI did not exit within {timeout} s:\n{err[-3000:]}")


def _borrowed(fixture: Any, *args: Any) -> Iterator[Any]:
    """Run another test module's generator fixture (its set-up and clean-up) from here."""
    gen = fixture.__wrapped__(*args)
    try:
        yield next(gen)
    finally:
        next(gen, None)


def _forget_state(cloud: Cloud) -> None:
    for f in cloud.home.glob("state.db*"):
        f.unlink()


class Matrix:
    """The cases, run for each cloud by the Test* classes below (each gives ``cloud``)."""

    @pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                             ids=lambda s: s.name)
    def test_signal_while_provisioning(self, cloud: Cloud, sig: signal.Signals) -> None:
        proc = self._held(cloud, "fmsig")
        _send(proc, sig)
        out, err = _finish(proc)
        assert proc.returncode == 130, err[-3000:]
        assert "Rolling back" in err and "Interrupted" in err and "Traceback" not in err
        assert not cloud.left("fmsig"), cloud.left("fmsig")
        assert cloud.status() == []

    def test_sigkill_then_down(self, cloud: Cloud) -> None:
        proc = self._held(cloud, "fmkilled")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        assert [c["name"] for c in cloud.status()] == ["fmkilled"]
        r = cloud.run("down", "fmkilled", "-y")
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"'fmkilled' is down; {cloud.provider} lists none of its nodes" in r.stderr
        assert not cloud.left("fmkilled"), cloud.left("fmkilled")
        assert cloud.status() == []

    def test_sigkill_state_lost_then_down_by_provider(self, cloud: Cloud) -> None:
        proc = self._held(cloud, "fmlost")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        _forget_state(cloud)
        r = cloud.run("down", "fmlost", "-y")
        assert r.returncode == 2 and "fmlost" in r.stderr and "Traceback" not in r.stderr
        assert cloud.left("fmlost"), "down without --provider touched the cluster"
        r = cloud.run("down", "fmlost", "--provider", cloud.provider, "-y")
        assert r.returncode == 0, r.stderr[-3000:]
        assert "'fmlost' is down" in r.stderr, r.stderr[-3000:]
        assert f"{cloud.provider} lists none of its nodes" in r.stderr, r.stderr[-3000:]
        assert not cloud.left("fmlost"), cloud.left("fmlost")

    def test_sigkill_state_lost_then_gc(self, cloud: Cloud) -> None:
        proc = self._held(cloud, "fmorphan")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        _forget_state(cloud)
        listed = cloud.run("gc", "--provider", cloud.provider, "--json")
        assert listed.returncode == 0, listed.stderr[-3000:]
        assert "fmorphan" in listed.stdout
        assert cloud.left("fmorphan"), "gc without -y removed something"
        # A running instance is never terminated without --force: gc -y names the command.
        r = cloud.run("gc", "--provider", cloud.provider, "-y")
        assert f"cloudtrain gc --provider {cloud.provider} --force -y" in r.stdout + r.stderr, \
            r.stdout[-2000:] + r.stderr[-2000:]
        assert cloud.left("fmorphan"), "gc -y without --force terminated a running instance"
        r = cloud.run("gc", "--provider", cloud.provider, "--force", "-y")
        assert r.returncode == 0, r.stderr[-3000:]
        assert wait_until(lambda: not cloud.left("fmorphan"), 30), cloud.left("fmorphan")

    @staticmethod
    def _held(cloud: Cloud, name: str) -> subprocess.Popen[str]:
        proc = cloud.held_launch(name)
        time.sleep(0.3)
        return proc


# --- GCP ---------------------------------------------------------------------------------------

GCP_TASK = """
name: NAME
num_nodes: 2
resources:
  provider: gcp
  region: us-central1
  accelerators: T4:1
  ssh_cidr: 198.51.100.7/32
run: 'true'
"""


class TestGCP(Matrix):
    @pytest.fixture
    def cloud(self, tmp_path: Path) -> Iterator[Cloud]:  # type: ignore[misc]
        pytest.importorskip("google.cloud.compute_v1")
        import test_gcp_e2e as gcp

        world = _borrowed(gcp.world, tmp_path)   # the fake, its nodes and environment
        cli, extra, fake, nodes, _ = next(world)

        def left(name: str) -> list[str]:
            return [k for k, v in fake.ours().items() for item in v if name in str(item)]

        yield Cloud("gcp", cli.env(**extra), GCP_TASK, left, tmp_path, nodes.use)
        next(world, None)


# --- Azure -------------------------------------------------------------------------------------

AZURE_TASK = """
name: NAME
num_nodes: 2
resources:
  provider: azure
  region: eastus
  instance_type: Standard_NC4as_T4_v3
  ssh_cidr: 127.0.0.1/32
run: 'true'
"""


class TestAzure(Matrix):
    @pytest.fixture
    def cloud(self, tmp_path: Path) -> Iterator[Cloud]:  # type: ignore[misc]
        pytest.importorskip("azure.mgmt.compute")
        import test_azure_e2e as az

        world = _borrowed(az.world, tmp_path)
        fake, nodes, _, env = next(world)

        def left(name: str) -> list[str]:
            return [str(r.get("id", r)) for r in fake.everything() if name in json.dumps(r)]

        c = Cloud("azure", env, AZURE_TASK, left, tmp_path, nodes.use)
        yield c
        c.run("down", "-a", "-y")
        next(world, None)


# --- AWS (moto) --------------------------------------------------------------------------------

AWS_TASK = """
name: NAME
num_nodes: 2
resources:
  provider: aws
  region: us-east-1
  instance_type: g4dn.xlarge
  ssh_cidr: 127.0.0.1/32
  aws: {host_key_wait: 0}
run: 'true'
"""


class TestAWS(Matrix):
    @pytest.fixture
    def cloud(self, tmp_path: Path) -> Iterator[Cloud]:  # type: ignore[misc]
        pytest.importorskip("moto")
        import test_aws_cli as aws

        guarded = aws.guarded.__wrapped__(tmp_path)
        server = _borrowed(aws.moto_server, tmp_path)
        moto_server = next(server)
        ec2 = aws._moto(moto_server)
        map_file = tmp_path / "proxy-map.json"
        env = {**guarded, "AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        nodes = aws.LocalNodes(tmp_path / "nodes")
        stop = threading.Event()
        mappers: list[threading.Thread] = []

        def prepare(name: str) -> None:
            # Once moto runs the instances, map their addresses (as the AWS e2e test does).
            t = threading.Thread(target=aws._map_when_running, daemon=True,
                                 args=(ec2, nodes, name, map_file, {}, stop))
            mappers.append(t)
            t.start()

        def left(name: str) -> dict[str, int]:
            return {k: len(v) for k, v in aws._tagged(ec2, name).items() if v}

        c = Cloud("aws", env, AWS_TASK, left, tmp_path,
                  lambda task: aws.aws_task(task, map_file, nodes), prepare)
        try:
            yield c
        finally:
            c.run("down", "-a", "-y")
            stop.set()
            nodes.stop()
            next(server, None)
        assert aws._guard_log(env) == "", "a connection left loopback"
