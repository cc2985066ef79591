"""Tokenizers and cases for the renderer tests (tests/test_renderers.py, tests/record_renderer_goldens.py).

Tokenizers are built here, offline: the embedded `tiny` one (ChatML specials only), a Llama 3 style one
(<|begin_of_text|> as BOS, header and <|eot_id|> specials, no chat template: a base model's) and a Qwen +
DeepSeek one (ChatML and DeepSeek's fullwidth-bar specials, <think>/<tool_call> as ordinary added tokens as in
Qwen3, a chat template). The two built ones are byte-level BPE with a few merges, so a renderer that encodes
pieces the reference encodes whole (or the other way) gets different tokens.

`reference(...)` runs tinker-cookbook's renderer of the same name on a case and returns plain JSON, the shape the
goldens in tests/data/renderers/ hold.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from backends.tokenizer import load_tokenizer

TOKENIZERS = ("tiny", "llama3like", "qwendeepseek", "harmonykimi")

# Renderer names compared with the cookbook, and the tokenizers each runs on (the others lack its specials).
RENDERERS: dict[str, tuple[str, ...]] = {
    "role_colon": TOKENIZERS,
    "llama3": ("llama3like",),
    "qwen3": ("tiny", "qwendeepseek"),
    "qwen3_disable_thinking": ("tiny", "qwendeepseek"),
    "qwen3_instruct": ("tiny", "qwendeepseek"),
    "deepseekv3": ("qwendeepseek",),
    "deepseekv3_disable_thinking": ("qwendeepseek",),
    "deepseekv3_thinking": ("qwendeepseek",),
    "gpt_oss_no_sysprompt": ("harmonykimi",),
    "gpt_oss_low_reasoning": ("harmonykimi",),
    "gpt_oss_medium_reasoning": ("harmonykimi",),
    "gpt_oss_high_reasoning": ("harmonykimi",),
    "kimi_k2": ("harmonykimi",),
}

# gpt-oss's system prompt holds today's date: both sides get this one.
FIXED_DATE = "2026-01-01"

TRAIN_ON_WHAT = ("last_assistant_message", "last_assistant_turn", "all_assistant_messages", "all_messages",
                 "all_tokens", "all_user_and_system_messages", "customized")

_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ċ", "Ċ"), ("o", "u"), ("Ġ", "a"),
           ("a", "n"), ("Ġa", "n"), ("U", "s"), ("Us", "er"), ("<", "|"), ("|", ">"), ("Ġ", "h"), ("e", "l"),
           ("l", "o"), ("Ġh", "el"), ("Ġhel", "lo")]

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
                    "<|constrain|>"]
KIMI_SPECIALS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                 "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
PLAIN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _bpe(specials: list[str], plain: list[str]) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in _MERGES:
        vocab.setdefault(a + b, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    core.add_tokens([AddedToken(s, special=False, normalized=False) for s in plain])
    return core


@cache
def _build(name: str) -> Any:
    if name == "tiny":
        return load_tokenizer("tiny")
    if name == "llama3like":
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(LLAMA3_SPECIALS, []),
                                                   bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                                   clean_up_tokenization_spaces=False)
        return tok
    if name == "qwendeepseek":
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(QWEN_SPECIALS + DEEPSEEK_SPECIALS, PLAIN_ADDED),
                                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                                   clean_up_tokenization_spaces=False)
        tok.chat_template = CHATML_TEMPLATE
        return tok
    if name == "harmonykimi":
        return transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(HARMONY_SPECIALS + KIMI_SPECIALS, PLAIN_ADDED),
                                                    eos_token="<|return|>", clean_up_tokenization_spaces=False)
    raise KeyError(name)


def tokenizer(name: str) -> Any:
    """A fresh-enough tokenizer (cached: building is ~ms, but the cookbook deep-copies backends)."""
    return _build(name)


def _call(name: str, args: str) -> dict[str, Any]:
    return {"type": "function", "id": None, "function": {"name": name, "arguments": args}}


THINK = [{"type": "thinking", "thinking": "2+2 is 4."}, {"type": "text", "text": "It is 4."}]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single": [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "Paris."}],
    "system": [{"role": "system", "content": "You answer in one word."},
               {"role": "user", "content": "Colour of the sky?"},
               {"role": "assistant", "content": "Blue"}],
    "multi": [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "hello there"},
              {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me the time."},
              {"role": "assistant", "content": "I cannot see a clock.\n\nSorry."}],
    "empty": [{"role": "system", "content": ""},
              {"role": "user", "content": ""},
              {"role": "assistant", "content": "ok"}],
    "unicode": [{"role": "user", "content": "héllo 👋 世界 — ça va?"},
                {"role": "assistant", "content": "très bien ✓ 你好"},
                {"role": "user", "content": "ñ"},
                {"role": "assistant", "content": "🙂"}],
    "thinking": [{"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": THINK},
                 {"role": "user", "content": "and 3+3?"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "3+3 is 6."},
                                                   {"type": "text", "text": "6."}]}],
    "inline_think": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nhi"}],
    "ends_with_user": [{"role": "user", "content": "one"},
                       {"role": "assistant", "content": "two"},
                       {"role": "user", "content": "three"}],
    "tools": [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", '{"city": "Paris"}')]},
              {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1", "name": "get_weather"},
              {"role": "assistant", "content": "21 degrees."}],
}

# Reply texts sampled after a prompt; each is tried ending on the stop sequence, on EOS, and cut off.
REPLIES = ("hello there", "<think>\nhmm\n</think>\n\nAnswer: 4", "hmm</think>4",
           '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', "<tool_call>\n{\"name\"", "")


def spans(weights: list[float]) -> list[list[int]]:
    """[start, end) runs of trained tokens (weights are 0/1): what a golden stores instead of every weight."""
    out: list[list[int]] = []
    for i, w in enumerate(weights):
        if w not in (0, 1):
            raise ValueError(f"weight {w} at {i} is not 0 or 1")
        if w and out and out[-1][1] == i:
            out[-1][1] = i + 1
        elif w:
            out.append([i, i + 1])
    return out


def with_trainable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `customized` variant of a conversation: every other message trainable (the assistant ones here)."""
    return [{**m, "trainable": m["role"] != "user"} for m in messages]


