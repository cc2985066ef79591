"""`runner render FILE#name`: the first rows of a recipe's data as the trainer sees them, tokens and weights from
the recipe's renderer (SFT conversations; DPO each side of a comparison; the reward model each order of its judge
prompt; generate and distill their prompts; RL the first training groups' first prompts, as its env builds them).
Colored by weight on a terminal, else one JSON object per line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TextIO

from backends.errors import UserError
from runner.renderers.display import colorize
from runner.renderers.registry import get_renderer


def rendered_rows(ref: str, overrides: list[str], n: int) -> Iterator[dict[str, Any]]:
    """{"where", "tokens", "weights"} (+ "side" for comparisons) for the first `n` rows of the recipe's data."""
    from backends.tokenizer import load_tokenizer
    from runner.recipe.load import load_recipe
    from runner.recipe.schema import DPO, RL, SFT, Distill, Generate, RewardModel

    _, recipe = load_recipe(ref, overrides)
    algo = recipe.algo
    if not isinstance(algo, SFT | DPO | RewardModel | Generate | Distill | RL):
        raise UserError(f"runner render shows the data of sft, dpo, reward_model, rl, generate and distill recipes; "
                        f"this one is {type(algo).__name__}")
    renderer = get_renderer(recipe.renderer, load_tokenizer(recipe.tokenizer or recipe.model), model_name=recipe.model)
    if isinstance(algo, SFT):
        from runner.data.conversations import load_conversations
        from runner.renderers.base import render_row

        convs, where = load_conversations(algo.data)
        for conv, w in list(zip(convs, where, strict=True))[:n]:
            tokens, weights = render_row(renderer, conv, algo.train_on_what, w)
            yield {"where": w, "tokens": tokens[: algo.max_length], "weights": weights[: algo.max_length]}
    elif isinstance(algo, DPO | RewardModel):
        from runner.data.comparisons import load_pairs, render_completion

        for pair in load_pairs(algo.data).pairs[:n]:
            if isinstance(algo, DPO):
                for side, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
                    tokens, weights = render_completion(renderer, pair.prompt, completion)
                    yield {"where": pair.where, "side": side, "tokens": tokens[: algo.max_length],
                           "weights": weights[: algo.max_length]}
            else:
                from runner.algos.reward_model import orders

                for side, judged in zip(("chosen first", "rejected first"), orders(renderer, pair, algo.max_length),
                                        strict=True):
                    tokens = [*judged.prefix, judged.label]
                    yield {"where": pair.where, "side": side, "tokens": tokens,
                           "weights": [0.0] * len(judged.prefix) + [1.0]}
    elif isinstance(algo, RL):
        yield from _env_prompts(algo, renderer, recipe.seed, n)
    else:
        from runner.data.conversations import load_conversations

        sources = [algo.prompts] if isinstance(algo, Generate) else [d.prompts for d in algo.datasets]
        shown = 0
        for source in sources:
            convs, where = load_conversations(source)
            for conv, w in zip(convs, where, strict=True):
                if shown >= n:
                    return
                tokens = renderer.build_generation_prompt(conv)
                yield {"where": w, "tokens": tokens, "weights": [0.0] * len(tokens)}
                shown += 1


def _env_prompts(algo: Any, renderer: Any, seed: int, n: int) -> list[dict[str, Any]]:
    """The first prompt of each of the first `n` training groups, built by the env itself (one env per group)."""
    import asyncio

    from runner.rl.envs import EnvContext, build_datasets, get_batch
    from runner.rl.renderer import ChatRenderer

    ctx = EnvContext(ChatRenderer(renderer), 1, 1, algo.groups_per_batch, seed)
    train, _ = build_datasets(algo.env, ctx)

    async def first() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for batch in range(len(train)):
            for group, builder in enumerate(get_batch(train, batch, "train")):
                if len(out) >= n:
                    return out
                ob = await (await builder.make_envs())[0].initial_observation()
                if ob is not None:
                    tokens = list(ob[0])
                    out.append({"where": f"env {type(algo.env).__struct_config__.tag} batch {batch} group {group}", "tokens": tokens,
                                "weights": [0.0] * len(tokens)})
        return out

    return asyncio.run(first())


def render_command(ref: str, overrides: list[str], n: int, as_json: bool, out: TextIO) -> None:
    from backends.tokenizer import load_tokenizer
    from runner.recipe.load import load_recipe

    if n < 1:
        raise UserError(f"--n must be >= 1, got {n}")
    color = not as_json and out.isatty()
    tokenizer = None
    for row in rendered_rows(ref, overrides, n):
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
