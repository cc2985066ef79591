"""The `code` env (runner/rl/envs/code.py): code extraction, the shipped problems, and hand-written replies (right,
wrong, partly right, an infinite loop, no code) graded in the sandbox through a scripted rollout."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from backends.types import SamplingParams
from runner.recipe.sources import Jsonl
from runner.renderers.chat import ChatRenderer
from runner.rl.envs import EnvContext, build_datasets, get_batch
from runner.rl.envs.code import CodeEnv, extract_code, load_code_problems, same_output
from runner.rl.envs.code_config import Code
from runner.rl.rollouts import run_episode
from runner.rl.testing import ScriptedSampler

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = str(ROOT / "examples/data/code_problems.jsonl")
TOK = build_tokenizer()
R = ChatRenderer(TOK)
# wall_s: a right solution's tests (a Python start each, 4 at a time) finish on a loaded 2-core machine too; the
# infinite loop is stopped by cpu_s (SIGXCPU, counted as a timeout) on an idle one.
CFG = Code(data=Jsonl(SHIPPED), test_size=2, cpu_s=1, wall_s=10.0, memory_mb=256, max_parallel=4)


def ctx(groups_per_batch: int = 2) -> EnvContext:
    return EnvContext(renderer=R, group_size=2, test_group_size=1, groups_per_batch=groups_per_batch, seed=0)


def block(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```"


def test_extract_code() -> None:
    assert extract_code("```python\nprint(1)\n```") == "print(1)\n"
    assert extract_code("first ```py\na = 1\n``` then ```\nb = 2\n```") == "b = 2\n"  # the last block
    assert extract_code("print(1)") is None
    assert extract_code("```python\nprint(1)") is None  # never closed


def test_same_output_ignores_trailing_whitespace_only() -> None:
    assert same_output("1\n2  \n\n", "1\n2")
    assert not same_output("1 2", "1\n2")
    assert not same_output("12", "1\n2")


def test_shipped_problems_load() -> None:
    ps = load_code_problems(Jsonl(SHIPPED))
    assert len(ps) == 12
    assert any(t.expected is None for p in ps for t in p.tests) and any(t.expected for p in ps for t in p.tests)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "q"}, "needs \"tests\""),
        ({"question": "q", "tests": [{"input": "1"}]}, r"tests\[0\] must be"),
        ({"question": "q", "asserts": [""]}, r"asserts\[0\] must be a non-empty string"),
        ({"tests": [{"input": "", "output": ""}]}, "non-empty \"question\""),
        ({"question": "q", "tests": 5}, "must be lists"),
        ({"question": "q", "tests": "[1, 2"}, "is a string but not JSON"),
        ({"question": "q", "tests": [{"input": "1", "output": "2", "testtype": "functional"}]},
         "functional test without a function name"),
    ],
)
def test_bad_rows(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError, match=message):
        build_datasets(Code(data=Jsonl(str(path)), test_size=0), ctx(1))


def grade(question_start: str, reply: str, max_tokens: int = 400) -> Any:
    problem = next(p for p in load_code_problems(Jsonl(SHIPPED)) if p.question.startswith(question_start))
    train, _ = build_datasets(CFG, ctx())
    sandbox = asyncio.run(get_batch(train, 0, "train")[0].make_envs())[0].sandbox  # the env's own sandbox
    env = CodeEnv(R, problem, CFG, sandbox)
    sampler = ScriptedSampler(TOK, lambda p, s: reply)
    traj = asyncio.run(run_episode(env, sampler, SamplingParams(max_tokens=max_tokens), seed=0, step=0, group=0,
                                   member=0))  # fmt: skip
    prompt = TOK.decode(sampler.calls[0][0])
    assert problem.question in prompt and "```python" in prompt
    (tr,) = traj.transitions
    return tr


def test_right_stdin_solution() -> None:
    tr = grade("Read two integers", block("a, b = map(int, input().split())\nprint(a + b)"))
    assert tr.reward == 1.0
    assert tr.metrics == {"format": 1.0, "compile": 1.0, "passed": 1.0, "all_passed": 1.0, "timeout": 0.0}
    assert tr.logs["tests_passed"] == "3/3" and tr.logs["first_failure"] == ""
    assert tr.logs["sandbox"] in {"bwrap", "unshare", "none"}


def test_partly_right_assert_solution() -> None:
    # Right for numbers, wrong for strings: 2 of 3 asserts.
    tr = grade("Write a function add", block("def add(a, b):\n    return int(a) + int(b)"))
    assert tr.reward == pytest.approx(2 / 3)
    assert tr.metrics["passed"] == pytest.approx(2 / 3) and tr.metrics["all_passed"] == 0.0
    assert "ValueError" in str(tr.logs["first_failure"])


def test_wrong_solution() -> None:
    tr = grade("Read a line of text", block("print(input())"))
    assert tr.metrics["passed"] == pytest.approx(1 / 3)  # only the palindrome passes
    assert str(tr.logs["first_failure"]).startswith("wrong output")


def test_infinite_loop_is_a_timeout_and_zero() -> None:
    tr = grade("Write a function factorial", block("def factorial(n):\n    while True:\n        pass"))
    assert tr.reward == 0.0 and tr.metrics["timeout"] == 1.0 and tr.metrics["passed"] == 0.0


def test_no_code_and_syntax_error() -> None:
    tr = grade("Read an integer n and print 'even'", "print('even')")  # no code block
    assert tr.reward == pytest.approx(-0.1) and tr.metrics["format"] == 0.0 and tr.metrics["compile"] == 0.0
    tr = grade("Read an integer n and print 'even'", block("if True print('even')"))
    assert tr.reward == 0.0 and tr.metrics["format"] == 1.0 and tr.metrics["compile"] == 0.0


def test_dataset_split() -> None:
    train, test = build_datasets(CFG, ctx())
    assert test is not None and len(train) == 5 and len(test) == 1  # 10 train problems, 2 held out


def test_deepcoder_and_taco_rows(tmp_path: Path) -> None:
    """The cookbook's code_rl data: LiveCodeBench tests as a JSON string (stdin and functional, the function name in
    metadata), TACO's parallel inputs/outputs lists, starter code; graded like our own rows."""
    lcb = {
        "problem": "Return the sum of a list and a number.",
        "starter_code": "class Solution:\n    def total(self, xs, k):",
        "tests": json.dumps([{"input": "[1, 2]\n3", "output": "6", "testtype": "functional",
                              "metadata": {"func_name": "total"}},
                             {"input": "[]\n0", "output": "0", "testtype": "functional",
                              "metadata": {"func_name": "total"}}]),
    }
    taco = {"question": "Print twice the input.", "tests": {"inputs": ["2\n", "5\n"], "outputs": [["4\n"], "10\n"]}}
    path = tmp_path / "dc.jsonl"
    path.write_text(json.dumps(lcb) + "\n" + json.dumps(taco) + "\n")
    first, second = load_code_problems(Jsonl(str(path)))
    assert "Start from:" in first.question and "class Solution" in first.question
    assert all(t.expected is None for t in first.tests) and [t.expected for t in second.tests] == ["4\n", "10\n"]

    cfg = Code(data=Jsonl(str(path)), test_size=0, cpu_s=1, wall_s=10.0)
    train, _ = build_datasets(cfg, EnvContext(renderer=R, group_size=1, test_group_size=1, groups_per_batch=1,
                                              seed=0))  # fmt: skip
    sandbox = asyncio.run(get_batch(train, 0, "train")[0].make_envs())[0].sandbox

    async def grade(problem: Any, reply: str) -> Any:
        return await CodeEnv(R, problem, cfg, sandbox).grade(reply, True)

    right = block("class Solution:\n    def total(self, xs, k):\n        return sum(xs) + k")
    wrong = block("class Solution:\n    def total(self, xs, k):\n        return k")
    assert asyncio.run(grade(first, right)).metrics["passed"] == 1.0
    assert asyncio.run(grade(first, wrong)).metrics["passed"] == 0.5  # right only for the empty list
    assert asyncio.run(grade(second, block("print(2 * int(input()))"))).metrics["passed"] == 1.0


