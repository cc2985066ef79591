"""On-policy distillation behind the loop's Algorithm interface (cookbook distillation/train_on_policy.py).

The student samples `group_size` replies to each prompt of every prompt set; each set's teacher scores the
student's own tokens (compute_logprobs of the whole sequence), and the per-token reverse KL
rkl_t = (student_lp_t − teacher_lp_t)·mask_t is folded into the advantages as −kl_coef·rkl_t (optionally as a
discounted sum over the later tokens), with no centring; the rewards are 0, so that is all the signal. Metrics
`teacher_kl` = Σ rkl / Σ mask and `teacher_kl/dataset_<i>`; evals report `test/teacher_kl` on held-out prompts.

Everything else is RL's (runner/algos/rl.py): the same sampling, datums, ratio loss, substeps and modes (sync, stream,
async: unlike the cookbook's sync only), checkpoints and transcripts. Teachers: a chained run's final weights
(`teacher = {init_from = "#teacher"}`, run first by runner/engine/chain.py), a saved sampler checkpoint, or a base model.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from backends.base import Backend, SamplingClient
from backends.errors import UserError
from backends.tokenizer import Tokenizer
from backends.types import Datum, Json
from runner.algos.distill_config import Distill, Teacher
from runner.algos.rl import EVAL_SEED_OFFSET, RLAlgo
from runner.data.conversations import load_conversations, prompt_rows
from runner.engine.spec import AlgoSpec, BuildArgs, Settings
from runner.recipe.schema import Recipe
from runner.renderers import Renderer
from runner.renderers.chat import ChatRenderer
from runner.rl.advantages import compute_advantages
from runner.rl.datums import assemble_datums
from runner.rl.envs.common import ChatEnv, EnvContext, ListDataset, RepeatGroupBuilder
from runner.rl.kl import reference_logprobs
from runner.rl.rollouts import rollout_batch
from runner.rl.types import EnvGroupBuilder, Observation, RLDataset, StepResult, StopCondition, TrajectoryGroup


class PromptEnv(ChatEnv):
    """One reply to a fixed conversation; reward 0 (the cookbook's PromptOnlyEnv)."""

    def __init__(self, renderer: ChatRenderer, messages: list[dict[str, str]]):
        super().__init__(renderer, messages)

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        return StepResult(0.0, True, metrics={"format": float(reply.ended_on_stop)})


class CompositeDataset(RLDataset):
    """Batch k holds batch k of every prompt set (each `groups_per_batch` groups, tagged dataset_<i>); as long as
    the shortest set."""

    def __init__(self, parts: Sequence[ListDataset]):
        self.parts = list(parts)

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [b for part in self.parts for b in part.get_batch(index)]

    def __len__(self) -> int:
        return min(len(p) for p in self.parts)


class DistillAlgo(RLAlgo):
    def __init__(self, cfg: Distill, s: Settings):
        seed = s.seed
        self.weights = dict(s.weights)
        self.prompts: list[tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]] = []
        for i, ds in enumerate(cfg.datasets):
            convs, _ = load_conversations(ds.prompts)
            if any(c[-1]["role"] == "assistant" for c in convs):
                raise UserError(f"algo.datasets[{i}].prompts: a prompt ends with an assistant message; "
                                "the student continues the conversation, so it must end with the user's turn")
            order = np.random.default_rng([seed, i]).permutation(len(convs))
            test = [convs[j] for j in order[: ds.test_size]]
            train = [convs[j] for j in order[ds.test_size:]]
            if len(train) < ds.groups_per_batch:
                raise UserError(f"algo.datasets[{i}]: {len(train)} training prompts, fewer than groups_per_batch "
                                f"{ds.groups_per_batch}")
            self.prompts.append((train, test))
        self.teachers: list[SamplingClient | None] = [None] * len(cfg.datasets)
        super().__init__(cfg, s)

    # ---------------------------------------------------------------- data

    def build_datasets(self, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
        cfg: Distill = self.cfg

        def builder(i: int, messages: object, group_size: int) -> EnvGroupBuilder:
            assert isinstance(messages, list)
            return RepeatGroupBuilder(functools.partial(PromptEnv, ctx.renderer, messages), group_size,
                                      [f"dataset_{i}"])

        train = CompositeDataset([
            ListDataset(tr, lambda m, i=i: builder(i, m, ctx.group_size), ds.groups_per_batch)
            for i, (ds, (tr, _)) in enumerate(zip(cfg.datasets, self.prompts, strict=True))])
        tests = [(i, t) for i, (_, test) in enumerate(self.prompts) for t in test]
        if not tests:
            return train, None
        # Items are (set index, prompt), so each test group is scored by its own set's teacher.
        test = ListDataset(tests, lambda item: builder(*_set_and_prompt(item), ctx.test_group_size),
                           max(1, cfg.groups_per_batch), drop_last=False)
        return train, test

    def env_label(self) -> str:
        return f"distill ({len(self.cfg.datasets)} prompt set(s))"

    # ---------------------------------------------------------------- the teacher KL

    async def teacher(self, i: int, backend: Backend) -> SamplingClient:
        client = self.teachers[i]
        if client is None:
            client = self.teachers[i] = await open_teacher(self.cfg.datasets[i].teacher, self.weights, backend,
                                                           self.base_model, f"algo.datasets[{i}].teacher")
        return client

    async def _datums(self, groups: list[TrajectoryGroup], backend: Backend) -> tuple[list[Datum], dict[str, float]]:
        data_D, sources_D = assemble_datums(groups, compute_advantages(groups))
        if not data_D:
            return data_D, {}
        t = time.monotonic()
        set_D = [_dataset_index(groups[src.group_idx].tags) for src in sources_D]
        sets = sorted(set(set_D))
        clients = await asyncio.gather(*(self.teacher(i, backend) for i in sets))
        teacher_lp: list[np.ndarray | None] = [None] * len(data_D)
        for i, client in zip(sets, clients, strict=True):
            idx = [k for k, s in enumerate(set_D) if s == i]
            for k, lp in zip(idx, await reference_logprobs(client, [data_D[k] for k in idx]), strict=True):
                teacher_lp[k] = lp
        out, metrics = apply_teacher_kl(data_D, [lp for lp in teacher_lp if lp is not None], set_D,
                                        self.cfg.kl_coef, self.cfg.kl_discount)
        metrics["time/teacher"] = time.monotonic() - t
        return out, metrics

    async def _evaluate(self, step: int, sampler: SamplingClient) -> dict[str, float]:
        """test/teacher_kl (and per set) of the student's samples on the held-out prompts."""
        assert self.test is not None
        builders = [b for i in range(len(self.test)) for b in self.test.get_batch(i)][: self.cfg.eval.max_groups]
        t = time.monotonic()
        batch = await rollout_batch(builders, sampler, replace(self.params, temperature=self.cfg.eval.temperature),
                                    seed=self.seed + EVAL_SEED_OFFSET, step=step, max_context=self.max_context,
                                    what=f"the test prompts (eval at step {step})")
        assert self._backend is not None  # set by RLAlgo.prepare / final, before any eval starts
        _, metrics = await self._datums(batch.groups, self._backend)
        out = {f"test/{k}": v for k, v in metrics.items() if k.startswith("teacher_kl")}
        out["time/eval"] = time.monotonic() - t
        self._write_transcripts("test", step, batch, None)
        return out



def _set_and_prompt(item: object) -> tuple[int, object]:
    assert isinstance(item, tuple)
    return item[0], item[1]


async def open_teacher(teacher: Teacher, weights: dict[str, str], backend: Backend, base_model: str,
                       where: str) -> SamplingClient:
    """A sampling client over a Teacher: the resolved weights of its init_from run, its checkpoint, or a base model
    (its own `model`, else the recipe's)."""
    path = weights.get(teacher.init_from, "") if teacher.init_from is not None else teacher.checkpoint
    if teacher.init_from is not None and not path:
        raise UserError(f"{where}.init_from {teacher.init_from!r} was not resolved to weights; run the recipe with "
                        "`runner run`, which runs the teacher first")
    return await backend.create_sampling_client(model_path=path or None,
                                                base_model=None if path else (teacher.model or base_model))


def _dataset_index(tags: Sequence[str]) -> int:
    return next(int(t.removeprefix("dataset_")) for t in tags if t.startswith("dataset_"))


def apply_teacher_kl(data_D: Sequence[Datum], teacher_D: Sequence[np.ndarray], set_D: Sequence[int], coef: float,
                     discount: float) -> tuple[list[Datum], dict[str, float]]:
    """adv_t += −coef·mask_t·Σ_{s≥t} γ^{s−t}·rkl_s with rkl_t = (lp_sampler_t − lp_teacher_t)·mask_t (γ = 0: rkl_t
    alone). Metrics: teacher_kl = Σ rkl / Σ mask over the batch, and per prompt set."""
    out: list[Datum] = []
    sums: dict[int, list[float]] = {}
    for d, teacher, i in zip(data_D, teacher_D, set_D, strict=True):
        assert d.logprobs is not None and d.advantages is not None and d.mask is not None
        rkl = (d.logprobs - teacher) * d.mask
        penalty = _discounted(rkl, discount) if discount > 0 else rkl
        out.append(replace(d, advantages=d.advantages - coef * d.mask * penalty))
        acc = sums.setdefault(i, [0.0, 0.0])
        acc[0] += float(rkl.sum())
        acc[1] += float(d.mask.sum())
    total_kl, total_mask = sum(a for a, _ in sums.values()), sum(m for _, m in sums.values())
    metrics = {"teacher_kl": total_kl / total_mask if total_mask else 0.0}
    for i, (kl, mask) in sorted(sums.items()):
        metrics[f"teacher_kl/dataset_{i}"] = kl / mask if mask else 0.0
    return out, metrics


def _discounted(x: np.ndarray, gamma: float) -> np.ndarray:
    out = np.zeros_like(x)
    acc = 0.0
    for t in range(len(x) - 1, -1, -1):
        acc = float(x[t]) + gamma * acc
        out[t] = acc
    return out


def prompts_from_chats(path: str, limit: int | None = None) -> list[Json]:
    """Prompts from a chat JSONL ({"messages": [...]} rows): each conversation up to, not including, its last
    assistant message (a data source target: `{kind = "python", target = "runner.algos.distill:prompts_from_chats",
    args = {path = "chats.jsonl"}}`)."""
    from pathlib import Path

    from runner.data.conversations import conversation, load_rows
    from runner.recipe.sources import Jsonl

    if not Path(path).is_file():
        raise UserError(f"prompts_from_chats: file not found: {path}")
    rows, where = load_rows(Jsonl(path=path))
    out = []
    for row, w in zip(rows, where, strict=True):
        messages = conversation(row, w)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None or last == 0:
            continue
        out.append({"messages": messages[:last]})
    return out[:limit] if limit else out


# ---------------------------------------------------------------- the registry entry (runner/engine/spec.py)

def build(cfg: Distill, args: BuildArgs) -> Callable[[Tokenizer], DistillAlgo]:
    # No reference model: the teachers are what the student is pulled toward.
    return lambda tokenizer: DistillAlgo(cfg, replace(Settings.of(args, tokenizer), reference_path=None))


def show(cfg: Distill, recipe: Recipe, renderer: Renderer, n: int) -> Iterator[Json]:
    """`runner render`: the first `n` prompts, over the datasets in order."""
    return prompt_rows([d.prompts for d in cfg.datasets], renderer, n)


SPEC = AlgoSpec(build=build, show=show,
                headline=[("teacher_kl", "teacher_kl"), ("test/teacher_kl", "test/teacher_kl")])
