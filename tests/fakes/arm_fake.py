"""A fake of Azure Resource Manager for tests: HTTPS on loopback with a self-signed
certificate, so the real Azure SDK clients (which refuse bearer tokens over plain http) talk
to it unchanged.

What it models, and how ARM behaves for each:

* resource groups: PUT (synchronous 201/200), GET/HEAD, list with ``$filter=tagName eq 'x'
  [and tagValue eq 'y']``, DELETE → 202 + ``Location``; when the operation ends the group
  and everything in it are gone. Resources of a group that is deleted go with it.
* resources under ``/resourceGroups/{rg}/providers/{ns}/{type}/{name}``: network security
  groups, virtual networks (and their subnets), public IPs, network interfaces, virtual
  machines (and their OS disks), disks. PUT → 201 (200 for an update) + ``Azure-AsyncOperation``;
  the operation answers ``InProgress`` for ``polls`` polls, then ``Succeeded`` (or ``Failed``
  with an injected error code; the resource stays, in provisioning state ``Failed``, as ARM
  leaves a VM whose allocation failed). DELETE → 202 + ``Location`` (204 when absent).
* availability sets (Aligned; their proximity placement group checked) and proximity
  placement groups: PUT is synchronous (200), as ARM answers it. A VM in an availability set
  may have no zone, and cannot move to another set.
* references are checked as ARM does: a NIC's subnet and public IP, a VM's NIC, location and
  size (against the SKU table: ``SkuNotAvailable``), the image (``PlatformImageNotFound``);
  deleting a NIC a VM uses, a public IP a NIC uses, an NSG or a subnet in use is refused.
* ``/subscriptions/{s}/resources`` and ``/resourceGroups/{rg}/resources`` (generic lists; a
  list filtered by tag name *and* value returns no tags, as ARM documents), resource SKUs
  (``/providers/Microsoft.Compute/skus``) and marketplace image versions.

State is kept, so a test can list what is left (``tagged()``, ``everything()``). Faults are
injected per request (``fail``): synchronous (an error status with an ARM error body) or
asynchronous (the operation ends ``Failed``). Every request is logged (``calls``).
Only loopback: the server binds 127.0.0.1, and the addresses it invents for public IPs are
never connected to by anything.

Identities and the self-stop (issue 12), as Azure does them:

* a VM PUT with ``identity: {type: SystemAssigned}`` gets a principal (``principalId``,
  ``tenantId``); the principal goes when the VM goes.
* role assignments (``.../providers/Microsoft.Authorization/roleAssignments/{name}`` at any
  scope; PUT/GET/DELETE): the principal must exist (``PrincipalNotFound``; ``principal_lag``
  answers that many PUTs with it, as Azure's directory replication does), one per
  (principal, role, scope) (``RoleAssignmentExists``); ``deny_role_assignments``: the
  caller lacks ``Microsoft.Authorization/roleAssignments/write`` (403 ``AuthorizationFailed``,
  and the ``permissions`` list says so). Deleting a group removes the assignments scoped in it.
* an IMDS (plain HTTP on loopback, ``imds_url``; one path prefix per VM,
  ``/vm/{group}/{name}``, since it cannot tell callers apart by address as the real one
  does): ``/metadata/identity/oauth2/token`` with ``Metadata: true`` issues a token bound to
  the VM's principal, only while the VM runs and has an identity; so does ``/msi/token``,
  the identity endpoint as App Service serves it (``api-version=2019-08-01``, the secret
  ``identity_header`` in ``X-IDENTITY-HEADER``). ``imds_requests`` records every request.
* ``private_address(nic_name)``: the private address a new NIC gets (tests: their stand-in
  node's own).
* a request with such a token is allowed only by a role assignment of its principal whose
  scope contains the resource and whose role (Virtual Machine Contributor) allows the action:
  else 403 ``AuthorizationFailed``.
* ``POST .../virtualMachines/{vm}/deallocate`` (``powerOff``, ``start``): power state
  ``deallocated``; the ProvisioningState status of the instance view carries the time of the
  VM's last operation. A guest OS shutdown (``guest_shutdown``, or ``POST
  {imds}/vm/{group}/{name}/_guest/shutdown`` from a node) leaves the VM ``stopped``: still
  allocated, still billing (``billing``). ``on_vm_stopped(name, how)`` is called (in a
  thread) when a VM's guest goes down either way.
"""

from __future__ import annotations

import base64
import datetime as _dt
import ipaddress
import json
import re
import ssl
import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

SUBSCRIPTION = "00000000-0000-4000-8000-00000000c10d"
TOKEN = "fake-arm-token"

TYPES = {
    "microsoft.network/networksecuritygroups": "Microsoft.Network/networkSecurityGroups",
    "microsoft.network/virtualnetworks": "Microsoft.Network/virtualNetworks",
    "microsoft.network/publicipaddresses": "Microsoft.Network/publicIPAddresses",
    "microsoft.network/networkinterfaces": "Microsoft.Network/networkInterfaces",
    "microsoft.compute/virtualmachines": "Microsoft.Compute/virtualMachines",
    "microsoft.compute/disks": "Microsoft.Compute/disks",
    "microsoft.compute/availabilitysets": "Microsoft.Compute/availabilitySets",
    "microsoft.compute/proximityplacementgroups": "Microsoft.Compute/proximityPlacementGroups",
}
SHORT = {v.lower(): v.split("/")[1] for v in TYPES.values()}
SYNCHRONOUS = ("availabilitysets", "proximityplacementgroups")
TENANT = "00000000-0000-4000-8000-0000000000te"
VM_CONTRIBUTOR = "9980e02c-c2be-4d73-94e8-173b1dc7cf3c"
BLOB_CONTRIBUTOR = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"
ROLE_ACTIONS = {BLOB_CONTRIBUTOR: ("microsoft.storage/storageaccounts/blobservices/containers/*",),
                VM_CONTRIBUTOR: ("microsoft.compute/virtualmachines/*",
                                 "microsoft.compute/disks/read",
                                 "microsoft.resources/subscriptions/resourcegroups/read")}
"""What each built-in role allows (the part of it the fake can be asked for)."""


# --- a certificate for 127.0.0.1 ---------------------------------------------------------------

