"""The provider door: everything a provider plugin (built-in or third-party) imports from
cloudtrain. ``contract`` says what each verb promises; ``registry`` finds providers by the
``cloudtrain.providers`` entry-point group."""

from cloudtrain.provider.contract import (ClusterRequest, NetworkRef, Node, Plan, Provider,
                                          ProviderContext)

__all__ = ["ClusterRequest", "NetworkRef", "Node", "Plan", "Provider", "ProviderContext"]
