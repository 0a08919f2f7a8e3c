"""Buckets on the nodes (laptop side): bucket ``file_mounts`` fetched by every node before setup,
and ``checkpoints:`` restored before the job and uploaded beside it. The transfers themselves are
``store.py`` on the node (cloudtrain/node/store.py, shipped with the bootstrap scripts); the
laptop never reads or writes an object, and the credentials the nodes use come from their cloud
identity or the task's ``envs`` (docs/storage.md)."""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from cloudtrain.cluster import Handle
from cloudtrain.context import Env
from cloudtrain.errors import RemoteError, UserError
from cloudtrain.pipeline import bootstrap, sync
from cloudtrain.remote import Group
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import

NOTHING_TO_RESTORE = 3


def store_py(node: NodeRow) -> str:
    return str(PurePosixPath(bootstrap.script_dir(node)) / "store.py")


def checkpoint_dir(node: NodeRow) -> str:
    """Where the job finds (and writes) its checkpoints on a node: ``CLOUDTRAIN_CHECKPOINT_DIR``."""
    return str(PurePosixPath(node.root_dir) / "checkpoints")


def job_env(task: Task, node: NodeRow) -> dict[str, str]:
    if not task.checkpoints:
        return {}
    return {"CLOUDTRAIN_CHECKPOINT_DIR": checkpoint_dir(node),
            "CLOUDTRAIN_CHECKPOINT_URL": str(task.checkpoints)}


def _target(node: NodeRow, remote: str) -> str:
    """A mount target as a shell word ('~/x' stays relative to the node's home)."""
    if remote.startswith("~/"):
        return '"$HOME"/' + shlex.quote(remote[2:])
    return shlex.quote(sync.mount_target(node, remote))


def check_rclone(handle: Handle, task: Task) -> None:
    """Stop before anything runs when a node has no rclone and the task needs buckets."""
    if not task.bucket_urls():
        return
    missing = [n.rank for n in handle.nodes if (n.bootstrap or {}).get("rclone") == "missing"]
    if missing:
        raise UserError(
            f"This task uses buckets ({'checkpoints' if task.checkpoints else 'file_mounts'}), "
            f"and node(s) {missing} have no rclone, which moves the data between the nodes and "
            "the bucket.",
            "Install it on those machines ('sudo apt-get install rclone'), then launch again "
            "with 'cloudtrain up --force-bootstrap' or on a fresh cluster.")


def fetch_mounts(env: Env, handle: Handle, group: Group, task: Task,
                 job_env_for: dict[int, dict[str, str]]) -> None:
    """Every node copies each bucket file_mount into its target, in parallel (rclone skips what
    is there already). The job environment (the task's envs: a local store's endpoint and keys)
    travels on stdin, never on a command line."""
    mounts = task.bucket_mounts()
    if not mounts:
        return
    env.ui.step(f"Fetching {len(mounts)} bucket mount(s) on {len(handle.nodes)} node(s)")

    def script(n: NodeRow) -> bytes:
        lines = ["set -u"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in job_env_for[n.rank].items()]
        if n.python_bin:
            lines.append(f"export PATH={shlex.quote(n.python_bin)}:\"$PATH\"")
        for remote, url in mounts.items():
            lines.append(f"python3 {shlex.quote(store_py(n))} fetch {shlex.quote(str(url))} "
                         f"{_target(n, remote)} || exit $?")
        return ("\n".join(lines) + "\n").encode()

    res = group.run("bash -s", stdin=script, combine=True)
    bad = []
    for rank, r in sorted(res.items()):
        for line in r.stdout.splitlines():
            if line.startswith("[store] "):
                env.ui.info(f"  node {rank}: {line[8:]}")
        if not r.ok:
            bad.append(f"node {rank}: {r.error or r.stdout.strip().splitlines()[-1:] or r.exit_code}")
    if bad:
        raise RemoteError("Fetching bucket file_mounts failed: " + "; ".join(bad),
                          "Check the URL and the nodes' access to it (their cloud identity, or "
                          "the endpoint and keys in the task's envs), then launch again.")


def wrap_body(task: Task, node: NodeRow, command: str) -> str:
    assert task.checkpoints
    """The job body with checkpoints: restore the newest complete checkpoint into
    CLOUDTRAIN_CHECKPOINT_DIR (every node), run ``command`` (not exec'd), and on the head node
    (rank 0) run ``store.py watch`` beside it; after the job ends (also after SIGTERM: the watch
    only notes it and waits for the job), a last upload. Exits with the job's code."""
    # The job runs in the workdir: a root under $HOME (the clouds' "cloudtrain") is made
    # absolute here, as every session starts in $HOME.
    rel = store_py(node)
    store = shlex.quote(rel) if rel.startswith("/") else f'"$HOME"/{shlex.quote(rel)}'
    url = shlex.quote(str(task.checkpoints))
    lines = [
        'case $CLOUDTRAIN_CHECKPOINT_DIR in /*) ;; '
        '*) export CLOUDTRAIN_CHECKPOINT_DIR=$HOME/$CLOUDTRAIN_CHECKPOINT_DIR ;; esac',
        f'python3 {store} restore {url} "$CLOUDTRAIN_CHECKPOINT_DIR"; ct_rc=$?',
        f'if [ "$ct_rc" != 0 ] && [ "$ct_rc" != {NOTHING_TO_RESTORE} ]; then',
        '    echo "cloudtrain: restoring the checkpoint failed (exit $ct_rc)" >&2; exit "$ct_rc"',
        "fi",
    ]
    # Not exec'd, so this shell must outlive a stop's SIGTERM (which reaches the whole group)
    # and exit with the job's own code once the job has saved and ended.
    lines += [f"{command} &", "ct_job=$!", "trap ':' TERM"]
    if node.rank == 0:
        # SIGTERM ignored until store.py takes it over (a stop in its first milliseconds must
        # not end the watch that makes the last upload).
        lines += [f'(trap "" TERM; exec python3 {store} watch {url} "$CLOUDTRAIN_CHECKPOINT_DIR" '
                  '--pid "$ct_job") &',
                  "ct_watch=$!"]
    lines += ['while kill -0 "$ct_job" 2>/dev/null; do wait "$ct_job"; done',
              'wait "$ct_job"; ct_rc=$?']
    if node.rank == 0:
        lines.append('wait "$ct_watch" || echo "cloudtrain: the last checkpoint upload failed" >&2')
    lines.append('exit "$ct_rc"')
    return "\n".join(lines)
