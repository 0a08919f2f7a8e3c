"""``cloudtrain check`` through the real command line, in a hermetic environment (no AWS_*,
GOOGLE_*, AZURE_*, CLOUDTRAIN_* of the caller, HOME in tmp_path): with no credentials at
all; with credentials for the clouds faked at the wire (a moto server, the GCE fake, the ARM
fake, all on loopback); with a cloud's SDK missing; and the one-line warning of
``up --dry-run`` and ``cost``. Every cloudtrain process runs under a guard (a sitecustomize
on PYTHONPATH) that refuses and records any connection that is not to loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from corevenv import core_venv  # noqa: F401 - the fixture (tests/corevenv.py), found by name
from loopback_guard import GUARD

CLOUDS = ("aws", "gcp", "azure")


# boto3 and botocore "not installed": the import system is told they do not exist
BLOCK_BOTO = '''
import sys

class _NoBoto:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("boto3", "botocore"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoBoto())
'''

TASK = """
name: chk
resources:
  provider: aws
  region: us-east-1
  instance_type: g4dn.xlarge
run: echo hi
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hermetic(tmp_path: Path, *, block_boto: bool = False) -> dict[str, str]:
    """No cloud settings of the caller, HOME and CLOUDTRAIN_HOME in tmp_path, no instance
    metadata lookups, and the loopback guard (plus the boto3 blocker when asked)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(GUARD + (BLOCK_BOTO if block_boto else ""))
    (tmp_path / "user").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "GOOGLE_", "CLOUDSDK_", "GCLOUD_", "GCE_", "AZURE_",
                                "CLOUDTRAIN_", "MSI_", "IDENTITY_", "MOTO_"))
           and k.lower() not in ("http_proxy", "https_proxy", "no_proxy")}
    env.update({
        "HOME": str(tmp_path / "user"), "CLOUDTRAIN_HOME": str(tmp_path / "home"),
        "NO_COLOR": "1", "AWS_EC2_METADATA_DISABLED": "true", "NO_GCE_CHECK": "true",
        "CT_TEST_GUARD_LOG": str(tmp_path / "guard.log"),
        "PYTHONPATH": os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    return env


def cloudtrain(env: dict[str, str], *args: str, cwd: Path | None = None,
               python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "cloudtrain", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def checked(env: dict[str, str], *names: str, timeout: float | None = 30
            ) -> tuple[int, dict[str, dict[str, Any]]]:
    """``check NAMES --json`` (``timeout``: its --timeout; the fakes can be slow on a busy
    machine; None: the default)."""
    more = ("--timeout", str(timeout)) if timeout is not None else ()
    r = cloudtrain(env, "check", *names, "--json", *more)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, {d["provider"]: d for d in json.loads(r.stdout)}


def outside(env: dict[str, str]) -> str:
    p = Path(env["CT_TEST_GUARD_LOG"])
    return p.read_text() if p.exists() else ""


# --- no credentials --------------------------------------------------------------------------

def test_check_with_no_credentials_says_what_to_do_and_exits_1(tmp_path: Path) -> None:
    env = hermetic(tmp_path)
    r = cloudtrain(env, "check")
    assert r.returncode == 1, r.stderr + r.stdout
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["PROVIDER", "SDK", "CREDENTIALS", "WORKS", "REACHES", "WHAT",
                                "TO", "DO"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {*CLOUDS, "local", "slurm", "ssh"}
    assert "aws configure" in rows["aws"] and "none found" in rows["aws"]
    assert "gcloud auth application-default login" in rows["gcp"]
    assert "az login" in rows["azure"]
    assert lines[-1] == "Usable: local, slurm, ssh; no cloud is usable (see WHAT TO DO above)."

    rc, found = checked(env)
    assert rc == 1
    for cloud in CLOUDS:
        assert found[cloud]["sdk"] is True
        assert found[cloud]["credentials"] is None and found[cloud]["works"] is None
        assert found[cloud]["usable"] is False and found[cloud]["fix"]
    assert found["local"]["usable"] and found["ssh"]["usable"] and found["slurm"]["usable"]
    assert outside(env) == ""
    assert not (tmp_path / "home" / "clusters").exists()


def test_check_of_an_unknown_provider_exits_2_naming_the_valid_ones(tmp_path: Path) -> None:
    r = cloudtrain(hermetic(tmp_path), "check", "aws", "awz")
    assert r.returncode == 2
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert "Unknown provider: awz." in r.stderr
    assert "Did you mean 'aws'?" in r.stderr
    assert "Valid providers: aws, azure, gcp, local, slurm, ssh." in r.stderr
    r = cloudtrain(hermetic(tmp_path), "check", "--timeout", "0")
    assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr


def test_check_of_local_alone_exits_0(tmp_path: Path) -> None:
    rc, found = checked(hermetic(tmp_path), "local")
    assert rc == 0 and list(found) == ["local"] and found["local"]["usable"] is True


# --- AWS: a moto server on loopback ----------------------------------------------------------

@pytest.fixture
def moto_url() -> Iterator[str]:
    pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(),
                                            verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{server._port}"
    finally:
        server.stop()


def aws_env(tmp_path: Path, url: str) -> dict[str, str]:
    return {**hermetic(tmp_path), "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "eu-west-1"}


def test_check_aws_with_moto_credentials_reaches_the_account_and_regions(
        tmp_path: Path, moto_url: str) -> None:
    import boto3

    env = aws_env(tmp_path, moto_url)
    rc, found = checked(env, "aws")
    assert rc == 0
    aws = found["aws"]
    assert list(found) == ["aws"]
    assert aws["sdk"] is True and aws["works"] is True and aws["usable"] is True
    assert aws["credentials"] == "environment (AWS_ACCESS_KEY_ID)"
    regions = boto3.client("ec2", region_name="eu-west-1", endpoint_url=moto_url,
                           aws_access_key_id="testing", aws_secret_access_key="testing"
                           ).describe_regions()["Regions"]
    assert aws["reaches"] == ["account 123456789012 as user/moto",
                              f"{len(regions)} regions (default eu-west-1)"]
    r = cloudtrain(env, "check", "aws", "--timeout", "30")
    assert r.returncode == 0
    assert r.stdout.splitlines()[-1] == "Usable: aws."
    assert outside(env) == ""


def test_check_aws_whose_endpoint_does_not_answer_says_so_in_time(tmp_path: Path) -> None:
    """An endpoint that takes the connection and never answers: the check gives up after its
    few seconds and says so, instead of hanging."""
    pytest.importorskip("boto3")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)            # connections complete, nothing ever reads or answers
        env = aws_env(tmp_path, f"http://127.0.0.1:{silent.getsockname()[1]}")
        began = time.monotonic()
        rc, found = checked(env, "aws", timeout=None)   # the default: 5 s per call
        took = time.monotonic() - began
    assert took < 30, took
    assert rc == 1
    aws = found["aws"]
    assert aws["credentials"] == "environment (AWS_ACCESS_KEY_ID)"
    assert aws["works"] is False and aws["usable"] is False
    assert "could not reach AWS" in aws["detail"] and aws["fix"]


# --- GCP: the GCE fake -----------------------------------------------------------------------

def gcp_env(tmp_path: Path, url: str, key: Path) -> dict[str, str]:
    """The GCE fake's endpoint, a key file it trusts; any other HTTPS goes to the fake's
    proxy, which refuses it."""
    return {**hermetic(tmp_path), "GOOGLE_APPLICATION_CREDENTIALS": str(key),
            "CLOUDTRAIN_GCP_API_ENDPOINT": url, "CLOUDSDK_CONFIG": str(tmp_path),
            "HTTPS_PROXY": url, "https_proxy": url,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def test_check_gcp_with_the_gce_fake_reaches_the_project_and_zones(tmp_path: Path) -> None:
    pytest.importorskip("google.cloud.compute_v1")
    from gce_fake import GCEFake

    with GCEFake(require_auth=True) as fake:
        key = fake.service_account_key(tmp_path / "key.json")
        env = gcp_env(tmp_path, fake.url, key)
        rc, found = checked(env, "gcp")
        zones = sum(len(z) for z in fake.regions.values())
        project = fake.project
        asked = [r for r in fake.requests if r["path"].endswith("/zones")]
    gcp = found["gcp"]
    assert rc == 0, gcp
    assert gcp["works"] is True and gcp["usable"] is True
    assert gcp["credentials"] == f"key file {key} (GOOGLE_APPLICATION_CREDENTIALS)"
    assert gcp["reaches"] == [f"project {project}",
                              f"{zones} zones in {len(fake.regions)} regions"]
    assert asked, "the fake was never asked for the zones"
    assert outside(env) == ""


def test_check_gcp_whose_credentials_may_not_list_zones_says_so(tmp_path: Path) -> None:
    pytest.importorskip("google.cloud.compute_v1")
    from gce_fake import GCEFake

    with GCEFake(require_auth=True) as fake:
        fake.fail_http(403, "forbidden", "Required 'compute.zones.list' permission",
                       method="GET", path=r"/zones$")
        key = fake.service_account_key(tmp_path / "key.json")
        env = gcp_env(tmp_path, fake.url, key)
        rc, found = checked(env, "gcp")
        project = fake.project
    gcp = found["gcp"]
    assert rc == 1
    assert gcp["credentials"] == f"key file {key} (GOOGLE_APPLICATION_CREDENTIALS)"
    assert gcp["works"] is False and gcp["usable"] is False
    assert gcp["reaches"] == [f"project {project}"]
    assert "compute.zones.list" in gcp["detail"] and "roles/" in gcp["fix"]


# --- Azure: the ARM fake ---------------------------------------------------------------------

def azure_env(tmp_path: Path, fake: Any, token: str) -> dict[str, str]:
    return {**hermetic(tmp_path), "CLOUDTRAIN_AZURE_ARM_ENDPOINT": fake.url,
            "CLOUDTRAIN_AZURE_CA_BUNDLE": str(fake.cert_file),
            "CLOUDTRAIN_AZURE_ACCESS_TOKEN": token, "AZURE_SUBSCRIPTION_ID": fake.subscription,
            "AZURE_CONFIG_DIR": str(tmp_path / "no-azure-cli")}


def test_check_azure_with_the_arm_fake_reaches_the_subscription(tmp_path: Path) -> None:
    pytest.importorskip("azure.mgmt.resource")
    from arm_fake import ArmFake

    fake = ArmFake(tmp_path / "arm").start()
    for name in ("rg-a", "rg-b"):   # what the subscription holds already
        fake.groups[name] = {"id": f"/subscriptions/{fake.subscription}/resourceGroups/{name}",
                             "name": name, "type": "Microsoft.Resources/resourceGroups",
                             "location": "eastus", "tags": {},
                             "properties": {"provisioningState": "Succeeded"}}
    try:
        env = azure_env(tmp_path, fake, fake.token)
        rc, found = checked(env, "azure")
        bad_rc, bad = checked(azure_env(tmp_path, fake, "not-the-token"), "azure")
    finally:
        fake.stop()
    az = found["azure"]
    assert rc == 0, az
    assert az["works"] is True and az["usable"] is True
    assert az["credentials"] == "a bearer token (CLOUDTRAIN_AZURE_ACCESS_TOKEN)"
    assert az["reaches"] == [f"subscription {fake.subscription} (AZURE_SUBSCRIPTION_ID)",
                             "2 resource group(s) readable",
                             f"1 subscription(s) visible: cloudtrain-fake ({fake.subscription})"]
    assert bad_rc == 1
    assert bad["azure"]["works"] is False and "InvalidAuthenticationToken" in bad["azure"]["detail"]
    assert "az login" in bad["azure"]["fix"]
    assert outside(env) == ""


# --- a cloud SDK missing ---------------------------------------------------------------------

def test_check_with_boto3_missing_says_install_the_extra(tmp_path: Path) -> None:
    env = {**hermetic(tmp_path, block_boto=True), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing"}
    probe = subprocess.run([sys.executable, "-c", "import boto3"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode != 0 and "boto3" in probe.stderr   # the blocker works
    assert cloudtrain(env, "--help").returncode == 0
    rc, found = checked(env)
    aws = found["aws"]
    assert aws["sdk"] is False and aws["usable"] is False and aws["works"] is None
    assert aws["fix"] == "Install it: pip install 'cloudtrain[aws]'."
    assert found["local"]["usable"] is True
    r = cloudtrain(env, "check", "aws")
    assert r.returncode == 1
    assert "Its SDK (boto3) is not installed. Install it: pip install 'cloudtrain[aws]'." \
        in r.stdout
    assert r.stdout.splitlines()[-1] == "Usable: none; no cloud is usable (see WHAT TO DO above)."
    assert "Traceback" not in r.stderr


def test_check_in_a_core_only_venv(core_venv: Path, tmp_path: Path) -> None:  # noqa: F811
    """The same through a venv holding only the core package (no cloud SDK at all): the
    wheel installed without extras (tests/corevenv.py)."""
    python = str(core_venv / "python")
    env = hermetic(tmp_path)
    r = cloudtrain(env, "check", "--json", python=python)
    assert r.returncode == 1, r.stderr
    found = {d["provider"]: d for d in json.loads(r.stdout)}
    for cloud in CLOUDS:
        assert found[cloud]["sdk"] is False
        assert found[cloud]["fix"] == f"Install it: pip install 'cloudtrain[{cloud}]'."
    assert found["local"]["usable"] is True


# --- the warning of up --dry-run and cost ----------------------------------------------------

def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "cloudtrain check" in line]


def test_dry_run_and_cost_warn_in_one_line_when_the_cloud_is_not_usable(tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(TASK)
    env = hermetic(tmp_path)
    # an endpoint where nothing listens: the warning path must make no call at all
    env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{_free_port()}"
    up = cloudtrain(env, "up", str(task), "--dry-run", cwd=tmp_path)
    assert up.returncode == 0, up.stderr + up.stdout
    out = up.stdout + up.stderr
    assert "nothing is created" in out and "g4dn.xlarge" in out
    assert _warnings(out) == ["! aws is not usable here (no credentials found): 'up' would "
                              "fail. Run 'cloudtrain check aws' for what to do."]
    cost = cloudtrain(env, "cost", str(task), cwd=tmp_path)
    assert cost.returncode == 0, cost.stderr + cost.stdout
    assert "g4dn.xlarge" in cost.stdout
    assert _warnings(cost.stderr) == ["warning: aws is not usable here (no credentials found): "
                                      "'up' would fail. Run 'cloudtrain check aws' for what "
                                      "to do."]
    assert outside(env) == ""

    # with credentials found (never tried on this path), neither warns
    env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    up = cloudtrain(env, "up", str(task), "--dry-run", cwd=tmp_path)
    cost = cloudtrain(env, "cost", str(task), cwd=tmp_path)
    assert up.returncode == 0 and cost.returncode == 0, up.stderr + cost.stderr
    assert _warnings(up.stdout + up.stderr) == [] and _warnings(cost.stdout + cost.stderr) == []


def test_cost_of_an_azure_task_warns_unless_the_providers_token_is_set(tmp_path: Path) -> None:
    """The warning finds credentials where the azure provider does: with only
    CLOUDTRAIN_AZURE_ACCESS_TOKEN set (no Azure CLI login), no warning."""
    task = tmp_path / "task.yaml"
    task.write_text(TASK.replace("provider: aws", "provider: azure").replace(
        "region: us-east-1", "region: eastus").replace("instance_type: g4dn.xlarge",
                                                        "accelerators: T4:1"))
    env = {**hermetic(tmp_path), "AZURE_CONFIG_DIR": str(tmp_path / "no-azure-cli")}
    cost = cloudtrain(env, "cost", str(task), cwd=tmp_path)
    assert cost.returncode == 0, cost.stderr
    assert _warnings(cost.stderr) == ["warning: azure is not usable here (no credentials "
                                      "found): 'up' would fail. Run 'cloudtrain check azure' "
                                      "for what to do."]
    env["CLOUDTRAIN_AZURE_ACCESS_TOKEN"] = "a-token"
    cost = cloudtrain(env, "cost", str(task), cwd=tmp_path)
    assert cost.returncode == 0, cost.stderr
    assert _warnings(cost.stdout + cost.stderr) == []
    assert outside(env) == ""
