"""Every third-party package that runner/ and backends/ import is declared in pyproject.toml (issue 23: tokenizers,
huggingface_hub, tqdm and zstandard were imported but not declared, so a clean install could miss them)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"runner", "backends"}
# Extras a user installs to get a feature (the import sits behind that feature); dev and bench are for us.
FEATURE_EXTRAS = ("plot", "wandb", "tensorboard", "mlflow", "trackio", "inspect", "reasoning", "verifiers")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def imported_top_levels(*folders: str) -> dict[str, set[str]]:
    """Top-level module name -> the files importing it (every import statement, at any depth in the file)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in FEATURE_EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return {_norm(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in reqs}


@functools.cache
def _packages_distributions() -> Mapping[str, list[str]]:
    """importlib.metadata.packages_distributions(), read once: each call scans every installed distribution."""
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    """The distributions that provide `module` (installed ones), else the module's own name normalised."""
    dists = _packages_distributions().get(module)
    return {_norm(d) for d in dists} if dists else {_norm(module)}


def test_the_scan_sees_imports():
    found = imported_top_levels("runner", "backends")
    assert {"msgspec", "torch", "numpy", "tomllib"} <= set(found)
    assert "backends/tiny_tokenizer.py" in found["tokenizers"]  # an import inside a function counts too


def test_every_third_party_import_is_declared():
    deps = declared()
    missing = {
        module: sorted(files)[:3]
        for module, files in imported_top_levels("runner", "backends").items()
        if module not in OURS and module not in sys.stdlib_module_names and not distributions(module) & deps
    }
    assert not missing, f"imported but not declared in pyproject.toml's dependencies: {missing}"
