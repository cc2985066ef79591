"""RL environments: rules and rewards, played by a scripted sampler over the embedded byte-level tokenizer.
Run: pytest tests/test_rl_envs.py"""

from __future__ import annotations

import asyncio
import re
import sys
import textwrap

import pytest

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from backends.types import SamplingParams
from runner.renderers.chat import ChatRenderer
from runner.rl.envs import EnvContext, build_datasets, get_batch
from runner.rl.envs.arithmetic import ArithmeticEnv
from runner.rl.envs.arithmetic_config import Arithmetic
from runner.rl.envs.guess_number import GuessNumberEnv
from runner.rl.envs.guess_number_config import GuessNumber
from runner.rl.envs.preference import round_robin, shorter_wins
from runner.rl.envs.preference_config import Preference
from runner.rl.envs.python_config import PythonEnv
from runner.rl.envs.tictactoe import OpponentEnv, optimal_move, winner
from runner.rl.envs.tictactoe_config import TicTacToe
from runner.rl.envs.twenty_questions import OBJECTS, TwentyQuestionsEnv
from runner.rl.envs.twenty_questions_config import TwentyQuestions
from runner.rl.rollouts import do_group_rollout, rollout_batch, run_episode
from runner.rl.testing import ScriptedSampler

TOK = build_tokenizer()
R = ChatRenderer(TOK)
PARAMS = SamplingParams(max_tokens=32)


def ctx(group_size: int = 2, groups_per_batch: int = 4, seed: int = 0) -> EnvContext:
    return EnvContext(
        renderer=R, group_size=group_size, test_group_size=1, groups_per_batch=groups_per_batch, seed=seed
    )


def play(env, policy, max_tokens: int = 32):
    sampler = ScriptedSampler(TOK, policy)
    params = SamplingParams(max_tokens=max_tokens)
    return asyncio.run(run_episode(env, sampler, params, seed=0, step=0, group=0, member=0)), sampler


def last_user(prompt: str) -> str:
    return prompt.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]


# ---------------------------------------------------------------- renderer


def test_renderer_prompt_stop_and_parse():
    ob = R.build_prompt([{"role": "user", "content": "hi"}])
    assert TOK.decode(ob) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert R.stop_tokens == [TOK.convert_tokens_to_ids("<|im_end|>")]
    ended = R.parse(TOK.encode("42", add_special_tokens=False) + R.stop_tokens)
    assert (ended.text, ended.ended_on_stop) == ("42", True)
    cut = R.parse(TOK.encode("42", add_special_tokens=False))
    assert (cut.text, cut.ended_on_stop) == ("42", False)


def test_renderer_caches_renderings_without_sharing_lists():
    class Counting:  # the tokenizer, counting template calls
        def __init__(self):
            self.calls = 0

        def __getattr__(self, name):
            return getattr(TOK, name)

        def apply_chat_template(self, *args, **kwargs):
            self.calls += 1
            return TOK.apply_chat_template(*args, **kwargs)

    tok = Counting()
    r = ChatRenderer(tok)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    a = r.render(msgs)
    a.tokens.append(0)  # a caller's list is its own
    b = r.render([dict(m) for m in msgs])
    assert tok.calls == 1 and b.tokens == R.build_prompt(msgs) and b.text == a.text
    assert r.render([{"role": "user", "content": "What is 2 + 4?"}]).tokens != b.tokens and tok.calls == 2
    parts = [{"role": "user", "content": ["unhashable", "parts"]}]  # rendered each time, not cached
    with pytest.raises(Exception):  # noqa: B017 - whatever the template makes of it, the cache is not the error
        r.render(parts)
    assert tok.calls == 3


def test_renderer_extend_reuses_sampled_tokens():
    msgs = [{"role": "user", "content": "hi"}]
    first = R.render(msgs)
    # Byte 0xFF alone is invalid UTF-8: it decodes to U+FFFD, which re-encodes to three other bytes.
    for action in ([104, 255, 105, *R.stop_tokens], [104, 255, 105]):  # ended on stop / cut by max_tokens
        reply = R.parse(action)
        convo = [*msgs, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "again"}]
        nxt = R.extend(first, action, reply, convo)
        assert nxt.tokens[: len(first.tokens) + len(action)] == first.tokens + action
        assert R.decode(nxt.tokens[len(first.tokens) + len(action) :]).endswith(
            "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
        )
        assert R.build_prompt(convo) != nxt.tokens  # a plain re-render would not have extended
    # A conversation that does not continue the previous one falls back to a full render.
    other = [{"role": "user", "content": "something else"}]
    assert R.extend(first, [104, *R.stop_tokens], R.parse([104, *R.stop_tokens]), other) == R.render(other)


