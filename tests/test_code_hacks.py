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
            "        return [i, Box()]\ndef make():\n    return Box()\ndef gen(n):\n    yield from range(n)")  # fmt: skip
    checks = [
        "assert Solution().pairs(n=3) == [(0, {'sq': 0}), (1, {'sq': 1}), (2, {'sq': 4})]",
        "assert len(make()) == 3 and make()[2][0] == 2 and len(make()[0][1]) == 3",  # remote len and item
        "assert make()",
        "assert make() == make()",
        "assert list(gen(0)) == [] and list(gen(3)) == [0, 1, 2]",  # remote iteration, an empty one too
    ]
    got = asyncio.run(run_tests(sandbox, code, tuple(CodeTest(check=c) for c in checks)))
    assert [ok for ok, _ in got] == [True, True, False, False, True], [r.stderr[-300:] for _, r in got]
    assert "no truth value" in got[2][1].stderr



# ------------------------------------------------------------------------------------- forged programs (issue #43)
# MBPP-shaped (`assert f(x) == y` lines, some leaving `math` to the program's import) and HumanEval-shaped
# (`def check(candidate): ...` then `check(entry_point)`) problems, each with an honest program.
def _mbpp(*asserts: str) -> CodeProblem:
    return CodeProblem("q", tuple(CodeTest(check=a) for a in asserts), "forged")


def _humaneval(body: str, entry: str) -> CodeProblem:
    return CodeProblem("q", (CodeTest(check=f"METADATA = {{}}\n\n\ndef check(candidate):\n{body}\n\ncheck({entry})\n"),),
                       "forged")  # fmt: skip


JUDGED = {
    # MBPP task 2, its own three asserts.
    "similar": (_mbpp("assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
                      "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
                      "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))"),
                "def similar_elements(a, b):\n    return tuple(set(a) & set(b))"),
    "area": (_mbpp("assert math.isclose(circle_area(2), 12.566370614359172, rel_tol=0.001)"),
             "import math\n\ndef circle_area(r):\n    return math.pi * r * r"),
    "distance": (_mbpp("assert abs(distance(0, 0, 3, 4) - 5.0) < 1e-9"),
                 "import math\n\ndef distance(x1, y1, x2, y2):\n    return math.hypot(x2 - x1, y2 - y1)"),
    "binary": (_mbpp("assert str(to_binary(5)) == '101'"), "def to_binary(n):\n    return bin(n)[2:]"),
    "unique": (_mbpp("assert len(unique([1, 1, 2, 3, 3])) == 3 and sorted(unique([3, 1, 3])) == [1, 3]"),
               "def unique(xs):\n    return list(set(xs))"),
    "evens": (_mbpp("assert isinstance(evens(6), list) and sorted(evens(6)) == [0, 2, 4]"),
              "def evens(n):\n    return list(range(0, n, 2))"),
    "positive": (_mbpp("try:\n    parse_positive('-1')\nexcept ValueError:\n    pass\nelse:\n"
                       "    raise AssertionError('no ValueError')", "assert parse_positive('7') == 7"),
                 "def parse_positive(s):\n    n = int(s)\n    if n < 0:\n        raise ValueError(s)\n    return n"),
    "doubles": (_mbpp("assert all(map(is_double, [(1, 2), (3, 6)]))"),
                "def is_double(p):\n    return p[1] == 2 * p[0]"),
    "square": (_humaneval("    for x in range(10):\n        assert candidate(x) == x * x", "square"),
               "def square(x):\n    return x * x"),
    "truncate": (_humaneval("    assert candidate(3.5) == 0.5\n    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
                            "    assert abs(candidate(123.456) - 0.456) < 1e-6", "truncate_number"),
                 "def truncate_number(x):\n    return x % 1.0"),
    "double": (_humaneval("    for a, b in zip([1, 2, 3], [2, 4, 6]):\n        assert candidate(a) == b", "double"),
               "def double(x):\n    return 2 * x"),
    "fabs": (CodeProblem("q", (CodeTest(check="import math\n\n\ndef check(candidate):\n"
                                         "    assert math.fabs(candidate(2.0) - 4.0) < 1e-6\n\ncheck(square_f)\n"),),
                         "forged"), "def square_f(x):\n    return x * x"),  # fmt: skip
    "totals": (_humaneval("    assert sum(candidate([1, 2, 3])) == 12\n    assert max(candidate([1, 5])) == 10",
                          "doubled"), "def doubled(xs):\n    return [2 * x for x in xs]"),
}

