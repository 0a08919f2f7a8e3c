"""A plain ``cloudtrain status`` answers from the local state and what the last contact saw:
with clusters in the state it imports no pydantic, paramiko, rich, cloud SDK, SSH transport or
provider, and shows the node guards and GPUs as the last contact saw them, with the age."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("pydantic", "pydantic_core", "paramiko", "rich", "boto3", "botocore", "google",
         "azure", "cryptography")
NOT_OFFLINE = ("cloudtrain.remote", "cloudtrain.connection", "cloudtrain.provider",
               "cloudtrain.catalog", "cloudtrain.spec", "cloudtrain.taskmodel",
               "cloudtrain.pipeline.guard", "cloudtrain_provisioners")

# Runs the CLI in this interpreter, then reports what it imported (a fresh process per call).
PROBE = r"""
import json, sys
import cloudtrain.commands.main
try:
    cloudtrain.commands.main.cli.main(args=sys.argv[2:], prog_name="cloudtrain")
    code = 0
except SystemExit as exc:
    code = exc.code
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def _home_with_clusters(home: Path) -> float:
    """Two local clusters in the state (nodes on ports where nothing listens); 'gpu' has a
    guard policy and what a contact saw 5 minutes ago. Returns that contact's time."""
    from cloudtrain.schema import ClusterRow, NodeRow
    from cloudtrain.state import open_state

    state = open_state(home)
    now = time.time()
    for name, n in (("one", 1), ("gpu", 2)):
        row = ClusterRow(name=name, provider="local", status="UP", num_nodes=n,
                         created_at=now - 3600, updated_at=now, instance_type="local-cpu",
                         hourly_price=1.5)
        row.nodes = [NodeRow(cluster=name, rank=r, instance_id=f"{name}-{r}", host="127.0.0.1",
                             port=9, user="u", internal_ip="127.0.0.1", status="running",
                             root_dir="/nonexistent") for r in range(n)]
        state.upsert_cluster(row)
        state.replace_nodes(name, row.nodes)
    d = home / "clusters" / "gpu"
    d.mkdir(parents=True)
    seen_at = now - 300
    (d / "guard-policy.json").write_text(json.dumps(
        {"idle_minutes": 60, "down": True, "down_on_end": [], "lease_at": now - 600}))
    state_json = {"at": seen_at - 1, "busy": False, "idle_for_s": 120.0, "jobs": 0}
    gpus = [{"rank": 0, "state": "ok", "detail": "", "job_running": False, "dropped_lines": 0,
             "gpus": [{"index": "0", "name": "NVIDIA H100 80GB HBM3", "util_pct": 97.0,
                       "mem_used_mib": 40960.0, "mem_total_mib": 81920.0, "temp_c": 61.0,
                       "power_w": 500.0, "power_limit_w": 700.0, "idle": False}]},
            {"rank": 1, "state": "no-gpu", "detail": "no nvidia-smi on this node", "gpus": []}]
    (d / "guard-seen.json").write_text(json.dumps(
        {"at": seen_at, "gpus_at": seen_at, "gpus": gpus,
         "nodes": {str(r): {"state": state_json, "guard_alive": True} for r in (0, 1)}}))
    return seen_at


def _run(tmp_path: Path, home: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:  # type: ignore[type-arg]
    out = tmp_path / "probe.json"
    env = dict(os.environ, CLOUDTRAIN_HOME=str(home), NO_COLOR="1")
    r = subprocess.run([sys.executable, "-c", PROBE, str(out), *args], capture_output=True,
                       text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r, json.loads(out.read_text())


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY
            or any(m == p or m.startswith(p + ".") for p in NOT_OFFLINE)]


def test_plain_status_is_offline_and_shows_the_last_contact_with_its_age(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _home_with_clusters(home)
    r, probe = _run(tmp_path, home, "status")
    assert probe["code"] == 0, r.stdout + r.stderr
    assert "cloudtrain.state" in probe["modules"]          # sanity: the probe sees imports
    assert _heavy(probe["modules"]) == []
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "PROVIDER", "STATUS"]
    assert any(ln.startswith("one ") and " UP " in ln for ln in lines), r.stdout
    # the guard as the contact 5 min ago saw it, extrapolated: idle 2 + 5 min, stops in ~53
    assert "gpu: autostop: tear down after 60 min idle; idle for 7.0 min, stops in 53.0 min " \
           "(as of 5 min ago; --refresh for live)" in r.stdout, r.stdout
    assert "gpu: GPUs as of 5 min ago (--refresh for live):" in r.stdout
    assert "gpu: node 0: 1 GPU (NVIDIA H100 80GB HBM3), util 97% mean / 97% max" in r.stdout
    assert "gpu: node 1: no GPU (no nvidia-smi on this node)" in r.stdout
    assert "--refresh" in r.stderr and "does not answer" not in r.stderr

    r, probe = _run(tmp_path, home, "status", "gpu", "--json")
    assert probe["code"] == 0 and _heavy(probe["modules"]) == []
    (c,) = json.loads(r.stdout)
    assert c["live"] is False and c["guard"]["live"] is False
    assert 299 <= c["guard"]["age_s"] < 330 and c["guard"]["busy"] is False
    assert 52.5 < c["guard"]["stops_in_min"] <= 53.0
    assert c["gpus"][0]["models"] == "NVIDIA H100 80GB HBM3" and c["gpus_at"] is not None
    assert c["autostop"]["idle_minutes"] == 60


def test_help_and_status_of_a_cluster_never_seen_import_nothing_heavy(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _home_with_clusters(home)
    r, probe = _run(tmp_path, home, "status", "one", "--json")
    (c,) = json.loads(r.stdout)
    assert (c["guard"], c["gpus"], c["gpus_at"]) == (None, None, None)   # no guard, no contact
    assert _heavy(probe["modules"]) == []
    r, probe = _run(tmp_path, home, "status", "--help")
    assert probe["code"] == 0 and "--refresh" in r.stdout
    assert _heavy(probe["modules"]) == []


def test_a_damaged_last_contact_file_leaves_the_policy_shown(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _home_with_clusters(home)
    (home / "clusters" / "gpu" / "guard-seen.json").write_text(json.dumps(
        {"at": 1, "gpus_at": 1, "gpus": [{"rank": 0, "gpus": [{"util_pct": 3}]}],
         "nodes": {"0": {"state": ["not", "a", "dict"]}}}))
    r, probe = _run(tmp_path, home, "status", "gpu")
    assert probe["code"] == 0, r.stderr
    assert "gpu: autostop: tear down after 60 min idle" in r.stdout, r.stdout


def test_the_catalog_refresh_choices_are_the_refresh_modules_providers() -> None:
    from cloudtrain.catalog.refresh import PROVIDERS
    from cloudtrain.commands.catalog import REFRESH_PROVIDERS

    assert REFRESH_PROVIDERS == PROVIDERS
