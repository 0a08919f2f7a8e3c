"""Are a cloud's credentials configured on this machine? Answered from environment variables
and the standard credential files only: no SDK is imported and nothing is sent anywhere, so
the answer is a cheap "probably yes" (the provider's own calls give the final word).

Used by the planner to choose among clouds when a task names no provider.
"""

from __future__ import annotations

import os
from pathlib import Path

# What to set up, per cloud, when its credentials are missing.
HOW_TO = {
    "aws": "run 'aws configure' (or 'aws sso login'), or set AWS_ACCESS_KEY_ID and "
           "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
    "gcp": "run 'gcloud auth application-default login', or set GOOGLE_APPLICATION_CREDENTIALS "
           "to a service-account key file",
    "azure": "run 'az login', or set AZURE_CLIENT_ID with AZURE_CLIENT_SECRET (or "
             "AZURE_CLIENT_CERTIFICATE_PATH) and AZURE_TENANT_ID",
}


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def _home() -> Path:
    return Path(os.environ.get("HOME") or Path.home())


def _is_file(p: str | Path) -> bool:
    try:
        return Path(p).expanduser().is_file()
    except OSError:
        return False


def _any_file(folder: Path, pattern: str) -> bool:
    try:
        return any(p.is_file() for p in folder.glob(pattern))
    except OSError:
        return False


def _aws() -> bool:
    if _env("AWS_ACCESS_KEY_ID") and _env("AWS_SECRET_ACCESS_KEY"):
        return True
    if _env("AWS_PROFILE") or _env("AWS_DEFAULT_PROFILE"):
        return True
    if _env("AWS_WEB_IDENTITY_TOKEN_FILE") and _is_file(_env("AWS_WEB_IDENTITY_TOKEN_FILE")):
        return True
    if _env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or _env("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return True
    aws_dir = _home() / ".aws"
    files = [_env("AWS_SHARED_CREDENTIALS_FILE") or aws_dir / "credentials",
             _env("AWS_CONFIG_FILE") or aws_dir / "config"]
    if any(_is_file(f) for f in files):
        return True
    return _any_file(aws_dir / "sso" / "cache", "*.json")


def _gcp() -> bool:
    key = _env("GOOGLE_APPLICATION_CREDENTIALS")
    if key and _is_file(key):
        return True
    folders = [Path(_env("CLOUDSDK_CONFIG")).expanduser()] if _env("CLOUDSDK_CONFIG") else []
    folders.append(_home() / ".config" / "gcloud")
    return any(_is_file(f / "application_default_credentials.json") for f in folders)


def _azure() -> bool:
    if _env("CLOUDTRAIN_AZURE_ACCESS_TOKEN"):   # the azure provider uses it as is
        return True
    if _env("AZURE_CLIENT_ID") and (_env("AZURE_CLIENT_SECRET")
                                    or _env("AZURE_CLIENT_CERTIFICATE_PATH")
                                    or _env("AZURE_FEDERATED_TOKEN_FILE")):
        return True
    folder = Path(_env("AZURE_CONFIG_DIR")).expanduser() if _env("AZURE_CONFIG_DIR") \
        else _home() / ".azure"
    return _any_file(folder, "msal_token_cache.*")


_CHECKS = {"aws": _aws, "gcp": _gcp, "azure": _azure}


def present(provider: str) -> bool:
    """True when ``provider``'s credentials look configured. Providers that need none of
    their own (local, ssh) and providers this module does not know are taken as present:
    their own check decides."""
    check = _CHECKS.get(provider)
    return True if check is None else check()


def how_to(provider: str) -> str:
    return HOW_TO.get(provider, f"configure {provider}'s credentials")
