"""Reading a sweep from the laptop (docs/sweep.md): ``sweep status``, ``sweep results``,
``sweep cancel``. The head's driver (cloudtrain/node/sweep.py) answers one JSON document
(``status``/``results``); pipeline/sweepdoc.py turns it into typed, frozen records with the
money; this module reads it (from the head, or from the ledger once the cluster is gone) and
renders it (table, JSON, CSV; the plot is pipeline/sweepplot.py)."""

from __future__ import annotations

import csv
import io
import time
from typing import TYPE_CHECKING

from cloudtrain.errors import RemoteError, UserError
from cloudtrain.pipeline import sweepnode
from cloudtrain.pipeline.sweep import find_record
from cloudtrain.pipeline.sweepdoc import Results, from_ledger, keep, parsed
from cloudtrain.schema import SweepRow

if TYPE_CHECKING:
    from cloudtrain.context import Env


def read(env: Env, name: str) -> Results:
    """Sweep ``name``: the driver's document, read from the head and kept in the ledger (the
    sweep's spend and its per-trial rows); once its cluster is gone or stopped, the ledger's
    last reading (the head's own last results when they were kept: sweepdoc.keep_final),
    marked incomplete when it was not the sweep's end."""
    from cloudtrain.cluster import get_handle

    from cloudtrain.pipeline.guard import reconcile

    rec = find_record(env, name)
    if reconcile(env, rec.cluster) is not None:     # nodes that stopped themselves: what the
        rec = find_record(env, name)                # head left was kept (sweepdoc.keep_final)
    why = gone(env, rec)
    if why is not None:
        return from_ledger(rec, env.state.sweep_trials(name), why)
    handle = get_handle(env, rec.cluster)
    group = sweepnode.head_group(env, handle)
    try:
        doc = sweepnode.document(handle, group, "results", name)   # status counts its trials too
    except RemoteError as exc:
        if "no such sweep on this node" not in str(exc):
            raise
        raise never_started(rec) from None
    finally:
        group.close()
    res = parsed(rec, doc)
    keep(env, res)
    return res


def gone(env: Env, rec: SweepRow) -> str | None:
    """Why the sweep's cluster can no longer be read (None: it is up): gone, with the ledger's
    end reason; stopped; or a cluster of that name created after the sweep."""
    row = env.state.get_cluster(rec.cluster)
    if row is not None and row.created_at <= rec.started_at + 1 and \
            row.status in ("UP", "DEGRADED"):
        return None
    if row is not None and row.created_at <= rec.started_at + 1:
        return f"the cluster is {row.status.lower()}"
    ended = [u for u in env.state.usage(cluster=rec.cluster)
             if u.ended_at is not None and u.ended_at >= rec.started_at]
    last = ended[-1].end_reason if ended else None
    return f"the cluster went down ({last})" if last else "the cluster went down"


def never_started(rec: SweepRow) -> UserError:
    return UserError(
        f"Sweep {rec.name} was recorded on this machine, but its driver never started on the "
        f"head of cluster '{rec.cluster}' (the command that started it was stopped first), so "
        "it has no trials.",
        "Start it again with 'cloudtrain sweep SWEEP.yaml' (the same file, so the same name).")


def cancel(env: Env, name: str) -> str:
    """Stop the sweep on the head (running trials get SIGTERM and their grace)."""
    from cloudtrain.cluster import get_handle

    rec = find_record(env, name)
    handle = get_handle(env, rec.cluster)
    group = sweepnode.head_group(env, handle)
    try:
        said = sweepnode.on_head(handle, group, "cancel", name).strip()
    finally:
        group.close()
    return cancel_words(name, said)


def cancel_words(name: str, said: str) -> str:
    """What ``sweep cancel`` says: the driver's stop reason and the trials it stops (its
    JSON answer), or its words as they are."""
    import json

    try:
        doc = json.loads(said.splitlines()[-1]) if said else {}
    except json.JSONDecodeError:
        return said
    if not isinstance(doc, dict) or not doc.get("stopped"):
        return said or f"Sweep {name} cancelled."
    running = (doc.get("counts") or {}).get("running") if isinstance(doc.get("counts"), dict) \
        else None
    tail = f"; {running} running trial(s) get SIGTERM and their stop_grace" if running else ""
    return f"Sweep {name} stopped: {doc['stopped']}{tail}."


def bar(done: int, total: int, width: int = 30) -> str:
    total = max(total, 1)
    filled = min(width, round(width * done / total))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def status_lines(res: Results) -> list[str]:
    """``sweep status``: the counts, the progress bar, the best, the money; why it stopped;
    and, once its cluster is gone, whether this is its end or only the last reading."""
    total = int(res.record.spec.get("trials") or len(res.trials))
    ended = res.count("complete") + res.count("pruned") + res.count("fail")
    lines = [f"Sweep {res.record.name} on cluster {res.record.cluster}"
             + (" (finished)" if res.finished else " (INCOMPLETE)" if res.incomplete else ""),
             bar(ended, total),
             "  ".join(f"{s}: {res.count(s)}" for s in ("running", "complete", "pruned", "fail"))]
    if res.stopped:
        lines.append(f"stopped: {res.stopped}")
    best = next((t for t in res.trials if t.number == res.best), None)
    if best is not None:
        lines.append(f"best: trial {best.number} = {best.value} with {best.params}")
    lines.append(f"spent: {money(res.spent_usd)}, estimate to the end: {money(res.estimate_usd)}")
    if res.gone is not None:
        lines.append(gone_words(res))
    return lines


def gone_words(res: Results) -> str:
    why = res.gone or "the cluster is gone"
    why = why[0].upper() + why[1:]
    when = "never" if res.as_of is None else time.strftime("%Y-%m-%d %H:%M:%S",
                                                           time.localtime(res.as_of))
    if res.finished:
        return f"{why}; these are the sweep's final results " \
               f"(as of {when})."
    return (f"{why} before its end was read: these are the trials "
            f"as of {when}, and what happened after that went with the nodes (the trials "
            "shown running were not seen to end). Read 'cloudtrain sweep status' while the "
            "cluster is up to keep the end.")


def money(x: float | None) -> str:
    return "unknown" if x is None else f"${x:.4f}"


COLUMNS = ("trial", "state", "value", "duration_s", "gpus", "node", "cost_usd", "params")


def rows(res: Results) -> list[list[str]]:
    """One row per trial (the best marked), for the table and the CSV."""
    out = []
    for t in res.trials:
        mark = "*" if t.number == res.best else ""
        out.append([f"{t.number}{mark}", t.state, "" if t.value is None else f"{t.value:g}",
                    "" if t.duration_s is None else f"{t.duration_s:.1f}", ",".join(t.gpus),
                    t.node or "",
                    "" if t.cost_usd is None else f"{t.cost_usd:.6f}",
                    " ".join(f"{k}={v}" for k, v in sorted(t.params.items()))])
    return out


def table(res: Results) -> str:
    body = [list(COLUMNS)] + rows(res)
    widths = [max(len(r[i]) for r in body) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body)


def csv_text(res: Results) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    w.writerows(rows(res))
    return buf.getvalue()
