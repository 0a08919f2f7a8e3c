"""The boundary with Azure Resource Manager: credentials, the SDK clients, error
classification and retries.

The Azure SDKs are imported here, lazily, when the first client is made: loading the provider
class (as ``cloudtrain status`` may) imports none of them. Tests hand the provider an
:class:`AzureClients` built with their own credential and the fake's endpoint; the SDK
clients themselves are the real ones.

Settings read from the environment (all optional):

``CLOUDTRAIN_AZURE_ARM_ENDPOINT``
    The Resource Manager endpoint (default ``https://management.azure.com``): sovereign and
    private clouds (e.g. ``https://management.chinacloudapi.cn``, Azure Stack Hub).
``CLOUDTRAIN_AZURE_CA_BUNDLE``
    A PEM file of the CA certificates that endpoint's TLS certificate is checked against.
``CLOUDTRAIN_AZURE_CREDENTIAL_SCOPE``
    The token scope (default: ``<endpoint>/.default``).
``CLOUDTRAIN_AZURE_ACCESS_TOKEN``
    A bearer token to use as is (e.g. from ``az account get-access-token``) instead of
    ``DefaultAzureCredential``.
``CLOUDTRAIN_AZURE_POLL_INTERVAL``
    Seconds between polls of a long-running operation (default 5).
``AZURE_SUBSCRIPTION_ID`` (or ``CLOUDTRAIN_AZURE_SUBSCRIPTION_ID``)
    The subscription when the task names none; else the Azure CLI's default subscription.

Every call goes through :class:`Api`, which turns the SDK's exceptions into cloudtrain's typed
errors by the ARM error *code* (never the HTTP status): capacity (another zone or region may
help), quota (another region may), auth (stop), transient (retried here with backoff).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cloudtrain.errors import (AuthError, CapacityError, MissingSDK, NoCredentials, ProviderError,
                               QuotaError, TransientError, UserError, code_of)

DEFAULT_ENDPOINT = "https://management.azure.com"
ENDPOINT_ENV = "CLOUDTRAIN_AZURE_ARM_ENDPOINT"
CA_ENV = "CLOUDTRAIN_AZURE_CA_BUNDLE"
SCOPE_ENV = "CLOUDTRAIN_AZURE_CREDENTIAL_SCOPE"
TOKEN_ENV = "CLOUDTRAIN_AZURE_ACCESS_TOKEN"
POLL_ENV = "CLOUDTRAIN_AZURE_POLL_INTERVAL"
SUBSCRIPTION_ENVS = ("CLOUDTRAIN_AZURE_SUBSCRIPTION_ID", "AZURE_SUBSCRIPTION_ID")

# --- which ARM error means what ----------------------------------------------------------------

CAPACITY_CODES = frozenset({
    "AllocationFailed", "ZonalAllocationFailed", "SkuNotAvailable",
    "OverconstrainedAllocationRequest", "OverconstrainedZonalAllocationRequest",
    "AllocationTimedOut", "SpotVMEvictedWhileCreating",
})
"""No room for this size here right now (this zone, or the region): try the next."""

QUOTA_CODES = frozenset({
    "QuotaExceeded", "PublicIPCountLimitReached", "SubscriptionNotRegisteredForFeature",
    "LowPriorityQuotaExceeded",
})
"""An account limit of this region: another region may have room."""

QUOTA_IF_MESSAGE = frozenset({"OperationNotAllowed"})
"""Codes that mean a quota only when their message says so ("... exceeding approved
standardNDASv4_A100Family Cores quota ...")."""

AUTH_CODES = frozenset({
    "AuthorizationFailed", "AuthenticationFailed", "InvalidAuthenticationToken",
    "InvalidAuthenticationTokenAudience", "InvalidAuthenticationTokenTenant",
    "ExpiredAuthenticationToken", "LinkedAuthorizationFailed", "SubscriptionNotFound",
    "InvalidSubscriptionId", "ReadOnlyDisabledSubscription", "MissingSubscription",
    "SubscriptionNotRegistered", "MissingSubscriptionRegistration",
})
"""Credentials missing, expired, or without the permission: nothing else will work."""

TRANSIENT_CODES = frozenset({
    "TooManyRequests", "RetryableError", "RetryableErrorDueToAnotherOperation",
    "InternalServerError", "InternalExecutionError", "ServiceUnavailable", "GatewayTimeout",
    "ServerTimeout", "OperationPreempted", "AnotherOperationInProgress", "Throttled",
    "SubscriptionRequestsThrottled", "ResourceGroupBeingDeleted",
})
"""Throttling or a passing fault on Azure's side: retried with backoff."""

AUTH_HINT = ("Sign in with 'az login' (or set AZURE_CLIENT_ID, AZURE_TENANT_ID and "
             "AZURE_CLIENT_SECRET for a service principal), check the subscription "
             "(resources.azure.subscription_id or AZURE_SUBSCRIPTION_ID), and that the identity "
             "may create resource groups, networks and VMs there (the Contributor role).")


def _error_parts(exc: BaseException) -> list[tuple[str, str]]:
    """(code, message) of the error and of its details, outermost first."""
    out: list[tuple[str, str]] = []
    err = getattr(exc, "error", None)

    def walk(e: Any, depth: int = 0) -> None:
        if e is None or depth > 4:
            return
        code = getattr(e, "code", None) if not isinstance(e, dict) else e.get("code")
        msg = getattr(e, "message", None) if not isinstance(e, dict) else e.get("message")
        if code:
            out.append((str(code), str(msg or "")))
        details = getattr(e, "details", None) if not isinstance(e, dict) else e.get("details")
        for d in details or []:
            walk(d, depth + 1)

    walk(err)
    if not out:
        resp = getattr(exc, "response", None)
        try:
            body = json.loads(resp.text()) if resp is not None else None
        except Exception:  # noqa: BLE001 - no JSON body
            body = None
        if isinstance(body, dict):
            walk(body.get("error") if isinstance(body.get("error"), dict) else body)
    return out


def classify(exc: BaseException, what: str) -> ProviderError:
    """The typed error for an Azure SDK exception raised by ``what`` (e.g. "create VM demo-0
    in eastus zone 1"). The ARM error code is its ``code``; the class depends on the
    code alone (OperationNotAllowed on its message: quota or not)."""
    from azure.core.exceptions import (ClientAuthenticationError, ServiceRequestError,
                                       ServiceResponseError)

    parts = _error_parts(exc)
    known = [(c, m) for c, m in parts if c in CAPACITY_CODES | QUOTA_CODES | AUTH_CODES
             | TRANSIENT_CODES | QUOTA_IF_MESSAGE]
    code, msg = known[0] if known else (parts[0] if parts else ("", ""))
    msg = msg or (str(getattr(exc, "message", "") or exc).splitlines() or [type(exc).__name__])[0]
    text = f"{what}: {code}: {msg}" if code else f"{what}: {msg}"
    if code in CAPACITY_CODES:
        return CapacityError(text, "Another zone or region may have capacity.", code=code)
    if code in QUOTA_CODES or (code in QUOTA_IF_MESSAGE and "quota" in msg.lower()):
        return QuotaError(text, "Another region may have room, or ask for a higher quota "
                                "(Azure portal: Subscriptions > Usage + quotas, the size's "
                                "family vCPUs and 'Total Regional (Spot) vCPUs').", code=code)
    if code in AUTH_CODES:
        return AuthError(text, AUTH_HINT, code=code)
    if code in TRANSIENT_CODES:
        return TransientError(text, "Azure is throttling or had a passing fault; run it again "
                                    "in a minute.", code=code)
    if isinstance(exc, ClientAuthenticationError):   # no token could be had: ARM was not reached
        return NoCredentials(f"{what}: no usable Azure credentials ({_first_line(exc)}).",
                         AUTH_HINT, code=code or type(exc).__name__)
    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        return TransientError(f"{what}: could not reach Azure Resource Manager "
                              f"({_first_line(exc)}).",
                              f"Check the network connection (and {ENDPOINT_ENV} / {CA_ENV} if "
                              "set), then run it again.", code=type(exc).__name__)
    return ProviderError(text, "", code=code or type(exc).__name__)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def is_not_found(err: BaseException) -> bool:
    return code_of(err) in ("ResourceNotFound", "ResourceGroupNotFound", "NotFound",
                            "ResourceNotFoundError")


# --- credentials and clients ------------------------------------------------------------------------

class StaticToken:
    """A TokenCredential that hands out one bearer token (``CLOUDTRAIN_AZURE_ACCESS_TOKEN``)."""

    def __init__(self, token: str, lifetime: float = 3600.0) -> None:
        self.token = token
        self.expires_on = int(time.time() + lifetime)

    def get_token(self, *scopes: str, **kwargs: Any) -> Any:
        from azure.core.credentials import AccessToken

        return AccessToken(self.token, self.expires_on)


def default_subscription() -> str | None:
    """The subscription from the environment, else the Azure CLI's default one."""
    for var in SUBSCRIPTION_ENVS:
        v = os.environ.get(var, "").strip()
        if v:
            return v
    folder = Path(os.environ.get("AZURE_CONFIG_DIR") or Path.home() / ".azure").expanduser()
    try:
        profile = json.loads((folder / "azureProfile.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None
    for s in profile.get("subscriptions", []) if isinstance(profile, dict) else []:
        if s.get("isDefault") and s.get("id"):
            return str(s["id"])
    return None


class Clients:
    """The three ARM clients of one subscription."""

    def __init__(self, subscription_id: str, resource: Any, network: Any, compute: Any) -> None:
        self.subscription_id = subscription_id
        self.resource = resource
        self.network = network
        self.compute = compute


class AzureClients:
    """Makes (once per subscription, shared by threads) the SDK's ResourceManagementClient,
    NetworkManagementClient and ComputeManagementClient. Everything not given comes from the
    environment (see the module's docstring); ``credential`` defaults to
    ``DefaultAzureCredential``. ``client_kwargs`` go to each client (e.g. ``retry_total``)."""

    def __init__(self, *, credential: Any = None, endpoint: str | None = None,
                 ca_bundle: str | None = None, scope: str | None = None,
                 polling_interval: float | None = None, **client_kwargs: Any) -> None:
        self._credential = credential
        self.endpoint = (endpoint or os.environ.get(ENDPOINT_ENV, "").strip()
                         or DEFAULT_ENDPOINT).rstrip("/")
        self.ca_bundle = ca_bundle or os.environ.get(CA_ENV, "").strip() or None
        self.scope = scope or os.environ.get(SCOPE_ENV, "").strip() or f"{self.endpoint}/.default"
        if polling_interval is None:
            try:
                polling_interval = float(os.environ.get(POLL_ENV, "") or 5)
            except ValueError:
                polling_interval = 5.0
        self.polling_interval = polling_interval
        self.client_kwargs = client_kwargs
        self._lock = threading.Lock()
        self._clients: dict[str, Clients] = {}

    def credential(self) -> Any:
        if self._credential is None:
            token = os.environ.get(TOKEN_ENV, "").strip()
            if token:
                self._credential = StaticToken(token)
            else:
                try:
                    from azure.identity import DefaultAzureCredential
                except ImportError:
                    raise MissingSDK("azure", "azure.identity") from None
                self._credential = DefaultAzureCredential()
        return self._credential

    def _kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"base_url": self.endpoint, "credential_scopes": [self.scope],
                              "polling_interval": self.polling_interval,
                              "connection_timeout": 30, "read_timeout": 120}
        if self.ca_bundle:
            if not Path(self.ca_bundle).is_file():
                raise UserError(f"{CA_ENV} names {self.ca_bundle}, which is not a file.",
                                "Give the PEM file of the CA that signed the endpoint's certificate.")
            kw["connection_verify"] = self.ca_bundle
        kw.update(self.client_kwargs)
        return kw

    def get(self, subscription_id: str) -> Clients:
        with self._lock:
            c = self._clients.get(subscription_id)
            if c is None:
                try:
                    from azure.mgmt.compute import ComputeManagementClient
                    from azure.mgmt.network import NetworkManagementClient
                    from azure.mgmt.resource.resources import ResourceManagementClient
                except ImportError as exc:
                    raise MissingSDK("azure", exc.name or "azure.mgmt") from None
                cred, kw = self.credential(), self._kwargs()
                c = Clients(subscription_id,
                            ResourceManagementClient(cred, subscription_id, **kw),
                            NetworkManagementClient(cred, subscription_id, **kw),
                            ComputeManagementClient(cred, subscription_id, **kw))
                self._clients[subscription_id] = c
            return c

    def default_subscription(self) -> str | None:
        return default_subscription()


# --- calls ------------------------------------------------------------------------------------------

class Api:
    """Calls ARM through one subscription's clients: typed errors, transient faults retried
    with exponential backoff (``retries`` tries, delays capped at ``max_delay`` s, jittered).
    ``lro`` waits for a long-running operation (PUT/DELETE) and returns its result; a retried
    PUT is safe (ARM's PUT is idempotent by name)."""

    def __init__(self, clients: Clients, *, sleep: Callable[[float], None] = time.sleep,
                 retries: int = 5, base_delay: float = 2.0, max_delay: float = 30.0) -> None:
        self.c = clients
        self.sleep = sleep
        self.retries = retries
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.delays: list[float] = []

    @property
    def subscription_id(self) -> str:
        return self.c.subscription_id

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._run(what, lambda: fn(*args, **kwargs))

    def lro(self, what: str, begin: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._run(what, lambda: begin(*args, **kwargs).result())

    def rest(self, what: str, method: str, path: str, body: Any = None) -> Any:
        """A plain ARM request (what the three SDK clients have no operation for, e.g.
        ``Microsoft.Authorization``): ``path`` relative to the endpoint, with its
        ``api-version``; the JSON answer (None when empty). Errors as for every call."""
        from azure.core.exceptions import HttpResponseError
        from azure.core.rest import HttpRequest

        def once() -> Any:
            req = HttpRequest(method, path, json=body) if body is not None \
                else HttpRequest(method, path)
            resp = self.c.resource.send_request(req)
            if resp.status_code >= 400:
                raise HttpResponseError(response=resp)
            return resp.json() if resp.content else None

        return self._run(what, once)

    def items(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Every item of a paged list (the pages are fetched inside the retry)."""
        return self._run(what, lambda: list(fn(*args, **kwargs)))

    def _run(self, what: str, thunk: Callable[[], Any]) -> Any:
        from azure.core.exceptions import AzureError

        for attempt in range(self.retries):
            try:
                return thunk()
            except AzureError as exc:
                err = classify(exc, what)
                if not isinstance(err, TransientError) or attempt + 1 == self.retries:
                    raise err from exc
                delay = min(self.max_delay, self.base_delay * 2 ** attempt)
                delay *= 0.5 + random.random() / 2
                self.delays.append(delay)
                self.sleep(delay)
        raise AssertionError("unreachable")


def as_dict(model: Any) -> dict[str, Any]:
    """An SDK model as the REST JSON it came from."""
    if model is None:
        return {}
    if isinstance(model, dict):
        return model
    fn = getattr(model, "as_dict", None)
    return dict(fn()) if callable(fn) else dict(model)


AUTHZ_API = "2022-04-01"   # Microsoft.Authorization role assignments


@dataclass(frozen=True)
class RoleAssignment:
    """A role (its definition id) for an identity (``principal``) at ``scope``; the
    ``description`` marks the assignments cloudtrain made, to find them again."""

    principal: str
    role: str
    scope: str
    description: str | None = None


def assign_role(api: Api, grant: RoleAssignment, what: str, *,
                sleep: Callable[[float], None], tries: int = 12,
                denied: Callable[[ProviderError], Exception] | None = None) -> None:
    """Make the assignment ``grant``: one named from the principal, role and scope, so a
    repeated ``up`` writes the same one. A brand-new identity may not have reached Azure AD's
    replicas yet (``PrincipalNotFound``): retried with backoff. ``denied`` turns ARM's refusal
    (``AuthorizationFailed``) into the caller's own error."""
    scope = grant.scope
    name = uuid.uuid5(uuid.NAMESPACE_URL, f"{grant.principal}|{grant.role}|{scope.lower()}")
    props = {"roleDefinitionId": f"/subscriptions/{api.subscription_id}/providers/"
                                 f"Microsoft.Authorization/roleDefinitions/{grant.role}",
             "principalId": grant.principal, "principalType": "ServicePrincipal"}
    if grant.description is not None:
        props["description"] = grant.description
    for attempt in range(tries):
        try:
            api.rest(what, "PUT", f"{scope}/providers/Microsoft.Authorization/roleAssignments/"
                                  f"{name}?api-version={AUTHZ_API}", {"properties": props})
            return
        except ProviderError as exc:
            code = code_of(exc)
            if code == "RoleAssignmentExists":
                return
            if denied is not None and code in ("AuthorizationFailed", "LinkedAuthorizationFailed"):
                raise denied(exc) from None
            if code != "PrincipalNotFound" or attempt + 1 == tries:
                raise
            sleep(min(10.0, 1.0 * 2 ** attempt))
