"""Where Azure launches: what the placement step (``cloudtrain/pipeline/place.py``) asks of
Azure to turn the ranked catalog offers into targets (the
:class:`~cloudtrain.provider.Places` protocol): the regions ``resources.azure.regions``
allows. The ranking is the step's; the launch in a target's zones is :mod:`.provider`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloudtrain.errors import UserError
from cloudtrain.provider import ClusterRequest, Target
from cloudtrain.provider.cloud import CloudProvider

if TYPE_CHECKING:
    from cloudtrain.provider import Offer


class AzurePlacement(CloudProvider):
    """Azure's placement rules; :class:`~.provider.AzureProvider` is built on them."""

    def wanted_regions(self, request: ClusterRequest, region: str | None) -> list[str]:
        """The task's region, else ``resources.azure.regions`` in their order ([]: any)."""
        return [region] if region else list(self._opts(request).regions)

    def unlisted_targets(self, request: ClusterRequest, region: str | None,
                         offers: list[Offer]) -> list[Target]:
        """A size the catalog prices nowhere needs a region from the task."""
        res = request.resources
        if res.instance_type and res.accelerators is None:
            raise UserError(f"The catalog prices {res.instance_type} in no region.",
                            "Give resources.region (or resources.azure.regions).")
        return []
