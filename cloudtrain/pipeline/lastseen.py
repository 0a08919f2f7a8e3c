"""What the last contact with a cluster's nodes saw, kept on this machine, so that a plain
``cloudtrain status`` answers from the state database and these files alone: no SSH, no
provider call, and no pydantic, paramiko, rich or cloud SDK import (docs/guard.md, "status").

In ``CLOUDTRAIN_HOME/clusters/NAME/`` (removed with the cluster's folder at ``down``):

- ``guard-policy.json``: the node guard's policy as the CLI last wrote it to the nodes (up,
  launch, autostop); ``lease_at`` is when;
- ``guard-contact.json``: the last CLI contact with the nodes (every command that renews the
  lease: up, launch, exec, logs, ssh, forward, status --refresh ...), ``{"at", "idle_at"}``:
  ``idle_at`` is the last contact after which the CLI knows nothing of its own was left
  running (a fresh ``up``, or guards seen idle), null after one that may have started work
  (launch, autostop, a guard seen busy);
- ``guard-seen.json``: what the node guards said (each node's ``state.json``, whether its guard
  runs) and each node's GPU query, at the last contact that read them (``status --refresh``,
  ``top``): ``{"at": epoch, "nodes": {rank: {...}}, "gpus": [NodeGPUs.as_json(), ...]}``.

Only the standard library and :mod:`cloudtrain.gpuuse` are imported here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from cloudtrain import paths

if TYPE_CHECKING:
    from cloudtrain.context import Env
    from cloudtrain.gpuuse import NodeGPUs

POLICY = "guard-policy.json"
SEEN = "guard-seen.json"
CONTACT = "guard-contact.json"
HINT = "--refresh for live"
RULES = ("idle_minutes", "down", "down_on_end", "max_cost_usd", "max_hours")


def policy_file(env: Env, name: str) -> Path:
    return env.cluster_dir(name) / POLICY


def saved(env: Env, name: str) -> dict[str, Any]:
    """The policy the CLI last wrote to the nodes ({} when none: no guard installed)."""
    return _read(policy_file(env, name))


def describe(pol: Mapping[str, Any]) -> str:
    """The policy in words."""
    parts = []
    idle = pol.get("idle_minutes")
    what = "tear down" if pol.get("down", True) else "stop"
    parts.append(f"autostop: {what} after {idle:g} min idle" if idle else "autostop: off")
    if pol.get("down_on_end"):
        parts.append("tear down when job " + ", ".join(pol["down_on_end"]) + " ends")
    if pol.get("max_cost_usd"):
        parts.append(f"budget ${pol['max_cost_usd']:.4f}")
    if pol.get("max_hours"):
        parts.append(f"lifetime {pol['max_hours']:g} h")
    return "; ".join(parts)


def busy_reasons(states: list[dict[str, Any]]) -> list[str]:
    """What kept the nodes busy, from their guards' states: "job 3f2a", "2 ssh sessions (no
    tty)", "1 queued job". A job runs on every node (named once); sessions are added up."""
    jobs = sorted({str(j) for s in states for j in (s.get("job_ids") or [])
                   if isinstance(s.get("job_ids"), list)})
    tty = sum(int(s.get("ssh_tty") or 0) for s in states)
    notty = sum(int(s.get("ssh_notty") or 0) for s in states)
    if not any("ssh_tty" in s for s in states):          # a guard of an older version
        tty = sum(int(s.get("ssh_sessions") or 0) for s in states)
    queued = max((int(s.get("queued") or 0) for s in states), default=0)
    out = [f"job {j}" for j in jobs]
    if not jobs and any(int(s.get("jobs") or 0) for s in states):
        out.append("a job")
    for n, kind in ((tty, ""), (notty, " (no tty)")):
        if n:
            out.append(f"{n} ssh session{'s' if n > 1 else ''}{kind}")
    if queued:
        out.append(f"{queued} queued job{'s' if queued > 1 else ''}")
    return out or ["a job or an SSH session"]


