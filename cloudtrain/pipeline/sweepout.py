"""A sweep's trials' outputs back on this machine (docs/sweep.md, "Outputs"): the task's
``outputs:`` of every ended trial, from the trial's own workdir on the node that ran it
(``ROOT/.cloudtrain/sweeps/NAME/trials/N/work``), into ``OUTPUTS_DIR/sweep-NAME/trial-N/``,
with the one outputs pull there is (``sync.pull``: the node is untrusted, nothing lands
outside the folder). The best trial's folder is named by the link ``best``.

The sweep's outputs are recorded like a job's (table ``outputs``, job ``sweep-NAME``), so a
cluster that goes down without them says so (docs/storage.md, "Outputs"). A trial's folder
appears only once its pull is whole (pulled into ``.trial-N.*.part``, then renamed): a trial
whose folder is here is not pulled again. ``sweep results`` and ``sweep outputs`` pull the
trials that ended since; ``down`` pulls them before it removes the nodes."""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from cloudtrain.errors import CloudtrainError, RemoteError, UserError
from cloudtrain.pipeline import sweepnode, sync
from cloudtrain.remote import Group, bash
from cloudtrain.schema import NodeRow, OutputsRow

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env
    from cloudtrain.pipeline.outputs import Unpulled
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import

ENDED = ("complete", "pruned", "fail")
LIST_BYTES = 1 << 20
"""At most this much of a node's list of trial folders is read (a node is untrusted)."""


def record(env: Env, cluster: str, name: str, task: Task) -> None:
    """When the sweep starts: its outputs (the task's ``outputs:``), to come back under
    ``OUTPUTS_DIR/sweep-NAME``; what an earlier sweep of that name left there is set aside
    first (a new study numbers its trials from 0 again: its trial-0 is not the old one)."""
    if task.outputs:
        top = task.outputs_path() / f"sweep-{name}"
        aside = set_aside(top)
        if aside is not None:
            env.ui.warn(f"{top} held an earlier sweep's outputs: moved to {aside}")
        env.state.add_outputs(OutputsRow(sweepnode.driver_job(name), cluster, list(task.outputs),
                                         False, str(top), time.time()))


def set_aside(top: Path) -> Path | None:
    """Rename a non-empty ``top`` to ``top.YYYYmmdd-HHMMSS[-N]`` (never over anything)."""
    if top.is_symlink() or not top.is_dir() or not any(top.iterdir()):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        aside = top.with_name(f"{top.name}.{stamp}" + (f"-{i}" if i else ""))
        if not aside.exists() and not aside.is_symlink():
            os.rename(top, aside)
            return aside
    raise UserError(f"Cannot set {top} aside: too many earlier copies beside it.",
                    f"Move the earlier sweep's outputs out of {top.parent}.")


def row_of(env: Env, cluster: str, name: str) -> OutputsRow | None:
    job = sweepnode.driver_job(name)
    return next((r for r in env.state.outputs(cluster) if r.job_id == job), None)


@dataclass(frozen=True)
class Fetched:
    """What ``OUTPUTS_DIR/sweep-NAME`` holds after a pull."""

    folder: Path
    pulled: tuple[int, ...]
    """The trials pulled just now."""
    here: tuple[int, ...]
    """Every trial whose folder is here (pulled now or before)."""
    best: Path | None
    """The best trial's folder, when it is here."""
    whole: bool
    """Every ended trial is here and every node answered."""


def trial_base(node: NodeRow, name: str, number: int) -> str:
    """The trial's own workdir on ``node`` (the driver's ``trials/N/work``)."""
    return str(PurePosixPath(node.root_dir, ".cloudtrain", "sweeps", name, "trials", str(number),
                             "work"))


