"""What each node already has, asked before a job (in the launch's node-guard round trip, or
by run_task itself): bootstrapped with these scripts? what was last synced and set up there?
The answers let run_task skip the bootstrap, the sync and the setup where they are done."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Callable

from cloudtrain.cluster import Handle
from cloudtrain.pipeline import bootstrap, sync
from cloudtrain.pipeline.bootstrap import bootstrap_env
from cloudtrain.remote import GroupResult, bash
from cloudtrain.schema import NodeRow

if TYPE_CHECKING:
    from cloudtrain.taskmodel import Task  # annotations only: no pydantic at import


@dataclass(frozen=True)
class NodeFacts:
    """What one node has: bootstrapped with these scripts, the fingerprint of what was last
    synced there, the hash of the setup last run there."""

    bootstrapped: bool
    sync_fp: str
    setup_hash: str


def prep_command(handle: Handle, task: Task) -> Callable[[NodeRow], str]:
    """The prep's command on each node: is it bootstrapped with these scripts, and what was
    last synced and set up there (folded into the launch's node-guard round trip)."""
    boot_env = bootstrap_env(handle, task.bootstrap, container=task.container is not None)
    plan_mounts = list(task.file_mounts)

    def cmd(n: NodeRow) -> str:
        root = shlex.quote(n.root_dir)
        stamp = shlex.quote(bootstrap.stamp_path(n, boot_env(n)))
        mk = " ".join(shlex.quote(str(PurePosixPath(sync.mount_target(n, m)).parent)) for m in plan_mounts)
        # bash builtins only: no process started on the node unless a folder is missing
        return bash(f"for d in {root}/workdir {root}/jobs {mk}; do "
                    "[ -d \"$d\" ] || mkdir -p \"$d\"; done; "
                    f"if [ -f {stamp} ]; then echo boot=yes; fi; s='' h=''; "
                    f"{{ read -r s < {root}/.sync-fp; read -r h < {root}/.setup-hash; }} "
                    "2>/dev/null; echo \"sync=$s\"; echo \"setup=$h\"")
    return cmd


def prep_facts(res: GroupResult) -> dict[int, NodeFacts]:
    """What prep_command's output says, per node (raises when a node failed it)."""
    res.raise_on_failure("Preparing the nodes")
    out = {}
    for rank, r in res.items():
        kv = dict(line.split("=", 1) for line in r.stdout.splitlines()
                  if line.split("=", 1)[0] in ("boot", "sync", "setup"))
        out[rank] = NodeFacts(kv.get("boot") == "yes", kv.get("sync", ""), kv.get("setup", ""))
    return out
