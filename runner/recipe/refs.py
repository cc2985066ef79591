"""Recipe references as written in a recipe file ("FILE#name", "#name", a run dir), made absolute.

Loading a recipe (runner/recipe/load.py) makes every reference absolute ("/abs/recipes.toml#name", "/abs/runs/x"),
so a run dir's config.toml still names the same upstream from anywhere. Walking the references (which runs a
recipe needs first) is runner/engine/chain.py; running them is runner/engine/pipeline.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.recipe.schema import Recipe

# A generate run's output folder in its run dir (generated/step_NNNNNN.jsonl), read by run_output data sources.
OUTPUT = "generated"


def absolute_ref(ref: str, recipe_file: str) -> str:
    """`ref` as written in `recipe_file`, made absolute when what it names is found (relative paths: from the
    working directory, else next to the recipe file, like data paths). Unfound references stay as written, for
    `upstreams` to report."""
    file, sep, name = ref.rpartition("#")
    base = Path(recipe_file).parent
    if not sep:  # a run dir
        for p in (Path(ref), base / ref):
            if p.is_dir():
                return str(p.resolve())
        return ref
    if not file:
        return f"{Path(recipe_file).resolve()}#{name}"
    for p in (Path(file), base / file):
        if p.is_file():
            return f"{p.resolve()}#{name}"
    return ref


def run_dir_path(recipe: Recipe, name: str) -> Path:
    """Where recipe `name` runs: its log_dir, else runs/<name> (relative to the working directory)."""
    return Path(recipe.log_dir) if recipe.log_dir else Path("runs") / name


def output_files(run_dir: Path) -> list[Path]:
    """The files a generate run wrote, in step order."""
    return sorted((run_dir / OUTPUT).glob("step_*.jsonl"))
