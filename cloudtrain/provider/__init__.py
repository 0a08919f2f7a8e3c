"""The provider door: everything a provider plugin (built-in or third-party) imports from
cloudtrain, besides :mod:`cloudtrain.errors` (the typed errors: CapacityError, QuotaError,
AuthError, TransientError, UserError, ProviderError with ``code`` and ``zone``, code_of).

What is here:

- the contract (:mod:`cloudtrain.provider.contract`): the :class:`Provider` protocol, the
  request and result types (ClusterRequest, Target, NetworkRef, Node, Plan,
  ProviderContext), the placement protocol a cloud gives the placement step (Places), and
  the optional capabilities a provider may declare (HasMasterPort, HasNodeEnv,
  HasHostKeySource, ReportsAttempts, ReportsInterruptions, CollectsOrphans, MarksOwner,
  ReportsNodeHealth with NodeHealth) and BucketURL (the buckets a request's nodes use);
- for clouds, the shared base (:mod:`cloudtrain.provider.cloud`): CloudProvider, Existing;
  the words of its failover loop (:mod:`cloudtrain.provider.failover`): Attempt, Pin,
  Unavailable, outcome_of, worst; and what it is built from:
  ClusterRecord (the cluster's record file), CallerCidr (the caller's address range);
- the marks every resource carries (CLUSTER, OWNER, RANK, CREATED, SHARED_RANK,
  default_owner, owner_hash, split_owner, owner_of_cluster, now) and ``check_name``;
- host keys made here and handed to a node by cloud-init (generate_host_key,
  host_key_cloud_config), and the ssh provider's USER_KNOWN_HOSTS, host_entry_name;
- the catalog a cloud's offers come from (Offer, provider_offers, canonical_gpu) and the UI
  type (UI): loaded on first use, so that importing this package stays cheap. A provider
  never ranks offers: the placement step does, once per launch.

``registry`` (a submodule) finds providers by the ``cloudtrain.providers`` entry-point
group; a plugin registers itself there in its own packaging, as the built-in ones do in
pyproject.toml.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from cloudtrain.keys import (USER_KNOWN_HOSTS, generate_host_key, host_entry_name,
                             host_key_cloud_config)
from cloudtrain.names import check as check_name
from cloudtrain.ownership import (CLUSTER, CREATED, OWNER, RANK, SHARED_RANK, default_owner,
                                  now, owner_hash, owner_of_cluster, split_owner)
from cloudtrain.provider import fabric
from cloudtrain.provider.contract import (ChecksAccess, ClusterRequest, CollectsOrphans,
                                          HasHostKeySource,
                                          HasMasterPort, HasNodeEnv, MarksOwner, NetworkRef,
                                          Node, NodeHealth, NodeState, NodeStatus, Places,
                                          Plan, Provider, ProviderCheck, ProviderContext,
                                          ReportsAttempts,
                                          ReportsInterruptions, ReportsNodeHealth, SelfStop,
                                          SelfStops, Target)
from cloudtrain.storage.url import BucketURL, of_scheme as buckets_of_scheme

if TYPE_CHECKING:   # what the lazy names below are, for type checkers
    from cloudtrain.catalog.gpus import canonical_gpu
    from cloudtrain.catalog.load import provider_offers
    from cloudtrain.catalog.model import Offer
    from cloudtrain.provider.caller import CallerCidr, lookup_public_ip
    from cloudtrain.provider.cloud import CloudProvider, Existing
    from cloudtrain.provider.failover import Attempt, Pin, Unavailable, outcome_of, worst
    from cloudtrain.provider.record import ClusterRecord
    from cloudtrain.ui import UI

# name -> module, imported when the name is first asked for
_LAZY = {
    **dict.fromkeys(("CloudProvider", "Existing"), "cloudtrain.provider.cloud"),
    **dict.fromkeys(("Attempt", "Pin", "Unavailable", "outcome_of", "worst"),
                    "cloudtrain.provider.failover"),
    "CallerCidr": "cloudtrain.provider.caller",
    "lookup_public_ip": "cloudtrain.provider.caller",
    "ClusterRecord": "cloudtrain.provider.record",
    "UI": "cloudtrain.ui",
    "Offer": "cloudtrain.catalog.model",
    "provider_offers": "cloudtrain.catalog.load",
    "canonical_gpu": "cloudtrain.catalog.gpus",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "fabric", "CLUSTER", "CREATED", "OWNER", "RANK", "SHARED_RANK", "USER_KNOWN_HOSTS", "ChecksAccess",
    "ClusterRequest", "ProviderCheck",
    "CollectsOrphans", "HasHostKeySource", "HasMasterPort", "HasNodeEnv", "MarksOwner",
    "NetworkRef", "Node", "NodeStatus", "Places", "Plan", "Provider", "ProviderContext",
    "ReportsAttempts",
    "ReportsInterruptions", "ReportsNodeHealth", "NodeHealth", "NodeState", "BucketURL",
    "buckets_of_scheme",
    "SelfStop", "SelfStops", "check_name", "default_owner", "generate_host_key",
    "host_entry_name", "host_key_cloud_config", "now", "owner_hash", "owner_of_cluster",
    "split_owner", "Target",
    # the lazy names (_LAZY), spelled out so that checkers see them
    "Attempt", "CallerCidr", "CloudProvider", "ClusterRecord", "Existing", "Offer", "Pin", "UI",
    "Unavailable", "canonical_gpu", "lookup_public_ip", "outcome_of", "provider_offers",
    "worst",
]
