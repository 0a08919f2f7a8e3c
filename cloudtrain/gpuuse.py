"""GPU use on the nodes: the one ``nvidia-smi`` query that ``status --refresh`` and ``top``
run on every node (in the round trip they already make), and its output parsed into typed
per-GPU and per-node records, with idle GPUs flagged during a running job.

A node's output is untrusted input: it is cut at :data:`MAX_BYTES` on the node and again
here, each line is parsed on its own, and a line that does not parse is counted and dropped;
nothing a node prints can make the caller fail. Stdlib only (``status`` stays fast).
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

FIELDS = ("index", "name", "utilization.gpu", "memory.used", "memory.total", "temperature.gpu",
          "power.draw", "power.limit")
QUERY = f"nvidia-smi --query-gpu={','.join(FIELDS)} --format=csv,noheader,nounits"
MAX_BYTES = 64 * 1024        # what is read of a node's answer (8 GPUs take about 1 KB)
MAX_GPUS = 64                # GPUs kept per node; more lines are counted as dropped
QUERY_TIMEOUT_S = 10         # nvidia-smi that hangs (a wedged driver) is cut off after this
BEGIN, END = "::ctgpu begin", "::ctgpu end"

# The idle rule: during a running job, a GPU is idle when its utilisation is at most
# IDLE_UTIL_PCT and it holds at most IDLE_MEM_MIB of memory (nothing is loaded on it).
IDLE_UTIL_PCT = 1.0
IDLE_MEM_MIB = 1024.0
IDLE_RULE = (f"idle: utilisation <= {IDLE_UTIL_PCT:g} % and memory used <= {IDLE_MEM_MIB:g} MiB "
             "while a job runs")


@dataclass
class GPU:
    """One GPU (or MIG device) as nvidia-smi reported it; None where it gave no number."""

    index: str
    name: str
    util_pct: float | None = None
    mem_used_mib: float | None = None
    mem_total_mib: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    idle: bool = False


@dataclass
class NodeGPUs:
    """What one node said: ``state`` "ok" (GPUs listed), "no-gpu" (no nvidia-smi, or it found
    no GPU), or "error" (it failed, timed out or printed nothing usable: ``detail`` says)."""

    rank: int
    state: str
    gpus: list[GPU] = field(default_factory=list)
    detail: str = ""
    dropped_lines: int = 0
    job_running: bool = False

    @property
    def models(self) -> str:
        names: dict[str, int] = {}
        for g in self.gpus:
            names[g.name] = names.get(g.name, 0) + 1
        return ", ".join(f"{n}x {m}" if n > 1 else m for m, n in names.items())

    def mean_util(self) -> float | None:
        vals = [g.util_pct for g in self.gpus if g.util_pct is not None]
        return sum(vals) / len(vals) if vals else None

    def max_util(self) -> float | None:
        vals = [g.util_pct for g in self.gpus if g.util_pct is not None]
        return max(vals) if vals else None

    def total(self, attr: str) -> float | None:
        vals = [getattr(g, attr) for g in self.gpus if getattr(g, attr) is not None]
        return sum(vals) if vals else None

    def max_temp(self) -> float | None:
        vals = [g.temp_c for g in self.gpus if g.temp_c is not None]
        return max(vals) if vals else None

    @property
    def idle(self) -> list[str]:
        return [g.index for g in self.gpus if g.idle]

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "state": self.state, "detail": self.detail,
                "count": len(self.gpus), "models": self.models, "job_running": self.job_running,
                "util_mean_pct": _round(self.mean_util()), "util_max_pct": self.max_util(),
                "mem_used_mib": self.total("mem_used_mib"),
                "mem_total_mib": self.total("mem_total_mib"),
                "temp_max_c": self.max_temp(), "power_w": _round(self.total("power_w")),
                "idle_gpus": self.idle, "idle_rule": IDLE_RULE,
                "dropped_lines": self.dropped_lines,
                "gpus": [asdict(g) for g in self.gpus]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeGPUs:
        """Back from :meth:`as_json` (the copy ``status`` keeps of the last query)."""
        known = set(GPU.__dataclass_fields__)
        return cls(rank=int(data.get("rank", 0)), state=str(data.get("state", "error")),
                   gpus=[GPU(**{k: v for k, v in g.items() if k in known})
                         for g in data.get("gpus") or [] if isinstance(g, dict)],
                   detail=str(data.get("detail") or ""),
                   dropped_lines=int(data.get("dropped_lines") or 0),
                   job_running=bool(data.get("job_running")))


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def remote_script(bin_dir: str | None = None, timeout_s: float = QUERY_TIMEOUT_S) -> str:
    """The shell text a node runs (under bash): the query between two marker lines, its output
    capped at MAX_BYTES, cut off after QUERY_TIMEOUT_S, and its exit code on the end line
    (127: no nvidia-smi). ``bin_dir`` (the node's Python environment) goes first on PATH, as
    for jobs; /usr/local/nvidia/bin (containers) last."""
    path = (f"PATH={shlex.quote(bin_dir)}:\"$PATH\":/usr/local/nvidia/bin" if bin_dir
            else "PATH=\"$PATH\":/usr/local/nvidia/bin")
    lim = f"timeout -k 2 {timeout_s:g}"
    return (f"{path}; echo '{BEGIN}'; "
            f"if command -v nvidia-smi >/dev/null 2>&1; then "
            f"{{ command -v timeout >/dev/null 2>&1 && T='{lim}' || T=''; "
            f"$T {QUERY} 2>&1; echo \"rc=$?\" >&2; }} 2>&1 | head -c {MAX_BYTES}; "
            f"else echo 'rc=127'; fi; echo; echo '{END}'")


def split_output(stdout: str) -> tuple[str, str | None]:
    """(what came before the GPU block, the GPU block or None when the node sent none)."""
    at = stdout.find(BEGIN)
    if at < 0:
        return stdout, None
    block = stdout[at + len(BEGIN):]
    end = block.rfind(END)
    return stdout[:at], block[:end] if end >= 0 else block


def _num(raw: str) -> float | None:
    s = raw.strip()
    if not s or s.startswith("[") or s.upper() in ("N/A", "NOT SUPPORTED"):
        return None
    try:
        v = float(s)
    except ValueError:
        return None
    return v if v == v and abs(v) != float("inf") and v >= 0 else None


def _text(raw: str, limit: int = 64) -> str:
    s = "".join(c for c in raw.strip() if c.isprintable())
    return s[:limit]


def parse(block: str | None, rank: int = 0, job_running: bool = False) -> NodeGPUs:
    """The GPU block of one node's answer (see :func:`remote_script`) as a record."""
    if block is None:
        return NodeGPUs(rank, "error", detail="the node sent no GPU answer", job_running=job_running)
    block = block[:MAX_BYTES + 64]
    rc: int | None = None
    gpus: list[GPU] = []
    bad = 0
    others: list[str] = []
    for line in block.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("rc=") and line[3:].isdigit():
            rc = int(line[3:])
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == len(FIELDS) - 1 and not parts[0].isdigit():
            parts = ["?"] + parts
        if len(parts) != len(FIELDS) or not _index_ok(parts[0]) or len(gpus) >= MAX_GPUS:
            bad += 1
            if len(others) < 3:
                others.append(_text(line, 120))
            continue
        idx, name, util, used, total, temp, power, limit = parts
        gpus.append(GPU(index=_text(idx, 16), name=_text(name) or "unknown GPU",
                        util_pct=_cap(_num(util), 100.0), mem_used_mib=_num(used),
                        mem_total_mib=_num(total), temp_c=_num(temp), power_w=_num(power),
                        power_limit_w=_num(limit)))
    out = NodeGPUs(rank, "ok", gpus, dropped_lines=bad, job_running=job_running)
    if rc == 127:
        out.state, out.detail = "no-gpu", "no nvidia-smi on this node"
    elif rc in (124, 137):
        out.state, out.detail = "error", "nvidia-smi did not answer in time (cut off)"
    elif not gpus:
        text = " | ".join(others)
        if "no devices were found" in text.lower() or (rc == 0 and not others) or rc == 6:
            out.state, out.detail = "no-gpu", "nvidia-smi found no GPU"
        else:
            out.state = "error"
            out.detail = (f"nvidia-smi failed (exit {rc})" if rc else
                          "nvidia-smi printed nothing usable") + (f": {text[:200]}" if text else "")
    if job_running:
        for g in out.gpus:
            g.idle = is_idle(g)
    return out


def _index_ok(s: str) -> bool:
    # "0".."7", or MIG devices some tools list as "0:1"; "?" when a row had no index
    return s == "?" or all(p.isdigit() for p in s.split(":")) and 0 < len(s) <= 16


def _cap(v: float | None, top: float) -> float | None:
    return None if v is None else min(v, top)


def is_idle(g: GPU) -> bool:
    """The idle rule (:data:`IDLE_RULE`); a GPU with no utilisation figure is never idle."""
    if g.util_pct is None:
        return False
    return g.util_pct <= IDLE_UTIL_PCT and (g.mem_used_mib is None or g.mem_used_mib <= IDLE_MEM_MIB)


def node_line(n: NodeGPUs) -> str:
    """One node in words: count, model, utilisation mean/max, memory, temperature, power."""
    if n.state == "no-gpu":
        return f"node {n.rank}: no GPU" + (f" ({n.detail})" if n.detail else "")
    if n.state == "error":
        return f"node {n.rank}: GPU query failed ({n.detail})"
    parts = [f"node {n.rank}: {len(n.gpus)} GPU{'s' if len(n.gpus) != 1 else ''} ({n.models})"]
    mean, top = n.mean_util(), n.max_util()
    parts.append("util -" if mean is None else f"util {mean:.0f}% mean / {top:.0f}% max")
    used, total = n.total("mem_used_mib"), n.total("mem_total_mib")
    if total:
        parts.append(f"mem {_gib(used)}/{_gib(total)} GiB")
    temp = n.max_temp()
    if temp is not None:
        parts.append(f"temp {temp:.0f} C max")
    power, limit = n.total("power_w"), n.total("power_limit_w")
    if power is not None:
        parts.append(f"power {power:.0f} W" + (f" of {limit:.0f} W" if limit else ""))
    else:
        parts.append("power n/a")
    text = ", ".join(parts)
    if n.idle:
        text += f"; IDLE during the job: GPU {', '.join(n.idle)} ({IDLE_RULE})"
    if n.dropped_lines:
        text += f"; {n.dropped_lines} unreadable line(s) dropped"
    return text


def _gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"
