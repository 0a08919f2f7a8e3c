"""Teardown: stop what a cluster runs on its nodes, terminate it, then ask the provider
again (a cluster is down only when its provider lists none of its nodes), forget it locally;
without a local record, find it by its tag. :func:`down_shielded` is the teardown after
``launch --down``, which no signal cuts off half-way."""

from __future__ import annotations

import os
import shutil

from cloudtrain import sshmux
from cloudtrain.cluster import Handle, cluster_lock, cluster_uid, connect, lost_record_hint
from cloudtrain.containers import runtime
from cloudtrain.context import Env
from cloudtrain.errors import CloudtrainError, ClusterNotFound, ProviderError, UserError
from cloudtrain.keys import ClusterKeys
from cloudtrain.pipeline import bootstrap, forward, outputs
from cloudtrain.pipeline.outputs import Unpulled
from cloudtrain.pipeline.signals import Shielded
from cloudtrain.provider.contract import CollectsOrphans, Provider
from cloudtrain.remote import Group


def kill_command(job_dir: str, marker: str, grace: float = 5) -> str:
    seconds = f"{grace:.3f}".rstrip("0").rstrip(".") or "0"
    return bootstrap.inline("ctkill.sh", job_dir, marker, seconds)


def stop_processes(env: Env, handle: Handle, marker: str, job_dirs: dict[int, str] | None = None,
                   grace: float = 5, group: Group | None = None,
                   node_markers: dict[int, str] | None = None) -> dict[int, int]:
    """Stop every process carrying ``marker`` (KEY=VALUE in its environment) on every node:
    SIGTERM, then SIGKILL to what is left after ``grace`` seconds (a task's stop_grace).
    ``node_markers``: a marker per node instead of ``marker`` (nodes that share one machine,
    like local ones, must not stop each other's processes). Returns how many were left per
    node (0 when clean)."""
    own = group is None
    if group is None:
        try:
            group = connect(env, handle, timeout=15)
        except Exception as exc:  # noqa: BLE001 - unreachable nodes cannot run anything
            env.ui.warn(f"Could not reach every node to stop processes: {exc}")
            return {}
    try:
        # Not cut short by the group's stop, which a loss sets to end the follows: a stop cut
        # short left the survivors' job running into the next attempt's launch.
        res = group.run_to_end(lambda n: kill_command((job_dirs or {}).get(n.rank, ""),
                                                      (node_markers or {}).get(n.rank, marker),
                                                      grace), timeout=grace + 30)
    finally:
        if own:
            group.close()
    left = {}
    for rank, r in res.items():
        for line in r.stdout.splitlines():
            if line.startswith("::left "):
                left[rank] = int(line.split()[1])
    return left


def down(env: Env, name: str, provider_name: str | None = None, *,
         require_found: bool = False, unpulled: Unpulled = "pull") -> None:
    """Tear ``name`` down and verify with the provider. Without a local record,
    ``provider_name`` finds it by tag; ``require_found`` (the ``down`` command) makes finding
    nothing at all an error instead of a note (the launch --down path stays quiet).
    ``unpulled``: what happens to job outputs never pulled (:func:`outputs.before_down`)."""
    from cloudtrain.names import check

    check(name)
    row = env.state.get_cluster(name)
    if row is None and provider_name is None:
        raise lost_record_hint(ClusterNotFound(name, [c.name for c in env.state.list_clusters()]),
                               name)
    pname = row.provider if row is not None else str(provider_name)
    provider = env.provider(pname)
    with cluster_lock(env, name):
        if row is None:
            _down_by_tag(env, provider, pname, name, require_found)
            return
        outputs.before_down(env, name, unpulled)
        boxes = runtime.ran_containers(env, name) and row.status != "STOPPED"   # none runs then
        handle = Handle(row, provider, ClusterKeys(env.pctx.cluster_dir(name) / "ssh"))
        if row.nodes and (not provider.powers_off or boxes):
            # Machines we do not own, or containers that outlive their processes (a local
            # node's docker daemon): stop what we started before forgetting it.
            left = stop_processes(env, handle, f"CLOUDTRAIN_CLUSTER_ID={cluster_uid(env, name)}")
            for rank, n in left.items():
                if n:
                    env.ui.warn(f"node {rank}: {n} process(es) of the cluster survived SIGKILL")
            if boxes:
                runtime.remove(env, handle)
        if row.nodes and (not provider.powers_off or pname == "local") and \
                env.state.cluster_image(name) is not None:   # the machine stays: its images too
            from cloudtrain.containers.pull import forget_images
            forget_images(env, handle)
        env.ui.step(f"Tearing down '{name}' on {pname}")
        _terminate_verified(provider, pname, name,
                            f"Run 'cloudtrain down {name}' again; nothing was forgotten locally.")
        env.state.close_usage(name)
        for launch in env.state.launches(name):
            if launch.status == "RUNNING":
                env.state.finish_launch(launch.job_id, "CANCELLED", None, None)
        env.state.delete_cluster(name)
        forget_files(env, name)
    env.ui.ok(f"'{name}' is down; {pname} lists none of its nodes")


