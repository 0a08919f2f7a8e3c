"""Find providers through the ``cloudtrain.providers`` entry-point group.

Loading a provider class must stay cheap: provider modules import their cloud SDK lazily,
inside the methods (or factories) that talk to the cloud. A provider class names the SDK
modules it needs in ``sdk_modules`` (its pip extra is ``cloudtrain[<name>]``), so that a
missing SDK is said before anything starts (:func:`require_sdk`), in lists of providers
(:func:`sdk_missing`), and where an import deep in a provider fails (:func:`sdk_error`).

Only installed providers are here: an instance a program makes itself (a test's fake, a
provider holding its own client) is handed in through :class:`cloudtrain.context.Env`.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from cloudtrain.errors import MissingSDK, UserError

if TYPE_CHECKING:
    from cloudtrain.provider.contract import Provider, ProviderContext

GROUP = "cloudtrain.providers"

@lru_cache(maxsize=1)
def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def names() -> list[str]:
    return sorted(_entry_points())


def provider_class(name: str) -> type[Provider]:
    """The class installed under ``name`` (unknown: a UserError naming the close ones)."""
    return _load(name)


def get(name: str, ctx: ProviderContext) -> Provider:
    """Provider ``name`` made for ``ctx`` (a provider class takes the context: the contract's
    constructor, which the Provider protocol cannot declare)."""
    return _load(name)(ctx)


def _load(name: str) -> Any:
    eps = _entry_points()
    if name not in eps:
        from difflib import get_close_matches

        close = get_close_matches(name, list(eps), n=1)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        raise UserError(f"Unknown provider '{name}'.", hint + described(sorted(eps)))
    try:
        return eps[name].load()
    except ImportError as exc:
        raise MissingSDK(name, exc.name or str(exc)) from None


# --- SDKs: installed or not ------------------------------------------------------------------

@runtime_checkable
class NeedsSDK(Protocol):
    """A provider class that names the SDK modules it imports (its extra installs them)."""

    sdk_modules: ClassVar[tuple[str, ...]]


def _sdk_modules(cls: type[Provider]) -> tuple[str, ...]:
    return tuple(cls.sdk_modules) if isinstance(cls, NeedsSDK) else ()


def _findable(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def sdk_missing(name: str) -> str | None:
    """The first SDK module provider ``name`` needs that is not installed here (None: it has
    all it needs, or names none)."""
    try:
        cls = provider_class(name)
    except MissingSDK as exc:
        return exc.module
    return next((m for m in _sdk_modules(cls) if not _findable(m)), None)


def require_sdk(name: str) -> None:
    """Raise :class:`MissingSDK` (exit 2, the pip line) when provider ``name`` lacks its SDK."""
    missing = sdk_missing(name)
    if missing is not None:
        raise MissingSDK(name, missing)


def sdk_error(exc: ModuleNotFoundError) -> MissingSDK | None:
    """The :class:`MissingSDK` for an SDK import that failed inside a provider (None: the
    missing module is no provider's SDK)."""
    root = (exc.name or "").split(".")[0]
    for name in names():
        try:
            modules = _sdk_modules(provider_class(name))
        except UserError:
            continue
        if root and any(m.split(".")[0] == root for m in modules):
            return MissingSDK(name, exc.name or root)
    return None


def described(providers: list[str] | None = None) -> str:
    """The providers as lists say them: those installed (and which of them have no
    credentials, as far as the standard files and variables tell), and those whose SDK is
    not installed, with the pip line."""
    from cloudtrain import credentials

    ready, no_sdk = [], []
    for name in providers if providers is not None else names():
        if sdk_missing(name) is not None:
            no_sdk.append(name)
        elif credentials.present(name):
            ready.append(name)
        else:
            ready.append(f"{name} (no credentials found)")
    out = f"Installed providers: {', '.join(ready) or 'none'}."
    if no_sdk:
        out += (f" Not installed (their SDK is missing): {', '.join(no_sdk)}; e.g. pip "
                f"install 'cloudtrain[{no_sdk[0]}]'.")
    return out
