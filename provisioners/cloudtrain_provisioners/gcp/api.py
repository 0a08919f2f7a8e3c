"""Compute Engine access: the client factory, credentials and project, error classification,
retries, and waiting for operations.

``google.cloud.compute_v1`` and ``google.auth`` are imported here, inside the functions that
need them, never at module level: loading the provider class stays cheap.

Everything crosses this boundary as plain dicts in the REST API's own JSON shape (camelCase
field names, enums as strings): requests are built as the API documents them and turned into
the SDK's messages here; answers come back as dicts. Mutations use the SDK's ``*_unary``
calls, which return the Operation without polling it, and :meth:`Api.wait` polls it with our
own ZoneOperationsClient / GlobalOperationsClient (same credentials, same endpoint): an SDK
``operation.result()`` would poll Google's public endpoint whatever the client was built for.

Errors: HTTP errors become the provider contract's errors (401/403 permission: AuthError,
403 quotaExceeded: QuotaError, 429/5xx and rate limits: TransientError, retried here with
backoff). Capacity and quota problems of an insert come back as a finished operation with an
``error``, classified by :func:`operation_error`: ZONE_RESOURCE_POOL_EXHAUSTED(_WITH_DETAILS)
and UNSUPPORTED_OPERATION are CapacityError (try the next zone), QUOTA_EXCEEDED is QuotaError
(try the next region).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from cloudtrain.errors import (AuthError, CapacityError, CloudtrainError, MissingSDK,
                               NoCredentials, ProviderError, QuotaError, TransientError)

ENDPOINT_ENV = "CLOUDTRAIN_GCP_API_ENDPOINT"
PROJECT_ENVS = ("CLOUDTRAIN_GCP_PROJECT", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT",
                "GCLOUD_PROJECT")
SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
DOCS = "docs/gcp.md"

CAPACITY_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                  "UNSUPPORTED_OPERATION")
QUOTA_CODES = ("QUOTA_EXCEEDED",)
PERMISSION_CODES = ("PERMISSION_DENIED", "FORBIDDEN", "ACCESS_DENIED")
RATE_REASONS = ("rateLimitExceeded", "userRateLimitExceeded", "backendError")

CREDENTIALS_HINT = ("Set up GCP credentials: run 'gcloud auth application-default login', or "
                    "point GOOGLE_APPLICATION_CREDENTIALS (or resources.gcp.credentials_file) at "
                    "a service-account key file. See " + DOCS + ".")
ROLES_HINT = ("Grant the account roles/compute.instanceAdmin.v1 and roles/compute.securityAdmin "
              "(firewall rules) on the project, or use credentials that have them"
              " (see " + DOCS + ").")

_CLIENT_CLASSES = {
    "instances": "InstancesClient", "firewalls": "FirewallsClient", "disks": "DisksClient",
    "zone_operations": "ZoneOperationsClient", "global_operations": "GlobalOperationsClient",
    "images": "ImagesClient", "machine_types": "MachineTypesClient",
    "accelerator_types": "AcceleratorTypesClient", "regions": "RegionsClient",
    "zones": "ZonesClient", "networks": "NetworksClient", "subnetworks": "SubnetworksClient",
    "region_operations": "RegionOperationsClient", "resource_policies": "ResourcePoliciesClient",
}


class NotFound(ProviderError):
    """HTTP 404 from Compute Engine (the resource does not exist)."""


class Conflict(ProviderError):
    """HTTP 409 (the resource exists already)."""


# --- clients ---------------------------------------------------------------------------------

class GoogleClients:
    """compute_v1 REST clients sharing one set of credentials and one endpoint.

    Credentials: ``credentials`` when given (tests: AnonymousCredentials), else the
    service-account key file ``credentials_file``, else Application Default Credentials
    (GOOGLE_APPLICATION_CREDENTIALS, gcloud's ADC file, or the metadata server on GCE).
    Endpoint: ``endpoint``, else ``$CLOUDTRAIN_GCP_API_ENDPOINT``, else Google's default.
    Project: ``project``, else the first of CLOUDTRAIN_GCP_PROJECT, GOOGLE_CLOUD_PROJECT,
    CLOUDSDK_CORE_PROJECT, GCLOUD_PROJECT, else the key file's or ADC's project."""

    def __init__(self, *, credentials: Any = None, credentials_file: str | None = None,
                 project: str | None = None, endpoint: str | None = None) -> None:
        self._credentials = credentials
        self.credentials_file = credentials_file
        self._project = project
        self._endpoint = endpoint
        self._cred_project: str | None = None
        self._loaded = credentials is not None
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}

    @property
    def endpoint(self) -> str | None:
        return self._endpoint or os.environ.get(ENDPOINT_ENV, "").strip() or None

    def _load_credentials(self) -> Any:
        if self._loaded:
            return self._credentials
        try:
            import google.auth
            from google.auth import exceptions as gauth_exc
        except ImportError as exc:  # the extra is missing
            raise MissingSDK("gcp", getattr(exc, "name", None) or "google-auth") from None
        try:
            if self.credentials_file:
                from google.oauth2 import service_account

                path = Path(self.credentials_file).expanduser()
                try:
                    info = json.loads(path.read_text())
                except (OSError, ValueError) as exc:
                    raise NoCredentials(f"The GCP key file {path} cannot be read: {exc}.",
                                    CREDENTIALS_HINT) from None
                if info.get("type") != "service_account":
                    raise NoCredentials(f"{path} is not a service-account key file "
                                    f"(type {info.get('type')!r}).", CREDENTIALS_HINT)
                self._credentials = service_account.Credentials.from_service_account_info(
                    info, scopes=SCOPES)
                self._cred_project = info.get("project_id")
            else:
                self._credentials, self._cred_project = google.auth.default(scopes=SCOPES)
        except gauth_exc.DefaultCredentialsError as exc:
            raise NoCredentials(f"No GCP credentials found ({str(exc).splitlines()[0]}).",
                            CREDENTIALS_HINT, code="credentials") from None
        except (ValueError, KeyError) as exc:
            raise NoCredentials(f"The GCP credentials cannot be used: {exc}.",
                            CREDENTIALS_HINT, code="credentials") from None
        self._loaded = True
        return self._credentials

    def project(self, configured: str | None = None) -> str:
        """The project to work in: ``configured`` (the task's), the factory's, the
        environment's, or the credentials'."""
        if configured:
            return configured
        if self._project:
            return self._project
        for var in PROJECT_ENVS:
            v = os.environ.get(var, "").strip()
            if v:
                return v
        with self._lock:
            self._load_credentials()
        if self._cred_project:
            return str(self._cred_project)
        raise NoCredentials("No GCP project is set.",
                        "Give resources.gcp.project in the task, or set GOOGLE_CLOUD_PROJECT "
                        "(or 'gcloud config set project ID' for ADC).",
                        code="no-project")

    def client(self, kind: str) -> Any:
        with self._lock:
            c = self._clients.get(kind)
            if c is None:
                creds = self._load_credentials()
                from google.cloud import compute_v1

                opts = {"api_endpoint": self.endpoint} if self.endpoint else None
                c = getattr(compute_v1, _CLIENT_CLASSES[kind])(
                    credentials=creds, transport="rest", client_options=opts)
                self._clients[kind] = c
            return c

    def session(self) -> Any:
        """An authorised HTTP session with the same credentials, for the JSON APIs the
        compute SDK does not cover (IAM service accounts, Cloud Storage bucket IAM)."""
        with self._lock:
            s = self._clients.get(" session")
        if s is None:
            creds = self._load_credentials()
            from google.auth.transport.requests import AuthorizedSession

            s = AuthorizedSession(creds)
            with self._lock:
                self._clients[" session"] = s
        return s

    def rest_url(self, service: str, path: str) -> str:
        """``https://<service>.googleapis.com<path>``, or the same path on the configured
        endpoint (tests: the fake serves compute, IAM and storage paths side by side)."""
        return (self.endpoint or f"https://{service}.googleapis.com").rstrip("/") + path

    def message(self, type_name: str, body: dict[str, Any]) -> Any:
        """An SDK message (e.g. ``Instance``) from a REST-shaped dict."""
        from google.cloud import compute_v1

        return getattr(compute_v1, type_name).from_json(json.dumps(body))


ClientFactory = GoogleClients


def as_dict(msg: Any) -> dict[str, Any]:
    """An SDK message as the REST API's JSON (camelCase names, enum names as strings)."""
    if isinstance(msg, dict):
        return msg
    return json.loads(type(msg).to_json(msg, preserving_proto_field_name=False,
                                        use_integers_for_enums=False))


# --- errors ---------------------------------------------------------------------------------

def classify(exc: BaseException, what: str) -> CloudtrainError:
    """The contract's error for an exception raised by the SDK (or google-auth)."""
    if isinstance(exc, CloudtrainError):
        return exc
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as aexc

    if isinstance(exc, aexc.DefaultCredentialsError):
        return NoCredentials(f"No GCP credentials found ({exc}).", CREDENTIALS_HINT,
                         code="credentials")
    if isinstance(exc, aexc.RefreshError):
        return AuthError(f"The GCP credentials were refused when refreshed: {exc}.",
                         CREDENTIALS_HINT, code="refresh")
    if isinstance(exc, gexc.GoogleAPICallError):
        status = int(exc.code or 0)
        reasons = [str(e.get("reason", "")) for e in (exc.errors or []) if isinstance(e, dict)]
        reason = reasons[0] if reasons else str(getattr(exc, "reason", "") or "")
        msg = str(exc.message or exc).strip()
        code = reason or str(status)
        if status == 401:
            return AuthError(f"GCP refused the credentials ({what}): {msg}",
                             CREDENTIALS_HINT, code=code)
        if status == 403:
            if reason == "quotaExceeded":
                return QuotaError(f"GCP quota exceeded ({what}): {msg}",
                                  "Ask for more quota (IAM & Admin > Quotas) or use "
                                  "another region.", code=code)
            if reason in RATE_REASONS:
                return TransientError(f"GCP is throttling requests ({what}): {msg}", code=code)
            if reason == "accessNotConfigured":
                return AuthError(f"The Compute Engine API is not enabled ({what}): {msg}",
                                 "Enable it: gcloud services enable compute.googleapis.com "
                                 "(or in the console), then run again.",
                                 code=code)
            return AuthError(f"GCP denied permission ({what}): {msg}", ROLES_HINT, code=code)
        if status == 404:
            return NotFound(f"{what}: {msg}", code="notFound")
        if status == 409:
            return Conflict(f"{what}: {msg}", code="alreadyExists")
        if status == 429 or status >= 500 or reason in RATE_REASONS:
            return TransientError(f"GCP had a passing fault ({what}): {msg}",
                                  "Run the command again in a minute.",
                                  code=code)
        return ProviderError(f"GCP refused the request ({what}): {msg}", code=code)
    if isinstance(exc, aexc.TransportError) or type(exc).__module__.startswith(
            ("requests", "urllib3")) or isinstance(exc, (ConnectionError, TimeoutError)):
        return TransientError(f"cannot reach the Compute Engine API ({what}): {exc}",
                              f"Check the network (and {ENDPOINT_ENV} if you set it).",
                              code="unreachable")
    return ProviderError(f"unexpected error from the GCP SDK ({what}): "
                         f"{type(exc).__name__}: {exc}", code=type(exc).__name__)


def operation_error(op: dict[str, Any], what: str) -> ProviderError | None:
    """The contract's error for a finished operation that failed, or None."""
    errors = (op.get("error") or {}).get("errors") or []
    if not errors:
        return None
    first = errors[0]
    code = str(first.get("code", "UNKNOWN"))
    msg = "; ".join(str(e.get("message", e.get("code", ""))) for e in errors)
    codes = [str(e.get("code", "")) for e in errors]
    if any(c in CAPACITY_CODES for c in codes):
        c = next(c for c in codes if c in CAPACITY_CODES)
        return CapacityError(f"{what}: {msg}", code=c)
    if any(c in QUOTA_CODES for c in codes):
        return QuotaError(f"{what}: {msg}",
                          "Ask for more quota (IAM & Admin > Quotas) or use another "
                          "region.", code="QUOTA_EXCEEDED")
    if any(c in PERMISSION_CODES for c in codes) or op.get("httpErrorStatusCode") in (401,):
        return AuthError(f"{what}: {msg}", ROLES_HINT, code=code)
    return ProviderError(f"{what}: {msg}", code=code)


# --- calls ----------------------------------------------------------------------------------

class Api:
    """Calls with classification and retries, and operation waits."""

    def __init__(self, clients: GoogleClients, *, sleep: Callable[[float], None] = time.sleep,
                 attempts: int = 6) -> None:
        self.clients = clients
        self.sleep = sleep
        self.attempts = attempts
        self.delays: list[float] = []

    def call(self, kind: str, method: str, **kw: Any) -> Any:
        """``clients.client(kind).method(**kw)``; passing faults are retried with backoff."""
        what = f"{kind}.{method}"
        delay = 1.0
        for attempt in range(self.attempts):
            try:
                return getattr(self.clients.client(kind), method)(**kw)
            except Exception as exc:  # noqa: BLE001 - classified below
                err = classify(exc, what)
                if not isinstance(err, TransientError) or attempt + 1 == self.attempts:
                    raise err from None
            self.delays.append(delay)
            self.sleep(delay)
            delay = min(delay * 2, 20.0)
        raise AssertionError("unreachable")

    def rest(self, service: str, method: str, path: str, body: Any = None,
             params: dict[str, str] | None = None) -> dict[str, Any]:
        """A JSON API call (``service``: iam, storage) with the same errors and retries."""
        what = f"{service} {method} {path.split('?')[0]}"

        def once() -> dict[str, Any]:
            from google.api_core import exceptions as gexc

            resp = self.clients.session().request(
                method, self.clients.rest_url(service, path), json=body, params=params,
                timeout=60)
            if resp.status_code >= 400:
                raise gexc.from_http_response(resp)
            return resp.json() if resp.content else {}

        delay = 1.0
        for attempt in range(self.attempts):
            try:
                return once()
            except Exception as exc:  # noqa: BLE001 - classified below
                err = classify(exc, what)
                if not isinstance(err, TransientError) or attempt + 1 == self.attempts:
                    raise err from None
            self.delays.append(delay)
            self.sleep(delay)
            delay = min(delay * 2, 20.0)
        raise AssertionError("unreachable")

    def get(self, kind: str, method: str, **kw: Any) -> dict[str, Any]:
        return as_dict(self.call(kind, method, **kw))

    def items(self, kind: str, method: str, **kw: Any) -> list[dict[str, Any]]:
        """Every item of a (paged) list call."""
        what = f"{kind}.{method}"
        for attempt in range(self.attempts):
            try:
                return [as_dict(i) for i in self.call(kind, method, **kw)]
            except CloudtrainError:
                raise
            except Exception as exc:  # noqa: BLE001 - a later page failed
                err = classify(exc, what)
                if not isinstance(err, TransientError) or attempt + 1 == self.attempts:
                    raise err from None
                self.sleep(1.0)
        raise AssertionError("unreachable")

    def aggregated(self, kind: str, project: str, field: str, flt: str | None) -> list[dict[str, Any]]:
        """Every ``field`` item (e.g. instances) of an aggregated list, in every zone."""
        what = f"{kind}.aggregated_list"
        req: dict[str, Any] = {"project": project}
        if flt:
            req["filter"] = flt
        for attempt in range(self.attempts):
            try:
                out = []
                for _scope, scoped in self.call(kind, "aggregated_list", request=req):
                    out += [as_dict(i) for i in getattr(scoped, field)]
                return out
            except CloudtrainError:
                raise
            except Exception as exc:  # noqa: BLE001 - a later page failed
                err = classify(exc, what)
                if not isinstance(err, TransientError) or attempt + 1 == self.attempts:
                    raise err from None
                self.sleep(1.0)
        raise AssertionError("unreachable")

    def wait(self, op: Any, *, project: str, zone: str | None = None, what: str = "",
             timeout: float = 900.0, region: str | None = None) -> dict[str, Any]:
        """Poll an operation until DONE (with our own operations client); raise the
        contract's error when it ended with one."""
        opd = as_dict(op)
        deadline = time.monotonic() + timeout
        while opd.get("status") != "DONE":
            if time.monotonic() > deadline:
                raise TransientError(
                    f"{what or opd.get('operationType', 'operation')} did not finish in "
                    f"{timeout:.0f}s (operation {opd.get('name')}).",
                    "Run the command again; it picks up what exists.", code="timeout")
            # ``wait`` blocks on GCE's side until the operation is DONE or about two
            # minutes have passed, so it is called again at once.
            if zone:
                opd = as_dict(self.call("zone_operations", "wait", project=project, zone=zone,
                                        operation=opd["name"]))
            elif region:
                opd = as_dict(self.call("region_operations", "wait", project=project,
                                        region=region, operation=opd["name"]))
            else:
                opd = as_dict(self.call("global_operations", "wait", project=project,
                                        operation=opd["name"]))
        err = operation_error(opd, what or f"{opd.get('operationType', 'operation')} "
                                           f"{_last(opd.get('targetLink', ''))}")
        if err is not None:
            raise err
        return opd


def _last(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]
