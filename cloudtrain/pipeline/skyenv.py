"""SkyPilot's node variables beside ours, and the one way they mislead on a CPU node.

A ``run:`` written for SkyPilot reads ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NODE_IPS``,
``SKYPILOT_NUM_NODES``, ``SKYPILOT_NUM_GPUS_PER_NODE`` and ``SKYPILOT_TASK_ID``: every job,
setup and ``exec`` gets them with the values of ours (``job_env``). On nodes without a GPU
the GPU count is 0, honestly: a ``run:`` that passes it to ``torchrun --nproc-per-node``
would start no process, so cloudtrain says so before the job starts (:func:`zero_gpu_warning`)
rather than pretend the node has a GPU (docs/migrating-from-skypilot.md).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

SKY_OF = {
    "SKYPILOT_NODE_RANK": "CLOUDTRAIN_NODE_RANK",
    "SKYPILOT_NODE_IPS": "CLOUDTRAIN_NODE_IPS",
    "SKYPILOT_NUM_NODES": "CLOUDTRAIN_NUM_NODES",
    "SKYPILOT_NUM_GPUS_PER_NODE": "CLOUDTRAIN_GPUS_PER_NODE",
}
"""SkyPilot's variable -> ours (same value); SKYPILOT_TASK_ID is the job id."""

_GPU_VAR = re.compile(r"\$\{?(SKYPILOT_NUM_GPUS_PER_NODE|CLOUDTRAIN_GPUS_PER_NODE)\b")


def aliases(ours: Mapping[str, str], job_id: str) -> dict[str, str]:
    """SkyPilot's names for the job's variables in ``ours`` (job_env's), and its task id."""
    out = {sky: ours[own] for sky, own in SKY_OF.items() if own in ours}
    out["SKYPILOT_TASK_ID"] = job_id
    return out


def zero_gpu_warning(text: str | None, gpus: Iterable[int | None],
                     what: str = "the job") -> str | None:
    """The warning for a ``run:`` (or, ``what``, exec's command) that reads the GPU count on
    nodes that have no GPU (``gpus``: each node's count); None when it does not apply."""
    counts = list(gpus)
    m = _GPU_VAR.search(text or "")
    if m is None or not counts or min((g or 0) for g in counts) > 0:
        return None
    var = m.group(1)
    return (f"{what} reads ${var}, which is 0 here (a node has no GPU): passed to "
            f"--nproc-per-node it starts no process; write "
            f"$(( {var} > 0 ? {var} : 1 )) to run one process per CPU node")
