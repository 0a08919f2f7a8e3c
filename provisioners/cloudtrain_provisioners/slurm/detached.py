"""The CLI's side of the guard inside the allocation (allocguard.py), through the login node:
ship the guard into the shared workdir, write its policy, drop a detached job's request,
read what it wrote (a job's per-node logs and exit codes, why it ended the allocation), and
cancel one job's step. Every file lives under ``<workdir>/.cloudtrain`` on the shared
filesystem (allocguard.py's docstring has the layout)."""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from cloudtrain.errors import ProviderError, UserError
from cloudtrain.node import guard as node_guard

from cloudtrain_provisioners.slurm import sched, steps
from cloudtrain_provisioners.slurm.login import Login

# The allocation's batch script: the guard (restarted if it dies; without a Python or the
# guard's files on the node, it only holds the nodes and says so in guard.log).
BATCH = """#!/bin/sh
# cloudtrain: the allocation of cluster {cluster}: its guard (idle stop, job-end --down, budget)
# runs here; jobs run in it as steps (srun). It ends with 'cloudtrain down {cluster}' (scancel),
# when the guard ends it (scancel of this job), or at its time limit.
CT={ct}
PY={python}
GD="$CT/slurm/$SLURM_JOB_ID"
mkdir -p "$GD"
if ! command -v "$PY" >/dev/null 2>&1 || [ ! -f "$CT/slurm/allocguard.py" ]; then
  echo "$(date +%FT%T) no $PY or no allocguard.py on $(hostname): the guard does not run;" \
    "only the time limit holds" >> "$GD/guard.log"
  exec sleep infinity
fi
while [ ! -e "$GD/stopped.json" ]; do
  "$PY" "$CT/slurm/allocguard.py" "$CT" >> "$GD/guard.log" 2>&1
  [ -e "$GD/stopped.json" ] && break
  echo "$(date +%FT%T) the guard exited: restarting it" >> "$GD/guard.log"
  sleep 5
done
"""


def ct_dir(workdir: str) -> str:
    return f"{workdir}/.cloudtrain"


def _write(login: Login, path: str, text: str) -> None:
    r = login.run(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1"',
                   "sh", path], stdin=text)
    if not r.ok:
        raise ProviderError(f"cannot write {path} on the login node: {r.words()}",
                            "Check the workdir on the shared filesystem (resources.slurm."
                            "workdir: writable, with space), then run again.")


def ship_guard(login: Login, workdir: str) -> None:
    """allocguard.py and what it imports (the node guard's policies) into the workdir."""
    here = Path(__file__).resolve().parent
    node = Path(node_guard.__file__).resolve().parent
    for name, src in (("nodeguard.py", node / "guard.py"), ("sessions.py", node / "sessions.py"),
                      ("allocguard.py", here / "allocguard.py")):
        _write(login, f"{ct_dir(workdir)}/slurm/{name}", src.read_text())


def write_policy(login: Login, workdir: str, allocation: str, policy: dict[str, object],
                 attached: str | None = None) -> None:
    """The guard's policy; with ``attached`` (a job id), that job is marked as an attached one
    whose step the guard watches (its end counts for a --down job). One round trip."""
    path = f"{ct_dir(workdir)}/slurm/{allocation}/policy.json"
    mark = f"{job_dir(workdir, attached)}/attached" if attached else ""
    r = login.run(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1" '
                   '&& { [ -z "$2" ] || { mkdir -p "$(dirname "$2")" && : > "$2"; }; }',
                   "sh", path, mark], stdin=json.dumps(policy))
    if not r.ok:
        raise ProviderError(f"cannot write {path} on the login node: {r.words()}",
                            "Check the workdir on the shared filesystem (resources.slurm."
                            "workdir: writable, with space), then run again.")


def job_dir(workdir: str, job_id: str) -> str:
    return f"{ct_dir(workdir)}/jobs/{job_id}"


def submit(login: Login, workdir: str, allocation: str, job_id: str, script: str,
           nodes: int, share: list[str]) -> None:
    """Drop the detached job's step script and request; the guard srun's it."""
    jd = job_dir(workdir, job_id)
    q = shlex.quote(jd)
    body = (f'[ -e {q}/cancelled ] && {{ echo "cloudtrain: job {job_id} was cancelled: not run"'
            ' >&2; exit 130; }\n'       # the guard's kill of a waiting srun may come late
            "(\n" + script + "\n)\nct_rc=$?\n"
            f'echo "$ct_rc" > {q}/rc-"$SLURM_NODEID"\nexit "$ct_rc"\n')
    _write(login, f"{jd}/step.sh", body)
    _write(login, f"{jd}/request.json", json.dumps({"allocation": allocation, "nodes": nodes,
                                                    "share": share, "at": time.time()}))


