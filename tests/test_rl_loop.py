"""RL through the one training loop (runner/engine/loop.py + runner/algos/rl.py) on the local backend and the tiny model:
every shipped RL recipe runs a couple of steps, writes the cookbook's metric names, an HTML transcript that
parses, rollout summaries and checkpoints; sync, stream and async modes behave as documented; a crashed sync
run resumes to the same metrics as an uninterrupted one.

Run: pytest tests/test_rl_loop.py   (well under a minute on 2 cores)
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import msgspec
import pytest
from crashing import CrashingBackend

from backends.base import BackendError
from backends.errors import UserError
from runner.engine.chain import upstreams
from runner.engine.loop import run
from runner.engine.pipeline import run_chain
from runner.recipe.load import dump_recipe, load_file, load_recipe
from runner.recipe.schema import Recipe

REPO = Path(__file__).resolve().parent.parent
RL_RECIPES = [
    (str(path), name)
    for path in [REPO / "recipes.toml", *sorted((REPO / "examples").glob("rl_*.toml"))]
    for name, recipe in load_file(str(path)).items()
    # rlhf_rl's judge is a reward model trained for minutes: tests/test_rlhf.py runs that chain at a small size.
    if type(recipe.algo).__name__ == "RL" and type(getattr(recipe.algo.env, "judge", None)).__name__ != "ModelJudge"
    # Recipes for hosted Tinker name hub models this machine does not have: their smoke tables run them offline.
    and type(recipe.backend).__name__ != "Tinker"
]
# Tiny everything: a CI run checks the plumbing, not the learning.
SMALL = ["max_steps=2", "eval_every=1", "save_every=1", "algo.groups_per_batch=2", "algo.eval.max_groups=2",
         'backend={kind="local", device="cpu"}']


def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def no_time(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]


def train_rows(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps' rows, without the final eval's (the only row without progress/batch)."""
    return [r for r in rs if "progress/batch" in r]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.seen: list[str] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self.seen.append(tag)
        if tag not in ("meta", "br"):
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def check_html(path: Path) -> list[str]:
    parser = _Tags()
    parser.feed(path.read_text(encoding="utf-8"))
    parser.close()
    assert parser.stack == []
    return parser.seen


def small_recipe(ref: str, tmp_path: Path, *extra: str) -> tuple[str, Recipe]:
    name = ref.split("#")[1]
    recipe = load_recipe(ref, [*SMALL, f"log_dir={tmp_path / name}", *extra])[1]
    env = recipe.algo.env
    group = 4 if type(env).__name__ == "TicTacToe" else 2  # two seats per self-play game
    if hasattr(env, "max_turns"):  # multi-turn envs: a few turns show the merging as well as many
        env = msgspec.structs.replace(env, max_turns=min(env.max_turns, 3))
    algo = msgspec.structs.replace(recipe.algo, group_size=group, env=env)
    return name, msgspec.structs.replace(recipe, algo=algo)


# The envs that need an optional extra (tests/conftest.py EXTRAS): their recipes skip, naming it, without it.
ENV_EXTRAS = {"reasoning_gym": "reasoning", "verifiers": "verifiers"}


def _needs(path: str, name: str) -> list[pytest.MarkDecorator]:
    kind = load_file(path)[name].algo.env.__struct_config__.tag  # type: ignore[union-attr]
    # twenty_questions: the longest example per step, behind its warm start (~29 s): `pytest -m slow` runs it.
    return [pytest.mark.extras(ENV_EXTRAS[kind])] if kind in ENV_EXTRAS else [pytest.mark.slow] if kind == "twenty_questions" else []


