"""A cloud provider's own note about one cluster: ``$CLOUDTRAIN_HOME/clusters/<name>/<provider>.json``
(regions tried, project or subscription, placement attempts). A hint that speeds things up
and explains what happened, never the truth: the cloud, searched by tag, is."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from cloudtrain.provider.contract import ProviderContext
from cloudtrain.provider.failover import Attempt

COMMON = ("attempts", "user", "public_ip", "num_nodes", "region", "zone", "instance_type")
"""The keys every cloud writes with the same meaning; the others are the cloud's own."""


@dataclass(frozen=True)
class CloudRecord:
    """One cluster's record file, read: what every cloud writes (typed; ``instance_type`` is
    the size on Azure, which older records called ``size``) and the cloud's own keys as it
    wrote them (``own``: AWS's regions, GCP's project and network, Azure's subscription and
    group, host keys, ...). A hint, never the truth."""

    attempts: tuple[Attempt, ...] = ()
    user: str | None = None
    public_ip: bool = True
    num_nodes: int = 0
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    own: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CloudRecord:
        """The record of a file's JSON object (keys it lacks take their defaults)."""
        return cls(tuple(Attempt.from_dict(a) for a in d.get("attempts") or []
                         if isinstance(a, dict)),
                   str(d["user"]) if d.get("user") else None, bool(d.get("public_ip", True)),
                   int(d.get("num_nodes") or 0), d.get("region"), d.get("zone"),
                   d.get("instance_type") or d.get("size"),
                   {k: v for k, v in d.items() if k not in COMMON})

    def as_dict(self) -> dict[str, Any]:
        """The JSON object the file holds (the common keys only where they are set)."""
        common = {"attempts": [a.as_dict() for a in self.attempts], "user": self.user,
                  "public_ip": self.public_ip, "num_nodes": self.num_nodes or None,
                  "region": self.region, "zone": self.zone,
                  "instance_type": self.instance_type}
        return {**self.own, **{k: v for k, v in common.items() if v not in (None, [])}}


class ClusterRecord:
    def __init__(self, ctx: ProviderContext, provider: str) -> None:
        self.ctx = ctx
        self.provider = provider

    def path(self, cluster: str) -> Path:
        return self.ctx.cluster_dir(cluster) / f"{self.provider}.json"

    def note(self, cluster: str) -> CloudRecord:
        """The note, typed (an empty one when there is none or it cannot be read)."""
        return CloudRecord.from_dict(self.read(cluster) or {})

    def read(self, cluster: str) -> dict[str, Any] | None:
        """The note as the file holds it, or None when there is none (or it cannot be
        read)."""
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
