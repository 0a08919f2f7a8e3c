"""The cluster's network boundary in one region: VPC and subnets, the security group and its
rules, the imported key pair and the cluster placement group.

The security group allows exactly: TCP 22 from the caller's range, all traffic from members
of the same group (the nodes talk to each other: NCCL, gloo, torch rendezvous), and the
task's ``ports`` from the caller's range. Nothing is open to 0.0.0.0/0 unless the user's
``ssh_cidr`` says so. ``ensure_security_group`` reconciles: it adds missing rules and revokes
any others, so the group matches the task after every ``up``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cloudtrain.errors import ProviderError, UserError, code_of

from . import tags
from .api import Api

# --- security group rules -----------------------------------------------------------------

@dataclass(frozen=True, order=True)
class Rule:
    """One ingress rule. ``source`` is a CIDR, or "self" (members of the same group)."""

    protocol: str          # "tcp" or "-1" (all)
    from_port: int | None
    to_port: int | None
    source: str
    description: str = field(default="", compare=False)

    def text(self) -> str:
        what = "all traffic" if self.protocol == "-1" else (
            f"tcp {self.from_port}" if self.from_port == self.to_port
            else f"tcp {self.from_port}-{self.to_port}")
        src = "members of the same group" if self.source == "self" else self.source
        return f"{what} from {src}"


def desired_rules(cidr: str, ports: list[int]) -> list[Rule]:
    rules = [Rule("tcp", 22, 22, cidr, "ssh from the caller (cloudtrain)"),
             Rule("-1", None, None, "self", "between the cluster's nodes (cloudtrain)")]
    rules += [Rule("tcp", p, p, cidr, f"port {p} from the caller (cloudtrain)")
              for p in sorted(set(ports))]
    return rules


def _permission(rule: Rule, group_id: str) -> dict[str, Any]:
    perm: dict[str, Any] = {"IpProtocol": rule.protocol}
    if rule.protocol != "-1":
        perm["FromPort"], perm["ToPort"] = rule.from_port, rule.to_port
    desc = {"Description": rule.description} if rule.description else {}
    if rule.source == "self":
        perm["UserIdGroupPairs"] = [{"GroupId": group_id, **desc}]
    elif rule.source.startswith("sg:"):
        perm["UserIdGroupPairs"] = [{"GroupId": rule.source[3:]}]
    elif rule.source.startswith("pl:"):
        perm["PrefixListIds"] = [{"PrefixListId": rule.source[3:]}]
    elif ":" in rule.source:
        perm["Ipv6Ranges"] = [{"CidrIpv6": rule.source, **desc}]
    else:
        perm["IpRanges"] = [{"CidrIp": rule.source, **desc}]
    return perm


def actual_rules(group: dict[str, Any]) -> set[Rule]:
    """The ingress rules of a described security group, one Rule per source."""
    out: set[Rule] = set()
    gid = group["GroupId"]
    for perm in group.get("IpPermissions", []):
        proto = str(perm.get("IpProtocol"))
        fp = None if proto == "-1" else perm.get("FromPort")
        tp = None if proto == "-1" else perm.get("ToPort")
        for r in perm.get("IpRanges", []):
            out.add(Rule(proto, fp, tp, r["CidrIp"]))
        for r in perm.get("Ipv6Ranges", []):
            out.add(Rule(proto, fp, tp, r["CidrIpv6"]))
        for r in perm.get("UserIdGroupPairs", []):
            out.add(Rule(proto, fp, tp, "self" if r.get("GroupId") == gid else f"sg:{r.get('GroupId')}"))
        for r in perm.get("PrefixListIds", []):
            out.add(Rule(proto, fp, tp, f"pl:{r.get('PrefixListId')}"))
    return out


# --- one region's network -------------------------------------------------------------------

@dataclass
class RegionNet:
    region: str
    vpc_id: str
    group_id: str
    key_name: str
    subnets: dict[str, str]
    """zone name -> subnet id, in the order zones are tried."""


def find_vpc(api: Api, region: str, vpc_id: str | None) -> str:
    if vpc_id:
        vpcs = api.call(region, "describe_vpcs", Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])
        if not vpcs.get("Vpcs"):
            raise UserError(f"resources.aws.vpc_id {vpc_id} does not exist in {region}.",
                            "Give a VPC of that region, or leave vpc_id out for the default VPC.")
        return vpc_id
    vpcs = api.call(region, "describe_vpcs", Filters=[{"Name": "isDefault", "Values": ["true"]}])
    if not vpcs.get("Vpcs"):
        raise UserError(f"Region {region} has no default VPC.",
                        "Give resources.aws.vpc_id and resources.aws.subnet_ids (subnets with a "
                        "route to the internet), or create a default VPC: "
                        "'aws ec2 create-default-vpc --region " + region + "'.")
    return str(vpcs["Vpcs"][0]["VpcId"])


def subnets_by_zone(api: Api, region: str, vpc_id: str, subnet_ids: list[str]) -> dict[str, str]:
    if subnet_ids:
        found = list(api.pages(region, "describe_subnets", "Subnets",
                               Filters=[{"Name": "subnet-id", "Values": subnet_ids}]))
        by_id = {s["SubnetId"]: s for s in found}
        missing = [s for s in subnet_ids if s not in by_id]
        if missing:
            raise UserError(f"resources.aws.subnet_ids: {', '.join(missing)} not found in {region}.",
                            "Give subnets of the region (and of vpc_id).")
        wrong = [s for s in subnet_ids if by_id[s]["VpcId"] != vpc_id]
        if wrong:
            raise UserError(f"resources.aws.subnet_ids: {', '.join(wrong)} are not in {vpc_id}.",
                            "Give subnets of resources.aws.vpc_id.")
        out: dict[str, str] = {}
        for s in subnet_ids:
            out.setdefault(by_id[s]["AvailabilityZone"], s)
        return out
    found = list(api.pages(region, "describe_subnets", "Subnets",
                           Filters=[{"Name": "vpc-id", "Values": [vpc_id]},
                                    {"Name": "default-for-az", "Values": ["true"]}]))
    return {s["AvailabilityZone"]: s["SubnetId"]
            for s in sorted(found, key=lambda s: s["AvailabilityZone"])}


def ensure_security_group(api: Api, region: str, vpc_id: str, name: str, cluster: str,
                          owner: str, rules: list[Rule]) -> str:
    flt = tags.filters(cluster, owner) + [{"Name": "vpc-id", "Values": [vpc_id]}]
    groups = api.call(region, "describe_security_groups", Filters=flt).get("SecurityGroups", [])
    if groups:
        group = groups[0]
    else:
        try:
            gid = api.call(region, "create_security_group", GroupName=name, VpcId=vpc_id,
                           Description=f"cloudtrain cluster {cluster} (owner {owner})",
                           TagSpecifications=tags.spec(
                               ["security-group"],
                               tags.tag_list(cluster, owner, tags.SHARED_RANK)))["GroupId"]
        except ProviderError as exc:
            if code_of(exc) != "InvalidGroup.Duplicate":
                raise
            raise ProviderError(
                f"A security group named {name} exists in {vpc_id} ({region}) without "
                f"cloudtrain's tags for '{cluster}'.",
                "Delete it, or use another cluster name.") from None
        group = {"GroupId": gid, "IpPermissions": []}
    gid = str(group["GroupId"])
    want = {r: r for r in rules}
    have = actual_rules(group)
    extra = [r for r in have if r not in want]
    missing = [want[r] for r in want if r not in have]
    if extra:
        api.call(region, "revoke_security_group_ingress", GroupId=gid,
                 IpPermissions=[_permission(r, gid) for r in sorted(extra)])
    if missing:
        api.call(region, "authorize_security_group_ingress", GroupId=gid,
                 IpPermissions=[_permission(r, gid) for r in missing])
    return gid


def _key_body(line: str) -> str:
    parts = line.split()
    return " ".join(parts[:2])


def ensure_key_pair(api: Api, region: str, name: str, public_key: str, cluster: str,
                    owner: str) -> str:
    """Import the cluster's public key as key pair ``name`` (replacing a pair of that name
    that holds another key: the cluster's key is the truth)."""
    found = api.call(region, "describe_key_pairs", IncludePublicKey=True,
                     Filters=[{"Name": "key-name", "Values": [name]}]).get("KeyPairs", [])
    if found:
        mine = tags.as_dict(found[0].get("Tags"))
        if mine.get(tags.CLUSTER) != cluster or mine.get(tags.OWNER) != owner:
            raise ProviderError(f"A key pair named {name} exists in {region} without cloudtrain's "
                                f"tags for '{cluster}'.", "Delete it, or use another cluster name.")
        if _key_body(found[0].get("PublicKey", "")) == _key_body(public_key):
            return name
        api.call(region, "delete_key_pair", KeyName=name)
    api.call(region, "import_key_pair", KeyName=name, PublicKeyMaterial=public_key.encode(),
             TagSpecifications=tags.spec(["key-pair"], tags.tag_list(cluster, owner, tags.SHARED_RANK)))
    return name


def ensure_placement_group(api: Api, region: str, name: str, cluster: str, owner: str) -> str:
    found = api.call(region, "describe_placement_groups",
                     Filters=[{"Name": "group-name", "Values": [name]}]).get("PlacementGroups", [])
    if not [g for g in found if g.get("State") not in ("deleting", "deleted")]:
        try:
            api.call(region, "create_placement_group", GroupName=name, Strategy="cluster",
                     TagSpecifications=tags.spec(["placement-group"],
                                              tags.tag_list(cluster, owner, tags.SHARED_RANK)))
        except ProviderError as exc:
            if code_of(exc) != "InvalidPlacementGroup.Duplicate":
                raise
    return name
