"""The task's image on every node: found where it is already, pulled where it is not (all
nodes at once), and the digest every node runs, which must be the same on all of them.

The first version here (scaffold for the containers issue) looks the image up with
``docker image inspect`` and pulls a missing one with ``docker pull``; the pull with progress
and registry credentials replaces the pulling half."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cloudtrain.errors import RemoteError, UserError
from cloudtrain.remote import Group, bash

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.containers.spec import ContainerSpec
    from cloudtrain.context import Env


@dataclass(frozen=True)
class NodeImage:
    """The image as one node has it."""

    rank: int
    image_id: str
    """The local image ID (``sha256:`` of its config), what ``docker run`` is given."""
    digest: str
    """``NAME@sha256:...`` (the registry's manifest digest) when it came from a registry,
    else the image ID (an image built or imported on the node has no repository digest)."""
    pulled: bool = False
    """cloudtrain pulled it now (it was not on the node before)."""
    seconds: float = 0.0


@dataclass(frozen=True)
class ImageOnNodes:
    """The one image every node of the cluster runs."""

    image: str
    digest: str
    image_id: str
    nodes: dict[int, NodeImage] = field(default_factory=dict)


_INSPECT = "docker image inspect --format '{{.Id}} {{range .RepoDigests}}{{.}} {{end}}' "


def _look_and_pull(image: str) -> str:
    q = shlex.quote(image)
    return bash(
        f"out=$({_INSPECT}{q} 2>/dev/null) && {{ echo \"::image present $out\"; exit 0; }}\n"
        f"docker pull -q {q} >/dev/null || exit $?\n"
        f"echo \"::image pulled $({_INSPECT}{q})\"\n")


def _node_image(rank: int, image: str, stdout: str) -> NodeImage:
    for line in stdout.splitlines():
        if line.startswith("::image "):
            parts = line.split()
            pulled, image_id, repo_digests = parts[1] == "pulled", parts[2], parts[3:]
            name = image.split("@", 1)[0].rsplit(":", 1)[0] if "/" in image or ":" in image \
                else image
            digest = next((d for d in repo_digests if d.split("@", 1)[0] == name),
                          repo_digests[0] if repo_digests else image_id)
            return NodeImage(rank, image_id, digest, pulled)
    raise RemoteError(f"node {rank}: no answer about image {image}",
                      "Check that Docker runs there ('docker info').")


def ensure_image(env: Env, handle: Handle, group: Group, spec: ContainerSpec) -> ImageOnNodes:
    """The image on every node (pulled where missing, all nodes at once). Raises
    :class:`RemoteError` naming the node where it could not be had, :class:`UserError` when
    the nodes do not all run the same digest."""
    res = group.run(_look_and_pull(spec.image), timeout=3600)
    bad = res.failed
    if bad:
        r = bad[0]
        why = (r.stderr or r.stdout or str(r.error or "")).strip().splitlines()[-1:] or ["no output"]
        raise RemoteError(f"node {r.rank}: could not pull {spec.image}: {why[0][:300]}",
                          "Check the image name and that the node reaches its registry.")
    nodes = {rank: _node_image(rank, spec.image, r.stdout) for rank, r in res.items()}
    first = nodes[min(nodes)]
    for n in nodes.values():
        if n.digest != first.digest:
            raise UserError(
                f"node {n.rank} runs image {n.digest}, node {first.rank} runs {first.digest}: "
                f"the nodes of '{handle.name}' do not run the same {spec.image}.",
                "Pin the image by digest (container.image: REPO@sha256:...) and launch again.")
    return ImageOnNodes(spec.image, first.digest, first.image_id, nodes)