# Each: (problem, program). Every program is wrong (its functions return None or a constant) and tries to make the
# check see a pass: names that shadow builtins, modules, objects that equal anything, patched interpreters.
EQ = "class _Eq:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
FORGED = {
    "set shadowed": ("similar", "set = lambda *a: 0\n\ndef similar_elements(a, b):\n    return None"),
    "abs shadowed": ("distance", "abs = lambda x: 0\n\ndef distance(*a):\n    return 1.0"),
    "abs shadowed (HumanEval)": ("truncate", "abs = lambda x: 0\n\ndef truncate_number(x):\n    return 0.5"),
    "str shadowed": ("binary", "str = lambda *a: '101'\n\ndef to_binary(n):\n    return None"),
    "len and sorted shadowed": ("unique", "len = lambda x: 3\nsorted = lambda *a, **k: [1, 3]\n\n"
                                          "def unique(xs):\n    return None"),
    "isinstance shadowed": ("evens", "isinstance = lambda *a: True\nsorted = lambda *a, **k: [0, 2, 4]\n\n"
                                     "def evens(n):\n    return 0"),
    "ValueError shadowed": ("positive", "ValueError = Exception\n\ndef parse_positive(s):\n    raise TypeError(s)"),
    "range shadowed": ("square", "range = lambda *a: []\n\ndef square(x):\n    return None"),
    "zip shadowed": ("double", "zip = lambda *a: []\n\ndef double(x):\n    return None"),
    "sum and max shadowed": ("totals", "sum = lambda *a: 12\nmax = lambda *a: 10\n\ndef doubled(xs):\n    return None"),
    "all shadowed": ("doubles", "all = lambda *a: True\n\ndef is_double(p):\n    return False"),
    "fake math class": ("area", "class math:\n    isclose = staticmethod(lambda *a, **k: True)\n\n"
                                "def circle_area(r):\n    return 0"),
    "fake math module": ("area", "import types\nmath = types.ModuleType('math')\nmath.isclose = lambda *a, **k: True\n"
                                 "\ndef circle_area(r):\n    return 0"),
    "math patched": ("area", "import math\nmath.isclose = lambda *a, **k: True\n\ndef circle_area(r):\n    return 0"),
    "cmath as math": ("area", "import cmath as math\n\ndef circle_area(r):\n    return 12.566370614359172 + 1j"),
    "sys.modules poisoned": ("fabs", "import sys, types\nfake = types.ModuleType('math')\nfake.fabs = lambda x: 0.0\n"
                                     "sys.modules['math'] = fake\n\ndef square_f(x):\n    return 0.0"),
    "builtins.set patched": ("similar", "import builtins\nbuiltins.set = lambda *a: 0\n\n"
                                        "def similar_elements(a, b):\n    return None"),
    "builtins.abs patched": ("truncate", "import builtins\nbuiltins.abs = lambda x: 0\n\n"
                                         "def truncate_number(x):\n    return 0.5"),
    "__builtins__ replaced": ("similar", "__builtins__ = {'set': lambda *a: 0}\n\n"
                                         "def similar_elements(a, b):\n    return None"),
    "always-equal object": ("square", EQ + "\ndef square(x):\n    return _Eq()"),
    "int with __eq__": ("square", "class _I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
                                  "\ndef square(x):\n    return _I(0)"),
    "list with __eq__": ("unique", "class _L(list):\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
                                   "    def __len__(self):\n        return 3\n\ndef unique(xs):\n    return _L()"),
    "__class__ says list": ("evens", EQ + "    __class__ = property(lambda self: list)\n    def __iter__(self):\n"
                                          "        return iter([0, 2, 4])\n\ndef evens(n):\n    return _Eq()"),
    "StopIteration ends map": ("doubles", "def is_double(p):\n    raise StopIteration"),
    "check redefined": ("square", "def check(candidate):\n    pass\n\ndef square(x):\n    return None"),
    "os._exit(0)": ("square", "import os\n\ndef square(x):\n    return None\n\nos._exit(0)"),
    "atexit exits 0": ("similar", "import atexit, os\natexit.register(os._exit, 0)\n\n"
                                  "def similar_elements(a, b):\n    return None"),
    "exit code 0 from excepthook": ("truncate", "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n\n"
                                                "def truncate_number(x):\n    return None"),
}


def test_honest_programs_pass_every_judged_check(sandbox: Sandbox) -> None:
    got = score(sandbox, [(code, p) for p, code in JUDGED.values()])
    assert got == [len(p.tests) for p, _ in JUDGED.values()]


@pytest.mark.parametrize("name", sorted(FORGED))
def test_forged_program_scores_zero(sandbox: Sandbox, name: str) -> None:
    assert len(FORGED) >= 25
    problem, code = FORGED[name]
    assert score(sandbox, [(code, JUDGED[problem][0])]) == [0]
