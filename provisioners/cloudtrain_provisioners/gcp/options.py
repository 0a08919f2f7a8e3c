"""``resources.gcp`` in a task file: what the GCP provider lets a user choose beyond the
common resources (region, zone, accelerators, instance_type, use_spot, disk_size_gb, image,
ports, ssh_cidr)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from cloudtrain_provisioners.optcheck import names, user

REGION_RE = re.compile(r"^[a-z]+-[a-z]+\d+$")
ZONE_RE = re.compile(r"^([a-z]+-[a-z]+\d+)-[a-z]$")

# The options' checks (optcheck).
Regions = Annotated[list[str], names(REGION_RE, "'{}' is not a GCP region name; write e.g. "
                                                "us-central1", twice="a region is listed twice")]
Zones = Annotated[list[str], names(ZONE_RE, "'{}' is not a GCP zone name; write e.g. us-central1-a",
                                   twice="a zone is listed twice")]
User = Annotated[str, user("write a Linux user name, e.g. cloudtrain")]


class GCPOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    project: str | None = Field(
        None, description="Project ID (default: CLOUDTRAIN_GCP_PROJECT, GOOGLE_CLOUD_PROJECT or "
                          "CLOUDSDK_CORE_PROJECT, else the credentials' project).")
    credentials_file: str | None = Field(
        None, description="A service-account key file (default: Application Default "
                          "Credentials, e.g. GOOGLE_APPLICATION_CREDENTIALS or "
                          "'gcloud auth application-default login').")
    regions: Regions = Field(
        default_factory=list,
        description="Regions to try, in this order, when resources.region is not given "
                    "(default: every region the catalog prices the machine in, cheapest first).")
    zones: Zones = Field(
        default_factory=list,
        description="Zones to try, in this order (default: the zones the catalog lists for the "
                    "offer, else every zone of the region).")
    network: str | None = Field(
        None, description="VPC network for the nodes and firewall rules (default: a network of "
                          "the cluster's own, created with it and deleted at teardown). A named "
                          "network is refused when a firewall rule on it admits more than "
                          "cloudtrain's rules would (the 'default' network's default-allow-ssh "
                          "and default-allow-internal do).")
    subnetwork: str | None = Field(
        None, description="Subnetwork (name in the node's region, or a path); needed for "
                          "custom-mode networks.")
    image_project: str = Field("deeplearning-platform-release",
                               description="Project of image families (resources.image or "
                                           "image_family).")
    image_family: str | None = Field(
        None, description="Image family to boot (default: the newest Deep Learning VM PyTorch "
                          "family).")
    disk_type: str | None = Field(
        None, description="Boot disk type (default: pd-balanced; hyperdisk-balanced where the "
                          "machine type needs it).")
    ssh_user: User = Field("cloudtrain", description="Login user the SSH key is given to "
                                                    "(created by the guest environment).")
    public_ip: bool = Field(
        True, description="Give nodes an external address and reach them there (false: reach "
                          "them at their internal address, e.g. over a VPN).")
    service_account: str | None = Field(
        None, description="Service account email for the nodes (default: none, so the nodes "
                          "hold no Google credentials).")
    host_key_wait: float = Field(
        120.0, ge=0, le=900,
        description="Seconds to wait for each new node's SSH host keys in its guest attributes "
                    "(published by the guest agent), to pin them before the first connection "
                    "(0: learn the key on first contact instead).")
    install_nvidia_driver: bool = Field(
        True, description="Ask Deep Learning VM images to install the NVIDIA driver on first "
                          "boot where the image does not carry it.")
