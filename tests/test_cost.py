"""Tokens, cost and budgets (runner/engine/cost.py, runner/engine/estimate.py, docs/cost.md) on the fake backend:
per-step counts against hand counts for SFT and RL, prices, totals across a resume, a budget that stops a run
and a larger one that finishes it, and the dry run's estimate of a chain.

Run: pytest tests/test_cost.py   (a few seconds, CPU only)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from backends.base import Future
from backends.errors import UserError
from backends.fake import FakeBackend
from backends.local.tiny import build_tokenizer
from runner.cli import main
from runner.engine.cost import BudgetReached, Usage, price_of
from runner.engine.loop import run
from runner.recipe.cost import Price
from runner.recipe.schema import Recipe

TOK = build_tokenizer()
CONV = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"}]
# Every row is the same conversation, so every datum has the same length: the rendered chat (byte-level tokenizer:
# one token per byte plus the <|im_start|>/<|im_end|> specials) less the last token (the datum's inputs).
DATUM = len(TOK.apply_chat_template(CONV, tokenize=True)["input_ids"]) - 1  # pyright: ignore[reportArgumentType,reportCallIssue]
PRICE = {"prefill": 1.0, "sample": 2.0, "train": 3.0}


def sft(tmp_path: Path, run_dir: str = "run", **over: Any) -> Recipe:
    data = tmp_path / "same.jsonl"
    data.write_text((json.dumps({"messages": CONV}) + "\n") * 24)
    raw = {"algo": {"kind": "sft", "data": {"kind": "jsonl", "path": str(data)}, "batch_size": 4},
           "lr": 0.05, "log_dir": str(tmp_path / run_dir), "eval_every": 0, "save_every": 2, "max_steps": 6, **over}
    return msgspec.convert(raw, Recipe)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def no_time(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]


def test_sft_counts_every_step_and_prices_it(tmp_path: Path) -> None:
    run(sft(tmp_path, price=PRICE), "t", backend=FakeBackend(TOK))
    rs = rows(tmp_path / "run")
    assert DATUM == 45 and [r["step"] for r in rs] == list(range(6))
    for k, r in enumerate(rs):
        assert (r["tokens/prefill"], r["tokens/sample"], r["tokens/train"]) == (0, 0, 4 * DATUM)
        assert r["tokens/total_train"] == r["tokens/total"] == (k + 1) * 4 * DATUM
        assert r["cost/step_usd"] == pytest.approx(4 * DATUM * 3.0 / 1e6)
        assert r["cost/total_usd"] == pytest.approx((k + 1) * 4 * DATUM * 3.0 / 1e6)


def test_sft_eval_forward_is_prefill(tmp_path: Path) -> None:
    """A held-out forward pass (eval steps 0 and 3) is billed as prefill, in the step it ran before."""
    run(sft(tmp_path, eval_every=3, algo={"kind": "sft", "data": {"kind": "jsonl", "path": str(tmp_path / "same.jsonl")},
                                           "batch_size": 4, "test_size": 4}), "t", backend=FakeBackend(TOK))
    rs = rows(tmp_path / "run")
    # 5 steps (20 train rows), then the final row: test/nll as compute_logprobs of each whole held-out chat.
    assert [r["tokens/prefill"] for r in rs] == [4 * DATUM, 0, 0, 4 * DATUM, 0, 4 * (DATUM + 1)]
    assert [r["tokens/train"] for r in rs] == [4 * DATUM] * 5 + [0]
    assert rs[-1]["tokens/total"] == 5 * 4 * DATUM + 2 * 4 * DATUM + 4 * (DATUM + 1)
    assert "cost/step_usd" in rs[0] and rs[-1]["cost/total_usd"] == 0.0  # local backend: free unless priced


class Tally(FakeBackend):
    """The fake backend, tallying by hand what it is asked for: per optim_step, the prompt and sampled tokens of
    every sample() and the tokens of every forward_backward() since the previous optim_step."""

    def __init__(self) -> None:
        super().__init__(TOK)
        self.steps: list[dict[str, int]] = []
        self.now = {"prefill": 0, "sample": 0, "train": 0}

    def _client(self, state: Any) -> Any:
        tc = super()._client(state)
        fb, optim, snap = tc.forward_backward, tc.optim_step, tc.save_weights_and_get_sampling_client

        def forward_backward(data: Any, loss_fn: Any, loss_config: Any = None) -> Any:
            self.now["train"] += sum(len(d.model_input) for d in data)
            return fb(data, loss_fn, loss_config)

        def optim_step(params: Any) -> Any:
            self.steps.append(self.now)
            self.now = {"prefill": 0, "sample": 0, "train": 0}
            return optim(params)

        tc.forward_backward, tc.optim_step = forward_backward, optim_step
        tc.save_weights_and_get_sampling_client = lambda: Future.completed(self._tally(snap().result()))
        return tc

    def _tally(self, sc: Any) -> Any:
        sample = sc.sample

        def counted(prompt: list[int], n: int, params: Any) -> Any:
            out = sample(prompt, n, params).result()
            self.now["prefill"] += len(prompt)
            self.now["sample"] += sum(len(s.tokens) for s in out.sequences)
            return Future.completed(out)

        sc.sample = counted
        return sc


def test_rl_counts_equal_a_hand_tally(tmp_path: Path) -> None:
    algo = {"kind": "rl", "env": {"kind": "arithmetic", "max_value": 9, "test_size": 0}, "group_size": 4,
            "groups_per_batch": 3, "max_tokens": 6}
    recipe = msgspec.convert({"algo": algo, "lr": 5e-3, "max_steps": 3, "eval_every": 0, "save_every": 0,
                              "depth": 0, "log_dir": str(tmp_path / "rl"), "price": PRICE}, Recipe)
    tally = Tally()
    run(recipe, "rl", backend=tally)
    rs = [r for r in rows(tmp_path / "rl") if "tokens/train" in r]
    assert len(rs) == 3 == len(tally.steps)
    for r, want in zip(rs, tally.steps, strict=True):
        assert want["sample"] > 0 and want["train"] > 0 and want["prefill"] > 0
        assert {k: r[f"tokens/{k}"] for k in want} == want
        assert r["cost/step_usd"] == pytest.approx(Usage(**want).usd(Price(**PRICE)))
    assert rs[-1]["tokens/total"] == sum(sum(s.values()) for s in tally.steps)


def test_totals_continue_after_resume(tmp_path: Path) -> None:
    run(sft(tmp_path, "straight", price=PRICE), "t", backend=FakeBackend(TOK))
    store = tmp_path / "store"
    run(sft(tmp_path, "resumed", price=PRICE, max_steps=3), "t", backend=FakeBackend(TOK, storage_dir=store))
    run(sft(tmp_path, "resumed", price=PRICE), "t", backend=FakeBackend(TOK, storage_dir=store))  # extended to 6
    got, want = no_time(rows(tmp_path / "resumed")), no_time(rows(tmp_path / "straight"))
    assert [r["tokens/total_train"] for r in got] == [(k + 1) * 4 * DATUM for k in range(6)]
    assert [{k: v for k, v in r.items() if k.startswith(("tokens/", "cost/"))} for r in got] == \
        [{k: v for k, v in r.items() if k.startswith(("tokens/", "cost/"))} for r in want]
    ckpts = [json.loads(line) for line in (tmp_path / "resumed" / "checkpoints.jsonl").read_text().splitlines()]
    assert ckpts[-1]["cost"]["train"] == 6 * 4 * DATUM


@pytest.mark.parametrize("depth", [0, 2])
def test_budget_stops_with_a_checkpoint_and_a_larger_one_finishes(tmp_path: Path, depth: int,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    per_step = 4 * DATUM
    store = tmp_path / "store"
    # 2.5 steps' tokens: steps 0-2 run (the third crosses the limit), step 3 does not start.
    recipe = sft(tmp_path, price=PRICE, depth=depth, save_every=0, budget={"tokens": int(2.5 * per_step)})
    with pytest.raises(BudgetReached, match=r"token budget reached: 540 of 450 tokens; stopped after 3 of 6 steps"):
        run(recipe, "t", backend=FakeBackend(TOK, storage_dir=store))
    assert "stopped after 3 of 6 steps" in capsys.readouterr().err
    assert [r["step"] for r in rows(tmp_path / "run")] == [0, 1, 2]
    ckpts = [json.loads(line) for line in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    assert [c["next_step"] for c in ckpts] == [3] and ckpts[0]["cost"]["train"] == 3 * per_step
    # The same budget again: nothing more starts, nothing is lost.
    with pytest.raises(BudgetReached, match="stopped after 3 of 6 steps"):
        run(recipe, "t", backend=FakeBackend(TOK, storage_dir=store))
    # A dollar budget with room for the rest: resumes at step 3 and finishes.
    more = msgspec.structs.replace(recipe, budget=msgspec.convert({"usd": 1.0}, type(recipe.budget)))
    run(more, "t", backend=FakeBackend(TOK, storage_dir=store))
    rs = rows(tmp_path / "run")
    assert [r["step"] for r in rs] == list(range(6)) and rs[-1]["tokens/total_train"] == 6 * per_step
    run(sft(tmp_path, "straight", price=PRICE, depth=depth, save_every=0), "t", backend=FakeBackend(TOK))
    assert [r["train_mean_nll"] for r in rs] == [r["train_mean_nll"] for r in rows(tmp_path / "straight")]


def test_prices_shipped_file_env_and_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def recipe(**over: Any) -> Recipe:
        return sft(tmp_path, **{"model": "Qwen/Qwen3-8B", "backend": {"kind": "tinker"}, **over})

    monkeypatch.delenv("RUNNER_PRICES", raising=False)
    assert price_of(recipe())[0] == Price(prefill=0.13, sample=0.40, train=0.40)
    assert price_of(recipe(model="someone/unlisted"))[0] is None
    with pytest.raises(UserError, match="budget.usd needs a price"):
        run(recipe(model="someone/unlisted", budget={"usd": 1}), "t", backend=FakeBackend(TOK))
    mine = tmp_path / "mine.toml"
    mine.write_text('[models."Qwen/Qwen3-8B"]\nprefill = 1\nsample = 2\ntrain = 3\n')
    monkeypatch.setenv("RUNNER_PRICES", str(mine))
    assert price_of(recipe())[0] == Price(**PRICE)
    other = tmp_path / "other.toml"
    other.write_text('[models."Qwen/Qwen3-8B"]\ntrain = 9\n')
    assert price_of(recipe(price_file=str(other)))[0] == Price(train=9)
    assert price_of(recipe(price_file=str(other), price={"train": 5}))[0] == Price(train=5)
    assert price_of(sft(tmp_path))[0] == Price()  # local: free (still counted), $RUNNER_PRICES aside...
    assert price_of(sft(tmp_path, model="Qwen/Qwen3-8B", price_file=str(other)))[0] == Price(train=9)  # ...not its own
    other.write_text('[models."Qwen/Qwen3-8B"]\ntrain = "cheap"\n')
    with pytest.raises(UserError, match="price_file"):
        price_of(recipe(price_file=str(other)))
    with pytest.raises(UserError, match="no such file"):
        price_of(recipe(price_file=str(tmp_path / "missing.toml")))
    with pytest.raises(msgspec.ValidationError, match="budget needs usd"):
        sft(tmp_path, budget={})


def test_dry_run_of_a_chain_prints_each_stage_and_the_total(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    sft(tmp_path)  # writes same.jsonl
    data = tmp_path / "same.jsonl"
    # Stage a: 24 rows, 4 per step, 6 steps; stage b (init_from a): 2 epochs of 8 per step, 6 steps, with an eval.
    (tmp_path / "chain.toml").write_text(f"""
