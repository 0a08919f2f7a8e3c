"""The fast network of an instance type: which fabric it has (EFA, GPUDirect-TCPX/TCPXO,
InfiniBand) and its line rate, with the public page each figure comes from.

``resources.network`` picks it: ``fast`` (the fabric, refused where the type has none),
``plain`` (the cloud's ordinary network only), or unset: the fabric where the type has one
and the cluster has more than one node (a single node has no peer to use it with).

    fabric_of("aws", "p4d.24xlarge")          # Fabric(kind="efa", links=4, gbps_per_link=100 ...)
    wanted(None, "aws", "p4d.24xlarge", 2)    # the fabric: up sets it up
    wanted("fast", "aws", "g4dn.xlarge", 2)   # UserError naming resources.network

The line rate is what the cloud sells per node (links x rate of one link); what NCCL reaches
is lower (``cloudtrain preflight`` measures it). Types not listed here get the plain network;
docs/network.md says why some fabric types are not listed yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cloudtrain.errors import UserError

NETWORKS = ("fast", "plain")

AWS_SPECS = "https://docs.aws.amazon.com/ec2/latest/instancetypes/ac.html"
AWS_EFA = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html"
GCP_GPUDIRECT = "https://cloud.google.com/compute/docs/gpus/gpudirect"
GCP_RECIPE = ("https://github.com/GoogleCloudPlatform/container-engine-accelerators/tree/"
              "master/gpudirect-tcpx")
AZ_A100 = ("https://learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/"
           "nda100v4-series")
AZ_H100 = ("https://learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/"
           "ndh100v5-series")


@dataclass(frozen=True)
class Fabric:
    """One instance type's fast network."""

    kind: str            # efa | gpudirect-tcpx | gpudirect-tcpxo | infiniband
    links: int           # EFA interfaces / GPU NICs / InfiniBand ports per node
    gbps_per_link: int   # line rate of one link, Gb/s
    source: str          # the public page the figures come from

    @property
    def gbps(self) -> int:
        """The node's line rate on the fabric, Gb/s."""
        return self.links * self.gbps_per_link

    @property
    def title(self) -> str:
        return {"efa": "EFA", "gpudirect-tcpx": "GPUDirect-TCPX",
                "gpudirect-tcpxo": "GPUDirect-TCPXO", "infiniband": "InfiniBand"}[self.kind]

    def text(self) -> str:
        """'EFA 4x100 Gb/s (400 Gb/s)'."""
        return f"{self.title} {self.links}x{self.gbps_per_link} Gb/s ({self.gbps} Gb/s)"

    def to_dict(self) -> dict[str, object]:
        return {"fabric": self.kind, "links": self.links, "gbps_per_link": self.gbps_per_link,
                "gbps": self.gbps, "source": self.source}


def _efa(links: int, gbps: int) -> Fabric:
    return Fabric("efa", links, gbps, AWS_SPECS)


FABRICS: dict[tuple[str, str], Fabric] = {
    # AWS: EFA interfaces (one per network card) x the card's bandwidth, as the EC2
    # accelerated-computing specs list them and DescribeInstanceTypes' NetworkInfo.EfaInfo /
    # NetworkCards report them.
    ("aws", "p3dn.24xlarge"): _efa(1, 100),
    ("aws", "p4d.24xlarge"): _efa(4, 100),
    ("aws", "p4de.24xlarge"): _efa(4, 100),
    ("aws", "p5.48xlarge"): _efa(32, 100),
    ("aws", "p5e.48xlarge"): _efa(32, 100),
    ("aws", "p5en.48xlarge"): _efa(16, 200),
    ("aws", "g5.48xlarge"): _efa(1, 100),
    ("aws", "g6.48xlarge"): _efa(1, 100),
    ("aws", "trn1.32xlarge"): _efa(8, 100),
    ("aws", "trn1n.32xlarge"): _efa(16, 100),
    # GCP: A3 High has 4 GPU NICs for GPUDirect-TCPX, A3 Mega 8 for TCPXO, 200 Gb/s each
    # (beside the primary gVNIC for everything else).
    ("gcp", "a3-highgpu-8g"): Fabric("gpudirect-tcpx", 4, 200, GCP_GPUDIRECT),
    ("gcp", "a3-megagpu-8g"): Fabric("gpudirect-tcpxo", 8, 200, GCP_GPUDIRECT),
    # Azure: one InfiniBand link per GPU, HDR 200 Gb/s (A100 v4) or NDR 400 Gb/s (H100 v5),
    # "automatically configured between VMs occupying the same virtual machine scale set".
    ("azure", "Standard_ND96asr_v4"): Fabric("infiniband", 8, 200, AZ_A100),
    ("azure", "Standard_ND96amsr_A100_v4"): Fabric("infiniband", 8, 200, AZ_A100),
    ("azure", "Standard_ND96isr_H100_v5"): Fabric("infiniband", 8, 400, AZ_H100),
}
_BY_KEY = {(p, t.casefold()): f for (p, t), f in FABRICS.items()}


