"""Bootstrap on Slurm: nothing is installed on the compute nodes. From the login node, one
quick step of the allocation (``srun --overlap``, one task a node) finds the Python to use
(``resources.slurm.python``, else the ``python3`` the site's ``modules`` give, else
``python3`` on PATH) and prints, on every node, its PyTorch version and the GPUs PyTorch sees;
a node whose CUDA build of PyTorch sees another number of GPUs than Slurm allocated is an
error naming it. Where there is no PyTorch and the task needs one (``train:``, or a
``bootstrap:`` section), a venv is built on the shared filesystem from the login node
(``python3 -m venv`` + ``pip install`` of the task's ``bootstrap.torch``) and checked again.
The result is kept per allocation (``slurm-bootstrap.json`` in the cluster's folder), so warm
launches into the same allocation skip all of it."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from cloudtrain.errors import ProviderError, UserError

from cloudtrain_provisioners.slurm import sched, steps
from cloudtrain_provisioners.slurm.login import Login

PROBE = r"""
PY={python}
[ -n "$PY" ] || PY=$(command -v python3 || true)
echo "py=$PY"
echo "cvd=${{CUDA_VISIBLE_DEVICES:-}}"
[ -n "$PY" ] || exit 0
"$PY" - <<'EOF'
try:
    import torch
except Exception:
    print("torch=")
else:
    cuda = torch.version.cuda or getattr(torch.version, "hip", None) or ""
    print("torch=" + torch.__version__)
    print("cuda=" + cuda)
    print("seen=" + (str(torch.cuda.device_count()) if cuda else ""))
EOF
"""


@dataclass(frozen=True)
class Wanted:
    """What the launch needs: the pip requirement for torch (``bootstrap.torch``), its index,
    whether the job needs PyTorch at all, and the GPUs Slurm allocated on each node."""

    torch: str = "torch"
    torch_index: str | None = None
    need_torch: bool = False
    gpus: int = 0


@dataclass(frozen=True)
class NodeFound:
    rank: int
    python: str
    torch: str            # '' : no PyTorch
    cuda: str             # '' : a CPU build
    seen: int | None      # GPUs PyTorch sees (None: a CPU build cannot tell)


@dataclass(frozen=True)
class Stamp:
    """What the bootstrap of one allocation found (kept; a warm launch reads it)."""

    allocation: str
    key: str
    python: str           # the Python every step uses ('' : the site's, unchanged)
    torch: str
    built_venv: bool


def probe(login: Login, alloc: sched.Allocation, workdir: str, modules: list[str],
          python: str | None) -> list[NodeFound]:
    """The check step: on every node, the Python and what PyTorch it has."""
    seen: dict[int, dict[str, str]] = {}

    def line(rank: int, text: str) -> None:
        key, sep, value = text.partition("=")
        if rank >= 0 and sep:
            seen.setdefault(rank, {})[key.strip()] = value.strip()

    body = PROBE.format(python=shlex.quote(python or ""))
    job = f"bootstrap-{alloc.job_id}"
    script = steps.step_script(job, workdir, {}, modules, None, body)
    codes = steps.run(login, alloc.job_id, alloc.node_count, job, workdir, script, line,
                      ["--overlap", "--kill-on-bad-exit=0"])
    bad = sorted(r for r, c in codes.items() if c != 0)
    if bad:
        raise ProviderError(f"the bootstrap check failed on node {bad[0]} (exit code "
                            f"{codes[bad[0]]}): the site's modules could not be loaded or the "
                            "workdir is not reachable there.",
                            "Check resources.slurm.modules and workdir on that node "
                            "(cloudtrain exec NAME --node N -- 'module list').")
    out = []
    for rank in range(alloc.node_count):
        f = seen.get(rank, {})
        n = f.get("seen", "")
        out.append(NodeFound(rank, f.get("py", ""), f.get("torch", ""), f.get("cuda", ""),
                             int(n) if n.isdigit() else None))
    return out


def check_gpus(found: list[NodeFound], nodes: list[str], gpus: int) -> None:
    """A CUDA build of PyTorch that sees another number of GPUs than Slurm allocated."""
    for f in found:
        if f.torch and f.cuda and gpus and f.seen != gpus:
            node = nodes[f.rank] if f.rank < len(nodes) else f"rank {f.rank}"
            raise ProviderError(f"node {f.rank} ({node}): PyTorch {f.torch} sees {f.seen} "
                                f"GPU(s), Slurm allocated {gpus}.",
                                "Ask the site about that node's GPUs (scontrol show node), or "
                                "exclude it with resources.slurm.constraint; then run again.")


def build_venv(login: Login, venv: str, base: str, want: Wanted,
               say: Callable[[str], None]) -> str:
    """``base -m venv`` on the shared filesystem, then pip install of the task's torch;
    the venv's python."""
    say(f"No PyTorch on the nodes: building a venv at {venv} with {want.torch} (pip, from the "
        "login node)")
    pip = [f"{venv}/bin/python", "-m", "pip", "install", "-q", want.torch]
    if want.torch_index:
        pip += ["--index-url", want.torch_index]
    for argv in ([base, "-m", "venv", venv], pip):
        r = login.run(argv, timeout=3600)
        if not r.ok:
            raise ProviderError(f"building the venv failed ({' '.join(argv[:4])} ...): "
                                f"{r.words()}",
                                "Give resources.slurm.python a Python with PyTorch, or "
                                "bootstrap.torch / bootstrap.torch_index that pip on the login "
                                "node can install from.")
    return f"{venv}/bin/python"


