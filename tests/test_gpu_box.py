"""A GPU box faked on the CPU (torch.cuda.is_available and the /dev/nvidia<N> check monkeypatched, model sizes from safetensors
headers): every default that depends on the device follows backends/local/device.py's `place`, so on such a box the
embedded `tiny` model, and every recipe and example built on it, still runs on the CPU in float32 (the numbers
the tests and bench/results/recipes.md assert), a sweep of tiny runs still parallelises as on a CPU box, and
`runner serve` sizes its --max-bytes default by the memory its models are placed in."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from backends.local import local_config
from backends.local.device import CPU_MAX_PARAMS, place
from backends.local.local_config import Local
from backends.local.tiny import TINY_DIR
from tests.test_bf16 import _fake_model

REPO = Path(__file__).resolve().parent.parent
GPU_BYTES = 80 << 30  # the faked card's memory


@pytest.fixture
def gpu_box(monkeypatch):
    """torch sees a CUDA device of GPU_BYTES and /dev/nvidia<N> exists; RUNNER_LOCAL_DEVICE is unset."""
    monkeypatch.setattr(local_config, "nvidia_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=GPU_BYTES))
    monkeypatch.delenv("RUNNER_LOCAL_DEVICE", raising=False)


@pytest.fixture
def big(tmp_path) -> Path:
    return _fake_model(tmp_path / "big", CPU_MAX_PARAMS)  # the smallest model "auto" puts on cuda


# ---------------------------------------------------------------- sweep parallelism


def test_a_sweep_of_tiny_runs_parallelises_on_a_gpu_box(gpu_box, big):
    assert Local().sweep_parallel(16, "tiny") == 8  # "auto" keeps tiny on the CPU: as on a CPU box
    assert Local().sweep_parallel(2, "tiny") == 2
    assert Local().sweep_parallel(16, str(big)) == 1  # a real model shares the one GPU
    assert Local().sweep_parallel(16, None) == 1  # unknown size: "auto" places it on cuda, as the run would
    assert Local(device="cuda").sweep_parallel(16, "tiny") == 1
    assert Local(device="cpu").sweep_parallel(16, str(big)) == 8
    assert Local().sweep_parallel(16, "Org/not-in-the-cache") == 1  # looked up without a download: unknown size


def test_a_sweep_on_a_cpu_box_ignores_the_model(monkeypatch, big):
    monkeypatch.setattr(local_config, "nvidia_present", lambda: False)
    assert Local().sweep_parallel(16, str(big)) == 8
    assert Local(device="cuda").sweep_parallel(4, "tiny") == 2  # the run itself fails, saying why


def test_the_sweep_asks_with_each_points_model(gpu_box, tmp_path, big):
    from runner.tools.sweep import default_parallel

    def point(model: str):
        return SimpleNamespace(recipe=SimpleNamespace(model=model, backend=Local()))

    assert default_parallel([point("tiny"), point("tiny")]) >= 1
    assert default_parallel([point("tiny"), point(str(big))]) == 1


# ---------------------------------------------------------------- runner serve --max-bytes


def _max_bytes(tmp_path: Path, models: tuple[str, ...], device: str = "auto") -> int:
    from backends.serve.http import ServeConfig, build_service

    service = build_service(ServeConfig(storage=tmp_path / "storage", models=models, device=device))
    try:
        return service.memory.max_bytes
    finally:
        service.close()


def test_serve_max_bytes_follows_where_the_models_are_placed(gpu_box, tmp_path, big):
    from backends.serve.memory import physical_memory

    assert _max_bytes(tmp_path / "a", ("tiny",)) == physical_memory() // 2  # tiny on the CPU of a GPU box
    assert _max_bytes(tmp_path / "b", (str(big),)) == int(GPU_BYTES * 0.9)
    assert _max_bytes(tmp_path / "c", ("tiny", str(big))) == int(GPU_BYTES * 0.9)  # any model on cuda: its memory
    assert _max_bytes(tmp_path / "d", ("tiny",), device="cuda") == int(GPU_BYTES * 0.9)
    assert _max_bytes(tmp_path / "e", (str(big),), device="cpu") == physical_memory() // 2


# ---------------------------------------------------------------- every recipe on the tiny model


def _tiny_recipes() -> list[tuple[str, object]]:
    from runner.recipe.load import load_file

    out = []
    for path in [REPO / "recipes.toml", *sorted((REPO / "examples").glob("*.toml"))]:
        for name, recipe in load_file(str(path)).items():
            if recipe.model == "tiny" and isinstance(recipe.backend, Local):
                out.append((f"{path.name}#{name}", recipe.backend))
    return out


def test_every_tiny_recipe_runs_on_the_cpu_in_float32_on_a_gpu_box(gpu_box, big, monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name their data relative to the repo root
    recipes = _tiny_recipes()
    assert len(recipes) >= 15, [r for r, _ in recipes]  # recipes.toml's 14 and the tiny examples
    wrong = {}
    for ref, backend in recipes:
        p = place(backend, TINY_DIR)  # torch.cuda.is_available() is True here
        if (p.device.type, p.dtype) != ("cpu", torch.float32):
            wrong[ref] = p.describe()
    assert wrong == {}
    # The same table on a real model goes to cuda in bfloat16.
    for ref, backend in recipes:
        if backend.device == "auto" and backend.dtype == "auto":
            p = place(backend, big)
            assert (p.device.type, p.dtype) == ("cuda", torch.bfloat16), ref


def test_serve_device_cuda_without_cuda_fails_before_serving(tmp_path, monkeypatch):
    from backends.errors import UserError
    from backends.serve.http import ServeConfig, build_service

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda: torch sees no CUDA device; use --device auto or cpu"):
        build_service(ServeConfig(storage=tmp_path / "storage", device="cuda"))
    assert not (tmp_path / "storage").exists()
