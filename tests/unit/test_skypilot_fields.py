"""A SkyPilot task file's fields, through the real command line (``cloudtrain cost`` with a
small user-local catalog, ``up --dry-run`` on local): ``resources.cloud`` and ``infra``
read as provider/region/zone with a note, a field given twice refused naming both,
``any_of``/``ordered`` refused naming what we have, a ``name:`` with capitals kept with the
cluster name derived, and ``cpus``/``memory`` filtering offers (docs/migrating-from-skypilot.md).
Nothing leaves loopback; nothing is created by any of these commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloudtrain.catalog.model import CatalogInfo, Offer
from cloudtrain.catalog.store import write_meta, write_offers


def off(provider: str, itype: str, count: float, vcpus: float, mem: float, region: str,
        price: float) -> Offer:
    return Offer(provider=provider, instance_type=itype, accelerator="A100",
                 accelerator_count=count, gpu_memory_gib=40, vcpus=vcpus, memory_gib=mem,
                 region=region, price=price, spot_price=price / 3)


OFFERS = [
    off("aws", "p4d.24xlarge", 8, 96, 1152, "us-east-1", 32.77),
    off("aws", "p4d.24xlarge", 8, 96, 1152, "us-west-2", 33.00),
    off("gcp", "a2-highgpu-8g", 8, 96, 680, "us-central1", 29.39),
    off("gcp", "a2-highgpu-8g", 8, 96, 680, "europe-west4", 30.00),
    off("gcp", "a2-slim-8g", 8, 48, 340, "us-central1", 25.00),
    off("azure", "Standard_ND96asr_v4", 8, 96, 900, "eastus", 27.20),
]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    folder = h / "catalog"
    write_offers(folder / "gpu_offers.csv", OFFERS)
    write_meta(folder, CatalogInfo(kind="user", path=str(folder), as_of="2026-01-15",
                                   source="test fixture", providers=("aws", "azure", "gcp")))
    return h


def run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update({"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1", "HOME": str(home.parent)})
    return subprocess.run([sys.executable, "-m", "cloudtrain", *args], capture_output=True,
                          text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


def task(tmp_path: Path, resources: str, head: str = "") -> str:
    p = tmp_path / "task.yaml"
    p.write_text(f"{head}resources:\n{resources}run: echo hi\n")
    return str(p)


def offers(home: Path, path: str) -> tuple[list[tuple[str, str, str]], str]:
    r = run(home, "cost", path, "--json")
    assert r.returncode == 0, r.stderr
    return [(o["provider"], o["instance_type"], o["region"])
            for o in json.loads(r.stdout)["offers"]], r.stderr


def refused(home: Path, path: str, *says: str) -> str:
    """Exit 2, one paragraph naming what it says, no traceback, nothing created."""
    r = run(home, "cost", path)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr
    assert err.startswith("error: ") and "Traceback" not in err, err
    for word in says:
        assert word in err, err
    assert not (home / "clusters").exists() and not (home / "state.db").exists()
    return err


def test_cloud_is_the_provider_with_a_note(home: Path, tmp_path: Path) -> None:
    got, err = offers(home, task(tmp_path, "  cloud: gcp\n  accelerators: A100:8\n"))
    assert {p for p, _, _ in got} == {"gcp"} and len(got) == 3
    assert "note: resources.cloud: read as resources.provider: gcp" in err
    # the same value under both names is one provider
    got, _ = offers(home, task(tmp_path, "  cloud: aws\n  provider: aws\n  accelerators: A100:8\n"))
    assert {p for p, _, _ in got} == {"aws"}


def test_infra_is_provider_region_and_zone(home: Path, tmp_path: Path) -> None:
    got, err = offers(home, task(tmp_path, "  infra: gcp/us-central1\n  accelerators: A100:8\n"))
    assert got == [("gcp", "a2-slim-8g", "us-central1"), ("gcp", "a2-highgpu-8g", "us-central1")]
    assert "note: resources.infra: read as resources provider gcp, region us-central1" in err
    got, _ = offers(home, task(tmp_path, "  infra: aws/*\n  accelerators: A100:8\n"))
    assert [r for _, _, r in got] == ["us-east-1", "us-west-2"]


@pytest.mark.parametrize("resources,says", [
    ("  cloud: aws\n  provider: gcp\n", ("resources.cloud", "resources.provider", "'gcp'")),
    ("  infra: aws/us-east-1\n  region: us-west-2\n",
     ("resources.infra", "resources.region", "us-west-2")),
    ("  cloud: aws\n  infra: gcp/us-central1\n", ("resources.infra", "resources.cloud")),
    ("  infra: aws/us-east-1/a/b\n", ("resources.infra", "PROVIDER[/REGION[/ZONE]]")),
    ("  infra: [aws]\n", ("resources.infra", "infra: aws/us-east-1")),
    ("  cloud: 3\n", ("resources.cloud", "cloud: aws")),
    ("  any_of:\n    - accelerators: A100:8\n    - accelerators: H100:8\n",
     ("resources.any_of", "any:N", "cloudtrain cost")),
    ("  ordered:\n    - infra: aws\n", ("resources.ordered", "any:N")),
    ("  accelerators: A100:8\n  cpus: many\n", ("resources.cpus", "4+")),
    ("  accelerators: A100:8\n  cpus: 0\n", ("resources.cpus", "more than 0")),
    ("  accelerators: A100:8\n  cpus: 8GB+\n", ("resources.cpus", "4+")),
    ("  accelerators: A100:8\n  memory: 32++\n", ("resources.memory", "32+")),
    ("  accelerators: A100:8\n  memory: true\n", ("resources.memory", "32+")),
    # a bad value read from a SkyPilot field is reported under the name the file wrote
    ("  cloud: kubernetes\n  accelerators: A100:8\n",
     ("field 'resources.cloud' (read as resources.provider)", "kubernetes")),
    ("  infra: aws/us east\n  accelerators: A100:8\n",
     ("field 'resources.infra' (read as resources.region)", "us east")),
    ("  disk_size: 4\n  accelerators: A100:8\n",
     ("field 'resources.disk_size' (read as resources.disk_size_gb)", "8")),
    ("  cloud: aws\n  cpus: 8+\n", ("resources.cpus", "no GPU", "instance_type")),
    ("  infra: gcp\n  memory: 64+\n", ("resources.memory", "accelerators")),
    ("  accelerators: [A100:8, H100:8]\n", ("resources.accelerators", "any:8")),
    ("  accelerators: {A100: 8, H100: 8}\n", ("resources.accelerators", "any:8")),
    ("  cloud: local\n  image_id: docker:My/Image\n",
     ("field 'resources.image_id' (read as container.image)", "lower case")),
])
def test_bad_skypilot_fields_exit_2_naming_the_field(home: Path, tmp_path: Path, resources: str,
                                                     says: tuple[str, ...]) -> None:
    err = refused(home, task(tmp_path, resources), *says)
    assert "task.yaml, line " in err


def test_cpus_and_memory_filter_offers(home: Path, tmp_path: Path) -> None:
    base = "  accelerators: A100:8\n"
    every, _ = offers(home, task(tmp_path, base))
    assert len(every) == len(OFFERS)
    got, _ = offers(home, task(tmp_path, base + "  cpus: 64+\n"))
    assert "a2-slim-8g" not in {t for _, t, _ in got} and len(got) == len(OFFERS) - 1
    got, _ = offers(home, task(tmp_path, base + "  cpus: 48\n"))       # exactly 48
    assert got == [("gcp", "a2-slim-8g", "us-central1")]
    got, _ = offers(home, task(tmp_path, base + "  memory: 900+\n"))   # GB
    assert [t for _, t, _ in got] == ["Standard_ND96asr_v4", "p4d.24xlarge", "p4d.24xlarge"]
    got, _ = offers(home, task(tmp_path, base + "  cpus: 96+\n  memory: 1000GB+\n"))
    assert {p for p, _, _ in got} == {"aws"}
    # nothing fits: exit 2, the reason names the field and the nearest offer's size
    err = refused(home, task(tmp_path, base + "  cpus: 128+\n"), "No offer fits",
                  "96 vCPUs (resources.cpus is 128+)")
    assert "with 128+ vCPUs" in err
    assert "Nearest: without resources.cpus: $25.00/h on gcp (a2-slim-8g, us-central1)" in err


def test_capital_name_is_kept_and_the_cluster_name_derived(home: Path, tmp_path: Path) -> None:
    path = task(tmp_path, "  cloud: local\n  cpus: 4+\n", head="name: My_Job.v2\n")
    r = run(home, "up", path, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "Plan for cluster 'my-job-v2'" in r.stderr + r.stdout
    assert "note: name: 'My_Job.v2' is the job's name; the cluster is named 'my-job-v2'" \
        in r.stderr
    # cpus/memory on the machines the user has: said, not checked
    assert "note: resources.cpus: not checked on local nodes" in r.stderr
    assert not (home / "clusters").exists()
    # -c gives the cluster another name
    r = run(home, "up", path, "--dry-run", "-c", "other")
    assert r.returncode == 0 and "Plan for cluster 'other'" in r.stderr + r.stdout, r.stderr


@pytest.mark.parametrize("name,cluster", [
    ("multi_hostname", "multi-hostname"),
    ("Train__GPT.2-", "train-gpt-2"),
    ("A_very_long.Name-for_a_SkyPilot_task_that_goes_on", "a-very-long-name-for-a-skypilot-task-tha"),
    ("x_-_", "x"),
])
def test_the_cluster_name_rule(home: Path, tmp_path: Path, name: str, cluster: str) -> None:
    r = run(home, "up", task(tmp_path, "  provider: local\n", head=f"name: {name}\n"), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"Plan for cluster '{cluster}'" in r.stderr + r.stdout
    assert f"the cluster is named '{cluster}'" in r.stderr


def test_a_valid_cluster_name_is_used_as_it_is_without_a_note(home: Path, tmp_path: Path) -> None:
    r = run(home, "up", task(tmp_path, "  provider: local\n", head="name: a--b\n"), "--dry-run")
    assert r.returncode == 0 and "Plan for cluster 'a--b'" in r.stderr + r.stdout, r.stderr
    assert not [ln for ln in r.stderr.splitlines() if ln.startswith("note:")], r.stderr


@pytest.mark.parametrize("name", ["9job", "-job", "'my job'", "a" * 64, "job/1"])
def test_names_that_give_no_cluster_name_exit_2(home: Path, tmp_path: Path, name: str) -> None:
    r = run(home, "up", task(tmp_path, "  cloud: local\n", head=f"name: {name}\n"), "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "field 'name'" in r.stderr and "starting with a letter" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_docker_image_id_is_the_container_image(home: Path, tmp_path: Path) -> None:
    """SkyPilot's ``image_id: docker:IMAGE`` is our ``container.image``: the plan shows the
    container; the same image under both names is one; two different ones are refused; a
    login given as SKYPILOT_DOCKER_* values in envs is not used, and the note says why."""
    ref = "localhost:5000/team/pytorch:1.0"
    other = task(tmp_path, f"  cloud: local\n  image_id: docker:{ref}\n",
                 head="container:\n  image: ubuntu:24.04\n")
    refused(home, other, "resources.image_id", "container.image", "'ubuntu:24.04'")
    path = task(tmp_path, f"  cloud: local\n  image_id: docker:{ref}\n",
                head="envs:\n  SKYPILOT_DOCKER_USERNAME: me\n")
    r = run(home, "up", path, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"note: resources.image_id: read as container.image: {ref}" in r.stderr
    assert f"container    {ref} (setup, run and exec run in it" in r.stdout + r.stderr
    assert "envs.SKYPILOT_DOCKER_*: not used to log in" in r.stderr
    assert "container.registry_auth" in r.stderr
    same = task(tmp_path, f"  cloud: local\n  image_id: docker:{ref}\n",
                head=f"container:\n  image: {ref}\n")
    assert run(home, "up", same, "--dry-run").returncode == 0
    # an image_id that is not docker: stays the cloud image field it was
    r = run(home, "up", task(tmp_path, "  cloud: local\n  image_id: ami-123\n"), "--dry-run")
    assert "container " not in r.stdout + r.stderr
