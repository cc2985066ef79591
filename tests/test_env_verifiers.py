"""The `verifiers` env (runner/rl/envs/verifiers_env.py) over the tests' own verifiers environments
(tests/verifiers_envs.py): a single-turn one with a rubric and a multi-turn one with a tool, rolled out through
runner's rollout loop and sampler by the in-process OpenAI client, scored by their rubrics; a recipe trains
through `runner run` and smokes. Skipped without the verifiers package."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers")
pytestmark = pytest.mark.extras("verifiers")

from backends.errors import UserError  # noqa: E402
from backends.local.tiny import build_tokenizer  # noqa: E402
from backends.types import SamplingParams  # noqa: E402
from runner.renderers.chat import ChatRenderer  # noqa: E402
from runner.rl.envs import EnvContext, build_datasets  # noqa: E402
from runner.rl.envs.verifiers_env_config import Verifiers  # noqa: E402
from runner.rl.rollouts import do_group_rollout  # noqa: E402
from runner.rl.testing import ScriptedSampler  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOK = build_tokenizer()
R = ChatRenderer(TOK)
MODULE = "tests.verifiers_envs"


def ctx() -> EnvContext:
    return EnvContext(renderer=R, group_size=2, test_group_size=1, groups_per_batch=2, seed=0)


def group(ds: Any, policy: Any) -> tuple[Any, ScriptedSampler]:
    sampler = ScriptedSampler(TOK, lambda p, s: policy(p))
    out = asyncio.run(do_group_rollout(ds.get_batch(0)[0], sampler, SamplingParams(max_tokens=96)))
    return out, sampler


def _question(prompt: str) -> tuple[int, int]:
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1]
    return int(a), int(b)


def test_single_turn_rubric_is_the_reward_and_its_metrics_are_logged() -> None:
    train, test = build_datasets(Verifiers(module=MODULE, args={"kind": "sums"}, train_size=8, test_size=4), ctx())
    assert len(train) == 4 and test is not None and len(test) == 2  # the env's own eval dataset, 4 rows of it
    right, sampler = group(train, lambda p: str(sum(_question(p))))
    assert right.total_rewards_G() == [1.0, 1.0]
    assert sampler.num_samples == [2]  # the group's first turns, one request (the rollout loop's grouping)
    prompt = TOK.decode(sampler.calls[0][0])
    assert prompt.startswith("<|im_start|>user\nWhat is ") and prompt.endswith("<|im_start|>assistant\n")
    m = right.metrics_G[0]
    assert m["exact"] == 1.0 and m["reply_chars"] == len(str(sum(_question(prompt)))) and m["vf_error"] == 0.0
    assert right.trajectories_G[0].transitions[0].episode_done
    wrong, _ = group(train, lambda p: "no")
    assert wrong.total_rewards_G() == [0.0, 0.0] and wrong.metrics_G[0]["exact"] == 0.0


def test_multi_turn_tool_calls_run_through_the_renderer() -> None:
    """The tiny model's renderer has no tool format: the tool is declared as a JSON schema, the model's `CALL add
    {...}` line comes back to the environment as an OpenAI tool call, verifiers runs the tool, and its result
    is the next turn's `RESULT add: ...` message."""
    train, _ = build_datasets(Verifiers(module=MODULE, args={"kind": "tool"}, train_size=4, test_size=2), ctx())

    def policy(prompt: str) -> str:
        if "RESULT add:" in prompt:
            return prompt.rsplit("RESULT add: ", 1)[1].split("<|im_end|>")[0]
        a, b = _question(prompt)
        return f'CALL add {{"a": {a}, "b": {b}}}'

    out, sampler = group(train, policy)
    assert out.total_rewards_G() == [1.0, 1.0]
    m = out.metrics_G[0]
    assert m["total_tool_calls"] == 1.0 and m["add_calls"] == 1.0 and m["num_turns"] == 2.0
    first, second = (TOK.decode(c[0]) for c in sampler.calls[:2])
    assert '"name": "add"' in first and "Use the add tool" in first
    a, b = _question(first)
    assert f'CALL add {{"a": {a}, "b": {b}}}' in second and f"RESULT add: {a + b}" in second
    traj = out.trajectories_G[0]
    assert [t.episode_done for t in traj.transitions] == [False, True]
    # A reply that never calls the tool is answered at once; a wrong answer scores 0.
    blunt, _ = group(train, lambda p: "7")
    assert all(len(t.transitions) == 1 for t in blunt.trajectories_G)
    assert blunt.metrics_G[0]["total_tool_calls"] == 0.0


@pytest.mark.parametrize(("cfg", "says"), [
    ({"module": "no_such_env_module"}, "cannot import environment module 'no_such_env_module'"),
    ({"module": MODULE, "args": {"kind": "nope"}}, "raised ValueError: unknown kind 'nope'"),
    ({"module": MODULE, "args": {"bogus": 1}}, "load_environment"),
    ({"module": MODULE, "args": {"n": 0}}, "its dataset has no rows to train on"),  # was an endless loop
])
def test_bad_settings_are_one_line_errors(cfg: dict[str, Any], says: str) -> None:
    with pytest.raises(UserError) as e:
        build_datasets(Verifiers(**cfg, train_size=4, test_size=2), ctx())
    assert says in str(e.value) and "\n" not in str(e.value)


RECIPE = """
[recipes.vf_sums]
lr = 1e-2
max_steps = 3
eval_every = 3
[recipes.vf_sums.algo]
kind = "rl"
group_size = 2
groups_per_batch = 2
max_tokens = 16
env = {{ kind = "verifiers", module = "tests.verifiers_envs", args = {{ kind = "{kind}" }}, train_size = 8, test_size = 2 }}
"""


@pytest.mark.parametrize("kind", ["sums", "tool"])
def test_trains_through_runner_run_and_smokes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    from runner.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setenv("RUNNER_SMOKE_CACHE", str(tmp_path / "models"))
    (tmp_path / "vf.toml").write_text(RECIPE.format(kind=kind))
    assert main(["run", "vf.toml#vf_sums"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "vf_sums" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "env/all/exact" in r]) == 3
    assert all(r["env/all/vf_error"] == 0.0 for r in rows if "env/all/vf_error" in r)
    assert any("test/env/all/exact" in r for r in rows)
    assert main(["smoke", "vf.toml"]) == 0


def test_the_cookbook_recipe_smokes_on_the_local_reverse_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/verifiers_rl.toml (hosted Tinker, the Hub's reverse-text) smokes offline on
    examples/vf_reverse_text.py, whose rubric scores a right reversal 1."""
    from runner.cli import main

    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUNNER_SMOKE_CACHE", str(tmp_path / "models"))
    assert main(["smoke", "examples/verifiers_rl.toml"]) == 0
    train, _ = build_datasets(Verifiers(module="examples.vf_reverse_text", args={"n": 4}, train_size=2, test_size=1),
                              ctx())
    right, _ = group(train, lambda p: "<reversed_text>" + p.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0][::-1]
                     + "</reversed_text>")
    assert right.total_rewards_G() == [1.0, 1.0] and right.metrics_G[0]["lcs_reward"] == 1.0
