"""``resources.azure`` in a task file: what the Azure provider lets a user choose beyond the
common resources (region, zone, accelerators, instance_type, use_spot, disk_size_gb, image,
ports, ssh_cidr)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from cloudtrain_provisioners.optcheck import form, names, private_ipv4, user

ZONES = ("1", "2", "3")

# The options' checks (optcheck).
SubscriptionId = Annotated[str | None, form(
    re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
    "'{}' is not a subscription id; write e.g. 00000000-0000-0000-0000-000000000000")]
Regions = Annotated[list[str], names(re.compile(r"[a-z][a-z0-9]{2,40}"),
                                     "'{}' is not an Azure region name; write e.g. eastus",
                                     twice="a region is listed twice")]
Zones = Annotated[list[str], names(re.compile("|".join(ZONES)),
                                   "'{}' is not an availability zone; write 1, 2 or 3",
                                   twice="a zone is listed twice")]
AdminUser = Annotated[str, user("'{}' cannot be an Azure VM admin user; write e.g. azureuser",
                                forbidden=("root", "admin", "administrator"))]
VnetRange = Annotated[str, private_ipv4(20, "'{}' is not an address range; write e.g. 10.42.0.0/16",
                                        "'{}' must be a private IPv4 range of /20 or larger")]


class AzureOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    subscription_id: SubscriptionId = Field(
        None, description="Subscription to create the cluster in (default: AZURE_SUBSCRIPTION_ID, "
                          "else the Azure CLI's default subscription).")
    regions: Regions = Field(
        default_factory=list,
        description="Regions to try, in this order, when resources.region is not given "
                    "(default: every region the catalog prices the size in, cheapest first).")
    zones: Zones = Field(
        default_factory=list,
        description="Availability zones to try, in this order (default: the zones where the "
                    "subscription may use the size, from the Resource SKUs API; none in a "
                    "region without zones).")
    ssh_user: AdminUser = Field("azureuser", description="The VM's admin user (SSH key only).")
    public_ip: bool = Field(
        True, description="Give each node a Standard static public IP and reach it there "
                          "(false: reach nodes at their private address, e.g. over a VPN).")
    vnet_cidr: VnetRange = Field("10.42.0.0/16", description="Address space of the cluster's "
                                                           "VNet; its subnet is the first /20 of it.")
    spot_max_price: float | None = Field(
        None, gt=0, description="Highest spot price per node-hour in USD (default: up to the "
                                "on-demand price, Azure's -1).")
    accelerated_networking: bool = Field(
        True, description="Enable accelerated networking on each NIC where the size supports "
                          "it (false: never).")
    self_stop: bool = Field(
        True, description="Give each VM a managed identity with the Virtual Machine "
                          "Contributor role on the cluster's own resource group, so the node "
                          "guard can deallocate it (needs the right to create role "
                          "assignments; false: no identity, and the cluster stops billing "
                          "only when 'cloudtrain down' runs).")
