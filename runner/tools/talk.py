"""`runner sample | chat | eval`: talk to and evaluate any checkpoint of a run, through the backend the run used.

A target is a run dir (its config.toml says model, backend and recipe) or a recipe `FILE#name` (its run dir).
`--checkpoint NAME` picks a row of checkpoints.jsonl (default: the last one with sampler weights); `base` is the
base model. Evals use the recipe's own evaluators on that checkpoint's sampler weights: the final eval of RL, DPO,
the reward model and distillation (the same seeds, so on the final checkpoint of a CPU run they repeat the logged
final row exactly), and for SFT the held-out NLL (`compute_logprobs`; the agreement eval too when the recipe asks
for it). Eval rows are appended to the run dir's evals.jsonl, never to metrics.jsonl (one row per step there).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from backends.errors import UserError
from backends.types import Json
from runner.recipe.schema import Recipe

if TYPE_CHECKING:
    from backends.base import Backend, SamplingClient
    from runner.engine.context import Algorithm, FinalContext
    from runner.renderers.chat import ChatRenderer

EVALS = "evals.jsonl"


@dataclass
class Target:
    name: str
    recipe: Recipe
    run_dir: Path
    where: str
    # The checkpoint row (None: the base model).
    checkpoint: Json | None


def open_target(target: str, checkpoint: str | None, base_ok: bool = True) -> Target:
    """A run dir or FILE#name, and the checkpoint to use (a name, the steps it was saved after, or "base" when
    base_ok); one-line UserErrors for everything a user can get wrong."""
    from runner.engine.rundir import CONFIG, load_config, read_checkpoints, run_dir_path
    from runner.recipe.load import load_recipe

    path = Path(target)
    if "#" not in target and path.is_dir():
        if not (path / CONFIG).is_file():
            raise UserError(f"{target}: not a run dir (no {CONFIG})")
        recipe = load_config(path / CONFIG)
        run_dir, name, where = path, path.name, f"{path / CONFIG}"
    elif "#" in target:
        name, recipe = load_recipe(target)
        run_dir, where = run_dir_path(recipe, name), target
    else:
        raise UserError(f"{target}: neither a run dir nor a recipe FILE#name")
    if checkpoint == "base" and base_ok:
        return Target(name, recipe, run_dir, where, None)
    rows = [r for r in read_checkpoints(run_dir) if r.get("sampler_path")]
    if not rows:
        raise UserError(f"{run_dir} has no checkpoint yet (run it first{', or use --checkpoint base' if base_ok else ''})")
    if checkpoint is None:
        return Target(name, recipe, run_dir, where, rows[-1])
    for row in rows:  # by name ("000020", "final"), or by the steps trained (--checkpoint 20)
        if row.get("name") == checkpoint or (checkpoint.isdigit() and row.get("next_step") == int(checkpoint)):
            return Target(name, recipe, run_dir, where, row)
    names = ", ".join(f"{r.get('name')} (step {r.get('next_step')})" for r in rows)
    raise UserError(f"{run_dir}: no checkpoint {checkpoint!r}; available: {names}{', base' if base_ok else ''}")


def _backend(t: Target) -> Backend:
    return t.recipe.backend.make(t.recipe.model, t.recipe.tokenizer, t.run_dir / "checkpoints", t.recipe.seed)


def _renderer(t: Target, backend: Backend) -> ChatRenderer:
    """The recipe's renderer (runner/renderers/) as the envs' ChatRenderer: prompts, stops, reply parsing."""
    from runner.renderers import get_renderer
    from runner.renderers.chat import ChatRenderer

    return ChatRenderer(get_renderer(t.recipe.renderer, backend.get_tokenizer(), model_name=t.recipe.model))


async def _client(backend: Backend, t: Target) -> SamplingClient:
    if t.checkpoint is None:
        return await backend.create_sampling_client(base_model=t.recipe.model)
    return await backend.create_sampling_client(model_path=t.checkpoint["sampler_path"])


def check_text(text: str, where: str) -> str:
    """text, or a UserError when it is not valid UTF-8: Python hands undecodable bytes of the command line or stdin
    on as lone surrogates, which the tokenizer refuses with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{where}: not valid UTF-8 text (at character {e.start})") from None
    return text


def check_messages(messages: list[dict[str, str]], where: str) -> list[dict[str, str]]:
    for m in messages:
        if isinstance(m.get("content"), str):
            check_text(m["content"], where)
    return messages


def read_prompts(file: str) -> list[list[dict[str, str]]]:
    """Rows {"messages": [...]} (ending with the user's turn) or {"prompt": "..."}; errors name file:line."""
    from runner.data.conversations import conversation
    from runner.data.files import read_jsonl

    out = []
    # The data files' reader: a missing file, a folder or FIFO, bytes that are not UTF-8 or a line that is not JSON
    # each one line naming file:line.
    for row, where in read_jsonl(Path(file)):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append(check_messages([{"role": "user", "content": row["prompt"]}], where))
        elif isinstance(row, dict) and "messages" in row:
            out.append(check_messages(conversation(row, where), where))
        else:
            raise UserError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
    if not out:
        raise UserError(f"{file}: no prompts")
    return out


