"""Before ``cost-report`` sums (docs/cost.md): the clusters the state says are running are
checked with their provider, the way ``status --refresh`` does (``guard.reconcile``: a cluster
whose nodes all stopped themselves gets its ledger closed when they stopped, and is removed or
kept as STOPPED), so a total never counts hours after the nodes stopped. With ``--offline``, or
for a provider that cannot be asked now, the cluster is "unconfirmed": counted up to when its
recorded rules must have stopped it (cloudtrain/pipeline/stopwhen.py), else up to now."""

from __future__ import annotations

import time

from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError

LIVE = ("UP", "DEGRADED", "INIT")


def confirm(env: Env, offline: bool) -> dict[str, float | None]:
    """Reconcile the live clusters (unless ``offline``); returns those left unconfirmed, each
    with when its rules stopped it (None: no rule tells, counted up to now)."""
    from cloudtrain.pipeline import guard as node_guard, lastseen

    loose: dict[str, float | None] = {}
    now = time.time()
    for row in env.state.list_clusters():
        if row.status not in LIVE:
            continue
        if not offline:
            try:
                node_guard.reconcile(env, row.name)
                continue
            except (CloudtrainError, ImportError) as exc:
                env.ui.warn(f"'{row.name}': could not ask {row.provider} ({exc}); its cost is "
                            "unconfirmed")
        stop = lastseen.expected_stop(env, row.name, row.provider, row.created_at or 0.0)
        loose[row.name] = stop[0] if stop is not None and stop[0] <= now else None
    return loose
