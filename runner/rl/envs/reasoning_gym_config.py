"""The `reasoning_gym` env's recipe table (`algo.env = {kind = "reasoning_gym", ...}`), implemented by runner/rl/envs/reasoning_gym.py."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from runner.recipe.common import EnvBase, NonNegFloat, NonNegInt


class ReasoningGym(EnvBase, tag="reasoning_gym", kw_only=True):
    """Single turn: procedural tasks of the reasoning-gym library (the `reasoning` extra), scored by the library's
    own scorers (0..1). reward = score + format_coef·(format − 1), format = the reply ended on its stop sequence
    (and held `<answer>` tags when answer_tag). train_size problems, split over the tasks; test_size per task."""

    # reasoning-gym task names ("basic_arithmetic", "spell_backward", ...; `python -c "import reasoning_gym;
    # print(sorted(reasoning_gym.factory.DATASETS))"`).
    tasks: Annotated[list[str], Meta(min_length=1)]
    # The task's generator settings (its *Config dataclass's fields); with several tasks, a table per task name.
    config: dict[str, Any] = {}
    # The generators' seed (None: the recipe's seed).
    seed: NonNegInt | None = None
    # The user message: a format string over the item's `question`, `answer` and metadata fields.
    prompt: str = "{question}"
    # A system message: a reasoning-gym system prompt's name ("default" asks for <answer> tags) or the text itself.
    system_prompt: str | None = None
    # The answer is what the reply holds between <answer> and </answer> (else the whole reply).
    answer_tag: bool = False
    # Solved examples of the same task shown before the question (held out from train and test).
    few_shot: NonNegInt = 0
    format_coef: NonNegFloat = 0.1

    def __post_init__(self) -> None:
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError("tasks holds a task twice")
