"""The house rules that a reader relies on: backends/ is the lower layer and never imports runner/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_backends_never_import_runner() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+runner\b")
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "backends").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.match(line)]
    assert offenders == []


def test_backends_import_alone() -> None:
    """Importing every backends module in a fresh interpreter loads no runner module (lazy imports included)."""
    code = ("import sys, pkgutil, importlib, backends\n"
            "for m in pkgutil.walk_packages(backends.__path__, 'backends.'):\n"
            "    importlib.import_module(m.name)\n"
            "bad = sorted(n for n in sys.modules if n == 'runner' or n.startswith('runner.'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_schema_is_only_the_schema() -> None:
    """runner/recipe/schema.py and its parts (common, sources, envs, pinned, cost, numerics_table) declare tables; reading,
    overrides, error text and imports of user code live elsewhere."""
    for part in ("schema", "common", "sources", "envs", "pinned", "cost", "numerics_table"):
        text = (REPO / "runner" / "recipe" / f"{part}.py").read_text()
        for word in ("tomllib", "importlib", "def load_", "def apply_overrides", "def explain", "def import_target"):
            assert word not in text, (part, word)
    assert not (REPO / "runner" / "rl" / "schema.py").exists()
