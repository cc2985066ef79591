"""Our renderers (runner/renderers/) against tinker-cookbook 0.6.1's of the same names: token for token, weight
for weight, for every train_on_what, on the embedded tokenizer and two built with other families' specials;
generation prompts (with and without prefill), stop sequences and parse_response (stop / EOS / cut off / two
stops). Against the checked-in goldens always, and against the cookbook live when it imports."""

from __future__ import annotations

import json
from typing import Any

import pytest
from record_renderer_goldens import golden_path
from renderer_tokenizers import (
    CONVERSATIONS,
    ENDINGS,
    FIXED_DATE,
    PROBE,
    RENDERERS,
    REPLIES,
    TRAIN_ON_WHAT,
    plain_message,
    reply_tokens,
    spans,
    tokenizer,
    with_trainable,
)

from backends.errors import UserError
from runner.renderers import get_renderer

PAIRS = [(r, t) for r, toks in RENDERERS.items() for t in toks]


def ours(renderer_name: str, tokenizer_name: str) -> dict[str, Any]:
    tok = tokenizer(tokenizer_name)
    r = get_renderer(renderer_name, tok)
    if hasattr(r, "current_date"):
        r.current_date = FIXED_DATE  # type: ignore[attr-defined]
    out: dict[str, Any] = {"stop_sequences": r.get_stop_sequences(), "supervised": {}, "prompts": {}, "parse": {}}
    for cname, conv in CONVERSATIONS.items():
        for what in TRAIN_ON_WHAT:
            msgs = with_trainable(conv) if what == "customized" else conv
            try:
                tokens, weights = r.build_supervised_example(msgs, what)
                assert len(tokens) == len(weights)
                out["supervised"][f"{cname}/{what}"] = {"tokens": tokens, "trained": spans(weights)}
            except UserError:
                out["supervised"][f"{cname}/{what}"] = {"error": True}
        prefix = conv[:-1] if conv[-1]["role"] == "assistant" else conv
        for prefill in (None, "Sure"):
            try:
                out["prompts"][f"{cname}/{prefill}"] = r.build_generation_prompt(prefix, prefill=prefill)
            except UserError:
                out["prompts"][f"{cname}/{prefill}"] = {"error": True}
    for i, text in enumerate(REPLIES):
        for ending in ENDINGS:
            toks = reply_tokens(tok, r.get_stop_sequences(), text, ending)
            try:
                msg, term = r.parse_response(toks)
                out["parse"][f"{i}/{ending}"] = {"tokens": toks, "message": plain_message(msg),
                                                 "termination": str(term)}
            except UserError:
                out["parse"][f"{i}/{ending}"] = {"tokens": toks, "error": True}
    return out


def _errors_as_flags(d: dict[str, Any]) -> dict[str, Any]:
    """Which exception the cookbook raised is its own business; that both refuse is what must match."""
    for section in ("supervised", "prompts", "parse"):
        for k, v in d[section].items():
            if isinstance(v, dict) and "error" in v:
                d[section][k] = {**v, "error": True}
    return d


def _compare(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert got["stop_sequences"] == expected["stop_sequences"]
    for section in ("supervised", "prompts", "parse"):
        assert set(got[section]) == set(expected[section])
        for key in expected[section]:
            assert got[section][key] == expected[section][key], f"{section} {key}"


@pytest.mark.parametrize(("renderer", "tok"), PAIRS)
def test_matches_golden(renderer: str, tok: str) -> None:
    golden = json.loads(golden_path(renderer, tok).read_text())
    assert golden["probe"] == list(tokenizer(tok).encode(PROBE, add_special_tokens=False)), \
        "the test tokenizer changed since the goldens were recorded: rerun tests/record_renderer_goldens.py"
    expected = _errors_as_flags({k: golden[k] for k in ("stop_sequences", "supervised", "prompts", "parse")})
    got = ours(renderer, tok)
    _compare(expected, got)
    # The cases exercise something: most supervised cases render and train some token.
    rendered = [v for v in got["supervised"].values() if "tokens" in v]
    assert len(rendered) >= len(got["supervised"]) // 2
    assert any(v["trained"] for v in rendered)


@pytest.mark.extras("cookbook")
@pytest.mark.parametrize(("renderer", "tok"), PAIRS)
def test_matches_cookbook_live(renderer: str, tok: str) -> None:
    pytest.importorskip("tinker_cookbook.renderers")
    from renderer_tokenizers import reference

    _compare(_errors_as_flags(reference(renderer, tok)), ours(renderer, tok))
