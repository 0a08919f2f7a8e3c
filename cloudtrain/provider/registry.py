"""Find providers through the ``cloudtrain.providers`` entry-point group.

Loading a provider class must stay cheap: provider modules import their cloud SDK lazily,
inside the methods (or factories) that talk to the cloud. A provider class names the SDK
modules it needs in ``sdk_modules`` (its pip extra is ``cloudtrain[<name>]``), so that a
missing SDK is said before anything starts (:func:`require_sdk`), in lists of providers
(:func:`sdk_missing`), and where an import deep in a provider fails (:func:`sdk_error`).
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from cloudtrain.errors import MissingSDK, UserError

if TYPE_CHECKING:
    from cloudtrain.provider.contract import Provider, ProviderContext

GROUP = "cloudtrain.providers"

# Instances handed in by an embedding program or a test (e.g. a provider holding moto's
# client). They win over the entry point of the same name.
_instances: dict[str, Provider] = {}


@lru_cache(maxsize=1)
def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def names() -> list[str]:
    return sorted(set(_entry_points()) | set(_instances))


def provider_class(name: str) -> type[Provider]:
    if name in _instances:
        return type(_instances[name])
    eps = _entry_points()
    if name not in eps:
        from difflib import get_close_matches

        close = get_close_matches(name, list(eps), n=1)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        raise UserError(f"Unknown provider '{name}'.", hint + described(sorted(eps)))
    try:
        return eps[name].load()
    except ImportError as exc:
        raise MissingSDK(name, getattr(exc, "name", None) or str(exc)) from None


def get(name: str, ctx: ProviderContext) -> Provider:
    if name in _instances:
        return _instances[name]
    return provider_class(name)(ctx)


def is_instance(name: str) -> bool:
    """Whether ``name`` is served by a registered instance (a test's fake) rather than an
    installed entry point."""
    return name in _instances


def register_instance(name: str, provider: Provider) -> None:
    _instances[name] = provider


def unregister_instance(name: str) -> None:
    _instances.pop(name, None)


# --- SDKs: installed or not ------------------------------------------------------------------

def _findable(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def sdk_missing(name: str) -> str | None:
    """The first SDK module provider ``name`` needs that is not installed here (None: it has
    all it needs, or names none). A registered instance (a test's) has what it needs."""
    if name in _instances:
        return None
    try:
        cls = provider_class(name)
    except MissingSDK as exc:
        return exc.module
    return next((m for m in getattr(cls, "sdk_modules", ()) if not _findable(m)), None)


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
            modules = getattr(provider_class(name), "sdk_modules", ())
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
        elif credentials.present(name) or name in _instances:
            ready.append(name)
        else:
            ready.append(f"{name} (no credentials found)")
    out = f"Installed providers: {', '.join(ready) or 'none'}."
    if no_sdk:
        out += (f" Not installed (their SDK is missing): {', '.join(no_sdk)}; e.g. pip "
                f"install 'cloudtrain[{no_sdk[0]}]'.")
    return out
