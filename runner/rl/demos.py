"""Demonstrations: a built-in env's scripted expert plays its training problems, and each finished episode's
conversation becomes an SFT row. A short SFT on them is the warm start the cookbook uses before RL on a format the
base model never produces (an RL recipe chains it with `init_from`):

    [recipes.guess_number_warmup.algo]
    kind = "sft"
    data = {kind = "python", target = "runner.rl.demos:demonstrations",
            args = {env = {kind = "guess_number", low = 0, high = 15, max_turns = 6}, n = 256}}

The env runs exactly as under RL (same prompts, same feedback, same conversation), only the replies come from the
expert: binary search (guess_number), minimax (tictactoe), the question that best splits the remaining candidates
(twenty_questions), a reply drawn from a pool of good answers of mixed length (preference: RL then learns which the
judge prefers). `epsilon` replaces that share of the expert's replies by a random legal one, so the demonstrations
show imperfect play too and RL has something to improve. Seeded: the same args give the same rows.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable

from backends.errors import UserError
from backends.types import Json
from runner.recipe.envs import Env
from runner.renderers.chat import ChatRenderer
from runner.rl.envs import build_datasets, get_batch
from runner.rl.envs import tictactoe as ttt
from runner.rl.envs import twenty_questions as tq
from runner.rl.envs.common import ChatEnv, EnvContext
from runner.rl.envs.guess_number_config import GuessNumber
from runner.rl.envs.preference_config import Preference
from runner.rl.envs.tictactoe_config import TicTacToe
from runner.rl.envs.twenty_questions_config import TwentyQuestions

Expert = Callable[[ChatEnv, random.Random], str]

# Preference demos: answers of mixed length per prompt (the default judge prefers the shorter reply).
ANSWERS: dict[str, list[str]] = {
    "Who are you?": ["I am Pip.", "I am Pip, a helper.", "I am Pip, a friendly helper who likes to chat."],
    "Say something nice.": ["You are kind.", "You are kind and clever.", "You are kind, clever and fun to talk to."],
    "What is 2 + 2?": ["4", "2 + 2 is 4.", "Two plus two makes four, of course."],
    "Name a colour.": ["Red.", "Blue is a colour.", "Green, like the leaves on a tree."],
    "Tell me a fact.": ["Fish swim.", "A vexle has 2 legs.", "The sea is big and full of fish and waves."],
}
GENERIC = ["Yes.", "I can help.", "I am happy to help you with that today."]


def demonstrations(env: Json, n: int = 256, seed: int = 0, epsilon: float = 0.0) -> list[Json]:
    """`n` SFT rows {"messages": [...]}: the expert's episodes on the env's training problems (from the start of
    its training split, cycling). `env` is the RL recipe's env table."""
    from runner.recipe.explain import convert

    cfg = convert(env, Env, "demonstrations: env")  # type: ignore[arg-type]
    expert = _expert(cfg)
    if not 0.0 <= epsilon <= 1.0:
        raise UserError(f"demonstrations: epsilon {epsilon} is not in [0, 1]")
    from backends.tokenizer import load_tokenizer

    # The conversation is text; any chat tokenizer renders the env's prompts (the SFT stage re-renders the rows
    # with the recipe's own tokenizer).
    renderer = ChatRenderer(load_tokenizer("tiny"))
    group = 2 if isinstance(cfg, TicTacToe) and cfg.opponent == "self" else 1
    train, _ = build_datasets(cfg, EnvContext(renderer, group, 1, 1, seed))
    rng = random.Random(seed)
    rows: list[Json] = []
    i = 0
    while len(rows) < n:
        builders = get_batch(train, i % len(train), "train")
        i += 1
        for builder in builders:
            envs = asyncio.run(builder.make_envs())
            episodes = asyncio.run(_play(list(envs), expert, epsilon, rng))  # type: ignore[arg-type]
            rows += [{"messages": m} for m in episodes if m]
    return rows[:n]


async def _play(envs: list[ChatEnv], expert: Expert, epsilon: float, rng: random.Random) -> list[list[dict[str, str]]]:
    async def one(env: ChatEnv) -> list[dict[str, str]]:
        if await env.initial_observation() is None:
            return []
        while True:
            text = _random_reply(env, rng) if rng.random() < epsilon else expert(env, rng)
            tokens = env.renderer.tokenizer.encode(text, add_special_tokens=False) + [env.renderer.stop_tokens[0]]
            result = await env.step(tokens, "stop")
            if result.episode_done:
                return list(env.messages)

    return list(await asyncio.gather(*(one(e) for e in envs)))  # self-play seats wait for each other


