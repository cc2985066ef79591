"""`--smoke`: any recipe run end to end offline in seconds (`runner run FILE#name --smoke`, `runner smoke FILE`).

`smoke_recipe` is the transform: a resolved Recipe in, the Recipe that will run out (`runner show FILE#name --smoke`
prints it). It keeps the recipe's algorithm, losses, modes and chain, and swaps what needs the network or hours:
- the backend: local, whatever the recipe says (a Tinker recipe never touches the service nor reads a key);
- the model: the recipe's `smoke.model`; else, when the model's config and tokenizer are local (a folder, or the
  Hugging Face cache: nothing is downloaded), a small random-init model of the same family built from them, so the
  tokenizer and chat template are the real ones; else the embedded `tiny` model;
- the data: `smoke.data` by key path ("algo.data", "algo.datasets[1].prompts"), else the recipe's own when it is
  local (a JSONL file's first HEAD_ROWS rows, a dataset folder, Python code, another run's output); a hub dataset
  without a stand-in is one line naming the key to set. `smoke.env` replaces an RL env;
- the sizes: `smoke.steps` steps (2), small batches, groups, test sets and max_tokens, no periodic checkpoints,
  evals only at the start and the end, no experiment tracking; `smoke.overrides` last;
- the run dir: `<name>-smoke` next to where the recipe's own would be, emptied first.
Chains (init_from, teachers, judges, run_output data) are smoked stage by stage: every recipe a target references is
smoked too and written with it to one generated recipe file (runs/.smoke/<file>.toml) whose references point at the
smoked stages, so runner/engine/pipeline.py runs the chain as it runs any other.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import tomli_w

from backends.errors import UserError
from backends.types import Json
from runner.algos.distill_config import Teacher
from runner.recipe.explain import dotted, info, is_ref
from runner.recipe.load import (
    apply_overrides,
    decode_recipe,
    load_recipe,
    pick,
    recipe_dict,
    recipe_names,
    refuse_short_renderer,
    split_ref,
    structs,
    toml_value,
)
from runner.recipe.schema import Recipe, Smoke
from runner.recipe.sources import HF, DataBase, Jsonl
from runner.renderers.registry import smoke_renderer

SMOKE_DIR = Path("runs") / ".smoke"
# Where small stand-in models are built (once per source config + tokenizer); RUNNER_SMOKE_CACHE overrides it.
CACHE_ENV = "RUNNER_SMOKE_CACHE"
# The sizes a smoked stage runs at (caps: a recipe's smaller values are kept).
CAPS = {"batch_size": 4, "group_size": 2, "groups_per_batch": 2, "max_tokens": 16, "n": 2, "minibatches": 2,
        "max_turns": 3, "max_length": 2048}
TEST_CAP = 2
# A local JSONL file is smoked on its first rows (a copy under runs/.smoke/data/), however large it is.
HEAD_ROWS = 256
# Tables whose fields are not the algorithm's sizes: data sources, user code's args, teachers, judges.
OPAQUE = frozenset({"data", "prompts", "args", "task_args", "teacher", "judge"})
# The stand-in model's shape (the family's config with these sizes; vocabulary and chat template unchanged).
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
         "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}


# ---------------------------------------------------------------- the transform


def smoke_recipe(recipe: Recipe, name: str, where: str, refs: dict[str, str] | None = None) -> Recipe:
    """The smoke version of `recipe` (named `name`, errors prefixed with `where`). `refs` maps each recipe reference
    it holds (absolute, as loaded) to the smoked stage's reference; one not in it stays as it is."""
    table = recipe.smoke or Smoke()
    raw = recipe_dict(recipe)
    raw.pop("smoke", None)
    raw.pop("log", None)
    raw["backend"] = _local_backend(raw["backend"])
    model = table.model or stand_in_model(recipe.model, recipe.tokenizer)
    raw["model"] = model
    raw["renderer"] = smoke_renderer(recipe.renderer, recipe.model, model)  # what the real model would render with
    raw.pop("tokenizer", None)
    raw["max_steps"] = table.steps
    raw["eval_every"] = table.steps if recipe.eval_every else 0
    raw["save_every"] = 0
    raw["if_exists"] = "resume"
    raw["log_dir"] = str(smoke_dir(recipe, name))
    _replace_data(recipe, raw, table, where, name)
    for keys, node in structs(recipe, ()):
        if isinstance(node, Teacher):
            teacher = _at(raw, keys)
            teacher.pop("checkpoint", None)  # weights of another model: the teacher is the stand-in base model
            if node.model is not None:
                teacher["model"] = table.model or stand_in_model(node.model, None)
        for f in info(type(node)).fields:
            value = getattr(node, f.name)
            if is_ref(f.type) and isinstance(value, str):
                _at(raw, keys)[f.encode_name] = (refs or {}).get(value, value)
    _shrink(raw["algo"])
    for pinned in raw.get("evals", []):  # [[evals]]: a few problems or rows, short replies
        _shrink(pinned)
        key = {"math": "max_problems", "nll": "max_rows", "inspect": "limit"}.get(pinned.get("kind", ""))
        if key is not None:
            pinned[key] = min(pinned.get(key) or TEST_CAP, TEST_CAP)
        if "samples" in pinned:
            pinned["samples"] = min(pinned["samples"], 2)
    refuse_short_renderer(dict(table.overrides), f"{where}: smoke.overrides")  # as a recipe's own is
    raw = apply_overrides(raw, [f"{k}={toml_value(v)}" for k, v in table.overrides.items()], f"{where}: smoke.overrides")
    return decode_recipe(raw, f"{where} (--smoke)")


