"""Azure nodes end their own billing with an identity Azure mints (issue 12), against the ARM
fake (identities, role assignments, IMDS, deallocate) through the real command line.

The VMs are two local sshd nodes reached through the tests' ssh_proxy (as in
test_azure_e2e.py, tests/fakes/standin.py). Each node's environment names its VM's identity
endpoint the way Azure's SDKs read it (AZURE_POD_IDENTITY_AUTHORITY_HOST: the fake's IMDS,
one path per VM; or IDENTITY_ENDPOINT with IDENTITY_HEADER), and its ``shutdown`` is the
stand-in's emulation of what a guest OS shutdown does on Azure: the fake marks the VM
stopped (still allocated, still billing) and the test stops that node (its sshd and every
process started through it). The fake does the same to a node whose VM is deallocated."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import needs_sshd

pytest.importorskip("azure.mgmt.compute")

import standin  # noqa: E402
from arm_fake import SUBSCRIPTION, ArmFake, FakeCredential, Harness, hermetic_env  # noqa: E402
from test_azure_e2e import Booter, Nodes, _cloudtrain, cli_env  # noqa: E402

WRITE = "Microsoft.Authorization/roleAssignments/write"

TASK = """
name: azstop
num_nodes: 2
resources:
  provider: azure
  region: eastus
  instance_type: Standard_NC4as_T4_v3
  ssh_cidr: 127.0.0.1/32
{extra}run: "true"
"""

def stop_node(nodes: Nodes, rank: int) -> None:
    """What a guest OS shutdown does to a local node: its sshd and every process of the
    cluster started through it end."""
    from cloudtrain_provisioners.local import sshd

    n = nodes.nodes[rank]
    sshd.stop(n["dir"])
    sshd.kill_marked(f"{nodes.marker}-{rank}")


@pytest.fixture
def world(tmp_path: Path):  # type: ignore[no-untyped-def]
    from cloudtrain_provisioners.local import sshd

    fake = ArmFake(tmp_path / "arm").start()
    nodes = Nodes(tmp_path / "vms")
    for r, n in enumerate(nodes.nodes):   # one marker per node: a node can stop alone
        standin.prepare(n["dir"], address=n["address"], port=n["port"], user=nodes.user,
                        marker=f"{nodes.marker}-{r}")
    booter = Booter(nodes, fake)
    fake.on_vm_running = booter
    stops: list[tuple[str, str]] = []

    def on_stopped(name: str, how: str) -> None:
        stops.append((name, how))
        stop_node(nodes, int(name.rsplit("-", 1)[1]))

    fake.on_vm_stopped = on_stopped
    env = cli_env(tmp_path, fake, "cloudtrain_azure_stop")
    nodes.start()
    try:
        yield fake, nodes, env, stops
    finally:
        nodes.stop()
        for r in range(len(nodes.nodes)):
            sshd.kill_marked(f"{nodes.marker}-{r}")
        fake.stop()


def _task(nodes: Nodes, tmp_path: Path, extra: str = "") -> Path:
    task = tmp_path / "task-azstop.yaml"
    task.write_text(TASK.format(extra=extra))
    return nodes.use(task)


def _provider(fake: ArmFake, env: dict[str, str]) -> Any:
    """The Azure provider as the CLI of ``env`` makes it (same home, same fake)."""
    from cloudtrain.provider import ProviderContext
    from cloudtrain_provisioners.azure import AzureProvider
    from cloudtrain_provisioners.azure.api import AzureClients

    clients = AzureClients(credential=FakeCredential(fake.token), endpoint=fake.url,
                           ca_bundle=str(fake.cert_file), polling_interval=0, retry_total=0)
    return AzureProvider(ProviderContext(Path(env["CLOUDTRAIN_HOME"])), clients=clients,
                         caller_ip=lambda: "203.0.113.7", poll=0.0)


def _on_node(env: dict[str, str], node: Any, command: str, reason: str = "idle", *,
             nodes: Nodes) -> subprocess.CompletedProcess[str]:
    """Run ``command`` on ``node`` over SSH with the cluster's key, through the stand-ins'
    proxy (the node's address is the fake's), as the guard would (its reason in
    CT_GUARD_REASON)."""
    key = Path(env["CLOUDTRAIN_HOME"]) / "clusters" / "azstop" / "ssh" / "id_ed25519"
    ssh = shutil.which("ssh") or "/usr/bin/ssh"
    remote = f"CT_GUARD_REASON={reason}; export CT_GUARD_REASON; {command}"
    return subprocess.run([ssh, "-i", str(key), "-p", str(node.port), "-o", "BatchMode=yes",
                           "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                           "-o", "ProxyCommand=" + standin.proxy_command(nodes.proxy_map),
                           "-o", "LogLevel=ERROR", f"{node.user}@{node.host}", remote],
                          capture_output=True, text=True, timeout=120)


@needs_sshd
def test_self_stop_without_the_role_fails_and_leaves_the_vm_running(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The role assignment removed (or not yet effective): the node cannot deallocate; it
    says why and does NOT shut the guest down (that would keep it billing, unreachable)."""
    fake, nodes, env, stops = world
    r = _cloudtrain(env, "up", str(_task(nodes, tmp_path)), "-y", "--no-bootstrap", timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    fake.role_assignments.clear()
    p = _provider(fake, env)
    n0 = p.list_nodes("azstop")[0]
    r0 = _on_node(env, n0, "CT_GUARD_AZURE_TRIES=2; export CT_GUARD_AZURE_TRIES; "
                  + p.self_stop_command("azstop", n0), nodes=nodes)
    assert r0.returncode == 1, r0.stderr
    assert "deallocate VM failed: HTTP 403" in r0.stderr and "AuthorizationFailed" in r0.stderr
    assert fake.power_of("azstop-0") == "running" and stops == []
    assert p.self_stopped("azstop") == []
    r = _cloudtrain(env, "down", "azstop", "-y", timeout=200)
    assert r.returncode == 0 and fake.everything() == [], r.stderr[-2000:]


def _until(cond: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


@needs_sshd
def test_self_stop_deallocates_guest_shutdown_alone_keeps_billing(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake, nodes, env, stops = world
    r = _cloudtrain(env, "up", str(_task(nodes, tmp_path)), "-y", "--no-bootstrap", timeout=300)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]

    # Each VM has a system-assigned identity with Virtual Machine Contributor on the
    # cluster's own resource group, and nothing else.
    vms = {n: fake.vm(n) for n in ("azstop-0", "azstop-1")}
    group = vms["azstop-0"]["id"].split("/")[4]
    for vm in vms.values():
        assert vm["identity"]["type"] == "SystemAssigned"
        (a,) = fake.assignments_of(vm["identity"]["principalId"])
        assert a["properties"]["scope"] == f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{group}"
        assert a["properties"]["roleDefinitionId"].endswith("9980e02c-c2be-4d73-94e8-173b1dc7cf3c")

    p = _provider(fake, env)
    n0, n1 = p.list_nodes("azstop")
    assert p.self_stopped("azstop") == []
    cmd = p.self_stop_command("azstop", n1)
    # the real command: IMDS at 169.254.169.254 unless the node's environment names another
    # endpoint, as Azure's SDKs read it (here the fake's IMDS path of each VM)
    assert "deallocate" in cmd and "169.254.169.254" in cmd
    assert "AZURE_POD_IDENTITY_AUTHORITY_HOST" in cmd and "IDENTITY_ENDPOINT" in cmd
    imds1 = fake.imds_of(group, "azstop-1")
    assert standin.environ_of(nodes.nodes[1]["dir"])["AZURE_POD_IDENTITY_AUTHORITY_HOST"] == imds1

    # A guest OS shutdown alone (node 0): Azure keeps the VM allocated, and billing.
    from cloudtrain_provisioners.azure import selfstop

    r0 = _on_node(env, n0, selfstop.GUEST_SHUTDOWN, nodes=nodes)
    assert _until(lambda: ("azstop-0", "guest-shutdown") in stops), (r0.returncode, r0.stderr[-2000:])
    assert fake.power_of("azstop-0") == "stopped" and fake.billing("azstop-0")
    assert p.self_stopped("azstop") == []

    # The self-stop (node 1): IMDS token -> tag -> deallocate -> guest shutdown.
    t0 = time.time()
    _on_node(env, n1, cmd, reason="budget", nodes=nodes)
    assert _until(lambda: fake.power_of("azstop-1") == "deallocated")
    (tok,) = [q for q in fake.imds_requests if q[1].startswith("/vm/" + group + "/azstop-1/")
              and "oauth2/token" in q[1]]
    assert tok[0] == "GET" and tok[2].get("metadata") == "true" and "api-version=2018-02-01" in tok[1]
    print(f"\nself-stop: ssh + token + tag + deallocate took {time.time() - t0:.2f} s; "
          f"command {len(cmd)} bytes; up made {len(fake.ops_of('GET', 'permissions'))} "
          f"permission read(s) and {len(fake.ops_of('PUT', 'roleassignments'))} role "
          "assignment PUT(s)")
    assert not fake.billing("azstop-1")
    assert _until(lambda: ("azstop-1", "deallocate") in stops)
    posts = [q for q in fake.requests if q.method == "POST" and q.kind == "deallocate"]
    assert [q.name for q in posts] == ["azstop-1"]
    assert fake.mi_tokens, "the node used a token IMDS issued to its identity"
    (s,) = p.self_stopped("azstop")
    assert (s.rank, s.reason, s.instance_id) == (1, "budget", n1.instance_id)
    assert t0 - 5 <= s.stopped_at <= time.time() + 5

    # The next contact (status --refresh): no node runs any more, one stopped itself: the
    # cluster is gone, and its group goes (a guest-shut-down VM and a deallocated one alike).
    r = _cloudtrain(env, "status", "--refresh", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    entry = [e for e in json.loads(r.stdout) if e["name"] == "azstop"]
    assert entry and entry[0]["status"] == "GONE" and entry[0]["reason"] == "budget", r.stdout
    assert fake.everything() == [] and fake.role_assignments == {}
    r = _cloudtrain(env, "down", "azstop", "--provider", "azure", "-y", timeout=200)
    assert r.returncode == 0 and fake.everything() == [], r.stderr[-2000:]
    guard_log = tmp_path / "guard.log"
    assert not guard_log.exists() or guard_log.read_text() == ""


@needs_sshd
def test_self_stop_takes_its_token_where_the_identity_variables_say(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """IDENTITY_ENDPOINT and IDENTITY_HEADER on the node (App Service's, as azure-identity
    reads them): the token comes from that endpoint with that header, not from IMDS; a wrong
    header gets no token, and the VM is left running (never a guest shutdown alone)."""
    fake, nodes, env, stops = world
    r = _cloudtrain(env, "up", str(_task(nodes, tmp_path)), "-y", "--no-bootstrap", timeout=300)
    assert r.returncode == 0, r.stderr[-4000:] + r.stdout[-2000:]
    p = _provider(fake, env)
    n0, n1 = p.list_nodes("azstop")
    group = fake.vm("azstop-0")["id"].split("/")[4]
    d0, d1 = (n["dir"] for n in nodes.nodes)
    standin.set_env(d0, {"IDENTITY_ENDPOINT": fake.imds_of(group, "azstop-0") + "/msi/token",
                         "IDENTITY_HEADER": "not-the-secret"})
    standin.set_env(d1, {"IDENTITY_ENDPOINT": fake.imds_of(group, "azstop-1") + "/msi/token",
                         "IDENTITY_HEADER": fake.identity_header})
    time.sleep(0.5)   # the sshds reread their config
    fake.imds_requests.clear()

    r0 = _on_node(env, n0, "CT_GUARD_AZURE_TRIES=1; export CT_GUARD_AZURE_TRIES; "
                  + p.self_stop_command("azstop", n0), nodes=nodes)
    assert r0.returncode == 1 and "token from the managed identity endpoint failed: HTTP 401" \
        in r0.stderr, r0.stderr
    assert fake.power_of("azstop-0") == "running" and stops == []

    r1 = _on_node(env, n1, p.self_stop_command("azstop", n1), reason="lifetime", nodes=nodes)
    assert _until(lambda: fake.power_of("azstop-1") == "deallocated"), r1.stderr[-2000:]
    asked = [q for q in fake.imds_requests if "/azstop-1/" in q[1]]
    assert asked and all(q[1].startswith(f"/vm/{group}/azstop-1/msi/token?") for q in asked)
    assert "api-version=2019-08-01" in asked[0][1] and "resource=" in asked[0][1]
    assert asked[0][2].get("x-identity-header") == fake.identity_header
    assert not [q for q in fake.imds_requests if "oauth2/token" in q[1]]   # IMDS not asked
    (s,) = p.self_stopped("azstop")
    assert (s.rank, s.reason) == (1, "lifetime")
    r = _cloudtrain(env, "down", "azstop", "-y", timeout=200)
    assert r.returncode == 0 and fake.everything() == [], r.stderr[-2000:]


@needs_sshd
def test_missing_role_assignment_permission_fails_before_anything_exists(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake, nodes, env, stops = world
    fake.deny_role_assignments = True
    r = _cloudtrain(env, "up", str(_task(nodes, tmp_path)), "-y", "--no-bootstrap", timeout=120)
    out = r.stderr + r.stdout
    assert r.returncode == 2, out[-3000:]
    assert WRITE in out and "User Access Administrator" in out and "self_stop: false" in out
    assert "Traceback" not in out
    assert fake.everything() == []
    assert not [q for q in fake.requests if q.method in ("PUT", "POST", "PATCH", "DELETE")]

    # The way out the message names: no self-stop, no identity, no role assignment.
    r = _cloudtrain(env, "up", str(_task(nodes, tmp_path, "  azure:\n    self_stop: false\n")),
                    "-y", "--no-bootstrap", timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "identity" not in fake.vm("azstop-0") and fake.role_assignments == {}
    p = _provider(fake, env)
    n0 = p.list_nodes("azstop")[0]
    r0 = _on_node(env, n0, p.self_stop_command("azstop", n0), nodes=nodes)
    assert r0.returncode == 1 and "self_stop: false" in r0.stderr
    assert fake.power_of("azstop-0") == "running" and not stops   # left as it was
    r = _cloudtrain(env, "down", "azstop", "-y", timeout=200)
    assert r.returncode == 0 and fake.everything() == []


@needs_sshd
def test_role_assignment_refused_late_rolls_back(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The permission list said yes, but the assignment is refused (e.g. a deny assignment
    or a policy): up fails with the same message and removes what it made."""
    fake, nodes, env, stops = world
    fake.fail("PUT", "roleassignments", "AuthorizationFailed", status=403, times=None)
    r = _cloudtrain(env, "up", str(_task(nodes, tmp_path)), "-y", "--no-bootstrap", timeout=300)
    out = r.stderr + r.stdout
    assert r.returncode == 2, out[-3000:]
    assert WRITE in out and "Rolling back" in out
    assert fake.ops_of("PUT", "virtualmachines"), "it got as far as the VMs"
    assert fake.everything() == [] and fake.role_assignments == {}


# --- the fake models Azure's rules (so the tests above can fail) ---------------------------------

@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    hermetic_env(monkeypatch)
    fake = ArmFake(tmp_path / "arm").start()
    try:
        yield Harness(fake, tmp_path / "home")
    finally:
        fake.stop()


def _imds_token(fake: ArmFake, group: str, vm: str, metadata: bool = True) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    url = (fake.imds_of(group, vm) + "/metadata/identity/oauth2/token?api-version=2018-02-01"
           "&resource=https://management.azure.com/")
    req = urllib.request.Request(url, headers={"Metadata": "true"} if metadata else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as f:
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _arm(fake: ArmFake, method: str, path: str, token: str) -> int:
    import ssl
    import urllib.error
    import urllib.request

    ctx = ssl.create_default_context(cafile=str(fake.cert_file))
    req = urllib.request.Request(f"{fake.url}{path}?api-version=2024-03-01", method=method,
                                 data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as f:
            return int(f.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_fake_token_is_bound_to_the_vm_and_scoped_to_its_group(harness) -> None:  # type: ignore[no-untyped-def]
    fake = harness.fake
    p, nodes = harness.up(harness.request("one", num_nodes=1))
    p2, nodes2 = harness.up(harness.request("two", num_nodes=1))
    g1, g2 = p.group("one"), p2.group("two")
    assert _imds_token(fake, g1, "one-0", metadata=False)[0] == 400
    status, tok = _imds_token(fake, g1, "one-0")
    assert status == 200
    token = tok["access_token"]
    # its own VM: yes; the other cluster's VM: 403; the group itself (delete): 403
    assert _arm(fake, "POST", nodes2[0].instance_id + "/deallocate", token) == 403
    assert fake.power_of("two-0") == "running"
    assert _arm(fake, "DELETE", f"/subscriptions/{SUBSCRIPTION}/resourceGroups/{g1}", token) == 403
    assert _arm(fake, "POST", nodes[0].instance_id + "/deallocate", token) == 202
    assert fake.power_of("one-0") == "deallocated" and not fake.billing("one-0")
    # a deallocated VM gets no token; a VM without an identity gets none either
    assert _imds_token(fake, g1, "one-0")[0] == 400
    p.terminate("one")
    p2.terminate("two")
    assert fake.everything() == [] and fake.role_assignments == {}
    assert _arm(fake, "GET", nodes[0].instance_id, token) in (401, 403)   # no rights left


def test_principal_not_yet_replicated_is_retried(harness) -> None:  # type: ignore[no-untyped-def]
    fake = harness.fake
    fake.principal_lag = 3
    p, nodes = harness.up(harness.request("lag", num_nodes=2))
    assert len(nodes) == 2 and len(fake.role_assignments) == 2
    assert len(harness.sleeps) >= 3
    # a second up writes the same assignments (named from the identity), not new ones
    harness.up(harness.request("lag", num_nodes=2), p)
    assert len(fake.role_assignments) == 2


def test_guest_shutdown_alone_keeps_the_vm_allocated(harness) -> None:  # type: ignore[no-untyped-def]
    fake = harness.fake
    p, nodes = harness.up(harness.request("gs", num_nodes=1))
    fake.guest_shutdown(p.group("gs"), "gs-0")
    assert fake.power_of("gs-0") == "stopped" and fake.billing("gs-0")
    assert [n.status for n in p.list_nodes("gs")] == ["stopped"]
    assert p.self_stopped("gs") == []
    p.terminate("gs")
    assert fake.everything() == []


def test_self_stop_command_outside_tests_talks_to_imds_and_arm(harness) -> None:  # type: ignore[no-untyped-def]
    from cloudtrain.provider import Node, SelfStops

    p = harness.provider()
    assert isinstance(p, SelfStops)
    vm = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/g/providers/Microsoft.Compute/virtualMachines/x-0"
    cmd = p.self_stop_command("x", Node(rank=0, instance_id=vm, host="10.0.0.4"))
    assert "http://169.254.169.254" in cmd and vm in cmd and "sudo -n shutdown -h now" in cmd
    assert cmd.index("/deallocate") < cmd.index("shutdown -h now")
    assert "disk" in p.what_still_bills() and "public IP" in p.what_still_bills()
    # valid shell and valid python
    subprocess.run(["sh", "-n", "-c", cmd], check=True)
    code = shlex.split(cmd)[2]
    compile(code, "<node>", "exec")
    assert sys.version_info >= (3, 8)


# --- with the node guard: the laptop is lost, the cluster deallocates itself ---------------------

@needs_sshd
def test_lost_laptop_launch_down_deallocates_with_no_further_command(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    fake, nodes, env, stops = world
    marks = tmp_path / "marks"
    marks.mkdir()
    task = tmp_path / "lost.yaml"
    task.write_text(TASK.format(extra="stop_grace: 5\n").replace('run: "true"\n', f"""run: |
  touch {marks}/start-$CLOUDTRAIN_NODE_RANK
  sleep 6
  touch {marks}/done-$CLOUDTRAIN_NODE_RANK
"""))
    nodes.use(task)
    fast = dict(env, CLOUDTRAIN_GUARD_POLL="0.3", CLOUDTRAIN_GUARD_ATTACHED_GRACE="2")
    with open(tmp_path / "launch.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cloudtrain", "launch", str(task), "-y",
                                 "--down"], env=fast, stdout=log, stderr=subprocess.STDOUT)
        try:
            assert _until(lambda: len(list(marks.glob("start-*"))) == 2, 240), \
                (tmp_path / "launch.log").read_text()[-3000:]
        finally:
            proc.kill()                     # the laptop is gone
            proc.wait(timeout=10)
    assert _until(lambda: len(list(marks.glob("done-*"))) == 2, 30), "the job did not complete"
    done = max(p.stat().st_mtime for p in marks.glob("done-*"))
    # With no further command, both VMs deallocate themselves (a guest shutdown would not do).
    assert _until(lambda: all(fake.power_of(f"azstop-{r}") == "deallocated" for r in (0, 1)), 90), \
        [fake.power_of(f"azstop-{r}") for r in (0, 1)]
    assert not fake.billing("azstop-0") and not fake.billing("azstop-1")
    print(f"\nlost laptop: job end -> both VMs deallocated in {time.time() - done:.2f} s "
          "(guard poll 0.3 s, attached grace 2 s)")
    assert ("azstop-0", "deallocate") in stops and ("azstop-1", "deallocate") in stops
    # each node deallocated itself, with its identity's token (the CLI never deallocates)
    assert sorted(q.name for q in fake.requests if q.kind == "deallocate") == ["azstop-0", "azstop-1"]
    assert len(set(fake.mi_tokens.values())) == 2
    stopped = _provider(fake, env).self_stopped("azstop")
    assert [(s.rank, s.reason) for s in stopped] == [(0, "job-end"), (1, "job-end")]

    # The next contact removes what is left: the resource group, its disks, IPs, NICs, NSG,
    # VNet and the role assignments.
    r = _cloudtrain(env, "status", "--refresh", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    entry = [e for e in json.loads(r.stdout) if e["name"] == "azstop"]
    assert entry and entry[0]["status"] == "GONE" and entry[0]["reason"] == "job-end", r.stdout
    assert fake.everything() == [] and fake.role_assignments == {}
    assert json.loads(_cloudtrain(env, "status", "--json").stdout) == []


@needs_sshd
def test_idle_up_deallocates_itself_and_the_next_contact_removes_it(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """'up' with a short idle limit, nothing run: both VMs deallocate themselves (reason
    idle); status --refresh then removes the group."""
    pytest.importorskip("torch")
    fake, nodes, env, stops = world
    fast = dict(env, CLOUDTRAIN_GUARD_POLL="0.3")
    task = _task(nodes, tmp_path, "autostop: {idle_minutes: 0.1}\n")
    r = _cloudtrain(fast, "up", str(task), "-y", timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "deallocates its VM" in r.stderr + r.stdout        # up says what still bills
    assert fake.billing("azstop-0") and fake.billing("azstop-1")
    assert _until(lambda: all(fake.power_of(f"azstop-{r}") == "deallocated" for r in (0, 1)), 90)
    p = _provider(fake, env)
    assert [(s.rank, s.reason) for s in p.self_stopped("azstop")] == [(0, "idle"), (1, "idle")]
    r = _cloudtrain(env, "status", "--refresh", "--json")
    entry = [e for e in json.loads(r.stdout) if e["name"] == "azstop"]
    assert entry and entry[0]["status"] == "GONE" and entry[0]["reason"] == "idle", r.stdout
    assert fake.everything() == [] and fake.role_assignments == {}
