"""``cloudtrain gc``: find (and with -y remove) cloud resources cloudtrain tagged that no live
cluster owns: what a crash, a lost state directory or a killed ``up`` left behind.

Generic over providers: any provider with ``orphans(live, all_regions=, any_owner=)`` and
``remove(resources)`` takes part (aws, gcp, azure). Registered by cli.py like the other
command modules.

Only click is imported at module level.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def register(cli: click.Group) -> None:
    from cloudtrain.cli import _guard

    @cli.command(name="gc", context_settings=CONTEXT)
    @click.option("--provider", "provider_name", metavar="NAME",
                  help="Only this provider (default: every installed provider that can list "
                       "what it tagged).")
    @click.option("--all-regions", is_flag=True,
                  help="Search every enabled region (default: the default region and the "
                       "regions of this machine's clusters).")
    @click.option("--any-owner", is_flag=True,
                  help="Also resources another user or machine created (careful: their live "
                       "clusters are unknown here and would be listed as orphans).")
    @click.option("-y", "--yes", is_flag=True, help="Remove what is listed without asking.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
    @_guard
    def gc(provider_name: str | None, all_regions: bool, any_owner: bool, yes: bool,
           as_json: bool) -> None:
        """List resources tagged by cloudtrain that no live cluster owns; remove them with -y
        (instances first, then security groups, key pairs, placement groups, volumes)."""
        _run(provider_name, all_regions, any_owner, yes, as_json)


def _run(provider_name: str | None, all_regions: bool, any_owner: bool, yes: bool,
         as_json: bool) -> None:
    from cloudtrain import registry
    from cloudtrain.cli import _env
    from cloudtrain.errors import UserError

    env = _env(quiet=as_json)
    names = [provider_name] if provider_name else registry.names()
    report: list[dict[str, Any]] = []
    for name in names:
        cls = registry.provider_class(name)
        if not hasattr(cls, "orphans"):
            if provider_name:
                raise UserError(f"Provider '{name}' cannot list what it created.",
                                "gc works with cloud providers (e.g. --provider aws).")
            continue
        provider: Any = registry.get(name, env.pctx)
        live = {c.name for c in env.state.list_clusters() if c.provider == name}
        found = provider.orphans(live, all_regions=all_regions, any_owner=any_owner)
        report += [{"provider": name, **_as_dict(r)} for r in found]
        if not found:
            env.ui.ok(f"{name}: nothing to collect")
            continue
        env.ui.info(f"{name}: {len(found)} resource(s) tagged by cloudtrain that no live "
                    "cluster owns:")
        for r in found:
            env.ui.info(f"  {r.text()}")
        if not yes:
            if not sys.stdin.isatty() or as_json:
                env.ui.info("Run 'cloudtrain gc -y' to remove them.")
                continue
            if not click.confirm(f"Remove these {len(found)} resource(s)?", default=False,
                                 err=True):
                continue
        provider.remove(found)
        left = provider.orphans(live, all_regions=all_regions, any_owner=any_owner)
        gone = {(r.region, r.kind, r.id) for r in found} - {(r.region, r.kind, r.id) for r in left}
        for item in report:
            if item["provider"] == name:
                item["removed"] = (item["region"], item["kind"], item["id"]) in gone
        env.ui.ok(f"{name}: removed {len(gone)} resource(s)")
    if as_json:
        click.echo(json.dumps(report, indent=2))


def _as_dict(r: Any) -> dict[str, Any]:
    return {"region": r.region, "kind": r.kind, "id": r.id, "name": r.name, "cluster": r.cluster,
            "owner": r.owner, "created_at": r.created_at, "removed": False}
