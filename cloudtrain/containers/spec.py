"""The task's ``container:`` section: the image (a Docker reference, checked against the
grammar Docker's own distribution/reference package defines), the registry credentials' names
(read on the laptop, never written to a node's disk), extra ``docker run`` options (checked:
what would undo cloudtrain's own settings or hand the host to the container is refused unless
``privileged: true``) and whether the image stays on an ``ssh`` host after ``down``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# distribution/reference's grammar, in its own terms.
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE_RE = re.compile(
    rf"^(?P<name>(?:(?P<domain>{_DOMAIN})/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$")
NAME_MAX = 255
DOCKER_HUB = "docker.io"
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference. ``registry`` is the host a ``docker login`` goes to
    (``docker.io`` when the name has no domain); ``text`` is what ``docker pull`` is given."""

    text: str
    name: str
    registry: str
    tag: str | None
    digest: str | None

    @property
    def pinned(self) -> bool:
        return self.digest is not None


def parse_image(text: str) -> ImageRef:
    """``text`` as an :class:`ImageRef`; ValueError says what is wrong, with an example."""
    example = "write e.g. nvcr.io/nvidia/pytorch:24.10-py3 or REPO@sha256:<64 hex digits>"
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"the image is empty; {example}")
    t = text
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in t):
        raise ValueError(f"{t[:80]!r} has spaces or control characters; {example}")
    m = _REFERENCE_RE.match(t)
    if m is None:
        hint = " (repository names are lower case)" if t.lower() != t and \
            _REFERENCE_RE.match(t.lower()) else ""
        raise ValueError(f"'{t[:80]}' is not a valid image reference{hint}; {example}")
    first = m.group("name").split("/", 1)[0]
    domain = m.group("domain")
    # Docker's rule: the first component is a registry host only if it has a '.' or a ':' or
    # is 'localhost'; else it is part of a Docker Hub path.
    if domain is not None and not ("." in first or ":" in first or first == "localhost"):
        domain = None
    if len(m.group("name")) > NAME_MAX:
        raise ValueError(f"the image name is over {NAME_MAX} characters; {example}")
    digest = m.group("digest")
    if digest is not None and digest.startswith("sha256:") and len(digest) != 71:
        raise ValueError(f"'{digest[:80]}' is not a sha256 digest (64 hex digits); {example}")
    return ImageRef(text=t, name=m.group("name"), registry=domain or DOCKER_HUB,
                    tag=m.group("tag"), digest=digest)


# --- run_options ----------------------------------------------------------------------------

# Set by cloudtrain on every container (docs/containers.md says why); a run option may not undo it.
_OURS = {
    "--network": "cloudtrain runs the container on the host's network (torchrun and NCCL need "
                 "the node's real interfaces)",
    "--net": "cloudtrain runs the container on the host's network",
    "--pid": "cloudtrain shares the host's process table with the container (the node guard "
             "and stop see the job's processes)",
    "--name": "cloudtrain names the container after the cluster and node",
    "--label": "cloudtrain labels the container with its cluster",
    "-l": "cloudtrain labels the container with its cluster",
    "--rm": "cloudtrain manages the container's life",
    "-d": "cloudtrain manages the container's life",
    "--detach": "cloudtrain manages the container's life",
    "--restart": "cloudtrain manages the container's life",
    "--entrypoint": "the job runs with 'docker exec'; the image's entrypoint is not used",
    "-u": "the job runs as the node's SSH user, so the files it writes are that user's",
    "--user": "the job runs as the node's SSH user, so the files it writes are that user's",
    "--gpus": "cloudtrain passes the node's GPUs (all, or the job's slots)",
    "-w": "the job runs in its workdir",
    "--workdir": "the job runs in its workdir",
    "-it": "the container runs without a terminal",
    "-t": "the container runs without a terminal",
    "--tty": "the container runs without a terminal",
    "-i": "the container runs without a terminal",
    "--interactive": "the container runs without a terminal",
}
# Options that take a value (as the next item or after '='), allowed as given.
_WITH_VALUE = {"--ipc", "--shm-size", "--ulimit", "--device", "-e", "--env", "--env-file",
               "-v", "--volume", "--mount", "--tmpfs", "--cap-add", "--cap-drop",
               "--security-opt", "--group-add", "--memory", "-m", "--memory-swap", "--cpus",
               "--cpuset-cpus", "--pids-limit", "--sysctl", "--runtime", "--add-host",
               "--oom-score-adj", "--stop-timeout", "--device-cgroup-rule", "--platform",
               "--log-driver", "--log-opt"}
