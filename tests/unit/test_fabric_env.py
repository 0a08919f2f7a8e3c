"""The fast network's variables reach every job's environment: what the provider recorded
when it made the nodes (FI_*, NCCL_*, UCX_* ...), never its other node variables, under the
task's own ``envs`` (which may override them) and under the interface bootstrap found."""

from __future__ import annotations

from pathlib import Path

from cloudtrain.provider.fabric import job_vars, wanted
from cloudtrain.spec import parse_task


class _Provider:
    """A provider with a node environment (the HasNodeEnv capability)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def node_env(self, cluster: str) -> dict[str, str]:
        return dict(self.env)


def test_job_env_carries_the_fabric_and_the_task_may_override(tmp_path: Path) -> None:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.keys import ClusterKeys
    from cloudtrain.pipeline.run import job_env
    from cloudtrain.schema import ClusterRow, NodeRow
    from cloudtrain.state import open_state
    from cloudtrain.ui import UI

    nodes = [NodeRow("c", r, f"i{r}", f"h{r}", 22, "u", f"10.1.0.{r + 10}", "running", "/r",
                     iface="ens5", gpus=8) for r in range(2)]
    row = ClusterRow("c", "aws", "UP", 2, 0, 0, master_port=29500, nodes=nodes)
    env = Env(tmp_path, open_state(tmp_path), UI(quiet=True))
    provider = _Provider({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
                          "NCCL_SOCKET_IFNAME": "eth9", "CLOUDTRAIN_FABRIC": "efa",
                          "CLOUDTRAIN_PYTHON": "/not/for/jobs"})
    handle = Handle(row, provider=provider, keys=ClusterKeys(tmp_path))  # type: ignore[arg-type]
    task = parse_task("num_nodes: 2\nrun: echo\nenvs: {FI_EFA_USE_DEVICE_RDMA: '0'}\n")
    e = job_env(env, handle, nodes[1], task.envs, "job1", {})
    assert e["FI_PROVIDER"] == "efa" and e["CLOUDTRAIN_FABRIC"] == "efa"
    assert e["FI_EFA_USE_DEVICE_RDMA"] == "0"          # the task's envs win
    assert e["NCCL_SOCKET_IFNAME"] == "ens5"            # the interface bootstrap found
    assert "CLOUDTRAIN_PYTHON" not in e


def test_job_vars_keeps_only_the_fabric_variables() -> None:
    assert job_vars({"NCCL_IB_PCI_RELAXED_ORDERING": "1", "UCX_TLS": "tcp", "PATH": "/x",
                     "CLOUDTRAIN_ROOT": "r"}) == {"NCCL_IB_PCI_RELAXED_ORDERING": "1",
                                                 "UCX_TLS": "tcp"}


def test_the_default_is_fast_on_two_nodes_of_a_fabric_type_only() -> None:
    assert wanted(None, "aws", "p4d.24xlarge", 2) is not None
    assert wanted(None, "aws", "p4d.24xlarge", 1) is None
    assert wanted(None, "aws", "g4dn.xlarge", 8) is None
    assert wanted("fast", "aws", "P4D.24XLARGE", 1) is not None   # names are case-blind
    assert wanted("plain", "gcp", "a3-megagpu-8g", 4) is None
