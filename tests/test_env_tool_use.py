"""The `tool_use` env (runner/rl/envs/tool_use.py) and its tools (runner/rewards/tools.py): the calculator, BM25
search, function -> tool spec, scripted episodes in the plain-text (`CALL`) and Qwen3 (<tool_call>) formats, and a
2-step run of the shipped recipe on the tiny model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import renderer_tokenizers

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from backends.types import SamplingParams
from runner.engine.loop import run
from runner.recipe.load import load_recipe
from runner.recipe.sources import Jsonl
from runner.renderers import get_renderer
from runner.renderers.chat import ChatRenderer
from runner.rewards.tools import BM25, ToolError, calculator, load_docs, tool_from_function
from runner.rl.envs import EnvContext, build_datasets
from runner.rl.envs.tool_use import Problem, ToolUseEnv, answer_matches, parse_plain_calls, setup_tools
from runner.rl.envs.tool_use_config import ToolUse
from runner.rl.rollouts import run_episode
from runner.rl.testing import ScriptedSampler
from runner.rl.types import Trajectory

ROOT = Path(__file__).resolve().parents[1]
TOK = build_tokenizer()
R = ChatRenderer(TOK)  # the tiny model's "hf" renderer: no tool format, so `CALL` lines
QUESTIONS = Jsonl(str(ROOT / "examples/data/tool_questions.jsonl"))
DOCS = Jsonl(str(ROOT / "examples/data/tool_docs.jsonl"))


def lookup_price(item: str, quantity: int = 1) -> str:
    """Price of an item in dollars.

    Args:
        item: the item's name
        quantity: how many
    """
    return f"{quantity} x {item} = {quantity * len(item)} dollars"


def play(cfg: ToolUse, replies: list[str], renderer: ChatRenderer = R, answer: str = "391",
         tok: Any = TOK) -> tuple[Trajectory, list[str]]:  # fmt: skip
    """One episode whose i-th reply is replies[i] (the last one repeated): the trajectory and each prompt's text."""
    env = ToolUseEnv(renderer, Problem("What is 17 * 23?", (answer,), "t"), setup_tools(cfg, renderer))
    sampler = ScriptedSampler(tok, lambda p, s: replies[min(len(sampler.calls) - 1, len(replies) - 1)])
    traj = asyncio.run(run_episode(env, sampler, SamplingParams(max_tokens=200), seed=0, step=0, group=0, member=0))
    return traj, [tok.decode(c[0], skip_special_tokens=False) for c in sampler.calls]


def cfg_of(**kw: Any) -> ToolUse:
    return ToolUse(data=QUESTIONS, **kw)


# ---------------------------------------------------------------- tools


@pytest.mark.parametrize(("expr", "out"), [("17 * 23", "391"), ("(45 + 55) * 3", "300"), ("2 ** 10 - 24", "1000"),
                                           ("7 / 2", "3.5"), ("sqrt(16) + abs(-2)", "6"), ("2^3", "8"),
                                           ("-5 // 2", "-3")])  # fmt: skip
def test_calculator(expr: str, out: str) -> None:
    assert calculator(expr) == out


@pytest.mark.parametrize(("expr", "error"), [("__import__('os').system('ls')", "unsupported expression"),
                                             ("1 / 0", "division by zero"), ("9 ** 9 ** 9", "too large"),
                                             ("open", "unsupported"), ("2 +", "not an arithmetic expression")])  # fmt: skip
def test_calculator_refuses(expr: str, error: str) -> None:
    with pytest.raises(ToolError, match=error):
        calculator(expr)


def test_search_ranks_the_right_doc_first() -> None:
    from runner.data.conversations import load_rows

    index = BM25(load_docs(*load_rows(DOCS)))
    for query, doc_id in [("who created the Python programming language", "python"),
                          ("capital of Australia", "canberra"), ("Jupiter moons", "jupiter"),
                          ("Bach born", "bach"), ("first person on the Moon", "moon")]:  # fmt: skip
        hits = index.top(query, 3)
        assert hits[0][0].id == doc_id, (query, [d.id for d, _ in hits])
    assert index.top("zzzz qqqq", 3) == []


