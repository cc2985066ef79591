"""The scripted experts behind RL warm starts (runner/rl/demos.py): they play their env well, through the env's own
feedback, and the rows are SFT conversations."""

from __future__ import annotations

import asyncio
import random

import pytest

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from runner.renderers.chat import ChatRenderer
from runner.renderers.chat_template import render
from runner.rl.demos import demonstrations
from runner.rl.envs import twenty_questions as tq


def test_guess_number_expert_searches_by_feedback() -> None:
    rows = demonstrations({"kind": "guess_number", "low": 0, "high": 15, "max_turns": 6, "test_size": 4}, n=40)
    assert len(rows) == 40
    for row in rows:
        guesses = [int(m["content"]) for m in row["messages"] if m["role"] == "assistant"]
        feedback = [m["content"] for m in row["messages"][2::2]]
        assert len(guesses) <= 5  # binary search over 16 numbers: at most ceil(log2(17))
        assert set(feedback) <= {"higher", "lower"} and len(feedback) == len(guesses) - 1  # the last one is right
        assert guesses[0] == 7


def test_guess_number_epsilon_shows_mistakes_and_is_seeded() -> None:
    env = {"kind": "guess_number", "low": 0, "high": 15, "max_turns": 6, "test_size": 4}
    noisy = demonstrations(env, n=64, seed=1, epsilon=0.5)
    assert noisy == demonstrations(env, n=64, seed=1, epsilon=0.5)
    assert noisy != demonstrations(env, n=64, seed=2, epsilon=0.5)
    assert max(sum(m["role"] == "assistant" for m in r["messages"]) for r in noisy) > 5


def test_tictactoe_minimax_self_play_always_draws() -> None:
    rows = demonstrations({"kind": "tictactoe", "opponent": "self"}, n=20)
    boards = [r["messages"][-2]["content"] for r in rows if len(r["messages"]) >= 2]
    assert len(rows) == 20 and boards
    # Both seats of each game are in the rows; every move is a legal cell.
    for row in rows:
        assert all(m["content"] in list("123456789") for m in row["messages"] if m["role"] == "assistant")


def test_twenty_questions_expert_finds_every_object() -> None:
    renderer = ChatRenderer(build_tokenizer())
    from runner.rl.demos import _best_question

    for obj in tq.OBJECTS:
        env = tq.TwentyQuestionsEnv(renderer, obj, max_turns=8)

        async def play() -> float:
            await env.initial_observation()
            while True:
                text = _best_question(env, random.Random(0))
                tokens = renderer.tokenizer.encode(text, add_special_tokens=False) + [renderer.stop_tokens[0]]
                result = await env.step(tokens, "stop")
                if result.episode_done:
                    return result.reward

        assert asyncio.run(play()) == 1.0, obj


def test_rows_render_as_sft_conversations() -> None:
    tok = build_tokenizer()
    for env in ({"kind": "preference", "prompts": ["Who are you?"]},
                {"kind": "twenty_questions", "max_turns": 8},
                {"kind": "tictactoe", "opponent": "random", "test_size": 4}):
        for row in demonstrations(env, n=3):
            tokens, weights = render(tok, row["messages"], "all_assistant_messages")
            assert 0 < sum(weights) < len(tokens)


def test_bad_demonstration_args() -> None:
    with pytest.raises(UserError, match="no scripted expert for env kind 'arithmetic'"):
        demonstrations({"kind": "arithmetic"}, n=1)
    with pytest.raises(UserError, match="epsilon"):
        demonstrations({"kind": "guess_number", "test_size": 4}, n=1, epsilon=2.0)
    with pytest.raises(UserError, match="demonstrations: env: lo: unknown key; did you mean `low`"):
        demonstrations({"kind": "guess_number", "lo": 1}, n=1)