def idle_words(pol: dict[str, Any], seen: dict[int, dict[str, Any]], now: float) -> dict[str, Any]:
    """'idle for X min, stops in Y min' from the guards' states (the head's, else any)."""
    states_ = [s.get("state") or {} for _, s in sorted(seen.items())]
    alive = all(s.get("guard_alive") for s in seen.values()) if seen else False
    st = next((s for s in states_ if s), {})
    idle_s = float(st.get("idle_for_s") or 0.0) + max(0.0, now - float(st.get("at") or now))
    out: dict[str, Any] = {"guard_running": alive, "busy": bool(st.get("busy"))}
    if st.get("busy"):
        why = busy_reasons([s for s in states_ if s])
        out.update(idle_for_min=0.0, stops_in_min=None, busy_with=why,
                   words="busy: " + "; ".join(why))
        return out
    out["idle_for_min"] = round(idle_s / 60, 2)
    idle = pol.get("idle_minutes")
    if idle:
        left = max(0.0, idle - idle_s / 60)
        out["stops_in_min"] = round(left, 2)
        out["words"] = f"idle for {idle_s / 60:.1f} min, stops in {left:.1f} min"
    else:
        out["stops_in_min"] = None
        out["words"] = f"idle for {idle_s / 60:.1f} min (no idle stop)"
    return out


def remember(env: Env, name: str, nodes: dict[int, dict[str, Any]],
             gpus: list[NodeGPUs] | None, at: float | None = None) -> None:
    """Keep what a contact read from the nodes (their guard states; the GPU query when it was
    asked, else the GPUs seen before stay). Never fails the command."""
    try:
        d = env.cluster_dir(name)
        if not d.is_dir():
            return                       # the cluster is gone (down) or was never here
        old = _read(d / SEEN)
        data: dict[str, Any] = {"at": time.time() if at is None else at,
                                "nodes": {str(r): s for r, s in sorted(nodes.items())}}
        if gpus is not None:
            data["gpus"] = [g.as_json() for g in gpus]
            data["gpus_at"] = data["at"]
        elif isinstance(old.get("gpus"), list):
            data["gpus"], data["gpus_at"] = old["gpus"], old.get("gpus_at")
        tmp = d / (SEEN + ".tmp")
        with open(tmp, "w", opener=paths.private_opener) as out:
            json.dump(data, out)
        tmp.replace(d / SEEN)
    except (OSError, ValueError, TypeError):
        pass


def contacted(env: Env, name: str, idle: bool | None = None, at: float | None = None) -> None:
    """Record a CLI contact with the nodes (the lease renewed). ``idle``: True when the CLI
    knows it left nothing running on them (a fresh up, guards seen idle), False when it may
    have started work (launch, autostop), None when it changed nothing (exec, logs, touch).
    Never fails the command."""
    try:
        d = env.cluster_dir(name)
        if not d.is_dir():
            return
        now = time.time() if at is None else at
        old = _read(d / CONTACT)
        idle_at = now if idle else (None if idle is False else _num(old.get("idle_at")))
        tmp = d / (CONTACT + ".tmp")
        with open(tmp, "w", opener=paths.private_opener) as out:
            json.dump({"at": max(now, _num(old.get("at")) or 0.0), "idle_at": idle_at}, out)
        tmp.replace(d / CONTACT)
    except (OSError, ValueError, TypeError):
        pass


def expected_stop(env: Env, name: str, provider: str,
                  created_at: float = 0.0) -> tuple[float, str] | None:
    """When the recorded rules must have stopped the cluster, and why (the earliest of its
    lifetime, its budget at the recorded price, and its idle stop counted from the last
    contact after which nothing was running), from this machine's files alone. None: no rule
    tells (a job may be running, or no rule is set)."""
    from cloudtrain.pipeline.stopwhen import expected

    launches = [r for r in env.state.launches(name) if r.started_at >= created_at - 1]
    waiting = any(r.status in ("RUNNING", "QUEUED") for r in launches)
    ended = {} if waiting else {r.job_id: r.ended_at for r in launches if r.ended_at is not None}
    return expected(saved(env, name), _read(env.cluster_dir(name) / CONTACT), ended,
                    powers_off=provider != "ssh")





def last(env: Env, name: str) -> dict[str, Any]:
    """What the last contact saw ({} when nothing was kept)."""
    return _read(env.cluster_dir(name) / SEEN)


def ago(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 90 * 60:
        return f"{s / 60:.0f} min ago"
    if s < 48 * 3600:
        return f"{s / 3600:.1f} h ago"
    return f"{s / 86400:.1f} days ago"


@dataclass(frozen=True)
class View:
    """What ``status`` shows of a cluster's guards: its policy, the guards' view (idle for,
    stops in, busy with) and each node's GPUs, as of the last contact (or live, from
    ``status --refresh``), and when its rules must have stopped it. :meth:`as_dict` is what
    the status command renders (and ``--json`` writes); a key is there only when known."""

    autostop: Mapping[str, Any]
    policy: str
    guard: Mapping[str, Any] | None = None
    gpus: list[NodeGPUs] | None = None
    gpus_at: float | None = None
    expected_stop: Mapping[str, Any] | None = None
    """When the recorded rules must have stopped the cluster: at, reason, words."""
    stale: bool = False
    """Live was asked for, but the nodes did not answer: this is the last contact's."""

    @classmethod
    def of(cls, pol: Mapping[str, Any]) -> View:
        """The policy alone, as if nothing was seen."""
        return cls({k: pol.get(k) for k in RULES}, describe(pol))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"autostop": dict(self.autostop), "policy": self.policy}
        if self.guard is not None:
            out["guard"] = dict(self.guard)
        if self.gpus is not None:
            out["gpus"], out["gpus_at"] = list(self.gpus), self.gpus_at
        if self.expected_stop is not None:
            out["expected_stop"] = dict(self.expected_stop)
        if self.stale:
            out["stale"] = True
        return out


