"""Preference learning: DPO (runner/algos/dpo.py) and the reward model (runner/algos/reward_model.py, runner/rewards/judge.py)
on comparisons (runner/data/comparisons.py).

Run: pytest tests/test_dpo.py   (about a minute on 2 cores; the learning tests are marked slow)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from backends.types import Datum, LoraSpec
from runner.algos.dpo import DPOAlgo, dpo_loss_fn, dpo_stats, sequence_logprobs
from runner.algos.dpo_config import DPO
from runner.algos.reward_model import RewardModelAlgo, judge_stats, orders, to_datum
from runner.algos.reward_model_config import RewardModel
from runner.data.comparisons import judge_messages, load_pairs, render_completion
from runner.engine.loop import run
from runner.engine.spec import Settings
from runner.recipe.schema import Recipe
from runner.recipe.sources import Jsonl

TOK = build_tokenizer()
REPO = Path(__file__).resolve().parents[1]
COMPARISONS = REPO / "examples" / "data" / "comparisons.jsonl"


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows without timings and token accounting (tests/test_cost.py checks that; a resumed DPO run asks for its
    reference logprobs again, which really costs tokens the uninterrupted run did not spend)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens/", "cost/"))} for r in rows]


def pair_row(i: int, fmt: str = "plain", label: str = "A") -> dict[str, Any]:
    prompt = [{"role": "user", "content": f"What is {i % 10} + 1?"}]
    good, bad = [{"role": "assistant", "content": str(i % 10 + 1)}], [{"role": "assistant", "content": "no idea"}]
    if fmt == "plain":
        return {"prompt": prompt, "chosen": good, "rejected": bad}
    a, b = (good, bad) if label in ("A", "Tie") else (bad, good)
    return {"comparison": {"prompt_conversation": prompt, "completion_A": a, "completion_B": b}, "label": label}


def write_rows(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def dpo_recipe(tmp_path: Path, data: Path, **over: Any) -> Recipe:
    algo = {"kind": "dpo", "data": {"kind": "jsonl", "path": str(data)}, "batch_size": 4, "test_size": 8,
            "max_length": 64, **over.pop("algo", {})}
    return msgspec.convert({"algo": algo, "lr": 5e-3, "lora": {"rank": 4}, "max_steps": 2, "eval_every": 1,
                            "save_every": 1, "depth": 1, "backend": {"kind": "local", "device": "cpu"},
                            "log_dir": str(tmp_path / "run"), **over}, Recipe)


# ---------------------------------------------------------------- the math


def test_loss_and_metrics_match_numpy():
    """dpo_loss_fn's value, metrics and gradient w.r.t. the logprobs against a plain numpy computation."""
    rng = np.random.default_rng(0)
    beta = 0.3
    lens = [5, 7, 4, 6, 3, 8]  # 3 pairs: (chosen, rejected) side by side
    data = [Datum(model_input=list(range(n)), target_tokens=np.arange(1, n + 1),
                  weights=(rng.uniform(size=n) > 0.4).astype(np.float32)) for n in lens]
    lps = [rng.normal(-2, 1, n).astype(np.float32) for n in lens]
    ref = np.array([float(np.dot(rng.normal(-2, 1, n), d.weights)) for n, d in zip(lens, data, strict=True)])

    leaves = [torch.tensor(lp, requires_grad=True) for lp in lps]
    loss, got = dpo_loss_fn(ref, beta)(data, leaves)
    loss.backward()

    # numpy, written out: sequence logprob = Σ w·lp; Δ = π − ref; z = β(Δc − Δr); loss = mean −log σ(z)
    pi = np.array([sum(float(w) * float(x) for w, x in zip(d.weights, lp, strict=True)) for d, lp in zip(data, lps, strict=True)])
    dc, dr = pi[0::2] - ref[0::2], pi[1::2] - ref[1::2]
    z = beta * (dc - dr)
    sig = 1 / (1 + np.exp(-z))
    want = {"dpo_loss": np.mean(-np.log(sig)), "accuracy": np.mean(dc > dr), "margin": np.mean(z),
            "chosen_reward": np.mean(beta * dc), "rejected_reward": np.mean(beta * dr)}
    assert float(loss.detach()) == pytest.approx(want["dpo_loss"], rel=1e-6)
    assert got == pytest.approx(want, rel=1e-6)
    assert dpo_stats(pi, ref, beta) == pytest.approx(want, rel=1e-6)
    assert 0 < want["accuracy"] < 1  # the batch has both outcomes, so the comparison is tested
    # d loss / d lp_t = ∓(1/P)·β·(1 − σ(z))·w_t for the chosen (−) and rejected (+) side of each pair
    for i, (d, leaf) in enumerate(zip(data, leaves, strict=True)):
        pair, sign = divmod(i, 2)
        g = (-1 if sign == 0 else 1) * beta * (1 - sig[pair]) / len(z) * d.weights
        np.testing.assert_allclose(leaf.grad.numpy(), g, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(sequence_logprobs(data, lps), pi, rtol=1e-6)


# ---------------------------------------------------------------- same gradient: local one pass vs the SDK's two


def test_gradient_local_one_pass_equals_tinker_sdk_two_passes(tmp_path, mock_tinker):
    """forward_backward_custom with the DPO loss: the local backend's single autograd pass and the real SDK's
    forward + surrogate backward against backends/serve (whose engine is the local backend) accumulate the same
    gradient, to 1e-5 of each tensor's scale."""
    from backends.local import LocalBackend
    from backends.local import model as M
    from backends.local.local_config import Local
    from backends.tinker.backend import TinkerBackend
    from backends.tinker.tinker_config import Tinker
    from backends.types import AdamParams

    pairs = load_pairs(Jsonl(str(COMPARISONS))).pairs[:3]
    cfg = msgspec.convert({"kind": "dpo", "data": {"kind": "jsonl", "path": "x"}}, DPO)
    algo = DPOAlgo(cfg, load_pairs(Jsonl(str(COMPARISONS))), Settings.make(TOK))
    data = [d for p in pairs for d in algo.datums(p)]
    ref = np.array([float(np.dot(d.weights, np.full(d.length, -3.0) + 0.1 * np.arange(d.length)))
                    for d in data])  # any fixed numbers: the reference is a constant here
    spec = LoraSpec("tiny", rank=4, seed=3)
    warmup = [Datum(d.model_input, d.target_tokens, weights=np.ones(d.length, np.float32)) for d in data]

    def grads(tc_model) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in M.trainable_params(tc_model)}

    local = LocalBackend(Local(device="cpu"), "tiny", None, tmp_path / "local", seed=0)
    try:
        tc = local.create_training_client(spec).result()
        tc.forward_backward(warmup, "cross_entropy")  # one step off LoRA's B = 0, so every tensor has a gradient
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        want = tc.forward_backward_custom(data, dpo_loss_fn(ref, 0.1)).result()
        want_grads = grads(tc.model)

        remote = TinkerBackend(Tinker(), "tiny", "tiny")
        try:
            rtc = remote.create_training_client(spec).result(60)
            rtc.forward_backward(warmup, "cross_entropy")
            rtc.optim_step(AdamParams(learning_rate=1e-2)).result(60)
            got = rtc.forward_backward_custom(data, dpo_loss_fn(ref, 0.1)).result(60)
            (model_id,) = {r.model_id for r in mock_tinker.submits("forward_backward")}
            got_grads = grads(mock_tinker.training_client(model_id).model)  # the engine's, before the session ends
        finally:
            remote.close()
        # The SDK really made two passes: a forward, then a forward_backward with weights = −dloss/dlogprobs.
        passes = [(r.route, r.forward_only) for r in mock_tinker.submits("forward_backward")]
        assert passes[-2:] == [("forward_backward", True), ("forward_backward", False)]
    finally:
        local.close()
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    assert got.metrics["dpo_loss"] == pytest.approx(want.metrics["dpo_loss"], rel=1e-5)
    assert want_grads.keys() == got_grads.keys() and want_grads
    worst = max(float((got_grads[n] - want_grads[n]).abs().max() / want_grads[n].abs().max()) for n in want_grads)
    assert worst <= 1e-5, worst
    assert all(float(g.abs().max()) > 0 for g in want_grads.values())


