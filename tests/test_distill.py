"""On-policy distillation (runner/algos/distill.py): the teacher-KL math, multi-teacher runs through the loop on both
backends, and a teacher with another tokenizer refused by `runner check`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backends.types import Datum
from runner.algos.distill import apply_teacher_kl, prompts_from_chats
from runner.cli import main
from runner.engine.log import read_jsonl
from scripts.tiny_build import sft_conversations


def rl_datum(lps: list[float], mask: list[float], adv: float = 0.0) -> Datum:
    n = len(lps)
    return Datum(model_input=list(range(1, n + 1)), target_tokens=np.arange(2, n + 2), logprobs=np.array(lps),
                 advantages=np.full(n, adv), mask=np.array(mask))


def test_teacher_kl_math() -> None:
    d = [rl_datum([-1.0, -2.0, -0.5], [0, 1, 1]), rl_datum([-0.2, -0.1], [1, 1], adv=0.5)]
    teacher = [np.array([-3.0, -1.0, -1.5]), np.array([-0.2, -0.6])]
    out, m = apply_teacher_kl(d, teacher, [0, 1], coef=2.0, discount=0.0)
    # rkl = (student − teacher)·mask: [0, −1, 1] and [0, 0.5]; adv −= 2·rkl, no centring.
    assert np.allclose(out[0].advantages, [0.0, 2.0, -2.0]) and np.allclose(out[1].advantages, [0.5, -0.5])
    assert m == pytest.approx({"teacher_kl": 0.5 / 4, "teacher_kl/dataset_0": 0.0, "teacher_kl/dataset_1": 0.25})
    out, _ = apply_teacher_kl(d, teacher, [0, 1], coef=1.0, discount=0.5)
    # Discounted: an action token pays its own KL plus γ times what the later tokens pay (masked tokens nothing).
    assert np.allclose(out[0].advantages, [0.0, -(-1 + 0.5 * 1), -1.0])


def test_prompts_from_chats(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in sft_conversations(5)))
    prompts = prompts_from_chats(str(f))
    assert len(prompts) == 5 and all(p["messages"][-1]["role"] == "user" for p in prompts)


DISTILL = """
[recipes.teacher]
lr = 0.02
max_steps = 4
eval_every = 0
save_every = 0
{backend}
algo = {{kind = "sft", data = {{kind = "jsonl", path = "chats.jsonl"}}, batch_size = 8}}

[recipes.student]
lr = 0.01
max_steps = 2
eval_every = 1
save_every = 0
{backend}
[recipes.student.algo]
kind = "distill"
group_size = 2
max_tokens = 8

[[recipes.student.algo.datasets]]
prompts = {{kind = "python", target = "runner.algos.distill:prompts_from_chats", args = {{path = "chats.jsonl"}}}}
teacher = {{init_from = "#teacher"}}
groups_per_batch = 2
test_size = 2

[[recipes.student.algo.datasets]]
prompts = {{kind = "python", target = "runner.algos.distill:prompts_from_chats", args = {{path = "chats.jsonl"}}}}
groups_per_batch = 2
"""
LOCAL = 'backend = {kind = "local", device = "cpu"}'
TINKER = 'model = "Qwen/Qwen3-8B"\ntokenizer = "tiny"\nbackend = {kind = "tinker"}'


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_conversations(40, seed=5)))
    return tmp_path


def check_rows(proj: Path, min_kl: float = 0.05) -> None:
    rows = read_jsonl(proj / "runs" / "student" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]  # two steps, then the final eval
    first = rows[0]
    # Set 0's teacher was fine-tuned; set 1's is the base model, which the student still is at step 0: no KL.
    assert first["teacher_kl/dataset_0"] > min_kl
    assert abs(first["teacher_kl/dataset_1"]) < min(1e-3, min_kl / 10)
    assert "test/teacher_kl" in first and "test/teacher_kl" in rows[-1]


def test_multi_teacher_distillation_on_the_local_backend(proj: Path) -> None:
    (proj / "r.toml").write_text(DISTILL.format(backend=LOCAL))
    assert main(["run", "r.toml#student"]) == 0
    check_rows(proj)


def test_distillation_over_the_tinker_sdk(proj: Path, mocked_tinker: None) -> None:
    (proj / "r.toml").write_text(DISTILL.format(backend=TINKER))
    assert main(["run", "r.toml#student"]) == 0
    check_rows(proj)  # the service trains and samples the tiny model as the local backend does: the same bounds


def test_a_teacher_with_another_tokenizer_is_a_check_error(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    other.save_pretrained(proj / "other_tok")
    text = DISTILL.format(backend=LOCAL).replace(
        'prompts = {kind = "python", target = "runner.algos.distill:prompts_from_chats", args = {path = "chats.jsonl"}}\n'
        "groups_per_batch = 2\n",
        'prompts = {kind = "python", target = "runner.algos.distill:prompts_from_chats", args = {path = "chats.jsonl"}}\n'
        f'teacher = {{model = "{proj / "other_tok"}"}}\ngroups_per_batch = 2\n')
    (proj / "r.toml").write_text(text)
    assert main(["check", "r.toml#student"]) == 2
    err = capsys.readouterr().err
    assert "algo.datasets[1].teacher.model" in err and "its tokenizer" in err and err.count("\n") == 1
    assert not (proj / "runs").exists()


def test_distillation_in_async_mode(proj: Path) -> None:
    """The cookbook distils synchronously only; here any RL mode works: async K=1 samples one step behind."""
    text = DISTILL.format(backend=LOCAL).replace('kind = "distill"\n', 'kind = "distill"\n'
                                                  'mode = {kind = "async", max_staleness = 1, fixed_staleness = true}\n')
    (proj / "r.toml").write_text(text)
    assert main(["run", "r.toml#student"]) == 0
    rows = [r for r in read_jsonl(proj / "runs" / "student" / "metrics.jsonl") if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in rows] == [0, 1]


@pytest.mark.parametrize(("extra", "message"), [
    ({"num_substeps": 5}, "num_substeps must be <= groups_per_batch"),
    ({"mode": {"kind": "stream", "minibatches": 3}}, "stream mode: groups_per_batch must split evenly"),
    ({"temperature": 0.5, "numerics": {}}, "agree only at temperature = 1"),
])
def test_distill_has_rls_checks(extra: dict[str, object], message: str) -> None:
    """RL and Distill share one base struct (runner/recipe/schema.py OnPolicy) and its checks: a step of 4 groups
    (two prompt sets of 2) cannot be split into 5 substeps or 3 stream minibatches."""
    import msgspec

    from runner.algos.distill_config import Distill
    from runner.algos.rl_config import RL, OnPolicy

    data = {"kind": "jsonl", "path": "x.jsonl"}
    cfg = {"datasets": [{"prompts": data, "groups_per_batch": 2}, {"prompts": data, "groups_per_batch": 2}]}
    assert msgspec.convert(cfg, Distill).groups_per_batch == 4
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert({**cfg, **extra}, Distill)
    assert issubclass(RL, OnPolicy) and issubclass(Distill, OnPolicy)