@pytest.mark.parametrize("path,name", [pytest.param(p, n, marks=_needs(p, n), id=n) for p, n in RL_RECIPES])
def test_shipped_rl_recipe_runs(path: str, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    name, recipe = small_recipe(f"{path}#{name}", tmp_path)
    if recipe.init_from is not None:  # a warm-started example: its SFT stage runs first, cut to 2 steps here
        [warm] = upstreams(recipe, f"{path}#{name}")
        small = tmp_path / "warm.toml"
        small.write_text(dump_recipe(warm.name, msgspec.structs.replace(
            warm.recipe, max_steps=2, log_dir=str(tmp_path / warm.name))))
        recipe = msgspec.structs.replace(recipe, init_from=f"{small}#{warm.name}")
        run_chain(recipe, name, f"{path}#{name}")
        assert len(rows(tmp_path / warm.name)) == 2 and (tmp_path / name / "init_from.json").is_file()
    else:
        run(recipe, name)
    run_dir = tmp_path / name
    tested = recipe.algo.env.__struct_config__.tag != "preference" or recipe.algo.env.test_prompts
    ms = rows(run_dir)
    # Two steps, then the final eval on the final weights at step 2 (where there is a test set).
    assert [m["step"] for m in ms] == ([0, 1, 2] if tested else [0, 1])
    if tested:
        *ms, final = ms
        assert sorted(k for k in final if k.startswith("test/")) == sorted(k for k in ms[0] if k.startswith("test/"))
        assert (run_dir / "iteration_000002" / "test.html").exists()
    for m in ms:
        for key in ("env/all/reward/total", "env/all/ac_tokens_per_turn", "env/all/total_episodes",
                    "env/all/by_group/frac_mixed", "optim/kl_sample_train_v1", "optim/kl_sample_train_v2",
                    "optim/entropy", "optim/lr", "progress/batch", "progress/done_frac", "time/total",
                    "sampling_client/step_max", "rollout_errors/total"):
            assert key in m, (name, key)
        assert m["env/all/total_episodes"] == recipe.algo.groups_per_batch * recipe.algo.group_size
        # A sampler and learner that see the same weights agree on the sampled tokens' logprobs (the sampler's
        # are at its temperature, the learner's at 1, so only at temperature 1).
        if recipe.algo.temperature == 1.0:
            assert abs(m["optim/kl_sample_train_v1"]) < 1e-3
    if recipe.algo.mode.__struct_config__.tag == "async":
        assert all(0 <= m["async/staleness_max"] <= recipe.algo.mode.max_staleness for m in ms)
    else:
        assert [m["sampling_client/step_max"] for m in ms] == [0, 1]  # on-policy: step k samples weights k
    assert ("test/env/all/reward/total" in ms[0]) == bool(tested)
    for step in (0, 1):
        folder = run_dir / f"iteration_{step:06d}"
        tags = check_html(folder / "train.html")
        assert "pre" in tags and "table" in tags
        summaries = rows(folder, "train_rollout_summaries.jsonl")
        assert len(summaries) == ms[step]["env/all/total_episodes"]
        assert {s["split"] for s in summaries} == {"train"} and summaries[0]["steps"]
    ckpts = rows(run_dir, "checkpoints.jsonl")
    assert [c["next_step"] for c in ckpts] == [1, 2]
    assert all((run_dir / c["state_path"]).exists() and c["rl_train_batches"] > 0 for c in ckpts)


def arith(tmp_path: Path, run_dir: str, **over: Any) -> Recipe:
    algo = {"kind": "rl", "env": {"kind": "arithmetic", "max_value": 9, "test_size": 4}, "group_size": 4,
            "groups_per_batch": 4, "max_tokens": 6, **over.pop("algo", {})}
    return msgspec.convert({"algo": algo, "lr": 5e-3, "lora": {"rank": 4}, "max_steps": 4, "eval_every": 2,
                            "save_every": 2, "schedule": {"kind": "constant"},
                            "backend": {"kind": "local", "device": "cpu"}, "log_dir": str(tmp_path / run_dir),
                            **over}, Recipe)


def assert_same_metrics(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Rewards, counts and sampled tokens exactly; the sampler's logprobs may differ in the last float bits
    with how its worker happened to batch the concurrent requests, so logprob-derived numbers to 1e-4."""
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for g, w in zip(got, want, strict=True):
        for k, v in w.items():
            if k.startswith(("env/", "test/env/", "progress/", "sampling_client/", "rollout_errors/")) or k == "step":
                assert g[k] == v, (w["step"], k)
            else:
                assert g[k] == pytest.approx(v, rel=1e-3, abs=1e-4), (w["step"], k)


def test_sync_crash_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    from backends.local import LocalBackend

    transcripts = {"transcript_every": 2}  # steps 0 and 2, and 3 as the last one
    run(arith(tmp_path, "straight", algo=transcripts), "r")
    want = no_time(rows(tmp_path / "straight"))
    assert len(want) == 5 and "test/env/all/reward/total" in want[2] and want[4]["step"] == 4  # 4: final eval

    recipe = arith(tmp_path, "crashed", algo=transcripts)
    inner = LocalBackend(recipe.backend, recipe.model, recipe.tokenizer, tmp_path / "crashed" / "checkpoints")
    with pytest.raises(BackendError, match="simulated crash"):
        run(recipe, "r", backend=CrashingBackend(inner, crash_at=3))  # steps 0-2 submitted, step 3 fails
    assert [c["next_step"] for c in rows(tmp_path / "crashed", "checkpoints.jsonl")] == [2]
    run(recipe, "r")  # a fresh backend resumes at step 2 from the checkpoint
    assert_same_metrics(no_time(rows(tmp_path / "crashed")), want)
    # Transcripts of the resumed steps are written again, and match.
    for step in (2, 3):
        a = rows(tmp_path / "straight" / f"iteration_{step:06d}", "train_rollout_summaries.jsonl")
        b = rows(tmp_path / "crashed" / f"iteration_{step:06d}", "train_rollout_summaries.jsonl")
        assert [x["total_reward"] for x in a] == [x["total_reward"] for x in b]


def test_async_fixed_staleness_repeats_exactly(tmp_path: Path) -> None:
    """fixed_staleness: step k samples the weights after step k - K whatever the timing, so two runs of the
    same seeded recipe give the same metrics (time/* aside), logprob-derived ones included."""
    mode = {"kind": "async", "max_staleness": 2, "fixed_staleness": True}
    for name in ("a", "b"):
        run(arith(tmp_path, name, algo={"mode": mode}, max_steps=5), "r")
    a, b = no_time(rows(tmp_path / "a")), no_time(rows(tmp_path / "b"))
    assert a == b
    ms = train_rows(a)
    assert [m["sampling_client/step_max"] for m in ms] == [0, 0, 0, 1, 2]
    assert [m["async/staleness_max"] for m in ms] == [0, 1, 2, 2, 2]


def test_async_is_off_policy_by_at_most_k(tmp_path: Path) -> None:
    """Async samples from weights older than the ones it trains (a sync implementation fails this), never more than
    K steps older."""
    run(arith(tmp_path, "sync", max_steps=5, lr=3e-2), "r")
    run(arith(tmp_path, "fixed", max_steps=5, lr=3e-2,
              algo={"mode": {"kind": "async", "max_staleness": 1, "fixed_staleness": True}}), "r")
    run(arith(tmp_path, "async", max_steps=5, lr=3e-2, algo={"mode": {"kind": "async", "max_staleness": 1}}), "r")
    sync, fixed, newest = (train_rows(rows(tmp_path / d)) for d in ("sync", "fixed", "async"))
    # Fixed staleness: step k samples the weights after step k - 1 (the first step, the initial weights).
    assert [m["async/staleness_max"] for m in fixed] == [0, 1, 1, 1, 1]
    assert [m["sampling_client/step_max"] for m in fixed] == [0, 0, 1, 2, 3]
    # ... and really did: the sampler's logprobs differ from the trained weights' by an update's worth, where sync
    # (the same weights on both sides) differs only by float noise.
    noise = max(abs(m["optim/kl_sample_train_v1"]) for m in sync)
    assert noise < 1e-4
    assert all(abs(m["optim/kl_sample_train_v1"]) > 10 * noise + 1e-5 for m in fixed[1:])
    # The newest-ready policy: never staler than K, and the sampler step is what it says.
    assert all(0 <= m["async/staleness_min"] <= m["async/staleness_max"] <= 1 for m in newest)
    assert [m["async/staleness_max"] for m in newest][0] == 0


def test_stream_submits_a_forward_backward_per_minibatch(tmp_path: Path) -> None:
    recipe = arith(tmp_path, "stream", algo={"mode": {"kind": "stream", "minibatches": 2}, "num_substeps": 2},
                   max_steps=2)
    run(recipe, "r")
    ms = train_rows(rows(tmp_path / "stream"))
    assert [m["optim/num_substeps"] for m in ms] == [2, 2]
    assert all(m["optim/num_datums"] == 16 and abs(m["optim/kl_sample_train_v1"]) < 0.5 for m in ms)


def test_losses_kl_and_post_kl(tmp_path: Path) -> None:
    for loss in ({"kind": "ppo"}, {"kind": "cispo"}, {"kind": "dro", "beta": 0.1}):
        run(arith(tmp_path, loss["kind"], max_steps=1, algo={"loss": loss}), "r")
        assert rows(tmp_path / loss["kind"])[0]["optim/grad_norm"] > 0
    recipe = arith(tmp_path, "kl", max_steps=2, algo={"kl": {"kind": "reference", "coef": 0.1},
                                                      "compute_post_kl": True, "num_substeps": 2})
    run(recipe, "r")
    ms = train_rows(rows(tmp_path / "kl"))
    assert ms[0]["kl_policy_base"] == pytest.approx(0.0, abs=1e-4)  # LoRA starts at the base weights
    assert all("optim/kl_pre_post_v2" in m and m["optim/kl_pre_post_v2"] >= 0 for m in ms)
    assert ms[1]["optim/kl_pre_post_v2"] > 0  # the update changed the policy


def test_dry_run_describes_rl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(arith(tmp_path, "dry"), "r", dry_run=True)
    out = capsys.readouterr().out
    assert "env: arithmetic" in out and "forward_backward(importance_sampling)" in out
    assert not (tmp_path / "dry").exists()


def test_stream_with_fewer_groups_than_minibatches_is_a_user_error(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A python env's dataset decides its batch size: one group per batch cannot split into 2 minibatches (before:
    ZeroDivisionError with a traceback)."""
    (tmp_path / "one_group_env.py").write_text(
        "from runner.rl.envs.arithmetic import ArithmeticEnv\n"
        "from runner.rl.envs.common import ListDataset, RepeatGroupBuilder\n"
        "def make():\n"
        "    def builder(ctx):\n"
        "        group = lambda i: RepeatGroupBuilder(lambda: ArithmeticEnv(ctx.renderer, i, 1), ctx.group_size, [])\n"
        "        return ListDataset(range(4), group, 1), None\n"
        "    return builder\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = arith(tmp_path, "stream1", max_steps=1, algo={"env": {"kind": "python", "target": "one_group_env:make"},
                                                           "mode": {"kind": "stream", "minibatches": 2}})
    with pytest.raises(UserError, match=r"stream mode: batch 0 of the train dataset has 1 groups, fewer than "
                                        r"num_substeps × minibatches = 2"):
        run(recipe, "r")


def test_train_and_snapshot_times_are_separate(tmp_path: Path) -> None:
    """time/sampler_wait mixes training and the snapshot; time/train and time/snapshot tell them apart."""
    run(arith(tmp_path, "times", max_steps=3, eval_every=0), "r")
    ms = train_rows(rows(tmp_path / "times"))
    assert all(m["time/train"] > 0 for m in ms)
    assert all(m["time/snapshot"] >= 0 for m in ms[:-1])  # the last step makes no snapshot for a next one
    assert all(m["time/train"] < m["time/total"] for m in ms)
