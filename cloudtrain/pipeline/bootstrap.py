"""Bootstrap: upload ``bootstrap/`` to every node, run ``node.sh`` there in parallel, stream
and time its steps, record what it found, and skip nodes already bootstrapped with the same
script version (a stamp on the node). :func:`run` is the runner over connections;
:func:`run_bootstrap` runs it for a cluster and records and shows what each node reported."""

from __future__ import annotations

import hashlib
import io
import shlex
import tarfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache, cache
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Callable

from cloudtrain.errors import RemoteError
from cloudtrain.paths import bootstrap_dir
from cloudtrain.remote import Group, bash
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.taskmodel import BootstrapSpec   # annotations only: no pydantic at import
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env

TAIL_LINES = 20


@lru_cache(maxsize=1)
def _bundle() -> tuple[str, bytes]:
    root = bootstrap_dir()
    files = [(p.relative_to(root).as_posix(), p)
             for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    # The node's storage agent and job queue travel with the scripts: store.py and queue.py
    # next to ctjob.sh (a launch runs them from script_dir(node); none travels per command).
    node = Path(__file__).resolve().parent.parent / "node"
    files += [("store.py", node / "store.py"), ("queue.py", node / "queue.py")]
    # The sweep driver (node/sweep.py and its siblings sweepstudy.py, sweepwork.py) too.
    files += [(p.name, p) for p in sorted(node.glob("sweep*.py"))]
    h = hashlib.sha256()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for rel, p in files:
            data = p.read_bytes()
            h.update(rel.encode() + b"\0" + data + b"\0")
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mode = 0o755 if p.suffix == ".sh" else 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return h.hexdigest()[:12], buf.getvalue()


@cache
def _script_text(name: str) -> str:
    return (bootstrap_dir() / name).read_text()


def inline(name: str, *args: str) -> str:
    """A command that runs the bootstrap script ``name`` with ``args`` on a node, the script
    travelling in the command itself: nothing has to be uploaded beforehand."""
    return bash(_script_text(name)) + " _ " + " ".join(shlex.quote(a) for a in args)


def version() -> str:
    return _bundle()[0]


def script_dir(node: NodeRow) -> str:
    """Where this version's scripts live on the node (ctjob.sh, ctworker.sh, ...)."""
    return str(PurePosixPath(node.root_dir) / "bootstrap" / version())


@dataclass
class StepReport:
    """One bootstrap step on one node: what it found, installed or skipped, and how long it
    took."""

    name: str
    seconds: float = 0.0
    outcome: str = ""        # "found" | "installed" | "skip" | "" (no word from the step)
    detail: str = ""


@dataclass
class NodeReport:
    rank: int
    skipped: bool = False
    steps: list[StepReport] = field(default_factory=list)
    results: dict[str, str] = field(default_factory=dict)
    tail: list[str] = field(default_factory=list)
    error: str | None = None
    failed_step: str | None = None
    failure: str | None = None  # the script's own account of what went wrong and the fix
    seconds: float = 0.0

    @property
    def installed(self) -> list[StepReport]:
        return [s for s in self.steps if s.outcome == "installed"]


def node_env(cfg: BootstrapSpec, node: NodeRow, extra: dict[str, str],
             container: bool = False) -> dict[str, str]:
    """What ``node.sh`` is told on one node: the provider's variables, the node's address and
    folder, and the task's bootstrap choices; with ``container`` (the task has ``container:``)
    only the host side is made ready: driver, Docker, the NVIDIA Container Toolkit."""
    env = {**extra, "CLOUDTRAIN_NODE_IP": node.internal_ip, "CLOUDTRAIN_ROOT": node.root_dir,
           "CLOUDTRAIN_TORCH": cfg.torch}
    if container:
        env["CLOUDTRAIN_CONTAINER"] = "1"
    if cfg.python:  # the user's choice: node.sh fails naming the field where it is missing
        env["CLOUDTRAIN_PYTHON"] = cfg.python
        env["CLOUDTRAIN_PYTHON_FIELD"] = "bootstrap.python"
    if cfg.torch_index:
        env["CLOUDTRAIN_TORCH_INDEX"] = cfg.torch_index
    if cfg.cuda_toolkit:
        env["CLOUDTRAIN_CUDA_TOOLKIT"] = "1"
    return env


def stamp_path(node: NodeRow, env: dict[str, str]) -> str:
    """The file that says this node was bootstrapped with these scripts and these choices."""
    key = hashlib.sha256(repr(sorted(env.items())).encode()).hexdigest()[:10]
    return str(PurePosixPath(script_dir(node)) / f".done-{key}")


def _command(node: NodeRow, env: dict[str, str], force: bool) -> str:
    d = script_dir(node)
    root = node.root_dir
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    script = f"""
set -o pipefail
root={shlex.quote(root)}; d={shlex.quote(d)}; stamp={shlex.quote(stamp_path(node, env))}
mkdir -p "$root/workdir" "$root/jobs" "$root/bootstrap" || exit 90
if [ -f "$stamp" ] && [ {int(force)} = 0 ]; then
    echo ::skipped; cat "$stamp"; cat > /dev/null; exit 0
fi
rm -rf "$d.tmp" && mkdir -p "$d.tmp" && tar -xzf - -C "$d.tmp" || exit 91
rm -rf "$d" && mv "$d.tmp" "$d" || exit 92
env {exports} bash "$d/node.sh" 2>&1 | tee "$d/bootstrap.log"
rc=${{PIPESTATUS[0]}}
if [ "$rc" = 0 ]; then grep -E '^::(result|step|found|installed|skip) ' "$d/bootstrap.log" > "$stamp"; fi
exit "$rc"
"""
    return bash(script)


def run(group: Group, env_for: Callable[[NodeRow], dict[str, str]], *, force: bool = False,
        on_step: Callable[[int, str], None] | None = None) -> dict[int, NodeReport]:
    """Bootstrap every node of ``group``; raise RemoteError naming the nodes, the failing
    step and the last log lines when any node fails."""
    _, tarball = _bundle()
    reports = {n.rank: NodeReport(n.rank) for n in group.nodes}
    lock = threading.Lock()

    starts: dict[int, list[float]] = {r: [] for r in reports}

    def on_line(rank: int, line: str) -> None:
        rep = reports[rank]
        now = time.monotonic()
        tag, _, rest = line.partition(" ")
        with lock:
            if line == "::skipped":
                rep.skipped = True
            elif tag == "::step":
                rep.steps.append(StepReport(rest.strip()))
                starts[rank].append(now)
                if on_step is not None:
                    on_step(rank, rest.strip())
            elif tag in ("::found", "::installed", "::skip") and rep.steps:
                cur = rep.steps[-1]
                if tag == "::installed":
                    # "installed KEY TEXT": the key names what for the results; show the text
                    _, _, rest = rest.partition(" ")
                if cur.outcome != "installed":
                    cur.outcome, cur.detail = tag[2:], rest.strip()
            elif tag == "::result":
                k, _, v = rest.partition("=")
                rep.results[k.strip()] = v.strip()
            elif tag == "::fail":
                rep.failure = rest.strip()
            else:
                rep.tail = (rep.tail + [line])[-TAIL_LINES:]

    t_start = time.monotonic()
    res = group.run(lambda n: _command(n, env_for(n), force), stdin=tarball, on_line=on_line,
                    combine=True)
    end = time.monotonic()
    failed = []
    for rank, r in res.items():
        rep = reports[rank]
        rep.seconds = end - t_start
        marks = starts[rank] + [end]
        for i, st in enumerate(rep.steps):
            st.seconds = 0.0 if rep.skipped else marks[i + 1] - marks[i]
        if not r.ok:
            rep.error = str(r.error) if r.error else f"exit {r.exit_code}"
            rep.failed_step = rep.steps[-1].name if rep.steps else "upload"
            failed.append(rep)
    if failed:
        parts = []
        for rep in failed:
            tail = "\n    ".join(rep.tail[-8:]) or "(no output)"
            why = f"\n  {rep.failure}" if rep.failure else ""
            parts.append(f"node {rep.rank}: step '{rep.failed_step}' failed ({rep.error}).{why}"
                         f"\n  last log lines:\n    {tail}")
        raise RemoteError("Bootstrap failed.\n" + "\n".join(parts),
                          "Fix the cause on the node (the full log is "
                          "~/cloudtrain/bootstrap/<version>/bootstrap.log there), then run "
                          "'cloudtrain up' again: nodes already done are skipped, and installs "
                          "already made are not redone.")
    return reports


# --- for a cluster -----------------------------------------------------------------------------

def provider_node_env(handle: Handle) -> dict[str, str]:
    from cloudtrain.provider.contract import HasNodeEnv

    provider = handle.provider
    return dict(provider.node_env(handle.name)) if isinstance(provider, HasNodeEnv) else {}


def bootstrap_env(handle: Handle, cfg: BootstrapSpec,
                  container: bool = False) -> Callable[[NodeRow], dict[str, str]]:
    # rclone (buckets): installed when missing on cloud nodes, only looked for on local/ssh ones;
    # Docker and the NVIDIA Container Toolkit (a task with container:): the same rule.
    mode = "check" if handle.row.provider in ("local", "ssh") else "install"
    extra = {**provider_node_env(handle), "CLOUDTRAIN_RCLONE": mode}
    if container:
        extra["CLOUDTRAIN_DOCKER"] = mode
    return lambda n: node_env(cfg, n, extra, container)


def run_bootstrap(env: Env, handle: Handle, group: Group, cfg: BootstrapSpec,
                  force: bool = False, container: bool = False) -> None:
    """Bootstrap every node of ``handle`` (skipping those already done), record what each
    found in the state, show it, and refresh the handle's nodes from the state. ``container``:
    the task has ``container:`` (the host side only; the stamp differs, so switching re-runs)."""
    t0 = time.monotonic()
    reports = run(group, bootstrap_env(handle, cfg, container), force=force)
    for rank, rep in sorted(reports.items()):
        r = rep.results
        env.state.set_node_bootstrap(
            handle.name, rank, version=version(), iface=r.get("iface") or None,
            python_bin=r.get("python_bin") or None,
            gpus=int(r["gpus"]) if r.get("gpus", "").isdigit() else None, info=r)
        show_report(env, rep)
    fresh = env.state.get_cluster(handle.name)
    if fresh is not None:
        handle.row.nodes = fresh.nodes
    env.ui.ok(f"Nodes ready in {time.monotonic() - t0:.1f}s")


def show_report(env: Env, rep: NodeReport) -> None:
    """Per node: what each step found or installed, and how long it took."""
    if rep.skipped:
        env.ui.info(f"  node {rep.rank}: already bootstrapped with these scripts; found "
                    + "; ".join(f"{s.name}: {s.detail}" for s in rep.steps
                                if s.outcome == "found" and s.name in ("gpu", "python", "torch")))
        return
    what = ", ".join(s.name for s in rep.installed) or "nothing"
    env.ui.info(f"  node {rep.rank}: bootstrapped in {rep.seconds:.1f}s, installed {what}")
    width = max((len(s.name) for s in rep.steps), default=0)
    for s in rep.steps:
        word = {"found": "found", "installed": "INSTALLED", "skip": "skipped"}.get(s.outcome, "done")
        env.ui.info(f"    {s.name:<{width}}  {s.seconds:6.2f}s  {word:<9}  {s.detail}".rstrip())
