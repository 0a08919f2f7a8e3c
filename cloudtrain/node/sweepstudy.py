"""The sweep's study, on the nodes (docs/sweep.md): Optuna's pieces built from the spec the
laptop wrote (distributions, sampler, pruner), the JournalStorage file on the head, telling a
trial's end, and the JSON document ``status``/``results`` answer. Shipped beside sweep.py
and sweepwork.py; optuna is imported inside the functions that use it (bootstrap installs it
on the nodes only when a sweep runs)."""

from __future__ import annotations

import os
from typing import Any


def sdir(root: str, name: str) -> str:
    return os.path.join(root, ".cloudtrain", "sweeps", name)


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


def tell(study: Any, trial: Any, state: Any, value: float | None = None) -> None:
    """``study.tell``; the grid sampler's ``study.stop()`` when its last point is told is
    meant for ``study.optimize`` and raises here, after the trial's state was stored."""
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def settled(study: Any) -> int:
    """How far the sweep has come, for keeping its journal (sweepkeep.py): it changes when a
    trial starts (a copy then knows it ran: a replacement head tells it FAIL, ``lost``), when
    one ends, and once the sweep is stopped."""
    trials = study.get_trials(deepcopy=False)
    ended = sum(1 for t in trials if t.state.name not in ("RUNNING", "WAITING"))
    return len(trials) + ended + (1 if "stop" in study.user_attrs else 0)


def read_study(root: str, name: str) -> Any:
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not os.path.exists(os.path.join(sdir(root, name), "journal.log")):
        return None
    return optuna.load_study(study_name=name, storage=journal(root, name))


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
    trials = [trial_record(t) for t in study.get_trials(deepcopy=False)
              if not t.user_attrs.get("surplus")]     # asked past `trials` (a race): never ran
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
