"""Which providers are usable here: ``cloudtrain check`` and the one-line warning of
``up --dry-run`` and ``cost``.

:func:`check` asks every provider (in parallel) through the provider door: the SDK from the
registry (nothing is imported for it), then the provider's own
:class:`~cloudtrain.provider.contract.ChecksAccess` (credentials found, one cheap read-only
call, what they reach). Each provider has a deadline: one that does not answer in time is
reported as such and left behind (its thread is a daemon), never waited for.

:func:`warning` is the cheap half, for commands that only plan: the SDK installed and
credentials present by the standard files and variables (no SDK import, no network call).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from cloudtrain.errors import CloudtrainError, MissingSDK, UserError
from cloudtrain.provider.contract import ChecksAccess, ProviderCheck, ProviderContext
from cloudtrain.ranking import CLOUDS

if TYPE_CHECKING:
    from cloudtrain.provider.contract import Provider

CALL_TIMEOUT = 5.0
"""Seconds each network call of a provider's check may take (connect and read)."""
DEADLINE = 20.0
"""Seconds a provider's whole check may take (finding credentials included)."""


def chosen(names: tuple[str, ...] | list[str], installed: list[str]) -> list[str]:
    """The providers to check: ``names`` in the order given (none: every installed one).
    An unknown name is a UserError naming the valid ones."""
    unknown = [n for n in names if n not in installed]
    if unknown:
        from difflib import get_close_matches

        close = get_close_matches(unknown[0], installed, n=1)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        raise UserError(f"Unknown provider{'s' if len(unknown) > 1 else ''}: "
                        f"{', '.join(unknown)}.",
                        f"{hint}Valid providers: {', '.join(installed)}.")
    return list(dict.fromkeys(names)) if names else list(installed)


def check(names: list[str], ctx: ProviderContext, handed: Mapping[str, Provider] | None = None,
          *, timeout: float = CALL_TIMEOUT, deadline: float = DEADLINE) -> list[ProviderCheck]:
    """One :class:`ProviderCheck` per name, in order (``handed``: provider instances to ask
    instead of the installed ones, as tests and embedders hand them in)."""
    results: dict[str, ProviderCheck] = {}
    threads = []
    for name in names:
        def run(name: str = name) -> None:
            results[name] = _one(name, ctx, (handed or {}).get(name), timeout)

        t = threading.Thread(target=run, name=f"check-{name}", daemon=True)
        t.start()
        threads.append((name, t))
    out = []
    for name, t in threads:
        t.join(deadline)   # they run side by side: the later joins find them done
        out.append(results.get(name) or ProviderCheck(
            name, True, "?", None, detail=f"no answer within {deadline:.0f} s",
            fix="Check the network connection (and any proxy), then run 'cloudtrain check "
                f"{name}' again."))
    return out


def _one(name: str, ctx: ProviderContext, provider: Provider | None,
         timeout: float) -> ProviderCheck:
    from cloudtrain.provider import registry

    try:
        if provider is None:
            missing = registry.sdk_missing(name)
            if missing is not None:
                return _no_sdk(name, missing)
            provider = registry.get(name, ctx)
        if not isinstance(provider, ChecksAccess):
            return ProviderCheck(name, True, None, None,
                                 detail="this provider cannot check its access",
                                 fix="Its own documentation says what it needs.")
        return provider.check_access(timeout)
    except MissingSDK as exc:
        return _no_sdk(name, exc.module)
    except ModuleNotFoundError as exc:
        if registry.sdk_error(exc) is None:   # not an SDK: a broken install, said as such
            return ProviderCheck(name, True, "?", False, detail=str(exc),
                                 fix="Reinstall cloudtrain (and the provider's extra).")
        return _no_sdk(name, exc.name or str(exc))
    except CloudtrainError as exc:
        return ProviderCheck(name, True, "?", False, detail=exc.message, fix=exc.hint)
    except Exception as exc:  # noqa: BLE001 - one provider's surprise must not hide the others
        return ProviderCheck(name, True, "?", False, detail=f"{type(exc).__name__}: {exc}",
                             fix="Run it again; if it persists, report it with this line.")


def _no_sdk(name: str, module: str) -> ProviderCheck:
    return ProviderCheck(name, False, None, None, detail=f"its SDK ({module}) is not installed",
                         fix=f"Install it: pip install 'cloudtrain[{name}]'.")


def usable_clouds(results: list[ProviderCheck]) -> list[str]:
    return [r.provider for r in results if r.provider in CLOUDS and r.usable]


def exit_code(results: list[ProviderCheck]) -> int:
    """0 when a cloud checked is usable, or when no cloud was asked about (``check local``);
    1 when every cloud checked is not."""
    clouds = [r for r in results if r.provider in CLOUDS]
    return 0 if not clouds or usable_clouds(results) else 1


def as_json(results: list[ProviderCheck]) -> list[dict[str, Any]]:
    return [{**asdict(r), "reaches": list(r.reaches), "usable": r.usable} for r in results]


def _yes_no(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "no")


def _what_to_do(r: ProviderCheck) -> str:
    """The detail, then the fix, as sentences ("-": nothing to do)."""
    parts = [p.strip().rstrip(".") for p in (r.detail, r.fix) if p.strip()]
    return ". ".join(p[0].upper() + p[1:] for p in parts) + "." if parts else "-"


def table(results: list[ProviderCheck]) -> list[str]:
    """The table's lines, then the line saying which providers are usable."""
    head = ("PROVIDER", "SDK", "CREDENTIALS", "WORKS", "REACHES", "WHAT TO DO")
    rows = [(r.provider, _yes_no(r.sdk), r.credentials or "none found", _yes_no(r.works),
             "; ".join(r.reaches) or "-", _what_to_do(r)) for r in results]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]
             for row in [head, *rows]]
    usable = [r.provider for r in results if r.usable]
    clouds = usable_clouds(results)
    if clouds:
        lines.append(f"Usable: {', '.join(usable)}.")
    elif any(r.provider in CLOUDS for r in results):
        lines.append(f"Usable: {', '.join(usable) or 'none'}; no cloud is usable "
                     "(see WHAT TO DO above).")
    else:
        lines.append(f"Usable: {', '.join(usable) or 'none'}.")
    return lines


def warning(provider: str | None) -> str | None:
    """One line when ``provider`` is a cloud that is not usable here (SDK missing or no
    credentials found), naming ``cloudtrain check``; None otherwise. No SDK import, no
    network call."""
    if provider not in CLOUDS:
        return None
    from cloudtrain.planner import availability

    why = availability([provider]).get(provider)
    if why is None:
        return None
    return (f"{provider} is not usable here ({why}): 'up' would fail. Run 'cloudtrain check "
            f"{provider}' for what to do.")
