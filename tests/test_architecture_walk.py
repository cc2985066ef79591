"""docs/architecture.md walks `runner run recipes.toml#rl_basic` to the optimizer step: each numbered line names a
file and the function or class of it on the path. Here: every such file exists and defines that name (a rename or a
move that leaves the walk stale fails), the steps are numbered 1..n, and the walk reaches the optimizer step."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
# "12. `backends/local/backend.py` `LocalBackend`: what it does"
STEP = re.compile(r"^(\d+)\. `([\w/.]+\.py)` `(\w+)`: \S")


def walk(text: str) -> list[tuple[int, str, str]]:
    """(number, file, name) of every numbered step of the page."""
    return [(int(m[1]), m[2], m[3]) for line in text.splitlines() if (m := STEP.match(line))]


def defined(path: Path) -> set[str]:
    """Every function and class name defined anywhere in the file (methods and nested ones too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def stale_steps(steps: list[tuple[int, str, str]], root: Path = ROOT) -> list[str]:
    out = []
    for n, file, name in steps:
        path = root / file
        if not path.is_file():
            out.append(f"{n}. {file}: no such file")
        elif name not in defined(path):
            out.append(f"{n}. {file}: defines no {name}")
    return out


def test_every_step_names_a_file_that_defines_it() -> None:
    steps = walk(PAGE.read_text(encoding="utf-8"))
    assert len(steps) >= 20, steps  # the walk is there, and parsed
    assert [n for n, _, _ in steps] == list(range(1, len(steps) + 1))
    assert steps[0][1:] == ("runner/cli.py", "main")  # the console script (pyproject.toml: runner = "runner.cli:main")
    assert any(name == "_optim_step" for _, _, name in steps)  # ... to the optimizer step
    stale = stale_steps(steps)
    assert not stale, "docs/architecture.md's walk names what is not there:\n" + "\n".join(stale)


def test_the_check_sees_a_stale_step(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("class A:\n    async def go(self):\n        def inner(): ...\n")
    text = "1. `pkg/a.py` `go`: runs\n2. `pkg/a.py` `inner`: nested\n3. `pkg/a.py` `gone`: renamed\n4. `pkg/b.py` `A`: x\n"
    steps = walk(text)
    assert [s[0] for s in steps] == [1, 2, 3, 4]
    assert stale_steps(steps, tmp_path) == ["3. pkg/a.py: defines no gone", "4. pkg/b.py: no such file"]
