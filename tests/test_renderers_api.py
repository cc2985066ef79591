"""The renderer registry, `auto`'s choice, the `hf` renderer, colorize and the errors a bad input gets."""

from __future__ import annotations

from typing import Any

import pytest
from renderer_tokenizers import CONVERSATIONS, tokenizer

from backends.errors import UserError
from runner.models import models
from runner.renderers import (
    TRAIN_ON_WHAT,
    Message,
    RenderContext,
    Rendered,
    Termination,
    colorize,
    get_renderer,
    names,
    pick_renderer,
    register,
)
from runner.renderers.base import REGISTRY
from runner.renderers.role_colon import RoleColonRenderer


def test_names_and_unknown_name() -> None:
    for name in ("auto", "hf", "role_colon", "llama3", "qwen3", "qwen3_disable_thinking", "qwen3_instruct",
                 "deepseekv3", "deepseekv3_thinking", "gpt_oss_medium_reasoning", "kimi_k2"):
        assert name in names()
    with pytest.raises(UserError, match="unknown renderer 'qwen9'.*role_colon"):
        get_renderer("qwen9", tokenizer("tiny"))


def test_register_adds_a_renderer_in_one_place() -> None:
    @register("test_shouty")
    class Shouty(RoleColonRenderer):
        def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
            return super().render_message({**message, "content": str(message["content"]).upper()}, ctx)

    try:
        r = get_renderer("test_shouty", tokenizer("tiny"))
        tokens, _ = r.build_supervised_example(CONVERSATIONS["single"])
        assert "PARIS." in tokenizer("tiny").decode(tokens)
        assert "test_shouty" in names()
        with pytest.raises(ValueError, match="twice"):
            register("test_shouty")(Shouty)
    finally:
        del REGISTRY["test_shouty"]


def test_auto() -> None:
    tiny, base = tokenizer("tiny"), tokenizer("llama3like")
    assert pick_renderer("meta-llama/Llama-3.2-1B", base) == "role_colon"
    assert pick_renderer("meta-llama/Llama-3.1-8B-Instruct", base) == "llama3"
    assert pick_renderer("Qwen/Qwen3-8B:some-checkpoint", tiny) == "qwen3"
    assert pick_renderer("openai/gpt-oss-20b", tiny) == "gpt_oss_no_sysprompt"
    assert pick_renderer("tiny", tiny) == "hf"  # a chat template
    assert pick_renderer("/some/base-model", base) == "role_colon"  # none
    assert get_renderer("auto", tiny, model_name="tiny").name == "hf"


@pytest.mark.extras("cookbook")
def test_auto_table_is_the_cookbooks() -> None:
    model_info = pytest.importorskip("tinker_cookbook.model_info")
    for model, renderer in ((n, m.renderer) for n, m in models().items() if m.renderer is not None):
        assert model_info.get_recommended_renderer_name(model) == renderer, model


def test_hf_renderer_trains_what_the_template_writes() -> None:
    tok = tokenizer("tiny")
    r = get_renderer("hf", tok)
    conv = CONVERSATIONS["multi"]
    tokens, weights = r.build_supervised_example(conv, "last_assistant_message")
    text = tok.decode(tokens)
    assert text == tok.apply_chat_template(conv, tokenize=False)
    trained = tok.decode([t for t, w in zip(tokens, weights, strict=True) if w])
    assert trained == "I cannot see a clock.\n\nSorry.<|im_end|>\n"
    _, all_w = r.build_supervised_example(conv, "all_assistant_messages")
    assert tok.decode([t for t, w in zip(tokens, all_w, strict=True) if w]).startswith("Hello! How can I help?")
    _, users = r.build_supervised_example(conv, "all_user_and_system_messages")
    assert "hello there" in tok.decode([t for t, w in zip(tokens, users, strict=True) if w])
    assert sum(users) < len(tokens) and sum(r.build_supervised_example(conv, "all_tokens")[1]) == len(tokens)
    prompt = r.build_generation_prompt(conv[:2])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in r.get_stop_sequences()
    reply = tok.encode("hi", add_special_tokens=False)
    assert r.parse_response([*reply, end]) == ({"role": "assistant", "content": "hi"}, Termination.STOP_SEQUENCE)
    assert r.parse_response(reply)[1] == Termination.MALFORMED
    with pytest.raises(UserError, match="renderer 'hf': the tokenizer has no chat template"):
        get_renderer("hf", tokenizer("llama3like"))


