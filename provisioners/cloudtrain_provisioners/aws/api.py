"""The boundary with EC2: the client factory, error classification and retries.

boto3 is imported here, lazily, by :class:`BotoClients` only: loading the provider class (as
``cloudtrain status`` may) imports no SDK. Tests hand the provider any object with the same
two methods (moto's clients, or a client wrapped to model what moto lacks).

Every call goes through :meth:`Api.call`, which turns botocore's exceptions into cloudtrain's
typed errors (capacity: another zone may help; quota: another region may; auth: stop at once;
transient: retried here with exponential backoff) so the failover logic never looks at an
AWS error code itself.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

from cloudtrain.errors import (AuthError, CapacityError, NoCredentials, ProviderError, QuotaError,
                               TransientError)

# --- which AWS error means what -----------------------------------------------------------

CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientCapacity",
    "InsufficientReservedInstanceCapacity", "InsufficientCapacityOnHost", "Unsupported",
    "InsufficientFreeAddressesInSubnet", "SpotMaxPriceTooLow",
})
"""No room for this shape in this zone right now (or the zone does not sell it)."""

QUOTA_CODES = frozenset({
    "VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded",
    "PendingVerification", "SecurityGroupLimitExceeded", "KeyPairLimitExceeded",
    "VolumeLimitExceeded", "MaxIOPSLimitExceeded", "AddressLimitExceeded", "OptInRequired",
    "PlacementGroupLimitExceeded", "ResourceLimitExceeded",
})
"""An account limit of this region (or a region the account has not enabled)."""

AUTH_CODES = frozenset({
    "AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch",
    "ExpiredToken", "ExpiredTokenException", "AccessDenied", "AccessDeniedException",
    "InvalidAccessKeyId", "MissingAuthenticationToken", "Blocked", "RequestExpired",
})
"""Credentials missing, expired or without the permission: nothing else will work."""

TRANSIENT_CODES = frozenset({
    "RequestLimitExceeded", "Throttling", "ThrottlingException", "InternalError",
    "InternalFailure", "ServiceUnavailable", "Unavailable", "RequestTimeout",
    "RequestTimeoutException", "PriorRequestNotComplete", "EC2ThrottledException",
})
"""Throttling or a passing fault on AWS's side: retry with backoff."""

AUTH_HINT = ("Check the AWS credentials cloudtrain uses (the standard chain: AWS_PROFILE, "
             "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws/config, SSO: 'aws sso login') and "
             "that they may call the EC2 actions listed in docs/aws.md.")


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _message(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Message", "")) or str(exc)
    return str(exc)


def classify(exc: BaseException, what: str) -> ProviderError:
    """The typed error for a botocore exception raised by ``what`` (e.g. "RunInstances in
    us-east-1a"). The AWS error code is its ``code``."""
    from botocore.exceptions import (ClientError, ConnectionClosedError, ConnectTimeoutError,
                                     CredentialRetrievalError, EndpointConnectionError,
                                     NoCredentialsError, NoRegionError, PartialCredentialsError,
                                     ProfileNotFound, ReadTimeoutError)

    code = error_code(exc)
    msg = _message(exc)
    cls: type[ProviderError] = ProviderError
    if isinstance(exc, ClientError):
        text, hint = f"{what}: {code}: {msg}", ""
        if code in CAPACITY_CODES:
            cls, hint = CapacityError, "Another zone or region may have capacity."
        elif code in QUOTA_CODES:
            cls, hint = QuotaError, ("Another region may have room, or ask AWS for a higher "
                                     "quota (Service Quotas console, 'EC2 Running On-Demand/Spot "
                                     "... instances' vCPU limits).")
        elif code in AUTH_CODES:
            cls, hint = AuthError, AUTH_HINT
        elif code in TRANSIENT_CODES:
            cls, hint = TransientError, ("AWS is throttling or had a passing fault; run it "
                                         "again in a minute.")
        return cls(text, hint, code=code)
    code = type(exc).__name__
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, ProfileNotFound,
                        CredentialRetrievalError)) or code in (
            "SSOTokenLoadError", "UnauthorizedSSOTokenError", "TokenRetrievalError"):
        # none found at all: no call reached AWS (an expired token may follow calls that did)
        none = isinstance(exc, (NoCredentialsError, PartialCredentialsError, ProfileNotFound))
        cls = NoCredentials if none else AuthError
        return cls(f"{what}: no usable AWS credentials ({exc}).",
                   "Run 'aws configure' (or 'aws sso login'), or set AWS_PROFILE or "
                   "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.", code=code)
    if isinstance(exc, NoRegionError):
        return ProviderError(f"{what}: no AWS region is configured.",
                             "Set resources.region in the task, or AWS_DEFAULT_REGION.",
                             code=code)
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError,
                        ConnectionClosedError)):
        return TransientError(f"{what}: could not reach AWS ({exc}).",
                              "Check the network connection and run it again.", code=code)
    return ProviderError(f"{what}: {exc}", "", code=code)


