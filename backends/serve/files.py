"""Files `runner serve` reads for a request outside its own storage (a run dir a /v1 `model` names, under a
`--runs` folder): regular files only, read-only, never through a link.

Each file is opened O_RDONLY | O_NONBLOCK | O_NOFOLLOW and checked with fstat on the open descriptor before a byte
is read: a FIFO (which would block the opener until someone writes to it), a device or a socket is refused at once,
and a link is refused by the open itself, so what was checked is what is read. Nothing here ever writes outside
the destination the server owns (copy_folder's `dest`, inside its storage).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from backends.errors import UserError

_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) \
    | getattr(os, "O_NOCTTY", 0)
MAX_TEXT_BYTES = 64 << 20  # a run's config.toml, checkpoints.jsonl, state.json: far under this


def open_regular(path: Path) -> int:
    """A read-only descriptor on `path`, a regular file that is not a link; UserError otherwise."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        why = "is a link" if exc.errno == getattr(os, "ELOOP", -1) else (exc.strerror or str(exc))
        raise UserError(f"{path}: cannot open ({why})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UserError(f"{path}: not a regular file")
        os.set_blocking(fd, True)  # a regular file never blocks; reads below are plain
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of regular file `path` (at most `limit` of them: more is a UserError)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UserError(f"{path}: {size} bytes, more than the {limit} read here")
        chunks, got = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - got)):
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                raise UserError(f"{path}: more than the {limit} bytes read here")
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_regular(path: Path) -> bool:
    """Whether `path` is a regular file and not a link (lstat: nothing is opened)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def copy_folder(src: Path, dest: Path, skip: frozenset[str] = frozenset(), max_bytes: int = 64 << 30) -> None:
    """Copy the regular files at the top of `src` (not `skip`, not links, not sub-folders) to new folder `dest`,
    each opened as open_regular does; a FIFO, device or link among them is a UserError, and `dest` is removed."""
    import shutil

    dest.mkdir(parents=True)
    try:
        total = 0
        for name in sorted(os.listdir(src)):
            if name in skip:
                continue
            p = src / name
            try:
                mode = p.lstat().st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode):
                continue
            fd = open_regular(p)  # a link, FIFO, device or socket: refused here
            try:
                total += os.fstat(fd).st_size
                if total > max_bytes:
                    raise UserError(f"{src}: over {max_bytes} bytes of files")
                with os.fdopen(os.dup(fd), "rb") as fin, open(dest / name, "xb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
            finally:
                os.close(fd)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
