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
#
# A config module (a `*_config.py`: an extension's recipe struct beside its code, backends/configs.py `found`)
# sits at the recipe's layer wherever its file is: the schema builds its unions from them, and code of any layer above
# reads them (runner/rl/ a runner/algos/ config), so one imports only what the recipe may (CONFIG_LAYER).
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


CONFIG_LAYER = "runner.recipe"


def is_config(module: str) -> bool:
    return module.rpartition(".")[2].endswith("_config")


def layer_of(module: str, order: Iterable[str] = ORDER) -> int:
    """The position in `order` of the longest entry that is `module` or a package above it (a config module of
    runner/: the recipe's, CONFIG_LAYER)."""
    order = tuple(order)
    if module.startswith("runner.") and is_config(module) and CONFIG_LAYER in order:
        return order.index(CONFIG_LAYER)
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


# ---------------------------------------------------------------- config modules and the unions built from them

FINDERS = ("found", "config_modules")


def _package_arg(call: ast.Call, module: str) -> str | None:
    """The package a finder call names: a string, `__name__` / `__package__` (the calling module's), or `x or "y"`."""
    if not call.args:
        return None
    arg = call.args[1] if len(call.args) > 1 and call.func and getattr(call.func, "id", "") == "found" else call.args[0]
    if isinstance(arg, ast.BoolOp):
        arg = arg.values[-1]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.Name) and arg.id in ("__name__", "__package__"):
        return module if arg.id == "__name__" else module.rpartition(".")[0]
    return None


