"""`runner check` (and so `runner run`): a recipe's lengths fit its models' context (runner/models.toml `context`).

A sequence is prompt + completion, so:
- max_length (SFT, DPO, reward_model: the longest datum a row renders to) must be at most the context;
- max_tokens (RL, distillation, generate: sampled tokens per turn) must leave room for a prompt, which has at least
  one token: the prompt lengths themselves are the data's, known only once rendered (RL then drops a group whose
  prompt leaves no room: runner/rl/rollouts.py ContextOverflow).
The models: the recipe's, and each teacher's base model (it scores the same sequences). A model the table does not
know (a local folder, a hub id) is not checked here; the local sampler refuses an over-long request at run time.
"""

from __future__ import annotations

from backends.errors import UserError
from runner.models import model_context
from runner.recipe.schema import Recipe, Teacher


def models_of(recipe: Recipe) -> list[tuple[str, str]]:
    """(key path, model name) of every model whose context the recipe's sequences must fit: the recipe's, and a
    teacher's base model (generate's `teacher`, each distillation set's)."""
    out = [("model", recipe.model)]
    algo = recipe.algo
    teachers: list[tuple[str, object]] = [("algo.teacher", getattr(algo, "teacher", None))]
    teachers += [(f"algo.datasets[{i}].teacher", getattr(d, "teacher", None))
                 for i, d in enumerate(getattr(algo, "datasets", None) or ())]
    for key, teacher in teachers:
        if isinstance(teacher, Teacher) and teacher.model is not None:
            out.append((f"{key}.model", teacher.model))
    return out


def check_context(recipe: Recipe, where: str) -> None:
    """UserError (one line, naming the recipe key) when the recipe's max_length / max_tokens cannot fit a model's
    context."""
    algo = recipe.algo
    max_length = getattr(algo, "max_length", None)
    max_tokens = getattr(algo, "max_tokens", None)
    for key, model in models_of(recipe):
        context = model_context(model)
        if context is None:
            continue
        of = f"the {context}-token context of {model!r} ({key}, runner/models.toml)"
        if isinstance(max_length, int) and max_length > context:
            raise UserError(f"{where}: algo.max_length = {max_length} exceeds {of}: set it to at most {context}")
        if isinstance(max_tokens, int) and max_tokens >= context:
            raise UserError(f"{where}: algo.max_tokens = {max_tokens} leaves no room for a prompt in {of}: set it "
                            f"below {context}")
