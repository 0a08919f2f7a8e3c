"""The preflight's judgement of what was measured: each problem names its node, GPU or link;
the verdict is one paragraph.

A figure fails when it is below ``threshold`` (default 0.7) times its reference (the GPU's
datasheet peak, the instance type's fabric line rate: reference.py) or times the cluster's
median (GPUs against the median GPU; nodes by their best node pair, against the median node). A check fails
when it differs between nodes (GPU count and model, driver, CUDA, NCCL, PyTorch), when a GPU
reports uncorrected ECC errors, when a CUDA build of PyTorch sees fewer GPUs than
nvidia-smi lists, and when NCCL fell back to TCP sockets on an instance type with a fabric.
CPU figures (fp32 GFLOPS) are reported, not judged: they measure the host's BLAS threads and
whatever else runs there, not a part that can be faulty."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping

from cloudtrain.preflight import reference
from cloudtrain.preflight.report import Measured, Node, size_text

# Sizes below this are latency-bound: the bus bandwidth reference is checked at the largest
# size only when it is at least this big.
MIN_REFERENCE_SIZE = 64 << 20


@dataclass(frozen=True)
class Problem:
    kind: str            # mismatch | ecc | torch-gpus | nvidia-smi | slow-gpu | slow-node |
    #                      slow-allreduce | socket-fallback
    node: int | None     # the node named (None: the cluster's)
    text: str


@dataclass(frozen=True)
class Verdict:
    ok: bool
    problems: tuple[Problem, ...]
    paragraph: str

    def to_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "paragraph": self.paragraph,
                "problems": [{"kind": p.kind, "node": p.node, "text": p.text}
                             for p in self.problems]}


@dataclass(frozen=True)
class Context:
    """What the judgement needs beside the figures."""

    cluster: str
    provider: str
    instance_type: str | None
    threshold: float = 0.7
    names: Mapping[int, str] | None = None     # node rank -> how to call it

    def node(self, rank: int) -> str:
        name = (self.names or {}).get(rank)
        return f"node {rank}" + (f" ({name})" if name else "")


def judge(m: Measured, ctx: Context) -> Verdict:
    problems: list[Problem] = []
    for check in (_node_checks, _mismatches, _gpus, _links, _allreduce, _transport):
        problems += check(m, ctx)
    if problems:
        text = (f"Preflight of '{ctx.cluster}' failed: "
                + "; ".join(p.text for p in problems) + ".")
    else:
        text = f"Preflight of '{ctx.cluster}' passed: " + summary(m) + "."
    return Verdict(not problems, tuple(problems), text)


def summary(m: Measured) -> str:
    gpus = sum(len(n.gpus) for n in m.nodes)
    what = f"{len(m.nodes)} node(s), {gpus} GPU(s)" if gpus else f"{len(m.nodes)} CPU node(s)"
    big = m.largest
    bw = ("" if big is None else
          ", no all-reduce between ranks (one rank)" if m.world_size == 1 else
          f", all-reduce {big.busbw_gbps:g} GB/s bus bandwidth "
          f"({big.algbw_gbps:g} GB/s algorithm) at {size_text(big.bytes)}")
    return f"{what}, {m.world_size} rank(s){bw} over {m.transport()}"


def _node_checks(m: Measured, ctx: Context) -> list[Problem]:
    out = []
    for n in m.nodes:
        if n.smi_error:
            out.append(Problem("nvidia-smi", n.rank, f"{ctx.node(n.rank)}: {n.smi_error}"))
        for g in n.gpus:
            if g.ecc_uncorrected:
                out.append(Problem("ecc", n.rank, f"{ctx.node(n.rank)} GPU {g.index} ({g.name}) "
                                   f"reports {g.ecc_uncorrected} uncorrected ECC error(s)"))
        if n.versions.get("cuda") and n.gpus and n.torch_gpus < len(n.gpus):
            out.append(Problem("torch-gpus", n.rank,
                               f"{ctx.node(n.rank)}: PyTorch (CUDA {n.versions['cuda']}) sees "
                               f"{n.torch_gpus} of the {len(n.gpus)} GPUs nvidia-smi lists"))
    return out


CHECKS: tuple[tuple[str, Callable[[Node], str]], ...] = (
    ("GPU count", lambda n: str(len(n.gpus))),
    ("GPU model", lambda n: ", ".join(sorted({g.name for g in n.gpus})) or "none"),
    ("NVIDIA driver", lambda n: n.versions.get("driver", "")),
    ("CUDA (PyTorch's build)", lambda n: n.versions.get("cuda", "")),
    ("NCCL", lambda n: n.versions.get("nccl", "")),
    ("PyTorch", lambda n: n.versions.get("torch", "")),
)


def _mismatches(m: Measured, ctx: Context) -> list[Problem]:
    out = []
    for what, value in CHECKS:
        seen = {n.rank: value(n) or "-" for n in m.nodes}
        counts = Counter(seen.values())
        if len(counts) < 2:
            continue
        (top, c1), (_, c2) = counts.most_common(2)
        if c1 > c2:     # a majority: the others are the odd ones
            for rank, v in seen.items():
                if v != top:
                    out.append(Problem("mismatch", rank, f"{ctx.node(rank)} has {what} {v}, "
                                       f"the other nodes {top}"))
        else:
            out.append(Problem("mismatch", None, f"{what} differs between nodes: " + ", ".join(
                f"{ctx.node(r)} {v}" for r, v in seen.items())))
    return out


def _gpus(m: Measured, ctx: Context) -> list[Problem]:
    figures = [(n, x) for n in m.nodes for x in n.matmuls if x.tflops is not None]
    if not figures:
        return []
    median = statistics.median(float(x.tflops or 0) for _, x in figures)
    out = []
    for n, x in figures:
        t = float(x.tflops or 0)
        gpu = n.gpus[x.local_rank] if x.local_rank < len(n.gpus) else None
        name = gpu.name if gpu else x.device
        ref = reference.gpu(name) if gpu else None
        why = []
        if len(figures) > 1 and t < ctx.threshold * median:
            why.append(f"{t / median:.0%} of the median GPU ({median:g})")
        if ref is not None and t < ctx.threshold * reference.ACHIEVED * ref.bf16_tflops:
            why.append(f"{t / ref.bf16_tflops:.0%} of the {ref.model}'s {ref.bf16_tflops:g} "
                       f"TFLOPS dense peak, where a healthy one reaches about "
                       f"{reference.ACHIEVED:.0%} ({ref.source})")
        if why:
            idx = gpu.index if gpu else x.local_rank
            out.append(Problem("slow-gpu", n.rank, f"{ctx.node(n.rank)} GPU {idx} ({name}) "
                               f"reaches {t:g} TFLOPS {x.dtype}, " + " and ".join(why)))
    return out


def _links(m: Measured, ctx: Context) -> list[Problem]:
    """Each node's figure is its best pair (a node is slow only when every pair it is in is),
    compared with the median node. A single slow pair between two healthy nodes is shown in
    the figures but not judged: on a shared host one pair's round trips vary too much alone."""
    if len(m.links) < 3:      # one pair (two nodes): nothing to compare it with
        return []
    best: dict[int, float] = {}
    for x in m.links:
        for r in x.nodes:
            best[r] = max(best.get(r, 0.0), x.gbps)
    median = statistics.median(best.values())
    cut = ctx.threshold * median
    out = []
    slow = sorted(r for r, g in best.items() if g < cut)
    for r in slow:
        figs = ", ".join(f"{a}-{b} {x.gbps:.3g} GB/s" for x in m.links if r in x.nodes
                         for a, b in [x.nodes])
        out.append(Problem("slow-node", r, f"{ctx.node(r)}'s network link is slow: its node "
                           f"pairs reach {figs}, {best[r] / median:.0%} of the median node's "
                           f"{median:.3g} GB/s"))
    return out


