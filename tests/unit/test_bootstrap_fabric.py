"""bootstrap/fabric.sh: what a node has of its fast network, found on a fake /sys and a fake
prefix (where the images install NCCL's plugins); it installs nothing and says what is
missing. node.sh runs its step only where the provider set a fabric up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bootstrap" / "fabric.sh"


def _run(tmp_path: Path, kind: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "CLOUDTRAIN_SYSFS": str(tmp_path / "sys"),
            "CLOUDTRAIN_FABRIC_PREFIX": str(tmp_path / "root"), **env}
    return subprocess.run(["bash", str(SCRIPT), kind], capture_output=True, text=True,
                          env=full, timeout=30)


def _touch(p: Path) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("")


def test_efa_with_devices_and_the_ofi_plugin(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"sys/class/infiniband/rdmap{i}s0").mkdir(parents=True)
    _touch(tmp_path / "root/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so")
    r = _run(tmp_path, "efa")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EFA devices: rdmap0s0 rdmap1s0 rdmap2s0 rdmap3s0" in r.stdout
    assert "aws-ofi-nccl in /opt/amazon/ofi-nccl/lib" in r.stdout


def test_efa_without_the_plugin_says_so(tmp_path: Path) -> None:
    (tmp_path / "sys/class/infiniband/rdmap0s0").mkdir(parents=True)
    r = _run(tmp_path, "efa")
    assert r.returncode == 1 and "no aws-ofi-nccl plugin" in r.stdout


def test_infiniband_checks_the_topology_file(tmp_path: Path) -> None:
    (tmp_path / "sys/class/infiniband/mlx5_ib0").mkdir(parents=True)
    r = _run(tmp_path, "infiniband", NCCL_TOPO_FILE="/opt/microsoft/ndv5-topo.xml")
    assert r.returncode == 1 and "no /opt/microsoft/ndv5-topo.xml" in r.stdout
    _touch(tmp_path / "root/opt/microsoft/ndv5-topo.xml")
    r = _run(tmp_path, "infiniband", NCCL_TOPO_FILE="/opt/microsoft/ndv5-topo.xml")
    assert r.returncode == 0 and "InfiniBand devices: mlx5_ib0" in r.stdout


@pytest.mark.parametrize("kind,nics", [("gpudirect-tcpx", 4), ("gpudirect-tcpxo", 8)])
def test_gpudirect_names_the_missing_nics_and_plugin(tmp_path: Path, kind: str,
                                                     nics: int) -> None:
    for i in range(nics - 1):     # one GPU NIC short
        (tmp_path / f"sys/class/net/eth{i}").mkdir(parents=True)
    r = _run(tmp_path, kind, CLOUDTRAIN_FABRIC_NICS=str(nics))
    assert r.returncode == 1
    assert f"no interface eth{nics - 1}" in r.stdout and "no GPUDirect NCCL plugin" in r.stdout
    (tmp_path / f"sys/class/net/eth{nics - 1}").mkdir(parents=True)
    (tmp_path / f"sys/class/net/eth{nics}").mkdir(parents=True)
    _touch(tmp_path / "root/usr/local/tcpx/lib64/libnccl-net.so")
    r = _run(tmp_path, kind, CLOUDTRAIN_FABRIC_NICS=str(nics))
    assert r.returncode == 0, r.stdout
