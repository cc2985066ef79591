"""`reasoning_gym`: procedural reasoning tasks from the reasoning-gym library (its generators and its scorers), one
turn each (docs/envs.md). The optional extra `reasoning` installs the library.

Each task in `tasks` is `reasoning_gym.create_dataset(task, size=..., seed=..., **its config)`; its items are
`{question, answer, metadata}` and the task's own `score_answer(answer, item)` (0..1, partial credit where the task
gives it) is the score. The test split is the first `test_size` items of each task's generator, the few-shot
examples the next `few_shot`, training the rest (so they never overlap by index; a task with few distinct problems
can still repeat one); the tasks' training items are interleaved in a seeded order.

The user message is `prompt` formatted with the item's question and metadata (`"{question}"`; e.g.
`"What is {expression}?"` for basic_arithmetic, the phrasing the embedded tiny model was pre-trained on). The answer
is the reply's text, or what it holds between `<answer>` tags with `answer_tag = true` (reasoning-gym's own
convention, which its `system_prompt = "default"` asks for).

reward = score + format_coef·(format − 1); format = the reply ended on its stop sequence (and held the answer tag
when one is asked for). Metrics: score, correct (score = 1), format, scorer_error (the task's scorer raised: score 0).
"""

from __future__ import annotations

import functools
import importlib
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from backends.errors import UserError
from backends.types import Json
from runner.renderers.chat import ChatRenderer, Message
from runner.rl.envs.common import ChatEnv, EnvContext, EnvKind, RepeatGroupBuilder, check_train_size, group_datasets
from runner.rl.envs.reasoning_gym_config import ReasoningGym
from runner.rl.types import Observation, RLDataset, StepResult, StopCondition

if TYPE_CHECKING:
    from reasoning_gym.dataset import ProceduralDataset

INSTALL = "the reasoning_gym env needs the reasoning-gym package: pip install 'runner[reasoning]'"


def library() -> ModuleType:
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError:
        raise UserError(INSTALL) from None


@dataclass(frozen=True)
class Task:
    name: str
    dataset: ProceduralDataset
    n_test: int
    n_shots: int


class ReasoningGymEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, messages: list[Message], task: Task, item: Json,
                 cfg: ReasoningGym):
        super().__init__(renderer, messages)
        self.task, self.item, self.cfg = task, item, cfg

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        answer: str | None = reply.text.strip()
        if self.cfg.answer_tag:
            from reasoning_gym.utils import extract_answer  # pyright: ignore[reportMissingImports]

            answer = extract_answer(reply.text)
        scorer_error = 0.0
        try:
            score = float(self.task.dataset.score_answer(answer, self.item))
        except Exception:  # noqa: BLE001 - the library's scorer on a model's reply: any failure scores 0
            score, scorer_error = 0.0, 1.0
        score = min(1.0, max(0.0, score)) if score == score else 0.0
        format_ok = float(reply.ended_on_stop and answer is not None)
        return StepResult(
            reward=score + self.cfg.format_coef * (format_ok - 1.0),
            episode_done=True,
            metrics={"score": score, "correct": float(score >= 1.0), "format": format_ok,
                     "scorer_error": scorer_error},
            logs={"task": self.task.name, "question": user_text(self.cfg.prompt, self.item),
                  "expected": str(self.item.get("answer")), "reply": reply.text},
        )


def user_text(prompt: str, item: Json) -> str:
    fields = {**(item.get("metadata") or {}), "question": item["question"], "answer": item.get("answer")}
    return prompt.format_map(fields)


def check_prompt(prompt: str, item: Json, task: str) -> None:
    names = [f for _, f, _, _ in string.Formatter().parse(prompt) if f]
    try:
        user_text(prompt, item)
    except (KeyError, IndexError, AttributeError, ValueError) as e:
        keys = sorted({"question", *(item.get("metadata") or {})})
        raise UserError(f"reasoning_gym env: prompt {prompt!r} names {names} but task {task!r} items have "
                        f"{keys} ({type(e).__name__}: {e})") from None