def fabric_of(provider: str, instance_type: str | None) -> Fabric | None:
    """The fabric of ``instance_type`` on ``provider``; None: the plain network only."""
    if not instance_type:
        return None
    return _BY_KEY.get((provider, instance_type.casefold()))


def with_fabric(provider: str) -> list[str]:
    """The instance types of ``provider`` that have a fabric, in the table's order."""
    return [t for (p, t) in FABRICS if p == provider]


def cell(provider: str, instance_type: str | None) -> str:
    """The network as a table shows it: 'EFA 4x100 Gb/s (400 Gb/s)', or 'plain'."""
    f = fabric_of(provider, instance_type)
    return f.text() if f else "plain"


def wanted(setting: str | None, provider: str, instance_type: str | None,
           num_nodes: int) -> Fabric | None:
    """The fabric ``up`` sets up for ``resources.network`` = ``setting``: None for plain
    (asked, or by default on a type without one or on one node). ``fast`` on a type without a
    fabric is the user's error (nothing is created)."""
    f = fabric_of(provider, instance_type)
    if setting == "plain":
        return None
    if setting == "fast":
        if f is None:
            raise no_fabric(provider, instance_type)
        return f
    return f if num_nodes > 1 else None


def no_fabric(provider: str, instance_type: str | None) -> UserError:
    types = ", ".join(with_fabric(provider)) or "none"
    return UserError(
        f"resources.network: fast, but {provider} {instance_type or '(no instance type)'} has "
        f"no fast network (EFA, GPUDirect-TCPX/TCPXO or InfiniBand). Nothing was created. "
        f"The {provider} types with one: {types}.",
        "Pick one of those instance types, or set resources.network: plain (or leave it out: "
        "the fast network is then used where the type has one).")


def describe(setting: str | None, provider: str, instance_type: str | None,
             num_nodes: int) -> str:
    """The plan's ``network`` row: what ``up`` sets up, and why when it is plain."""
    f = wanted(setting, provider, instance_type, num_nodes)
    if f is not None:
        return f"fast: {f.text()}"
    have = fabric_of(provider, instance_type)
    if have is None:
        return "plain (the instance type has no fast network)"
    if setting == "plain":
        return f"plain (resources.network: plain; the type has {have.text()})"
    return f"plain (one node; the type has {have.text()}, used with 2 or more)"


JOB_PREFIXES = ("FI_", "NCCL_", "UCX_", "CLOUDTRAIN_FABRIC", "CUDA_DEVICE_ORDER")


def job_vars(node_env: dict[str, str]) -> dict[str, str]:
    """The fast network's variables among a provider's node variables: what every job's
    processes get (the task's ``envs`` may override them)."""
    return {k: v for k, v in node_env.items() if k.startswith(JOB_PREFIXES)}


def fast_only(setting: str | None, offers: list[Any]) -> list[Any]:
    """The offers ``resources.network`` = ``setting`` allows: with ``fast``, those of types
    with a fabric (the ranking then picks among them); all of them otherwise."""
    if setting != "fast":
        return offers
    return [o for o in offers if fabric_of(o.provider, o.instance_type) is not None]
