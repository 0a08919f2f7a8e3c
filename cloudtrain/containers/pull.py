"""The task's image on every node: found where it is already, pulled where it is not (all
nodes at once, each node's progress shown), and the digest every node runs, which must be the
same on all of them (docs/containers.md, "Pulls, registry credentials and digests").

The pull is Docker's own: ``cloudtrain/node/dockerpull.py`` asks the node's Docker Engine
(``POST /images/create`` on its socket) and streams its progress back. Registry credentials
are read from the laptop's environment and travel as the Engine API's ``X-Registry-Auth``
header on the SSH session's stdin: never in an argument, the environment or a file on the
node. Pull policy: only when the image is missing on the node (``docker run --pull missing``);
a digest-pinned image found on the node is never pulled again.

What cloudtrain pulled is recorded on the node (``<node root>/pulled-images``) so that
``down`` on a host we do not power off removes it again (:func:`forget_images_command`), unless
``container.keep_image`` or a container still uses it; an image that was there before is never
on that list."""

from __future__ import annotations

import base64
import json
import os
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cloudtrain.errors import RemoteError, UserError
from cloudtrain.remote import Group, bash

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.containers.spec import ContainerSpec, ImageRef
    from cloudtrain.context import Env
    from cloudtrain.schema import NodeRow

DOCKER_HUB_AUTH = "https://index.docker.io/v1/"   # the server address docker login uses for Hub
PULLED_LIST = "pulled-images"
_GONE = ("No such image", "reference does not exist")


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


@dataclass(frozen=True)
class Credentials:
    """The registry login read from the laptop's environment: the header's value, and the
    secrets (never shown: :meth:`scrub` takes them out of any text)."""

    header: str
    secrets: tuple[str, ...]

    def scrub(self, text: str) -> str:
        for s in self.secrets:
            if s:
                text = text.replace(s, "***")
        return text


NO_CREDENTIALS = Credentials("", ())


def credentials(spec: ContainerSpec, environ: dict[str, str] | None = None) -> Credentials:
    """The ``X-Registry-Auth`` value from the variables ``container.registry_auth`` names,
    read on this machine. UserError (exit 2) names the field and the variable when one is not
    set."""
    auth = spec.registry_auth
    if auth is None:
        return NO_CREDENTIALS
    env = os.environ if environ is None else environ
    values = {}
    for fld, var in (("username_env", auth.username_env), ("password_env", auth.password_env)):
        value = env.get(var, "")
        if not value:
            raise UserError(
                f"container.registry_auth.{fld} names the environment variable {var}, which "
                "is not set (or empty) on this machine: the registry login cannot be sent.",
                f"Set it before the launch (export {var}=...), or remove "
                "container.registry_auth for an image that needs no login.")
        values[fld] = value
    ref = spec.ref
    server = DOCKER_HUB_AUTH if ref.registry == "docker.io" else ref.registry
    doc = {"username": values["username_env"], "password": values["password_env"],
           "serveraddress": server}
    header = base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()
    pw = values["password_env"]
    secrets = (pw, header, base64.b64encode(pw.encode()).decode(),
               base64.b64encode(f"{values['username_env']}:{pw}".encode()).decode())
    return Credentials(header, secrets)


def check_credentials(spec: ContainerSpec | None) -> None:
    """Before anything is created: the variables ``container.registry_auth`` names are set on
    this machine (UserError naming the field and the variable otherwise)."""
    if spec is not None:
        credentials(spec)


def _source() -> str:
    return base64.b64encode((Path(__file__).resolve().parent.parent / "node" / "dockerpull.py")
                            .read_bytes()).decode()


def root_of(node: NodeRow) -> str:
    """Bash that sets ``r`` to the node's cloudtrain folder (relative: under $HOME)."""
    return f"r={shlex.quote(node.root_dir)}; case $r in /*) ;; *) r=$HOME/$r ;; esac; "


def sudo(node: NodeRow) -> str:
    """``sudo -n `` where this node's SSH sessions reach Docker only through sudo (bootstrap
    found the user not yet in group docker: its ``docker_sudo`` result), else nothing."""
    return "sudo -n " if node.bootstrap.get("docker_sudo") == "1" else ""


def pull_command(node: NodeRow, image: str, keep: bool) -> str:
    """dockerpull.py on ``node`` (the file travels in the command; stdin carries the header)."""
    code = f"import base64; exec(compile(base64.b64decode('{_source()}'), 'dockerpull.py', 'exec'))"
    path = f"PATH={shlex.quote(node.python_bin)}:\"$PATH\"; " if node.python_bin else ""
    return bash(
        root_of(node) + path + "py=$(command -v python3 || command -v python) || "
        "{ echo '::fail engine no python3 on the node to talk to the Docker Engine'; exit 5; }; "
        f"exec {sudo(node)}\"$py\" -c {shlex.quote(code)} {shlex.quote(image)} \"$r\""
        + (" --keep" if keep else ""))


