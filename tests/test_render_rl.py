"""`runner render` of RL recipes: the env's first prompts as the trainer's groups build them, tictactoe self-play
included (its groups hold group_size/2 games; built at a size of 1 they held none and render raised IndexError),
and a one-line error (exit 2) when nothing at all is there to show."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from backends.tokenizer import load_tokenizer
from runner.cli import main
from runner.rl.envs import tictactoe
from runner.rl.types import Env

SELF_PLAY = ('[recipes.t]\nalgo = {kind = "rl", env = {kind = "tictactoe", opponent = "self", test_size = 2}, '
             'group_size = 2, groups_per_batch = 2, max_tokens = 4}\n')


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.toml").write_text(SELF_PLAY)
    return tmp_path


def test_render_shows_tictactoe_self_play_prompts(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "r.toml#t", "--n", "3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["where"] for r in rows] == ["env tictactoe batch 0 group 0", "env tictactoe batch 0 group 1",
                                          "env tictactoe batch 1 group 0"]
    text = load_tokenizer("tiny").decode(rows[0]["tokens"])
    # The X seat moves first on an empty board: the rules and the numbered board, nothing trained.
    assert "You are X" in text and "1 2 3\n4 5 6\n7 8 9" in text
    assert all(r["weights"] == [0.0] * len(r["tokens"]) for r in rows)


def test_render_with_nothing_to_show_is_one_line(proj: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_envs(self: object) -> Sequence[Env]:
        return []

    monkeypatch.setattr(tictactoe.SelfPlayGroupBuilder, "make_envs", no_envs)
    assert main(["render", "r.toml#t", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # Prefixed FILE#name: as `run`'s errors are (#39).
    assert captured.err == ("error: r.toml#t: runner render: nothing to show (its data or env gave no rows or "
                            "prompts)\n")
    assert len(captured.err.strip().splitlines()) == 1
