"""What ``status`` shows of a cluster's image: the image and digest its last launch with a
container ran (the launch's ledger entry, state.launches), as a line and in ``--json``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloudtrain.schema import LaunchRow
    from cloudtrain.state import State


def last_image(state: State, cluster: str) -> LaunchRow | None:
    """The cluster's last launch that ran a container image (None: none did)."""
    return next((r for r in reversed(state.launches(cluster)) if r.image), None)


def image_view(state: State, cluster: str) -> dict[str, Any] | None:
    """``status --json``'s ``image``: image, digest (null: not known), job_id, started_at."""
    r = last_image(state, cluster)
    if r is None:
        return None
    return {"image": r.image, "digest": r.image_digest, "job_id": r.job_id,
            "started_at": r.started_at}


def image_line(state: State, cluster: str) -> str | None:
    """``NAME: image IMAGE, digest D (every node), last launch JOB`` for ``status``."""
    v = image_view(state, cluster)
    if v is None:
        return None
    digest = v["digest"] or "not recorded"
    return f"{cluster}: image {v['image']}, digest {digest} on every node (launch {v['job_id']})"


def with_images(state: State, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``status --json`` entry with its ``image`` (see :func:`image_view`)."""
    for e in entries:
        if "name" in e and "provider" in e:
            e["image"] = image_view(state, e["name"])
    return entries