def smoke_dir(recipe: Recipe, name: str) -> Path:
    """runs/<name>-smoke, or <name>-smoke next to the recipe's own log_dir."""
    parent = Path(recipe.log_dir).parent if recipe.log_dir else Path("runs")
    return parent / f"{name}-smoke"


def _local_backend(raw: Json) -> Json:
    return raw if raw.get("kind") == "local" else {"kind": "local"}


def _replace_data(recipe: Recipe, raw: Json, table: Smoke, where: str, name: str) -> None:
    sources = {dotted(keys): keys for keys, node in [*structs(recipe.algo, ("algo",)), *structs(recipe.evals, ("evals",))]
               if isinstance(node, DataBase)}
    for key, source in table.data.items():
        if key not in sources:
            have = ", ".join(sorted(sources)) or "none: this algorithm reads no data source"
            raise UserError(f"{where}: smoke.data: {key!r} is not a data source of this recipe (its data sources: "
                            f"{have})")
        _set(raw, sources[key], msgspec.to_builtins(source))
    for key, keys in sources.items():
        node = _node(recipe, keys)
        if key not in table.data and isinstance(node, Jsonl):  # the file's first rows (written by `write`)
            _at(raw, keys)["path"] = str(head_path(name, key))
        if key not in table.data and isinstance(node, HF) and not Path(node.name).expanduser().is_dir():
            raise UserError(f"{where}: --smoke: {key} is the hub dataset {node.name!r}, which a smoke run does not "
                            f"download; set smoke.data.\"{key}\" = {{kind = \"jsonl\", path = \"<a few local rows>\"}} "
                            "in the recipe")
    if table.env is not None:
        if "env" not in raw["algo"]:
            raise UserError(f"{where}: smoke.env: algo kind {raw['algo'].get('kind')!r} has no env")
        raw["algo"]["env"] = msgspec.to_builtins(table.env)


