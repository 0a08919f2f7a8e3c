"""What a guest shutdown does, for a cloud fake whose "instances" are local sshd nodes: the
stand-in node's own ``shutdown``, ``poweroff``, ``systemctl poweroff`` (tests/fakes/standin.py
puts emulations of them first on the node's PATH) run this when the node guard runs the
product's real self-stop command (``sudo -n shutdown -P now || ...``).

1. The cloud sees the guest power off, as that cloud reacts to it:
   - ``aws``: a TerminateInstances to the moto server carrying the guest-shutdown header
     (:data:`aws_moto.GUEST_SHUTDOWN_HEADER`): moto terminates the instance (as its
     InstanceInitiatedShutdownBehavior says) with the state reason
     Client.InstanceInitiatedShutdown, and its console shows the guard's line;
   - ``gce``: the GCE fake's control endpoint marks the instance TERMINATED (boot disk kept,
     ephemeral external IP released, lastStopTimestamp set, the guard's line on serial port
     1);
   - ``azure``: the VM's IMDS path on the ARM fake (``{imds}/_guest/shutdown``): the VM is
     ``stopped``, still allocated and billing (the fake's ``on_vm_stopped`` then stops the
     node, as the test wires it).
2. The node goes away (aws, gce): its sshd stops, and every process started through it (their
   environment carries the node's own HOME) is killed, this one last.

The reason is ``$CT_GUARD_REASON`` (as the guard sets it). Usage::

    python guest_shutdown.py aws --endpoint URL --region R --instance ID --node-dir DIR
    python guest_shutdown.py gce --url URL [--zone Z] --name NAME --node-dir DIR
    python guest_shutdown.py gce --url URL --instance NAME/ID --node-dir DIR
    python guest_shutdown.py azure --url IMDS_OF_VM --node-dir DIR
    python guest_shutdown.py --node DIR

``--node DIR``: the arguments the test wrote to ``DIR/cloud.json`` (``{"argv": [...]}``)
when it mapped the node to its instance (:func:`standin.bind`); without that file it fails
and does nothing. A second power-off of a node (the fallbacks after the first) does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

HEADER = "X-Ct-Guest-Shutdown"   # aws_moto.GUEST_SHUTDOWN_HEADER (this runs without it)


def aws(endpoint: str, region: str, instance: str, reason: str) -> None:
    import boto3

    ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint,
                       aws_access_key_id="testing", aws_secret_access_key="testing")

    def mark(request, **_):  # type: ignore[no-untyped-def]
        request.headers[HEADER] = reason or " "

    ec2.meta.events.register("before-sign.ec2.TerminateInstances", mark)
    ec2.terminate_instances(InstanceIds=[instance])


def gce(url: str, zone: str | None, name: str, reason: str) -> None:
    where = f"/zones/{zone}" if zone else ""
    req = urllib.request.Request(f"{url}/_fake{where}/instances/{name}/guest-shutdown",
                                 data=json.dumps({"reason": reason}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as resp:
        resp.read()


def azure(url: str) -> None:
    req = urllib.request.Request(url.rstrip("/") + "/_guest/shutdown", data=b"", method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as resp:
        resp.read()


def _with_home(home: str) -> list[int]:
    needle = f"HOME={home}".encode()
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def stop_node(node_dir: Path) -> None:
    """The node powers off: its sshd, then every process of the node."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.kill(int((node_dir / "sshd.pid").read_text().strip()), signal.SIGTERM)
    except (OSError, ValueError):
        pass
    home = str(node_dir / "root")
    for sig, wait in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 0.5)):
        for pid in _with_home(home):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(wait)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--node"]:
        node = Path(argv[1])
        if (node / "powered-off").exists():
            return 0
        try:
            argv = list(json.loads((node / "cloud.json").read_text())["argv"])
        except (OSError, ValueError, KeyError) as exc:
            print(f"stand-in node {node}: no instance bound to it ({exc}): not powering off",
                  file=sys.stderr)
            return 1
        (node / "powered-off").touch()
        argv += ["--node-dir", str(node)]
    ap = argparse.ArgumentParser()
    ap.add_argument("cloud", choices=["aws", "gce", "azure"])
    ap.add_argument("--endpoint")
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--instance")
    ap.add_argument("--url")
    ap.add_argument("--zone")
    ap.add_argument("--name")
    ap.add_argument("--node-dir", required=True)
    a = ap.parse_args(argv)
    reason = os.environ.get("CT_GUARD_REASON", "")
    if a.cloud == "azure":
        azure(a.url)
        return 0
    if a.cloud == "aws":
        aws(a.endpoint, a.region, a.instance, reason)
    else:
        # the name, or cloudtrain's instance id for a GCE node ("name/id"); the fake finds the
        # zone by name when none is given
        gce(a.url, a.zone, (a.name or a.instance).split("/")[0], reason)
    stop_node(Path(a.node_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
