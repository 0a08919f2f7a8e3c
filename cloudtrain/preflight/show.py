"""The preflight's result as the user meets it: the text report, the ``--json`` object and
the compact record the ledger keeps in the launch's row (``launches.preflight``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Mapping

from cloudtrain.preflight import reference
from cloudtrain.preflight.report import Measured, Node, size_text
from cloudtrain.preflight.verdict import Context, Verdict


@dataclass(frozen=True)
class Result:
    """One preflight: what was measured, how it was judged, where its logs are."""

    job_id: str
    measured: Measured
    verdict: Verdict
    ctx: Context
    took_s: float


def _matmul_text(n: Node) -> str:
    parts = []
    for x in n.matmuls:
        if x.tflops is not None:
            parts.append(f"{x.device} {x.tflops:g} TFLOPS {x.dtype}")
        else:
            parts.append(f"{x.device} {x.gflops:g} GFLOPS {x.dtype} (not judged)")
    return "; ".join(parts)


def text_lines(r: Result) -> list[str]:
    m, ctx = r.measured, r.ctx
    out = [f"Preflight of '{ctx.cluster}': {len(m.nodes)} node(s), {m.world_size} rank(s), "
           f"{m.backend}, in {r.took_s:.1f} s (job {r.job_id})"]
    for n in m.nodes:
        gpus = (f"{len(n.gpus)}x {n.gpus[0].name}" if n.gpus else "no GPU")
        v = n.versions
        vers = ", ".join(f"{k} {v[k]}" for k in ("driver", "cuda", "nccl", "torch", "python")
                         if v.get(k))
        out.append(f"  {ctx.node(n.rank)} {n.host}: {gpus}; {vers}")
        out.append(f"    matmul: {_matmul_text(n)}")
    out.append(f"  all-reduce over {m.transport()}:")
    out.append(f"    {'size':>10} {'time (us)':>12} {'algbw GB/s':>12} {'busbw GB/s':>12}")
    for s in m.sizes:
        out.append(f"    {size_text(s.bytes):>10} {s.time_us:12.1f} {s.algbw_gbps:12.3f} "
                   f"{s.busbw_gbps:12.3f}")
    if m.links:
        out.append(f"  node pairs ({size_text(m.links[0].bytes)} back and forth): " + ", ".join(
            f"{a}-{b} {x.gbps:.3g} GB/s" for x in m.links for a, b in [x.nodes]))
    ref = reference.instance(ctx.instance_type)
    if ref is not None:
        out.append(f"  reference for {ref.instance_type}: {ref.fabric} {ref.line_gbit:g} Gb/s "
                   f"({ref.busbw_gbps:g} GB/s) per node, {ref.source}")
    return out


def as_json(r: Result) -> dict[str, Any]:
    m, ctx = r.measured, r.ctx
    ref = reference.instance(ctx.instance_type)
    return {
        "cluster": ctx.cluster, "job_id": r.job_id, "took_s": round(r.took_s, 3),
        "threshold": ctx.threshold, "backend": m.backend, "world_size": m.world_size,
        "instance_type": ctx.instance_type,
        "transport": {"words": m.transport(), "via": list(m.via), "network": list(m.network),
                      "socket_fallback": m.socket_fallback(),
                      "fabric": reference.fabric_of(ctx.provider, ctx.instance_type)},
        "nodes": [{"rank": n.rank, "name": (ctx.names or {}).get(n.rank), "host": n.host,
                   "gpus": [vars(g) for g in n.gpus], "nvidia_smi_error": n.smi_error,
                   "versions": dict(n.versions), "torch_gpus": n.torch_gpus,
                   "matmul": [vars(x) for x in n.matmuls]} for n in m.nodes],
        "allreduce": [vars(s) for s in m.sizes],
        "links": [{"nodes": list(x.nodes), "bytes": x.bytes, "gbps": x.gbps} for x in m.links],
        "reference": None if ref is None else {
            "instance_type": ref.instance_type, "fabric": ref.fabric, "line_gbit": ref.line_gbit,
            "busbw_gbps": ref.busbw_gbps, "source": ref.source},
        "verdict": r.verdict.to_dict(),
    }


def record(r: Result) -> str:
    """What the launch's ledger row keeps (JSON): the verdict and the headline figures."""
    big = r.measured.largest
    return json.dumps({
        "ok": r.verdict.ok, "at": time.time(), "preflight_job": r.job_id,
        "paragraph": r.verdict.paragraph, "transport": r.measured.transport(),
        "busbw_gbps": None if big is None else big.busbw_gbps,
        "bytes": None if big is None else big.bytes,
        "nodes": [p.node for p in r.verdict.problems if p.node is not None]})


def read_record(text: str | None) -> Mapping[str, Any] | None:
    if not text:
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
