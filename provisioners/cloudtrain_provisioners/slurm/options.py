"""``resources.slurm`` in a task file: how to reach the cluster's login node and what to ask
Slurm for. Every value here ends up on an ``sbatch`` command line or in a shell line on the
login node, so each is checked to be what its name says and nothing an option parser or a
shell could read as more."""

from __future__ import annotations

import re

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cloudtrain_provisioners.ssh import SSHHost, SSHOptions

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:+-]{0,127}$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_\[(!][A-Za-z0-9_.:+&|!*\[\]()=,-]{0,255}$")
_MODULE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./+-]{0,127}$")
_PATH = re.compile(r"^[~/A-Za-z0-9_.][A-Za-z0-9_./+@=-]{0,1023}$")


def _named(v: str | None, what: str, example: str) -> str | None:
    if v is not None and not _NAME.fullmatch(v):
        raise ValueError(f"{what} {v[:40]!r} is not a Slurm name (letters, digits, '_', '.', "
                         f"':', '+' and '-', not starting with '-'); write e.g. {example}")
    return v


class SlurmOptions(BaseModel):
    """What a Slurm site needs from a task: the login node and the allocation's options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    login: str = Field("local", description="'local' (cloudtrain runs on the login node) or "
                                            "user@host[:port], reached over SSH")
    identity_file: str | None = Field(None, description="The private key for the login node "
                                                       "(default: ssh's own)")
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    reservation: str | None = None
    gpu_type: str | None = Field(None, description="The site's GRES type name, exactly as "
                                                   "its gres.conf writes it (case matters)")
    gpu_flag: Literal["auto", "gres", "gpus-per-node"] = Field(
        "auto", description="How GPUs are asked for: --gres=gpu:N, --gpus-per-node=N, or "
                            "auto: --gres where the site declares GPU GRES (sinfo %G), else "
                            "--gpus-per-node")
    cpus_per_node: int | None = Field(None, ge=1, le=4096)
    exclusive: bool = False
    workdir: str | None = Field(None, description="On the shared filesystem "
                                                  "(default ~/cloudtrain/<cluster>)")
    modules: list[str] = Field(default_factory=list, max_length=64)
    python: str | None = None
    price_per_gpu_hour: float = Field(0.0, ge=0, le=1000)

    @field_validator("login")
    @classmethod
    def _login(cls, v: str) -> str:
        if v != "local":
            login_host(v)      # raises ValueError naming what is wrong
        return v

    @field_validator("partition", "account", "qos", "reservation")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return _named(v, "the name", "gpu")

    @field_validator("gpu_type")
    @classmethod
    def _gpu_type(cls, v: str | None) -> str | None:
        return _named(v, "gpu_type", "h100 (as the site's gres.conf spells it)")

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v: str | None) -> str | None:
        if v is not None and not _CONSTRAINT.fullmatch(v):
            raise ValueError(f"constraint {v[:40]!r} is not a Slurm feature expression "
                             "(features joined by '&', '|', brackets); write e.g. a100&ib")
        return v

    @field_validator("modules")
    @classmethod
    def _modules(cls, v: list[str]) -> list[str]:
        for m in v:
            if not _MODULE.fullmatch(m):
                raise ValueError(f"the module {m[:40]!r} is not a module name (letters, digits, "
                                 "'_', '.', '/', '+' and '-'); write e.g. cuda/12.4")
        return v

    @field_validator("workdir", "python", "identity_file")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        if v is not None and not _PATH.fullmatch(v):
            raise ValueError(f"{v[:40]!r} is not a plain path (letters, digits, '_', '.', '/', "
                             "'~', '+', '@', '=' and '-'; no spaces, not starting with '-'); "
                             "write e.g. /shared/me/cloudtrain")
        return v


def login_host(v: str) -> SSHHost:
    """``user@host[:port]`` as the ssh provider reads a host (same checks and messages)."""
    from pydantic import ValidationError

    try:
        return SSHOptions.model_validate({"hosts": [v]}).hosts[0]
    except ValidationError as exc:
        msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ValueError(f"login is 'local' or user@host[:port]: {msg}") from None
