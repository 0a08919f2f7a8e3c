"""The cluster's rules compose (cloudtrain/pipeline/rules.py): a launch keeps the budget or
makes it stricter, --no-budget and the budget command lift it, --down jobs accumulate, and
the budget a launch runs under is the stricter of the two."""

from __future__ import annotations

from cloudtrain.budget import Budget
from cloudtrain.pipeline import rules


def _launch(job: str, usd: float | None = None, *, no_budget: bool = False, down: bool = False,
            grace: float | None = None) -> rules.LaunchRules:
    return rules.LaunchRules(job, usd, "--max-cost", no_budget, down, grace)


def _apply(pol: dict, launch: rules.LaunchRules) -> dict:
    return dict(pol, **rules.compose(pol, launch))


def test_a_budget_is_kept_made_stricter_and_lifted_only_on_purpose() -> None:
    pol = _apply({}, _launch("a", 20.0, down=True))
    assert pol["max_cost_usd"] == 20.0 and pol["set_by"]["max_cost_usd"]["job"] == "a"
    pol = _apply(pol, _launch("b"))                               # no budget: kept
    assert pol["max_cost_usd"] == 20.0 and pol["set_by"]["max_cost_usd"]["job"] == "a"
    pol = _apply(pol, _launch("c", 50.0))                         # looser: kept
    assert pol["max_cost_usd"] == 20.0 and pol["set_by"]["max_cost_usd"]["job"] == "a"
    pol = _apply(pol, _launch("d", 5.0))                          # stricter: taken
    assert pol["max_cost_usd"] == 5.0 and pol["set_by"]["max_cost_usd"]["job"] == "d"
    assert rules.budget_words(pol) == "budget $5.0000 (set by launch d (--max-cost))"
    pol = dict(pol, **rules.budget_change(pol, 30.0))             # the command: any value
    assert rules.budget_words(pol) == "budget $30.0000 (set by budget --max-cost 30)"
    pol = _apply(pol, _launch("e", no_budget=True))
    assert pol["max_cost_usd"] is None and rules.budget_words(pol) == "no budget"
    # --down jobs accumulate; an attached one carries its grace; who set each is kept.
    assert pol["down_on_end"] == ["a"]
    pol = _apply(pol, _launch("f", down=True, grace=300.0))
    assert pol["down_on_end"] == ["a", "f"] and pol["followed"] == {"f": 300.0}
    view = rules.view(pol)
    assert [(d["job"], d["attached"], d["set_by"]["command"]) for d in view["down_on_end"]] == [
        ("a", False, "launch --down -d"), ("f", True, "launch --down")]


def test_the_budget_a_launch_runs_under() -> None:
    own = Budget(50.0, 2.0, "--hours")
    assert rules.in_force({}, own, False) == own
    assert rules.in_force({"max_cost_usd": 20.0}, own, False) == Budget(20.0, 2.0, "--hours")
    assert rules.in_force({"max_cost_usd": 20.0}, None, False) == Budget(20.0, None, "")
    assert rules.in_force({"max_cost_usd": 20.0}, Budget(5.0, 1.0, "x"), False).max_cost_usd == 5.0  # type: ignore[union-attr]
    assert rules.in_force({"max_cost_usd": 20.0}, None, True) is None
