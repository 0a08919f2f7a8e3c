"""What the node program (cloudtrain/node/preflight.py) measured, as typed records: parsed
once from its JSON, judged by verdict.py, printed by the command and kept in the ledger."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

VERSION_KEYS = ("driver", "cuda", "nccl", "torch", "python")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: int | None
    driver: str
    ecc_uncorrected: int | None


@dataclass(frozen=True)
class Matmul:
    local_rank: int
    device: str
    dtype: str
    tflops: float | None     # on a GPU
    gflops: float | None     # on the CPU


@dataclass(frozen=True)
class Node:
    rank: int                # the node's rank in the cluster
    host: str
    gpus: tuple[Gpu, ...]
    smi_error: str | None
    versions: Mapping[str, str]
    torch_gpus: int
    matmuls: tuple[Matmul, ...]


@dataclass(frozen=True)
class Size:
    bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


@dataclass(frozen=True)
class Link:
    nodes: tuple[int, int]   # node ranks
    bytes: int
    gbps: float


@dataclass(frozen=True)
class Measured:
    backend: str
    world_size: int
    nodes: tuple[Node, ...]
    sizes: tuple[Size, ...]
    links: tuple[Link, ...]
    via: tuple[str, ...]     # what NCCL's INFO lines say it connected through (P2P, NET/IB ...)
    network: tuple[str, ...]  # NCCL's "Using network ..." (IB, Socket, AWS Libfabric ...)
    sweep_s: float

    @property
    def largest(self) -> Size | None:
        return self.sizes[-1] if self.sizes else None

    def transport(self) -> str:
        """In words: 'gloo/tcp', 'NCCL: NET/IB, P2P', or 'NCCL: none (one rank)'."""
        if self.backend == "gloo":
            return "gloo/tcp" if self.world_size > 1 else "gloo (one rank)"
        seen = list(self.via) + [f"network {n}" for n in self.network]
        return "NCCL: " + (", ".join(seen) if seen else "none reported (one rank?)")

    def socket_fallback(self) -> bool:
        """NCCL moved data between nodes over plain TCP sockets: a channel through
        NET/Socket, or (no NET channel line seen) Socket the only network it set up."""
        if any(v.startswith("NET/Socket") for v in self.via):
            return True
        nets = set(self.network)
        return not any(v.startswith("NET/") for v in self.via) and nets == {"Socket"}


def parse(obj: Mapping[str, Any]) -> Measured:
    """The node program's object (run mode) as records; raises KeyError/TypeError/ValueError
    on a malformed one (the caller says the program's output was not understood)."""
    ranks = list(obj["ranks"])
    node_of = {int(r["rank"]): int(r["node_rank"]) for r in ranks}
    nodes = []
    for r in sorted((r for r in ranks if int(r["local_rank"]) == 0), key=lambda r: r["node_rank"]):
        mine = sorted((x for x in ranks if x["node_rank"] == r["node_rank"]),
                      key=lambda x: int(x["local_rank"]))
        smi = r.get("nvidia_smi") or {}
        v = r.get("versions") or {}
        nodes.append(Node(
            rank=int(r["node_rank"]), host=str(r.get("host", "")),
            gpus=tuple(Gpu(int(g["index"]), str(g["name"]), g.get("memory_mib"),
                           str(g.get("driver", "")), g.get("ecc_uncorrected"))
                       for g in smi.get("gpus", [])),
            smi_error=smi.get("error"),
            versions={k: str(v.get(k, "")) for k in VERSION_KEYS},
            torch_gpus=int(v.get("torch_gpus", 0)),
            matmuls=tuple(Matmul(int(x["local_rank"]), str(x["matmul"]["device"]),
                                 str(x["matmul"]["dtype"]), x["matmul"].get("tflops"),
                                 x["matmul"].get("gflops")) for x in mine)))
    sizes = tuple(Size(int(s["bytes"]), float(s["time_us"]), float(s["algbw_gbps"]),
                       float(s["busbw_gbps"])) for s in obj["allreduce"])
    links = tuple(Link((node_of[int(x["ranks"][0])], node_of[int(x["ranks"][1])]),
                       int(x["bytes"]), float(x["gbps"])) for x in obj.get("links", []))
    t = obj.get("transport") or {}
    return Measured(str(obj["backend"]), int(obj["world_size"]), tuple(nodes), sizes, links,
                    tuple(t.get("via", [])), tuple(t.get("network", [])),
                    float(obj.get("sweep_s", 0.0)))


def size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