def test_bad_inputs_are_user_errors() -> None:
    r = get_renderer("qwen3", tokenizer("tiny"))
    with pytest.raises(UserError, match="unknown train_on_what 'everything'.*all_tokens"):
        r.build_supervised_example(CONVERSATIONS["single"], "everything")
    with pytest.raises(UserError, match="trainable"):
        r.build_supervised_example(CONVERSATIONS["single"], "customized")
    with pytest.raises(UserError, match="content"):
        r.build_supervised_example([{"role": "user"}], "all_messages")
    with pytest.raises(UserError, match="<\\|eot_id\\|>"):
        get_renderer("llama3", tokenizer("tiny"))
    with pytest.raises(UserError, match="<\\|im_end\\|>"):
        get_renderer("qwen3", tokenizer("llama3like"))
    assert set(TRAIN_ON_WHAT) >= {"last_assistant_turn", "all_tokens", "all_user_and_system_messages"}


def test_colorize() -> None:
    tok = tokenizer("tiny")
    r = get_renderer("role_colon", tok)
    tokens, weights = r.build_supervised_example(CONVERSATIONS["single"])
    plain = colorize(tokens, weights, tok, color=False)
    assert plain == "User: What is the capital of France?\n\nAssistant:[[ Paris.\n\nUser:]]"
    colored = colorize(tokens, weights, tok, color=True)
    assert "\x1b[32m Paris.\n\nUser:\x1b[0m" in colored
    with pytest.raises(ValueError):
        colorize(tokens, weights[:-1], tok)


def _roundtrip(name: str, tok_name: str, message: dict[str, Any]) -> dict[str, Any]:
    tok = tokenizer(tok_name)
    r = get_renderer(name, tok)
    tokens, weights = r.build_supervised_example([{"role": "user", "content": "q"}, message])
    reply = [t for t, w in zip(tokens, weights, strict=True) if w]
    parsed, term = r.parse_response(reply)
    assert term.is_clean
    return parsed


@pytest.mark.parametrize(("name", "tok"), [("qwen3", "qwendeepseek"), ("deepseekv3_thinking", "qwendeepseek"),
                                           ("kimi_k2", "harmonykimi"), ("gpt_oss_no_sysprompt", "harmonykimi")])
def test_trained_reply_parses_back(name: str, tok: str) -> None:
    thinking = [{"type": "thinking", "thinking": "think"}, {"type": "text", "text": "answer"}]
    parsed = _roundtrip(name, tok, {"role": "assistant", "content": thinking})
    assert parsed["content"] == thinking


def test_chat_renderer_over_a_renderer_keeps_sampled_tokens_across_turns() -> None:
    from runner.renderers.chat import ChatRenderer

    tok = tokenizer("tiny")
    chat = ChatRenderer(get_renderer("role_colon", tok))
    assert chat.stop == ["\n\nUser:"]
    with pytest.raises(UserError, match="stops on strings"):
        _ = chat.stop_tokens
    msgs = [{"role": "user", "content": "guess"}]
    first = chat.render(msgs)
    assert tok.decode(first.tokens) == "User: guess\n\nAssistant:"
    action = tok.encode(" 5\n\nUser:", add_special_tokens=False)
    reply = chat.parse(action)
    assert (reply.text, reply.ended_on_stop, reply.termination) == ("5", True, Termination.STOP_SEQUENCE)
    convo = [*msgs, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "higher"}]
    nxt = chat.extend(first, action, reply, convo)
    assert nxt.tokens[: len(first.tokens) + len(action)] == first.tokens + action
    assert tok.decode(nxt.tokens).endswith("User: higher\n\nAssistant:")
    cut = chat.parse(tok.encode(" 5", add_special_tokens=False))
    assert (cut.text, cut.ended_on_stop) == ("5", False)
    # qwen3 on the same tokenizer: the reply's reasoning is parsed out of the text
    q = ChatRenderer(get_renderer("qwen3", tok))
    parsed = q.parse(tok.encode("<think>\nhm\n</think>\n\n7", add_special_tokens=False) + q.stop_tokens)
    assert parsed.text == "7" and parsed.message["content"][0] == {"type": "thinking", "thinking": "hm"}


def test_show_says_what_auto_picks(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from runner.cli import main
    from runner.renderers.auto import auto_note

    assert auto_note("auto", "tiny") == "" and auto_note("qwen3", "Qwen/Qwen3-8B") == ""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "r.toml").write_text('[recipes.q]\nmodel = "Qwen/Qwen3-8B"\nbackend = {kind = "tinker"}\n'
                                     'algo = {kind = "sft", data = {kind = "jsonl", path = "d.jsonl"}}\n')
    assert main(["show", "r.toml#q"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("# renderer = qwen3: auto: the cookbook's renderer for Qwen/Qwen3-8B\n")
