"""`lr = "auto"`: the cookbook's get_lr formula, resolved when the recipe loads and stated by `runner show`.

    pytest tests/test_lr_auto.py

Compared live with tinker_cookbook.hyperparam_utils.get_lr (0.6.1) whenever it imports; every model in our table
is in the cookbook's, so no lookup touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.errors import UserError
from runner.cli import main
from runner.models import hidden_sizes
from runner.recipe.load import load_recipe
from runner.recipe.lr import auto_lr

RECIPE = """\
[recipes.x]
lr = "auto"
{extra}
algo = {{kind = "sft", data = {{kind = "jsonl", path = "d.jsonl"}}}}
"""
TINY_LR = 5e-4 * (2000 / 128) ** 0.0775  # the embedded model: Qwen3-style, hidden size 128


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return tmp_path


def recipe(extra: str = "") -> str:
    Path("r.toml").write_text(RECIPE.format(extra=extra))
    return "r.toml#x"


@pytest.mark.extras("cookbook")
def test_matches_the_cookbook_for_every_model_in_the_table() -> None:
    hp = pytest.importorskip("tinker_cookbook.hyperparam_utils")
    assert len(hidden_sizes()) >= 20
    for name in hidden_sizes():
        assert auto_lr(name)[0] == pytest.approx(hp.get_lr(name), rel=1e-12), name
        assert auto_lr(name, full_finetune=True)[0] == pytest.approx(hp.get_lr(name, is_lora=False), rel=1e-12)
    # Tinker's variant suffix is ignored, as the cookbook does.
    assert auto_lr("Qwen/Qwen3-8B:peft:131072")[0] == pytest.approx(hp.get_lr("Qwen/Qwen3-8B:peft:131072"))
    # Families the cookbook has not calibrated: it refuses, and so do we.
    for name in ("openai/gpt-oss-20b", "deepseek-ai/DeepSeek-V3.1", "moonshotai/Kimi-K2.6"):
        with pytest.raises((NotImplementedError, ValueError)):
            hp.get_lr(name)
        with pytest.raises(UserError, match=f"no calibrated learning rate for model '{name}'"):
            auto_lr(name)


def test_known_values() -> None:
    # Independent of the cookbook: 5e-4 × (2000 / hidden) ** exponent.
    assert auto_lr("meta-llama/Llama-3.1-8B")[0] == pytest.approx(5e-4 * (2000 / 4096) ** 0.781)
    assert auto_lr("Qwen/Qwen3-32B")[0] == pytest.approx(5e-4 * (2000 / 5120) ** 0.0775)
    assert auto_lr("tiny")[0] == pytest.approx(TINY_LR)
    assert f"{TINY_LR:.3g}" == "0.000619"


def test_resolved_at_load_and_stated_by_show(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = recipe()
    assert load_recipe(ref)[1].lr == pytest.approx(TINY_LR)
    assert main(["show", ref]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# lr = 0.000618716: auto: the cookbook's get_lr for LoRA of tiny (qwen family, hidden "
                          "size 128 from ")
    assert f"lr = {load_recipe(ref)[1].lr!r}\n" in out  # the TOML holds the number, so it loads back the same
    assert main(["check", ref]) == 0
    # An override to auto works the same; a number given is used as given, with no note.
    assert load_recipe(recipe(), ["lr=auto"])[1].lr == pytest.approx(TINY_LR)
    assert main(["show", ref, "lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert "# lr" not in out and "lr = 0.01\n" in out
    # A full fine-tune uses the formula without the LoRA multiplier.
    full = load_recipe(recipe('backend = {kind = "local", full_finetune = true}'))[1]
    assert full.lr == pytest.approx(TINY_LR / 10)


def test_local_model_folder_and_unknown_models(workdir: Path) -> None:
    folder = workdir / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 512}))
    assert load_recipe(recipe(f'model = "{folder}"'))[1].lr == pytest.approx(5e-4 * (2000 / 512) ** 0.781)
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 512}))
    with pytest.raises(UserError) as e:
        load_recipe(recipe(f'model = "{folder}"'))
    assert str(e.value) == (f"r.toml#x: lr = \"auto\": no calibrated learning rate for model '{folder}' (the "
                            "cookbook's get_lr covers the Llama and Qwen families only); set lr to a number")
    with pytest.raises(UserError, match="the hidden size of model 'Qwen/Qwen9-1B' is unknown .*; set lr to a number"):
        load_recipe(recipe('model = "Qwen/Qwen9-1B"'))
    with pytest.raises(UserError, match=r"lr: expected float, got str 'fast'"):
        load_recipe(recipe(), ["lr=fast"])
