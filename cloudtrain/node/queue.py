"""The job queue of one node (Python standard library only, like guard.py): a launch on a
busy cluster waits its turn here, and the node starts it when the job before it has ended,
with no CLI connected (docs/queue.md).

    python3 queue.py submit ROOT JOB_ID SUBMITTER SUBMITTED_AT TASK [--gpus N]
                                           (the job script on stdin)
    python3 queue.py run ROOT JOB_ID SUBMITTER SUBMITTED_AT TASK OFFSET [--gpus N]
                                           submit once and follow the job in the same session
                                           (stdin: "LENGTH\n", the script, then held open)
    python3 queue.py wait ROOT JOB_ID      the waiter (started by submit; in its own session)
    python3 queue.py list ROOT             every record, oldest first (one JSON list)
    python3 queue.py slots ROOT            the node's GPU slot count
    python3 queue.py room ROOT             {"slots", "free": [slot indices], "queued": N}: what
                                           a job submitted now would find (launch --now)
    python3 queue.py cancel ROOT JOB_ID    a queued job removed; a running one marked (the CLI
                                           stops it with the job's stop_grace)

GPU slots: the node has slots(ROOT) of them (ROOT/.cloudtrain/slots, written by the bootstrap:
the node's GPUs, or the local provider's declared count; 1 when absent). A job submitted with
--gpus N waits for N free slots of this node and runs with CUDA_VISIBLE_DEVICES set to them; one
without --gpus (a whole-node job) waits for all of them and holds them all. Jobs start in
submission order: a job never starts before an earlier one that still waits.

Files in ROOT/.cloudtrain/queue: JOB_ID.json (the record: id, submitter, submitted_at, task,
state, started_at, ended_at, exit_code, gpus: N or null, held: the slot indices while running,
[] otherwise; ran_on: the ones it held, once it ended), JOB_ID.sh (the job's script, 0600,
until it starts), lock (flock). A job starts as ctjob.sh starts one (ROOT/jobs/JOB_ID: run.sh,
node.log, pid, rc), so ``logs --job`` and the stop path work on it unchanged. Every node of a cluster holds
the same queue (the CLI submits to each, with one SUBMITTED_AT), so each node starts its part
of the next job when its part of the one before has ended; the head's copy is the one shown.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

POLL_S = float(os.environ.get("CT_QUEUE_POLL", "0.5"))
ACTIVE = ("queued", "running")
RUN = 'trap : TERM; bash "$1/run.sh"; rc=$?; echo "$rc" > "$1/rc.tmp"; mv "$1/rc.tmp" "$1/rc"'


def qdir(root: str) -> str:
    return os.path.join(root, ".cloudtrain", "queue")


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class Locked:
    """The queue's lock (flock on ROOT/.cloudtrain/queue/lock) while records change."""

    def __init__(self, root: str) -> None:
        os.makedirs(qdir(root), mode=0o700, exist_ok=True)
        self.f = open(os.path.join(qdir(root), "lock"), "a")

    def __enter__(self) -> Locked:
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


WAITER_RESTARTS = 3


def orphaned(rec: dict) -> bool:
    """A queued job whose waiter is gone (killed, OOM): nothing would start it."""
    pid = rec.get("waiter")
    return rec.get("state") == "queued" and isinstance(pid, int) and not alive(pid)


def adopt(root: str, rec: dict) -> dict:
    """A queued job whose waiter died gets a new waiter (at most WAITER_RESTARTS times),
    then is marked failed with the reason. Called with the queue locked."""
    n = int(rec.get("waiter_restarts") or 0)
    if n >= WAITER_RESTARTS or not os.path.exists(os.path.join(qdir(root), rec["id"] + ".sh")):
        rec = dict(rec, state="failed", ended_at=time.time(), waiter=None,
                   reason=f"its waiter process (pid {rec.get('waiter')}) died before the job "
                          f"started, {n} time(s) restarted: nothing would start it")
    else:
        rec = dict(rec, waiter=spawn_waiter(root, rec["id"]), waiter_restarts=n + 1)
    write_json(os.path.join(qdir(root), rec["id"] + ".json"), rec)
    return rec


