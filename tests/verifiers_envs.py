"""Small verifiers environments of the tests' own (the Environments Hub is not reachable here), loaded by
`verifiers.load_environment("tests.verifiers_envs", kind=...)` as `env = {kind = "verifiers", module =
"tests.verifiers_envs", args = {kind = ...}}` does:

- "sums": single turn, "What is a + b?", a rubric of two reward functions (exact answer, weight 1; the reply's length,
  weight 0: a metric only);
- "tool": multi-turn with a tool (`add`), a ToolEnv: the model may call add, reads its result, and answers.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _sums(n: int, offset: int = 0) -> Dataset:
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)}
            for a, b in ((i % 10, (i * 7 + offset) % 10) for i in range(n))]
    return Dataset.from_list(rows)


def exact(completion: vf.Messages, answer: str, **kwargs: object) -> float:
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return float(str(text).strip() == answer)


def reply_chars(completion: vf.Messages, **kwargs: object) -> float:
    return float(sum(len(str(m.get("content") or "")) for m in completion if m["role"] == "assistant"))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def load_environment(kind: str = "sums", n: int = 32) -> vf.Environment:
    rubric = vf.Rubric(funcs=[exact, reply_chars], weights=[1.0, 0.0])
    if kind == "sums":
        return vf.SingleTurnEnv(dataset=_sums(n), eval_dataset=_sums(8, offset=3), rubric=rubric)
    if kind == "tool":
        return vf.ToolEnv(dataset=_sums(n), tools=[add], max_turns=3, rubric=rubric,
                          system_prompt="Use the add tool, then answer with the number alone.")
    raise ValueError(f"unknown kind {kind!r}")
