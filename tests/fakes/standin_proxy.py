"""The tests' ``resources.ssh_proxy`` (a ProxyCommand): reach a fake cloud's instance at the
address the fake invented by relaying to the local sshd node that stands in for it.

    python standin_proxy.py MAPFILE HOST PORT [WAIT]

ssh runs it with ``%h %p``. MAPFILE (the test's own, written once the fake's instances run)
maps an invented address to a stand-in node on loopback::

    {"54.1.2.3": {"host": "127.70.3.10", "port": 40123}, ...}

It waits up to WAIT seconds (default 60) for HOST to appear, then connects to the stand-in
and relays bytes both ways until either side ends. It REFUSES (exit 1, nothing connected) an
address the map does not give, or one that maps to anything but a loopback address: no test
ever connects to an address a fake invented. Each relay is logged to ``MAPFILE.log``
(``HOST:PORT -> ADDR:PORT``), for the tests that check where connections went.
"""

from __future__ import annotations

import ipaddress
import json
import os
import selectors
import socket
import sys
import time
from pathlib import Path


def lookup(mapfile: Path, host: str, wait: float) -> tuple[str, int] | None:
    deadline = time.monotonic() + wait
    while True:
        try:
            entry = json.loads(mapfile.read_text()).get(host)
        except (OSError, ValueError):
            entry = None
        if entry is not None:
            return str(entry["host"]), int(entry.get("port", 22))
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def relay(sock: socket.socket) -> None:
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, "in")
    sel.register(sock, selectors.EVENT_READ, "sock")
    while True:
        for key, _ in sel.select():
            if key.data == "in":
                data = os.read(0, 65536)
                if not data:
                    sel.unregister(0)
                    sock.shutdown(socket.SHUT_WR)
                else:
                    sock.sendall(data)
            else:
                data = sock.recv(65536)
                if not data:
                    return
                view = memoryview(data)
                while view:
                    view = view[os.write(1, view):]


def main(argv: list[str]) -> int:
    mapfile, host, port = Path(argv[1]), argv[2], argv[3]
    wait = float(argv[4]) if len(argv) > 4 else 60.0
    target = lookup(mapfile, host, wait)
    if target is None:
        print(f"standin proxy: {host} is not in {mapfile}: refusing to connect to an address "
              "a fake invented", file=sys.stderr)
        return 1
    if not ipaddress.ip_address(target[0]).is_loopback:
        print(f"standin proxy: {host} maps to {target[0]}, not a loopback address: refused",
              file=sys.stderr)
        return 1
    with open(str(mapfile) + ".log", "a") as log:
        log.write(f"{host}:{port} -> {target[0]}:{target[1]}\n")
    with socket.create_connection(target, timeout=10) as sock:
        sock.settimeout(None)
        relay(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
