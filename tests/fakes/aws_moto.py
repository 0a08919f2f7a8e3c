"""Test doubles for the AWS provider, shipped beside it (as httpx ships MockTransport).

- :class:`EmulatorClients`: a client factory for an EC2 emulator (moto in-process, or a moto
  server through ``AWS_ENDPOINT_URL``) whose clients also model placement groups, which moto
  does not implement: kept in memory, tagged, refused while instances use them.
- :class:`Faults`: errors injected at the API boundary through botocore's ``before-call``
  event (the provider's own code and botocore's parsing run unchanged), the requests the
  provider made (its own parameters, before serialisation), and spot interruptions
  simulated in ``DescribeInstances`` answers.
- :func:`dlami_images` / :func:`add_images_to_moto` / :func:`write_moto_amis`: fake AWS Deep
  Learning AMIs for moto (in-process backends, or a ``MOTO_AMIS_PATH`` file for a server).
- :class:`Harness` and :func:`hermetic_env`: a provider wired to moto for tests.
- :func:`serve_moto`: a moto server (its own process) with placement groups and the fake
  AMIs, for the end-to-end test and the benchmark.

Nothing here is imported by the provider itself; moto is needed only by the moto helpers.
"""

from __future__ import annotations

import base64
import copy
import datetime as _dt
import fnmatch
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from cloudtrain_provisioners.aws.api import BotoClients
from cloudtrain_provisioners.aws.instances import HOST_KEY_BEGIN, HOST_KEY_END

MOTO_ACCOUNT = "123456789012"
DLAMI_OWNER = "898082745236"


def client_error(code: str, message: str, op: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": message},
                        "ResponseMetadata": {"HTTPStatusCode": 400}}, op)


# --- placement groups (moto has none) -------------------------------------------------------

