"""Slurm's own commands, as cloudtrain asks them: submit the allocation, find it by its name
and cloudtrain's mark, read its state, its nodes in Slurm's order, cancel it, and check with
``sacct`` that it ended. Every answer comes from the scheduler (the truth)."""

from __future__ import annotations

from dataclasses import dataclass

from cloudtrain.errors import ProviderError, UserError

from cloudtrain_provisioners.slurm.login import Login

# squeue's fields: id, state, reason, (expected) start, time left, node count, nodes, comment
_FORMAT = "%i|%T|%r|%S|%L|%D|%N|%k"
# Pending reasons that no amount of waiting fixes: the site will never run this job.
NEVER = frozenset({"PartitionTimeLimit", "PartitionNodeLimit", "PartitionConfig",
                   "BadConstraints", "InvalidAccount", "InvalidQOS", "AccountNotAllowed",
                   "QOSNotAllowed", "DependencyNeverSatisfied", "JobHeldAdmin"})
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED",
                    "REQUEUED", "RESIZING", "SIGNALING", "STAGE_OUT"})


@dataclass(frozen=True)
class Allocation:
    """One allocation job as squeue shows it."""

    job_id: str
    state: str
    reason: str
    start: str
    time_left: str
    node_count: int
    nodelist: str

    @property
    def never_runs(self) -> bool:
        r = self.reason
        return self.state == "PENDING" and (r in NEVER or (r.startswith(("QOSMax", "AssocMax"))
                                                            and "PerJob" in r))

    def words(self) -> str:
        """For ``status`` and ``up``: the job id, its state, and why it waits or how long it
        has left."""
        if self.state == "PENDING":
            start = "" if self.start in ("N/A", "", "Unknown") else \
                f", expected start {self.start.replace('T', ' ')}"
            why = "being scheduled" if self.reason in ("None", "") else self.reason
            return f"Slurm job {self.job_id} PENDING ({why}){start}"
        left = "" if self.time_left in ("", "INVALID") else f", time left {self.time_left}"
        on = f" on {self.nodelist}" if self.nodelist and self.nodelist != "(null)" else ""
        return f"Slurm job {self.job_id} {self.state}{on}{left}"


def gpu_args(flag: str, gpu_type: str | None, count: int) -> list[str]:
    """How a job or a step asks for ``count`` GPUs on each node: ``--gres=gpu[:type]:N`` or
    ``--gpus-per-node=[type:]N`` (``flag``: gres | gpus-per-node; auto is taken as gres)."""
    if count <= 0:
        return []
    if flag == "gpus-per-node":
        return [f"--gpus-per-node={gpu_type}:{count}" if gpu_type
                else f"--gpus-per-node={count}"]
    return [f"--gres=gpu:{gpu_type}:{count}" if gpu_type else f"--gres=gpu:{count}"]


def other_gpu_flag(args: list[str]) -> list[str] | None:
    """The same sbatch options with the other way of asking for GPUs (auto: a site that
    refuses --gres may take --gpus-per-node); None: ``args`` ask for no GPU."""
    out, swapped = [], False
    for a in args:
        if a.startswith("--gres=gpu:"):
            rest = a.removeprefix("--gres=gpu:")
            out.append(f"--gpus-per-node={rest}")
            swapped = True
        else:
            out.append(a)
    return out if swapped else None


def job_name(cluster: str) -> str:
    return f"ct-{cluster}"


def find(login: Login, cluster: str, mark: str) -> list[Allocation]:
    """The cluster's allocations still known to squeue (pending, running or ending): the
    user's own jobs named after the cluster and carrying this home's mark."""
    r = login.run(["squeue", "--me", "-h", "--name", job_name(cluster), "-o", _FORMAT])
    if not r.ok:
        raise ProviderError(f"squeue on {login.where} failed: {r.words()}",
                            "Check that Slurm answers there (sinfo), then run again.")
    found = []
    for line in r.out.splitlines():
        f = line.split("|")
        if len(f) < 8 or f[7].strip() != mark:
            continue
        found.append(Allocation(f[0], f[1], f[2], f[3], f[4],
                                int(f[5]) if f[5].isdigit() else 0, f[6]))
    return found


def submit(login: Login, args: list[str], script: str) -> str:
    """``sbatch --parsable`` with the script on stdin; the job id. A refusal is the site's
    answer to this request: a UserError in Slurm's own words (nothing was queued)."""
    r = login.run(["sbatch", "--parsable", *args], stdin=script)
    if not r.ok:
        raise UserError(f"Slurm refused the allocation: {r.words()}",
                        "Fix resources.slurm (partition, account, qos, constraint), num_nodes, "
                        "accelerators or max_hours to what the site allows (sinfo, sacctmgr "
                        "show assoc user=$USER), then run again.")
    job = r.out.strip().split(";")[0]
    if not job.isdigit():
        raise ProviderError(f"sbatch printed {r.out.strip()[:80]!r}, not a job id.",
                            "Check the login node's Slurm, then run again.")
    return job


def submit_gpus(login: Login, args: list[str], flag: str, script: str) -> tuple[str, str]:
    """:func:`submit`, and with ``flag`` auto, once more with ``--gpus-per-node`` when the
    site refuses ``--gres`` (the refusal quoted is the first one if both fail); the job id and
    the flag the site took."""
    try:
        return submit(login, args, script), "gpus-per-node" if flag == "gpus-per-node" \
            else "gres"
    except UserError:
        other = other_gpu_flag(args) if flag == "auto" else None
        if other is None:
            raise
        try:
            return submit(login, other, script), "gpus-per-node"
        except UserError:
            pass
        raise


def hostnames(login: Login, nodelist: str) -> list[str]:
    """The allocation's nodes in Slurm's order (its first node runs the batch script)."""
    r = login.run(["scontrol", "show", "hostnames", nodelist])
    if not r.ok:
        raise ProviderError(f"scontrol show hostnames {nodelist}: {r.words()}",
                            "Run the command again.")
    return r.out.split()


def addresses(login: Login, nodes: list[str]) -> dict[str, str]:
    """Each node's NodeAddr (where the other nodes reach it)."""
    r = login.run(["scontrol", "-o", "show", "node", ",".join(nodes)])
    out: dict[str, str] = {}
    for line in r.out.splitlines() if r.ok else []:
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            out[fields["NodeName"]] = fields.get("NodeAddr", fields["NodeName"])
    return out


def cancel(login: Login, job_ids: list[str]) -> None:
    if not job_ids:
        return
    r = login.run(["scancel", *job_ids])
    if not r.ok and "Invalid job id" not in r.err:     # already gone is what we wanted
        raise ProviderError(f"scancel {' '.join(job_ids)}: {r.words()}",
                            "Run 'cloudtrain down' again.")


def final_state(login: Login, job_id: str) -> str | None:
    """The job's state in accounting (CANCELLED, COMPLETED, TIMEOUT, ...; None: sacct has no
    record of it, or accounting is off at this site)."""
    r = login.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"])
    if not r.ok:
        return None
    states = [s.split()[0] for s in r.out.splitlines() if s.strip()]
    return states[-1] if states else None
