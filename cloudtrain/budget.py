"""Budget guardrails for ``launch``: refuse what would cost more than the budget, and stop what
does.

The budget (``max_cost_usd`` in the task, or ``--max-cost``) is for the cluster, not for one
launch: what the cluster has already cost (an earlier launch on it, the time since it was
created) counts against it, because that is what the bill will show.

Before anything is created (or the job started on a cluster that exists), ``launch`` refuses
when ``spent so far + cluster $/h x hours`` exceeds the budget, ``hours`` coming from
``--hours`` or ``max_hours``. With a budget but no hours the estimate cannot be made, and
``launch`` refuses too rather than start something it cannot check.

While a foreground launch runs, :class:`Watch` (a thread) recomputes the cluster's accrued
cost from the usage ledger every ``CLOUDTRAIN_BUDGET_POLL`` seconds (default 5): it warns once
at 80 %, and at 100 % stops the job on every node; the launch then tears the cluster down
(with or without ``--down``), records "budget: $X of $Y" as the reason in the ledger and the
launch row, and exits with :data:`EXIT_CODE`.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from cloudtrain.errors import CloudtrainError, UserError
from cloudtrain.state import State
from cloudtrain.ui import UI

EXIT_CODE = 3
"""``launch`` exits with this when the budget was reached (job stopped, cluster torn down)."""
WARN_FRACTION = 0.8
DEFAULT_POLL = 5.0


def poll_interval() -> float:
    raw = os.environ.get("CLOUDTRAIN_BUDGET_POLL", "")
    try:
        value = float(raw) if raw else DEFAULT_POLL
    except ValueError:
        return DEFAULT_POLL
    return value if value > 0 else DEFAULT_POLL


def reason_text(accrued: float, budget: float) -> str:
    return f"budget: ${accrued:.4f} of ${budget:.4f}"


class BudgetExceeded(CloudtrainError):
    """The cluster's accrued cost reached its budget while the job ran."""

    exit_code = EXIT_CODE

    def __init__(self, cluster: str, accrued: float, budget: float) -> None:
        self.cluster = cluster
        self.accrued = accrued
        self.budget = budget
        self.reason = reason_text(accrued, budget)
        super().__init__(
            f"Budget reached: cluster '{cluster}' has cost ${accrued:.4f} of its "
            f"${budget:.4f} budget (max_cost_usd), so the job was stopped on every node and the "
            "cluster torn down.",
            "Raise max_cost_usd (or --max-cost) to go further; "
            "'cloudtrain cost-report' shows what each cluster cost.")


@dataclass(frozen=True)
class Budget:
    max_cost_usd: float
    hours: float | None
    hours_from: str       # "--hours" / "max_hours" / ""


def resolve(task_max_cost: float | None, task_max_hours: float | None, *,
            max_cost: float | None, hours: float | None, no_budget: bool) -> Budget | None:
    """The budget in force: ``--max-cost`` over the task's ``max_cost_usd``; none with
    ``--no-budget``."""
    if no_budget:
        if max_cost is not None:
            raise UserError("--no-budget and --max-cost contradict each other.", "Drop one of them.")
        return None
    limit = max_cost if max_cost is not None else task_max_cost
    if limit is None:
        return None
    if hours is not None:
        return Budget(limit, hours, "--hours")
    return Budget(limit, task_max_hours, "max_hours" if task_max_hours is not None else "")


