"""The planner (ranking, constraints, rejections, suggestions), the memory-fit formula, the
credential probe and the provider auto-pick of up/launch, in process with small offer lists
and fake providers. No network, no cloud SDK, no sshd."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, ClassVar

import pytest

from cloudtrain import credentials, planner, ranking
from cloudtrain.provider import registry
from cloudtrain.catalog.model import Offer
from cloudtrain.errors import CapacityError, UserError
from cloudtrain.memfit import GIB, MemoryEstimate, parse_params
from cloudtrain.provider import ClusterRequest, NetworkRef, Node, Plan
from cloudtrain.taskmodel import Resources
from cloudtrain.spec import parse_task


def off(provider: str, itype: str, acc: str | None, count: float, mem: float | None,
        region: str, price: float | None, spot: float | None = None,
        zones: tuple[str, ...] = ()) -> Offer:
    return Offer(provider=provider, instance_type=itype, accelerator=acc, accelerator_count=count,
                 gpu_memory_gib=mem, vcpus=96, memory_gib=1152, region=region, zones=zones,
                 price=price, spot_price=spot)


OFFERS = [
    off("aws", "p4d.24xlarge", "A100", 8, 40, "us-east-1", 32.77, 12.0, ("use1-az1", "use1-az2")),
    off("aws", "p4d.24xlarge", "A100", 8, 40, "eu-west-1", 35.40, None),
    off("aws", "p4de.24xlarge", "A100-80GB", 8, 80, "us-east-1", 40.97, 16.0),
    off("gcp", "a2-highgpu-8g", "A100", 8, 40, "us-central1", 29.39, 8.8,
        ("us-central1-a", "us-central1-b")),
    off("gcp", "a2-highgpu-4g", "A100", 4, 40, "us-central1", 14.69, 4.4),
    off("gcp", "a2-ultragpu-8g", "A100-80GB", 8, 80, "us-central1", 40.55, 12.1),
    off("azure", "Standard_ND96asr_v4", "A100", 8, 40, "eastus", 27.20, 3.0),
    off("azure", "Standard_NC24ads_A100_v4", "A100-80GB", 1, 80, "eastus", 3.67, 1.1),
    off("aws", "g5.xlarge", "A10G", 1, 22.35, "us-east-1", 1.006, 0.45),
    off("gcp", "g2-standard-4", "L4", 1, 24, "us-central1", 0.71, 0.25),
]


def res(**kw: Any) -> Resources:
    return Resources.model_validate(kw)


def order(result: ranking.PlanResult) -> list[tuple[str, str, str]]:
    return [(r.offer.provider, r.offer.region, r.offer.instance_type) for r in result.ranked]


def needed_gib(params: float, bytes_per_param: int, shards: int = 1) -> float:
    """The documented formula, written out again for the tests."""
    return params * bytes_per_param / shards / GIB * 1.2 + 1.0


# --- ranking ----------------------------------------------------------------------------------

def test_cheapest_cluster_first_across_providers() -> None:
    r = ranking.rank(res(accelerators="A100:8"), 2, OFFERS)
    assert order(r) == [("azure", "eastus", "Standard_ND96asr_v4"),
                        ("gcp", "us-central1", "a2-highgpu-8g"),
                        ("aws", "us-east-1", "p4d.24xlarge"),
                        ("aws", "eu-west-1", "p4d.24xlarge")]
    pick = r.pick
    assert pick is not None and pick.per_node == 27.20 and pick.cluster == pytest.approx(54.40)
    assert pick.total(10) == pytest.approx(544.0)
    assert [c.cluster for c in r.ranked] == sorted(c.cluster for c in r.ranked)


def test_ties_broken_by_provider_region_instance_whatever_the_input_order() -> None:
    same = [off(p, t, "H100", 8, 80, reg, 50.0) for p, reg, t in
            (("gcp", "us-east4", "a3-highgpu-8g"), ("aws", "us-west-2", "p5.48xlarge"),
             ("aws", "us-east-1", "p5.48xlarge"), ("aws", "us-east-1", "p5a.48xlarge"),
             ("azure", "eastus", "Standard_ND96isr_H100_v5"))]
    # a sub-1/100-cent difference is no difference
    same.append(off("aws", "p5.48xlarge", "H100", 8, 80, "ap-south-1", 50.000001))
    expected = [("aws", "ap-south-1", "p5.48xlarge"), ("aws", "us-east-1", "p5.48xlarge"),
                ("aws", "us-east-1", "p5a.48xlarge"), ("aws", "us-west-2", "p5.48xlarge"),
                ("azure", "eastus", "Standard_ND96isr_H100_v5"), ("gcp", "us-east4", "a3-highgpu-8g")]
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(same)
        assert order(ranking.rank(res(accelerators="H100:8"), 1, same)) == expected


def test_spot_market_ranks_by_spot_price_and_drops_offers_without_one() -> None:
    r = ranking.rank(res(accelerators="A100:8"), 2, OFFERS, spot=True)
    assert order(r)[0] == ("azure", "eastus", "Standard_ND96asr_v4")
    assert [x.per_node for x in r.ranked] == [3.0, 8.8, 12.0]
    assert any(j.constraint == "market" and j.reason == "no spot price" and j.count == 1
               for j in r.rejected)
    # on-demand: the spot alternative and its saving are reported with each offer
    od = ranking.rank(res(accelerators="A100:8"), 2, OFFERS)
    gcp = next(x for x in od.ranked if x.offer.provider == "gcp")
    assert gcp.alternative_per_node == 8.8
    assert gcp.spot_saving == pytest.approx(1 - 8.8 / 29.39)
    d = gcp.to_dict(hours=3)
    assert d["spot_cluster_hourly_usd"] == pytest.approx(17.6)
    assert d["total_usd"] == pytest.approx(29.39 * 2 * 3, abs=0.01)
    assert (d["price_hourly_usd"], d["spot_price_hourly_usd"], d["nodes"]) == (29.39, 8.8, 2)
    assert d["cluster_hourly_usd"] == pytest.approx(58.78)
    assert d["spot_saving_pct"] == pytest.approx(100 * (1 - 8.8 / 29.39), abs=0.05)


def test_max_hourly_cost_caps_the_whole_cluster_not_one_node() -> None:
    # 3 nodes: azure 3 x 27.20 = 81.60, gcp 3 x 29.39 = 88.17, aws 3 x 32.77 = 98.31
    r = ranking.rank(res(accelerators="A100:8"), 3, OFFERS, max_hourly_cost=90)
    assert order(r) == [("azure", "eastus", "Standard_ND96asr_v4"),
                        ("gcp", "us-central1", "a2-highgpu-8g")]
    over = [j for j in r.rejected if j.constraint == "max_hourly_cost"]
    assert len(over) == 1 and over[0].count == 2 and "$90/h" in over[0].reason
    assert "<= max_hourly_cost $90/h" in r.ranked[0].why
    # the cap is inclusive, and a single node of each would pass it
    assert len(ranking.rank(res(accelerators="A100:8"), 3, OFFERS, max_hourly_cost=81.60).ranked) == 1
    assert len(ranking.rank(res(accelerators="A100:8"), 1, OFFERS, max_hourly_cost=35).ranked) == 3


def test_task_budget_and_market_come_from_the_task() -> None:
    task = parse_task("num_nodes: 3\nresources:\n  accelerators: A100:8\n  use_spot: true\n"
                      "  max_hourly_cost: 25\nrun: x\n")
    r = ranking.rank_task(task, OFFERS)
    # spot x 3 nodes: azure 9.00, gcp 26.40, aws 36.00; the cap of $25/h leaves azure
    assert [(x.offer.provider, x.cluster) for x in r.ranked] == [("azure", pytest.approx(9.0))]
    assert r.ranked[0].spot and r.want == "A100:8 x 3 nodes, spot"


def test_nothing_under_the_cap_says_what_removed_what_and_the_nearest_relaxation() -> None:
    r = ranking.rank(res(accelerators="A100:8"), 2, OFFERS, max_hourly_cost=20)
    assert r.ranked == []
    with pytest.raises(UserError) as e:
        r.require()
    msg = str(e.value)
    assert "4 offers: over max_hourly_cost $20/h for the cluster" in msg
    assert "cheapest without max_hourly_cost: $54.40/h on azure (Standard_ND96asr_v4, eastus)" in msg
    assert e.value.exit_code == 2


def test_region_and_zone_constraints() -> None:
    r = ranking.rank(res(accelerators="A100:8", region="us-east-1"), 1, OFFERS)
    assert order(r) == [("aws", "us-east-1", "p4d.24xlarge")]
    assert any(j.constraint == "region" and j.count == 3 for j in r.rejected)
    # GCP lists zone names: only a listed zone passes
    assert order(ranking.rank(res(accelerators="A100:8", zone="us-central1-b"), 1, OFFERS)) == \
        [("gcp", "us-central1", "a2-highgpu-8g")]
    none = ranking.rank(res(accelerators="A100:8", zone="us-central1-f"), 1, OFFERS)
    assert none.ranked == [] and any("us-central1-f" in j.reason for j in none.rejected)
    # AWS lists zone IDs (use1-az1), which map to names per account: a name of the region passes
    assert order(ranking.rank(res(accelerators="A100:8", zone="us-east-1a"), 1, OFFERS)) == \
        [("aws", "us-east-1", "p4d.24xlarge")]
    # nothing in the region: the suggestion is another region
    eu = ranking.rank(res(accelerators="A100-80GB:8", region="eu-west-1"), 1, OFFERS)
    assert eu.ranked == [] and "in another region: $40.55/h on gcp" in str(eu.error())


def test_provider_in_the_task_restricts_the_offers() -> None:
    r = ranking.rank(res(provider="aws", accelerators="A100:8"), 1, OFFERS)
    assert {x.offer.provider for x in r.ranked} == {"aws"}
    assert any(j.constraint == "provider" and j.reason == "on azure, the task asks for aws"
               for j in r.rejected)


def test_instance_type_alone_picks_that_type_and_an_unknown_one_is_named() -> None:
    r = ranking.rank(res(instance_type="P4D.24xlarge"), 1, OFFERS)
    assert order(r) == [("aws", "us-east-1", "p4d.24xlarge"), ("aws", "eu-west-1", "p4d.24xlarge")]
    assert r.ranked[0].gpus() == "8xA100"
    bad = ranking.rank(res(instance_type="p4d.24xlarg"), 1, OFFERS)
    assert bad.ranked == []
    assert "did you mean p4d.24xlarge?" in str(bad.error())
    # both given: both must match
    assert ranking.rank(res(instance_type="p4d.24xlarge", accelerators="A100-80GB:8"), 1,
                        OFFERS).ranked == []


def test_gpu_aliases_are_canonical_and_80gb_is_another_model() -> None:
    r40 = ranking.rank(res(accelerators="a100-40gb:8"), 1, OFFERS)
    assert {x.offer.accelerator for x in r40.ranked} == {"A100"}
    r80 = ranking.rank(res(accelerators="nvidia a100-80g:8"), 1, OFFERS)
    assert {x.offer.accelerator for x in r80.ranked} == {"A100-80GB"}
    assert any(j.reason == "another GPU model (not A100-80GB)" for j in r80.rejected)


def test_gpu_count_is_per_node_and_exact() -> None:
    r = ranking.rank(res(accelerators="A100:4"), 2, OFFERS)
    assert order(r) == [("gcp", "us-central1", "a2-highgpu-4g")]
    assert r.ranked[0].cluster == pytest.approx(2 * 14.69)
    two = ranking.rank(res(accelerators="A100:2"), 1, OFFERS)
    assert two.ranked == [] and "A100 comes with 4, 8 per node" in str(two.error())


def test_unknown_gpu_is_a_user_error_with_a_suggestion() -> None:
    with pytest.raises(UserError) as e:
        ranking.rank(res(accelerators="A1000:8"), 1, OFFERS)
    assert "unknown GPU 'A1000'" in e.value.message and "Did you mean" in e.value.hint


def test_neither_gpus_nor_instance_type_is_a_user_error() -> None:
    with pytest.raises(UserError, match="accelerators"):
        ranking.rank(res(provider="aws"), 1, OFFERS)


# --- memory fit -------------------------------------------------------------------------------

def test_memory_formula_by_hand() -> None:
    b = MemoryEstimate(7e9, "bf16", "adamw", "ddp").breakdown(16)
    assert (b.weight_bytes, b.gradient_bytes, b.optimizer_bytes, b.shards) == (6, 2, 8, 1)
    assert b.weights_gib == pytest.approx(7e9 * 6 / GIB)
    assert b.needed_gib == pytest.approx(needed_gib(7e9, 16))
    f = MemoryEstimate(7e9, "bf16", "adamw", "fsdp").breakdown(16)
    assert f.shards == 16 and f.needed_gib == pytest.approx(needed_gib(7e9, 16, 16))
    s = MemoryEstimate(1e9, "fp32", "sgd", "ddp").breakdown()
    assert (s.weight_bytes, s.gradient_bytes, s.optimizer_bytes) == (4, 4, 4)
    assert s.needed_gib == pytest.approx(needed_gib(1e9, 12))
    assert MemoryEstimate(1e9, "fp16", "sgd").breakdown().states_gib == pytest.approx(1e9 * 12 / GIB)
    assert b.fits(b.needed_gib / 0.9) and not b.fits(b.needed_gib / 0.9 - 0.01)
    d = b.to_dict()
    assert d["bytes_per_param"] == {"weights": 6, "gradients": 2, "optimizer": 8}
    assert d["needed_gib"] == pytest.approx(b.needed_gib, abs=0.01)


# Memory fit for three model sizes, worked out by hand from the formula in docs/cost.md (not
# with memfit): needed per GPU = params x bytes / shards / 2^30 x 1.2 + 1 GiB, where bytes is
# weights + gradients + optimizer: bf16 + AdamW = 6 + 2 + 8 = 16, fp32 + SGD = 4 + 4 + 4 = 12,
# fp16 + SGD = 6 + 2 + 4 = 12. 2^30 = 1 073 741 824. Figures to 4 decimals.
HAND: list[tuple[float, str, str, str, int, float, float]] = [
    # params, precision, optimizer, strategy, GPUs in the cluster -> states GiB, needed GiB
    # 1.3e9 x 16 = 20.8e9 B; / 2^30 = 19.3715; x 1.2 = 23.2458; + 1 = 24.2458
    (1.3e9, "bf16", "adamw", "ddp", 8, 19.3715, 24.2458),
    # 1.3e9 x 12 = 15.6e9 B; / 2^30 = 14.5286; x 1.2 = 17.4344; + 1 = 18.4344
    (1.3e9, "fp32", "sgd", "ddp", 1, 14.5286, 18.4344),
    # 7e9 x 16 = 112e9 B; / 2^30 = 104.3081; x 1.2 = 125.1698; + 1 = 126.1698 (ddp: GPUs ignored)
    (7e9, "bf16", "adamw", "ddp", 16, 104.3081, 126.1698),
    # 7e9 x 16 / 8 GPUs = 14e9 B; / 2^30 = 13.0385; x 1.2 = 15.6462; + 1 = 16.6462
    (7e9, "bf16", "adamw", "fsdp", 8, 13.0385, 16.6462),
    # 7e9 x 12 / 16 GPUs = 5.25e9 B; / 2^30 = 4.8894; x 1.2 = 5.8673; + 1 = 6.8673
    (7e9, "fp16", "sgd", "fsdp", 16, 4.8894, 6.8673),
    # 70e9 x 16 = 1120e9 B; / 2^30 = 1043.0813; x 1.2 = 1251.6975; + 1 = 1252.6975
    (70e9, "bf16", "adamw", "ddp", 8, 1043.0813, 1252.6975),
    # 70e9 x 16 / 16 GPUs = 70e9 B; / 2^30 = 65.1926; x 1.2 = 78.2311; + 1 = 79.2311
    (70e9, "bf16", "adamw", "fsdp", 16, 65.1926, 79.2311),
    # 70e9 x 16 / 32 GPUs = 35e9 B; / 2^30 = 32.5963; x 1.2 = 39.1155; + 1 = 40.1155
    (70e9, "bf16", "adamw", "fsdp", 32, 32.5963, 40.1155),
    # 70e9 x 12 / 64 GPUs = 13.125e9 B; / 2^30 = 12.2236; x 1.2 = 14.6683; + 1 = 15.6683
    (70e9, "fp32", "sgd", "fsdp", 64, 12.2236, 15.6683),
]


@pytest.mark.parametrize("params, precision, optimizer, strategy, gpus, states, needed", HAND,
                         ids=[f"{h[0]:g}-{h[1]}-{h[2]}-{h[3]}-{h[4]}gpus" for h in HAND])
def test_memory_fit_matches_hand_computed_figures(params: float, precision: str, optimizer: str,
                                                  strategy: str, gpus: int, states: float,
                                                  needed: float) -> None:
    b = MemoryEstimate(params, precision, optimizer, strategy).breakdown(gpus)
    assert b.shards == (gpus if strategy == "fsdp" else 1)
    assert b.states_gib == pytest.approx(states, abs=5e-4)
    assert b.activations_gib == pytest.approx(0.2 * states, abs=5e-4)
    assert b.overhead_gib == 1.0
    assert b.needed_gib == pytest.approx(needed, abs=5e-4)
    assert b.min_gpu_memory_gib == pytest.approx(needed / 0.9, abs=1e-3)
    assert b.to_dict()["needed_gib"] == round(needed, 2)


def test_memory_fit_components_and_verdicts_by_hand() -> None:
    # 1.3e9 bf16 AdamW ddp, per part: weights 1.3e9 x 6 / 2^30 = 7.2643, gradients x 2 = 2.4214,
    # AdamW x 8 = 9.6858 (sum 19.3715); activations 0.2 x 19.3715 = 3.8743.
    b = MemoryEstimate(1.3e9).breakdown()
    assert (b.weights_gib, b.gradients_gib, b.optimizer_gib, b.activations_gib) == (
        pytest.approx(7.2643, abs=5e-4), pytest.approx(2.4214, abs=5e-4),
        pytest.approx(9.6858, abs=5e-4), pytest.approx(3.8743, abs=5e-4))
    # 24.2458 GiB needed: a 40 GiB GPU (36 usable) holds it, a 24 GiB one (21.6 usable) does not.
    assert b.fits(40) and not b.fits(24)
    # 70e9 bf16 AdamW on 80 GiB GPUs (72 usable): fsdp over 2 x 8 needs 79.2311 (no), over
    # 4 x 8 needs 40.1155 (yes); 40 GiB A100s (36 usable) do not hold it even over 4 x 8.
    fit = MemoryEstimate(70e9, "bf16", "adamw", "fsdp")
    two = ranking.rank(res(accelerators="A100-80GB:8"), 2, OFFERS, fit=fit)
    assert two.ranked == []
    assert [j.reason for j in two.rejected if j.constraint == "memory"] == \
        ["80 GiB per GPU: 72 GiB usable < 79.2 GiB needed"]
    four = ranking.rank(res(accelerators="any:8"), 4, OFFERS, fit=fit)
    assert {r.offer.accelerator for r in four.ranked} == {"A100-80GB"}
    assert four.ranked[0].fit is not None and four.ranked[0].fit.shards == 32
    assert {j.reason for j in four.rejected if j.constraint == "memory"} == \
        {"40 GiB per GPU: 36 GiB usable < 40.1 GiB needed"}
    # 7e9 fp16 SGD fsdp on 2 nodes x 1 GPU: 2 shards, 7e9 x 12 / 2 / 2^30 = 39.1155 GiB of
    # states, x 1.2 + 1 = 47.9387 GiB: only the 80 GiB GPU (72 usable) holds it, not the
    # 22.35 GiB A10G (20.1 usable) nor the 24 GiB L4 (21.6 usable).
    small = ranking.rank(res(accelerators="any:1"), 2, OFFERS,
                         fit=MemoryEstimate(7e9, "fp16", "sgd", "fsdp"))
    assert [r.offer.accelerator for r in small.ranked] == ["A100-80GB"]      # 80 GiB: 72 usable
    assert small.ranked[0].fit is not None
    assert small.ranked[0].fit.needed_gib == pytest.approx(47.9387, abs=5e-4)


@pytest.mark.parametrize("text, value", [("7e9", 7e9), ("7B", 7e9), ("350M", 3.5e8),
                                         ("1.5b", 1.5e9), ("125000000", 1.25e8)])
def test_parse_params(text: str, value: float) -> None:
    assert parse_params(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["seven", "-7e9", "0", "7Q", ""])
def test_parse_params_refuses(text: str) -> None:
    with pytest.raises(UserError):
        parse_params(text)


def test_7b_bf16_adamw_ddp_does_not_fit_80gb_but_fsdp_over_16_gpus_does() -> None:
    ddp = MemoryEstimate(7e9, "bf16", "adamw", "ddp")
    assert needed_gib(7e9, 16) > 80 * 0.9      # the premise, from the formula
    r = ranking.rank(res(accelerators="A100-80GB:8"), 2, OFFERS, fit=ddp)
    assert r.ranked == []
    reason = f"80 GiB per GPU: 72 GiB usable < {needed_gib(7e9, 16):.1f} GiB needed"
    assert [(j.constraint, j.reason, j.count) for j in r.rejected if j.constraint == "memory"] == \
        [("memory", reason, 2)]
    assert "with --strategy fsdp it fits" in str(r.error())

    fsdp = MemoryEstimate(7e9, "bf16", "adamw", "fsdp")
    assert needed_gib(7e9, 16, 16) <= 80 * 0.9
    ok = ranking.rank(res(accelerators="A100-80GB:8"), 2, OFFERS, fit=fsdp)
    assert order(ok) == [("gcp", "us-central1", "a2-ultragpu-8g"), ("aws", "us-east-1", "p4de.24xlarge")]
    assert ok.ranked[0].fit is not None and ok.ranked[0].fit.shards == 16
    assert f"{needed_gib(7e9, 16, 16):.1f} GiB needed fits 80 GiB" in ok.ranked[0].why


def test_memory_fit_keeps_the_gpus_that_hold_the_model_and_says_why_not_the_others() -> None:
    # 3e9 x 16 B = 44.7 GiB of states, 54.6 GiB needed: 40 GiB GPUs no, 80 GiB yes
    fit = MemoryEstimate(3e9)
    need = needed_gib(3e9, 16)
    assert 40 * 0.9 < need <= 80 * 0.9
    r = ranking.rank(res(accelerators="any:8"), 1, OFFERS, fit=fit)
    assert {x.offer.accelerator for x in r.ranked} == {"A100-80GB"}
    mem = [j for j in r.rejected if j.constraint == "memory"]
    assert [(j.reason, j.count) for j in mem] == \
        [(f"40 GiB per GPU: 36 GiB usable < {need:.1f} GiB needed", 4)]
    # asking for the 40 GB part: nothing fits, and the 80 GB part is suggested
    a100 = ranking.rank(res(accelerators="A100:8"), 1, OFFERS, fit=fit)
    assert a100.ranked == [] and "A100-80GB:8 fits: $40.55/h on gcp" in str(a100.error())


# --- choosing a provider for up ---------------------------------------------------------------

class FakeCloud:
    """A provider that creates nothing real; ``fail_with`` makes create_nodes raise."""

    name: ClassVar[str] = "fake"
    options_model = None
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = True
    list_is_cheap: ClassVar[bool] = True

    def __init__(self, name: str, fail_with: Exception | None = None) -> None:
        self.name = name  # type: ignore[misc]
        self.fail_with = fail_with
        self.nodes: dict[str, list[Node]] = {}
        self.calls: list[str] = []

    def check(self, request: ClusterRequest) -> None:
        self.calls.append("check")

    def plan(self, request: ClusterRequest) -> Plan:
        r = request.resources
        return Plan(provider=self.name, num_nodes=request.num_nodes, region=r.region,
                    instance_type=r.instance_type, use_spot=r.use_spot,
                    creates=[f"{request.num_nodes} x {r.instance_type} in {r.region}"])

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        return NetworkRef("net-1")

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        self.calls.append(f"create {request.resources.instance_type} {request.resources.region}")
        if self.fail_with is not None:
            raise self.fail_with
        nodes = [Node(rank=i, instance_id=f"{self.name}-{i}", host=f"10.0.0.{i + 1}")
                 for i in range(request.num_nodes)]
        self.nodes[request.name] = nodes
        return nodes

    def list_nodes(self, cluster: str) -> list[Node]:
        return list(self.nodes.get(cluster, []))

    def terminate(self, cluster: str) -> None:
        self.calls.append("terminate")
        self.nodes.pop(cluster, None)


CRED_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
             "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
             "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
             "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "AZURE_CLIENT_ID",
             "AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PATH", "AZURE_FEDERATED_TOKEN_FILE",
             "AZURE_TENANT_ID", "AZURE_CONFIG_DIR")


@pytest.fixture
def bare_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME with no credentials at all, and none in the environment."""
    home = tmp_path / "userhome"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for v in CRED_VARS:
        monkeypatch.delenv(v, raising=False)
    return home


