"""The preflight's reference figures: what a healthy GPU and a healthy fabric give, from the
vendors' public pages (each row cites its page). Local and ssh nodes have no reference: they
are compared with their own median only.

GPUs: the datasheet's dense (no sparsity) BF16 Tensor Core peak per GPU, in TFLOPS. A healthy
GPU's short 8192x8192 matmul reaches well below its peak (clocks, power); the default 70 %
threshold is meant to catch a GPU that is throttled, faulty or shared.

Instance types: the fabric and its line rate per node (the sum of the node's GPU NICs, in
Gbit/s, as the cloud's page gives it). A multi-node all-reduce's bus bandwidth is bounded by
the node's network bandwidth; the reference is that line rate in GB/s (Gbit/s / 8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuRef:
    pattern: str        # a regular expression on nvidia-smi's name (case-insensitive)
    model: str
    bf16_tflops: float  # dense, per GPU
    source: str


@dataclass(frozen=True)
class TypeRef:
    instance_type: str
    cloud: str
    gpu: str
    fabric: str         # efa | gpudirect-tcpx | gpudirect-tcpxo | infiniband
    line_gbit: float    # per node
    source: str

    @property
    def busbw_gbps(self) -> float:
        """The all-reduce bus bandwidth a multi-node run can reach at most, GB/s."""
        return self.line_gbit / 8


# What a healthy GPU's short matmul (the preflight's 8192^3 bf16, half a second) reaches of
# its datasheet peak: about 70 % (two H200s gave 669 to 704 of 989 TFLOPS in
# bench/gpu_preflight.sh on 2026-11-26; longer runs reach 78-80 %). A GPU is judged against
# this share of its peak, so the default 70 % threshold fails a GPU under about half its peak,
# not a healthy one that runs a little cooler than the last.
ACHIEVED = 0.7

GPUS: tuple[GpuRef, ...] = (
    GpuRef(r"H100.*(PCIe)", "H100 PCIe", 756.0,
           "https://www.nvidia.com/en-us/data-center/h100/"),
    GpuRef(r"H100.*(NVL)", "H100 NVL", 835.0,
           "https://www.nvidia.com/en-us/data-center/h100/"),
    GpuRef(r"H100", "H100 SXM", 989.0, "https://www.nvidia.com/en-us/data-center/h100/"),
    GpuRef(r"H200", "H200 SXM", 989.0, "https://www.nvidia.com/en-us/data-center/h200/"),
    GpuRef(r"A100", "A100", 312.0, "https://www.nvidia.com/en-us/data-center/a100/"),
    GpuRef(r"\bL4\b", "L4", 121.0, "https://www.nvidia.com/en-us/data-center/l4/"),
)

TYPES: tuple[TypeRef, ...] = (
    TypeRef("p4d.24xlarge", "aws", "A100", "efa", 400.0,
            "https://aws.amazon.com/ec2/instance-types/p4/"),
    TypeRef("p4de.24xlarge", "aws", "A100", "efa", 400.0,
            "https://aws.amazon.com/ec2/instance-types/p4/"),
    TypeRef("p5.48xlarge", "aws", "H100", "efa", 3200.0,
            "https://aws.amazon.com/ec2/instance-types/p5/"),
    TypeRef("a3-highgpu-8g", "gcp", "H100", "gpudirect-tcpx", 800.0,
            "https://cloud.google.com/compute/docs/accelerator-optimized-machines#a3-vms"),
    TypeRef("a3-megagpu-8g", "gcp", "H100", "gpudirect-tcpxo", 1600.0,
            "https://cloud.google.com/compute/docs/accelerator-optimized-machines#a3-vms"),
    TypeRef("Standard_ND96asr_v4", "azure", "A100", "infiniband", 1600.0,
            "https://learn.microsoft.com/en-us/azure/virtual-machines/nda100-v4-series"),
    TypeRef("Standard_ND96amsr_A100_v4", "azure", "A100", "infiniband", 1600.0,
            "https://learn.microsoft.com/en-us/azure/virtual-machines/ndm-a100-v4-series"),
    TypeRef("Standard_ND96isr_H100_v5", "azure", "H100", "infiniband", 3200.0,
            "https://learn.microsoft.com/en-us/azure/virtual-machines/nd-h100-v5-series"),
)


def gpu(name: str) -> GpuRef | None:
    """The reference row of a GPU by nvidia-smi's name, None when the table has none."""
    for row in GPUS:
        if re.search(row.pattern, name, re.I):
            return row
    return None


def instance(instance_type: str | None) -> TypeRef | None:
    if not instance_type:
        return None
    return next((t for t in TYPES if t.instance_type.lower() == instance_type.lower()), None)


def fabric_of(provider: str, instance_type: str | None) -> str | None:
    """The instance type's fabric, as the catalog records it (cloudtrain/provider/fabric.py);
    None for a type without a fast fabric."""
    if not instance_type:     # local and ssh nodes (and the GPU script: no package needed)
        return None
    from cloudtrain.provider import fabric as catalog_fabric

    found = catalog_fabric.fabric_of(provider, instance_type)
    return None if found is None else str(found.kind)