def test_function_becomes_a_tool_spec() -> None:
    tool = tool_from_function(lookup_price, "t")
    assert tool.spec == {
        "name": "lookup_price",
        "description": "Price of an item in dollars.",
        "parameters": {"type": "object", "required": ["item"], "properties": {
            "item": {"type": "string", "description": "the item's name"},
            "quantity": {"type": "integer", "description": "how many"}}},
    }  # fmt: skip
    assert asyncio.run(tool.call({"item": "pen", "quantity": 2}, 5.0)) == "2 x pen = 6 dollars"
    with pytest.raises(ToolError, match="should be a integer"):
        asyncio.run(tool.call({"item": "pen", "quantity": "2"}, 5.0))
    with pytest.raises(ToolError, match="missing argument 'item'"):
        asyncio.run(tool.call({}, 5.0))


def test_tool_without_docstring_or_hints_is_a_user_error() -> None:
    def bare(x: int) -> int:
        return x

    def untyped(x):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        """Has a docstring."""
        return x

    with pytest.raises(UserError, match="needs a docstring"):
        tool_from_function(bare, "tool 'm:bare'")
    with pytest.raises(UserError, match="argument 'x' needs a type hint"):
        tool_from_function(untyped, "tool 'm:untyped'")


def test_plain_call_lines() -> None:
    calls, errors = parse_plain_calls('Let me.\nCALL calculator {"expression": "1+1"}\nCALL search {bad}\nCALL x []')
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "1+1"})]
    assert len(errors) == 2 and "not JSON" in errors[0] and "JSON object" in errors[1]


@pytest.mark.parametrize(("given", "golds"), [("391", ["391"]), ("391.0", ["391"]), ("the answer is 36.", ["36"]), ("36 dollars", ["36"]),
                                                     ("guido van rossum.", ["Guido van Rossum"]),
                                                     ("Van Rossum", ["Guido van Rossum", "van Rossum"]),
                                                     ("the Canberra", ["Canberra"])])  # fmt: skip
def test_answer_matches(given: str, golds: list[str]) -> None:
    assert answer_matches(given, golds)


@pytest.mark.parametrize(("given", "golds"), [("390", ["391"]), ("Sydney", ["Canberra"]), ("", ["1"])])
def test_answer_mismatches(given: str, golds: list[str]) -> None:
    assert not answer_matches(given, golds)


# ---------------------------------------------------------------- episodes (plain-text format)


def test_calculator_call_then_answer() -> None:
    traj, prompts = play(cfg_of(), ['I will compute.\nCALL calculator {"expression": "17 * 23"}', "Answer: 391"])
    first, last = traj.transitions
    assert "CALL calculator" in prompts[0] and '"name": "calculator"' in prompts[0]  # declared in the system prompt
    assert "RESULT calculator: 391" in prompts[1]
    assert first.reward == 0.0 and not first.episode_done
    assert first.logs["tool_call_0"] == 'calculator({"expression": "17 * 23"})' and first.logs["tool_result_0"] == "391"
    assert last.reward == 1.0 and last.episode_done
    assert last.metrics == {"correct": 1.0, "format": 1.0, "turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0,
                            "malformed": 0.0, "out_of_turns": 0.0}
    assert last.logs["extracted"] == "391"


def test_answer_without_prefix_and_wrong_answer() -> None:
    t = play(cfg_of(), ["391"])[0].transitions[-1]
    assert t.reward == pytest.approx(-0.1) and t.metrics["format"] == 0.0 and t.metrics["correct"] == 0.0
    t = play(cfg_of(), ["Answer: 390"])[0].transitions[-1]
    assert t.reward == 0.0 and t.metrics["format"] == 1.0
    t = play(cfg_of(answer_prefix=""), ["391"])[0].transitions[-1]
    assert t.reward == 1.0


