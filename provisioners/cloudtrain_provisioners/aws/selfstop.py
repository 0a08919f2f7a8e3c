"""How an EC2 node ends its own billing, with no AWS credential on it (the node guard's last
act), and how the CLI reads afterwards what it did.

Every instance is launched with ``InstanceInitiatedShutdownBehavior: terminate`` and its root
volume with ``DeleteOnTermination`` (see :mod:`.instances`), so a guest power-off is all it
takes: EC2 terminates the instance, its EBS root volume, its network interface and public
IPv4 address go with it, and compute billing ends. Before powering off, the node writes
``cloudtrain-guard: stop: <reason>`` to its serial console; the CLI reads it back with
GetConsoleOutput (with the user's credentials, at the next contact). EC2 records the guest
shutdown as the state reason ``Client.InstanceInitiatedShutdown`` and its time in the state
transition reason ("... (2026-11-24 01:02:03 GMT)").

What is left: the security group, the key pair and the placement group (none of them bills),
removed by the next CLI contact that reconciles the cluster (``status --refresh``, ``down``)
or by ``cloudtrain gc``.
"""

from __future__ import annotations

import calendar
import re
import time
from typing import Any

from cloudtrain.errors import ProviderError

from .api import Api

GUEST_SHUTDOWN = "Client.InstanceInitiatedShutdown"
MARK = "cloudtrain-guard: stop: "
REASONS = ("idle", "job-end", "budget", "lifetime")
STILL_BILLS = ("AWS: nothing for compute: a guest shutdown terminates the instance "
               "(InstanceInitiatedShutdownBehavior=terminate) and its EBS root volume, network "
               "interface and public IP go with it (DeleteOnTermination); the security group, "
               "key pair and placement group left behind cost nothing and are removed at the "
               "next CLI contact (status --refresh, down) or by 'cloudtrain gc'.")

# The node writes the reason to its serial console (ttyS0 on Xen and Nitro; /dev/console as
# the fallback), then powers off. sudo -n: the login user of the AMIs has passwordless sudo;
# without it the command fails instead of waiting for a password.
COMMAND = ('m="' + MARK + '${CT_GUARD_REASON:-unknown}"; '
           '{ echo "$m" | sudo -n tee /dev/ttyS0 || echo "$m" | sudo -n tee /dev/console; } '
           '>/dev/null 2>&1; sync; '
           'sudo -n shutdown -P now || sudo -n systemctl poweroff || sudo -n poweroff')

_WHEN = re.compile(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) (?:GMT|UTC)\)")
_REASON = re.compile(re.escape(MARK) + r"([a-z-]+)")


def stopped_at(transition: str) -> float | None:
    """The epoch time in a state transition reason ("User initiated (2026-11-24 01:02:03
    GMT)"); None when it gives none."""
    m = _WHEN.search(transition or "")
    if not m:
        return None
    return float(calendar.timegm(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")))


def reason_in(console: str) -> str | None:
    """The last reason the guard wrote to the console, when it is one it gives."""
    found = [r for r in _REASON.findall(console or "") if r in REASONS]
    return found[-1] if found else None


def console_reason(api: Api, region: str, instance_id: str) -> str | None:
    """The guard's reason from the instance's console output (EC2 keeps the output of a
    terminated instance for a while); None when it cannot be read or holds none."""
    for latest in (True, False):
        kw: dict[str, Any] = {"InstanceId": instance_id}
        if latest:
            kw["Latest"] = True
        try:
            out = api.call(region, "get_console_output", **kw).get("Output") or ""
        except ProviderError:
            continue
        text = _decode(out)
        if reason_in(text):
            return reason_in(text)
    return None


def _decode(out: str) -> str:
    """boto3 gives the console output decoded; an emulator may hand back base64."""
    if MARK in out:
        return out
    import base64
    import binascii

    try:
        return base64.b64decode(out, validate=True).decode(errors="replace")
    except (binascii.Error, ValueError):
        return out
