"""The caller's address range, for the SSH rule of a cluster's firewall (AWS security group,
GCP firewall, Azure NSG): ``resources.ssh_cidr`` when the task gives it, else this machine's
public IPv4 address as a /32, looked up once and cached (in memory, and for an hour in
``$CLOUDTRAIN_HOME/caller-ip.json``). Shared by every cloud provider."""

from __future__ import annotations

import ipaddress
import json
import time
from pathlib import Path
from typing import Callable

from cloudtrain.errors import NoCallerAddress

CHECKIP_URL = "https://checkip.amazonaws.com"
CALLER_IP_TTL = 3600.0


def lookup_public_ip(timeout: float = 5.0) -> str:
    """This machine's public IPv4 address, as a public echo service sees it."""
    import urllib.request

    with urllib.request.urlopen(CHECKIP_URL, timeout=timeout) as resp:  # noqa: S310 - fixed https URL
        return resp.read(64).decode().strip()


class CallerCidr:
    def __init__(self, home: Path, lookup: Callable[[], str] = lookup_public_ip,
                 clock: Callable[[], float] = time.time) -> None:
        self.file = home / "caller-ip.json"
        self.lookup = lookup
        self.clock = clock
        self._ip: str | None = None

    def cached(self) -> str | None:
        if self._ip is not None:
            return f"{self._ip}/32"
        try:
            data = json.loads(self.file.read_text())
            if self.clock() - float(data["at"]) < CALLER_IP_TTL:
                ipaddress.IPv4Address(data["ip"])
                self._ip = str(data["ip"])
                return f"{self._ip}/32"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def get(self, configured: str | None) -> str:
        """``configured`` (the task's ssh_cidr) when set, else the caller's /32."""
        if configured:
            return configured
        cached = self.cached()
        if cached:
            return cached
        try:
            ip = self.lookup().strip()
            ipaddress.IPv4Address(ip)
        except Exception as exc:  # noqa: BLE001 - any failure: ask the user for the range
            raise NoCallerAddress(
                f"Could not find this machine's public IP address for the cluster's SSH rule "
                f"({CHECKIP_URL}: {exc}).",
                "Set it in the task: resources.ssh_cidr: 203.0.113.7/32 (your address), or your "
                "network's range, e.g. 198.51.100.0/24.") from None
        self._ip = ip
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"ip": ip, "at": self.clock()}))
            tmp.replace(self.file)
        except OSError:
            pass
        return f"{ip}/32"