class PlacementGroups:
    """An in-memory model of EC2 placement groups, shared by the clients of one factory."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.launch_lock = threading.Lock()
        self.groups: dict[tuple[str, str], dict[str, Any]] = {}
        self.members: dict[tuple[str, str], set[str]] = {}
        self._ids = itertools.count(1)
        self.observer: Callable[[str, str, dict[str, Any]], str | None] | None = None
        """Set by :class:`Faults`: sees each call (region, op, params) and may return an
        error code to fail it with."""

    def list(self, region: str, filters: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(g) for (r, _), g in self.groups.items()
                    if r == region and _matches(g, filters or [])]

    def observe(self, region: str, op: str, params: dict[str, Any]) -> None:
        code = self.observer(region, op, params) if self.observer is not None else None
        if code:
            raise client_error(code, "injected by the test", op)


def _matches(group: dict[str, Any], filters: list[dict[str, Any]]) -> bool:
    tags = {t["Key"]: t["Value"] for t in group.get("Tags", [])}
    for f in filters:
        name, values = f["Name"], f["Values"]
        if name == "tag-key":
            ok = any(any(fnmatch.fnmatchcase(k, v) for v in values) for k in tags)
        elif name.startswith("tag:"):
            k = name[4:]
            ok = k in tags and any(fnmatch.fnmatchcase(tags[k], v) for v in values)
        elif name in ("group-name", "strategy", "state"):
            field = {"group-name": "GroupName", "strategy": "Strategy", "state": "State"}[name]
            ok = any(fnmatch.fnmatchcase(str(group.get(field, "")), v) for v in values)
        else:
            raise NotImplementedError(f"placement group filter {name}")
        if not ok:
            return False
    return True


class WithPlacementGroups:
    """An EC2 client that answers the placement-group calls itself and passes every other
    call to the wrapped client. ``RunInstances`` into a group that does not exist is refused
    as EC2 refuses it; deleting a group that non-terminated instances use is refused too."""

    def __init__(self, client: Any, region: str, store: PlacementGroups) -> None:
        self._client = client
        self._region = region
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def create_placement_group(self, *, GroupName: str, Strategy: str = "cluster",
                               TagSpecifications: list[dict[str, Any]] | None = None,
                               **_: Any) -> dict[str, Any]:
        self._store.observe(self._region, "CreatePlacementGroup",
                            {"GroupName": GroupName, "Strategy": Strategy,
                             "TagSpecifications": copy.deepcopy(TagSpecifications)})
        tags = [t for s in TagSpecifications or [] if s["ResourceType"] == "placement-group"
                for t in s["Tags"]]
        with self._store.lock:
            key = (self._region, GroupName)
            if key in self._store.groups:
                raise client_error("InvalidPlacementGroup.Duplicate",
                                   f"The placement group '{GroupName}' already exists.",
                                   "CreatePlacementGroup")
            group = {"GroupName": GroupName, "Strategy": Strategy, "State": "available",
                     "GroupId": f"pg-{next(self._store._ids):017x}", "Tags": tags}
            self._store.groups[key] = group
        return {"PlacementGroup": copy.deepcopy(group)}

    def describe_placement_groups(self, *, Filters: list[dict[str, Any]] | None = None,
                                  GroupNames: list[str] | None = None, **_: Any) -> dict[str, Any]:
        self._store.observe(self._region, "DescribePlacementGroups", {"Filters": Filters})
        with self._store.lock:
            out = [copy.deepcopy(g) for (r, n), g in self._store.groups.items()
                   if r == self._region and (not GroupNames or n in GroupNames)
                   and _matches(g, Filters or [])]
        return {"PlacementGroups": out}

    def delete_placement_group(self, *, GroupName: str, **_: Any) -> dict[str, Any]:
        self._store.observe(self._region, "DeletePlacementGroup", {"GroupName": GroupName})
        key = (self._region, GroupName)
        with self._store.lock:
            if key not in self._store.groups:
                raise client_error("InvalidPlacementGroup.Unknown",
                                   f"The Placement Group '{GroupName}' is unknown.",
                                   "DeletePlacementGroup")
            members = sorted(self._store.members.get(key, set()))
        if members:
            found = self._client.describe_instances(InstanceIds=members)
            alive = [i["InstanceId"] for r in found["Reservations"] for i in r["Instances"]
                     if i["State"]["Name"] != "terminated"]
            if alive:
                raise client_error("InvalidPlacementGroup.InUse",
                                   f"The placement group '{GroupName}' is in use.",
                                   "DeletePlacementGroup")
        with self._store.lock:
            self._store.groups.pop(key, None)
            self._store.members.pop(key, None)
        return {}

    def run_instances(self, **params: Any) -> dict[str, Any]:
        check_interfaces(params.get("NetworkInterfaces") or [])
        group = (params.get("Placement") or {}).get("GroupName")
        if group:
            with self._store.lock:
                known = (self._region, group) in self._store.groups
            if not known:
                raise client_error("InvalidPlacementGroup.Unknown",
                                   f"The Placement Group '{group}' is unknown.", "RunInstances")
        with self._store.launch_lock:   # moto's subnet address allocation is not thread-safe
            resp = self._client.run_instances(**params)
        if len(params.get("NetworkInterfaces") or []) > 1:
            no_public_address(self._region, [i["InstanceId"] for i in resp["Instances"]])
        if group:
            with self._store.lock:
                self._store.members.setdefault((self._region, group), set()).update(
                    i["InstanceId"] for i in resp["Instances"])
        return resp


def no_public_address(region: str, instance_ids: list[str]) -> None:
    """EC2 gives an instance launched with several interfaces no public address; moto gives
    its (one kept) interface one: taken away here (moto in-process)."""
    from moto.ec2.models import ec2_backends

    backend = ec2_backends[MOTO_ACCOUNT][region]
    for iid in instance_ids:
        for nic in backend.get_instance(iid).nics.values():
            nic.public_ip = None
            nic.public_ip_auto_assign = False


def check_interfaces(nics: list[dict[str, Any]]) -> None:
    """EC2's rules for RunInstances' NetworkInterfaces that moto does not keep: no public
    address asked for with several interfaces; the primary (card 0, device 0) not efa-only;
    each (card, device) once."""
    if len(nics) > 1 and any(n.get("AssociatePublicIpAddress") for n in nics):
        raise client_error("InvalidParameterCombination", "The associatePublicIPAddress "
                           "parameter cannot be specified when launching with multiple network "
                           "interfaces.", "RunInstances")
    slots = [(int(n.get("NetworkCardIndex", 0)), int(n.get("DeviceIndex", 0))) for n in nics]
    if len(set(slots)) != len(slots):
        raise client_error("InvalidParameterValue", "Each network interface needs its own "
                           "NetworkCardIndex/DeviceIndex.", "RunInstances")
    for n, slot in zip(nics, slots):
        if slot == (0, 0) and n.get("InterfaceType") == "efa-only":
            raise client_error("InvalidParameterCombination", "An EFA-only network interface "
                               "cannot be the primary network interface.", "RunInstances")


class EmulatorClients:
    """A client factory for an EC2 emulator: boto3's own clients (moto patches them in
    process; a server is reached through ``AWS_ENDPOINT_URL``) wrapped to model placement
    groups."""

    def __init__(self, default_region: str = "us-east-1") -> None:
        self._boto = BotoClients()
        self._inspect = BotoClients()
        self._region = default_region
        self.placement_groups = PlacementGroups()
        self._lock = threading.Lock()
        self._wrapped: dict[str, WithPlacementGroups] = {}

    def ec2(self, region: str) -> Any:
        with self._lock:
            c = self._wrapped.get(region)
            if c is None:
                c = WithPlacementGroups(self._boto.ec2(region), region, self.placement_groups)
                self._wrapped[region] = c
            return c

    def iam(self) -> Any:
        """IAM: moto's own (it models roles, instance profiles, their tags and policies)."""
        return self._boto.iam()

    def raw_iam(self) -> Any:
        """An IAM client without the provider's hooks, for tests to look or plant things."""
        return self._inspect.iam()

    def default_region(self) -> str:
        return self._region

    def raw(self, region: str) -> Any:
        """A boto3 client of its own, without the provider's hooks (for tests to look at or
        change what the emulator holds without being recorded or failed)."""
        return self._inspect.ec2(region)


