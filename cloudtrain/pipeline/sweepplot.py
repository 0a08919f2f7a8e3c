"""``sweep results NAME --plot FILE.png``: the optimisation history (each complete trial's
value and the best so far) and the parameters' importance, which Optuna computes
(``optuna.importance``) from the trials rebuilt into an in-memory study. Drawn with
matplotlib (the ``chart`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloudtrain.errors import UserError

if TYPE_CHECKING:
    from cloudtrain.pipeline.sweepdoc import Results, Trial


def history(trials: list[Trial], minimize: bool) -> tuple[list[int], list[float], list[float]]:
    """Trial numbers, their values, the best value so far."""
    xs: list[int] = []
    ys: list[float] = []
    best: list[float] = []
    for t in sorted(trials, key=lambda t: t.number):
        if t.value is None:
            continue
        xs.append(t.number)
        ys.append(t.value)
        prev = best[-1] if best else t.value
        best.append(min(prev, t.value) if minimize else max(prev, t.value))
    return xs, ys, best


def distribution(values: list[Any]) -> Any:
    """The Optuna distribution a parameter's observed values fit in."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        lo, hi = float(min(values)), float(max(values))
        return FloatDistribution(lo, hi if hi > lo else lo + 1.0)
    return CategoricalDistribution(sorted({str(v) for v in values}))


def importances(trials: list[Trial], minimize: bool) -> dict[str, float]:
    """Optuna's parameter importances over the complete trials ({} with fewer than two)."""
    import optuna

    done = [t for t in trials if t.value is not None and t.params]
    if len(done) < 2:
        return {}
    names = sorted(set.intersection(*(set(t.params) for t in done)))
    dists = {n: distribution([t.params[n] for t in done]) for n in names}
    study = optuna.create_study(direction="minimize" if minimize else "maximize")
    for t in done:
        params = {n: (t.params[n] if not hasattr(dists[n], "choices") else str(t.params[n]))
                  for n in names}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists,
                                                  value=t.value))
    return dict(optuna.importance.get_param_importances(study))


def plot(res: Results, path: str) -> Path:
    """Write the two panels to ``path`` (PNG)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise UserError("--plot needs matplotlib.", "pip install 'cloudtrain[chart]'") from exc
    obj = res.record.spec.get("objective") or {}
    minimize = str(obj.get("goal", "minimize")).startswith("min")
    trials = list(res.trials)
    xs, ys, best = history(trials, minimize)
    imp = importances(trials, minimize)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.scatter(xs, ys, s=14, label="trial")
    left.plot(xs, best, color="tab:red", label="best so far")
    left.set(title=f"Optimisation history: {res.record.name}", xlabel="trial",
             ylabel=str(obj.get("metric", "objective")))
    left.legend()
    right.barh(list(imp), list(imp.values()))
    right.set(title="Parameter importance (Optuna)", xlabel="importance")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
