#!/usr/bin/env python3
"""Distributed (DDP) training template for cloudtrain.

Start from this file and swap the dataset and model for your own. The same script runs

    python train.py                                   # one process, no process group (CPU or 1 GPU)
    torchrun --nproc-per-node 8 train.py              # one machine, 8 GPUs
    torchrun --nnodes 4 --nproc-per-node 8 ... train.py   # several machines (cloudtrain starts this)

What it takes care of, so your own code does not have to:

* process group (NCCL on GPUs, gloo on CPU), device placement, mixed precision (bf16/fp16);
* a DistributedSampler whose position inside the epoch goes into every checkpoint, so a resumed
  run sees exactly the batches the interrupted one would have seen (skipped, not loaded);
* gradient accumulation without redundant all-reduces, gradient clipping, warm-up + cosine LR;
* atomic checkpoints written on every node (rented machines rarely share a disk) and automatic
  resume from the newest one, wherever it is;
* SIGTERM (a spot/preemption notice, or torchrun passing one on): every rank stops at the same
  step, saves a checkpoint and exits with code 143, so the job can be started again and resume;
* evaluation with early stopping, TensorBoard, metrics.jsonl and a result.json summary.

Files under --out (only the first process of each node writes checkpoints; only global rank 0
writes the rest):

    metrics.jsonl          one JSON object a line: {"step","loss","lr","samples_per_sec"} and
                           {"step","val_loss"}; the same lines are appended to
                           $CLOUDTRAIN_METRICS_FILE when it is set (a trial of a
                           ``cloudtrain sweep``: the sweep optimises e.g. val_loss)
    result.json            summary of the run: steps, stop reason, losses, throughput, setup
                           (written at the end of ``Trainer._run``, also after SIGTERM)
    tb/                    TensorBoard event files (if tensorboard is installed)
    checkpoints/step-000050.pt ...   the newest --keep-ckpts step checkpoints
    checkpoints/latest     the file name of the newest step checkpoint
    checkpoints/best.pt    the state with the lowest validation loss so far (never pruned)

The checkpoints go to $CLOUDTRAIN_CHECKPOINT_DIR instead when it is set: cloudtrain sets it when
the task has ``checkpoints: s3://...`` (or gs://, Azure Blob), restores the newest complete
checkpoint there before the job starts and uploads new ones while it runs.

A trial of a sweep ($CLOUDTRAIN_SWEEP and $CLOUDTRAIN_TRIAL set) keeps its checkpoints in
sweep-NAME/trial-N under $CLOUDTRAIN_CHECKPOINT_DIR, so that trials neither share nor resume
each other's. cloudtrain runs each trial in its own copy of the workdir ($CLOUDTRAIN_TRIAL_DIR
set), so --out is the trial's own; run by another tool in a shared folder, a trial writes under
--out/sweep-NAME/trial-N instead.

Exit codes: 0 finished (or stopped early), 2 bad arguments or data, 143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

log = logging.getLogger("train")

EXIT_USAGE = 2
EXIT_SIGTERM = 128 + signal.SIGTERM  # 143, what a shell reports for a process ended by SIGTERM
STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
TIMING_WARMUP_STEPS = 3  # the first steps of a run (allocation, caching, compile) skew throughput
SYNTHETIC_SEED = 1234  # the synthetic data set does not depend on --seed: losses stay comparable

# A small corpus for --dataset tiny-text, so the language-model path works without any download.
TINY_TEXT = """\
The night shift at the training cluster begins when the prices drop. Somebody in a distant
office clicks a button, and eight machines wake up in a data centre none of us will ever see.
They do not know each other yet. Each one boots, mounts an empty disk, pulls the code, and
waits for the others to say hello. When the last one answers, the work can start.

The work is simple to describe and slow to finish. A model reads a batch of examples, guesses
what comes next, measures how wrong it was, and nudges every weight a little in the direction
that would have made it less wrong. Then it does it again. And again. After a few thousand
rounds the guesses stop being random. After a few hundred thousand they start to look clever.

Because the machines are rented by the hour, and because the cheap ones can be taken back at
any moment, the model keeps a diary. Every so often it writes down everything it knows: the
weights, the state of the optimizer, the position in the data, even the dice it was about to
roll. If the landlord knocks on the door, it has a few seconds to finish the sentence it was
writing, close the diary, and leave. The next machine that picks up the job opens the diary on
the last page and carries on as if nothing had happened.

A good diary is written carefully. First the page is filled in a scratch copy. Only when every
word is on the disk does the scratch copy get its real name, in one quick move, so that nobody
ever reads half a page. Old pages are thrown away, except the best one, which is kept in a
drawer of its own.

Now and then the model sits a small exam on examples it has never trained on. If the marks
improve, it celebrates quietly and files the paper in the drawer. If they stop improving for
too long, there is no point in paying for more hours, and the job ends early. That is not a
failure. It is the cheapest kind of success.

In the morning the machines are returned, the disks are wiped, and the only things left are a
few files: a diary, a report, and a chart that slopes gently downward. The person who clicked
the button reads the report over coffee, changes one number, and clicks the button again.

Counting helps. One machine with eight cards, four machines with eight cards each, a batch of
thirty-two per card, two micro-batches before each step: the arithmetic decides how many
examples go into every nudge, and the learning rate has to be chosen with that number in mind.
Too small and nothing moves. Too large and everything moves at once, mostly in the wrong
direction. A short warm-up at the start lets the optimizer find its feet, and a long slow
decay at the end lets it settle into the valley instead of bouncing off the walls.