def check_before_launch(b: Budget, *, cluster: str, price_per_node: float | None,
                        num_nodes: int, spent: float | None) -> float:
    """Raise :class:`UserError` (exit 2, nothing created) when the run may exceed the budget.
    Returns the estimate (spent so far + cluster $/h x hours)."""
    if price_per_node is None or spent is None:
        raise UserError(
            f"A budget of ${b.max_cost_usd:.2f} is set, but the hourly price of cluster "
            f"'{cluster}' is unknown, so its cost can be neither estimated nor watched.",
            "Pick resources with a known price, or launch with --no-budget to go without the guard.")
    if b.hours is None:
        raise UserError(
            f"A budget of ${b.max_cost_usd:.2f} is set (max_cost_usd), but not how long the run "
            "takes, so the estimate cannot be checked against it before anything is created.",
            "Add 'max_hours: H' to the task or pass --hours H; or --no-budget to launch without "
            "the guard.")
    rate = price_per_node * num_nodes
    estimate = spent + rate * b.hours
    if estimate > b.max_cost_usd + 1e-12:
        already = f" plus ${spent:.4f} the cluster has already cost" if spent > 0 else ""
        raise UserError(
            f"The estimate for {b.hours:g} h ({b.hours_from}) is ${estimate:.4f}: {num_nodes} "
            f"node(s) x ${price_per_node:.4f}/h{already}. That is more than the budget of "
            f"${b.max_cost_usd:.4f}, so nothing was launched.",
            "Raise max_cost_usd (or --max-cost), shorten max_hours (or --hours), or pick "
            "cheaper resources (resources.max_hourly_cost).")
    return estimate


class JobWatch(Protocol):
    """What watches a job beside it while it runs (``run_task``'s ``watch``): a budget
    :class:`Watch`, or ``launch --recover``'s HealthWatch (pipeline/recover_watch.py), which
    carries the budget watch along with its poll of the cloud."""

    exceeded: threading.Event

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def attach(self, stop: Callable[[str], None]) -> None: ...
    def detach(self) -> None: ...
    def error(self) -> BudgetExceeded: ...


class Watch:
    """Tracks a cluster's accrued cost while a job runs (a daemon thread).

    ``attach(stop)`` names what stops the job now running; at 100 % the watch calls it (and
    again on later polls while the job is still attached, for a node whose job started just
    after the first stop). The caller checks :attr:`exceeded` after the job returns and calls
    :meth:`error` for the exception to raise."""

    def __init__(self, state: State, cluster: str, budget: float, ui: UI, *,
                 poll: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.state, self.cluster, self.budget, self.ui = state, cluster, budget, ui
        self.poll = poll if poll is not None else poll_interval()
        self.clock = clock
        self.accrued = 0.0
        self.warned = False
        self.exceeded = threading.Event()
        self._stop: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def reason(self) -> str:
        return reason_text(self.accrued, self.budget)

    def start(self) -> None:
        self.state.set_budget(self.cluster, self.budget)
        self.check()
        self.ui.info(f"Budget: ${self.accrued:.4f} of ${self.budget:.4f} spent on "
                     f"'{self.cluster}' so far; a warning at {WARN_FRACTION:.0%}, and at 100% "
                     "the job is stopped and the cluster torn down.")
        self._thread = threading.Thread(target=self._loop, name="budget-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def attach(self, stop: Callable[[str], None]) -> None:
        with self._lock:
            self._stop = stop

    def detach(self) -> None:
        with self._lock:
            self._stop = None

    def _loop(self) -> None:
        while not self._done.wait(self.poll):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - a failed poll must not end the watch
                self.ui.warn(f"budget watch: {exc}")

    def check(self) -> None:
        """Poll once: recompute the accrued cost; warn at 80 %; stop the job at 100 %."""
        from cloudtrain.ledger import cluster_spend

        spent = cluster_spend(self.state, self.cluster, now=self.clock())
        if spent is None:
            return
        first_time = False
        with self._lock:
            if not self.exceeded.is_set():
                self.accrued = spent
            if not self.warned and spent >= WARN_FRACTION * self.budget:
                self.warned = True
                self.ui.warn(f"budget: '{self.cluster}' has cost ${spent:.4f}, "
                             f"{spent / self.budget:.0%} of its ${self.budget:.4f} budget; at 100% "
                             "the job is stopped and the cluster torn down.")
            if spent >= self.budget and not self.exceeded.is_set():
                self.exceeded.set()
                first_time = True
            stop = self._stop if self.exceeded.is_set() else None
        if first_time:
            self.ui.warn(f"{self.reason}: the budget of '{self.cluster}' is spent; stopping the "
                         "job on every node and tearing the cluster down.")
        if stop is not None:
            stop(self.reason)

    def error(self) -> BudgetExceeded:
        return BudgetExceeded(self.cluster, self.accrued, self.budget)
