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

from runner.errors import UserError


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
    """One updating line on a terminal (stderr isatty); otherwise a plain line every `every` seconds
    and at the last step, so CI logs stay short."""

    def __init__(self, total: int, start: int, stream: TextIO | None = None, every: float = 10.0):
        self.total, self.start = total, start
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every
        self.t0 = time.monotonic()
        self.last_print = -math.inf

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        now = time.monotonic()
        done = step + 1 - self.start
        eta = (now - self.t0) / done * (self.total - step - 1) if done > 0 else 0.0
        parts = [f"step {step + 1}/{self.total}", *_shown(metrics), f"eta {_fmt_seconds(eta)}"]
        line = "  ".join(parts)
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if step + 1 == self.total:
                self.stream.write("\n")
        elif now - self.last_print >= self.every or step + 1 == self.total:
            self.stream.write(line + "\n")
            self.last_print = now
        self.stream.flush()

    def final(self, metrics: dict[str, Any]) -> None:
        """The row logged after the last step (RL: the final eval), always printed."""
        self.message("  ".join([f"final ({self.total} steps)", *_shown(metrics)]))

    def message(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()


def _shown(metrics: dict[str, Any]) -> list[str]:
    """The headline numbers a row holds: SFT shows NLLs, RL rewards; whichever the row logged."""
    parts = []
    loss = metrics.get("train_mean_nll", metrics.get("loss"))
    if isinstance(loss, (int, float)):
        parts.append(f"loss {loss:.4f}")
    for key, label in (("test/nll", "test/nll"), ("env/all/reward/total", "reward"),
                       ("test/env/all/reward/total", "test/reward")):
        if isinstance(metrics.get(key), (int, float)):
            parts.append(f"{label} {metrics[key]:.4f}")
    return parts


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
