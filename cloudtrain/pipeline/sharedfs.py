"""What a scheduler's shared filesystem offers the pipeline (provider: slurm): the protocol
of a provider whose nodes share a filesystem with a login node that rsync reaches, and the pull
of a job's outputs from the workdir there, once, with the same staging and checks as every
provider's (``sync.pull``: nothing lands outside the outputs folder; links and special files
are not copied). Every node writes into the same workdir, so the outputs come once, straight
into the outputs folder, also with ``outputs_from: all``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, runtime_checkable

from cloudtrain.context import Env
from cloudtrain.errors import RemoteError
from cloudtrain.pipeline import sync
from cloudtrain.schema import NodeRow, OutputsRow

if TYPE_CHECKING:
    from cloudtrain.cluster import Handle
    from cloudtrain.provider import ClusterRequest


@runtime_checkable
class SharesFiles(Protocol):
    """A provider whose nodes share a filesystem with a login node that rsync reaches."""

    def shared_source(self, cluster: str) -> tuple[Callable[[str], list[str]], str]: ...

    def check_files(self, request: ClusterRequest, targets: list[str], buckets: bool
                    ) -> None: ...

    def put_mounts(self, cluster: str, local: Mapping[str, Path], buckets: Mapping[str, str],
                   program: str, say: Callable[[str], None]) -> None: ...


def _anchor(handle: Handle) -> NodeRow:
    """The node named in sync.pull's messages (the shared filesystem has no rank of its own;
    an allocation that ended has no node left, and its files are still there)."""
    if handle.nodes:
        return handle.nodes[0]
    return NodeRow(handle.name, 0, "", "", 0, "", "", "ended", "")


def pull_row(env: Env, handle: Handle, row: OutputsRow) -> tuple[list[Path], bool]:
    """``row``'s outputs from the workdir on the shared filesystem into its folder, once.
    Returns what came back and whether the login node answered."""
    provider = handle.provider
    assert isinstance(provider, SharesFiles)
    via, workdir = provider.shared_source(handle.name)
    dest = Path(row.dest)
    got: list[Path] = []
    ok = True
    if row.from_all:
        env.ui.info("outputs_from: all: the nodes share the workdir, so its outputs come once")
    for rel in row.paths:
        try:
            pulled = sync.pull(_anchor(handle), handle.keys, rel, dest, base=workdir, via=via)
        except RemoteError as exc:
            ok = False
            env.ui.warn(str(exc).replace(" from node 0", " from the shared filesystem"))
            continue
        for what in pulled.skipped:
            env.ui.warn(f"output '{rel}': not copied: {what}")
        if pulled.found:
            got.append(dest / rel.rstrip("/"))
        elif not pulled.skipped:
            env.ui.warn(f"output '{rel}' does not exist in the workdir {workdir}")
    if got:
        env.ui.ok("Outputs: " + ", ".join(str(p) for p in got))
    return got, ok
