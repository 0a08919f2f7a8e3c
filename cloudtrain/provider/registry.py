"""Find providers through the ``cloudtrain.providers`` entry-point group.

Loading a provider class must stay cheap: provider modules import their cloud SDK lazily,
inside the methods (or factories) that talk to the cloud.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from cloudtrain.errors import UserError

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
        raise UserError(
            f"Unknown provider '{name}'.",
            hint + f"Installed providers: {', '.join(sorted(eps)) or 'none'}. Cloud providers "
            "come with their extra, e.g. pip install 'cloudtrain[aws]'.",
        )
    try:
        return eps[name].load()
    except ImportError as exc:
        raise UserError(
            f"Provider '{name}' could not be loaded ({exc}).",
            f"Install its extra: pip install 'cloudtrain[{name}]'.",
        ) from None


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