def refresh(root: str, rec: dict) -> dict:
    """A running record whose job has ended gets its end: time, exit code and state; a
    queued one whose waiter died is adopted (see adopt)."""
    if orphaned(rec):
        return adopt(root, rec)
    if rec.get("state") != "running":
        return rec
    jdir = os.path.join(root, "jobs", rec["id"])
    rc_file = os.path.join(jdir, "rc")
    try:
        with open(os.path.join(jdir, "pid")) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        pid = None
    if os.path.exists(rc_file):
        try:
            with open(rc_file) as f:
                code = int(f.read().strip())
        except (OSError, ValueError):
            code = 1
        ended = os.stat(rc_file).st_mtime
    elif pid is not None and not alive(pid):
        code, ended = 137, time.time()     # ended without writing rc: killed (SIGKILL)
    elif pid is None and time.time() - (rec.get("started_at") or 0) > 30:
        code, ended = 1, time.time()       # never got a pid: the start failed
    else:
        return rec
    state = "cancelled" if rec.get("cancel") else ("succeeded" if code == 0 else "failed")
    rec = dict(rec, state=state, exit_code=code, ended_at=ended, held=[],
               ran_on=rec.get("held") or [])
    write_json(os.path.join(qdir(root), rec["id"] + ".json"), rec)
    return rec


def records(root: str) -> list[dict]:
    """Every record, refreshed, oldest submission first (the queue's order)."""
    out = []
    try:
        names = os.listdir(qdir(root))
    except OSError:
        return []
    for name in names:
        if name.endswith(".json"):
            rec = read_json(os.path.join(qdir(root), name))
            if rec is not None and isinstance(rec.get("id"), str):
                out.append(refresh(root, rec))
    return sorted(out, key=lambda r: (r.get("submitted_at") or 0, r["id"]))


def slots(root: str) -> int:
    """The node's GPU slot count: ROOT/.cloudtrain/slots (1 when absent or unreadable)."""
    try:
        with open(os.path.join(root, ".cloudtrain", "slots")) as f:
            return max(1, int(f.read().strip()))
    except (OSError, ValueError):
        return 1


def held(rec: dict, n: int) -> list[int]:
    """The slots a record holds: its ``held`` while running (all ``n`` for a record written
    before slots existed), none otherwise."""
    if rec.get("state") != "running":
        return []
    got = rec.get("held")
    return [i for i in got if isinstance(i, int)] if isinstance(got, list) else list(range(n))


def allocate(recs: list[dict], job_id: str, n: int) -> list[int] | None:
    """The slots ``job_id`` gets now out of ``n`` (the lowest free ones), or None while it
    must wait: a job submitted before it still waits, or too few slots are free."""
    busy: set[int] = set()
    mine = None
    for rec in recs:
        if rec["id"] == job_id:
            mine = rec
        elif rec.get("state") == "queued" and mine is None:
            return None
        busy.update(held(rec, n))
    if mine is None:
        return None
    want = mine.get("gpus")
    need = want if isinstance(want, int) and want > 0 else n
    free = [i for i in range(n) if i not in busy]
    return free[:need] if len(free) >= need else None


def room(root: str) -> dict:
    """What a job submitted now would find (``launch --now``): the node's slots, the free
    ones, and how many jobs wait (a new job never starts before them)."""
    recs, n = records(root), slots(root)
    busy = {i for rec in recs for i in held(rec, n)}
    return {"slots": n, "free": [i for i in range(n) if i not in busy],
            "queued": sum(1 for rec in recs if rec.get("state") == "queued")}


def ahead(root: str, job_id: str) -> list[dict]:
    """The queued or running jobs submitted before ``job_id``."""
    out = []
    for rec in records(root):
        if rec["id"] == job_id:
            break
        if rec.get("state") in ACTIVE:
            out.append(rec)
    return out


