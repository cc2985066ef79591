"""Trajectory -> datum assembly (merging, masks, alignment, logprob/advantage placement), transcripts, schema.
Run: pytest tests/test_rl_datums.py"""

from __future__ import annotations

import asyncio
import functools
import json

import msgspec
import numpy as np
import pytest

from backends.local.tiny import build_tokenizer
from backends.losses.ppo_config import PPO
from backends.types import Datum, SampledSequence, SamplingParams
from runner.algos.rl_config import RL, ReferenceKL, Stream
from runner.renderers.chat import ChatRenderer
from runner.rl.advantages import compute_advantages
from runner.rl.datums import assemble_datums, trajectory_to_datums
from runner.rl.envs.arithmetic_config import Arithmetic
from runner.rl.envs.common import RepeatGroupBuilder
from runner.rl.envs.guess_number import GuessNumberEnv
from runner.rl.kl import apply_kl_penalty, kl_sample_train, reference_logprobs
from runner.rl.rollouts import do_group_rollout
from runner.rl.testing import ScriptedSampler, fake_logprob
from runner.rl.transcripts import rollout_summary_rows, write_html, write_rollout_summaries
from runner.rl.types import Trajectory, TrajectoryGroup, Transition

TOK = build_tokenizer()
R = ChatRenderer(TOK)


def tr(ob, ac, lps=None, metrics=None, done=False) -> Transition:
    lps = lps if lps is not None else [-0.1 * (i + 1) for i in range(len(ac))]
    return Transition(list(ob), SampledSequence(list(ac), lps, "stop"), 0.0, done, metrics or {})


def test_single_turn_alignment_mask_logprobs():
    (d,) = trajectory_to_datums(Trajectory([tr([1, 2, 3], [4, 5], [-0.4, -0.5], done=True)]), advantage=0.25)
    # full sequence 1 2 3 4 5: input = seq[:-1], targets = seq[1:]
    assert d.model_input == [1, 2, 3, 4]
    np.testing.assert_array_equal(d.target_tokens, [2, 3, 4, 5])
    np.testing.assert_array_equal(d.mask, [0, 0, 1, 1])
    np.testing.assert_allclose(d.logprobs, [0, 0, -0.4, -0.5])
    np.testing.assert_allclose(d.advantages, [0, 0, 0.25, 0.25])
    assert d.full_sequence == [1, 2, 3, 4, 5]
    d.check_for("importance_sampling")


def test_multi_turn_merges_when_observations_extend():
    t = Trajectory([tr([1, 2], [3, 4]), tr([1, 2, 3, 4, 7, 8], [9], [-0.9], done=True)])
    (d,) = trajectory_to_datums(t, advantage=-1.0)
    assert d.full_sequence == [1, 2, 3, 4, 7, 8, 9]
    np.testing.assert_array_equal(d.mask, [0, 1, 1, 0, 0, 1])
    np.testing.assert_allclose(d.logprobs, [0, -0.1, -0.2, 0, 0, -0.9])
    np.testing.assert_allclose(d.advantages, [0, -1, -1, 0, 0, -1])


def test_multi_turn_splits_when_an_observation_does_not_extend():
    t = Trajectory([tr([1, 2], [3]), tr([1, 5, 6], [7], done=True)])
    d1, d2 = trajectory_to_datums(t, advantage=1.0)
    assert d1.full_sequence == [1, 2, 3] and d2.full_sequence == [1, 5, 6, 7]
    np.testing.assert_array_equal(d1.mask, [0, 1])
    np.testing.assert_array_equal(d2.mask, [0, 0, 1])


def test_parse_error_masked_turn_and_empty_trajectory():
    t = Trajectory([tr([1, 2], [3], metrics={"parse_error_masked": 1.0}), tr([1, 2, 3, 4], [5], done=True)])
    (d,) = trajectory_to_datums(t, advantage=2.0)
    np.testing.assert_array_equal(d.mask, [0, 0, 0, 1])
    np.testing.assert_allclose(d.advantages, [0, 0, 0, 2])
    np.testing.assert_allclose(d.logprobs[1], -0.1)  # the sampled logprob is kept; only mask/advantage drop
    assert trajectory_to_datums(Trajectory([]), 1.0) == []


