"""Machine shapes and boot images.

GPUs: the accelerator-optimized machine types (a2, a3, a4, g2) come with their GPUs built in;
N1 machine types get theirs attached as ``guestAccelerators`` (T4, V100, P100, P4, K80: the
catalog lists these offers as an N1 host, ``host_type``, plus the GPUs). Either way the
instance must stop for host maintenance (``onHostMaintenance: TERMINATE``).

Images: by default the newest Deep Learning VM PyTorch image family found in
``deeplearning-platform-release`` (NVIDIA driver and CUDA present), tried in the order of
:data:`DLVM_FAMILIES`. ``resources.image`` overrides it: an image path
(``projects/P/global/images/NAME`` or ``.../images/family/F``, or a full URL) or a bare
family name in ``resources.gcp.image_project``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cloudtrain.errors import UserError

from .api import Api, NotFound

DLVM_PROJECT = "deeplearning-platform-release"
DLVM_FAMILIES = ("pytorch-2-9-cu129-ubuntu-2404-nvidia-580",
                 "pytorch-2-9-cu129-ubuntu-2204-nvidia-580",
                 "pytorch-2-7-cu128-ubuntu-2204-nvidia-570")
"""Deep Learning VM PyTorch families, preferred first (Ubuntu; driver in the name)."""

BUILTIN_GPU_FAMILIES = ("a2-", "a3-", "a4-", "a4x-", "g2-")
"""Machine type prefixes whose GPUs come with the machine (no guestAccelerators)."""

ATTACHED_GPUS = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100",
                 "P100": "nvidia-tesla-p100", "P4": "nvidia-tesla-p4",
                 "K80": "nvidia-tesla-k80", "L4": "nvidia-l4", "A100": "nvidia-tesla-a100",
                 "A100-80GB": "nvidia-a100-80gb", "H100": "nvidia-h100-80gb",
                 "H100-MEGA": "nvidia-h100-mega-80gb", "H200": "nvidia-h200-141gb",
                 "B200": "nvidia-b200"}
"""Canonical GPU name -> GCE accelerator type."""

_HYPERDISK_ONLY = ("a3-ultragpu", "a4-", "a4x-")


def builtin_gpus(machine_type: str) -> bool:
    return machine_type.startswith(BUILTIN_GPU_FAMILIES)


def accelerator_type(gpu: str) -> str:
    from cloudtrain.provider import canonical_gpu

    canon = canonical_gpu(gpu) or gpu
    if canon in ATTACHED_GPUS:
        return ATTACHED_GPUS[canon]
    if gpu.lower().startswith("nvidia-"):
        return gpu.lower()
    raise UserError(f"resources.accelerators: GCP has no accelerator type for '{gpu}'.",
                    "Use one of " + ", ".join(sorted(ATTACHED_GPUS)) + ", or a GCE accelerator "
                    "type name such as nvidia-tesla-t4.")


def default_disk_type(machine_type: str) -> str:
    return "hyperdisk-balanced" if machine_type.startswith(_HYPERDISK_ONLY) else "pd-balanced"


@dataclass(frozen=True)
class Image:
    self_link: str
    name: str
    family: str
    disk_gb: int
    source: str
    """The sourceImage to give in the insert (a path the API resolves)."""


_PATH = re.compile(r"(?:^|/)projects/([^/]+)/global/images/(family/)?([^/]+)$")


def describe_choice(image: str | None, image_project: str, image_family: str | None) -> str:
    """What the plan says about the image, without calling the API."""
    if image:
        return f"image {image}"
    if image_family:
        return f"image family {image_family} ({image_project})"
    return (f"the newest Deep Learning VM PyTorch image ({DLVM_FAMILIES[0]}, "
            f"{DLVM_PROJECT}; NVIDIA driver and CUDA included)")


def _from(img: dict[str, Any], source: str) -> Image:
    state = (img.get("deprecated") or {}).get("state")
    if state in ("OBSOLETE", "DELETED"):
        raise NotFound(f"image {img.get('name')} is {state.lower()}")
    return Image(img.get("selfLink", source), str(img.get("name", "")), str(img.get("family", "")),
                 int(img.get("diskSizeGb") or 10), source)


def find_image(api: Api, image: str | None, image_project: str,
               image_family: str | None) -> Image:
    """Resolve the boot image (one or two API calls)."""
    if image:
        m = _PATH.search(image)
        if m:
            project, family, name = m.groups()
        else:
            project, family, name = image_project, "family/", image
        try:
            if family:
                return _from(api.get("images", "get_from_family", project=project, family=name),
                             f"projects/{project}/global/images/family/{name}")
            return _from(api.get("images", "get", project=project, image=name),
                         f"projects/{project}/global/images/{name}")
        except NotFound:
            raise UserError(f"resources.image: no image {image} "
                            f"({'family ' if family else ''}{name} in project {project}).",
                            "Give an image path (projects/P/global/images/NAME or "
                            ".../images/family/F) or a family of resources.gcp.image_project; "
                            "leave it out for the Deep Learning VM image.") from None
    families = [image_family] if image_family else list(DLVM_FAMILIES)
    for fam in families:
        try:
            return _from(api.get("images", "get_from_family", project=image_project, family=fam),
                         f"projects/{image_project}/global/images/family/{fam}")
        except NotFound:
            continue
    raise UserError(f"No image in family {' or '.join(families)} of project {image_project}.",
                    "Set resources.gcp.image_family to a current Deep Learning VM family (see "
                    "'gcloud compute images list --project deeplearning-platform-release'), or "
                    "resources.image.")


def check_disk(image: Image, disk_gb: int) -> None:
    if disk_gb < image.disk_gb:
        raise UserError(f"resources.disk_size_gb {disk_gb} is smaller than the image "
                        f"{image.name} ({image.disk_gb} GB).",
                        f"Set disk_size_gb to at least {image.disk_gb}.")


def offered_in_zone(api: Api, project: str, zone: str, machine_type: str,
                    accelerator: str | None) -> str | None:
    """Why ``zone`` cannot run the shape (None: it can)."""
    try:
        api.get("machine_types", "get", project=project, zone=zone, machine_type=machine_type)
    except NotFound:
        return f"{machine_type} is not offered in {zone}"
    if accelerator:
        try:
            api.get("accelerator_types", "get", project=project, zone=zone,
                    accelerator_type=accelerator)
        except NotFound:
            return f"{accelerator} is not offered in {zone}"
    return None


def region_zones(api: Api, project: str, region: str) -> list[str]:
    try:
        reg = api.get("regions", "get", project=project, region=region)
    except NotFound:
        raise UserError(f"GCP has no region {region} (or project {project} cannot use it).",
                        "Check resources.region.") from None
    return sorted(z.rsplit("/", 1)[-1] for z in reg.get("zones", []))
