"""`tictactoe`: the policy names a free cell 1-9. Two ways to play:

- self-play (multi-agent): both seats are the policy. A group holds group_size/2 games; each game is two
  envs (X, O) sharing one `Game`, and each seat's episode waits while the other seat moves. The outcome is
  paid by `compute_group_rewards` (win 1, draw 0, loss −1; an illegal move loses), so it is zero-sum and the
  group-mean baseline is 0. O gets no turn at all if X's first move is illegal (an empty trajectory).
- against a fixed opponent (`random` or `optimal` minimax) in a seat drawn per problem; step rewards.

The cookbook plays TextArena's TicTacToe; this is the same game without the dependency."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Sequence
from typing import Literal

from runner.renderers.chat import ChatRenderer
from runner.rl.envs.arithmetic import INTEGER
from runner.rl.envs.common import (
    ChatEnv,
    EnvContext,
    EnvKind,
    RepeatGroupBuilder,
    check_train_size,
    group_datasets,
    split_problems,
)
from runner.rl.envs.tictactoe_config import TicTacToe
from runner.rl.types import Env, EnvGroupBuilder, Metrics, Observation, RLDataset, StepResult, StopCondition, Trajectory

Seat = Literal["X", "O"]
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def other(seat: str) -> Seat:
    return "O" if seat == "X" else "X"


def winner(board: str) -> str | None:
    """'X' or 'O' for three in a row, 'draw' for a full board, None while the game goes on."""
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return "draw" if " " not in board else None


def show(board: str) -> str:
    cells = [board[i] if board[i] != " " else str(i + 1) for i in range(9)]
    return "\n".join(" ".join(cells[r * 3 : r * 3 + 3]) for r in range(3))


def parse_move(text: str, board: str) -> int | None:
    """The 0-based cell of a legal move, or None."""
    text = text.strip()
    if INTEGER.fullmatch(text) is None:
        return None
    cell = int(text) - 1
    return cell if 0 <= cell < 9 and board[cell] == " " else None


def place(board: str, cell: int, seat: str) -> str:
    return board[:cell] + seat + board[cell + 1 :]


@functools.cache
def _value(board: str, to_move: str) -> int:
    """Minimax value for the player to move: 1 win, 0 draw, −1 loss."""
    w = winner(board)
    if w is not None:
        return 0 if w == "draw" else (1 if w == to_move else -1)
    return max(-_value(place(board, c, to_move), other(to_move)) for c in range(9) if board[c] == " ")


def optimal_move(board: str, seat: str, rng: random.Random) -> int:
    """A best cell by minimax; ties broken by rng so the optimal opponent is not one fixed line of play."""
    free = [c for c in range(9) if board[c] == " "]
    scores = {c: -_value(place(board, c, seat), other(seat)) for c in free}
    best = max(scores.values())
    return rng.choice([c for c in free if scores[c] == best])


def random_move(board: str, seat: str, rng: random.Random) -> int:
    return rng.choice([c for c in range(9) if board[c] == " "])


def rules(seat: str) -> str:
    return f"Let's play tic-tac-toe. You are {seat}; X moves first. Reply with the number of a free cell."


def outcome_metrics(result: str, seat: str, illegal_by: str | None) -> Metrics:
    return {
        "win": float(result == seat),
        "loss": float(result == other(seat)),
        "draw": float(result == "draw"),
        "illegal": float(illegal_by == seat),
    }


# ---------------------------------------------------------------- against a fixed opponent


class OpponentEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, seat: Seat, opponent: str, opponent_seed: int):
        super().__init__(renderer, [])
        self.seat = seat
        self.pick = optimal_move if opponent == "optimal" else random_move
        self.rng = random.Random(opponent_seed)
        self.board = " " * 9

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        text = rules(self.seat)
        if self.seat == "O":
            cell = self._opponent_moves()
            text += f"\nI played {cell + 1}."
        self.say(f"{text}\n{show(self.board)}")
        return self.observe()

    def _opponent_moves(self) -> int:
        cell = self.pick(self.board, other(self.seat), self.rng)
        self.board = place(self.board, cell, other(self.seat))
        return cell

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        cell = parse_move(reply.text, self.board)
        if cell is None:
            return self._end(other(self.seat), illegal_by=self.seat)
        self.board = place(self.board, cell, self.seat)
        if (result := winner(self.board)) is not None:
            return self._end(result)
        reply_cell = self._opponent_moves()
        if (result := winner(self.board)) is not None:
            return self._end(result)
        self.say(f"I played {reply_cell + 1}.\n{show(self.board)}")
        ob, stop = self.observe()
        return StepResult(0.0, False, ob, stop, logs={"move": cell + 1, "opponent": reply_cell + 1})

    def _end(self, result: str, illegal_by: str | None = None) -> StepResult:
        reward = 1.0 if result == self.seat else -1.0 if result == other(self.seat) else 0.0
        return StepResult(
            reward, True, metrics=outcome_metrics(result, self.seat, illegal_by), logs={"board": show(self.board)}
        )


# ---------------------------------------------------------------- self-play


class Game:
    """The board both seats of one self-play game share; a seat's coroutine waits on `changed` for its turn."""

    def __init__(self) -> None:
        self.board = " " * 9
        self.turn: Seat = "X"
        self.result: str | None = None
        self.illegal_by: str | None = None
        self.last_move: int | None = None
        self.changed = asyncio.Condition()

    async def wait_turn(self, seat: str) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.result is not None or self.turn == seat)

    async def play(self, seat: Seat, cell: int | None) -> None:
        async with self.changed:
            if cell is None:
                self.result, self.illegal_by = other(seat), seat
            else:
                self.board = place(self.board, cell, seat)
                self.last_move = cell
                self.result = winner(self.board)
                self.turn = other(seat)
            self.changed.notify_all()


class SelfPlayEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, game: Game, seat: Seat):
        super().__init__(renderer, [])
        self.game = game
        self.seat: Seat = seat

    async def initial_observation(self) -> tuple[Observation, StopCondition] | None:
        await self.game.wait_turn(self.seat)
        if self.game.result is not None:
            return None  # X lost on an illegal first move: O never plays
        text = rules(self.seat)
        if self.game.last_move is not None:
            text += f"\nI played {self.game.last_move + 1}."
        self.say(f"{text}\n{show(self.game.board)}")
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        cell = parse_move(reply.text, self.game.board)
        await self.game.play(self.seat, cell)
        await self.game.wait_turn(self.seat)
        if self.game.result is not None:
            return StepResult(0.0, True, logs={"board": show(self.game.board)})
        self.say(f"I played {self.game.last_move + 1}.\n{show(self.game.board)}")  # type: ignore[operator]
        ob, stop = self.observe()
        return StepResult(0.0, False, ob, stop, logs={"move": "illegal" if cell is None else cell + 1})


class SelfPlayGroupBuilder(EnvGroupBuilder):
    """group_size/2 games, envs ordered [game0.X, game0.O, game1.X, ...]."""

    def __init__(self, renderer: ChatRenderer, group_size: int):
        self.renderer, self.group_size = renderer, group_size

    async def make_envs(self) -> Sequence[Env]:
        envs: list[Env] = []
        for _ in range(self.group_size // 2):
            game = Game()
            envs += [SelfPlayEnv(self.renderer, game, "X"), SelfPlayEnv(self.renderer, game, "O")]
        return envs

    async def compute_group_rewards(
        self, trajectories_G: list[Trajectory], envs_G: Sequence[Env]
    ) -> list[tuple[float, Metrics]]:
        out = []
        for env in envs_G:
            assert isinstance(env, SelfPlayEnv)
            result, seat = env.game.result, env.seat
            assert result is not None, "self-play episode ended before its game did"
            reward = 1.0 if result == seat else -1.0 if result == other(seat) else 0.0
            out.append((reward, outcome_metrics(result, seat, env.game.illegal_by)))
        return out

    def logging_tags(self) -> list[str]:
        return ["tictactoe", "selfplay"]


# ---------------------------------------------------------------- datasets


def build(cfg: TicTacToe, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    check_train_size(cfg.train_size, ctx.groups_per_batch, "tictactoe")
    # A problem is (seat, opponent seed); self-play ignores it but keeps the same dataset length.
    train, test = split_problems(
        ctx.seed,
        lambda rng: (rng.choice("XO"), rng.randrange(2**31)),
        cfg.train_size,
        cfg.test_size,
        2**32,
        "tictactoe",
    )

    def vs(opponent: str, item: object, group_size: int) -> EnvGroupBuilder:
        seat, opp_seed = item  # type: ignore[misc]
        env = functools.partial(OpponentEnv, ctx.renderer, seat, opponent, opp_seed)
        return RepeatGroupBuilder(env, group_size, ["tictactoe", opponent])

    def make_train(item: object, group_size: int) -> EnvGroupBuilder:
        if cfg.opponent == "self":
            return SelfPlayGroupBuilder(ctx.renderer, group_size)
        return vs(cfg.opponent, item, group_size)

    return group_datasets(train, test, ctx, make_train, "tictactoe",
                          make_test=functools.partial(vs, cfg.test_opponent))


ENV = EnvKind(build, [("env/all/illegal", "illegal"), ("env/all/turns_per_episode", "turns")])