def forget_images_command(node: NodeRow) -> str:
    """What ``down`` runs on a node we do not power off (local, ssh), after the cluster's
    containers are removed: every image cloudtrain pulled there (``<root>/pulled-images``) is
    removed with ``docker image rm``, unless a container (of any state, anyone's) still uses
    the image; no force, and only the reference cloudtrain pulled is removed, never another
    tag of the same image. Prints ``::removed REF`` / ``::kept REF WHY``."""
    return bash(
        root_of(node) + f"f=\"$r/{PULLED_LIST}\"; [ -s \"$f\" ] || exit 0\n"
        + ("docker() { sudo -n docker \"$@\"; }\n" if sudo(node) else "")
        + "while IFS= read -r ref; do\n"
        "  [ -n \"$ref\" ] || continue\n"
        "  id=$(docker image inspect --format '{{.Id}}' \"$ref\" 2>/dev/null) || continue\n"
        "  users=$(docker ps -a -q --filter \"ancestor=$id\" | tr '\\n' ' ')\n"
        "  if [ -n \"$users\" ]; then echo \"::kept $ref used by container(s) $users\"; continue; fi\n"
        "  if why=$(docker image rm \"$ref\" 2>&1 >/dev/null); then echo \"::removed $ref\"\n"
        "  else echo \"::kept $ref $(printf %s \"$why\" | tr '\\n' ' ' | cut -c1-300)\"; fi\n"
        "done < \"$f\"\n"
        "rm -f \"$f\"\n")


def forget_images(env: Env, handle: Handle, group: Group | None = None) -> dict[int, list[str]]:
    """:func:`forget_images_command` on every node (best effort: a node that does not answer
    is warned about). Returns the references removed per node."""
    from cloudtrain.cluster import connect

    own = group is None
    try:
        g = group if group is not None else connect(env, handle, timeout=15)
    except Exception as exc:  # noqa: BLE001 - unreachable nodes cannot remove anything
        env.ui.warn(f"Could not reach every node to remove the images cloudtrain pulled: {exc}")
        return {}
    try:
        now = {n.rank: n for n in handle.nodes}    # as bootstrap left them (docker_sudo)
        res = g.run(lambda n: forget_images_command(now.get(n.rank, n)), timeout=300)
    finally:
        if own:
            g.close()
    removed: dict[int, list[str]] = {}
    for rank, r in res.items():
        for line in r.stdout.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "::removed":
                removed.setdefault(rank, []).append(rest)
                env.ui.info(f"node-{rank}: removed image {rest} (cloudtrain pulled it)")
            elif kind == "::kept":
                ref, _, why = rest.partition(" ")
                if not any(w in why for w in _GONE):   # nodes sharing one Docker: removed once
                    env.ui.info(f"node-{rank}: kept image {ref}: {why.strip() or 'refused'}")
    return removed


# --- the pull --------------------------------------------------------------------------------

def _mb(n: float) -> str:
    """Bytes as Docker shows them (decimal units): 412 MB, 1.1 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            v = n / size
            return f"{v:.1f} {unit}" if v < 10 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


class _Shown:
    """Each node's progress lines, shown as ``node-N: pulling IMAGE: ...`` (the node prints
    one about every second)."""

    def __init__(self, env: Env, image: str) -> None:
        self.env, self.image = env, image
        self.started: set[int] = set()
        self.lock = threading.Lock()

    def line(self, rank: int, line: str) -> None:
        if not line.startswith("::progress "):
            return
        try:
            done, total, got, size, rate = (int(x) for x in line.split()[1:6])
        except ValueError:
            return
        with self.lock:
            first = rank not in self.started
            self.started.add(rank)
        if first and total == 0:
            self.env.ui.info(f"node-{rank}: pulling {self.image}")
            return
        self.env.ui.info(f"node-{rank}: pulling {self.image}: {done}/{total} layers, "
                         f"{_mb(got)} of {_mb(size)}, {_mb(rate)}/s")


def _parse(rank: int, image: str, stdout: str) -> NodeImage | None:
    for line in stdout.splitlines():
        if line.startswith("::image "):
            _, how, doc = line.split(" ", 2)
            data = json.loads(doc)
            return NodeImage(rank, str(data["id"]), pick_digest(image, data["repo_digests"],
                                                                str(data["id"])),
                             how == "pulled", float(data.get("seconds", 0.0)))
    return None


def pick_digest(image: str, repo_digests: list[str], image_id: str) -> str:
    """The repository digest of ``image``'s own repository (``NAME@sha256:...``, what the
    registry serves), else the image ID (a local image has no registry digest)."""
    from cloudtrain.containers.spec import parse_image

    ref = parse_image(image)
    names = {ref.name, _familiar(ref)}
    for d in repo_digests:
        if d.split("@", 1)[0] in names:
            return d
    return image_id


def _familiar(ref: ImageRef) -> str:
    """Docker's short form of a Docker Hub name (``library/x`` -> ``x``)."""
    return ref.name.removeprefix("docker.io/").removeprefix("library/")


def _failure(r_rank: int, stdout: str, stderr: str, error: object) -> tuple[str, str]:
    for line in stdout.splitlines():
        if line.startswith("::fail "):
            _, kind, *why = line.split(" ", 2)
            return kind, (why[0] if why else "")
    tail = (stderr or stdout or str(error or "")).strip().splitlines()[-1:] or ["no output"]
    return "ssh", tail[0][:300]