[recipes.a]
max_steps = 6
eval_every = 0
price = {{prefill = 1.0, sample = 2.0, train = 3.0}}
algo = {{kind = "sft", data = {{kind = "jsonl", path = "{data}"}}, batch_size = 4}}

[recipes.b]
init_from = "#a"
eval_every = 0
price = {{prefill = 1.0, sample = 2.0, train = 10.0}}
algo = {{kind = "sft", data = {{kind = "jsonl", path = "{data}"}}, batch_size = 8, epochs = 2}}
""")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "chain.toml#b", "--dry-run"]) == 0
    out = capsys.readouterr().out
    a = re.search(r"cost of #a: estimate for (\d+) steps: prefill 0, sample 0, train ([\d,]+) tokens .* cost \$([\d.]+)",
                  out)
    b = re.search(r"cost of #b: estimate for (\d+) steps: prefill 0, sample 0, train ([\d,]+) tokens .* cost \$([\d.]+)",
                  out)
    total = re.search(r"total cost of the chain: \$([\d.]+); ([\d,]+) tokens", out)
    assert a and b and total, out
    assert (int(a[1]), int(a[2].replace(",", ""))) == (6, 6 * 4 * DATUM)
    assert (int(b[1]), int(b[2].replace(",", ""))) == (6, 6 * 8 * DATUM)
    assert float(a[3]) == pytest.approx(6 * 4 * DATUM * 3 / 1e6, abs=1e-4)
    assert float(b[3]) == pytest.approx(6 * 8 * DATUM * 10 / 1e6, abs=1e-4)
    assert float(total[1]) == pytest.approx(float(a[3]) + float(b[3]), abs=1e-4)
    assert int(total[2].replace(",", "")) == 18 * 4 * DATUM
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_cli_exit_code_3_when_the_budget_stops_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`runner run` of a chain whose upstream has a budget: it stops there (exit 3, one line, a checkpoint), and
    the downstream does not start. (The loop runs on the fake backend.)"""
    import runner.engine.loop as loop

    sft(tmp_path)  # writes same.jsonl
    data = tmp_path / "same.jsonl"
    (tmp_path / "chain.toml").write_text(f"""
[recipes.a]
max_steps = 6
eval_every = 0
save_every = 0
budget = {{tokens = 300}}
algo = {{kind = "sft", data = {{kind = "jsonl", path = "{data}"}}, batch_size = 4}}

[recipes.b]
init_from = "#a"
eval_every = 0
max_steps = 2
algo = {{kind = "sft", data = {{kind = "jsonl", path = "{data}"}}, batch_size = 4}}
""")
    monkeypatch.chdir(tmp_path)
    started: list[str] = []
    real_run = loop.run

    def run_on_fake(recipe: Recipe, name: str, **kw: Any) -> None:
        started.append(name)
        real_run(recipe, name, backend=FakeBackend(TOK, storage_dir=tmp_path / "store"), **kw)

    monkeypatch.setattr(loop, "run", run_on_fake)
    assert main(["run", "chain.toml#b"]) == 3
    assert started == ["a"] and not (tmp_path / "runs" / "b").exists()
    assert "token budget reached: 360 of 300 tokens; stopped after 2 of 6 steps" in capsys.readouterr().err
    assert [json.loads(x)["next_step"] for x in (tmp_path / "runs/a/checkpoints.jsonl").read_text().splitlines()] == [2]