def start(root: str, rec: dict, slots_held: list[int]) -> int:
    """Start the job as ctjob.sh --detach does: its own session, node.log, pid, rc; a job
    that asked for GPUs sees only its slots (CUDA_VISIBLE_DEVICES)."""
    q = qdir(root)
    jdir = os.path.join(root, "jobs", rec["id"])
    old = os.umask(0o077)
    try:
        os.makedirs(jdir, exist_ok=True)
        os.chmod(jdir, 0o700)
        os.chmod(os.path.dirname(jdir), 0o700)   # jobs/: run.sh holds the task's envs
        os.replace(os.path.join(q, rec["id"] + ".sh"), os.path.join(jdir, "run.sh"))
        log = open(os.path.join(jdir, "node.log"), "wb")
    finally:
        os.umask(old)
    env = dict(os.environ)
    if isinstance(rec.get("gpus"), int):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in slots_held)
    with log:
        proc = subprocess.Popen(["bash", "-c", RUN, "_", jdir], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
    with open(os.path.join(jdir, "pid"), "w") as f:
        f.write(str(proc.pid))
    write_json(os.path.join(q, rec["id"] + ".json"),
               dict(rec, state="running", started_at=time.time(), held=slots_held))
    return proc.pid


def submit(root: str, job_id: str, submitter: str, submitted_at: float, task: str,
           script: bytes, gpus: int | None = None) -> str:
    """Queue the job (its script) and start it when its slots are free and no earlier job
    waits: "::started PID" or "::queued POSITION FIRST_AHEAD"; "::refused WHY" (nothing
    queued) when it asks for more GPUs than the node has. Called with the queue locked."""
    if gpus is not None and gpus > slots(root):
        return (f"::refused gpus_per_job is {gpus}, but this node has {slots(root)} GPU "
                "slot(s)")
    q = qdir(root)
    path = os.path.join(q, job_id + ".sh")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(script)
    rec = {"id": job_id, "submitter": submitter, "submitted_at": submitted_at, "task": task,
           "state": "queued", "started_at": None, "ended_at": None, "exit_code": None,
           "gpus": gpus, "held": []}
    write_json(os.path.join(q, job_id + ".json"), rec)
    prune(root)
    got = allocate(records(root), job_id, slots(root))
    if got is not None and not stopped(root):
        return f"::started {start(root, rec, got)}"
    write_json(os.path.join(q, job_id + ".json"),
               dict(rec, waiter=spawn_waiter(root, job_id), queue_py=os.path.abspath(__file__)))
    before = ahead(root, job_id)
    return f"::queued {len(before)} {before[0]['id'] if before else '-'}"


def spawn_waiter(root: str, job_id: str) -> int:
    """The waiter of a queued job (its own session: it outlives the SSH connection)."""
    with open(os.path.join(qdir(root), job_id + ".waiter.log"), "ab") as log:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "wait", root,
                                 job_id], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True).pid


def read_framed() -> bytes:
    """stdin: "LENGTH\n" then LENGTH bytes, read exactly (stdin stays open after them)."""
    head = b""
    while not head.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            break
        head += c
    if not head.strip().isdigit():
        raise ValueError("no script length on stdin")
    left, out = int(head), []
    while left > 0:
        chunk = os.read(0, min(left, 65536))
        if not chunk:
            raise ValueError("stdin ended inside the script")
        out.append(chunk)
        left -= len(chunk)
    return b"".join(out)


def run(root: str, job_id: str, submitter: str, submitted_at: float, task: str,
        offset: str, gpus: int | None = None) -> int:
    """Submit once and follow, in one session (the launch's): the framed script on stdin,
    then stdin held open as the follower's EOF watch. A repeat of the same command (a
    reconnect) submits nothing: it follows from ``offset``. A job that waits its turn says
    "::ctjob queued POSITION FIRST_AHEAD" on stderr and exits 253 (the CLI waits, then
    follows); stdout carries only the job's node.log."""
    try:
        script = read_framed()
    except ValueError as exc:
        print(f"::ctjob bad-input: {exc}", file=sys.stderr)
        return 2
    with Locked(root):
        rec = read_json(os.path.join(qdir(root), job_id + ".json"))
        if rec is None:
            said = submit(root, job_id, submitter, submitted_at, task, script, gpus)
            if said.startswith("::refused "):
                print(f"::ctjob bad-input: {said[10:]}", file=sys.stderr)
                return 2
            state: str | None = "running" if said.startswith("::started") else "queued"
        else:
            state = rec.get("state")
            before = ahead(root, job_id) if state == "queued" else []
            said = f"::queued {len(before)} {before[0]['id'] if before else '-'}"
    if state == "queued":
        print(said.replace("::", "::ctjob ", 1), file=sys.stderr)
        return 253
    if state == "cancelled" and not os.path.exists(os.path.join(root, "jobs", job_id, "pid")):
        print(f"::ctjob no-job: job {job_id} was cancelled before it started", file=sys.stderr)
        return 254
    follow(os.path.join(root, "jobs", job_id), offset)
    return 255


