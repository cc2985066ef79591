"""`runner render FILE#name`: the first rows of a recipe's data as the trainer sees them, tokens and weights from
the recipe's renderer, as its algorithm's spec shows them (`AlgoSpec.show`: SFT conversations; DPO each side of a
comparison; the reward model each order of its judge prompt; generate and distill their prompts; RL the first
training groups' first prompts, as its env builds them). Colored by weight on a terminal, else one JSON object per
line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TextIO

from backends.errors import UserError
from backends.types import Json
from runner.engine.chain import check_all
from runner.engine.pipeline import naming
from runner.engine.spec import spec_of
from runner.recipe.load import split_ref
from runner.renderers.display import colorize
from runner.renderers.registry import get_renderer


def rendered_rows(ref: str, overrides: list[str], n: int) -> Iterator[Json]:
    """{"where", "tokens", "weights"} (+ "side" for comparisons) for the first `n` rows of the recipe's data: what
    its algorithm's spec shows (`AlgoSpec.show`, runner/engine/spec.py)."""
    from backends.tokenizer import load_tokenizer
    from runner.recipe.load import load_recipe

    name, recipe = load_recipe(ref, overrides)
    where = f"{split_ref(ref)[0]}#{name}"
    spec = spec_of(recipe.algo)
    if spec.show is None:
        kind = type(recipe.algo).__struct_config__.tag
        raise UserError(f"{where}: runner render: the {kind} algorithm has no data to show (its AlgoSpec declares no "
                        "`show`)")
    # What `runner run` checks first is checked here too, and every error names the recipe as run's do.
    check_all(recipe, where)
    with naming(where):
        renderer = get_renderer(recipe.renderer, load_tokenizer(recipe.tokenizer or recipe.model),
                                model_name=recipe.model)
        yield from spec.show(recipe.algo, recipe, renderer, n)


def render_command(ref: str, overrides: list[str], n: int, as_json: bool, out: TextIO) -> None:
    from backends.tokenizer import load_tokenizer
    from runner.recipe.load import load_recipe

    if n < 1:
        raise UserError(f"--n must be >= 1, got {n}")
    color = not as_json and out.isatty()
    tokenizer = None
    shown = 0
    for row in rendered_rows(ref, overrides, n):
        shown += 1
        if not color:
            out.write(json.dumps(row) + "\n")
            continue
        if tokenizer is None:
            _, recipe = load_recipe(ref, overrides)
            tokenizer = load_tokenizer(recipe.tokenizer or recipe.model)
        side = f" ({row['side']})" if "side" in row else ""
        trained = sum(1 for w in row["weights"] if w > 0)
        out.write(f"── {row['where']}{side}: {len(row['tokens'])} tokens, {trained} trained\n")
        out.write(colorize(row["tokens"], row["weights"], tokenizer, color=True) + "\n\n")
    out.flush()
    if not shown:  # silence would read as success
        name, _ = load_recipe(ref, overrides)
        raise UserError(f"{split_ref(ref)[0]}#{name}: runner render: nothing to show (its data or env gave no rows or "
                        "prompts)")
