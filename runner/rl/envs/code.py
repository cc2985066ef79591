"""`code`: single-turn programming problems; the reply's code runs in the local sandbox against the problem's tests
(the cookbook's code_rl, with runner/rewards/sandbox.py in place of SandboxFusion/Modal).

Rows: {"question": str, "tests": [{"input": str, "output": str}, ...], "asserts": [str, ...]} (either list may be
absent, not both). A stdin/stdout test passes when the program exits 0 and its output matches line by line (trailing
whitespace ignored); an assert test runs in runner/rewards/harness.py: the check code runs in a harness process that
calls the program's functions in another process (of another uid) and passes only when the harness prints the run's
nonce, so the program's exit code, output or patches count for nothing (docs/sandbox.md). Every test is its own
sandboxed run. reward = passed fraction + format_coef·(format − 1); metrics `format`, `compile`, `passed`,
`all_passed`, `timeout` (a test ran out of time).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from backends.errors import UserError
from backends.types import Json
from runner.data.conversations import load_rows
from runner.recipe.common import DataSource
from runner.renderers.chat import ChatRenderer
from runner.rewards import harness
from runner.rewards.sandbox import Limits, RunResult, Sandbox
from runner.rl.envs.code_config import Code
from runner.rl.envs.common import ChatEnv, EnvContext, EnvKind, RepeatGroupBuilder, group_datasets, split
from runner.rl.types import EnvGroupBuilder, Observation, RLDataset, StepResult, StopCondition

INSTRUCTION = (
    "\n\nWrite a complete Python 3 program (or the function asked for) in a single ```python code block."
)
_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class CodeTest:
    stdin: str = ""
    # Expected stdout; None for an assert test.
    expected: str | None = None
    # Python run by the harness against the program's names, for an assert test.
    check: str = ""


@dataclass(frozen=True)
class CodeProblem:
    question: str
    tests: tuple[CodeTest, ...]
    where: str


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python, ```py or bare ```), or None."""
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


def compiles(code: str) -> bool:
    try:
        compile(code, "main.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError, OverflowError):
        return False
    return True


def same_output(got: str, expected: str) -> bool:
    def lines(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip().splitlines()]

    return lines(got) == lines(expected)


def _tests_of(row: Json, where: str) -> tuple[CodeTest, ...]:
    tests: list[CodeTest] = []
    io = row.get("tests", [])
    asserts = row.get("asserts", [])
    if isinstance(io, str):  # DeepCoder / LiveCodeBench rows hold their tests as a JSON string
        try:
            io = json.loads(io)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: \"tests\" is a string but not JSON ({e.msg})") from None
    if isinstance(io, dict) and "inputs" in io and "outputs" in io:  # TACO: parallel lists (+ fn_name)
        io = [{"input": i, "output": o, "fn_name": io.get("fn_name")} for i, o in zip(io["inputs"], io["outputs"])]
    if not isinstance(io, list) or not isinstance(asserts, list):
        raise UserError(f"{where}: \"tests\" and \"asserts\" must be lists")
    for j, t in enumerate(io):
        tests.append(_io_test(t, row, f"{where}: tests[{j}]"))
    for j, a in enumerate(asserts):
        if not isinstance(a, str) or not a.strip():
            raise UserError(f"{where}: asserts[{j}] must be a non-empty string of Python")
        tests.append(CodeTest(check=a))
    if not tests:
        raise UserError(f"{where}: a code problem needs \"tests\" (stdin/stdout pairs) or \"asserts\"")
    return tuple(tests)


def _io_test(t: object, row: Json, where: str) -> CodeTest:
    """{"input", "output"} (stdin/stdout), or a LiveCodeBench functional test: "testtype": "functional" with the
    function's name in its metadata / the row's metadata / fn_name, arguments as JSON lines, output as JSON."""
    if not isinstance(t, dict):
        raise UserError(f"{where} must be {{\"input\": str, \"output\": str}}")
    inp, out = t.get("input"), t.get("output")
    if isinstance(out, list) and len(out) == 1:  # TACO wraps some outputs in a list
        out = out[0]
    if not (isinstance(inp, str) and isinstance(out, str)):
        raise UserError(f"{where} must be {{\"input\": str, \"output\": str}}")
    fn = t.get("fn_name") or _meta(t).get("func_name") or _meta(row).get("func_name")
    if t.get("testtype") != "functional" and not t.get("fn_name"):
        return CodeTest(stdin=inp, expected=out)
    if not isinstance(fn, str) or not fn.isidentifier():
        raise UserError(f"{where} is a functional test without a function name (metadata.func_name)")
    check = (
        "import json as _json\n"
        f"_args = [_json.loads(_line) for _line in {inp!r}.splitlines() if _line.strip()]\n"
        f"_fn = Solution().{fn} if 'Solution' in globals() else {fn}\n"
        f"assert _fn(*_args) == _json.loads({out!r}), 'wrong result'\n"
    )
    return CodeTest(check=check)