# ---------------------------------------------------------------- data


def test_both_formats_ties_and_rendering(tmp_path, capsys):
    path = write_rows(tmp_path / "p.jsonl", [pair_row(1), pair_row(2, "cookbook", "A"), pair_row(3, "cookbook", "B"),
                                             pair_row(4, "cookbook", "Tie"), pair_row(5, "cookbook", "Tie")])
    loaded = load_pairs(Jsonl(str(path)))
    assert (loaded.rows, loaded.ties, len(loaded.pairs)) == (5, 2, 3)
    assert "2 of 5 rows are ties" in capsys.readouterr().err
    for p, i in zip(loaded.pairs, (1, 2, 3), strict=True):  # whatever the position, the right answer is chosen
        assert p.chosen[0]["content"] == str(i + 1) and p.rejected[0]["content"] == "no idea"
    assert [p.where for p in loaded.pairs] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    # Rendering: weight 1 on the completion's content and end of turn, 0 on the prompt and its generation header.
    tokens, w = render_completion(TOK, loaded.pairs[0].prompt, loaded.pairs[0].chosen)
    trained = TOK.decode([t for t, x in zip(tokens, w, strict=True) if x])
    assert trained == "2<|im_end|>\n"
    assert TOK.decode(tokens).endswith("<|im_start|>assistant\n2<|im_end|>\n")
    # The dry-run plan reports the ties.
    recipe = dpo_recipe(tmp_path, path, algo={"test_size": 1, "batch_size": 1})
    run(recipe, "d", dry_run=True)
    out = capsys.readouterr().out
    assert "3 pairs from" in out and "(2 ties dropped)" in out and "compute_logprobs on the reference" in out