def where_trials_ran(handle: Handle, group: Group, name: str) -> dict[int, NodeRow]:
    """Each trial's node: the node that holds its folder (trial numbers are the study's, one
    node runs each). A node's answer is read up to LIST_BYTES, numbers only."""
    def cmd(n: NodeRow) -> str:
        d = shlex.quote(str(PurePosixPath(n.root_dir, ".cloudtrain", "sweeps", name, "trials")))
        return bash(f"d={d}; case $d in /*) ;; *) d=$HOME/$d ;; esac; "
                    f"ls -1 \"$d\" 2>/dev/null | head -c {LIST_BYTES}; true")

    out: dict[int, NodeRow] = {}
    for n in handle.nodes:
        res = group.run(cmd, ranks=[n.rank], timeout=60)[n.rank]
        if not res.ok:
            raise RemoteError(f"node {n.rank} did not list the sweep's trials: "
                              f"{res.stderr.strip()[-300:]}", "")
        for word in res.stdout[:LIST_BYTES].split():
            if word.isdigit() and len(word) < 10:
                out.setdefault(int(word), n)
    return out


def pull_trial(env: Env, handle: Handle, row: OutputsRow, node: NodeRow, number: int,
               name: str) -> bool:
    """One trial's outputs into ``trial-N`` (through its own ``.trial-N.*.part`` folder, so
    two pulls at once never mix): True when whole."""
    top = Path(row.dest)
    top.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".trial-{number}.", suffix=".part", dir=top))
    final = top / f"trial-{number}"
    base = trial_base(node, name, number)
    for rel in row.paths:
        try:
            got = sync.pull(node, handle.keys, rel, part, base=base)
        except RemoteError as exc:
            env.ui.warn(f"trial {number}: {exc.message}")
            shutil.rmtree(part, ignore_errors=True)
            return False
        for what in got.skipped:
            env.ui.warn(f"trial {number}: output '{rel}' on node {node.rank}: not copied: {what}")
    try:
        os.rename(part, final)
    except OSError:                  # another pull (a second command) renamed its copy first
        shutil.rmtree(part, ignore_errors=True)
        return final.is_dir()
    return True


def name_best(top: Path, best: int | None) -> Path | None:
    """``best`` -> ``trial-N``, replaced at once (a link we made, never followed here)."""
    link = top / "best"
    if best is None or not (top / f"trial-{best}").is_dir():
        return None
    tmp = top / ".best.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(f"trial-{best}", tmp)
    if link.exists() and not link.is_symlink():
        raise UserError(f"'{link}' is not the link cloudtrain makes to the best trial.",
                        f"Move it out of {top}: the best trial's folder is named by it.")
    os.replace(tmp, link)
    return top / f"trial-{best}"


def ended_and_best(doc: dict[str, Any]) -> tuple[list[int], int | None]:
    """The ended trials and the best one in the driver's ``results`` document."""
    listed = doc.get("trials_list", doc.get("trials"))
    ended = [int(t["number"]) for t in (listed if isinstance(listed, list) else [])
             if isinstance(t, dict) and t.get("state") in ENDED
             and isinstance(t.get("number"), int) and not isinstance(t.get("number"), bool)]
    best = doc.get("best")
    best = best.get("number") if isinstance(best, dict) else best
    return ended, best if isinstance(best, int) and not isinstance(best, bool) else None


def fetch(env: Env, handle: Handle, group: Group, row: OutputsRow,
          doc: dict[str, Any]) -> Fetched:
    """Pull every ended trial of the driver's document ``doc`` that is not here yet; name
    the best."""
    name = row.job_id.removeprefix("sweep-")
    top = Path(row.dest)
    ended, best = ended_and_best(doc)
    here = {int(p.name[6:]) for p in top.glob("trial-*") if p.name[6:].isdigit()} \
        if top.is_dir() else set()
    todo = [n for n in sorted(ended) if n not in here]
    nodes = where_trials_ran(handle, group, name) if todo else {}
    pulled: list[int] = []
    whole = True
    for number in todo:
        node = nodes.get(number)
        if node is None:
            env.ui.warn(f"trial {number}: no node holds its folder; its outputs are lost")
            whole = False
        elif pull_trial(env, handle, row, node, number, name):
            pulled.append(number)
        else:
            whole = False
    here |= set(pulled)
    if pulled:
        env.ui.ok(f"Outputs of trial(s) {', '.join(map(str, pulled))} in {top}")
    return Fetched(top, tuple(pulled), tuple(sorted(here)), name_best(top, best), whole)


