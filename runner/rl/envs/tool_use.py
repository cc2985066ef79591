"""`tool_use`: multi-turn tool calling (the cookbook's search_tool recipe, over our own tools and renderers).

The conversation opens with a system prompt that declares the tools in the renderer's own format (`TOOL_FORMATS`:
Qwen3's `<tools>` block and `<tool_call>{json}</tool_call>` calls, DeepSeek V3's `## Tools` section and
`<｜tool▁call▁begin｜>` calls, Kimi K2's `tool_declare` message), then the question. Each assistant turn either
calls tools (every call runs, its result comes back as a `tool` message) or answers; the episode ends at an answer
or after `max_turns` assistant turns. Renderers with no tool format (`hf`, `role_colon`, llama3, gpt-oss here) get
a plain-text convention instead, declared in the same system prompt: a call is a line

    CALL calculator {"expression": "2 + 3"}

and its result comes back as a user message `RESULT calculator: 5`.

reward = correct + format_coef·(format − 1): correct = the text after the last `answer_prefix` of the final reply
matches an accepted answer (normalized text, or equal numbers by runner/rewards/math_grading.py); format = an answer
was given with the prefix, the reply ended on its stop sequence, and no tool call in the episode was malformed.
Metrics: correct, format, turns, tool_calls, tool_errors (unknown tool, bad arguments, a tool that raised),
malformed (calls that did not parse), out_of_turns.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.errors import UserError
from backends.types import Json
from runner.data.conversations import load_rows
from runner.recipe.targets import import_target
from runner.renderers.chat import ChatRenderer, Message, ParsedReply
from runner.rewards.math_grading import extract_answer, grade
from runner.rewards.tools import BM25, Tool, ToolError, builtin_tools, load_docs, search_tool, tool_from_function
from runner.rl.envs.common import ChatEnv, EnvContext, EnvKind, RepeatGroupBuilder, group_datasets, split
from runner.rl.envs.tool_use_config import ToolUse
from runner.rl.types import EnvGroupBuilder, Logs, Observation, RLDataset, StepResult, StopCondition

if TYPE_CHECKING:
    from runner.recipe.common import DataSource

DEFAULT_SYSTEM_PROMPT = ("Solve the problem. You may call the tools below, one or more times, and read their "
                         "results; then give your final answer after \"Answer:\".")

# ---------------------------------------------------------------- tool formats, by renderer name


def _qwen3(specs: list[Json], system: str) -> list[Message]:
    # The cookbook's Qwen3Renderer.create_conversation_prefix_with_tools (HF's template text).
    lines = "\n".join(json.dumps({"type": "function", "function": s}, separators=(", ", ": ")) for s in specs)
    tools = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
             "You are provided with function signatures within <tools></tools> XML tags:\n"
             f"<tools>\n{lines}\n</tools>\n\n"
             "For each function call, return a json object with function name and arguments within "
             "<tool_call></tool_call> XML tags:\n<tool_call>\n"
             '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    return [{"role": "system", "content": f"{system}\n\n{tools}" if system else tools}]


def _deepseek(specs: list[Json], system: str) -> list[Message]:
    # The cookbook's DeepSeekV3 create_conversation_prefix_with_tools.
    blocks = "\n".join(f"### {s['name']}\nDescription: {s['description']}\n\nParameters: {json.dumps(s['parameters'])}"
                       for s in specs)
    tools = ("\n\n## Tools\nYou have access to the following tools:\n\n" + blocks
             + "\n\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
             "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments"
             "<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n\nWhere:\n"
             "- `tool_call_name` must be an exact match to one of the available tools\n"
             "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
             "- For multiple tool calls, chain them directly without separators or spaces")
    return [{"role": "system", "content": system + tools}]


def _kimi(specs: list[Json], system: str) -> list[Message]:
    payload = json.dumps([{"type": "function", "function": s} for s in specs], separators=(",", ":"), sort_keys=True)
    out: list[Message] = [{"role": "tool_declare", "content": payload}]
    return [*out, {"role": "system", "content": system}] if system else out


def plain_text_prefix(specs: list[Json], system: str) -> list[Message]:
    lines = "\n".join(json.dumps(s) for s in specs)
    tools = ("Tools (JSON schemas):\n" + lines + "\n\nTo call a tool, write a line\nCALL <tool name> <arguments as a "
             'JSON object>\nfor example: CALL calculator {"expression": "2 + 3"}\nEach result comes back as '
             '"RESULT <tool name>: <result>".')
    return [{"role": "system", "content": f"{system}\n\n{tools}" if system else tools}]


# Renderer name -> its tool declaration (system messages). Calls are parsed by the renderer's parse_response into
# `tool_calls` / `unparsed_tool_calls`. A renderer not listed here gets plain_text_prefix and `CALL` lines.
TOOL_FORMATS: dict[str, Callable[[list[Json], str], list[Message]]] = {
    "qwen3": _qwen3, "qwen3_disable_thinking": _qwen3, "qwen3_instruct": _qwen3,
    "deepseekv3": _deepseek, "deepseekv3_thinking": _deepseek,
    "kimi_k2": _kimi,
}

_CALL_LINE = re.compile(r"^[ \t]*CALL[ \t]+(\S+)[ \t]*(.*?)[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: Json
    call_id: str


def parse_plain_calls(text: str) -> tuple[list[Call], list[str]]:
    """`CALL name {json}` lines: (calls, errors of the malformed ones)."""
    calls, errors = [], []
    for i, m in enumerate(_CALL_LINE.finditer(text)):
        name, raw = m.group(1), m.group(2) or "{}"
        try:
            args = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(f"CALL {name}: arguments are not JSON ({e.msg})")
            continue
        if not isinstance(args, dict):
            errors.append(f"CALL {name}: arguments must be a JSON object")
            continue
        calls.append(Call(name, args, f"call_{i}"))
    return calls, errors


def parse_native_calls(message: Message) -> tuple[list[Call], list[str]]:
    """The renderer's parsed `tool_calls` (and `unparsed_tool_calls` as errors)."""
    calls, errors = [], [str(u.get("error", "unparsable tool call")) for u in message.get("unparsed_tool_calls", [])]
    for i, c in enumerate(message.get("tool_calls", [])):
        fn = c.get("function", c)
        raw = fn.get("arguments", "{}")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError as e:
            errors.append(f"{fn.get('name')}: arguments are not JSON ({e.msg})")
            continue
        if not isinstance(args, dict):
            errors.append(f"{fn.get('name')}: arguments must be a JSON object")
            continue
        calls.append(Call(str(fn.get("name")), args, str(c.get("id") or f"call_{i}")))
    return calls, errors


