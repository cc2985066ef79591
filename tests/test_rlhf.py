"""The RLHF pipeline as chained recipes: SFT -> reward model -> RL whose preference judge is the reward model
(`judge = {kind = "model", init_from = "#rm"}`), with test/win_rate_vs_init in the final row; both backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.cli import main
from runner.engine.log import read_jsonl

REPO = Path(__file__).resolve().parent.parent
COMPARISONS = REPO / "examples" / "data" / "comparisons.jsonl"

PIPELINE = """
[recipes.sft]
lr = 4e-3
max_steps = 2
eval_every = 0
save_every = 0
{backend}
algo = {{kind = "sft", batch_size = 8, data = {{kind = "python", target = "runner.data.comparisons:preferred_conversations", \
args = {{path = "{data}"}}}}}}
lora = {{rank = 4}}

[recipes.rm]
lr = 3e-3
max_steps = 2
eval_every = 0
save_every = 0
{backend}
algo = {{kind = "reward_model", batch_size = 8, data = {{kind = "jsonl", path = "{data}"}}}}
lora = {{rank = 4}}

[recipes.rl]
init_from = "#sft"
lr = 3e-3
max_steps = 2
eval_every = 1
save_every = 0
{backend}
lora = {{rank = 4}}

[recipes.rl.algo]
kind = "rl"
group_size = 3
groups_per_batch = 2
max_tokens = 4

[recipes.rl.algo.env]
kind = "preference"
judge = {{kind = "model", init_from = "#rm"}}
prompts = ["What is 1 + 2?", "What is 3 + 4?"]
test_prompts = ["What is 2 + 2?", "What is 5 + 1?"]
train_size = 8
"""
LOCAL = 'backend = {kind = "local", device = "cpu"}'
TINKER = 'model = "Qwen/Qwen3-8B"\ntokenizer = "tiny"\nbackend = {kind = "tinker"}'


def check_pipeline(proj: Path) -> None:
    for stage in ("sft", "rm"):
        assert (proj / "runs" / stage / "checkpoints.jsonl").is_file(), stage  # ran first, by the chain
    rows = read_jsonl(proj / "runs" / "rl" / "metrics.jsonl")
    train = [r for r in rows if "env/all/win_frac" in r]
    # A round-robin of pairs judged in both orders: the group's win rates average 0.5 exactly.
    assert all(r["env/all/win_frac"] == pytest.approx(0.5) for r in train) and len(train) == 2
    final = rows[-1]
    assert final["step"] == 2 and 0.0 <= final["test/win_rate_vs_init"] <= 1.0


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_rlhf_pipeline_on_the_local_backend(proj: Path) -> None:
    (proj / "r.toml").write_text(PIPELINE.format(backend=LOCAL, data=COMPARISONS))
    assert main(["run", "r.toml#rl"]) == 0
    check_pipeline(proj)


def test_rlhf_pipeline_over_the_tinker_sdk(proj: Path, mocked_tinker: None) -> None:
    (proj / "r.toml").write_text(PIPELINE.format(backend=TINKER, data=COMPARISONS))
    assert main(["run", "r.toml#rl"]) == 0
    check_pipeline(proj)


def test_a_judge_on_another_backend_is_a_check_error(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = PIPELINE.format(backend=LOCAL, data=COMPARISONS)
    a = text.index("[recipes.rm]")
    b = text.index("[recipes.rl]")
    text = text[:a] + text[a:b].replace(LOCAL, TINKER) + text[b:]
    (proj / "r.toml").write_text(text)
    assert main(["check", "r.toml#rl"]) == 2
    assert "algo.env.judge.init_from" in capsys.readouterr().err


# ---------------------------------------------------------------- the SFT stage's demonstrations

PREFIXES = ["Hmm, I believe that ", "Let me see. After some thought, "]
REPLIES = ["I am not sure.", "Ask me something else."]


def test_hedged_demonstrations_are_seeded_and_hedge_as_asked() -> None:
    from runner.data.comparisons import hedged_demonstrations, load_pairs
    from runner.recipe.sources import Jsonl

    pairs = load_pairs(Jsonl(path=str(COMPARISONS))).pairs
    rows = hedged_demonstrations(str(COMPARISONS), PREFIXES, REPLIES, prefix_frac=0.3, reply_frac=0.4, seed=3)
    assert rows == hedged_demonstrations(str(COMPARISONS), PREFIXES, REPLIES, prefix_frac=0.3, reply_frac=0.4, seed=3)
    assert rows != hedged_demonstrations(str(COMPARISONS), PREFIXES, REPLIES, prefix_frac=0.3, reply_frac=0.4, seed=4)
    assert len(rows) == len(pairs)
    kinds = {"plain": 0, "prefixed": 0, "replaced": 0}
    for row, pair in zip(rows, pairs, strict=True):
        *prompt, reply = row["messages"]
        good = pair.chosen[0]["content"]
        assert prompt == pair.prompt and reply["role"] == "assistant"
        if reply["content"] == good:
            kinds["plain"] += 1
        elif reply["content"] in REPLIES:
            kinds["replaced"] += 1
        else:
            assert any(reply["content"] == p + good for p in PREFIXES), reply
            kinds["prefixed"] += 1
    n = len(rows)
    assert abs(kinds["prefixed"] / n - 0.3) < 0.06 and abs(kinds["replaced"] / n - 0.4) < 0.06
    # No hedging: the preferred answers, as preferred_conversations.
    from runner.data.comparisons import preferred_conversations

    assert hedged_demonstrations(str(COMPARISONS)) == preferred_conversations(str(COMPARISONS))


def test_hedged_demonstrations_leave_out_held_out_prompts_and_change_nothing_else() -> None:
    from runner.data.comparisons import hedged_demonstrations

    held_out = ["What is 2 + 4?", "What is 5 + 8?"]
    args = {"prefixes": PREFIXES, "replies": REPLIES, "prefix_frac": 0.4, "reply_frac": 0.4, "seed": 0}
    everything = hedged_demonstrations(str(COMPARISONS), **args)
    kept = hedged_demonstrations(str(COMPARISONS), exclude=held_out, **args)
    assert all(r["messages"][-2]["content"] not in held_out for r in kept)
    assert kept == [r for r in everything if r["messages"][-2]["content"] not in held_out]
    assert len(kept) < len(everything)


@pytest.mark.parametrize("args", [{"prefix_frac": 0.6, "reply_frac": 0.6, "prefixes": PREFIXES, "replies": REPLIES},
                                  {"prefix_frac": 0.5}, {"reply_frac": -0.1, "replies": REPLIES}])
def test_hedged_demonstrations_bad_args_are_user_errors(args: dict) -> None:
    from backends.errors import UserError
    from runner.data.comparisons import hedged_demonstrations

    with pytest.raises(UserError):
        hedged_demonstrations(str(COMPARISONS), **args)


def test_the_rlhf_recipes_hold_the_rl_test_prompts_out_of_every_policy_training_stage() -> None:
    import tomllib

    recipes = tomllib.loads((REPO / "recipes.toml").read_text())["recipes"]
    env = recipes["rlhf_rl"]["algo"]["env"]
    assert not set(env["prompts"]) & set(env["test_prompts"])
    assert recipes["rlhf_sft"]["algo"]["data"]["args"]["exclude"] == env["test_prompts"]
