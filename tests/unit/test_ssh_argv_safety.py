"""No value from a node record reaches OpenSSH's command line where it could be read as an
option: the address comes after '--'. Run with the real ``ssh`` client and a node whose address
is an option ('-oProxyCommand=...'): the command it names never runs. (The task's ssh hosts
are refused before this, when the task is read: tests/unit/test_spec_errors.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, cast

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


# --- resources.ssh_proxy ----------------------------------------------------------------------

def _keys_with(tmp_path: Path, proxy: str | None) -> ClusterKeys:
    from cloudtrain.keys import record_proxy

    keys = ClusterKeys(tmp_path / "keys")
    keys.dir.mkdir(parents=True, exist_ok=True)
    record_proxy(keys, proxy)
    return keys


def _resolved(argv: list[str]) -> dict[str, str]:
    """What OpenSSH makes of a cloudtrain command line (ssh -G: no connection)."""
    at = argv.index("--")
    r = subprocess.run([*argv[:at], "-G", *argv[at:at + 2]], capture_output=True, text=True,
                       timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if " " in ln)


def test_a_jump_host_chain_becomes_the_hop_command_openssh_would_run(tmp_path: Path) -> None:
    keys = _keys_with(tmp_path, "jump1.example.com,admin@[2001:db8::1]:2222,ops@bastion:22")
    node = NodeRow("c", 0, "i-1", "10.0.0.7", 22, "ubuntu", "10.0.0.7", "UP", "/r")
    got = _resolved(client_argv(keys, node, tmp_path / "mux.sock", "true"))
    # The last hop is the one ssh -W runs on; the earlier ones go to -J, in order; no -F:
    # the hop reads the user's own config (docs/ssh.md).
    assert got["proxycommand"] == ("ssh -o BatchMode=yes -l ops -p 22 "
                                   "-J 'jump1.example.com,admin@[2001:db8::1]:2222' "
                                   "-W '[%h]:%p' bastion")
    assert "proxyjump" not in got


def test_a_proxy_command_is_used_as_written_and_absent_without_a_proxy(tmp_path: Path) -> None:
    node = NodeRow("c", 0, "i-1", "10.0.0.7", 2222, "ubuntu", "10.0.0.7", "UP", "/r")
    cmd = "nc -X connect -x proxy.corp:3128 %h %p"
    got = _resolved(client_argv(_keys_with(tmp_path, cmd), node, tmp_path / "m.sock", "true"))
    assert got["proxycommand"] == cmd
    got = _resolved(client_argv(_keys_with(tmp_path, None), node, tmp_path / "m.sock", "true"))
    assert "proxycommand" not in got


def test_the_proxy_process_for_paramiko_is_run_as_openssh_runs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.sshproxy import shell_argv

    monkeypatch.delenv("SHELL", raising=False)

    assert shell_argv("ssh -W %h:%p b %% %r", host="10.0.0.7", port=2222, user="u") == \
        ["/bin/sh", "-c", "exec ssh -W 10.0.0.7:2222 b % u"]
    assert shell_argv("admin@b:2200", host="10.0.0.7", port=22, user="u") == \
        ["/bin/sh", "-c", "exec ssh -o BatchMode=yes -l admin -p 2200 -W '[10.0.0.7]:22' b"]


@pytest.mark.parametrize("value", ["-oProxyCommand=touch x", "b -oX", "b;touch x", "b:0",
                                   "u@-b", "$(touch x)", "b,,c", "nc %h %p\n", "%h:%p"])
def test_no_value_that_could_be_read_as_an_option_or_a_second_command_is_accepted(
        value: str) -> None:
    from cloudtrain.sshproxy import check

    with pytest.raises(ValueError, match="%h and %p"):
        check(value)


def test_the_cluster_config_sends_ssh_name_through_the_proxy_and_may_prompt(
        tmp_path: Path) -> None:
    from cloudtrain.cluster import Handle
    from cloudtrain.schema import ClusterRow
    from cloudtrain.sshconfig import render

    keys = _keys_with(tmp_path, "admin@bastion.corp")
    nodes = [NodeRow("lab", r, f"i-{r}", f"10.0.0.{r + 7}", 22, "ubuntu", "", "UP", "/r")
             for r in range(2)]
    row = ClusterRow("lab", "aws", "UP", 2, 0.0, 0.0, nodes=nodes)
    conf = tmp_path / "lab.conf"
    conf.write_text(render(Handle(row, cast(Any, None), keys)))   # rendering asks no provider
    for alias, host in (("lab", "10.0.0.7"), ("lab-1", "10.0.0.8")):
        r = subprocess.run(["ssh", "-F", str(conf), "-G", alias], capture_output=True,
                           text=True, timeout=30, stdin=subprocess.DEVNULL)
        got = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if " " in ln)
        assert got["hostname"] == host
        # a person is at the terminal: no BatchMode for the hop
        assert got["proxycommand"] == "ssh -l admin -W '[%h]:%p' bastion.corp"