def import_time_finders(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """module -> the packages whose config modules it imports while it is itself imported: a module-level call of a
    finder (`found`, `config_modules`) or of a function of ours whose body calls one (builtin_configs)."""
    files = module_files(root, packages)
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in files.items()}
    wrappers: dict[str, str] = {}  # function name -> the package its body finds
    for name, tree in trees.items():
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name not in FINDERS):
            for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call) and getattr(c.func, "id", "") in FINDERS):
                if (pkg := _package_arg(call, name)) is not None:
                    wrappers[fn.name] = pkg
    out: dict[str, set[str]] = {}
    for name, tree in trees.items():
        top = [c for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for c in ast.walk(stmt) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
        for call in top:
            pkg = _package_arg(call, name) if call.func.id in FINDERS else wrappers.get(call.func.id)
            if pkg is not None:
                out.setdefault(name, set()).add(pkg)
    return out


def half_built_configs(graph: Mapping[str, Set[str]], finders: Mapping[str, Set[str]]) -> list[str]:
    """Config modules that import, directly or not, a module finding their own package's configs as it is imported
    (its package's own __init__ aside: Python runs that first). Imported first, such a module would run the finder
    midway through itself and its union would miss what it declares below that import."""
    bad: list[str] = []
    for module in sorted(m for m in graph if is_config(m)):
        seen, todo = set(), list(graph[module])
        while todo:
            dep = todo.pop()
            if dep in seen:
                continue
            seen.add(dep)
            todo.extend(graph.get(dep, ()))
            finds = {p for p in finders.get(dep, ()) if module.startswith(p + ".")}
            if finds and not module.startswith(dep + "."):
                bad.append(f"{module} -> ... -> {dep} (finds {', '.join(sorted(finds))})")
    return bad


def test_config_modules_sit_at_the_recipe_layer() -> None:
    """Every union of the schema is built from config modules (algorithms, envs, pinned evals, losses, backends), and
    every such module imports nothing above the recipe's layer (checked by the order test through layer_of) and never
    the module that finds its own kind."""
    graph = repo_graph()
    finders = import_time_finders()
    found_packages = {p for ps in finders.values() for p in ps}
    assert {"runner.algos", "runner.rl.envs", "runner.engine", "backends.losses", "backends"} <= found_packages, finders
    configs = [m for m in graph if is_config(m) and m.rpartition(".")[0] in found_packages | {"backends.local",
                                                                                                "backends.tinker"}]
    assert len(configs) >= 30, configs
    assert all(layer_of(m) == ORDER.index(CONFIG_LAYER) for m in configs if m.startswith("runner."))
    bad = half_built_configs(graph, finders)
    assert not bad, "\n".join(bad)


def test_the_half_built_check_sees_a_config_importing_its_finder(tmp_path: Path) -> None:
    """The checker itself: a config module that imports (through another module) the module finding its package is
    caught; one whose finder is its own package's __init__ is not."""
    pkg = tmp_path / "q"
    (pkg / "kinds").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kinds" / "__init__.py").write_text("")
    (pkg / "base.py").write_text("class B: ...\n")
    (pkg / "union.py").write_text("from q.base import B\nfrom x import found\nU = found(B, 'q.kinds')\n")
    (pkg / "helper.py").write_text("from q.union import U\n")
    (pkg / "kinds" / "a_config.py").write_text("from q.helper import U\n")
    (pkg / "kinds" / "b_config.py").write_text("from q.base import B\n")
    graph = import_graph(tmp_path, ["q"])
    finders = import_time_finders(tmp_path, ["q"])
    assert finders == {"q.union": {"q.kinds"}}
    assert half_built_configs(graph, finders) == ["q.kinds.a_config -> ... -> q.union (finds q.kinds)"]
    (pkg / "kinds" / "a_config.py").write_text("from q.base import B\n")
    assert half_built_configs(import_graph(tmp_path, ["q"]), finders) == []


# ---------------------------------------------------------------- particular backends: reached only by the composition roots
# backends/ is a shared bottom (errors, types, the backend interface, tokenizer loading, the loss registry, the config
# finder) with the backends beside it: each folder of backends/ (local/, tinker/, serve/: the HTTP service over the
# local backend) and the test double (fake.py) is a particular backend, save the shared folders below. Only the
# composition roots, which turn a command line into a run, may name one; every other module of runner/ reaches a
# backend through the interface (backends/base.py, backends/backend_config.py: a recipe's `backend = {...}` makes its
# own), and the shared bottom never imports one (the "tiny" tokenizer is backends/tiny_tokenizer.py's, not the model's).
SHARED_FOLDERS = ("backends.losses",)
TEST_DOUBLES = ("backends.fake",)
COMPOSITION_ROOTS = ("runner.cli", "runner.tools")
# Known, named exceptions, each to be removed with its edge (the test fails on a listed edge that is gone):
# the verifiers env renders through `runner serve`'s OpenAI chat translation, backends/serve/chat_api.py (which imports
# nothing of the server).
ALLOWED: frozenset[str] = frozenset({"runner.rl.envs.verifiers_env -> backends.serve.chat_api"})


def particular_backends(root: Path = ROOT, package: str = "backends", shared: Iterable[str] = SHARED_FOLDERS,
                        doubles: Iterable[str] = TEST_DOUBLES) -> tuple[str, ...]:
    """The particular backends of `package`: each of its sub-packages (a folder with an __init__.py) that is not a
    shared one, and its test doubles."""
    folder = root.joinpath(*package.split("."))
    subs = {f"{package}.{p.parent.name}" for p in folder.glob("*/__init__.py")}
    return tuple(sorted((subs - set(shared)) | set(doubles)))


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def backend_reaches(graph: Mapping[str, Set[str]], particular: Iterable[str], roots: Iterable[str] = COMPOSITION_ROOTS,
                    runner: str = "runner", bottom: str = "backends") -> list[str]:
    """Every edge ("a -> b") to a particular backend b from a module of `runner` outside the composition roots, or from
    the shared bottom of `bottom` (a module of it in no particular backend)."""
    particular, roots = tuple(particular), tuple(roots)
    bad = []
    for a, deps in graph.items():
        from_runner = _within(a, (runner,)) and not _within(a, roots)
        from_bottom = _within(a, (bottom,)) and not _within(a, particular)
        if from_runner or from_bottom:
            bad += [f"{a} -> {b}" for b in deps if _within(b, particular)]
    return sorted(bad)


def test_only_the_composition_roots_import_a_particular_backend() -> None:
    particular = particular_backends()
    assert {"backends.local", "backends.tinker", "backends.serve", "backends.fake"} <= set(particular), particular
    assert not set(particular) & set(SHARED_FOLDERS)
    bad = backend_reaches(repo_graph(), particular)
    stale = sorted(ALLOWED - set(bad))
    assert not stale, f"listed in ALLOWED but gone (remove them): {stale}"
    bad = [edge for edge in bad if edge not in ALLOWED]
    assert not bad, ("a particular backend imported outside runner/cli.py and runner/tools/, or by backends/'s shared "
                     "bottom (tests/test_import_graph.py):\n" + "\n".join(bad))


def test_the_backend_check_sees_a_planted_import(tmp_path: Path) -> None:
    """The checker itself: a runner module (even a function-level import) or a bottom module reaching a particular
    backend is caught; a composition root, a backend importing the bottom or another backend, and the shared folders
    are not."""
    for d in ("r/engine", "r/tools", "b/local", "b/losses"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "__init__.py").write_text("")
    for d in ("r", "b"):
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "b" / "base.py").write_text("import os\n")
    (tmp_path / "b" / "fake.py").write_text("from b.base import os\n")
    (tmp_path / "b" / "local" / "model.py").write_text("from b import base, fake\n")
    (tmp_path / "b" / "losses" / "ppo.py").write_text("from b.base import os\n")
    (tmp_path / "r" / "tools" / "serve.py").write_text("from b.local import model\n")
    (tmp_path / "r" / "engine" / "loop.py").write_text("from b import base\nfrom b.losses import ppo\n")
    particular = particular_backends(tmp_path, "b", ("b.losses",), ("b.fake",))
    assert particular == ("b.fake", "b.local")

    def check() -> list[str]:
        return backend_reaches(import_graph(tmp_path, ["r", "b"]), particular, ("r.tools",), "r", "b")

    assert check() == []
    (tmp_path / "r" / "engine" / "loop.py").write_text("from b import base\n\ndef f():\n    from b.fake import x\n")
    (tmp_path / "b" / "base.py").write_text("import os\nfrom .local.model import X\n")
    assert check() == ["b.base -> b.local.model", "r.engine.loop -> b.fake"]