def view(env: Env, name: str, now: float | None = None) -> View | None:
    """For a plain ``status``: the policy, and the guards' view as of the last contact, with
    its age; the GPUs as of the last query. None when no guard was installed.

    The guards' words come from the last states read (status --refresh, top), extrapolated to
    now, unless the CLI wrote the policy since (a later contact: launch, autostop), which
    renewed the lease and saw no state: then the idle stop is counted from that contact (the
    earliest it can fire: a job or session since then only delays it)."""
    now = time.time() if now is None else now
    pol = saved(env, name)
    if not pol:
        return None
    try:
        return _seen(pol, last(env, name), now)
    except (TypeError, ValueError, AttributeError):
        return View.of(pol)       # a damaged file: the policy alone, as if nothing was seen


def _seen(pol: dict[str, Any], seen: dict[str, Any], now: float) -> View:
    from cloudtrain.gpuuse import NodeGPUs

    guard: dict[str, Any] | None = None
    seen_at = _num(seen.get("at"))
    lease_at = _num(pol.get("lease_at"))
    nodes = {int(r): s for r, s in (seen.get("nodes") or {}).items()
             if str(r).isdigit() and isinstance(s, dict)}
    if nodes and seen_at is not None and (lease_at is None or seen_at >= lease_at):
        guard = idle_words(pol, nodes, now)
        guard.update(as_of=seen_at, age_s=round(now - seen_at, 1), live=False)
        guard["words"] += f" (as of {ago(now - seen_at)}; {HINT})"
    elif lease_at is not None:
        guard = idle_words(pol, {0: {"state": {"at": lease_at, "idle_for_s": 0.0}}}, now)
        guard.update(guard_running=None, busy=None, as_of=lease_at,
                     age_s=round(now - lease_at, 1), live=False)
        idle = pol.get("idle_minutes")
        guard["words"] = (f"last contact {ago(now - lease_at)}"
                          + (f"; stops in {guard['stops_in_min']:.1f} min at the earliest"
                             if idle else " (no idle stop)") + f"; {HINT}")
    gpus_at = _num(seen.get("gpus_at"))
    gpus = None
    if isinstance(seen.get("gpus"), list) and gpus_at is not None:
        gpus = [NodeGPUs.from_json(n) for n in seen["gpus"] if isinstance(n, dict)]
    return replace(View.of(pol), guard=guard, gpus=gpus,
                   gpus_at=gpus_at if gpus is not None else None)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


PROBABLY_STOPPED = "PROBABLY_STOPPED"


def offline_rows(env: Env, rows: list[Any], now: float | None = None
                 ) -> tuple[list[Any], dict[str, View | None], dict[str, float]]:
    """For a plain ``status``: the rows, a cluster whose rules must have stopped it shown as
    PROBABLY_STOPPED (never as UP); each cluster's view (with ``expected_stop``: at, reason,
    words); and, for those, when they probably stopped (their spend ends there)."""
    now = time.time() if now is None else now
    views: dict[str, View | None] = {}
    until, out = {}, []
    for r in rows:
        views[r.name] = seen = view(env, r.name, now)
        stop = expected_stop(env, r.name, r.provider, r.created_at) \
            if r.status in ("UP", "DEGRADED") else None
        if stop is None:
            out.append(r)
            continue
        at, why = stop
        clock = time.strftime("%H:%M" if now - at < 86400 else "%Y-%m-%d %H:%M",
                              time.localtime(at))
        words = (f"probably stopped itself at {clock} ({why}); --refresh to confirm" if at <= now
                 else f"expected to stop itself at {clock} ({why})")
        if seen is not None:
            views[r.name] = replace(seen, expected_stop={"at": at, "reason": why, "words": words})
        if at <= now:
            until[r.name] = at
            r = replace(r, status=PROBABLY_STOPPED)
        out.append(r)
    return out, views, until