# ---------------------------------------------------------------- answers

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_text(s: str) -> str:
    """The cookbook's (SQuAD) normalize_answer: lowercase, no punctuation or articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", s).split())


def final_answer(text: str, prefix: str) -> str | None:
    if not prefix:
        return text.strip() or None
    at = text.lower().rfind(prefix.lower())
    if at < 0:
        return None
    return text[at + len(prefix) :].strip() or None


def answer_matches(given: str, accepted: Sequence[str]) -> bool:
    """Normalized text equal to an accepted answer, or (for a numeric answer) the same number."""
    number = extract_answer(given, "auto")
    for gold in accepted:
        if normalize_text(given) == normalize_text(gold):
            return True
        if grade(given, gold, "builtin") or (number is not None and grade(number, gold, "builtin")):
            return True
    return False


@dataclass(frozen=True)
class Problem:
    question: str
    answers: tuple[str, ...]
    where: str


def _answer_list(value: object) -> list[str]:
    values = value if isinstance(value, list) else [value]
    return [str(v) for v in values if isinstance(v, (str, int, float)) and not isinstance(v, bool) and str(v).strip()]


def load_problems(source: DataSource) -> list[Problem]:
    rows, where = load_rows(source)
    if not rows:
        raise UserError(f"tool_use env: the data source {source!r} has no rows")
    out = []
    for row, w in zip(rows, where, strict=True):
        question = row.get("question") or row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(question, str) or not question.strip() or not isinstance(row, dict):
            raise UserError(f"{w}: expected an object with a non-empty `question`")
        # "golden_answers": the Search-R1 / NQ-HotpotQA rows the cookbook's search_tool trains on.
        answers = _answer_list(row.get("answer", row.get("answers", row.get("golden_answers"))))
        if not answers:
            raise UserError(f"{w}: expected an `answer` (a string, a number or a list of them)")
        out.append(Problem(question, tuple(answers), w))
    return out


# ---------------------------------------------------------------- tools and the episode


@dataclass(frozen=True)
class ToolSetup:
    tools: dict[str, Tool]
    prefix: list[Message]
    native: bool
    cfg: ToolUse


def make_tools(cfg: ToolUse) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    builtins = builtin_tools()
    for entry in cfg.tools:
        if entry == "search":
            assert cfg.docs is not None  # checked by the schema
            rows, where = load_rows(cfg.docs)
            tool = search_tool(BM25(load_docs(rows, where)), cfg.top_k)
        elif entry in builtins:
            tool = tool_from_function(builtins[entry], f"tool {entry!r}")
        else:
            try:
                fn = import_target(entry)
            except UserError as e:
                raise UserError(f"tool_use env: tools: {e}") from None
            tool = tool_from_function(fn, f"tool {entry!r}")
        if tool.name in tools:
            raise UserError(f"tool_use env: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def setup_tools(cfg: ToolUse, renderer: ChatRenderer) -> ToolSetup:
    tools = make_tools(cfg)
    specs = [t.spec for t in tools.values()]
    system = DEFAULT_SYSTEM_PROMPT if cfg.system_prompt is None else cfg.system_prompt
    declare = TOOL_FORMATS.get(renderer.renderer.name)
    prefix = (declare or plain_text_prefix)(specs, system)
    return ToolSetup(tools, prefix, declare is not None, cfg)


class ToolUseEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, problem: Problem, setup: ToolSetup):
        super().__init__(renderer, [*setup.prefix, {"role": "user", "content": problem.question}])
        self.problem, self.setup, self.cfg = problem, setup, setup.cfg
        self.turns = self.tool_calls = self.tool_errors = self.malformed = 0

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    def _append_reply(self, action_tokens: list[int], reply: ParsedReply) -> None:
        if self.setup.native:
            message = {k: v for k, v in reply.message.items() if k != "unparsed_tool_calls"}
            message["role"] = "assistant"
            # A malformed call stays in the history as the text the model wrote.
            raw = "".join(str(u.get("raw_text", "")) for u in reply.message.get("unparsed_tool_calls", []))
            if raw:
                message["content"] = reply.text + raw
        else:
            message = {"role": "assistant", "content": reply.text}
        self.messages.append(message)
        self._last_reply = (list(action_tokens), reply)

    async def _run(self, call: Call) -> tuple[str, bool]:
        """(result text, ok)."""
        tool = self.setup.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; the tools are {sorted(self.setup.tools)}", False
        try:
            out = await tool.call(call.arguments, self.cfg.tool_timeout_s)
        except ToolError as e:
            return f"Error: {e}", False
        if len(out) > self.cfg.max_result_chars:
            out = out[: self.cfg.max_result_chars] + "…"
        return out, True

    def _result_message(self, call: Call, text: str) -> Message:
        if self.setup.native:
            return {"role": "tool", "content": text, "tool_call_id": call.call_id, "name": call.name}
        return {"role": "user", "content": f"RESULT {call.name}: {text}"}

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.renderer.parse(action_tokens)
        self._append_reply(action_tokens, reply)
        self.turns += 1
        calls, errors = parse_native_calls(reply.message) if self.setup.native else parse_plain_calls(reply.text)
        if not calls and not errors:
            return self._answer(reply)
        self.malformed += len(errors)
        logs: Logs = {"reply": reply.text}
        results = await asyncio.gather(*(self._run(c) for c in calls))
        new: list[Message] = []
        for i, (call, (text, ok)) in enumerate(zip(calls, results, strict=True)):
            self.tool_calls += 1
            self.tool_errors += int(not ok)
            logs[f"tool_call_{i}"] = f"{call.name}({json.dumps(call.arguments)})"
            logs[f"tool_result_{i}"] = text
            new.append(self._result_message(call, text))
        for j, err in enumerate(errors):
            logs[f"malformed_{j}"] = err
            name = "tool_call"
            text = f"Error: malformed tool call: {err}"
            new.append({"role": "tool", "content": text, "tool_call_id": "", "name": name} if self.setup.native
                       else {"role": "user", "content": f"RESULT {name}: {text}"})
        if self.turns >= self.cfg.max_turns:
            return self._end(correct=False, format_ok=False, out_of_turns=True, logs=logs)
        self.messages.extend(new)
        ob, stop = self.observe()
        return StepResult(0.0, False, ob, stop, logs=logs)

    def _answer(self, reply: ParsedReply) -> StepResult:
        answer = final_answer(reply.text, self.cfg.answer_prefix)
        correct = answer is not None and answer_matches(answer, self.problem.answers)
        format_ok = answer is not None and reply.ended_on_stop and self.malformed == 0
        logs: Logs = {"question": self.problem.question, "reference": " | ".join(self.problem.answers),
                      "extracted": answer or "", "reply": reply.text}
        return self._end(correct, format_ok, out_of_turns=False, logs=logs)

    def _end(self, correct: bool, format_ok: bool, out_of_turns: bool, logs: Logs) -> StepResult:
        reward = float(correct) + self.cfg.format_coef * (float(format_ok) - 1.0)
        metrics = {"correct": float(correct), "format": float(format_ok), "turns": float(self.turns),
                   "tool_calls": float(self.tool_calls), "tool_errors": float(self.tool_errors),
                   "malformed": float(self.malformed), "out_of_turns": float(out_of_turns)}
        return StepResult(reward, True, metrics=metrics, logs=logs)


def build(cfg: ToolUse, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    setup = setup_tools(cfg, ctx.renderer)
    problems = load_problems(cfg.data)
    held = load_problems(cfg.test_data) if cfg.test_data else None
    train, test = split(problems, held, cfg, ctx.seed, "tool_use env")

    def make(problem: Problem, group_size: int) -> EnvGroupBuilder:
        return RepeatGroupBuilder(functools.partial(ToolUseEnv, ctx.renderer, problem, setup), group_size,
                                  ["tool_use"])

    return group_datasets(train, test, ctx, make, "tool_use env")


ENV = EnvKind(build, [("env/all/correct", "correct"), ("env/all/tool_calls", "tool_calls"),
                  ("env/all/malformed", "malformed")])
