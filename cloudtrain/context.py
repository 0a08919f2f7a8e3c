"""What every step of the data path is handed: :class:`Env` (the home folder, the state
database, the UI, and the way to get a provider by name). Commands open one with
:func:`open_env` and pass it down; nothing below the commands opens its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cloudtrain.provider import registry
from cloudtrain.provider.contract import ProviderContext
from cloudtrain.state import State, open_state
from cloudtrain.ui import UI

if TYPE_CHECKING:
    from cloudtrain.provider.contract import Provider


@dataclass
class Env:
    home: Path
    state: State
    ui: UI

    @property
    def pctx(self) -> ProviderContext:
        return ProviderContext(self.home)

    def provider(self, name: str) -> Provider:
        """The provider ``name`` (an installed one, or an instance handed to the registry)."""
        return registry.get(name, self.pctx)

    def logs_dir(self, cluster: str) -> Path:
        from cloudtrain.names import check, inside

        return inside(self.home / "logs", check(cluster))


def open_env(ui: UI) -> Env:
    from cloudtrain.paths import home

    h = home()
    return Env(h, open_state(h), ui)
