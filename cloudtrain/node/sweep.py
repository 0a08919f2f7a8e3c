"""The sweep driver's commands, run on the nodes (docs/sweep.md). Optuna does the search
(samplers, pruners, a JournalStorage file on the head: sweepstudy.py); each node's worker
(sweepwork.py) turns trials into jobs of the node's queue (queue.py) and metrics lines into
reports. The three sweep*.py files are the node modules allowed a package outside the
standard library: optuna (grpcio too, for the other nodes' workers), imported inside the
functions that use it, installed on the nodes when a sweep runs.

    python3 sweep.py start ROOT NAME SPEC_JSON_FILE   the head (study, gRPC storage proxy on
                                                      spec "host", a free port; its worker),
                                                      detached; prints {"pid", "port", "dir"}
    python3 sweep.py worker ROOT NAME HEAD_ADDR PORT [RANK]
                                                      another node's worker, detached; its pid
                                                      in ROOT/jobs/sweep-NAME.worker/pid
    python3 sweep.py status|results ROOT NAME         one JSON document (results: every trial)
    python3 sweep.py cancel ROOT NAME                 stop the sweep (running trials: SIGTERM)

Files in ROOT/.cloudtrain/sweeps/NAME: journal.log (the study), spec.json, proxy.json (the
head's {"host", "port"} once its study and proxy are ready), head.log, worker.log,
trials/NUMBER/metrics.jsonl (the trial's $CLOUDTRAIN_METRICS_FILE), results.json (the
head's last ``results`` document: at each trial's end and at the driver's own end).
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
    # The node's queue.py lies beside this file: once the siblings are in, the standard
    # library's ``queue`` (grpc's thread pool imports it) must not resolve to it.
    sys.path[:] = [p for p in sys.path
                   if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


# -- the commands ---------------------------------------------------------------------------

READY_S = float(os.environ.get("CLOUDTRAIN_SWEEP_READY", "120"))  # start: the head's proxy.json
LINGER_S = 30.0       # the head serves the study this long at most for workers still leaving
FINAL_READ_S = 60.0   # ...and waits this long at most for a reader to fetch the final results
ANSWER_S = 5.0        # after that read: time for its answer to reach the laptop over SSH


def detach(root: str, name: str, args: list[str], log: str) -> int:
    """This file run with ``args`` in its own session (it outlives the SSH connection), in
    ROOT: the trials it submits start there (their script goes into ROOT's ``workdir``)."""
    os.makedirs(sdir(root, name), exist_ok=True)
    with open(os.path.join(sdir(root, name), log), "ab") as f:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=root).pid


def write_json(path: str, doc: dict) -> None:
    """``doc`` at ``path``, atomically (each thread its own temporary file)."""
    tmp = f"{path}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def node_label(spec: dict, rank: int) -> str:
    """How results name a node: its internal address from the spec's ``nodes`` (local nodes
    share a host name), else the host name."""
    nodes = spec.get("nodes")
    if isinstance(nodes, list) and 0 <= rank < len(nodes) and isinstance(nodes[rank], str):
        return nodes[rank]
    return socket.gethostname()


def serve(storage: Any, host: str) -> int:
    """Optuna's gRPC storage proxy on ``host`` (the head's internal address, never every
    interface: the proxy has no authentication) and a port free there; the port once it
    answers. Raises OSError when five ports in a row would not serve."""
    import optuna
    for _ in range(5):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        t = threading.Thread(target=optuna.storages.run_grpc_proxy_server, args=(storage,),
                             kwargs={"host": host, "port": port}, daemon=True)
        t.start()
        deadline = time.time() + 20
        while t.is_alive() and time.time() < deadline:
            try:
                socket.create_connection((host, port), timeout=1).close()
                return port
            except OSError:
                time.sleep(0.1)
    raise OSError(f"the gRPC storage proxy would not listen on {host}")


