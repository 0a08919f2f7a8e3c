"""Will the model fit? A per-GPU memory estimate for data-parallel training.

The estimate is deliberately simple, so that it can be checked by hand (docs/cost.md):

    bytes per parameter
        weights     fp32: 4      bf16/fp16 (mixed precision): 2 (compute copy) + 4 (fp32 master) = 6
        gradients   fp32: 4      bf16/fp16: 2
        optimizer   adamw: 8 (two fp32 moments)      sgd: 4 (one fp32 momentum buffer)

    states      = params x (weights + gradients + optimizer) bytes / shards
                  shards = 1 for ddp (every GPU holds everything),
                           every GPU of the cluster for fsdp (full shard)
    activations = 20 % of states (an allowance; real activations depend on batch and sequence)
    overhead    = 1 GiB (CUDA context, cuBLAS/NCCL workspaces)
    needed      = states + activations + overhead
    fits        when needed <= GPU memory x 0.9 (the usable fraction)

GiB are 2**30 bytes. Nothing here imports torch or talks to a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cloudtrain.errors import UserError

GIB = float(2 ** 30)
ACTIVATION_FRACTION = 0.20
OVERHEAD_GIB = 1.0
USABLE_FRACTION = 0.90

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "sgd")
STRATEGIES = ("ddp", "fsdp")

# bytes per parameter: (weights, gradients)
_WEIGHT_GRAD_BYTES = {"fp32": (4, 4), "bf16": (6, 2), "fp16": (6, 2)}
_OPTIMIZER_BYTES = {"adamw": 8, "sgd": 4}

FORMULA = ("needed per GPU = params x (weights + gradients + optimizer bytes) / shards x 1.2 "
           "+ 1 GiB; weights 4 B (fp32) or 2+4 B (bf16/fp16 with an fp32 master copy), "
           "gradients 4 or 2 B, optimizer 8 B (adamw) or 4 B (sgd); shards = every GPU of the "
           "cluster for fsdp, 1 for ddp; the 20 % is the activation allowance and 1 GiB the CUDA "
           "context; it fits when needed <= 90 % of the GPU's memory")


@dataclass(frozen=True)
class Breakdown:
    """Memory needed on each GPU, in GiB, for a given number of shards."""

    params: float
    precision: str
    optimizer: str
    strategy: str
    shards: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    overhead_gib: float

    @property
    def states_gib(self) -> float:
        return self.weights_gib + self.gradients_gib + self.optimizer_gib

    @property
    def needed_gib(self) -> float:
        return self.states_gib + self.activations_gib + self.overhead_gib

    @property
    def min_gpu_memory_gib(self) -> float:
        """The smallest GPU (nominal memory) this fits on."""
        return self.needed_gib / USABLE_FRACTION

    def fits(self, gpu_memory_gib: float) -> bool:
        return self.needed_gib <= gpu_memory_gib * USABLE_FRACTION + 1e-9

    def to_dict(self) -> dict[str, object]:
        r = lambda v: round(v, 2)  # noqa: E731 - a named one-line callable, read once below
        return {
            "params": self.params, "precision": self.precision, "optimizer": self.optimizer,
            "strategy": self.strategy, "shards": self.shards,
            "bytes_per_param": {"weights": self.weight_bytes, "gradients": self.gradient_bytes,
                                "optimizer": self.optimizer_bytes},
            "weights_gib": r(self.weights_gib), "gradients_gib": r(self.gradients_gib),
            "optimizer_gib": r(self.optimizer_gib), "activations_gib": r(self.activations_gib),
            "overhead_gib": r(self.overhead_gib), "needed_gib": r(self.needed_gib),
            "usable_fraction": USABLE_FRACTION,
            "min_gpu_memory_gib": r(self.min_gpu_memory_gib),
        }

    def lines(self) -> list[str]:
        """The arithmetic, one line each, for the terminal."""
        p = fmt_params(self.params)
        shard = f" / {self.shards} GPUs (fsdp)" if self.strategy == "fsdp" else " (ddp: not sharded)"
        return [
            f"weights     {p} x {self.weight_bytes} B{shard} = {self.weights_gib:8.2f} GiB",
            f"gradients   {p} x {self.gradient_bytes} B{shard} = {self.gradients_gib:8.2f} GiB",
            f"optimizer   {p} x {self.optimizer_bytes} B{shard} = {self.optimizer_gib:8.2f} GiB",
            f"activations {ACTIVATION_FRACTION:.0%} of the above = {self.activations_gib:8.2f} GiB",
            f"CUDA context and workspace = {self.overhead_gib:8.2f} GiB",
            f"needed per GPU = {self.needed_gib:.2f} GiB: fits a GPU with at least "
            f"{self.min_gpu_memory_gib:.2f} GiB ({USABLE_FRACTION:.0%} usable)",
        ]


@dataclass(frozen=True)
class MemoryEstimate:
    """What is trained and how; ``breakdown(gpus)`` gives the per-GPU need for a cluster of
    ``gpus`` GPUs in all (it matters only for fsdp)."""

    params: float
    precision: str = "bf16"
    optimizer: str = "adamw"
    strategy: str = "ddp"

    def __post_init__(self) -> None:
        if not self.params > 0:
            raise UserError(f"--model-params must be more than 0 (got {self.params:g}).",
                            "Give the parameter count, e.g. 7e9 or 7B.")
        for value, allowed, what in ((self.precision, PRECISIONS, "precision"),
                                     (self.optimizer, OPTIMIZERS, "optimizer"),
                                     (self.strategy, STRATEGIES, "strategy")):
            if value not in allowed:
                raise UserError(f"Unknown {what} '{value}'.", f"Use one of: {', '.join(allowed)}.")

    def shards(self, gpus: float) -> int:
        return max(1, int(gpus)) if self.strategy == "fsdp" else 1

    def breakdown(self, gpus: float = 1) -> Breakdown:
        wb, gb = _WEIGHT_GRAD_BYTES[self.precision]
        ob = _OPTIMIZER_BYTES[self.optimizer]
        n = self.shards(gpus)
        per = self.params / n / GIB
        weights, grads, opt = per * wb, per * gb, per * ob
        return Breakdown(params=self.params, precision=self.precision, optimizer=self.optimizer,
                         strategy=self.strategy, shards=n, weight_bytes=wb, gradient_bytes=gb,
                         optimizer_bytes=ob, weights_gib=weights, gradients_gib=grads,
                         optimizer_gib=opt,
                         activations_gib=ACTIVATION_FRACTION * (weights + grads + opt),
                         overhead_gib=OVERHEAD_GIB)

    def describe(self) -> str:
        return f"{fmt_params(self.params)} params, {self.precision}, {self.optimizer}, {self.strategy}"


def fmt_params(p: float) -> str:
    """7e9 -> "7e9", 1.3e10 -> "1.3e10", 350e6 -> "3.5e8", 1000 -> "1000"."""
    return f"{p:.4g}".replace("e+0", "e").replace("e+", "e")


_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_params(text: str) -> float:
    """``7e9``, ``7000000000``, ``7B``, ``350M``, ``1.5b`` -> a parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise UserError(f"--model-params '{text}' is not a parameter count.",
                        "Write e.g. 7e9, 7B or 350M.")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value <= 0:
        raise UserError(f"--model-params must be more than 0 (got '{text}').",
                        "Write e.g. 7e9, 7B or 350M.")
    return value