# --- faults and request capture at the API boundary --------------------------------------------

class Faults:
    """Inject errors into, and record, the calls a factory's clients make.

    ``fail("RunInstances", "InsufficientInstanceCapacity", zone="us-east-1a")`` makes every
    RunInstances into that zone fail (``times``: only the first N matching calls). Each
    injected failure is recorded in ``injected``; every call in ``calls`` as (region, op,
    params) with the provider's own parameters."""

    def __init__(self, clients: Any) -> None:
        self.clients = clients
        self.lock = threading.RLock()
        self.rules: list[dict[str, Any]] = []
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.injected: list[tuple[str, str, str]] = []
        self.interrupted: dict[str, str] = {}
        self.console: dict[str, str] = {}
        self.wire: list[dict[str, str]] = []
        """Each request as sent (the EC2 Query API's form fields: ``Action``,
        ``NetworkInterface.1.NetworkCardIndex`` ...), after botocore serialised it."""
        self._installed: set[str] = set()

    def install(self, *regions: str) -> Faults:
        store = getattr(self.clients, "placement_groups", None)
        if store is not None:
            store.observer = self._observe_pg
        for region in regions:
            if region in self._installed:
                continue
            events = self.clients.ec2(region).meta.events
            events.register("provide-client-params.ec2", self._capture(region))
            events.register("before-call.ec2", self._before(region))
            events.register("after-call.ec2.DescribeInstances", self._after_describe)
            events.register("before-send.ec2", self._sent)
            self._installed.add(region)
        return self

    def fail(self, op: str, code: str, *, region: str | None = None, zone: str | None = None,
             times: int | None = None, skip: int = 0, message: str = "injected by the test",
             when: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Fail matching calls with ``code``: after the first ``skip`` of them, ``times``
        of them (None: all). ``when`` sees the provider's parameters."""
        with self.lock:
            self.rules.append({"op": op, "code": code, "region": region, "zone": zone,
                               "times": times, "skip": skip, "message": message, "when": when})

    def _match(self, region: str, op: str, params: dict[str, Any]) -> dict[str, Any] | None:
        zone = (params.get("Placement") or {}).get("AvailabilityZone")
        with self.lock:
            for rule in self.rules:
                if rule["op"] != op or rule["region"] not in (None, region):
                    continue
                if rule["zone"] is not None and rule["zone"] != zone:
                    continue
                if rule["when"] is not None and not rule["when"](params):
                    continue
                if rule["skip"] > 0:
                    rule["skip"] -= 1
                    continue
                if rule["times"] is not None:
                    if rule["times"] <= 0:
                        continue
                    rule["times"] -= 1
                self.injected.append((region, op, rule["code"]))
                return rule
        return None

    def _observe_pg(self, region: str, op: str, params: dict[str, Any]) -> str | None:
        with self.lock:
            self.calls.append((region, op, params))
        rule = self._match(region, op, params)
        return rule["code"] if rule else None

    def clear(self) -> None:
        with self.lock:
            self.rules.clear()

    def interrupt(self, region: str, instance_id: str,
                  reason: str = "Server.SpotInstanceTermination") -> None:
        """AWS takes the instance back: it is terminated in the emulator, and from now on
        DescribeInstances gives ``reason`` as its state reason."""
        self.interrupted[instance_id] = reason
        raw = getattr(self.clients, "raw", self.clients.ec2)(region)
        raw.terminate_instances(InstanceIds=[instance_id])

    def console_output(self, instance_id: str, text: str) -> None:
        """GetConsoleOutput for the instance returns ``text``."""
        self.console[instance_id] = text

    def _sent(self, request: Any, **_: Any) -> None:
        from urllib.parse import parse_qsl

        body = request.body
        text = body.decode() if isinstance(body, bytes) else str(body or "")
        with self.lock:
            self.wire.append(dict(parse_qsl(text, keep_blank_values=True)))

    def sent(self, action: str) -> list[dict[str, str]]:
        """The requests of ``action`` as they went on the wire (form fields)."""
        return [w for w in self.wire if w.get("Action") == action]

    def ops(self, op: str, region: str | None = None) -> list[dict[str, Any]]:
        return [p for r, o, p in self.calls if o == op and (region is None or r == region)]

    def _capture(self, region: str) -> Callable[..., None]:
        def handler(params: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
            snapshot = copy.deepcopy(params)
            context["cloudtrain_params"] = snapshot
            with self.lock:
                self.calls.append((region, model.name, snapshot))
        return handler

    def _before(self, region: str) -> Callable[..., Any]:
        def handler(model: Any, context: dict[str, Any], **_: Any) -> Any:
            from botocore.awsrequest import AWSResponse

            params = context.get("cloudtrain_params", {})
            if model.name == "GetConsoleOutput" and params.get("InstanceId") in self.console:
                text = self.console[params["InstanceId"]]
                return (AWSResponse("https://ec2.test", 200, {}, None),
                        {"InstanceId": params["InstanceId"],
                         "Output": base64.b64encode(text.encode()).decode(),
                         "ResponseMetadata": {"HTTPStatusCode": 200}})
            rule = self._match(region, model.name, params)
            if rule is not None:
                return (AWSResponse("https://ec2.test", 400, {}, None),
                        {"Error": {"Code": rule["code"], "Message": rule["message"]},
                         "ResponseMetadata": {"HTTPStatusCode": 400}})
            return None
        return handler

    def _after_describe(self, parsed: dict[str, Any], **_: Any) -> None:
        if not self.interrupted:
            return
        for r in parsed.get("Reservations", []):
            for i in r.get("Instances", []):
                reason = self.interrupted.get(i.get("InstanceId"))
                if reason and i.get("State", {}).get("Name") in ("shutting-down", "terminated"):
                    i["StateReason"] = {"Code": reason, "Message": f"{reason}: injected"}


# --- fake Deep Learning AMIs for moto ----------------------------------------------------------

def dlami_images() -> list[dict[str, Any]]:
    """Deep Learning AMIs (and decoys) in moto's AMI record format: two PyTorch DLAMIs
    (the newer must win), a Base DLAMI, an ARM64 one, and an image with a DLAMI name that
    Amazon does not own (must never be picked)."""
    def ami(ami_id: str, name: str, date: str, arch: str = "x86_64",
            owner: str = DLAMI_OWNER, alias: str | None = "amazon") -> dict[str, Any]:
        return {"ami_id": ami_id, "name": name, "description": name, "owner_id": owner,
                "owner_alias": alias, "public": True, "virtualization_type": "hvm",
                "architecture": arch, "state": "available", "creation_date": date,
                "platform": None, "root_device_type": "ebs", "root_device_name": "/dev/sda1",
                "sriov": "simple", "hypervisor": "xen", "image_type": "machine"}
    return [
        ami("ami-0d1a0000000000001",
            "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.7 (Ubuntu 22.04) 20250601",
            "2025-06-01T00:00:00.000Z"),
        ami("ami-0d1a0000000000002",
            "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.9 (Ubuntu 24.04) 20260317",
            "2026-03-17T00:00:00.000Z"),
        ami("ami-0d1a0000000000003",
            "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20260428",
            "2026-04-28T00:00:00.000Z"),
        ami("ami-0d1a0000000000004",
            "Deep Learning ARM64 AMI OSS Nvidia Driver GPU PyTorch 2.9 (Ubuntu 24.04) 20260317",
            "2026-03-17T00:00:00.000Z", arch="arm64"),
        ami("ami-0bad000000000000f",
            "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 9.9 (Ubuntu 24.04) 20991231",
            "2099-12-31T00:00:00.000Z", owner=MOTO_ACCOUNT, alias=None),
    ]


NEWEST_DLAMI = "ami-0d1a0000000000002"


def add_images_to_moto(region: str, images: list[dict[str, Any]] | None = None) -> None:
    """Put images into moto's in-process EC2 backend of ``region``."""
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.amis import Ami

    backend = ec2_backends[MOTO_ACCOUNT][region]
    for rec in images or dlami_images():
        rec = dict(rec)
        rec["creation_date"] = _dt.datetime.fromisoformat(rec["creation_date"].replace("Z", "+00:00"))
        ami = Ami(backend, rec.pop("ami_id"), region_name=f"{region}a", **rec)
        backend.amis[ami.id] = ami


def write_moto_amis(path: Path) -> Path:
    """A ``MOTO_AMIS_PATH`` file holding the fake DLAMIs (for a moto server). The decoy is
    left out: moto takes every image of that file as Amazon's."""
    path.write_text(json.dumps([i for i in dlami_images() if i["owner_id"] == DLAMI_OWNER]))
    return path


# --- a harness for tests and benchmarks on moto -------------------------------------------------

TEST_CALLER_IP = "203.0.113.7"


class _Environ:
    """``setenv``/``delenv`` on os.environ (what pytest's monkeypatch offers, for scripts)."""

    def setenv(self, key: str, value: str) -> None:
        import os

        os.environ[key] = value

    def delenv(self, key: str, raising: bool = False) -> None:
        import os

        os.environ.pop(key, None)


def hermetic_env(mp: Any = None) -> None:
    """Environment for moto runs: fake credentials, none of the user's profiles or config
    files, and moto without its 1300 default AMIs per region (slow to load, never used).
    ``mp``: pytest's monkeypatch (default: os.environ, changed for good)."""
    mp = mp or _Environ()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_CONFIG_FILE": "/nonexistent/aws-config",
                 "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
                 "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}.items():
        mp.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "CLOUDTRAIN_AWS_PROFILE", "AWS_ENDPOINT_URL",
              "AWS_ENDPOINT_URL_EC2"):
        mp.delenv(k, raising=False)


class Harness:
    """A provider wired to an emulator, with what tests need around it."""

    def __init__(self, home: Path, regions: tuple[str, ...] = ("us-east-1",),
                 clients: EmulatorClients | None = None) -> None:
        import io

        self.home = home
        self.clients = clients or EmulatorClients()
        self.faults = Faults(self.clients).install(*regions)
        self.sleeps: list[float] = []
        self.err = io.StringIO()

    def provider(self, **kw: Any) -> Any:
        from cloudtrain.provider import ProviderContext
        from cloudtrain.ui import UI

        from cloudtrain_provisioners.aws.provider import AWSProvider

        kw.setdefault("caller_ip", lambda: TEST_CALLER_IP)
        kw.setdefault("sleep", self.sleeps.append)
        kw.setdefault("poll", 0.0)
        kw.setdefault("ui", UI(err=self.err))
        return AWSProvider(ProviderContext(self.home), clients=self.clients, **kw)

    def messages(self) -> str:
        return self.err.getvalue()

    def request(self, name: str = "demo", num_nodes: int = 2, aws: dict[str, Any] | None = None,
                region: str | None = "us-east-1", offers: Any = None, **resources: Any) -> Any:
        """A ClusterRequest for ``num_nodes`` x A100:8 (by default) in ``region`` (None: no
        region, the targets in price order), with the cluster's real SSH key and the
        targets the placement step gives it (from ``offers``, else the catalog's)."""
        from cloudtrain.keys import ensure_keys
        from cloudtrain.pipeline.place import placed
        from cloudtrain.provider import ClusterRequest
        from cloudtrain.taskmodel import Resources

        from cloudtrain_provisioners.aws.options import AWSOptions

        resources.setdefault("provider", "aws")
        resources["region"] = region
        if "accelerators" not in resources and "instance_type" not in resources:
            resources["accelerators"] = "A100:8"
        opts = {"host_key_wait": 0, **(aws or {})}
        keys = ensure_keys(self.home / "clusters" / name, comment=f"cloudtrain-{name}")
        req = ClusterRequest(name=name, num_nodes=num_nodes, resources=Resources(**resources),
                             options=AWSOptions(**opts), public_key=keys.public_key())
        return placed(self.provider(**({"offers": offers} if offers else {})), req)

    def tagged(self, region: str = "us-east-1", cluster: str | None = None) -> dict[str, list[Any]]:
        """What the emulator holds with cloudtrain's tags (instances not terminated)."""
        raw = self.clients.raw(region)
        flt = [{"Name": "tag-key", "Values": ["cloudtrain:cluster"]}]
        if cluster is not None:
            flt.append({"Name": "tag:cloudtrain:cluster", "Values": [cluster]})
        live = ["pending", "running", "stopping", "stopped", "shutting-down"]
        pgs = self.clients.placement_groups.list(region, flt)
        return {
            "instances": [i for r in raw.describe_instances(Filters=flt + [
                {"Name": "instance-state-name", "Values": live}])["Reservations"]
                for i in r["Instances"]],
            "security_groups": raw.describe_security_groups(Filters=flt)["SecurityGroups"],
            "key_pairs": raw.describe_key_pairs(Filters=flt)["KeyPairs"],
            "placement_groups": pgs,
            "volumes": raw.describe_volumes(Filters=flt)["Volumes"],
        }

    def counts(self, region: str = "us-east-1", cluster: str | None = None) -> dict[str, int]:
        return {k: len(v) for k, v in self.tagged(region, cluster).items()}


def host_key_console(keys: list[str]) -> str:
    """Console output as cloud-init prints a node's host keys."""
    body = "\n".join(f"{k} root@ip-10-0-0-1" for k in keys)
    return ("[   12.345] cloud-init[901]: Generating public/private ed25519 key pair.\n"
            "ec2: #############################################################\n"
            f"{HOST_KEY_BEGIN}\n{body}\n{HOST_KEY_END}\n"
            "ec2: #############################################################\n")


# --- a moto server with placement groups, for end-to-end tests and the benchmark ----------------

FAIL_RUN_ENV = "CT_MOTO_FAIL_RUN_ZONES"


def patch_moto_server(run_latency: float = 0.0) -> PlacementGroups:
    """Teach moto's EC2 responses the three placement-group actions (backed by
    :class:`PlacementGroups`), and serialise RunInstances (moto's subnet address allocation
    is not thread-safe; the server answers requests in parallel threads). ``run_latency``:
    seconds each RunInstances takes before moto handles it (EC2 takes about 0.5-2 s; moto
    milliseconds), for benchmarks of the provider's fan-out. ``$CT_MOTO_FAIL_RUN_ZONES``
    (``us-east-1a=InsufficientInstanceCapacity,...``): RunInstances into those zones fails
    with that error code, as EC2 answers when a zone has no capacity."""
    import os
    from moto.core.responses import ActionResult
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.responses import EC2Response
    from moto.ec2.responses.instances import InstanceResponse

    store = PlacementGroups()
    # RunInstances into these zones fails with the given code: "zone=Code,zone=Code"
    failing = dict(item.split("=", 1) for item in os.environ.get(FAIL_RUN_ENV, "").split(",")
                   if "=" in item)

    def create(self: Any) -> Any:
        name = self._get_param("GroupName")
        tags = self._parse_tag_specification("placement-group").get("placement-group", {})
        with store.lock:
            key = (self.region, name)
            if key in store.groups:
                raise EC2ClientError("InvalidPlacementGroup.Duplicate",
                                     f"The placement group '{name}' already exists.")
            group = {"GroupName": name, "Strategy": self._get_param("Strategy") or "cluster",
                     "State": "available", "GroupId": f"pg-{next(store._ids):017x}",
                     "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
            store.groups[key] = group
        return ActionResult({"PlacementGroup": copy.deepcopy(group)})

    def describe(self: Any) -> Any:
        filters = [{"Name": k, "Values": list(v)}
                   for k, v in self._filters_from_querystring().items()]
        names = self._get_param("GroupNames", [])
        found = [g for g in store.list(self.region, filters) if not names or g["GroupName"] in names]
        return ActionResult({"PlacementGroups": found})

    def delete(self: Any) -> Any:
        name = self._get_param("GroupName")
        with store.lock:
            if store.groups.pop((self.region, name), None) is None:
                raise EC2ClientError("InvalidPlacementGroup.Unknown",
                                     f"The Placement Group '{name}' is unknown.")
        return ActionResult({})

    EC2Response.create_placement_group = create
    EC2Response.describe_placement_groups = describe
    EC2Response.delete_placement_group = delete
    original = InstanceResponse.run_instances

    def run_instances(self: Any) -> Any:
        if run_latency > 0:
            time.sleep(run_latency)
        zone = self._get_param("Placement.AvailabilityZone") or ""
        if zone in failing:   # capacity (or any error) injected for a zone
            raise EC2ClientError(failing[zone], f"We currently do not have sufficient capacity "
                                                f"in the Availability Zone you requested ({zone}).")
        with store.launch_lock:
            return original(self)

    EC2Response.run_instances = run_instances
    patch_guest_shutdown()
    patch_private_addresses()
    return store


# --- private addresses (the stand-in nodes' own) -------------------------------------------------

PRIVATE_IPS_ENV = "CT_MOTO_PRIVATE_IPS"
"""A patched moto server's setting: a JSON file ``{"<rank>": "127.70.3.10", ...}`` (or
``"<cluster>/<rank>"`` keys) the test writes; an instance tagged with that rank gets that
private address instead of one of its subnet's."""


def private_address_for(plan: dict[str, str], tags: dict[str, str]) -> str | None:
    rank = tags.get("cloudtrain:node-rank")
    if rank is None:
        return None
    return plan.get(f"{tags.get('cloudtrain:cluster', '')}/{rank}") or plan.get(rank)


def patch_private_addresses() -> None:
    """Teach moto's RunInstances to hand out the test's stand-in nodes' loopback addresses as
    the instances' private addresses (``$CT_MOTO_PRIVATE_IPS``): the address the other nodes
    reach a node at (MASTER_ADDR) is then one the test machine really has. A patch of the
    fake, in the fake's own process: the provider and boto3 run unchanged."""
    import os
    from moto.ec2.models.instances import InstanceBackend

    original = InstanceBackend.run_instances

    def run_instances(self: Any, *args: Any, **kwargs: Any) -> Any:
        reservation = original(self, *args, **kwargs)
        path = os.environ.get(PRIVATE_IPS_ENV, "")
        try:
            plan = json.loads(Path(path).read_text()) if path else {}
        except (OSError, ValueError):
            plan = {}
        for inst in reservation.instances:
            tags = {t["key"]: t["value"] for t in inst.get_tags()}
            addr = private_address_for(plan, tags)
            if addr and inst.nics:
                nic = inst.nics[0]
                nic.private_ip_address = addr
                nic.private_ip_addresses = [{"Primary": True, "PrivateIpAddress": addr}]
        return reservation

    InstanceBackend.run_instances = run_instances


# --- guest shutdown (what EC2 does when a node powers itself off) --------------------------------

GUEST_SHUTDOWN_HEADER = "X-Ct-Guest-Shutdown"
"""On a TerminateInstances call to a patched moto server: this is not the API terminating the
instances but each one's guest powering off; the value is the reason the guard wrote to the
serial console (tests/fakes/guest_shutdown.py sends it)."""
CONSOLE: dict[str, str] = {}
"""Serial console text by instance id, in a patched moto server."""


def guest_shutdown(backend: Any, instance_ids: list[str], reason: str = "") -> list[Any]:
    """Do to moto's instances what EC2 does on a guest shutdown: terminate (or stop, as the
    instance's InstanceInitiatedShutdownBehavior says) with the state reason
    Client.InstanceInitiatedShutdown; the guard's line goes to the console first. Returns
    [(instance, previous state)]."""
    from moto.ec2.models.instances import StateReason

    out = []
    for iid in instance_ids:
        inst = backend.get_instance(iid)
        if reason:
            CONSOLE[iid] = CONSOLE.get(iid, "") + f"cloudtrain-guard: stop: {reason}\n"
        behaviour = getattr(inst, "instance_initiated_shutdown_behavior", "stop")
        previous = inst.terminate() if behaviour == "terminate" else inst.stop()
        inst.state_reason = StateReason("Client.InstanceInitiatedShutdown: Instance initiated "
                                        "shutdown", "Client.InstanceInitiatedShutdown")
        out.append((inst, previous))
    return out


def patch_guest_shutdown() -> None:
    """Teach moto's server the guest shutdown (a TerminateInstances carrying
    :data:`GUEST_SHUTDOWN_HEADER`) and a console that shows what the guests wrote."""
    from moto.core.responses import ActionResult
    from moto.core.utils import utcnow
    from moto.ec2.responses.general import General
    from moto.ec2.responses.instances import InstanceResponse
    from moto.ec2.utils import Base64EncodedString  # type: ignore[attr-defined]

    terminate, console = InstanceResponse.terminate_instances, General.get_console_output

    def terminate_instances(self: Any) -> Any:
        reason = self.headers.get(GUEST_SHUTDOWN_HEADER)
        if reason is None:
            return terminate(self)
        done = guest_shutdown(self.ec2_backend, self._get_param("InstanceIds", []),
                              reason.strip())
        return ActionResult({"TerminatingInstances": [
            {"InstanceId": i.id, "CurrentState": {"Code": i._state.code, "Name": i._state.name},
             "PreviousState": {"Code": p.code, "Name": p.name}} for i, p in done]})

    def get_console_output(self: Any) -> Any:
        iid = self._get_param("InstanceId")
        if iid not in CONSOLE:
            return console(self)
        self.ec2_backend.get_instance(iid)
        return ActionResult({"InstanceId": iid, "Timestamp": utcnow(),
                             "Output": Base64EncodedString.from_raw_string(CONSOLE[iid])})

    InstanceResponse.terminate_instances = terminate_instances
    General.get_console_output = get_console_output


def serve_moto(host: str, port: int, run_latency: float = 0.0) -> None:
    """Run a moto server (EC2 with placement groups and the fake Deep Learning AMIs) until
    killed. Run it in a process of its own: the AMIs are read when moto is first imported."""
    import os
    import tempfile

    if "MOTO_AMIS_PATH" not in os.environ:
        fd, path = tempfile.mkstemp(suffix=".json", prefix="moto-amis-")
        os.close(fd)
        os.environ["MOTO_AMIS_PATH"] = str(write_moto_amis(Path(path)))
    from moto.server import ThreadedMotoServer

    patch_moto_server(run_latency)
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    while True:
        time.sleep(3600)
