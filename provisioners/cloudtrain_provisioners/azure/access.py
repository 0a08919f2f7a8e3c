"""``cloudtrain check azure``: are Azure credentials found, do they work, what do they reach.

Credentials and subscription are found as :class:`~.api.AzureClients` finds them for the
provider: ``CLOUDTRAIN_AZURE_ACCESS_TOKEN`` as is, else azure-identity's
``DefaultAzureCredential`` (a service principal's AZURE_CLIENT_* variables, the Azure CLI's
login, a managed identity); the subscription from CLOUDTRAIN_AZURE_SUBSCRIPTION_ID,
AZURE_SUBSCRIPTION_ID or the Azure CLI's default; the endpoint and CA bundle from
CLOUDTRAIN_AZURE_ARM_ENDPOINT and CLOUDTRAIN_AZURE_CA_BUNDLE. One read-only call, tried
once, its connection and read each bounded by ``timeout`` seconds: the subscription's
resource groups (the first page); then the subscriptions the credential sees.
"""

from __future__ import annotations

import os
from pathlib import Path

from cloudtrain.errors import CloudtrainError
from cloudtrain.provider import ProviderCheck

from .api import AUTH_HINT, SUBSCRIPTION_ENVS, TOKEN_ENV, Api, AzureClients

SUBSCRIPTIONS_API = "2022-12-01"

FIX_NONE = ("Run 'az login', or set AZURE_CLIENT_ID, AZURE_TENANT_ID and AZURE_CLIENT_SECRET "
            "(or AZURE_CLIENT_CERTIFICATE_PATH) for a service principal.")
FIX_NO_SUBSCRIPTION = ("Set AZURE_SUBSCRIPTION_ID (or resources.azure.subscription_id in the "
                       "task), or run 'az account set --subscription ID'.")


def where_found() -> str | None:
    """Where the provider's credential comes from, in words (None: nothing found on this
    machine; a managed identity is not looked for here, since that takes a network call)."""
    if os.environ.get(TOKEN_ENV, "").strip():
        return f"a bearer token ({TOKEN_ENV})"
    env = {k: os.environ.get(k, "").strip() for k in (
        "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PATH",
        "AZURE_FEDERATED_TOKEN_FILE", "AZURE_CONFIG_DIR")}
    if env["AZURE_CLIENT_ID"] and (env["AZURE_CLIENT_SECRET"]
                                   or env["AZURE_CLIENT_CERTIFICATE_PATH"]
                                   or env["AZURE_FEDERATED_TOKEN_FILE"]):
        return "service principal (AZURE_CLIENT_ID)"
    folder = Path(env["AZURE_CONFIG_DIR"] or Path.home() / ".azure").expanduser()
    try:
        cli_login = any(p.is_file() for p in folder.glob("msal_token_cache.*"))
    except OSError:
        cli_login = False
    return f"Azure CLI login ({folder})" if cli_login else None


def check(clients: AzureClients, timeout: float) -> ProviderCheck:
    """What the provider's credential finds, and whether it may read the subscription."""
    found = where_found()
    if found is None:
        return ProviderCheck("azure", True, None, None,
                             detail="no Azure credentials found", fix=FIX_NONE)
    sub = clients.default_subscription()
    if sub is None:
        return ProviderCheck("azure", True, found, False, detail="no subscription is set",
                             fix=FIX_NO_SUBSCRIPTION)
    source = next((v for v in SUBSCRIPTION_ENVS if os.environ.get(v, "").strip()),
                  "the Azure CLI's default")
    bounded = AzureClients(credential=clients.credential(), endpoint=clients.endpoint,
                           ca_bundle=clients.ca_bundle, scope=clients.scope,
                           connection_timeout=timeout, read_timeout=timeout, retry_total=0)
    reaches = (f"subscription {sub} ({source})",)
    try:
        api = Api(bounded.get(sub), retries=1)
        groups = api.call("list resource groups", lambda: next(
            iter(api.c.resource.resource_groups.list().by_page()), []))
        n = len(list(groups))
    except CloudtrainError as exc:
        return ProviderCheck("azure", True, found, False, reaches, exc.message,
                             exc.hint or AUTH_HINT)
    more = "+" if n >= 100 else ""
    visible = subscriptions(api)
    seen = (f"{len(visible)} subscription(s) visible: {', '.join(visible[:5])}"
            + (", ..." if len(visible) > 5 else ""),) if visible else ()
    return ProviderCheck("azure", True, found, True,
                         (*reaches, f"{n}{more} resource group(s) readable", *seen))


def subscriptions(api: Api) -> list[str]:
    """The enabled subscriptions the credential sees ("name (id)"); [] where the endpoint
    does not list them (some private clouds) or the call is refused: the subscription in use
    was read already, this only adds what else is reachable."""
    try:
        answer = api.rest("list subscriptions", "GET",
                          f"/subscriptions?api-version={SUBSCRIPTIONS_API}")
    except CloudtrainError:
        return []
    subs = answer.get("value", []) if isinstance(answer, dict) else []
    return [f"{s.get('displayName') or '?'} ({s.get('subscriptionId')})" for s in subs
            if isinstance(s, dict) and s.get("state", "Enabled") == "Enabled"]
