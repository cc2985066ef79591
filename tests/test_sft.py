"""SFT: rendering and token weights, datums, data validation and order, and a real run on the tiny model.

Run: pytest tests/test_sft.py   (the local-backend run takes ~10 s on 2 cores)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from runner.algos.sft import SFTAlgo, to_datum
from runner.algos.sft_config import SFT
from runner.data.conversations import load_conversations
from runner.engine.loop import run
from runner.engine.spec import Settings
from runner.recipe.common import Python
from runner.recipe.schema import Recipe
from runner.recipe.sources import HF, Jsonl
from runner.renderers.chat_template import render  # the "hf" renderer: what "auto" gives the tiny model

TOK = build_tokenizer()
CONV = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
    {"role": "assistant", "content": "A2"},
]
SHIPPED = Path(__file__).resolve().parents[1] / "examples" / "data" / "chat_sft.jsonl"


def trained_spans(tok, tokens: list[int], weights: list[float]) -> list[str]:
    spans, cur = [], []
    for t, w in zip(tokens, weights, strict=True):
        if w:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize(
    "mode, want",
    [
        ("last_assistant_message", ["A2<|im_end|>\n"]),
        ("all_assistant_messages", ["A1<|im_end|>\n", "A2<|im_end|>\n"]),
        ("all_messages", [("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\n"
                           "A1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n")]),
    ],
)
def test_train_on_what(mode, want):
    tokens, weights = render(TOK, CONV, mode)
    assert TOK.decode(tokens) == TOK.apply_chat_template(CONV, tokenize=False)
    assert trained_spans(TOK, tokens, weights) == want


def test_any_template_works():
    """A template with a default system prompt and an assistant header that differs from the others:
    spans come from rendering prefixes, so nothing here is specific to ChatML."""
    tok = build_tokenizer()
    tok.chat_template = (
        "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\nDefault.<|im_end|>\n{%- endif %}"
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}{% if m['role'] == 'assistant' %} (bot){% endif %}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant (bot)\n{%- endif %}"
    )
    tokens, weights = render(tok, CONV[1:], "all_assistant_messages")
    assert tok.decode(tokens).startswith("<|im_start|>system\nDefault.")
    assert trained_spans(tok, tokens, weights) == ["A1<|im_end|>\n", "A2<|im_end|>\n"]


def test_datum_alignment_truncation_reduction():
    tokens, weights = render(TOK, CONV, "last_assistant_message")
    d = to_datum(tokens, weights, None, "none")
    assert d.model_input == tokens[:-1] and d.target_tokens.tolist() == tokens[1:]
    assert d.weights.tolist() == weights[1:]
    assert d.weights.sum() == len("A2") + 2  # "A2", <|im_end|>, "\n": one byte-level token each
    mean = to_datum(tokens, weights, None, "mean")
    assert mean.weights.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(mean.weights * d.weights.sum(), d.weights)
    # Truncation from the right: cut inside the trained answer, keeping its first byte.
    first = weights.index(1.0)
    cut = to_datum(tokens, weights, first + 1, "none")
    assert cut.length == first and cut.weights.sum() == 1.0
    assert to_datum(tokens[:1], weights[:1], None, "mean") is None


def write(path: Path, lines: list[str]) -> Jsonl:
    path.write_text("\n".join(lines) + "\n")
    return Jsonl(path=str(path))


def test_bad_rows_name_file_and_line(tmp_path):
    good = json.dumps({"messages": CONV})
    f = tmp_path / "d.jsonl"
    with pytest.raises(UserError, match=rf"{f}:3: not valid JSON"):
        load_conversations(write(f, [good, "", "{oops"]))
    with pytest.raises(UserError, match=rf"{f}:2: messages\[1\].content must be a string"):
        load_conversations(write(f, [good, json.dumps({"messages": [{"role": "user", "content": "x"},
                                                                     {"role": "assistant"}]})]))
    with pytest.raises(UserError, match=rf"{f}:1: expected an object with a \"messages\" list"):
        load_conversations(write(f, [json.dumps({"prompt": "x"})]))
    with pytest.raises(UserError, match="not found"):
        load_conversations(Jsonl(path=str(tmp_path / "missing.jsonl")))
    # A row with nothing to train on is caught when it is rendered, with its line.
    convs, where = load_conversations(write(f, [good, json.dumps({"messages": CONV[:2]})]))
    algo = SFTAlgo(SFT(data=Jsonl(path=str(f)), batch_size=1), convs, where, Settings.make(TOK))
    with pytest.raises(UserError, match=rf"{f}:2: no message to train on"):
        algo.datums([(convs[1], where[1])])


def test_split_shuffle_epochs():
    convs = [[{"role": "user", "content": str(i)}, {"role": "assistant", "content": "x"}] for i in range(23)]
    where = [f"f:{i + 1}" for i in range(23)]
    cfg = SFT(data=Jsonl(path="f"), batch_size=4, epochs=2, test_size=3)
    algo = SFTAlgo(cfg, convs, where, Settings.make(TOK, seed=5))
    assert algo.batches_per_epoch == 5 and algo.total_steps == 10  # 20 train rows; none left over here
    test = {w for _, w in algo.test_rows}
    epochs = [[w for s in range(e * 5, e * 5 + 5) for _, w in algo.rows_for(s)] for e in (0, 1)]
    for seen in epochs:
        assert len(seen) == len(set(seen)) == 20 and not test & set(seen)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    again = SFTAlgo(cfg, convs, where, Settings.make(TOK, seed=5))
    assert [w for _, w in again.rows_for(7)] == [w for _, w in algo.rows_for(7)]  # seeded
    assert SFTAlgo(cfg, convs, where, Settings.make(TOK, seed=5, max_steps=3)).total_steps == 3
    odd = SFT(data=Jsonl(path="f"), batch_size=6, test_size=3)
    # 20 // 6: last partial dropped
    assert SFTAlgo(odd, convs, where, Settings.make(TOK)).total_steps == 3
    with pytest.raises(UserError, match="larger than the 20 training rows"):
        SFTAlgo(SFT(data=Jsonl(path="f"), batch_size=21, test_size=3), convs, where, Settings.make(TOK))


def test_hf_folder_and_python_sources(tmp_path, monkeypatch):
    import datasets

    rows = [{"messages": CONV}, {"messages": CONV[1:3]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    convs, where = load_conversations(HF(name=str(tmp_path / "ds")))
    assert convs == [r["messages"] for r in rows] and where[1].endswith("[train][1]")

    (tmp_path / "mydata.py").write_text(
        "def rows(n):\n    return [{'messages': [{'role': 'user', 'content': str(i)}]} for i in range(n)]\n"
        "def broken():\n    raise RuntimeError('no network')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    convs, _ = load_conversations(Python(target="mydata:rows", args={"n": 3}))
    assert [c[0]["content"] for c in convs] == ["0", "1", "2"]
    with pytest.raises(UserError, match="raised RuntimeError: no network"):
        load_conversations(Python(target="mydata:broken"))
    sys.modules.pop("mydata", None)


def test_sft_nll_falls_on_shipped_data(tmp_path):
    """A short SFT run of the tiny model on the local backend: train and held-out NLL both fall."""
    recipe = msgspec.convert({
        "algo": {"kind": "sft", "data": {"kind": "jsonl", "path": str(SHIPPED)}, "batch_size": 8, "test_size": 16,
                 "max_length": 256},
        "lr": 3e-3, "lora": {"rank": 8}, "max_steps": 8, "eval_every": 7, "save_every": 0,
        "backend": {"kind": "local", "device": "cpu"}, "log_dir": str(tmp_path / "run"),
    }, Recipe)
    run(recipe, "sft")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    test = [r["test/nll"] for r in rows if "test/nll" in r]
    assert len(nll) == 8 and len(test) == 3  # before steps 0 and 7, and on the final weights (step 8)
    assert np.mean(nll[-3:]) < nll[0] - 0.1, nll
    assert test[2] < test[1] < test[0], test
    assert rows[-1]["step"] == 8


def test_resume_guard_names_what_changed():
    """The one resume guard (runner/data/position.py) every algorithm's load_state uses: a checkpoint's data
    position over data of another size is a one-line error, the same data resumes."""
    convs = [[{"role": "user", "content": str(i)}, {"role": "assistant", "content": "x"}] for i in range(23)]
    where = [f"f:{i + 1}" for i in range(23)]
    algo = SFTAlgo(SFT(data=Jsonl(path="f"), batch_size=4, test_size=3), convs, where, Settings.make(TOK))
    algo.load_state(algo.state(), 2)
    assert algo.next_step == 2
    with pytest.raises(UserError, match=r"^the training data changed since the checkpoint \(5 -> 20 rows\), so its "
                                        r"data position means nothing; use if_exists = \"overwrite\"$"):
        algo.load_state({**algo.state(), "train_rows": 5}, 2)
