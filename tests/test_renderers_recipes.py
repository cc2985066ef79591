"""The recipe's `renderer` end to end: `runner check` names an unknown one with the choices; `runner render` prints
what the trainer trains on; a base model (the tiny model saved without its chat template) trains with SFT and RL,
samples and exports with `role_colon`, which `auto` picks for it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from backends.local.tiny import save_random_tiny
from backends.tokenizer import load_tokenizer
from runner.cli import main
from runner.engine.log import read_jsonl
from runner.renderers import get_renderer
from runner.tools.render import render_command
from scripts.tiny_build import sft_conversations

PAIRS = [{"prompt": [{"role": "user", "content": "Say hi"}], "chosen": "hi", "rejected": "no"},
         {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"}]


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_conversations(16, seed=2)))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return tmp_path


def test_check_names_an_unknown_renderer(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (proj / "r.toml").write_text('[recipes.s]\nrenderer = "qwen9"\n'
                                 'algo = {kind = "sft", data = {kind = "jsonl", path = "chats.jsonl"}}\n')
    assert main(["check", "r.toml"]) == 2
    err = capsys.readouterr().err
    assert "renderer 'qwen9' is unknown (did you mean 'qwen3'?); choose one of: auto, hf," in err and "role_colon" in err
    assert len(err.strip().splitlines()) == 1


def test_render_prints_what_sft_and_dpo_train_on(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (proj / "r.toml").write_text(
        '[recipes.s]\nrenderer = "qwen3"\n'
        'algo = {kind = "sft", data = {kind = "jsonl", path = "chats.jsonl"}, train_on_what = "last_assistant_turn"}\n'
        '[recipes.d]\nalgo = {kind = "dpo", data = {kind = "jsonl", path = "pairs.jsonl"}}\n')
    assert main(["render", "r.toml#s", "--n", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    renderer = get_renderer("qwen3", load_tokenizer("tiny"))
    for row, conv in zip(rows, sft_conversations(16, seed=2)[:2], strict=True):
        tokens, weights = renderer.build_supervised_example(conv["messages"], "last_assistant_turn")
        assert (row["tokens"], row["weights"]) == (tokens, weights) and any(weights)
    assert len(rows) == 2 and rows[0]["where"] == "chats.jsonl:1"
    assert main(["render", "r.toml#d", "--n", "1"]) == 0  # auto on tiny = its chat template ("hf")
    sides = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["side"] for s in sides] == ["chosen", "rejected"]
    tok = load_tokenizer("tiny")
    assert [tok.decode([t for t, w in zip(s["tokens"], s["weights"], strict=True) if w]) for s in sides] == \
        ["hi<|im_end|>\n", "no<|im_end|>\n"]

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    render_command("r.toml#s", ["renderer=role_colon"], 1, False, out)
    text = out.getvalue()
    assert text.startswith("── chats.jsonl:1: ") and "\x1b[32m" in text and "Assistant:" in text
    assert main(["render", "r.toml#s", "--n", "0"]) == 2


USER_ALGO = """
from runner.engine.spec import AlgoSpec


def build(cfg, args):
    raise AssertionError("runner render builds nothing")


def show(cfg, recipe, renderer, n):
    for word in cfg.args["words"][:n]:
        tokens = renderer.build_generation_prompt([{"role": "user", "content": word}])
        yield {"where": word, "tokens": tokens, "weights": [0.0] * len(tokens)}


SPEC = AlgoSpec(build=build, show=show)
QUIET = AlgoSpec(build=build)
"""


def test_render_asks_the_algorithms_spec(proj: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`runner render` lists no algorithms: a user's algorithm renders through its spec's `show`; one without
    `show` is a one-line error (exit 2); the reward model shows both orders of its judge prompt, the label trained."""
    (proj / "user_algo.py").write_text(USER_ALGO)
    monkeypatch.syspath_prepend(str(proj))
    (proj / "r.toml").write_text(
        '[recipes.u]\nalgo = {kind = "python", target = "user_algo:SPEC", args = {words = ["hi", "yo", "ok"]}}\n'
        '[recipes.q]\nalgo = {kind = "python", target = "user_algo:QUIET"}\n'
        '[recipes.m]\nalgo = {kind = "reward_model", data = {kind = "jsonl", path = "pairs.jsonl"}}\n')
    assert main(["render", "r.toml#u", "--n", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    renderer = get_renderer("auto", load_tokenizer("tiny"), model_name="tiny")
    assert rows == [{"where": w, "tokens": renderer.build_generation_prompt([{"role": "user", "content": w}]),
                     "weights": [0.0] * len(rows[i]["tokens"])} for i, w in enumerate(["hi", "yo"])]
    assert main(["render", "r.toml#q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the python algorithm has no data to show" in err and len(err.splitlines()) == 1
    assert main(["render", "r.toml#m", "--n", "1", "--json"]) == 0
    sides = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["side"] for s in sides] == ["chosen first", "rejected first"]
    assert all(s["weights"] == [0.0] * (len(s["tokens"]) - 1) + [1.0] for s in sides)
    tok = load_tokenizer("tiny")
    assert [tok.decode(s["tokens"][-1:]) for s in sides] == ["A", "B"]  # chosen is A first, then B


def _base_model(path: Path) -> Path:
    """The tiny model saved as a folder, its chat template removed: a base model."""
    save_random_tiny(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert not getattr(load_tokenizer(str(path)), "chat_template", None)
    return path


def test_base_model_trains_and_samples_with_role_colon(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _base_model(proj / "base")
    local = 'backend = {kind = "local", device = "cpu"}\nlora = {rank = 4}\nsave_every = 0\neval_every = 0\n'
    (proj / "r.toml").write_text(
        f'[recipes.s]\nmodel = "{base}"\n{local}max_steps = 2\n'
        'algo = {kind = "sft", data = {kind = "jsonl", path = "chats.jsonl"}, batch_size = 2}\n'
        f'[recipes.r]\nmodel = "{base}"\nrenderer = "role_colon"\n{local}max_steps = 2\n'
        'algo = {kind = "rl", env = {kind = "arithmetic", max_value = 9, test_size = 2}, group_size = 2, '
        'groups_per_batch = 2, max_tokens = 4}\n')
    # auto on a folder without a chat template (and a name the cookbook does not know) = role_colon
    assert main(["render", "r.toml#s", "--n", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    tok = load_tokenizer(str(base))
    assert tok.decode(row["tokens"]).startswith("System: ") or tok.decode(row["tokens"]).startswith("User: ")
    assert main(["render", "r.toml#r", "--n", "1", "--json"]) == 0  # RL: the env's first prompt
    prompt = tok.decode(json.loads(capsys.readouterr().out)["tokens"])
    assert prompt.startswith("User: ") and prompt.endswith("\n\nAssistant:")
    assert main(["run", "r.toml#s"]) == 0
    assert [r["step"] for r in read_jsonl(proj / "runs" / "s" / "metrics.jsonl")] == [0, 1]
    assert main(["run", "r.toml#r"]) == 0
    assert [r["step"] for r in read_jsonl(proj / "runs" / "r" / "metrics.jsonl") if "env/all/reward/total" in r]
    capsys.readouterr()
    assert main(["sample", "r.toml#s", "How many legs does a vexle have?", "--max-tokens", "6", "--json"]) == 0
    [sampled] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sampled["checkpoint"] == "final" and len(sampled["completions"]) == 1
    assert main(["export", str(proj / "runs" / "s"), str(proj / "out"), "--merged"]) == 0
    assert (proj / "out" / "config.json").is_file()
