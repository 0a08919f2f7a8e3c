"""Recovery end to end on the ARM fake (issue 13, docs/recovery.md), through the real CLI:
``cloudtrain launch --recover`` of a 2-node spot job (priority Spot, eviction policy Delete)
whose VMs are local sshd nodes reached through the tests' ssh_proxy (as
tests/providers/test_azure_e2e.py drives the fake, under its connection guard and ssh
recorder: nothing ever connects to an address the fake invented).

Mid-run Azure evicts node 1's VM (``ArmFake.evict``: policy Delete, what cloudtrain asks for,
or Deallocate) and its local node dies at once. The controller sees ARM's answer, deletes
what is left of rank 1 (VM, NIC, public IP, disk) and creates it again; the fake's
"cloud-init" gives the new VM a fresh local node. The job resumes from the head's last
checkpoint and ends as an uninterrupted run; the ledger has one recovery with ARM's reason
and its dollars; ``down`` leaves nothing in the fake."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import needs_sshd

pytest.importorskip("azure.mgmt.compute")

import standin  # noqa: E402
from arm_fake import ArmFake  # noqa: E402
from recovery_job import (order, recoveries, resumed_steps, take,  # noqa: E402
                          uninterrupted_order, wait_or_fail, write_job)
from test_azure_e2e import SSH_RECORDER, Booter, Nodes, _cloudtrain, cli_env  # noqa: E402

pytestmark = [needs_sshd, pytest.mark.e2e]

TASK = """name: azrec
num_nodes: 2
resources:
  provider: azure
  region: eastus
  instance_type: Standard_NC4as_T4_v3
  use_spot: true
  ssh_cidr: 127.0.0.1/32
workdir: proj
stop_grace: 5
recovery: {poll_seconds: 1, max_recoveries: 1}
run: python steps.py
"""


class FreshNodeBooter(Booter):
    """test_azure_e2e's cloud-init and proxy-map writer, except that a VM made again for a
    rank (a replacement) boots on the next spare local node, not on the dead one."""

    def __init__(self, nodes: Nodes, fake: ArmFake) -> None:
        super().__init__(nodes, fake)
        self.node_of: dict[str, int] = {}       # VM id (vmId) -> local node index
        self.spare = 2

    def __call__(self, vm: dict[str, Any], public: str, private: str) -> None:
        rank = int(vm["tags"]["cloudtrain:node-rank"])
        vm_id = vm["properties"]["vmId"]
        if vm_id not in self.node_of:
            taken = set(self.node_of.values())
            self.node_of[vm_id] = rank if rank not in taken else self.spare
            self.spare += self.node_of[vm_id] == self.spare
        self.boot(self.nodes.nodes[self.node_of[vm_id]], rank, vm, public, private)


@pytest.fixture
def az_world(tmp_path: Path):  # type: ignore[no-untyped-def]
    fake = ArmFake(tmp_path / "arm").start()
    nodes = Nodes(tmp_path / "vms", n=3)
    booter = FreshNodeBooter(nodes, fake)
    fake.on_vm_running = booter
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "ssh").write_text(SSH_RECORDER.format(ssh=shutil.which("ssh") or "/usr/bin/ssh"))
    (shim / "ssh").chmod(0o755)
    env = cli_env(tmp_path, fake, "cloudtrain_azure_recovery")
    env["PATH"] = f"{shim}:{env.get('PATH', '')}"
    env["CLOUDTRAIN_NODE_TIMEOUT"] = "30"
    nodes.start()
    try:
        yield fake, nodes, booter, env
    finally:
        _cloudtrain(env, "down", "-a", "-y", timeout=300)
        nodes.stop()
        fake.stop()


def _vms(fake: ArmFake) -> dict[int, dict[str, Any]]:
    return {r: vm for r in range(3) if (vm := fake.vm(f"azrec-{r}")) is not None}


@pytest.mark.parametrize("policy", ["Delete", "Deallocate"])
def test_azure_eviction_is_recovered_and_the_job_ends_as_uninterrupted(
        az_world, tmp_path: Path, policy: str) -> None:  # type: ignore[no-untyped-def]
    import subprocess

    fake, nodes, booter, env = az_world
    write_job(tmp_path / "proj")
    task = tmp_path / "azrec.yaml"
    task.write_text(TASK)
    nodes.use(task)
    head = nodes.nodes[0]["dir"] / "root"
    proc = subprocess.Popen([sys.executable, "-m", "cloudtrain", "launch", str(task), "-y",
                             "--recover"], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_or_fail(proc, lambda: len(order(head)) >= 10, 240, "the job did not train")
        before = _vms(fake)
        assert sorted(before) == [0, 1]
        assert all(v["properties"]["priority"] == "Spot" for v in before.values())
        fake.evict("azrec-1", policy)
        take(nodes.nodes[1]["dir"])
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = out + err
    assert proc.returncode == 0, text[-6000:]
    assert "the cloud took node 1:" in text and "Recovered: job" in text, text[-6000:]
    print(*[ln for ln in text.splitlines() if "Recovered: job" in ln])   # the phases, in s
    resumed = resumed_steps(text)
    assert resumed[0] == 0 and len(resumed) == 2 and resumed[1] >= 8, resumed
    assert order(head) == uninterrupted_order()      # same final step, same data order
    after = _vms(fake)
    assert after[0]["properties"]["vmId"] == before[0]["properties"]["vmId"]
    assert after[1]["properties"]["vmId"] != before[1]["properties"]["vmId"]
    assert after[1]["properties"]["priority"] == "Spot"
    assert booter.node_of[after[1]["properties"]["vmId"]] == 2
    assert (nodes.nodes[2]["dir"] / "root" / "trainstate").is_dir(), "rank 1 did not run there"

    (r,) = recoveries(lambda *a: _cloudtrain(env, *a), "azrec")
    assert r["ranks"] == [1] and r["status"] == "RECOVERED", r
    expected = ("a spot VM evicted" if policy == "Delete"
                else "VM azrec-1 (spot) is deallocated: evicted by Azure")
    assert expected in str(r["reason"]), r
    for k in ("detect_s", "replace_s", "bootstrap_s", "sync_s", "restart_s"):
        assert isinstance(r[k], float) and r[k] >= 0, (k, r)
    assert isinstance(r["replacement_usd"], float) and r["replacement_usd"] > 0, r

    down = _cloudtrain(env, "down", "azrec", "-y", timeout=300)
    assert down.returncode == 0, down.stderr[-3000:]
    assert fake.everything() == []
    assert json.loads(_cloudtrain(env, "status", "--json").stdout) == []
    guard_log = tmp_path / "guard.log"
    assert not guard_log.exists() or guard_log.read_text() == ""
    assert Path(env["CT_AZ_SSH_LOG"]).read_text(), "ssh went through the recorder"
    relays = standin.ProxyMap(nodes.proxy_map)
    assert relays.relayed and relays.only_loopback(), relays.relayed
    for address in booter.addresses:
        assert address not in text
