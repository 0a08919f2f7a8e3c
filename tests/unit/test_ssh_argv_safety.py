"""No value from a node record reaches OpenSSH's command line where it could be read as an
option: the address comes after '--'. Run with the real ``ssh`` client and a node whose address
is an option ('-oProxyCommand=...'): the command it names never runs. (The task's ssh hosts
are refused before this, when the task is read: tests/unit/test_spec_errors.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cloudtrain.keys import ClusterKeys
from cloudtrain.schema import NodeRow
from cloudtrain.sshmux import client_argv

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client")


def test_an_address_written_as_an_option_is_not_read_as_one(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    node = NodeRow("c", 0, "i-1", f"-oProxyCommand=touch {pwned}", 22, "ubuntu", "10.0.0.1",
                   "UP", "/r")
    argv = client_argv(ClusterKeys(tmp_path / "keys"), node, tmp_path / "mux.sock", "true")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert not pwned.exists(), "ssh read the node's address as an option"
