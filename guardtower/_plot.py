"""Gradient-norm plots for ``guardtower report --plot`` and the demo (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guardtower.errors import MissingDependencyError

if TYPE_CHECKING:
    from guardtower.incidents import Incident, RunLog

__all__ = ["plot_run_log"]

_MAX_PANELS = 6
_MAX_LAYERS = 6
_WINDOW = 15
_COLORS = {"spike": "tab:red", "nonfinite": "tab:purple", "rollback": "tab:orange", "halt": "black",
           "activation": "tab:purple", "preflight": "tab:gray"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError("matplotlib", "plot") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_run_log(log: RunLog, out: str | Path) -> Path:
    """Draw the whole run on top and one zoomed panel per incident below; return the PNG path.

    Each panel shows the global gradient norm, the trigger layer's norm when it was recorded, the threshold
    (the layer's baseline times the spike threshold) and the steps whose update was not applied, shaded.
    """
    plt = _pyplot()
    stepped = [i for i in log.incidents if i.step is not None]
    panels = stepped[:_MAX_PANELS]
    rows = 1 + math.ceil(len(panels) / 2)
    fig = plt.figure(figsize=(12, 3.4 * rows), constrained_layout=True)
    grid = fig.add_gridspec(rows, 2)
    overview = fig.add_subplot(grid[0, :])
    _draw_overview(overview, log, stepped)
    for n, incident in enumerate(panels):
        ax = fig.add_subplot(grid[1 + n // 2, n % 2])
        _draw_incident(ax, log, incident)
    if len(stepped) > len(panels):
        fig.text(0.99, 0.005, f"{len(stepped) - len(panels)} more incident(s) not shown", ha="right", fontsize=8)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(points: dict[int, float], lo: int | None = None, hi: int | None = None) -> tuple[list[int], list[float]]:
    """A step->value map inside [lo, hi] in step order; NaN/Inf/0 (unplottable on a log axis) and missing
    steps become NaN so the line breaks there instead of bridging the incident."""
    xs: list[int] = []
    ys: list[float] = []
    for step in sorted(points):
        if (lo is not None and step < lo) or (hi is not None and step > hi):
            continue
        if xs and step > xs[-1] + 1:
            xs.append(xs[-1] + 1)
            ys.append(math.nan)
        value = points[step]
        xs.append(step)
        ys.append(value if math.isfinite(value) and value > 0 else math.nan)
    if all(math.isnan(y) for y in ys):
        return [], []
    return xs, ys


def _shade_skipped(ax: Any, skipped: set[int], lo: int | None = None, hi: int | None = None) -> None:
    labelled = False
    for start, end in _runs(sorted(skipped)):
        if (hi is not None and start > hi) or (lo is not None and end < lo):
            continue
        ax.axvspan(start - 0.5, end + 0.5, color="tab:red", alpha=0.15, lw=0,
                   label=None if labelled else "update not applied")
        labelled = True


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return runs


def _draw_overview(ax: Any, log: RunLog, incidents: list[Incident]) -> None:
    xs, ys = _series(log.global_norms)
    if xs:
        ax.plot(xs, ys, color="tab:blue", lw=1.4, label="global grad norm")
    busiest = sorted(log.layer_norms, key=lambda name: -len(log.layer_norms[name]))[:_MAX_LAYERS]
    for name in busiest:
        lx, ly = _series(log.layer_norms[name])
        if len(lx) > 1:
            ax.plot(lx, ly, lw=0.8, alpha=0.7, label=_short(name))
    _shade_skipped(ax, log.skipped_steps)
    kinds_labelled: set[str] = set()
    for incident in incidents:
        color = _COLORS.get(incident.kind, "tab:red")
        ax.axvline(incident.step, color=color, ls=":", lw=1.2,
                   label=None if incident.kind in kinds_labelled else f"incident: {incident.kind}")
        kinds_labelled.add(incident.kind)
    ax.set_title(f"gradient norms over the run ({len(incidents)} incident(s))")
    _finish(ax, log_scale=bool(xs or busiest), outside=True)


def _draw_incident(ax: Any, log: RunLog, incident: Incident) -> None:
    assert incident.step is not None
    lo, hi = incident.step - _WINDOW, incident.step + _WINDOW
    xs, ys = _series(log.global_norms, lo, hi)
    if xs:
        ax.plot(xs, ys, color="tab:blue", marker=".", lw=1.2, label="global grad norm")
    layer_points = log.layer_norms.get(incident.layer, {})
    lx, ly = _series(layer_points, lo, hi)
    if len(lx) > 1:
        ax.plot(lx, ly, color="tab:green", marker=".", lw=1, label=f"{_short(incident.layer)} norm")
    if incident.baseline and incident.threshold and math.isfinite(incident.baseline):
        ax.axhline(incident.baseline * incident.threshold, color="tab:red", ls="--", lw=1,
                   label=f"threshold ({incident.threshold:g}x baseline)")
    _shade_skipped(ax, log.skipped_steps, lo, hi)
    color = _COLORS.get(incident.kind, "tab:red")
    ax.axvline(incident.step, color=color, ls=":", lw=1.2)
    trigger = layer_points.get(incident.step)
    if trigger is not None and math.isfinite(trigger) and trigger > 0:
        ax.plot([incident.step], [trigger], marker="X", ms=10, color=color, ls="none", label="trigger layer")
    else:
        ax.annotate("NaN/Inf" if incident.kind == "nonfinite" else incident.kind, (incident.step, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                    color=color, fontsize=8)
    ratio = "" if incident.ratio is None or not math.isfinite(incident.ratio) else f", ratio {incident.ratio:.3g}"
    ax.set_title(f"step {incident.step}: {incident.kind} -> {incident.action}{ratio}\n{_short(incident.layer, 60)}",
                 fontsize=9)
    ax.set_xlim(lo - 0.5, hi + 0.5)
    _finish(ax, log_scale=bool(xs or lx), fontsize=7)


def _finish(ax: Any, *, log_scale: bool, fontsize: int = 8, outside: bool = False) -> None:
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient L2 norm")
    if log_scale:
        ax.set_yscale("log")
    ax.grid(True, which="major", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles and outside:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    elif handles:
        ax.legend(fontsize=fontsize, loc="upper left")


def _short(name: str, width: int = 40) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]
