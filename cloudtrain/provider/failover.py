"""Words and choices every cloud provider's failover shares: what an attempt's outcome is
called in the attempt log, and which of several per-node errors a partial launch reports."""

from __future__ import annotations

from cloudtrain.errors import AuthError, CapacityError, ProviderError, QuotaError, TransientError


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