The quick brown fox jumps over the lazy dog, and the lazy dog, who has seen this before, does
not even lift its head. Pack my box with five dozen liquor jugs. Sphinx of black quartz, judge
my vow. These lines contain every letter, which makes them a fair first lesson for a model that
has to learn the alphabet before it can learn anything else.
"""


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _dashed(arg: str) -> str:
    """``--batch_size`` as ``--batch-size``: a sweep's parameter names have no dashes."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="DDP training template: run with `python train.py` or under torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data and outputs")
    g.add_argument("--out", default="outputs", metavar="DIR",
                   help="output directory: metrics.jsonl, result.json, tb/, checkpoints/")
    g.add_argument("--dataset", choices=["synthetic", "tiny-text"], default="synthetic",
                   help="built-in data: 'synthetic' (classification, labels from a random "
                        "teacher MLP) or 'tiny-text' (a small built-in text, character-level LM)")
    g.add_argument("--data", default=None, metavar="PATH",
                   help="your own text: a file or a directory of *.txt files, trained as a "
                        "character-level language model; overrides --dataset")
    g.add_argument("--num-workers", metavar="N", type=_int_at_least(0), default=2,
                   help="DataLoader worker processes per training process (0: load in-process)")
    g.add_argument("--prefetch-factor", metavar="N", type=_int_at_least(1), default=2,
                   help="batches each DataLoader worker prepares ahead")

    g = p.add_argument_group("optimisation")
    g.add_argument("--max-steps", metavar="N", type=_int_at_least(1), default=200,
                   help="total number of optimizer steps (counted across resumes)")
    g.add_argument("--batch-size", metavar="N", type=_int_at_least(1), default=32,
                   help="micro-batch size per process")
    g.add_argument("--grad-accum", metavar="N", type=_int_at_least(1), default=1,
                   help="micro-batches per optimizer step (global batch = batch-size x "
                        "grad-accum x world size)")
    g.add_argument("--lr", metavar="X", type=_non_negative_float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", metavar="X", type=_non_negative_float, default=0.1,
                   help="the cosine schedule ends at lr x this ratio")
    g.add_argument("--warmup-steps", metavar="N", type=_int_at_least(0), default=20,
                   help="steps of linear warm-up from 0 to --lr")
    g.add_argument("--weight-decay", metavar="X", type=_non_negative_float, default=0.01,
                   help="AdamW weight decay (not applied to biases and norm weights)")
    g.add_argument("--clip-grad", metavar="X", type=_non_negative_float, default=1.0,
                   help="clip the global gradient norm to this value (0 disables)")
    g.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="auto: bf16 on GPUs that support it, else fp16 on GPU, fp32 on CPU")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--seed", metavar="N", type=int, default=0, help="seed for model init and data order")

    g = p.add_argument_group("model size")
    g.add_argument("--hidden", metavar="N", type=_int_at_least(1), default=128,
                   help="MLP width (synthetic) or Transformer width d_model (text)")
    g.add_argument("--layers", metavar="N", type=_int_at_least(1), default=2,
                   help="hidden layers (MLP) or Transformer blocks (text)")
    g.add_argument("--heads", metavar="N", type=_int_at_least(1), default=4,
                   help="attention heads (text); must divide --hidden")
    g.add_argument("--context", metavar="N", type=_int_at_least(1), default=64,
                   help="characters of context (text)")
    g.add_argument("--dropout", metavar="X", type=_non_negative_float, default=0.0, help="dropout (text)")

    g = p.add_argument_group("checkpoints, evaluation, logging")
    g.add_argument("--ckpt-every", metavar="N", type=_int_at_least(0), default=50,
                   help="save a checkpoint every N steps (0: only at the end / on SIGTERM)")
    g.add_argument("--keep-ckpts", metavar="N", type=_int_at_least(1), default=3,
                   help="step checkpoints to keep (best.pt is kept in addition)")
    g.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                   help="auto: continue from the newest checkpoint any node has; never: start "
                        "fresh (moves the checkpoints already in --out aside into checkpoints/previous-<time>/); PATH: load this "
                        "checkpoint file (read on global rank 0 and sent to the others)")
    g.add_argument("--eval-every", metavar="N", type=_int_at_least(0), default=25,
                   help="evaluate every N steps (0: only at the start and the end)")
    g.add_argument("--eval-batches", metavar="N", type=_int_at_least(1), default=8,
                   help="validation batches per process in each evaluation")
    g.add_argument("--patience", metavar="N", type=_int_at_least(0), default=5,
                   help="stop after this many evaluations without improvement (0 disables)")
    g.add_argument("--min-delta", metavar="X", type=_non_negative_float, default=0.0,
                   help="an improvement must lower the best validation loss by more than this")
    g.add_argument("--log-every", metavar="N", type=_int_at_least(0), default=10,
                   help="log training loss every N steps (0 disables)")
    g.add_argument("--sleep-per-step", type=_non_negative_float, default=0.0, metavar="SECONDS",
                   help="sleep after each step (to watch a demo, or to test interruptions)")
    args = p.parse_args([_dashed(a) for a in (sys.argv[1:] if argv is None else argv)])
    if args.hidden % args.heads:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    trial = trial_dir()
    if trial is not None and not os.environ.get("CLOUDTRAIN_TRIAL_DIR"):
        args.out = str(Path(args.out) / trial)   # a trial sharing its workdir: a folder of its own
    return args


