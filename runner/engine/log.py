"""Run logging: crash-safe JSONL files and a progress line.

Every JSONL line is appended with one os.write on an O_APPEND descriptor and fsynced before the loop moves
on. A write that fails part-way (disk full) is cut back off the file, so the file never ends in a torn line
from a failed append; after a `kill -9` (or an older version's crash) it ends in whole lines plus at most
one torn line, which `read_jsonl` drops and cuts off. Disk errors (ENOSPC, EDQUOT, EIO, EROFS) become one
UserError line, "disk full writing <path>" (disk_errors).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from backends.errors import UserError
from runner.recipe.common import Json

if TYPE_CHECKING:
    from tqdm import tqdm  # imported when a terminal shows the bar

# errno values that are the disk's, not the program's: one line naming the file, exit 2.
DISK_ERRNOS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EIO: "I/O error",
               errno.EROFS: "read-only file system"}


def disk_error(exc: BaseException, path: Path | str) -> UserError | None:
    """The one-line UserError for a disk error anywhere in `exc`'s cause chain (a backend wraps the OSError of a
    failed save; torch.save reports ENOSPC as RuntimeError "... file write failed"), else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in DISK_ERRNOS:
            where = cur.filename or path
            return UserError(f"{DISK_ERRNOS[cur.errno]} writing {where} ({os.strerror(cur.errno)}); free space "
                             "and run the same command to resume")
        text = str(cur)
        if "No space left on device" in text or "file write failed" in text:
            return UserError(f"disk full writing {path} ({text.strip().splitlines()[0][:200]}); free space and run "
                             "the same command to resume")
        cur = cur.__cause__ or cur.__context__
    return None


@contextlib.contextmanager
def disk_errors(path: Path | str) -> Iterator[None]:
    """Turn a disk error raised inside into one UserError line naming `path`, and so a refused link (ELOOP: the
    writers below open with O_NOFOLLOW, docs/reliability.md)."""
    try:
        yield
    except OSError as e:
        if (err := disk_error(e, path)) is not None:
            raise err from None
        if e.errno == errno.ELOOP:
            raise UserError(f"{e.filename or path} is a symbolic link; runner does not write through links in a run "
                            "dir: replace it with a file") from None
        raise


def _open_nofollow(path: Path, flags: int) -> int:
    """os.open that never follows a link at `path` (ELOOP instead), nor blocks on a FIFO there."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)


def append_jsonl(path: Path, row: Json) -> None:
    """Append one row as one line: a single os.write of the whole line on an O_APPEND descriptor, then fsync.
    A failed or short write is cut back off (the file never keeps half a row) and raises "disk full writing
    <path>"."""
    data = (json.dumps(row, allow_nan=True) + "\n").encode("utf-8")
    with disk_errors(path):
        fd = _open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                os.fsync(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)  # never leave a torn line behind
                raise
        finally:
            os.close(fd)


@dataclass(frozen=True)
class JsonlText:
    """A JSONL text, line by line (split at each newline character; blank lines skipped). What a line that does not
    parse means is the reader's: read_jsonl cuts a torn last line off and refuses a corrupt one; read-only readers
    skip a torn line (openai_serve) or any bad line (compare)."""

    rows: list[Json]  # the lines that are JSON objects, in order
    others: list[int]  # line numbers (from 1) of lines that are JSON but not an object
    corrupt: int | None  # the first line, ended by a newline, that is not JSON
    torn_at: int | None  # where (a str offset) an unended last line that is not JSON starts: a crash mid-write


def parse_jsonl(text: str) -> JsonlText:
    rows: list[Json] = []
    others: list[int] = []
    corrupt: int | None = None
    torn_at: int | None = None
    lines = text.split("\n")
    start = 0
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):
                    torn_at = start
                elif corrupt is None:
                    corrupt = n
            else:
                if isinstance(row, dict):
                    rows.append(row)
                else:
                    others.append(n)
        start += len(line) + 1
    return JsonlText(rows, others, corrupt, torn_at)