def test_real_multiturn_env_gives_one_datum_per_episode():
    builder = RepeatGroupBuilder(functools.partial(GuessNumberEnv, R, 2, 0, 9, 5), 2, [])
    replies = iter(["5", "1", "2", "7", "8", "9", "0", "1", "2", "3"])
    group = asyncio.run(do_group_rollout(builder, ScriptedSampler(TOK, lambda p, s: next(replies)), SamplingParams()))
    advantages = compute_advantages([group])
    data, sources = assemble_datums([group], advantages)
    assert len(data) == 2 and [(s.group_idx, s.traj_idx) for s in sources] == [(0, 0), (0, 1)]
    for d, traj, adv in zip(data, group.trajectories_G, advantages[0]):
        acts = [t for x in traj.transitions for t in x.ac.tokens]
        assert int(d.mask.sum()) == len(acts)
        trained = np.asarray(d.target_tokens)[d.mask > 0]
        np.testing.assert_array_equal(trained, acts)  # exactly the sampled tokens are trained
        np.testing.assert_allclose(d.logprobs[d.mask > 0], [lp for x in traj.transitions for lp in x.ac.logprobs])
        assert np.all(d.advantages[d.mask > 0] == adv) and np.all(d.advantages[d.mask == 0] == 0)
        assert d.full_sequence[: len(traj.transitions[-1].ob)] == traj.transitions[-1].ob


# ---------------------------------------------------------------- transcripts


def evil_group() -> TrajectoryGroup:
    ob = TOK.encode("<b>user</b> & co", add_special_tokens=False)
    ac = TOK.encode("<script>alert('x')</script>", add_special_tokens=False)
    t = Trajectory(
        [
            Transition(
                ob, SampledSequence(ac, [-1.0] * len(ac), "length"), 0.5, True, {"correct": 1.0}, {"reply": "<i>hi</i>"}
            )
        ]
    )
    return TrajectoryGroup([t, Trajectory([])], [0.25, 0.0], [{"win": 1.0}, {}], ["<tag>"])


def test_html_transcript_escapes_everything(tmp_path):
    path = tmp_path / "iteration_000001" / "train.html"
    write_html(path, [evil_group()], R.decode, title="step 1 <train>", group_indices=[7])
    text = path.read_text()
    assert "<script>" not in text and "<b>" not in text and "<i>" not in text and "<tag>" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "&lt;b&gt;user&lt;/b&gt; &amp; co" in text
    assert "Group 7" in text and "total reward 0.75" in text and "no turns" in text
    assert "step 1 &lt;train&gt;" in text