def sample(target: str, checkpoint: str | None, prompts: list[list[dict[str, str]]], n: int, temperature: float,
           max_tokens: int, seed: int | None, as_json: bool, out: TextIO) -> None:
    from backends.types import SamplingParams

    t = open_target(target, checkpoint)
    backend = _backend(t)
    try:
        renderer = _renderer(t, backend)

        async def go() -> list[list[str]]:
            client = await _client(backend, t)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=renderer.stop,
                                    seed=seed)
            outs = await asyncio.gather(*(client.sample(renderer.build_prompt(p), n, params) for p in prompts))
            return [[renderer.parse(s.tokens).text for s in o.sequences] for o in outs]

        replies = asyncio.run(go())
    finally:
        backend.close()
    label = t.checkpoint["name"] if t.checkpoint else "base"
    for prompt, texts in zip(prompts, replies, strict=True):
        if as_json:
            out.write(json.dumps({"checkpoint": label, "messages": prompt, "completions": texts}) + "\n")
            continue
        out.write(f"> {prompt[-1]['content']}\n")
        out.writelines(f"[{i + 1}] {text}\n" if len(texts) > 1 else f"{text}\n" for i, text in enumerate(texts))
        out.write("\n")
    out.flush()


def chat(target: str, checkpoint: str | None, temperature: float, max_tokens: int, system: str | None,
         stdin: TextIO, out: TextIO) -> None:
    """A multi-turn chat: one reply per input line; `/reset` starts over, `/quit` (or EOF) ends."""
    from backends.types import SamplingParams

    t = open_target(target, checkpoint)
    backend = _backend(t)
    tty = stdin.isatty()
    try:
        renderer = _renderer(t, backend)
        client = asyncio.run(_client(backend, t))
        start = [{"role": "system", "content": check_text(system, "--system")}] if system else []
        messages = list(start)
        if tty:
            label = t.checkpoint["name"] if t.checkpoint else "base"
            out.write(f"chatting with {t.name} (checkpoint {label}); /reset starts over, /quit or Ctrl-D ends\n")
        while True:
            if tty:
                out.write("you> ")
                out.flush()
            line = stdin.readline()
            if not line:
                break
            text = line.strip()
            if text == "/quit":
                break
            if text == "/reset":
                messages = list(start)
                # Said on the terminal; piped, stdout holds only replies (one JSON string a line), so on stderr.
                note = out if tty else sys.stderr
                note.write("(conversation reset: the next message starts a new chat)\n")
                note.flush()
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": check_text(text, "stdin")})
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=renderer.stop)
            result = client.sample(renderer.build_prompt(messages), 1, params).result()
            reply = renderer.parse(result.sequences[0].tokens).text
            messages.append({"role": "assistant", "content": reply})
            # Piped: each reply one line, as a JSON string, so a reply's own newlines cannot split it.
            out.write(f"{t.name}> {reply}\n" if tty else json.dumps(reply, ensure_ascii=False) + "\n")
            out.flush()
    finally:
        backend.close()


async def _evaluate_all(algo: Algorithm, ctx: FinalContext, recipe: Recipe) -> dict[str, float]:
    """The algorithm's held-out evals, then the recipe's pinned ones (runner/engine/evals.py), on ctx's weights."""
    from runner.engine.evals import pinned_metrics

    metrics = dict(await algo.evaluate(ctx))
    sampler = ctx.backend.create_sampling_client(ctx.sampler_path) if recipe.evals else None
    if sampler is not None:
        metrics.update(await pinned_metrics(recipe.evals, sampler, ctx.backend.get_tokenizer(), recipe.renderer,
                                            recipe.model))
    return metrics


def eval_order(recipe: Recipe, metrics: dict[str, float]) -> list[str]:
    """The keys `runner eval` prints: the algorithm's main metrics first (`runner compare`'s, held-out first), then the
    rest alphabetically; no time/ keys."""
    from runner.engine.spec import spec_of

    main = [k for k in spec_of(recipe.algo).compare_keys() if k in metrics]
    return [*main, *sorted(k for k in metrics if k not in main and not k.startswith("time/"))]


def evaluate(target: str, checkpoint: str | None, out: TextIO) -> dict[str, float]:
    """The recipe's evaluators on one checkpoint; printed, and appended to the run dir's evals.jsonl."""
    from runner.engine.chain import resolved_inputs
    from runner.engine.context import FinalContext
    from runner.engine.log import append_jsonl
    from runner.engine.loop import make_algo

    if checkpoint == "base":
        raise UserError("eval needs a checkpoint of the run (its sampler weights), not base: the held-out evals of the "
                        "base model are the run's step-0 eval row")
    t = open_target(target, checkpoint, base_ok=False)
    assert t.checkpoint is not None
    inputs = resolved_inputs(t.recipe, t.where)
    backend = _backend(t)
    try:
        algo = make_algo(t.recipe, inputs["init"], inputs["weights"])(backend.get_tokenizer())
        # The checkpoint's step: its test rollouts are seeded as the run's eval at that step was (the same value).
        ctx = FinalContext(backend, t.checkpoint["sampler_path"], t.run_dir, t.checkpoint.get("next_step"))

        metrics = asyncio.run(_evaluate_all(algo, ctx, t.recipe))
    finally:
        backend.close()
    if not metrics:
        raise UserError(f"{t.where}: the recipe has nothing to evaluate (no held-out data, test set or pinned evals)")
    row = {"checkpoint": t.checkpoint["name"], "step": t.checkpoint.get("next_step"), **metrics, "time": time.time()}
    append_jsonl(t.run_dir / EVALS, row)
    out.write(f"{t.name} checkpoint {t.checkpoint['name']} (after {t.checkpoint.get('next_step')} steps)\n")
    for k in eval_order(t.recipe, metrics):
        out.write(f"  {k} {metrics[k]:.6g}\n")
    out.flush()
    return metrics
