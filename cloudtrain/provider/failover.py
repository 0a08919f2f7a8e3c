"""The words of the failover loop (:mod:`cloudtrain.provider.cloud`): what one attempt is
recorded as, where a launch is pinned, what ends a region, and which error a partial launch
reports. Imported by the cloud base, which hands them on to the providers."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from cloudtrain.errors import AuthError, CapacityError, ProviderError, QuotaError, TransientError


@dataclass(frozen=True)
class Attempt:
    """One placement attempt, the same fields on every cloud. ``outcome``: ok, capacity
    (next zone), quota or unavailable (next region), auth, throttled or error (stop).
    ``code``: the cloud's error code (or the reason in words); ``at``: UTC, ISO 8601."""

    region: str
    zone: str | None
    instance_type: str
    outcome: str
    code: str
    message: str
    at: str

    def as_dict(self) -> dict[str, Any]:
        """The attempt as the record file and ``up --json`` hold it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Attempt:
        """An attempt read back from a record file (records written before the fields were
        the same on every cloud said ``size`` on Azure)."""
        return cls(str(d.get("region", "")), d.get("zone"),
                   str(d.get("instance_type", d.get("size", ""))), str(d.get("outcome", "")),
                   str(d.get("code", "")), str(d.get("message", "")), str(d.get("at", "")))


@dataclass(frozen=True)
class Pin:
    """Launch only in ``zone``: the task's, or the one the cluster's nodes are in (None: a
    cluster placed without a zone, as Azure places in regions without zones)."""

    zone: str | None


class Unavailable(Exception):
    """This region cannot run the request at all (type not sold, no image, no zone): the
    failover loop records it and tries the next region."""


def outcome_of(exc: BaseException) -> str:
    """The attempt log's word for an error that is neither capacity nor quota."""
    if isinstance(exc, AuthError):
        return "auth"
    if isinstance(exc, TransientError):
        return "throttled"
    return "error"


def worst(errors: list[ProviderError]) -> ProviderError:
    """The error a partial launch reports: credentials first (stop), then anything unexpected
    (stop), then quota (next region), then capacity (next zone)."""
    for e in errors:
        if isinstance(e, AuthError):
            return e
    for e in errors:
        if not isinstance(e, (QuotaError, CapacityError)):
            return e
    for e in errors:
        if isinstance(e, QuotaError):
            return e
    return errors[0]
