"""A cloud provider's own note about one cluster: ``$CLOUDTRAIN_HOME/clusters/<name>/<provider>.json``
(regions tried, project or subscription, placement attempts). A hint that speeds things up
and explains what happened, never the truth: the cloud, searched by tag, is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cloudtrain.provider.contract import ProviderContext


class ClusterRecord:
    def __init__(self, ctx: ProviderContext, provider: str) -> None:
        self.ctx = ctx
        self.provider = provider

    def path(self, cluster: str) -> Path:
        return self.ctx.cluster_dir(cluster) / f"{self.provider}.json"

    def read(self, cluster: str) -> dict[str, Any] | None:
        """The note, or None when there is none (or it cannot be read)."""
        try:
            data = json.loads(self.path(cluster).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def update(self, cluster: str, base: dict[str, Any] | None = None, **updates: Any) -> None:
        """Merge ``updates`` into the note (starting from ``base`` when there is none), written
        atomically."""
        from cloudtrain.ownership import RECORD_MARK

        rec = self.read(cluster)
        if rec is None:   # a new note: its cluster's resources carry this home's owner mark
            rec = {**(base or {}), RECORD_MARK: True}
        rec.update(updates)
        f = self.path(cluster)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        tmp.replace(f)

    def every(self) -> list[dict[str, Any]]:
        """The notes of every cluster of this home (those that can be read), by name: where
        gc looks beyond the defaults (regions, projects, subscriptions)."""
        folder = self.ctx.home / "clusters"
        out = []
        for f in sorted(folder.glob(f"*/{self.provider}.json")) if folder.is_dir() else []:
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                out.append(data)
        return out
