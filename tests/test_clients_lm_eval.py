"""lm-evaluation-harness against a real `runner serve` (issue 40's "tests that run the real clients"), with
lm-eval's own API models as docs/openai.md shows them: `local-completions` (tokenizing on its side with the served
model's tokenizer folder) on loglikelihood tasks scored by `acc` (is_greedy) and on a generation task, and
`local-chat-completions` on a generation task. The tasks are local (a task YAML and a jsonl written into tmp_path,
nothing downloaded), built from the served model's own greedy continuations sampled through the API first, so a
correct server must score acc 1.0 on them, and 0.0 on the same continuations with their first character changed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_serve import REPO, runner_serve

pytestmark = pytest.mark.extras("lmeval")

TOKENIZER = REPO / "backends" / "local" / "assets" / "tiny"
# Prompts in the tiny model's chat format (its chat template written out: /v1/completions and lm-eval's tokenizer both
# read the special tokens in the text), which it continues with a few characters where a bare text mostly ends at once.
# Without the template's last newline: lm-eval moves a context's trailing whitespace into the continuation.
CONTEXTS = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant" for q in (
    "Name a fruit.", "What is 2+3?", "Say hello.", "Tell me about glimmerhorns.", "Write a poem.")]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("clients-lm-eval")
    mp = pytest.MonkeyPatch()
    for var, value in [("TINKER_TELEMETRY", "0"), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                       ("TRANSFORMERS_OFFLINE", "1"), ("OPENAI_API_KEY", "unused")]:
        mp.setenv(var, value)
    try:
        with runner_serve(tmp / "storage", "--device", "cpu") as (url, _):
            httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                       timeout=120).raise_for_status()  # the first request loads the model
            yield {"url": url, "tmp": tmp, "log": tmp / "storage.log"}
    finally:
        mp.undo()


def _write_task(folder: Path, name: str, rows: list[dict[str, Any]], body: str) -> None:
    """A local lm-eval task: `name`.yaml reading `name`.jsonl through the datasets `json` builder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
  cache_dir: {json.dumps(str(folder / "hf-datasets"))}
test_split: test
{body}""")


def _greedy_continuations(url: str, tokens: int) -> list[dict[str, Any]]:
    """Each context's greedy continuation through /v1/completions (temperature 0), with the sampler's logprobs;
    kept where lm-eval's own split of context + continuation into tokens gives back the sampled tokens (the tiny
    model's tokenizer is byte-level: a continuation that ends inside a UTF-8 character does not)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    rows = []
    for context in CONTEXTS:
        r = httpx.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": context, "max_tokens": tokens, "temperature": 0, "logprobs": 0,
            "return_token_ids": True}, timeout=120).json()["choices"][0]
        ids = r["token_ids"][:len(r["logprobs"]["tokens"])]
        text = r["text"]
        if len(text) >= 2 and tok.encode(context + text, add_special_tokens=False) == \
                [*tok.encode(context, add_special_tokens=False), *ids]:
            rows.append({"context": context, "continuation": text, "sampled": sum(r["logprobs"]["token_logprobs"])})
    assert len(rows) >= 3, rows
    return rows


def _evaluate(model: str, model_args: dict[str, Any], tasks: list[str], folder: Path, **kw: Any) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` on the tasks in `folder` alone (none of lm-eval's own)."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    out: Any = evaluator.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), log_samples=True,
                                  task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                                  bootstrap_iters=0, **kw)
    assert out is not None
    return out


def test_local_completions_loglikelihood_is_greedy_on_greedy_continuations(served):
    """lm-eval's loglikelihood requests (token ids, echo, max_tokens 1, logprobs 1) on the model's own greedy
    continuations: is_greedy (`acc`) is 1.0, their loglikelihoods are the sampler's logprobs of the same tokens; the
    same continuations with the first character changed score acc 0.0."""
    url, folder = served["url"], served["tmp"] / "tasks-ll"
    rows = _greedy_continuations(url, 6)
    wrong = [{**r, "continuation": ("q" if r["continuation"][0] == "x" else "x") + r["continuation"][1:]}
             for r in rows]
    body = """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{continuation}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""
    _write_task(folder, "runner_greedy", rows, body)
    _write_task(folder, "runner_not_greedy", wrong, body)
    # As docs/openai.md gives it: the served model's name, the completions URL, its tokenizer folder.
    args = {"model": "tiny", "base_url": f"{url}/v1/completions", "tokenizer": str(TOKENIZER), "num_concurrent": 2}
    out = _evaluate("local-completions", args, ["runner_greedy", "runner_not_greedy"], folder)
    results = out["results"]
    assert results["runner_greedy"]["acc,none"] == 1.0
    assert results["runner_not_greedy"]["acc,none"] == 0.0
    samples = out["samples"]["runner_greedy"]
    assert len(samples) == len(rows)
    for s in samples:
        loglikelihood, is_greedy = s["filtered_resps"][0]
        assert is_greedy is True
        assert loglikelihood == pytest.approx(rows[s["doc_id"]]["sampled"], abs=1e-4)
    assert "Traceback" not in served["log"].read_text()


def test_local_completions_and_chat_generate_the_greedy_replies(served):
    """generate_until through `local-completions` (token ids in, `until` as stop strings) and
    `local-chat-completions` (messages, the server's chat template): exact_match 1.0 against the greedy replies the
    same routes gave when asked directly."""
    url, folder = served["url"], served["tmp"] / "tasks-gen"
    questions = ["Name a fruit.", "What is 2+3?", "Say hello."]
    chat = [httpx.post(f"{url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 8},
        timeout=120).json()["choices"][0]["message"]["content"] for q in questions]
    assert any(chat), chat
    rows = _greedy_continuations(url, 8)
    body = """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
    _write_task(folder, "runner_chat", [{"prompt": q, "target": a} for q, a in zip(questions, chat, strict=True)],
                body)
    _write_task(folder, "runner_gen", [{"prompt": r["context"], "target": r["continuation"]} for r in rows], body)
    completions = _evaluate("local-completions", {
        "model": "tiny", "base_url": f"{url}/v1/completions", "tokenizer": str(TOKENIZER)}, ["runner_gen"], folder)
    assert completions["results"]["runner_gen"]["exact_match,none"] == 1.0
    chats = _evaluate("local-chat-completions", {
        "model": "tiny", "base_url": f"{url}/v1/chat/completions", "tokenized_requests": False,
        "num_concurrent": 2}, ["runner_chat"], folder, apply_chat_template=True)
    assert chats["results"]["runner_chat"]["exact_match,none"] == 1.0
    replies = [s["filtered_resps"][0] for s in sorted(chats["samples"]["runner_chat"], key=lambda s: s["doc_id"])]
    assert replies == chat
