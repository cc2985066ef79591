"""Recipe chaining: `init_from` starts a recipe from another run's final weights (runner/recipe/schema.py).

A reference is "FILE#name", "#name" (a recipe in the same file) or a run dir. Loading a recipe (runner/recipe/load.py)
makes it absolute ("/abs/recipes.toml#name", "/abs/runs/x"), so a run dir's config.toml still names the same
upstream from anywhere. `upstreams` walks the chain (deepest first) and reports a missing name, a cycle, or an
upstream that trains another model or adapter shape as one line; `runner check` calls it. `run_chain` runs each
unfinished upstream recipe (resuming a partial one), then the recipe itself from the last upstream's final
checkpoint: weights only, fresh optimizer, step 0. The upstream run's recipe and checkpoint are recorded in the
downstream run dir (init_from.json); if either changes after the downstream trained, resuming it is refused like
any other recipe change (runner/engine/rundir.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import msgspec

from backends.errors import UserError
from runner.algos.distill_config import Teacher
from runner.algos.generate_config import Generate
from runner.engine.checkpoints import Checkpoint, checkpoints_of
from runner.engine.context import InitWeights
from runner.engine.rundir import CONFIG, claim, load_config, run_dir_path
from runner.recipe.common import RunOutput
from runner.recipe.explain import dotted, info, is_ref
from runner.recipe.load import check_recipe, load_recipe, structs
from runner.recipe.schema import Recipe


@dataclass(frozen=True)
class Upstream:
    """One stage a recipe starts from."""

    ref: str  # absolute: "/abs/recipes.toml#name" or "/abs/run/dir"
    name: str
    recipe: Recipe
    run_dir: Path
    # A recipe (run when unfinished) or a run dir given directly (used as it is; it must be finished).
    runnable: bool

    @property
    def label(self) -> str:
        return f"#{self.name}" if self.runnable else str(self.run_dir)


# The longest chain of runs a recipe may start from (init_from stages, or teachers and judges each trained from
# another): a bound, so that a chain of any length is one line, not a RecursionError or an hour of checking.
MAX_CHAIN = 1000


def upstreams(recipe: Recipe, where: str) -> list[Upstream]:
    """The init_from chain above `recipe` (named `where`, 'FILE#name'), deepest first; UserError on a missing
    reference, a cycle, or an upstream whose weights cannot start this recipe. Walked in a loop; inside
    check_session() a stage's own chain is remembered, so checking every recipe of a chain of N is linear in N."""
    chain: list[Upstream] = []
    seen = [_key(where)]
    current, current_where = recipe, where
    tail: list[Upstream] = []  # a remembered chain above the last stage walked
    while current.init_from is not None:
        prefix = f"{current_where}: init_from {current.init_from!r}"
        stage = _stage(current.init_from, prefix, seen)
        _check_compatible(stage.recipe, current, prefix)
        chain.append(stage)
        if len(chain) > MAX_CHAIN:
            raise UserError(f"{where}: init_from chain longer than {MAX_CHAIN} runs (at {current_where}); make it "
                            "shorter")
        current, current_where = stage.recipe, stage.ref
        if not stage.runnable:
            break  # a finished run dir's own history is its business: its weights are what they are
        known = _SESSION.upstreams.get(stage.ref) if _SESSION is not None else None
        if known is not None:
            # No cycle can pass through it: walking its chain would have met the same cycle, and it is remembered
            # only once walked without error.
            if len(chain) + len(known) > MAX_CHAIN:
                raise UserError(f"{where}: init_from chain longer than {MAX_CHAIN} runs; make it shorter")
            tail = list(known)
            break
    out = tail + chain[::-1]
    if _SESSION is not None:  # each stage's chain is what lies below it in `out`
        for i, stage in enumerate(out):
            if stage.runnable and stage.ref not in _SESSION.upstreams:
                _SESSION.upstreams[stage.ref] = out[:i]
    return out


def ref_fields(recipe: Recipe) -> list[tuple[str, str, bool]]:
    """(key path, reference, weights?) of every RecipeRef in the recipe except the top-level init_from: runs whose
    final weights the algorithm samples from (teachers, judges: weights? true) or whose output it reads (run_output
    data: false)."""
    return [(dotted([*keys, field.encode_name]), value, not isinstance(node, RunOutput))
            for keys, node in structs(recipe, ()) for field in info(type(node)).fields
            if keys and is_ref(field.type) and isinstance(value := getattr(node, field.name), str)]