class UsageError(Exception):
    """A problem with the arguments or the data: reported without a traceback, exit code 2."""


# ----------------------------------------------------------------------------------------------
# Processes and devices
# ----------------------------------------------------------------------------------------------


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    distributed: bool  # a process group exists (started by torchrun)
    backend: str | None
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_node_main(self) -> bool:
        """The first process of each node: the one that writes this node's checkpoints."""
        return self.local_rank == 0

    def all_reduce(self, values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(t, op=op)
        return t.tolist()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(device_ids=[self.local_rank] if self.backend == "nccl" else None)


def init_runtime() -> Runtime:
    # torchrun sets these; a plain `python train.py` is a world of one without a process group.
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
        torch.backends.cuda.matmul.allow_tf32 = True  # free speed for fp32 matmuls on Ampere+
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if distributed:
        dist.init_process_group(backend=backend)
    return Runtime(rank, world, local_rank, local_world, distributed,
                   backend if distributed else None, device)


def setup_logging(rank: int) -> None:
    """INFO from global rank 0 only; the others report warnings and errors."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


class StopRequest:
    """Remembers a SIGTERM. The handler only sets a flag: the training loop decides, together
    with every other rank, at which step to stop (see ``agree_to_stop``)."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True


def _dataloader_worker_init(worker_id: int) -> None:
    # Workers share their rank's process group, and torchrun signals whole process groups, so a
    # SIGTERM reaches them too. They must neither run the trainer's handler nor die (the loader
    # would then fail before the checkpoint is saved): they ignore it and are shut down by their
    # parent when it exits.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


@dataclass
class Data:
    name: str  # "synthetic", "tiny-text" or "text"
    train: Dataset
    val: Dataset
    description: str
    model_config: dict[str, Any]  # what the model needs to know about the data
    extra: dict[str, Any]  # stored in checkpoints (e.g. the vocabulary)


def make_synthetic(hidden: int, layers: int) -> Data:
    """Gaussian inputs labelled by a fixed random 'teacher' MLP. The generator is seeded, so
    every rank (and every run) builds exactly the same data; no rank needs to send it."""
    in_dim, teacher_width, classes, n_train, n_val = 32, 64, 8, 8192, 1024
    g = torch.Generator().manual_seed(SYNTHETIC_SEED)
    w1 = torch.randn(in_dim, teacher_width, generator=g) / math.sqrt(in_dim)
    w2 = torch.randn(teacher_width, classes, generator=g) / math.sqrt(teacher_width)
    x = torch.randn(n_train + n_val, in_dim, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return Data(
        name="synthetic",
        train=TensorDataset(x[:n_train], y[:n_train]),
        val=TensorDataset(x[n_train:], y[n_train:]),
        description=f"synthetic: {n_train} train / {n_val} val samples, {in_dim} features, "
                    f"{classes} classes",
        model_config={"kind": "mlp", "in_dim": in_dim, "hidden": hidden, "layers": layers,
                      "out_dim": classes},
        extra={},
    )


class CharWindows(Dataset):
    """Every window of ``context`` characters, paired with the same window shifted by one."""

    def __init__(self, ids: torch.Tensor, context: int) -> None:
        self.ids, self.context = ids, context

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i:i + self.context + 1]
        return chunk[:-1], chunk[1:]


def read_text(path: Path) -> str:
    if not path.exists():
        raise UsageError(f"--data: no such file or directory: {path}")
    if path.is_dir():
        files = sorted(f for f in path.rglob("*.txt") if f.is_file())
        if not files:
            raise UsageError(f"--data: no *.txt files in directory {path}")
    else:
        files = [path]
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def make_char_lm(name: str, text: str, args: argparse.Namespace) -> Data:
    """Character-level language modelling: the first 90% of the text trains, the last 10%
    validates (a contiguous split, so no validation window overlaps a training one)."""
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    n_val = max(len(ids) // 10, args.context + 1)
    if len(ids) - n_val < args.context + 1:
        raise UsageError(f"the text has {len(ids)} characters; with --context {args.context} it "
                         f"needs at least {n_val + args.context + 1}")
    train, val = CharWindows(ids[:-n_val], args.context), CharWindows(ids[-n_val:], args.context)
    return Data(
        name=name,
        train=train,
        val=val,
        description=f"{name}: {len(ids)} characters, vocabulary {len(chars)}, "
                    f"{len(train)} train / {len(val)} val windows of {args.context}",
        model_config={"kind": "char-transformer", "vocab": len(chars), "d_model": args.hidden,
                      "layers": args.layers, "heads": args.heads, "context": args.context,
                      "dropout": args.dropout},
        extra={"vocab": "".join(chars)},
    )


def load_data(args: argparse.Namespace) -> Data:
    if args.data is not None:
        return make_char_lm("text", read_text(Path(args.data)), args)
    if args.dataset == "tiny-text":
        return make_char_lm("tiny-text", TINY_TEXT, args)
    return make_synthetic(args.hidden, args.layers)


class ResumableDistributedSampler(DistributedSampler):
    """A DistributedSampler that can begin an epoch part-way through.

    After a resume the first ``skip`` indices of the current epoch are dropped here, before the
    DataLoader sees them, so the samples already trained on are never loaded again. The order is
    the same as without the skip: it depends only on the seed and the epoch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - min(self.skip, self.num_samples)


class TrainStream:
    """Micro-batches across epoch boundaries, keeping track of where we are:
    ``epoch`` and ``batch_in_epoch`` (micro-batches of this epoch already handed out)."""

    def __init__(self, loader: DataLoader, sampler: ResumableDistributedSampler, batch_size: int,
                 epoch: int = 0, batch_in_epoch: int = 0) -> None:
        self.loader, self.sampler, self.batch_size = loader, sampler, batch_size
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
        self._it: Any = None

    def next(self) -> Any:
        while True:
            if self._it is None:
                self.sampler.set_epoch(self.epoch)  # a new shuffle each epoch, same on all ranks
                self.sampler.skip = self.batch_in_epoch * self.batch_size
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:
                self.epoch, self.batch_in_epoch, self._it = self.epoch + 1, 0, None
                continue
            self.batch_in_epoch += 1
            return batch

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, in_dim: int, hidden: int, layers: int, out_dim: int) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        width = in_dim
        for _ in range(layers):
            mods += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        mods.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-norm Transformer block with causal self-attention."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, context: int,
                 dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model(config: dict[str, Any]) -> nn.Module:
    cfg = dict(config)
    kind = cfg.pop("kind")
    return MLP(**cfg) if kind == "mlp" else CharTransformer(**cfg)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for both tasks: (B, C) vs (B,) and (B, T, V) vs (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    # Decay matrices only; biases, norm weights and the like are left alone.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr)


def lr_factor(args: argparse.Namespace) -> Callable[[int], float]:
    """Multiplier of --lr for the optimizer step after ``done`` steps: linear warm-up from 0,
    reaching --lr at step --warmup-steps, then a cosine down to --min-lr-ratio at --max-steps."""

    def factor(done: int) -> float:
        step = done + 1  # 1-based number of the step this learning rate is used for
        if step <= args.warmup_steps:
            return step / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def resolve_precision(requested: str, device: torch.device, rt: Runtime) -> str:
    if device.type == "cuda":
        if requested == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return requested
    if requested == "fp16":
        if rt.is_main:
            log.warning("--precision fp16 needs a GPU; using fp32 on CPU (bf16 works on CPU)")
        return "fp32"
    return "fp32" if requested == "auto" else requested


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write to a temporary file, fsync it, then rename it over ``path``: a reader sees the old
    file or the new one, never half of one. The temporary name is unique to this host and
    process, so nodes that do share a disk cannot write into each other's temporary file."""
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}-{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


class Checkpoints:
    """step-NNNNNN.pt files, ``latest`` and ``best.pt`` in one node-local directory."""

    def __init__(self, directory: Path, keep: int) -> None:
        self.dir, self.keep = directory, keep

    @staticmethod
    def name(step: int) -> str:
        return f"step-{step:06d}.pt"

    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for f in self.dir.iterdir() if (m := STEP_FILE.match(f.name)))

    def latest_step(self) -> int | None:
        """The step ``latest`` names, or else the highest step file present."""
        try:
            named = (self.dir / "latest").read_text().strip()
        except OSError:
            named = ""
        m = STEP_FILE.match(named)
        if m and (self.dir / named).is_file():
            return int(m.group(1))
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, state: dict[str, Any], step: int) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = self.name(step)
        atomic_write(self.dir / name, lambda f: torch.save(state, f))
        atomic_write(self.dir / "latest", lambda f: f.write(f"{name}\n".encode()))
        # Keep the newest --keep-ckpts, and in any case the one just written (``latest``).
        steps = self.steps()
        for old in [s for s in steps if s != step][: max(0, len(steps) - self.keep)]:
            (self.dir / self.name(old)).unlink(missing_ok=True)
        for stale in self.dir.glob("*.tmp"):  # left behind by a process killed mid-write
            with contextlib.suppress(OSError):
                if stale.stat().st_mtime < time.time() - 3600:
                    stale.unlink()
        return self.dir / name

    def save_best(self, state: dict[str, Any]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.dir / "best.pt", lambda f: torch.save(state, f))
        return self.dir / "best.pt"

    def set_aside(self) -> tuple[int, Path]:
        """Move the step checkpoints, ``latest`` and ``best.pt`` into a dated folder beside
        them (nothing is deleted), so a fresh run starts from an empty directory."""
        steps = self.steps()
        dest = self.dir / time.strftime("previous-%Y%m%d-%H%M%S")
        dest.mkdir(parents=True, exist_ok=True)
        for name in [self.name(s) for s in steps] + ["latest", "best.pt"]:
            if (self.dir / name).exists():
                os.replace(self.dir / name, dest / name)
        return len(steps), dest


