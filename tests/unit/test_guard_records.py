"""The guard's records at their JSON edge (issue 22): the policy the CLI writes to the nodes
(pipeline/policy.py) and the last-seen view a plain ``status`` renders (pipeline/lastseen.py)
are frozen records; ``as_dict()`` is the JSON, and a policy read back from its file is the
same record."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cloudtrain.pipeline.lastseen import View
from cloudtrain.pipeline.policy import Policy


def test_a_policy_round_trips_through_its_json_and_keeps_what_it_does_not_know() -> None:
    pol = Policy(cluster="c", idle_minutes=30.0, down=False, max_hours=2.0, grace_s=60.0,
                 down_on_end=("j1",), followed={"j1": 300.0},
                 set_by={"max_cost_usd": {"command": "launch", "job": "j1", "at": 1.0}},
                 max_cost_usd=5.0, budget_grace_s=60.0, started_at=1.0, lease_at=2.0,
                 cluster_hourly_usd=1.5, spent_usd=0.25, spent_at=2.0,
                 extra={"from_a_later_version": [1, 2]})
    data = json.loads(json.dumps(pol.as_dict()))
    assert data["down_on_end"] == ["j1"] and data["followed"] == {"j1": 300.0}
    assert data["from_a_later_version"] == [1, 2]
    assert Policy.from_dict(data) == pol


def test_a_damaged_policy_file_reads_as_the_fields_that_make_sense() -> None:
    pol = Policy.from_dict({"idle_minutes": "soon", "down_on_end": "j1", "followed": [1],
                            "max_cost_usd": True, "spent_usd": None})
    assert pol.idle_minutes is None and pol.down_on_end == () and pol.followed == {}
    assert pol.max_cost_usd is None and pol.spent_usd == 0.0 and pol.down is True


def test_a_policy_is_frozen_and_changed_returns_a_new_one() -> None:
    pol = Policy(cluster="c")
    with pytest.raises(dataclasses.FrozenInstanceError):
        pol.__setattr__("max_cost_usd", 3.0)
    assert pol.changed(down_on_end=["a"], max_cost_usd=3.0) == Policy(
        cluster="c", down_on_end=("a",), max_cost_usd=3.0)
    assert pol.max_cost_usd is None


def test_the_view_says_only_what_is_known() -> None:
    pol = {"idle_minutes": 10, "down": True, "max_cost_usd": 2.0}
    bare = View.of(pol)
    assert bare.as_dict() == {"autostop": {"idle_minutes": 10, "down": True, "down_on_end": None,
                                           "max_cost_usd": 2.0, "max_hours": None},
                              "policy": "autostop: tear down after 10 min idle; budget $2.0000"}
    full = dataclasses.replace(bare, guard={"words": "idle"}, gpus=[], gpus_at=5.0,
                               expected_stop={"at": 9.0}, stale=True).as_dict()
    assert full["guard"] == {"words": "idle"} and full["gpus"] == [] and full["gpus_at"] == 5.0
    assert full["expected_stop"] == {"at": 9.0} and full["stale"] is True