class _RunOrder:
    """Stages in the order to run them, each run once (by ref)."""

    def __init__(self) -> None:
        self.stages: list[Upstream] = []
        self._refs: set[str] = set()

    def add(self, stages: list[Upstream]) -> None:
        for d in stages:
            if d.ref not in self._refs:
                self._refs.add(d.ref)
                self.stages.append(d)


def dependencies(recipe: Recipe, where: str, seen: tuple[str, ...] = (),
                 memo: dict[str, list[Upstream]] | None = None) -> list[Upstream]:
    """The runs the algorithm samples from (ref_fields), each after the runs it depends on itself, in the order
    to run them; every init_from chain checked. UserError on a missing reference or a cycle. `memo`: the
    dependencies of each run already walked in this call (a run reached twice is walked once)."""
    memo = {} if memo is None else memo
    seen = (*seen, _key(where))
    if len(seen) > MAX_CHAIN:
        raise UserError(f"{where}: chain of teachers, judges and run outputs deeper than {MAX_CHAIN} runs; make it "
                        "shorter")
    order = _RunOrder()
    add = order.add
    # The init_from chain's stages are all in upstreams(): each needs what its own references need.
    for stage in upstreams(recipe, where):
        if not stage.runnable:
            continue
        known = _SESSION.ref_dependencies.get(stage.ref) if _SESSION is not None else None
        if known is None:
            known = _ref_dependencies(stage.recipe, stage.ref, (*seen, _key(stage.ref)), memo)
            if _SESSION is not None:
                _SESSION.ref_dependencies[stage.ref] = known
        add(known)
    add(_ref_dependencies(recipe, where, seen, memo))
    return order.stages


def _ref_dependencies(recipe: Recipe, where: str, seen: tuple[str, ...],
                      memo: dict[str, list[Upstream]]) -> list[Upstream]:
    """What the references of `recipe` itself (not of its init_from chain) need, in the order to run them."""
    order = _RunOrder()
    add = order.add
    for path, ref, samples in ref_fields(recipe):
        prefix = f"{where}: {path} {ref!r}"
        stage = _stage(ref, prefix, list(seen))
        if samples and type(stage.recipe.backend) is not type(recipe.backend):
            raise UserError(f"{prefix}: it runs on backend {_tag(stage.recipe.backend)}, this recipe on "
                            f"{_tag(recipe.backend)}; its weights must be on the same backend")
        if samples and (problem := tokenizer_mismatch(stage.recipe.tokenizer or stage.recipe.model,
                                                      recipe.tokenizer or recipe.model)) is not None:
            raise UserError(f"{prefix}: {problem}")
        if stage.runnable:
            key = _key(stage.ref)
            if key not in memo:
                memo[key] = dependencies(stage.recipe, stage.ref, seen, memo)
            add(memo[key])
            add(upstreams(stage.recipe, stage.ref))
        add([stage])
    return order.stages


@dataclass
class _Session:
    """What one `runner check` (or sweep plan) has loaded and checked, so that a run reached from many recipes is
    loaded and checked once: the recipe files do not change while it looks."""

    stages: dict[str, Upstream] = field(default_factory=dict)  # a loaded reference -> its run
    upstreams: dict[str, list[Upstream]] = field(default_factory=dict)  # a runnable stage's ref -> its chain
    checked: set[tuple[str, bytes]] = field(default_factory=set)  # (key, recipe as JSON or b"") that passed check_all
    keys: dict[str, str] = field(default_factory=dict)  # _key's answers
    claimed: set[Path] = field(default_factory=set)  # run dirs rundir.claim accepted
    ref_dependencies: dict[str, list[Upstream]] = field(default_factory=dict)  # a stage's _ref_dependencies


_SESSION: _Session | None = None


@contextmanager
def check_session() -> Iterator[None]:
    """Inside it, references are loaded once and each recipe of a chain checked once (check_all, upstreams)."""
    global _SESSION
    outer = _SESSION
    _SESSION = outer or _Session()
    try:
        yield
    finally:
        _SESSION = outer


