"""The one model table (runner/models.toml, runner/models.py): what `auto` renderers, `lr = "auto"` and the shipped
prices read, checked against the registries it names."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from backends.local.local_config import Local
from backends.tinker.tinker_config import Tinker
from runner.engine.cost import price_of
from runner.models import MODELS, _load, model_info
from runner.recipe.cost import Price
from runner.recipe.lr import auto_lr
from runner.recipe.schema import SFT, Jsonl, Recipe
from runner.renderers import names
from runner.renderers.auto import pick_renderer


def test_every_row_names_a_renderer_runner_has_and_a_sane_size_and_price() -> None:
    assert len(MODELS) >= 25
    renderers = set(names())
    for name, row in MODELS.items():
        assert row.renderer is None or row.renderer in renderers, (name, row.renderer)
        assert row.hidden_size is None or 128 <= row.hidden_size <= 65536, (name, row.hidden_size)
        if row.price is not None:
            price = msgspec.convert(row.price, Price)  # the recipe's own check: three known, non-negative keys
            assert price.train > 0 and price.sample > 0 and price.prefill > 0, name


def test_the_readers_read_the_table() -> None:
    assert pick_renderer("Qwen/Qwen3-8B:peft:abc", None) == MODELS["Qwen/Qwen3-8B"].renderer == "qwen3"
    lr, how = auto_lr("meta-llama/Llama-3.1-8B")
    assert lr == pytest.approx(5e-5 * 10 * (2000 / 4096) ** 0.781) and "hidden size 4096" in how
    assert model_info("nobody/unknown") is None
    recipe = Recipe(model="Qwen/Qwen3-8B", backend=Tinker(), algo=SFT(data=Jsonl(path="x.jsonl")))
    price, where = price_of(recipe)
    assert where == "the shipped table" and price == Price(prefill=0.13, sample=0.4, train=0.4)
    local = Recipe(model="Qwen/Qwen3-8B", backend=Local(), algo=SFT(data=Jsonl(path="x.jsonl")))
    assert price_of(local)[0] == Price()  # a local run is free unless its recipe says otherwise


def test_a_typo_in_the_table_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    bad.write_text('[models."a/b"]\nrenderer = "qwen3"\nhiden_size = 4096\n')
    with pytest.raises(msgspec.ValidationError, match="hiden_size"):
        _load(bad)