_FLAGS = {"--init", "--read-only", "--oom-kill-disable"}
_HOST_POWER = ("the container would get the host's power (root on the node)",
               "set container.privileged: true if that is what you mean")


def _value_refusal(opt: str, value: str) -> str | None:
    """Why ``opt value`` hands the host to the container (None: it does not)."""
    v = value.strip()
    if opt == "--cap-add" and v.upper().removeprefix("CAP_") in {"ALL", "SYS_ADMIN", "SYS_MODULE",
                                                                "SYS_RAWIO", "SYS_PTRACE"}:
        return f"--cap-add {v}"
    if opt == "--security-opt" and "unconfined" in v:
        return f"--security-opt {v}"
    if opt in ("-v", "--volume", "--mount"):
        src = v.split(",") if opt == "--mount" else [v.split(":", 1)[0]]
        for part in src:
            s = part.split("=", 1)[1] if opt == "--mount" and "=" in part else part
            if opt == "--mount" and not part.startswith(("source=", "src=")):
                continue
            if s.rstrip("/") in ("", "/proc", "/sys", "/dev", "/etc", "/boot", "/root") or \
                    "docker.sock" in s or s.rstrip("/") == "/var/run" or s.rstrip("/") == "/run":
                return f"{opt} {v}"
    if opt == "--device" and v.split(":", 1)[0].rstrip("/") in ("/dev", "/dev/mem", "/dev/kmem"):
        return f"--device {v}"
    return None


def check_run_options(options: list[str], privileged: bool) -> list[str]:
    """The options as given, each checked; ValueError names the first one refused and why."""
    out: list[str] = []
    i = 0
    while i < len(options):
        item = options[i]
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"run_options[{i}] is empty; write e.g. --ipc=host")
        if any(ord(c) < 32 for c in item):
            raise ValueError(f"run_options[{i}] has control characters")
        opt, eq, value = item.partition("=")
        if opt in _OURS:
            raise ValueError(f"run_options[{i}] '{item}' is not allowed: {_OURS[opt]}")
        if opt == "--privileged":
            if not privileged:
                raise ValueError(f"run_options[{i}] '--privileged' is refused: {_HOST_POWER[0]}; "
                                 f"{_HOST_POWER[1]}")
            out.append(item)
            i += 1
            continue
        if opt in _FLAGS and not eq:
            out.append(item)
            i += 1
            continue
        if opt not in _WITH_VALUE:
            raise ValueError(f"run_options[{i}] '{item[:40]}' is not an option cloudtrain "
                             "passes on; allowed: " + " ".join(sorted(_WITH_VALUE | _FLAGS)))
        if not eq:
            if i + 1 >= len(options) or not isinstance(options[i + 1], str):
                raise ValueError(f"run_options[{i}] '{opt}' needs a value: write {opt}=VALUE")
            value = options[i + 1]
        why = _value_refusal(opt, value)
        if why is not None and not privileged:
            raise ValueError(f"run_options '{why}' is refused: {_HOST_POWER[0]}; {_HOST_POWER[1]}")
        out += [item] if eq else [opt, value]
        i += 1 if eq else 2
    return out


# --- the section ----------------------------------------------------------------------------

class RegistryAuth(BaseModel):
    """The names of two environment variables on the laptop that hold the registry login."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    username_env: str
    password_env: str

    @field_validator("username_env", "password_env")
    @classmethod
    def _env_name(cls, v: str) -> str:
        if not _ENV_NAME_RE.match(v):
            raise ValueError(f"'{v[:40]}' is not an environment variable name; write the NAME "
                             "of a variable set on this machine (e.g. NGC_KEY), not its value")
        return v


class ContainerSpec(BaseModel):
    """``container:`` — the image every node runs ``setup``, ``run``/``train`` and ``exec`` in."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    image: str
    registry_auth: RegistryAuth | None = None
    privileged: bool = False          # before run_options: their check reads it
    run_options: list[str] = Field(default_factory=list)
    keep_image: bool = False
    """On an ``ssh`` or local host: keep an image cloudtrain pulled after ``down`` (default:
    removed, unless it was there before)."""

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        return parse_image(v).text

    @field_validator("run_options")
    @classmethod
    def _options(cls, v: list[str], info: ValidationInfo) -> list[str]:
        check_run_options(list(v), bool(info.data.get("privileged", False)))
        return v

    @property
    def ref(self) -> ImageRef:
        return parse_image(self.image)
