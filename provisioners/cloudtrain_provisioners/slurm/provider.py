"""The ``slurm`` provider: the cluster a lab or company already runs, behind its scheduler.

A cloudtrain cluster is ONE allocation job of Slurm's, named ``ct-<cluster>`` and marked with
this home's mark (``--comment``): ``up`` submits it (``sbatch``; its batch script only holds
the allocation until it is cancelled or reaches its time limit), shows why it waits and when
Slurm expects to start it while it is pending, and ends once it runs: its nodes, in Slurm's
order, are the cluster's nodes. ``down`` cancels it and checks with squeue and sacct that it
ended. cloudtrain never SSHes to a compute node and installs nothing on one; every command
runs on the login node (``resources.slurm.login``).
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, ClassVar, Mapping

from pydantic import BaseModel

from cloudtrain.errors import ProviderError, UserError
from cloudtrain.provider import (ClusterRequest, NetworkRef, Node, Plan, ProviderCheck,
                                 ProviderContext, SelfStop)
from cloudtrain.provider.contract import NodeStatus

from cloudtrain_provisioners.slurm import (accounting, bootstrap, detached, execs, files, sched,
                                           steps)
from cloudtrain_provisioners.slurm.login import Login
from cloudtrain_provisioners.slurm.options import SlurmOptions, login_host

_NODE_STATUS: dict[str, NodeStatus] = {"RUNNING": "running", "PENDING": "pending",
                                       "CONFIGURING": "pending", "COMPLETING": "stopped"}


class SlurmProvider:
    name: ClassVar[str] = "slurm"
    host_key_source: ClassVar[str] = "none: the nodes are reached through Slurm, not SSH"
    options_model: ClassVar[type[BaseModel] | None] = SlurmOptions
    allows_absolute_mounts: ClassVar[bool] = True
    powers_off: ClassVar[bool] = True
    """``terminate`` ends the allocation (scancel kills every process of it on the nodes)."""
    list_is_cheap: ClassVar[bool] = False
    """Asking squeue may be an SSH round trip to the login node: status --refresh asks."""

    def __init__(self, ctx: ProviderContext, poll_seconds: float = 2.0) -> None:
        self.ctx = ctx
        self.poll_seconds = poll_seconds

    # --- what is recorded here: only where to ask -------------------------------------

    def _file(self, cluster: str) -> Path:
        return self.ctx.cluster_dir(cluster) / "slurm.json"

    def _login(self, cluster: str) -> Login | None:
        """The login node recorded at ``up`` (None: this home never submitted an allocation
        for ``cluster``, so there is no scheduler to ask)."""
        known = self.ctx.cluster_dir(cluster) / "slurm-login-known_hosts"
        try:
            rec = json.loads(self._file(cluster).read_text())
            return Login(rec["login"], rec.get("identity_file"), known)
        except (OSError, ValueError, KeyError):
            return None

    def _record(self, cluster: str, login: Login, job_id: str | None,
                opts: SlurmOptions, gpus: int) -> None:
        f = self._file(cluster)
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps({"login": login.spec, "identity_file": login.identity_file,
                                   "job_id": job_id, "workdir": opts.workdir,
                                   "gpus": gpus, "cpus": opts.cpus_per_node,
                                   "modules": opts.modules, "python": opts.python,
                                   "price_per_gpu_hour": opts.price_per_gpu_hour,
                                   "gpu_flag": opts.gpu_flag}))
        os.replace(tmp, f)

    def _recorded(self, cluster: str) -> dict[str, object]:
        try:
            rec = json.loads(self._file(cluster).read_text())
        except (OSError, ValueError):
            rec = None
        if not isinstance(rec, dict):
            raise UserError(f"cluster '{cluster}' has no Slurm allocation recorded here.",
                            "Run 'cloudtrain up' for it first.")
        return rec

    def _flag(self, cluster: str, given: str) -> str:
        """The GPU flag the site took at the first ``up`` (auto tried --gres first)."""
        try:
            return str(json.loads(self._file(cluster).read_text()).get("gpu_flag") or given)
        except (OSError, ValueError, AttributeError):
            return given

    def _workdir(self, login: Login, cluster: str, given: object) -> str:
        """The workdir on the shared filesystem, absolute (``~`` is the login's $HOME)."""
        wd = str(given) if given else f"~/cloudtrain/{cluster}"
        if wd.startswith("~"):
            home = login.run(["sh", "-c", 'printf %s "$HOME"']).out.strip() \
                if login.spec != "local" else str(Path.home())
            wd = home + wd[1:]
        return wd

    def run_step(self, cluster: str, job_id: str, workdir: Path | None, filters: list[str],
                 script: str, env: Mapping[str, str], line: Callable[[int, str], None],
                 gpus_per_job: int | None = None) -> dict[int, int]:
        """The job as one srun step of the allocation (steps.py). With ``gpus_per_job``
        below the GPUs of a node, the step asks for its share (``--exact``, its GPUs and its
        part of the allocation's CPUs), so Slurm runs the steps that fit at once."""
        rec, login, alloc = self._running(cluster)
        wd = self._workdir(login, cluster, rec.get("workdir"))
        if workdir is not None:
            steps.sync(login, workdir, wd, filters)
        text, share = self._step_text(cluster, rec, job_id, wd, env, script, gpus_per_job)
        return steps.run(login, alloc.job_id, alloc.node_count, job_id, wd, text, line, share)

    def _step_text(self, cluster: str, rec: dict[str, object], job_id: str, wd: str,
                   env: Mapping[str, str], script: str, gpus_per_job: int | None
                   ) -> tuple[str, list[str]]:
        """The step script, and srun's options for the step's share of each node ([]: whole
        nodes; with ``gpus_per_job`` below a node's GPUs: its GPUs and part of the CPUs)."""
        modules = rec.get("modules")
        text = steps.step_script(job_id, wd, env, [str(m) for m in modules]
                                 if isinstance(modules, list) else [],
                                 self._python(cluster, rec), script)
        gpus, cpus = int(str(rec.get("gpus") or 0)), int(str(rec.get("cpus") or 1))
        share = (["--exact", *sched.gpu_args(str(rec.get("gpu_flag") or "gres"), None,
                                              gpus_per_job),
                  "-c", str(max(1, cpus * gpus_per_job // gpus))]
                 if gpus_per_job and gpus and gpus_per_job < gpus else [])
        return text, share

    def allocation_jobs(self, cluster: str) -> detached.AllocationJobs:
        """The cluster's allocation as its jobs see it (detached.py): the login node, the
        workdir, the running allocation (None: none runs now)."""
        rec = self._recorded(cluster)
        login = self._login(cluster)
        assert login is not None
        found = sched.find(login, cluster, self.mark())
        alloc = next((a for a in found if a.state == "RUNNING"), None)
        return detached.AllocationJobs(login, self._workdir(login, cluster, rec.get("workdir")),
                                       alloc, rec, functools.partial(self._step_text, cluster))

    def self_stop_command(self, cluster: str, node: Node) -> str:
        """What the guard inside the allocation runs (allocguard.py): its own job, no more."""
        return "scancel $SLURM_JOB_ID"

    def what_still_bills(self) -> str:
        return ("nothing: the guard's scancel ends the allocation and every step in it; the "
                "ledger closes at the next CLI contact")

    def self_stopped(self, cluster: str) -> list[SelfStop]:
        """The allocation the guard ended (stopped.json), once squeue no longer lists it."""
        words = self._guard_end(cluster)
        return [] if words is None else [SelfStop(0, f"{words[0]}/guard", words[1], words[2])]

    def _guard_end(self, cluster: str) -> tuple[str, float, str] | None:
        """(job id, when, why) of the recorded allocation, when its guard ended it."""
        try:
            rec = self._recorded(cluster)
        except UserError:
            return None
        login, job = self._login(cluster), rec.get("job_id")
        if login is None or not job or any(a.job_id == job for a in
                                           sched.find(login, cluster, self.mark())):
            return None
        data = detached.stopped(login, self._workdir(login, cluster, rec.get("workdir")),
                                str(job))
        if data is None:
            return None
        at = data.get("at")
        return (str(job), float(at) if isinstance(at, (int, float)) else time.time(),
                f"the guard ended Slurm job {job}: {detached.stop_words(data)}")

    def _python(self, cluster: str, rec: Mapping[str, object]) -> str | None:
        """The Python the steps use: the venv bootstrap built, else resources.slurm.python."""
        stamp = bootstrap.read_stamp(self.ctx.cluster_dir(cluster))
        return (stamp.python if stamp is not None and stamp.python else
                str(rec["python"]) if rec.get("python") else None)

    def _running(self, cluster: str) -> tuple[dict[str, object], Login, sched.Allocation]:
        """The cluster's record, its login node and its running allocation (refused when
        none runs)."""
        rec = self._recorded(cluster)
        login = self._login(cluster)
        found = sched.find(login, cluster, self.mark()) if login is not None else []
        alloc = next((a for a in found if a.state == "RUNNING"), None)
        if login is None or alloc is None:
            raise UserError(f"cluster '{cluster}' has no running Slurm allocation.",
                            "Run 'cloudtrain up' for it again ('cloudtrain status --refresh' "
                            "shows what Slurm says).")
        return rec, login, alloc

    def bootstrap_steps(self, cluster: str, torch: str, torch_index: str | None,
                        need_torch: bool, say: Callable[[str], None]) -> None:
        """Find (or build) the Python with PyTorch and check the GPUs from inside the
        allocation, once per allocation (bootstrap.py)."""
        rec, login, alloc = self._running(cluster)
        want = bootstrap.Wanted(torch, torch_index, need_torch, int(str(rec.get("gpus") or 0)))
        bootstrap.ensure(login, alloc, self.ctx.cluster_dir(cluster),
                         self._workdir(login, cluster, rec.get("workdir")), rec, want, say)

    def exec_step(self, cluster: str, job_id: str, command: str, env: Mapping[str, str],
                  line: Callable[[int, str], None], ranks: list[int] | None) -> dict[int, int]:
        """``exec``: the command as an --overlap step of the allocation (execs.py)."""
        rec, login, alloc = self._running(cluster)
        wd = self._workdir(login, cluster, rec.get("workdir"))
        return execs.run(login, alloc, job_id, wd, execs.script(job_id, wd, env, rec, command),
                         line, ranks)

    def _shared(self, cluster: str) -> tuple[Login, str]:
        rec = self._recorded(cluster)
        login = self._login(cluster)
        if login is None:
            raise UserError(f"cluster '{cluster}' has no Slurm login node recorded here.",
                            "Run 'cloudtrain up' for it first.")
        return login, self._workdir(login, cluster, rec.get("workdir"))

    def shared_source(self, cluster: str) -> tuple[Callable[[str], list[str]], str]:
        """How rsync reads the shared filesystem (through the login node), and the workdir
        there, where a job's outputs are (files.py)."""
        login, wd = self._shared(cluster)
        return files.rsync_source(login), wd

    def check_files(self, request: ClusterRequest, targets: list[str], buckets: bool) -> None:
        """Before ``up``: every file_mounts target writable on the shared filesystem, and
        rclone on the login node for bucket mounts (files.py); nothing is created there."""
        o = self._opts(request)
        self.ctx.cluster_dir(request.name).mkdir(parents=True, exist_ok=True)
        login = Login(o.login, o.identity_file,
                      self.ctx.cluster_dir(request.name) / "slurm-login-known_hosts")
        files.check(login, self._workdir(login, request.name, o.workdir), targets, buckets)

    def put_mounts(self, cluster: str, local: Mapping[str, Path], buckets: Mapping[str, str],
                   program: str, say: Callable[[str], None]) -> None:
        """file_mounts into the shared filesystem from the login node (files.py)."""
        login, wd = self._shared(cluster)
        files.push_mounts(login, wd, local, say)
        files.fetch_buckets(login, wd, buckets, program, say)

    def mark(self) -> str:
        """This home's mark on its allocations (two homes may name a cluster alike)."""
        digest = hashlib.sha256(str(self.ctx.home.resolve()).encode()).hexdigest()[:16]
        return f"cloudtrain-home-{digest}"

    # --- the contract --------------------------------------------------------------------

    @staticmethod
    def _opts(request: ClusterRequest) -> SlurmOptions:
        return request.options if isinstance(request.options, SlurmOptions) else SlurmOptions()

    def check_access(self, timeout: float) -> ProviderCheck:
        return ProviderCheck("slurm", True, "your login on the Slurm cluster (per task)", True,
                             ("the login node a task names in resources.slurm.login",))

    def check(self, request: ClusterRequest) -> None:
        key = self._opts(request).identity_file
        if key and not Path(key).expanduser().is_file():
            raise UserError(f"resources.slurm.identity_file '{key}' does not exist.",
                            "Give the path of your private key for the login node, or remove "
                            "the line to use ssh's defaults.")
        if request.resources.use_spot:
            raise UserError("resources.use_spot does not apply to the slurm provider.",
                            "Remove it (a Slurm site's preemption is its QOS: "
                            "resources.slurm.qos).")
        if request.resources.instance_type:
            raise UserError("resources.instance_type does not apply to the slurm provider.",
                            "Remove it; ask for nodes with num_nodes, GPUs with accelerators "
                            "and node kinds with resources.slurm.constraint or partition.")

    def sbatch_args(self, request: ClusterRequest) -> list[str]:
        """The allocation's sbatch options, from the task."""
        o = self._opts(request)
        args = ["-J", sched.job_name(request.name), f"--comment={self.mark()}",
                "-N", str(request.num_nodes), "--output=/dev/null", "--chdir=/tmp"]
        acc = request.resources.accelerators
        if acc is not None:
            args += sched.gpu_args(o.gpu_flag, o.gpu_type, acc.count)
        if request.max_hours is not None:
            args += ["-t", str(max(1, math.ceil(request.max_hours * 60)))]
        for flag, value in (("-p", o.partition), ("-A", o.account), ("-q", o.qos),
                            ("-C", o.constraint), ("--reservation", o.reservation)):
            if value:
                args += [flag, value]
        if o.cpus_per_node:
            args += ["-c", str(o.cpus_per_node)]
        if o.exclusive:
            args.append("--exclusive")
        return args

    def plan(self, request: ClusterRequest) -> Plan:
        o = self._opts(request)
        acc = request.resources.accelerators
        gpus = acc.count if acc is not None else 0
        login = Login(o.login)
        return Plan(
            provider="slurm", num_nodes=request.num_nodes, region=f"Slurm via {login.where}",
            instance_type=f"partition {o.partition}" if o.partition else "default partition",
            accelerators=f"gpu:{gpus}" if gpus else None,
            hourly_price_per_node=o.price_per_gpu_hour * gpus,
            creates=[f"one allocation job {sched.job_name(request.name)}: sbatch "
                     + " ".join(self.sbatch_args(request))],
            notes=["the allocation's time limit is the hard lifetime"
                   if request.max_hours is not None else
                   "no max_hours: the allocation gets the partition's default time limit",
                   f"price: ${o.price_per_gpu_hour:g} per GPU-hour "
                   "(resources.slurm.price_per_gpu_hour)"])

    def ensure_network(self, request: ClusterRequest) -> NetworkRef:
        return NetworkRef("", "the Slurm cluster's own network")

    def create_nodes(self, request: ClusterRequest, network: NetworkRef) -> list[Node]:
        """Adopt the cluster's allocation or submit it, then wait until it runs."""
        o = self._opts(request)
        acc = request.resources.accelerators
        gpus = acc.count if acc is not None else 0
        self.ctx.cluster_dir(request.name).mkdir(parents=True, exist_ok=True)
        login = Login(o.login, o.identity_file,
                      self.ctx.cluster_dir(request.name) / "slurm-login-known_hosts")
        found = sched.find(login, request.name, self.mark())
        wd = self._workdir(login, request.name, o.workdir)
        o = o.model_copy(update={"workdir": wd})
        if found:
            job = found[0].job_id
            o = o.model_copy(update={"gpu_flag": self._flag(request.name, o.gpu_flag)})
        else:
            self._record(request.name, login, None, o, gpus)
            detached.ship_guard(login, wd)    # the batch script runs it (allocguard.py)
            job, flag = sched.submit_gpus(login, self.sbatch_args(request), o.gpu_flag,
                                          detached.BATCH.format(
                                              cluster=request.name,
                                              ct=shlex.quote(detached.ct_dir(wd)),
                                              python=shlex.quote(o.python or "python3")))
            o = o.model_copy(update={"gpu_flag": flag})
        self._record(request.name, login, job, o, gpus)
        try:
            alloc = self._wait_running(login, request.name, job)
        except BaseException:
            sched.cancel(login, [job])
            _say(f"cancelled Slurm job {job}", end=True)
            raise
        return self._nodes(login, request.name, alloc)

    def _wait_running(self, login: Login, cluster: str, job: str) -> sched.Allocation:
        shown = ""
        while True:
            alloc = next((a for a in sched.find(login, cluster, self.mark())
                          if a.job_id == job), None)
            if alloc is None:
                state = sched.final_state(login, job) or "no longer in squeue"
                raise ProviderError(f"Slurm job {job} ended before it ran ({state}).",
                                    f"See 'sacct -j {job}' on the login node; then run "
                                    "'cloudtrain up' again.")
            if alloc.state == "RUNNING" and alloc.nodelist:
                if shown:
                    _say(alloc.words(), end=True)
                return alloc
            if alloc.never_runs:
                raise UserError(f"Slurm will never start this allocation: {alloc.reason} "
                                f"(job {job}, cancelled).",
                                "Ask for what the partition and your account allow (sinfo, "
                                "sacctmgr show assoc user=$USER): fewer nodes or GPUs, a "
                                "shorter max_hours, another partition or qos.")
            words = alloc.words()
            if words != shown:
                _say(words)
                shown = words
            time.sleep(self.poll_seconds)

    def _nodes(self, login: Login, cluster: str, alloc: sched.Allocation) -> list[Node]:
        status = _NODE_STATUS.get(alloc.state, "unknown")
        user = login_host(login.spec).user if login.spec != "local" else getpass.getuser()
        if not alloc.nodelist or alloc.nodelist == "(null)" or alloc.state == "PENDING":
            return [Node(rank=i, instance_id=f"{alloc.job_id}/pending-{i}", host="", user=user,
                         status=status) for i in range(max(1, alloc.node_count))]
        names = sched.hostnames(login, alloc.nodelist)
        addrs = sched.addresses(login, names)
        return [Node(rank=i, instance_id=f"{alloc.job_id}/{n}", host=n, port=22, user=user,
                     internal_ip=addrs.get(n, n), status=status,
                     root_dir=f"cloudtrain/{cluster}")
                for i, n in enumerate(names)]

    def list_nodes(self, cluster: str) -> list[Node]:
        """The allocation's nodes as Slurm has them now ([] : no allocation in squeue)."""
        login = self._login(cluster)
        found = sched.find(login, cluster, self.mark()) if login is not None else []
        return self._nodes(login, cluster, found[0]) if login is not None and found else []

    def allocation_words(self, cluster: str) -> str | None:
        """``status``: the allocation's job id, state and time left, from squeue."""
        login = self._login(cluster)
        found = sched.find(login, cluster, self.mark()) if login is not None else []
        if login is not None:      # the ledger's figures; a failing sacct keeps the last read
            try:
                self.account(cluster, login, [a.job_id for a in found if a.state != "PENDING"])
            except ProviderError:
                pass
        if not found and (end := self._guard_end(cluster)) is not None:
            return f"no allocation in the scheduler: {end[2]}"
        return "; ".join(a.words() for a in found) or None

    def account(self, cluster: str, login: Login | None = None, jobs: list[str] | None = None,
                wait_s: float = 0.0) -> list[accounting.AllocationUsage]:
        """The ledger's figures for the cluster's allocations from sacct (``jobs``: these;
        None: the recorded one), kept under <home>/ledger/slurm."""
        login = login or self._login(cluster)
        rec = self._recorded(cluster) if login is not None else {}
        jobs = jobs if jobs is not None else [str(rec["job_id"])] if rec.get("job_id") else []
        price = float(str(rec.get("price_per_gpu_hour") or 0.0))
        got = [accounting.read_and_record(self.ctx.home, login, cluster, j, price, wait_s)
               for j in jobs] if login is not None else []
        return [u for u in got if u is not None]

    def terminate(self, cluster: str, wait_seconds: float = 120) -> None:
        """scancel the cluster's allocations; return once squeue lists none and sacct shows
        each ended."""
        login = self._login(cluster)
        if login is None:          # never submitted from this home: nothing to cancel
            return
        found = sched.find(login, cluster, self.mark())
        if not found and (end := self._guard_end(cluster)) is not None:
            _say(f"Slurm job {end[0]} had already ended: {end[2]}", end=True)
        ids = [a.job_id for a in found]
        sched.cancel(login, ids)
        deadline = time.time() + wait_seconds
        while sched.find(login, cluster, self.mark()):
            if time.time() > deadline:
                raise ProviderError(f"Slurm job(s) {', '.join(ids)} still listed by squeue "
                                    f"{wait_seconds:g} s after scancel.",
                                    f"Run 'cloudtrain down {cluster}' again.")
            time.sleep(0.5)
        for job in ids:
            state = sched.final_state(login, job)
            if state in sched.ACTIVE:
                raise ProviderError(f"sacct shows Slurm job {job} still {state} after scancel.",
                                    f"Run 'cloudtrain down {cluster}' again.")
        try:       # the ledger's figures; the allocation has ended whatever sacct says now
            self.account(cluster, login, ids or None, wait_s=10.0)
        except ProviderError as exc:
            _say(f"warning: the ledger has no sacct figures for {cluster}: {exc.message}", True)
        self._file(cluster).unlink(missing_ok=True)


def _say(words: str, end: bool = False) -> None:
    """The pending allocation's line: rewritten in place on a terminal, one line a change
    otherwise."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K" + words + ("\n" if end else ""))
    else:
        sys.stderr.write(words + "\n")
    sys.stderr.flush()
