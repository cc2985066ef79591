"""The local backend's recipe table: `backend = {kind = "local", ...}` (the default)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from backends.backend_config import BackendConfig
from backends.local.options import LocalOptions

if TYPE_CHECKING:
    from backends.base import Backend


def nvidia_present() -> bool:
    """Whether this machine has an NVIDIA GPU, asked without importing torch: a /dev/nvidia<N> device node (what a
    CUDA process opens; a container given a GPU has one too)."""
    try:
        return any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev"))
    except OSError:
        return False


class Local(BackendConfig, LocalOptions):  # pyright: ignore[reportGeneralTypeIssues] - see ConfigStruct
    """In-process torch trainer and sampler (backends/local). Its fields and their checks: options.py."""

    def make(self, model: str, tokenizer: str | None, storage_dir: Path, seed: int) -> Backend:
        from backends.local.backend import LocalBackend  # torch loads here, not when a recipe is validated

        return LocalBackend(self, model, tokenizer, storage_dir, seed=seed)

    def describe(self, model: str) -> str | None:
        from backends.errors import UserError
        from backends.local.device import place  # torch loads here
        from backends.local.model import resolve_model_dir

        try:
            model_dir = resolve_model_dir(model)
        except UserError:  # not on this machine (yet): the run itself says so
            model_dir = None
        return f"device: {place(self, model_dir).describe()}"

    def billed(self) -> bool:
        return False  # this machine: free, unless the recipe's own price says otherwise

    def cache_problem(self, model: str, tokenizer: str | None) -> str | None:
        from backends.hub import cache_miss  # the model's files and the tokenizer's, as resolve_model_dir loads them

        return (cache_miss(model, "model", self.local_files_only)
                or (cache_miss(tokenizer, "tokenizer", self.local_files_only) if tokenizer else None))  # fmt: skip

    def sweep_parallel(self, cores: int, model: str | None = None) -> int:
        """1 when the runs would land on one NVIDIA GPU and share it: where one exists, what `place`
        (backends/local/device.py) decides for `model`, the run's own placement. Else (a CPU box, device = "cpu",
        or device = "auto" keeping a model under 50M parameters such as `tiny` on the CPU): half the cores, so each
        run trains on 2 threads, but at least 2 on a machine with 2 or 3 cores (bench/bench_sweep.py, 2 cores: 4
        tiny runs take 0.57x the time 2 at a time, 1 thread each, that they take one at a time on 2)."""
        on_cpu = max(min(2, cores), cores // 2)
        if self.device == "cpu" or not nvidia_present():
            return on_cpu  # no torch import on a CPU box
        return 1 if self.runs_on_cuda(model) else on_cpu

    def runs_on_cuda(self, model: str | None) -> bool:
        """Whether a run of `model` on this table is placed on cuda (device.place). A model not on this machine yet
        is looked up without downloading it: of unknown size, "auto" places it on cuda as the run would. A
        placement that fails (device = "cuda" where torch sees none) answers True: the run itself says why."""
        from backends.errors import UserError
        from backends.local.device import place  # torch loads here: only on a box with an NVIDIA device
        from backends.local.model import resolve_model_dir

        try:
            model_dir = resolve_model_dir(model, local_files_only=True) if model else None
        except UserError:
            model_dir = None
        try:
            return place(self, model_dir).device.type == "cuda"
        except UserError:
            return True
