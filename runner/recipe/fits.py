"""`runner check` (and so `runner run`): a recipe's lengths fit its models' context (runner/models.toml `context`).

A sequence is prompt + completion, so:
- max_length (SFT, DPO, reward_model: the longest datum a row renders to) must be at most the context;
- max_tokens (RL, distillation, generate: sampled tokens per turn) must leave room for a prompt, which has at least
  one token, or, where part of it is in the recipe (generate's `system`) and the tokenizer is on this machine, at
  least that part's tokens. The rest of a prompt is the data's, known only once rendered (RL then drops a group
  whose prompt leaves no room: runner/rl/rollouts.py ContextOverflow).
The models: the recipe's, and each teacher's base model (it scores the same sequences); a pinned eval's
max_tokens against the recipe's model. A model the table does not
know (a local folder, a hub id) is not checked here; the local sampler refuses an over-long request at run time.
"""

from __future__ import annotations

from backends.errors import UserError
from runner.algos.distill_config import Teacher
from runner.models import model_context
from runner.recipe.schema import Recipe


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


def static_prompt(recipe: Recipe) -> tuple[str, int] | None:
    """(key, tokens) of the part of every prompt the recipe itself holds (generate's `system`), when the tokenizer is
    on this machine to count it (backends/tokenizer.py local_core_tokenizer: no download, no transformers)."""
    from backends.tokenizer import local_core_tokenizer  # imports `tokenizers`: only for a recipe with a system

    system = getattr(recipe.algo, "system", None)
    if not isinstance(system, str) or not system:
        return None
    tok = local_core_tokenizer(recipe.tokenizer or recipe.model)
    return None if tok is None else ("algo.system", len(tok.encode(system, add_special_tokens=False).ids))


def check_context(recipe: Recipe, where: str) -> None:
    """UserError (one line, naming the recipe key) when the recipe's max_length / max_tokens cannot fit a model's
    context."""
    check_evals_context(recipe, where)
    algo = recipe.algo
    max_length = getattr(algo, "max_length", None)
    max_tokens = getattr(algo, "max_tokens", None)
    prompt: tuple[str, int] | None = None
    counted = False  # the static prompt is counted once, when a model with a context first needs it
    for key, model in models_of(recipe):
        context = model_context(model)
        if context is None:
            continue
        of = _of(context, model, key)
        if isinstance(max_length, int) and max_length > context:
            raise UserError(f"{where}: algo.max_length = {max_length} exceeds {of}: set it to at most {context}")
        if not isinstance(max_tokens, int):
            continue
        _room_for_a_prompt(where, "algo.max_tokens", max_tokens, context, of)
        if not counted:
            prompt, counted = static_prompt(recipe), True
        if prompt is not None and prompt[1] >= context:
            raise UserError(f"{where}: {prompt[0]} alone ({prompt[1]} tokens) fills {of}: shorten it")
        if prompt is not None and prompt[1] + max_tokens > context:
            raise UserError(f"{where}: algo.max_tokens = {max_tokens} and the {prompt[1]} tokens of {prompt[0]} "
                            f"exceed {of}: shorten one (at most {context - prompt[1]} tokens to sample)")


def check_evals_context(recipe: Recipe, where: str) -> None:
    """A pinned eval's max_tokens (math, inspect) against the recipe's model, which the evals sample: at least a
    1-token prompt must fit (the local sampler caps a longer request at the context; Tinker may refuse it mid-run)."""
    context = model_context(recipe.model)
    if context is None:
        return
    for i, e in enumerate(recipe.evals):
        max_tokens = getattr(e, "max_tokens", None)
        if isinstance(max_tokens, int):
            _room_for_a_prompt(where, f"evals[{i}].max_tokens", max_tokens, context, _of(context, recipe.model, "model"))


def _of(context: int, model: str, key: str) -> str:
    return f"the {context}-token context of {model!r} ({key}, runner/models.toml)"


def _room_for_a_prompt(where: str, key: str, max_tokens: int, context: int, of: str) -> None:
    """A prompt has at least one token: max_tokens must be below the context."""
    if max_tokens >= context:
        raise UserError(f"{where}: {key} = {max_tokens} leaves no room for a prompt in {of}: set it below {context}")
