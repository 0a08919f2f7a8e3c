"""Where GCP launches: what the placement step (``cloudtrain/pipeline/place.py``) asks of
GCP to turn the ranked catalog offers into targets (the
:class:`~cloudtrain.provider.Places` protocol): the regions ``resources.gcp.regions`` (or
the regions of ``resources.gcp.zones``) allow, and which GPUs are attached to the machine
(N1) rather than built in. The ranking is the step's; the launch in a target's zones is
:mod:`.provider`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cloudtrain.provider import ClusterRequest, Target
from cloudtrain.provider.cloud import CloudProvider

from . import images
from .options import ZONE_RE

if TYPE_CHECKING:
    from cloudtrain.provider import Offer

DEFAULT_REGION = "us-central1"
"""Where a machine type the catalog does not price goes when the task names no region."""


class GCPPlacement(CloudProvider):
    """GCP's placement rules; :class:`~.provider.GCPProvider` is built on them."""

    def wanted_regions(self, request: ClusterRequest, region: str | None) -> list[str]:
        """The task's region, else ``resources.gcp.regions``, else the regions of
        ``resources.gcp.zones`` ([]: any)."""
        opts = self._opts(request)
        return [region] if region else list(opts.regions) or list(dict.fromkeys(
            m.group(1) for z in opts.zones if (m := ZONE_RE.match(z))))

    def _target(self, region: str, machine_type: str, acc: Any, price: float | None = None,
                zones: tuple[str, ...] = ()) -> Target:
        """GPUs are attached to N1 machines; the other GPU machines come with theirs."""
        attach = acc.name if acc and not images.builtin_gpus(machine_type) else None
        return Target(self.name, region, machine_type, price, zones, attach,
                      acc.count if attach and acc else 0)

    def target_of(self, offer: Offer, price: float | None) -> Target:
        attach = offer.accelerator if offer.accelerator and not images.builtin_gpus(
            offer.instance_type) else None
        return Target(self.name, offer.region, offer.instance_type, price, tuple(offer.zones),
                      attach, int(offer.accelerator_count) if attach else 0)

    def unpriced_target(self, request: ClusterRequest, region: str) -> Target:
        res = request.resources
        return self._target(region, str(res.instance_type), res.accelerators)

    def unlisted_targets(self, request: ClusterRequest, region: str | None,
                         offers: list[Offer]) -> list[Target]:
        """A machine type the catalog does not price runs in :data:`DEFAULT_REGION`."""
        if request.resources.instance_type:
            return [self.unpriced_target(request, DEFAULT_REGION)]
        return []
