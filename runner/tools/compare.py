"""`runner compare DIR...`: one table of runs, a row per run.

The DIRs are run dirs, sweep dirs (every run dir below them; moved-aside `*.old-*` dirs left out) or globs.
Columns: the run dir; the recipe keys whose values differ between the runs (from each run's config.toml,
flattened to dotted keys; log_dir and the log table left out); the steps trained; then the final and the best
value of each metric: by default the main ones of the runs' algorithms (their registry entries, runner/algos), or those named with
`--metric NAME` (`NAME:min` / `NAME:max` says which way is better when the name does not). Rows are sorted by the
first metric's final value, best first. Formats: table (aligned text), csv, markdown, json, html.

Everything here only reads run dirs (a running run's files included: a torn last line is skipped, not cut).
"""

from __future__ import annotations

import csv
import glob
import html
import io
import json
import math
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from backends.errors import UserError
from backends.types import Json
from runner.engine.log import parse_jsonl
from runner.engine.rundir import CONFIG, METRICS, flatten
from runner.engine.spec import spec_of_kind
from runner.recipe.load import show_value

# Lower is better for NLLs and losses, higher for rewards and accuracy (parse_metric).
_LOWER_IS_BETTER = re.compile(r"nll|loss|error|perplexity|(^|/)kl|time/|grad_norm|illegal")
# Config keys that never make two runs different experiments.
_NOT_COMPARED = ("log_dir", "log", "if_exists")
FORMATS = ("table", "csv", "markdown", "json", "html")


@dataclass
class Run:
    path: Path
    config: Json  # the recipe, flattened: {"lr": 0.001, "lora.rank": 8, "algo.kind": "sft", ...}
    kind: str  # algo kind
    rows: list[Json]

    @property
    def label(self) -> str:
        return _shown_path(self.path)

    @property
    def steps(self) -> int:
        """Steps trained: the last training row's step + 1 (a final eval row is not a step)."""
        trained = [r["step"] for r in self.rows if "progress/done_frac" in r and isinstance(r.get("step"), int)]
        return max(trained) + 1 if trained else 0


@dataclass
class Metric:
    name: str
    lower_is_better: bool

    @property
    def direction(self) -> str:
        return "min" if self.lower_is_better else "max"


@dataclass
class Summary:
    final: float | None = None
    best: float | None = None
    best_step: int | None = None


# ---------------------------------------------------------------- reading

def read_rows(path: Path) -> list[Json]:
    """A JSONL file's rows, read only: a line that does not parse (the torn last line of a running or killed
    run) is skipped, never cut off (runner.engine.log.read_jsonl cuts it; that is the writer's job)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        return []
    return parse_jsonl(text).rows


def find_runs(args: Sequence[str]) -> list[Run]:
    """The run dirs that DIR arguments name (run dirs, dirs holding run dirs, globs), each once, in order."""
    found: list[Path] = []
    seen: set[Path] = set()
    for arg in args:
        matches = sorted(glob.glob(arg)) if glob.has_magic(arg) else [arg]
        if not matches:
            raise UserError(f"{arg}: matches nothing")
        for match in matches:
            p = Path(match)
            if p.name == CONFIG and p.is_file():
                p = p.parent
            if not p.exists():
                raise UserError(f"{match}: no such run dir")
            if not p.is_dir():
                raise UserError(f"{match}: not a run dir (a run dir is a folder holding {CONFIG} and {METRICS})")
            dirs = run_dirs_under(p)
            if not dirs:
                raise UserError(f"{match}: no run dir in it (a run dir holds {CONFIG} and {METRICS})")
            for d in dirs:
                if d.resolve() not in seen:
                    seen.add(d.resolve())
                    found.append(d)
    return [load_run(d) for d in found]


def run_dirs_under(p: Path) -> list[Path]:
    """`p` if it is a run dir, else every run dir below it (not below a run dir; not moved-aside old runs)."""
    if (p / CONFIG).is_file():
        return [p]
    out = []
    for root, dirs, files in os.walk(p):
        if CONFIG in files:
            out.append(Path(root))
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if ".old-" not in d and not d.startswith("."))
    return out


def load_run(path: Path) -> Run:
    config_file = path / CONFIG
    try:
        data = tomllib.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{config_file}: cannot read the run's recipe ({e})") from None
    tables = data.get("recipes")
    if not isinstance(tables, dict) or len(tables) != 1:
        raise UserError(f"{config_file}: expected exactly one [recipes.<name>] table")
    raw = next(iter(tables.values()))
    algo = raw.get("algo")
    kind = str(algo.get("kind", "?")) if isinstance(algo, dict) else "?"
    return Run(path, flatten(raw), kind, read_rows(path / METRICS))


def _shown_path(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


# ---------------------------------------------------------------- what to compare

def differing_keys(runs: Sequence[Run]) -> list[str]:
    """Recipe keys whose values are not the same in every run (a key some runs lack counts as differing)."""
    keys: list[str] = []
    for r in runs:
        keys.extend(k for k in r.config if k not in keys)
    out = []
    for k in keys:
        if k.split(".")[0] in _NOT_COMPARED:
            continue
        values = {json.dumps(r.config.get(k, "<unset>"), sort_keys=True, default=str) for r in runs}
        if len(values) > 1:
            out.append(k)
    return out


def parse_metric(spec: str) -> Metric:
    """'NAME', 'NAME:min' or 'NAME:max'."""
    name, sep, way = spec.rpartition(":")
    if sep and way in ("min", "max") and name:
        return Metric(name, way == "min")
    return Metric(spec, bool(_LOWER_IS_BETTER.search(spec)))


def choose_metrics(runs: Sequence[Run], specs: Sequence[str] = ()) -> list[Metric]:
    """The --metric choices, or the main metrics of the runs' algorithms that some run has."""
    logged = {k for r in runs for row in r.rows for k in row}
    if specs:
        metrics = [parse_metric(s) for s in specs]
        missing = [m.name for m in metrics if m.name not in logged]
        if len(missing) == len(metrics):
            hint = ", ".join(sorted(k for k in logged if k != "step" and not k.startswith("time/"))[:12])
            raise UserError(f"no run logged {', '.join(missing)}; metrics in these runs: {hint}, ...")
        return metrics
    names: list[str] = []
    for r in runs:
        names.extend(m for m in main_metrics(r.kind, r.config.get("algo.target", r.config.get("algo.spec"))) if m not in names and m in logged)
    # The recipes' pinned evals (runner/engine/evals.py): their headline numbers, whatever the algorithm.
    names.extend(sorted(k for k in logged if k.startswith("test/eval/") and k.endswith(("/accuracy", "/nll", "/mean"))))
    return [parse_metric(n) for n in names]


