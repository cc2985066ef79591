"""`rubric`: one reply per prompt, graded by a judge against the prompt's rubric (the cookbook's rubric recipe).

Each rubric item is graded on its own (the cookbook's RubricGradedEnv): a model judge gets the cookbook's grader
prompt (the conversation, the reply, the item, "output your score between 0 and 1 wrapped in <score> ...
</score>") and its reply is parsed by `parse_score`; a python grader fn(messages, reply, item) returns the score
(a number in [0, 1] or a bool) or a judge's text, parsed the same way. reward = mean item score +
format_coef·(ended_on_stop − 1). Judge text with no score counts 0 and is counted in `judge_unparsed` (the fraction
of the reply's items). Metrics: rubric_score, format, judge_unparsed.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.base import SamplingClient
from backends.errors import UserError
from backends.types import SamplingParams
from runner.data.conversations import load_rows, messages_of
from runner.recipe.targets import import_target
from runner.renderers.chat import ChatRenderer, Message
from runner.rl.envs.common import ChatEnv, EnvContext, EnvKind, RepeatGroupBuilder, group_datasets, split
from runner.rl.envs.rubric_config import JudgeModel, PythonGrader, Rubric
from runner.rl.rollouts import describe_error
from runner.rl.types import EnvGroupBuilder, Logs, Observation, RLDataset, StepResult, StopCondition

if TYPE_CHECKING:
    from runner.recipe.common import DataSource

OUTPUT_INSTRUCTION = "Please output your score between 0 and 1 wrapped in <score> ... </score>"

# ---------------------------------------------------------------- parsing a judge's text

_NUM = r"[-+]?\d+(?:\.\d+)?|[-+]?\.\d+"
_TAGGED = re.compile(r"<score>\s*(.*?)\s*</score>", re.IGNORECASE | re.DOTALL)
_FRACTION = re.compile(rf"({_NUM})\s*(?:/|out of)\s*({_NUM})", re.IGNORECASE)
_LABELLED = re.compile(rf"\b(?:score|rating|grade)\s*[:=]?\s*({_NUM})", re.IGNORECASE)
_BARE = re.compile(rf"^\s*({_NUM})\s*\.?\s*$")
# A verdict word alone or followed by punctuation ("No." / "Yes, it does"), not "no idea".
_VERDICT = re.compile(r"^\W*(?:verdict\s*:\s*|answer\s*:\s*)?(yes|no|pass|fail|true|false)\s*(?:[.,;:!]|$)",
                      re.IGNORECASE)


def _scaled(x: float) -> float | None:
    """A score on 0-1, or on 0-10 when above 1; None outside both."""
    if 0.0 <= x <= 1.0:
        return x
    if 1.0 < x <= 10.0:
        return x / 10.0
    return None


def _fraction(text: str) -> float | None:
    m = _FRACTION.search(text)
    if m is None:
        return None
    num, den = float(m.group(1)), float(m.group(2))
    return num / den if den > 0 and 0 <= num <= den else None


def parse_score(text: str) -> float | None:
    """A score in [0, 1] from a judge's text, or None. Tried in order: the last `<score>x</score>` (x a number on
    0-1 or 0-10, or a fraction "7/10"); a fraction "7/10" / "7 out of 10"; "Score: x" (0-1, or 0-10 above 1); a
    reply that is just a number; a reply that opens with the word yes/pass/true (1) or no/fail/false (0), alone or before punctuation."""
    tagged = _TAGGED.findall(text)
    if tagged:
        inner = tagged[-1]
        frac = _fraction(inner)
        if frac is not None:
            return frac
        m = _BARE.match(inner)
        return _scaled(float(m.group(1))) if m else None
    frac = _fraction(text)
    if frac is not None:
        return frac
    labelled = _LABELLED.findall(text)
    if labelled:
        return _scaled(float(labelled[-1]))
    m = _BARE.match(text)
    if m:
        return _scaled(float(m.group(1)))
    v = _VERDICT.match(text)
    if v:
        return 1.0 if v.group(1).lower() in ("yes", "pass", "true") else 0.0
    return None


def flatten(messages: Sequence[Message]) -> str:
    """The cookbook's _flatten_convo: "Human: ..." / "Chatbot: ..." turns."""
    return "\n\n".join(f"{'Human' if m['role'] in ('user', 'system') else 'Chatbot'}: {m['content']}"
                       for m in messages)


