"""`algo = {kind = "generate", ...}` behind the loop's Algorithm interface: the first stage of prompt distillation.

Step k samples the teacher (with its `system` prompt) over prompts [k·batch_size, (k+1)·batch_size) and writes the
conversations *without* the system prompt to generated/step_<k>.jsonl in the run dir, one file per step written
whole (atomically), so a resumed run rewrites exactly the steps after its checkpoint and nothing is duplicated.
Every sample has an explicit seed from (recipe seed, prompt index), so a run repeats. An SFT recipe trains on the
rows with `data = {kind = "run_output", run = "#this"}` (runner/data/conversations.py), and `runner run` of that recipe runs this
one first (runner/engine/chain.py).

It goes through the same loop as training (checkpoints are its resume points); it submits no training call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypedDict

from backends.base import Backend, SamplingClient, TrainingClient
from backends.errors import UserError
from backends.tokenizer import Tokenizer
from backends.types import AdamParams, Json, SamplingParams
from runner.algos.generate_config import Generate
from runner.data.conversations import Conversation, load_conversations, prompt_rows
from runner.data.position import check_resume
from runner.engine.context import AlgorithmBase, Context
from runner.engine.log import write_text_atomic
from runner.engine.rundir import OUTPUT
from runner.engine.spec import AlgoSpec, BuildArgs, Settings
from runner.recipe.schema import Recipe
from runner.renderers import Renderer
from runner.renderers.chat import ChatRenderer


class Generated(TypedDict):
    """One step's part: the rows written to generated/step_N.jsonl, and the replies dropped as cut off."""

    rows: list[Json]  # {"messages": [...the prompt, the teacher's reply]}
    truncated: int
    samples: int


class GenerateAlgo(AlgorithmBase):
    def __init__(self, cfg: Generate, prompts: list[Conversation], where: list[str], s: Settings):
        seed, base_model, max_steps = s.seed, s.model, s.max_steps
        for conv, w in zip(prompts, where, strict=True):
            if conv[-1]["role"] != "user":
                raise UserError(f"{w}: a prompt must end with the user's turn (the teacher replies to it)")
        self.cfg, self.prompts, self.seed, self.base_model = cfg, prompts, seed, base_model
        self.weights = dict(s.weights)
        self.renderer = ChatRenderer(s.renderer)
        full = -(-len(prompts) // cfg.batch_size)
        self.total_steps = min(full, max_steps) if max_steps else full
        self.client: SamplingClient | None = None
        self.next_step = 0
        self.log_dir: Path | None = None

    async def teacher(self, backend: Backend) -> SamplingClient:
        if self.client is None:
            from runner.algos.distill import open_teacher

            self.client = await open_teacher(self.cfg.teacher, self.weights, backend, self.base_model, "algo.teacher")
        return self.client

    async def prepare(self, step: int, ctx: Context) -> AsyncIterator[Generated]:
        self.next_step = step + 1
        self.log_dir = ctx.log_dir
        client = await self.teacher(ctx.backend)
        cfg = self.cfg
        first = step * cfg.batch_size
        batch = self.prompts[first : first + cfg.batch_size]
        system = [{"role": "system", "content": cfg.system}] if cfg.system else []
        futures = [client.sample(self.renderer.build_prompt(system + conv), cfg.n,
                                 SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                                stop=self.renderer.stop,
                                                # n samples use seeds s .. s + n - 1: spaced by n
                                                seed=(self.seed * 1_000_003 + (first + i) * cfg.n) % 2**31))
                   for i, conv in enumerate(batch)]
        outs = await asyncio.gather(*futures)
        rows: list[Json] = []
        truncated = 0
        for conv, out in zip(batch, outs, strict=True):
            for seq in out.sequences:
                reply = self.renderer.parse(seq.tokens)
                if not reply.ended_on_stop and not cfg.keep_truncated:
                    truncated += 1
                    continue
                rows.append({"messages": [*conv, {"role": "assistant", "content": reply.text.strip()}]})
        yield {"rows": rows, "truncated": truncated, "samples": len(batch) * cfg.n}

    def submit(self, tc: TrainingClient, step: int, part: Generated, adam: AdamParams, evaluate: bool) -> Generated:
        return part  # nothing to train

    async def finish(self, step: int, parts: list[Generated]) -> dict[str, float]:
        (part,) = parts
        assert self.log_dir is not None
        out = Path(self.log_dir) / OUTPUT
        out.mkdir(parents=True, exist_ok=True)
        # Atomic, fsynced, never through a link (docs/reliability.md).
        write_text_atomic(out / f"step_{step:06d}.jsonl", "".join(json.dumps(r) + "\n" for r in part["rows"]))
        rows = part["rows"]
        replies = [r["messages"][-1]["content"] for r in rows]
        return {"rows": len(rows), "samples": part["samples"],
                "truncated_frac": part["truncated"] / part["samples"] if part["samples"] else 0.0,
                "reply_chars": sum(map(len, replies)) / len(replies) if replies else 0.0}

    def state(self) -> Json:
        return {"generate_prompts": len(self.prompts)}

    def load_state(self, state: Json, next_step: int) -> None:
        check_resume(state, "generate_prompts", len(self.prompts), "the prompts")
        self.next_step = next_step

    def describe(self) -> list[str]:
        cfg = self.cfg
        teacher = (f"#{cfg.teacher.init_from.rpartition('#')[2]}" if cfg.teacher.init_from
                   else cfg.teacher.checkpoint or cfg.teacher.model or self.base_model)
        return [
            f"generate: {len(self.prompts)} prompts x {cfg.n} replies, {cfg.batch_size} prompts per step, teacher "
            f"{teacher}{' with a system prompt' if cfg.system else ''}; temperature {cfg.temperature:g}, max_tokens "
            f"{cfg.max_tokens}",
            f"writes {OUTPUT}/step_NNNNNN.jsonl (conversations without the system prompt); no training calls",
        ]




# ---------------------------------------------------------------- the registry entry (runner/engine/spec.py)

def build(cfg: Generate, args: BuildArgs) -> Callable[[Tokenizer], GenerateAlgo]:
    prompts, where = load_conversations(cfg.prompts)
    return lambda tokenizer: GenerateAlgo(cfg, prompts, where, Settings.of(args, tokenizer))


def show(cfg: Generate, recipe: Recipe, renderer: Renderer, n: int) -> Iterator[Json]:
    return prompt_rows([cfg.prompts], renderer, n)


SPEC = AlgoSpec(build=build, show=show,
                headline=[("rows", "rows"), ("reply_chars", "reply_chars"), ("truncated_frac", "truncated")])
