"""What one ``cloudtrain launch`` asks for, as one typed, frozen record: built once by the
command (``commands/jobs.py``), handed to :func:`cloudtrain.pipeline.job.launch` (the only
launch chain), and rebuilt by a background recovery controller from its record
(``pipeline/controller_main.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from cloudtrain.budget import Budget
from cloudtrain.provider.contract import Plan

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


def no_confirm(plan: Plan) -> None:
    """A launch that asks nobody before a new cluster is paid for (-y, a background
    controller)."""


@dataclass(frozen=True)
class CommandLine:
    """The command line's own values, which a background controller (``-d --recover``) is
    started with and resolves again: the task file, --max-cost, --hours."""

    task_file: str
    max_cost: float | None = None
    hours: float | None = None


@dataclass(frozen=True)
class Launch:
    """One launch: run ``task`` on cluster ``name`` as ``plan`` places it."""

    task: Task
    name: str
    plan: Plan
    down_after: bool = False
    """--down: tear the cluster down after the run, whatever happened."""
    detach: bool = False
    overrides: Mapping[str, str] = field(default_factory=dict)
    """--env K=V."""
    budget: Budget | None = None
    """The launch's own budget (the task's max_cost_usd, or --max-cost); the cluster's rules
    may make it stricter (pipeline/rules.py)."""
    no_budget: bool = False
    now: bool = False
    """--now: refuse (exit 2) instead of waiting the job's turn in the cluster's queue."""
    recover: bool = False
    """--recover (or ``recovery:`` in the task): replace the nodes the cloud takes."""
    confirm: Callable[[Plan], None] = no_confirm
    """Asked before a new cluster is paid for."""
    command_line: CommandLine | None = None
    preflight: bool | None = None
    """--preflight (True), --no-preflight (False); None: before the first multi-node launch."""

    @property
    def provider(self) -> str:
        """The provider the cluster is (or will be) on."""
        return self.plan.provider or self.task.resources.provider or "local"