def started(login: Login, workdir: str, job_id: str, wait_s: float) -> bool:
    """Whether the guard took the request within ``wait_s`` seconds."""
    deadline = time.time() + wait_s
    while True:
        if login.run(["test", "-e", f"{job_dir(workdir, job_id)}/started"]).ok:
            return True
        if time.time() >= deadline:
            return False
        time.sleep(0.5)


def stopped(login: Login, workdir: str, allocation: str) -> dict[str, object] | None:
    """What the guard wrote when it ended ``allocation`` (None: it did not)."""
    r = login.run(["cat", f"{ct_dir(workdir)}/slurm/{allocation}/stopped.json"])
    try:
        data = json.loads(r.out) if r.ok else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def stop_words(data: dict[str, object]) -> str:
    """'idle (no job step for 6 s)', 'budget ($0.0102 spent)', 'job-end (a --down job ended)'."""
    reason = str(data.get("reason") or "?")
    d = data.get("detail") if isinstance(data.get("detail"), dict) else {}
    assert isinstance(d, dict)
    if reason == "idle" and isinstance(d.get("idle_for_s"), (int, float)):
        s = float(d["idle_for_s"])
        return f"idle (no job step for {s / 60:.1f} min)" if s >= 60 else \
            f"idle (no job step for {s:.0f} s)"
    if reason == "budget" and isinstance(d.get("spent_usd"), (int, float)):
        return f"budget (${float(d['spent_usd']):.4f} spent)"
    if reason == "job-end":
        return "job-end (a --down job ended)"
    return reason


@dataclass(frozen=True)
class JobFiles:
    """What the shared filesystem says of one job (``rc``: srun's exit code once it ended,
    None while it runs; ``node_codes``: each node's)."""

    job_id: str
    detached: bool
    started: bool
    cancelled: bool
    rc: int | None
    ended: bool
    node_codes: dict[int, int] = field(default_factory=dict)


_LIST = r"""cd "$1" 2>/dev/null || exit 0
for d in */; do d=${d%/}; [ -d "$d" ] || continue
  printf '%s|%s|%s|%s|%s|' "$d" "$([ -e "$d/request.json" ] && echo 1)" \
    "$([ -e "$d/started" ] && echo 1)" "$([ -e "$d/cancelled" ] && echo 1)" \
    "$([ -e "$d/rc" ] && echo "e$(cat "$d/rc")")"
  for f in "$d"/rc-*; do [ -e "$f" ] && printf '%s=%s,' "${f##*/rc-}" "$(cat "$f")"; done
  echo
done"""


def job_files(login: Login, workdir: str) -> dict[str, JobFiles]:
    """Every job's files, in one round trip."""
    r = login.run(["sh", "-c", _LIST, "sh", f"{ct_dir(workdir)}/jobs"])
    out: dict[str, JobFiles] = {}
    for line in r.out.splitlines() if r.ok else []:
        f = line.split("|")
        if len(f) < 6:
            continue
        codes = {int(k): int(v) for k, _, v in (p.partition("=") for p in f[5].split(","))
                 if k.isdigit() and v.strip().lstrip("-").isdigit()}
        rc = f[4][1:].strip() if f[4].startswith("e") else None
        out[f[0]] = JobFiles(f[0], f[1] == "1", f[2] == "1", f[3] == "1",
                             int(rc) if rc and rc.lstrip("-").isdigit() else None,
                             rc is not None, codes)
    return out


@dataclass(frozen=True)
class LogRead:
    """New bytes of each node's log since the offsets asked (``done``: the job had ended
    before they were read, so nothing more comes)."""

    chunks: dict[int, bytes]
    sizes: dict[int, int]
    done: bool


def read_logs(login: Login, workdir: str, job_id: str, offsets: dict[int, int]) -> LogRead:
    """Each node's log from its offset, with whether the job ended, in one round trip."""
    mark = "::ct-" + secrets.token_hex(6)
    script = (f'd=$1; shift; [ -e "$d/rc" ] && echo "{mark} rc"; '
              'for p in "$@"; do n=${p%%:*}; o=${p#*:}; f="$d/node-$n.log"; '
              '[ -f "$f" ] || continue; s=$(wc -c < "$f"); '
              f'echo "{mark} $n $s"; tail -c +$((o + 1)) "$f" | head -c $((s - o)); done')
    argv = login.argv(["sh", "-c", script, "sh", job_dir(workdir, job_id),
                       *(f"{n}:{o}" for n, o in sorted(offsets.items()))])
    done = subprocess.run(argv, capture_output=True, timeout=120)
    if done.returncode != 0:
        raise ProviderError(f"reading the job's logs on the login node failed: "
                            f"{done.stderr.decode(errors='replace').strip()[:300]}",
                            "Check the login node and the workdir, then run again.")
    out, chunks, sizes, ended = done.stdout, {}, {}, False
    head = mark.encode() + b" "
    pos = 0
    while pos < len(out):
        nl = out.find(b"\n", pos)
        if nl < 0 or not out.startswith(head, pos):
            break
        words = out[pos + len(head):nl].split()
        pos = nl + 1
        if words == [b"rc"]:
            ended = True
            continue
        n, size = int(words[0]), int(words[1])
        take = max(0, size - offsets.get(n, 0))
        chunks[n], sizes[n] = out[pos:pos + take], size
        pos += take
    return LogRead(chunks, sizes, ended)


