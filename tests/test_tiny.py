"""The embedded "tiny" model: tokenizer, config, shipped checkpoint (backends/local/tiny.py), and the build tooling
that made it and the shipped example data (scripts/tiny_build.py)."""

import json
import random
from pathlib import Path

import pytest
import transformers

from backends.local import tiny
from scripts import tiny_build

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def shipped():
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny.TINY_DIR)
    model.eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny.TINY_DIR)


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🙂👍🏽 zwj 👩‍👩‍👧",
                                  "tabs\tand\nnewlines\r\n", "  leading and trailing  ", "e\u0301 combining",
                                  "\x00\x01 control", "<|im_end|> as text? no: " + "a" * 50])
def test_tokenizer_round_trips_bytes(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    if "<|" not in text:
        assert len(ids) == len(text.encode("utf-8"))  # one token per byte


def test_specials_are_single_tokens(tok):
    assert [tok.encode(s, add_special_tokens=False) for s in tiny.SPECIALS] == [[256], [257], [258]]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == 258 and tok.pad_token_id == 256 and len(tok) == 259
    # Nothing is added around plain encodes (no BOS): renderers control every token.
    assert tok.encode("hi") == [104, 105]


def test_chat_template_is_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages[:2], tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(text, add_special_tokens=False)


def test_render_chat_weights_assistant_content_and_eos(tok):
    messages = [{"role": "user", "content": "Reverse: abc"}, {"role": "assistant", "content": "cba"},
                {"role": "user", "content": "Again"}, {"role": "assistant", "content": "cba"}]
    ids, weights = tiny_build.render_chat(tok, messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode([i for i, w in zip(ids, weights) if w]) == "cba<|im_end|>cba<|im_end|>"


def test_random_tiny_saves_and_reloads(tmp_path, tok):
    path = tiny.save_random_tiny(tmp_path / "m", seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok2 = transformers.AutoTokenizer.from_pretrained(path)
    assert tok2.get_vocab() == tok.get_vocab() and tok2.chat_template == tok.chat_template
    assert (model.config.eos_token_id, model.config.pad_token_id) == (258, 256)
    assert transformers.GenerationConfig.from_pretrained(path).eos_token_id == 258
    logits = model(input_ids=__import__("torch").tensor([[257, 104, 105]])).logits
    assert logits.shape == (1, 3, 259)
    # Same seed, same weights.
    again = transformers.AutoModelForCausalLM.from_pretrained(tiny.save_random_tiny(tmp_path / "n", seed=3))
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_shipped_folder_is_small_and_in_range(shipped, tok):
    model, tok2 = shipped
    files = {p.name for p in tiny.TINY_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert sum(p.stat().st_size for p in tiny.TINY_DIR.iterdir()) <= 10 * 2**20
    assert 0.8e6 <= sum(p.numel() for p in model.parameters()) <= 1.2e6
    assert model.config.max_position_embeddings >= 1024
    assert tok2.get_vocab() == tok.get_vocab() and tok2.chat_template == tok.chat_template


def test_shipped_model_answers_small_sums_in_format(shipped):
    model, tok = shipped
    rng = random.Random(0)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(24)]
    replies = tiny_build.generate(model, tok, [[{"role": "user", "content": tiny.arithmetic_prompt(x, y)}] for x, y in pairs])
    assert all(ended and text.isdigit() for text, ended in replies), replies
    correct = sum(int(text) == x + y for (x, y), (text, _) in zip(pairs, replies))
    assert correct > len(pairs) // 2, replies


def _jsonl(name):
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def test_sft_data_shape():
    rows = _jsonl("chat_sft.jsonl")
    assert 300 <= len(rows) <= 600
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert set(roles) <= {"system", "user", "assistant"} and roles[-1] == "assistant"
        assert all(isinstance(m["content"], str) and m["content"] for m in r["messages"])
    assert sum(r["messages"][0]["role"] == "system" for r in rows) > 50
    assert sum(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in rows) > 50


def test_preference_data_shape():
    rows = _jsonl("preferences.jsonl")
    assert 100 <= len(rows) <= 300
    for r in rows:
        assert r["prompt"][-1]["role"] == "user"
        assert [m["role"] for m in r["chosen"]] == [m["role"] for m in r["rejected"]] == ["assistant"]
        assert r["chosen"][0]["content"] != r["rejected"][0]["content"]


def test_shipped_data_is_what_the_script_writes(tmp_path):
    for path in tiny_build.write_data(tmp_path):
        assert path.read_bytes() == (DATA / path.name).read_bytes(), path.name


def test_pretrain_is_deterministic(tmp_path):
    import safetensors.torch

    phases = ((2, 5e-3, 0.6, 0.5, False), (1, 2e-3, 0.9, 0.7, True))
    a = tiny_build.pretrain(tmp_path / "a", phases=phases, log_every=10**9)
    b = tiny_build.pretrain(tmp_path / "b", phases=phases, log_every=10**9)
    wa = safetensors.torch.load_file(a / "model.safetensors")
    wb = safetensors.torch.load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert transformers.AutoTokenizer.from_pretrained(a).chat_template == tiny.CHAT_TEMPLATE


def test_the_runtime_module_imports_neither_torch_nor_transformers():
    """`runner check` imports backends.local.tiny (recipes name `backends.local.tiny:task_prompts`): it must stay
    cheap. A fresh interpreter, so modules other tests loaded do not hide an import."""
    import subprocess
    import sys

    code = ("import sys, backends.local.tiny as t; rows = t.task_prompts(3, seed=1); "
            "assert len(rows) == 3 and rows[0]['messages'][0]['role'] == 'user'; "
            "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_build_tooling_is_not_packaged():
    """tools/ (pre-training, data generation) stays out of the wheel; the package keeps what runs."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(p == "tools" or p.startswith("tools.") for p in include)
    assert not hasattr(tiny, "pretrain") and not hasattr(tiny, "sft_conversations")