def _refused(spec: ContainerSpec, creds: Credentials, failures: list[tuple[int, str]]) -> UserError:
    ranks = ", ".join(str(r) for r, _ in failures)
    why = creds.scrub(failures[0][1])
    registry = spec.ref.registry
    if spec.registry_auth is None:
        return UserError(
            f"container.registry_auth: the registry {registry} does not serve {spec.image} "
            f"without a login (node {ranks}: {why}).",
            "Check the image's name; if it needs a login, add container.registry_auth: "
            "{username_env: VAR, password_env: VAR} naming two variables set on this machine.")
    a = spec.registry_auth
    return UserError(
        f"container.registry_auth: the registry {registry} refused the login from "
        f"${a.username_env} / ${a.password_env} for {spec.image} (node {ranks}: {why}).",
        f"Check the user name and password (or token) in {a.username_env} and "
        f"{a.password_env}, and that this user may pull the image; then launch again.")


_seen: dict[tuple[str, str, tuple[str, ...]], ImageOnNodes] = {}
_seen_lock = threading.Lock()


def ensure_image(env: Env, handle: Handle, group: Group, spec: ContainerSpec) -> ImageOnNodes:
    """The image on every node (pulled where missing, all nodes at once, progress shown per
    node). Raises :class:`UserError` naming ``container.registry_auth`` when the registry
    refuses the login (or a variable it names is not set), naming the node that differs when
    the nodes do not all run the same digest; :class:`RemoteError` naming each node where the
    image could not be had and Docker's reason. The image and digest are kept for the
    cluster (its next launch's ledger entry records them: state.add_launch)."""
    key = (handle.name, spec.image, tuple(n.instance_id for n in handle.nodes))
    with _seen_lock:
        if key in _seen:          # already found / pulled on these nodes by this command
            return _seen[key]
    creds = credentials(spec)
    if env.state.cluster_image(handle.name) is None:
        env.state.set_cluster_image(handle.name, spec.image)   # 'down' looks for what it pulls
    shown = _Shown(env, spec.image)
    t0 = time.monotonic()
    now = {n.rank: n for n in handle.nodes}    # as bootstrap left them (docker_sudo)
    res = group.run(lambda n: pull_command(now.get(n.rank, n), spec.image, spec.keep_image),
                    stdin=(creds.header + "\n").encode(), on_line=shown.line, timeout=3600)
    failures = {r.rank: _failure(r.rank, r.stdout, r.stderr, r.error) for r in res.failed}
    auth = [(rank, why) for rank, (kind, why) in failures.items() if kind == "auth"]
    if auth:
        raise _refused(spec, creds, auth)
    nodes: dict[int, NodeImage] = {}
    for rank, r in res.items():
        got = None if rank in failures else _parse(rank, spec.image, r.stdout)
        if got is None and rank not in failures:
            failures[rank] = ("ssh", "no answer about the image")
        elif got is not None:
            nodes[rank] = got
    if failures:
        parts = "; ".join(f"node {rank}: {creds.scrub(why).rstrip('.')}"
                          for rank, (_, why) in sorted(failures.items()))
        raise RemoteError(
            f"could not get {spec.image} on {len(failures)} of {len(res)} node(s): {parts}.",
            "Check the image name and tag, that each node reaches its registry and that "
            "Docker runs there ('docker info' on the node), then launch again.")
    out = same_everywhere(handle.name, spec.image, nodes)
    pulled = [n for n in nodes.values() if n.pulled]
    how = (f"pulled on {len(pulled)} of {len(nodes)} node(s) in {time.monotonic() - t0:.1f} s"
           if pulled else f"already on {'every node' if len(nodes) > 1 else 'the node'}")
    env.ui.ok(f"Image {spec.image} {how}: {out.digest}")
    env.state.set_cluster_image(handle.name, spec.image, out.digest, out.image_id)
    with _seen_lock:
        _seen[key] = out
    return out


def same_everywhere(cluster: str, image: str, nodes: dict[int, NodeImage]) -> ImageOnNodes:
    """The one image all ``nodes`` run; UserError naming the node(s) that differ from the
    others (the most common digest is the cluster's; on a tie, node 0's)."""
    counts: dict[str, int] = {}
    for n in nodes.values():
        counts[n.digest] = counts.get(n.digest, 0) + 1
    first = nodes[min(nodes)]
    best = max(counts, key=lambda d: (counts[d], d == first.digest))
    odd = [n for n in sorted(nodes.values(), key=lambda n: n.rank) if n.digest != best]
    if odd:
        which = "; ".join(f"node {n.rank} runs {n.digest}" for n in odd)
        agree = ", ".join(str(n.rank) for n in nodes.values() if n.digest == best)
        raise UserError(
            f"the nodes of '{cluster}' do not run the same {image}: {which}, while node(s) "
            f"{agree} run {best}.",
            "Pin the image by digest (container.image: REPO@sha256:...) so every node pulls "
            "the same one, or remove the differing image on that node; then launch again.")
    return ImageOnNodes(image, first.digest, first.image_id, dict(nodes))
