"""OpenAI chat messages over runner's renderers: the `ChatFormat` that backends/serve/openai_api.py renders chat
completions with (`runner serve`'s /v1/chat/completions, and the verifiers env's in-process client), and
`runner serve`'s hooks (the model's renderer; local checkpoints named by run dir).

Tools (`tools` in a request) are declared the way the tool_use env declares them (runner/rl/envs/tool_use.py): in
the renderer's own format where it has one (Qwen3, DeepSeek V3, Kimi K2), else the plain `CALL name {json}` line
convention, whose calls come back as OpenAI `tool_calls` and whose `tool` results go in as `RESULT name: ...` user
messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backends.errors import UserError
from backends.serve.openai_api import LocalModel, OpenAIHooks
from runner.renderers import get_renderer
from runner.renderers.base import make_tool_call
from runner.rl.envs.tool_use import TOOL_FORMATS, parse_plain_calls, plain_text_prefix
from runner.rl.renderer import ChatRenderer


class RendererChat:
    """backends.serve.openai_api.ChatFormat over a ChatRenderer."""

    def __init__(self, chat: ChatRenderer):
        self.chat = chat
        self.native = chat.renderer.name in TOOL_FORMATS

    @property
    def tokenizer(self) -> Any:
        return self.chat.tokenizer

    @property
    def stop(self) -> list[str] | list[int]:
        return self.chat.stop

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        msgs = [self._message(m) for m in messages]
        if tools:
            system = ""
            if msgs and msgs[0]["role"] == "system":
                system = str(msgs.pop(0)["content"])
            declare = TOOL_FORMATS.get(self.chat.renderer.name) or plain_text_prefix
            msgs = [*declare(tools, system), *msgs]
        return self.chat.build_prompt(msgs)

    def _message(self, m: dict[str, Any]) -> dict[str, Any]:
        if self.native:
            return m
        if m["role"] == "tool":
            return {"role": "user", "content": f"RESULT {m.get('name') or 'tool'}: {m['content']}"}
        if m.get("tool_calls"):
            lines = [f"CALL {c['function']['name']} {c['function'].get('arguments') or '{}'}" for c in m["tool_calls"]]
            return {"role": m["role"], "content": "\n".join([m["content"], *lines]).strip()}
        return {k: v for k, v in m.items() if k in ("role", "content")}

    def reply(self, tokens: list[int]) -> tuple[dict[str, Any], bool]:
        r = self.chat.parse(tokens)
        msg: dict[str, Any] = {"content": r.text}
        content = r.message.get("content")
        if isinstance(content, list):
            thinking = "".join(p.get("thinking", "") for p in content if p.get("type") == "thinking")
            if thinking:
                msg["reasoning_content"] = thinking
        if self.native:
            calls = [{**c, "id": c.get("id") or f"call_{i}"} for i, c in enumerate(r.message.get("tool_calls", []))]
        else:
            found, _ = parse_plain_calls(r.text)
            calls = [make_tool_call(c.name, json.dumps(c.arguments), c.call_id) for c in found]
        if calls:
            msg["tool_calls"] = calls
        return msg, r.ended_on_stop


def chat_format(model_name: str, tokenizer: Any, renderer: str = "auto") -> RendererChat:
    return RendererChat(ChatRenderer(get_renderer(renderer, tokenizer, model_name=model_name)))


def local_model(spec: str) -> LocalModel | None:
    """A run dir (its last checkpoint), `RUN_DIR:NAME` (its checkpoint NAME) or a checkpoint folder (a local
    save's sampler weights or state); None when `spec` names none of these. The run's recipe gives the base model
    and the renderer."""
    from runner.engine.rundir import CHECKPOINTS, CONFIG, load_config, read_checkpoints

    path, name = Path(spec).expanduser(), None
    if not path.is_dir():
        head, sep, tail = spec.rpartition(":")
        if not (sep and Path(head).expanduser().is_dir()):
            return None
        path, name = Path(head).expanduser(), tail
    if (path / CHECKPOINTS).is_file():
        rows = [r for r in read_checkpoints(path) if r.get("sampler_path")]
        if not rows:
            raise UserError(f"run dir {spec} has no checkpoint with sampler weights")
        row = rows[-1] if name is None else next((r for r in rows if r.get("name") == name), None)
        if row is None:
            raise UserError(f"run dir {path} has no checkpoint {name!r}; it has: "
                            f"{', '.join(str(r.get('name')) for r in rows)}")
        folder, run = Path(row["sampler_path"]), path
    elif name is None and any((path / f).is_file() for f in ("state.json", "adapter_config.json")):
        folder = path
        run = path.parent.parent.parent if path.parent.parent.name == "checkpoints" else None
    else:
        return None
    if run is not None and (run / CONFIG).is_file():
        recipe = load_config(run / CONFIG)
        return LocalModel(recipe.model, folder, recipe.renderer)
    base = _base_of(folder)
    if base is None:
        raise UserError(f"{folder}: cannot tell its base model (no run dir config.toml above it)")
    return LocalModel(base, folder, None)


def _base_of(folder: Path) -> str | None:
    for name, key in (("state.json", "base_model"), ("adapter_config.json", "base_model_name_or_path")):
        try:
            value = json.loads((folder / name).read_text()).get(key)
        except (OSError, ValueError):
            continue
        if isinstance(value, str):
            return value
    return None


def serve_hooks(renderer: str | None = None) -> OpenAIHooks:
    """`runner serve`'s OpenAI hooks: each model's renderer is `renderer` when given, else a checkpoint's run's,
    else "auto" (the cookbook's for a model it knows, else the tokenizer's chat template)."""

    def chat(model_name: str, tokenizer: Any, run_renderer: str | None) -> RendererChat:
        return chat_format(model_name, tokenizer, renderer or run_renderer or "auto")

    return OpenAIHooks(chat=chat, local_model=local_model)
