"""Where AWS launches: what the placement step (``cloudtrain/pipeline/place.py``) asks of
AWS to turn the ranked catalog offers into targets (the
:class:`~cloudtrain.provider.Places` protocol). The ranking is the step's; the launch in a
target's zones is :mod:`.provider`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloudtrain.provider import ClusterRequest, Target
from cloudtrain.provider.cloud import CloudProvider

if TYPE_CHECKING:
    from cloudtrain.provider import Offer

    from .api import ClientFactory


class AWSPlacement(CloudProvider):
    """AWS's placement rules; :class:`~.provider.AWSProvider` is built on them."""

    clients: ClientFactory

    def _default_region(self) -> str:
        return self.clients.default_region()

    def wanted_regions(self, request: ClusterRequest, region: str | None) -> list[str]:
        """[]: the ranking is narrowed to the task's region (when it gives one) instead."""
        return []

    def unlisted_targets(self, request: ClusterRequest, region: str | None,
                         offers: list[Offer]) -> list[Target]:
        """A type the catalog does not list (there) still runs, at no known price: in the
        task's region, else the default one."""
        res = request.resources
        itype = (res.instance_type or "").lower()
        known = any(o.instance_type.lower() == itype and region in (None, o.region)
                    for o in offers)
        if itype and res.accelerators is None and not known:
            return [Target(self.name, region or self._default_region(), str(res.instance_type),
                           None)]
        return []