# ---------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    "reply, max_tokens, reward, fmt, correct",
    [
        ("12", 32, 1.0, 1.0, 1.0),
        (" 12 ", 32, 1.0, 1.0, 1.0),
        ("12", 2, 0.9, 0.0, 1.0),  # right number, but cut off before the stop token
        ("13", 32, 0.0, 1.0, 0.0),
        ("twelve", 32, -0.1, 0.0, 0.0),
    ],
)
def test_arithmetic_reward(reply, max_tokens, reward, fmt, correct):
    traj, sampler = play(ArithmeticEnv(R, 5, 7), lambda p, s: reply, max_tokens)
    (tr,) = traj.transitions
    assert tr.reward == pytest.approx(reward)
    assert tr.metrics == {"format": fmt, "correct": correct}
    prompt = TOK.decode(sampler.calls[0][0])
    assert last_user(prompt) == "What is 5 + 7?"
    assert "What is 4 + 5?" in prompt  # the few-shot example


def test_arithmetic_dataset_split_and_determinism():
    cfg = Arithmetic(max_value=20, train_size=40, test_size=10)
    train, test = build_datasets(cfg, ctx(group_size=3, groups_per_batch=4, seed=5))
    again, _ = build_datasets(cfg, ctx(group_size=3, groups_per_batch=4, seed=5))
    assert len(train) == 10 and test is not None and len(test) == 3  # 10 test problems, 4 per batch, last partial
    assert train.items == again.items  # type: ignore[attr-defined]
    assert not set(train.items) & set(test.items)  # type: ignore[attr-defined]
    assert all(0 <= x <= 20 and 0 <= y <= 20 for x, y in train.items)  # type: ignore[attr-defined]
    builders = train.get_batch(0)
    assert len(builders) == 4
    envs = asyncio.run(builders[0].make_envs())
    assert len(envs) == 3 and builders[0].logging_tags() == ["arithmetic"]
    other, _ = build_datasets(cfg, ctx(seed=6))
    assert other.items != train.items  # type: ignore[attr-defined]


def test_dataset_size_errors():
    with pytest.raises(UserError, match="smaller than groups_per_batch"):
        build_datasets(Arithmetic(train_size=3), ctx(groups_per_batch=4))
    with pytest.raises(UserError, match="more than half"):
        build_datasets(Arithmetic(max_value=2, test_size=5), ctx())


# ---------------------------------------------------------------- guess_number


def bisect_policy(low: int, high: int):
    """Binary search driven only by the env's feedback in the prompt."""
    state = {"lo": low, "hi": high, "last": None}

    def policy(prompt: str, params: SamplingParams) -> str:
        fb = last_user(prompt)
        if fb == "higher":
            state["lo"] = state["last"] + 1
        elif fb == "lower":
            state["hi"] = state["last"] - 1
        state["last"] = (state["lo"] + state["hi"]) // 2
        return str(state["last"])

    return policy


def test_guess_number_feedback_and_reward():
    env = GuessNumberEnv(R, secret=37, low=0, high=99, max_turns=10)
    traj, sampler = play(env, bisect_policy(0, 99))
    feedback = [last_user(TOK.decode(p)) for p, _ in sampler.calls[1:]]
    guesses = [int(t.logs["guess"]) for t in traj.transitions[:-1]]
    assert guesses == [49, 24, 36, 42, 39, 37][:-1]
    assert feedback == ["lower", "higher", "higher", "lower", "lower"]
    last = traj.transitions[-1]
    assert last.episode_done and last.metrics == {"correct": 1.0, "format": 1.0, "guesses": 6.0}
    assert last.reward == pytest.approx(1 - 5 / 10)
    assert all(t.reward == 0.0 for t in traj.transitions[:-1])


def test_guess_number_bad_format_and_out_of_turns():
    traj, _ = play(GuessNumberEnv(R, 5, 0, 9, 3), lambda p, s: "maybe five?")
    (tr,) = traj.transitions
    assert tr.reward == -1.0 and tr.metrics["format"] == 0.0
    traj, _ = play(GuessNumberEnv(R, 5, 0, 9, 3), lambda p, s: "1")
    assert len(traj.transitions) == 3
    assert traj.transitions[-1].reward == 0.0 and traj.transitions[-1].metrics["correct"] == 0.0


def test_guess_number_dataset():
    train, test = build_datasets(GuessNumber(low=1, high=50, train_size=8, test_size=4), ctx(groups_per_batch=2))
    assert len(train) == 4 and test is not None
    assert all(1 <= s <= 50 for s in train.items)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- twenty_questions