def task_configs(cfg: ReasoningGym) -> dict[str, Json]:
    """Each task's config: `config` itself for a single task; keyed by task name for several."""
    if len(cfg.tasks) == 1:
        only = cfg.config.get(cfg.tasks[0]) if set(cfg.config) == {cfg.tasks[0]} else cfg.config
        return {cfg.tasks[0]: dict(only or {})}
    extra = sorted(set(cfg.config) - set(cfg.tasks))
    if extra:
        raise UserError(f"reasoning_gym env: with several tasks, config is keyed by task name; {extra} "
                        f"{'is' if len(extra) == 1 else 'are'} not among tasks {list(cfg.tasks)}")
    out = {}
    for t in cfg.tasks:
        c = cfg.config.get(t, {})
        if not isinstance(c, dict):
            raise UserError(f"reasoning_gym env: config.{t} must be a table of that task's settings")
        out[t] = dict(c)
    return out


def make_tasks(cfg: ReasoningGym, seed: int, n_train: dict[str, int]) -> list[Task]:
    rg = library()
    known = sorted(rg.factory.DATASETS)
    tasks = []
    for name, config in task_configs(cfg).items():
        if name not in known:
            import difflib

            near = difflib.get_close_matches(name, known, n=3)
            raise UserError(f"reasoning_gym env: unknown task {name!r}"
                            + (f" (did you mean {', '.join(near)}?)" if near else f"; there are {len(known)} tasks"))
        size = cfg.test_size + cfg.few_shot + n_train[name]
        try:
            ds = rg.create_dataset(name, **{**config, "size": size, "seed": seed})
        except (TypeError, ValueError, AssertionError) as e:
            raise UserError(f"reasoning_gym env: task {name!r} with config {config}: {e}") from None
        tasks.append(Task(name, ds, cfg.test_size, cfg.few_shot))
        check_prompt(cfg.prompt, ds[0], name)
    return tasks


def build(cfg: ReasoningGym, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    check_train_size(cfg.train_size, ctx.groups_per_batch, "reasoning_gym")
    seed = ctx.seed if cfg.seed is None else cfg.seed
    k = len(cfg.tasks)
    n_train = {t: cfg.train_size // k + (i < cfg.train_size % k) for i, t in enumerate(cfg.tasks)}
    tasks = make_tasks(cfg, seed, n_train)
    system: list[Message] = []
    if cfg.system_prompt is not None:
        from reasoning_gym.utils import SYSTEM_PROMPTS  # pyright: ignore[reportMissingImports]

        text = SYSTEM_PROMPTS.get(cfg.system_prompt, cfg.system_prompt)
        system = [{"role": "system", "content": text}]

    def messages(task: Task, idx: int) -> list[Message]:
        shots: list[Message] = []
        for j in range(task.n_test, task.n_test + task.n_shots):
            ex = task.dataset[j]
            answer = f"<answer>{ex['answer']}</answer>" if cfg.answer_tag else str(ex["answer"])
            shots += [{"role": "user", "content": user_text(cfg.prompt, ex)}, {"role": "assistant", "content": answer}]
        return [*system, *shots, {"role": "user", "content": user_text(cfg.prompt, task.dataset[idx])}]

    def builder(ref: tuple[int, int], group_size: int) -> RepeatGroupBuilder:
        t, idx = ref
        task = tasks[t]
        make: Callable[[], ReasoningGymEnv] = functools.partial(
            ReasoningGymEnv, ctx.renderer, messages(task, idx), task, task.dataset[idx], cfg)
        return RepeatGroupBuilder(make, group_size, [task.name])

    train = [(t, task.n_test + task.n_shots + i) for t, task in enumerate(tasks) for i in range(n_train[task.name])]
    random.Random(seed).shuffle(train)
    test = [(t, i) for i in range(cfg.test_size) for t in range(len(tasks))]
    return group_datasets(train, test, ctx, builder, "reasoning_gym")


ENV = EnvKind(build, [("env/all/score", "score"), ("env/all/format", "format")])