def cancel(login: Login, workdir: str, allocation: str, job_id: str) -> str | None:
    """Stop one job: never started if the guard has not taken it yet; its step scancel'ed if
    it runs (the allocation and its other steps keep running). The step's id, or None."""
    _write(login, f"{job_dir(workdir, job_id)}/cancelled", "")
    r = login.run(["squeue", "-h", "-s", "-j", allocation, "-o", "%i %j"])
    steps = [ln.split()[0] for ln in r.out.splitlines()
             if ln.split()[1:] == [f"ct-job-{job_id}"]] if r.ok else []
    if steps:
        c = login.run(["scancel", *steps])
        if not c.ok and "Invalid job id" not in c.err:
            raise ProviderError(f"scancel {' '.join(steps)}: {c.words()}",
                                "Run the cancel again.")
        return steps[0]
    # a started srun that waits for resources: the guard stops it (it looks every 2 s)
    jd = job_dir(workdir, job_id)
    deadline = time.time() + 15
    while login.run(["test", "-e", f"{jd}/started"]).ok and \
            not login.run(["test", "-e", f"{jd}/rc"]).ok and time.time() < deadline:
        time.sleep(0.5)
    return None


def step_states(login: Login, allocation: str) -> dict[str, str]:
    """The allocation's running steps of cloudtrain's jobs: {job id: step id}."""
    r = login.run(["squeue", "-h", "-s", "-j", allocation, "-o", "%i %j"])
    out = {}
    for ln in r.out.splitlines() if r.ok else []:
        f = ln.split()
        if len(f) == 2 and f[1].startswith("ct-job-"):
            out[f[1][len("ct-job-"):]] = f[0]
    return out


StepText = Callable[[dict[str, object], str, str, Mapping[str, str], str, "int | None"],
                    tuple[str, list[str]]]


@dataclass(frozen=True)
class AllocationJobs:
    """The cluster's allocation as its jobs see it: the login node, the workdir on the shared
    filesystem, the running allocation (None: none runs now), the cluster's record, and how
    the provider writes a step script (``step_text``)."""

    login: Login
    workdir: str
    allocation: sched.Allocation | None
    record: dict[str, object]
    step_text: StepText

    def running(self) -> sched.Allocation:
        if self.allocation is None:
            raise UserError("the cluster has no running Slurm allocation.",
                            "Run 'cloudtrain up' for it again ('cloudtrain status --refresh' "
                            "shows what Slurm says).")
        return self.allocation

    def write_policy(self, policy: dict[str, object], attached: str | None = None) -> None:
        write_policy(self.login, self.workdir, self.running().job_id, policy, attached)

    def submit(self, job_id: str, local: Path | None, filters: list[str], script: str,
               env: Mapping[str, str], gpus_per_job: int | None) -> bool:
        """Sync the workdir and drop the detached job for the guard; whether the guard took
        it within 20 s."""
        alloc = self.running()
        if local is not None:
            steps.sync(self.login, local, self.workdir, filters)
        text, share = self.step_text(self.record, job_id, self.workdir, env, script,
                                     gpus_per_job)
        submit(self.login, self.workdir, alloc.job_id, job_id, text, alloc.node_count, share)
        return started(self.login, self.workdir, job_id, 20.0)

    def files(self) -> dict[str, JobFiles]:
        return job_files(self.login, self.workdir)

    def read_logs(self, job_id: str, offsets: dict[int, int]) -> LogRead:
        return read_logs(self.login, self.workdir, job_id, offsets)

    def cancel(self, job_id: str) -> str | None:
        return cancel(self.login, self.workdir, self.running().job_id, job_id)

    def steps(self) -> dict[str, str]:
        return {} if self.allocation is None else step_states(self.login,
                                                              self.allocation.job_id)

    def guard_log(self) -> str:
        """The running allocation's guard log ("" when there is none)."""
        if self.allocation is None:
            return ""
        r = self.login.run(["cat", f"{ct_dir(self.workdir)}/slurm/{self.allocation.job_id}/"
                                   "guard.log"])
        return r.out if r.ok else ""