def test_twenty_questions_answers_and_guess():
    script = iter(["Is it an animal?", "Can it fly?", "What colour is it?", "Guess: a parrot", "Guess: eagle"])
    traj, sampler = play(TwentyQuestionsEnv(R, "eagle", max_turns=20), lambda p, s: next(script))
    answers = [last_user(TOK.decode(p)) for p, _ in sampler.calls[1:]]
    assert answers[:2] == ["Yes.", "Yes."]
    assert answers[2] == "Ask about one attribute, or guess."
    assert answers[3] == "No, that's not it."
    last = traj.transitions[-1]
    assert last.reward == 1.0 and last.metrics["correct"] == 1.0 and last.metrics["turns"] == 5.0
    assert last.metrics["answered"] == pytest.approx(2 / 5)


def test_twenty_questions_turn_limit_and_no_answers():
    traj, sampler = play(TwentyQuestionsEnv(R, "car", max_turns=3), lambda p, s: "Does it live in water?")
    assert [t.reward for t in traj.transitions] == [0.0, 0.0, 0.0]
    assert traj.transitions[-1].metrics["correct"] == 0.0
    assert last_user(TOK.decode(sampler.calls[1][0])) == "No."
    assert all(len(attrs) == len(set(attrs)) for attrs in OBJECTS.values())


def test_twenty_questions_split_holds_out_objects():
    train, test = build_datasets(TwentyQuestions(train_size=40, test_size=4), ctx(groups_per_batch=4))
    assert test is not None and len(set(test.items)) == 4  # type: ignore[attr-defined]
    assert not set(train.items) & set(test.items)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- tictactoe


def board_of(prompt: str) -> str:
    """The board from the last user message (free cells shown as their numbers)."""
    rows = [line.split() for line in last_user(prompt).splitlines() if re.fullmatch(r"(\S ){2}\S", line)]
    cells = [c for row in rows[-3:] for c in row]
    return "".join(c if c in "XO" else " " for c in cells)


def lowest_free(prompt: str, params: SamplingParams) -> str:
    return str(board_of(prompt).index(" ") + 1)


def test_tictactoe_rules():
    assert winner("XXX      ") == "X"
    assert winner("O  O  O  ") == "O"
    assert winner("XOXXOOOXX") == "draw"
    assert winner("X        ") is None
    import random

    assert optimal_move("XX OO    ", "X", random.Random(0)) == 2  # take the win
    assert all(optimal_move("XX  O    ", "O", random.Random(s)) == 2 for s in range(5))  # block


def test_tictactoe_vs_opponent_win_illegal_and_draw():
    # Opponent (O) always takes the lowest free cell (1, 2, 4); X plays 5, 9, 3, 7 and completes 3-5-7.
    env = OpponentEnv(R, "X", "random", 0)
    env.pick = lambda board, seat, rng: board.index(" ")
    moves = iter(["5", "9", "3", "7"])
    traj, _ = play(env, lambda p, s: next(moves))
    assert [t.logs.get("move") for t in traj.transitions[:-1]] == [5, 9, 3]
    assert traj.transitions[-1].reward == 1.0 and traj.transitions[-1].metrics["win"] == 1.0

    env = OpponentEnv(R, "O", "optimal", 0)  # opponent X moves first, then "1"/occupied cells are illegal
    traj, _sampler = play(env, lambda p, s: str(board_of(p).index("X") + 1))
    (tr,) = traj.transitions
    assert tr.reward == -1.0 and tr.metrics["illegal"] == 1.0 and tr.metrics["loss"] == 1.0

    # Minimax against minimax always draws.
    import random

    env = OpponentEnv(R, "X", "optimal", 1)
    traj, _ = play(env, lambda p, s: str(optimal_move(board_of(p), "X", random.Random(0)) + 1))
    assert traj.transitions[-1].reward == 0.0 and traj.transitions[-1].metrics["draw"] == 1.0


def test_tictactoe_selfplay_group_rewards():
    train, _ = build_datasets(
        TicTacToe(opponent="self", train_size=4, test_size=2), ctx(group_size=4, groups_per_batch=2)
    )
    builder = train.get_batch(0)[0]
    # Both seats take the lowest free cell: X 1, O 2, X 3, O 4, X 5, O 6, X 7 -> X wins on 3-5-7.
    sampler = ScriptedSampler(TOK, lowest_free)
    group = asyncio.run(do_group_rollout(builder, sampler, PARAMS))
    assert len(group.trajectories_G) == 4
    assert group.final_rewards_G == [1.0, -1.0, 1.0, -1.0]  # [game0.X, game0.O, game1.X, game1.O]
    assert [len(t.transitions) for t in group.trajectories_G] == [4, 3, 4, 3]
    assert group.metrics_G[0]["win"] == 1.0 and group.metrics_G[1]["loss"] == 1.0
    assert all(r == 0.0 for t in group.trajectories_G for r in [tr.reward for tr in t.transitions])