def pull_now(env: Env, cluster: str, name: str, doc: dict[str, Any] | None = None) -> Fetched | None:
    """``sweep results``/``sweep outputs``: the trials that ended since the last pull (None:
    the task declares no outputs). ``doc``: the driver's ``results`` document when the
    caller has read it. Once the sweep has finished and every trial is here, the sweep's
    outputs are marked pulled."""
    from cloudtrain.cluster import connect, get_handle

    row = row_of(env, cluster, name)
    if row is None:
        return None
    if env.state.get_cluster(cluster) is None:      # gone: what came back before is all
        top = Path(row.dest)
        here = tuple(sorted(int(p.name[6:]) for p in top.glob("trial-*") if p.name[6:].isdigit()))
        return Fetched(top, (), here, name_best(top, ended_and_best(doc or {})[1]),
                       row.pulled_at is not None)
    handle = get_handle(env, cluster)
    group = connect(env, handle, timeout=30)
    try:
        if doc is None:
            doc = sweepnode.document(handle, group, "results", name)
        got = fetch(env, handle, group, row, doc)
    finally:
        group.close()
    if got.whole and doc.get("finished"):
        env.state.mark_outputs([row.job_id], pulled=True)
    return got


def before_down(env: Env, cluster: str, how: Unpulled) -> None:
    """Before ``down`` removes the nodes: the outputs of the cluster's sweeps never pulled,
    pulled (every ended trial), or the teardown refused (exit 2) when they cannot be, as
    for a job's (:func:`cloudtrain.pipeline.outputs.before_down`): ``try`` goes ahead
    without them, ``discard`` does not pull."""
    from cloudtrain.pipeline.outputs import unpulled

    rows = [r for r in unpulled(env, cluster)
            if r.job_id.startswith("sweep-") and env.state.get_sweep(r.job_id[6:]) is not None]
    if not rows or how == "discard":
        return
    for row in rows:
        name = row.job_id[6:]
        env.ui.warn(f"'{cluster}': the outputs of sweep {name} were never all pulled: pulling "
                    "them before the teardown")
        try:
            got = pull_now(env, cluster, name)
            if got is not None and not got.whole:
                raise RemoteError("some trials' outputs could not be pulled (above).", "")
        except CloudtrainError as exc:
            if how == "try":
                continue
            raise UserError(
                f"'{cluster}': the outputs of sweep {name} were never all pulled, and pulling "
                f"them failed: {exc.message} Nothing was torn down.",
                f"Run 'cloudtrain down {cluster}' again once its nodes answer, or tear it down "
                f"without them: cloudtrain down {cluster} --discard-outputs") from None
        env.state.mark_outputs([row.job_id], pulled=True)


def after_results(env: Env, cluster: str, name: str, doc: dict[str, Any]) -> str | None:
    """``sweep results``: the trials that ended since, pulled; the line naming the best
    trial's folder (None: no outputs declared, or the best's not here). A pull that fails
    is a warning: the results are still shown."""
    try:
        got = pull_now(env, cluster, name, doc)
    except CloudtrainError as exc:
        env.ui.warn(f"the trials' outputs were not pulled: {exc.message}")
        return None
    return None if got is None or got.best is None else \
        f"Best trial's outputs: {got.best} (also {got.folder / 'best'})"


def pull_command(env: Env, cluster: str, name: str, doc: dict[str, Any] | None) -> str:
    """``sweep outputs NAME``: pull the trials that ended since; what the folder holds."""
    got = pull_now(env, cluster, name, doc)
    if got is None:
        raise UserError(f"The task of sweep '{name}' declares no outputs: there is nothing to "
                        "pull.", "List the paths each trial writes under 'outputs:' in the "
                        "task file (e.g. outputs: [outputs/]) for the next sweep.")
    best = f"; the best trial's: {got.best} (link {got.folder / 'best'})" if got.best else ""
    return (f"Outputs of {len(got.here)} trial(s) in {got.folder} ({len(got.pulled)} pulled "
            f"now){best}")