def reply_tokens(tok: Any, stops: list[str] | list[int], text: str, ending: str) -> list[int]:
    body = list(tok.encode(text, add_special_tokens=False))
    if ending == "stop":
        first = stops[0]
        return body + (list(tok.encode(first, add_special_tokens=False)) if isinstance(first, str) else [first])
    if ending == "eos":
        return body + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    if ending == "double":
        first = stops[0]
        stop = list(tok.encode(first, add_special_tokens=False)) if isinstance(first, str) else [first]
        return body + stop + body + stop
    return body


ENDINGS = ("stop", "eos", "cut", "double")


# ---- the cookbook side ----------------------------------------------------------------------------------------
def _to_cookbook(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from tinker_cookbook.renderers import ToolCall

    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [ToolCall(id=c.get("id"), function=ToolCall.FunctionBody(**c["function"]))
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A parsed message as JSON: tool calls as dicts, unparsed ones by their raw text only."""
    out: dict[str, Any] = {}
    for k, v in message.items():
        if k == "tool_calls":
            out[k] = [c if isinstance(c, dict) else c.model_dump() for c in v]
        elif k == "unparsed_tool_calls":
            out[k] = [(c if isinstance(c, dict) else c.model_dump())["raw_text"] for c in v]
        else:
            out[k] = v
    return json.loads(json.dumps(out))


def reference(renderer_name: str, tokenizer_name: str) -> dict[str, Any]:
    """The cookbook's answers for every case of one renderer on one tokenizer (errors recorded as such)."""
    import logging
    import warnings

    import tinker_cookbook.renderers as cb

    logging.getLogger("tinker_cookbook").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gpt-oss warns about a second system message: the cases do that on purpose
        return _reference(cb, renderer_name, tokenizer_name)


def _reference(cb: Any, renderer_name: str, tokenizer_name: str) -> dict[str, Any]:
    tok = tokenizer(tokenizer_name)
    r = cb.get_renderer(renderer_name, tok)
    if hasattr(r, "current_date"):
        r.current_date = FIXED_DATE
    out: dict[str, Any] = {"stop_sequences": r.get_stop_sequences(), "supervised": {}, "prompts": {},
                           "parse": {}}
    for cname, conv in CONVERSATIONS.items():
        for what in TRAIN_ON_WHAT:
            msgs = with_trainable(conv) if what == "customized" else conv
            try:
                mi, w = r.build_supervised_example(_to_cookbook(msgs), train_on_what=cb.TrainOnWhat(what))
                out["supervised"][f"{cname}/{what}"] = {"tokens": mi.to_ints(), "trained": spans(w.tolist())}
            except Exception as e:  # noqa: BLE001 - recorded: ours must refuse the same case
                out["supervised"][f"{cname}/{what}"] = {"error": type(e).__name__}
        prefix = conv[:-1] if conv[-1]["role"] == "assistant" else conv
        for prefill in (None, "Sure"):
            key = f"{cname}/{prefill}"
            try:
                out["prompts"][key] = r.build_generation_prompt(_to_cookbook(prefix), prefill=prefill).to_ints()
            except Exception as e:  # noqa: BLE001
                out["prompts"][key] = {"error": type(e).__name__}
    for i, text in enumerate(REPLIES):
        for ending in ENDINGS:
            toks = reply_tokens(tok, r.get_stop_sequences(), text, ending)
            try:
                msg, term = r.parse_response(toks)
                out["parse"][f"{i}/{ending}"] = {"tokens": toks, "message": plain_message(dict(msg)),
                                                 "termination": str(term)}
            except Exception as e:  # noqa: BLE001
                out["parse"][f"{i}/{ending}"] = {"tokens": toks, "error": type(e).__name__}
    return out

# Encoded into every golden: a tokenizer built differently than when the goldens were recorded shows up here.
PROBE = " hello\n\nUser: <|im_end|> <think> <｜User｜> <|eot_id|> <|start|> <|im_middle|> héllo 👋"
