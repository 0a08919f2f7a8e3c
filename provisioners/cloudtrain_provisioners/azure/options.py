"""``resources.azure`` in a task file: what the Azure provider lets a user choose beyond the
common resources (region, zone, accelerators, instance_type, use_spot, disk_size_gb, image,
ports, ssh_cidr)."""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_REGION_RE = re.compile(r"^[a-z][a-z0-9]{2,40}$")
_UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
ZONES = ("1", "2", "3")


class AzureOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    subscription_id: str | None = Field(
        None, description="Subscription to create the cluster in (default: AZURE_SUBSCRIPTION_ID, "
                          "else the Azure CLI's default subscription).")
    regions: list[str] = Field(
        default_factory=list,
        description="Regions to try, in this order, when resources.region is not given "
                    "(default: every region the catalog prices the size in, cheapest first).")
    zones: list[str] = Field(
        default_factory=list,
        description="Availability zones to try, in this order (default: the zones where the "
                    "subscription may use the size, from the Resource SKUs API; none in a "
                    "region without zones).")
    ssh_user: str = Field("azureuser", description="The VM's admin user (SSH key only).")
    public_ip: bool = Field(
        True, description="Give each node a Standard static public IP and reach it there "
                          "(false: reach nodes at their private address, e.g. over a VPN).")
    vnet_cidr: str = Field("10.42.0.0/16", description="Address space of the cluster's VNet; "
                                                       "its subnet is the first /20 of it.")
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

    @field_validator("subscription_id")
    @classmethod
    def _sub(cls, v: str | None) -> str | None:
        if v is not None and not _UUID_RE.match(v):
            raise ValueError(f"'{v}' is not a subscription id; write e.g. "
                             "00000000-0000-0000-0000-000000000000")
        return v

    @field_validator("regions")
    @classmethod
    def _regions(cls, v: list[str]) -> list[str]:
        for r in v:
            if not _REGION_RE.match(r):
                raise ValueError(f"'{r}' is not an Azure region name; write e.g. eastus")
        if len(set(v)) != len(v):
            raise ValueError("a region is listed twice")
        return v

    @field_validator("zones")
    @classmethod
    def _zones(cls, v: list[str]) -> list[str]:
        for z in v:
            if z not in ZONES:
                raise ValueError(f"'{z}' is not an availability zone; write 1, 2 or 3")
        if len(set(v)) != len(v):
            raise ValueError("a zone is listed twice")
        return v

    @field_validator("ssh_user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", v) or v in ("root", "admin", "administrator"):
            raise ValueError(f"'{v}' cannot be an Azure VM admin user; write e.g. azureuser")
        return v

    @field_validator("vnet_cidr")
    @classmethod
    def _cidr(cls, v: str) -> str:
        try:
            net = ipaddress.ip_network(v, strict=True)
        except ValueError:
            raise ValueError(f"'{v}' is not an address range; write e.g. 10.42.0.0/16") from None
        if net.version != 4 or not net.is_private or net.prefixlen > 20:
            raise ValueError(f"'{v}' must be a private IPv4 range of /20 or larger")
        return str(net)