@pytest.fixture
def clouds(bare_home: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    # aws and gcp are fakes; azure counts as not installed whatever this machine has, so the
    # "not installed" path is tested too (our own registry's listing, not an SDK, is patched).
    real_names = registry.names
    monkeypatch.setattr(registry, "names", lambda: [n for n in real_names() if n != "azure"])
    return {"aws": FakeCloud("aws"), "gcp": FakeCloud("gcp")}   # handed in through _env


def test_credentials_from_env_and_standard_files(bare_home: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert not any(credentials.present(p) for p in ("aws", "gcp", "azure"))
    assert credentials.present("local") and credentials.present("ssh")
    # AWS: keys, profile, files, SSO cache
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA")
    assert not credentials.present("aws")          # half a key pair is not a credential
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert credentials.present("aws")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.setenv("AWS_PROFILE", "work")
    assert credentials.present("aws")
    monkeypatch.delenv("AWS_PROFILE")
    (bare_home / ".aws" / "sso" / "cache").mkdir(parents=True)
    assert not credentials.present("aws")
    (bare_home / ".aws" / "sso" / "cache" / "abc.json").write_text("{}")
    assert credentials.present("aws")
    # GCP: a key file named by the env, ADC in the gcloud folder or CLOUDSDK_CONFIG
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(bare_home / "missing.json"))
    assert not credentials.present("gcp")
    adc = bare_home / "sdk" / "application_default_credentials.json"
    adc.parent.mkdir()
    adc.write_text("{}")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(adc.parent))
    assert credentials.present("gcp")
    # Azure: a service principal in the env, or the CLI's token cache
    monkeypatch.setenv("AZURE_CLIENT_ID", "id")
    assert not credentials.present("azure")
    monkeypatch.setenv("AZURE_CLIENT_CERTIFICATE_PATH", "/x.pem")
    assert credentials.present("azure")
    monkeypatch.delenv("AZURE_CLIENT_ID")
    (bare_home / ".azure").mkdir()
    (bare_home / ".azure" / "msal_token_cache.json").write_text("{}")
    assert credentials.present("azure")