def write_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (it is its own CA): (cert file,
    key file). The cert file is the CA bundle clients verify the fake with."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "arm-fake.test")])
    now = _dt.datetime.now(_dt.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "arm-fake.pem", folder / "arm-fake.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    return cert_file, key_file


class FakeCredential:
    """A TokenCredential that hands out the fake's token (never asks anyone for one)."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.scopes: list[tuple[str, ...]] = []

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        self.scopes.append(scopes)
        return AccessToken(self.token, 4102444800)

    def get_token_info(self, *scopes: str, options: Any = None) -> Any:
        from azure.core.credentials import AccessTokenInfo

        self.scopes.append(scopes)
        return AccessTokenInfo(self.token, 4102444800)


# --- what a test can inject ------------------------------------------------------------------------

@dataclass
class Req:
    """One request as a fault's ``when`` sees it."""

    method: str
    kind: str                 # resourcegroups | virtualmachines | ... | skus | versions | resources
    name: str
    group: str
    body: dict[str, Any]
    query: dict[str, str]

    @property
    def zone(self) -> str | None:
        z = self.body.get("zones") or []
        return str(z[0]) if z else None

    @property
    def location(self) -> str:
        return str(self.body.get("location") or "")

    @property
    def rank(self) -> str | None:
        return (self.body.get("tags") or {}).get("cloudtrain:node-rank")


@dataclass
class Fault:
    method: str
    kind: str
    code: str
    message: str
    status: int
    mode: str                 # sync | async
    times: int | None
    skip: int
    when: Callable[[Req], bool] | None
    seen: int = 0
    fired: int = 0

    def matches(self, req: Req) -> bool:
        if self.method != req.method or self.kind != req.kind:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        if self.when is not None and not self.when(req):
            return False
        self.seen += 1
        if self.seen <= self.skip:
            return False
        self.fired += 1
        return True


class ArmError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class Op:
    polls_left: int
    apply: Callable[[], None] | None
    error: dict[str, str] | None = None
    done: bool = False


@dataclass
class Sku:
    name: str
    zones: tuple[str, ...] = ("1", "2", "3")
    accelerated_networking: bool = True
    generations: tuple[str, ...] = ("V1", "V2")
    premium_io: bool = True
    spot: bool = True
    restricted_zones: tuple[str, ...] = ()
    restricted: bool = False

    def as_json(self, location: str) -> dict[str, Any]:
        caps = [{"name": "AcceleratedNetworkingEnabled", "value": str(self.accelerated_networking)},
                {"name": "HyperVGenerations", "value": ",".join(self.generations)},
                {"name": "PremiumIO", "value": str(self.premium_io)},
                {"name": "LowPriorityCapable", "value": str(self.spot)}]
        restrictions = []
        if self.restricted:
            restrictions.append({"type": "Location", "values": [location],
                                 "restrictionInfo": {"locations": [location]},
                                 "reasonCode": "NotAvailableForSubscription"})
        if self.restricted_zones:
            restrictions.append({"type": "Zone", "values": [location],
                                 "restrictionInfo": {"locations": [location],
                                                     "zones": list(self.restricted_zones)},
                                 "reasonCode": "NotAvailableForSubscription"})
        return {"resourceType": "virtualMachines", "name": self.name, "tier": "Standard",
                "size": self.name.removeprefix("Standard_"), "locations": [location],
                "locationInfo": [{"location": location, "zones": list(self.zones)}],
                "capabilities": caps, "restrictions": restrictions}


DEFAULT_SKUS = (
    Sku("Standard_NC4as_T4_v3"),
    Sku("Standard_NC24ads_A100_v4", generations=("V2",)),
    Sku("Standard_ND96asr_v4", zones=("1", "2"), generations=("V2",)),
    Sku("Standard_ND96isr_H100_v5", generations=("V2",)),
    Sku("Standard_NC6", zones=(), accelerated_networking=False, generations=("V1",),
        premium_io=False),
)
DEFAULT_LOCATIONS = ("eastus", "eastus2", "westus2", "southcentralus", "westus3")
DEFAULT_IMAGES = (("microsoft-dsvm", "ubuntu-hpc", "2204"),
                  ("Canonical", "0001-com-ubuntu-server-jammy", "22_04-lts"),
                  ("Canonical", "0001-com-ubuntu-server-jammy", "22_04-lts-gen2"))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --- the fake ------------------------------------------------------------------------------------

class ArmFake:
    def __init__(self, folder: Path, *, subscription: str = SUBSCRIPTION, token: str = TOKEN,
                 polls: int = 1, locations: tuple[str, ...] = DEFAULT_LOCATIONS) -> None:
        self.folder = folder
        self.subscription = subscription
        self.token = token
        self.polls = polls
        self.lock = threading.RLock()
        self.groups: dict[str, dict[str, Any]] = {}
        self.resources: dict[str, dict[str, Any]] = {}
        self.power: dict[str, str] = {}
        self.ops: dict[str, Op] = {}
        self.faults: list[Fault] = []
        self.calls: list[tuple[str, str, str]] = []
        """(method, kind, name) of every request, in order."""
        self.requests: list[Req] = []
        self.skus: dict[str, dict[str, Sku]] = {loc: {s.name.lower(): s for s in DEFAULT_SKUS}
                                                for loc in locations}
        self.images: dict[tuple[str, str, str, str], list[str]] = {
            (loc, p.lower(), o.lower(), s.lower()): ["22.04.2024050101", "22.04.2025010101"]
            for loc in locations for p, o, s in DEFAULT_IMAGES}
        self.sticky: set[str] = set()
        """Resource ids (lower case) that survive their group's deletion (a test of the
        check that follows a teardown)."""
        self.on_vm_running: Callable[[dict[str, Any], str, str], None] | None = None
        # osProfile.customData by VM id: ARM takes it at creation, hands it to the VM (where
        # cloud-init reads it) and never returns it in a GET; on_vm_running sees it
        self.custom_data: dict[str, str] = {}
        """Called (vm body, its public IP, its private IP) when a VM's creation succeeds."""
        self._next_public = 1
        self._next_private: dict[str, int] = {}
        self.private_address: Callable[[str], str | None] | None = None
        """The private address of a new NIC, by NIC name (tests: the address of the local
        node that stands in for its VM); None, or None from it: the next one of its subnet."""
        self.identity_header = "ct-identity-secret"
        """What the identity endpoint (``{imds}/msi/token``, as App Service's) wants in
        ``X-IDENTITY-HEADER``."""
        self.imds_requests: list[tuple[str, str, dict[str, str]]] = []
        """(method, path with query, headers by lower-case name) of every request to the IMDS
        server."""
        self.role_assignments: dict[str, dict[str, Any]] = {}
        self.storage_accounts: dict[str, dict[str, Any]] = {}
        self.deny_role_assignments = False
        self.principal_lag = 0
        self.mi_tokens: dict[str, str] = {}
        """Token -> the principal IMDS issued it to."""
        self.last_op: dict[str, str] = {}
        """VM id (lower case) -> time of its last operation (the instance view's)."""
        self.on_vm_stopped: Callable[[str, str], None] | None = None
        self._imds: ThreadingHTTPServer | None = None
        self.cert_file, self.key_file = write_certificate(folder)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"https://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> ArmFake:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert_file, self.key_file)
        fake = self

        class Handler(_Handler):
            arm = fake

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.socket = ctx.wrap_socket(server.socket, server_side=True,
                                        do_handshake_on_connect=False)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="arm-fake", daemon=True)
        self._thread.start()
        imds = ThreadingHTTPServer(("127.0.0.1", 0), type("Imds", (_ImdsHandler,), {"arm": fake}))
        imds.daemon_threads = True
        self._imds = imds
        threading.Thread(target=imds.serve_forever, kwargs={"poll_interval": 0.05},
                         name="imds-fake", daemon=True).start()
        return self

    @property
    def imds_url(self) -> str:
        assert self._imds is not None
        return f"http://127.0.0.1:{self._imds.server_address[1]}"

    def imds_of(self, group: str, vm: str) -> str:
        """The IMDS base URL as the VM ``vm`` of ``group`` sees it."""
        return f"{self.imds_url}/vm/{group}/{vm}"

    def stop(self) -> None:
        if self._imds is not None:
            self._imds.shutdown()
            self._imds.server_close()
            self._imds = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # --- what tests use -----------------------------------------------------------------------------

    def fail(self, method: str, kind: str, code: str, message: str | None = None, *,
             status: int | None = None, mode: str = "sync", times: int | None = 1, skip: int = 0,
             when: Callable[[Req], bool] | None = None) -> Fault:
        """Make the next matching request fail with ARM error ``code``. ``kind``: the last
        type segment, lower case (``virtualmachines``, ``resourcegroups``, ``skus`` ...).
        ``mode="async"``: the request is accepted and its operation ends Failed."""
        f = Fault(method.upper(), kind.lower(), code, message or f"injected {code}",
                  status or (409 if mode == "sync" else 200), mode, times, skip, when)
        with self.lock:
            self.faults.append(f)
        return f

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def add_sku(self, location: str, sku: Sku) -> None:
        with self.lock:
            self.skus.setdefault(location, {})[sku.name.lower()] = sku

    def remove_sku(self, location: str, name: str) -> None:
        with self.lock:
            self.skus.get(location, {}).pop(name.lower(), None)

    def everything(self) -> list[dict[str, Any]]:
        """Every group and resource the fake holds."""
        with self.lock:
            return [dict(g) for g in self.groups.values()] + [dict(r) for r in self.resources.values()]

    def tagged(self, cluster: str | None = None) -> list[dict[str, Any]]:
        """What carries cloudtrain's cluster tag (of ``cluster``, or of any)."""
        out = []
        for r in self.everything():
            tags = r.get("tags") or {}
            if "cloudtrain:cluster" in tags and (cluster is None or tags["cloudtrain:cluster"] == cluster):
                out.append(r)
        return out

    def of_type(self, kind: str, group: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(r) for r in self.resources.values()
                    if SHORT.get(r["type"].lower(), "").lower() == kind.lower()
                    and (group is None or _group_of(r["id"]).lower() == group.lower())]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.everything():
            k = r["type"].split("/")[-1]
            out[k] = out.get(k, 0) + 1
        return out

    def ops_of(self, method: str, kind: str) -> list[Req]:
        return [r for r in self.requests if r.method == method and r.kind == kind]

    def evict(self, vm_name: str, policy: str | None = None) -> None:
        """A spot eviction, as the VM's ``evictionPolicy`` (or ``policy``) says: Delete: the
        VM and its OS disk go (NIC and public IP stay); Deallocate: the VM stays,
        PowerState/deallocated, its compute no longer billed."""
        with self.lock:
            for rid, r in list(self.resources.items()):
                if r["type"] == TYPES["microsoft.compute/virtualmachines"] and r["name"] == vm_name:
                    how = policy or (r.get("properties") or {}).get("evictionPolicy") or "Delete"
                    if how == "Deallocate":
                        self.power[rid.lower()] = "deallocated"
                        self.last_op[rid.lower()] = _now()
                    else:
                        self._delete_vm(rid)

    def add_storage_account(self, group: str, name: str, location: str = "eastus") -> str:
        """A storage account the user has (in its own resource group, made here too):
        listed by ``GET /subscriptions/S/providers/Microsoft.Storage/storageAccounts``; role
        assignments may be scoped to its containers. Returns its id."""
        with self.lock:
            self.groups.setdefault(group.lower(), {
                "id": f"{self._base()}/resourceGroups/{group}", "name": group,
                "type": "Microsoft.Resources/resourceGroups", "location": location, "tags": {},
                "properties": {"provisioningState": "Succeeded"}})
            sid = (f"{self._base()}/resourceGroups/{group}/providers/Microsoft.Storage/"
                   f"storageAccounts/{name}")
            self.storage_accounts[name.lower()] = {
                "id": sid, "name": name, "type": "Microsoft.Storage/storageAccounts",
                "location": location, "kind": "StorageV2", "sku": {"name": "Standard_LRS"},
                "properties": {"primaryEndpoints": {
                    "blob": f"https://{name}.blob.core.windows.net/"}}}
            return sid

    def assignments_at(self, scope: str) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(a) for a in self.role_assignments.values()
                    if a["properties"]["scope"].lower() == scope.lower()]

    def vm(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            for r in self.resources.values():
                if r["type"] == TYPES["microsoft.compute/virtualmachines"] and r["name"] == name:
                    return r
        return None

    def power_of(self, name: str) -> str | None:
        vm = self.vm(name)
        return None if vm is None else self.power.get(vm["id"].lower())

    def billing(self, name: str) -> bool:
        """Whether Azure bills the VM's compute: it exists and is not deallocated."""
        p = self.power_of(name)
        return self.vm(name) is not None and p not in ("deallocated", "deallocating")

    def guest_shutdown(self, group: str, name: str) -> None:
        """The guest OS shut itself down: Azure keeps the VM allocated (PowerState/stopped)."""
        with self.lock:
            vm = self.resources.get(self._vm_id(group, name))
            if vm is None:
                raise ArmError(404, "ResourceNotFound", f"VM {name} not found.")
            if self.power.get(vm["id"].lower()) in ("running", "starting"):
                self.power[vm["id"].lower()] = "stopped"
        self._stopped(name, "guest-shutdown")

    def _vm_id(self, group: str, name: str) -> str:
        return (f"{self._base()}/resourceGroups/{group}/providers/Microsoft.Compute/"
                f"virtualMachines/{name}").lower()

    def _stopped(self, name: str, how: str) -> None:
        if self.on_vm_stopped is not None:
            threading.Thread(target=self.on_vm_stopped, args=(name, how), daemon=True).start()

    def issue_token(self, group: str, name: str) -> dict[str, Any]:
        """IMDS: a token for the VM's system-assigned identity."""
        with self.lock:
            vm = self.resources.get(self._vm_id(group, name))
            if vm is None or self.power.get(vm["id"].lower()) != "running":
                raise ArmError(400, "invalid_request", "No VM answers at this address.")
            pid = (vm.get("identity") or {}).get("principalId")
            if not pid:
                raise ArmError(400, "invalid_request", "Identity not found")
            token = f"mi.{pid}.{uuid.uuid4().hex}"
            self.mi_tokens[token] = pid
            return {"access_token": token, "expires_in": "3599", "token_type": "Bearer",
                    "resource": "https://management.azure.com/", "client_id": pid}

    def assignments_of(self, principal: str) -> list[dict[str, Any]]:
        with self.lock:
            return [a for a in self.role_assignments.values()
                    if a["properties"]["principalId"] == principal]

    # --- request handling -----------------------------------------------------------------------------

    def _base(self) -> str:
        return f"/subscriptions/{self.subscription}"

    def handle(self, method: str, raw_path: str, headers: Any, body: bytes) -> tuple[int, dict[str, str], Any]:
        parts = urlsplit(raw_path)
        path = parts.path.rstrip("/")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        auth = headers.get("Authorization") or ""
        principal = None
        if auth != f"Bearer {self.token}":
            principal = self.mi_tokens.get(auth.removeprefix("Bearer "))
            if principal is None:
                return 401, {}, _err("InvalidAuthenticationToken",
                                     "The access token is missing or invalid.")
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            return 400, {}, _err("InvalidRequestContent", "The request content is not JSON.")
        try:
            with self.lock:
                if principal is not None:
                    self._authorize(principal, method, path)
                return self._route(method, path, query, data)
        except ArmError as e:
            return e.status, {}, _err(e.code, e.message)

    def _route(self, method: str, path: str, query: dict[str, str], body: dict[str, Any]
               ) -> tuple[int, dict[str, str], Any]:
        low = path.lower()
        m = re.fullmatch(r"/_ops/([0-9a-f]+)(/location)?", low)
        if m:
            return self._poll(m.group(1), bool(m.group(2)))
        if low == "/subscriptions" and method == "GET":   # the caller's subscriptions
            return 200, {}, {"value": [{"subscriptionId": self.subscription, "state": "Enabled",
                                        "displayName": "cloudtrain-fake"}]}
        base = self._base().lower()
        if not low.startswith(base):
            if low.startswith("/subscriptions/"):
                raise ArmError(404, "SubscriptionNotFound",
                               f"The subscription '{path.split('/')[2]}' could not be found.")
            raise ArmError(404, "NotFound", f"No route for {path}.")
        rest = path[len(base):]
        lrest = rest.lower()
        m = re.fullmatch(r"(.*)/providers/microsoft\.authorization/roleassignments/([^/]+)", lrest)
        if m:
            self._req(method, "roleassignments", m.group(2), _group_of(path), body, query)
            return self._role_assignment(method, path[:len(base) + len(m.group(1))],
                                         path.rsplit("/", 1)[1], body)
        m = re.fullmatch(r"(.*)/providers/microsoft\.authorization/roleassignments", lrest)
        if m and method == "GET":
            self._req(method, "roleassignments", "", _group_of(path), body, query)
            return self._list_assignments(path[:len(base) + len(m.group(1))], query)
        if lrest == "/providers/microsoft.storage/storageaccounts" and method == "GET":
            self._req(method, "storageaccounts", "", "", body, query)
            return 200, {}, {"value": list(self.storage_accounts.values())}
        m = re.fullmatch(r"(.*)/providers/microsoft\.authorization/permissions", lrest)
        if m:
            self._req(method, "permissions", "", _group_of(path), body, query)
            return 200, {}, {"value": [self._caller_permissions()]}
        m = re.fullmatch(r"/resourcegroups/([^/]+)/providers/microsoft\.compute/virtualmachines/"
                         r"([^/]+)/(deallocate|poweroff|start)", lrest)
        if m and method == "POST":
            self._req(method, m.group(3), m.group(2), m.group(1), body, query)
            return self._vm_action(self._get(self._rid(rest.rsplit("/", 1)[0])), m.group(3))

        if lrest == "/resourcegroups":
            self._req(method, "resourcegroups", "", "", body, query)
            return self._list_groups(query)
        if lrest == "/resources":
            self._req(method, "resources", "", "", body, query)
            return 200, {}, {"value": self._generic(list(self.resources.values()), query)}
        if lrest == "/providers/microsoft.compute/skus":
            self._req(method, "skus", "", "", body, query)
            return self._list_skus(query)
        m = re.fullmatch(r"/providers/microsoft\.compute/locations/([^/]+)/publishers/([^/]+)/"
                         r"artifacttypes/vmimage/offers/([^/]+)/skus/([^/]+)/versions", lrest)
        if m:
            self._req(method, "versions", m.group(4), "", body, query)
            versions = self.images.get((m.group(1), m.group(2), m.group(3), m.group(4)))
            if versions is None:
                raise ArmError(404, "NotFound", "Artifact: VMImage was not found.")
            return 200, {}, [{"name": v, "location": m.group(1),
                              "id": f"{path}/{v}"} for v in versions]
        m = re.fullmatch(r"/resourcegroups/([^/]+)", rest, flags=re.I)
        if m:
            req = self._req(method, "resourcegroups", m.group(1), m.group(1), body, query)
            return self._group(req)
        m = re.fullmatch(r"/resourcegroups/([^/]+)/resources", rest, flags=re.I)
        if m:
            self._req(method, "resources", "", m.group(1), body, query)
            self._need_group(m.group(1))
            inside = [r for r in self.resources.values()
                      if _group_of(r["id"]).lower() == m.group(1).lower()]
            return 200, {}, {"value": self._generic(inside, query)}
        m = re.fullmatch(r"/resourcegroups/([^/]+)/providers/([^/]+)/([^/]+)", rest, flags=re.I)
        if m:
            kind = m.group(3).lower()
            self._req(method, kind, "", m.group(1), body, query)
            self._need_group(m.group(1))
            t = TYPES.get(f"{m.group(2)}/{m.group(3)}".lower())
            if t is None:
                raise ArmError(400, "NoRegisteredProviderFound", f"No type {m.group(3)}.")
            found = [self._view(r) for r in self.resources.values()
                     if r["type"] == t and _group_of(r["id"]).lower() == m.group(1).lower()]
            if kind == "virtualmachines" and query.get("$expand", "").lower() == "instanceview":
                for vm in found:
                    vm["properties"]["instanceView"] = self._instance_view(vm)
            return 200, {}, {"value": found}
        m = re.fullmatch(r"/resourcegroups/([^/]+)/providers/microsoft\.compute/virtualmachines/"
                         r"([^/]+)/instanceview", lrest)
        if m:
            self._req(method, "instanceview", m.group(2), m.group(1), body, query)
            vm = self._get(self._rid(rest.rsplit("/", 1)[0]))
            return 200, {}, self._instance_view(vm)
        m = re.fullmatch(r"/resourcegroups/([^/]+)/providers/microsoft\.network/virtualnetworks/"
                         r"([^/]+)/subnets/([^/]+)", lrest)
        if m:
            self._req(method, "subnets", m.group(3), m.group(1), body, query)
            vnet = self._get(self._rid(rest.rsplit("/", 2)[0]))
            for s in vnet["properties"].get("subnets", []):
                if s["name"].lower() == m.group(3):
                    if method == "GET":
                        return 200, {}, s
            raise ArmError(404, "NotFound", f"Subnet {m.group(3)} not found.")
        m = re.fullmatch(r"/resourcegroups/([^/]+)/providers/([^/]+)/([^/]+)/([^/]+)", rest, flags=re.I)
        if m:
            t = TYPES.get(f"{m.group(2)}/{m.group(3)}".lower())
            req = self._req(method, m.group(3).lower(), m.group(4), m.group(1), body, query)
            if t is None:
                raise ArmError(400, "NoRegisteredProviderFound", f"No type {m.group(3)}.")
            return self._resource(req, t, self._rid(rest))
        raise ArmError(404, "NotFound", f"No route for {path}.")

    def _req(self, method: str, kind: str, name: str, group: str, body: dict[str, Any],
             query: dict[str, str]) -> Req:
        req = Req(method, kind, name, group, body, query)
        self.requests.append(req)
        self.calls.append((method, kind, name))
        for f in self.faults:
            if f.matches(req):
                if f.mode == "sync":
                    raise ArmError(f.status, f.code, f.message)
                req.fault = f  # type: ignore[attr-defined]
                break
        return req

    def _rid(self, rest: str) -> str:
        return self._base() + rest

    def _op(self, apply: Callable[[], None] | None, error: dict[str, str] | None = None) -> str:
        oid = uuid.uuid4().hex
        self.ops[oid] = Op(self.polls, apply, error)
        return oid

    def _poll(self, oid: str, location: bool) -> tuple[int, dict[str, str], Any]:
        op = self.ops.get(oid)
        if op is None:
            raise ArmError(404, "OperationNotFound", f"Operation {oid} not found.")
        if op.polls_left > 0:
            op.polls_left -= 1
            if location:
                return 202, {"Location": f"{self.url}/_ops/{oid}/location"}, None
            return 200, {}, {"status": "InProgress"}
        if not op.done:
            op.done = True
            if op.apply is not None:
                try:
                    op.apply()
                except ArmError as e:
                    op.error = {"code": e.code, "message": e.message}
        if op.error is not None:
            if location:
                return 409, {}, {"error": op.error}
            return 200, {}, {"status": "Failed", "error": op.error}
        if location:
            return 204, {}, None
        return 200, {}, {"status": "Succeeded"}

    def _accepted_delete(self, apply: Callable[[], None], error: dict[str, str] | None = None
                         ) -> tuple[int, dict[str, str], Any]:
        oid = self._op(apply, error)
        return 202, {"Location": f"{self.url}/_ops/{oid}/location"}, None

    # --- resource groups -------------------------------------------------------------------------

    def _need_group(self, name: str) -> dict[str, Any]:
        g = self.groups.get(name.lower())
        if g is None:
            raise ArmError(404, "ResourceGroupNotFound", f"Resource group '{name}' could not be found.")
        return g

    def _list_groups(self, query: dict[str, str]) -> tuple[int, dict[str, str], Any]:
        name, value = _tag_filter(query.get("$filter", ""))
        out = []
        for g in self.groups.values():
            tags = g.get("tags") or {}
            if name is not None and name not in tags:
                continue
            if value is not None and tags.get(name) != value:
                continue
            out.append(g)
        return 200, {}, {"value": out}

    def _group(self, req: Req) -> tuple[int, dict[str, str], Any]:
        key = req.name.lower()
        if req.method in ("GET", "HEAD"):
            g = self.groups.get(key)
            if g is None:
                raise ArmError(404, "ResourceGroupNotFound",
                               f"Resource group '{req.name}' could not be found.")
            return (204 if req.method == "HEAD" else 200), {}, (None if req.method == "HEAD" else g)
        if req.method in ("PUT", "PATCH"):
            old = self.groups.get(key)
            if old is not None and req.body.get("location") and \
                    req.body["location"].lower() != old["location"].lower():
                raise ArmError(409, "InvalidResourceGroupLocation",
                               f"Invalid resource group location '{req.body['location']}'. The "
                               f"Resource group already exists in location '{old['location']}'.")
            if old is None and req.method == "PATCH":
                raise ArmError(404, "ResourceGroupNotFound", f"Resource group '{req.name}' could not be found.")
            g = {"id": f"{self._base()}/resourceGroups/{req.name}", "name": req.name,
                 "type": "Microsoft.Resources/resourceGroups",
                 "location": req.body.get("location") or (old or {}).get("location"),
                 "tags": dict(req.body.get("tags") or (old or {}).get("tags") or {}),
                 "properties": {"provisioningState": "Succeeded"}}
            self.groups[key] = g
            return (200 if old else 201), {}, g
        if req.method == "DELETE":
            if key not in self.groups:
                raise ArmError(404, "ResourceGroupNotFound",
                               f"Resource group '{req.name}' could not be found.")
            fault = getattr(req, "fault", None)
            error = {"code": fault.code, "message": fault.message} if fault else None
            self.groups[key]["properties"]["provisioningState"] = "Deleting"

            def apply() -> None:
                if error is not None:
                    self.groups[key]["properties"]["provisioningState"] = "Succeeded"
                    return
                for rid, r in list(self.resources.items()):
                    if _group_of(r["id"]).lower() == key and rid not in self.sticky:
                        del self.resources[rid]
                        self.power.pop(rid, None)
                for aid in list(self.role_assignments):
                    if _group_of(aid).lower() == key:
                        del self.role_assignments[aid]
                self.groups.pop(key, None)

            return self._accepted_delete(apply, error)
        raise ArmError(405, "MethodNotAllowed", req.method)

    # --- resources -------------------------------------------------------------------------------

    def _get(self, rid: str) -> dict[str, Any]:
        r = self.resources.get(rid.lower())
        if r is None:
            self._need_group(_group_of(rid))
            raise ArmError(404, "ResourceNotFound",
                           f"The Resource '{rid.split('/providers/')[-1]}' under resource group "
                           f"'{_group_of(rid)}' was not found.")
        return r

    def _resource(self, req: Req, rtype: str, rid: str) -> tuple[int, dict[str, str], Any]:
        if req.method == "GET":
            found = self._view(self._get(rid))
            if req.kind == "virtualmachines" and req.query.get("$expand", "").lower() == "instanceview":
                found["properties"]["instanceView"] = self._instance_view(found)
            return 200, {}, found
        if req.method == "PUT":
            self._need_group(req.group)
            return self._put(req, rtype, rid)
        if req.method == "PATCH":
            r = self._get(rid)
            if "tags" in req.body:
                r["tags"] = dict(req.body["tags"] or {})
            return 200, {}, self._view(r)
        if req.method == "DELETE":
            self._need_group(req.group)
            r = self.resources.get(rid.lower())
            if r is None:
                return 204, {}, None
            self._check_delete(r)
            return self._accepted_delete(lambda: self._delete(rid.lower()))
        raise ArmError(405, "MethodNotAllowed", req.method)

    def _put(self, req: Req, rtype: str, rid: str) -> tuple[int, dict[str, str], Any]:
        body = req.body
        old = self.resources.get(rid.lower())
        location = str(body.get("location") or "")
        if not location:
            raise ArmError(400, "LocationRequired", "The location property is required.")
        if location not in self.skus:
            raise ArmError(400, "LocationNotAvailableForResourceType",
                           f"The provided location '{location}' is not available.")
        props = json.loads(json.dumps(body.get("properties") or {}))
        r: dict[str, Any] = {"id": rid, "name": req.name, "type": rtype, "location": location,
                             "tags": dict(body.get("tags") or {}), "properties": props}
        for k in ("zones", "sku", "identity"):
            if k in body:
                r[k] = json.loads(json.dumps(body[k]))
        short = SHORT[rtype.lower()].lower()
        check = getattr(self, f"_put_{short}", None)
        if check is not None:
            check(r, old)
        if short in SYNCHRONOUS:   # ARM writes these at once and answers 200
            self.resources[rid.lower()] = r
            return 200, {}, self._view(r)
        props["provisioningState"] = "Updating" if old else "Creating"
        self.resources[rid.lower()] = r
        fault = getattr(req, "fault", None)
        error = {"code": fault.code, "message": fault.message} if fault else None

        def apply() -> None:
            cur = self.resources.get(rid.lower())
            if cur is None:
                return
            if error is not None:
                cur["properties"]["provisioningState"] = "Failed"
                return
            cur["properties"]["provisioningState"] = "Succeeded"
            done = getattr(self, f"_done_{short}", None)
            if done is not None:
                done(cur)

        oid = self._op(apply, error)
        hdrs = {"Azure-AsyncOperation": f"{self.url}/_ops/{oid}"}
        return (200 if old else 201), hdrs, self._view(r)

    def _ref(self, rid: str | None, what: str, location: str) -> dict[str, Any]:
        if not rid:
            raise ArmError(400, "InvalidResourceReference", f"{what}: no id given.")
        if "/subnets/" in rid.lower():
            vnet = self.resources.get(rid.lower().split("/subnets/")[0])
            sub = None
            if vnet is not None:
                sub = next((s for s in vnet["properties"].get("subnets", [])
                            if s["id"].lower() == rid.lower()), None)
            if sub is None:
                raise ArmError(400, "InvalidResourceReference",
                               f"Resource {rid} referenced by {what} was not found.")
            target = vnet
        else:
            target = self.resources.get(rid.lower())
            if target is None:
                raise ArmError(400, "InvalidResourceReference",
                               f"Resource {rid} referenced by {what} was not found.")
            sub = target
        if target["location"] != location:
            raise ArmError(400, "InvalidResourceReference",
                           f"Resource {rid} referenced by {what} is in {target['location']}, "
                           f"not {location}.")
        return sub

    def _put_networksecuritygroups(self, r: dict[str, Any], old: dict[str, Any] | None) -> None:
        for rule in r["properties"].get("securityRules", []):
            rule["id"] = f"{r['id']}/securityRules/{rule['name']}"
            rule.setdefault("properties", {})["provisioningState"] = "Succeeded"

    def _put_virtualnetworks(self, r: dict[str, Any], old: dict[str, Any] | None) -> None:
        space = [ipaddress.ip_network(p) for p in
                 r["properties"].get("addressSpace", {}).get("addressPrefixes", [])]
        used = {}
        for s in (old or {}).get("properties", {}).get("subnets", []):
            used[s["name"].lower()] = s["properties"].get("ipConfigurations", [])
        for s in r["properties"].get("subnets", []):
            s["id"] = f"{r['id']}/subnets/{s['name']}"
            p = s.setdefault("properties", {})
            net = ipaddress.ip_network(p.get("addressPrefix", ""))
            if not any(net.subnet_of(a) for a in space):
                raise ArmError(400, "NetcfgSubnetRangeOutsideVnet",
                               f"Subnet '{s['name']}' is not valid in its virtual network.")
            if p.get("networkSecurityGroup"):
                self._ref(p["networkSecurityGroup"].get("id"), f"subnet {s['name']}", r["location"])
            p["provisioningState"] = "Succeeded"
            if used.get(s["name"].lower()):
                p["ipConfigurations"] = used[s["name"].lower()]
        gone = set(used) - {s["name"].lower() for s in r["properties"].get("subnets", [])}
        if any(used[g] for g in gone):
            raise ArmError(400, "InUseSubnetCannotBeDeleted", "A subnet in use would be removed.")

    def _put_publicipaddresses(self, r: dict[str, Any], old: dict[str, Any] | None) -> None:
        p = r["properties"]
        if old is not None and old["properties"].get("ipAddress"):
            p["ipAddress"] = old["properties"]["ipAddress"]
            if old["properties"].get("ipConfiguration"):
                p["ipConfiguration"] = old["properties"]["ipConfiguration"]
        elif p.get("publicIPAllocationMethod", "Dynamic") == "Static":
            n = self._next_public
            self._next_public += 1
            p["ipAddress"] = f"20.{60 + n // 65536}.{(n // 256) % 256}.{n % 256}"

    def _put_networkinterfaces(self, r: dict[str, Any], old: dict[str, Any] | None) -> None:
        p = r["properties"]
        if p.get("networkSecurityGroup"):
            self._ref(p["networkSecurityGroup"].get("id"), f"NIC {r['name']}", r["location"])
        for i, cfg in enumerate(p.get("ipConfigurations", [])):
            cp = cfg.setdefault("properties", {})
            cfg["id"] = f"{r['id']}/ipConfigurations/{cfg['name']}"
            subnet = self._ref((cp.get("subnet") or {}).get("id"), f"NIC {r['name']}", r["location"])
            if cp.get("publicIPAddress"):
                pip = self._ref(cp["publicIPAddress"].get("id"), f"NIC {r['name']}", r["location"])
                holder = (pip["properties"].get("ipConfiguration") or {}).get("id", "")
                if holder and not holder.lower().startswith(r["id"].lower() + "/"):
                    raise ArmError(400, "PublicIPAddressInUse",
                                   f"Public IP {pip['name']} is used by {holder}.")
                pip["properties"]["ipConfiguration"] = {"id": cfg["id"]}
            oldcfg = ((old or {}).get("properties", {}).get("ipConfigurations") or [{}])[0]
            addr = (oldcfg.get("properties") or {}).get("privateIPAddress")
            if not addr and self.private_address is not None:
                addr = self.private_address(r["name"])
            if not addr:
                net = ipaddress.ip_network(subnet["properties"]["addressPrefix"])
                n = self._next_private.get(subnet["id"].lower(), 4)
                self._next_private[subnet["id"].lower()] = n + 1
                addr = str(net.network_address + n)
            cp["privateIPAddress"] = addr
            cp["privateIPAllocationMethod"] = "Dynamic"
            cp["primary"] = i == 0
            refs = subnet["properties"].setdefault("ipConfigurations", [])
            if not any(x["id"].lower() == cfg["id"].lower() for x in refs):
                refs.append({"id": cfg["id"]})
        if old is not None and old["properties"].get("virtualMachine"):
            p["virtualMachine"] = old["properties"]["virtualMachine"]
        p["macAddress"] = "00-0D-3A-" + uuid.uuid4().hex[:6].upper()

    def _sku(self, location: str, size: str, zone: str | None) -> Sku:
        sku = self.skus.get(location, {}).get(size.lower())
        if sku is None or sku.restricted or (zone is not None and (
                zone not in sku.zones or zone in sku.restricted_zones)):
            where = f"zone '{zone}' of " if zone else ""
            raise ArmError(409, "SkuNotAvailable",
                           f"The requested VM size {size} is currently not available in "
                           f"{where}location '{location}'. Please try another size or deploy to "
                           "a different location or different zone.")
        return sku

    def _put_availabilitysets(self, r: dict[str, Any], old: dict[str, Any] | None) -> None:
        if (r.get("sku") or {}).get("name") != "Aligned":
            raise ArmError(400, "InvalidParameter", "Managed disks need an Aligned availability "
                                                    "set.")
        ppg = (r["properties"].get("proximityPlacementGroup") or {}).get("id")
        if ppg:
            self._ref(ppg, "availability set", r["location"])

    def _put_virtualmachines(self, r: dict[str, Any], old: dict[str, Any] | None) -> None:
        p = r["properties"]
        zone = (r.get("zones") or [None])[0]
        aset = (p.get("availabilitySet") or {}).get("id")
        if aset:
            self._ref(aset, "virtual machine", r["location"])
            if zone:
                raise ArmError(400, "InvalidParameter", "A virtual machine cannot be in an "
                                                        "availability set and in a zone.")
            if old is not None and ((old["properties"].get("availabilitySet") or {}).get("id")
                                    or "").lower() != aset.lower():
                raise ArmError(409, "PropertyChangeNotAllowed", "Changing property "
                                                               "'availabilitySet' is not allowed.")
        if old is not None and (old.get("zones") or [None])[0] != zone:
            raise ArmError(409, "PropertyChangeNotAllowed",
                           "Changing property 'zones' is not allowed.")
        size = (p.get("hardwareProfile") or {}).get("vmSize", "")
        sku = self._sku(r["location"], size, zone)
        img = (p.get("storageProfile") or {}).get("imageReference") or {}
        if "id" not in img:
            key = (r["location"], str(img.get("publisher", "")).lower(),
                   str(img.get("offer", "")).lower(), str(img.get("sku", "")).lower())
            if key not in self.images:
                raise ArmError(404, "PlatformImageNotFound",
                               f"The platform image '{img.get('publisher')}:{img.get('offer')}:"
                               f"{img.get('sku')}:{img.get('version')}' is not available.")
            gen2 = str(img.get("sku", "")).endswith("gen2") or img.get("offer") == "ubuntu-hpc"
            if ("V2" if gen2 else "V1") not in sku.generations:
                raise ArmError(400, "BadRequest",
                               f"The selected VM size '{size}' cannot boot Hypervisor Generation "
                               f"'{'2' if gen2 else '1'}'.")
        os_ = p.get("osProfile") or {}
        if "customData" in os_:
            cd = str(os_.pop("customData"))
            try:
                base64.b64decode(cd, validate=True)
            except ValueError:
                raise ArmError(400, "InvalidParameter", "Custom data in OSProfile must be in "
                                                        "Base64 encoding.") from None
            if len(cd) > 87380:
                raise ArmError(400, "InvalidParameter", "Custom data is longer than 87380 "
                                                        "characters.")
            if old is not None and self.custom_data.get(r["id"].lower(), cd) != cd:
                raise ArmError(409, "PropertyChangeNotAllowed",
                               "Changing property 'customData' is not allowed.")
            self.custom_data[r["id"].lower()] = cd
        lin = os_.get("linuxConfiguration") or {}
        if not lin.get("disablePasswordAuthentication") and not os_.get("adminPassword"):
            raise ArmError(400, "InvalidParameter", "Required parameter 'adminPassword' is missing (null).")
        nics = (p.get("networkProfile") or {}).get("networkInterfaces") or []
        if not nics:
            raise ArmError(400, "InvalidParameter", "The VM needs at least one network interface.")
        for ref in nics:
            nic = self._ref(ref.get("id"), f"VM {r['name']}", r["location"])
            holder = (nic["properties"].get("virtualMachine") or {}).get("id", "")
            if holder and holder.lower() != r["id"].lower():
                raise ArmError(400, "NicInUse", f"Network interface {nic['name']} is used by {holder}.")
            if nic["properties"].get("enableAcceleratedNetworking") and not sku.accelerated_networking:
                raise ArmError(400, "VMSizeIsNotPermittedToEnableAcceleratedNetworking",
                               f"VM size {size} is not compatible with accelerated networking on "
                               f"network interface {nic['name']}.")
        for ref in nics:
            self.resources[ref["id"].lower()]["properties"]["virtualMachine"] = {"id": r["id"]}
        ident = r.get("identity") or {}
        if "systemassigned" in str(ident.get("type", "")).lower():
            ident["principalId"] = ((old or {}).get("identity") or {}).get("principalId") \
                or str(uuid.uuid4())
            ident["tenantId"] = TENANT
        elif ident:
            ident.pop("principalId", None)
        p["vmId"] = (old or {}).get("properties", {}).get("vmId") or str(uuid.uuid4())
        p.setdefault("timeCreated", _now())

    def _done_virtualmachines(self, vm: dict[str, Any]) -> None:
        rid = vm["id"].lower()
        osd = vm["properties"].setdefault("storageProfile", {}).setdefault("osDisk", {})
        disk_name = osd.get("name") or f"{vm['name']}_OsDisk_1_{uuid.uuid4().hex[:12]}"
        osd["name"] = disk_name
        disk_id = f"{_prefix(vm['id'])}/providers/Microsoft.Compute/disks/{disk_name}"
        osd.setdefault("managedDisk", {})["id"] = disk_id
        if disk_id.lower() not in self.resources:
            self.resources[disk_id.lower()] = {
                "id": disk_id, "name": disk_name, "type": TYPES["microsoft.compute/disks"],
                "location": vm["location"], "tags": {}, "managedBy": vm["id"],
                **({"zones": vm["zones"]} if vm.get("zones") else {}),
                "properties": {"diskSizeGB": osd.get("diskSizeGB", 30), "osType": "Linux",
                               "provisioningState": "Succeeded", "diskState": "Attached"}}
        self.power[rid] = "running"
        self.last_op[rid] = _now()
        if self.on_vm_running is not None:
            nic = self.resources[vm["properties"]["networkProfile"]["networkInterfaces"][0]["id"].lower()]
            cfg = nic["properties"]["ipConfigurations"][0]["properties"]
            pip_ref = (cfg.get("publicIPAddress") or {}).get("id")
            public = self.resources[pip_ref.lower()]["properties"].get("ipAddress", "") if pip_ref else ""
            seen = json.loads(json.dumps(vm))
            if rid in self.custom_data:
                seen["properties"].setdefault("osProfile", {})["customData"] = self.custom_data[rid]
            self.on_vm_running(seen, public, cfg["privateIPAddress"])

    def _instance_view(self, vm: dict[str, Any]) -> dict[str, Any]:
        state = vm["properties"].get("provisioningState", "")
        statuses = [{"code": f"ProvisioningState/{state.lower()}", "level": "Info"}]
        if vm["id"].lower() in self.last_op:
            statuses[0]["time"] = self.last_op[vm["id"].lower()]
        power = self.power.get(vm["id"].lower())
        if power:
            statuses.append({"code": f"PowerState/{power}", "level": "Info"})
        return {"computerName": vm["name"], "osName": "ubuntu", "statuses": statuses}

    def _check_delete(self, r: dict[str, Any]) -> None:
        t = r["type"].lower()
        if t == "microsoft.network/networkinterfaces":
            vm = (r["properties"].get("virtualMachine") or {}).get("id", "")
            if vm and vm.lower() in self.resources:
                raise ArmError(400, "NicInUse", f"Network Interface {r['id']} is used by existing "
                                                f"resource {vm}. In order to delete the network "
                                                "interface, it must be dissociated from the resource.")
        if t == "microsoft.network/publicipaddresses":
            holder = (r["properties"].get("ipConfiguration") or {}).get("id", "")
            if holder and holder.lower().split("/ipconfigurations/")[0] in self.resources:
                raise ArmError(400, "PublicIPAddressCannotBeDeleted",
                               f"Public IP address {r['id']} can not be deleted since it is still "
                               f"allocated to resource {holder}.")
        if t == "microsoft.network/networksecuritygroups":
            for o in self.resources.values():
                for s in o["properties"].get("subnets", []) if o["type"].lower() == \
                        "microsoft.network/virtualnetworks" else []:
                    if ((s.get("properties") or {}).get("networkSecurityGroup") or {}).get("id", "").lower() == r["id"].lower():
                        raise ArmError(400, "InUseNetworkSecurityGroupCannotBeDeleted",
                                       f"Network security group {r['id']} cannot be deleted "
                                       f"because it is in use by {s['id']}.")
        if t == "microsoft.network/virtualnetworks":
            for s in r["properties"].get("subnets", []):
                live = [c for c in s["properties"].get("ipConfigurations", [])
                        if c["id"].lower().split("/ipconfigurations/")[0] in self.resources]
                if live:
                    raise ArmError(400, "InUseSubnetCannotBeDeleted",
                                   f"Subnet {s['name']} is in use by {live[0]['id']} and cannot "
                                   "be deleted.")
        if t == "microsoft.compute/disks" and r.get("managedBy", "").lower() in self.resources:
            raise ArmError(409, "OperationNotAllowed",
                           f"Disk {r['name']} is attached to VM {r['managedBy']}.")

    def _delete(self, rid: str) -> None:
        r = self.resources.get(rid)
        if r is None:
            return
        if r["type"].lower() == "microsoft.compute/virtualmachines":
            self._delete_vm(rid)
            return
        self._check_delete(r)
        if r["type"].lower() == "microsoft.network/networkinterfaces":
            for cfg in r["properties"].get("ipConfigurations", []):
                cp = cfg.get("properties") or {}
                pip = self.resources.get(((cp.get("publicIPAddress") or {}).get("id") or "").lower())
                if pip is not None:
                    pip["properties"].pop("ipConfiguration", None)
                vnet = self.resources.get(((cp.get("subnet") or {}).get("id") or "").lower().split("/subnets/")[0])
                for s in (vnet or {}).get("properties", {}).get("subnets", []):
                    s["properties"]["ipConfigurations"] = [
                        c for c in s["properties"].get("ipConfigurations", [])
                        if c["id"].lower() != cfg["id"].lower()]
        del self.resources[rid]

    def _delete_vm(self, rid: str) -> None:
        vm = self.resources.pop(rid, None)
        self.power.pop(rid, None)
        pid = ((vm or {}).get("identity") or {}).get("principalId")
        self.mi_tokens = {t: p for t, p in self.mi_tokens.items() if p != pid}
        if vm is None:
            return
        osd = (vm["properties"].get("storageProfile") or {}).get("osDisk") or {}
        disk_id = ((osd.get("managedDisk") or {}).get("id") or "").lower()
        if disk_id in self.resources:
            if osd.get("deleteOption") == "Delete":
                del self.resources[disk_id]
            else:
                self.resources[disk_id].pop("managedBy", None)
                self.resources[disk_id]["properties"]["diskState"] = "Unattached"
        for ref in (vm["properties"].get("networkProfile") or {}).get("networkInterfaces", []):
            nic = self.resources.get(ref["id"].lower())
            if nic is None:
                continue
            nic["properties"].pop("virtualMachine", None)
            if (ref.get("properties") or {}).get("deleteOption") == "Delete":
                self._delete(ref["id"].lower())

    # --- identities, roles, power actions ------------------------------------------------------

    def _authorize(self, principal: str, method: str, path: str) -> None:
        low = path.lower()
        m = re.search(r"/providers/(microsoft\.[a-z]+)/([a-z]+)(?:/[^/]+(?:/([a-z]+))?)?$", low)
        if m is None:
            action = "microsoft.resources/subscriptions/resourcegroups/" + \
                ("read" if method == "GET" else "write" if method == "PUT" else "delete")
        else:
            base = f"{m.group(1)}/{m.group(2)}"
            verb = {"GET": "read", "PUT": "write", "PATCH": "write", "DELETE": "delete"}.get(method)
            action = f"{base}/{m.group(3)}/action" if method == "POST" and m.group(3) \
                else f"{base}/{verb}"
        for a in self.assignments_of(principal):
            scope = a["properties"]["scope"].lower()
            role = a["properties"]["roleDefinitionId"].rsplit("/", 1)[-1]
            inside = low == scope or low.startswith(scope + "/")
            if inside and any(_fnmatch(action, pat) for pat in ROLE_ACTIONS.get(role, ())):
                return
        raise ArmError(403, "AuthorizationFailed",
                       f"The client '{principal}' with object id '{principal}' does not have "
                       f"authorization to perform action '{action}' over scope '{path}' or the "
                       "scope is invalid.")

    def _caller_permissions(self) -> dict[str, Any]:
        if self.deny_role_assignments:    # Contributor
            return {"actions": ["*"], "notActions": [
                "Microsoft.Authorization/*/Delete", "Microsoft.Authorization/*/Write",
                "Microsoft.Authorization/elevateAccess/Action"]}
        return {"actions": ["*"], "notActions": []}   # Owner

    def _role_assignment(self, method: str, scope: str, name: str, body: dict[str, Any]
                         ) -> tuple[int, dict[str, str], Any]:
        aid = f"{scope}/providers/Microsoft.Authorization/roleAssignments/{name}"
        old = self.role_assignments.get(aid.lower())
        if method == "GET":
            if old is None:
                raise ArmError(404, "RoleAssignmentNotFound", f"Role assignment {name} not found.")
            return 200, {}, old
        if method == "DELETE":
            self.role_assignments.pop(aid.lower(), None)
            return (200, {}, old) if old else (204, {}, None)
        if method != "PUT":
            raise ArmError(405, "MethodNotAllowed", method)
        if self.deny_role_assignments:
            raise ArmError(403, "AuthorizationFailed",
                           "The client 'user@example.com' with object id 'u-1' does not have "
                           "authorization to perform action 'Microsoft.Authorization/"
                           f"roleAssignments/write' over scope '{aid}' or the scope is invalid.")
        g = _group_of(scope)
        if g:
            self._need_group(g)
        p = body.get("properties") or {}
        pid, role = str(p.get("principalId") or ""), str(p.get("roleDefinitionId") or "")
        if self.principal_lag > 0:
            self.principal_lag -= 1
            raise ArmError(400, "PrincipalNotFound",
                           f"Principal {pid.replace('-', '')} does not exist in the directory.")
        known = {(v.get("identity") or {}).get("principalId") for v in self.resources.values()}
        if not pid or pid not in known:
            raise ArmError(400, "PrincipalNotFound",
                           f"Principal {pid.replace('-', '')} does not exist in the directory.")
        if role.rsplit("/", 1)[-1] not in ROLE_ACTIONS:
            raise ArmError(400, "RoleDefinitionDoesNotExist", f"{role} does not exist.")
        for a in self.role_assignments.values():
            ap = a["properties"]
            if a["id"].lower() != aid.lower() and ap["principalId"] == pid and \
                    ap["roleDefinitionId"].lower() == role.lower() and ap["scope"].lower() == scope.lower():
                raise ArmError(409, "RoleAssignmentExists", "The role assignment already exists.")
        a = {"id": aid, "name": name, "type": "Microsoft.Authorization/roleAssignments",
             "properties": {"principalId": pid, "roleDefinitionId": role, "scope": scope,
                            "principalType": p.get("principalType", "ServicePrincipal"),
                            "description": p.get("description")}}
        self.role_assignments[aid.lower()] = a
        return (200 if old else 201), {}, a

    def _list_assignments(self, scope: str, query: dict[str, str]
                          ) -> tuple[int, dict[str, str], Any]:
        """Role assignments at ``scope`` (``$filter=atScope()``: at it and above it), as
        ARM lists them; without a filter, also those below it."""
        low = scope.lower()
        at = "atscope()" in query.get("$filter", "").lower()
        out = []
        for a in self.role_assignments.values():
            s = a["properties"]["scope"].lower()
            above = low == s or low.startswith(s + "/")
            below = s.startswith(low + "/")
            if above or (below and not at):
                out.append(a)
        return 200, {}, {"value": out}

    def _vm_action(self, vm: dict[str, Any], action: str) -> tuple[int, dict[str, str], Any]:
        rid = vm["id"].lower()
        before = self.power.get(rid)
        self.power[rid] = {"deallocate": "deallocated", "poweroff": "stopped",
                           "start": "running"}[action]
        self.last_op[rid] = _now()
        if action != "start" and before in ("running", "starting"):
            self._stopped(vm["name"], action)
        oid = self._op(None)
        self.ops[oid].polls_left = 0
        return 202, {"Location": f"{self.url}/_ops/{oid}/location",
                     "Azure-AsyncOperation": f"{self.url}/_ops/{oid}"}, None

    def _view(self, r: dict[str, Any]) -> dict[str, Any]:
        return json.loads(json.dumps(r))

    def _generic(self, items: list[dict[str, Any]], query: dict[str, str]) -> list[dict[str, Any]]:
        name, value = _tag_filter(query.get("$filter", ""))
        out = []
        for r in items:
            tags = r.get("tags") or {}
            if name is not None and name not in tags:
                continue
            if value is not None and tags.get(name) != value:
                continue
            g = {"id": r["id"], "name": r["name"], "type": r["type"], "location": r["location"]}
            if value is None:   # ARM: filtered by tag name and value, the tags are not returned
                g["tags"] = dict(tags)
            out.append(g)
        return out

    def _list_skus(self, query: dict[str, str]) -> tuple[int, dict[str, str], Any]:
        m = re.search(r"location eq '([^']+)'", query.get("$filter", ""))
        locations = [m.group(1)] if m else list(self.skus)
        return 200, {}, {"value": [s.as_json(loc) for loc in locations
                                   for s in self.skus.get(loc, {}).values()]}


def _tag_filter(flt: str) -> tuple[str | None, str | None]:
    if not flt:
        return None, None
    m = re.fullmatch(r"\s*tagName eq '([^']*)'(?:\s+and\s+tagValue eq '([^']*)')?\s*", flt)
    if not m:
        raise ArmError(400, "InvalidFilterInQueryString", f"Unsupported $filter: {flt}")
    return m.group(1), m.group(2)


def _group_of(rid: str) -> str:
    m = re.search(r"/resourcegroups/([^/]+)", rid, flags=re.I)
    return m.group(1) if m else ""


def _prefix(rid: str) -> str:
    m = re.match(r"(/subscriptions/[^/]+/resourcegroups/[^/]+)", rid, flags=re.I)
    return m.group(1) if m else rid


def _err(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class _Handler(BaseHTTPRequestHandler):
    arm: ArmFake
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def setup(self) -> None:
        try:
            self.request.do_handshake()
        except (ssl.SSLError, OSError):
            self.request.close()
            raise
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass

    def _serve(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        try:
            status, headers, payload = self.arm.handle(self.command, self.path, self.headers, body)
        except Exception as exc:  # noqa: BLE001 - a bug in the fake: tell the client
            status, headers, payload = 500, {}, _err("FakeInternalError", repr(exc))
        data = b"" if payload is None or self.command == "HEAD" else json.dumps(payload).encode()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("x-ms-request-id", uuid.uuid4().hex)
        if data:
            self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)

    do_GET = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_POST = _serve


def _fnmatch(action: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(action.lower(), pattern.lower())


class _ImdsHandler(BaseHTTPRequestHandler):
    """The Instance Metadata Service as each VM sees it, at ``/vm/{group}/{name}``."""

    arm: ArmFake
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass

    def _serve(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        parts = urlsplit(self.path)
        self.arm.imds_requests.append((self.command, self.path,
                                       {k.lower(): v for k, v in self.headers.items()}))
        m = re.fullmatch(r"/vm/([^/]+)/([^/]+)(/.*)", parts.path)
        status, payload = 404, {"error": "not_found"}
        try:
            if m and m.group(3) == "/msi/token" and self.command == "GET":
                # the identity endpoint of App Service, Functions and Container Apps
                # (IDENTITY_ENDPOINT, its secret in IDENTITY_HEADER), api-version 2019-08-01
                q = parse_qs(parts.query)
                if self.headers.get("X-IDENTITY-HEADER") != self.arm.identity_header:
                    status, payload = 401, {"error": "unauthorized",
                                            "error_description": "X-IDENTITY-HEADER is wrong"}
                elif q.get("api-version") != ["2019-08-01"] or not q.get("resource"):
                    status, payload = 400, {"error": "invalid_request",
                                            "error_description": "api-version 2019-08-01 and "
                                                                 "resource are required"}
                else:
                    status, payload = 200, self.arm.issue_token(m.group(1), m.group(2))
            elif m and m.group(3) == "/metadata/identity/oauth2/token" and self.command == "GET":
                q = parse_qs(parts.query)
                if self.headers.get("Metadata", "").lower() != "true":
                    status, payload = 400, {"error": "invalid_request",
                                            "error_description": "Required metadata header not specified"}
                elif not q.get("resource") or not q.get("api-version"):
                    status, payload = 400, {"error": "invalid_request",
                                            "error_description": "resource and api-version are required"}
                else:
                    status, payload = 200, self.arm.issue_token(m.group(1), m.group(2))
            elif m and m.group(3) == "/_guest/shutdown" and self.command == "POST":
                self.arm.guest_shutdown(m.group(1), m.group(2))
                status, payload = 200, {"shutdown": m.group(2)}
        except ArmError as e:
            status, payload = e.status, {"error": e.code, "error_description": e.message}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _serve


# --- a harness for tests: the provider wired to a running fake ------------------------------------

TEST_CALLER_IP = "203.0.113.7"


def hermetic_env(mp: Any, subscription: str = SUBSCRIPTION) -> None:
    """No real Azure configuration reaches the provider: the fake's subscription, no CLI
    profile, none of cloudtrain's Azure settings (``mp``: pytest's monkeypatch)."""
    import os

    for k in list(os.environ):
        if k.startswith("CLOUDTRAIN_AZURE_") or k.startswith("AZURE_"):
            mp.delenv(k, raising=False)
    mp.setenv("AZURE_SUBSCRIPTION_ID", subscription)
    mp.setenv("AZURE_CONFIG_DIR", "/nonexistent/azure-config")


class Harness:
    def __init__(self, fake: ArmFake, home: Path) -> None:
        import io

        from cloudtrain_provisioners.azure.api import AzureClients

        self.fake = fake
        self.home = home
        self.sleeps: list[float] = []
        self.err = io.StringIO()
        self.credential = FakeCredential(fake.token)
        self.clients = AzureClients(credential=self.credential, endpoint=fake.url,
                                    ca_bundle=str(fake.cert_file), polling_interval=0,
                                    retry_total=0)

    def provider(self, **kw: Any) -> Any:
        from cloudtrain.provider import ProviderContext
        from cloudtrain.ui import UI
        from cloudtrain_provisioners.azure import AzureProvider

        kw.setdefault("clients", self.clients)
        kw.setdefault("caller_ip", lambda: TEST_CALLER_IP)
        kw.setdefault("sleep", self.sleeps.append)
        kw.setdefault("poll", 0.0)
        kw.setdefault("ui", UI(err=self.err))
        return AzureProvider(ProviderContext(self.home), **kw)

    def messages(self) -> str:
        return self.err.getvalue()

    def request(self, name: str = "demo", num_nodes: int = 2, azure: dict[str, Any] | None = None,
                region: str | None = "eastus", offers: Any = None, **resources: Any) -> Any:
        """A ClusterRequest for ``num_nodes`` x A100:8 (by default, on the plain network: the
        InfiniBand set-up is test_network_azure.py's) in ``region`` (None: no region, the
        targets in price order), with the cluster's real SSH key and the targets the
        placement step gives it (from ``offers``, else the catalog's)."""
        from cloudtrain.keys import ensure_keys
        from cloudtrain.pipeline.place import placed
        from cloudtrain.provider import ClusterRequest
        from cloudtrain.taskmodel import Resources
        from cloudtrain_provisioners.azure import AzureOptions

        resources.setdefault("provider", "azure")
        resources["region"] = region
        if "accelerators" not in resources and "instance_type" not in resources:
            resources["accelerators"] = "A100:8"
            resources.setdefault("network", "plain")
        keys = ensure_keys(self.home / "clusters" / name, comment=f"cloudtrain-{name}")
        req = ClusterRequest(name=name, num_nodes=num_nodes, resources=Resources(**resources),
                             options=AzureOptions(**(azure or {})), public_key=keys.public_key())
        return placed(self.provider(**({"offers": offers} if offers else {})), req)

    def up(self, req: Any, p: Any = None) -> tuple[Any, list[Any]]:
        p = p or self.provider()
        return p, p.create_nodes(req, p.ensure_network(req))