def test_malformed_call_costs_the_format_bonus() -> None:
    traj, prompts = play(cfg_of(), ["CALL calculator {expression: 17*23}", "Answer: 391"])
    first, last = traj.transitions
    assert "malformed tool call" in prompts[1] and "not JSON" in str(first.logs["malformed_0"])
    assert last.metrics["malformed"] == 1.0 and last.metrics["tool_calls"] == 0.0
    assert last.metrics["correct"] == 1.0 and last.metrics["format"] == 0.0
    assert last.reward == pytest.approx(0.9)


def test_unknown_tool_and_bad_arguments_are_tool_errors() -> None:
    traj, prompts = play(cfg_of(), ["CALL weather {}", 'CALL calculator {"expr": "1"}', "Answer: 391"])
    assert "unknown tool 'weather'" in prompts[1] and "['calculator']" in prompts[1]
    assert "has no argument 'expr'" in prompts[2]
    last = traj.transitions[-1]
    assert last.metrics["tool_errors"] == 2.0 and last.metrics["tool_calls"] == 2.0 and last.metrics["malformed"] == 0.0
    assert last.reward == 1.0  # errors are the model's to recover from; only malformed calls cost the format


def test_exceeding_max_turns_ends_the_episode() -> None:
    traj, prompts = play(cfg_of(max_turns=3), ['CALL calculator {"expression": "1+1"}'])
    assert len(traj.transitions) == 3 and len(prompts) == 3
    last = traj.transitions[-1]
    assert last.episode_done and last.reward == pytest.approx(-0.1)
    assert last.metrics["out_of_turns"] == 1.0 and last.metrics["turns"] == 3.0 and last.metrics["tool_calls"] == 3.0
    assert last.metrics["correct"] == 0.0


def test_user_tool_is_called_with_its_args() -> None:
    cfg = cfg_of(tools=["calculator", "test_env_tool_use:lookup_price"])
    traj, prompts = play(cfg, ['CALL lookup_price {"item": "pencil", "quantity": 3}', "Answer: 18"], answer="18")
    assert '"name": "lookup_price"' in prompts[0] and "the item's name" in prompts[0]
    assert "RESULT lookup_price: 3 x pencil = 18 dollars" in prompts[1]
    assert traj.transitions[-1].reward == 1.0


def test_search_tool_in_an_episode() -> None:
    cfg = cfg_of(tools=["search"], docs=DOCS, top_k=1)
    traj, prompts = play(cfg, ['CALL search {"query": "capital of Australia"}', "Answer: Canberra"], answer="Canberra")
    assert "RESULT search: [1] Canberra (id canberra)" in prompts[1] and "Jupiter" not in prompts[1]
    assert traj.transitions[-1].reward == 1.0


def test_long_results_are_cut() -> None:
    cfg = cfg_of(tools=["search"], docs=DOCS, max_result_chars=20)
    traj, _ = play(cfg, ['CALL search {"query": "Eiffel"}', "Answer: 391"])
    assert len(str(traj.transitions[0].logs["tool_result_0"])) == 21


# ---------------------------------------------------------------- the Qwen3 tool format


def test_qwen3_tool_format() -> None:
    tok = renderer_tokenizers.tokenizer("qwendeepseek")
    renderer = ChatRenderer(get_renderer("qwen3_instruct", tok))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
    traj, prompts = play(cfg_of(), [call, "Answer: 391"], renderer=renderer, tok=tok)
    assert "<tools>\n" in prompts[0] and '{"type": "function", "function": {"name": "calculator"' in prompts[0]
    assert "CALL" not in prompts[0]
    assert prompts[1].endswith("<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}"
                               "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n391\n</tool_response>"
                               "<|im_end|>\n<|im_start|>assistant\n")
    assert traj.transitions[-1].reward == 1.0 and traj.transitions[-1].metrics["tool_calls"] == 1.0
    # The second prompt extends the first with the sampled reply: one sequence for training.
    assert prompts[1].startswith(prompts[0])

    traj, prompts = play(cfg_of(), ["<tool_call>\n{not json}\n</tool_call>", "Answer: 391"], renderer=renderer, tok=tok)
    assert "malformed tool call: Invalid JSON" in prompts[1] and "{not json}" in prompts[1]
    assert traj.transitions[-1].metrics["malformed"] == 1.0 and traj.transitions[-1].reward == pytest.approx(0.9)