def _shrink(algo: Json) -> None:
    """Small sizes, in place, through the algorithm's tables (env, eval, datasets, mode)."""
    for key, value in list(algo.items()):
        if key in OPAQUE:
            continue
        if key in CAPS and isinstance(value, int) and not isinstance(value, bool):
            algo[key] = min(value, CAPS[key])
        elif key == "test_size" and isinstance(value, int):
            algo[key] = min(value, TEST_CAP)
        elif isinstance(value, dict):
            _shrink(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, dict):
                    _shrink(item)
    if "num_substeps" in algo:
        algo["num_substeps"] = 1
    if algo.get("kind") == "generate":
        algo["keep_truncated"] = True  # a random stand-in rarely stops: keep its replies for the next stage
    if "eval" in algo and isinstance(algo["eval"], dict):
        algo["eval"]["max_groups"] = TEST_CAP
    mode = algo.get("mode")
    if isinstance(mode, dict) and mode.get("kind") == "stream" and "groups_per_batch" in algo:
        algo["groups_per_batch"] = mode.get("minibatches", 2)


def _node(recipe: Recipe, keys: Sequence[str | int]) -> object:
    """What `keys` (a path from `structs`: fields, list items) leads to in the decoded recipe."""
    node: object = recipe
    for k in keys:
        node = node[k] if isinstance(k, int) and isinstance(node, Sequence) else getattr(node, str(k))
    return node


def _walk(node: object, keys: Sequence[str | int]) -> object:
    """What `keys` leads to in the raw recipe (tables and arrays)."""
    for k in keys:
        if isinstance(node, dict) and isinstance(k, str):
            node = node[k]
        elif isinstance(node, list) and isinstance(k, int):
            node = node[k]
        else:
            raise TypeError(f"{dotted(keys)}: the raw recipe has no {k!r} where the decoded one has")
    return node


def _at(raw: Json, keys: Sequence[str | int]) -> Json:
    """The raw table of the struct at `keys`."""
    node = _walk(raw, keys)
    if not isinstance(node, dict):
        raise TypeError(f"{dotted(keys)}: a struct of the recipe that is not a table in the raw recipe")
    return node


def _set(raw: Json, keys: Sequence[str | int], value: object) -> None:
    parent, last = _walk(raw, keys[:-1]), keys[-1]
    if isinstance(parent, dict) and isinstance(last, str):
        parent[last] = value
    elif isinstance(parent, list) and isinstance(last, int):
        parent[last] = value
    else:
        raise TypeError(f"{dotted(keys)}: the raw recipe has nothing to set there")


# ---------------------------------------------------------------- the stand-in model


def stand_in_model(model: str, tokenizer: str | None) -> str:
    """"tiny", or the folder of a small random-init model of `model`'s family (built by `build_stand_ins` before the
    run) when its config and tokenizer are on this machine; never contacts the hub."""
    if model == "tiny":
        return "tiny"
    config = _local_file(model, "config.json")
    tok = _local_file(tokenizer or model, "tokenizer_config.json")
    if config is None or tok is None:
        return "tiny"
    digest = hashlib.sha256(config.read_bytes() + str(tok.parent.resolve()).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model.strip("/"))[-60:]
    return str(cache_root() / f"{slug}-{digest}")


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "runner" / "smoke-models")


