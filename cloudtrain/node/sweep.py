"""The sweep driver, run on the nodes (docs/sweep.md). Optuna does the search (samplers,
pruners, a JournalStorage file on the head); this module turns trials into jobs of the node's
queue (queue.py, beside it) and metrics lines into reports. The one node module allowed a
package outside the standard library: optuna (grpcio too, for the other nodes' workers),
imported inside the functions that use it, installed on the nodes when a sweep runs.

    python3 sweep.py start ROOT NAME SPEC_JSON_FILE   the head (study, gRPC storage proxy on
                                                      spec "port", its worker), detached
    python3 sweep.py worker ROOT NAME HEAD_ADDR PORT  another node's worker, detached
    python3 sweep.py status|results ROOT NAME         one JSON document (results: every trial)
    python3 sweep.py cancel ROOT NAME                 stop the sweep (running trials: SIGTERM)

Files in ROOT/.cloudtrain/sweeps/NAME: journal.log (the study), spec.json, head.log,
worker.log, trials/NUMBER/metrics.jsonl (the trial's $CLOUDTRAIN_METRICS_FILE).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

POLL_S = float(os.environ.get("CLOUDTRAIN_SWEEP_POLL", "0.5"))
HERE = os.path.dirname(os.path.abspath(__file__))
ENDED = ("succeeded", "failed", "cancelled")
MAX_FAILED_IN_A_ROW = 3


def sdir(root: str, name: str) -> str:
    return os.path.join(root, ".cloudtrain", "sweeps", name)


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
                                tuple(str(g) for g in r.get("held") or ()))
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


# -- Optuna's pieces, from the spec ---------------------------------------------------------

def distributions(spec: dict) -> dict[str, Any]:
    from optuna.distributions import (CategoricalDistribution, FloatDistribution,
                                      IntDistribution)
    out: dict[str, Any] = {}
    for k, p in spec["params"].items():
        if p["kind"] == "choice":
            out[k] = CategoricalDistribution(p["choices"])
        elif p["kind"] == "int":
            out[k] = IntDistribution(p["low"], p["high"], log=p["log"], step=p["step"])
        else:
            out[k] = FloatDistribution(p["low"], p["high"], log=p["kind"] == "loguniform")
    return out


def grid_space(spec: dict) -> dict[str, list]:
    """Every point of the grid sampler's axes (the spec has choice and int params only)."""
    return {k: p["choices"] if p["kind"] == "choice"
            else list(range(p["low"], p["high"] + 1, p["step"]))
            for k, p in spec["params"].items()}


def sampler(spec: dict) -> Any:
    import optuna
    seed, kind = spec.get("seed"), spec.get("sampler", "tpe")
    if kind == "grid":
        return optuna.samplers.GridSampler(grid_space(spec), seed=seed)
    return {"tpe": optuna.samplers.TPESampler, "nsga2": optuna.samplers.NSGAIISampler,
            "random": optuna.samplers.RandomSampler}[kind](seed=seed)


def pruner(spec: dict) -> Any:
    import optuna
    kind = spec.get("pruner", "median")
    if kind == "median":
        return optuna.pruners.MedianPruner()
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def journal(root: str, name: str) -> Any:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    os.makedirs(sdir(root, name), exist_ok=True)
    return JournalStorage(JournalFileBackend(os.path.join(sdir(root, name), "journal.log")))


def open_study(storage: Any, name: str, spec: dict | None = None) -> Any:
    """The study (created from ``spec`` when given, else loaded as the head made it)."""
    import warnings

    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # gRPC
    if spec is None:
        spec = optuna.load_study(study_name=name, storage=storage).user_attrs["spec"]
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                direction=spec["objective"]["goal"], sampler=sampler(spec),
                                pruner=pruner(spec))
    if "spec" not in study.user_attrs:
        study.set_user_attr("spec", spec)
    return study


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


def trial_script(spec: dict, name: str, number: int, metrics: str, params: dict) -> str:
    """The job a trial runs: its params as env and as "$@" (--name value), then the spec's
    script (the task's run:/train:, composed by the CLI)."""
    env = {"CLOUDTRAIN_SWEEP": name, "CLOUDTRAIN_TRIAL": str(number),
           "CLOUDTRAIN_METRICS_FILE": metrics}
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
        trial = self.study.ask(fixed_distributions=self.dists)
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
            time.sleep(poll_s)


def tell(study: Any, trial: Any, state: Any, value: float | None = None) -> None:
    """``study.tell``; the grid sampler's ``study.stop()`` when its last point is told is
    meant for ``study.optimize`` and raises here, after the trial's state was stored."""
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


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


# -- reading a study: status and results ----------------------------------------------------

def trial_record(t: Any) -> dict:
    attrs = t.user_attrs
    started = attrs.get("started") or (t.datetime_start.timestamp() if t.datetime_start else None)
    ended = attrs.get("ended") or (t.datetime_complete.timestamp()
                                   if t.datetime_complete else None)
    return {"number": t.number, "params": t.params, "state": t.state.name.lower(),
            "value": t.value if t.state.name == "COMPLETE" else None,
            "intermediate": len(t.intermediate_values), "started": started, "ended": ended,
            "duration_s": round(ended - started, 3) if started and ended else None,
            "gpus": attrs.get("gpus", []), "node": attrs.get("node"),
            "job_id": attrs.get("job_id"), "exit_code": attrs.get("exit_code")}