def test_tictactoe_selfplay_illegal_moves():
    # O answers with an occupied cell: O loses. X opens with "0" (not a cell): X loses and O never plays.
    def policy(prompt: str, params: SamplingParams) -> str:
        board = board_of(prompt)
        return str(board.index("X") + 1) if "You are O" in prompt else "1"

    train, _ = build_datasets(
        TicTacToe(opponent="self", train_size=2, test_size=0), ctx(group_size=2, groups_per_batch=1)
    )
    group = asyncio.run(do_group_rollout(train.get_batch(0)[0], ScriptedSampler(TOK, policy), PARAMS))
    assert group.final_rewards_G == [1.0, -1.0] and group.metrics_G[1]["illegal"] == 1.0

    group = asyncio.run(do_group_rollout(train.get_batch(0)[0], ScriptedSampler(TOK, lambda p, s: "0"), PARAMS))
    assert group.final_rewards_G == [-1.0, 1.0]
    assert [len(t.transitions) for t in group.trajectories_G] == [1, 0]


def test_tictactoe_test_split_uses_opponent():
    _, test = build_datasets(TicTacToe(opponent="self", test_opponent="optimal", train_size=4, test_size=3), ctx())
    assert test is not None and len(test) == 1
    builders = test.get_batch(0)
    assert len(builders) == 3 and builders[0].logging_tags() == ["tictactoe", "optimal"]


# ---------------------------------------------------------------- preference


def test_round_robin_shorter_wins():
    assert round_robin("p", ["a", "bb", "ccc"], shorter_wins) == [1.0, 0.5, 0.0]
    assert round_robin("p", ["x", "y"], shorter_wins) == [0.5, 0.5]
    with pytest.raises(UserError, match="probability"):
        round_robin("p", ["a", "b"], lambda p, a, b: 2.0)
    # Not a number at all: the same one line (before: a TypeError / ValueError from float()).
    for bad in (None, "0.5", "abc", float("nan"), [0.5]):
        with pytest.raises(UserError, match=r"preference judge returned .*, expected a probability in \[0, 1\]"):
            round_robin("p", ["a", "b"], lambda p, a, b, bad=bad: bad)
    assert round_robin("p", ["a", "b"], lambda p, a, b: True) == [0.5, 0.5]


def test_preference_group_rollout():
    replies = iter(["hi", "hello there", "hey", "a very long answer indeed"])
    train, test = build_datasets(
        Preference(prompts=["Who are you?"], train_size=4), ctx(group_size=4, groups_per_batch=1)
    )
    assert test is None
    group = asyncio.run(
        do_group_rollout(train.get_batch(0)[0], ScriptedSampler(TOK, lambda p, s: next(replies)), PARAMS)
    )
    # "hi" beats all (1), "hey" beats two of three (2/3), "hello there" one (1/3), the long one none.
    assert group.final_rewards_G == pytest.approx([1.0, 1 / 3, 2 / 3, 0.0])
    assert group.metrics_G[0] == {"win_frac": 1.0, "format": 1.0}


