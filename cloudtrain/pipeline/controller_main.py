"""The body of a detached recovery controller: ``python -m cloudtrain.pipeline.controller_main
ID`` (started by :func:`cloudtrain.pipeline.controllers.spawn`). It runs the same controller
as ``launch --recover`` with the record's task and options, writes its output to
controller.log and its final state to controller.json."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloudtrain.context import Env
    from cloudtrain.pipeline.request import Launch


def main(cid: str) -> int:
    from cloudtrain.context import open_env
    from cloudtrain.errors import CloudtrainError, Interrupted
    from cloudtrain.pipeline import controllers, job
    from cloudtrain.pipeline.signals import stop_signals_as_interrupt
    from cloudtrain.ui import UI

    stop_signals_as_interrupt()
    d = controllers.check_id(cid)
    rec = controllers.read(d)
    code, state, error = 1, "failed", None
    try:
        env = open_env(UI(quiet=False))
        outcome = job.launch(env, request(env, rec))
        assert outcome is not None    # attached: the controller is this process
        print(f"Job {outcome.job_id} succeeded on every node", flush=True)
        code, state = 0, "succeeded"
    except (Interrupted, KeyboardInterrupt):
        code = 130
        state = "cancelled" if (d / "cancel-requested").exists() else "failed"
        error = "cancelled" if state == "cancelled" else "interrupted by a signal"
    except CloudtrainError as exc:
        code, error = exc.exit_code, exc.message
        print(f"error: {exc.message}" + (f"\n{exc.hint}" if exc.hint else ""), flush=True)
    finally:
        rec = controllers.read(d)
        rec.update(state=state, exit_code=code, error=error, ended_at=time.time())
        controllers.write(d, rec)
    return code


def request(env: Env, rec: dict[str, Any]) -> Launch:
    """The launch a controller's record describes: its task and command line, resolved
    again, attached (this process is the controller) and asking nobody."""
    from cloudtrain import budget
    from cloudtrain.pipeline import plan
    from cloudtrain.pipeline.request import CommandLine, Launch
    from cloudtrain.provider.options import load_checked

    task = load_checked(rec["task_file"])
    limit = budget.resolve(task.max_cost_usd, task.max_hours, max_cost=rec["max_cost"],
                           hours=rec["hours"], no_budget=rec["no_budget"])
    name = rec["cluster"]
    planned = plan.plan(env, task, name)
    return Launch(task, name, planned, down_after=rec["down_after"],
                  overrides=rec["overrides"], budget=limit, no_budget=rec["no_budget"],
                  recover=True, command_line=CommandLine(rec["task_file"], rec["max_cost"],
                                                         rec["hours"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
