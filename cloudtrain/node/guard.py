"""The node guard: one small daemon per node (Python standard library only) that ends the
node's billing when a policy fires, with no user credential on the node.

    python3 guard.py run ROOT        the loop (the supervisor restarts it when it dies)
    python3 guard.py deadman ROOT    the hard lifetime alone, in a separate process
    python3 guard.py state ROOT      print what the guard last saw (for ``status``)

ROOT is the node's root_dir; the guard's files live in ROOT/.cloudtrain/guard:
``policy.json`` (written by the CLI, read on every loop, so changes apply live), ``lease``
(the epoch of the last CLI contact), ``guard.log`` (its decisions), ``state.json`` (what it
last saw), ``stopped.json`` ({"reason", "at"}: written just before the self-stop).

Policies (each off when its field is null): idle (``idle_minutes``: no cloudtrain job and no
interactive SSH session, counted from the last busy moment or CLI contact), job end
(``down_on_end``: job ids whose end stops the node; one in ``recovering`` only after its
time: a recovery stopped it and goes on), budget (``max_cost_usd`` against
``spent_usd`` at ``spent_at`` plus ``cluster_hourly_usd`` since then), lifetime
(``max_hours`` from ``started_at``; also watched by the deadman process). A stop: write
stopped.json, log, SIGTERM the running jobs (``grace_s``, then SIGKILL), then run
``self_stop`` with CT_GUARD_REASON set. Without a ``self_stop`` (machines cloudtrain does not
own) only cloudtrain's own processes are stopped, and idle does nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

if __package__:                    # imported from the package (the CLI, the tests)
    from cloudtrain.node.sessions import proc_env, proc_pids, ssh_sessions
else:                              # run on the node: sessions.py is shipped beside this file
    from sessions import (  # type: ignore[no-redef]  # the same names, from the node's copy
        proc_env, proc_pids, ssh_sessions)

POLL_S = float(os.environ.get("CT_GUARD_POLL", "2"))


def gdir(root: str) -> str:
    return os.path.join(root, ".cloudtrain", "guard")


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


def log(root: str, line: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
    try:
        with open(os.path.join(gdir(root), "guard.log"), "a") as f:
            f.write(f"{stamp} rank={os.environ.get('CT_GUARD_RANK', '?')} {line}\n")
    except OSError:
        pass


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


def read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# --- what the node is doing --------------------------------------------------------------------

def running_jobs(root: str) -> list[tuple[str, int]]:
    """Job folders of ctjob.sh (ROOT/jobs/ID) whose job still runs: (folder, pid)."""
    jobs_dir = os.path.join(root, "jobs")
    found = []
    try:
        names = os.listdir(jobs_dir)
    except OSError:
        return []
    for name in names:
        d = os.path.join(jobs_dir, name)
        if os.path.exists(os.path.join(d, "rc")):
            continue
        pid = read_pid(os.path.join(d, "pid"))
        if pid is not None and alive(pid):
            found.append((d, pid))
    return found


SUBMIT_S = 60.0     # a queued record with no waiter older than this: its submission died


def queued_records(root: str) -> list[dict]:
    """The queued records of the node's queue (cloudtrain/node/queue.py), each with the
    age of its file (``_age_s``)."""
    qd = os.path.join(root, ".cloudtrain", "queue")
    names = os.listdir(qd) if os.path.isdir(qd) else []
    out = []
    for n in names:
        path = os.path.join(qd, n)
        rec = read_json(path) if n.endswith(".json") else None
        if rec and rec.get("state") == "queued":
            try:
                rec["_age_s"] = time.time() - os.stat(path).st_mtime
            except OSError:
                continue
            out.append(rec)
    return out


def startable(rec: dict) -> bool:
    """A queued job that something will start: its waiter runs (a record with no waiter is
    being submitted, under the queue's lock, for at most SUBMIT_S)."""
    pid = rec.get("waiter")
    if isinstance(pid, int):
        return alive(pid)
    return float(rec.get("_age_s") or 0.0) < SUBMIT_S


def queued_jobs(root: str) -> int:
    """Jobs waiting in the node's queue that something will start: queued work is not idle,
    but a job whose waiter died is not work (the queue gives it a new waiter, or marks it
    failed: adopt_orphans)."""
    recs = queued_records(root)
    if not all(startable(r) for r in recs):
        adopt_orphans(root, [r for r in recs if not startable(r)])
        recs = queued_records(root)
    return sum(1 for r in recs if startable(r))


def adopt_orphans(root: str, orphans: list[dict]) -> None:
    """Have the queue look at itself (``queue.py list``, which adopts a queued job whose
    waiter died: a new waiter, or failed with the reason)."""
    for q in {r.get("queue_py") for r in orphans}:
        if isinstance(q, str) and os.path.isfile(q):
            log(root, "a queued job's waiter is gone: the queue adopts it")
            try:
                subprocess.run([sys.executable, q, "list", root], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, timeout=30)
            except (OSError, subprocess.SubprocessError) as exc:
                log(root, f"queue.py list failed: {exc}")


def job_ended(root: str, job_id: str, now: float | None = None) -> float | None:
    """When the job ended (its rc file's time; ``now`` for one killed before writing it: the
    sweep driver, which writes none, or a job SIGKILLed; its
    queue record's end for one that never started: cancelled, or failed in the queue), or
    None while it runs or waits."""
    d = os.path.join(root, "jobs", job_id)
    try:
        return os.stat(os.path.join(d, "rc")).st_mtime
    except OSError:
        pass
    pid = read_pid(os.path.join(d, "pid"))
    if pid is not None:
        return None if alive(pid) else (time.time() if now is None else now)
    rec = read_json(os.path.join(root, ".cloudtrain", "queue", job_id + ".json")) or {}
    if rec.get("state") in ("cancelled", "failed", "succeeded"):
        return num(rec, "ended_at") or time.time()
    return None


FOLLOWER_WINDOW_S = 30.0    # a follower silent this long (after its last beat) is gone
FOLLOWER_BEAT_S = 5.0       # how often an attached CLI says it is there


def follower_seen(root: str, job_id: str) -> float | None:
    """The last heartbeat of the attached CLI that follows ``job_id`` (the mtime of
    guard/followers/JOB_ID, which the CLI touches every FOLLOWER_BEAT_S)."""
    try:
        return os.stat(os.path.join(gdir(root), "followers", job_id)).st_mtime
    except OSError:
        return None


def job_end_stop_at(root: str, pol: dict, job_id: str, now: float | None = None) -> float | None:
    """When the end of a ``--down`` job stops the node (None: it has not ended). A detached
    job: at its end. One an attached CLI follows (``followed``: {job: grace}): the CLI
    pulls outputs and tears down itself, so the node waits, but only while the CLI is there:
    min(end + grace, max(end, last heartbeat + window + beat)); the whole grace when no
    heartbeat ever came (a follower that never beat)."""
    ended = job_ended(root, job_id, now)
    if ended is None:
        return None
    followed = pol.get("followed")
    grace = num(followed, job_id) if isinstance(followed, dict) else None
    if grace is None:
        return ended
    seen = follower_seen(root, job_id)
    if seen is None:
        return ended + grace
    gone = seen + (num(pol, "follower_window_s") or FOLLOWER_WINDOW_S) + \
        (num(pol, "follower_beat_s") or FOLLOWER_BEAT_S)
    return min(ended + grace, max(ended, gone))


# --- the policies ---------------------------------------------------------------------------------

def num(pol: dict, key: str) -> float | None:
    v = pol.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def lifetime_end(pol: dict) -> float | None:
    hours, start = num(pol, "max_hours"), num(pol, "started_at")
    return None if hours is None or start is None else start + hours * 3600


def decide(root: str, pol: dict, now: float, busy_at: float, lease: float,
           busy: bool, working: bool = False) -> tuple[str | None, dict]:
    """The reason to stop now (or None), and what the guard sees (state.json). ``working``:
    a job runs, or waits in the queue with something to start it (a ``--down`` job's end
    stops the node only once nothing does)."""
    seen: dict = {"at": now, "busy": busy, "busy_at": busy_at, "lease_at": lease}
    end = lifetime_end(pol)
    if end is not None:
        seen["lifetime_stop_at"] = end
        if now >= end:
            return "lifetime", seen
    cap, hourly = num(pol, "max_cost_usd"), num(pol, "cluster_hourly_usd")
    if cap is not None and hourly is not None:
        spent0, at0 = num(pol, "spent_usd") or 0.0, num(pol, "spent_at") or now
        spent = spent0 + hourly * max(0.0, now - at0) / 3600
        seen["spent_usd"] = round(spent, 6)
        # An attached CLI watches the budget itself: the node acts budget_grace_s later.
        reached = at0 + (cap - spent0) / hourly * 3600 if hourly > 0 else None
        if spent >= cap and (reached is None or now >= reached + (num(pol, "budget_grace_s") or 0)):
            return "budget", seen
    held = pol.get("recovering")
    held = held if isinstance(held, dict) else {}
    for job_id in pol.get("down_on_end") or []:
        if not isinstance(job_id, str) or "/" in job_id or job_id.startswith("."):
            continue
        until = num(held, job_id)
        if until is not None and now < until:     # stopped by a recovery that goes on
            seen["recovering_until"] = until
            continue
        at = job_end_stop_at(root, pol, job_id, now)
        if at is not None:
            seen["job_end_stop_at"] = at
            if now >= at and not working:
                return "job-end", seen
    idle = num(pol, "idle_minutes")
    since = max(busy_at, lease, num(pol, "lease_at") or 0.0)
    seen["idle_for_s"] = 0.0 if busy else round(now - since, 1)
    if idle is not None and pol.get("self_stop"):
        seen["idle_stop_at"] = None if busy else since + idle * 60
        if not busy and now - since >= idle * 60:
            return "idle", seen
    return None, seen


def stop_jobs(root: str, grace: float) -> None:
    """SIGTERM every running job's process group (and what carries its job folder in its
    environment), SIGKILL what is left after ``grace`` seconds."""
    def targets() -> tuple[list[int], list[int]]:
        groups = [pid for _, pid in running_jobs(root)]
        marks = {f"CLOUDTRAIN_JOB_DIR={d}".encode() for d, _ in running_jobs(root)}
        pids = [int(p) for p in proc_pids() if int(p) != os.getpid()
                and marks & set(proc_env(p))] if marks else []
        return groups, pids

    for sig in (signal.SIGTERM, signal.SIGKILL):
        groups, pids = targets()
        if not groups and not pids:
            return
        for g in groups:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.time() + (grace if sig == signal.SIGTERM else 2)
        while time.time() < end and any(targets()):
            time.sleep(0.2)


def end_containers(root: str) -> None:
    """On a host left on (an ``ssh`` host): the cluster's containers (Docker label
    ``cloudtrain-cluster-id``, the cluster's mark) are removed; nothing else of Docker's. A
    host without Docker, or without a container of the cluster, has nothing to do."""
    uid = os.environ.get("CLOUDTRAIN_CLUSTER_ID", "")
    for docker in (["docker"], ["sudo", "-n", "docker"]):    # a user outside group docker
        try:
            ps = subprocess.run([*docker, "ps", "-aq", "--filter",
                                 f"label=cloudtrain-cluster-id={uid}"], capture_output=True,
                                text=True, timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return
        ids = ps.stdout.split()
        if ps.returncode == 0 and uid and ids:
            rm = subprocess.run([*docker, "rm", "-f", *ids], capture_output=True, text=True,
                                timeout=120, stdin=subprocess.DEVNULL)
            log(root, f"container(s) removed: {' '.join(ids)}" if rm.returncode == 0 else
                f"removing container(s) {' '.join(ids)} failed: {rm.stderr.strip()[:200]}")
        if ps.returncode == 0:
            return


def stop(root: str, pol: dict, reason: str, detail: str = "") -> None:
    """The guard's last act."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    d = gdir(root)
    if os.path.exists(os.path.join(d, "stopped.json")):
        return
    decided = {"reason": reason, "at": time.time(), "decided_at": time.time(),
               "rank": pol.get("rank")}
    write_json(os.path.join(d, "stopped.json"), decided)     # no restart, no second stop
    log(root, f"stop: {reason} {detail}".rstrip())
    grace = num(pol, "grace_s") or 60.0
    if running_jobs(root):
        log(root, f"SIGTERM to running jobs (grace {grace:g} s)")
        stop_jobs(root, grace)
    cmd = pol.get("self_stop")
    if not cmd:
        end_containers(root)
        log(root, "no self-stop on this provider: cloudtrain's processes stopped, host left on")
        return
    # "at": when billing ends, just before the self-stop (after the jobs' grace).
    write_json(os.path.join(d, "stopped.json"), dict(decided, at=time.time()))
    log(root, "self-stop: running the provider's command")
    env = dict(os.environ, CT_GUARD_REASON=reason)
    try:
        subprocess.run(["/bin/sh", "-c", cmd], env=env, timeout=600,
                       stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        log(root, f"self-stop failed: {exc}")


def run(root: str) -> int:
    d = gdir(root)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "guard.pid"), "w") as f:
        f.write(str(os.getpid()))
    state = read_json(os.path.join(d, "state.json")) or {}
    busy_at = float(state.get("busy_at") or 0.0)
    pol: dict = {}
    last_write = 0.0
    last_rules = None
    log(root, f"guard started (pid {os.getpid()})")
    lease = 0.0
    while True:
        if os.path.exists(os.path.join(d, "stopped.json")):
            return 0
        pol = read_json(os.path.join(d, "policy.json")) or pol
        now = time.time()
        jobs = running_jobs(root)
        sessions = ssh_sessions()
        queued = queued_jobs(root)
        busy = bool(jobs or sum(sessions) or queued)
        if busy:
            busy_at = now
        # The newest lease seen: the CLI rewrites the file in place (no process for a rename),
        # so a read in the instant of its rewrite may find it empty.
        lease = max(lease, num(read_json(os.path.join(d, "lease")) or {}, "at") or 0.0)
        reason, seen = decide(root, pol, now, busy_at, lease, busy, bool(jobs or queued))
        seen.update(jobs=len(jobs), ssh_sessions=sum(sessions), queued=queued, pid=os.getpid(),
                    job_ids=sorted(os.path.basename(d) for d, _ in jobs),
                    ssh_tty=sessions.tty, ssh_notty=sessions.notty)
        rules = {k: pol.get(k) for k in ("idle_minutes", "down", "down_on_end", "max_cost_usd",
                                         "max_hours")}
        if rules != last_rules:
            log(root, "policy: " + json.dumps(rules, sort_keys=True))
            last_rules = rules
        if reason is not None or now - last_write >= 10 or busy != state.get("busy"):
            write_json(os.path.join(d, "state.json"), seen)
            state, last_write = seen, now
        if reason is not None:
            stop(root, pol, reason, json.dumps({k: v for k, v in seen.items()
                                                if k in ("idle_for_s", "spent_usd")}))
            return 0
        time.sleep(num(pol, "poll_s") or POLL_S)


def deadman(root: str) -> int:
    """The hard lifetime, in a process of its own: it fires even when the guard is dead."""
    d = gdir(root)
    with open(os.path.join(d, "deadman.pid"), "w") as f:
        f.write(str(os.getpid()))
    pol: dict = {}
    while not os.path.exists(os.path.join(d, "stopped.json")):
        pol = read_json(os.path.join(d, "policy.json")) or pol   # the last good one
        end = lifetime_end(pol)
        if end is not None and time.time() >= end:
            stop(root, pol, "lifetime", "(deadman)")
            return 0
        time.sleep(max(1.0, min(10.0, (end - time.time()) if end else 10.0)))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("run", "deadman", "state"):
        print(__doc__, file=sys.stderr)
        return 2
    root = argv[2]
    if argv[1] == "state":
        d = gdir(root)
        out = {"state": read_json(os.path.join(d, "state.json")),
               "stopped": read_json(os.path.join(d, "stopped.json")),
               "guard_alive": any(alive(p) for p in [read_pid(os.path.join(d, "guard.pid"))]
                                  if p is not None)}
        print(json.dumps(out))
        return 0
    return run(root) if argv[1] == "run" else deadman(root)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