def run_head(root: str, name: str) -> int:
    """The head: the study from spec.json, the gRPC storage proxy (when the spec names the
    head's ``host``: other nodes run workers), proxy.json, the head's worker; at the end it
    serves the study a while longer for the workers still leaving. Trials left running by
    an earlier head (a recovered cluster resuming the journal) are told FAIL."""
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
    host = spec.get("host")
    port = serve(storage, host) if isinstance(host, str) and host else None
    write_json(os.path.join(sdir(root, name), "proxy.json"), {"host": host, "port": port})
    mark_driver(root, name)
    # the journal to the bucket (outside: its last push comes after kept's wind-down)
    with keeping(root, name, lambda: settled(study)), kept(root, study):
        work(root, study, node_label(spec, 0))
        others = [node_label(spec, r) for r in range(1, len(spec.get("nodes") or []))] \
            if port is not None else []
        linger(study, others)
    print(json.dumps(report(study, with_trials=False)), flush=True)
    return 0


def linger(study: Any, labels: list[str], workers_s: float = LINGER_S,
           read_s: float = FINAL_READ_S) -> None:
    """The sweep has ended; the head (the sweep's job: its end may take the nodes down) goes
    on until every other node's worker said it left (``left:LABEL``; at most ``workers_s``),
    and until ``results`` has read the final document once (``read_final``, so that the
    laptop's ledger holds every trial; at most ``read_s``: nobody may be reading), plus
    ANSWER_S after that read (the node going down would cut the reader's SSH session)."""
    start = time.time()
    while True:
        attrs, now = study.user_attrs, time.time()
        left = now >= start + workers_s or all(f"left:{label}" in attrs for label in labels)
        read = attrs.get("read_final")
        if left and (isinstance(read, (int, float)) and now >= read + ANSWER_S
                     or now >= start + read_s):
            return
        time.sleep(0.2)


def run_worker(root: str, name: str, host: str, port: int, rank: int) -> int:
    """Another node's worker: the study through the head's gRPC storage proxy, its sampler
    seeded ``seed + rank`` (the same seed on two nodes would draw the same params). Once the
    sweep has ended it says it left and marks the end of the sweep's job on this node
    (ROOT/jobs/sweep-NAME/rc, which ``down: true`` waits for); a worker that fails (the head
    lost) marks nothing."""
    import optuna
    from optuna.storages import GrpcStorageProxy
    proxy = GrpcStorageProxy(host=host, port=port)
    proxy.wait_server_ready(timeout=60)
    spec = optuna.load_study(study_name=name, storage=proxy).user_attrs["spec"]
    seed = spec.get("seed")
    study = open_study(proxy, name, dict(spec, seed=None if seed is None else seed + rank))
    label = node_label(spec, rank)
    work(root, study, label)
    study.set_user_attr(f"left:{label}", time.time())
    mark_end(root, name, 0)
    print(json.dumps({"left": label}), flush=True)
    return 0


def end_mark(root: str, name: str) -> str:
    """ROOT/jobs/sweep-NAME/rc: the end of the sweep's job on this node, as the node guard
    reads a job's end (``down_on_end``: node/guard.py ``job_ended``)."""
    return os.path.join(root, "jobs", f"sweep-{name}", "rc")


def mark_end(root: str, name: str, code: int) -> None:
    os.makedirs(os.path.dirname(end_mark(root, name)), exist_ok=True)
    with open(end_mark(root, name) + ".tmp", "w") as f:
        f.write(f"{code}\n")
    os.replace(end_mark(root, name) + ".tmp", end_mark(root, name))


def work(root: str, study: Any, label: str) -> None:
    """This node's worker over the node's queue, until the sweep has ended."""
    grace = float(study.user_attrs["spec"].get("stop_grace", 10))
    dispatch = QueueDispatch(root, f"sweep:{study.study_name}", grace)
    Worker(root, study, dispatch, label).run()


