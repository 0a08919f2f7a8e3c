"""bootstrap/node.sh with CLOUDTRAIN_CHECK_ONLY=1 (what bench/gpu_preflight.sh runs on a lent
GPU machine): on the fake nodes of test_bootstrap_scripts.py, it finds and reports exactly
what a normal run finds, and where a normal run would install something it stops (exit 7)
saying what, having installed nothing."""

from __future__ import annotations

from pathlib import Path

from test_bootstrap_scripts import A100, H100, FakeNode


def test_a_complete_gpu_node_is_reported_and_nothing_is_run_as_root(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[H100] * 8, driver="550.90.07",
                    image_env=("2.13.0+cu126", "12.6"))
    r = node.run(CLOUDTRAIN_CHECK_ONLY="1")
    assert r.rc == 0, r.out
    assert r.installs() == [] and not [c for c in r.calls if c.startswith("sudo")], r.calls
    assert r.result("gpus") == "8" and r.result("gpu_gen") == "hopper"
    assert r.result("driver") == "550.90.07"
    assert r.outcome("torch") == "found PyTorch 2.13.0+cu126 (CUDA 12.6)"
    assert r.outcome("cuda-check") == "found PyTorch 2.13.0+cu126 sees 8 GPU(s)"


def test_a_missing_driver_stops_it_naming_the_install_it_would_do(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[A100] * 2)
    r = node.run(CLOUDTRAIN_CHECK_ONLY="1")
    assert r.rc == 7, r.out
    fail = r.lines("::fail")
    assert fail and fail[0].startswith("check-only: would") and "CLOUDTRAIN_CHECK_ONLY=1" in fail[0]
    assert r.installs() == [] and "modprobe nvidia" not in r.calls, r.calls


def test_a_missing_pytorch_stops_it_before_the_virtualenv(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, pci=[H100], driver="550.90.07")
    r = node.run(CLOUDTRAIN_CHECK_ONLY="1")
    assert r.rc == 7, r.out
    assert r.lines("::fail")[0].startswith("check-only: would create a virtualenv in ")
    assert r.installs() == [], r.calls
    normal = FakeNode(tmp_path / "again", pci=[H100], driver="550.90.07").run()
    assert normal.rc == 0 and normal.result("installed") == "venv,torch"
