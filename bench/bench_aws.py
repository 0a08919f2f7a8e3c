#!/usr/bin/env python3
"""AWS provider: provision and tear down 1, 8 and 64 nodes against a moto server on loopback.

What it runs, per node count N (``--nodes``), ``--repeats`` times:

1. ``ensure_network`` + ``create_nodes`` of the AWS provider (in process, with boto3's real
   client talking HTTP to a moto server started on 127.0.0.1 by this script): security group
   and its rules, key pair, cluster placement group (N > 1), N x RunInstances in parallel
   (at most ``instances.MAX_PARALLEL`` in flight), batched DescribeInstances until all run;
2. ``terminate``: one batched TerminateInstances, wait until EC2 says terminated, delete the
   security group, key pair and placement group, and check nothing tagged is left.

Printed: wall time of each phase (median over the repeats), EC2 API calls per phase (and how
many were RunInstances / TerminateInstances / DescribeInstances), and whether anything was
left. With ``--serial`` it also runs each count with one RunInstances in flight at a time,
to show what the parallel fan-out buys.

Read the numbers as the provider's own overhead (request building, parsing, batching, its
polling) plus moto's: moto answers in milliseconds where EC2 takes seconds to minutes, and it
serialises RunInstances internally (its address allocation is not thread-safe), so parallel
launches overlap only the HTTP round trips here. ``--latency S`` makes each RunInstances
wait S seconds in the server first (outside moto's lock, as EC2's time is spent on EC2's
side): with ``--latency 0.5 --serial`` the table shows what the parallel fan-out buys.

No credentials or network beyond loopback are used; nothing outside a temp directory is
touched, and the moto server is stopped (by its pid) on exit, Ctrl-C and SIGTERM too.

    python bench/bench_aws.py [--nodes 1,8,64] [--repeats 3] [--serial] [--latency 0.5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
FAKES = Path(__file__).resolve().parent.parent / "tests" / "fakes"
sys.path.insert(0, str(FAKES))
from _common import (  # noqa: E402 - found through the sys.path lines above
    fmt, iter_csv_ints, machine_line, median, sigterm_as_interrupt, table, verdict)

REGION = "us-east-1"
INSTANCE_TYPE = "g4dn.xlarge"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(root: Path, latency: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}
    env.pop("MOTO_AMIS_PATH", None)
    log = open(root / "moto.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(FAKES)!r}); "
                               "from aws_moto import serve_moto; "
                               f"serve_moto('127.0.0.1', {port}, {latency!r})"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start; see "
                                   + str(root / "moto.log")) from None
            time.sleep(0.1)


class Calls:
    """Counts the EC2 calls a client makes (botocore's before-call event)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def install(self, client: Any) -> None:
        client.meta.events.register("before-call.ec2", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        with self.lock:
            self.counts[model.name] += 1

    def take(self) -> Counter[str]:
        with self.lock:
            out, self.counts = self.counts, Counter()
        return out


def one_run(home: Path, n: int, run: int, serial: bool) -> dict[str, Any]:
    from cloudtrain.keys import ensure_keys
    from cloudtrain.provider import ClusterRequest, ProviderContext
    from cloudtrain.taskmodel import Resources
    from cloudtrain.ui import UI
    from cloudtrain_provisioners.aws import AWSOptions, AWSProvider
    from cloudtrain_provisioners.aws import instances as I
    from cloudtrain_provisioners.aws.api import BotoClients

    clients = BotoClients()
    calls = Calls()
    calls.install(clients.ec2(REGION))
    inspect = BotoClients().ec2(REGION)
    name = f"bench{n}-{run}{'s' if serial else ''}"
    keys = ensure_keys(home / "clusters" / name, comment=name)
    req = ClusterRequest(name=name, num_nodes=n,
                         resources=Resources.model_validate(
                             {"provider": "aws", "region": REGION,
                              "instance_type": INSTANCE_TYPE}),
                         options=AWSOptions(host_key_wait=0), public_key=keys.public_key())
    provider = AWSProvider(ProviderContext(home), clients=clients,
                           caller_ip=lambda: "203.0.113.7", poll=0.2, ui=UI(quiet=True))
    saved = I.MAX_PARALLEL
    if serial:
        I.MAX_PARALLEL = 1
    try:
        t0 = time.perf_counter()
        nodes = provider.create_nodes(req, provider.ensure_network(req))
        t1 = time.perf_counter()
    finally:
        I.MAX_PARALLEL = saved
    up_calls = calls.take()
    assert len(nodes) == n and all(x.status == "running" for x in nodes), nodes
    t2 = time.perf_counter()
    provider.terminate(name)
    t3 = time.perf_counter()
    down_calls = calls.take()
    flt = [{"Name": "tag:cloudtrain:cluster", "Values": [name]}]
    live = [i for r in inspect.describe_instances(Filters=flt + [
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped",
                                                   "shutting-down"]}])["Reservations"]
            for i in r["Instances"]]
    left = (len(live) + len(inspect.describe_security_groups(Filters=flt)["SecurityGroups"])
            + len(inspect.describe_key_pairs(Filters=flt)["KeyPairs"])
            + len(inspect.describe_placement_groups(Filters=flt)["PlacementGroups"]))
    return {"up": t1 - t0, "down": t3 - t2, "up_calls": up_calls, "down_calls": down_calls,
            "left": left}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,8,64", help="node counts (default 1,8,64)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per count (default 3)")
    ap.add_argument("--serial", action="store_true",
                    help="also run with one RunInstances in flight at a time")
    ap.add_argument("--latency", type=float, default=0.0, metavar="S",
                    help="seconds each RunInstances takes in the server before moto answers "
                         "(EC2 takes ~0.5-2 s; default 0: moto's own speed)")
    args = ap.parse_args()
    counts = list(iter_csv_ints(args.nodes))

    sigterm_as_interrupt()
    root = Path(tempfile.mkdtemp(prefix="ct-bench-aws-"))
    home = root / "home"
    print("# AWS provider against a moto server on loopback: provision + teardown")
    print(f"# machine: {machine_line()}")
    from aws_moto import hermetic_env

    hermetic_env()
    print(f"# a moto server on 127.0.0.1 per row; instance type {INSTANCE_TYPE}, "
          f"{args.repeats} run(s) per row after a warm-up run, medians; RunInstances latency "
          f"added in the server: {args.latency:g} s")
    rows, ok_all = [], True
    servers: list[subprocess.Popen[bytes]] = []
    try:
        modes = [False, True] if args.serial else [False]
        for n in counts:
            for serial in modes:
                # a fresh moto per row: terminated instances pile up in moto and slow it down
                proc, endpoint = start_moto(root, args.latency)
                servers.append(proc)
                os.environ["AWS_ENDPOINT_URL"] = endpoint
                one_run(home, 2, -1, False)   # warm-up (moto's region, boto3's client): not counted
                runs = [one_run(home, n, r, serial) for r in range(args.repeats)]
                proc.kill()
                proc.wait(timeout=10)
                up_calls, down_calls = runs[-1]["up_calls"], runs[-1]["down_calls"]
                left = max(r["left"] for r in runs)
                batched = (up_calls["RunInstances"] == n
                           and down_calls["TerminateInstances"] == -(-n // 200))
                ok_all &= left == 0 and batched
                up_s, down_s = median([r["up"] for r in runs]), median([r["down"] for r in runs])
                rows.append([f"{n}{' serial' if serial else ''}", fmt(up_s, 2),
                             fmt(up_s / n * 1000, 1), fmt(down_s, 2),
                             sum(up_calls.values()), up_calls["RunInstances"],
                             up_calls["DescribeInstances"], sum(down_calls.values()),
                             down_calls["TerminateInstances"], down_calls["DescribeInstances"],
                             left])
                print(f"# {rows[-1][0]} node(s): up {fmt(up_s, 2)} s, down {fmt(down_s, 2)} s",
                      flush=True)
    except KeyboardInterrupt:
        print("\n[bench] interrupted", file=sys.stderr)
        return 130
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(["nodes", "up s", "up ms/node", "down s", "up calls", "Run", "DescribeInst",
                 "down calls", "Terminate", "DescribeInst", "left"], rows))
    print()
    print(f"{verdict(ok_all)}  one RunInstances per node, one TerminateInstances per 200 "
          "nodes, nothing tagged left after teardown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
