"""``cloudtrain check gcp``: are GCP credentials found, do they work, what do they reach.

Credentials and project are found as :class:`~.api.GoogleClients` finds them for the
provider: Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud's ADC
file, or the metadata server on GCE), the project from CLOUDTRAIN_GCP_PROJECT,
GOOGLE_CLOUD_PROJECT, CLOUDSDK_CORE_PROJECT, GCLOUD_PROJECT or the credentials; the endpoint
from CLOUDTRAIN_GCP_API_ENDPOINT. One read-only call, tried once and bounded by ``timeout``
seconds: the project's zones (zones.list), which says the regions it reaches.
"""

from __future__ import annotations

import os
from pathlib import Path

from cloudtrain.errors import CloudtrainError, NoCredentials
from cloudtrain.provider import ProviderCheck

from .api import CREDENTIALS_HINT, PROJECT_ENVS, Api, GoogleClients, as_dict


def where_found() -> str:
    """Where google.auth.default looks first, in words (what ``check`` reports as found)."""
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "").strip()
    if key:
        return f"key file {key} (GOOGLE_APPLICATION_CREDENTIALS)"
    folder = os.environ.get("CLOUDSDK_CONFIG", "").strip() or str(Path.home() / ".config/gcloud")
    adc = Path(folder).expanduser() / "application_default_credentials.json"
    if adc.is_file():
        return f"gcloud ADC ({adc})"
    return "application default credentials"


def check(clients: GoogleClients, timeout: float) -> ProviderCheck:
    """What ``clients`` (the provider's default factory) find, and what they reach."""
    try:
        api = Api(clients, attempts=1)
        api.clients.client("zones")      # loads the credentials: NoCredentials when none
    except NoCredentials as exc:
        detail = ("no credentials in GOOGLE_APPLICATION_CREDENTIALS, gcloud's ADC file or a "
                  "GCE metadata server" if exc.code == "credentials" else exc.message)
        return ProviderCheck("gcp", True, None, None, detail=detail,
                             fix=exc.hint or CREDENTIALS_HINT)
    found = where_found()
    try:
        project = clients.project()
    except CloudtrainError as exc:
        return ProviderCheck("gcp", True, found, False, detail=exc.message, fix=exc.hint)
    source = next((v for v in PROJECT_ENVS if os.environ.get(v, "").strip()), "")
    reaches = [f"project {project}" + (f" ({source})" if source else "")]
    try:
        zones = api.items("zones", "list", project=project, timeout=timeout, retry=None)
    except CloudtrainError as exc:
        return ProviderCheck("gcp", True, found, False, tuple(reaches), exc.message,
                             exc.hint or CREDENTIALS_HINT)
    regions = {str(as_dict(z).get("region", "")).rsplit("/", 1)[-1] for z in zones}
    reaches.append(f"{len(zones)} zones in {len(regions - {''})} regions")
    return ProviderCheck("gcp", True, found, True, tuple(reaches))
