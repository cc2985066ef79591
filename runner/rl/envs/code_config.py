"""The `code` env's recipe table (`algo.env = {kind = "code", ...}`), implemented by runner/rl/envs/code.py."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from runner.recipe.common import DataSource, EnvBase, NonNegFloat, PosFloat, PosInt


class Code(EnvBase, kw_only=True):
    """Single turn: a programming problem; the reply's last ```python block runs in a local sandbox
    (runner/rewards/sandbox.py, docs/sandbox.md) against the problem's tests. reward = fraction of tests passed
    + format_coef·(format − 1), format = a code block found and the reply ended on the stop token."""

    # Rows: {"question": str, "tests": [{"input": str, "output": str}, ...] and/or "asserts": [str, ...]}.
    data: DataSource
    test_data: DataSource | None = None
    format_coef: NonNegFloat = 0.1
    # Per test run (seconds of CPU / wall, MiB of address space).
    cpu_s: PosInt = 2
    wall_s: PosFloat = 5.0
    memory_mb: Annotated[int, Meta(ge=64)] = 512
    # Sandboxed programs at once (None: the CPU count).
    max_parallel: PosInt | None = None
