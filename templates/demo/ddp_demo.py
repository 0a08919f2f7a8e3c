"""A small multi-node DDP job: every rank checks an all-reduce, then trains a tiny model on
synthetic data for a few steps. Rank 0 writes a summary to outputs/ (pulled back by cloudtrain).

Exits with the code in FAIL_EXIT_CODE on the global rank FAIL_RANK (to test failure handling),
and sleeps SLEEP_SECONDS before training (to test Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="outputs")
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)

    # Every rank takes part: the sum of all ranks must come back to each of them.
    t = torch.tensor([float(rank)], device=device)
    dist.all_reduce(t)
    expected = world * (world - 1) / 2
    if t.item() != expected:
        print(f"rank {rank}: all-reduce gave {t.item()}, expected {expected}", flush=True)
        return 3
    print(f"rank {rank}/{world} on {socket.gethostname()} node "
          f"{os.environ.get('CLOUDTRAIN_NODE_RANK')}: all-reduce ok ({t.item():.0f})", flush=True)

    if os.environ.get("FAIL_RANK") not in (None, "") and int(os.environ["FAIL_RANK"]) == rank:
        time.sleep(float(os.environ.get("FAIL_AFTER", "0.5")))
        print(f"rank {rank}: failing on purpose", flush=True)
        sys.exit(int(os.environ.get("FAIL_EXIT_CODE", "7")))
    time.sleep(float(os.environ.get("SLEEP_SECONDS", "0")))

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.arange(16, dtype=torch.float32) / 16
    first = last = 0.0
    for step in range(args.steps):
        x = torch.randn(64, 16, generator=g).to(device)
        y = (x @ w_true.to(device)).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0:
            first = loss.item()
        last = loss.item()
    # Replicas must agree after DDP's gradient all-reduce.
    w = model.module.weight.detach().clone()
    ref = w.clone()
    dist.broadcast(ref, 0)
    in_sync = bool(torch.allclose(w, ref))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"world_size": world, "allreduce_sum": t.item(), "first_loss": first,
                       "last_loss": last, "replicas_in_sync": in_sync,
                       "num_nodes": int(os.environ.get("CLOUDTRAIN_NUM_NODES", "1"))}, f)
        print(f"loss {first:.4f} -> {last:.4f}; replicas in sync: {in_sync}", flush=True)
    dist.destroy_process_group()
    return 0 if in_sync else 4


if __name__ == "__main__":
    sys.exit(main())
