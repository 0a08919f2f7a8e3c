"""The ``azure`` provider: Azure VMs in a resource group of their own per cluster, found again
by tag.

Install with ``pip install 'cloudtrain[azure]'``. Credentials come from azure-identity's
``DefaultAzureCredential`` (environment, workload or managed identity, the Azure CLI's
``az login``, ...) and never leave this machine; the subscription from the task
(``resources.azure.subscription_id``), ``AZURE_SUBSCRIPTION_ID`` or the Azure CLI's default.
The Azure SDKs are imported only when the provider first calls Azure.

Modules: ``provider`` (the contract, placement and failover), ``api`` (credentials, clients,
endpoint override, error classification, retries), ``network`` (resource group, NSG rules,
VNet), ``images`` (sizes, images), ``instances`` (public IPs, NICs, VMs), ``teardown`` (removal by tag, gc),
``tags`` (tags and names), ``options`` (``resources.azure``). See docs/azure.md.
"""

from __future__ import annotations

from .options import AzureOptions
from .provider import AzureProvider

__all__ = ["AzureOptions", "AzureProvider"]
