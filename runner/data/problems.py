"""Problems with a reference answer, for RL envs that grade a reply (e.g. a math env).

    from runner.data.problems import Problem, load_problems
    problems = load_problems(source)   # source: any data source of a recipe (jsonl, file, hf, python, ...)
    problems[0].question, problems[0].answer, problems[0].where   # str, str, "train.parquet[0]"

`source.format` says how a row becomes a problem (runner/recipe/formats.py):
  - "gsm8k"  {"question", "answer"}: the answer is the text after the last "####" (commas dropped), as the cookbook;
  - "math"   {"problem", "solution"}: the answer is the content of the last \\boxed{...};
  - "prompt_response" {"prompt", "response"}: the response is the answer as it is;
  - "auto" (no format): rows {"question": str, "answer": str | number} as they are.
`fields` renames columns (`fields = {question = "q", answer = "a"}` with format "gsm8k"). Rows without a final answer
are dropped and counted (the cookbook drops them too); any other bad row is a one-line UserError naming file:line.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.errors import UserError
from runner.data.conversations import describe, mapped_rows
from runner.recipe.common import DataSource


@dataclass(frozen=True)
class Problem:
    question: str
    # The reference final answer (not the worked solution).
    answer: str
    # Where the row came from ("train.jsonl:3").
    where: str


def load_problems(source: DataSource) -> list[Problem]:
    """Every row of `source` as a Problem, in file order; UserError for a bad row or no problems at all."""
    rows, where, dropped = mapped_rows(source, "problem")
    problems = [problem(row, w) for row, w in zip(rows, where, strict=True)]
    if not problems:
        raise UserError(f"data source {describe(source)} has no problems ({dropped} rows without a final answer)")
    return problems


def problem(row: object, where: str) -> Problem:
    """A row {"question": str, "answer": str | int | float} as a Problem."""
    if not isinstance(row, dict) or "question" not in row or "answer" not in row:
        have = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
        raise UserError(f"{where}: expected an object with \"question\" and \"answer\" (got: {have}); a source's "
                        "`format` (gsm8k, math, prompt_response) maps other columns")
    question, answer = row["question"], row["answer"]
    if not isinstance(question, str) or not question:
        raise UserError(f"{where}: \"question\" must be a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: \"answer\" must be a string or a number, got {type(answer).__name__}")
    return Problem(question, str(answer).strip(), where)
