"""`verifiers`: any installed `verifiers` environment (the format of Prime Intellect's Environments Hub; the
cookbook's verifiers_rl recipe), rolled out through runner's own sampler, scored by the environment's rubric
(docs/envs.md). Needs the `verifiers` package (tested with 0.1.9.post3, the version tinker-cookbook 0.6.1 pins).

A verifiers environment runs its own rollout loop and talks to the model through an `openai.AsyncOpenAI` client.
Here that client is in process (no socket): an httpx transport hands each chat request to the episode's `Env`,
which renders it with the recipe's renderer (backends/serve/chat_api.py `chat_plan`, as `runner serve` does),
passes the prompt tokens to runner's rollout loop as the next observation, and answers the request with the
sampled tokens (`chat_response`: text, tool calls, finish reason). So every sample goes through the RL loop's
sampler with its params (temperature, max_tokens, seeds), multi-turn episodes (tool calls, env replies) become
runner turns, and the datums are built from runner's own tokens and logprobs. The request's own sampling args
(max_tokens, temperature, stop) are ignored: the recipe's apply.

When the group's rollouts end, the environment's rubric scores them together (`rubric.score_group`): its reward is
the reward, its metrics (every reward function's value, turn and tool-call counts) are logged as env metrics, plus
`vf_error` (the rollout ended on an error, e.g. a request this renderer cannot render).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from backends.errors import UserError
from backends.serve.chat_api import ApiError, chat_plan, chat_response, error_body
from backends.types import Json, SampledSequence, SampleOutput
from runner.rl.envs.common import EnvContext, EnvKind, check_train_size, group_datasets
from runner.rl.envs.verifiers_env_config import Verifiers
from runner.rl.types import Env, EnvGroupBuilder, Metrics, Observation, RLDataset, StepResult, StopCondition, Trajectory

if TYPE_CHECKING:  # imported in build(): runner.rl.openai_chat imports an env module (tool_use), hence this package
    import httpx
    from datasets import Dataset
    from verifiers import Environment, State

    from runner.rl.openai_chat import RendererChat

INSTALL = "the verifiers env needs the verifiers package: pip install 'verifiers==0.1.9.post3'"


def library() -> ModuleType:
    try:
        return importlib.import_module("verifiers")
    except ImportError:
        raise UserError(INSTALL) from None


def load(cfg: Verifiers) -> Environment:
    """The environment: `verifiers.load_environment(module, **args)` (the module's load_environment)."""
    vf = library()
    # verifiers logs every load and rubric at INFO on its own handler: runner's progress line is the output.
    logging.getLogger("verifiers").setLevel(logging.WARNING)
    with contextlib.suppress(Exception):  # and its datasets' map() progress bars
        importlib.import_module("datasets").disable_progress_bars()
    if os.getcwd() not in sys.path:  # environment modules next to the recipe, as user targets (recipe/targets.py)
        sys.path.insert(0, os.getcwd())
    try:
        importlib.import_module(cfg.module.replace("-", "_").split("/")[-1])
    except ImportError as e:
        raise UserError(f"verifiers env: cannot import environment module {cfg.module!r} ({e}); install it "
                        "(e.g. `prime env install owner/name`)") from None
    try:
        env = vf.load_environment(cfg.module, **cfg.args)
    except Exception as e:  # noqa: BLE001 - the environment's own code: one line naming it
        while e.__cause__ is not None and isinstance(e.__cause__, Exception):  # verifiers wraps it in a RuntimeError
            e = e.__cause__
        raise UserError(f"verifiers env {cfg.module!r}: load_environment(**{cfg.args}) raised "
                        f"{type(e).__name__}: {e}") from None
    if not isinstance(env, vf.Environment):
        raise UserError(f"verifiers env {cfg.module!r}: load_environment returned {type(env).__name__}, "
                        "not a verifiers Environment")
    if env.message_type != "chat":
        raise UserError(f"verifiers env {cfg.module!r}: message_type {env.message_type!r}; only chat environments "
                        "are supported")
    return env


@dataclass
class _Ended:
    state: State | None
    error: BaseException | None


class VerifiersEnv(Env):
    """One rollout of the verifiers environment, driven turn by turn by runner's rollout loop."""

    def __init__(self, vf_env: Environment, row: Json, fmt: RendererChat, model: str):
        self.vf_env, self.row, self.fmt, self.model = vf_env, row, fmt, model
        self.state: State | None = None
        self.error: BaseException | None = None
        self._queue: asyncio.Queue[tuple[list[int], asyncio.Future[SampledSequence]] | _Ended] = asyncio.Queue()
        self._pending: asyncio.Future[SampledSequence] | None = None
        self._task: asyncio.Task[None] | None = None

    async def initial_observation(self) -> tuple[Observation, StopCondition] | None:
        self._task = asyncio.create_task(self._rollout())
        return await self._next()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        assert self._pending is not None
        self._pending.set_result(SampledSequence(list(action_tokens), [0.0] * len(action_tokens),
                                                 "stop" if stop_reason == "stop" else "length"))
        nxt = await self._next()
        if nxt is None:
            return StepResult(reward=0.0, episode_done=True, logs={"reply": self.fmt.chat.parse(action_tokens).text})
        return StepResult(reward=0.0, episode_done=False, next_observation=nxt[0], next_stop=nxt[1])

    async def _next(self) -> tuple[Observation, StopCondition] | None:
        item = await self._queue.get()
        if isinstance(item, _Ended):
            self.state, self.error = item.state, item.error
            if item.error is not None and item.state is None:
                raise item.error
            return None
        prompt, self._pending = item
        return list(prompt), self.fmt.stop

    async def _rollout(self) -> None:
        import httpx
        import openai

        # An httpx client: openai 2.x's own; 3.x (on httpx2) accepts it as a legacy one.
        http: Any = httpx.AsyncClient(transport=_transport(self))
        client = openai.AsyncOpenAI(base_url="http://runner.in-process/v1", api_key="in-process", max_retries=0,
                                    http_client=http)
        try:
            vf = library()
            rollout_input = vf.RolloutInput(**self.row)
            state = await self.vf_env.rollout(rollout_input, client, self.model, {})
            self._queue.put_nowait(_Ended(state, state.get("error")))
        except BaseException as e:  # noqa: BLE001 - the environment's code: reported by the rollout loop
            self._queue.put_nowait(_Ended(None, e))
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    async def answer(self, path: str, body: object) -> tuple[int, Json]:
        """One request of the environment's client: rendered, sampled by the rollout loop, answered."""
        if not path.endswith("/chat/completions"):
            return 404, error_body(404, f"the in-process client answers chat completions, not {path}")
        try:
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            plan = chat_plan({**body, "return_token_ids": True}, self.fmt)  # verifiers records them
            if plan.n != 1:
                raise ApiError(400, "n must be 1 (the RL loop samples each member of a group on its own)")
        except ApiError as e:
            return e.status, error_body(e.status, e.detail)
        fut: asyncio.Future[SampledSequence] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((plan.prompts[0], fut))
        seq = await fut
        return 200, chat_response(plan, SampleOutput([seq]), self.fmt)


def _transport(env: VerifiersEnv) -> httpx.AsyncBaseTransport:
    """An httpx transport answering in process (httpx is imported only here: the openai client brings it)."""
    import httpx

    class Transport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            try:
                body = json.loads(await request.aread() or b"null")
            except ValueError:
                status, obj = 400, error_body(400, "the body is not valid JSON")
            else:
                status, obj = await env.answer(request.url.path, body)
            return httpx.Response(status, json=obj, request=request)

    return Transport()


class VerifiersGroupBuilder(EnvGroupBuilder):
    def __init__(self, vf_env: Environment, row: Json, fmt: RendererChat, model: str, group_size: int, tag: str):
        self.vf_env, self.row, self.fmt, self.model = vf_env, row, fmt, model
        self.group_size, self.tag = group_size, tag

    async def make_envs(self) -> Sequence[Env]:
        return [VerifiersEnv(self.vf_env, self.row, self.fmt, self.model) for _ in range(self.group_size)]

    async def compute_group_rewards(self, trajectories_G: list[Trajectory], envs_G: Sequence[Env]
                                    ) -> list[tuple[float, Metrics]]:
        envs = [e for e in envs_G if isinstance(e, VerifiersEnv)]
        states = [e.state for e in envs]
        scored = [s for s in states if s is not None]
        if scored:
            await self.vf_env.rubric.score_group(scored, score_sem=contextlib.nullcontext())
        out = []
        for e in envs:
            metrics: Metrics = {"vf_error": float(e.error is not None)}
            if e.state is None:
                out.append((0.0, metrics))
                continue
            for k, v in (e.state.get("metrics") or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    metrics[k] = float(v)
            out.append((float(e.state.get("reward") or 0.0), metrics))
        return out

    def logging_tags(self) -> list[str]:
        return [self.tag]


def _rows(ds: Dataset) -> list[Json]:
    cols = set(ds.column_names)
    keys = [k for k in ("prompt", "example_id", "task", "answer", "info") if k in cols]
    return [{k: ds[i][k] for k in keys} for i in range(len(ds))]


def build(cfg: Verifiers, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    vf_env = load(cfg)
    if vf_env.dataset is None:
        raise UserError(f"verifiers env {cfg.module!r} has no dataset")
    seed = ctx.seed if cfg.seed is None else cfg.seed
    rows = _rows(vf_env.dataset)
    rng = random.Random(seed)
    rng.shuffle(rows)
    if vf_env.eval_dataset is not None:
        test = _rows(vf_env.eval_dataset)[: cfg.test_size]
    else:
        if cfg.test_size >= len(rows):
            raise UserError(f"verifiers env {cfg.module!r}: test_size {cfg.test_size} leaves none of its "
                            f"{len(rows)} rows to train on (it has no eval dataset)")
        test, rows = rows[: cfg.test_size], rows[cfg.test_size:]
    check_train_size(cfg.train_size, ctx.groups_per_batch, "verifiers env")
    if not rows:
        raise UserError(f"verifiers env {cfg.module!r}: its dataset has no rows to train on")
    train: list[Json] = []
    while len(train) < cfg.train_size:  # repeat the rows, reshuffled, up to train_size
        train += rows[: cfg.train_size - len(train)]
        rng.shuffle(rows)
    from runner.rl.openai_chat import RendererChat

    fmt = RendererChat(ctx.renderer)
    tag = cfg.module.split("/")[-1].split(".")[-1]

    def builder(row: Json, group_size: int) -> VerifiersGroupBuilder:
        return VerifiersGroupBuilder(vf_env, row, fmt, cfg.model_name, group_size, tag)

    return group_datasets(train, test, ctx, builder, "verifiers env")


ENV = EnvKind(build, [("env/all/vf_error", "vf_error")])
