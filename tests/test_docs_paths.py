"""Every path of this repo that README.md and docs/*.md name exists, so a rename cannot leave a page pointing at
nothing. What counts as a path here:
- a path under one of the repo's top-level folders (`runner/...`, `backends/...`, `tests/...`, a folder too), and a
  `python -m pkg.mod` of ours;
- a markdown link's target, relative to its page;
- an entry of a `| module | job |` table, inside the package the page names above the table (`backends/serve/`);
- a bare `name.py` in backticks: some file of the repo has that name.
Not checked: URLs, placeholders (NAME, NNNNNN), paths of the user's (`data/chats.jsonl`, `pkg/mod.py`: not under a
folder of ours), and the outputs a documented command writes (GENERATED)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The repo's top-level folders (`tools` was one: a page that still names it is stale).
FOLDERS = ("runner", "backends", "docs", "examples", "tests", "bench", "scripts", "tools")
# Files a documented command writes; absent from a fresh clone.
GENERATED = {"bench/results/gpu-suite.md", "bench/results/gpu_speed.md"}

# A folder of ours and something in it (a bare `tools/` may be a subpackage in a tree of runner/'s).
REPO_PATH = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(FOLDERS)})/[\w.-][\w./-]*)")
MODULE = re.compile(r"python -m ([\w.]+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE = re.compile(r"`([\w-]+\.(?:py|c|sh))`")
# A placeholder a page stands in a path (`NAME_config.py`, `step_NNNNNN.json`), not a name of the repo (README.md).
PLACEHOLDER = re.compile(r"(?<![A-Za-z])(?:NAME|FILE|DIR|PATH|KEY)(?![A-Za-z])|N{3,}|\.\.\.")
PACKAGE = re.compile(r"`((?:runner|backends)/[\w/]*/)`")


@functools.cache
def repo_names() -> frozenset[str]:
    """The name of every file and folder of the repo, hidden folders (.git, .venv: 90 s to walk) and caches left out."""
    names: set[str] = set()
    for _, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "node_modules")]
        names.update(dirs)
        names.update(files)
    return frozenset(names)


def _exists(path: str, base: Path = ROOT) -> bool:
    return path in GENERATED or (base / path).exists()


def stale_paths(page: Path, text: str | None = None) -> list[str]:
    """'page:line: path' for each path the page (or `text`, as if it were the page) names that does not exist."""
    text = page.read_text(encoding="utf-8") if text is None else text
    names = repo_names()
    package: str | None = None  # the package a module table lists: the last one the page named above it
    in_table = False
    out: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        found: list[tuple[str, bool]] = []
        for m in REPO_PATH.finditer(line):
            if line[m.end():m.end() + 1] in ("{", "*", "<"):  # a pattern (`examples/rl_{a,b}.toml`), not a path
                continue
            path = m.group(1).rstrip(".,;:")
            found.append((path, _exists(path)))
        for m in MODULE.finditer(line):
            parts = m.group(1).rstrip(".").split(".")
            if parts[0] in FOLDERS:
                mod = "/".join(parts)
                found.append((m.group(1), _exists(f"{mod}.py") or _exists(f"{mod}/__init__.py")))
        for m in LINK.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if target and "://" not in target and not target.startswith("mailto:"):
                found.append((target, _exists(target, page.parent)))
        if not line.startswith("|"):
            in_table = False
            if pkg := PACKAGE.findall(line):
                package = pkg[-1]
        elif re.match(r"\|\s*module\s*\|", line):
            in_table = True
        if in_table and package is not None:  # a module table's first cell: files of the package
            for entry in re.findall(r"`([\w./-]+)`", line.split("|")[1]):
                found.append((package + entry, _exists(package + entry)))
        else:
            found += [(m.group(1), m.group(1) in names) for m in BARE.finditer(line)]
        out += [f"{page.relative_to(ROOT)}:{n}: {path}" for path, ok in found
                if not ok and not PLACEHOLDER.search(path)]
    return out


def test_every_path_the_docs_name_exists() -> None:
    stale = [s for page in PAGES for s in stale_paths(page)]
    assert not stale, "paths named in the docs that do not exist:\n" + "\n".join(stale)


def test_the_check_sees_each_kind_of_stale_path() -> None:
    """The checker itself, on a page of its own: each kind of reference to a missing file is caught; existing
    ones, URLs, placeholders and the user's paths are not."""
    page = ROOT / "docs" / "probe.md"  # not written: its text is given
    text = (
        "Fine: runner/models.py, `backends/local/` and [a page](serve.md), [web](https://x.org/a.md),\n"
        "`runner/renderers/NAME.py`, `backends/NAME/NAME_config.py`, bench/README.md, data/chats.jsonl, `python -m scripts.tiny_build data`, examples/rl_{a,b}.toml.\n"
        "Stale: tools/tiny_build.py, see [gone](nowhere.md), `python -m runner.nothing_here`,\n"
        "`backends/config.py`, `losses_gone.py`.\n"
        "## Layout (`backends/serve/`)\n"
        "| module | job |\n|---|---|\n| `http.py` / `gone.py` | x |\n"
    )
    found = stale_paths(page, text)
    assert found == [f"docs/probe.md:{n}: {path}" for n, path in [
        (3, "tools/tiny_build.py"), (3, "runner.nothing_here"), (3, "nowhere.md"), (4, "backends/config.py"),
        (4, "losses_gone.py"), (8, "backends/serve/gone.py")]], found
