"""What every step of the data path is handed: :class:`Env` (the home folder, the state
database, the UI, and the way to get a provider by name). Commands open one with
:func:`open_env` and pass it down; nothing below the commands opens its own.

The provider package is imported on first use (``pctx``, ``provider``), so a command that only
reads the state (a plain ``status``) never loads it."""

from __future__ import annotations

from dataclasses import dataclass
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

    @property
    def pctx(self) -> ProviderContext:
        from cloudtrain.provider.contract import ProviderContext

        return ProviderContext(self.home)

    def provider(self, name: str) -> Provider:
        """The provider ``name`` (an installed one, or an instance handed to the registry)."""
        from cloudtrain.provider import registry

        return registry.get(name, self.pctx)

    def cluster_dir(self, name: str) -> Path:
        """``home/clusters/<name>``, the same folder as ``pctx.cluster_dir`` (the name
        checked, the path inside ``home/clusters``) without importing the provider package."""
        from cloudtrain.names import check, inside

        return inside(self.home / "clusters", check(name))

    def logs_dir(self, cluster: str) -> Path:
        from cloudtrain.names import check, inside

        return inside(self.home / "logs", check(cluster))


def open_env(ui: UI) -> Env:
    from cloudtrain.paths import home

    h = home()
    return Env(h, open_state(h), ui)
