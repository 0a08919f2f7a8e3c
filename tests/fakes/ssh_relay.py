"""A proxy command for tests (``resources.ssh_proxy``): ``python ssh_relay.py %h %p LOG [WHERE]``
connects to the node ``%h``:``%p`` (or, with WHERE, a JSON file ``{"host:port": [real host,
real port]}``, to the real address of an address only this relay knows), appends one line to
LOG, and relays its stdin and stdout to that connection until either side ends.

LOG's line: ``HOST PORT LOCAL_PORT PARENT GRANDPARENT``: the address it was asked for, the local
port of its connection to the node (what the node sees in ``$SSH_CONNECTION``), and the process
names of its parent and grandparent (``ssh`` and ``rsync`` for rsync's connection; ``python``
for paramiko's, which runs the proxy itself).

Standard library only: it runs as its own process, under whichever Python the test names.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading


def comm(pid: int) -> tuple[str, int]:
    """A process's name and its parent's pid (("?", 0) when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return "?", 0
    name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
    return name, int(rest.split()[1])


def main(argv: list[str]) -> None:
    host, port, log = argv[0], int(argv[1]), argv[2]
    where: dict[str, list[object]] = {}
    if len(argv) > 3:
        with open(argv[3]) as f:
            where = json.load(f)
    real = where.get(f"{host}:{port}", [host, port])
    conn = socket.create_connection((str(real[0]), int(str(real[1]))))
    parent, grand = comm(os.getppid())
    with open(log, "a") as f:
        f.write(f"{host} {port} {conn.getsockname()[1]} {parent} {comm(grand)[0]}\n")

    def up() -> None:
        while True:
            data = os.read(0, 65536)
            if not data:
                conn.shutdown(socket.SHUT_WR)
                return
            conn.sendall(data)

    threading.Thread(target=up, daemon=True).start()
    while True:
        data = conn.recv(65536)
        if not data:
            break
        os.write(1, data)


if __name__ == "__main__":
    main(sys.argv[1:])