def test_preference_format_penalty_and_custom_judge(tmp_path, monkeypatch):
    (tmp_path / "myjudge.py").write_text("def longer(prompt, a, b):\n    return float(len(a) > len(b))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = Preference(prompts=["Q"], train_size=1, judge="myjudge:longer", format_coef=0.5)
    train, _ = build_datasets(cfg, ctx(group_size=2, groups_per_batch=1))
    tokens = iter([TOK.encode("a long reply", add_special_tokens=False), "b"])  # the first is cut (no stop token)
    group = asyncio.run(
        do_group_rollout(train.get_batch(0)[0], ScriptedSampler(TOK, lambda p, s: next(tokens)), PARAMS)
    )
    assert group.final_rewards_G == pytest.approx([1.0 - 0.5, 0.0])


# ---------------------------------------------------------------- python targets

USER_ENV = textwrap.dedent("""
    from runner.rl.envs.arithmetic import ArithmeticEnv
    from runner.rl.envs.common import ListDataset, RepeatGroupBuilder

    def make(n_problems, offset=0):
        def builder(ctx):
            def group(i):
                return RepeatGroupBuilder(lambda: ArithmeticEnv(ctx.renderer, i + offset, 1), ctx.group_size, ["mine"])
            return ListDataset(range(n_problems), group, ctx.groups_per_batch), None
        return builder

    def not_a_builder(**kw):
        return 42

    def bad_pair():
        return lambda ctx: "nope"

    def raises(**kw):
        raise ValueError("no config file")

    def builder_raises():
        def builder(ctx):
            return {}["missing"]
        return builder

    def inner_type_error(n_problems):
        return len(n_problems)

    class BadDataset:
        def __init__(self, batch, length=3):
            self.batch, self.length = batch, length
        def get_batch(self, index):
            if isinstance(self.batch, Exception):
                raise self.batch
            return self.batch
        def __len__(self):
            return self.length

    def bad_dataset(batch=None, length=3):
        return lambda ctx: (BadDataset(batch, length), None)

    def with_empty_test():
        def builder(ctx):
            train, _ = make(8)(ctx)
            return train, ListDataset([], None, ctx.groups_per_batch, drop_last=False)
        return builder
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rl_envs.py").write_text(USER_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rl_envs"
    sys.modules.pop("my_rl_envs", None)


def test_python_env_target(user_module):
    train, test = build_datasets(PythonEnv(target=f"{user_module}:make", args={"n_problems": 8, "offset": 10}), ctx())
    assert test is None and len(train) == 2
    batch = asyncio.run(rollout_batch(train.get_batch(1), ScriptedSampler(TOK, lambda p, s: "15"), PARAMS))
    # Problems 4..7 are 14+1 .. 17+1: only the first is answered right by "15".
    rewards = [g.total_rewards_G() for g in batch.groups]
    assert rewards == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize(
    "target, args, message",
    [
        ("no_such_module_xyz:make", {}, "cannot import 'no_such_module_xyz:make'"),
        ("my_rl_envs:missing", {}, "has no attribute 'missing'"),
        ("my_rl_envs:make", {"wrong": 1}, "calling it with args"),
        ("my_rl_envs:not_a_builder", {}, "returned int, expected a dataset builder"),
        ("my_rl_envs:bad_pair", {}, "expected a \\(train, test\\) pair"),
        ("my_rl_envs:make", {"n_problems": 0}, "no batches"),
        ("my_rl_envs:make", {}, r"with args \[\] failed: missing a required argument: 'n_problems'"),
        ("my_rl_envs:raises", {"a": 1}, r"with args \['a'\] raised ValueError: no config file \(in raises, .*my_rl_envs.py:\d+\)"),
        ("my_rl_envs:builder_raises", {}, r"its dataset builder raised KeyError: 'missing' \(in builder, "),
        # A TypeError inside the function is its own, not "wrong args".
        ("my_rl_envs:inner_type_error", {"n_problems": 3}, r"raised TypeError: object of type 'int' has no len\(\)"),
    ],
)
def test_python_env_errors(user_module, target, args, message):
    with pytest.raises(UserError, match=message):
        build_datasets(PythonEnv(target=target, args=args), ctx())


@pytest.mark.parametrize(
    "batch, message",
    [
        (RuntimeError("boom"), r"BadDataset.get_batch\(1\) raised RuntimeError: boom \(in get_batch, .*my_rl_envs.py"),
        (None, r"BadDataset.get_batch\(1\) returned NoneType, expected a list of EnvGroupBuilders"),
        ([], r"BadDataset.get_batch\(1\) returned no group builders"),
        (["a"], r"BadDataset.get_batch\(1\) returned a str in its list, expected EnvGroupBuilders"),
    ],
)
def test_python_env_dataset_errors(user_module, batch, message):
    """A user dataset's get_batch is checked when the loop calls it: one line, not a traceback (or, for an empty
    batch, a step that silently trains on nothing)."""
    train, _ = build_datasets(PythonEnv(target=f"{user_module}:bad_dataset"), ctx())
    train.batch = batch
    with pytest.raises(UserError, match="the train dataset's " + message):
        get_batch(train, 1, "train")


def test_python_env_empty_test_set_is_none(user_module):
    """Evals of an empty test set would log test/env/all/reward/total = 0 from zero episodes."""
    train, test = build_datasets(PythonEnv(target=f"{user_module}:with_empty_test"), ctx())
    assert len(train) == 2 and test is None


def test_python_env_dataset_len_error(user_module):
    with pytest.raises(UserError, match=r"len\(\) of the train dataset failed: TypeError: 'str' object cannot be "):
        build_datasets(PythonEnv(target=f"{user_module}:bad_dataset", args={"length": "3"}), ctx())
