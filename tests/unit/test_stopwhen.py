"""When the recorded rules must have stopped a cluster (cloudtrain/pipeline/stopwhen.py), and
what kept the nodes busy in words (lastseen.busy_reasons): what a plain ``status`` says
offline (docs/guard.md, "status")."""

from __future__ import annotations

from cloudtrain.pipeline.lastseen import busy_reasons
from cloudtrain.pipeline.stopwhen import expected

T0 = 1_800_000_000.0


def test_lifetime_from_creation() -> None:
    assert expected({"max_hours": 2, "started_at": T0}, {}) == (T0 + 7200, "lifetime")


def test_budget_at_the_recorded_price_after_the_spend_then() -> None:
    pol = {"max_cost_usd": 10.0, "cluster_hourly_usd": 4.0, "spent_usd": 2.0, "spent_at": T0,
           "budget_grace_s": 60}
    assert expected(pol, {}) == (T0 + 2 * 3600 + 60, "budget")
    assert expected(dict(pol, cluster_hourly_usd=0.0), {}) is None     # free: never reached


def test_idle_needs_a_contact_after_which_nothing_ran() -> None:
    pol = {"idle_minutes": 10, "lease_at": T0}
    assert expected(pol, {"at": T0, "idle_at": None}) is None   # a launch: a job may run
    assert expected(pol, {"at": T0, "idle_at": T0}) == (T0 + 600, "idle")
    # a later contact (exec, logs) only moves it on
    assert expected(pol, {"at": T0 + 100, "idle_at": T0}) == (T0 + 700, "idle")
    # the end of the last launch the CLI saw (none running or queued) is such a moment too
    assert expected(pol, {"at": T0, "idle_at": None}, {"j1": T0 + 50}) == (T0 + 650, "idle")


def test_job_end_seen_and_the_earliest_rule_wins() -> None:
    pol = {"down_on_end": ["j1"], "job_end_grace_s": 0, "max_hours": 1, "started_at": T0}
    assert expected(pol, {}, {"j1": T0 + 60}) == (T0 + 60, "job-end")
    assert expected(pol, {}, {"j2": T0 + 60}) == (T0 + 3600, "lifetime")


def test_hosts_that_are_never_powered_off_have_no_expected_stop() -> None:
    assert expected({"max_hours": 1, "started_at": T0}, {}, powers_off=False) is None
    assert expected({}, {"at": T0, "idle_at": T0}) is None


def test_busy_words_name_jobs_sessions_and_the_queue() -> None:
    a = {"busy": True, "job_ids": ["3f2a"], "ssh_tty": 0, "ssh_notty": 1, "queued": 0}
    b = {"busy": True, "job_ids": ["3f2a"], "ssh_tty": 1, "ssh_notty": 1, "queued": 2}
    assert busy_reasons([a]) == ["job 3f2a", "1 ssh session (no tty)"]
    assert busy_reasons([a, b]) == ["job 3f2a", "1 ssh session", "2 ssh sessions (no tty)",
                                    "2 queued jobs"]
    old = {"busy": True, "jobs": 0, "ssh_sessions": 1}              # a guard of before
    assert busy_reasons([old]) == ["1 ssh session"]