def grader_prompt(messages: Sequence[Message], reply: str, item: str) -> list[Message]:
    """The cookbook's Rubric.get_grader_prompt."""
    lines = [
        "I will show you a conversation context, a chatbot completion to grade, and a rubric.",
        "Please grade the chatbot's completion based on the rubric.",
        "",
        "<context>",
        flatten(messages) if messages else "(No prior context)",
        "</context>",
        "",
        "<completion_to_grade>",
        f"Chatbot: {reply}",
        "</completion_to_grade>",
        "",
        "<rubric>",
        item,
        "</rubric>",
        "",
        f"Please grade the chatbot's completion based on the rubric. {OUTPUT_INSTRUCTION}",
    ]
    return [{"role": "user", "content": "\n".join(lines)}]


# ---------------------------------------------------------------- judges

# (score or None when the judge's text has none, the judge's text for transcripts)
Grade = tuple[float | None, str]


class ModelGrader:
    """A model judge: one sample per item on the judge's sampling client, opened once through the run's backend."""

    def __init__(self, cfg: JudgeModel, ctx: EnvContext):
        self.cfg, self.ctx = cfg, ctx
        self.renderer = ctx.renderer
        if cfg.model is not None and cfg.init_from is None and cfg.checkpoint is None:
            from backends.tokenizer import load_tokenizer
            from runner.renderers import get_renderer

            # The judge's own chat format (it may be another family than the policy).
            self.renderer = ChatRenderer(get_renderer("auto", load_tokenizer(cfg.model), model_name=cfg.model))
        self._client: asyncio.Task[SamplingClient] | None = None

    async def _open(self) -> SamplingClient:
        cfg, ctx = self.cfg, self.ctx
        if cfg.init_from is not None:
            if ctx.open_weights is None:
                raise UserError(f"rubric judge {cfg.init_from!r}: a model judge needs the run's backend")
            return await ctx.open_weights(cfg.init_from)
        if ctx.open_model is None:
            raise UserError("rubric judge: a model judge needs the run's backend")
        return await ctx.open_model(cfg.checkpoint, cfg.model)

    async def __call__(self, messages: list[Message], reply: str, item: str, seed: int) -> Grade:
        if self._client is None:
            self._client = asyncio.ensure_future(self._open())
        client = await self._client
        params = SamplingParams(max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature,
                                stop=self.renderer.stop, seed=seed)
        out = await client.sample(self.renderer.build_prompt(grader_prompt(messages, reply, item)), 1, params)
        text = self.renderer.parse(out.sequences[0].tokens).text
        return parse_score(text), text


class FunctionGrader:
    def __init__(self, cfg: PythonGrader):
        self.target = cfg.target
        self.fn: Callable[..., object] = import_target(cfg.target)

    async def __call__(self, messages: list[Message], reply: str, item: str, seed: int) -> Grade:
        where = f"rubric grader {self.target!r}"
        try:
            out = self.fn(list(messages), reply, item)
            if inspect.isawaitable(out):
                out = await out
        except Exception as e:  # noqa: BLE001 - user code: one line naming it
            raise UserError(f"{where} raised {describe_error(e)}") from None
        if isinstance(out, str):
            return parse_score(out), out
        if isinstance(out, (bool, int, float)):
            score = float(out)
            if not 0.0 <= score <= 1.0:
                raise UserError(f"{where} returned {out!r}, expected a score in [0, 1]")
            return score, str(out)
        raise UserError(f"{where} returned {type(out).__name__}, expected a score in [0, 1], a bool or the judge's text")


Grader = ModelGrader | FunctionGrader


