"""``cloudtrain forward``, ``tensorboard`` and ``ssh-config``: reaching a cluster from the
laptop with plain OpenSSH (docs/ssh.md).

Only click is imported at module level; each command imports what it needs when it runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

import click

from cloudtrain.commands.base import CONTEXT, check_name, guard, open_env

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.context import Env


def ssh_config_choice(ask: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--ssh-config/--no-ssh-config`` for ``up`` (``ask``: with neither flag, an interactive
    up asks once) and ``launch``: once the command is over and a cluster's SSH config file was
    written, the Include line is added to ~/.ssh/config (or not) as chosen."""

    def chosen(ctx: click.Context, param: click.Parameter, value: bool | None) -> None:
        ctx.call_on_close(lambda: offer_include(value, ask))

    return click.option("--ssh-config/--no-ssh-config", "ssh_config", default=None,
                        expose_value=False, callback=chosen,
                        help="Add (or not) one Include line to ~/.ssh/config so that 'ssh NAME', "
                             "scp, rsync and VS Code reach the cluster (docs/ssh.md).")


def offer_include(choice: bool | None, ask: bool) -> None:
    from cloudtrain import sshconfig
    from cloudtrain.errors import CloudtrainError
    from cloudtrain.paths import home, home_path

    if not sshconfig.written_here(home_path()):
        return   # no cluster came up (or it was rolled back)
    interactive = ask and sys.stdin.isatty() and sys.stderr.isatty()
    try:
        said = sshconfig.after_up(home(), choice, (lambda q: click.confirm(
            q, default=True, err=True)) if interactive else None)
    except CloudtrainError as exc:
        said = f"warning: {exc.message}" + (f"\n{exc.hint}" if exc.hint else "")
    if said:
        click.echo(said, err=True)


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name", required=False)
@click.argument("port", required=False, metavar="PORT[:LOCAL]")
@click.option("-p", "--port", "more", multiple=True, metavar="PORT[:LOCAL]",
              help="Another port to forward (repeatable).")
@click.option("--node", "node", type=int, default=0, show_default=True, help="Node rank.")
@click.option("--background", is_flag=True, help="Start it detached and return.")
@click.option("--list", "list_", is_flag=True, help="List the background forwards.")
@click.option("--stop", "stop", is_flag=True, help="Stop CLUSTER_NAME's background forwards.")
@click.option("--all", "all_", is_flag=True, help="With --stop: every background forward.")
@guard
def forward(cluster_name: str | None, port: str | None, more: tuple[str, ...], node: int,
            background: bool, list_: bool, stop: bool, all_: bool) -> None:
    """Forward a port of a node to this machine through SSH, until Ctrl-C.

    The node's 127.0.0.1:PORT is served on this machine's 127.0.0.1:LOCAL (default: the same
    port) by the system ssh client, with the cluster's key and pinned host key. No firewall
    port is opened. Local port in use: exit 2.

    \b
    Examples:
      cloudtrain forward train-1 8888              Jupyter on the head, at localhost:8888
      cloudtrain forward train-1 6006:16006 --node 1 --background
      cloudtrain forward --list
      cloudtrain forward --stop train-1            (or --stop --all)"""
    from cloudtrain.pipeline import forward as tunnels

    if list_ or stop:
        manage(cluster_name, list_, all_)
        return
    name, pairs = wanted_ports(cluster_name, port, more)
    handle, env = cluster_handle(name)
    rank = node_rank(handle, node)
    if background:
        rec = tunnels.background(env, handle, rank, pairs)
        for p in pairs:
            env.ui.ok(f"http://127.0.0.1:{p[1]}/ -> '{handle.name}' node {rank} port {p[0]} "
                      f"(pid {rec.pid}; stop: cloudtrain forward --stop {handle.name})")
        return
    tunnels.foreground(env, handle, rank, pairs, kept_alive(env, handle.name))


def wanted_ports(cluster_name: str | None, port: str | None,
                 more: tuple[str, ...]) -> tuple[str, list[tuple[int, int]]]:
    """The cluster's name and (node port, local port) for PORT[:LOCAL] and every -p, checked
    before anything runs."""
    from cloudtrain.errors import UserError
    from cloudtrain.pipeline import forward as tunnels

    if cluster_name is None or port is None:
        raise UserError("Give the cluster and the port: cloudtrain forward NAME PORT[:LOCAL].",
                        "Or --list / --stop NAME. See 'cloudtrain forward --help'.")
    return cluster_name, [tunnels.parse_port(s, w)
                          for s, w in [(port, "PORT"), *[(m, "-p") for m in more]]]