# --- clients ------------------------------------------------------------------------------

class ClientFactory(Protocol):
    """What the provider needs from boto3: an EC2 client per region, and the region to use
    when the task names none."""

    def ec2(self, region: str) -> Any: ...

    def default_region(self) -> str: ...


@runtime_checkable
class HasIam(Protocol):
    """A factory that also makes an IAM client (IAM is global: one client). Needed only
    when cloudtrain mints the nodes' identity (``ClusterRequest.buckets``)."""

    def iam(self) -> Any: ...


class BotoClients:
    """The real factory: one boto3 session (the standard credential chain: env, profile, SSO,
    instance role), one client per region, created once and shared by threads (clients are
    thread-safe; sessions are not, hence the lock). ``AWS_ENDPOINT_URL`` is honoured by
    botocore itself."""

    def __init__(self, profile: str | None = None) -> None:
        self.profile = profile
        self._lock = threading.Lock()
        self._session: Any = None
        self._clients: dict[str, Any] = {}

    def _get_session(self) -> Any:
        if self._session is None:
            import boto3

            self._session = boto3.session.Session(profile_name=self.profile)
        return self._session

    def ec2(self, region: str) -> Any:
        with self._lock:
            client = self._clients.get(region)
            if client is None:
                from botocore.config import Config

                cfg = Config(retries={"mode": "standard", "total_max_attempts": 3},
                             max_pool_connections=32, connect_timeout=10, read_timeout=60)
                client = self._get_session().client("ec2", region_name=region, config=cfg)
                self._clients[region] = client
            return client

    def iam(self) -> Any:
        with self._lock:
            client = self._clients.get(" iam")
            if client is None:
                from botocore.config import Config

                cfg = Config(retries={"mode": "standard", "total_max_attempts": 3},
                             connect_timeout=10, read_timeout=60)
                client = self._get_session().client("iam", config=cfg)
                self._clients[" iam"] = client
            return client

    def default_region(self) -> str:
        with self._lock:
            try:
                region = self._get_session().region_name
            except Exception:  # noqa: BLE001 - a broken profile is reported by the first call
                region = None
        return region or "us-east-1"


# --- calls --------------------------------------------------------------------------------

class Api:
    """Calls EC2 through the factory: typed errors, and throttling retried with exponential
    backoff (``retries`` tries, delays capped at ``max_delay`` seconds, with jitter)."""

    def __init__(self, clients: ClientFactory, *, sleep: Callable[[float], None] = time.sleep,
                 retries: int = 6, base_delay: float = 1.0, max_delay: float = 20.0) -> None:
        self.clients = clients
        self.sleep = sleep
        self.retries = retries
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.delays: list[float] = []
        """Backoff delays slept so far (read by tests and the benchmark)."""

    def call(self, region: str, op: str, where: str = "", **params: Any) -> Any:
        what = f"{_op_name(op)} in {where or region}"
        for attempt in range(self.retries):
            try:
                return getattr(self.client(region), op)(**params)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not _is_botocore(exc):
                    raise
                err = classify(exc, what)
                if not isinstance(err, TransientError) or attempt + 1 == self.retries:
                    raise err from exc
                delay = min(self.max_delay, self.base_delay * 2 ** attempt)
                delay *= 0.5 + random.random() / 2
                self.delays.append(delay)
                self.sleep(delay)
        raise AssertionError("unreachable")

    def client(self, region: str) -> Any:
        return self.clients.ec2(region)

    def pages(self, region: str, op: str, key: str, **params: Any) -> Iterator[Any]:
        """Every item under ``key`` of every page (NextToken followed)."""
        token = None
        while True:
            kw = dict(params)
            if token:
                kw["NextToken"] = token
            page = self.call(region, op, **kw)
            yield from page.get(key, [])
            token = page.get("NextToken")
            if not token:
                return


class IamApi(Api):
    """The same typed errors and backoff for IAM calls (``region`` only names the place in
    messages: IAM is global)."""

    def client(self, region: str) -> Any:
        if not isinstance(self.clients, HasIam):
            raise ProviderError("This AWS client factory makes no IAM client (needed for the "
                                "nodes' identity on buckets).")
        return self.clients.iam()

    def pages(self, region: str, op: str, key: str, **params: Any) -> Iterator[Any]:
        """IAM pages with Marker/IsTruncated instead of NextToken."""
        marker = None
        while True:
            kw = dict(params)
            if marker:
                kw["Marker"] = marker
            page = self.call(region, op, **kw)
            yield from page.get(key, [])
            marker = page.get("Marker") if page.get("IsTruncated") else None
            if not marker:
                return


def _op_name(op: str) -> str:
    return "".join(p.capitalize() for p in op.split("_"))


def _is_botocore(exc: BaseException) -> bool:
    mod = type(exc).__module__ or ""
    return mod.startswith("botocore") or hasattr(exc, "response") and isinstance(
        getattr(exc, "response", None), dict)
