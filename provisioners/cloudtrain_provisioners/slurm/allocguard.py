"""The guard inside a Slurm allocation: the allocation's batch script (Python standard library
only), on the allocation's first node, for as long as the allocation lives.

    python3 allocguard.py CT_DIR        (in the batch script: $SLURM_JOB_ID is its allocation)

CT_DIR is ``<workdir>/.cloudtrain`` on the shared filesystem. The guard's own files live in
``CT_DIR/slurm/<allocation>/``: ``policy.json`` (written by the CLI, read on every loop, so a
change applies live), ``guard.log`` (its decisions), ``state.json`` (what it last saw),
``stopped.json`` ({"reason", "at", "allocation"}: written just before it ends the allocation),
``begun`` (made by its first start: the allocation's start, which a restarted guard keeps).
Jobs live in ``CT_DIR/jobs/<job id>/``:

- a detached job (``launch -d``): the CLI drops ``step.sh`` and ``request.json``
  ({"allocation", "nodes", "share"}); the guard writes ``started`` and runs
  ``srun -J ct-job-<id> --output=node-%n.log ... bash step.sh`` in a session of its own (Slurm
  holds a step that does not fit until it does: no queue here); srun's exit code goes to
  ``rc``, each node's to ``rc-<node>`` (written by the step script), srun's own words to
  ``srun.log``. A ``cancelled`` file before it started: it never starts.
- an attached job (``launch`` without -d): the CLI drops ``attached`` and runs the step
  itself; the guard only watches it: seen as a step, then gone, it has ended (``rc`` written
  if the CLI did not write one), which is what a ``--down`` job's end needs when that CLI was
  killed. The guard marks such a step seen (``step-seen``) so that a restarted guard knows.

Policies (cloudtrain/node/guard.py's ``decide``, shipped beside this file as nodeguard.py):
idle (``idle_minutes``: no step of ours running or waiting), job end (``down_on_end``), budget
(``max_cost_usd`` against ``spent_usd`` at ``spent_at`` plus ``cluster_hourly_usd`` since).
A stop: write stopped.json, then ``scancel $SLURM_JOB_ID`` (the user's own job: no other
credential). The hard lifetime is Slurm's own time limit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

if __package__:                    # imported from the package (the tests, mypy)
    from cloudtrain.node import guard as nodeguard
else:                              # on the node: shipped beside this file
    import nodeguard  # type: ignore[no-redef]

POLL_S = 2.0
STEP_NAME = "ct-job-"
_CHILDREN: list[subprocess.Popen[bytes]] = []     # the srun wrappers, reaped as they end


def log(gd: str, line: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
    try:
        with open(os.path.join(gd, "guard.log"), "a") as f:
            f.write(f"{stamp} {line}\n")
    except OSError:
        pass


def our_steps(alloc: str) -> dict[str, str] | None:
    """The allocation's steps of cloudtrain's jobs now, {job id: step id} (None: squeue did
    not answer; nothing is concluded from that)."""
    try:
        r = subprocess.run(["squeue", "-h", "-s", "-j", alloc, "-o", "%i %j"],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    out = {}
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) == 2 and f[1].startswith(STEP_NAME):
            out[f[1][len(STEP_NAME):]] = f[0]
    return out


def _write_if_absent(path: str, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(text)


def start(gd: str, jd: str, job_id: str, req: dict) -> None:
    """srun the detached job's step, in a session of its own (a restarted guard does not wait
    on it: ``rc`` says when it ended)."""
    share = [str(a) for a in req.get("share") or []]
    nodes = str(int(req.get("nodes") or 1))
    srun = ["srun", "-N", nodes, "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--input=none",
            "-J", STEP_NAME + job_id, f"--output={jd}/node-%n.log", *share,
            "bash", os.path.join(jd, "step.sh")]
    # the exit code as srun reports it, written once srun ends (rc.tmp then rc: atomic)
    line = " ".join(_q(a) for a in srun) + f' ; echo $? > {_q(jd)}/rc.tmp && mv {_q(jd)}/rc.tmp {_q(jd)}/rc'
    _write_if_absent(os.path.join(jd, "started"), str(time.time()))
    with open(os.path.join(jd, "srun.log"), "ab") as out:
        p = subprocess.Popen(["/bin/sh", "-c", line], stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True, cwd=jd)
    _CHILDREN.append(p)
    nodeguard.write_json(os.path.join(jd, "srun.json"), {"pgid": p.pid,
                                                         "host": os.uname().nodename})
    log(gd, f"job {job_id}: started (srun -N {nodes} {' '.join(share)})".rstrip())


def stop_srun(jd: str) -> None:
    """A cancelled job's srun (waiting for resources, or its step's client): SIGTERM."""
    rec = nodeguard.read_json(os.path.join(jd, "srun.json")) or {}
    pgid = rec.get("pgid")
    if isinstance(pgid, int) and rec.get("host") == os.uname().nodename:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def jobs(ct: str, alloc: str, steps: dict[str, str] | None, seen: set[str], gd: str) -> bool:
    """Start the allocation's new detached jobs; mark the attached jobs whose step was seen and
    is gone as ended. Whether a job of ours runs or waits (a detached job started and not
    ended, a request not started yet, a step running)."""
    jroot = os.path.join(ct, "jobs")
    try:
        names = os.listdir(jroot)
    except OSError:
        names = []
    working = bool(steps) or steps is None
    for job_id in names:
        jd = os.path.join(jroot, job_id)
        if os.path.exists(os.path.join(jd, "rc")):
            continue
        req = nodeguard.read_json(os.path.join(jd, "request.json"))
        if req is not None and str(req.get("allocation")) == alloc:
            if os.path.exists(os.path.join(jd, "cancelled")):
                stop_srun(jd)              # a started one may wait for resources in srun
                continue
            if not os.path.exists(os.path.join(jd, "started")):
                start(gd, jd, job_id, req)
            working = True
        elif os.path.exists(os.path.join(jd, "attached")) and steps is not None:
            if job_id in steps:
                if job_id not in seen:     # kept in the job's folder too: a restarted guard
                    _write_if_absent(os.path.join(jd, "step-seen"), "")    # knows it ran
                seen.add(job_id)
            elif job_id in seen or os.path.exists(os.path.join(jd, "step-seen")):
                _write_if_absent(os.path.join(jd, "rc"), "")
                log(gd, f"job {job_id}: its step ended")
    return working


def ended_before(ct: str, job_id: str, begun: float) -> bool:
    """A --down job that ended before this allocation began (an earlier allocation's)."""
    try:
        return os.stat(os.path.join(ct, "jobs", job_id, "rc")).st_mtime < begun
    except OSError:
        return False


def own_downs(ct: str, gd: str, pol: dict, begun: float, earlier: set[str]) -> list[str]:
    """The policy's --down jobs but those that ended before this allocation began (the
    cluster's rules keep an earlier allocation's); each of those is logged once."""
    out = []
    for j in pol.get("down_on_end") or []:
        if not isinstance(j, str):
            continue
        if not ended_before(ct, j, begun):
            out.append(j)
        elif j not in earlier:
            earlier.add(j)
            log(gd, f"job {j}: its --down ended before this allocation began: not counted")
    return out


def allocation_begun(gd: str) -> float:
    """When this allocation's guard first started, as the shared filesystem's clock says (the
    clock of the rc files it is compared with): the mtime of ``begun`` in the guard's folder,
    made once. A guard the batch script restarted keeps the allocation's start, not its own,
    so a --down job that ended while no guard ran still counts as this allocation's."""
    path = os.path.join(gd, "begun")
    _write_if_absent(path, "")
    try:
        return os.stat(path).st_mtime
    except OSError:
        return time.time()


def stop(gd: str, alloc: str, reason: str, seen: dict) -> None:
    """The guard's last act: say why, then end its own allocation."""
    detail = {k: seen[k] for k in ("idle_for_s", "spent_usd", "job_end_stop_at") if k in seen}
    nodeguard.write_json(os.path.join(gd, "stopped.json"),
                         {"reason": reason, "at": time.time(), "allocation": alloc,
                          "detail": detail})
    log(gd, f"stop: {reason} {json.dumps(detail)}: scancel {alloc}")
    try:
        r = subprocess.run(["scancel", alloc], capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            log(gd, f"scancel {alloc} failed: {r.stderr.strip()[:300]}; the batch script ends")
    except (OSError, subprocess.SubprocessError) as exc:
        log(gd, f"scancel {alloc} failed: {exc}; the batch script ends")


def run(ct: str) -> int:
    alloc = os.environ.get("SLURM_JOB_ID", "")
    if not alloc:
        print("allocguard.py runs as a Slurm job's batch script ($SLURM_JOB_ID)", file=sys.stderr)
        return 2
    gd = os.path.join(ct, "slurm", alloc)
    os.makedirs(gd, exist_ok=True)
    os.makedirs(os.path.join(ct, "jobs"), exist_ok=True)
    begun = allocation_begun(gd)
    busy_at = time.time()
    seen: set[str] = set()
    earlier: set[str] = set()        # --down jobs of earlier allocations (logged once)
    pol: dict = {}
    last_rules, last_write = None, 0.0
    log(gd, f"guard started on {os.environ.get('SLURMD_NODENAME', '?')} (pid {os.getpid()}) "
            f"for allocation {alloc}")
    while not os.path.exists(os.path.join(gd, "stopped.json")):
        pol = nodeguard.read_json(os.path.join(gd, "policy.json")) or pol
        _CHILDREN[:] = [c for c in _CHILDREN if c.poll() is None]
        steps = our_steps(alloc)
        working = jobs(ct, alloc, steps, seen, gd)
        now = time.time()
        if working:
            busy_at = now
        mine = dict(pol, down_on_end=own_downs(ct, gd, pol, begun, earlier))
        reason, state = nodeguard.decide(ct, mine, now, busy_at, begun, working, working)
        state.update(steps=steps, allocation=alloc)
        rules = {k: pol.get(k) for k in ("idle_minutes", "down_on_end", "max_cost_usd")}
        if rules != last_rules:
            log(gd, "policy: " + json.dumps(rules, sort_keys=True))
            last_rules = rules
        if reason is not None or now - last_write >= 10:
            nodeguard.write_json(os.path.join(gd, "state.json"), state)
            last_write = now
        if reason is not None:
            stop(gd, alloc, reason, state)
            return 0
        time.sleep(nodeguard.num(pol, "poll_s") or POLL_S)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(run(sys.argv[1]))
