"""`runner plot DIR...`: learning curves, one line per run, and the sweep report (index.html).

One panel per metric (default: the main metrics of the runs' algorithms, runner/tools/compare.py), step on the x axis,
each run labelled by the recipe keys that differ between the runs (the legend's title names them); a single
numeric key colours the runs along a colour scale in value order. `--smooth K` draws a trailing moving average
over K logged points in bold over the raw curve, drawn faint (curves of fewer than 2K points, such as evals
every N steps, are drawn as they are). The PNG is drawn off screen (Agg), 150 dpi.

matplotlib is a base dependency (pyproject.toml); an install without it (`--no-deps`) makes `runner plot` one line
saying so, and a sweep's index.html has the table without the curves.
"""

from __future__ import annotations

import html
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from backends.errors import UserError
from runner.tools.compare import (
    Metric,
    Run,
    cell,
    cells,
    choose_metrics,
    differing_keys,
    html_page,
    html_table,
    series,
    table,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPORT = "index.html"
MISSING = "matplotlib is not installed: pip install 'runner[plot]' (or pip install matplotlib)"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def smooth(values: Sequence[float], k: int) -> list[float]:
    """Trailing moving average over the last k values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out


def _sort_value(v: object) -> tuple[int, float | str]:  # numbers first, in value order
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, v)
    return (1, json.dumps(v, sort_keys=True, default=str))


def legend(runs: Sequence[Run]) -> tuple[str, list[Run], list[str]]:
    """(legend title, runs in legend order, their labels): labelled by the keys that differ, sorted by their values."""
    keys = differing_keys(runs)
    if not keys:
        return "", list(runs), [r.label for r in runs]
    ordered = sorted(runs, key=lambda r: [_sort_value(r.config.get(k)) for k in keys])
    labels = [", ".join(cell(r.config.get(k), config=True) for k in keys) for r in ordered]
    return ", ".join(keys), ordered, labels


def _colors(runs: Sequence[Run], n: int) -> list[tuple[float, float, float, float]]:  # RGBA
    from matplotlib import colormaps

    keys = differing_keys(runs)
    values = [r.config.get(keys[0]) for r in runs] if len(keys) == 1 else []
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and n > 1:
        # One numeric key (lr, rank): a colour scale in value order says which end is which.
        nums = [float(v) for v in values if v is not None]  # all of them: checked numeric above
        ranks = {v: i for i, v in enumerate(sorted(set(nums)))}
        scale = colormaps["viridis"]
        return [scale(0.8 * ranks[v] / max(1, len(ranks) - 1)) for v in nums]  # not its pale yellow end
    palette = colormaps["tab10" if n <= 10 else "tab20"]
    return [palette(i % palette.N) for i in range(n)]


def figure(runs: Sequence[Run], metrics: Sequence[Metric], k: int = 1) -> Figure:
    """A matplotlib Figure, one panel per metric (two columns at most)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    title, ordered, labels = legend(runs)
    colors = _colors(ordered, len(ordered))
    ncols = min(len(metrics), 2)
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(6.4 * ncols, 4.4 * nrows), dpi=150, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    for ax, m in zip(axes, metrics, strict=False):
        drawn = smoothed = 0
        for run, label, color in zip(ordered, labels, colors, strict=True):
            pts = series(run, m.name)
            if not pts:
                continue
            drawn += 1
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            marker = "o" if len(pts) <= 25 else None
            # A sparse curve (evals every N steps) is drawn as it is: averaging a few points only lags them.
            if k > 1 and len(pts) >= 2 * k:
                smoothed += 1
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1.0)
                ax.plot(xs, smooth(ys, k), color=color, linewidth=2.0, label=label)
            else:
                ax.plot(xs, ys, color=color, linewidth=1.8, marker=marker, markersize=3.5, label=label)
        better = "lower" if m.lower_is_better else "higher"
        ax.set_title(m.name + (f"  (moving average of {k} points)" if smoothed else ""), fontsize=12)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"{m.name} ({better} is better)")
        ax.grid(True, alpha=0.3)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        if drawn == 0:
            ax.text(0.5, 0.5, "no run logged this metric", ha="center", va="center", transform=ax.transAxes)
        elif drawn > 12:
            ax.legend(title=title or None, fontsize="small", frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1))
        else:
            ax.legend(title=title or None, fontsize="small", frameon=False)
    return fig


def plot(runs: Sequence[Run], metrics: Sequence[Metric], out: Path, k: int = 1) -> Path:
    if not have_matplotlib():
        raise UserError(f"runner plot: {MISSING}")
    if not metrics:
        raise UserError("no metric to plot: these runs logged none of their algorithm's main metrics; "
                        "name one with --metric NAME")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure(runs, metrics, k).savefig(out)
    return out


def slug(metric: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in metric)


def write_report(folder: Path, runs: Sequence[Run], metric_specs: Sequence[str] = (), k: int = 1) -> Path:
    """`folder`/index.html: the comparison table and one PNG per metric next to it (plot-<metric>.png).
    Without matplotlib, the table and a line saying what the curves need."""
    metrics = choose_metrics(runs, metric_specs)
    header, rows = table(runs, metrics)
    parts = []
    record = folder / "sweep.json"
    if record.exists():
        try:
            sweep = json.loads(record.read_text())
            axes = "; ".join(f"{key}: {', '.join(cell(v, config=True) for v in values)}"
                             for key, values in sweep.get("axes", {}).items())
            parts.append(f"<p>recipe <code>{html.escape(str(sweep.get('recipe')))}</code>"
                         f"{' (zipped)' if sweep.get('zip') else ''}; swept {html.escape(axes)}"
                         + (f"; every point: <code>{html.escape(' '.join(sweep.get('overrides', [])))}</code>"
                            if sweep.get("overrides") else "") + "</p>")
        except (json.JSONDecodeError, AttributeError, TypeError):
            pass
    parts.append(html_table(header, [cells(row, len(header) - 1 - 2 * len(metrics)) for row in rows]))
    if have_matplotlib():
        for m in metrics:
            png = folder / f"plot-{slug(m.name)}.png"
            plot(runs, [m], png, k)
            parts.append(f'<div><img src="{html.escape(png.name)}" alt="{html.escape(m.name)}"></div>')
    else:
        parts.append(f"<p>No curves: {html.escape(MISSING)}.</p>")
    parts.append(f"<p style=\"color:#888\">{len(runs)} runs; written {time.strftime('%Y-%m-%d %H:%M:%S')}; "
                 f"again with <code>runner plot {html.escape(str(folder))}</code></p>")
    page = folder / REPORT
    page.write_text(html_page(f"runs in {folder}", "\n".join(parts)), encoding="utf-8")
    return page
