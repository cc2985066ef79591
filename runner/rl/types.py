"""The RL environment model (the cookbook's `rl/types.py`), in our own types.

An `Env` is one episode and is used once: `initial_observation()` gives the first prompt (tokens) and
the stop condition to sample with; each `step(action_tokens, stop_reason)` gives the reward for that action
and either the next prompt or `episode_done`. An `EnvGroupBuilder` makes the envs whose episodes are
compared with each other (the group of group-relative advantages), and may add rewards that need the
whole group (`compute_group_rewards`: pairwise judges, self-play). An `RLDataset` hands out builders by
batch index, so batch i is the same on every run and on resume.

Observations are plain token lists, not chat messages: the policy sees exactly what the sampler is given,
and datums.py can check the "extension property" (each observation starts with the previous observation
plus its action) token for token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends.types import SampledSequence, StopReason

Observation = list[int]
# As in SamplingParams.stop: strings or token ids, the sample ends on (and includes) the first one;
# None stops on EOS only.
StopCondition = list[str] | list[int] | None
Metrics = dict[str, float]
Logs = dict[str, str | int | float]


@dataclass(frozen=True)
class StepResult:
    reward: float
    episode_done: bool
    # Ignored when episode_done; otherwise the next prompt and what to stop sampling on.
    next_observation: Observation = field(default_factory=list)
    next_stop: StopCondition = None
    # Averaged into env/all/<name> over the transitions that report them.
    metrics: Metrics = field(default_factory=dict)
    # Shown in transcripts only.
    logs: Logs = field(default_factory=dict)


@dataclass(frozen=True)
class Transition:
    ob: Observation
    # The sampled action: tokens (with the stop token that ended them), sampler logprobs, stop reason.
    ac: SampledSequence
    reward: float
    episode_done: bool
    metrics: Metrics = field(default_factory=dict)
    logs: Logs = field(default_factory=dict)


@dataclass(frozen=True)
class Trajectory:
    transitions: list[Transition]
    # The observation the env would have shown next; empty when the episode ended (as it always does here).
    final_ob: Observation = field(default_factory=list)

    @property
    def total_step_reward(self) -> float:
        return float(sum(t.reward for t in self.transitions))


@dataclass(frozen=True)
class TrajectoryGroup:
    trajectories_G: list[Trajectory]
    # Rewards from compute_group_rewards, added to each trajectory's step rewards.
    final_rewards_G: list[float]
    metrics_G: list[Metrics]
    # The builder's logging_tags(): metrics are also reported under env/<tag>/.
    tags: list[str] = field(default_factory=list)

    def total_rewards_G(self) -> list[float]:
        return [t.total_step_reward + r for t, r in zip(self.trajectories_G, self.final_rewards_G, strict=True)]


class Env(ABC):
    """One episode; single use, no reset."""

    @abstractmethod
    async def initial_observation(self) -> tuple[Observation, StopCondition] | None:
        """The first prompt; None when the episode is over before this env's first turn (e.g. the other
        seat of a self-play game lost on its first move): the trajectory then has no transitions."""

    @abstractmethod
    async def step(self, action_tokens: list[int], stop_reason: StopReason) -> StepResult: ...


class EnvGroupBuilder(ABC):
    """Makes one group of envs. Builders are plain data (picklable), so async and streaming loops can queue them."""

    @abstractmethod
    async def make_envs(self) -> Sequence[Env]: ...

    async def compute_group_rewards(
        self, trajectories_G: list[Trajectory], envs_G: Sequence[Env]
    ) -> list[tuple[float, Metrics]]:
        """(reward, metrics) per trajectory, added after the episodes end. Default: nothing to add."""
        return [(0.0, {}) for _ in trajectories_G]

    def logging_tags(self) -> list[str]:
        return []


class RLDataset(ABC):
    """Batches of group builders. get_batch(i) must be deterministic in i (resume replays by index)."""

    @abstractmethod
    def get_batch(self, index: int) -> list[EnvGroupBuilder]: ...

    @abstractmethod
    def __len__(self) -> int: ...
