"""How a Compute Engine node ends its own compute billing, with no Google credential on it
(the node guard's last act), and how the CLI reads afterwards what it did.

A guest power-off STOPS a GCE VM (status TERMINATED): vCPU, memory and GPU billing end, and
the ephemeral external IP is released, but the boot disk remains and bills (persistent disk
per GB-month) until the instance is deleted, which the next CLI contact that reconciles the
cluster (``status --refresh``, ``down``) or ``cloudtrain gc`` does. A node cannot delete
itself without credentials (the nodes get no service account), so a stop is the cleanest
end there is from the node. The hard lifetime does not depend on the node at all: with
``max_hours`` each instance carries ``scheduling.maxRunDuration`` and
``instanceTerminationAction: DELETE``, and GCE deletes it, boot disk included, when the time
is up.

Before powering off, the node writes ``cloudtrain-guard: stop: <reason>`` to serial port 1
(ttyS0), which the CLI reads with instances.getSerialPortOutput.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time

from cloudtrain.errors import ProviderError

from .api import Api, NotFound

STOPPED = ("TERMINATED", "STOPPED", "SUSPENDED")
MARK = "cloudtrain-guard: stop: "
REASONS = ("idle", "job-end", "budget", "lifetime")
MIN_RUN = 30
"""GCE's shortest maxRunDuration, in seconds."""
STILL_BILLS = ("GCP: a guest shutdown only stops the VM (TERMINATED): compute and GPU "
               "billing end and the ephemeral IP is released, but each node's boot disk "
               "bills (persistent disk, per GB-month) until the next CLI contact (status "
               "--refresh, down) or 'cloudtrain gc' deletes the instance; with max_hours GCE "
               "itself deletes the instance and its disk at the hard lifetime "
               "(maxRunDuration, termination action DELETE).")

COMMAND = ('m="' + MARK + '${CT_GUARD_REASON:-unknown}"; '
           '{ echo "$m" | sudo -n tee /dev/ttyS0 || echo "$m" | sudo -n tee /dev/console; } '
           '>/dev/null 2>&1; sync; '
           'sudo -n shutdown -P now || sudo -n systemctl poweroff || sudo -n poweroff')

_REASON = re.compile(re.escape(MARK) + r"([a-z-]+)")


def run_seconds(max_hours: float | None) -> int | None:
    """The maxRunDuration for a task's ``max_hours`` (None: no limit)."""
    if not max_hours:
        return None
    return max(MIN_RUN, math.ceil(max_hours * 3600))


def lifetime_text(max_hours: float | None) -> str:
    secs = run_seconds(max_hours)
    if secs is None:
        return ""
    return (f"; maxRunDuration {secs} s (max_hours) with termination action DELETE: GCE "
            "deletes each node and its disk when it is up")


def stopped_at(stamp: str) -> float:
    """The epoch time of a ``lastStopTimestamp``; now when GCE gives none."""
    try:
        return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


def reason_in(text: str) -> str | None:
    found = [r for r in _REASON.findall(text or "") if r in REASONS]
    return found[-1] if found else None


def serial_reason(api: Api, project: str, zone: str, name: str) -> str | None:
    """The guard's reason from serial port 1 (GCE keeps a stopped VM's output); None when
    it cannot be read or holds none."""
    try:
        out = api.get("instances", "get_serial_port_output", project=project, zone=zone,
                      instance=name)   # port 1 (ttyS0) by default
    except (NotFound, ProviderError):
        return None
    return reason_in(str(out.get("contents") or ""))
