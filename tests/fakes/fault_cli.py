"""The real cloudtrain command line with one phase held open, so that the fault matrix
(tests/e2e/test_fault_matrix.py) can signal it there deterministically. Test-only: it lives in
tests/, is never installed, and production code knows nothing of it.

    python tests/fakes/fault_cli.py launch task.yaml --down

Environment:
  CT_FAULT_PHASE   provision | ssh | bootstrap | sync  (setup and run are marked by the task's
                   own scripts and need no hook)
  CT_FAULT_MARKER  a file written when the phase is reached
  CT_FAULT_HOLD    how long the phase is held, in seconds (default 120)
  CT_FAULT_ROLLBACK_MARKER  with provision: a file written when the provider's terminate
                   starts, which then waits CT_FAULT_ROLLBACK_HOLD seconds (default 3) before
                   the real terminate, so a signal can land inside a rollback

provision: the provider has created the nodes; create_nodes then holds (any provider).
ssh:       local provider only: the nodes' sshd comes up only after the hold, so the CLI waits
           for SSH; the marker is written when it starts waiting.
bootstrap: held as bootstrap starts.
sync:      rsync is a wrapper that writes the marker and sleeps before the real rsync.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

HOLD = float(os.environ.get("CT_FAULT_HOLD", "120"))


def _reached() -> None:
    Path(os.environ["CT_FAULT_MARKER"]).write_text(str(os.getpid()))


def _hold() -> None:
    end = time.monotonic() + HOLD
    while time.monotonic() < end:
        time.sleep(0.05)


def _hold_provision() -> None:
    from cloudtrain.provider import registry

    real_get = registry.get

    def get(name: str, ctx: Any) -> Any:
        p = real_get(name, ctx)
        if not getattr(p, "_ct_fault_held", False):
            create = p.create_nodes

            def create_nodes(request: Any, network: Any) -> Any:
                nodes = create(request, network)
                _reached()
                _hold()
                return nodes

            p.create_nodes = create_nodes
            p._ct_fault_held = True
            if os.environ.get("CT_FAULT_ROLLBACK_MARKER"):
                terminate = p.terminate

                def held_terminate(cluster: str) -> Any:
                    Path(os.environ["CT_FAULT_ROLLBACK_MARKER"]).write_text(str(os.getpid()))
                    end = time.monotonic() + float(os.environ.get("CT_FAULT_ROLLBACK_HOLD", "3"))
                    while time.monotonic() < end:
                        time.sleep(0.05)
                    return terminate(cluster)

                p.terminate = held_terminate
        return p

    registry.get = get  # type: ignore[assignment]


def _slow_sshd() -> None:
    from cloudtrain import remote
    from cloudtrain_provisioners.local import sshd

    real_start = sshd.start

    def start(node_dir: Path, netns: str | None = None) -> None:
        t = threading.Timer(HOLD, real_start, (node_dir, netns))
        t.daemon = True
        t.start()

    sshd.start = start  # type: ignore[assignment]
    real_connect = remote.Group.connect

    def connect(self: Any, *args: Any, **kwargs: Any) -> Any:
        _reached()
        return real_connect(self, *args, **kwargs)

    remote.Group.connect = connect  # type: ignore[method-assign]


def _hold_bootstrap() -> None:
    from cloudtrain.pipeline import bootstrap

    real_run = bootstrap.run

    def run(*args: Any, **kwargs: Any) -> Any:
        _reached()
        _hold()
        return real_run(*args, **kwargs)

    bootstrap.run = run  # type: ignore[assignment]


def _slow_rsync() -> None:
    from cloudtrain.pipeline import sync

    real = shutil.which("rsync")
    marker = os.environ["CT_FAULT_MARKER"]
    wrapper = Path(marker + ".rsync")
    wrapper.write_text(f"#!/bin/sh\necho $$ > '{marker}'\nsleep {HOLD:g}\nexec '{real}' \"$@\"\n")
    wrapper.chmod(0o755)
    sync._rsync_bin = lambda: str(wrapper)  # type: ignore[attr-defined]


def main() -> None:
    phase = os.environ.get("CT_FAULT_PHASE", "")
    hooks = {"provision": _hold_provision, "ssh": _slow_sshd, "bootstrap": _hold_bootstrap,
             "sync": _slow_rsync}
    if phase:
        hooks[phase]()
    from cloudtrain.commands.main import cli

    sys.argv[0] = "cloudtrain"
    cli(prog_name="cloudtrain")


if __name__ == "__main__":
    main()