def _local_file(name: str, filename: str) -> Path | None:
    """`filename` of a model folder or of a hub id in the local Hugging Face cache (no network)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder / filename if (folder / filename).is_file() else None
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, filename)
    except Exception:  # noqa: BLE001 - a name the hub client refuses is simply not cached
        return None
    return Path(found) if isinstance(found, str) else None


def build_stand_ins(recipe: Recipe, original: Recipe) -> None:
    """Build the stand-in model folders `recipe` (smoked from `original`) names, if not built yet."""
    pairs = [(recipe.model, original.model, original.tokenizer)]
    pairs += [(s.model, o.model, None) for (_, s), (_, o) in zip(_teachers(recipe), _teachers(original), strict=True)
              if s.model is not None and o.model is not None]
    for target, model, tokenizer in pairs:
        if target != "tiny" and Path(target).parent == cache_root() and not (Path(target) / "config.json").is_file():
            build_small_model(model, tokenizer or model, Path(target))


def _teachers(recipe: Recipe) -> list[tuple[tuple[str | int, ...], Teacher]]:
    return [(k, n) for k, n in structs(recipe, ()) if isinstance(n, Teacher)]


def build_small_model(model: str, tokenizer: str, out: Path) -> None:
    """A random-init model with `model`'s config at small sizes, and `tokenizer`'s files, written to `out`."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config_file, tok_file = _local_file(model, "config.json"), _local_file(tokenizer, "tokenizer_config.json")
    if config_file is None or tok_file is None:
        raise UserError(f"--smoke: {model!r}: its config or tokenizer is no longer on this machine")
    try:
        cfg = AutoConfig.from_pretrained(config_file.parent)
        for part in [cfg, getattr(cfg, "text_config", None)]:
            if part is None:
                continue
            for key, value in SMALL.items():
                if isinstance(getattr(part, key, None), int):
                    setattr(part, key, value)
            if isinstance(getattr(part, "layer_types", None), list):
                part.layer_types = part.layer_types[: SMALL["num_hidden_layers"]]
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(0)
        net = AutoModelForCausalLM.from_config(cfg)
        tok = AutoTokenizer.from_pretrained(tok_file.parent)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        net.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    except Exception as e:  # noqa: BLE001 - an unusual family: the fix is the same whatever transformers raised
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--smoke: cannot build a small random-init {model!r} ({type(e).__name__}: {first}); set "
                        "smoke.model = \"tiny\" in the recipe") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").is_file():  # built meanwhile by another smoke
        shutil.rmtree(tmp, ignore_errors=True)
        return
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"smoke: built a small random-init {model} in {out}", file=sys.stderr)


# ---------------------------------------------------------------- planning: every stage, one generated file


@dataclass
class Stage:
    ref: str  # the original reference: "/abs/file.toml#name"
    name: str  # its name in the smoke file
    original: Recipe
    where: str  # errors name it as the user did ("FILE#name")
    recipe: Recipe | None = None  # smoked


@dataclass
class SmokePlan:
    file: Path  # the generated recipe file
    targets: dict[str, str]  # the recipe names asked for -> their names in the smoke file
    stages: dict[str, Stage] = field(default_factory=dict)  # by original reference, in load order

    def recipe(self, name: str) -> Recipe:
        out = self.stages_by_name()[self.targets[name]].recipe
        assert out is not None
        return out

    def stages_by_name(self) -> dict[str, Stage]:
        return {s.name: s for s in self.stages.values()}

    def needs(self, name: str) -> list[Stage]:
        """The stages `name` runs (those it references, transitively), itself last."""
        order: list[Stage] = []
        by_name = self.stages_by_name()

        def visit(stage: Stage) -> None:
            if stage in order:
                return
            assert stage.recipe is not None
            for ref in _references(stage.recipe):
                file, _, ref_name = ref.rpartition("#")
                if Path(file).resolve() == self.file.resolve() and ref_name in by_name:
                    visit(by_name[ref_name])
            order.append(stage)

        visit(by_name[self.targets[name]])
        return order


def plan(path: str, names: Sequence[str], overrides: Sequence[str] = (), out: Path | None = None) -> SmokePlan:
    """Smoke `names` of recipe file `path` (overrides on each) and every recipe they reference."""
    out = out or SMOKE_DIR / f"{Path(path).stem}.toml"
    smoke = SmokePlan(out.resolve(), {})
    queue: list[tuple[str, Recipe, str]] = []
    for name in names:
        _, recipe = load_recipe(f"{path}#{name}", overrides)
        ref = f"{Path(path).resolve()}#{name}"
        smoke.stages[ref] = Stage(ref, name, recipe, f"{path}#{name}")
        smoke.targets[name] = name
        queue.append((ref, recipe, f"{path}#{name}"))
    while queue:
        ref, recipe, where = queue.pop(0)
        for up in _references(recipe):
            if "#" not in up:
                raise UserError(f"{where}: --smoke runs recipes, not the finished run dir {up!r} it names; reference "
                                "the recipe that trains it (FILE#name)")
            if up in smoke.stages:
                continue
            try:
                up_name, up_recipe = load_recipe(up)
            except UserError as e:
                raise UserError(f"{where}: {up!r}: {e}") from None
            taken = {s.name for s in smoke.stages.values()}
            label = up_name if up_name not in taken else f"{Path(up.rpartition('#')[0]).stem}__{up_name}"
            smoke.stages[up] = Stage(up, label, up_recipe, up)
            queue.append((up, up_recipe, up))
    refs = {s.ref: f"{smoke.file}#{s.name}" for s in smoke.stages.values()}
    for stage in smoke.stages.values():
        stage.recipe = smoke_recipe(stage.original, stage.name, stage.where, refs)
    return smoke