def test_grade_is_not_fooled_by_shadowed_builtins(tmp_path: Path) -> None:
    """MBPP task 2 with its own asserts: an empty function plus two lines shadowing `set` and `math` got reward 1.00
    from grade() (the check ran among the program's names); the harness's builtins and modules win now (#43)."""
    row = {"question": "Write a function to find the shared elements from the given two lists.",
           "asserts": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
                       "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
                       "assert math.isclose(len(similar_elements((1, 2), (2, 3))), 1.0)"]}  # fmt: skip
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (problem,) = load_code_problems(Jsonl(str(path)))
    cfg = Code(data=Jsonl(str(path)), test_size=0, cpu_s=1, wall_s=4.0)
    train, _ = build_datasets(cfg, EnvContext(renderer=R, group_size=1, test_group_size=1, groups_per_batch=1,
                                              seed=0))  # fmt: skip
    sandbox = asyncio.run(get_batch(train, 0, "train")[0].make_envs())[0].sandbox

    async def reward(code: str) -> float:
        return (await CodeEnv(R, problem, cfg, sandbox).grade(block(code), True)).reward

    forged = ("set = lambda *a: 0\nclass math:\n    isclose = staticmethod(lambda *a, **k: True)\n\n"
              "def similar_elements(a, b):\n    pass")
    honest = "import math\n\ndef similar_elements(a, b):\n    return tuple(set(a) & set(b))"
    assert asyncio.run(reward(forged)) == 0.0
    assert asyncio.run(reward(honest)) == 1.0
