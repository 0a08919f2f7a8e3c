"""The task's typed model: the fields of task.yaml, their defaults and their own rules.

Pure data and field-level validation (pydantic). Reading the file, naming the line of an
error and checking local paths is ``spec``'s work; checking provider names and options is
``provider.options``'s.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator,
                      model_validator)

from cloudtrain import sizes, sshproxy
from cloudtrain.containers.spec import ContainerSpec
from cloudtrain.names import TASK_NAME_RE, TASK_NAME_RULE, derive
from cloudtrain.storage import url as bucket_url
from cloudtrain.taskpaths import check_mount_target, check_path_text
from cloudtrain.yamlsrc import LocatedYaml

# Upper bounds for the task's money and time fields: a number past these is a typo (or .inf),
# and would turn estimates and budget checks into nonsense.
MAX_HOURS = 24 * 366            # max_hours: a year
MAX_USD = 10_000_000            # max_cost_usd
MAX_USD_PER_HOUR = 100_000      # resources.max_hourly_cost


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_PLACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_ITYPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Accelerators(_Strict):
    name: str
    count: int = Field(ge=1, le=64)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip() or v.startswith("-") or len(v) > 64 or _CONTROL_RE.search(v):
            raise ValueError(f"'{v[:40]}' is not a GPU model name; write e.g. A100 or H100")
        return v

    def __str__(self) -> str:
        return f"{self.name}:{self.count}"


def parse_accelerators(value: Any) -> Any:
    """``A100:8``, ``A100`` (one), ``{A100: 8}`` or ``{name: A100, count: 8}`` as the mapping
    :class:`Accelerators` takes; None for none. ValueError names what is wrong."""
    if value is None or value == "none" or value == "":
        return None
    if isinstance(value, str):
        name, _, count = value.partition(":")
        name = name.strip()
        if not name:
            raise ValueError("expected NAME[:COUNT], e.g. A100:8")
        if count == "":
            return {"name": name, "count": 1}
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"the count '{count}' is not a whole number; write e.g. {name}:8") from None
        return {"name": name, "count": n}
    if isinstance(value, dict):
        if set(value) <= {"name", "count"} and "name" in value:
            return value
        if len(value) != 1:
            raise ValueError("give one GPU model, e.g. {A100: 8} or A100:8 (alternatives are "
                             "not read: any:8 lets the planner pick the model)")
        (name, count), = value.items()
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"the count '{count}' is not a whole number; write e.g. {{{name}: 8}}")
        return {"name": str(name), "count": count}
    if isinstance(value, (list, tuple, set)):
        raise ValueError("give one GPU model as NAME[:COUNT], e.g. A100:8 (SkyPilot's list of "
                         "alternatives is not read: any:8 lets the planner pick the model)")
    raise ValueError("expected NAME[:COUNT] (e.g. A100:8) or {NAME: COUNT}")


class Resources(BaseModel):
    """Where and on what the nodes run. Provider-specific options sit under a key named
    after the provider (``local:``, ``ssh:``, ...), validated by that provider's model."""

    model_config = ConfigDict(extra="allow", frozen=True)

    # None: the planner picks the cheapest cloud with credentials (only when accelerators or
    # instance_type are given; without them the default stays "local", see _default_provider).
    provider: str | None = None
    region: str | None = None
    zone: str | None = None
    accelerators: Accelerators | None = None
    instance_type: str | None = None
    use_spot: bool = False
    disk_size_gb: int = Field(200, ge=8, le=65536)
    image: str | None = None
    ports: list[int] = Field(default_factory=list)
    ssh_cidr: str | None = None
    network: Literal["fast", "plain"] | None = None   # None: fast where the type has one
    ssh_proxy: str | None = None        # a jump host or a proxy command: cloudtrain.sshproxy
    max_hourly_cost: float | None = Field(None, gt=0, le=MAX_USD_PER_HOUR,   # whole cluster
                                          allow_inf_nan=False)
    # A job's share of each node: N GPU slots (docs/queue.md); None: every node whole.
    gpus_per_job: int | None = Field(None, ge=1, le=64)
    # SkyPilot's size requests: vCPUs and memory (GB) per node, ``4`` exactly or ``4+`` at
    # least; the ranking keeps the offers that have them (not checked on local/ssh nodes).
    cpus: sizes.SizeAsk | None = None
    memory: sizes.SizeAsk | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_provider(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("provider") is None:
            if data.get("accelerators") in (None, "", "none") and not data.get("instance_type"):
                return {**data, "provider": "local"}
        return data

    _acc = field_validator("accelerators", mode="before")(classmethod(
        lambda cls, v: parse_accelerators(v)))

    @field_validator("cpus", "memory", mode="before")
    @classmethod
    def _sizes(cls, v: Any, info: ValidationInfo) -> Any:
        return sizes.parse(v, str(info.field_name))

    @field_validator("region", "zone")
    @classmethod
    def _place(cls, v: str | None) -> str | None:
        if v is not None and not _PLACE_RE.fullmatch(v):
            raise ValueError(f"'{v[:60]}' is not a region or zone name (letters, digits, '-' "
                             "and '_', e.g. us-east-1)")
        return v

    @field_validator("instance_type")
    @classmethod
    def _itype(cls, v: str | None) -> str | None:
        if v is not None and not _ITYPE_RE.fullmatch(v):
            raise ValueError(f"'{v[:60]}' is not an instance type name (letters, digits, '.', "
                             "'-' and '_', e.g. p4d.24xlarge)")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or v.startswith("-") or len(v) > 1024
                              or _CONTROL_RE.search(v)):
            raise ValueError("write an image id, name or path (at most 1024 characters, no "
                             "control characters, not starting with '-'), e.g. ami-0abc1234")
        return v

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        for p in v:
            if not 1 <= p <= 65535:
                raise ValueError(f"port {p} is outside 1-65535")
            if p == 22:
                raise ValueError("port 22 is always open to ssh_cidr; list only extra ports")
        return v

    @field_validator("ssh_cidr")
    @classmethod
    def _cidr(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            return str(ipaddress.ip_network(v, strict=False))
        except ValueError:
            raise ValueError(f"'{v}' is not an address range; write e.g. 203.0.113.7/32") from None

    @field_validator("ssh_proxy", mode="before")
    @classmethod
    def _proxy(cls, v: Any) -> Any:
        return v if v is None else sshproxy.check(v)

    @model_validator(mode="after")
    def _gpus_fit(self) -> Resources:
        """gpus_per_job within what a node has, where the task file says it: the GPUs of
        ``accelerators`` (per node), or the slots the local provider declares (local.gpus)."""
        local = (self.model_extra or {}).get("local")
        own = local.get("gpus") if self.provider == "local" and isinstance(local, dict) else None
        have, what = ((own, "resources.local.gpus declares") if type(own) is int else
                      (self.accelerators and self.accelerators.count, "resources.accelerators "
                       "gives each node"))
        if self.gpus_per_job is not None and have and self.gpus_per_job > have:
            raise ValueError(f"gpus_per_job is {self.gpus_per_job}, but {what} {have} GPU "
                             f"slot(s): a job's share of a node is at most {have}")
        return self

    def provider_options_raw(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}(\.[A-Za-z_][A-Za-z0-9_]{0,99}){0,31}$")


class Train(_Strict):
    script: str | None = None
    module: str | None = None
    args: list[str] = Field(default_factory=list)
    nproc_per_node: int | Literal["auto"] = "auto"
    rendezvous: Literal["static", "c10d"] = "static"
    max_restarts: int = Field(0, ge=0, le=100)
    master_port: int | None = Field(None, ge=1024, le=65535)

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a for a in v]
        return v

    @field_validator("script")
    @classmethod
    def _script(cls, v: str | None) -> str | None:
        if v is not None:
            check_path_text(v)
            if v.startswith(("/", "-", "~")) or ".." in v.split("/"):
                raise ValueError(f"'{v[:60]}': give the script's path inside workdir, without "
                                 "'..' and not starting with '/', '~' or '-', e.g. train.py")
        return v

    @field_validator("module")
    @classmethod
    def _module(cls, v: str | None) -> str | None:
        if v is not None and not _MODULE_RE.fullmatch(v):
            raise ValueError(f"'{v[:60]}' is not a Python module name; write dotted names, "
                             "e.g. pkg.train")
        return v

    @field_validator("nproc_per_node")
    @classmethod
    def _nproc(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 64:
            raise ValueError("must be 'auto' or between 1 and 64")
        return v

    @model_validator(mode="after")
    def _one_entry(self) -> Train:
        if bool(self.script) == bool(self.module):
            raise ValueError("give exactly one of 'script' (a file in workdir) or 'module' (pkg.mod)")
        return self


_REQ_CLAUSE = r"\s*(==|>=|<=|~=|<|>|!=)\s*[0-9][0-9A-Za-z.+*]*"
_REQ_RE = re.compile(rf"^torch({_REQ_CLAUSE})?(\s*,{_REQ_CLAUSE})*$")


class BootstrapSpec(_Strict):
    """What bootstrap installs where a node lacks it (nothing is reinstalled where present)."""

    torch: str = "torch"
    torch_index: str | None = None
    cuda_toolkit: bool = False
    python: str | None = None  # a Python on the nodes to use first (e.g. a conda env)

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is not None:
            if not v.startswith("/"):
                raise ValueError("give the absolute path of a python on the nodes, e.g. "
                                 "/opt/conda/bin/python")
            check_path_text(v)
            if _CONTROL_RE.search(v):
                raise ValueError("the path has control characters; give the absolute path of "
                                 "a python on the nodes, e.g. /opt/conda/bin/python")
        return v

    @field_validator("torch")
    @classmethod
    def _torch(cls, v: str) -> str:
        if not _REQ_RE.match(v.strip()):
            raise ValueError("write a pip requirement for torch, e.g. 'torch' or 'torch==2.13.0'")
        return v.strip()

    @field_validator("torch_index")
    @classmethod
    def _index(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^\s'\"]+$", v):
            raise ValueError("write the wheel index URL, e.g. https://download.pytorch.org/whl/cu126")
        return v


class Autostop(_Strict):
    """``autostop:`` the node guard's idle stop (docs/guard.md)."""

    idle_minutes: float | None = Field(60, gt=0, le=MAX_HOURS * 60, allow_inf_nan=False)
    """None: off (``autostop: false``)."""
    down: bool = True     # tear down (True) or only stop (False) when the nodes stop themselves


class Recovery(_Strict):
    """``recovery:`` what a controller does when the cloud takes a node (docs/recovery.md)."""

    max_recoveries: int = Field(3, ge=0, le=100)
    """Replacements of lost nodes one launch may make before it gives up (and fails)."""
    failover: bool = True
    """When the same zone has no capacity for a replacement: move the whole cluster along the
    planner's failover order (True) or fail (False)."""
    poll_seconds: float = Field(15, ge=0.2, le=600, allow_inf_nan=False)
    """How often the controller asks the cloud about the nodes."""


class Task(_Strict):
    name: str | None = None
    num_nodes: int = Field(1, ge=1, le=512)
    resources: Resources = Field(default_factory=Resources)
    workdir: str | None = None
    file_mounts: dict[str, str] = Field(default_factory=dict)
    envs: dict[str, str] = Field(default_factory=dict)
    setup: str | None = None
    run: str | None = None
    train: Train | None = None
    bootstrap: BootstrapSpec = Field(default_factory=BootstrapSpec)
    container: ContainerSpec | None = None     # docs/containers.md (setup/run/train run in it)
    outputs: list[str] = Field(default_factory=list)
    outputs_from: Literal["head", "all"] = "head"
    outputs_dir: str = "cloudtrain-outputs"
    max_cost_usd: float | None = Field(None, gt=0, le=MAX_USD,          # this cluster's budget
                                       allow_inf_nan=False)
    max_hours: float | None = Field(None, gt=0, le=MAX_HOURS,           # expected/allowed run
                                    allow_inf_nan=False)
    # Seconds from SIGTERM to SIGKILL when a job is stopped (a failure elsewhere, Ctrl-C, the
    # budget): the time the job has to write its checkpoint.
    stop_grace: float = Field(60, gt=0, le=3600, allow_inf_nan=False)
    # The node guard's idle stop: {idle_minutes, down}, false (off), or unset (the provider's
    # default: on for clouds, off for local and ssh).
    autostop: Autostop | None = None
    # A bucket URL (s3://, gs://, https://ACCOUNT.blob.core.windows.net/...): the job's
    # checkpoint directory ($CLOUDTRAIN_CHECKPOINT_DIR) is uploaded there by the nodes after
    # each complete checkpoint, and the newest complete one is downloaded before a job starts.
    checkpoints: str | None = None
    # Spot recovery: replace nodes the cloud took and resume (``recovery: true`` or a mapping).
    recovery: Recovery | None = None

    @field_validator("checkpoints")
    @classmethod
    def _checkpoints(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not bucket_url.is_bucket_url(v):
            raise ValueError(f"'{v}' is not a bucket URL; write e.g. s3://my-bucket/run-1, "
                             "gs://my-bucket/run-1 or "
                             "https://ACCOUNT.blob.core.windows.net/CONTAINER/run-1")
        return str(bucket_url.parse(v))

    @field_validator("recovery", mode="before")
    @classmethod
    def _recovery_flag(cls, v: Any) -> Any:
        if v is False:
            return None
        return {} if v is True else v

    def bucket_urls(self) -> list[bucket_url.BucketURL]:
        """Every bucket the nodes read or write: file_mounts sources and ``checkpoints``."""
        out = [bucket_url.parse(src) for src in self.file_mounts.values()
               if bucket_url.is_bucket_url(src)]
        if self.checkpoints:
            out.append(bucket_url.parse(self.checkpoints))
        return out

    def local_mounts(self) -> dict[str, str]:
        """file_mounts whose source is a path on this machine (not a bucket URL)."""
        return {t: s for t, s in self.file_mounts.items() if not bucket_url.is_bucket_url(s)}

    def bucket_mounts(self) -> dict[str, bucket_url.BucketURL]:
        """file_mounts whose source is a bucket URL: node path -> URL."""
        return {t: bucket_url.parse(s) for t, s in self.file_mounts.items()
                if bucket_url.is_bucket_url(s)}

    @field_validator("autostop", mode="before")
    @classmethod
    def _autostop_flag(cls, v: Any) -> Any:
        if v is False:
            return {"idle_minutes": None}
        return {} if v is True else v

    # Set by load_task, not by the user: where relative paths start.
    base_dir: Path = Field(default=Path("."), exclude=True)
    # Set by parse_task: the file's name and key lines, so later checks can name the line.
    _located: LocatedYaml | None = PrivateAttr(default=None)
    _source: str = PrivateAttr(default="")
    _notes: tuple[str, ...] = PrivateAttr(default=())
    _renamed: dict[str, str] = PrivateAttr(default_factory=dict)

    def attach_source(self, located: LocatedYaml, source: str, notes: tuple[str, ...] = (),
                      renamed: dict[str, str] | None = None) -> None:
        """Remember the file, its key lines, its notes and renamed fields (``skytask``)."""
        self._located, self._source, self._notes = located, source, tuple(notes)
        self._renamed = dict(renamed or {})

    @property
    def renamed(self) -> dict[str, str]:   # our dotted field -> SkyPilot's, as the file wrote it
        return dict(self._renamed)

    @property
    def notes(self) -> tuple[str, ...]:
        """One line each: what reading the file took differently from how it is written."""
        return self._notes

    @property
    def cluster_name(self) -> str | None:
        """The cluster name ``name:`` gives (names.derive), None without a name."""
        return derive(self.name) if self.name else None

    @property
    def source(self) -> str:
        """The task file's name as errors show it ("" for a task not read from a file)."""
        return self._source

    def line_of(self, *path: Any) -> int | None:
        return self._located.line_of(path) if self._located is not None else None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        # The job's name; the cluster's is derived from it (names.derive: 'My_Job' -> 'my-job').
        if v is not None and not TASK_NAME_RE.match(v):
            raise ValueError(f"use {TASK_NAME_RULE}, e.g. my-job")
        return v

    @field_validator("workdir", "outputs_dir")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        if v is not None:
            check_path_text(v)
        return v

    @field_validator("file_mounts")
    @classmethod
    def _mounts(cls, v: dict[str, str]) -> dict[str, str]:
        out = {}
        for target, local in v.items():
            check_mount_target(target)
            if bucket_url.is_bucket_url(local):
                try:
                    local = str(bucket_url.parse(local))
                except ValueError as exc:
                    raise ValueError(f"the source for '{target}': {exc}") from None
            else:
                try:
                    check_path_text(local)
                except ValueError as exc:
                    raise ValueError(f"the local path for '{target}': {exc}") from None
            out[target] = local
        return out

    @field_validator("envs", mode="before")
    @classmethod
    def _envs(cls, v: Any) -> Any:
        if isinstance(v, dict):
            out = {}
            for k, val in v.items():
                if not isinstance(k, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                    raise ValueError(f"'{k}' is not a valid environment variable name")
                if isinstance(val, bool):
                    val = "true" if val else "false"
                elif isinstance(val, (int, float)):
                    val = str(val)
                elif val is None:
                    val = ""
                out[k] = val
            return out
        return v

    @field_validator("outputs")
    @classmethod
    def _outputs(cls, v: list[str]) -> list[str]:
        for p in v:
            check_path_text(p)
            if p.startswith("/") or ".." in Path(p).parts:
                raise ValueError(f"'{p}': outputs are paths inside workdir, e.g. checkpoints/")
        return v

    @model_validator(mode="after")
    def _run_or_train(self) -> Task:
        if self.run and self.train:
            raise ValueError("give either 'run' or 'train', not both")
        if not self.run and not self.train:
            raise ValueError("give 'run' (a shell script) or 'train' (cloudtrain builds torchrun)")
        return self

    # --- resolved paths -------------------------------------------------------------------

    def workdir_path(self) -> Path | None:
        if self.workdir is None:
            return None
        return (self.base_dir / self.workdir).resolve()

    def outputs_path(self) -> Path:
        return (self.base_dir / self.outputs_dir).resolve()