@pytest.mark.parametrize(("renderer_name", "tok_name", "declared", "call"), [
    ("deepseekv3", "qwendeepseek", "### calculator\nDescription: Evaluate",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{\"expression\": \"17 * 23\"}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("kimi_k2", "harmonykimi", "<|im_system|>tool_declare<|im_middle|>[{\"function\":{\"description\"",
     "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>"
     "{\"expression\": \"17 * 23\"}<|tool_call_end|><|tool_calls_section_end|>"),
])  # fmt: skip
def test_deepseek_and_kimi_tool_formats(renderer_name: str, tok_name: str, declared: str, call: str) -> None:
    tok = renderer_tokenizers.tokenizer(tok_name)
    renderer = ChatRenderer(get_renderer(renderer_name, tok))
    traj, prompts = play(cfg_of(), [call, "Answer: 391"], renderer=renderer, tok=tok)
    assert declared in prompts[0] and "CALL" not in prompts[0]
    assert "391" in prompts[1][len(prompts[0]):] and prompts[1].startswith(prompts[0])
    assert traj.transitions[0].logs["tool_call_0"] == 'calculator({"expression": "17 * 23"})'
    assert traj.transitions[-1].reward == 1.0


# ---------------------------------------------------------------- config and data


def test_config_errors() -> None:
    with pytest.raises(msgspec.ValidationError, match="search tool needs `docs`"):
        msgspec.convert({"data": {"kind": "jsonl", "path": "x"}, "tools": ["search"]}, ToolUse)
    with pytest.raises(msgspec.ValidationError, match="neither a built-in"):
        msgspec.convert({"data": {"kind": "jsonl", "path": "x"}, "tools": ["weather"]}, ToolUse)


def test_bad_rows_and_tools_are_one_line_errors(tmp_path: Path) -> None:
    ctx = EnvContext(renderer=R, group_size=1, test_group_size=1, groups_per_batch=1, seed=0)
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"question": "x?"}) + "\n")
    with pytest.raises(UserError, match="q.jsonl:1: expected an `answer`"):
        build_datasets(ToolUse(data=Jsonl(str(bad))), ctx)
    with pytest.raises(UserError, match="tool_use env: tools: cannot import .no_such_module_xyz:fn."):
        build_datasets(cfg_of(tools=["no_such_module_xyz:fn"]), ctx)
    docs = tmp_path / "d.jsonl"
    docs.write_text(json.dumps({"id": "1", "title": "t"}) + "\n")
    with pytest.raises(UserError, match="d.jsonl:1: a search document"):
        build_datasets(cfg_of(tools=["search"], docs=Jsonl(str(docs))), ctx)


def test_tool_use_recipe_two_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    over = ["max_steps=2", "eval_every=1", f"log_dir={tmp_path / 'run'}", "algo.groups_per_batch=2",
            "algo.group_size=2", "algo.env.test_size=2", "algo.max_tokens=8"]  # fmt: skip
    name, r = load_recipe(f"{ROOT / 'recipes.toml'}#tool_use", over)
    run(r, name)
    ms = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in ms if "env/all/tool_calls" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["env/all/turns"] >= 1.0 and 0.0 <= m["env/all/correct"] <= 1.0 and "env/all/malformed" in m
    assert any("test/env/all/correct" in m for m in ms)
    first = json.loads((tmp_path / "run" / "iteration_000000" / "train_rollout_summaries.jsonl").read_text()
                       .splitlines()[0])  # fmt: skip
    assert first["steps"][-1]["logs"]["question"] and "reference" in first["steps"][-1]["logs"]