def _meta(d: Json) -> Json:
    m = d.get("metadata")
    if isinstance(m, str):
        try:
            m = json.loads(m)
        except json.JSONDecodeError:
            return {}
    return m if isinstance(m, dict) else {}


def load_code_problems(source: DataSource) -> list[CodeProblem]:
    rows, where = load_rows(source)
    if not rows:
        raise UserError(f"code env: the data source {source!r} has no rows")
    out = []
    for row, w in zip(rows, where, strict=True):
        question = next((row.get(k) for k in ("question", "prompt", "problem")
                         if isinstance(row, dict) and isinstance(row.get(k), str) and row[k].strip()), None)  # fmt: skip
        if question is None or not isinstance(row, dict):
            raise UserError(f"{w}: expected an object with a non-empty \"question\" (or \"prompt\", \"problem\")")
        starter = row.get("starter_code")
        if isinstance(starter, str) and starter.strip():
            question += f"\n\nStart from:\n```python\n{starter.rstrip()}\n```"
        out.append(CodeProblem(question, _tests_of(row, w), w))
    return out


HARNESS = Path(harness.__file__).read_text()


async def run_check(sandbox: Sandbox, code: str, check: str) -> tuple[bool, RunResult]:
    """An assert test: passed only when the harness prints this run's nonce (runner/rewards/harness.py)."""
    nonce = secrets.token_hex(16)
    job = json.dumps({"nonce": nonce, "check": check, "source": HARNESS})
    argv = [sandbox.python, "-I", "-S", "-c", HARNESS]
    r = await sandbox.run({"main.py": code}, argv, job, harness=True)
    return r.ok and f"{nonce} passed" in r.stdout.splitlines(), r


async def run_tests(sandbox: Sandbox, code: str, tests: tuple[CodeTest, ...]) -> list[tuple[bool, RunResult]]:
    async def one(t: CodeTest) -> tuple[bool, RunResult]:
        if t.expected is None:
            return await run_check(sandbox, code, t.check)
        r = await sandbox.run_python(code, t.stdin)
        return r.ok and same_output(r.stdout, t.expected), r

    return list(await asyncio.gather(*(one(t) for t in tests)))


class CodeEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, problem: CodeProblem, cfg: Code, sandbox: Sandbox):
        super().__init__(renderer, [{"role": "user", "content": problem.question + INSTRUCTION}])
        self.problem, self.cfg, self.sandbox = problem, cfg, sandbox

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        return await self.grade(reply.text, reply.ended_on_stop)

    async def grade(self, text: str, ended_on_stop: bool) -> StepResult:
        code = extract_code(text)
        format_ok = code is not None and ended_on_stop
        ok = code is not None and compiles(code)
        results = await run_tests(self.sandbox, code, self.problem.tests) if ok and code is not None else []
        n = len(self.problem.tests)
        passed = sum(p for p, _ in results)
        timed_out = any(r.timed_out or r.signal == "SIGXCPU" for _, r in results)
        frac = passed / n
        reward = frac + self.cfg.format_coef * (float(format_ok) - 1.0)
        first_fail = next((r for p, r in results if not p), None)
        logs: dict[str, str | int | float] = {
            "question": self.problem.question,
            "reply": text,
            "tests_passed": f"{passed}/{n}",
            "first_failure": "" if first_fail is None else _describe(first_fail),
            # Which isolation ran the tests: bwrap, unshare or none (docs/sandbox.md).
            "sandbox": self.sandbox.containment.isolation,
        }
        metrics = {
            "format": float(format_ok),
            "compile": float(ok),
            "passed": frac,
            "all_passed": float(passed == n),
            "timeout": float(timed_out),
        }
        return StepResult(reward, True, metrics=metrics, logs=logs)


def _describe(r: RunResult) -> str:
    if r.timed_out:
        return "timed out"
    if r.signal:
        return f"killed by {r.signal}"
    if r.exit_code:
        tail = r.stderr.strip().splitlines()[-1:] or [""]
        return f"exit {r.exit_code}: {tail[0][:200]}"
    return f"wrong output: {r.stdout[:200]!r}"


def build(cfg: Code, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    problems = load_code_problems(cfg.data)
    held = load_code_problems(cfg.test_data) if cfg.test_data else None
    train, test = split(problems, held, cfg, ctx.seed, "code env")
    try:
        sandbox = Sandbox(Limits(cpu_s=cfg.cpu_s, wall_s=cfg.wall_s, memory_mb=cfg.memory_mb), cfg.max_parallel)
    except RuntimeError as e:
        raise UserError(f"code env: {e}") from None

    def make(problem: CodeProblem, group_size: int) -> EnvGroupBuilder:
        env = functools.partial(CodeEnv, ctx.renderer, problem, cfg, sandbox)
        return RepeatGroupBuilder(env, group_size, ["code"])

    return group_datasets(train, test, ctx, make, "code env")


ENV = EnvKind(build, [("env/all/passed", "passed"), ("env/all/compile", "compile"), ("env/all/timeout", "timeout")])