def _expert(cfg: Env) -> Expert:
    match cfg:
        case GuessNumber():
            return _binary_search
        case TicTacToe():
            return _minimax
        case TwentyQuestions():
            return _best_question
        case Preference():
            return _answer
    raise UserError(f"demonstrations: no scripted expert for env kind {type(cfg).__struct_config__.tag!r}; "
                    "choose guess_number, tictactoe, twenty_questions or preference")


# ---------------------------------------------------------------- experts


def _binary_search(env: ChatEnv, rng: random.Random) -> str:
    low, high = map(int, re.findall(r"from (-?\d+) to (-?\d+)", env.messages[0]["content"])[0])
    last: int | None = None
    for m in env.messages[1:]:
        if m["role"] == "assistant":
            last = int(m["content"]) if m["content"].strip().lstrip("-").isdigit() else None
        elif last is not None and m["content"] == "higher":
            low = max(low, last + 1)
        elif last is not None and m["content"] == "lower":
            high = min(high, last - 1)
    return str((low + high) // 2)


def _board_and_seat(env: ChatEnv) -> tuple[str, str]:
    if isinstance(env, ttt.SelfPlayEnv):
        return env.game.board, env.seat
    assert isinstance(env, ttt.OpponentEnv)
    return env.board, env.seat


def _minimax(env: ChatEnv, rng: random.Random) -> str:
    board, seat = _board_and_seat(env)
    return str(ttt.optimal_move(board, seat, rng) + 1)


def _candidates(env: ChatEnv) -> tuple[list[str], set[str]]:
    """Objects consistent with the answers so far, and the attributes already asked."""
    names, asked = list(tq.OBJECTS), set()
    messages = env.messages[1:]
    for question, reply in zip(messages[::2], messages[1::2], strict=False):
        words = set(re.findall(r"[a-z]+", question["content"].lower()))
        attrs = [a for a, (_, keys) in tq.ATTRIBUTES.items() if words & set(keys)]
        if len(attrs) == 1 and reply["content"] in ("Yes.", "No."):
            asked.add(attrs[0])
            yes = reply["content"] == "Yes."
            names = [o for o in names if (attrs[0] in tq.OBJECTS[o]) == yes]
        elif question["content"].startswith("Guess: "):
            names = [o for o in names if o != question["content"][len("Guess: "):]]
    return names, asked


def _best_question(env: ChatEnv, rng: random.Random) -> str:
    names, asked = _candidates(env)
    if len(names) <= 1:
        return f"Guess: {names[0] if names else rng.choice(list(tq.OBJECTS))}"
    # The attribute whose yes/no split of the candidates is the most even.
    def balance(attr: str) -> int:
        yes = sum(attr in tq.OBJECTS[o] for o in names)
        return abs(2 * yes - len(names))

    attr = min((a for a in tq.ATTRIBUTES if a not in asked), key=lambda a: (balance(a), a))
    return _question(attr)


def _question(attr: str) -> str:
    label = tq.ATTRIBUTES[attr][0]
    return label[0].upper() + label[1:] + "?"


def _answer(env: ChatEnv, rng: random.Random) -> str:
    prompt = env.messages[-1]["content"]
    return rng.choice(ANSWERS.get(prompt, GENERIC))


def _random_reply(env: ChatEnv, rng: random.Random) -> str:
    """A plausible but uninformed reply in the env's format (epsilon exploration in the demonstrations)."""
    if isinstance(env, ttt.SelfPlayEnv | ttt.OpponentEnv):
        board, _ = _board_and_seat(env)
        return str(rng.choice([c for c in range(9) if board[c] == " "]) + 1)
    if isinstance(env, tq.TwentyQuestionsEnv):
        if rng.random() < 0.5:
            return f"Guess: {rng.choice(list(tq.OBJECTS))}"
        return _question(rng.choice(list(tq.ATTRIBUTES)))
    first = env.messages[0]["content"]
    if (m := re.findall(r"from (-?\d+) to (-?\d+)", first)):
        low, high = map(int, m[0])
        return str(rng.randint(low, high))
    return _answer(env, rng)
