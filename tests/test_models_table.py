"""The one model table (runner/models.toml, runner/models.py): what `auto` renderers, `lr = "auto"`, the shipped
prices and the context checks read, checked against the registries it names."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from backends.errors import UserError
from backends.local.local_config import Local
from backends.tinker.tinker_config import Tinker
from runner.algos.distill_config import Distill, DistillSet, Teacher
from runner.algos.generate_config import Generate
from runner.algos.rl_config import RL
from runner.algos.sft_config import SFT
from runner.cli import main
from runner.engine.cost import price_of
from runner.engine.math_eval_config import MathPinned
from runner.models import _load, model_context, model_info, models
from runner.recipe.cost import Price
from runner.recipe.fits import check_context
from runner.recipe.lr import auto_lr
from runner.recipe.schema import Recipe
from runner.recipe.sources import Jsonl
from runner.renderers import names
from runner.renderers.auto import pick_renderer
from runner.renderers.chat import context_window
from runner.rl.envs.tictactoe_config import TicTacToe as TicTacToeEnv

TINY = Path(__file__).resolve().parent.parent / "backends" / "local" / "assets" / "tiny"


def test_every_row_names_a_renderer_runner_has_and_a_sane_size_and_price() -> None:
    assert len(models()) >= 25
    renderers = set(names())
    for name, row in models().items():
        assert row.renderer is None or row.renderer in renderers, (name, row.renderer)
        assert row.hidden_size is None or 128 <= row.hidden_size <= 65536, (name, row.hidden_size)
        if row.price is not None:
            price = msgspec.convert(row.price, Price)  # the recipe's own check: three known, non-negative keys
            assert price.train > 0 and price.sample > 0 and price.prefill > 0, name
        # Every model has its context: at least the tiny model's 2048, at most a 1M-token context.
        assert row.context is not None and 2048 <= row.context <= 2**20, (name, row.context)


def test_the_readers_read_the_table() -> None:
    assert pick_renderer("Qwen/Qwen3-8B:peft:abc", None) == models()["Qwen/Qwen3-8B"].renderer == "qwen3"
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
    with pytest.raises(UserError, match=r'^.*models\.toml: \[models\."a/b"\]: Object contains unknown field `hiden_size`$'):
        _load(bad)  # the model is named (msgspec alone said "at `$[...]`")
    bad.write_text('[models."a/b"]\ncontext = 0\n')
    with pytest.raises(UserError, match=r'\[models\."a/b"\]: Expected `int` >= 1 - at `\$.context`'):
        _load(bad)
    bad.write_text('[models."a/b"\n')
    with pytest.raises(UserError, match="not valid TOML"):
        _load(bad)


def test_context_facts() -> None:
    """Spot checks against the published configs; the tiny row is its embedded config's and tokenizer's."""
    config = json.loads((TINY / "config.json").read_text())
    tokenizer_config = json.loads((TINY / "tokenizer_config.json").read_text())
    assert model_context("tiny") == config["max_position_embeddings"] == tokenizer_config["model_max_length"] == 2048
    assert model_context("Qwen/Qwen3-8B") == 40960 and model_context("Qwen/Qwen3-8B-Base") == 32768
    assert model_context("meta-llama/Llama-3.1-8B-Instruct") == 131072
    assert model_context("Qwen/Qwen3-4B-Instruct-2507:peft:xyz") == 262144  # a suffix is ignored
    assert model_context("nobody/unknown") is None


def _recipe(model: str, algo: object) -> Recipe:
    return Recipe(model=model, backend=Tinker(), algo=algo)  # type: ignore[arg-type]


def test_check_refuses_lengths_beyond_the_context() -> None:
    data = Jsonl(path="x.jsonl")
    check_context(_recipe("Qwen/Qwen3-8B", SFT(data=data, max_length=40960)), "f#a")  # exactly fits
    with pytest.raises(UserError) as e:
        check_context(_recipe("Qwen/Qwen3-8B", SFT(data=data, max_length=40961)), "f#a")
    assert str(e.value) == ("f#a: algo.max_length = 40961 exceeds the 40960-token context of 'Qwen/Qwen3-8B' "
                            "(model, runner/models.toml): set it to at most 40960")
    rl = RL(env=TicTacToeEnv(), max_tokens=2047)
    check_context(_recipe("tiny", rl), "f#r")  # a 1-token prompt still fits
    with pytest.raises(UserError, match=r"^f#r: algo.max_tokens = 2048 leaves no room for a prompt in the 2048-token "
                                         r"context of 'tiny' \(model, "):
        check_context(_recipe("tiny", RL(env=TicTacToeEnv(), max_tokens=2048)), "f#r")
    # A teacher's base model scores the same sequences: its context counts too, and the error names its key.
    distill = Distill(datasets=[DistillSet(prompts=data), DistillSet(prompts=data, teacher=Teacher(model="tiny"))],
                      max_tokens=4096)
    with pytest.raises(UserError, match=r"algo.max_tokens = 4096 .* the 2048-token context of 'tiny' "
                                         r"\(algo.datasets\[1\].teacher.model, "):
        check_context(_recipe("Qwen/Qwen3-8B", distill), "f#d")
    check_context(_recipe("/some/local/folder", SFT(data=data, max_length=10**9)), "f#a")  # not in the table
    # A pinned eval samples the recipe's model: its max_tokens was not checked (the local sampler caps it silently).
    evals = [MathPinned(data=data), MathPinned(data=data, max_tokens=2048)]
    with pytest.raises(UserError, match=r"^f#e: evals\[1\].max_tokens = 2048 leaves no room for a prompt in the "
                                         r"2048-token context of 'tiny' \(model, "):
        check_context(Recipe(model="tiny", backend=Tinker(), algo=SFT(data=data), evals=evals), "f#e")  # type: ignore[arg-type]


def test_check_counts_the_prompt_the_recipe_holds() -> None:
    """generate's `system` is in every prompt: its tokens (the tiny tokenizer: one per byte) count against the
    context with max_tokens, when the tokenizer is on this machine."""
    data = Jsonl(path="x.jsonl")
    check_context(_recipe("tiny", Generate(prompts=data, system="s" * 100, max_tokens=1948)), "f#g")  # 2048: fits
    with pytest.raises(UserError) as e:
        check_context(_recipe("tiny", Generate(prompts=data, system="s" * 100, max_tokens=1949)), "f#g")
    assert str(e.value) == ("f#g: algo.max_tokens = 1949 and the 100 tokens of algo.system exceed the 2048-token "
                            "context of 'tiny' (model, runner/models.toml): shorten one (at most 1948 tokens to sample)")
    with pytest.raises(UserError, match=r"^f#g: algo.system alone \(3000 tokens\) fills the 2048-token context"):
        check_context(_recipe("tiny", Generate(prompts=data, system="s" * 3000, max_tokens=8)), "f#g")
    # A tokenizer that is not on this machine (a hub id never downloaded): only the 1-token floor is checked.
    check_context(_recipe("Qwen/Qwen3-8B", Generate(prompts=data, system="s" * 50000, max_tokens=8)), "f#g")


def test_runner_check_and_run_refuse_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "r.toml").write_text('[recipes.s]\nmodel = "tiny"\n'
                                     'algo = {kind = "sft", data = {kind = "jsonl", path = "x.jsonl"}}\n')
    assert main(["check", "r.toml#s", "algo.max_length=2048"]) == 0
    capsys.readouterr()
    for command in ("check", "run"):
        assert main([command, "r.toml#s", "algo.max_length=4096"]) == 2
        err = capsys.readouterr().err
        assert err == ("error: r.toml#s: algo.max_length = 4096 exceeds the 2048-token context of 'tiny' (model, "
                       "runner/models.toml): set it to at most 2048\n")


def test_context_window_takes_the_shorter_known_limit() -> None:
    unset = SimpleNamespace(model_max_length=int(1e30))  # transformers' sentinel: the tokenizer states none
    assert context_window(unset) is None  # type: ignore[arg-type]
    assert context_window(unset, "tiny") == 2048  # type: ignore[arg-type]  # the table fills the gap
    # Qwen3's tokenizer claims 131072; its config has 40960 positions.
    assert context_window(SimpleNamespace(model_max_length=131072), "Qwen/Qwen3-8B") == 40960  # type: ignore[arg-type]
    # A served stand-in (the tiny model under a service name) states less than the name's table row.
    assert context_window(SimpleNamespace(model_max_length=2048), "Qwen/Qwen3-8B") == 2048  # type: ignore[arg-type]
    assert context_window(SimpleNamespace(model_max_length=2048), "/a/folder") == 2048  # type: ignore[arg-type]


def test_a_broken_table_is_a_one_line_error_of_the_command_that_reads_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The table is read at first use, not at `import runner.cli`: an edit that breaks it was a traceback for every
    command; now `runner check` of a recipe says which file and exits 2, and a command that does not read it runs."""
    import runner.models

    bad = tmp_path / "models.toml"
    bad.write_text('[models."a/b"]\ncontext = "long"\n')
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "r.toml").write_text('[recipes.s]\nmodel = "tiny"\n'
                                     'algo = {kind = "sft", data = {kind = "jsonl", path = "x.jsonl"}}\n')
    monkeypatch.setattr(runner.models, "TABLE", bad)
    models.cache_clear()
    try:
        assert main(["list", "r.toml"]) == 0
        capsys.readouterr()
        assert main(["check", "r.toml#s"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and str(bad) in err and '[models."a/b"]' in err
    finally:
        monkeypatch.undo()
        models.cache_clear()
    assert model_context("tiny") == 2048  # the shipped table again
