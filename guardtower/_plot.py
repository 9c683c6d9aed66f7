"""The one gradient-norm plot, for ``guardtower report --plot`` and the demo's ``grad_norms.png`` (matplotlib, Agg).

Both draw a ``RunLog`` read back from the run's files, so the demo's picture is what ``report --plot`` gives on
the same folder: the whole run on top (the guard's summary cadence plus the window of norms recorded with each
incident), and below it one panel per incident, or per burst of incidents close together.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from guardtower.errors import MissingDependencyError

if TYPE_CHECKING:
    from guardtower.incidents import Incident, RunLog

__all__ = ["plot_run_log", "figure", "bursts"]

_MAX_PANELS = 6
_MAX_LAYERS = 6
_WINDOW = 15
#: incidents at most this many steps apart share a panel
_BURST_GAP = 3
_COLORS = {"spike": "tab:red", "nonfinite": "tab:purple", "rollback": "tab:orange", "halt": "black",
           "activation": "tab:purple", "preflight": "tab:gray"}
_GLOBAL = "global"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError("matplotlib", "plot") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_run_log(log: RunLog, out: str | Path) -> Path:
    """Draw the run (see ``figure``) into a PNG at ``out``; return its path."""
    plt = _pyplot()
    fig = figure(log)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bursts(incidents: Sequence[Incident]) -> list[list[Incident]]:
    """Incidents with a step, grouped: each group's steps are at most ``_BURST_GAP`` apart."""
    groups: list[list[Incident]] = []
    for incident in sorted((i for i in incidents if i.step is not None), key=lambda i: i.step or 0):
        if groups and (incident.step or 0) - (groups[-1][-1].step or 0) <= _BURST_GAP:
            groups[-1].append(incident)
        else:
            groups.append([incident])
    return groups


