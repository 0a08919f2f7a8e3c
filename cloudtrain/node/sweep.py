"""The sweep driver's commands, run on the nodes (docs/sweep.md). Optuna does the search
(samplers, pruners, a JournalStorage file on the head: sweepstudy.py); each node's worker
(sweepwork.py) turns trials into jobs of the node's queue (queue.py) and metrics lines into
reports. The three sweep*.py files are the node modules allowed a package outside the
standard library: optuna (grpcio too, for the other nodes' workers), imported inside the
functions that use it, installed on the nodes when a sweep runs.

    python3 sweep.py start ROOT NAME SPEC_JSON_FILE   the head (study, gRPC storage proxy on
                                                      spec "port", its worker), detached
    python3 sweep.py worker ROOT NAME HEAD_ADDR PORT  another node's worker, detached
    python3 sweep.py status|results ROOT NAME         one JSON document (results: every trial)
    python3 sweep.py cancel ROOT NAME                 stop the sweep (running trials: SIGTERM)

Files in ROOT/.cloudtrain/sweeps/NAME: journal.log (the study), spec.json, head.log,
worker.log, trials/NUMBER/metrics.jsonl (the trial's $CLOUDTRAIN_METRICS_FILE), results.json
(the head's last ``results`` document: at each trial's end and at the driver's own end).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

if __package__:
    from cloudtrain.node.sweepkeep import keeping, put_aside, restored
    from cloudtrain.node.sweepstudy import (journal, open_study, read_study, report, sdir,
                                            settled, tell)
    from cloudtrain.node.sweepwork import QueueDispatch, Worker
else:  # on a node: run as a script, its siblings beside it
    from sweepkeep import keeping, put_aside, restored  # type: ignore[no-redef]  # the shipped sibling
    from sweepstudy import journal, open_study, read_study, report, sdir, settled, tell  # type: ignore[no-redef]  # the shipped sibling
    from sweepwork import QueueDispatch, Worker  # type: ignore[no-redef]  # the shipped sibling


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
    restored(root, name)      # a replacement head: the journal kept in the bucket, first
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
    mark_driver(root, name)
    # the journal to the bucket (outside: its last push comes after kept's wind-down)
    with keeping(root, name, lambda: settled(study)), kept(root, study):
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
        spec = put_aside(root, name, json.load(f))   # its "keep": keep.json, not the study
    path = os.path.join(sdir(root, name), "spec.json")
    with open(path + ".tmp", "w") as f:
        json.dump(spec, f)
    os.replace(path + ".tmp", path)
    pid = detach(root, name, ["head", root, name], "head.log")
    print(json.dumps({"pid": pid, "dir": sdir(root, name)}))
    return 0


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


# -- the head's end: what it leaves for a laptop that was gone -------------------------------

class Stopped(Exception):
    """SIGTERM to the head driver: the node guard stops the node (a budget, the lifetime),
    or ``down`` stops the cluster's processes."""


def _stopped(signum: int, frame: Any) -> None:
    raise Stopped()


@contextmanager
def kept(root: str, study: Any) -> Iterator[None]:
    """Around the head's worker: results.json kept current (a thread, at each trial's end)
    and written at the end; a SIGTERM stops the sweep with the guard's reason (wind_down)."""
    done = threading.Event()
    threading.Thread(target=keep_on_change, args=(root, study, done), daemon=True).start()
    signal.signal(signal.SIGTERM, _stopped)
    try:
        yield
    except Stopped:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        wind_down(root, study)
    finally:
        done.set()
        keep_results(root, study)


GUARD_WORDS = {
    "budget": "the cluster's budget (max_cost_usd) was spent: the node guard stopped the "
              "running trials (SIGTERM, then their stop_grace) and the sweep",
    "lifetime": "the cluster's lifetime (max_hours) ended: the node guard stopped the running "
                "trials and the sweep",
    "idle": "the node guard stopped the idle cluster",
}


def guard_reason(root: str) -> str:
    """Why the driver was stopped, in words: the node guard's reason (its stopped.json, written
    before it stops the jobs), or a SIGTERM from outside the sweep."""
    try:
        with open(os.path.join(root, ".cloudtrain", "guard", "stopped.json")) as f:
            reason = json.load(f).get("reason")
    except (OSError, ValueError, AttributeError):
        reason = None
    if reason is None:
        return "the sweep's driver was stopped (SIGTERM: 'cloudtrain down', or its job cancelled)"
    return GUARD_WORDS.get(str(reason), f"the node guard stopped the cluster ({reason})")


def wind_down(root: str, study: Any) -> None:
    """Stop the sweep with the guard's reason; within the trials' grace (the guard SIGTERMs
    their jobs too), tell each running trial FAIL once its job has ended, and what still runs
    then FAIL as well."""
    from optuna.trial import TrialState
    if "stop" not in study.user_attrs:
        study.set_user_attr("stop", {"reason": guard_reason(root), "at": time.time(),
                                     "by": "guard"})
    spec = study.user_attrs.get("spec", {})
    end = time.time() + max(0.5, float(spec.get("stop_grace", 10)) - 1.0)
    while True:
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        for t in running:
            if job_over(root, str(t.user_attrs.get("job_id", ""))) or time.time() >= end:
                tell(study, t.number, TrialState.FAIL)       # its end: datetime_complete
        if not running or time.time() >= end:
            return
        time.sleep(0.2)


def job_over(root: str, job_id: str) -> bool:
    """The trial's job has ended: its exit code is written, or its process is gone."""
    d = os.path.join(root, "jobs", job_id)
    if not job_id or "/" in job_id or os.path.exists(os.path.join(d, "rc")):
        return True
    try:
        with open(os.path.join(d, "pid")) as f:
            os.killpg(int(f.read().strip()), 0)
        return False
    except (OSError, ValueError):
        return True


def keep_on_change(root: str, study: Any, done: Any) -> None:
    """results.json again whenever a trial has ended since the last write."""
    ended = -1
    while not done.wait(1.0):
        try:
            now = sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished())
            if now != ended:
                keep_results(root, study)
                ended = now
        except Exception:  # noqa: BLE001 - a snapshot that fails: the next one, or the last
            pass


def keep_results(root: str, study: Any) -> None:
    """ROOT/.cloudtrain/sweeps/NAME/results.json: the ``results`` document, written atomically
    (what the laptop reads when the head is gone: docs/sweep.md, "Reading a sweep")."""
    path = os.path.join(sdir(root, study.study_name), "results.json")
    doc = dict(report(study, with_trials=True), written_at=time.time())
    tmp = f"{path}.{threading.get_ident()}.tmp"      # the thread's and the last write's
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def mark_driver(root: str, name: str) -> None:
    """ROOT/jobs/sweep-NAME/pid: the driver is the sweep's job on the head (the guard counts
    it as work, and its end as the job's end for ``down: true``) from its first moment, even
    when the CLI that started it was killed before it could write it."""
    d = os.path.join(root, "jobs", f"sweep-{name}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(d, "pid.tmp"), os.path.join(d, "pid"))


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