def start(root: str, name: str, spec_file: str) -> int:
    """spec.json, the head detached, then wait (READY_S at most) for its proxy.json."""
    os.makedirs(sdir(root, name), exist_ok=True)
    with open(spec_file) as f:
        spec = put_aside(root, name, json.load(f))   # its "keep": keep.json, not the study
    write_json(os.path.join(sdir(root, name), "spec.json"), spec)
    ready = os.path.join(sdir(root, name), "proxy.json")
    for old in (ready, end_mark(root, name)):   # an earlier head's (a resumed sweep)
        if os.path.exists(old):
            os.remove(old)
    pid = detach(root, name, ["head", root, name], "head.log")
    deadline = time.time() + READY_S
    while not os.path.exists(ready):
        gone = _reaped(pid)
        if gone or time.time() > deadline:
            said = "the sweep's head " + ("exited" if gone else f"was not ready after "
                                          f"{READY_S:g} s") + ": " + \
                _tail(os.path.join(sdir(root, name), "head.log"))
            print(json.dumps({"pid": pid, "error": said}))
            print(said, file=sys.stderr)
            return 1
        time.sleep(0.1)
    with open(ready) as f:
        port = json.load(f).get("port")
    print(json.dumps({"pid": pid, "port": port, "dir": sdir(root, name)}))
    return 0


def _reaped(pid: int) -> bool:
    """True when ``pid`` (our child) has exited (reaped here, so that it is no zombie)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def _tail(path: str, limit: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return "(no log)"


def start_worker(root: str, name: str, host: str, port: str, rank: str) -> int:
    """A worker detached; its pid in ROOT/jobs/sweep-NAME.worker/pid (the node's guard counts
    it as work; that job id is in no ``down_on_end``: a worker's end alone never stops the
    node). An earlier sweep's end mark of the same name is removed first."""
    if os.path.exists(end_mark(root, name)):
        os.remove(end_mark(root, name))
    pid = detach(root, name, ["worker-run", root, name, host, port, rank], "worker.log")
    job = os.path.join(root, "jobs", f"sweep-{name}.worker")
    os.makedirs(job, exist_ok=True)
    with open(os.path.join(job, "pid"), "w") as f:
        f.write(f"{pid}\n")
    print(json.dumps({"pid": pid, "job": f"sweep-{name}.worker"}))
    return 0


def show(root: str, name: str, cmd: str) -> int:
    """status, results (a finished sweep's marks ``read_final``: see linger), or cancel:
    mark the study stopped (every worker then cancels its running trials on its next
    poll)."""
    study = read_study(root, name)
    if study is None:
        print(json.dumps({"name": name, "error": "no such sweep on this node"}))
        return 1
    if cmd == "cancel" and "stop" not in study.user_attrs:
        study.set_user_attr("stop", {"reason": "cancelled (sweep cancel)", "at": time.time(),
                                     "by": "cancel"})
    doc = report(study, with_trials=cmd == "results")
    ended = doc["finished"] and not doc["counts"]["running"] and not doc["counts"]["waiting"]
    if cmd == "results" and ended and "read_final" not in study.user_attrs:
        study.set_user_attr("read_final", time.time())     # the head may end now: linger()
    print(json.dumps(doc))
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
    write_json(os.path.join(sdir(root, study.study_name), "results.json"),
               dict(report(study, with_trials=True), written_at=time.time()))


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
    if cmd == "worker" and len(args) in (4, 5) and all(a.isdigit() for a in args[3:]):
        return start_worker(args[0], args[1], args[2], args[3],
                            args[4] if len(args) == 5 else "1")
    if cmd == "head" and len(args) == 2:
        code = 1
        try:
            code = run_head(*args)
        finally:      # the job sweep-NAME ends here (an exception too), not with the pid only
            mark_end(args[0], args[1], code)
        return code
    if cmd == "worker-run" and len(args) == 5:
        return run_worker(args[0], args[1], args[2], int(args[3]), int(args[4]))
    if cmd in ("status", "results", "cancel") and len(args) == 2:
        return show(args[0], args[1], cmd)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