def test_provider_unset_only_when_gpus_or_instance_type_are_asked_for() -> None:
    assert parse_task("run: x\n").resources.provider == "local"
    assert parse_task("resources: {accelerators: none}\nrun: x\n").resources.provider == "local"
    assert parse_task("resources: {accelerators: A100:8}\nrun: x\n").resources.provider is None
    assert parse_task("resources: {instance_type: p4d.24xlarge}\nrun: x\n").resources.provider is None
    assert parse_task("resources: {provider: ssh, accelerators: A100:8}\nrun: x\n"
                      ).resources.provider == "ssh"


def test_no_usable_cloud_names_what_to_install_or_configure(clouds: dict[str, FakeCloud]) -> None:
    task = parse_task("resources: {accelerators: A100:8}\nrun: x\n")
    with pytest.raises(UserError) as e:
        planner.pick_for_up(task, OFFERS)
    err = e.value
    assert "A100:8" in err.message and "not installed: azure" in err.message
    assert "installed without credentials: aws, gcp" in err.message
    assert "aws configure" in err.hint and "cloudtrain[azure]" in err.hint


def test_auto_pick_takes_the_cheapest_cloud_with_credentials(
        clouds: dict[str, FakeCloud], bare_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    task = parse_task("num_nodes: 2\nresources: {accelerators: A100:8}\nrun: x\n")
    # azure is cheapest but not installed; gcp is next but has no credentials: aws
    choice, alternatives, notes = planner.pick_for_up(task, OFFERS)
    assert (choice.provider, choice.region, choice.instance_type) == \
        ("aws", "us-east-1", "p4d.24xlarge")
    assert choice.hourly_price_per_node == 32.77 and choice.accelerators == "A100:8"
    assert [(a.provider, a.region) for a in alternatives] == [("aws", "eu-west-1")]
    assert "aws" in notes[0] and "failover" in notes[1]
    avail = planner.availability()
    assert avail == {"aws": None, "azure": "not installed (pip install 'cloudtrain[azure]')",
                     "gcp": "no credentials found"}
    result = planner.choose(task, OFFERS, avail=avail)
    assert any(j.constraint == "provider" and j.reason == "on gcp: no credentials found"
               for j in result.rejected)
    # with gcp's credentials too, the cheaper gcp offer wins and aws becomes the failover
    adc = bare_home / ".config" / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir(parents=True)
    adc.write_text("{}")
    choice, alternatives, _ = planner.pick_for_up(task, OFFERS)
    assert choice.provider == "gcp"
    assert [a.provider for a in alternatives] == ["aws", "aws"]
    resolved = planner.resolved(task, choice)
    assert (resolved.resources.provider, resolved.resources.region,
            resolved.resources.instance_type) == ("gcp", "us-central1", "a2-highgpu-8g")
    assert task.resources.provider is None   # the original is untouched


def _env(tmp_path: Path, providers: dict[str, FakeCloud]):  # type: ignore[no-untyped-def]
    from cloudtrain.context import Env
    from cloudtrain.state import open_state
    from cloudtrain.ui import UI

    home = tmp_path / "cthome"
    home.mkdir()
    return Env(home, open_state(home), UI(quiet=True), providers)  # type: ignore[arg-type]


def test_up_plan_and_failover_walk_the_ranked_list(clouds: dict[str, FakeCloud], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.pipeline.plan import plan
    from cloudtrain.pipeline.provision import provision

    monkeypatch.setenv("AWS_PROFILE", "p")
    adc = Path(str(tmp_path / "userhome")) / ".config" / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir(parents=True)
    adc.write_text("{}")
    env = _env(tmp_path, clouds)
    task = parse_task("name: job\nnum_nodes: 2\nresources: {accelerators: A100:8}\nrun: x\n")

    p = plan(env, task, "job", offers=OFFERS)
    assert (p.provider, p.region, p.instance_type) == ("gcp", "us-central1", "a2-highgpu-8g")
    assert p.hourly_price_per_node == 29.39 and p.accelerators == "A100:8"
    assert p.creates == ["2 x a2-highgpu-8g in us-central1"]
    assert [(a.provider, a.region) for a in p.alternatives] == [("aws", "us-east-1"),
                                                               ("aws", "eu-west-1")]
    assert any("picked by the planner" in n for n in p.notes)

    # gcp has no capacity: up rolls it back and takes the next offer of the same list
    clouds["gcp"].fail_with = CapacityError("no a2-highgpu-8g capacity in us-central1")
    handle, fresh = provision(env, task, "job", planned=p)
    assert fresh and handle.row.provider == "aws"
    assert (handle.row.region, handle.row.instance_type) == ("us-east-1", "p4d.24xlarge")
    assert handle.row.hourly_price == 32.77
    assert clouds["gcp"].calls[-2:] == ["create a2-highgpu-8g us-central1", "terminate"]
    assert [n.instance_id for n in handle.nodes] == ["aws-0", "aws-1"]

    # the cluster exists now: a later plan keeps it where it is
    again = plan(env, task, "job", offers=OFFERS)
    assert (again.provider, again.instance_type) == ("aws", "p4d.24xlarge")
    assert again.alternatives == []


def test_failover_stops_at_the_end_of_the_list(clouds: dict[str, FakeCloud], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.pipeline.plan import plan
    from cloudtrain.pipeline.provision import provision

    monkeypatch.setenv("AWS_PROFILE", "p")
    clouds["aws"].fail_with = CapacityError("none left")
    env = _env(tmp_path, clouds)
    task = parse_task("name: job\nresources: {accelerators: A100:8, region: us-east-1}\nrun: x\n")
    with pytest.raises(CapacityError):
        provision(env, task, "job", planned=plan(env, task, "job", offers=OFFERS))
    assert env.state.get_cluster("job") is None


# --- the shipped snapshot ---------------------------------------------------------------------

def test_ranking_over_the_shipped_snapshot_agrees_with_the_catalog() -> None:
    from cloudtrain.catalog.load import load_catalog

    cat = load_catalog(None)
    for spot in (False, True):
        r = ranking.rank(res(accelerators="A100:8"), 2, cat.offers, spot=spot)
        assert r.ranked, "the snapshot sells A100:8"
        assert all(x.offer.accelerator == "A100" and x.offer.accelerator_count == 8
                   for x in r.ranked)
        clusters = [round(x.cluster, 4) for x in r.ranked]   # compared to 1/100 of a cent
        assert clusters == sorted(clusters)
        found = cat.find("A100", 8, spot=spot)
        assert len(found) == len(r.ranked)
        assert r.ranked[0].per_node == pytest.approx(found[0].hourly(spot), abs=1e-4)
        assert sum(j.count for j in r.rejected) + len(r.ranked) == len(cat.offers)
    # H100:8 on one node cannot hold 7e9 params with AdamW under ddp; the planner says so and
    # points at fsdp
    h = ranking.rank(res(accelerators="H100:8"), 1, cat.offers, fit=MemoryEstimate(7e9))
    assert h.ranked == [] and "fsdp" in h.error().hint
    ok = ranking.rank(res(accelerators="H100:8"), 1, cat.offers,
                      fit=MemoryEstimate(7e9, strategy="fsdp"))
    assert ok.ranked and ok.ranked[0].fit is not None and ok.ranked[0].fit.shards == 8


def test_a_named_cloud_without_region_gets_its_cheapest_region(clouds: dict[str, FakeCloud],
                                                               tmp_path: Path) -> None:
    from cloudtrain.pipeline.plan import plan

    # aws is named: its own check speaks for credentials (none here); the planner picks the region
    env = _env(tmp_path, clouds)
    task = parse_task("name: job\nresources: {provider: aws, accelerators: A100:8}\nrun: x\n")
    assert planner.needs_pick(task)
    p = plan(env, task, "job", offers=OFFERS)
    assert (p.provider, p.region, p.instance_type, p.hourly_price_per_node) == \
        ("aws", "us-east-1", "p4d.24xlarge", 32.77)
    assert [(a.provider, a.region) for a in p.alternatives] == [("aws", "eu-west-1")]
    # a region in the task: the provider is asked as is, no planner
    pinned = parse_task("resources: {provider: aws, region: eu-west-1, accelerators: A100:8}\n"
                        "run: x\n")
    assert not planner.needs_pick(pinned)
    assert plan(env, pinned, "job2", offers=OFFERS).region == "eu-west-1"


# --- placement is decided once, in the plan ---------------------------------------------------

class PlacingCloud(FakeCloud):
    """A fake cloud with the placement protocol (``Places``): the placement step turns its
    offers into its targets; ``create_nodes`` records the targets it was handed."""

    title: ClassVar[str] = "Fake"
    regions_hint: ClassVar[str] = ""

    def __init__(self, name: str, fail_with: Exception | None = None) -> None:
        super().__init__(name, fail_with)
        self.handed: list[tuple[Any, ...]] = []

    def offers(self) -> list[Offer]:
        return [o for o in OFFERS if o.provider == self.name]

    def region_of(self, request: ClusterRequest) -> str | None:
        return request.resources.region

    def wanted_regions(self, request: ClusterRequest, region: str | None) -> list[str]:
        return [region] if region else []

    def target_of(self, offer: Offer, price: float | None) -> Any:
        from cloudtrain.provider import Target

        return Target(self.name, offer.region, offer.instance_type, price, tuple(offer.zones))

    def unpriced_target(self, request: ClusterRequest, region: str) -> Any:
        raise AssertionError("every type here has a price")

    def unlisted_targets(self, request: ClusterRequest, region: str | None,
                         offers: list[Offer]) -> list[Any]:
        return []

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        self.handed.append(request.targets)
        return super().create_nodes(request, network)


def test_the_offers_are_ranked_once_and_the_request_carries_the_targets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.pipeline.place import placed
    from cloudtrain.pipeline.plan import plan
    from cloudtrain.pipeline.provision import provision
    from cloudtrain.provider import Places

    ranked: list[int] = []
    real = ranking.rank
    monkeypatch.setattr(ranking, "rank", lambda *a, **k: ranked.append(1) or real(*a, **k))
    cloud = PlacingCloud("aws")
    assert isinstance(cloud, Places) and not isinstance(FakeCloud("aws"), Places)
    env = _env(tmp_path, {"aws": cloud})
    # a named cloud without a region: the planner ranks the offers once, across regions
    task = parse_task("name: job\nresources: {provider: aws, accelerators: A100:8}\n"
                      "run: x\n")
    p = plan(env, task, "job", offers=OFFERS)
    assert [(t.provider, t.region, t.price) for t in p.targets] == [
        ("aws", "us-east-1", 32.77), ("aws", "eu-west-1", 35.40)]
    assert p.targets[0].zones == ("use1-az1", "use1-az2")
    cloud.fail_with = CapacityError("no p4d.24xlarge in us-east-1")
    with pytest.raises(CapacityError):
        provision(env, task, "job", planned=p)
    assert len(ranked) == 1, "provision ranked the offers again"
    # each hop is handed its own target, in the plan's order
    assert cloud.handed == [p.targets[:1], p.targets[1:2]]
    # a task naming its cloud and region: the cloud's own offers, ranked once, carried
    pinned = parse_task("name: job2\nresources: {provider: aws, region: eu-west-1, "
                        "accelerators: A100:8}\nrun: x\n")
    ranked.clear()
    cloud.fail_with, cloud.handed = None, []
    q = plan(env, pinned, "job2")
    handle, _ = provision(env, pinned, "job2", planned=q)
    assert len(ranked) == 1 and handle.row.region == "eu-west-1"
    assert cloud.handed == [q.targets] and [t.region for t in q.targets] == ["eu-west-1"]
    # a request the pipeline did not place: placed() ranks the cloud's offers for it
    from cloudtrain.pipeline.plan import cluster_request

    req = placed(cloud, cluster_request(pinned, "job3", ""))
    assert req.targets == q.targets