def forget_files(env: Env, name: str) -> None:
    """What this machine keeps for a cluster that is gone: its SSH masters are ended (no
    later command can reuse a connection to a node that no longer is the cluster's), its
    folder (keys, pinned host keys, policy) and its forwards are removed."""
    sshmux.end_cluster(ClusterKeys(env.pctx.cluster_dir(name) / "ssh"))
    shutil.rmtree(env.pctx.cluster_dir(name), ignore_errors=True)
    forward.forget_cluster(env.home, name)


def _terminate_verified(provider: Provider, pname: str, name: str, hint: str) -> None:
    """Terminate, then list the provider again: the cluster is down only when it lists none
    of its nodes."""
    provider.terminate(name)
    remaining = [n for n in provider.list_nodes(name) if n.status != "terminated"]
    if remaining:
        raise ProviderError(
            f"after teardown, {pname} still lists {len(remaining)} node(s) of '{name}': "
            + ", ".join(n.instance_id for n in remaining) + ".", hint)


def _down_by_tag(env: Env, provider: Provider, pname: str, name: str,
                 require_found: bool) -> None:
    """``down NAME --provider P`` with no local record: tear down what the provider finds by
    tag. Finding no node is not a success: say so (exit 2), and how to look elsewhere."""
    cdir = env.pctx.cluster_dir(name)
    had_files = cdir.exists()
    found = [n for n in provider.list_nodes(name) if n.status != "terminated"]
    env.ui.step(f"Tearing down '{name}' on {pname} (no local record: found by tag)")
    # also what a half-built cluster left (groups, keys, files)
    _terminate_verified(provider, pname, name,
                        f"Run 'cloudtrain down {name} --provider {pname}' again.")
    env.state.close_usage(name)
    forget_files(env, name)
    if found:
        env.ui.ok(f"'{name}' is down: {len(found)} node(s) found by tag on {pname} were "
                  f"removed; {pname} lists none of its nodes now")
    elif had_files:
        env.ui.ok(f"'{name}' had no node running on {pname}; its local leftovers were removed")
    elif any(u.provider == pname for u in env.state.usage(cluster=name)):
        # This home's ledger knows it: a cluster this home tore down before.
        env.ui.ok(f"'{name}' was already down; {pname} lists none of its nodes")
    elif not require_found:
        env.ui.info(f"Found nothing of '{name}' on {pname}; nothing to tear down.")
    else:
        listing = (f", or list everything cloudtrain tagged with 'cloudtrain gc --provider "
                   f"{pname} --any-owner'" if isinstance(provider, CollectsOrphans) else "")
        raise UserError(
            f"Found no node of cluster '{name}' on {pname}, and this CLOUDTRAIN_HOME has no "
            "record of it: nothing was torn down.",
            f"Check the name and the provider (--provider PROVIDER looks for it by its tag on "
            f"PROVIDER). A cluster created under another CLOUDTRAIN_HOME is that home's: run "
            f"'cloudtrain down {name} --provider PROVIDER' there{listing}.")


def down_shielded(env: Env, name: str, provider_name: str) -> None:
    """Teardown after --down: Ctrl-C cannot interrupt it halfway. ``provider_name`` (the
    task's) finds what a half-built cluster left when no state row was written. Outputs
    never pulled are pulled first when the nodes answer; else it goes ahead and says so."""
    with Shielded():
        try:
            if env.state.get_cluster(name) is not None or os.path.isdir(env.pctx.cluster_dir(name)):
                down(env, name, provider_name=provider_name, unpulled="try")
        except CloudtrainError as exc:
            env.ui.error(f"teardown of '{name}' failed: {exc}")
            raise