def read_jsonl(path: Path) -> list[Json]:
    """Rows of a JSONL file written by append_jsonl. A torn last line (a crash mid-write) is dropped
    and cut off the file, so the next append starts on a clean line; a bad line elsewhere is corruption."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    parsed = parse_jsonl(text)
    bad = min((n for n in (parsed.corrupt, *parsed.others) if n is not None), default=None)
    if bad is not None:
        what = "not JSON" if bad == parsed.corrupt else "not a JSON object"
        raise UserError(f"{path}:{bad}: corrupt line ({what}); fix or remove the file")
    if parsed.torn_at is not None:
        with disk_errors(path):  # torn tail: cut it off
            fd = _open_nofollow(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, len(text[:parsed.torn_at].encode()))
            finally:
                os.close(fd)
    elif text and not text.endswith("\n"):  # whole row, newline lost: end the line
        with disk_errors(path):
            fd = _open_nofollow(path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, b"\n")
            finally:
                os.close(fd)
    return parsed.rows


def write_jsonl_atomic(path: Path, rows: list[Json]) -> None:
    write_text_atomic(path, "".join(json.dumps(row, allow_nan=True) + "\n" for row in rows))


def write_text_atomic(path: Path, text: str) -> None:
    """Write a sibling temp file, fsync, rename over `path`: readers see the old file or the new one. A disk
    error removes the temp file and is one line."""
    tmp = path.with_name(path.name + ".tmp")
    with disk_errors(path):
        try:
            with os.fdopen(_open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


def _fmt_value(v: float) -> str:
    """A headline number: a count (an int) as a count ("rows 64"), everything else to 4 decimals."""
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else f"{v:.4f}"


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
        self.t0 = self.t_first = time.monotonic()
        self.last_print = -math.inf
        self.bar: tqdm | None = None
        self.stopped = False
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, file=self.stream, dynamic_ncols=True, unit="step",
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")

    def update(self, step: int, metrics: Json) -> None:
        if self.stopped:  # after Ctrl-C: the steps still finishing are summed up by the final message
            return
        now = time.monotonic()
        shown = self.shown(metrics, test=False)
        if any(k.startswith("test/") for k in metrics):
            self.message("  ".join([f"eval at step {step}", *self.shown(metrics, test=True)]))
        if self.bar is not None:
            self.bar.set_postfix_str("  ".join(shown), refresh=False)
            self.bar.update(step + 1 - self.bar.n)
            return
        done = step + 1 - self.start
        if done == 1:
            self.t_first = now  # the first step pays for the start (model load, first snapshot): no rate from it
        left = self.total - step - 1
        eta = "--" if done == 1 and left else _fmt_seconds((now - self.t_first) / (done - 1) * left if done > 1 else 0.0)
        if now - self.last_print >= self.every or step + 1 == self.total or done == 1:
            self.stream.write("  ".join([f"step {step + 1}/{self.total}", *shown, f"eta {eta}"]) + "\n")
            self.stream.flush()
            self.last_print = now

    def shown(self, metrics: Json, test: bool) -> list[str]:
        """'label value' for each headline key the row has (test: only the test/ ones, else only the others)."""
        parts = []
        for key, label in self.keys:
            if key.startswith("test/") != test:
                continue
            if isinstance(metrics.get(key), (int, float)):
                parts.append(f"{label} {_fmt_value(metrics[key])}")
        if test:  # other test/ metrics of an eval row that the headline keys do not name
            named = {k for k, _ in self.keys}
            for key in ("test/nll", "test/env/all/reward/total", "test/accuracy", "test/teacher_kl", "test/agreement",
                        "test/win_rate_vs_init"):
                if key not in named and isinstance(metrics.get(key), (int, float)):
                    parts.append(f"{key} {metrics[key]:.4f}")
            # Pinned evals' headline numbers (runner/engine/evals.py).
            parts += [f"{k[len('test/'):]} {v:.4f}" for k, v in metrics.items()
                      if k.startswith("test/eval/") and k.endswith(("/accuracy", "/nll", "/mean")) and isinstance(v, float)]
        return parts

    def final(self, metrics: Json) -> None:
        """The row logged after the last step (RL: the final eval), always printed."""
        self.message("  ".join([f"final ({self.total} steps)", *self.shown(metrics, test=True)]))

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def interrupt(self, text: str) -> None:
        """Ctrl-C's message: the bar is closed first (left as it stood), so it is not redrawn under the message by
        the steps still finishing; those print nothing more."""
        self.close()
        self.stopped = True
        self.message(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _fmt_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
