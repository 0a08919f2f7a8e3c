"""The clouds' ``resources.<cloud>`` options (aws, azure, gcp), refused through the real CLI
with the words a user reads: each check (cloudtrain_provisioners/optcheck.py) with each
cloud's own message, exit code 2, the field and its line, nothing created."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloudtrain_provisioners.aws.options import AWSOptions
from cloudtrain_provisioners.azure.options import AzureOptions
from cloudtrain_provisioners.gcp.options import GCPOptions
from conftest import assert_nothing_left

LONG = "A" * 50

# (cloud, field, value as YAML, the message after "field 'resources.CLOUD.FIELD': ")
REFUSED = [
    ("aws", "ssh_user", json.dumps(LONG), f"'{LONG[:40]}' is not a Linux user name; write e.g. ubuntu"),
    ("aws", "ssh_user", '"-oX=y"', "'-oX=y' is not a Linux user name; write e.g. ubuntu"),
    ("aws", "vpc_id", "sg-1", "'sg-1' is not a VPC id; write e.g. vpc-0abc1234"),
    ("aws", "subnet_ids", "[subnet-1, x-1]", "'x-1' is not a subnet id; write e.g. subnet-0abc1234"),
    ("azure", "ssh_user", "root", "'root' cannot be an Azure VM admin user; write e.g. azureuser"),
    ("azure", "ssh_user", "Admin", "'Admin' cannot be an Azure VM admin user; write e.g. azureuser"),
    ("azure", "regions", "[eastus, east_us]", "'east_us' is not an Azure region name; write e.g. eastus"),
    ("azure", "regions", "[eastus, westus, eastus]", "a region is listed twice"),
    ("azure", "zones", "['1', '4']", "'4' is not an availability zone; write 1, 2 or 3"),
    ("azure", "zones", "['2', '2']", "a zone is listed twice"),
    ("azure", "vnet_cidr", "10.0.0.0/28", "'10.0.0.0/28' must be a private IPv4 range of /20 or larger"),
    ("azure", "vnet_cidr", "8.8.0.0/16", "'8.8.0.0/16' must be a private IPv4 range of /20 or larger"),
    ("azure", "vnet_cidr", "10.0.0.1/16", "'10.0.0.1/16' is not an address range; write e.g. 10.42.0.0/16"),
    ("azure", "subscription_id", "x", "'x' is not a subscription id; write e.g. "
                                      "00000000-0000-0000-0000-000000000000"),
    ("gcp", "ssh_user", "Trainer", "write a Linux user name, e.g. cloudtrain"),
    ("gcp", "regions", "[us-central1, uscentral1]",
     "'uscentral1' is not a GCP region name; write e.g. us-central1"),
    ("gcp", "regions", '["us-central1\\n"]',        # a trailing newline is no part of a name
     "'us-central1\\n' is not a GCP region name; write e.g. us-central1"),
    ("gcp", "regions", "[us-central1, us-central1]", "a region is listed twice"),
    ("gcp", "zones", "[us-central1-a, us-central1]",
     "'us-central1' is not a GCP zone name; write e.g. us-central1-a"),
    ("gcp", "zones", "[us-central1-a, us-central1-a]", "a zone is listed twice"),
]


@pytest.mark.parametrize("cloud,field,value,message", REFUSED,
                         ids=[f"{c}-{f}-{i}" for i, (c, f, _, _) in enumerate(REFUSED)])
def test_bad_cloud_option_is_refused_in_its_own_words(cli, tmp_path: Path, cloud: str, field: str,
                                                      value: str, message: str) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(f"name: job\nresources:\n  provider: {cloud}\n  {cloud}:\n"
                    f"    {field}: {value}\nrun: echo hi\n")
    r = cli.run("up", "--dry-run", str(task), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == (f"error: {task}, line 5: field 'resources.{cloud}.{field}': {message}\n"
                        "Fix it and run again.\n"), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert_nothing_left(cli.home)


def test_good_cloud_options_pass_as_written() -> None:
    aws = AWSOptions.model_validate({"ssh_user": "ec2-user", "vpc_id": "vpc-0abc",
                                     "subnet_ids": ["subnet-1", "subnet-2"]})
    assert (aws.ssh_user, aws.vpc_id, aws.subnet_ids) == ("ec2-user", "vpc-0abc",
                                                          ["subnet-1", "subnet-2"])
    az = AzureOptions.model_validate({"regions": ["westeurope", "eastus"], "zones": ["3", "1"],
                                      "ssh_user": "trainer", "vnet_cidr": "172.16.0.0/12",
                                      "subscription_id": "0" * 8 + "-0000-0000-0000-" + "a" * 12})
    assert (az.regions, az.zones, az.ssh_user, az.vnet_cidr) == (
        ["westeurope", "eastus"], ["3", "1"], "trainer", "172.16.0.0/12")
    gcp = GCPOptions.model_validate({"regions": ["europe-west4", "us-central1"],
                                     "zones": ["europe-west4-a"], "ssh_user": "_svc"})
    assert (gcp.regions, gcp.zones, gcp.ssh_user) == (["europe-west4", "us-central1"],
                                                      ["europe-west4-a"], "_svc")