def follow(jdir: str, offset: str) -> None:
    """ctjob.sh --follow, in this process: the follower's code is the one in ctjob.sh beside
    this file (one copy of it; no second interpreter to start). Exits with its code."""
    ctjob = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ctjob.sh")
    sys.stderr.flush()
    try:
        with open(ctjob) as f:
            code = f.read().split("\nfollower='\n", 1)[1].split("\n'\n", 1)[0]
        compiled = compile(code, ctjob + " (follower)", "exec")
    except (OSError, IndexError, SyntaxError):
        os.execvp("bash", ["bash", ctjob, jdir, "--follow", offset])
    sys.argv = [ctjob, jdir, offset, "0"]
    exec(compiled, {"__name__": "ctjob_follower"})
    sys.exit(255)


def prune(root: str) -> None:
    """Ended records beyond the newest CLOUDTRAIN_KEEP_QUEUE (100) are removed."""
    keep = int(os.environ.get("CLOUDTRAIN_KEEP_QUEUE", "100"))
    ended = [r for r in records(root) if r.get("state") not in ACTIVE]
    for rec in ended[:max(0, len(ended) - keep)]:
        for suffix in (".json", ".sh", ".waiter.log"):
            try:
                os.unlink(os.path.join(qdir(root), rec["id"] + suffix))
            except OSError:
                pass


def stopped(root: str) -> bool:
    """The node guard has stopped this node: nothing more starts."""
    return os.path.exists(os.path.join(root, ".cloudtrain", "guard", "stopped.json"))


def wait(root: str, job_id: str) -> int:
    path = os.path.join(qdir(root), job_id + ".json")
    while os.path.isdir(qdir(root)):       # gone: the cluster was torn down
        with Locked(root):
            rec = read_json(path)
            if rec is None or rec.get("state") != "queued":
                return 0
            if stopped(root):
                write_json(path, dict(rec, state="cancelled", ended_at=time.time(),
                                      reason="the node guard stopped the node"))
                return 0
            got = allocate(records(root), job_id, slots(root))
            if got is not None:
                start(root, rec, got)
                return 0
        time.sleep(POLL_S)
    return 0


def cancel(root: str, job_id: str) -> int:
    path = os.path.join(qdir(root), job_id + ".json")
    with Locked(root):
        rec = read_json(path)
        if rec is None:
            print("::unknown")
            return 0
        rec = refresh(root, rec)
        state = rec.get("state")
        if state == "queued":
            write_json(path, dict(rec, state="cancelled", ended_at=time.time()))
            try:
                os.unlink(os.path.join(qdir(root), job_id + ".sh"))
            except OSError:
                pass
        elif state == "running":
            write_json(path, dict(rec, cancel=True))
        print(f"::was {state}")
    return 0


def gpus_option(args: list[str]) -> tuple[list[str], int | None]:
    """``--gpus N`` taken out of ``args`` (N a whole number >= 1; ValueError otherwise)."""
    if "--gpus" not in args:
        return args, None
    i = args.index("--gpus")
    value = args[i + 1] if i + 1 < len(args) else ""
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--gpus wants a whole number of GPU slots >= 1, not '{value}'")
    return args[:i] + args[i + 2:], int(value)


def main(argv: list[str]) -> int:
    cmd, args = (argv[1], argv[2:]) if len(argv) > 2 else ("", [])
    try:
        args, gpus = gpus_option(args)
    except ValueError as exc:
        print(f"::bad-input {exc}", file=sys.stderr)
        return 2
    args = [os.path.abspath(os.path.expanduser(args[0]))] + args[1:] if args else args
    if cmd == "submit" and len(args) == 5:
        with Locked(args[0]):
            said = submit(args[0], args[1], args[2], float(args[3]), args[4],
                          sys.stdin.buffer.read(), gpus)
        print(said)
        return 2 if said.startswith("::refused ") else 0
    if cmd == "run" and len(args) == 6:
        return run(args[0], args[1], args[2], float(args[3]), args[4], args[5], gpus)
    if cmd == "slots" and len(args) == 1:
        print(slots(args[0]))
        return 0
    if cmd == "wait" and len(args) == 2:
        return wait(args[0], args[1])
    if cmd == "cancel" and len(args) == 2:
        return cancel(args[0], args[1])
    if cmd == "room" and len(args) == 1:
        with Locked(args[0]):
            print(json.dumps(room(args[0])))
        return 0
    if cmd == "list" and len(args) == 1:
        with Locked(args[0]):
            print(json.dumps(records(args[0])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
