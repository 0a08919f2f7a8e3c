"""The preflight's node side (Python standard library and torch only): measures one cluster
before a paid run. Shipped to the nodes and started like a job, so it needs none of
cloudtrain's own dependencies; ``python3 preflight.py ...`` works wherever torch imports.

    python3 preflight.py node [--out FILE]
        this machine alone: its GPUs (nvidia-smi), versions and a short matmul per GPU
        (bf16 TFLOPS; fp32 GFLOPS on the CPU when there is no GPU)

    torchrun ... preflight.py run --out FILE [--max-size BYTES] [--iters N]
        under torchrun (the launch chain's own torchrun line and rendezvous): every rank
        does its device's matmul, the first rank of each node its node's checks, then all
        ranks an all-reduce sweep (NCCL on GPUs, gloo on CPUs) over sizes doubling from
        64 KiB to --max-size, and a ping-pong between the first ranks of neighbouring
        nodes. Global rank 0 writes one JSON object to FILE and prints it on one line
        after the marker ``CT-PREFLIGHT``.

Figures, as nccl-tests' PERFORMANCE.md defines them: algbw = bytes / time; for an
all-reduce busbw = algbw * 2(n-1)/n, n the number of ranks. The time of a size is the
slowest rank's mean over the timed iterations (after warm-up iterations).

Why a link check besides the all-reduce: a ring all-reduce runs at the speed of its slowest
link, so its time says that something is slow but not what. The first ranks of neighbouring
nodes (0-1, 1-2, ..., n-1 - 0) exchange a buffer back and forth, one pair at a time, so each
pair has the wire to itself: a slow node is the one in two slow pairs (any node, rank 0's
too, which a star of pairs from rank 0 could not single out), and a round trip shows a link
slowed in either direction.

The transport: NCCL is started with NCCL_DEBUG=INFO written to a file per process
(NCCL_DEBUG_FILE), whose "via ..." and "Using network ..." lines say what it chose
(P2P, SHM, NVLS, NET/IB, NET/Socket, NET/OFI ...); on gloo the transport is gloo/tcp.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time

if not __package__:
    # Run as a script, its folder comes first on sys.path; in the repository that folder holds
    # the node's queue.py, which would shadow the standard library's queue that torch imports.
    # This program needs nothing beside it.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

MARKER = "CT-PREFLIGHT"
SMI_QUERY = "index,name,memory.total,driver_version,ecc.errors.uncorrected.volatile.total"
MIN_SIZE = 64 * 1024
DEFAULT_MAX_GPU = 1 << 30      # 1 GiB with NCCL
DEFAULT_MAX_CPU = 64 << 20     # 64 MiB with gloo: the CPU copies cost seconds beyond that
LINK_SIZE = 1 << 20            # the node pairs' buffer
LINK_ROUNDS = 10               # at least this many round trips per pair (the best counts)


def nvidia_smi() -> dict:
    """The GPUs nvidia-smi lists: {"gpus": [...], "error": str|None}; no nvidia-smi: no GPUs."""
    try:
        p = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_QUERY}",
                            "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return {"gpus": [], "error": None}
    except subprocess.TimeoutExpired:
        return {"gpus": [], "error": "nvidia-smi did not answer in 30 s"}
    if p.returncode == 127:
        return {"gpus": [], "error": None}
    if p.returncode != 0:
        text = (p.stdout + p.stderr).strip().splitlines()
        if text and "No devices were found" in text[0]:
            return {"gpus": [], "error": None}
        return {"gpus": [], "error": f"nvidia-smi exited {p.returncode}: {' '.join(text)[:200]}"}
    gpus = []
    for line in p.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 5 or not parts[0].isdigit():
            continue
        gpus.append({"index": int(parts[0]), "name": parts[1],
                     "memory_mib": _num(parts[2]), "driver": parts[3],
                     "ecc_uncorrected": _num(parts[4])})
    return {"gpus": gpus, "error": None}


def _num(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None      # [N/A]: no ECC on this GPU, or the driver has no value


def versions(smi: dict) -> dict:
    import torch
    cuda_ok = torch.cuda.is_available()
    nccl = ""
    if cuda_ok:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except (AttributeError, RuntimeError):   # a build without NCCL
            nccl = ""
    drivers = sorted({g["driver"] for g in smi["gpus"]})
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda or "", "nccl": nccl,
            "driver": ",".join(drivers), "torch_gpus": torch.cuda.device_count() if cuda_ok else 0}


def matmul(device: str, seconds: float = 0.5) -> dict:
    """A short dense matmul on one device: bf16 TFLOPS on a GPU, fp32 GFLOPS on the CPU."""
    import torch
    gpu = device.startswith("cuda")
    n = 8192 if gpu else 512
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu and not torch.cuda.is_bf16_supported():
        dtype = torch.float16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    warm = time.perf_counter()     # a quarter second first: library set-up, clocks up
    while True:
        for _ in range(3):
            a @ b
        sync()
        if time.perf_counter() - warm >= seconds / 2:
            break
    iters, t0 = 0, time.perf_counter()
    while True:
        for _ in range(5):
            a @ b
        iters += 5
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    flops = 2 * n ** 3 * iters / elapsed
    dname = str(dtype).replace("torch.", "")
    if gpu:
        return {"device": device, "dtype": dname, "n": n, "tflops": round(flops / 1e12, 2)}
    return {"device": "cpu", "dtype": dname, "n": n, "gflops": round(flops / 1e9, 2),
            "threads": torch.get_num_threads()}


def node_checks() -> dict:
    smi = nvidia_smi()
    return {"host": socket.gethostname(), "nvidia_smi": smi, "versions": versions(smi)}


def cmd_node(args: argparse.Namespace) -> int:
    import torch
    info = node_checks()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info["matmul"] = [matmul(f"cuda:{i}") for i in range(n)] if n else [matmul("cpu")]
    emit(info, args.out)
    return 0


def emit(obj: dict, out: str | None) -> None:
    text = json.dumps(obj, sort_keys=True)
    if out:
        tmp = f"{out}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, out)
    print(f"{MARKER} {text}", flush=True)


# ---------------------------------------------------------------------------------------------
# Under torchrun


def transports(paths: list[str]) -> dict:
    """What NCCL chose, from its NCCL_DEBUG=INFO lines."""
    via, networks = set(), set()
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    m = re.search(r"\bvia (\S+)", line)
                    if m:
                        via.add("/".join(m.group(1).split("/")[:2]))
                    m = re.search(r"Using network (.+?)\s*$", line) or \
                        re.search(r"\bNET/(\w+) ?: Using", line)
                    if m:
                        networks.add(m.group(1))
                    m = re.search(r"NET/OFI Selected [Pp]rovider is (\S+)", line)
                    if m:
                        networks.add("OFI/" + m.group(1))
                    if re.search(r"NVLS comm|Connected NVLS", line):
                        via.add("NVLS")
        except OSError:
            continue
    return {"via": sorted(via), "network": sorted(networks)}


def sweep(dist, torch, device: str, max_size: int, iters: int) -> list[dict]:
    world = dist.get_world_size()
    sizes, s = [], MIN_SIZE
    while s <= max_size:
        sizes.append(s)
        s *= 2
    if not sizes or sizes[-1] != max_size:
        sizes.append(max_size)
    rows = []
    for size in sizes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        n = iters if size < (64 << 20) else max(3, iters // 2)
        for _ in range(2):
            dist.all_reduce(x)
        _sync(torch, device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        _sync(torch, device)
        took = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        t = float(took.item())
        algbw = size / t / 1e9
        rows.append({"bytes": size, "time_us": round(t * 1e6, 1), "algbw_gbps": round(algbw, 3),
                     "busbw_gbps": round(algbw * 2 * (world - 1) / world, 3) if world > 1 else 0.0})
        del x
    return rows


def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def pairs_of(leaders: list[int]) -> list[tuple[int, int]]:
    """The node pairs the link check measures: each node with the next one, in a ring (two
    nodes: one pair). A slow node is in two slow pairs; the others are not."""
    n = len(leaders)
    if n < 2:
        return []
    if n == 2:
        return [(leaders[0], leaders[1])]
    return [(leaders[i], leaders[(i + 1) % n]) for i in range(n)]


def links(dist, torch, device: str, leaders: list[int], size: int, rounds: int) -> list[dict]:
    """Each pair of node-first ranks exchanges ``size`` bytes back and forth, one pair at a
    time (nothing else on the wire), in ``rounds`` rounds over all the pairs (a busy moment
    on a host then touches every pair, not one pair's whole series): a pair's best round
    trip gives 2*size/time, in GB/s."""
    rank = dist.get_rank()
    x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
    pairs = pairs_of(leaders)
    best = torch.full((max(1, len(pairs)),), float("inf"), dtype=torch.float64, device=device)
    for i in range(rounds + 1):
        for k, (a, b) in enumerate(pairs):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == a:
                dist.send(x, b)
                dist.recv(x, b)
            elif rank == b:
                dist.recv(x, a)
                dist.send(x, a)
            _sync(torch, device)
            if i and rank == a:   # round 0 is a warm-up (connection set-up)
                best[k] = min(float(best[k]), time.perf_counter() - t0)
    best[torch.isinf(best)] = 0.0
    dist.all_reduce(best)     # each pair's figure comes from its first rank; the rest add 0
    return [{"ranks": [a, b], "bytes": size, "time_us": round(float(best[k]) * 1e6, 1),
             "gbps": round(2 * size / float(best[k]) / 1e9, 4)} for k, (a, b) in enumerate(pairs)]


def cmd_run(args: argparse.Namespace) -> int:
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if "RANK" not in os.environ:      # started alone: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    import torch
    import torch.distributed as dist
    gpu = torch.cuda.is_available() and torch.cuda.device_count() > local
    if gpu:
        os.environ["NCCL_DEBUG"] = "INFO"
        if "NCCL_DEBUG_FILE" not in os.environ:
            os.environ["NCCL_DEBUG_FILE"] = os.path.join(
                tempfile.mkdtemp(prefix="ct-preflight-nccl-"), "nccl.%h.%p.log")
        torch.cuda.set_device(local)
    device = f"cuda:{local}" if gpu else "cpu"
    dist.init_process_group("nccl" if gpu else "gloo")
    world = dist.get_world_size()
    mine = {"rank": rank, "local_rank": local,
            "node_rank": int(os.environ.get("CLOUDTRAIN_NODE_RANK",
                                            os.environ.get("GROUP_RANK", "0"))),
            "node": os.environ.get("CT_PREFLIGHT_NODE", ""), "matmul": matmul(device)}
    if local == 0:
        mine.update(node_checks())
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    max_size = args.max_size or (DEFAULT_MAX_GPU if gpu else DEFAULT_MAX_CPU)
    t0 = time.perf_counter()
    rows = sweep(dist, torch, device, max_size, args.iters)
    sweep_s = time.perf_counter() - t0
    leaders = sorted({r["node_rank"]: r["rank"] for r in everyone if r["local_rank"] == 0}.values())
    link_rows = links(dist, torch, device, leaders, LINK_SIZE, max(LINK_ROUNDS, args.iters))
    seen = transports(_debug_files()) if gpu else \
        {"via": ["gloo/tcp"] if world > 1 else [], "network": []}
    seen_all: list = [None] * world
    dist.all_gather_object(seen_all, seen)
    dist.barrier()
    if rank == 0:
        via = sorted({v for s in seen_all for v in s["via"]})
        nets = sorted({v for s in seen_all for v in s["network"]})
        emit({"backend": dist.get_backend(), "world_size": world, "ranks": everyone,
              "allreduce": rows, "sweep_s": round(sweep_s, 3), "links": link_rows,
              "transport": {"via": via, "network": nets}}, args.out)
    dist.destroy_process_group()
    return 0


def _debug_files() -> list[str]:
    """This process's NCCL_DEBUG_FILE (its %h and %p filled in by NCCL)."""
    pattern = os.environ.get("NCCL_DEBUG_FILE", "")
    mine = pattern.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    return [mine] if os.path.exists(mine) else glob.glob(re.sub(r"%[hp]", "*", pattern))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B?|B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 64MiB, 65536)")
    mult = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[(m.group(2) or "")[:1].upper()]
    value = int(m.group(1)) * mult
    if value < 4:
        raise argparse.ArgumentTypeError(f"--max-size must be at least 4 bytes, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="preflight.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node", help="this machine's checks only")
    n.add_argument("--out", default=None)
    r = sub.add_parser("run", help="under torchrun: checks, all-reduce sweep, links")
    r.add_argument("--out", default=None)
    r.add_argument("--max-size", type=_size, default=None)
    r.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    return cmd_node(args) if args.cmd == "node" else cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
