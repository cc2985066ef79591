"""`math`: single-turn problems from a data source, the reply's final answer graded against the reference (the
cookbook's math_rl MathEnv / ProblemEnv: reward = correct + format_coef·(format − 1), metrics `format`, `correct`).

Rows: a question (`question` or `problem`, or `question_field`) and a reference (`answer` or `solution`, or
`answer_field`); a GSM8K "#### x" answer or a MATH \\boxed{x} solution is reduced to x, a plain answer kept as is.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from backends.errors import UserError
from backends.types import Json
from runner.data.conversations import load_rows
from runner.recipe.common import DataSource
from runner.renderers.chat import ChatRenderer, Message
from runner.rewards.math_grading import extract_answer, grade, math_verify_available, reference_answer, warm_up
from runner.rl.envs.common import ChatEnv, EnvContext, EnvKind, RepeatGroupBuilder, group_datasets, split
from runner.rl.envs.math_config import Math
from runner.rl.types import EnvGroupBuilder, Observation, RLDataset, StepResult, StopCondition

BOXED_SUFFIX = " Write your answer in \\boxed{} format."
FEW_SHOT: dict[str, list[Message]] = {
    # The cookbook's MathEnv.standard_fewshot_prefix().
    "boxed": [
        {"role": "user", "content": "How many r's are in strawberry?" + BOXED_SUFFIX},
        {
            "role": "assistant",
            "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e "
            "8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
        },
    ],
    "auto": [
        {"role": "user", "content": "Ann has 4 pens and buys 5 more. How many pens does she have?"},
        {"role": "assistant", "content": "9"},
    ],
}
# A grading that takes longer (sympy on a pathological answer) counts as wrong.
GRADE_TIMEOUT_S = 5.0


P = TypeVar("P")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    where: str


def _field(row: Json, names: Sequence[str], where: str, what: str) -> str:
    for name in names:
        value = row.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value.strip():
            return value
    expected = " or ".join(repr(n) for n in names)
    raise UserError(f"{where}: expected a non-empty {what} in field {expected}")


def load_problems(source: DataSource, question_field: str | None, answer_field: str | None) -> list[Problem]:
    rows, where = load_rows(source)
    if not rows:
        raise UserError(f"math env: the data source {where or source!r} has no rows")
    q_names = [question_field] if question_field else ["question", "problem", "prompt"]
    a_names = [answer_field] if answer_field else ["answer", "solution", "final_answer"]
    problems = []
    for row, w in zip(rows, where, strict=True):
        if not isinstance(row, dict):
            raise UserError(f"{w}: expected an object with a question and an answer")
        question = _field(row, q_names, w, "question")
        answer = reference_answer(_field(row, a_names, w, "answer"))
        problems.append(Problem(question, answer, w))
    return problems


class MathEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, problem: Problem, cfg: Math):
        suffix = cfg.question_suffix if cfg.question_suffix is not None else (
            BOXED_SUFFIX if cfg.answer_format == "boxed" else "")  # fmt: skip
        prefix = FEW_SHOT[cfg.answer_format] if cfg.few_shot else []
        super().__init__(renderer, [*prefix, {"role": "user", "content": problem.question + suffix}])
        self.problem, self.cfg = problem, cfg
        warm_up(cfg.grader)  # once per process (build did it already in a run): not under GRADE_TIMEOUT_S

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        answer = extract_answer(reply.text, self.cfg.answer_format)
        format_ok = answer is not None and reply.ended_on_stop
        correct = False
        if answer is not None:
            try:
                correct = await asyncio.wait_for(
                    asyncio.to_thread(grade, answer, self.problem.answer, self.cfg.grader), GRADE_TIMEOUT_S
                )
            except TimeoutError:
                correct = False
        reward = float(correct) + self.cfg.format_coef * (float(format_ok) - 1.0)
        logs: dict[str, str | int | float] = {
            "question": self.problem.question,
            "reference": self.problem.answer,
            "extracted": "" if answer is None else answer,
            "reply": reply.text,
        }
        return StepResult(reward, True, metrics={"format": float(format_ok), "correct": float(correct)}, logs=logs)


def build(cfg: Math, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    if cfg.grader == "math_verify" and not math_verify_available():
        raise UserError("math env: grader = \"math_verify\" needs the math-verify package (pip install 'runner[math]')")
    warm_up(cfg.grader)
    problems = load_problems(cfg.data, cfg.question_field, cfg.answer_field)
    held = load_problems(cfg.test_data, cfg.question_field, cfg.answer_field) if cfg.test_data else None
    train, test = split(problems, held, cfg, ctx.seed, "math env")

    def make(problem: Problem, group_size: int) -> EnvGroupBuilder:
        return RepeatGroupBuilder(functools.partial(MathEnv, ctx.renderer, problem, cfg), group_size, ["math"])

    return group_datasets(train, test, ctx, make, "math env")


ENV = EnvKind(build, [("env/all/correct", "correct"), ("env/all/format", "format")])