def test_rollout_summaries_jsonl(tmp_path):
    path = tmp_path / "train_rollout_summaries.jsonl"
    write_rollout_summaries(path, [evil_group()], split="train", iteration=3, group_indices=[7], sampling_client_step=2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2
    r = rows[0]
    assert set(r) == {
        "schema_version",
        "split",
        "iteration",
        "group_idx",
        "traj_idx",
        "tags",
        "sampling_client_step",
        "total_reward",
        "final_reward",
        "trajectory_metrics",
        "final_ob_len",
        "steps",
    }
    assert (r["group_idx"], r["traj_idx"], r["iteration"], r["split"]) == (7, 0, 3, "train")
    assert r["total_reward"] == 0.75 and r["final_reward"] == 0.25
    assert r["trajectory_metrics"] == {"correct": 1.0, "win": 1.0}
    (step,) = r["steps"]
    assert step["ac_len"] == 27 and step["reward"] == 0.5 and step["logs"] == {"reply": "<i>hi</i>"}
    assert (
        rows[1]["steps"] == [] and rollout_summary_rows([evil_group()], split="test", iteration=0)[1]["group_idx"] == 0
    )


# ---------------------------------------------------------------- schema


def decode(table: dict) -> RL:
    return msgspec.convert({"kind": "rl", **table}, RL)


def test_schema_defaults_and_unions():
    rl = decode(
        {
            "env": {"kind": "arithmetic", "max_value": 20},
            "loss": {"kind": "ppo"},
            "kl": {"kind": "reference", "coef": 0.1},
            "mode": {"kind": "stream", "minibatches": 4},
        }
    )
    assert rl.env == Arithmetic(max_value=20) and rl.loss == PPO(clip_low=0.8, clip_high=1.2)
    assert rl.kl == ReferenceKL(coef=0.1) and rl.mode == Stream(minibatches=4)
    assert (rl.group_size, rl.groups_per_batch, rl.normalize_std, rl.remove_constant_reward_groups) == (
        4,
        16,
        False,
        False,
    )
    for kind in ("guess_number", "twenty_questions", "tictactoe", "preference"):
        assert decode({"env": {"kind": kind}}).env.__struct_config__.tag == kind


@pytest.mark.parametrize(
    "table, message",
    [
        ({"env": {"kind": "arith"}}, "Invalid value 'arith' - at `$.env.kind`"),
        ({"env": {"kind": "arithmetic"}, "group_sise": 2}, "unknown field `group_sise`"),
        ({"env": {"kind": "arithmetic"}, "group_size": 1}, "Expected `int` >= 2 - at `$.group_size`"),
        ({"env": {"kind": "tictactoe"}, "group_size": 3}, "even group_size"),
        ({"env": {"kind": "arithmetic"}, "loss": {"kind": "cispo", "clip_low": 5.0}}, "clip_low must be < clip_high"),
        ({"env": {"kind": "arithmetic"}, "kl": {"kind": "reference"}}, "missing required field `coef`"),
        ({"env": {"kind": "python", "target": "not a target"}}, "at `$.env.target`"),
        ({"env": {"kind": "arithmetic"}, "mode": {"kind": "stream", "minibatches": 3}}, "split evenly"),
        ({"env": {"kind": "guess_number", "low": 5, "high": 1}}, "high must be >= low"),
    ],
)
def test_schema_errors(table, message):
    with pytest.raises(msgspec.ValidationError) as e:
        decode(table)
    assert message in str(e.value)


# ---------------------------------------------------------------- KL terms


def kl_datum(lps, mask, adv) -> Datum:
    n = len(lps)
    return Datum(list(range(n)), np.arange(1, n + 1), logprobs=lps, advantages=adv, mask=mask)


def test_kl_penalty_is_centred_on_action_tokens():
    d1 = kl_datum([0.0, -1.0, -2.0], [0, 1, 1], [0, 1, 1])
    d2 = kl_datum([-1.0, -1.0], [0, 1], [0, -1])
    ref = [np.array([-5.0, -1.5, -1.0]), np.array([-9.0, -2.0])]
    out, m = apply_kl_penalty([d1, d2], ref, coef=0.5)
    # d = [0.5, -1.0] and [1.0] on action tokens; mean 1/6
    assert m["kl_policy_base"] == pytest.approx(1 / 6)
    np.testing.assert_allclose(out[0].advantages, [0, 1 + 0.5 * (1 / 6 - 0.5), 1 + 0.5 * (1 / 6 + 1.0)], rtol=1e-6)
    np.testing.assert_allclose(out[1].advantages, [0, -1 + 0.5 * (1 / 6 - 1.0)], rtol=1e-6)
    total_shift = sum(((o.advantages - d.advantages) * d.mask).sum() for o, d in zip(out, [d1, d2]))
    assert total_shift == pytest.approx(0.0, abs=1e-6)  # centred: the mean advantage is unchanged


def test_reference_logprobs_align_with_targets_and_kl_sample_train():
    (d,) = trajectory_to_datums(Trajectory([tr([5, 6], [7, 8], [-0.3, -0.4], done=True)]), 1.0)
    sampler = ScriptedSampler(TOK, lambda p, s: "")
    (ref,) = asyncio.run(reference_logprobs(sampler, [d]))
    assert ref.shape == d.target_tokens.shape
    np.testing.assert_allclose(ref, [fake_logprob(t, i) for i, t in enumerate([6, 7, 8])], rtol=1e-6)
    m = kl_sample_train([d], [np.array([0.0, -0.5, -0.1])])  # diffs on the two action tokens: 0.2, -0.3
    assert m["optim/kl_sample_train_v1"] == pytest.approx(-0.05, abs=1e-6)
    assert m["optim/kl_sample_train_v2"] == pytest.approx(0.5 * (0.04 + 0.09) / 2, abs=1e-6)
    assert m["optim/entropy"] == pytest.approx(0.35, abs=1e-6)
