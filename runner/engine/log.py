"""Run logging: crash-safe JSONL files and a progress line.

Every JSONL line is appended, flushed and fsynced before the loop moves on, so after a `kill -9`
the file ends in whole lines plus at most one torn line, which `read_jsonl` drops.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from backends.errors import UserError


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    line = json.dumps(row, allow_nan=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file written by append_jsonl. A torn last line (a crash mid-write) is dropped
    and cut off the file, so the next append starts on a clean line; a bad line elsewhere is corruption."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise UserError(f"{path}:{i + 1}: corrupt line (not JSON); fix or remove the file") from None
            with open(path, "r+", encoding="utf-8") as f:  # torn tail: cut it off
                f.truncate(len("\n".join(lines[:i]).encode()) + (1 if i else 0))
            return rows
    if text and not text.endswith("\n"):  # whole row, newline lost: end the line
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n")
    return rows


def write_jsonl_atomic(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, allow_nan=True) + "\n" for row in rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Progress:
    """A live bar (tqdm) on a terminal: step, the algorithm's headline metrics, ETA. Not on a terminal (CI, a
    pipe, a file) a plain line per step for short runs, and about every `every` seconds plus the first and last
    steps for long ones, so logs stay readable. Eval rows (any row with test/ metrics) always get a line of
    their own."""

    def __init__(self, total: int, start: int, keys: list[tuple[str, str]] | None = None,
                 stream: TextIO | None = None, every: float = 10.0):
        self.total, self.start = total, start
        self.keys = keys if keys is not None else [("train_mean_nll", "nll"), ("env/all/reward/total", "reward")]
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        # Short runs (<= 50 steps) print every step; longer ones every `every` seconds.
        self.every = 0.0 if total - start <= 50 else every
        self.t0 = time.monotonic()
        self.last_print = -math.inf
        self.bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, file=self.stream, dynamic_ncols=True, unit="step",
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        now = time.monotonic()
        shown = self.shown(metrics, test=False)
        if any(k.startswith("test/") for k in metrics):
            self.message("  ".join([f"eval at step {step}", *self.shown(metrics, test=True)]))
        if self.bar is not None:
            self.bar.set_postfix_str("  ".join(shown), refresh=False)
            self.bar.update(step + 1 - self.bar.n)
            return
        done = step + 1 - self.start
        eta = (now - self.t0) / done * (self.total - step - 1) if done > 0 else 0.0
        if now - self.last_print >= self.every or step + 1 == self.total or done == 1:
            self.stream.write("  ".join([f"step {step + 1}/{self.total}", *shown, f"eta {_fmt_seconds(eta)}"]) + "\n")
            self.stream.flush()
            self.last_print = now

    def shown(self, metrics: dict[str, Any], test: bool) -> list[str]:
        """'label value' for each headline key the row has (test: only the test/ ones, else only the others)."""
        parts = []
        for key, label in self.keys:
            if key.startswith("test/") != test:
                continue
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{label} {metrics[key]:.4f}")
        if test:  # other test/ metrics of an eval row that the headline keys do not name
            named = {k for k, _ in self.keys}
            for key in ("test/nll", "test/env/all/reward/total", "test/accuracy", "test/teacher_kl", "test/agreement",
                        "test/win_rate_vs_init"):
                if key not in named and isinstance(metrics.get(key), (int, float)):
                    parts.append(f"{key} {metrics[key]:.4f}")
            # Pinned evals' headline numbers (runner/engine/evals.py).
            parts += [f"{k[len('test/'):]} {v:.4f}" for k, v in metrics.items()
                      if k.startswith("test/eval/") and k.endswith(("/accuracy", "/nll")) and isinstance(v, float)]
        return parts

    def final(self, metrics: dict[str, Any]) -> None:
        """The row logged after the last step (RL: the final eval), always printed."""
        self.message("  ".join([f"final ({self.total} steps)", *self.shown(metrics, test=True)]))

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