def base_python(login: Login, modules: list[str], python: str | None) -> str:
    """The Python the venv is made from, on the login node."""
    if python:
        return python
    loads = "".join(f"module load {shlex.quote(m)} >/dev/null 2>&1; " for m in modules)
    r = login.run(["bash", "-c", loads + "command -v python3"])
    if not r.ok or not r.out.strip():
        raise UserError("no python3 on the login node to build a venv from.",
                        "Give resources.slurm.python (a Python with PyTorch), or the modules "
                        "that provide python3.")
    return r.out.strip().splitlines()[-1]


def stamp_file(cluster_dir: Path) -> Path:
    return cluster_dir / "slurm-bootstrap.json"


def read_stamp(cluster_dir: Path) -> Stamp | None:
    try:
        return Stamp(**json.loads(stamp_file(cluster_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_stamp(cluster_dir: Path, stamp: Stamp) -> None:
    f = stamp_file(cluster_dir)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(stamp)))
    os.replace(tmp, f)


def ensure(login: Login, alloc: sched.Allocation, cluster_dir: Path, workdir: str,
           rec: dict[str, object], want: Wanted, say: Callable[[str], None]) -> Stamp:
    """The allocation's Python with PyTorch, checked on every node (or the stamp of an earlier
    launch into the same allocation: nothing asked again)."""
    mods = rec.get("modules")
    modules = [str(m) for m in mods] if isinstance(mods, list) else []
    python = str(rec["python"]) if rec.get("python") else None
    key = json.dumps([python, modules, want.torch, want.torch_index, want.need_torch])
    old = read_stamp(cluster_dir)
    if old is not None and old.allocation == alloc.job_id and old.key == key:
        return old
    say(f"Bootstrap: checking the Python and PyTorch on {alloc.node_count} node(s) "
        f"(one step of Slurm job {alloc.job_id})")
    found = probe(login, alloc, workdir, modules, python)
    built = False
    if want.need_torch and any(not f.torch for f in found):
        venv = f"{workdir}/.cloudtrain/venv"
        python = build_venv(login, venv, base_python(login, modules, python), want, say)
        built = True
        found = probe(login, alloc, workdir, modules, python)
        missing = [f.rank for f in found if not f.torch]
        if missing:
            raise ProviderError(f"the venv {venv} has no PyTorch on node {missing[0]}.",
                                "Check that the workdir is on a filesystem the nodes share.")
    check_gpus(found, sched.hostnames(login, alloc.nodelist), want.gpus)
    for f in found:
        what = (f"PyTorch {f.torch}" + (f" (CUDA {f.cuda}, {f.seen} GPU(s) visible)"
                                        if f.cuda else " (a CPU build)")) if f.torch \
            else "no PyTorch"
        say(f"  node {f.rank}: {f.python or 'no python3'}: {what}")
    stamp = Stamp(alloc.job_id, key, python or "", found[0].torch if found else "", built)
    write_stamp(cluster_dir, stamp)
    return stamp
