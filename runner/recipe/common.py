"""The recipe's basic types (shared by runner/recipe/schema.py and every config module): number limits, `pkg.mod:fn`
targets, recipe references, the struct base, the bases of the algorithm, env and pinned eval variants, the data
sources a table may name, and TrainOnWhat.

Nothing here finds config modules (backends/configs.py `found`): a config module imports its base from here,
never from the module that builds its union (runner/recipe/schema.py, envs.py, pinned.py), so importing a config
module first cannot leave it half-built inside its own union (tests/test_import_graph.py checks it)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from backends.configs import ConfigStruct

# A JSON object (a row of a .jsonl file, a table whose keys are open: metric names, an algorithm's data position):
# defined once, in backends/types.py.
from backends.types import Json as Json
from runner.recipe.sources import HF, DataBase, File, Jsonl

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Frac = Annotated[float, Meta(ge=0, le=1)]
# User code, "pkg.mod:fn". `runner check` imports every field of this type, wherever it appears.
TARGET_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
Target = Annotated[str, Meta(pattern=TARGET_PATTERN, description="'pkg.mod:fn'")]
# Another recipe's run, whose final weights a field uses: "FILE#name", "#name" (this file) or a run dir.
# runner/engine/chain.py finds every field of this type, runs the unfinished ones first and resolves them.
REF_DESCRIPTION = "'FILE#name', '#name' or a run dir"
RecipeRef = Annotated[str, Meta(min_length=1, description=REF_DESCRIPTION)]


class Base(ConfigStruct):  # pyright: ignore[reportGeneralTypeIssues] (see ConfigStruct)
    pass


class AlgoBase(Base, tag_field="kind", tag=str.lower):
    """An algorithm (`algo = {kind = ...}`): each in runner/algos/NAME_config.py, implemented by runner/algos/NAME.py,
    which declares `SPEC = AlgoSpec(...)` (runner/engine/spec.py)."""


class EnvBase(Base, tag_field="kind", tag=str.lower):
    """An RL environment (`algo.env = {kind = ...}`): each in runner/rl/envs/NAME_config.py, implemented by
    runner/rl/envs/NAME.py, which declares `ENV = EnvKind(...)` (runner/rl/envs/common.py)."""

    # Problems in the training split (batches = train_size // groups_per_batch) and held out for evals.
    train_size: PosInt = 10_000
    test_size: NonNegInt = 64


class PinnedEvalBase(Base, tag_field="kind", tag=str.lower, kw_only=True):
    """An eval pinned in the recipe (`[[recipes.x.evals]]`, runner/engine/evals.py): run with eval_every, after the last
    step and by `runner eval`, on the sampler weights of the moment; logged as test/eval/<name>/<metric>. Each kind is in
    runner/engine/NAME_eval_config.py, implemented by runner/engine/NAME_eval.py (`EVAL = EvalKind(...)`)."""

    # The metric prefix; default: the kind, with its position when two evals share a kind ("math", "math_1").
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]+$")] | None = None

    def default_name(self) -> str:
        """The metric prefix when `name` is not set: the kind."""
        return str(type(self).__struct_config__.tag)


# ---------------------------------------------------------------- data sources

# DataBase and the file/hub sources (jsonl, file, hf: format, fields, streaming) are in runner/recipe/sources.py.


class Python(DataBase):
    """User code: `target = "pkg.mod:fn"`, called as fn(**args); imported and checked by `runner check`."""

    target: Target
    args: Json = {}


class RunOutput(DataBase, tag="run_output"):
    """The rows another run wrote (a `generate` recipe's conversations): run first by `runner run`."""

    run: RecipeRef


DataSource = Jsonl | File | HF | Python | RunOutput


# Which tokens of a conversation carry loss: the cookbook's TrainOnWhat (runner/renderers/base.py, docs/renderers.md).
TrainOnWhat = Literal["last_assistant_message", "last_assistant_turn", "all_assistant_messages", "all_messages",
                      "all_tokens", "all_user_and_system_messages", "customized"]
