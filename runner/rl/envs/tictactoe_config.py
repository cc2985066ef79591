"""The `tictactoe` env's recipe table (`algo.env = {kind = "tictactoe", ...}`), implemented by runner/rl/envs/tictactoe.py."""

from __future__ import annotations

from typing import Literal

from runner.recipe.common import EnvBase


class TicTacToe(EnvBase, tag="tictactoe"):
    """Reply with a cell 1-9. "self": both seats are the policy (group_size/2 games per group); otherwise the
    policy plays a random seat against a fixed opponent. win 1, draw 0, loss −1; an illegal move loses."""

    opponent: Literal["self", "random", "optimal"] = "self"
    test_opponent: Literal["random", "optimal"] = "random"