def _references(recipe: Recipe) -> list[str]:
    """Every recipe reference in `recipe` (init_from first)."""
    out = [] if recipe.init_from is None else [recipe.init_from]
    for keys, node in structs(recipe, ()):
        for f in info(type(node)).fields:
            value = getattr(node, f.name)
            if keys and is_ref(f.type) and isinstance(value, str) and value not in out:
                out.append(value)
    return out


def head_path(name: str, key: str) -> Path:
    """Where the first rows of recipe `name`'s JSONL data source at `key` are copied."""
    return SMOKE_DIR / "data" / f"{name}.{re.sub(r'[^A-Za-z0-9_.-]+', '_', key)}.jsonl"


def _write_heads(stage: Stage) -> None:
    """The first HEAD_ROWS lines of each local JSONL file the stage reads, where its smoked recipe looks for them."""
    assert stage.recipe is not None
    smoked = {dotted(k): n for k, n in [*structs(stage.recipe.algo, ("algo",)), *structs(stage.recipe.evals, ("evals",))]
              if isinstance(n, Jsonl)}
    for keys, node in [*structs(stage.original.algo, ("algo",)), *structs(stage.original.evals, ("evals",))]:
        key = dotted(keys)
        if isinstance(node, Jsonl) and key in smoked and Path(smoked[key].path) == head_path(stage.name, key):
            src = Path(node.path)
            if not src.is_file():
                raise UserError(f"{stage.where}: {key}.path: data file not found: {node.path}")
            dst = head_path(stage.name, key)
            dst.parent.mkdir(parents=True, exist_ok=True)
            with src.open(encoding="utf-8") as f, dst.open("w", encoding="utf-8") as out:
                for n, line in enumerate(f):
                    if n >= HEAD_ROWS:
                        break
                    out.write(line)


def write(smoke: SmokePlan) -> None:
    """The smoke file: every smoked stage, so the chain machinery loads them by reference; and the first rows of
    their local data files."""
    tables = {}
    for s in smoke.stages.values():
        assert s.recipe is not None
        tables[s.name] = recipe_dict(s.recipe)
        _write_heads(s)
    smoke.file.parent.mkdir(parents=True, exist_ok=True)
    smoke.file.write_text("# Generated by runner --smoke (runner/tools/smoke.py); rewritten on every smoke.\n"
                          + tomli_w.dumps({"recipes": tables}))


def check_smoke(path: str, name: str, overrides: Sequence[str] = ()) -> None:
    """`runner check`: a recipe with a smoke table must smoke (its data keys name data sources, its overrides fit)."""
    if "smoke" in pick(f"{path}#{name}")[2]:
        plan(path, [name], overrides)


def show(path: str, name: str, overrides: Sequence[str]) -> str:
    """`runner show FILE#name --smoke`: the smoked recipe and the stages it runs first, as TOML."""
    smoke = plan(path, [name], overrides)
    from runner.recipe.load import dump_recipe

    stages = smoke.needs(name)
    head = f"# --smoke: runs (from {smoke.file}, written when it runs) {' -> '.join('#' + s.name for s in stages)}\n"
    return head + "\n".join(dump_recipe(s.name, s.recipe) for s in stages if s.recipe is not None)


# ---------------------------------------------------------------- running


@dataclass
class Result:
    name: str
    stages: int
    steps: int
    wall_s: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


