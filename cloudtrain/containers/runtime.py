"""One long-lived container per node (docs/containers.md): started at a task's first launch
with ``container:``, reused by the next while its image and options are the same, replaced when
they change, removed by ``down``. Jobs run in it with ``docker exec`` from the host
(:mod:`cloudtrain.containers.wrap`).

A warm launch starts no docker process of its own: ``ensure`` leaves ``<node root>/.container``
("NAME REQ KEEPER_PID KEEPER_START DIGEST UID:GID SHELL API"), the launch's prep round trip
reads it with bash builtins (with the keeper's start time from ``/proc``), and :func:`ready`
skips the image lookup and ``ensure`` when every node's file names this cluster's container,
this request and a keeper that still runs; each job's ``docker exec`` reads the user, the
image's shell and the Engine's API version from it."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from cloudtrain.cluster import cluster_uid
from cloudtrain.errors import RemoteError, UserError
from cloudtrain.pipeline import bootstrap, sync

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.containers.pull import ImageOnNodes
    from cloudtrain.containers.spec import ContainerSpec
    from cloudtrain.context import Env
    from cloudtrain.pipeline.prep import NodeFacts
    from cloudtrain.remote import Group
    from cloudtrain.schema import NodeRow
    from cloudtrain.taskmodel import Task

KEEPER_VERSION = "1"
"""Part of every spec hash: a new keeper (how cloudtrain starts the container) replaces the
containers of an older one."""
RECORD = "containers.json"

NO_DOCKER_HINT = ("Install Docker Engine on the node (https://docs.docker.com/engine/install/) "
                  "and let the SSH user run it (its 'docker' group), or remove 'container:' to "
                  "run on the host; on a cloud node bootstrap installs it.")


@dataclass(frozen=True)
class Boxes:
    """The containers a launch's jobs run in: the name per rank, and the digest of the image
    they run (read back from the nodes on a warm launch)."""

    names: dict[int, str]
    digest: str
    reused: bool
    started: frozenset[int] = frozenset()
    """Ranks whose container was started now: what a setup did in an older one is gone."""


def container_name(uid: str, rank: int) -> str:
    return f"ct-{uid}-{rank}"


def mounts(node: NodeRow, task: Task) -> list[str]:
    """Absolute file_mount targets: bind-mounted at the same path (the node's $HOME, which
    holds the workdir and every relative target, is mounted anyway)."""
    return sorted({t for t in (sync.mount_target(node, m) for m in task.file_mounts)
                   if t.startswith("/")})


def request_hash(spec: ContainerSpec, node: NodeRow, targets: list[str]) -> str:
    """What the laptop asks for on ``node`` (``targets``: the bind-mounted file_mount
    targets), known without asking docker: a warm launch compares it with the one in the
    node's ``.container``."""
    parts = [KEEPER_VERSION, spec.image, json.dumps(list(spec.run_options)),
             str(spec.privileged), ":".join(targets), str(node.gpus or 0)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def spec_hash(request: str, image_id: str) -> str:
    """The ``cloudtrain-spec`` label: the request and the image ID the container runs."""
    return hashlib.sha256(f"{request}\0{image_id}".encode()).hexdigest()[:16]


def warm_digest(fact: NodeFacts, name: str, request: str) -> str | None:
    """The digest the node's running container was started with, when ``.container`` names
    ``name`` and ``request`` and its keeper still runs (its start time unchanged); else None."""
    parts = fact.container.split()
    if len(parts) < 5 or not fact.keeper_start:
        return None
    if parts[0] != name or parts[1] != request or parts[3] != fact.keeper_start:
        return None
    return parts[4]


def ready(env: Env, handle: Handle, group: Group, task: Task,
          prep: Mapping[int, NodeFacts]) -> Boxes | None:
    """The task's containers, one per node, running (None: the task has no ``container:``).
    Reused as they run when every node says so; else the image is found or pulled on every
    node and each container is reused or replaced by ``ensure``."""
    spec = task.container
    if spec is None:
        forget(env, handle.name)
        return None
    no_docker = [rank for rank, f in sorted(prep.items()) if not f.docker]
    if no_docker:
        raise UserError(f"container: node(s) {no_docker} of '{handle.name}' have no Docker "
                        "('docker' is not on the SSH user's PATH there).", NO_DOCKER_HINT)
    uid = cluster_uid(env, handle.name)
    names = {n.rank: container_name(uid, n.rank) for n in handle.nodes}
    digests = [warm_digest(prep[n.rank], names[n.rank], request_hash(spec, n, mounts(n, task)))
               for n in handle.nodes]
    if all(d is not None for d in digests) and len(set(digests)) == 1:
        boxes = Boxes(names, str(digests[0]), reused=True)
    else:
        from cloudtrain.containers.pull import ensure_image

        image = ensure_image(env, handle, group, spec)
        names, started = _ensure(env, handle, group, spec, image, task)
        boxes = Boxes(names, image.digest, reused=False, started=frozenset(started))
    remember(env, handle.name, boxes)
    return boxes


def ensure(env: Env, handle: Handle, group: Group, spec: ContainerSpec, image: ImageOnNodes,
           task: Task | None = None) -> dict[int, str]:
    """Every node's container running ``image`` with the task's options: the one there is
    kept when its spec label matches, else it is replaced. Returns the name per rank."""
    return _ensure(env, handle, group, spec, image, task)[0]


def _ensure(env: Env, handle: Handle, group: Group, spec: ContainerSpec, image: ImageOnNodes,
            task: Task | None) -> tuple[dict[int, str], set[int]]:
    """:func:`ensure`, and the ranks whose container was started now."""
    uid = cluster_uid(env, handle.name)
    names = {n.rank: container_name(uid, n.rank) for n in handle.nodes}

    def cmd(n: NodeRow) -> str:
        targets = mounts(n, task) if task is not None else []
        req = request_hash(spec, n, targets)
        return bootstrap.inline(
            "ctcontainer.sh", "ensure", n.root_dir, names[n.rank], spec_hash(req, image.image_id),
            req, image.digest, str(n.gpus or 0), image.image_id, handle.name, uid, str(n.rank),
            ":".join(targets), "--", *(["--privileged"] if spec.privileged and
                                       "--privileged" not in spec.run_options else []),
            *spec.run_options)

    res = group.run(cmd, timeout=300)
    for r in res.failed:
        why = (r.stderr or r.stdout or str(r.error or "")).strip().splitlines()
        if r.exit_code == 3:
            raise UserError(f"container: node {r.rank} of '{handle.name}' has no Docker.",
                            NO_DOCKER_HINT)
        if r.exit_code == 4:
            raise UserError(
                f"container: node {r.rank} of '{handle.name}' has GPUs, but its Docker has no "
                "NVIDIA runtime, so the container would not see them.",
                "Install the NVIDIA Container Toolkit there (https://docs.nvidia.com/datacenter/"
                "cloud-native/container-toolkit/install-guide.html) and restart Docker; on a "
                "cloud node bootstrap installs it.")
        if r.exit_code == 5:
            raise RemoteError(
                f"container: the container of node {r.rank} ended as soon as it started.",
                f"cloudtrain keeps it running with /bin/sh: check that {spec.image} has "
                "/bin/sh ('docker run --rm --entrypoint /bin/sh IMAGE -c true').")
        raise RemoteError(f"container: starting the container on node {r.rank} failed: "
                          + (why[-1][:300] if why else f"exit {r.exit_code}"),
                          "Check the run_options and that Docker runs there ('docker info').")
    started = {rank for rank, r in res.items()
               if any(ln.startswith("::container started ") for ln in r.stdout.splitlines())}
    return names, started


# --- the laptop's record: which containers a cluster's jobs run in (exec, ssh, down) --------

def _record(env: Env, name: str) -> Path:
    return env.pctx.cluster_dir(name) / RECORD


def remember(env: Env, name: str, boxes: Boxes) -> None:
    _write(env, name, {"names": {str(k): v for k, v in boxes.names.items()},
                       "digest": boxes.digest, "current": True})


def forget(env: Env, name: str) -> None:
    """A launch without ``container:``: later ``exec`` runs on the host (the containers stay
    until ``down``, which still finds the record)."""
    data = _read(env, name)
    if data is not None and data.get("current"):
        _write(env, name, dict(data, current=False))


def _read(env: Env, name: str) -> dict | None:
    try:
        data = json.loads(_record(env, name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(env: Env, name: str, data: dict) -> None:
    p = _record(env, name)
    text = json.dumps(data)
    try:
        if p.exists() and p.read_text() == text:
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, p)
    except OSError as exc:
        env.ui.warn(f"could not record the cluster's containers in {p}: {exc}")


def recorded(env: Env, name: str) -> dict[int, str]:
    """The container per rank the cluster's last launch ran in ({}: none)."""
    data = _read(env, name)
    try:
        if data is None or not data.get("current"):
            return {}
        return {int(k): str(v) for k, v in data["names"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


def ran_containers(env: Env, name: str) -> bool:
    """Whether the cluster ever ran a container (``down`` removes them)."""
    return _record(env, name).exists()


def remove_command(uid: str) -> str:
    """Run on a node: remove the cluster's containers (by label), print ``::left N``."""
    return bootstrap.inline("ctcontainer.sh", "remove", uid)


def remove(env: Env, handle: Handle) -> None:
    """``down``: the cluster's containers removed on every node, found by their
    ``cloudtrain-cluster-id`` label (nothing else of docker's is touched)."""
    from cloudtrain.cluster import connect

    try:
        group = connect(env, handle, timeout=15)
    except Exception as exc:  # noqa: BLE001 - unreachable nodes: said, and down goes on
        env.ui.warn(f"Could not reach every node to remove the cluster's containers: {exc}")
        return
    try:
        res = group.run(remove_command(cluster_uid(env, handle.name)), timeout=120)
    finally:
        group.close()
    for rank, r in sorted(res.items()):
        left = [ln for ln in r.stdout.splitlines() if ln.startswith("::left ")]
        if not r.ok or not left or left[0] != "::left 0":
            env.ui.warn(f"node {rank}: the cluster's containers may remain ('docker ps -a "
                        f"--filter label=cloudtrain-cluster-id={cluster_uid(env, handle.name)}'"
                        " lists them; 'docker rm -f' removes them)")