def check_all(recipe: Recipe, where: str, keep_rows: bool = False, name: str | None = None) -> None:
    """`runner check` of one recipe: what decoding cannot see (runner.recipe.load.check_recipe, the data's rows:
    runner.data.check.check_data, a custom algorithm's args) for it and every recipe it runs first (its init_from chain, teachers, judges), and that every model it scores with shares its tokenizer.
    `name` (the recipe's): also that its run dir, and those of the recipes it runs first, are new or run dirs of
    ours (rundir.claim, which only looks)."""
    from runner.data.check import check_data
    from runner.engine.evals import check_evals
    from runner.engine.spec import check_algo
    from runner.engine.track import check_trackers
    from runner.renderers.registry import renderer_mismatch

    first = [s for s in [*upstreams(recipe, where), *dependencies(recipe, where)] if s.runnable]
    for i, (r, at) in enumerate([(recipe, where), *((s.recipe, s.ref) for s in first)]):
        # A stage is the recipe its reference loads (one per session); the recipe itself may carry overrides.
        done = None if _SESSION is None else (_key(at), b"" if i else msgspec.json.encode(r))
        if done is not None and done in _SESSION.checked:  # pyright: ignore[reportOptionalMemberAccess]
            continue
        check_recipe(r, at)
        if (problem := r.backend.cache_problem(r.model, r.tokenizer)) is not None:  # HF_HUB_OFFLINE=1, uncached
            raise UserError(f"{at}: {problem}")
        if (problem := renderer_mismatch(r.renderer, r.model, r.tokenizer)) is not None:
            raise UserError(f"{at}: {problem}")
        # keep_rows (`runner run`): a recipe that runs alone keeps its data's rows for its loader (read once); in a
        # chain they would wait in memory while the stages before it train, so those are read again instead.
        check_data(r, at, keep=keep_rows and not first)
        check_algo(r.algo, at)
        check_evals(r.evals, at)
        check_trackers(r.log, at)
        if done is not None and not (keep_rows and not first):
            _SESSION.checked.add(done)  # pyright: ignore[reportOptionalMemberAccess]
    if name is not None:
        for run_dir in [run_dir_path(recipe, name), *(s.run_dir for s in first)]:
            if _SESSION is None or run_dir not in _SESSION.claimed:
                claim(run_dir)
                if _SESSION is not None:
                    _SESSION.claimed.add(run_dir)
    for path, model in base_models(recipe):
        if (problem := tokenizer_mismatch(model, recipe.tokenizer or recipe.model)) is not None:
            raise UserError(f"{where}: {path} {model!r}: {problem}")


def base_models(recipe: Recipe) -> list[tuple[str, str]]:
    """(key path, model) of every other base model the recipe samples from (a teacher's `model`)."""
    return [(dotted([*keys, "model"]), node.model) for keys, node in structs(recipe, ())
            if isinstance(node, Teacher) and node.model is not None and node.init_from is None]


def tokenizer_mismatch(theirs: str, ours: str) -> str | None:
    """Why a model with tokenizer `theirs` cannot score our tokens (None when it can: the same name, or two
    tokenizers with the same vocabulary). Both are loaded only when the names differ; one that cannot be loaded
    here (a hub name offline) is taken on trust."""
    if theirs == ours:
        return None
    from backends.tokenizer import load_tokenizer

    try:
        a, b = load_tokenizer(theirs), load_tokenizer(ours)
    except UserError:
        return None
    if a.get_vocab() != b.get_vocab():
        return (f"its tokenizer ({theirs}) differs from this recipe's ({ours}): it would score other tokens than "
                "the ones sampled")
    return None


def _stage(ref: str, prefix: str, seen: list[str]) -> Upstream:
    """The run a reference names; `seen` (keys of the recipes on the way here) detects cycles."""
    file, sep, _ = ref.rpartition("#")
    if sep and _key(ref) in seen:
        cycle = " -> ".join([*(_short(k) for k in seen), _short(_key(ref))])
        raise UserError(f"{prefix}: the chain is a cycle ({cycle})")
    if _SESSION is not None and ref in _SESSION.stages:
        if sep:
            seen.append(_key(ref))
        return _SESSION.stages[ref]
    stage = _load_stage(ref, prefix, seen)
    if _SESSION is not None:
        _SESSION.stages[ref] = stage
    return stage


