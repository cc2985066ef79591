"""The import graph of runner/ and backends/ has no circles, backends/ never imports runner/, and runner/'s packages
import only down the package order (ORDER below, drawn in docs/architecture.md).

Pure `ast`, no module is imported. Every import statement counts wherever it sits: at module level, inside a
function (a lazy import is still a dependency), under `if TYPE_CHECKING:` (a type-only dependency still couples the
two modules). Relative imports are resolved; `import a.b` is an edge to `a.b`; `from a import b` is an edge to
`a.b` when `a/b.py` (or `a/b/`) exists, else to `a` (b is a name defined in a).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping, Set
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runner", "backends")

# runner/'s packages from the bottom up: a module may import its own package and any package before it, never one
# after it. renderers (messages <-> tokens, over a tokenizer) sit below the recipe, whose schema names them as it
# names backends/'s losses; the engine holds the algorithm interface (runner/engine/spec.py) and finds an algorithm
# module by the name its recipe variant gives, so it never imports runner/algos/; the tools and the CLI sit on top.
ORDER = ("runner.threads", "runner.user_code", "runner.models", "runner.renderers", "runner.recipe", "runner.data", "runner.rewards", "runner.rl",
         "runner.engine", "runner.algos", "runner.tools", "runner.cli", "runner.__main__", "runner")


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__.py)."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute module a `from ...module import x` in `importer` names."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules among `known` that the module `name` (file `path`) imports, anywhere in its body."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                targets.append(sub if sub in known else base)
        for target in targets:
            # `import a.b.c` where only a.b is ours (c a name): the longest known prefix.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    files = module_files(root, packages)
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


@functools.cache
def repo_graph() -> dict[str, frozenset[str]]:
    """import_graph() of runner/ and backends/, parsed once for the tests that only read it."""
    return {name: frozenset(deps) for name, deps in import_graph().items()}


def strongly_connected(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _describe(comp: list[str], graph: Mapping[str, Set[str]]) -> str:
    members = set(comp)
    edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a] & members)]
    return f"circle of {len(comp)}: " + "; ".join(edges)


def test_no_import_circles() -> None:
    graph = repo_graph()
    assert len(graph) > 50, sorted(graph)  # the walk found the packages
    circles = strongly_connected(graph)
    assert not circles, "\n".join(_describe(c, graph) for c in circles)


def test_backends_never_import_runner() -> None:
    graph = repo_graph()
    bad = sorted(f"{a} -> {b}" for a, deps in graph.items() if a.startswith("backends")
                 for b in deps if b == "runner" or b.startswith("runner."))
    assert not bad, bad


def layer_of(module: str, order: Iterable[str] = ORDER) -> int:
    """The position in `order` of the longest entry that is `module` or a package above it."""
    best, found = -1, ""
    for i, entry in enumerate(order):
        if (module == entry or module.startswith(entry + ".")) and len(entry) > len(found):
            best, found = i, entry
    return best


def imports_up(graph: Mapping[str, Set[str]], order: Iterable[str] = ORDER) -> list[str]:
    """Every edge from a module of runner/ to one of a package later in the order ("a -> b")."""
    order = tuple(order)
    return sorted(f"{a} -> {b}" for a, deps in graph.items() if layer_of(a, order) >= 0
                  for b in deps if layer_of(b, order) > layer_of(a, order))


def test_every_module_has_a_place_in_the_order() -> None:
    lost = sorted(m for m in repo_graph() if m.startswith("runner") and layer_of(m) < 0)
    assert not lost, lost


def test_no_import_runs_back_up_the_package_order() -> None:
    up = imports_up(repo_graph())
    assert not up, "imports up the package order (tests/test_import_graph.py ORDER):\n" + "\n".join(up)


def test_the_order_check_sees_a_function_level_import_up(tmp_path: Path) -> None:
    """The checker itself: an import inside a function that reaches a later package is caught, one that reaches an
    earlier one or its own package is not, and the longest matching entry places a module."""
    pkg = tmp_path / "q"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("import os\n\ndef f():\n    from q.high import b\n")
    (pkg / "low" / "c.py").write_text("from q.low import a\n")
    (pkg / "high" / "b.py").write_text("from ..low import c\n")
    order = ("q.low", "q.high", "q")
    graph = import_graph(tmp_path, ["q"])
    assert layer_of("q.high.b", order) == 1 and layer_of("q", order) == 2 and layer_of("r.x", order) == -1
    assert imports_up(graph, order) == ["q.low.a -> q.high.b"]
    (pkg / "low" / "a.py").write_text("import os\n")
    assert imports_up(import_graph(tmp_path, ["q"]), order) == []


def test_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself: function-level, relative, TYPE_CHECKING and `from pkg import module` imports are edges,
    and a circle through them is found (with its members), while a chain is not."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from p.sub import leaf\n")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")  # function-level, relative, module named
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.leaf import X\n")
    (pkg / "sub" / "leaf.py").write_text("import p.a\nX = 1\n")
    (pkg / "c.py").write_text("from p.a import f\nimport os\n")  # a name from p.a: the edge goes to p.a
    graph = import_graph(tmp_path, ["p"])
    assert graph["p.a"] == {"p.b"}
    assert graph["p.b"] == {"p.sub.leaf"}
    assert graph["p.sub.leaf"] == {"p.a"}
    assert graph["p.c"] == {"p.a"}
    assert graph["p.sub"] == {"p.sub.leaf"}
    assert strongly_connected(graph) == [["p.a", "p.b", "p.sub.leaf"]]
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    assert strongly_connected(import_graph(tmp_path, ["p"])) == []
