"""What every command shares: the click context settings, the one guard (our errors become a
one-paragraph message and their exit code, Ctrl-C becomes 130), the one way to open the
:class:`~cloudtrain.context.Env`, and small option helpers.

Only click is imported at module level (``cloudtrain --help`` stays fast).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import click

if TYPE_CHECKING:
    from cloudtrain.context import Env
    from cloudtrain.provider.contract import Plan, Provider
    from cloudtrain.taskmodel import Task

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def fail(exc: BaseException) -> NoReturn:
    """Print our error (message and hint) and exit with its code; anything else propagates."""
    from cloudtrain.errors import CloudtrainError

    if isinstance(exc, CloudtrainError):
        text = exc.message + (f"\n{exc.hint}" if exc.hint else "")
        prefix = "error: " if exc.exit_code != 130 else ""
        click.echo(prefix + text, err=True)
        sys.exit(exc.exit_code)
    raise exc


def guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our errors into a one-paragraph message and the right exit code; Ctrl-C into 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from cloudtrain.errors import CloudtrainError, Interrupted

        try:
            return fn(*args, **kwargs)
        except CloudtrainError as exc:
            fail(exc)
        except ModuleNotFoundError as exc:   # a cloud's SDK, imported deep in its provider
            from cloudtrain.provider.registry import sdk_error

            missing = sdk_error(exc)
            if missing is None:
                raise
            fail(missing)
        except KeyboardInterrupt:
            fail(Interrupted("Interrupted."))

    return wrapper


def open_env(quiet: bool = False, contact: bool = True) -> Env:
    """The Env a command hands to the pipeline (``contact=False``: a command that reaches no
    node, e.g. a plain ``status``, which then skips the SSH settings' check and import), with
    the provider instances the program running the command line handed it (see
    :func:`handed_providers`)."""
    from cloudtrain.context import open_env as open_context
    from cloudtrain.ui import UI

    if contact:
        from cloudtrain.connection import node_timeout
        from cloudtrain.pipeline.policy import guard_poll
        from cloudtrain.sshmux import persist_seconds

        node_timeout()   # a bad CLOUDTRAIN_NODE_TIMEOUT is refused before anything is created
        persist_seconds()   # the same for CLOUDTRAIN_SSH_PERSIST
        guard_poll()   # and CLOUDTRAIN_GUARD_POLL
    return open_context(UI(quiet=quiet), handed_providers())


def handed_providers() -> Mapping[str, Provider]:
    """Provider instances by name, handed to the command line by the program that runs it in
    its own process as click's context object (``cli.main(args, obj={"aws": provider})``; a
    test: ``CliRunner().invoke(cli, args, obj={"aws": MemoryProvider("aws")})``). From the
    shell: none."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.obj if ctx is not None else None
    return obj if isinstance(obj, Mapping) else {}


def load_task(task_file: str) -> Task:
    from cloudtrain.provider.options import load_checked

    return show_notes(load_checked(task_file))


def show_notes(task: Task) -> Task:
    """What reading the task noted (SkyPilot's fields read as ours: cloudtrain.skytask), one
    ``note:`` line each on stderr."""
    for note in task.notes:
        click.echo(f"note: {note}", err=True)
    return task


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """Option callback: reject nan and inf, which click's FloatRange lets through."""
    import math

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number.", ctx, param)
    return value


def check_name(name: str, what: str = "CLUSTER_NAME") -> None:
    """The one cluster-name rule, before the name reaches a path, a filter or a provider."""
    from cloudtrain.names import check

    check(name, what)


def confirm_cost(plan: Plan, yes: bool) -> None:
    """Ask before a new cluster is paid for (not with -y, a free plan, or no terminal)."""
    from cloudtrain.errors import Interrupted

    price = plan.hourly_price_per_node
    if yes or not price or not sys.stdin.isatty():
        return
    total = price * plan.num_nodes
    if not click.confirm(f"This cluster costs about ${total:.2f}/hour while it runs. Continue?",
                         default=True, err=True):
        raise Interrupted("Cancelled; nothing was created.")
