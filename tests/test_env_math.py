"""The `math` env (runner/rl/envs/math.py): data loading (GSM8K, MATH and plain answers), prompts, rewards and metrics
with a scripted policy, and a 2-step run of the shipped `math_rl` recipe on the tiny model (seconds)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from backends.types import SamplingParams
from runner.engine.loop import run
from runner.recipe.load import load_recipe
from runner.recipe.sources import Jsonl
from runner.renderers.chat import ChatRenderer
from runner.rl.envs import EnvContext, build_datasets, get_batch
from runner.rl.envs.math import BOXED_SUFFIX, MathEnv, Problem, load_problems
from runner.rl.envs.math_config import Math
from runner.rl.rollouts import run_episode
from runner.rl.testing import ScriptedSampler

ROOT = Path(__file__).resolve().parents[1]
TOK = build_tokenizer()
R = ChatRenderer(TOK)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ctx(group_size: int = 2, groups_per_batch: int = 2, seed: int = 0) -> EnvContext:
    return EnvContext(renderer=R, group_size=group_size, test_group_size=1, groups_per_batch=groups_per_batch, seed=seed)


def play(env: MathEnv, reply: str, max_tokens: int = 64) -> tuple[Any, str]:
    sampler = ScriptedSampler(TOK, lambda p, s: reply)
    traj = asyncio.run(run_episode(env, sampler, SamplingParams(max_tokens=max_tokens), seed=0, step=0, group=0,
                                   member=0))  # fmt: skip
    return traj, TOK.decode(sampler.calls[0][0])


def test_load_problems_gsm8k_math_and_plain(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [
        {"question": "2 and 3?", "answer": "2 + 3 = 5\n#### 5"},
        {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
        {"question": "Seven?", "answer": 7},
    ])  # fmt: skip
    ps = load_problems(Jsonl(str(path)), None, None)
    assert [(p.question, p.answer) for p in ps] == [("2 and 3?", "5"), ("Half of one?", "\\frac{1}{2}"), ("Seven?", "7")]
    assert ps[0].where.endswith("p.jsonl:1")
    mapped = write_rows(tmp_path / "m.jsonl", [{"q": "Two?", "final": "2"}])
    assert load_problems(Jsonl(str(mapped)), "q", "final")[0].answer == "2"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question": "x?"}], "p.jsonl:1: expected a non-empty answer in field 'answer' or 'solution'"),
        ([{"answer": "1"}], "p.jsonl:1: expected a non-empty question"),
        ([["not", "an", "object"]], "p.jsonl:1: expected an object"),
        ([{"question": "", "answer": "1"}], "expected a non-empty question"),
    ],
)
def test_bad_rows_are_one_line_errors(tmp_path: Path, rows: list[Any], message: str) -> None:
    path = write_rows(tmp_path / "p.jsonl", rows)
    with pytest.raises(UserError, match=message.replace("?", r"\?")):
        build_datasets(Math(data=Jsonl(str(path))), ctx())


def test_boxed_prompt_reward_and_metrics() -> None:
    cfg = Math(data=Jsonl("unused"))
    env = lambda: MathEnv(R, Problem("What is 1/2 + 1/4?", "\\frac{3}{4}", "t"), cfg)  # noqa: E731
    traj, prompt = play(env(), "1/2 + 1/4 = 3/4, so \\boxed{0.75}")
    (tr,) = traj.transitions
    assert "What is 1/2 + 1/4?" + BOXED_SUFFIX in prompt and "strawberry" in prompt  # the cookbook's few-shot
    assert (tr.reward, tr.metrics) == (1.0, {"format": 1.0, "correct": 1.0})
    assert tr.logs["extracted"] == "0.75" and tr.logs["reference"] == "\\frac{3}{4}"
    traj, _ = play(env(), "The answer is 3/4.")  # right, but not in the asked format
    assert (traj.transitions[0].reward, traj.transitions[0].metrics) == (pytest.approx(-0.1), {"format": 0.0,
                                                                                              "correct": 0.0})
    traj, _ = play(env(), "\\boxed{0.5}")
    assert (traj.transitions[0].reward, traj.transitions[0].metrics["correct"]) == (0.0, 0.0)
    traj, _ = play(env(), "\\boxed{0.75}", max_tokens=12)  # right, but cut before the stop token
    assert (traj.transitions[0].reward, traj.transitions[0].metrics) == (pytest.approx(0.9), {"format": 0.0,
                                                                                             "correct": 1.0})
    traj, _ = play(env(), "\\boxed{0.75}", max_tokens=8)  # cut inside the box: no answer at all
    assert traj.transitions[0].metrics == {"format": 0.0, "correct": 0.0}


def test_auto_format_accepts_bare_numbers() -> None:
    cfg = Math(data=Jsonl("unused"), answer_format="auto", format_coef=0.5)
    env = MathEnv(R, Problem("Tom has 2 cats and gets 3 more. What is 2 + 3?", "5", "t"), cfg)
    traj, prompt = play(env, " 5 ")
    assert prompt.count("<|im_start|>user") == 2 and BOXED_SUFFIX not in prompt
    assert (traj.transitions[0].reward, traj.transitions[0].metrics) == (1.0, {"format": 1.0, "correct": 1.0})
    env = MathEnv(R, Problem("?", "5", "t"), cfg)
    traj, _ = play(env, "five")
    assert (traj.transitions[0].reward, traj.transitions[0].metrics) == (-0.5, {"format": 0.0, "correct": 0.0})


def test_split_is_seeded_and_disjoint(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(10)])
    cfg = Math(data=Jsonl(str(path)), test_size=4)
    train, test = build_datasets(cfg, ctx(groups_per_batch=2, seed=3))
    assert test is not None and len(train) == 3 and len(test) == 2

    def questions(ds: Any, n: int) -> list[str]:
        return [asyncio.run(b.make_envs())[0].problem.question for i in range(n) for b in get_batch(ds, i, "x")]

    tr, te = questions(train, 3), questions(test, 2)
    assert len(set(tr) | set(te)) == 10
    again, _ = build_datasets(cfg, ctx(groups_per_batch=2, seed=3))
    assert questions(again, 3) == tr
    other, _ = build_datasets(cfg, ctx(groups_per_batch=2, seed=4))
    assert questions(other, 3) != tr
    with pytest.raises(UserError, match="test_size 10 leaves no training problems"):
        build_datasets(Math(data=Jsonl(str(path)), test_size=10), ctx())
    with pytest.raises(UserError, match="fewer than groups_per_batch 8"):
        build_datasets(Math(data=Jsonl(str(path)), test_size=4), ctx(groups_per_batch=8))


def test_shipped_word_problems_load() -> None:
    ps = load_problems(Jsonl(str(ROOT / "examples/data/word_problems.jsonl")), None, None)
    assert len(ps) == 50 and all(p.answer.isdigit() for p in ps)


def test_math_rl_recipe_two_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    over = ["max_steps=2", "eval_every=1", f"log_dir={tmp_path / 'run'}", "algo.groups_per_batch=2",
            "algo.group_size=2", "algo.env.test_size=2"]  # fmt: skip
    name, r = load_recipe(f"{ROOT / 'recipes.toml'}#math_rl", over)
    run(r, name)
    ms = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in ms if "env/all/correct" in m]
    assert len(steps) == 2
    for m in steps:
        assert 0.0 <= m["env/all/correct"] <= 1.0 and 0.0 <= m["env/all/format"] <= 1.0
    assert any("test/env/all/correct" in m for m in ms)
    transcript = (tmp_path / "run" / "iteration_000000" / "train_rollout_summaries.jsonl").read_text().splitlines()
    logs = json.loads(transcript[0])["steps"][0]["logs"]
    assert set(logs) == {"question", "reference", "extracted", "reply"} and logs["reference"].isdigit()
    assert "What is" in logs["question"]
    assert "correct" in (tmp_path / "run" / "iteration_000000" / "train.html").read_text()
