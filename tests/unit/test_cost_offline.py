"""`gpus`, `cost` and `cost-report` work with no network and no credentials: each runs in a
subprocess whose HOME is an empty folder, with every cloud credential variable removed, and
the network made unusable two ways:

* always: HTTP(S)_PROXY / ALL_PROXY point at a closed loopback port, and an audit hook in the
  child aborts on any attempt to resolve a name or open an internet socket (so a call that
  ignores proxies is caught too);
* as root where ``unshare -n`` works: the command runs in a new network namespace, which has
  no interface up at all (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cloudtrain.schema import ClusterRow
from cloudtrain.state import open_state

CRED_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "CLOUDSDK_", "GCLOUD_", "ARM_")
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")

# Run in the child before cloudtrain: any name lookup or internet socket connect is fatal.
NO_NET = """
import socket, sys
def _hook(event, args):
    if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
                 "socket.gethostbyaddr"):
        raise RuntimeError(f"NETWORK USED: {event} {args[:2]}")
    if event in ("socket.connect", "socket.sendto", "socket.sendmsg") \\
            and getattr(args[0], "family", None) in (socket.AF_INET, socket.AF_INET6):
        raise RuntimeError(f"NETWORK USED: {event} {args[1:2]}")
sys.addaudithook(_hook)
import runpy
sys.argv = ["cloudtrain"] + sys.argv[1:]
runpy.run_module("cloudtrain", run_name="__main__", alter_sys=True)
"""

TASK = "name: offline\nnum_nodes: 2\nresources:\n  accelerators: A100:8\nrun: echo hi\n"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])       # closed again when the block ends


@pytest.fixture
def offline(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(environment, CLOUDTRAIN_HOME) with no credentials and dead proxies, and a ledger with
    two finished clusters in that home."""
    userhome = tmp_path / "empty-home"
    userhome.mkdir()
    home = tmp_path / "cthome"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(CRED_PREFIXES) and k not in PROXY_VARS}
    proxy = f"http://127.0.0.1:{_closed_port()}"
    env.update({p: proxy for p in PROXY_VARS})
    env.update({"HOME": str(userhome), "CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1",
                "NO_PROXY": "", "no_proxy": "", "XDG_CONFIG_HOME": str(userhome / ".config")})
    state = open_state(home)
    for name, provider, price, nodes, hours in (("a", "aws", 32.77, 2, 3.0),
                                                ("b", "gcp", 8.8, 1, 10.0)):
        row = ClusterRow(name=name, provider=provider, status="UP", num_nodes=nodes,
                         created_at=1.7e9, updated_at=1.7e9, instance_type="x",
                         hourly_price=price, use_spot=provider == "gcp")
        state.open_usage(row, when=1.7e9)
        state.close_usage(name, when=1.7e9 + hours * 3600)
    return env, home


def _run(env: dict[str, str], args: list[str], prefix: list[str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    cmd = [*(prefix or []), sys.executable, "-c", NO_NET, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env,
                       stdin=subprocess.DEVNULL, cwd=env["HOME"])
    assert "NETWORK USED" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    return r


def _check_all(env: dict[str, str], home: Path, tmp_path: Path,
               prefix: list[str] | None = None) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(TASK)

    r = _run(env, ["gpus", "A100:8", "--json"], prefix)
    assert r.returncode == 0, r.stderr
    offers = json.loads(r.stdout)
    assert offers and all(o["accelerator"] == "A100" and o["price_hourly_usd"] for o in offers)
    r = _run(env, ["gpus"], prefix)
    assert r.returncode == 0 and "A100" in r.stdout and "H100" in r.stdout, r.stderr

    r = _run(env, ["cost", str(task), "--json", "--hours", "2"], prefix)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["offers"] and doc["catalog"]["kind"] == "snapshot"
    first = doc["offers"][0]
    assert first["total_usd"] == pytest.approx(first["cluster_hourly_usd"] * 2, abs=0.01)
    # no cloud has credentials here: up would take nothing, and cost says why
    assert doc["choice"] is None
    assert all(not p["usable"] for p in doc["providers"].values())
    r = _run(env, ["cost", str(task), "--model-params", "7e9", "--strategy", "fsdp"], prefix)
    assert r.returncode == 0, r.stderr
    assert "feasible offer(s)" in r.stdout and "needed per GPU" in r.stdout

    r = _run(env, ["cost-report", "--json"], prefix)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert {c["name"]: c["cost_usd"] for c in rep["clusters"]} == \
        {"a": pytest.approx(3 * 32.77 * 2), "b": pytest.approx(88.0)}
    assert rep["total_usd"] == pytest.approx(3 * 32.77 * 2 + 88.0)
    r = _run(env, ["cost-report"], prefix)
    assert r.returncode == 0 and "Total for everything recorded" in r.stdout, r.stderr

    # nothing was written to the empty HOME (no credential or config file appeared)
    assert not any(Path(env["HOME"]).rglob("*")), list(Path(env["HOME"]).rglob("*"))


def test_the_hook_catches_a_network_attempt(offline: tuple[dict[str, str], Path]) -> None:
    """The guard itself works: a child that tries to connect is stopped."""
    env, _ = offline
    probe = NO_NET.split("import runpy")[0] + (
        "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode != 0 and "NETWORK USED" in r.stderr, r.stderr


def test_gpus_cost_and_report_offline_without_credentials(
        offline: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    env, home = offline
    _check_all(env, home, tmp_path)


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs root and a working 'unshare -n'")
def test_gpus_cost_and_report_in_a_namespace_without_network(
        offline: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    env, home = offline
    # the namespace really has no network: not even loopback is up
    probe = subprocess.run(["unshare", "-n", sys.executable, "-c",
                            "import socket; socket.create_connection(('127.0.0.1', 9), 2)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "unreachable" in probe.stderr.lower()
    _check_all(env, home, tmp_path, prefix=["unshare", "-n"])
