"""Recovery end to end on the GCE fake (issue 13, docs/recovery.md), through the real CLI:
``cloudtrain launch --recover`` of a 2-node spot job (provisioningModel SPOT) whose instances
are local sshd nodes reached through the tests' ssh_proxy (as tests/providers/test_gcp_e2e.py
drives the fake; nothing ever connects to an address the fake invented).

Mid-run GCE preempts node 1 (``GCEFake.preempt``: as its termination action says, DELETE,
what cloudtrain asks for spot VMs, or STOP) and its local node dies at once. The controller
sees GCE's answer, deletes what is left, creates rank 1 again; the fake gives the new
instance the next external address, which the proxy map sends to a fresh local node. The job
resumes from the head's last checkpoint and ends as an uninterrupted run; the ledger has one
recovery with GCE's reason and its dollars; ``down`` leaves nothing in the fake."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import CLI, needs_sshd, processes_with

pytest.importorskip("google.cloud.compute_v1")

from gce_fake import GCEFake  # noqa: E402
from recovery_job import (order, recoveries, resumed_steps, take,  # noqa: E402
                          uninterrupted_order, wait_or_fail, write_job)
from test_gcp_e2e import Nodes, _entry_point_shim  # noqa: E402

pytestmark = [needs_sshd, pytest.mark.e2e]

NAT = ["34.9.0.10", "34.9.0.11", "34.9.0.12"]          # the third: the replacement's


@pytest.fixture
def gcp_world(tmp_path: Path):  # type: ignore[no-untyped-def]
    """(cli, env, fake, nodes): three local nodes for the fake's three pooled address pairs;
    the guest agent authorises each instance's metadata key on the node its address maps to
    and publishes that node's host key."""
    nodes = Nodes(tmp_path / "nodes", count=3)
    fake = GCEFake(require_auth=True, nat_ips=list(NAT), internal_ips=nodes.internal).start()

    def guest_agent(inst: dict[str, Any]) -> None:
        k = NAT.index(inst["networkInterfaces"][0]["accessConfigs"][0]["natIP"])
        nodes.bind(k, fake.url, inst["name"])
        fake.publish_host_keys(inst, [nodes.host_keys[k]])
        for item in inst["metadata"]["items"]:
            if item["key"] == "ssh-keys":
                nodes.authorize(k, item["value"].partition(":")[2])
    fake.on_running.append(guest_agent)

    nodes.map(NAT)
    (tmp_path / "gcloud-config").mkdir()
    env = {"GOOGLE_APPLICATION_CREDENTIALS": str(fake.service_account_key(tmp_path / "key.json")),
           "CLOUDTRAIN_GCP_API_ENDPOINT": fake.url, "NO_GCE_CHECK": "true",
           "CLOUDSDK_CONFIG": str(tmp_path / "gcloud-config"), "GOOGLE_CLOUD_PROJECT": "",
           "CLOUDSDK_CORE_PROJECT": "", "CLOUDTRAIN_GCP_PROJECT": "", "GCLOUD_PROJECT": "",
           "HTTPS_PROXY": fake.url, "HTTP_PROXY": fake.url, "https_proxy": fake.url,
           "http_proxy": fake.url, "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost", "CLOUDTRAIN_NODE_TIMEOUT": "30"}
    shim = _entry_point_shim(tmp_path)
    if shim:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH"))
                                            if p)
    home = tmp_path / "home"
    home.mkdir()
    cli = CLI(home)
    try:
        yield cli, env, fake, nodes
    finally:
        cli.run("down", "-a", "-y", timeout=120, **env)
        nodes.stop()
        fake.stop()
        for pid in processes_with(str(home)):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def _by_rank(fake: GCEFake) -> dict[int, dict[str, Any]]:
    return {int(i["labels"]["cloudtrain-node-rank"]): i for i in fake.instances.values()}


@pytest.mark.parametrize("action", ["DELETE", "STOP"])
def test_gcp_preemption_is_recovered_and_the_job_ends_as_uninterrupted(
        gcp_world, tmp_path: Path, action: str) -> None:  # type: ignore[no-untyped-def]
    cli, env, fake, nodes = gcp_world
    write_job(tmp_path / "proj")
    task = tmp_path / "task.yaml"
    task.write_text("name: gcprec\nnum_nodes: 2\nworkdir: proj\nstop_grace: 5\n"
                    "resources:\n  provider: gcp\n  region: us-central1\n  accelerators: T4:1\n"
                    "  use_spot: true\n  ssh_cidr: 198.51.100.7/32\n"
                    "recovery: {poll_seconds: 1, max_recoveries: 1}\nrun: python steps.py\n")
    nodes.use(task)
    proc = cli.popen("launch", str(task), "-y", "--recover", **env)
    try:
        # the ranks are created in parallel: which pooled address (local node) each got
        wait_or_fail(proc, lambda: len(_by_rank(fake)) == 2, 240, "no instances")
        node_of = {r: NAT.index(i["networkInterfaces"][0]["accessConfigs"][0]["natIP"])
                   for r, i in _by_rank(fake).items()}
        assert sorted(node_of.values()) == [0, 1], node_of
        head = nodes.dirs[node_of[0]] / "root"
        wait_or_fail(proc, lambda: len(order(head)) >= 10, 240, "the job did not train")
        before = _by_rank(fake)
        assert all(i["scheduling"]["provisioningModel"] == "SPOT" for i in before.values())
        one = before[1]
        fake.preempt(one["zone"].rsplit("/", 1)[-1], one["name"], action=action)
        take(nodes.dirs[node_of[1]])
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
    after = _by_rank(fake)
    assert after[0]["id"] == before[0]["id"] and after[1]["id"] != before[1]["id"]
    assert after[1]["networkInterfaces"][0]["accessConfigs"][0]["natIP"] == NAT[2]
    assert after[1]["scheduling"]["provisioningModel"] == "SPOT"
    assert (nodes.dirs[2] / "root" / "trainstate").is_dir(), "rank 1 did not run on the new node"

    (r,) = recoveries(lambda *a: cli.run(*a, **env), "gcprec")
    assert r["ranks"] == [1] and r["status"] == "RECOVERED", r
    assert f"instance {one['name']} was preempted by GCE" in str(r["reason"]), r
    for k in ("detect_s", "replace_s", "bootstrap_s", "sync_s", "restart_s"):
        assert isinstance(r[k], float) and r[k] >= 0, (k, r)
    assert isinstance(r["replacement_usd"], float) and r["replacement_usd"] > 0, r

    down = cli.run("down", "gcprec", "-y", timeout=300, **env)
    assert down.returncode == 0, down.stderr[-3000:]
    assert fake.empty(), fake.ours()
    assert cli.run("status", "--json", **env).stdout.strip() == "[]"
    assert all(h.startswith("iamcredentials.googleapis.com") for h in fake.outside), fake.outside
