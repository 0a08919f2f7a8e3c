"""Collect what cloudtrain tagged and no live cluster owns: what a crash, a lost state
directory or a killed ``up`` left behind (``cloudtrain gc``).

Generic over providers: any provider with ``orphans(live, all_regions=, any_owner=)`` and
``remove(resources)`` takes part (aws, gcp, azure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from cloudtrain import credentials
from cloudtrain.context import Env
from cloudtrain.errors import AuthError, CloudtrainError, ProviderError, UserError
from cloudtrain.ownership import relation
from cloudtrain.provider.contract import CollectsOrphans, MarksOwner

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


@dataclass(frozen=True)
class Sweep:
    """What one ``cloudtrain gc`` looks for: ``provider`` (None: every installed cloud with
    its SDK and credentials; the others are skipped with a note), every region or the usual
    ones, another home's resources too (``any_owner``), running instances too (``force``)."""

    provider: str | None = None
    all_regions: bool = False
    any_owner: bool = False
    force: bool = False

    def command(self, provider: str) -> str:
        """The gc command line that would also take the running instances."""
        return ("cloudtrain gc --provider " + provider
                + (" --all-regions" if self.all_regions else "")
                + (" --any-owner" if self.any_owner else "") + " --force -y")


Confirm = Callable[[int], bool]
"""Asked with the number of resources before they are removed (True: remove them)."""


def collect(env: Env, sweep: Sweep, *, yes: bool, confirm: Confirm | None
            ) -> tuple[list[dict[str, Any]], list[CloudtrainError]]:
    """List, per provider of ``sweep``, what cloudtrain tagged that no live cluster owns, and
    remove it with ``yes`` (or when ``confirm(count)`` says so; ``confirm`` None: nobody can
    be asked, the command to run is said instead). Running instances are left alone without
    ``sweep.force``; another home's resources unless ``sweep.any_owner``. Returns every
    resource seen (each with whether it was removed, or why it was left alone) and the
    providers' errors (the other providers are still collected)."""
    report: list[dict[str, Any]] = []
    failed: list[CloudtrainError] = []
    for name in _providers(env, sweep):
        try:
            provider: Any = env.provider(name)
            live = {c.name for c in env.state.list_clusters() if c.provider == name}
            # Everything cloudtrain tagged; whose it is is decided here, not by the filter.
            every = provider.orphans(live, all_regions=sweep.all_regions, any_owner=True)
        except (AuthError, UserError) as exc:
            if sweep.provider:
                raise
            env.ui.info(f"{name}: skipped, {exc.message} {exc.hint}".rstrip())
            continue
        except ProviderError as exc:
            if sweep.provider:
                raise
            env.ui.error(f"{name}: could not list what cloudtrain tagged: {exc}")
            failed.append(exc)
            continue
        report += _sweep_one(env, sweep, name, provider, live, every, yes=yes, confirm=confirm)
    return report, failed


def _providers(env: Env, sweep: Sweep) -> Iterator[str]:
    """The providers this sweep asks, in turn (an explicit one that cannot collect: exit 2),
    once the clusters whose nodes stopped themselves are reconciled; each skipped one is said
    when its turn comes."""
    names = [sweep.provider] if sweep.provider else env.provider_names()
    if sweep.provider:
        env.require_sdk(sweep.provider)   # exit 2 with the pip line
    _reconcile(env, [n for n in names if env.sdk_missing(n) is None])
    for name in names:
        if not issubclass(env.provider_class(name), CollectsOrphans):
            if sweep.provider:
                raise UserError(f"Provider '{name}' cannot list what it created.",
                                "gc works with cloud providers (e.g. --provider aws).")
        elif env.sdk_missing(name) is not None:
            env.ui.info(f"{name}: skipped, its SDK is not installed (to include it: pip "
                        f"install 'cloudtrain[{name}]')")
        elif not sweep.provider and not env.has_credentials(name):
            env.ui.info(f"{name}: skipped, no credentials configured "
                        f"(to include it: {credentials.how_to(name)})")
        else:
            yield name


def _sweep_one(env: Env, sweep: Sweep, name: str, provider: Any, live: set[str],
               every: list[Any], *, yes: bool, confirm: Confirm | None) -> list[dict[str, Any]]:
    """One provider's part of the sweep: what it found, said, and removed when allowed."""
    as_mark = provider.owner_mark if isinstance(provider, MarksOwner) else (lambda o: o)
    kinds = {id(r): relation(r.owner, provider.owner, as_mark) for r in every}
    found = [r for r in every if sweep.any_owner or kinds[id(r)] == "mine"]
    others = [r for r in every if r not in found and kinds[id(r)] in ("other-home", "legacy")]
    running = {(r.cluster, r.owner) for r in found if _running(r)}
    held = [] if sweep.force else [r for r in found if (r.cluster, r.owner) in running]
    removable = [r for r in found if not any(r is h for h in held)]
    report = [{"provider": name, **_as_dict(r), "left_alone": kinds[id(r)]} for r in others]
    report += [{"provider": name, **_as_dict(r)}
               | ({"left_alone": "running"} if any(r is h for h in held) else {})
               for r in found]
    _show_others(env, name, others, kinds)
    if not found:
        env.ui.ok(f"{name}: nothing to collect")
        return report
    _show_found(env, sweep, name, found, held)
    if not removable or not _approved(env, name, len(removable), bool(held), yes, confirm):
        return report
    provider.remove(removable)
    left = provider.orphans(live, all_regions=sweep.all_regions, any_owner=True)
    gone = {(r.region, r.kind, r.id) for r in removable} - {(r.region, r.kind, r.id) for r in left}
    for item in report:
        item["removed"] = (item["region"], item["kind"], item["id"]) in gone
    env.ui.ok(f"{name}: removed {len(gone)} resource(s)")
    return report


def _show_found(env: Env, sweep: Sweep, name: str, found: list[Any], held: list[Any]) -> None:
    env.ui.info(f"{name}: {len(found)} resource(s) tagged by cloudtrain that no live "
                "cluster owns:")
    for r in found:
        env.ui.info(f"  {r.text()}")
    if held:
        names_running = ", ".join(f"{r.id} (cluster {r.cluster})" for r in held if _running(r))
        env.ui.warn(f"{name}: still running, left alone without --force: {names_running}. "
                    f"To terminate them (and remove their clusters' other resources): "
                    f"{sweep.command(name)}")


def _approved(env: Env, name: str, count: int, held: bool, yes: bool,
              confirm: Confirm | None) -> bool:
    """Whether the ``count`` removable resources go: -y, or the user said so."""
    if yes:
        return True
    if confirm is None:
        env.ui.info("Run 'cloudtrain gc -y' to remove them."
                    if not held else f"Run 'cloudtrain gc --provider {name} -y' to "
                    "remove those not running.")
        return False
    return confirm(count)


def _reconcile(env: Env, providers: list[str]) -> None:
    """Clusters of these providers whose nodes stopped themselves (the node guard) are torn
    down first, so what their self-stop left is removed as theirs, not as orphans."""
    from cloudtrain.pipeline import guard

    for row in env.state.list_clusters():
        if row.provider in providers:
            try:
                guard.reconcile(env, row.name)
            except CloudtrainError as exc:
                env.ui.warn(f"'{row.name}': checking with {row.provider} failed: {exc}")


def _show_others(env: Env, provider: str, others: list[Any], kinds: dict[int, str]) -> None:
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
