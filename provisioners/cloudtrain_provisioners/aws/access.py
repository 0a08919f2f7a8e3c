"""``cloudtrain check aws``: are AWS credentials found, do they work, what do they reach.

The credentials are boto3's standard chain, exactly as :class:`~.api.BotoClients` finds them
(``CLOUDTRAIN_AWS_PROFILE``, then the environment, ``AWS_PROFILE``, ``~/.aws``, SSO, an
instance role); ``AWS_ENDPOINT_URL`` is honoured by botocore itself. Two read-only calls, each
bounded by ``timeout`` seconds and tried once: STS GetCallerIdentity (the account) and EC2
DescribeRegions in the configured region (the regions the account has enabled).
"""

from __future__ import annotations

from typing import Any

from cloudtrain.errors import CloudtrainError
from cloudtrain.provider import ProviderCheck

from .api import AUTH_HINT, classify

FIX_NONE = ("Run 'aws configure' (or 'aws sso login'), or set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE.")

# botocore's names for where its credentials came from, in words
_METHODS = {
    "env": "environment (AWS_ACCESS_KEY_ID)",
    "shared-credentials-file": "~/.aws/credentials",
    "config-file": "~/.aws/config",
    "sso": "AWS SSO (~/.aws/sso/cache)",
    "assume-role": "an assumed role (profile)",
    "assume-role-with-web-identity": "web identity (AWS_WEB_IDENTITY_TOKEN_FILE)",
    "container-role": "the container's role",
    "iam-role": "the instance's role (IMDS)",
    "custom-process": "a credential_process (profile)",
}


def check(profile: str | None, timeout: float) -> ProviderCheck:
    """What the chain finds for ``profile`` (None: the default), and what it reaches."""
    import boto3
    from botocore.config import Config

    try:
        session = boto3.session.Session(profile_name=profile)
        creds = session.get_credentials()
    except Exception as exc:  # noqa: BLE001 - classified below (a missing profile, ...)
        return _failed(None, classify(exc, "finding the credentials"))
    if creds is None:
        return ProviderCheck("aws", True, None, None, detail="no credentials in boto3's chain",
                             fix=FIX_NONE)
    found = _METHODS.get(creds.method, creds.method or "boto3's chain")
    if profile:
        found += f" (profile {profile})"
    region = session.region_name or "us-east-1"
    cfg = Config(connect_timeout=timeout, read_timeout=timeout,
                 retries={"total_max_attempts": 1})
    try:
        who: Any = session.client("sts", region_name=region, config=cfg).get_caller_identity()
    except Exception as exc:  # noqa: BLE001 - classified below
        return _failed(found, classify(exc, "STS GetCallerIdentity"))
    arn = str(who.get("Arn", ""))
    reaches = [f"account {who.get('Account', '?')}"
               + (f" as {arn.split(':')[-1]}" if ":" in arn else "")]
    try:
        ec2 = session.client("ec2", region_name=region, config=cfg)
        names = sorted(r["RegionName"] for r in ec2.describe_regions()["Regions"])
    except Exception as exc:  # noqa: BLE001 - classified below
        err = classify(exc, f"EC2 DescribeRegions in {region}")
        return ProviderCheck("aws", True, found, False, tuple(reaches), err.message,
                             err.hint or AUTH_HINT)
    reaches.append(f"{len(names)} regions (default {region})")
    return ProviderCheck("aws", True, found, True, tuple(reaches))


def _failed(found: str | None, err: CloudtrainError) -> ProviderCheck:
    return ProviderCheck("aws", True, found, False if found else None, (), err.message,
                         err.hint or FIX_NONE)
