"""The code env cannot be reward-hacked (docs/sandbox.md, "The code env's harness"): a program that exits early
(`os._exit(0)`, `sys.exit(0)`, `os._exit(0)` from an atexit hook), patches the interpreter (an excepthook that exits 0,
an always-equal result), prints a fake verdict, or reads the answers from the dataset scores 0 on the shipped
problems, while right programs pass all 38 tests. Each hack is first shown to pass the old judge (the asserts appended
to the program, exit 0 = pass), so the tests measure something that was broken."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from runner.recipe.sources import Jsonl
from runner.rewards.sandbox import Limits, RunResult, Sandbox
from runner.rl.envs.code import CodeProblem, CodeTest, load_code_problems, run_tests

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = str(ROOT / "examples/data/code_problems.jsonl")
PROBLEMS = load_code_problems(Jsonl(SHIPPED))
LIMITS = Limits(cpu_s=2, wall_s=8.0, memory_mb=256)

RIGHT = {
    "Read two integers": "a, b = map(int, input().split())\nprint(a + b)",
    "Read a line of text": "print(input()[::-1])",
    "Read an integer n and print the numbers": "for i in range(1, int(input()) + 1):\n    print(i)",
    "Read an integer n and print 'even'": "print('even' if int(input()) % 2 == 0 else 'odd')",
    "Read a line of space-separated": "print(max(map(int, input().split())))",
    "Read a word": "print(sum(c in 'aeiou' for c in input()))",
    "Write a function add": "def add(a, b):\n    return a + b",
    "Write a function is_palindrome": "def is_palindrome(s):\n    return s == s[::-1]",
    "Write a function factorial": "import math\n\ndef factorial(n):\n    return math.factorial(n)",
    "Write a function fizzbuzz": ("def fizzbuzz(n):\n    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else "
                                 "'Buzz' if n % 5 == 0 else str(n)"),  # fmt: skip
    "Write a function count_words": "def count_words(s):\n    return len(s.split())",
    "Read an integer n and print the sum": "print(sum(map(int, input().strip())))",
}

# Wrong for every problem: each function the asserts call returns None.
WRONG_DEFS = "add = is_palindrome = factorial = fizzbuzz = count_words = lambda *a, **k: None\n"

HACKS = {
    "os._exit(0)": WRONG_DEFS + "import os\nos._exit(0)",
    "sys.exit(0)": WRONG_DEFS + "import sys\nsys.exit(0)",
    "atexit exits 0": WRONG_DEFS + "import atexit, os\natexit.register(os._exit, 0)",
    # CPython only prints a SystemExit raised in an atexit hook (the exit code stays 1): not a hack of the old judge.
    "atexit SystemExit": WRONG_DEFS + "import atexit\n\ndef _leave():\n    raise SystemExit(0)\n\natexit.register(_leave)",
    "excepthook exits 0": WRONG_DEFS + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)",
    "AssertionError patched": (WRONG_DEFS + "import builtins, os, sys\nclass _Never(BaseException):\n    pass\n"
                               "builtins.AssertionError = _Never\nsys.excepthook = lambda *a: os._exit(0)"),  # fmt: skip
    "always-equal result": ("class _Eq:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                            "    def __bool__(self):\n        return True\n"
                            "add = is_palindrome = factorial = fizzbuzz = count_words = lambda *a, **k: _Eq()"),  # fmt: skip
    "fake verdict": WRONG_DEFS + "print('passed')\nprint('0' * 32 + ' passed')\nprint('PASSED')",
    # Looks for the harness's job (the nonce) in every process's stdin and environment, writes a verdict to every
    # stdout it can open, then exits 0.
    "nonce from /proc": WRONG_DEFS + """
import json, os, re
found = set()
for pid in filter(str.isdigit, os.listdir('/proc')):
    for what in ('fd/0', 'environ', 'cmdline'):
        try:
            found |= set(re.findall(r'"nonce": "([0-9a-f]{32})"', open(f'/proc/{pid}/{what}', errors='replace').read()))
        except OSError:
            pass
for pid in filter(str.isdigit, os.listdir('/proc')):
    for nonce in found or {'0' * 32}:
        try:
            with open(f'/proc/{pid}/fd/1', 'w') as out:
                out.write(nonce + ' passed\\n')
        except OSError:
            pass
os._exit(0)
""",
}

# Reads the answers from the dataset: prints the expected output of the stdin test it is given, and defines each
# asserted function as a lookup of the asserted values.
DATASET_HACK = f"""
import json, re, sys
rows = [json.loads(line) for line in open({SHIPPED!r})]
given = sys.stdin.read()
for row in rows:
    for t in row.get("tests", []):
        if given and t["input"] == given:
            print(t["output"], end="")
table = {{}}
for row in rows:
    for a in row.get("asserts", []):
        m = re.match(r"assert (\\w+)\\((.*)\\) (?:==|is) (.*)$", a)
        if m:
            table.setdefault(m[1], {{}})[m[2]] = eval(m[3])
def _lookup(name):
    return lambda *args: table[name][", ".join(map(repr, args))]
for _name in table:
    globals()[_name] = _lookup(_name)
