"""A Compute Engine REST fake, served on loopback by a threading ``http.server``, for the GCP
provider's tests. The real google-cloud-compute clients talk to it through
``client_options={"api_endpoint": fake.url}`` (transport "rest"); nothing in the SDK is
patched.

What it models (the parts of the v1 API the provider uses, with the rules the real service
enforces that matter to cloudtrain):

- instances: insert (validated: names, labels, machine type, boot disk from an image, GPUs
  need ``onHostMaintenance: TERMINATE``, spot needs ``automaticRestart: false``), get, list
  and aggregated list with ``filter`` on labels, delete, start. A new instance is
  PROVISIONING while its operation runs, STAGING when it is done, RUNNING on the next read;
  it gets a networkIP (10.128.x.y) and, with an access config, a natIP (34.x.y.z), both
  invented here. Its boot disk exists beside it and goes with it when ``autoDelete``.
- disks: list, aggregated list, delete (a boot disk left behind without autoDelete).
- instances.getGuestAttributes (``hostkeys/``): what the test, playing the guest agent,
  published with :meth:`GCEFake.publish_host_keys`; refused unless the instance's metadata
  sets ``enable-guest-attributes``.
- firewalls: insert (a rule without sources is open to 0.0.0.0/0, as in GCE), get, list,
  patch, delete.
- zone and global operations: RUNNING until polled ``op_polls`` times (``get`` or
  ``wait``), then DONE; an operation may end with an error (capacity or quota, injected per
  zone/region with :meth:`GCEFake.fail_operation`), which is how GCE reports them.
- images.getFromFamily (Deep Learning VM families in deeplearning-platform-release),
  machineTypes.get, acceleratorTypes.get, zones, regions.
- networks: get, list, insert, delete (refused while a firewall rule, a subnetwork or an
  instance uses the network); with ``network_quota`` the project's NETWORKS quota (an insert
  past it ends with QUOTA_EXCEEDED, as GCE's operation does).
- subnetworks (custom-mode networks): insert (the range checked, not overlapping another in
  the network), get, list, aggregated list, delete (refused while an instance uses it);
  region operations.
- resource policies (``groupPlacementPolicy``): insert, get, aggregated list, delete (refused
  while an instance names it); an instance's ``resourcePolicies`` must exist in its region.
- instances with several network interfaces: each on its own VPC network (GCE refuses two on
  one), a custom-mode network's interface in a subnetwork of the instance's region. The project's ``default`` network comes, as in a real project, with
  ``default-allow-ssh`` (tcp:22 from 0.0.0.0/0), ``default-allow-rdp``,
  ``default-allow-icmp`` and ``default-allow-internal`` (all tcp/udp/icmp from
  10.128.0.0/9), none with target tags.
- guest shutdown (:meth:`GCEFake.guest_shutdown`, or ``POST /_fake/zones/Z/instances/N/
  guest-shutdown`` with ``{"reason": ...}`` from tests/fakes/guest_shutdown.py on a node): the
  instance is TERMINATED as GCE stops a VM whose guest powered off (boot disk kept, ephemeral
  external IP released, ``lastStopTimestamp`` set) and the guard's line is on serial port 1
  (instances.getSerialPortOutput).
- ``scheduling.maxRunDuration`` with ``instanceTerminationAction`` (DELETE or STOP): counted
  from when the instance runs, on the fake's clock (:meth:`GCEFake.advance` moves it on); at
  the deadline the instance is deleted (with its auto-delete disk) or TERMINATED.
- HTTP errors injected per method/path (:meth:`GCEFake.fail_http`), e.g. 403 permission.
- an OAuth token endpoint (``/token``) for service-account key files whose ``token_uri``
  points here; with ``require_auth`` every API call must carry a token it issued.

Everything the provider sent is kept in ``requests``; the state is plain dicts a test can
read (``fake.instances``, ``fake.firewalls``, ``fake.disks``) or summarise
(:meth:`GCEFake.ours`).
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

GOOGLE = "https://www.googleapis.com/compute/v1"
DLVM_PROJECT = "deeplearning-platform-release"
DLVM_FAMILIES = ("pytorch-2-9-cu129-ubuntu-2404-nvidia-580",
                 "pytorch-2-9-cu129-ubuntu-2204-nvidia-580",
                 "pytorch-2-7-cu128-ubuntu-2204-nvidia-570",
                 "common-cu129-ubuntu-2404-nvidia-580")
DEFAULT_ZONES = {
    "us-central1": ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"),
    "us-east1": ("us-east1-b", "us-east1-c", "us-east1-d"),
    "europe-west4": ("europe-west4-a", "europe-west4-b", "europe-west4-c"),
    "asia-east1": ("asia-east1-a", "asia-east1-b", "asia-east1-c"),
}
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
_GPU_FAMILIES = ("a2-", "a3-", "a4-", "g2-")
_PROTOCOLS = ("tcp", "udp", "icmp", "esp", "ah", "sctp", "ipip", "all")


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message,
                          "errors": [{"domain": "global", "reason": self.reason,
                                      "message": self.message}]}}


def _not_found(what: str) -> ApiError:
    return ApiError(404, "notFound", f"The resource '{what}' was not found")


def _last(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


# --- list filters --------------------------------------------------------------------------

_TERM = re.compile(r'\s*\(?\s*([A-Za-z][\w.\-]*)\s*(!=|=|:|\beq\b|\bne\b)\s*'
                   r'("(?:[^"\\]|\\.)*"|[^\s)]+)\s*\)?\s*')


def parse_filter(text: str) -> list[tuple[str, str, str]]:
    """The (field, op, value) terms of a list filter, all ANDed: ``(a = "x") (b:*)``,
    ``a = x AND b != y``. OR is not modelled (refused), nor is anything else."""
    terms: list[tuple[str, str, str]] = []
    rest = text.strip()
    while rest:
        if rest.upper().startswith("AND "):
            rest = rest[4:].lstrip()
            continue
        if rest.upper().startswith("OR "):
            raise ApiError(400, "invalid", "the fake does not model OR in filters")
        m = _TERM.match(rest)
        if not m:
            raise ApiError(400, "invalid", f"Invalid value for field 'filter': '{text}'. "
                                           "Invalid list filter expression.")
        field, op, value = m.groups()
        if value.startswith('"'):
            value = json.loads(value)
        terms.append((field, op, value))
        rest = rest[m.end():]
    return terms


def _field(res: dict[str, Any], path: str) -> Any:
    cur: Any = res
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def matches(res: dict[str, Any], text: str | None) -> bool:
    if not text:
        return True
    for field, op, value in parse_filter(text):
        got = _field(res, field)
        if op == ":":
            ok = got is not None if value == "*" else (got is not None and value in str(got))
        elif op in ("=", "eq"):
            ok = got is not None and (re.fullmatch(value, str(got)) is not None if op == "eq"
                                      else str(got) == value)
        else:
            ok = got is None or (re.fullmatch(value, str(got)) is None if op == "ne"
                                 else str(got) != value)
        if not ok:
            return False
    return True


# --- the fake ------------------------------------------------------------------------------

class GCEFake:
    def __init__(self, project: str = "test-project",
                 zones: dict[str, tuple[str, ...]] | None = None,
                 networks: tuple[str, ...] = ("default",), op_polls: int = 2,
                 page_size: int = 500, require_auth: bool = False,
                 nat_ips: list[str] | None = None, internal_ips: list[str] | None = None) -> None:
        self.project = project
        self.regions = dict(zones or DEFAULT_ZONES)
        self.zone_region = {z: r for r, zs in self.regions.items() for z in zs}
        self.networks = set(networks)
        self.op_polls = op_polls
        self.page_size = page_size
        self.require_auth = require_auth
        self.lock = threading.RLock()
        self.instances: dict[tuple[str, str], dict[str, Any]] = {}
        self.disks: dict[tuple[str, str], dict[str, Any]] = {}
        self.firewalls: dict[str, dict[str, Any]] = {}
        self.operations: dict[tuple[str, str], dict[str, Any]] = {}
        self._effects: dict[tuple[str, str], tuple[int, Callable[[], dict[str, Any] | None]]] = {}
        self.images: dict[tuple[str, str], dict[str, Any]] = {}
        for i, fam in enumerate(DLVM_FAMILIES):
            self.add_image(DLVM_PROJECT, fam, f"{fam}-v20260416", disk_gb=50 + i)
        self.unavailable_machine_types: set[tuple[str, str]] = set()
        self.unavailable_accelerators: set[tuple[str, str]] = set()
        self.requests: list[dict[str, Any]] = []
        self.unhandled: list[str] = []
        self.tokens: set[str] = set()
        self.token_requests: list[dict[str, str]] = []
        self.trusted_keys: dict[str, Any] = {}
        self.jwt_uses: list[dict[str, Any]] = []
        self.outside: list[str] = []
        self.on_running: list[Callable[[dict[str, Any]], None]] = []
        self.guest_attributes: dict[tuple[str, str], dict[str, str]] = {}
        self.serial: dict[tuple[str, str], str] = {}
        self.run_deadlines: dict[tuple[str, str], float] = {}
        self.clock_offset = 0.0
        self._released_nat: dict[tuple[str, str], str] = {}
        self._op_faults: list[dict[str, Any]] = []
        self._take_back: list[dict[str, Any]] = []
        self._http_faults: list[dict[str, Any]] = []
        self._ids = itertools.count(1000001)
        self._nat = list(nat_ips) if nat_ips is not None else None
        self._internal = list(internal_ips) if internal_ips is not None else None
        self._ip = itertools.count(2)
        self.service_accounts: dict[str, dict[str, Any]] = {}
        """IAM service accounts of the project, by email."""
        self.buckets: dict[str, dict[str, Any]] = {}
        """Cloud Storage buckets (only their IAM policy and uniform access), by name."""
        self.network_res: dict[str, dict[str, Any]] = {}
        self.subnetworks: dict[tuple[str, str], dict[str, Any]] = {}
        """Subnetworks by (region, name)."""
        self.policies: dict[tuple[str, str], dict[str, Any]] = {}
        """Resource policies (compact placement) by (region, name)."""
        self.network_quota: int | None = None
        for net in sorted(self.networks):
            self.network_res[net] = self._network_res(project, net, {"autoCreateSubnetworks": True})
        if "default" in self.networks:
            self.add_default_rules()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- serving ----------------------------------------------------------------------------

    def start(self) -> GCEFake:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True   # headers and body go out at once (no 40 ms stall)

            def log_message(self, *args: Any) -> None:
                pass

            def _do(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if self.path.startswith(("http://", "https://")):
                    # a proxied request for somewhere else (e.g. the GCE metadata server):
                    # recorded and refused, never forwarded
                    with fake.lock:
                        fake.outside.append(self.path)
                    self.send_response(502)
                    self.send_header("Content-Length", "0")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    return
                status, body = fake.handle(self.command, self.path, raw, dict(self.headers))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _do

            def do_CONNECT(self) -> None:  # noqa: N802 - http.server's naming
                # The fake is also the tests' HTTPS proxy: whatever tries to leave loopback
                # (e.g. google-auth's regional access boundary lookup) is recorded, refused.
                with fake.lock:
                    fake.outside.append(self.path)
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,),
                                        daemon=True, name="gce-fake")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> GCEFake:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- test controls --------------------------------------------------------------------

    def add_image(self, project: str, family: str, name: str, disk_gb: int = 50,
                  deprecated: str | None = None) -> dict[str, Any]:
        img = {"kind": "compute#image", "id": str(next(itertools.count(7000))), "name": name,
               "family": family, "status": "READY", "diskSizeGb": str(disk_gb),
               "architecture": "X86_64",
               "selfLink": f"{GOOGLE}/projects/{project}/global/images/{name}"}
        if deprecated:
            img["deprecated"] = {"state": deprecated}
        self.images[(project, family)] = img
        return img

    def remove_family(self, project: str, family: str) -> None:
        self.images.pop((project, family), None)

    def fail_operation(self, code: str, message: str | None = None, *, zone: str | None = None,
                       region: str | None = None, op: str = "insert", times: int | None = None,
                       when: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Make matching instance operations (``insert``/``delete``/``start``) end DONE with
        ``code`` as GCE reports capacity and quota errors. ``when`` sees the request body."""
        with self.lock:
            self._op_faults.append({"code": code, "message": message or _MESSAGES.get(
                code, "injected by the test"), "zone": zone, "region": region, "op": op,
                "times": times, "when": when})

    def fail_http(self, status: int, reason: str, message: str = "injected by the test", *,
                  method: str | None = None, path: str | None = None,
                  times: int | None = None, skip: int = 0) -> None:
        """Answer matching requests (``path``: a regex searched in the URL path) with an
        HTTP error in Google's JSON error format: after the first ``skip`` of them,
        ``times`` of them (None: all)."""
        with self.lock:
            self._http_faults.append({"status": status, "reason": reason, "message": message,
                                      "method": method, "path": path, "times": times,
                                      "skip": skip})

    def take_back_on_start(self, *, zone: str | None = None, times: int | None = None) -> None:
        """Instances inserted into ``zone`` are taken back by GCE right after their insert
        succeeded (a spot VM preempted at once): gone before they ever run."""
        with self.lock:
            self._take_back.append({"zone": zone, "times": times})

    def clear_faults(self) -> None:
        with self.lock:
            self._op_faults.clear()
            self._http_faults.clear()
            self._take_back.clear()

    def preempt(self, zone: str, name: str, action: str | None = None) -> None:
        """GCE takes a spot instance back, as ``action`` or its ``instanceTerminationAction``
        says (neither: DELETE): DELETE: it and its auto-delete boot disk are gone; STOP: it is
        TERMINATED (disk kept, ephemeral IP released, ``lastStopTimestamp`` set). Either way
        the zone gets a DONE ``compute.instances.preempted`` operation targeting it: the
        instance resource itself carries no "preempted" mark, the operation is GCE's record."""
        with self.lock:
            inst = self.instances.get((zone, name))
            if inst is None:
                raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
            action = action or (inst.get("scheduling") or {}).get(
                "instanceTerminationAction") or "DELETE"
            link = f"{GOOGLE}/projects/{self.project}/zones/{zone}/instances/{name}"
            op = self._operation(self.project, zone, "compute.instances.preempted", link,
                                 lambda: None)
            key = (zone, op["name"])
            self._effects.pop(key, None)
            self.operations[key].update(status="DONE", progress=100,
                                        targetId=str(inst.get("id", "")),
                                        statusMessage="Instance was preempted.")
            if action == "DELETE":
                self._remove_instance(zone, name)
                return
        self.guest_shutdown(zone, name)

    def now(self) -> float:
        """The fake's clock (epoch seconds): real time plus what :meth:`advance` added."""
        return time.time() + self.clock_offset

    def advance(self, seconds: float) -> None:
        """Move the fake's clock on (run-duration limits fire on the next request)."""
        with self.lock:
            self.clock_offset += seconds
            self._expire()

    def guest_shutdown(self, zone: str, name: str, reason: str = "") -> None:
        """The instance's guest powered off: GCE stops the VM (TERMINATED). Its boot disk
        stays (and bills); its ephemeral external IP is released."""
        with self.lock:
            inst = self.instances.get((zone, name))
            if inst is None:
                raise _not_found(f"projects/{self.project}/zones/{zone}/instances/{name}")
            if reason:
                self.serial[(zone, name)] = (self.serial.get((zone, name), "")
                                             + f"cloudtrain-guard: stop: {reason}\n")
            inst["status"] = "TERMINATED"
            inst["lastStopTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S.000+00:00",
                                                      time.gmtime(self.now()))
            for nic in inst.get("networkInterfaces") or []:
                for ac in nic.get("accessConfigs") or []:
                    if "natIP" in ac:   # released; the same one comes back on start (the fake
                        self._released_nat[(zone, name)] = ac.pop("natIP")  # keeps maps valid)
            self.run_deadlines.pop((zone, name), None)

    def _expire(self) -> None:
        """Instances past their maxRunDuration: deleted or stopped, as their
        instanceTerminationAction says."""
        now = self.now()
        for key, deadline in list(self.run_deadlines.items()):
            if deadline > now:
                continue
            self.run_deadlines.pop(key, None)
            inst = self.instances.get(key)
            if inst is None:
                continue
            if (inst.get("scheduling") or {}).get("instanceTerminationAction") == "DELETE":
                self._remove_instance(*key)
            else:
                inst["status"] = "TERMINATED"

    def calls(self, method: str | None = None, path: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if (method is None or r["method"] == method)
                    and (path is None or re.search(path, r["path"]))]

    def inserted_instances(self) -> list[dict[str, Any]]:
        """The instance bodies the provider sent, in order (with the zone in ``_zone``)."""
        out = []
        for r in self.calls("POST", r"/zones/[^/]+/instances$"):
            body = dict(r["body"])
            body["_zone"] = r["path"].split("/zones/")[1].split("/")[0]
            out.append(body)
        return out

    def ours(self) -> dict[str, list[str]]:
        """Everything the fake holds that carries cloudtrain's marks: instances and disks
        with a ``cloudtrain-cluster`` label, firewall rules named or described by it."""
        with self.lock:
            return {
                "instances": sorted(f"{z}/{n}" for (z, n), i in self.instances.items()
                                    if "cloudtrain-cluster" in (i.get("labels") or {})),
                "disks": sorted(f"{z}/{n}" for (z, n), d in self.disks.items()
                                if "cloudtrain-cluster" in (d.get("labels") or {})),
                "firewalls": sorted(n for n, f in self.firewalls.items()
                                    if "cloudtrain" in (f.get("description") or "")
                                    or n.startswith("ct-")),
                "networks": sorted(n for n, r in self.network_res.items()
                                   if "cloudtrain" in (r.get("description") or "")),
                "subnetworks": sorted(f"{r}/{n}" for (r, n), s in self.subnetworks.items()
                                      if "cloudtrain" in (s.get("description") or "")),
                "resource_policies": sorted(f"{r}/{n}" for (r, n), s in self.policies.items()
                                            if "cloudtrain" in (s.get("description") or "")),
                "service_accounts": sorted(e for e, a in self.service_accounts.items()
                                           if "cloudtrain" in (a.get("description") or "")),
            }

    def empty(self) -> bool:
        return not any(self.ours().values())

    # --- dispatch --------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, raw: bytes,
               headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        parsed = urllib.parse.urlsplit(raw_path)
        path = parsed.path
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query).items()}
        body: Any = None
        if raw:
            ctype = headers.get("Content-Type", headers.get("content-type", ""))
            if "json" in ctype or raw[:1] in (b"{", b"["):
                try:
                    body = json.loads(raw)
                except ValueError:
                    return 400, ApiError(400, "parseError", "Parse Error").body()
            else:
                body = {k: v[-1] for k, v in urllib.parse.parse_qs(raw.decode()).items()}
        with self.lock:
            self.requests.append({"method": method, "path": path, "query": query,
                                  "body": copy.deepcopy(body), "at": time.monotonic()})
        try:
            with self.lock:
                self._expire()
            m = re.fullmatch(r"/_fake(?:/zones/([^/]+))?/instances/([^/]+)/guest-shutdown", path)
            if m and method == "POST":
                zone = m.group(1) or next((z for z, n in self.instances if n == m.group(2)), "")
                self.guest_shutdown(zone, m.group(2), str((body or {}).get("reason", "")))
                return 200, {}
            if path == "/token" and method == "POST":
                return 200, self._token(body or {})
            if self.require_auth:
                auth = headers.get("Authorization") or headers.get("authorization") or ""
                if not self._authorized(auth):
                    raise ApiError(401, "required", "Request is missing required authentication "
                                   "credential. Expected OAuth 2 access token.")
            self._http_fault(method, path)
            for m, pattern, fn in self._routes():
                if m != method:
                    continue
                hit = re.fullmatch(pattern, path)
                if hit:
                    return 200, fn(query=query, body=body, **hit.groupdict())
            self.unhandled.append(f"{method} {path}")
            raise ApiError(404, "notFound", f"the fake does not model {method} {path}")
        except ApiError as exc:
            return exc.status, exc.body()

    def _http_fault(self, method: str, path: str) -> None:
        with self.lock:
            for f in self._http_faults:
                if f["method"] not in (None, method):
                    continue
                if f["path"] is not None and not re.search(f["path"], path):
                    continue
                if f["skip"] > 0:
                    f["skip"] -= 1
                    continue
                if f["times"] is not None:
                    if f["times"] <= 0:
                        continue
                    f["times"] -= 1
                raise ApiError(f["status"], f["reason"], f["message"])

    def _routes(self) -> list[tuple[str, str, Callable[..., dict[str, Any]]]]:
        p = r"/compute/v1/projects/(?P<project>[^/]+)"
        z = p + r"/zones/(?P<zone>[^/]+)"
        sa = r"/v1/projects/(?P<project>[^/]+)/serviceAccounts"
        return [
            ("POST", sa, self._create_sa),
            ("GET", sa, self._list_sa),
            ("GET", sa + r"/(?P<email>[^/]+)", self._get_sa),
            ("DELETE", sa + r"/(?P<email>[^/]+)", self._delete_sa),
            ("GET", r"/storage/v1/b/(?P<bucket>[^/]+)/iam", self._get_bucket_iam),
            ("PUT", r"/storage/v1/b/(?P<bucket>[^/]+)/iam", self._set_bucket_iam),
            ("POST", z + r"/instances", self._insert_instance),
            ("GET", z + r"/instances", self._list_instances),
            ("GET", z + r"/instances/(?P<name>[^/]+)", self._get_instance),
            ("DELETE", z + r"/instances/(?P<name>[^/]+)", self._delete_instance),
            ("POST", z + r"/instances/(?P<name>[^/]+)/start", self._start_instance),
            ("POST", z + r"/instances/(?P<name>[^/]+)/stop", self._stop_instance),
            ("GET", z + r"/instances/(?P<name>[^/]+)/getGuestAttributes",
             self._guest_attrs),
            ("GET", z + r"/instances/(?P<name>[^/]+)/serialPort", self._serial_port),
            ("GET", p + r"/aggregated/instances", self._aggregated_instances),
            ("GET", z + r"/disks", self._list_disks),
            ("GET", p + r"/aggregated/disks", self._aggregated_disks),
            ("DELETE", z + r"/disks/(?P<name>[^/]+)", self._delete_disk),
            ("POST", p + r"/global/firewalls", self._insert_firewall),
            ("GET", p + r"/global/firewalls", self._list_firewalls),
            ("GET", p + r"/global/firewalls/(?P<name>[^/]+)", self._get_firewall),
            ("PATCH", p + r"/global/firewalls/(?P<name>[^/]+)", self._patch_firewall),
            ("DELETE", p + r"/global/firewalls/(?P<name>[^/]+)", self._delete_firewall),
            ("GET", z + r"/operations", self._list_zone_ops),
            ("GET", z + r"/operations/(?P<op>[^/]+)", self._get_zone_op),
            ("POST", z + r"/operations/(?P<op>[^/]+)/wait", self._get_zone_op),
            ("GET", p + r"/global/operations/(?P<op>[^/]+)", self._get_global_op),
            ("POST", p + r"/global/operations/(?P<op>[^/]+)/wait", self._get_global_op),
            ("GET", p + r"/global/images/family/(?P<family>[^/]+)", self._image_family),
            ("GET", p + r"/global/images/(?P<image>[^/]+)", self._image),
            ("GET", z + r"/machineTypes/(?P<mt>[^/]+)", self._machine_type),
            ("GET", z + r"/acceleratorTypes/(?P<at>[^/]+)", self._accelerator_type),
            ("GET", p + r"/zones", self._list_zones),
            ("GET", z, self._get_zone),
            ("GET", p + r"/regions/(?P<region>[^/]+)", self._get_region),
            ("GET", p + r"/global/networks/(?P<network>[^/]+)", self._get_network),
            ("GET", p + r"/global/networks", self._list_networks),
            ("POST", p + r"/global/networks", self._insert_network),
            ("DELETE", p + r"/global/networks/(?P<network>[^/]+)", self._delete_network),
            ("POST", p + r"/regions/(?P<region>[^/]+)/subnetworks", self._insert_subnet),
            ("GET", p + r"/regions/(?P<region>[^/]+)/subnetworks", self._list_subnets),
            ("GET", p + r"/regions/(?P<region>[^/]+)/subnetworks/(?P<name>[^/]+)",
             self._get_subnet),
            ("DELETE", p + r"/regions/(?P<region>[^/]+)/subnetworks/(?P<name>[^/]+)",
             self._delete_subnet),
            ("GET", p + r"/aggregated/subnetworks", self._aggregated_subnets),
            ("POST", p + r"/regions/(?P<region>[^/]+)/resourcePolicies", self._insert_policy),
            ("GET", p + r"/regions/(?P<region>[^/]+)/resourcePolicies/(?P<name>[^/]+)",
             self._get_policy),
            ("DELETE", p + r"/regions/(?P<region>[^/]+)/resourcePolicies/(?P<name>[^/]+)",
             self._delete_policy),
            ("GET", p + r"/aggregated/resourcePolicies", self._aggregated_policies),
            ("GET", p + r"/regions/(?P<region>[^/]+)/operations/(?P<op>[^/]+)", self._get_region_op),
            ("POST", p + r"/regions/(?P<region>[^/]+)/operations/(?P<op>[^/]+)/wait",
             self._get_region_op),
        ]

    # --- helpers ---------------------------------------------------------------------------

    def _own(self, project: str) -> None:
        if project != self.project:
            raise ApiError(404, "notFound", f"The resource 'projects/{project}' was not found")

    def _zone(self, project: str, zone: str) -> str:
        self._own(project)
        if zone not in self.zone_region:
            raise ApiError(400, "invalid", f"Invalid value for field 'zone': '{zone}'. "
                                           "Unknown zone.")
        return zone

    def _page(self, items: list[Any], query: dict[str, str]) -> tuple[list[Any], str | None]:
        size = min(int(query.get("maxResults") or self.page_size), self.page_size)
        start = int(query.get("pageToken") or 0)
        page = items[start:start + size]
        nxt = str(start + size) if start + size < len(items) else None
        return page, nxt

    def _operation(self, project: str, scope: str, kind: str, target: str,
                   effect: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
        """A RUNNING operation; ``effect`` runs when it completes and returns an error (as
        GCE puts it in the operation) or None."""
        name = f"operation-{next(self._ids)}-fake"
        where = (scope if scope.startswith("regions/") else
                 f"zones/{scope}" if scope != "global" else "global")
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name,
              "operationType": kind, "targetLink": target, "status": "RUNNING",
              "progress": 0, "insertTime": "2026-01-01T00:00:00.000-07:00",
              "selfLink": f"{GOOGLE}/projects/{project}/{where}/operations/{name}"}
        if scope.startswith("regions/"):
            op["region"] = f"{GOOGLE}/projects/{project}/{scope}"
        elif scope != "global":
            op["zone"] = f"{GOOGLE}/projects/{project}/zones/{scope}"
        self.operations[(scope, name)] = op
        self._effects[(scope, name)] = (self.op_polls, effect)
        return copy.deepcopy(op)

    def _poll(self, scope: str, name: str) -> dict[str, Any]:
        key = (scope, name)
        if key not in self.operations:
            raise _not_found(f"projects/{self.project}/"
                             f"{'global' if scope == 'global' else 'zones/' + scope}"
                             f"/operations/{name}")
        op = self.operations[key]
        if key in self._effects:
            left, effect = self._effects[key]
            left -= 1
            if left > 0:
                self._effects[key] = (left, effect)
            else:
                del self._effects[key]
                error = effect()
                op["status"], op["progress"] = "DONE", 100
                op["endTime"] = "2026-01-01T00:00:05.000-07:00"
                if error is not None:
                    op["error"] = {"errors": [error]}
                    op["httpErrorStatusCode"] = 403 if error["code"] == "QUOTA_EXCEEDED" else 503
                    op["httpErrorMessage"] = ("FORBIDDEN" if error["code"] == "QUOTA_EXCEEDED"
                                              else "SERVICE UNAVAILABLE")
        return copy.deepcopy(op)

    def _op_fault(self, op: str, zone: str, body: dict[str, Any]) -> dict[str, Any] | None:
        for f in self._op_faults:
            if f["op"] != op or f["zone"] not in (None, zone):
                continue
            if f["region"] not in (None, self.zone_region.get(zone)):
                continue
            if f["when"] is not None and not f["when"](body):
                continue
            if f["times"] is not None:
                if f["times"] <= 0:
                    continue
                f["times"] -= 1
            msg = f["message"].replace("{zone}", zone).replace(
                "{region}", self.zone_region.get(zone, "")).replace("{project}", self.project)
            return {"code": f["code"], "message": msg}
        return None

    def _ip_pair(self, pooled: bool = True) -> tuple[str, str]:
        """The next addresses: from the given lists while they last (``pooled``: an insert
        that is to fail takes none of them), then made up."""
        n = next(self._ip)
        internal = self._internal.pop(0) if self._internal and pooled else f"10.128.{n // 250}.{n % 250 + 2}"
        nat = self._nat.pop(0) if self._nat and pooled else f"34.{120 + n // 62500 % 10}.{n // 250 % 250}.{n % 250 + 2}"
        return internal, nat

    # --- instances -------------------------------------------------------------------------

    def _validate_labels(self, labels: dict[str, Any] | None, where: str) -> None:
        for k, v in (labels or {}).items():
            if not _LABEL_KEY.match(k) or not isinstance(v, str) or not _LABEL_VALUE.match(v):
                raise ApiError(400, "invalid", f"Invalid value for field '{where}.labels': "
                                               f"'{k}={v}'. Label keys and values may contain "
                                               "only lowercase letters, digits, '-' and '_'.")
        if len(labels or {}) > 64:
            raise ApiError(400, "invalid", "Too many labels.")

    def _resolve_image(self, source: str) -> dict[str, Any]:
        m = re.search(r"projects/([^/]+)/global/images/(family/)?([^/]+)$", source or "")
        if not m:
            raise ApiError(400, "invalid", f"Invalid value for field "
                                           f"'resource.disks[0].initializeParams.sourceImage': "
                                           f"'{source}'.")
        project, family, name = m.groups()
        for (p, f), img in self.images.items():
            if p == project and ((family and f == name) or (not family and img["name"] == name)):
                return img
        raise _not_found(f"projects/{project}/global/images/{'family/' if family else ''}{name}")

    def _insert_instance(self, project: str, zone: str, query: dict[str, str],
                         body: dict[str, Any] | None) -> dict[str, Any]:
        zone = self._zone(project, zone)
        b = copy.deepcopy(body or {})
        name = str(b.get("name", ""))
        if not _NAME.match(name):
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'. "
                                           "Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}"
                                           "[a-z0-9])?)'")
        if (zone, name) in self.instances:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{project}/zones/{zone}"
                                                 f"/instances/{name}' already exists")
        mt_path = str(b.get("machineType", ""))
        m = re.search(r"zones/([^/]+)/machineTypes/([^/]+)$", mt_path)
        if not m or m.group(1) != zone:
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.machineType': "
                                           f"'{mt_path}'.")
        mt = m.group(2)
        if (zone, mt) in self.unavailable_machine_types:
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.machineType': "
                                           f"'{mt_path}'. Machine type with name '{mt}' does "
                                           f"not exist in zone '{zone}'.")
        self._validate_labels(b.get("labels"), "resource")
        for sa in b.get("serviceAccounts") or []:   # this project's must exist (GCE checks)
            email = str(sa.get("email", ""))
            if email.endswith(f"@{project}.iam.gserviceaccount.com") and \
                    email not in self.service_accounts:
                raise ApiError(400, "invalid", f"The resource 'projects/{project}/"
                                               f"serviceAccounts/{email}' was not found")
        boots = [d for d in b.get("disks", []) if d.get("boot")]
        if len(boots) != 1:
            raise ApiError(400, "invalid", "Exactly one boot disk must be given.")
        init = boots[0].get("initializeParams") or {}
        img = self._resolve_image(str(init.get("sourceImage", "")))
        size = int(init.get("diskSizeGb") or img["diskSizeGb"])
        if size < int(img["diskSizeGb"]):
            raise ApiError(400, "invalid", f"Requested disk size cannot be smaller than the image "
                                           f"size ({img['diskSizeGb']} GB)")
        self._validate_labels(init.get("labels"), "resource.disks[0].initializeParams")
        nics = b.get("networkInterfaces") or []
        if not nics:
            raise ApiError(400, "invalid", "At least one network interface is required.")
        net = _last(str(nics[0].get("network") or "default"))
        nets = self._check_nics(project, zone, nics)
        for rp in b.get("resourcePolicies") or []:
            m = re.search(r"regions/([^/]+)/resourcePolicies/([^/]+)$", str(rp))
            if not m or (m.group(1), m.group(2)) not in self.policies \
                    or m.group(1) != self.zone_region.get(zone):
                raise ApiError(400, "invalid", f"Invalid value for field 'resource."
                                               f"resourcePolicies[0]': '{rp}'.")
        gpus = b.get("guestAccelerators") or []
        for g in gpus:
            at = str(g.get("acceleratorType", ""))
            am = re.search(r"zones/([^/]+)/acceleratorTypes/([^/]+)$", at)
            if not am or am.group(1) != zone or (zone, am.group(2)) in self.unavailable_accelerators:
                raise ApiError(400, "invalid", f"Invalid value for field "
                                               f"'resource.guestAccelerators[0].acceleratorType': "
                                               f"'{at}'. Accelerator type not found in {zone}.")
        sched = b.get("scheduling") or {}
        if (gpus or mt.startswith(_GPU_FAMILIES)) and sched.get("onHostMaintenance") != "TERMINATE":
            raise ApiError(400, "invalid", "Instances with guest accelerators do not support live "
                                           "migration.")
        if sched.get("provisioningModel") == "SPOT":
            if sched.get("automaticRestart", True):
                raise ApiError(400, "invalid", "Invalid value for field "
                                               "'resource.scheduling.automaticRestart': 'true'. "
                                               "Spot VMs do not support automatic restart.")
            if sched.get("instanceTerminationAction") not in ("STOP", "DELETE"):
                raise ApiError(400, "invalid", "Spot VMs need instanceTerminationAction STOP or "
                                               "DELETE.")
        if "maxRunDuration" in sched:
            secs = int((sched["maxRunDuration"] or {}).get("seconds") or 0)
            if not 30 <= secs <= 120 * 86400:
                raise ApiError(400, "invalid", "Invalid value for field 'resource.scheduling."
                                               f"maxRunDuration.seconds': '{secs}'.")
            if sched.get("instanceTerminationAction") not in ("STOP", "DELETE"):
                raise ApiError(400, "invalid", "maxRunDuration needs instanceTerminationAction "
                                               "STOP or DELETE.")
        keys = [i.get("key") for i in (b.get("metadata") or {}).get("items", [])]
        if len(keys) != len(set(keys)):
            raise ApiError(400, "invalid", "Duplicate metadata keys.")
        fault = self._op_fault("insert", zone, b)
        internal, nat = self._ip_pair(pooled=fault is None)
        for i, nic in enumerate(nics):
            nic["name"] = f"nic{i}"
            nic["networkIP"] = internal if i == 0 else f"192.0.2.{next(self._ip) % 250 + 1}"
            nic["network"] = f"{GOOGLE}/projects/{project}/global/networks/{nets[i]}"
            for ac in nic.get("accessConfigs") or []:
                ac["natIP"] = nat
        link = f"{GOOGLE}/projects/{project}/zones/{zone}/instances/{name}"
        inst = dict(b, kind="compute#instance", id=str(next(self._ids)), status="PROVISIONING",
                    zone=f"{GOOGLE}/projects/{project}/zones/{zone}", selfLink=link,
                    machineType=f"{GOOGLE}/projects/{project}/zones/{zone}/machineTypes/{mt}",
                    creationTimestamp="2026-01-01T00:00:00.000-07:00", networkInterfaces=nics)
        disk_name = str(init.get("diskName") or name)
        disk_link = f"{GOOGLE}/projects/{project}/zones/{zone}/disks/{disk_name}"
        boots[0]["source"] = disk_link
        boots[0].setdefault("autoDelete", False)
        self.instances[(zone, name)] = inst
        self.disks[(zone, disk_name)] = {
            "kind": "compute#disk", "id": str(next(self._ids)), "name": disk_name,
            "sizeGb": str(size), "zone": inst["zone"], "status": "READY", "selfLink": disk_link,
            "sourceImage": img["selfLink"], "labels": dict(init.get("labels") or {}),
            "users": [link], "creationTimestamp": inst["creationTimestamp"]}
        take_back = fault is None and self._take(zone)

        def effect() -> dict[str, Any] | None:
            if fault is not None or take_back:
                self._remove_instance(zone, name)
                return fault
            if (zone, name) in self.instances:
                self.instances[(zone, name)]["status"] = "STAGING"
            return None

        return self._operation(project, zone, "insert", link, effect)

    def _take(self, zone: str) -> bool:
        for t in self._take_back:
            if t["zone"] not in (None, zone):
                continue
            if t["times"] is not None:
                if t["times"] <= 0:
                    continue
                t["times"] -= 1
            return True
        return False

    def _remove_instance(self, zone: str, name: str) -> None:
        inst = self.instances.pop((zone, name), None)
        self.guest_attributes.pop((zone, name), None)
        self.serial.pop((zone, name), None)
        self.run_deadlines.pop((zone, name), None)
        if inst is None:
            return
        for d in inst.get("disks", []):
            key = (zone, _last(d.get("source", "")))
            if key in self.disks:
                if d.get("autoDelete"):
                    del self.disks[key]
                else:
                    self.disks[key]["users"] = []

    def _read(self, inst: dict[str, Any]) -> dict[str, Any]:
        """A read of an instance: STAGING becomes RUNNING (and the running hooks fire)."""
        if inst["status"] == "STAGING":
            inst["status"] = "RUNNING"
            run = (inst.get("scheduling") or {}).get("maxRunDuration")
            if run:
                key = (_last(str(inst["zone"])), str(inst["name"]))
                self.run_deadlines[key] = self.now() + int(run.get("seconds") or 0)
            for hook in self.on_running:
                hook(copy.deepcopy(inst))
        return copy.deepcopy(inst)

    def _get_instance(self, project: str, zone: str, name: str, **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        inst = self.instances.get((zone, name))
        if inst is None:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        return self._read(inst)

    def publish_host_keys(self, inst: dict[str, Any], key_lines: list[str]) -> None:
        """Play the guest agent: publish an instance's SSH host public keys ("type base64")
        in its guest attributes (``hostkeys/<type>``), as it does on a real instance whose
        metadata sets ``enable-guest-attributes``."""
        zone = _last(str(inst["zone"]))
        with self.lock:
            attrs = self.guest_attributes.setdefault((zone, inst["name"]), {})
            for line in key_lines:
                typ, b64 = line.split()[:2]
                attrs[f"hostkeys/{typ}"] = b64

    def _guest_attrs(self, project: str, zone: str, name: str, query: dict[str, str],
                     **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        inst = self.instances.get((zone, name))
        if inst is None:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        meta = {i.get("key"): i.get("value") for i in (inst.get("metadata") or {}).get("items", [])}
        if str(meta.get("enable-guest-attributes", "")).upper() != "TRUE":
            raise ApiError(400, "invalid", "Guest attributes endpoint access is disabled.")
        path = query.get("queryPath", "")
        items = [{"namespace": k.split("/", 1)[0], "key": k.split("/", 1)[1], "value": v}
                 for k, v in sorted(self.guest_attributes.get((zone, name), {}).items())
                 if k.startswith(path)]
        if not items:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}/"
                             f"guestAttributes/{path}")
        return {"kind": "compute#guestAttributes", "queryPath": path,
                "queryValue": {"items": items}}

    def _serial_port(self, project: str, zone: str, name: str, query: dict[str, str],
                     **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        if (zone, name) not in self.instances:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        text = self.serial.get((zone, name), "")
        start = min(int(query.get("start") or 0), len(text))
        return {"kind": "compute#serialPortOutput", "contents": text[start:],
                "start": str(start), "next": str(len(text)), "selfLink": ""}

    def _instances_in(self, zone: str, flt: str | None) -> list[dict[str, Any]]:
        return [self._read(i) for (z, n), i in sorted(self.instances.items())
                if z == zone and matches(i, flt)]

    def _list_instances(self, project: str, zone: str, query: dict[str, str],
                        **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        items, nxt = self._page(self._instances_in(zone, query.get("filter")), query)
        out: dict[str, Any] = {"kind": "compute#instanceList", "items": items}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _aggregated(self, kind: str, rows: list[tuple[str, dict[str, Any]]],
                    query: dict[str, str]) -> dict[str, Any]:
        page, nxt = self._page(rows, query)
        items: dict[str, Any] = {}
        for zone in sorted(self.zone_region):
            found = [r for z, r in page if z == zone]
            items[f"zones/{zone}"] = {kind: found} if found else {
                "warning": {"code": "NO_RESULTS_ON_PAGE",
                            "message": "There are no results for scope 'zones/" + zone
                                       + "' on this page."}}
        out: dict[str, Any] = {"kind": f"compute#{kind[:-1]}AggregatedList", "items": items}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _aggregated_instances(self, project: str, query: dict[str, str],
                              **_: Any) -> dict[str, Any]:
        self._own(project)
        rows = [(z, self._read(i)) for (z, n), i in sorted(self.instances.items())
                if matches(i, query.get("filter"))]
        return self._aggregated("instances", rows, query)

    def _delete_instance(self, project: str, zone: str, name: str, **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        inst = self.instances.get((zone, name))
        if inst is None:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        inst["status"] = "STOPPING"
        fault = self._op_fault("delete", zone, inst)

        def effect() -> dict[str, Any] | None:
            if fault is not None:
                if (zone, name) in self.instances:
                    self.instances[(zone, name)]["status"] = "RUNNING"
                return fault
            self._remove_instance(zone, name)
            return None

        return self._operation(project, zone, "delete", inst["selfLink"], effect)

    def _start_instance(self, project: str, zone: str, name: str, **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        inst = self.instances.get((zone, name))
        if inst is None:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        fault = self._op_fault("start", zone, inst)

        def effect() -> dict[str, Any] | None:
            if fault is not None:
                return fault
            if (zone, name) in self.instances:
                self.instances[(zone, name)]["status"] = "STAGING"
                nat = self._released_nat.pop((zone, name), None)
                for nic in self.instances[(zone, name)].get("networkInterfaces") or []:
                    for ac in nic.get("accessConfigs") or []:
                        if nat:
                            ac["natIP"] = nat
            return None

        return self._operation(project, zone, "start", inst["selfLink"], effect)

    def _stop_instance(self, project: str, zone: str, name: str, **_: Any) -> dict[str, Any]:
        """instances.stop: as a guest shutdown (TERMINATED, disk kept, external IP released)."""
        zone = self._zone(project, zone)
        inst = self.instances.get((zone, name))
        if inst is None:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}")

        def effect() -> dict[str, Any] | None:
            if (zone, name) in self.instances:
                self.guest_shutdown(zone, name)
            return None

        return self._operation(project, zone, "stop", inst["selfLink"], effect)

    # --- disks -----------------------------------------------------------------------------

    def _list_disks(self, project: str, zone: str, query: dict[str, str],
                    **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        rows = [copy.deepcopy(d) for (z, n), d in sorted(self.disks.items())
                if z == zone and matches(d, query.get("filter"))]
        items, nxt = self._page(rows, query)
        out: dict[str, Any] = {"kind": "compute#diskList", "items": items}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _aggregated_disks(self, project: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        self._own(project)
        rows = [(z, copy.deepcopy(d)) for (z, n), d in sorted(self.disks.items())
                if matches(d, query.get("filter"))]
        return self._aggregated("disks", rows, query)

    def _delete_disk(self, project: str, zone: str, name: str, **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        disk = self.disks.get((zone, name))
        if disk is None:
            raise _not_found(f"projects/{project}/zones/{zone}/disks/{name}")
        if disk.get("users"):
            raise ApiError(400, "resourceInUseByAnotherResource",
                           f"The disk resource '{disk['selfLink']}' is already being used by "
                           f"'{disk['users'][0]}'")

        def effect() -> dict[str, Any] | None:
            self.disks.pop((zone, name), None)
            return None

        return self._operation(project, zone, "delete", disk["selfLink"], effect)

    # --- networks --------------------------------------------------------------------------

    def add_default_rules(self) -> None:
        """The rules a real project's ``default`` network comes with (GCE creates them with
        the network): SSH, RDP and ICMP from anywhere, and everything between the default
        network's auto-mode subnets (10.128.0.0/9). None has target tags: they apply to every
        instance on the network."""
        net = f"{GOOGLE}/projects/{self.project}/global/networks/default"
        rules = {
            "default-allow-ssh": ([{"IPProtocol": "tcp", "ports": ["22"]}], ["0.0.0.0/0"]),
            "default-allow-rdp": ([{"IPProtocol": "tcp", "ports": ["3389"]}], ["0.0.0.0/0"]),
            "default-allow-icmp": ([{"IPProtocol": "icmp"}], ["0.0.0.0/0"]),
            "default-allow-internal": ([{"IPProtocol": "tcp", "ports": ["0-65535"]},
                                        {"IPProtocol": "udp", "ports": ["0-65535"]},
                                        {"IPProtocol": "icmp"}], ["10.128.0.0/9"]),
        }
        for name, (allowed, ranges) in rules.items():
            self.firewalls[name] = {
                "kind": "compute#firewall", "id": str(next(self._ids)), "name": name,
                "network": net, "direction": "INGRESS", "priority": 65534,
                "allowed": allowed, "sourceRanges": ranges, "disabled": False,
                "description": "Allow " + name.split("-", 2)[-1] + " from the default network",
                "selfLink": f"{GOOGLE}/projects/{self.project}/global/firewalls/{name}",
                "creationTimestamp": "2026-01-01T00:00:00.000-07:00"}

    def _network_res(self, project: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(body, kind="compute#network", name=name,
                    id=str(next(self._ids)),
                    autoCreateSubnetworks=bool(body.get("autoCreateSubnetworks", False)),
                    creationTimestamp="2026-01-01T00:00:00.000-07:00",
                    selfLink=f"{GOOGLE}/projects/{project}/global/networks/{name}")

    def _list_networks(self, project: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        self._own(project)
        rows = [copy.deepcopy(r) for _n, r in sorted(self.network_res.items())
                if matches(r, query.get("filter"))]
        items, nxt = self._page(rows, query)
        out: dict[str, Any] = {"kind": "compute#networkList", "items": items}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _insert_network(self, project: str, body: dict[str, Any] | None,
                        **_: Any) -> dict[str, Any]:
        self._own(project)
        b = copy.deepcopy(body or {})
        name = str(b.get("name", ""))
        if not _NAME.match(name):
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'.")
        if name in self.network_res:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{project}/global/"
                                                 f"networks/{name}' already exists")
        res = self._network_res(project, name, b)
        over = self.network_quota is not None and len(self.network_res) >= self.network_quota

        def effect() -> dict[str, Any] | None:
            if over:
                return {"code": "QUOTA_EXCEEDED", "message": f"Quota 'NETWORKS' exceeded.  "
                                                             f"Limit: {self.network_quota}.0 globally."}
            self.network_res[name] = res
            self.networks.add(name)
            return None
        return self._operation(project, "global", "insert", res["selfLink"], effect)

    def _delete_network(self, project: str, network: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        if network not in self.network_res:
            raise _not_found(f"projects/{project}/global/networks/{network}")
        users = [n for n, f in self.firewalls.items() if _last(f["network"]) == network]
        users += [n for (_r, n), s in self.subnetworks.items() if _last(s["network"]) == network]
        users += [n for (_z, n), i in self.instances.items()
                  if any(_last(str(nic.get("network", ""))) == network
                         for nic in i.get("networkInterfaces") or [])]
        if users:
            raise ApiError(400, "resourceInUseByAnotherResource",
                           f"The network resource 'projects/{project}/global/networks/"
                           f"{network}' is already being used by '{users[0]}'")
        link = self.network_res[network]["selfLink"]

        def effect() -> dict[str, Any] | None:
            self.network_res.pop(network, None)
            self.networks.discard(network)
            return None
        return self._operation(project, "global", "delete", link, effect)

    # --- subnetworks and instances' interfaces ----------------------------------------------

    def _check_nics(self, project: str, zone: str, nics: list[dict[str, Any]]) -> list[str]:
        """Each interface's network (checked as GCE does); their names in order."""
        region = self.zone_region.get(zone, "")
        out = []
        for i, nic in enumerate(nics):
            net = _last(str(nic.get("network") or "default"))
            if net not in self.networks:
                raise _not_found(f"projects/{project}/global/networks/{net}")
            if net in out:
                raise ApiError(400, "invalid", f"Invalid value for field 'resource."
                                               f"networkInterfaces[{i}].network': Networks must "
                                               "be distinct for NICs attached to a VM.")
            sub = nic.get("subnetwork")
            custom = not self.network_res[net].get("autoCreateSubnetworks")
            if custom and not sub:
                raise ApiError(400, "invalid", f"Invalid value for field 'resource."
                                               f"networkInterfaces[{i}].subnetwork': a "
                                               f"subnetwork is required on network {net}.")
            if custom:
                m = re.search(r"regions/([^/]+)/subnetworks/([^/]+)$", str(sub))
                s = self.subnetworks.get((m.group(1), m.group(2))) if m else None
                if s is None or m is None or m.group(1) != region or _last(s["network"]) != net:
                    raise ApiError(400, "invalid", f"Invalid value for field 'resource."
                                                   f"networkInterfaces[{i}].subnetwork': '{sub}'.")
            out.append(net)
        return out

    def _insert_subnet(self, project: str, region: str, body: dict[str, Any] | None,
                       **_: Any) -> dict[str, Any]:
        import ipaddress

        self._own(project)
        b = copy.deepcopy(body or {})
        name, net = str(b.get("name", "")), _last(str(b.get("network", "")))
        if not _NAME.match(name):
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'.")
        if region not in self.regions:
            raise _not_found(f"projects/{project}/regions/{region}")
        if net not in self.network_res or self.network_res[net].get("autoCreateSubnetworks"):
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.network': '{net}'.")
        try:
            rng = ipaddress.ip_network(str(b.get("ipCidrRange", "")))
        except ValueError:
            raise ApiError(400, "invalid", "Invalid IPCidrRange.") from None
        for s in self.subnetworks.values():
            if _last(s["network"]) == net and ipaddress.ip_network(s["ipCidrRange"]).overlaps(rng):
                raise ApiError(400, "invalid", f"Invalid IPCidrRange: {rng} conflicts with "
                                               f"existing subnetwork '{s['name']}'.")
        if (region, name) in self.subnetworks:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{project}/regions/"
                                                 f"{region}/subnetworks/{name}' already exists")
        link = f"{GOOGLE}/projects/{project}/regions/{region}/subnetworks/{name}"
        res = dict(b, kind="compute#subnetwork", id=str(next(self._ids)), selfLink=link,
                   region=f"{GOOGLE}/projects/{project}/regions/{region}",
                   network=f"{GOOGLE}/projects/{project}/global/networks/{net}",
                   creationTimestamp="2026-01-01T00:00:00.000-07:00")

        def effect() -> dict[str, Any] | None:
            self.subnetworks[(region, name)] = res
            return None
        return self._operation(project, f"regions/{region}", "insert", link, effect)

    def _get_subnet(self, project: str, region: str, name: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        if (region, name) not in self.subnetworks:
            raise _not_found(f"projects/{project}/regions/{region}/subnetworks/{name}")
        return copy.deepcopy(self.subnetworks[(region, name)])

    def _list_subnets(self, project: str, region: str, query: dict[str, str],
                      **_: Any) -> dict[str, Any]:
        self._own(project)
        rows = [copy.deepcopy(s) for (r, _n), s in sorted(self.subnetworks.items()) if r == region]
        items, nxt = self._page(rows, query)
        out: dict[str, Any] = {"kind": "compute#subnetworkList", "items": items}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _aggregated_subnets(self, project: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        self._own(project)
        items: dict[str, Any] = {}
        for region in sorted(self.regions):
            found = [copy.deepcopy(s) for (r, _n), s in sorted(self.subnetworks.items())
                     if r == region and matches(s, query.get("filter"))]
            items[f"regions/{region}"] = {"subnetworks": found} if found else {
                "warning": {"code": "NO_RESULTS_ON_PAGE", "message": "none"}}
        return {"kind": "compute#subnetworkAggregatedList", "items": items}

    def _delete_subnet(self, project: str, region: str, name: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        s = self.subnetworks.get((region, name))
        if s is None:
            raise _not_found(f"projects/{project}/regions/{region}/subnetworks/{name}")
        users = [n for (_z, n), i in self.instances.items()
                 if any(_last(str(nic.get("subnetwork", ""))) == name
                        and f"/regions/{region}/" in str(nic.get("subnetwork", ""))
                        for nic in i.get("networkInterfaces") or [])]
        if users:
            raise ApiError(400, "resourceInUseByAnotherResource",
                           f"The subnetwork resource '{s['selfLink']}' is already being used by "
                           f"'{users[0]}'")

        def effect() -> dict[str, Any] | None:
            self.subnetworks.pop((region, name), None)
            return None
        return self._operation(project, f"regions/{region}", "delete", s["selfLink"], effect)

    def _insert_policy(self, project: str, region: str, body: dict[str, Any] | None,
                       **_: Any) -> dict[str, Any]:
        self._own(project)
        b = copy.deepcopy(body or {})
        name = str(b.get("name", ""))
        if not _NAME.match(name) or region not in self.regions:
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'.")
        if (region, name) in self.policies:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{project}/regions/"
                                                 f"{region}/resourcePolicies/{name}' already exists")
        link = f"{GOOGLE}/projects/{project}/regions/{region}/resourcePolicies/{name}"
        res = dict(b, kind="compute#resourcePolicy", id=str(next(self._ids)), selfLink=link,
                   region=f"{GOOGLE}/projects/{project}/regions/{region}", status="READY")

        def effect() -> dict[str, Any] | None:
            self.policies[(region, name)] = res
            return None
        return self._operation(project, f"regions/{region}", "insert", link, effect)

    def _get_policy(self, project: str, region: str, name: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        if (region, name) not in self.policies:
            raise _not_found(f"projects/{project}/regions/{region}/resourcePolicies/{name}")
        return copy.deepcopy(self.policies[(region, name)])

    def _aggregated_policies(self, project: str, query: dict[str, str],
                             **_: Any) -> dict[str, Any]:
        self._own(project)
        items: dict[str, Any] = {}
        for region in sorted(self.regions):
            found = [copy.deepcopy(p) for (r, _n), p in sorted(self.policies.items())
                     if r == region and matches(p, query.get("filter"))]
            items[f"regions/{region}"] = {"resourcePolicies": found} if found else {
                "warning": {"code": "NO_RESULTS_ON_PAGE", "message": "none"}}
        return {"kind": "compute#resourcePolicyAggregatedList", "items": items}

    def _delete_policy(self, project: str, region: str, name: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        pol = self.policies.get((region, name))
        if pol is None:
            raise _not_found(f"projects/{project}/regions/{region}/resourcePolicies/{name}")
        users = [n for (_z, n), i in self.instances.items()
                 if any(str(rp).endswith(f"/regions/{region}/resourcePolicies/{name}")
                        for rp in i.get("resourcePolicies") or [])]
        if users:
            raise ApiError(400, "resourceInUseByAnotherResource",
                           f"The resource_policy resource '{pol['selfLink']}' is already being "
                           f"used by '{users[0]}'")

        def effect() -> dict[str, Any] | None:
            self.policies.pop((region, name), None)
            return None
        return self._operation(project, f"regions/{region}", "delete", pol["selfLink"], effect)

    def _get_region_op(self, project: str, region: str, op: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        return self._poll(f"regions/{region}", op)

    # --- firewalls -------------------------------------------------------------------------

    def _check_firewall(self, project: str, fw: dict[str, Any]) -> dict[str, Any]:
        name = str(fw.get("name", ""))
        if not _NAME.match(name):
            raise ApiError(400, "invalid", f"Invalid value for field 'resource.name': '{name}'.")
        net = _last(str(fw.get("network") or "default"))
        if net not in self.networks:
            raise _not_found(f"projects/{project}/global/networks/{net}")
        fw["network"] = f"{GOOGLE}/projects/{project}/global/networks/{net}"
        fw.setdefault("direction", "INGRESS")
        fw.setdefault("priority", 1000)
        allowed = fw.get("allowed") or []
        if not allowed and not fw.get("denied"):
            raise ApiError(400, "invalid", "At least one of 'allowed' or 'denied' is required.")
        for a in allowed:
            proto = str(a.get("IPProtocol", ""))
            if proto not in _PROTOCOLS:
                raise ApiError(400, "invalid", f"Invalid value for field "
                                               f"'resource.allowed[0].IPProtocol': '{proto}'.")
            if a.get("ports") and proto not in ("tcp", "udp", "sctp"):
                raise ApiError(400, "invalid", "Ports may only be given for tcp, udp and sctp.")
        if fw["direction"] == "INGRESS" and not (fw.get("sourceRanges") or fw.get("sourceTags")
                                                 or fw.get("sourceServiceAccounts")):
            fw["sourceRanges"] = ["0.0.0.0/0"]   # what GCE does when no source is given
        return fw

    def _insert_firewall(self, project: str, body: dict[str, Any] | None,
                         **_: Any) -> dict[str, Any]:
        self._own(project)
        fw = self._check_firewall(project, copy.deepcopy(body or {}))
        name = fw["name"]
        if name in self.firewalls:
            raise ApiError(409, "alreadyExists", f"The resource 'projects/{project}/global/"
                                                 f"firewalls/{name}' already exists")
        link = f"{GOOGLE}/projects/{project}/global/firewalls/{name}"

        def effect() -> dict[str, Any] | None:
            self.firewalls[name] = dict(fw, kind="compute#firewall", id=str(next(self._ids)),
                                        selfLink=link,
                                        creationTimestamp="2026-01-01T00:00:00.000-07:00")
            return None

        return self._operation(project, "global", "insert", link, effect)

    def _list_firewalls(self, project: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        self._own(project)
        rows = [copy.deepcopy(f) for n, f in sorted(self.firewalls.items())
                if matches(f, query.get("filter"))]
        items, nxt = self._page(rows, query)
        out: dict[str, Any] = {"kind": "compute#firewallList", "items": items}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _get_firewall(self, project: str, name: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        if name not in self.firewalls:
            raise _not_found(f"projects/{project}/global/firewalls/{name}")
        return copy.deepcopy(self.firewalls[name])

    def _patch_firewall(self, project: str, name: str, body: dict[str, Any] | None,
                        **_: Any) -> dict[str, Any]:
        self._own(project)
        if name not in self.firewalls:
            raise _not_found(f"projects/{project}/global/firewalls/{name}")
        merged = dict(copy.deepcopy(self.firewalls[name]), **copy.deepcopy(body or {}))
        fw = self._check_firewall(project, merged)

        def effect() -> dict[str, Any] | None:
            self.firewalls[name] = fw
            return None

        return self._operation(project, "global", "patch", fw["selfLink"], effect)

    def _delete_firewall(self, project: str, name: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        if name not in self.firewalls:
            raise _not_found(f"projects/{project}/global/firewalls/{name}")
        link = self.firewalls[name]["selfLink"]

        def effect() -> dict[str, Any] | None:
            self.firewalls.pop(name, None)
            return None

        return self._operation(project, "global", "delete", link, effect)

    # --- IAM service accounts and bucket IAM (iam.googleapis.com, storage.googleapis.com) ------

    def add_bucket(self, name: str, uniform: bool = True) -> None:
        """A bucket of the user's, with GCS's default policy (the project's owners and
        editors own it, viewers read it). ``uniform``: uniform bucket-level access (IAM
        conditions are refused without it)."""
        p = self.project
        with self.lock:
            self.buckets[name] = {"uniform": uniform, "etag": 1, "policy": {"bindings": [
                {"role": "roles/storage.legacyBucketOwner",
                 "members": [f"projectEditor:{p}", f"projectOwner:{p}"]},
                {"role": "roles/storage.legacyBucketReader", "members": [f"projectViewer:{p}"]},
            ]}}

    def _sa_res(self, project: str, account_id: str, body: dict[str, Any]) -> dict[str, Any]:
        email = f"{account_id}@{project}.iam.gserviceaccount.com"
        return {"name": f"projects/{project}/serviceAccounts/{email}", "projectId": project,
                "uniqueId": str(next(self._ids)), "email": email,
                "displayName": body.get("displayName", ""),
                "description": body.get("description", ""),
                "oauth2ClientId": str(next(self._ids))}

    def _create_sa(self, project: str, body: dict[str, Any] | None, **_: Any) -> dict[str, Any]:
        self._own(project)
        b = body or {}
        aid = str(b.get("accountId", ""))
        if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])", aid) or not 6 <= len(aid) <= 30:
            raise ApiError(400, "INVALID_ARGUMENT", f"Invalid account ID '{aid}': 6-30 "
                           "lowercase letters, digits or hyphens, starting with a letter.")
        if "labels" in (b.get("serviceAccount") or {}):
            raise ApiError(400, "INVALID_ARGUMENT", "Unknown name \"labels\" at "
                           "'service_account': Cannot find field.")
        res = self._sa_res(project, aid, b.get("serviceAccount") or {})
        if res["email"] in self.service_accounts:
            raise ApiError(409, "ALREADY_EXISTS", f"Service account {aid} already exists "
                           f"within project projects/{project}.")
        self.service_accounts[res["email"]] = res
        return copy.deepcopy(res)

    def _list_sa(self, project: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        self._own(project)
        items, nxt = self._page(sorted(self.service_accounts.values(),
                                       key=lambda a: a["email"]), query)
        out: dict[str, Any] = {"accounts": copy.deepcopy(items)}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _need_sa(self, project: str, email: str) -> dict[str, Any]:
        self._own(project)
        email = urllib.parse.unquote(email)
        if email not in self.service_accounts:
            raise ApiError(404, "NOT_FOUND", f"Unknown service account {email}")
        return self.service_accounts[email]

    def _get_sa(self, project: str, email: str, **_: Any) -> dict[str, Any]:
        return copy.deepcopy(self._need_sa(project, email))

    def _delete_sa(self, project: str, email: str, **_: Any) -> dict[str, Any]:
        sa = self._need_sa(project, email)
        del self.service_accounts[sa["email"]]
        # as IAM does: the policies that named it now name a deleted account
        for bk in self.buckets.values():
            for x in bk["policy"]["bindings"]:
                x["members"] = [f"deleted:serviceAccount:{sa['email']}?uid={sa['uniqueId']}"
                                if m == f"serviceAccount:{sa['email']}" else m
                                for m in x["members"]]
        return {}

    def _need_bucket(self, bucket: str) -> dict[str, Any]:
        if bucket not in self.buckets:
            raise ApiError(404, "notFound", "The specified bucket does not exist.")
        return self.buckets[bucket]

    def _get_bucket_iam(self, bucket: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        bk = self._need_bucket(bucket)
        pol = copy.deepcopy(bk["policy"])
        conditional = any("condition" in x for x in pol["bindings"])
        if conditional and int(query.get("optionsRequestedPolicyVersion", "1")) < 3:
            raise ApiError(400, "invalid", "Cannot get a policy with conditions at version 1; "
                           "request version 3.")
        return {"kind": "storage#policy", "resourceId": f"projects/_/buckets/{bucket}",
                "version": 3 if conditional else 1, "etag": f"CA{bk['etag']}=",
                "bindings": pol["bindings"]}

    def _set_bucket_iam(self, bucket: str, body: dict[str, Any] | None,
                        **_: Any) -> dict[str, Any]:
        bk = self._need_bucket(bucket)
        b = body or {}
        if b.get("etag") and b["etag"] != f"CA{bk['etag']}=":
            raise ApiError(412, "conditionNotMet", "Precondition Failed")
        bindings = copy.deepcopy(b.get("bindings") or [])
        if any("condition" in x for x in bindings):
            if int(b.get("version") or 1) < 3:
                raise ApiError(400, "invalid", "IAM conditions need policy version 3.")
            if not bk["uniform"]:
                raise ApiError(400, "invalid", "IAM conditions require uniform bucket-level "
                                               "access on the bucket.")
        for x in bindings:
            for m in x.get("members") or []:
                if m.startswith("serviceAccount:") and m.endswith(
                        f"@{self.project}.iam.gserviceaccount.com") and \
                        m.split(":", 1)[1] not in self.service_accounts:
                    raise ApiError(400, "invalid", f"Service account {m} does not exist.")
        bk["policy"] = {"bindings": bindings}
        bk["etag"] += 1
        return self._get_bucket_iam(bucket, {"optionsRequestedPolicyVersion": "3"})

    # --- operations ------------------------------------------------------------------------

    def _list_zone_ops(self, project: str, zone: str, query: dict[str, str],
                       **_: Any) -> dict[str, Any]:
        """zoneOperations.list with ``filter`` (e.g. operationType="...preempted")."""
        zone = self._zone(project, zone)
        rows = [copy.deepcopy(o) for (z, _n), o in self.operations.items()
                if z == zone and matches(o, query.get("filter"))]
        items, nxt = self._page(rows, query)
        out: dict[str, Any] = {"kind": "compute#operationList", "items": items}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _get_zone_op(self, project: str, zone: str, op: str, **_: Any) -> dict[str, Any]:
        return self._poll(self._zone(project, zone), op)

    def _get_global_op(self, project: str, op: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        return self._poll("global", op)

    # --- images, types, zones, networks ------------------------------------------------------

    def _image_family(self, project: str, family: str, **_: Any) -> dict[str, Any]:
        img = self.images.get((project, family))
        if img is None:
            raise _not_found(f"projects/{project}/global/images/family/{family}")
        return copy.deepcopy(img)

    def _image(self, project: str, image: str, **_: Any) -> dict[str, Any]:
        for (p, _f), img in self.images.items():
            if p == project and img["name"] == image:
                return copy.deepcopy(img)
        raise _not_found(f"projects/{project}/global/images/{image}")

    def _machine_type(self, project: str, zone: str, mt: str, **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        if (zone, mt) in self.unavailable_machine_types:
            raise _not_found(f"projects/{project}/zones/{zone}/machineTypes/{mt}")
        m = re.search(r"-(\d+)g?$", mt)
        cpus = int(m.group(1)) if m else 4
        return {"kind": "compute#machineType", "name": mt, "guestCpus": cpus,
                "memoryMb": cpus * 3840, "zone": zone,
                "selfLink": f"{GOOGLE}/projects/{project}/zones/{zone}/machineTypes/{mt}"}

    def _accelerator_type(self, project: str, zone: str, at: str, **_: Any) -> dict[str, Any]:
        zone = self._zone(project, zone)
        if (zone, at) in self.unavailable_accelerators or not at.startswith("nvidia-"):
            raise _not_found(f"projects/{project}/zones/{zone}/acceleratorTypes/{at}")
        return {"kind": "compute#acceleratorType", "name": at, "zone": zone,
                "maximumCardsPerInstance": 8,
                "selfLink": f"{GOOGLE}/projects/{project}/zones/{zone}/acceleratorTypes/{at}"}

    def _zone_res(self, project: str, zone: str) -> dict[str, Any]:
        return {"kind": "compute#zone", "name": zone, "status": "UP",
                "region": f"{GOOGLE}/projects/{project}/regions/{self.zone_region[zone]}",
                "selfLink": f"{GOOGLE}/projects/{project}/zones/{zone}"}

    def _list_zones(self, project: str, query: dict[str, str], **_: Any) -> dict[str, Any]:
        self._own(project)
        rows = [z for z in (self._zone_res(project, z) for z in sorted(self.zone_region))
                if matches(z, query.get("filter"))]
        items, nxt = self._page(rows, query)
        out: dict[str, Any] = {"kind": "compute#zoneList", "items": items}
        if nxt:
            out["nextPageToken"] = nxt
        return out

    def _get_zone(self, project: str, zone: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        if zone not in self.zone_region:
            raise _not_found(f"projects/{project}/zones/{zone}")
        return self._zone_res(project, zone)

    def _get_region(self, project: str, region: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        if region not in self.regions:
            raise _not_found(f"projects/{project}/regions/{region}")
        return {"kind": "compute#region", "name": region, "status": "UP",
                "zones": [f"{GOOGLE}/projects/{project}/zones/{z}" for z in self.regions[region]],
                "selfLink": f"{GOOGLE}/projects/{project}/regions/{region}"}

    def _get_network(self, project: str, network: str, **_: Any) -> dict[str, Any]:
        self._own(project)
        if network not in self.network_res:
            raise _not_found(f"projects/{project}/global/networks/{network}")
        return copy.deepcopy(self.network_res[network])

    # --- credentials ------------------------------------------------------------------------

    def service_account_key(self, path: Any, project: str | None = None,
                            email: str = "cloudtrain-test@test-project.iam.gserviceaccount.com"
                            ) -> Any:
        """Write a service-account key file (a fresh RSA key, ``token_uri`` here) whose
        self-signed JWTs and tokens this fake accepts."""
        key = write_service_account_key(path, self.url + "/token", project or self.project,
                                        email)
        from cryptography.hazmat.primitives import serialization

        info = json.loads(path.read_text())
        self.trusted_keys[email] = serialization.load_pem_private_key(
            info["private_key"].encode(), password=None).public_key()
        return key

    def guard_env(self, mp: Any) -> None:
        """Route every HTTP(S) request that is not for loopback to this fake's proxy, which
        records and refuses it (``outside``): nothing reaches Google from the tests."""
        for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
            mp.setenv(k, self.url)
        for k in ("NO_PROXY", "no_proxy"):
            mp.setenv(k, "127.0.0.1,localhost")

    def _authorized(self, auth: str) -> bool:
        if not auth.startswith("Bearer "):
            return False
        tok = auth[7:]
        if tok in self.tokens:
            return True
        parts = tok.split(".")
        if len(parts) != 3:
            return False
        try:
            def part(p: str) -> bytes:
                return base64.urlsafe_b64decode(p + "=" * (-len(p) % 4))
            claims = json.loads(part(parts[1]))
            key = self.trusted_keys.get(claims.get("iss"))
            if key is None:
                return False
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.asymmetric import padding

            key.verify(part(parts[2]), f"{parts[0]}.{parts[1]}".encode(), padding.PKCS1v15(),
                       hashes.SHA256())
        except Exception:  # noqa: BLE001 - anything wrong: not authorised
            return False
        with self.lock:
            self.jwt_uses.append({"iss": claims.get("iss"), "aud": claims.get("aud"),
                                  "scope": claims.get("scope")})
        return True

    # --- OAuth token endpoint (service-account key files pointing here) ----------------------

    def _token(self, form: dict[str, str]) -> dict[str, Any]:
        if form.get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer":
            raise ApiError(400, "invalid_grant", "unsupported grant type")
        try:
            payload = form["assertion"].split(".")[1]
            claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except (KeyError, IndexError, ValueError) as exc:
            raise ApiError(400, "invalid_grant", f"bad assertion: {exc}") from None
        token = f"ya29.fake-{next(self._ids)}"
        with self.lock:
            self.tokens.add(token)
            self.token_requests.append({"iss": claims.get("iss", ""),
                                        "scope": claims.get("scope", "")})
        return {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}


_MESSAGES = {
    "ZONE_RESOURCE_POOL_EXHAUSTED": "The zone 'projects/{project}/zones/{zone}' does not have "
                                    "enough resources available to fulfill the request.  Try a "
                                    "different zone, or try again later.",
    "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": "The zone 'projects/{project}/zones/{zone}' does "
                                                 "not have enough resources available to fulfill "
                                                 "the request. '(resource type:compute)'.",
    "UNSUPPORTED_OPERATION": "The selected machine type has no capacity for spot VMs in "
                             "{zone} right now.",
    "QUOTA_EXCEEDED": "Quota 'NVIDIA_T4_GPUS' exceeded.  Limit: 0.0 in region {region}.",
}


def write_service_account_key(path: Any, token_uri: str, project: str = "test-project",
                              email: str = "cloudtrain-test@test-project.iam.gserviceaccount.com"
                              ) -> Any:
    """A service-account key file (a fresh RSA key) whose ``token_uri`` is the fake's."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path.write_text(json.dumps({
        "type": "service_account", "project_id": project, "private_key_id": "0" * 40,
        "private_key": pem, "client_email": email, "client_id": "1" * 21,
        "token_uri": token_uri}))
    return path


# --- a harness for the provider's tests ------------------------------------------------------

TEST_CALLER_IP = "203.0.113.7"


def fake_offers() -> list[Any]:
    """A small fixed catalog: T4 on N1 hosts (attached) in three regions, A100 on a2 (built
    in), L4 on g2."""
    from cloudtrain.catalog.model import Offer

    t4 = {"us-central1": (0.73, 0.25, ("us-central1-a", "us-central1-b", "us-central1-c")),
          "us-east1": (0.75, 0.26, ("us-east1-c", "us-east1-d")),
          "europe-west4": (0.80, 0.27, ("europe-west4-a", "europe-west4-b"))}
    out = [Offer("gcp", "n1-standard-8", "T4", 1, 16, 8, 30, r, zones, price=p, spot_price=s,
                 host_type="n1-standard-8") for r, (p, s, zones) in t4.items()]
    out.append(Offer("gcp", "a2-highgpu-8g", "A100", 8, 40, 96, 680, "us-central1",
                     ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"),
                     price=29.39, spot_price=8.8))
    out.append(Offer("gcp", "g2-standard-8", "L4", 1, 24, 8, 32, "us-east1",
                     ("us-east1-b", "us-east1-c"), price=0.85, spot_price=0.34))
    return out


def hermetic_env(mp: Any, tmp: Any) -> None:
    """No user credentials, config, project or endpoint; never the GCE metadata server."""
    for k in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT",
              "GCLOUD_PROJECT", "CLOUDTRAIN_GCP_PROJECT", "CLOUDTRAIN_GCP_API_ENDPOINT",
              "GCE_METADATA_HOST", "GCE_METADATA_IP"):
        mp.delenv(k, raising=False)
    mp.setenv("NO_GCE_CHECK", "true")
    cfg = tmp / "gcloud-config"
    cfg.mkdir(exist_ok=True)
    mp.setenv("CLOUDSDK_CONFIG", str(cfg))


class Harness:
    """A provider wired to a started :class:`GCEFake`, with what tests need around it."""

    def __init__(self, fake: GCEFake, home: Any) -> None:
        import io

        self.fake = fake
        self.home = home
        self.sleeps: list[float] = []
        self.err = io.StringIO()

    def clients(self, **kw: Any) -> Any:
        from google.auth.credentials import AnonymousCredentials

        from cloudtrain_provisioners.gcp.api import GoogleClients

        kw.setdefault("credentials", AnonymousCredentials())
        kw.setdefault("project", self.fake.project)
        kw.setdefault("endpoint", self.fake.url)
        return GoogleClients(**kw)

    def provider(self, **kw: Any) -> Any:
        from cloudtrain.provider import ProviderContext
        from cloudtrain.ui import UI
        from cloudtrain_provisioners.gcp import GCPProvider

        kw.setdefault("clients", self.clients())
        kw.setdefault("caller_ip", lambda: TEST_CALLER_IP)
        kw.setdefault("sleep", self.sleeps.append)
        kw.setdefault("poll", 0.0)
        kw.setdefault("ui", UI(err=self.err))
        kw.setdefault("offers", fake_offers)
        kw.setdefault("owner", "alice@laptop.example")
        return GCPProvider(ProviderContext(self.home), **kw)

    def messages(self) -> str:
        return self.err.getvalue()

    def request(self, name: str = "demo", num_nodes: int = 2, gcp: dict[str, Any] | None = None,
                region: str | None = "us-central1", offers: Any = None,
                **resources: Any) -> Any:
        """A ClusterRequest for ``num_nodes`` x T4:1 (by default) in ``region`` (None: the
        targets in price order), with the cluster's real SSH key and the targets the
        placement step gives it (from ``offers``, else the fake catalog's)."""
        from cloudtrain.keys import ensure_keys
        from cloudtrain.pipeline.place import placed
        from cloudtrain.provider import ClusterRequest
        from cloudtrain.taskmodel import Resources
        from cloudtrain_provisioners.gcp import GCPOptions

        resources.setdefault("provider", "gcp")
        resources["region"] = region
        if "accelerators" not in resources and "instance_type" not in resources:
            resources["accelerators"] = "T4:1"
        keys = ensure_keys(self.home / "clusters" / name, comment=f"cloudtrain-{name}")
        req = ClusterRequest(name=name, num_nodes=num_nodes, resources=Resources(**resources),
                             options=GCPOptions(**{"host_key_wait": 0, **(gcp or {})}),
                             public_key=keys.public_key())
        return placed(self.provider(**({"offers": offers} if offers else {})), req)

    def up(self, request: Any, provider: Any = None) -> tuple[Any, list[Any]]:
        p = provider or self.provider()
        return p, p.create_nodes(request, p.ensure_network(request))
