"""What every step of the data path is handed: :class:`Env` (the home folder, the state
database, the UI, and the way to get a provider by name). Commands open one with
:func:`open_env` and pass it down; nothing below the commands opens its own.

Providers come from the installed entry points (:mod:`cloudtrain.provider.registry`), unless
the program that opened the Env handed in instances of its own (``Env(...,
providers={"aws": p})``: an embedding program's provider built with its own client, or a
test's, e.g. :class:`cloudtrain.testing.MemoryProvider`); those win over the entry point of
the same name.

The provider package is imported on first use (``pctx``, ``provider``), so a command that only
reads the state (a plain ``status``) never loads it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cloudtrain.state import State, open_state
from cloudtrain.ui import UI

if TYPE_CHECKING:
    from cloudtrain.provider.contract import Provider, ProviderContext


@dataclass
class Env:
    home: Path
    state: State
    ui: UI
    providers: Mapping[str, Provider] = field(default_factory=dict)
    """Provider instances handed in, by name; they win over the installed entry points."""

    @property
    def pctx(self) -> ProviderContext:
        from cloudtrain.provider.contract import ProviderContext

        return ProviderContext(self.home)

    def provider(self, name: str) -> Provider:
        """The provider ``name``: the instance handed in, or the installed one's class made
        for this home."""
        if name in self.providers:
            return self.providers[name]
        from cloudtrain.provider import registry

        return registry.get(name, self.pctx)

    def provider_class(self, name: str) -> type[Provider]:
        """The class of provider ``name`` (its capabilities, without making one)."""
        if name in self.providers:
            return type(self.providers[name])
        from cloudtrain.provider import registry

        return registry.provider_class(name)

    def provider_names(self) -> list[str]:
        """Every provider this Env can hand out: the installed ones and those handed in."""
        from cloudtrain.provider import registry

        return sorted(set(registry.names()) | set(self.providers))

    def sdk_missing(self, name: str) -> str | None:
        """The SDK module provider ``name`` lacks here (None: none; an instance handed in was
        made, so it has what it needs)."""
        if name in self.providers:
            return None
        from cloudtrain.provider import registry

        return registry.sdk_missing(name)

    def require_sdk(self, name: str) -> None:
        """Raise :class:`~cloudtrain.errors.MissingSDK` (exit 2, the pip line) when provider
        ``name`` lacks its SDK."""
        if name not in self.providers:
            from cloudtrain.provider import registry

            registry.require_sdk(name)

    def has_credentials(self, name: str) -> bool:
        """Whether provider ``name`` can be asked anything: credentials in the standard files
        and variables (:func:`cloudtrain.credentials.present`), or an instance handed in,
        which carries its own client."""
        from cloudtrain import credentials

        return name in self.providers or credentials.present(name)

    def cluster_dir(self, name: str) -> Path:
        """``home/clusters/<name>``, the same folder as ``pctx.cluster_dir`` (the name
        checked, the path inside ``home/clusters``) without importing the provider package."""
        from cloudtrain.names import check, inside

        return inside(self.home / "clusters", check(name))

    def logs_dir(self, cluster: str) -> Path:
        from cloudtrain.names import check, inside

        return inside(self.home / "logs", check(cluster))


def open_env(ui: UI, providers: Mapping[str, Provider] | None = None) -> Env:
    """The Env of this user's home (``CLOUDTRAIN_HOME``), with ``providers`` handed in."""
    from cloudtrain.paths import home

    h = home()
    return Env(h, open_state(h), ui, dict(providers or {}))