def trial_dir() -> Path | None:
    """sweep-NAME/trial-N for a trial of a cloudtrain sweep, else None."""
    sweep, trial = os.environ.get("CLOUDTRAIN_SWEEP"), os.environ.get("CLOUDTRAIN_TRIAL")
    if not sweep or not trial:
        return None
    return Path(f"sweep-{Path(sweep).name}") / f"trial-{Path(trial).name}"


def checkpoint_dir(args: argparse.Namespace) -> Path:
    """$CLOUDTRAIN_CHECKPOINT_DIR when cloudtrain sets it (the task has ``checkpoints:``, a
    bucket the node uploads them to and restores them from; a sweep's trial: its own folder
    there), else --out/checkpoints."""
    env = os.environ.get("CLOUDTRAIN_CHECKPOINT_DIR")
    if not env:
        return Path(args.out) / "checkpoints"
    trial = trial_dir()
    return Path(env) / trial if trial else Path(env)


def load_checkpoint(path: Path) -> dict[str, Any]:
    # weights_only: tensors and plain Python values only, nothing that runs code when loaded.
    return torch.load(path, map_location="cpu", weights_only=True)


def rng_state(device: torch.device) -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def restore_rng(states: list[dict[str, Any]], rt: Runtime) -> None:
    s = states[rt.rank % len(states)]  # each rank its own, when the world size is unchanged
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and rt.device.type == "cuda":
        torch.cuda.set_rng_state(s["cuda"], rt.device)