def run_smoke(path: str, names: Sequence[str], overrides: Sequence[str] = (), *, dry_run: bool = False,
              keep_going: bool = True) -> list[Result]:
    """Smoke each recipe (its stages first); the smoke run dirs are emptied first, once (a stage two targets share
    runs once). With keep_going a failure is recorded and the next recipe goes on; else it raises."""
    from runner.engine.chain import check_all
    from runner.engine.pipeline import run_chain

    planned: dict[str, str | None] = {}  # a recipe that cannot be smoked is reported; the others still run
    for name in names:
        try:
            plan(path, [name], overrides)
            planned[name] = None
        except UserError as e:
            if not keep_going:
                raise
            planned[name] = str(e)
    ok = [n for n in names if planned[n] is None]
    smoke = plan(path, ok, overrides) if ok else SmokePlan(Path(), {})
    if ok:
        write(smoke)
    if ok:  # also for a dry run, whose plan is then the one a smoke runs (smoke run dirs are scratch)
        for stage in smoke.stages.values():
            assert stage.recipe is not None
            _empty(Path(stage.recipe.log_dir or ""))
    results = []
    for i, name in enumerate(names, 1):
        if keep_going:  # `runner smoke FILE`: which recipe the log that follows is of
            print(f"== smoke {path}#{name} ({i}/{len(names)})", file=sys.stderr, flush=True)
        if (problem := planned[name]) is not None:
            results.append(Result(name, 0, 0, 0.0, problem))
            continue
        stages = smoke.needs(name)
        t0 = time.perf_counter()
        error = None
        try:
            for stage in stages:
                assert stage.recipe is not None
                build_stand_ins(stage.recipe, stage.original)
            where = f"{smoke.file}#{smoke.targets[name]}"
            check_all(smoke.recipe(name), where)
            run_chain(smoke.recipe(name), smoke.targets[name], where, dry_run=dry_run)
        except UserError as e:
            if not keep_going:
                raise
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a smoke reports every failure (with its traceback) and goes on
            if not keep_going or type(e).__name__ == "Interrupted":  # Ctrl-C in the loop stops the smoke
                raise
            traceback.print_exc()
            error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        results.append(Result(name, len(stages), _steps(smoke.recipe(name)), time.perf_counter() - t0, error))
    return results


def _steps(recipe: Recipe) -> int:
    from runner.engine.log import read_jsonl
    from runner.engine.rundir import CHECKPOINTS

    rows = read_jsonl(Path(recipe.log_dir or "") / CHECKPOINTS)
    return int(rows[-1].get("next_step", 0)) if rows else 0


def _empty(run_dir: Path) -> None:
    """Remove an earlier smoke's run dir (only a dir named *-smoke that is a run dir of ours, or empty: rundir.claim;
    shutil.rmtree removes links inside, never what they point to)."""
    from runner.engine.rundir import claim

    if not run_dir.name.endswith("-smoke") or not run_dir.is_dir() or run_dir.is_symlink():
        return
    try:
        claim(run_dir)
    except UserError:
        raise UserError(f"{run_dir} exists and is not a run dir; --smoke writes its run there: move it away") from None
    shutil.rmtree(run_dir)


def table(results: Sequence[Result]) -> str:
    """The `runner smoke` summary: recipe, stages, steps, wall s, result."""
    rows = [("recipe", "stages", "steps", "wall s", "result")]
    rows += [(r.name, str(r.stages), str(r.steps), f"{r.wall_s:.1f}", "ok" if r.ok else f"FAILED: {r.error}")
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join([*(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                              strict=False))),
                        row[4]]) for row in rows]
    return "\n".join(lines) + "\n"


def all_names(path: str) -> list[str]:
    return recipe_names(path)


def split(ref: str) -> tuple[str, str]:
    """FILE#name (or FILE holding one recipe) -> (FILE, name)."""
    path, name = split_ref(ref)
    if name is None:
        names = all_names(path)
        if len(names) != 1:
            raise UserError(f"{path}: pick a recipe as {path}#NAME; available: {', '.join(sorted(names))}")
        name = names[0]
    return path, name
