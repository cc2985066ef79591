"""Every recipe example written in runner/'s and backends/' docstrings and comments passes `runner check` (issue #41:
two docstrings once told users to write `algo = {kind = "custom", target = ...}`, which check refused).

An example is a backticked `PATH = {kind = "K", ...}` (or `[[recipes.x.evals]] kind = "K"`). Each one's kind must be
a choice `runner check` offers at that key path (asked of check itself, with a kind that is not one); an example
with nothing left to fill in (no `...`, no `pkg.mod`, no `a | b`, no `#this` recipe name) must pass check as written, as an override of a
shipped recipe."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = str(ROOT / "recipes.toml")
# Where each example's table goes: the shipped recipe it overrides and the key path there.
TARGETS = {
    "algo": ("sl_basic", "algo"),
    "backend": ("sl_basic", "backend"),
    "renderer": ("sl_basic", "renderer"),
    "data": ("sl_basic", "algo.data"),
    "algo.data": ("sl_basic", "algo.data"),
    "algo.env": ("rl_basic", "algo.env"),
    "algo.loss": ("rl_basic", "algo.loss"),
    "loss": ("rl_basic", "algo.loss"),
}
EXAMPLE = re.compile(r"`(" + "|".join(re.escape(k) for k in sorted(TARGETS, key=len, reverse=True))
                     + r") ?= ?(\{ ?kind ?= ?\"(\w+)\"[^`]*\})`")
EVAL = re.compile(r"`\[\[recipes\.\w+\.evals\]\] kind = \"(\w+)\"`")
PLACEHOLDERS = ("...", "pkg.mod", " | ", '"#this"')  # `run = "#this"`: the reader's own recipe name


def examples() -> list[tuple[str, str, str, str]]:
    """(file:line, path, table, kind) for every example in runner/ and backends/."""
    found = []
    for pkg in ("runner", "backends"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                where = f"{path.relative_to(ROOT)}:{n}"
                found += [(where, m[1], m[2], m[3]) for m in EXAMPLE.finditer(line)]
                found += [(where, "evals", "", m[1]) for m in EVAL.finditer(line)]
    return found


def choices(capsys: pytest.CaptureFixture[str], recipe: str, override: str) -> set[str]:
    """The kinds `runner check` lists when given one that is not a kind."""
    capsys.readouterr()
    assert main(["check", f"{RECIPES}#{recipe}", override]) == 2
    err = capsys.readouterr().err
    m = re.search(r"invalid choice '__nope__'; expected one of: (.*)$", err.strip())
    assert m, err
    return set(m[1].split(", "))


def test_the_examples_are_found() -> None:
    found = examples()
    paths = {p for _, p, _, _ in found}
    assert len(found) >= 30 and {"algo", "backend", "algo.env", "algo.loss", "evals"} <= paths, found


def kinds_check_accepts(capsys: pytest.CaptureFixture[str]) -> dict[str, set[str]]:
    known = {path: choices(capsys, recipe, f"{key}.kind=__nope__") for path, (recipe, key) in TARGETS.items()}
    known["evals"] = choices(capsys, "sl_basic", 'evals=[{kind = "__nope__"}]')
    known["algo"].discard("custom")  # the old spelling, kept only to be refused with the new one
    return known


def wrong_kinds(found: list[tuple[str, str, str, str]], known: dict[str, set[str]]) -> list[tuple[str, str, str]]:
    return [(where, path, kind) for where, path, _, kind in found if kind not in known[path]]


def test_every_example_names_a_kind_check_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    known = kinds_check_accepts(capsys)
    assert not wrong_kinds(examples(), known), wrong_kinds(examples(), known)
    # and the old advice would have been caught
    old = EXAMPLE.search('see `algo = {kind = "custom", target = "pkg.mod:X"}` there')
    assert old and wrong_kinds([("x", old[1], old[2], old[3])], known) == [("x", "algo", "custom")]


def test_every_complete_example_passes_check_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    complete = [(where, path, table) for where, path, table, _ in examples()
                if path != "evals" and not any(p in table for p in PLACEHOLDERS)]
    assert len(complete) >= 5, complete
    for where, path, table in complete:
        recipe, key = TARGETS[path]
        capsys.readouterr()
        assert main(["check", f"{RECIPES}#{recipe}", f"{key}={table}"]) == 0, (where, capsys.readouterr().err)
    capsys.readouterr()  # and a complete example with a typo would fail
    assert main(["check", f"{RECIPES}#rl_basic", 'algo.loss={kind = "ppo", clip_lo = 0.8}']) == 2