def find_resume_state(args: argparse.Namespace, rt: Runtime,
                      ckpts: Checkpoints) -> tuple[dict[str, Any] | None, str | None]:
    """Every rank returns the same checkpoint (or None) and where it came from."""
    if args.resume == "never":
        return None, None
    if args.resume != "auto":
        # An explicit file: only global rank 0 needs to have it.
        state, error = None, None
        if rt.is_main:
            path = Path(args.resume)
            if path.is_file():
                state = load_checkpoint(path)
            else:
                error = f"--resume: no such checkpoint file: {path}"
        state, error = rt.broadcast_object((state, error), src=0)
        if error:
            raise UsageError(error)
        return state, args.resume

    # auto: the newest step any node has (a replaced node comes back with an empty disk).
    local = ckpts.latest_step()
    (step,) = rt.all_reduce([-1 if local is None else local], dist.ReduceOp.MAX)
    if step < 0:
        return None, None
    path = ckpts.dir / ckpts.name(int(step))
    have = path.is_file()
    (everyone_has,) = rt.all_reduce([1 if have else 0], dist.ReduceOp.MIN)
    if everyone_has:
        return load_checkpoint(path), str(path)
    # Some node lacks it: the lowest rank that has it sends it to everybody.
    (src,) = rt.all_reduce([rt.rank if have else rt.world_size], dist.ReduceOp.MIN)
    if rt.is_main:
        log.warning("some node has no %s; rank %d sends its copy to all ranks", path.name, int(src))
    state = rt.broadcast_object(load_checkpoint(path) if rt.rank == int(src) else None, src=int(src))
    return state, str(path)


def convert_position(state: dict[str, Any], args: argparse.Namespace, rt: Runtime) -> tuple[int, int]:
    """The checkpoint's (epoch, micro-batches consumed in it), converted if the world size or the
    batch size changed: DistributedSampler deals one shuffled order out rank by rank, so the
    number of samples consumed globally maps onto the same place in that order."""
    epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
    old_world, old_batch = int(state["world_size"]), int(state["args"]["batch_size"])
    if (old_world, old_batch) == (rt.world_size, args.batch_size):
        return epoch, batch
    new = (batch * old_batch * old_world) // (args.batch_size * rt.world_size)
    if rt.is_main:
        log.warning("world size x batch size changed from %d x %d to %d x %d: continuing epoch %d "
                    "at micro-batch %d (was %d)", old_world, old_batch, rt.world_size,
                    args.batch_size, epoch, new, batch)
    return epoch, new


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------