def figure(log: RunLog) -> Any:
    """The whole run on top, one panel per burst of incidents below (at most ``_MAX_PANELS``)."""
    plt = _pyplot()
    groups = bursts(log.incidents)
    shown = groups[:_MAX_PANELS]
    rows = 1 + math.ceil(len(shown) / 2)
    fig = plt.figure(figsize=(13, 3.6 * rows), constrained_layout=True)
    grid = fig.add_gridspec(rows, 2)
    _draw_overview(fig.add_subplot(grid[0, :]), log, [i for group in groups for i in group])
    for n, group in enumerate(shown):
        _draw_burst(fig.add_subplot(grid[1 + n // 2, n % 2]), log, group)
    if len(groups) > len(shown):
        fig.text(0.99, 0.005, f"{len(groups) - len(shown)} more incident panel(s) not shown", ha="right", fontsize=8)
    return fig


def _series(points: dict[int, float], lo: float = -math.inf, hi: float = math.inf) -> tuple[list[int], list[float]]:
    """A step->value map inside [lo, hi] in step order, joined across the summary cadence's gaps; NaN/Inf and 0
    (unplottable on a log axis) become NaN so the line breaks at the incident instead of bridging it."""
    xs = [step for step in sorted(points) if lo <= step <= hi]
    ys = [points[s] if math.isfinite(points[s]) and points[s] > 0 else math.nan for s in xs]
    if all(math.isnan(y) for y in ys):
        return [], []
    return xs, ys


def _shade_skipped(ax: Any, skipped: set[int], lo: float = -math.inf, hi: float = math.inf) -> None:
    labelled = False
    for start, end in _runs(sorted(skipped)):
        if start > hi or end < lo:
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


def _mark_incidents(ax: Any, incidents: Sequence[Incident], *, label: bool) -> None:
    labelled: set[str] = set()
    for incident in incidents:
        ax.axvline(incident.step, color=_COLORS.get(incident.kind, "tab:red"), ls=":", lw=1.2,
                   label=None if not label or incident.kind in labelled else f"incident: {incident.kind}")
        labelled.add(incident.kind)


def _draw_overview(ax: Any, log: RunLog, incidents: list[Incident]) -> None:
    xs, ys = _series(log.global_norms)
    if xs:
        ax.plot(xs, ys, color="tab:blue", lw=1.2, label="global grad norm")
    # whole-run layer series only (summary metrics): an incident's few steps of history belong to its panel
    coverage = max(2, len(log.global_norms) // 2)
    busiest = [name for name in sorted(log.layer_norms, key=lambda name: -len(log.layer_norms[name]))
               if len(log.layer_norms[name]) >= coverage][:_MAX_LAYERS]
    for name in busiest:
        lx, ly = _series(log.layer_norms[name])
        ax.plot(lx, ly, lw=0.8, alpha=0.7, label=_short(name))
    _shade_skipped(ax, log.skipped_steps)
    _mark_incidents(ax, incidents, label=True)
    steps = "" if log.last_step is None else f"{log.last_step} steps, "
    ax.set_title(f"gradient norms over the run ({steps}{len(incidents)} incident(s))")
    _finish(ax, log_scale=bool(xs or busiest))
    if log.last_step is not None:  # the run goes on past its last summary point: the axis shows every step
        ax.set_xlim(min([0, *log.global_norms]) - 0.5, max([log.last_step, *log.global_norms]) + 0.5)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _draw_burst(ax: Any, log: RunLog, group: list[Incident]) -> None:
    """The trigger layer's norm and its threshold on the left axis, the global norm on the right one.

    The threshold is the trigger layer's (its baseline times the spike threshold), so it is drawn against that
    layer's norm; the global norm, on its own scale, only gives context. A non-finite value is off any scale: it
    is marked at the top edge of the panel, with its words in the legend, not over the lines.
    """
    first, last = group[0].step or 0, group[-1].step or 0
    lo, hi = first - _WINDOW, last + _WINDOW
    lead = next((i for i in group if i.layer and i.layer in log.layer_norms), group[0])
    layer = lead.layer or _GLOBAL
    on_global = layer == _GLOBAL or layer not in log.layer_norms
    points = log.global_norms if on_global else log.layer_norms[layer]
    name = "global grad norm" if on_global else f"{_short(layer)} norm"
    lx, ly = _series(points, lo, hi)
    if lx:
        ax.plot(lx, ly, color="tab:green", marker=".", ms=4, lw=1.2, label=f"{name} (trigger)")
    limit = (lead.baseline or 0.0) * (lead.threshold or 0.0)
    if _finite_positive(limit):
        ax.axhline(limit, color="tab:red", ls="--", lw=1,
                   label=f"threshold of {'the global norm' if on_global else 'this layer'} "
                         f"({lead.threshold:g}x baseline)")
    _shade_skipped(ax, log.skipped_steps, lo, hi)
    _mark_incidents(ax, group, label=False)
    offscale = [i.step for i in group if not _finite_positive(points.get(i.step or 0))]
    if offscale:
        ax.plot(offscale, [0.97] * len(offscale), transform=ax.get_xaxis_transform(), marker="v", ms=8,
                color="tab:purple", ls="none", clip_on=False, label="NaN/Inf (off the scale)")
    hit = [(i.step, points[i.step]) for i in group if i.step is not None and _finite_positive(points.get(i.step))]
    if hit:
        ax.plot([s for s, _ in hit], [v for _, v in hit], marker="X", ms=9, color="tab:red", ls="none",
                label="rejected step")
    _finish(ax, log_scale=bool(lx))
    values = [y for y in ly if not math.isnan(y)] + ([limit] if _finite_positive(limit) else [])
    if values and lx:  # headroom above the data and the threshold for the off-scale markers at the top edge
        ax.set_ylim(min(values) / 2, max(values) * 6)
    handles, labels = ax.get_legend_handles_labels()
    if not on_global:
        gx, gy = _series(log.global_norms, lo, hi)
        if gx:
            right = ax.twinx()
            right.plot(gx, gy, color="tab:blue", lw=0.9, alpha=0.45, label="global grad norm (right axis)")
            right.set_yscale("log")
            _plain_log_ticks(right)
            right.set_ylabel("global norm", fontsize=8, color="tab:blue")
            right.tick_params(axis="y", labelsize=7, colors="tab:blue")
            more_handles, more_labels = right.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
    if handles:  # below the panel, so it never hides a line
        ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2,
                  frameon=False)
    ax.set_xlim(lo - 0.5, hi + 0.5)
    ax.set_title(_burst_title(group), fontsize=9)


def _burst_title(group: list[Incident]) -> str:
    first, last = group[0], group[-1]
    where = f"step {first.step}" if first.step == last.step else f"steps {first.step}-{last.step}"
    kinds: dict[str, int] = {}
    for incident in group:
        kinds[incident.kind] = kinds.get(incident.kind, 0) + 1
    what = ", ".join(kind if n == 1 else f"{n} x {kind}" for kind, n in kinds.items())
    actions = ", ".join(dict.fromkeys(i.action for i in group))
    ratio = ""
    if len(group) == 1 and first.ratio is not None and math.isfinite(first.ratio):
        ratio = f", ratio {first.ratio:.3g}"
    return f"{where}: {what} -> {actions}{ratio}\n{_short(first.layer or _GLOBAL, 70)}"


def _finite_positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _finish(ax: Any, *, log_scale: bool) -> None:
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient L2 norm")
    if log_scale:
        ax.set_yscale("log")
        _plain_log_ticks(ax)
    ax.grid(True, which="major", alpha=0.3)


def _plain_log_ticks(ax: Any) -> None:
    """Log-axis ticks at 1, 2, 5 per decade written as plain numbers (``0.02``, ``5e+03``), not ``2 x 10^-2``."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=12))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def _short(name: str, width: int = 40) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]
