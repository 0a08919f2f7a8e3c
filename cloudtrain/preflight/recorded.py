"""What ``status`` shows of a cluster's preflight: the verdict its last guarded launch
recorded (the launch's ledger entry, ``launches.preflight``), as a line and in ``--json``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloudtrain.state import State


def preflight_view(state: State, cluster: str) -> dict[str, Any] | None:
    """``status --json``'s ``preflight``: the last guarded launch's job_id, status and the
    verdict (ok, paragraph, transport, busbw_gbps ...); null when no launch had one."""
    row = next((r for r in reversed(state.launches(cluster)) if r.preflight), None)
    if row is None or row.preflight is None:
        return None
    try:
        verdict = json.loads(row.preflight)
    except ValueError:
        return None
    return {"job_id": row.job_id, "launch_status": row.status,
            **(verdict if isinstance(verdict, dict) else {})}


def preflight_line(state: State, cluster: str) -> str | None:
    v = preflight_view(state, cluster)
    if v is None:
        return None
    word = "passed" if v.get("ok") else "FAILED"
    return f"{cluster}: preflight {word} before launch {v['job_id']}: {v.get('paragraph', '')}"


def with_preflight(state: State, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for e in entries:
        if "name" in e and "provider" in e:
            e["preflight"] = preflight_view(state, e["name"])
    return entries