def _allreduce(m: Measured, ctx: Context) -> list[Problem]:
    ref = reference.instance(ctx.instance_type)
    big = m.largest
    if ref is None or big is None or len(m.nodes) < 2 or big.bytes < MIN_REFERENCE_SIZE:
        return []
    if big.busbw_gbps >= ctx.threshold * ref.busbw_gbps:
        return []
    return [Problem("slow-allreduce", None,
                    f"the all-reduce reaches {big.busbw_gbps:g} GB/s bus bandwidth at "
                    f"{size_text(big.bytes)}, {big.busbw_gbps / ref.busbw_gbps:.0%} of "
                    f"{ref.instance_type}'s {ref.line_gbit:g} Gb/s {ref.fabric} line rate "
                    f"({ref.busbw_gbps:g} GB/s; {ref.source})")]


def _transport(m: Measured, ctx: Context) -> list[Problem]:
    fabric = reference.fabric_of(ctx.provider, ctx.instance_type)
    if fabric is None or len(m.nodes) < 2 or m.backend != "nccl" or not m.socket_fallback():
        return []
    return [Problem("socket-fallback", None,
                    f"NCCL fell back to plain TCP sockets ({m.transport()}) on "
                    f"{ctx.instance_type}, whose {fabric} fabric it should use: check the "
                    "fabric's setup (docs/network.md) before a paid run")]