def _load_stage(ref: str, prefix: str, seen: list[str]) -> Upstream:
    file, sep, name = ref.rpartition("#")
    if sep:
        if not Path(file).is_file():
            raise UserError(f"{prefix}: recipe file not found: {file or '(this file)'}")
        seen.append(_key(ref))
        try:
            name, up = load_recipe(ref)
        except UserError as e:
            raise UserError(f"{prefix}: {e}") from None
        return Upstream(ref, name, up, run_dir_path(up, name).resolve(), runnable=True)
    run_dir = Path(ref)
    if not (run_dir / CONFIG).is_file():
        raise UserError(f"{prefix}: not a recipe reference (FILE#name or #name) nor a run dir with a {CONFIG}")
    return Upstream(ref, run_dir.name, load_config(run_dir / CONFIG), run_dir.resolve(), runnable=False)


def _check_compatible(up: Recipe, down: Recipe, prefix: str) -> None:
    """The downstream loads the upstream's saved state into its own training client: same base model, backend
    and adapter shape."""
    problems = []
    if up.model != down.model:
        problems.append(f"model {up.model!r} vs {down.model!r}")
    if type(up.backend) is not type(down.backend):
        problems.append(f"backend {_tag(up.backend)} vs {_tag(down.backend)}")
    full_up, full_down = (getattr(r.backend, "full_finetune", False) for r in (up, down))
    if full_up != full_down:
        problems.append("full_finetune differs")
    elif not full_up and up.lora != down.lora:
        diff = [f"lora.{k} {getattr(up.lora, k)} vs {getattr(down.lora, k)}" for k in up.lora.__struct_fields__
                if getattr(up.lora, k) != getattr(down.lora, k)]
        problems.extend(diff)
    if problems:
        raise UserError(f"{prefix}: its weights cannot start this recipe ({'; '.join(problems)}); "
                        "a chained recipe trains the same model and adapter")


def final_checkpoint(stage: Upstream) -> Checkpoint:
    """The upstream run's last checkpoint row, which must be its final one (the weights after its last step)."""
    rows = [r for r in checkpoints_of(stage.run_dir) if r.state_path and r.sampler_path]
    if not rows:
        raise UserError(f"init_from {stage.label}: {stage.run_dir} has no checkpoint yet"
                        + ("" if stage.runnable else "; run it first"))
    last = rows[-1]
    if not last.name.startswith("final"):
        raise UserError(f"init_from {stage.label}: {stage.run_dir} is not finished (its last checkpoint is "
                        f"{last.name!r}, after step {last.next_step}); run it first")
    return last


def has_weights(stage: Upstream) -> bool:
    """Whether a run ends with weights worth sampling (a generate run trains nothing; its output is data)."""
    return not isinstance(stage.recipe.algo, Generate)


class Inputs(TypedDict):
    """What runner.engine.loop.run takes besides the recipe, once its upstreams have run (resolved_inputs)."""

    init: InitWeights | None  # the chain's last stage's final checkpoint: where training starts
    weights: dict[str, str]  # every RecipeRef the recipe names -> that run's final sampler weights


def resolved_inputs(recipe: Recipe, where: str) -> Inputs:
    """`init` (InitWeights or None) and `weights` (final sampler weights by reference) of a recipe whose upstreams
    have run: what runner.engine.loop.run and `runner eval` need to build its algorithm (start, reference, teachers,
    judges) without running anything."""
    chain = upstreams(recipe, where)
    init = None
    if chain:
        last = chain[-1]
        ckpt = final_checkpoint(last)
        init = InitWeights(last.ref, last.name, last.recipe, str(ckpt.state_path), str(ckpt.sampler_path), ckpt.name)
    deps = dependencies(recipe, where)
    return Inputs(init=init, weights={d.ref: str(final_checkpoint(d).sampler_path) for d in deps if has_weights(d)})


def _status(stage: Upstream) -> str:
    rows = [r for r in checkpoints_of(stage.run_dir) if r.state_path]
    if not rows:
        return "new" if stage.runnable else "no checkpoint"
    if rows[-1].name.startswith("final"):
        return "finished"
    return f"partial: resumes at step {rows[-1].next_step}"


def _key(ref: str) -> str:
    if _SESSION is not None and ref in _SESSION.keys:
        return _SESSION.keys[ref]
    file, _, name = ref.rpartition("#")
    key = f"{Path(file).resolve()}#{name}" if file else ref
    if _SESSION is not None:
        _SESSION.keys[ref] = key
    return key


def _short(key: str) -> str:
    return "#" + key.rpartition("#")[2] if "#" in key else key


def _tag(struct: object) -> str:
    return str(type(struct).__struct_config__.tag)  # type: ignore[attr-defined]
