from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cloudtrain.errors import HostKeyMismatch, RemoteError
from cloudtrain.keys import ensure_keys, is_pinned, pin_host_keys
from cloudtrain.remote import GroupResult
from cloudtrain.connection import Result
from cloudtrain.schema import ClusterRow, NodeRow
from cloudtrain.state import open_state


def test_state_is_safe_with_several_processes(tmp_path: Path) -> None:
    """Eight processes record launches at once; every row lands, none is lost."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from cloudtrain.state import open_state
        s = open_state(Path({str(tmp_path)!r}))
        for i in range(25):
            s.add_launch("c", f"job-{{sys.argv[1]}}-{{i}}", None, False)
            s.finish_launch(f"job-{{sys.argv[1]}}-{{i}}", "SUCCEEDED", 0, None)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(k)]) for k in range(8)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    launches = open_state(tmp_path).launches("c")
    assert len(launches) == 200
    assert {lr.status for lr in launches} == {"SUCCEEDED"}


def test_state_keeps_bootstrap_facts_for_the_same_instance(tmp_path: Path) -> None:
    s = open_state(tmp_path)
    s.upsert_cluster(ClusterRow("c", "local", "UP", 1, 0, 0, hourly_price=1.5))
    s.replace_nodes("c", [NodeRow("c", 0, "i-1", "h", 22, "u", "10.0.0.1", "running", "/r")])
    s.set_node_bootstrap("c", 0, version="v1", iface="eth0", python_bin="/py", gpus=2, info={"os": "x"})
    # The provider reports the same instance again: what bootstrap learned stays.
    s.replace_nodes("c", [NodeRow("c", 0, "i-1", "h", 22, "u", "10.0.0.1", "running", "/r")])
    n = s.get_cluster("c").nodes[0]  # type: ignore[union-attr]
    assert (n.iface, n.python_bin, n.gpus, n.bootstrap_version) == ("eth0", "/py", 2, "v1")
    # A replaced instance starts afresh.
    s.replace_nodes("c", [NodeRow("c", 0, "i-2", "h", 22, "u", "10.0.0.1", "running", "/r")])
    n = s.get_cluster("c").nodes[0]  # type: ignore[union-attr]
    assert n.bootstrap_version is None and n.python_bin is None


def test_usage_interval_records_price_at_launch(tmp_path: Path) -> None:
    s = open_state(tmp_path)
    row = ClusterRow("c", "aws", "UP", 2, 0, 0, hourly_price=3.0, instance_type="p4d")
    s.open_usage(row)
    s.open_usage(row)  # adopting an up cluster does not open a second interval
    s.close_usage("c", when=10**10)
    u = s.usage()
    assert len(u) == 1 and u[0].hourly_price_per_node == 3.0 and u[0].num_nodes == 2
    assert u[0].ended_at == 10**10


def test_group_result_names_every_failed_node() -> None:
    g = GroupResult({0: Result(0, 0), 1: Result(1, 3, stderr="disk full"),
                     2: Result(2, None, error=TimeoutError("timed out"))})
    assert [r.rank for r in g.failed] == [1, 2]
    with pytest.raises(RemoteError) as e:
        g.raise_on_failure("Sync")
    msg = str(e.value)
    assert "2 of 3" in msg and "node 1: exit 3 (disk full)" in msg and "node 2: timed out" in msg


def test_keys_are_private_and_pins_replace_old_entries(tmp_path: Path) -> None:
    k = ensure_keys(tmp_path, "cloudtrain-x")
    assert k.private_key.stat().st_mode & 0o777 == 0o600
    assert k.public_key().startswith("ssh-ed25519 ")
    assert ensure_keys(tmp_path, "cloudtrain-x").public_key() == k.public_key()  # created once
    pin_host_keys(k.known_hosts, "10.0.0.1", 2222, ("ssh-ed25519 AAAA1",))
    pin_host_keys(k.known_hosts, "10.0.0.1", 2222, ("ssh-ed25519 AAAA2",))
    lines = k.known_hosts.read_text().splitlines()
    assert lines == ["[10.0.0.1]:2222 ssh-ed25519 AAAA2"]
    assert is_pinned(k.known_hosts, "10.0.0.1", 2222)
    assert not is_pinned(k.known_hosts, "10.0.0.1", 22)


@pytest.mark.e2e
def test_changed_host_key_is_refused(tmp_path: Path) -> None:
    """A node whose host key differs from the pinned one is refused, not trusted."""
    import shutil

    if shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists():
        pytest.skip("no sshd")
    from cloudtrain.context import open_env
    from cloudtrain.pipeline.provision import provision
    from cloudtrain.cluster import connect as connect_cluster
    from cloudtrain.spec import parse_task
    from cloudtrain.ui import UI

    import os

    os.environ["CLOUDTRAIN_HOME"] = str(tmp_path / "home")
    env = open_env(UI(quiet=True))
    task = parse_task("name: hk\nnum_nodes: 1\nrun: 'true'\n")
    handle, _ = provision(env, task, "hk")
    try:
        connect_cluster(env, handle, timeout=30).close()  # the pinned key works
        node = handle.nodes[0]
        pin_host_keys(handle.keys.known_hosts, node.host, node.port,
                      ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKMbvPxPzqPDSiX2e6Cw8wz5yRMAIuTLwZNWWH5e3hQq",))
        with pytest.raises(HostKeyMismatch) as e:
            connect_cluster(env, handle, timeout=10)
        assert "different from the one pinned" in str(e.value)
    finally:
        from cloudtrain.pipeline.teardown import down

        down(env, "hk")
        del os.environ["CLOUDTRAIN_HOME"]


def test_a_node_flooding_output_without_newlines_cannot_grow_the_laptops_memory() -> None:
    from cloudtrain.connection import MAX_LINE_BYTES, LineBuffer

    got: list[tuple[int, str]] = []
    buf = LineBuffer(3, lambda rank, line: got.append((rank, line)))
    chunk = b"x" * 4096
    for _ in range(256):                      # 1 MiB, no newline
        buf.add(chunk)
        assert len(buf.pending) < MAX_LINE_BYTES
    buf.add(b"tail\nnext")
    buf.flush()
    text = "".join(line for _, line in got[:-2])
    assert len(text) + len(got[-2][1]) == 256 * 4096 + 4 and got[-2][1].endswith("tail")
    assert all(len(line) <= MAX_LINE_BYTES for _, line in got) and {r for r, _ in got} == {3}
    assert got[-1] == (3, "next")