def main_metrics(kind: str, spec: str | None = None) -> list[str]:
    """An algorithm's default columns, from its registry entry (runner/algos); none for an unknown one."""
    found = spec_of_kind(kind, spec)
    return found.compare_keys() if found is not None else []


def summarize(run: Run, metric: Metric) -> Summary:
    points = series(run, metric.name)
    if not points:
        return Summary()
    pick = min if metric.lower_is_better else max
    best_step, best = pick(points, key=lambda p: p[1])
    return Summary(final=points[-1][1], best=best, best_step=best_step)


def series(run: Run, name: str) -> list[tuple[int, float]]:
    """(step, value) of every row that has a finite number for `name`, in the order logged."""
    out = []
    for row in run.rows:
        v, step = row.get(name), row.get("step")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and isinstance(step, int):
            out.append((step, float(v)))
    return out


def sort_runs(runs: Sequence[Run], metrics: Sequence[Metric]) -> list[Run]:
    """Best first by the first metric's final value (ties: by the next metric's); runs without it last."""
    def key(r: Run) -> list[tuple[int, float]]:
        out = []
        for m in metrics:
            final = summarize(r, m).final
            out.append((1, 0.0) if final is None else (0, final if m.lower_is_better else -final))
        return out

    return sorted(runs, key=key)


# ---------------------------------------------------------------- the table

def table(runs: Sequence[Run], metrics: Sequence[Metric]) -> tuple[list[str], list[list[object]]]:
    """(header, rows of raw values): run, differing keys, steps, then final and best of each metric."""
    keys = differing_keys(runs)
    header = ["run", *keys, "steps"]
    for m in metrics:
        header += [f"{m.name} final", f"{m.name} best"]
    rows = []
    for r in sort_runs(runs, metrics):
        row: list[object] = [r.label, *(r.config.get(k) for k in keys), r.steps]
        for m in metrics:
            s = summarize(r, m)
            row += [s.final, s.best]
        rows.append(row)
    return header, rows


def cell(v: object, config: bool = False) -> str:
    """A table cell: a recipe value as written (`config`: 0.001, 8, local), a metric to 4 decimals."""
    if v is None:
        return "-"
    if isinstance(v, float) and not config:
        return f"{v:.4f}" if 1e-3 <= abs(v) < 1e6 else f"{v:.4g}"
    return show_value(v)


def cells(row: Sequence[object], first_number: int) -> list[str]:
    """A table row as text: the run and its recipe values as written, numbers from column `first_number` on."""
    return [cell(v, config=i < first_number) for i, v in enumerate(row)]


def render(runs: Sequence[Run], metrics: Sequence[Metric], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(as_json(runs, metrics), indent=1, default=str) + "\n"
    header, rows = table(runs, metrics)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(header)
        writer.writerows([["" if v is None else v for v in row] for row in rows])
        return buf.getvalue()
    first = len(header) - 1 - 2 * len(metrics)  # steps and the metrics (numbers) are right-aligned
    shown = [cells(row, first) for row in rows]
    if fmt == "markdown":
        def line(cells: Sequence[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
        rule = "|" + "|".join("---:" if i >= first else "---" for i in range(len(header))) + "|"
        return "\n".join([line(header), rule, *map(line, shown)]) + "\n"
    if fmt == "html":
        return html_page("runner compare", html_table(header, shown))
    widths = [max(len(str(c)) for c in col) for col in zip(header, *shown, strict=True)]

    def fmt_row(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i >= first else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
    return "\n".join([fmt_row(header), *map(fmt_row, shown)]) + "\n"


def as_json(runs: Sequence[Run], metrics: Sequence[Metric]) -> list[Json]:
    keys = differing_keys(runs)
    out = []
    for r in sort_runs(runs, metrics):
        out.append({
            "run": r.label, "kind": r.kind, "config": {k: r.config.get(k) for k in keys}, "steps": r.steps,
            "metrics": {m.name: {**vars(summarize(r, m)), "better": m.direction} for m in metrics},
        })
    return out


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


def html_page(title: str, body: str) -> str:
    style = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222}"
             "table{border-collapse:collapse;font-size:14px}th,td{padding:4px 10px;border-bottom:1px solid #ddd;"
             "text-align:right;white-space:nowrap}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}"
             "img{max-width:100%;margin:1em 0}")
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head>\n<body>\n<h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")


def main_metrics_line(run_dir: Path) -> str:
    """'5 steps  test/nll 6.8394  train_mean_nll 5.6339': how a run did, for a sweep's progress lines."""
    try:
        run = load_run(run_dir)
    except UserError:
        return ""
    parts = [f"{run.steps} steps"]
    for m in choose_metrics([run]):
        s = summarize(run, m)
        if s.final is not None:
            parts.append(f"{m.name} {cell(s.final)}")
    return "  ".join(parts)