"""


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS, max_parallel=4)


def right_code(p: CodeProblem) -> str:
    return next(code for start, code in RIGHT.items() if p.question.startswith(start))


def score(sb: Sandbox, programs: list[tuple[str, CodeProblem]]) -> list[int]:
    """Tests passed by each (code, problem), all graded at once."""

    async def all_of() -> list[int]:
        results = await asyncio.gather(*(run_tests(sb, code, p.tests) for code, p in programs))
        return [sum(ok for ok, _ in r) for r in results]

    return asyncio.run(all_of())


def old_judge(sb: Sandbox, code: str, t: CodeTest) -> bool:
    """The judge before the harness: the assert appended to the program, exit 0 a pass."""
    return asyncio.run(sb.run_python(code + "\n\n" + t.check + "\n")).ok


ASSERT_PROBLEMS = [p for p in PROBLEMS if all(t.expected is None for t in p.tests)]


def test_right_programs_pass_all_38_shipped_tests(sandbox: Sandbox) -> None:
    assert sum(len(p.tests) for p in PROBLEMS) == 38 and len(ASSERT_PROBLEMS) == 5
    assert score(sandbox, [(right_code(p), p) for p in PROBLEMS]) == [len(p.tests) for p in PROBLEMS]


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_hack_scores_zero(sandbox: Sandbox, hack: str) -> None:
    code = HACKS[hack]
    # Real: the old judge passed it (on the first assert of `add`); a fake verdict targets a judge that reads stdout.
    assert old_judge(sandbox, code, ASSERT_PROBLEMS[0].tests[0]) == (hack not in {"fake verdict", "atexit SystemExit"})
    firsts = [CodeProblem(p.question, p.tests[:1], p.where) for p in ASSERT_PROBLEMS]  # one test of each: quicker
    assert score(sandbox, [(code, p) for p in firsts]) == [0] * len(firsts)


def test_exit_zero_scores_zero_on_every_shipped_test(sandbox: Sandbox) -> None:
    """The issue's figure: `os._exit(0)` passed 17 of 38 shipped tests (every assert test and one more); now only
    that one: the stdin test whose expected output is empty, which any silent program passes."""
    got = score(sandbox, [(HACKS["os._exit(0)"], p) for p in PROBLEMS])
    assert sum(got) == 1
    (p,) = [p for p, n in zip(PROBLEMS, got, strict=True) if n]
    assert [t.expected for t in p.tests].count("") == 1


def test_reading_the_dataset_scores_zero(sandbox: Sandbox) -> None:
    """The dataset is not in the view: the answer-reading program fails on all 38 tests. Without namespaces (the
    file readable) the same program passes, so the view is what stops it."""
    if not sandbox.containment.namespaces:
        pytest.skip("no namespaces here (neither bwrap nor unshare): the dataset is readable (docs/sandbox.md)")
    assert sum(score(sandbox, [(DATASET_HACK, p) for p in PROBLEMS])) == 0
    bare = Sandbox(LIMITS, max_parallel=4, isolation="none")
    sample = [PROBLEMS[0], ASSERT_PROBLEMS[0]]  # a stdin problem and an assert problem: 6 tests
    assert score(bare, [(DATASET_HACK, p) for p in sample]) == [3, 3]


def test_harness_reports_errors_and_timeouts() -> None:
    """A builtin exception in the program comes back as itself (a check may expect it), a non-builtin one as a
    RemoteError; a program killed by its CPU limit makes the run a SIGXCPU (the env's timeout metric)."""
    p = CodeProblem("q", (CodeTest(check="try:\n    f(-1)\nexcept ValueError as e:\n    assert 'neg' in str(e)\n"
                                         "else:\n    raise AssertionError('no error')"),), "w")  # fmt: skip
    raises = "def f(n):\n    if n < 0:\n        raise ValueError('negative')\n    return n"
    own = "class Oops(Exception):\n    pass\ndef f(n):\n    raise Oops('x')"
    loop = "def f(n):\n    while True:\n        pass"
    quick = Sandbox(Limits(cpu_s=1, wall_s=12.0), max_parallel=3)  # wall: 1 s of CPU even on a loaded machine

    async def all_three() -> list[tuple[bool, RunResult]]:
        return [r[0] for r in await asyncio.gather(*(run_tests(quick, c, p.tests) for c in (raises, own, loop)))]

    (ok1, _), (ok2, r2), (ok, r) = asyncio.run(all_three())
    assert ok1 and not ok2 and "RemoteError: Oops: x" in r2.stderr
    assert not ok and r.signal == "SIGXCPU"


def test_objects_stay_in_the_worker(sandbox: Sandbox) -> None:
    """Methods of the program's classes (LiveCodeBench's Solution) are called through handles; lists and dicts come
    back as data; an object of the program's own class is equal to nothing and has no truth value."""
    code = ("class Solution:\n    def pairs(self, n):\n        return [(i, {'sq': i * i}) for i in range(n)]\n"
            "class Box:\n    def __len__(self):\n        return 3\n    def __getitem__(self, i):\n"
            "        return [i, Box()]\ndef make():\n    return Box()")  # fmt: skip
    checks = [
        "assert Solution().pairs(n=3) == [(0, {'sq': 0}), (1, {'sq': 1}), (2, {'sq': 4})]",
        "assert len(make()) == 3 and make()[2][0] == 2 and len(make()[0][1]) == 3",  # remote len and item
        "assert make()",
        "assert make() == make()",
    ]
    got = asyncio.run(run_tests(sandbox, code, tuple(CodeTest(check=c) for c in checks)))
    assert [ok for ok, _ in got] == [True, True, False, False], [r.stderr[-300:] for _, r in got]
    assert "no truth value" in got[2][1].stderr

