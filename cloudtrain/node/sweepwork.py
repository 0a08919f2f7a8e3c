"""One node's worker of a sweep (docs/sweep.md): it fills this node's GPU slots with trials
(Optuna's ask), runs each as a job of the node's queue (queue.py, beside it), follows the
trial's metrics file, reports each value and prunes when Optuna says so, and tells Optuna how
the trial ended. Shipped beside sweep.py; optuna is imported inside the functions."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

if __package__:
    from cloudtrain.node.sweepstudy import distributions, grid_space, sdir, tell
else:  # on a node: run as a script, its siblings beside it
    from sweepstudy import distributions, grid_space, sdir, tell  # type: ignore[no-redef]  # the shipped sibling

POLL_S = float(os.environ.get("CLOUDTRAIN_SWEEP_POLL", "0.5"))
HERE = os.path.dirname(os.path.abspath(__file__))
ENDED = ("succeeded", "failed", "cancelled")
MAX_FAILED_IN_A_ROW = 3
WAKE_S = 0.02      # how often a sleeping worker looks for its trials' rc files


@dataclass(frozen=True)
class JobView:
    """What the driver needs of one queue record."""
    state: str
    exit_code: int | None
    gpus: tuple[str, ...] = ()


class Dispatch(Protocol):
    """Where trials run: the node's queue (:class:`QueueDispatch`) or a test's stand-in."""

    def submit(self, job_id: str, script: str, gpus: int) -> None: ...

    def jobs(self) -> dict[str, JobView]: ...

    def cancel(self, job_id: str) -> None: ...


class QueueDispatch:
    """Trials as jobs of this node's queue. A pruned or stopped trial is cancelled in the
    queue and, when it runs, sent SIGTERM, then SIGKILL after ``grace`` seconds."""

    def __init__(self, root: str, task: str, grace: float) -> None:
        self.root, self.task, self.grace = root, task, grace
        self.queue_py = os.path.join(HERE, "queue.py")
        self.kill_at: dict[str, float] = {}

    def _queue(self, *args: str, stdin: bytes = b"") -> str:
        return subprocess.run([sys.executable, self.queue_py, *args], input=stdin, check=True,
                              capture_output=True, timeout=60).stdout.decode()

    def submit(self, job_id: str, script: str, gpus: int) -> None:
        self._queue("submit", self.root, job_id, "sweep", str(time.time()), self.task,
                    "--gpus", str(gpus), stdin=script.encode())

    def jobs(self) -> dict[str, JobView]:
        out = {r["id"]: JobView(str(r.get("state")), r.get("exit_code"),
                                tuple(str(g) for g in r.get("held") or r.get("ran_on") or ()))
               for r in json.loads(self._queue("list", self.root) or "[]")}
        for job_id, at in list(self.kill_at.items()):
            if out.get(job_id, JobView("succeeded", None)).state in ENDED:
                del self.kill_at[job_id]
            elif time.time() >= at:
                self._signal(job_id, signal.SIGKILL)
                del self.kill_at[job_id]
        return out

    def _signal(self, job_id: str, sig: int) -> None:
        try:
            with open(os.path.join(self.root, "jobs", job_id, "pid")) as f:
                os.killpg(int(f.read().strip()), sig)
        except (OSError, ValueError):
            pass

    def cancel(self, job_id: str) -> None:
        self._queue("cancel", self.root, job_id)
        self._signal(job_id, signal.SIGTERM)
        self.kill_at[job_id] = time.time() + self.grace


# -- the worker: fills this node's slots ----------------------------------------------------

@dataclass
class Running:
    """A trial of this worker while its job runs."""
    trial: Any
    job_id: str
    metrics: str
    offset: int = 0
    steps: int = 0
    final: float | None = None
    pruned: bool = False
    stopping: bool = False
    gpus_seen: bool = False
    woke: bool = False          # its rc file woke the worker (Worker.nap) once already


def synced_workdir(trial_dir: str) -> str:
    """The node's synced workdir (``ROOT/workdir``) seen from a trial's folder
    (``ROOT/.cloudtrain/sweeps/NAME/trials/NUMBER``, sweepstudy.sdir)."""
    return os.path.normpath(os.path.join(trial_dir, *[".."] * 5, "workdir"))


def trial_script(spec: dict, name: str, number: int, metrics: str, params: dict) -> str:
    """The job a trial runs: its params as env and as "$@" (--name value), its own folder
    (``CLOUDTRAIN_TRIAL_DIR``, the metrics file's; the spec's script makes the trial's copy
    of the synced workdir, ``CLOUDTRAIN_SYNCED_WORKDIR``, in it: docs/sweep.md "Outputs"),
    then the spec's script (the task's run:/train:, composed by the CLI)."""
    folder = os.path.dirname(metrics)
    env = {"CLOUDTRAIN_SWEEP": name, "CLOUDTRAIN_TRIAL": str(number),
           "CLOUDTRAIN_METRICS_FILE": metrics, "CLOUDTRAIN_TRIAL_DIR": folder,
           "CLOUDTRAIN_SYNCED_WORKDIR": synced_workdir(folder)}
    env.update({f"CLOUDTRAIN_PARAM_{k.upper()}": str(v) for k, v in params.items()})
    args = [part for k, v in params.items() for part in (f"--{k}", str(v))]
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append("set -- " + " ".join(shlex.quote(a) for a in args))
    return "\n".join(lines) + "\n" + spec.get("script", "") + "\n"


class Worker:
    """One node's share of the sweep: ask, submit, follow, report, tell."""

    def __init__(self, root: str, study: Any, dispatch: Dispatch, node: str) -> None:
        self.root, self.study, self.dispatch, self.node = root, study, dispatch, node
        self.spec: dict = study.user_attrs["spec"]
        self.name: str = study.study_name
        self.metric: str = self.spec["objective"]["metric"]
        self.dists = distributions(self.spec)
        self.capacity = max(1, int(self.spec.get("slots", 1))
                            // int(self.spec.get("gpus_per_trial", 1)))
        self.running: dict[int, Running] = {}
        self.failed_in_a_row = 0

    def total(self) -> int:
        total = int(self.spec["trials"])
        if self.spec.get("sampler") == "grid":
            total = min(total, math.prod(len(v) for v in grid_space(self.spec).values()))
        return total

    def stop_reason(self) -> str | None:
        stop = self.study.user_attrs.get("stop")
        return stop["reason"] if stop else None

    def stop(self, reason: str) -> None:
        if self.stop_reason() is None:
            self.study.set_user_attr("stop", {"reason": reason, "at": time.time(),
                                              "by": self.node})

    def room(self) -> bool:
        trials = self.study.get_trials(deepcopy=False)
        if len(trials) >= self.total() or len(self.running) >= self.capacity:
            return False
        parallel = self.spec.get("parallel", "auto")
        busy = sum(1 for t in trials if t.state.name == "RUNNING")
        return parallel == "auto" or busy < int(parallel)

    def launch(self) -> None:
        """Ask Optuna for a trial and submit it. ``room`` counted the trials before this ask,
        so two workers (or nodes) may both pass it for the last one; the storage numbers the
        trials in the order they were asked (0, 1, ...), so a trial numbered ``total()`` or
        above is one too many: it is told FAIL at once, marked ``surplus`` (the reports leave
        it out), and never runs."""
        from optuna.trial import TrialState
        trial = self.study.ask(fixed_distributions=self.dists)
        if trial.number >= self.total():
            trial.set_user_attr("surplus", True)
            tell(self.study, trial, TrialState.FAIL)
            return
        folder = os.path.join(sdir(self.root, self.name), "trials", str(trial.number))
        os.makedirs(folder, exist_ok=True)
        metrics = os.path.join(folder, "metrics.jsonl")
        job_id = f"sweep-{self.name}-t{trial.number}"
        for k, v in (("node", self.node), ("job_id", job_id), ("started", time.time())):
            trial.set_user_attr(k, v)
        script = trial_script(self.spec, self.name, trial.number, metrics, trial.params)
        self.dispatch.submit(job_id, script, int(self.spec.get("gpus_per_trial", 1)))
        self.running[trial.number] = Running(trial, job_id, metrics)

    def follow(self, run: Running, ended: bool = False) -> None:
        """Report the metric's new values (a last line without its newline once the job
        ended); prune when Optuna says so."""
        try:
            with open(run.metrics, "rb") as f:
                f.seek(run.offset)
                chunk = f.read()
        except OSError:
            return
        whole, before = chunk if ended else chunk[:chunk.rfind(b"\n") + 1], run.steps
        run.offset += len(whole)
        for line in whole.splitlines():
            value, step = _metric_of(line, self.metric, run.steps)
            if value is None:
                continue
            run.final = value
            run.trial.report(value, step)
            run.steps += 1
        if run.steps > before and not (run.pruned or ended) and run.trial.should_prune():
            run.pruned = True
            self.dispatch.cancel(run.job_id)

    def finish(self, run: Running, job: JobView) -> None:
        """Tell Optuna how the ended trial went; stop the sweep when the contract is broken."""
        from optuna.trial import TrialState
        self.follow(run, ended=True)
        run.trial.set_user_attr("ended", time.time())
        run.trial.set_user_attr("exit_code", job.exit_code)
        del self.running[run.trial.number]
        if run.stopping:
            tell(self.study, run.trial, TrialState.FAIL)
        elif run.pruned:
            tell(self.study, run.trial, TrialState.PRUNED)
        elif job.state == "succeeded" and run.final is not None:
            self.failed_in_a_row = 0
            tell(self.study, run.trial, TrialState.COMPLETE, run.final)
        else:
            tell(self.study, run.trial, TrialState.FAIL)
            self.failed_in_a_row += 1
            self.judge_failure(run, job)

    def judge_failure(self, run: Running, job: JobView) -> None:
        n = run.trial.number
        if job.state == "succeeded":
            self.stop(f"trial {n} ended without reporting the metric '{self.metric}' in "
                      "$CLOUDTRAIN_METRICS_FILE (JSON lines such as {\"step\": 1, "
                      f"\"{self.metric}\": 0.5}}): the sweep stopped rather than run trials "
                      "with no objective")
        elif self.failed_in_a_row >= MAX_FAILED_IN_A_ROW:
            self.stop(f"{self.failed_in_a_row} trials in a row failed (the last, trial {n}: "
                      f"{job.state}, exit code {job.exit_code}; its log: "
                      f"{os.path.join(self.root, 'jobs', run.job_id, 'node.log')})")

    def poll(self) -> bool:
        """One round; False when this worker has nothing left to do."""
        jobs = self.dispatch.jobs() if self.running else {}
        for run in list(self.running.values()):
            job = jobs.get(run.job_id)
            if job and job.gpus and not run.gpus_seen:
                run.gpus_seen = True
                run.trial.set_user_attr("gpus", list(job.gpus))
            if job is None or job.state not in ENDED:
                self.follow(run)
            else:
                self.finish(run, job)
        if self.stop_reason() is not None:
            return self.halt()
        while self.room():
            self.launch()
        return bool(self.running) or self.study_open()

    def study_open(self) -> bool:
        trials = self.study.get_trials(deepcopy=False)
        return len(trials) < self.total() or any(t.state.name == "RUNNING" for t in trials)

    def halt(self) -> bool:
        """The sweep was stopped: cancel this worker's trials; each is told FAIL when its job
        has ended (``poll``)."""
        for run in self.running.values():
            if not run.stopping:
                run.stopping = True
                if not run.pruned:
                    self.dispatch.cancel(run.job_id)
        return bool(self.running)

    def run(self, poll_s: float = POLL_S) -> None:
        while self.poll():
            self.nap(poll_s)

    def nap(self, poll_s: float) -> None:
        """Sleep ``poll_s``, waking as soon as one of this worker's trial jobs has ended (its
        ``ROOT/jobs/JOB_ID/rc``, written by the queue's job when it exits): its slot takes
        the next trial without waiting out the poll. A stat per running trial every 20 ms."""
        deadline = time.monotonic() + poll_s
        marks = [(r, os.path.join(self.root, "jobs", r.job_id, "rc"))
                 for r in self.running.values() if not r.woke]
        while (left := deadline - time.monotonic()) > 0:
            for run, mark in marks:
                if os.path.exists(mark):
                    run.woke = True         # once: a job the queue still shows running
                    return                  # cannot make the worker spin
            time.sleep(min(WAKE_S, left))


def _metric_of(line: bytes, metric: str, steps: int) -> tuple[float | None, int]:
    """The metric's value in one JSON line and its step (the line's "step", else a count)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None, steps
    if not isinstance(rec, dict):
        return None, steps
    value = rec.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None, steps
    step = rec.get("step")
    return float(value), step if isinstance(step, int) and not isinstance(step, bool) else steps