def keyword_grader(messages: list[Message], reply: str, item: str) -> float:
    """A programmatic grader for rubric items that quote what the reply should contain: 'says "4" or "four"' scores 1
    when the reply contains any quoted phrase (case-insensitively), else 0; an item with no quotes ("is friendly")
    scores 1 for a non-empty reply."""
    phrases = re.findall(r"\"([^\"]+)\"", item)
    if not phrases:
        return float(bool(reply.strip()))
    return float(any(p.lower() in reply.lower() for p in phrases))


# ---------------------------------------------------------------- data and the env


@dataclass(frozen=True)
class Problem:
    messages: tuple[Message, ...]
    items: tuple[str, ...]
    where: str


def load_problems(source: DataSource) -> list[Problem]:
    rows, where = load_rows(source)
    if not rows:
        raise UserError(f"rubric env: the data source {source!r} has no rows")
    out = []
    for row, w in zip(rows, where, strict=True):
        if not isinstance(row, dict):
            raise UserError(f"{w}: expected an object with `prompt` (or `messages`) and `rubric`")
        key = "messages" if "messages" in row else "convo"  # "convo": the cookbook's RubricDatapoint
        if key in row:
            messages = messages_of(row[key], w, key)
        elif isinstance(row.get("prompt"), str) and row["prompt"].strip():
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            raise UserError(f"{w}: expected a non-empty `prompt` or a `messages` list")
        rubric = row.get("rubric", row.get("rubric_items"))
        items = [rubric] if isinstance(rubric, str) else rubric
        if isinstance(items, list):  # the cookbook's items are {"rubric_str": ...} (its own score regex is not used)
            items = [i.get("rubric_str") if isinstance(i, dict) else i for i in items]
        texts = [i for i in items if isinstance(i, str) and i.strip()] if isinstance(items, list) else []
        if not texts or len(texts) != len(items or []):
            raise UserError(f"{w}: `rubric` must be a non-empty string or a list of non-empty strings")
        out.append(Problem(tuple(messages), tuple(texts), w))
    return out


class RubricEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, problem: Problem, grader: Grader, format_coef: float, seed: int):
        super().__init__(renderer, list(problem.messages))
        self.problem, self.grader, self.format_coef, self.seed = problem, grader, format_coef, seed

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        context = list(self.problem.messages)
        grades = await asyncio.gather(*(self.grader(context, reply.text, item, self.seed + i)
                                         for i, item in enumerate(self.problem.items)))
        scores = [0.0 if s is None else s for s, _ in grades]
        unparsed = sum(s is None for s, _ in grades)
        score = sum(scores) / len(scores)
        fmt = float(reply.ended_on_stop)
        logs: Logs = {"prompt": self.problem.messages[-1]["content"], "reply": reply.text}
        for i, (item, (s, text)) in enumerate(zip(self.problem.items, grades, strict=True)):
            logs[f"item_{i}"] = f"{'unparsed' if s is None else f'{s:.2f}'} | {item[:120]}"
            logs[f"judge_{i}"] = text[:300]
        metrics = {"rubric_score": score, "format": fmt, "judge_unparsed": unparsed / len(grades)}
        return StepResult(score + self.format_coef * (fmt - 1.0), True, metrics=metrics, logs=logs)


def make_grader(cfg: Rubric, ctx: EnvContext) -> Grader:
    if isinstance(cfg.judge, PythonGrader):
        return FunctionGrader(cfg.judge)
    return ModelGrader(cfg.judge, ctx)


def build(cfg: Rubric, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    grader = make_grader(cfg, ctx)
    problems = load_problems(cfg.data)
    held = load_problems(cfg.test_data) if cfg.test_data else None
    train, test = split(problems, held, cfg, ctx.seed, "rubric env")

    def make(problem: Problem, group_size: int) -> EnvGroupBuilder:
        env = functools.partial(RubricEnv, ctx.renderer, problem, grader, cfg.format_coef, ctx.seed)
        return RepeatGroupBuilder(env, group_size, ["rubric"])

    return group_datasets(train, test, ctx, make, "rubric env")


ENV = EnvKind(build, [("env/all/rubric_score", "rubric"), ("env/all/judge_unparsed", "unparsed")])