def cluster_handle(cluster_name: str) -> tuple[Handle, Env]:
    from cloudtrain.cluster import get_handle

    check_name(cluster_name)
    env = open_env()
    return get_handle(env, cluster_name), env


def kept_alive(env: Env, name: str) -> Callable[[], None]:
    """While a forward lasts, the cluster's idle stop waits (as for 'cloudtrain ssh')."""
    from cloudtrain.pipeline import guard as node_guard

    return node_guard.keep_alive(env, name)


def node_rank(handle: Handle, node: int) -> int:
    from cloudtrain.errors import UserError

    if node not in [n.rank for n in handle.nodes]:
        raise UserError(f"--node {node}: cluster '{handle.name}' has no such node.",
                        f"Its nodes are 0..{len(handle.nodes) - 1}.")
    return node


def manage(cluster_name: str | None, list_: bool, all_: bool) -> None:
    """``forward --list`` and ``forward --stop NAME|--all``."""
    from cloudtrain.errors import UserError
    from cloudtrain.paths import home
    from cloudtrain.pipeline import forward as tunnels

    if cluster_name is not None:
        check_name(cluster_name)
    if list_:
        recs = tunnels.listed(home(), cluster_name)
        for r in recs:
            ports = ", ".join(f"127.0.0.1:{local} -> {remote}" for remote, local in r.ports)
            click.echo(f"{r.cluster}  node {r.node}  pid {r.pid}  {ports}")
        if not recs:
            click.echo("No background forwards.", err=True)
        return
    if cluster_name is None and not all_:
        raise UserError("--stop needs a cluster name or --all.",
                        "e.g. cloudtrain forward --stop train-1")
    n = tunnels.stop(home(), None if all_ else cluster_name)
    click.echo(f"Stopped {n} forward(s).", err=True)


@click.command(context_settings=CONTEXT)
@click.argument("cluster_name")
@click.option("--logdir", default=".", show_default=True,
              help="Event files' folder on the head (relative: to the synced workdir).")
@click.option("--port", "port", type=click.IntRange(1, 65535), default=6006, show_default=True,
              help="The port on this machine (on the head: 6006, or a free one when taken).")
@click.option("--background", is_flag=True, help="Forward in the background and return.")
@guard
def tensorboard(cluster_name: str, logdir: str, port: int, background: bool) -> None:
    """Start TensorBoard on the head (when not running there) and forward it here.

    TensorBoard runs from the head's Python (the one bootstrap recorded), bound to the node's
    127.0.0.1; the SSH forward serves it at http://127.0.0.1:PORT/ until Ctrl-C. No firewall
    port is opened. The node's Python needs the tensorboard package (add it to setup).

    \b
    Example:
      cloudtrain tensorboard train-1 --logdir runs"""
    from cloudtrain.pipeline import forward as tunnels

    handle, env = cluster_handle(cluster_name)
    tunnels.check_free([(port, port)])
    remote = tunnels.tensorboard(env, handle, logdir)
    env.ui.ok(f"TensorBoard runs on '{cluster_name}' node {handle.head.rank} (port {remote}).")
    if background:
        tunnels.background(env, handle, handle.head.rank, [(remote, port)])
        click.echo(f"http://127.0.0.1:{port}/")
        return
    click.echo(f"http://127.0.0.1:{port}/  (Ctrl-C stops the forward; TensorBoard keeps running)")
    tunnels.foreground(env, handle, handle.head.rank, [(remote, port)],
                       kept_alive(env, handle.name))


@click.command(name="ssh-config", context_settings=CONTEXT)
@click.argument("action", type=click.Choice(["install", "uninstall", "show"]))
@guard
def ssh_config(action: str) -> None:
    """Add (install) or remove (uninstall) the one Include line in ~/.ssh/config that makes
    'ssh NAME', 'ssh NAME-RANK', scp, rsync and VS Code Remote-SSH reach your clusters.

    Each cluster's entries live in their own file under $CLOUDTRAIN_HOME/ssh/, written at
    'up' and removed at 'down'; uninstall leaves ~/.ssh/config as it was. 'show' prints the
    Include line to add by hand.

    \b
    Example:
      cloudtrain ssh-config install && ssh train-1 nvidia-smi"""
    from cloudtrain import sshconfig
    from cloudtrain.paths import home

    if action == "show":
        click.echo(sshconfig.include_block(home()), nl=False)
        return
    said = sshconfig.install(home()) if action == "install" else sshconfig.uninstall(home())
    click.echo(said, err=True)


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    for command in (forward, tensorboard, ssh_config):
        cli.add_command(command)