class Reporter:
    """metrics.jsonl and TensorBoard (global rank 0 only)."""

    def __init__(self, out: Path, fresh: bool, start_step: int) -> None:
        self.tb = None
        out.mkdir(parents=True, exist_ok=True)
        # A fresh run starts a new file; a resumed one continues it (a reader should take the
        # last record of a step: the steps after the checkpoint were redone).
        self.metrics = open(out / "metrics.jsonl", "w" if fresh else "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # not installed, or a broken install: carry on without it
            log.warning("TensorBoard logging is off (%s); `pip install tensorboard` to enable it", e)
            return
        # purge_step drops the events of steps redone after a resume.
        self.tb = SummaryWriter(log_dir=str(out / "tb"), purge_step=None if fresh else start_step)

    def record(self, **fields: Any) -> None:
        line = json.dumps(fields) + "\n"
        self.metrics.write(line)
        self.metrics.flush()  # readers (and tests) follow the file while it grows
        sweep_file = os.environ.get("CLOUDTRAIN_METRICS_FILE")
        if sweep_file:  # a sweep's trial: the driver reads the same lines there (one append each)
            with open(sweep_file, "a", encoding="utf-8") as f:
                f.write(line)

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.tb:
            self.tb.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self.tb:
            self.tb.flush()

    def close(self) -> None:
        if self.tb:
            self.tb.close()
        self.metrics.close()


def write_result(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "result.json", lambda f: f.write(json.dumps(result, indent=2).encode()))


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


@dataclass
class Start:
    """Where a run starts: from scratch, or from a checkpoint."""

    state: dict[str, Any] | None = None
    resumed_from: str | None = None
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best_val: float = math.inf
    evals_without_improvement: int = 0


def resolve_start(args: argparse.Namespace, rt: Runtime, ckpts: Checkpoints) -> Start | None:
    """The starting point, the same on every rank; None when the checkpoint has nothing left."""
    if args.resume == "never" and rt.is_node_main and ckpts.steps():
        n, dest = ckpts.set_aside()
        log.warning("--resume never: moved %d old step checkpoint(s) to %s", n, dest)
    rt.barrier()  # nobody looks for checkpoints while they are being moved
    state, resumed_from = find_resume_state(args, rt, ckpts)
    if state is None:
        return Start()
    step, patience_used = int(state["step"]), int(state["evals_without_improvement"])
    if step >= args.max_steps:
        log.info("%s is at step %d and --max-steps is %d: nothing left to do (raise --max-steps "
                 "to train further)", resumed_from, step, args.max_steps)
        return None
    if state["reason"] == "early-stop" and 0 < args.patience <= patience_used:
        log.info("%s was saved by early stopping (%d evaluations without improvement): nothing "
                 "left to do (raise --patience, or set it to 0, to train further)",
                 resumed_from, patience_used)
        return None
    epoch, batch = convert_position(state, args, rt)
    log.info("resumed from %s at step %d (epoch %d, micro-batch %d of the epoch; saved: %s)",
             resumed_from, step, epoch, batch, state["reason"])
    return Start(state, resumed_from, step, epoch, batch, float(state["best_val_loss"]),
                 patience_used)


class Trainer:
    """One run: everything is set up in __init__, ``run()`` trains. To adapt the template, change
    ``load_data``/``build_model``/``loss_fn`` above, or ``train_step`` here."""

    def __init__(self, args: argparse.Namespace, rt: Runtime, data: Data, ckpts: Checkpoints,
                 start: Start) -> None:
        self.args, self.rt, self.data, self.ckpts = args, rt, data, ckpts
        self.out = Path(args.out)
        self.cuda = rt.device.type == "cuda"
        self.precision = resolve_precision(args.precision, rt.device, rt)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        self.start_step = self.step = start.step
        self.resumed_from = start.resumed_from
        self.best_val = start.best_val
        self.evals_without_improvement = start.evals_without_improvement
        self.val_losses: list[list[float]] = []  # [step, loss] of this run
        self.last_ckpt: Path | None = None
        self.stop = StopRequest()

        # Model. ``raw_model`` stays the unwrapped module: checkpoints save its state_dict,
        # whatever torch.compile and DDP add around it (they share its parameters).
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        random.seed(args.seed + rt.rank)
        self.raw_model = build_model(data.model_config).to(rt.device)
        if start.state is not None:
            self.raw_model.load_state_dict(start.state["model"])
        compiled = torch.compile(self.raw_model) if args.compile else self.raw_model
        self.eval_model = compiled  # evaluation needs no gradient synchronisation: no DDP
        self.model: nn.Module = compiled
        if rt.distributed:
            self.model = DDP(compiled, device_ids=[rt.local_rank] if self.cuda else None)

        self.optimizer = make_optimizer(self.raw_model, args)
        self.lr_factor = lr_factor(args)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=self.precision == "fp16")
        if start.state is not None:
            self._restore(start.state)
        start.state = None  # let the checkpoint's memory go

        # Data. Only the sampler knows the order; it is the same on all ranks for a given epoch.
        workers = args.num_workers
        loader_kwargs: dict[str, Any] = dict(
            batch_size=args.batch_size, num_workers=workers, pin_memory=self.cuda,
            worker_init_fn=_dataloader_worker_init if workers else None,
            persistent_workers=workers > 0, prefetch_factor=args.prefetch_factor if workers else None)
        sampler = ResumableDistributedSampler(data.train, num_replicas=rt.world_size, rank=rt.rank,
                                              shuffle=True, seed=args.seed, drop_last=True)
        self.batches_per_epoch = sampler.num_samples // args.batch_size
        if self.batches_per_epoch == 0:
            raise UsageError(f"{len(data.train)} training samples are too few for "
                             f"{rt.world_size} process(es) x --batch-size {args.batch_size}")
        loader = DataLoader(data.train, sampler=sampler, drop_last=True, **loader_kwargs)
        self.stream = TrainStream(loader, sampler, args.batch_size, start.epoch, start.batch_in_epoch)
        self.start_position = self.stream.position()
        val_sampler = DistributedSampler(data.val, num_replicas=rt.world_size, rank=rt.rank,
                                         shuffle=False)
        self.val_loader = DataLoader(data.val, sampler=val_sampler, **loader_kwargs)
        self.global_batch = args.batch_size * args.grad_accum * rt.world_size
        self.reporter: Reporter | None = None

    def _restore(self, state: dict[str, Any]) -> None:
        args = self.args
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        restore_rng(state["rng"], self.rt)
        # The schedule follows this run's --lr, --warmup-steps and --max-steps (a longer run
        # stretches the cosine), and the weight decay this run's --weight-decay.
        self.scheduler.base_lrs = [args.lr for _ in self.optimizer.param_groups]
        for group, decay in zip(self.optimizer.param_groups, (args.weight_decay, 0.0)):
            group["initial_lr"] = args.lr
            group["lr"] = args.lr * self.lr_factor(self.scheduler.last_epoch)
            group["weight_decay"] = decay

    def autocast(self) -> Any:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.rt.device.type, dtype=self.amp_dtype)

    # --- one optimizer step ------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, float]:
        """--grad-accum micro-batches, then one optimizer step. Returns the mean loss (a tensor,
        to avoid a device sync) and the learning rate the step used."""
        args, device = self.args, self.rt.device
        total = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            x, y = self.stream.next()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # DDP all-reduces gradients during backward: only needed on the last micro-batch.
            last = micro == args.grad_accum - 1
            no_sync = isinstance(self.model, DDP) and not last
            with self.model.no_sync() if no_sync else contextlib.nullcontext():  # type: ignore[operator]
                with self.autocast():
                    loss = loss_fn(self.model(x), y)
                self.scaler.scale(loss / args.grad_accum).backward()
            total += loss.detach()
        if args.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)  # clip true gradients, not fp16-scaled ones
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), args.clip_grad)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)  # skipped by the scaler if fp16 gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total / args.grad_accum, lr

    # --- collective decisions -----------------------------------------------------------------

    def agree_to_stop(self) -> bool:
        """Every rank calls this at every step boundary, so all of them stop at the same step even
        if only one node got the signal, and no rank leaves the others waiting in a collective."""
        (flag,) = self.rt.all_reduce([1.0 if self.stop.requested else 0.0], dist.ReduceOp.MAX)
        return flag > 0

    def evaluate(self) -> float:
        """Mean validation loss over --eval-batches batches per rank, averaged over all ranks:
        every rank gets the same number, so all take the same early-stopping decision."""
        rt = self.rt
        self.eval_model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for i, (x, y) in enumerate(self.val_loader):
                if i >= self.args.eval_batches:
                    break
                x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
                with self.autocast():
                    total += loss_fn(self.eval_model(x), y).item()
                count += 1
        self.eval_model.train()
        total, count = rt.all_reduce([total, count], dist.ReduceOp.SUM)
        val = total / max(count, 1)
        self.val_losses.append([self.step, val])
        self.report(step=self.step, val_loss=val)
        # (Only the training line says "step N/M": one line per step for log watchers.)
        log.info("eval at step %d: val_loss %.4f (best %.4f)", self.step, val, min(val, self.best_val))
        return val

    def judge(self, val: float) -> bool:
        """Early-stopping bookkeeping (saves best.pt on improvement); True: patience ran out."""
        if val < self.best_val - self.args.min_delta:
            self.best_val, self.evals_without_improvement = val, 0
            self.checkpoint("best")
            return False
        self.evals_without_improvement += 1
        return 0 < self.args.patience <= self.evals_without_improvement

    def checkpoint(self, reason: str) -> None:
        """A collective (the RNG states of all ranks are gathered); LOCAL_RANK 0 of every node
        writes its own copy. ``reason`` "best" writes best.pt, the others a step checkpoint."""
        rngs = self.rt.gather_objects(rng_state(self.rt.device))
        if not self.rt.is_node_main:
            return
        pos = self.stream.position()
        state = {
            "step": self.step, "epoch": pos["epoch"], "batch_in_epoch": pos["batch_in_epoch"],
            "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "rng": rngs, "best_val_loss": self.best_val,
            "evals_without_improvement": self.evals_without_improvement, "args": vars(self.args),
            "world_size": self.rt.world_size, "reason": reason, "wall_time": time.time(),
            "model_config": self.data.model_config, "data": self.data.extra,
        }
        if reason == "best":
            path = self.ckpts.save_best(state)
        else:
            path = self.last_ckpt = self.ckpts.save(state, self.step)
        log.info("saved %s (step %d, %s)", path, self.step, reason)

    # --- reporting ------------------------------------------------------------------------------

    def report(self, **record: Any) -> None:
        """A metrics.jsonl record, mirrored to TensorBoard (rank 0 only)."""
        if self.reporter is None:
            return
        self.reporter.record(**record)
        step = record.pop("step")
        tags = {"loss": "train/loss", "lr": "train/lr", "val_loss": "val/loss",
                "samples_per_sec": "perf/samples_per_sec", "peak_mem_mb": "perf/peak_mem_mb"}
        for key, value in record.items():
            self.reporter.scalar(tags[key], value, step)
        if "val_loss" in record:
            self.reporter.flush()

    def log_config(self) -> None:
        args, rt = self.args, self.rt
        n_params = sum(p.numel() for p in self.raw_model.parameters())
        log.info("world size %d (%d per node), backend %s, device %s, precision %s, compile %s",
                 rt.world_size, rt.local_world_size, rt.backend or "none (single process)",
                 rt.device, self.precision, "on" if args.compile else "off")
        log.info("data %s; %d micro-batches per epoch per process", self.data.description,
                 self.batches_per_epoch)
        log.info("model %s, %.2fM parameters", type(self.raw_model).__name__, n_params / 1e6)
        log.info("batch %d per process x grad accum %d x %d process(es) = global batch %d; "
                 "steps %d -> %d", args.batch_size, args.grad_accum, rt.world_size,
                 self.global_batch, self.start_step, args.max_steps)

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        self.log_config()
        if self.rt.is_main:
            self.reporter = Reporter(self.out, fresh=self.resumed_from is None,
                                     start_step=self.start_step)
        try:
            return self._run()
        finally:
            if self.reporter is not None:
                self.reporter.close()

    def _run(self) -> int:
        args, rt = self.args, self.rt
        self.stop.install()  # before the first evaluation; DataLoader workers will ignore it
        started = time.time()
        first_val = self.evaluate()
        if self.resumed_from is None:
            self.judge(first_val)  # the starting point: best.pt exists from step 0 on
        last_eval_step = self.step
        stop_reason = None
        window_loss, window_steps, window_time = torch.zeros((), device=rt.device), 0, 0.0
        timed_steps, timed_time = 0, 0.0  # for result.json, without the first few steps

        while self.step < args.max_steps:
            if self.agree_to_stop():
                stop_reason = "sigterm"
                log.warning("SIGTERM: stopping at step %d", self.step)
                break
            t0 = time.perf_counter()
            loss, lr = self.train_step()
            if self.cuda:
                torch.cuda.synchronize()  # honest timing; the stop check syncs anyway
            dt = time.perf_counter() - t0
            self.step += 1
            window_loss += loss
            window_steps, window_time = window_steps + 1, window_time + dt
            if self.step - self.start_step > TIMING_WARMUP_STEPS:
                timed_steps, timed_time = timed_steps + 1, timed_time + dt

            if args.log_every and self.step % args.log_every == 0:
                (mean_loss,) = rt.all_reduce([window_loss.item() / window_steps], dist.ReduceOp.SUM)
                mean_loss /= rt.world_size
                sps = window_steps * self.global_batch / max(window_time, 1e-9)
                log.info("step %d/%d loss %.4f lr %.1e %.0f samples/s",
                         self.step, args.max_steps, mean_loss, lr, sps)
                extra = {"peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20} if self.cuda else {}
                self.report(step=self.step, loss=mean_loss, lr=lr, samples_per_sec=sps, **extra)
                window_loss.zero_()
                window_steps, window_time = 0, 0.0

            if args.eval_every and self.step % args.eval_every == 0:
                last_eval_step = self.step
                if self.judge(self.evaluate()):
                    stop_reason = "early-stop"
                    log.info("early stop at step %d: no improvement in %d evaluations (best "
                             "val_loss %.4f)", self.step, self.evals_without_improvement, self.best_val)
                    break
            if args.ckpt_every and self.step % args.ckpt_every == 0 and self.step < args.max_steps:
                self.checkpoint("periodic")
            if args.sleep_per_step:
                time.sleep(args.sleep_per_step)

        if stop_reason is None:
            stop_reason = "completed"
            if last_eval_step != self.step:
                self.judge(self.evaluate())
        self.checkpoint({"completed": "final"}.get(stop_reason, stop_reason))
        rt.barrier()  # every node's checkpoint is on disk before anyone exits

        last_val = self.val_losses[-1][1]
        if rt.is_main:
            write_result(self.out, {
                "start_step": self.start_step, "final_step": self.step,
                "max_steps": args.max_steps, "resumed_from": self.resumed_from,
                "stop_reason": stop_reason, "world_size": rt.world_size, "backend": rt.backend,
                "device": rt.device.type, "precision": self.precision,
                "batch_size": args.batch_size, "grad_accum": args.grad_accum,
                "global_batch": self.global_batch, "first_val_loss": first_val,
                "last_val_loss": last_val, "best_val_loss": self.best_val,
                "val_losses": self.val_losses,
                "samples_per_sec": timed_steps * self.global_batch / timed_time if timed_time else None,
                "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if self.cuda else None,
                "compile": bool(args.compile), "dataset": self.data.name, "data_path": args.data,
                "start_position": self.start_position, "final_position": self.stream.position(),
                "checkpoint": self.last_ckpt.name if self.last_ckpt else None,
                "wall_time_s": time.time() - started,
            })
        done = {"completed": "finished", "early-stop": "stopped early", "sigterm": "stopped by SIGTERM"}
        log.info("%s at step %d of %d; val_loss %.4f -> %.4f (best %.4f); outputs in %s",
                 done[stop_reason], self.step, args.max_steps, first_val, last_val, self.best_val,
                 self.out)
        return EXIT_SIGTERM if stop_reason == "sigterm" else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # exits with 2 on bad arguments
    setup_logging(int(os.environ.get("RANK", "0")))
    if args.data is not None and not Path(args.data).exists():
        # Checked before joining the process group, so a missing path fails fast everywhere.
        log.error("--data: no such file or directory: %s", args.data)
        return EXIT_USAGE
    rt = init_runtime()
    try:
        data = load_data(args)
        ckpts = Checkpoints(checkpoint_dir(args), args.keep_ckpts)
        start = resolve_start(args, rt, ckpts)
        if start is None:
            return 0
        return Trainer(args, rt, data, ckpts, start).run()
    except UsageError as e:
        log.error("%s", e)
        return EXIT_USAGE
    finally:
        if rt.distributed and dist.is_initialized():
            dist.destroy_process_group()
            global _PROCESS_GROUP_DESTROYED
            _PROCESS_GROUP_DESTROYED = True


_PROCESS_GROUP_DESTROYED = False


def _exit(code: int) -> None:
    """Leave without the interpreter's finalization once the process group is gone: Gloo's
    worker threads can still hold objects whose release during finalization aborts a worker
    that finished cleanly ('terminate called without an active exception', SIGABRT), which
    turns a successful run into a failed one. Everything is closed and flushed by now."""
    if not _PROCESS_GROUP_DESTROYED:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