def report(study: Any, with_trials: bool) -> dict:
    """One JSON document: counts by state, the best trial, the stop reason (and the trials)."""
    spec = study.user_attrs.get("spec", {})
    trials = [trial_record(t) for t in study.get_trials(deepcopy=False)]
    counts = {s: sum(1 for t in trials if t["state"] == s)
              for s in ("running", "complete", "pruned", "fail", "waiting")}
    done = [t for t in trials if t["state"] == "complete"]
    pick = min if spec.get("objective", {}).get("goal", "minimize") == "minimize" else max
    best = pick(done, key=lambda t: t["value"]) if done else None
    stop = study.user_attrs.get("stop")
    out = {"name": study.study_name, "trials": spec.get("trials"), "counts": counts,
           "objective": spec.get("objective"), "best": best,
           "stopped": stop["reason"] if stop else None, "lost": study.user_attrs.get("lost", []),
           "finished": bool(stop) or (len(trials) >= int(spec.get("trials", 0))
                                      and counts["running"] == 0 and counts["waiting"] == 0)}
    if with_trials:
        out["trials_list"] = trials
    return out


# -- the commands ---------------------------------------------------------------------------

def detach(root: str, name: str, args: list[str], log: str) -> int:
    """This file run with ``args`` in its own session (it outlives the SSH connection)."""
    os.makedirs(sdir(root, name), exist_ok=True)
    with open(os.path.join(sdir(root, name), log), "ab") as f:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True).pid


def run_head(root: str, name: str) -> int:
    """The head: the study from spec.json, the gRPC storage proxy, the head's worker. Trials
    left running by an earlier head (a recovered cluster resuming the journal) are told FAIL."""
    import optuna
    from optuna.trial import TrialState
    with open(os.path.join(sdir(root, name), "spec.json")) as f:
        spec = json.load(f)
    storage = journal(root, name)
    study = open_study(storage, name, spec)
    lost = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    for number in lost:
        tell(study, number, TrialState.FAIL)
    if lost:
        study.set_user_attr("lost", study.user_attrs.get("lost", []) + lost)
    if spec.get("port"):
        threading.Thread(target=optuna.storages.run_grpc_proxy_server, args=(storage,),
                         kwargs={"host": "0.0.0.0", "port": int(spec["port"])},
                         daemon=True).start()
    work(root, study)
    print(json.dumps(report(study, with_trials=False)), flush=True)
    return 0


def run_worker(root: str, name: str, host: str, port: int) -> int:
    """Another node's worker: the study through the head's gRPC storage proxy."""
    from optuna.storages import GrpcStorageProxy
    work(root, open_study(GrpcStorageProxy(host=host, port=port), name))
    return 0


def work(root: str, study: Any) -> None:
    """This node's worker over the node's queue, until the sweep has ended."""
    grace = float(study.user_attrs["spec"].get("stop_grace", 10))
    dispatch = QueueDispatch(root, f"sweep:{study.study_name}", grace)
    Worker(root, study, dispatch, socket.gethostname()).run()


def start(root: str, name: str, spec_file: str) -> int:
    os.makedirs(sdir(root, name), exist_ok=True)
    with open(spec_file) as f:
        spec = json.load(f)
    path = os.path.join(sdir(root, name), "spec.json")
    with open(path + ".tmp", "w") as f:
        json.dump(spec, f)
    os.replace(path + ".tmp", path)
    pid = detach(root, name, ["head", root, name], "head.log")
    print(json.dumps({"pid": pid, "dir": sdir(root, name)}))
    return 0


def read_study(root: str, name: str) -> Any:
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not os.path.exists(os.path.join(sdir(root, name), "journal.log")):
        return None
    return optuna.load_study(study_name=name, storage=journal(root, name))


def show(root: str, name: str, cmd: str) -> int:
    """status, results, or cancel: mark the study stopped (every worker then cancels its
    running trials on its next poll)."""
    study = read_study(root, name)
    if study is None:
        print(json.dumps({"name": name, "error": "no such sweep on this node"}))
        return 1
    if cmd == "cancel" and "stop" not in study.user_attrs:
        study.set_user_attr("stop", {"reason": "cancelled (sweep cancel)", "at": time.time(),
                                     "by": "cancel"})
    print(json.dumps(report(study, with_trials=cmd == "results")))
    return 0


def main(argv: list[str]) -> int:
    cmd, args = (argv[1], argv[2:]) if len(argv) > 2 else ("", [])
    args = [os.path.abspath(os.path.expanduser(args[0]))] + args[1:] if args else args
    if cmd == "start" and len(args) == 3:
        return start(*args)
    if cmd == "worker" and len(args) == 4:
        pid = detach(args[0], args[1], ["worker-run", *args], "worker.log")
        print(json.dumps({"pid": pid}))
        return 0
    if cmd == "head" and len(args) == 2:
        return run_head(*args)
    if cmd == "worker-run" and len(args) == 4:
        return run_worker(args[0], args[1], args[2], int(args[3]))
    if cmd in ("status", "results", "cancel") and len(args) == 2:
        return show(args[0], args[1], cmd)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
