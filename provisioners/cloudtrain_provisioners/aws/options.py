"""``resources.aws`` in a task file: what the AWS provider lets a user choose beyond the
common resources (region, zone, accelerators, instance_type, use_spot, disk_size_gb, image,
ports, ssh_cidr)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from cloudtrain_provisioners.optcheck import form, names, user

# The options' checks (optcheck): an id of the form AWS gives (its API refuses one it does
# not know), a Linux user.
VpcId = Annotated[str | None, form(re.compile(r"vpc-.*", re.DOTALL),
                                   "'{}' is not a VPC id; write e.g. vpc-0abc1234")]
SubnetIds = Annotated[list[str], names(re.compile(r"subnet-.*", re.DOTALL),
                                       "'{}' is not a subnet id; write e.g. subnet-0abc1234")]
User = Annotated[str, user("'{:.40}' is not a Linux user name; write e.g. ubuntu")]


class AWSOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    vpc_id: VpcId = Field(
        None, description="VPC for the security group and nodes (default: the region's default "
                          "VPC). Give subnet_ids with it.")
    subnet_ids: SubnetIds = Field(
        default_factory=list,
        description="Subnets to launch into, one per zone to try (default: the default VPC's "
                    "default subnet of each zone).")
    placement_group: bool = Field(
        True, description="Put a multi-node cluster in a cluster placement group where the "
                          "instance type supports one (false: never).")
    efa: bool = Field(
        False, description="Ask for EFA even where resources.network would not set it up: every "
                           "EFA interface the type takes (refused on a type without EFA; see "
                           "resources.network and docs/network.md).")
    ssh_user: User = Field("ubuntu", description="Login user of the image (the Deep Learning AMIs "
                                                 "on Ubuntu use 'ubuntu').")
    public_ip: bool = Field(
        True, description="Give nodes a public address and reach them there (false: reach "
                          "them at their private address, e.g. over a VPN).")
    spot_max_price: float | None = Field(
        None, gt=0, description="Highest spot price per node-hour in USD (default: the "
                                "on-demand price, AWS's default).")
    inject_host_key: bool = Field(
        True, description="Give each new node a host key made by cloudtrain, in its user data "
                          "(cloud-init installs it), pinned before the first connection. "
                          "false: read the node's own keys from its console output instead.")
    host_key_wait: float = Field(
        90.0, ge=0, le=900,
        description="With inject_host_key false: seconds to wait for each new node's host "
                    "keys in its console output (0: learn the key on first contact instead).")
    iam_instance_profile: str | None = Field(
        None, description="Name of an instance profile for the nodes (e.g. to read S3). "
                          "cloudtrain never copies your own credentials to a node.")