@pytest.mark.parametrize("line, message", [
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": "a"}', "no 'rejected'"),
    ('{"comparison": {"prompt_conversation": [], "completion_A": "a", "completion_B": "b"}, "label": "A"}',
     '"comparison.prompt_conversation" must be a non-empty list'),
    (('{"comparison": {"prompt_conversation": [{"role": "user", "content": "q"}], "completion_A": "a", '
      '"completion_B": "b"}, "label": "C"}'), '"label" must be one of "A", "B", "Tie", got \'C\''),
    ('{"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}', r"prompt\[0\].content must be a string"),
    ("[1, 2]", "expected an object"),
    ("{not json", "not valid JSON"),
])
def test_bad_rows_are_one_line_naming_file_and_line_exit_2(tmp_path, capsys, monkeypatch, line, message):
    from runner.cli import main

    path = write_rows(tmp_path / "bad.jsonl", [pair_row(1), pair_row(2), line])
    with pytest.raises(UserError, match=rf"^{path}:3: .*{message}"):
        load_pairs(Jsonl(str(path)))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.toml").write_text(f'[recipes.d]\nalgo = {{kind = "dpo", data = {{kind = "jsonl", path = "{path}"}}}}\n')
    assert main(["run", "r.toml#d"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: r.toml#d: algo.data: {path}:3: ") and err.count("\n") == 1  # from the check
    assert not (tmp_path / "runs").exists()  # nothing was created: the data is read first


def test_a_prompt_that_fills_max_length_is_an_error_naming_the_row(tmp_path):
    long = {"prompt": [{"role": "user", "content": "x" * 100}], "chosen": "a", "rejected": "b"}
    path = write_rows(tmp_path / "p.jsonl", [pair_row(1), long, pair_row(2)])
    cfg = msgspec.convert({"kind": "dpo", "data": {"kind": "jsonl", "path": str(path)}, "max_length": 64,
                           "batch_size": 1}, DPO)
    algo = DPOAlgo(cfg, load_pairs(cfg.data), Settings.make(TOK))
    with pytest.raises(UserError, match=rf"{path}:2: the prompt fills algo.max_length = 64 tokens"):
        algo.datums(algo.data.pairs[1])


# ---------------------------------------------------------------- through the loop


def test_the_ties_note_is_said_once(tmp_path, capsys):
    """A chain's dry run reads the same comparisons in two stages (the reward model and the RL stage that prices it):
    the note about its ties prints once."""
    path = write_rows(tmp_path / "t.jsonl", [pair_row(1), pair_row(2, "cookbook", "Tie")])
    first, second = load_pairs(Jsonl(str(path))), load_pairs(Jsonl(str(path)))
    assert first.ties == second.ties == 1  # both counted
    assert capsys.readouterr().err.count("1 of 2 rows are ties") == 1


def test_dpo_runs_on_the_local_backend(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [pair_row(i) for i in range(16)] + [pair_row(99, "cookbook", "Tie")])
    run(dpo_recipe(tmp_path, path), "d")
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]  # 2 steps, then the final eval at step = total steps
    first = rows[0]
    assert first["num_pairs"] == 4 and first["data/ties_dropped"] == 1 and first["num_tokens"] > 0
    # Before any update the policy is the reference: every Δ is 0 (up to the sampler's vs the trainer's rounding).
    assert first["dpo_loss"] == pytest.approx(np.log(2), abs=1e-3)
    assert abs(first["chosen_reward"]) < 1e-3 and abs(first["margin"]) < 1e-3
    assert rows[1]["margin"] > 0.01  # one update later the chosen side gained on the rejected side
    for r in rows[:2]:
        assert {"dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward", "optim/grad_norm",
                "test/dpo_loss", "test/accuracy", "test/margin"} <= r.keys()
    assert set(rows[2]) == {"step", "test/dpo_loss", "test/accuracy", "test/margin", "test/chosen_reward",
                            "test/rejected_reward"}
    assert rows[2]["test/margin"] > rows[1]["test/margin"]


def test_dpo_runs_through_the_tinker_sdk(tmp_path, mock_tinker):
    """The same algorithm over the real SDK and backends/serve: reference logprobs from a base-model sampling client,
    the custom loss as the SDK's two passes, evals as forwards, the final eval on the final sampler weights."""
    path = write_rows(tmp_path / "p.jsonl", [pair_row(i) for i in range(16)])
    recipe = dpo_recipe(tmp_path, path, model="Qwen/Qwen3-8B", tokenizer="tiny", backend={"kind": "tinker"})
    mock = mock_tinker
    run(recipe, "d")
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Step 0: the policy is the reference (LoRA starts at B = 0), so Δ = 0 up to sampler-vs-trainer float noise.
    assert rows[0]["dpo_loss"] == pytest.approx(np.log(2), abs=1e-4)
    assert rows[1]["margin"] > 0 and rows[2]["test/margin"] > 0
    # Per step: forward (the eval), then the custom loss's two passes, then optim_step, in one FIFO.
    training = mock.submits("forward_backward", "optim_step")
    kinds = ["forward" if r.forward_only else r.route for r in training]
    assert kinds == ["forward", "forward", "forward_backward", "optim_step"] * 2
    assert [r.n_datums for r in training[:3]] == [16, 8, 8]  # 8 held-out pairs, then 4 pairs x 2 sides
    sessions = [r.body for r in mock.records if r.route == "create_sampling_session"]
    assert sessions[0].get("base_model") == "Qwen/Qwen3-8B" and sessions[0].get("model_path") is None
    assert "/sampler_weights/" in sessions[-1]["model_path"]  # the final eval's policy


class RecordingBackend:
    """The wrapped backend, recording create_sampling_client's arguments."""

    def __init__(self, inner: Any, log: list[dict[str, Any]]):
        self.inner, self.log = inner, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> Any:
        self.log.append({"model_path": model_path, "base_model": base_model})
        return self.inner.create_sampling_client(model_path=model_path, base_model=base_model)


def test_reference_is_the_initial_weights_after_a_resume(tmp_path):
    """A run that crashes and resumes from its checkpoint ends with the uninterrupted run's metrics exactly, every
    DPO number included: its reference is still the base model, not the resumed weights (the cookbook's bug)."""
    from crashing import CrashingBackend

    from backends.base import BackendError
    from backends.local import LocalBackend

    path = write_rows(tmp_path / "p.jsonl", [pair_row(i) for i in range(40)])

    def recipe(run_dir: str) -> Recipe:
        return msgspec.structs.replace(dpo_recipe(tmp_path, path, max_steps=6, eval_every=2, save_every=2,
                                                  depth=2), log_dir=str(tmp_path / run_dir))

    run(recipe("straight"), "d")
    want = metrics(tmp_path / "straight")
    assert len(want) == 7 and want[-1]["step"] == 6

    crashed = recipe("crashed")
    inner = LocalBackend(crashed.backend, crashed.model, crashed.tokenizer, tmp_path / "crashed" / "checkpoints")

    class Crashing(CrashingBackend):  # DPO trains through forward_backward_custom
        def create_training_client(self, spec: Any) -> Any:
            def wrap(tc: Any) -> Any:
                left = [5]
                custom = tc.forward_backward_custom

                def fbc(*args: Any) -> Any:
                    left[0] -= 1
                    if left[0] < 0:
                        raise BackendError("simulated crash", request="forward_backward_custom")
                    return custom(*args)

                tc.forward_backward_custom = fbc
                return tc

            return self.inner.create_training_client(spec).map(wrap)

    with pytest.raises(BackendError, match="simulated crash"):
        run(crashed, "d", backend=Crashing(inner, None))
    resume_at = json.loads((tmp_path / "crashed" / "checkpoints.jsonl").read_text().splitlines()[-1])["next_step"]
    assert 0 < resume_at < 6
    calls: list[dict[str, Any]] = []
    backend = RecordingBackend(LocalBackend(crashed.backend, crashed.model, crashed.tokenizer,
                                            tmp_path / "crashed" / "checkpoints"), calls)
    run(crashed, "d", backend=backend)
    assert metrics(tmp_path / "crashed") == want
    # The resumed session's reference: the base model, by name (then the final eval loads the final weights).
    assert calls[0] == {"model_path": None, "base_model": "tiny"}
    assert calls[-1]["model_path"] is not None and "final" in calls[-1]["model_path"]


def test_reference_path_is_used_when_given():
    """A chained recipe's initial weights (runner/engine/chain.py passes the upstream's final sampler weights)."""
    cfg = msgspec.convert({"kind": "dpo", "data": {"kind": "jsonl", "path": "x"}}, DPO)
    calls: list[dict[str, Any]] = []

    class Backend:
        def create_sampling_client(self, model_path=None, base_model=None):
            from backends.base import Future

            calls.append({"model_path": model_path, "base_model": base_model})
            return Future.completed("client")

    async def go(algo: DPOAlgo) -> Any:
        return await algo.reference(Backend())

    pairs = load_pairs(Jsonl(str(COMPARISONS)))
    assert asyncio.run(go(DPOAlgo(cfg, pairs, Settings.make(TOK, reference_path="/up/sampler")))) == "client"
    asyncio.run(go(DPOAlgo(cfg, pairs, Settings.make(TOK, model="base"))))
    assert calls == [{"model_path": "/up/sampler", "base_model": None}, {"model_path": None, "base_model": "base"}]
    lines = DPOAlgo(cfg, pairs, Settings.make(TOK, reference_path="/up/sampler")).describe()
    assert any("reference: the initial weights, sampler weights /up/sampler" in line for line in lines)


@pytest.mark.slow
def test_dpo_learns_the_shipped_comparisons(tmp_path):
    """A short run on examples/data/comparisons.jsonl: held-out accuracy climbs well above its start."""
    recipe = msgspec.convert({
        "algo": {"kind": "dpo", "data": {"kind": "jsonl", "path": str(COMPARISONS)}, "batch_size": 16,
                 "test_size": 64},
        "lr": 5e-3, "lora": {"rank": 8}, "max_steps": 20, "eval_every": 10, "save_every": 0,
        "backend": {"kind": "local", "device": "cpu"}, "log_dir": str(tmp_path / "run"),
    }, Recipe)
    run(recipe, "d")
    rows = metrics(tmp_path / "run")
    evals = [r for r in rows if "test/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]  # two periodic evals and the final one
    # Step 0's policy is the reference (loss log 2, accuracy a coin toss on float noise); 20 steps later most
    # held-out pairs rank the right way, by a clear margin.
    assert evals[0]["test/dpo_loss"] == pytest.approx(np.log(2), abs=1e-3)
    assert evals[-1]["test/accuracy"] >= 0.8 and evals[-1]["test/dpo_loss"] < 0.45, evals[-1]
    assert np.mean([r["dpo_loss"] for r in rows[-6:-1]]) < 0.5


# ---------------------------------------------------------------- the reward model


def rm_algo(path: Path, **over: Any) -> RewardModelAlgo:
    cfg = msgspec.convert({"kind": "reward_model", "data": {"kind": "jsonl", "path": str(path)}, "batch_size": 1,
                           **over}, RewardModel)
    return RewardModelAlgo(cfg, load_pairs(cfg.data), Settings.make(TOK))


def test_reward_model_renders_both_orders(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [pair_row(3, "cookbook", "B"), pair_row(4)])
    algo = rm_algo(path)
    pair = algo.data.pairs[0]
    first, second = orders(TOK, pair, 2048)
    a, b = TOK.convert_tokens_to_ids(["A", "B"])
    assert (first.label, first.other, second.label, second.other) == (a, b, b, a)
    text1, text2 = TOK.decode(first.prefix), TOK.decode(second.prefix)
    assert text1.endswith("<|im_start|>assistant\n") and "Which completion is better, A or B?" in text1
    assert "user: What is 3 + 1?\n\nCompletion A: 4\n\nCompletion B: no idea\n\n" in text1
    assert "user: What is 3 + 1?\n\nCompletion A: no idea\n\nCompletion B: 4\n\n" in text2
    assert judge_messages(pair.prompt, pair.chosen, pair.rejected)[0]["content"] in text1
    d = to_datum(second)
    assert d.target_tokens.shape == (d.length, 2) and d.weights is not None
    assert d.weights.sum() == 1 and d.weights[-1, 0] == 1  # one trained token: the preferred label
    assert list(d.target_tokens[-1]) == [b, a] and list(d.full_sequence) == [*second.prefix, b]


def test_dpo_accuracy_counts_a_tie_as_half():
    """Policy == reference up to rounding (step 0: the trainer's and the sampler's sums of the same weights differ
    in the last bits) is a tie, counted 1/2, whichever way the noise falls; a real preference still counts 0 or 1."""
    ref = np.array([-40.0, -55.0, -30.0, -31.0])
    noise = np.array([3e-6, -2e-6, -1e-6, 4e-6])  # ~1e-7 relative, as measured at dpo_basic's step 0
    assert dpo_stats(ref + noise, ref, 0.1)["accuracy"] == 0.5
    assert dpo_stats(ref, ref, 0.1)["accuracy"] == 0.5
    moved = ref + np.array([0.5, -0.5, -0.2, 0.3])  # pair 1 right, pair 2 wrong
    assert dpo_stats(moved, ref, 0.1)["accuracy"] == 0.5
    assert dpo_stats(moved[:2], ref[:2], 0.1)["accuracy"] == 1.0 and dpo_stats(moved[2:], ref[2:], 0.1)["accuracy"] == 0.0
    # one tie and one right pair: 0.75
    assert dpo_stats(np.concatenate([moved[:2], ref[2:]]), ref, 0.1)["accuracy"] == 0.75


def test_reward_model_accuracy_counts_a_tie_as_half():
    """A judge that says "A" whatever the order (both orders' P cancel to 0.5) has no preference: 1/2, not 0."""
    label = np.array([-0.3, -1.5, -0.3, -1.5])
    other = np.array([-1.5, -0.3, -1.5, -0.3])
    assert judge_stats(label, other)["accuracy"] == 0.5


def test_reward_model_accuracy_metric():
    """Per comparison, P(preferred) averaged over its two orders must exceed 0.5; nll is −lp(preferred label)."""
    # Two comparisons, each as (order 1, order 2): logprobs of the preferred label and of the other label.
    label = np.array([-0.1, -3.0, -0.2, -0.4])
    other = np.array([-2.5, -0.2, -3.0, -2.0])
    # comparison 1: σ(2.4) = 0.917 and σ(−2.8) = 0.057, mean 0.487: wrong (sure in one order, wrong in the other);
    # comparison 2: σ(2.8) = 0.943 and σ(1.6) = 0.832: right
    assert judge_stats(label, other) == pytest.approx({"nll": (0.1 + 3.0 + 0.2 + 0.4) / 4, "accuracy": 0.5})
    assert judge_stats(label[2:], other[2:])["accuracy"] == 1.0 and judge_stats(label[:2], other[:2])["accuracy"] == 0.0


def test_judge_prob_is_a_symmetric_probability(tmp_path):
    from backends.local import LocalBackend
    from backends.local.local_config import Local
    from runner.rewards.judge import judge_prob

    backend = LocalBackend(Local(device="cpu"), "tiny", None, tmp_path / "store", seed=0)
    try:
        client = backend.create_sampling_client(base_model="tiny").result()

        async def both(prompt: Any, a: Any, b: Any) -> tuple[float, float]:
            return (await judge_prob(client, TOK, prompt, a, b), await judge_prob(client, TOK, prompt, b, a))

        for prompt, a, b in [("What is 2 + 3?", "5", "Well, let me think. 7"),
                             ([{"role": "user", "content": "Say yes."}], [{"role": "assistant", "content": "yes"}],
                              [{"role": "assistant", "content": "no"}])]:
            p, q = asyncio.run(both(prompt, a, b))
            assert 0.0 <= p <= 1.0 and 0.0 <= q <= 1.0
            assert p + q == pytest.approx(1.0, abs=1e-6)
            assert abs(p - 0.5) > 1e-4  # the two completions are judged differently
    finally:
        backend.close()


def test_reward_model_runs_on_the_local_backend(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [pair_row(i, "cookbook", "AB"[i % 2]) for i in range(16)])
    recipe = msgspec.convert({
        "algo": {"kind": "reward_model", "data": {"kind": "jsonl", "path": str(path)}, "batch_size": 4,
                 "test_size": 4},
        "lr": 5e-3, "lora": {"rank": 4}, "max_steps": 2, "eval_every": 1, "save_every": 1,
        "backend": {"kind": "local", "device": "cpu"}, "log_dir": str(tmp_path / "run"),
    }, Recipe)
    run(recipe, "m")
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["num_sequences"] == 8 and {"train_mean_nll", "accuracy", "test/nll", "test/accuracy"} <= rows[0].keys()
    assert rows[1]["train_mean_nll"] < rows[0]["train_mean_nll"]  # "A"/"B" after the question becomes likely
    # The final eval (sampling client, compute_logprobs) agrees with a forward on the same final weights: its nll is
    # the one a step-2 eval would log, to float noise, and below the first eval's.
    assert set(rows[2]) == {"step", "test/nll", "test/accuracy"} and rows[2]["test/nll"] < rows[0]["test/nll"]


def test_shipped_comparisons_are_reproducible_and_small():
    from scripts import tiny_build

    rows = tiny_build.comparison_rows()
    assert COMPARISONS.read_text() == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    assert COMPARISONS.stat().st_size < 500_000
    labels = [r["label"] for r in rows]
    assert 0.4 < labels.count("A") / len(labels) < 0.6 and 0 < labels.count("Tie") < 0.1 * len(labels)
