"""``cloudtrain gc``: find (and with -y remove) cloud resources cloudtrain tagged that no live
cluster owns: what a crash, a lost state directory or a killed ``up`` left behind.

Generic over providers: any provider with ``orphans(live, all_regions=, any_owner=)`` and
``remove(resources)`` takes part (aws, gcp, azure). Registered by commands/main.py like the
other command modules.

Only click is imported at module level.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from cloudtrain.commands.base import CONTEXT, guard, open_env


@click.command(name="gc", context_settings=CONTEXT)
@click.option("--provider", "provider_name", metavar="NAME",
              help="Only this provider (default: every installed cloud; those without "
                   "credentials are skipped with a note).")
@click.option("--all-regions", is_flag=True,
              help="Search every enabled region (default: the default region and the "
                   "regions of this machine's clusters).")
@click.option("--any-owner", is_flag=True,
              help="Also resources of another CLOUDTRAIN_HOME, user or machine, and those "
                   "an older cloudtrain tagged without a home id (careful: their live "
                   "clusters are unknown here and would be listed as orphans).")
@click.option("--force", is_flag=True,
              help="Also terminate instances that are still running (without it, gc only "
                   "lists them and prints the command that would).")
@click.option("-y", "--yes", is_flag=True, help="Remove what is listed without asking.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@guard
def gc(provider_name: str | None, all_regions: bool, any_owner: bool, force: bool,
       yes: bool, as_json: bool) -> None:
    """List resources tagged by this CLOUDTRAIN_HOME that no live cluster owns; remove them
    with -y (instances first, then security groups, key pairs, placement groups, volumes).
    Another home's resources (same user@host) are shown and left alone; a running
    instance is only terminated with --force."""
    _run(provider_name, all_regions, any_owner, yes, as_json, force)


# Instance states in which nothing runs any more (AWS, GCE, Azure spellings, lowercased).
_IDLE = {"terminated", "stopped", "stopping", "shutting-down", "deallocated", "deallocating",
         "suspended", "suspending"}
_INSTANCE_KINDS = {"instance", "virtual-machine"}


def _running(r: Any) -> bool:
    """An instance that may be running: every state but the idle ones (an unknown state
    counts as running)."""
    if r.kind not in _INSTANCE_KINDS:
        return False
    state = str(r.detail or "").strip().strip("[]").strip().lower()
    return state not in _IDLE


def _command(provider: str, all_regions: bool, any_owner: bool) -> str:
    return ("cloudtrain gc --provider " + provider + (" --all-regions" if all_regions else "")
            + (" --any-owner" if any_owner else "") + " --force -y")


def _run(provider_name: str | None, all_regions: bool, any_owner: bool, yes: bool,
         as_json: bool, force: bool = False) -> None:
    from cloudtrain import credentials
    from cloudtrain.provider import registry
    from cloudtrain.errors import AuthError, CloudtrainError, ProviderError, UserError
    from cloudtrain.ownership import relation

    env = open_env(quiet=as_json)
    names = [provider_name] if provider_name else registry.names()
    report: list[dict[str, Any]] = []
    failed: list[CloudtrainError] = []
    for name in names:
        cls = registry.provider_class(name)
        if not hasattr(cls, "orphans"):
            if provider_name:
                raise UserError(f"Provider '{name}' cannot list what it created.",
                                "gc works with cloud providers (e.g. --provider aws).")
            continue
        if not provider_name and not credentials.present(name) \
                and not registry.is_instance(name):
            env.ui.info(f"{name}: skipped, no credentials configured "
                        f"(to include it: {credentials.how_to(name)})")
            continue
        try:
            provider: Any = registry.get(name, env.pctx)
            live = {c.name for c in env.state.list_clusters() if c.provider == name}
            # Everything cloudtrain tagged; whose it is is decided here, not by the filter.
            every = provider.orphans(live, all_regions=all_regions, any_owner=True)
        except (AuthError, UserError) as exc:
            if provider_name:
                raise
            env.ui.info(f"{name}: skipped, {exc.message} {exc.hint}".rstrip())
            continue
        except ProviderError as exc:
            if provider_name:
                raise
            env.ui.error(f"{name}: could not list what cloudtrain tagged: {exc}")
            failed.append(exc)
            continue
        as_mark = getattr(provider, "owner_mark", lambda o: o)
        kinds = {id(r): relation(r.owner, provider.owner, as_mark) for r in every}
        found = [r for r in every if any_owner or kinds[id(r)] == "mine"]
        others = [r for r in every if r not in found and kinds[id(r)] in ("other-home", "legacy")]
        running = {(r.cluster, r.owner) for r in found if _running(r)}
        held = [] if force else [r for r in found if (r.cluster, r.owner) in running]
        collect = [r for r in found if not any(r is h for h in held)]
        for r in others:
            item = {"provider": name, **_as_dict(r), "left_alone": kinds[id(r)]}
            report.append(item)
        for r in found:
            report.append({"provider": name, **_as_dict(r)}
                          | ({"left_alone": "running"} if any(r is h for h in held) else {}))
        _show_others(env, name, others, kinds)
        if not found:
            env.ui.ok(f"{name}: nothing to collect")
            continue
        env.ui.info(f"{name}: {len(found)} resource(s) tagged by cloudtrain that no live "
                    "cluster owns:")
        for r in found:
            env.ui.info(f"  {r.text()}")
        if held:
            names_running = ", ".join(f"{r.id} (cluster {r.cluster})" for r in held
                                      if _running(r))
            env.ui.warn(f"{name}: still running, left alone without --force: {names_running}. "
                        f"To terminate them (and remove their clusters' other resources): "
                        f"{_command(name, all_regions, any_owner)}")
        if not collect:
            continue
        if not yes:
            if not sys.stdin.isatty() or as_json:
                env.ui.info("Run 'cloudtrain gc -y' to remove them."
                            if not held else f"Run 'cloudtrain gc --provider {name} -y' to "
                            "remove those not running.")
                continue
            if not click.confirm(f"Remove these {len(collect)} resource(s)?", default=False,
                                 err=True):
                continue
        provider.remove(collect)
        left = provider.orphans(live, all_regions=all_regions, any_owner=True)
        gone = {(r.region, r.kind, r.id) for r in collect} - {(r.region, r.kind, r.id) for r in left}
        for item in report:
            if item["provider"] == name:
                item["removed"] = (item["region"], item["kind"], item["id"]) in gone
        env.ui.ok(f"{name}: removed {len(gone)} resource(s)")
    if as_json:
        click.echo(json.dumps(report, indent=2))
    if failed:
        sys.exit(max(e.exit_code for e in failed))


def _show_others(env: Any, provider: str, others: list[Any], kinds: dict[int, str]) -> None:
    """Say what gc saw and leaves alone: another home's clusters, and what an older
    cloudtrain tagged without a home id (whose home cannot be told)."""
    homes = sorted({r.cluster for r in others if kinds[id(r)] == "other-home"})
    legacy = sorted({r.cluster for r in others if kinds[id(r)] == "legacy"})
    if homes:
        env.ui.info(f"{provider}: another home's, left alone (same user@host, another "
                    f"CLOUDTRAIN_HOME): cluster(s) {', '.join(homes)}. Run gc in that home, "
                    "or add --any-owner.")
    if legacy:
        env.ui.info(f"{provider}: tagged by an older cloudtrain without a home id, left alone "
                    f"(they may be another home's live clusters): cluster(s) "
                    f"{', '.join(legacy)}. Add --any-owner to collect them.")


def _as_dict(r: Any) -> dict[str, Any]:
    return {"region": r.region, "kind": r.kind, "id": r.id, "name": r.name, "cluster": r.cluster,
            "owner": r.owner, "created_at": r.created_at, "removed": False}


def register(cli: click.Group) -> None:
    """Add this module's commands to the top-level group."""
    cli.add_command(gc)
