"""The `rubric` env (runner/rl/envs/rubric.py): the judge-output parser, python graders, a model judge on a scripted
sampling client (the prompt it sees, the scores it gives), data errors, and 2-step runs of the shipped recipe (python
grader) and of a base-model judge on the tiny model through the local backend."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from backends.types import SamplingParams
from runner.engine.loop import run
from runner.recipe.load import load_recipe
from runner.recipe.sources import Jsonl
from runner.renderers.chat import ChatRenderer
from runner.rl.envs import EnvContext, build_datasets, get_batch
from runner.rl.envs.rubric import ModelGrader, Problem, RubricEnv, keyword_grader, load_problems, parse_score
from runner.rl.envs.rubric_config import JudgeModel, PythonGrader, Rubric
from runner.rl.rollouts import run_episode
from runner.rl.testing import ScriptedSampler
from runner.rl.types import Transition

ROOT = Path(__file__).resolve().parents[1]
TOK = build_tokenizer()
R = ChatRenderer(TOK)
PROMPTS = Jsonl(str(ROOT / "examples/data/rubric_prompts.jsonl"))


def constant_grader(messages: list[dict[str, Any]], reply: str, item: str) -> Any:
    return 0.25


def text_grader(messages: list[dict[str, Any]], reply: str, item: str) -> Any:
    return "Score: 8/10" if "good" in reply else "no idea"


def bad_grader(messages: list[dict[str, Any]], reply: str, item: str) -> Any:
    return 3.0


def raising_grader(messages: list[dict[str, Any]], reply: str, item: str) -> Any:
    raise KeyError("boom")


def ctx(**kw: Any) -> EnvContext:
    return EnvContext(renderer=R, group_size=1, test_group_size=1, groups_per_batch=1, seed=0, **kw)


def play(grader: Any, reply: str, items: tuple[str, ...] = ("mentions \"Paris\"",),
         max_tokens: int = 64) -> Transition:  # fmt: skip
    problem = Problem(({"role": "user", "content": "What is the capital of France?"},), items, "t")
    env = RubricEnv(R, problem, grader, 0.1, 0)
    sampler = ScriptedSampler(TOK, lambda p, s: reply)
    traj = asyncio.run(run_episode(env, sampler, SamplingParams(max_tokens=max_tokens), seed=0, step=0, group=0,
                                   member=0))  # fmt: skip
    (t,) = traj.transitions
    return t


@pytest.mark.parametrize(("text", "score"), [
    ("<score>0.8</score>", 0.8), ("Reasoning... <score> 1 </score>", 1.0), ("<score>7</score>", 0.7),
    ("<score>3/4</score>", 0.75), ("<score>0.2</score> then <score>0.6</score>", 0.6),
    ("Score: 7/10", 0.7), ("I'd say 3 out of 5.", 0.6), ("Score: 0.9", 0.9), ("Rating = 4", 0.4),
    ("0.5", 0.5), ("1", 1.0), ("Yes, it mentions Paris.", 1.0), ("No.", 0.0), ("Verdict: PASS", 1.0),
    ("fail", 0.0),
])  # fmt: skip
def test_parse_score(text: str, score: float) -> None:
    assert parse_score(text) == pytest.approx(score)


@pytest.mark.parametrize("text", ["", "I cannot grade this.", "<score>great</score>", "<score>42</score>",
                                  "Score: 55", "11/10", "-1", "The answer mentions Paris", "no idea", "Yesterday"])
def test_unparseable_judge_output(text: str) -> None:
    assert parse_score(text) is None


def test_python_grader_rewards() -> None:
    from runner.rl.envs.rubric import FunctionGrader

    t = play(FunctionGrader(PythonGrader("test_env_rubric:constant_grader")), "Paris.", items=("a", "b"))
    assert t.reward == pytest.approx(0.25) and t.metrics == {"rubric_score": 0.25, "format": 1.0, "judge_unparsed": 0.0}
    t = play(FunctionGrader(PythonGrader("test_env_rubric:text_grader")), "a good answer")
    assert t.reward == pytest.approx(0.8) and t.logs["judge_0"] == "Score: 8/10"
    t = play(FunctionGrader(PythonGrader("test_env_rubric:text_grader")), "bad")
    assert t.reward == 0.0 and t.metrics["judge_unparsed"] == 1.0 and str(t.logs["item_0"]).startswith("unparsed |")
    # Cut at max_tokens: the format penalty.
    t = play(FunctionGrader(PythonGrader("test_env_rubric:constant_grader")), "Paris is the capital", max_tokens=3)
    assert t.reward == pytest.approx(0.15) and t.metrics["format"] == 0.0


def test_keyword_grader() -> None:
    t = play(keyword_grader_fn(), "It is Paris.", items=('mentions "Paris"', 'says "France" or "French"', "is short"))
    assert t.metrics["rubric_score"] == pytest.approx(2 / 3)
    assert keyword_grader([], 'the "word"', 'says "4" or "four"') == 0.0
    assert keyword_grader([], "Four.", 'says "4" or "four"') == 1.0


def keyword_grader_fn() -> Any:
    from runner.rl.envs.rubric import FunctionGrader

    return FunctionGrader(PythonGrader("runner.rl.envs.rubric:keyword_grader"))


@pytest.mark.parametrize(("target", "message"), [("test_env_rubric:bad_grader", r"returned 3.0, expected a score"),
                                                 ("test_env_rubric:raising_grader", "raised KeyError")])
def test_broken_python_grader_is_a_user_error(target: str, message: str) -> None:
    from runner.rl.envs.rubric import FunctionGrader

    with pytest.raises(UserError, match=message):
        play(FunctionGrader(PythonGrader(target)), "Paris")


def test_model_judge_on_a_scripted_client() -> None:
    seen: list[str] = []
    opened: list[tuple[str | None, str | None]] = []

    def judge_policy(prompt: str, params: SamplingParams) -> str:
        seen.append(prompt)
        if "Chatbot: Paris" in prompt:
            return "It names the city. <score>1</score>"
        if "Chatbot: Lyon" in prompt:
            return "Score: 2/10"
        return "hmm"

    async def open_model(path: str | None, base: str | None) -> Any:
        opened.append((path, base))
        return ScriptedSampler(TOK, judge_policy)

    grader = ModelGrader(JudgeModel(checkpoint="/ckpt/judge"), ctx(open_model=open_model))
    t = play(grader, "Paris", items=('mentions "Paris"', "is one word"))
    assert t.reward == 1.0 and t.metrics["judge_unparsed"] == 0.0
    assert opened == [("/ckpt/judge", None)]  # opened once for both items
    assert "<rubric>\nmentions \"Paris\"\n</rubric>" in seen[0] and "Human: What is the capital of France?" in seen[0]
    assert "wrapped in <score> ... </score>" in seen[0]
    assert play(grader, "Lyon").reward == pytest.approx(0.2)
    t = play(grader, "dunno")
    assert t.reward == 0.0 and t.metrics["judge_unparsed"] == 1.0 and t.logs["judge_0"] == "hmm"


def test_model_judge_needs_a_backend() -> None:
    grader = ModelGrader(JudgeModel(), ctx())
    with pytest.raises(UserError, match="needs the run's backend"):
        play(grader, "Paris")


def test_data_rows(tmp_path: Path) -> None:
    ps = load_problems(PROMPTS)
    assert len(ps) == 16 and all(p.items for p in ps)
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}], "rubric": ["a", "b"]}) + "\n")
    (p,) = load_problems(Jsonl(str(path)))
    assert p.messages[0]["content"] == "Be brief." and p.items == ("a", "b")
    for row, message in [({"prompt": "x"}, "r.jsonl:1: `rubric` must be"), ({"rubric": "x"}, "r.jsonl:1: expected a "
                         "non-empty `prompt`"), ({"prompt": "x", "rubric": []}, "`rubric` must be")]:  # fmt: skip
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(UserError, match=message):
            build_datasets(Rubric(data=Jsonl(str(path)), judge=PythonGrader("test_env_rubric:constant_grader")), ctx())


def test_config() -> None:
    cfg = msgspec.convert({"data": {"kind": "jsonl", "path": "x"}}, Rubric)
    assert isinstance(cfg.judge, JudgeModel) and cfg.judge.model is None
    with pytest.raises(msgspec.ValidationError, match="not both"):
        msgspec.convert({"data": {"kind": "jsonl", "path": "x"},
                         "judge": {"kind": "model", "init_from": "#a", "checkpoint": "b"}}, Rubric)
    train, test = build_datasets(Rubric(data=PROMPTS, judge=PythonGrader("test_env_rubric:constant_grader"),
                                        test_size=4), ctx())  # fmt: skip
    assert len(train) == 12 and test is not None and len(get_batch(test, 0, "test")) == 1


def test_rubric_recipe_two_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    over = ["max_steps=2", "eval_every=1", f"log_dir={tmp_path / 'run'}", "algo.groups_per_batch=2",
            "algo.group_size=2", "algo.env.test_size=2"]  # fmt: skip
    name, r = load_recipe(f"{ROOT / 'recipes.toml'}#rubric", over)
    run(r, name)
    ms = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in ms if "env/all/rubric_score" in m]
    assert len(steps) == 2 and all(m["env/all/judge_unparsed"] == 0.0 for m in steps)
    logs = json.loads((tmp_path / "run" / "iteration_000000" / "train_rollout_summaries.jsonl").read_text()
                      .splitlines()[0])["steps"][0]["logs"]  # fmt: skip
    assert logs["prompt"] and logs["item_0"][:4] in ("0.00", "1.00")


def test_base_model_judge_two_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """judge = the recipe's own base model (tiny), sampled through the local backend: it cannot grade, so its text is
    unparsed and counted, and the run goes on."""
    monkeypatch.chdir(ROOT)
    over = ["max_steps=2", "eval_every=0", f"log_dir={tmp_path / 'run'}", "algo.groups_per_batch=2",
            "algo.group_size=2", "algo.env.test_size=2", "algo.max_tokens=4"]  # fmt: skip
    name, r = load_recipe(f"{ROOT / 'recipes.toml'}#rubric", over)
    env = msgspec.structs.replace(r.algo.env, judge=JudgeModel(max_tokens=6))  # type: ignore[union-attr]
    r = msgspec.structs.replace(r, algo=msgspec.structs.replace(r.algo, env=env))
    run(r, name)
    ms = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in ms if "env/all/judge_unparsed" in m]
    assert len(steps) == 2 and all(0.0 <= m["env/all/rubric_score"] <= 1.0 for m in steps)
    logs = json.loads((tmp_path / "run" / "iteration_000000" / "train_rollout_summaries.jsonl").read_text()
                      .splitlines()[0])["steps"][0]["logs"]  # fmt: skip
    assert "judge_0" in logs


def test_chained_judge_runs_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """judge = {kind = "model", init_from = "#judge"}: `runner run` trains the judge first and grades with its final
    weights (runner/engine/chain.py finds the reference like the preference env's)."""
    from runner.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.toml").write_text(f"""
[recipes.judge]
max_steps = 1
algo = {{ kind = "sft", data = {{ kind = "jsonl", path = "{ROOT / 'examples/data/chat_sft.jsonl'}" }} }}

[recipes.pol]
max_steps = 1
[recipes.pol.algo]
kind = "rl"
group_size = 2
groups_per_batch = 2
max_tokens = 4
[recipes.pol.algo.env]
kind = "rubric"
data = {{ kind = "jsonl", path = "{PROMPTS.path}" }}
test_size = 2
judge = {{ kind = "model", init_from = "#judge", max_tokens = 4 }}
""")
    assert main(["run", "r.toml#pol"]) == 0
    assert (tmp_path / "runs" / "judge" / "metrics.jsonl").exists()
    ms = [json.loads(line) for line in (tmp_path / "runs" / "pol" / "metrics.jsonl").read_text().splitlines()]
    assert any("env/all/judge_unparsed" in m for m in ms)
