"""The preflight's judgement of GPU-node figures that the CPU test nodes cannot produce
(matmul TFLOPS per GPU, NCCL's transport, ECC errors, a fabric instance type): the node
program's own object is built as it writes it, then parsed and judged as the CLI does; and
the node program's reading of NCCL_DEBUG=INFO files, written in NCCL's line format."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from cloudtrain.preflight import reference
from cloudtrain.preflight.report import parse
from cloudtrain.preflight.verdict import Context, judge

NODE = Path(__file__).resolve().parents[2] / "cloudtrain" / "node" / "preflight.py"


def _program() -> Any:
    spec = importlib.util.spec_from_file_location("ct_node_preflight", NODE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ct_node_preflight"] = mod
    spec.loader.exec_module(mod)
    return mod


def _obj(nodes: int = 2, gpus: int = 8, tflops: dict[tuple[int, int], float] | None = None,
         via: list[str] | None = None, network: list[str] | None = None,
         busbw: float = 150.0, ecc: dict[tuple[int, int], int] | None = None) -> dict[str, Any]:
    """What node 0 of ``nodes`` H100 nodes prints, every GPU at 700 TFLOPS unless told."""
    ranks = []
    for n in range(nodes):
        for g in range(gpus):
            r: dict[str, Any] = {
                "rank": n * gpus + g, "local_rank": g, "node_rank": n, "node": "",
                "matmul": {"device": f"cuda:{g}", "dtype": "bfloat16", "n": 8192,
                           "tflops": (tflops or {}).get((n, g), 700.0)}}
            if g == 0:
                r["host"] = f"h{n}"
                r["nvidia_smi"] = {"error": None, "gpus": [
                    {"index": i, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                     "driver": "550.54.15", "ecc_uncorrected": (ecc or {}).get((n, i), 0)}
                    for i in range(gpus)]}
                r["versions"] = {"python": "3.11.7", "torch": "2.5.1", "cuda": "12.4",
                                 "nccl": "2.21.5", "driver": "550.54.15", "torch_gpus": gpus}
            ranks.append(r)
    world = nodes * gpus
    return {"backend": "nccl", "world_size": world, "ranks": ranks, "sweep_s": 2.0,
            "allreduce": [{"bytes": 1 << 30, "time_us": 1e4,
                           "algbw_gbps": busbw * world / (2 * (world - 1)),
                           "busbw_gbps": busbw}],
            "links": [], "transport": {"via": via or ["NET/OFI", "P2P/CUMEM"],
                                       "network": network or ["AWS Libfabric"]}}


def _judge(obj: dict[str, Any], instance_type: str | None = "p5.48xlarge",
           provider: str = "aws") -> list[tuple[str, int | None]]:
    v = judge(parse(obj), Context("c", provider, instance_type))
    assert v.ok == (not v.problems)
    return [(p.kind, p.node) for p in v.problems]


def test_a_healthy_p5_pair_passes() -> None:
    assert _judge(_obj(busbw=300.0)) == []


def test_a_slow_gpu_is_named_against_the_median_and_the_datasheet() -> None:
    obj = _obj(tflops={(1, 3): 420.0}, busbw=300.0)
    v = judge(parse(obj), Context("c", "aws", "p5.48xlarge"))
    assert [(p.kind, p.node) for p in v.problems] == [("slow-gpu", 1)]
    text = v.problems[0].text
    assert "node 1 GPU 3 (NVIDIA H100 80GB HBM3) reaches 420 TFLOPS bfloat16" in text
    assert "60% of the median GPU (700)" in text
    assert "42% of the H100 SXM's 989 TFLOPS dense peak" in text
    assert "node 1 GPU 3" in v.paragraph


def test_a_gpu_at_the_share_of_its_peak_a_healthy_one_reaches_passes() -> None:
    # As measured on a lent H200 (bench/gpu_preflight.sh, 2026-11-26): 695 of its 989 peak.
    tflops = {(n, g): 695.0 for n in range(2) for g in range(8)}
    assert _judge(_obj(tflops=tflops, busbw=300.0)) == []


def test_every_gpu_slow_is_caught_by_the_reference_alone() -> None:
    tflops = {(n, g): 400.0 for n in range(2) for g in range(8)}
    kinds = _judge(_obj(tflops=tflops, busbw=300.0))
    assert kinds == [("slow-gpu", 0)] * 8 + [("slow-gpu", 1)] * 8


def test_nccl_on_sockets_on_a_fabric_type_fails_and_not_on_a_plain_one() -> None:
    obj = _obj(via=["NET/Socket", "P2P/CUMEM"], network=["Socket"], busbw=300.0)
    assert _judge(obj) == [("socket-fallback", None)]
    assert _judge(obj, "g5.12xlarge") == []
    v = judge(parse(obj), Context("c", "aws", "p5.48xlarge"))
    assert "NCCL fell back to plain TCP sockets" in v.paragraph and "efa" in v.paragraph


def test_a_bus_bandwidth_below_the_line_rate_share_fails() -> None:
    ref = reference.instance("p4d.24xlarge")
    assert ref is not None and ref.busbw_gbps == 50.0
    assert _judge(_obj(busbw=30.0), "p4d.24xlarge") == [("slow-allreduce", None)]
    assert _judge(_obj(busbw=40.0), "p4d.24xlarge") == []


def test_ecc_errors_and_a_torch_that_sees_fewer_gpus_are_named() -> None:
    obj = _obj(ecc={(1, 5): 2}, busbw=300.0)
    obj["ranks"][0]["versions"]["torch_gpus"] = 6
    assert sorted(_judge(obj), key=str) == [("ecc", 1), ("torch-gpus", 0)]


def test_a_driver_that_differs_on_one_of_three_nodes_is_named() -> None:
    obj = _obj(nodes=3, busbw=300.0)
    obj["ranks"][16]["versions"]["driver"] = "535.161.08"
    v = judge(parse(obj), Context("c", "aws", "p5.48xlarge"))
    assert [(p.kind, p.node) for p in v.problems] == [("mismatch", 2)]
    assert "node 2 has NVIDIA driver 535.161.08, the other nodes 550.54.15" in v.paragraph


def test_the_transport_is_read_from_nccl_debug_files(tmp_path: Path) -> None:
    prog = _program()
    ib = tmp_path / "nccl.h0.1.log"
    ib.write_text(
        "h0:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.1<0>\n"
        "h0:1:1 [0] NCCL INFO Using network IB\n"
        "h0:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
        "h0:1:9 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA\n")
    sock = tmp_path / "nccl.h1.2.log"
    sock.write_text(
        "h1:2:2 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>\n"
        "h1:2:2 [0] NCCL INFO Using network Socket\n"
        "h1:2:9 [0] NCCL INFO Channel 01/0 : 0[0] -> 8[0] [send] via NET/Socket/0\n")
    got = prog.transports([str(ib)])
    assert got == {"via": ["NET/IB", "P2P/CUMEM"], "network": ["IB"]}
    m = parse(_obj(via=got["via"], network=got["network"], busbw=300.0))
    assert not m.socket_fallback() and m.transport() == "NCCL: NET/IB, P2P/CUMEM, network IB"
    got = prog.transports([str(sock)])
    assert got == {"via": ["NET/Socket"], "network": ["Socket"]}
    assert parse(_obj(via=got["via"], network=got["network"])).socket_fallback()


def test_node_pairs_name_the_node_in_two_slow_pairs() -> None:
    prog = _program()
    assert prog.pairs_of([0, 8, 16, 24]) == [(0, 8), (8, 16), (16, 24), (24, 0)]
    assert prog.pairs_of([0, 8]) == [(0, 8)] and prog.pairs_of([0]) == []
    obj = _obj(nodes=4, busbw=300.0)
    figs = {(0, 8): 20.0, (8, 16): 2.0, (16, 24): 2.5, (24, 0): 22.0}
    obj["links"] = [{"ranks": list(p), "bytes": 1 << 20, "gbps": g} for p, g in figs.items()]
    v = judge(parse(obj), Context("c", "aws", "p5.48xlarge"))
    assert [(p.kind, p.node) for p in v.problems] == [("slow-node", 2)]
