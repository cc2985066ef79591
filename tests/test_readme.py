"""The README's two commands are the product's front door: keep them true."""

import re
from pathlib import Path

from runner.recipe.load import load_recipe

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run's first pytest is the README's test command, verbatim, with nothing pip-installed before it (so the
    suite passes with `.[dev]` alone, the optional extras' tests skipping); its second runs, with that same install,
    the slow tests the first deselects (pyproject's addopts); its third runs the extras' tests (`-m extras`) after
    installing the extras (later ones, e.g. the trackers', come after both, and select slow tests too)."""
    import tomllib

    commands = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    ci_lines = [line for line in commands if "pytest" in line]
    assert len(ci_lines) >= 3
    test_command = _bash_blocks()[1].strip()
    assert ci_lines[0].strip() == test_command and " -q " not in test_command  # pip's progress shows
    first = commands.index(ci_lines[0])
    assert not any("pip install" in line for line in commands[:first])
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-m 'not slow'" in addopts and commands[first + 1] == ".venv/bin/python -m pytest -m slow"
    assert "-m extras" in ci_lines[2] and any("pip install" in line for line in commands[first + 2:commands.index(ci_lines[2])])
    assert all(" -m " in line for line in ci_lines[1:]), "a later step without -m would deselect its slow tests"
    between = (ROOT / "README.md").read_text().split("```bash")[1].split("```", 1)[1]  # the test command's paragraph
    assert "pytest -m slow" in between


def test_main_command_names_a_real_recipe() -> None:
    main_command = _bash_blocks()[0].strip()
    ref = re.search(r"runner run (\S+)", main_command)
    assert ref is not None
    _name, recipe = load_recipe(str(ROOT / ref.group(1)))
    assert recipe.backend.__class__.__name__ == "Local" and recipe.model == "tiny"
    assert main_command.startswith("python3 -m venv .venv && ") and "torch==2.13.0" in main_command


def test_quick_start_shows_progress_and_installs_what_plot_needs() -> None:
    """The first command's install is not silent (no pip -q: it takes minutes), and `runner plot` works after it:
    matplotlib is in the base dependencies the quick start installs (`-e .`, no extra)."""
    import tomllib

    main_command = _bash_blocks()[0].strip()
    assert " -q " not in main_command and "-e . " in main_command
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("matplotlib") for d in deps)
    readme = (ROOT / "README.md").read_text()
    assert "The install takes a few minutes" in readme


def test_pyproject_ships_every_package() -> None:
    """A non-editable install ships what setuptools finds under pyproject's include patterns: every subpackage of
    runner/ and backends/ (each with an __init__.py), and nothing else (tests, bench, tools, examples)."""
    import tomllib

    from setuptools import find_packages

    found_by_setuptools = set(find_packages(
        str(ROOT), include=tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
        ["include"]))
    dirs = {str(p.parent.relative_to(ROOT)).replace("/", ".") for top in ("runner", "backends")
            for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    assert dirs <= found_by_setuptools, f"a folder of modules without __init__.py: {dirs - found_by_setuptools}"
    listed = found_by_setuptools
    found = {
        str(p.parent.relative_to(ROOT)).replace("/", ".")
        for top in ("runner", "backends")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert found == listed


def test_recipe_figures_come_from_the_bench_output() -> None:
    """The README's table of what the shipped recipes do is bench/bench_recipes.py's output, as saved in
    bench/results/recipes.md by bench/figures.py: the same rows (and CI's `bench/figures.py --check` reruns the cheap
    ones at HEAD: tests/test_figures.py checks CI runs it)."""
    saved = (ROOT / "bench" / "results" / "recipes.md").read_text().splitlines()
    rows = [line for line in saved if line.startswith("| ")]
    assert len(rows) >= 4 and rows[0].startswith("| recipe |")
    readme = (ROOT / "README.md").read_text().splitlines()
    start = readme.index(rows[0])
    assert readme[start:start + len(rows) + 1] == [rows[0], saved[saved.index(rows[0]) + 1], *rows[1:]]
    assert any(line.startswith("<!-- figure:recipes (") for line in saved)  # bench/figures.py writes both


def test_every_relative_link_in_the_docs_exists() -> None:
    """The README and docs/ link each other and the code by relative paths: none of them dangles."""
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
