"""The ``gcp`` provider: Compute Engine instances behind the cluster's own firewall rules,
found again by label.

Install with ``pip install 'cloudtrain[gcp]'``. Credentials: Application Default Credentials
(``gcloud auth application-default login``, GOOGLE_APPLICATION_CREDENTIALS, the metadata
server) or a service-account key file (``resources.gcp.credentials_file``); the project from
the task (``resources.gcp.project``) or the environment. ``CLOUDTRAIN_GCP_API_ENDPOINT``
points the clients at another endpoint (a private one, or a test fake). google-cloud-compute
is imported only when the provider first calls GCP.

Modules: ``provider`` (the contract, placement and failover), ``api`` (client factory,
error classification, retries, operation waits), ``network`` (firewall rules), ``images``
(machine shapes, GPUs, Deep Learning VM images), ``instances`` (insert bodies, launch,
wait), ``teardown`` (removal by label, gc), ``tags`` (the marks: labels and descriptions), ``options``
(``resources.gcp``). See docs/gcp.md.
"""

from __future__ import annotations

from .options import GCPOptions
from .provider import GCPProvider

__all__ = ["GCPOptions", "GCPProvider"]
