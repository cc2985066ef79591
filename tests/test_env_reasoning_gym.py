"""The `reasoning_gym` env (runner/rl/envs/reasoning_gym.py) over the reasoning-gym library (the `reasoning` extra;
skipped without it): splits, prompts, few-shot examples, several tasks, the library's scorer as the reward, one-line
errors, and the shipped recipe smoked."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

rg = pytest.importorskip("reasoning_gym")
pytestmark = pytest.mark.extras("reasoning")

from backends.errors import UserError  # noqa: E402
from backends.local.tiny import build_tokenizer  # noqa: E402
from backends.types import SamplingParams  # noqa: E402
from runner.renderers.chat import ChatRenderer  # noqa: E402
from runner.rl.envs import EnvContext, build_datasets  # noqa: E402
from runner.rl.envs.reasoning_gym_config import ReasoningGym  # noqa: E402
from runner.rl.rollouts import run_episode  # noqa: E402
from runner.rl.testing import ScriptedSampler  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOK = build_tokenizer()
R = ChatRenderer(TOK)
SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False}


def ctx(seed: int = 0) -> EnvContext:
    return EnvContext(renderer=R, group_size=2, test_group_size=1, groups_per_batch=4, seed=seed)


def env_cfg(**kw: Any) -> ReasoningGym:
    return ReasoningGym(**{"tasks": ["basic_arithmetic"], "config": SUMS, "train_size": 16, "test_size": 4, **kw})


def episodes(ds: Any, policy: Any) -> list[tuple[str, Any]]:
    """Every env of every group of the dataset's first batch, played by `policy(prompt text) -> reply`: (prompt
    text, trajectory)."""
    out = []
    for builder in ds.get_batch(0):
        for env in asyncio.run(builder.make_envs()):
            sampler = ScriptedSampler(TOK, lambda p, s: policy(p))
            traj = asyncio.run(run_episode(env, sampler, SamplingParams(max_tokens=64), seed=0, step=0, group=0,
                                           member=0))
            out.append((TOK.decode(sampler.calls[0][0]), traj))
    return out


def _sum_of(prompt: str) -> str:
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1]
    return str(int(a) + int(b))


def test_the_library_scorer_is_the_reward_and_the_prompt_is_formatted() -> None:
    train, test = build_datasets(env_cfg(prompt="What is {expression}?", few_shot=1), ctx())
    assert len(train) == 4 and test is not None and len(test) == 1
    right = episodes(train, _sum_of)
    for prompt, traj in right:
        # one solved example from the generator (held out), then the question in the asked phrasing
        assert prompt.count("What is ") == 2 and "Calculate" not in prompt
        assert traj.transitions[-1].reward == 1.0 and traj.transitions[-1].metrics["correct"] == 1.0
    wrong = episodes(train, lambda p: "no idea")
    assert all(t.transitions[-1].reward == 0.0 and t.transitions[-1].metrics["score"] == 0.0 for _, t in wrong)
    # the library's partial credit (len(answer) / len(reply) for a reply that contains the answer) passes through
    for prompt, t in episodes(train, lambda p: "x" + _sum_of(p)):
        n = len(_sum_of(prompt))
        assert t.transitions[-1].reward == pytest.approx(n / (n + 1)) and t.transitions[-1].metrics["correct"] == 0
    # a reply cut by max_tokens (no stop token) pays the format term
    cut = episodes(train, lambda p: [*TOK.encode(_sum_of(p) + " " * 70)])
    assert all(t.transitions[-1].reward == pytest.approx(0.9) and t.transitions[-1].metrics["format"] == 0 for _, t in cut)


def test_splits_are_disjoint_and_seeded() -> None:
    def questions(ds: Any, n: int) -> list[str]:
        return [b.make_env().messages[-1]["content"] for i in range(n) for b in ds.get_batch(i)]

    cfg = ReasoningGym(tasks=["basic_arithmetic"], config={**SUMS, "max_digits": 2, "min_digits": 2},
                       train_size=40, test_size=8)
    train, test = build_datasets(cfg, ctx(seed=3))
    assert test is not None
    tr, te = questions(train, len(train)), questions(test, len(test))
    assert len(tr) == 40 and len(te) == 8 and not set(tr) & set(te)
    again, _ = build_datasets(cfg, ctx(seed=3))
    assert questions(again, len(again)) == tr
    other, _ = build_datasets(cfg, ctx(seed=4))
    assert questions(other, len(other)) != tr
    pinned, _ = build_datasets(ReasoningGym(tasks=["basic_arithmetic"], config=cfg.config, train_size=40,
                                            test_size=8, seed=3), ctx(seed=99))
    assert questions(pinned, len(pinned)) == tr  # the env's own seed wins over the recipe's


def test_several_tasks_answer_tags_and_system_prompt() -> None:
    cfg = ReasoningGym(tasks=["basic_arithmetic", "spell_backward"],
                       config={"basic_arithmetic": SUMS, "spell_backward": {"min_word_len": 3, "max_word_len": 4}},
                       train_size=16, test_size=2, answer_tag=True, system_prompt="default")
    train, test = build_datasets(cfg, ctx())
    assert test is not None and len(test) == 1  # 2 per task
    tags = {b.logging_tags()[0] for i in range(len(train)) for b in train.get_batch(i)}
    assert tags == {"basic_arithmetic", "spell_backward"}

    def solve(prompt: str) -> str:
        q = prompt.rsplit("<|im_start|>user\n", 1)[1]
        if "backward" in q:
            word = q.split(":")[-1].split("<|im_end|>")[0].strip()
            return f"reversing... <answer>{word[::-1]}</answer>"
        a, b = re.findall(r"(\d+) \+ (\d+)", q)[-1]
        return f"<answer>{int(a) + int(b)}</answer>"

    played = episodes(train, solve)
    assert all("<answer>answer here</answer>" in p for p, _ in played)  # reasoning-gym's default system prompt
    assert all(t.transitions[-1].reward == 1.0 for _, t in played)
    untagged = episodes(train, lambda p: solve(p).split("<answer>")[-1].split("</answer>")[0])
    assert all(t.transitions[-1].metrics["format"] == 0.0 for _, t in untagged)


@pytest.mark.parametrize(("kw", "says"), [
    ({"tasks": ["basic_arithmetc"]}, "did you mean basic_arithmetic"),
    ({"config": {"bogus": 1}}, "unexpected keyword argument 'bogus'"),
    ({"config": {"min_terms": 0}}, "min_terms must be positive"),
    ({"prompt": "What is {nope}?"}, "names ['nope']"),
    ({"tasks": ["basic_arithmetic", "spell_backward"], "config": {"chain_sum": {}}}, "not among tasks"),
    ({"train_size": 2}, "smaller than groups_per_batch"),
])
def test_bad_settings_are_one_line_errors(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(UserError) as e:
        build_datasets(env_cfg(**kw), ctx())
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_recipe_smokes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUNNER_SMOKE_CACHE", str(tmp_path / "models"))
    assert main(["smoke", str(REPO / "examples" / "rl_reasoning_gym.toml")]) == 0
