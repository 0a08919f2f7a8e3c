"""Test-only address mapping: reach "cloud instances" that are really local sshd nodes.

When the provider's variable (``CLOUDTRAIN_<PROVIDER>_ADDRESS_MAP``, e.g.
``CLOUDTRAIN_GCP_ADDRESS_MAP``) names a JSON file, the provider does not use the addresses the
cloud (or a fake of it) reports. It looks each one up in the file and uses the local address
found there instead, and it REFUSES any address the file does not map: in this mode
cloudtrain never opens a connection to an address a fake cloud invented. The file is read
again on each lookup, so a test may write it once the instances exist; ``wait_for`` waits up
to ``<VAR>_WAIT`` seconds (default 60) for the entries. Format::

    {
      "addresses": {
        "34.90.1.2": {"host": "127.70.3.10", "port": 40123, "root_dir": "/tmp/n0/root"},
        "10.0.1.17": {"host": "127.70.3.10"}
      },
      "user": "alice",               # login user on the mapped nodes (default: the task's)
      "python": "/path/bin/python",  # CLOUDTRAIN_PYTHON for bootstrap (optional)
      "master_port": 41234           # torch rendezvous port on the head (optional)
    }

Public addresses map to where SSH connects (host, port, the node's root_dir); private
addresses map to the address the other nodes reach a node at (MASTER_ADDR). Not for users.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cloudtrain.errors import ProviderError


def env_name(provider: str) -> str:
    return f"CLOUDTRAIN_{provider.upper()}_ADDRESS_MAP"


@dataclass(frozen=True)
class Target:
    host: str
    port: int = 22
    root_dir: str | None = None


class AddressMap:
    def __init__(self, path: Path, env: str, sleep: Callable[[float], None] = time.sleep) -> None:
        self.path = path
        self.env = env
        self.sleep = sleep

    @classmethod
    def from_env(cls, provider: str) -> AddressMap | None:
        var = env_name(provider)
        p = os.environ.get(var, "").strip()
        return cls(Path(p), var) if p else None

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ProviderError(f"{self.env} file {self.path} cannot be read: {exc}.") from None
        return data if isinstance(data, dict) else {}

    def lookup(self, address: str) -> Target | None:
        entry = (self._load().get("addresses") or {}).get(address)
        if entry is None:
            return None
        if isinstance(entry, str):
            host, _, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
            return Target(host or entry, int(port) if port else 22)
        return Target(str(entry["host"]), int(entry.get("port", 22)), entry.get("root_dir"))

    def resolve(self, address: str, what: str) -> Target:
        t = self.lookup(address)
        if t is None:
            raise ProviderError(
                f"{what}: address {address or '(none)'} is not in the address map {self.path} "
                f"({self.env} is set): refusing to connect to an address the map does not give.",
                f"Add it to the map, or unset {self.env} (it is meant for tests only).")
        return t

    def wait_for(self, addresses: list[str], timeout: float | None = None) -> None:
        if timeout is None:
            timeout = float(os.environ.get(self.env + "_WAIT", "60"))
        deadline = time.monotonic() + timeout
        while True:
            missing = [a for a in addresses if self.lookup(a) is None]
            if not missing or time.monotonic() >= deadline:
                return
            self.sleep(0.1)

    def setting(self, key: str) -> Any:
        return self._load().get(key)
