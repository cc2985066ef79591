"""Recipe loading: exact error messages (they are UI), overrides, and the show -> load round trip.

    pytest tests/test_recipe.py
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi
import pytest

from backends.errors import UserError
from backends.local.local_config import Local
from backends.tinker.tinker_config import Tinker
from runner.algos.sft_config import SFT
from runner.recipe.common import Python
from runner.recipe.explain import convert
from runner.recipe.load import check_recipe, dump_recipe, load_file, load_recipe, parse_override, recipe_dict
from runner.recipe.schema import Cosine, Linear, Recipe
from runner.recipe.sources import Jsonl

REPO = Path(__file__).resolve().parent.parent
SHIPPED = [REPO / "recipes.toml", *sorted((REPO / "examples").glob("*.toml"))]

GOOD = """\
[recipes.sl_basic]
lr = 2e-3
algo = {kind = "sft", data = {kind = "jsonl", path = "data.jsonl"}}
"""


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding data.jsonl; recipe paths are relative to it, like the CLI's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return tmp_path


def write(text: str, name: str = "recipes.toml") -> str:
    Path(name).write_text(text)
    return name


def error_of(fn: Any, *args: Any) -> str:
    with pytest.raises(UserError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- bad recipes, exact messages

# (recipe body under [recipes.sl_basic], expected message). The body replaces GOOD's.
DATA = 'data = {kind = "jsonl", path = "data.jsonl"}'
BAD_RECIPES = [
    (
        f'algo = {{kind = "sft", {DATA}, batch_sise = 8}}',
        ("recipes.toml#sl_basic: algo.batch_sise: unknown key; did you mean `batch_size`? "
        "(valid: agreement, batch_size, data, epochs, kind, max_length, reduction, test_size, train_on_what)"),
    ),
    (
        f'lro = 1e-3\nalgo = {{kind = "sft", {DATA}}}',
        ("recipes.toml#sl_basic: lro: unknown key; did you mean `lr`? (valid: algo, backend, budget, depth, eval_every, "
        "evals, if_exists, init_from, log, log_dir, lora, lr, max_steps, model, optim, price, price_file, renderer, "
        "save_every, schedule, seed, smoke, tokenizer)"),
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nlora = {{zzz = 1}}',
        "recipes.toml#sl_basic: lora.zzz: unknown key (valid: rank, train_attn, train_mlp, train_unembed)",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nbackend = {{kind = "tinkr"}}',
        "recipes.toml#sl_basic: backend.kind: invalid choice 'tinkr'; expected one of: local, python, tinker",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nbackend = {{kind = 3}}',
        "recipes.toml#sl_basic: backend.kind: invalid choice 3; expected one of: local, python, tinker",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nbackend = {{device = "cpu"}}',
        "recipes.toml#sl_basic: backend.kind: missing key; expected one of: local, python, tinker",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nbackend = "tinker"',
        ("recipes.toml#sl_basic: backend: expected a table, got str 'tinker'; "
        'write e.g. backend = {kind = "tinker"} (kind one of: local, python, tinker)'),
    ),
    (
        # A field of the other variant is unknown here: each variant carries only its own fields.
        f'algo = {{kind = "sft", {DATA}}}\nbackend = {{kind = "tinker", device = "cpu"}}',
        "recipes.toml#sl_basic: backend.device: unknown key; it is a key of kind local, and this backend is kind "
        "'tinker': to change the kind, give the table whole (backend={kind = \"tinker\", ...}) "
        "(valid: base_url, connect_timeout_s, kind, lost_after_s, ttl_seconds)",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nbackend = {{kind = "local", device = "tpu"}}',
        "recipes.toml#sl_basic: backend.device: invalid choice 'tpu'; expected one of: auto, cpu, cuda",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nbackend = {{kind = "tinker", ttl_seconds = 60}}',
        "recipes.toml#sl_basic: backend.ttl_seconds: expected int >= 3600, got 60",
    ),
    (
        f'algo = {{kind = "sft", {DATA}, batch_size = 0}}',
        "recipes.toml#sl_basic: algo.batch_size: expected int >= 1, got 0",
    ),
    (
        f'lr = "fast"\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: lr: expected float, got str 'fast'",
    ),
    (
        f'lr = -1e-3\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: lr: expected float > 0.0, got -0.001",
    ),
    (
        f'lr = [1e-3]\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: lr: expected float, got array [0.001]",
    ),
    (
        f'seed = 1.5\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: seed: expected int, got float 1.5",
    ),
    (
        f'seed = true\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: seed: expected int, got bool true",
    ),
    (
        f'max_steps = "ten"\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: max_steps: expected int, got str 'ten'",
    ),
    (
        f'tokenizer = 3\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: tokenizer: expected str, got int 3",
    ),
    (
        f'depth = 65\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: depth: expected int <= 64, got 65",
    ),
    (
        f'if_exists = "append"\nalgo = {{kind = "sft", {DATA}}}',
        "recipes.toml#sl_basic: if_exists: invalid choice 'append'; expected one of: error, overwrite, resume",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\noptim = {{beta1 = 1}}',
        "recipes.toml#sl_basic: optim.beta1: expected float < 1.0, got 1",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nschedule = {{kind = "cosine", final_frac = 1.5}}',
        "recipes.toml#sl_basic: schedule.final_frac: expected float <= 1.0, got 1.5",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nschedule = {{kind = "constant", final_frac = 0.1}}',
        "recipes.toml#sl_basic: schedule.final_frac: unknown key; it is a key of kinds cosine, linear, and this "
        "schedule is kind 'constant': to change the kind, give the table whole (schedule={kind = \"constant\", "
        "...}) (valid: kind, warmup_steps)",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nschedule = {{kind = "Cosine"}}',
        "recipes.toml#sl_basic: schedule.kind: invalid choice 'Cosine'; expected one of: constant, cosine, linear",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nlora = 8',
        "recipes.toml#sl_basic: lora: expected table, got int 8",
    ),
    (
        f'algo = {{kind = "sft", {DATA}}}\nlora = {{train_attn = false, train_mlp = false, train_unembed = false}}',
        "recipes.toml#sl_basic: lora: at least one of train_attn, train_mlp, train_unembed must be true",
    ),
    (
        'algo = {kind = "ppo"}',
        "recipes.toml#sl_basic: algo.kind: invalid choice 'ppo'; expected one of: custom, distill, dpo, generate, python, reward_model, rl, sft",
    ),
    (
        'model = "tiny"',
        'recipes.toml#sl_basic: algo: missing key; write e.g. algo = {kind = "distill"} (kind one of: custom, distill, dpo, generate, python, reward_model, rl, sft)',
    ),
    (
        'algo = {kind = "sft"}',
        ('recipes.toml#sl_basic: algo.data: missing key; write e.g. data = {kind = "jsonl"} '
        "(kind one of: file, hf, jsonl, python, run_output)"),
    ),
    (
        'algo = {kind = "sft", data = {path = "data.jsonl"}}',
        "recipes.toml#sl_basic: algo.data.kind: missing key; expected one of: file, hf, jsonl, python, run_output",
    ),
    (
        'algo = {kind = "sft", data = {kind = "jsonl"}}',
        "recipes.toml#sl_basic: algo.data.path: missing key; expected str",
    ),
    (
        'algo = {kind = "sft", data = {kind = "python", target = "mymodule.rows"}}',
        "recipes.toml#sl_basic: algo.data.target: expected 'pkg.mod:fn', got 'mymodule.rows'",
    ),
    (
        'algo = {kind = "sft", data = {kind = "hf", name = "x", split = 2}}',
        "recipes.toml#sl_basic: algo.data.split: expected str, got int 2",
    ),
    (
        f'algo = {{kind = "sft", {DATA}, train_on_what = "assistant"}}',
        ("recipes.toml#sl_basic: algo.train_on_what: invalid choice 'assistant'; "
        "expected one of: all_assistant_messages, all_messages, all_tokens, all_user_and_system_messages, customized, "
        "last_assistant_message, last_assistant_turn"),
    ),
    # numpy's generators take no negative seed: sl_basic and dpo_basic ran and crashed at the data shuffle.
    (f"seed = -3\nalgo = {{kind = \"sft\", {DATA}}}", "recipes.toml#sl_basic: seed: expected int >= 0, got -3"),
]


@pytest.mark.parametrize("body,expected", BAD_RECIPES, ids=[e.split(": ")[1] for _, e in BAD_RECIPES])
def test_bad_recipe_message(workdir: Path, body: str, expected: str) -> None:
    path = write(f"[recipes.sl_basic]\n{body}\n")
    assert error_of(load_recipe, f"{path}#sl_basic") == expected
    assert error_of(load_file, path) == expected


BAD_FILES = [
    ("[recipes.sl_basic]\nlr = 1e-3\nmodel = \n", "recipes.toml: TOML syntax error at line 3, column 9: invalid value"),
    (
        "[recipes.sl_basic]\nlr = 1\nlr = 2\n",
        "recipes.toml: TOML syntax error at line 3, column 7: cannot overwrite a value",
    ),
    ('[recipes.sl_basic]\nmodel = "tiny', "recipes.toml: TOML syntax error at end of file: unterminated string"),
    ('[sl_basic]\nmodel = "tiny"\n', "recipes.toml: no [recipes] table; write each recipe as [recipes.<name>]"),
    (
        f"{GOOD}\n[recipe.other]\nlr = 1.0\n",
        "recipes.toml: recipe: unknown top-level key; write each recipe as [recipes.<name>]",
    ),
    ("recipes = 3\n", "recipes.toml: recipes: expected a table of [recipes.<name>] tables, got int 3"),
    ("[recipes]\n", "recipes.toml: [recipes] is empty; write each recipe as [recipes.<name>]"),
    ("[recipes]\nsl_basic = 3\n", "recipes.toml#sl_basic: expected a table [recipes.sl_basic], got int 3"),
    (
        '[recipes."my recipe"]\nmodel = "tiny"\n',
        "recipes.toml: recipe name 'my recipe': use only letters, digits, '_' and '-'",
    ),
]


@pytest.mark.parametrize("text,expected", BAD_FILES, ids=[e.split(": ", 1)[1][:30] for _, e in BAD_FILES])
def test_bad_file_message(workdir: Path, text: str, expected: str) -> None:
    assert error_of(load_file, write(text)) == expected


def test_file_and_reference_messages(workdir: Path) -> None:
    write(GOOD + '\n[recipes.rl_basic]\nalgo = {kind = "sft", data = {kind = "jsonl", path = "data.jsonl"}}\n')
    assert error_of(load_recipe, "recipes.toml#sl_basci") == (
        "recipes.toml: no recipe named 'sl_basci' (did you mean recipes.toml#sl_basic?); available: rl_basic, sl_basic"
    )
    assert error_of(load_recipe, "recipes.toml") == (
        "recipes.toml: pick a recipe as recipes.toml#NAME; available: rl_basic, sl_basic"
    )
    assert error_of(load_recipe, "nope.toml#sl_basic") == "nope.toml: file not found"
    assert error_of(load_recipe, ".#sl_basic") == ".: not a file"
    for ref in ("recipes.toml#", "#sl_basic", "recipes.toml#a b"):
        assert error_of(load_recipe, ref) == (
            f"bad recipe reference {ref!r}: expected FILE#NAME, e.g. recipes.toml#sl_basic"
        )
    Path("latin1.toml").write_bytes(b'[recipes.x]\nmodel = "\xe9"\n')
    assert error_of(load_file, "latin1.toml") == "latin1.toml: not UTF-8 text"


class Source(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind", tag=str.lower):
    pass


class Gauss(Source):
    sigma: Annotated[float, msgspec.Meta(gt=0)] = 1.0


class Coin(Source):
    p: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5


class Noise(msgspec.Struct, forbid_unknown_fields=True):
    """A schema the recipe does not have: the messages must not depend on Recipe's fields."""

    source: Gauss | Coin
    per_env: dict[str, Annotated[float, msgspec.Meta(ge=0)]] = {}
    sizes: list[Annotated[int, msgspec.Meta(ge=1)]] = []


@pytest.mark.parametrize(
    "raw,expected",
    [
        ({"source": {"kind": "gaus"}}, "n: source.kind: invalid choice 'gaus'; expected one of: coin, gauss"),
        ({"source": {"kind": "coin", "sigma": 1.0}}, ("n: source.sigma: unknown key; it is a key of kind gauss, and this source is kind 'coin': to change "
                                                          "the kind, give the table whole (source={kind = \"coin\", ...}) (valid: kind, p)")),
        ({"source": {"kind": "gauss", "sigmaa": 1.0}}, ("n: source.sigmaa: unknown key; did you mean `sigma`? "
         "(valid: kind, sigma)")),
        ({"source": {"kind": "coin", "p": 2}}, "n: source.p: expected float <= 1.0, got 2"),
        ({}, 'n: source: missing key; write e.g. source = {kind = "gauss"} (kind one of: coin, gauss)'),
        # msgspec reports a bad dict value as `[...]`: the message names the key.
        ({"source": {"kind": "coin"}, "per_env": {"a": 1.0, "b c": -2.0}},
         'n: per_env."b c": expected float >= 0.0, got -2.0'),
        ({"source": {"kind": "coin"}, "sizes": [1, 0]}, "n: sizes[1]: expected int >= 1, got 0"),
    ],
)
def test_messages_are_generic_over_struct_types(raw: dict[str, Any], expected: str) -> None:
    assert error_of(convert, raw, Noise, "n") == expected


# ---------------------------------------------------------------- good recipes and defaults

def test_minimal_recipe_takes_defaults(workdir: Path) -> None:
    name, recipe = load_recipe(f"{write(GOOD)}#sl_basic")
    assert name == "sl_basic"
    assert recipe == Recipe(algo=SFT(data=Jsonl(path="data.jsonl")), lr=2e-3)
    assert recipe.backend == Local() and recipe.schedule == Linear() and recipe.model == "tiny"
    # A file with one recipe needs no #name.
    assert load_recipe("recipes.toml") == (name, recipe)
    assert load_file("recipes.toml") == {"sl_basic": recipe}


def test_ints_are_accepted_for_floats(workdir: Path) -> None:
    _, recipe = load_recipe(f"{write(GOOD)}#sl_basic", ["lr=1"])
    assert recipe.lr == 1.0 and isinstance(recipe.lr, float)


# ---------------------------------------------------------------- overrides

def test_override_values_are_toml_literals() -> None:
    assert parse_override("lr=3e-4") == (["lr"], 3e-4)
    assert parse_override("lora.rank=8") == (["lora", "rank"], 8)
    assert parse_override("lora.train_mlp=false") == (["lora", "train_mlp"], False)
    assert parse_override('backend={kind="tinker"}') == (["backend"], {"kind": "tinker"})
    assert parse_override('algo.data.path="x.jsonl"') == (["algo", "data", "path"], "x.jsonl")
    # Not a TOML literal: the plain text.
    assert parse_override("backend.kind=tinker") == (["backend", "kind"], "tinker")
    assert parse_override("model=Qwen/Qwen3-8B") == (["model"], "Qwen/Qwen3-8B")
    assert parse_override("log_dir=") == (["log_dir"], "")
    # Two TOML lines are not one literal.
    assert parse_override("model=1\nlr = 2") == (["model"], "1\nlr = 2")


def test_overrides_apply_with_types_and_nesting(workdir: Path) -> None:
    ref = f"{write(GOOD)}#sl_basic"
    _, recipe = load_recipe(ref, ["lr=3e-4", "lora.rank=8", "algo.batch_size=4", "schedule.warmup_steps=5"])
    assert recipe.lr == 3e-4 and recipe.lora.rank == 8 and recipe.algo.batch_size == 4
    # A table the recipe did not write starts from the field's default: still linear, warmup changed.
    assert recipe.schedule == Linear(warmup_steps=5)
    # Later overrides win; a table value replaces the whole table.
    _, recipe = load_recipe(ref, ["lr=1e-3", "lr=2e-3", 'schedule={kind="cosine", final_frac=0.1}'])
    assert recipe.lr == 2e-3 and recipe.schedule == Cosine(final_frac=0.1)
    # A str-only field keeps the text even when it parses as a number or bool.
    _, recipe = load_recipe(ref, ["model=1e3", "tokenizer=true"])
    assert (recipe.model, recipe.tokenizer) == ("1e3", "true")


def test_override_switches_variant(workdir: Path) -> None:
    ref = f"{write(GOOD)}#sl_basic"
    assert load_recipe(ref, ['backend={kind="tinker"}'])[1].backend == Tinker()
    assert load_recipe(ref, ["backend.kind=tinker", "backend.ttl_seconds=7200"])[1].backend == Tinker(ttl_seconds=7200)
    _, recipe = load_recipe(ref, ['algo.data={kind="python", target="json:loads", args={s="[]"}}'])
    assert recipe.algo.data == Python(target="json:loads", args={"s": "[]"})


def test_override_errors_match_file_errors(workdir: Path) -> None:
    ref = f"{write(GOOD)}#sl_basic"
    assert error_of(load_recipe, ref, ["lora.rnak=8"]) == (
        "recipes.toml#sl_basic: lora.rnak: unknown key; did you mean `rank`? "
        "(valid: rank, train_attn, train_mlp, train_unembed)"
    )
    assert error_of(load_recipe, ref, ["lr=fast"]) == "recipes.toml#sl_basic: lr: expected float, got str 'fast'"
    assert error_of(load_recipe, ref, ["algo.batch_size=0"]) == (
        "recipes.toml#sl_basic: algo.batch_size: expected int >= 1, got 0"
    )
    assert error_of(load_recipe, ref, ["backend.kind=tinkr"]) == (
        "recipes.toml#sl_basic: backend.kind: invalid choice 'tinkr'; expected one of: local, python, tinker"
    )
    # Switching the tag keeps the other keys, which the new variant may not have: the error says whose they are.
    assert error_of(load_recipe, ref, ["backend.device=cpu", "backend.kind=tinker"]) == (
        "recipes.toml#sl_basic: backend.device: unknown key; it is a key of kind local, and this backend is kind "
        "'tinker': to change the kind, give the table whole (backend={kind = \"tinker\", ...}) "
        "(valid: base_url, connect_timeout_s, kind, lost_after_s, ttl_seconds)"
    )
    assert error_of(load_recipe, ref, ["lr.x=1"]) == (
        "recipes.toml#sl_basic: lr: is float 0.002, not a table, so 'lr.x=1' cannot set it"
    )
    for bad in ("lr", "=3", "lora..rank=8", "lora rank=8"):
        assert error_of(load_recipe, ref, [bad]) == (
            f"bad override {bad!r}: expected KEY=VALUE, e.g. lr=3e-4 or lora.rank=8"
        )


def test_overrides_do_not_touch_the_file_table(workdir: Path) -> None:
    ref = f"{write(GOOD)}#sl_basic"
    load_recipe(ref, ["lora.rank=8", "algo.data.path=other.jsonl"])
    assert load_recipe(ref)[1] == Recipe(algo=SFT(data=Jsonl(path="data.jsonl")), lr=2e-3)


# ---------------------------------------------------------------- round trip

OVERRIDE_SETS = [
    [],
    ["lr=3e-4", "lora.rank=8", "max_steps=7", "log_dir=runs/x"],
    ['backend={kind="tinker", base_url="http://localhost:8000"}', "model=Qwen/Qwen3-8B", "tokenizer=tok"],
    ['schedule={kind="cosine", warmup_steps=3, final_frac=0.25}', "optim.eps=1e-8", "optim.grad_clip_norm=1.0"],
    ['algo.data={kind="hf", name="org/set", subset="main"}', "seed=0", "depth=0"],
    ['algo.data={kind="python", target="json:loads", args={s="[]", n=[1, 2.5], t={u=true}}}'],
]


@pytest.mark.parametrize("overrides", OVERRIDE_SETS)
@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_show_round_trips(path: Path, overrides: list[str], tmp_path: Path) -> None:
    for name, shipped in load_file(str(path)).items():
        if not isinstance(shipped.algo, SFT) and any(o.startswith("algo.data") for o in overrides):
            continue  # only SFT reads a data source
        _, recipe = load_recipe(f"{path}#{name}", overrides)
        shown = tmp_path / "shown.toml"
        shown.write_text(dump_recipe(name, recipe))
        assert load_recipe(f"{shown}#{name}") == (name, recipe)
        # Every field is written, defaults included (None fields have no TOML form, and are the default).
        assert set(load_file(str(shown))) == {name}
        assert set(recipe_dict(recipe)) == {f for f in Recipe.__struct_fields__ if getattr(recipe, f) is not None}


def _optional_fields(t: Any, seen: set[type], out: list[str]) -> None:
    if isinstance(t, mi.Metadata):
        return _optional_fields(t.type, seen, out)
    if isinstance(t, mi.UnionType | mi.ListType | mi.DictType):
        for sub in getattr(t, "types", ()) or (getattr(t, "item_type", None), getattr(t, "value_type", None)):
            if sub is not None:
                _optional_fields(sub, seen, out)
    if isinstance(t, mi.StructType) and t.cls not in seen:
        seen.add(t.cls)
        for f in t.fields:
            nullable = isinstance(f.type, mi.UnionType) and any(isinstance(m, mi.NoneType) for m in f.type.types)
            if nullable and f.default is not None:
                out.append(f"{t.cls.__name__}.{f.name}")
            _optional_fields(f.type, seen, out)


def test_every_optional_field_defaults_to_none() -> None:
    # TOML has no null: `show` leaves None out, which reads back as the default, so it must BE the default.
    bad: list[str] = []
    _optional_fields(mi.type_info(Recipe), set(), bad)
    assert bad == []


# ---------------------------------------------------------------- check: data files and Python targets

@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """import_target puts the working directory on sys.path and imports user modules: undo both."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_user_module_next_to_the_recipe_imports_from_elsewhere(tmp_path: Path, monkeypatch, isolated_imports) -> None:
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    proj.mkdir()
    elsewhere.mkdir()
    (proj / "next_to_recipe_rows.py").write_text("def rows():\n    return []\n")
    (proj / "r.toml").write_text(
        '[recipes.x.algo]\nkind = "sft"\ndata = {kind = "python", target = "next_to_recipe_rows:rows"}\n'
    )
    monkeypatch.chdir(elsewhere)
    check_recipe(load_recipe(str(proj / "r.toml"))[1], "r.toml#x")  # raises if it does not import


def test_relative_data_path_falls_back_to_the_recipe_files_folder(tmp_path: Path, monkeypatch) -> None:
    """`runner run ~/proj/recipes.toml#x` from another folder finds the data next to the recipe (and records
    its absolute path); a path that exists relative to the working directory wins."""
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (proj / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (proj / "data" / "rows.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (proj / "r.toml").write_text('[recipes.x.algo]\nkind = "sft"\ndata = {kind = "jsonl", path = "data/rows.jsonl"}\n')
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(str(proj / "r.toml"))[1]
    assert isinstance(recipe.algo, SFT) and isinstance(recipe.algo.data, Jsonl)
    assert recipe.algo.data.path == str((proj / "data" / "rows.jsonl").resolve())
    check_recipe(recipe, "r.toml#x")
    monkeypatch.chdir(proj)
    recipe = load_recipe("r.toml")[1]
    assert isinstance(recipe.algo, SFT) and isinstance(recipe.algo.data, Jsonl)
    assert recipe.algo.data.path == "data/rows.jsonl"  # found where it says: left as written
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "rows.jsonl").write_text("")
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(str(proj / "r.toml"))[1]
    assert isinstance(recipe.algo, SFT) and isinstance(recipe.algo.data, Jsonl)
    assert recipe.algo.data.path == "data/rows.jsonl"  # the working directory's copy wins


def test_path_args_of_user_code_fall_back_to_the_recipe_files_folder(tmp_path: Path, monkeypatch) -> None:
    """A python data source's `args = {path = ...}` (the shipped RLHF and distillation recipes pass their files this
    way) is found next to the recipe from another folder too; other args are left alone."""
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (proj / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (proj / "data" / "chats.jsonl").write_text("")
    (proj / "r.toml").write_text('[recipes.x.algo]\nkind = "sft"\ndata = {kind = "python", target = "m:rows", args = '
                                 '{path = "data/chats.jsonl", name = "data/chats.jsonl", out_dir = "data/none"}}\n')
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(str(proj / "r.toml"))[1]
    assert isinstance(recipe.algo, SFT)
    args = recipe.algo.data.args  # pyright: ignore[reportAttributeAccessIssue]
    assert args == {"path": str((proj / "data" / "chats.jsonl").resolve()), "name": "data/chats.jsonl",
                    "out_dir": "data/none"}

def test_check_recipe_data_and_targets(workdir: Path, isolated_imports: None) -> None:
    ref = f"{write(GOOD)}#sl_basic"
    check_recipe(load_recipe(ref)[1], "recipes.toml#sl_basic")
    missing = load_recipe(ref, ["algo.data.path=examples/data/nope.jsonl"])[1]
    assert error_of(check_recipe, missing, "recipes.toml#sl_basic") == (
        f"recipes.toml#sl_basic: algo.data.path: data file not found: examples/data/nope.jsonl (looked in "
        f"{workdir} and next to the recipe file)"
    )
    (workdir / "user_rows.py").write_text("ROWS = []\ndef rows():\n    return ROWS\n")
    (workdir / "broken_rows.py").write_text("import not_a_module_anywhere\n")
    python = 'algo.data={kind="python", target="%s"}'
    check_recipe(load_recipe(ref, [python % "user_rows:rows"])[1], "w")  # the working directory is importable
    cases = {
        "user_rows:nope": "w: algo.data.target: cannot import 'user_rows:nope': "
        "AttributeError: module 'user_rows' has no attribute 'nope'",
        "user_rows:ROWS": "w: algo.data.target: 'user_rows:ROWS' is list, not a callable",
        "broken_rows:rows": "w: algo.data.target: cannot import 'broken_rows:rows': "
        "ModuleNotFoundError: No module named 'not_a_module_anywhere'",
    }
    for target, expected in cases.items():
        assert error_of(check_recipe, load_recipe(ref, [python % target])[1], "w") == expected


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_recipes_check(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # data paths are relative to the repository root
    recipes = load_file(str(path.relative_to(REPO)))
    assert recipes
    for name, recipe in recipes.items():
        check_recipe(recipe, f"{path.name}#{name}")


# ---------------------------------------------------------------- RL: bad recipes, exact messages

RL_GOOD = """\
[recipes.arith]
lr = 3e-3
algo = {kind = "rl", env = {kind = "arithmetic", max_value = 20}, group_size = 4}
"""

RL_ERRORS = [
    (["algo.loss.kind=ppx"], "algo.loss.kind: invalid choice 'ppx'; expected one of: cispo, dro, importance_sampling, ppo, python"),
    (["algo.group_size=1"], "algo.group_size: expected int >= 2, got 1"),
    (['algo.kl={kind="reference"}'], "algo.kl.coef: missing key; expected float > 0"),
    (['algo.env={kind="tictactoe"}', "algo.group_size=3"],
     "algo: tictactoe self-play needs an even group_size (two seats per game)"),
    (['algo.env={kind="python", target="nocolon"}'], "algo.env.target: expected 'pkg.mod:fn', got 'nocolon'"),
    (["algo.mode.kind=async", "algo.mode.max_stalenes=2"],
     "algo.mode.max_stalenes: unknown key; did you mean `max_staleness`? (valid: fixed_staleness, kind, max_staleness)"),
    (["algo.mode.kind=async", "depth=0"],
     "algo.mode async samples while the previous step trains: it needs depth >= 1"),
    (['algo.mode={kind="stream", minibatches=3}'],
     "algo: stream mode: groups_per_batch must split evenly into num_substeps × minibatches"),
    (['algo.loss={kind="ppo", clip_low=1.5}'], "algo.loss: clip_low must be < clip_high"),
    (["algo.env.kind=chess"],
     ("algo.env.kind: invalid choice 'chess'; expected one of: arithmetic, code, guess_number, math, preference, "
     "python, reasoning_gym, rubric, tictactoe, tool_use, twenty_questions, verifiers")),
]


@pytest.mark.parametrize("overrides,expected", RL_ERRORS, ids=[e[1].split(":")[0] + str(i) for i, e in
                                                                enumerate(RL_ERRORS)])
def test_rl_bad_recipe_message(workdir: Path, overrides: list[str], expected: str) -> None:
    ref = f"{write(RL_GOOD)}#arith"
    assert error_of(load_recipe, ref, overrides) == f"recipes.toml#arith: {expected}"


def test_rl_recipe_round_trips_and_checks_targets(workdir: Path, isolated_imports: None) -> None:
    ref = f"{write(RL_GOOD)}#arith"
    over = ['algo.kl={kind="reference", coef=0.05}', 'algo.mode={kind="async", max_staleness=2}',
            'algo.loss={kind="cispo", clip_high=3.0}', "algo.eval.max_groups=4"]
    name, recipe = load_recipe(ref, over)
    Path("shown.toml").write_text(dump_recipe(name, recipe))
    assert load_recipe("shown.toml#arith") == (name, recipe)
    # User envs and preference judges are imported by check, like any other target.
    (workdir / "my_env.py").write_text("def build(**args):\n    return lambda ctx: (None, None)\n")
    check_recipe(load_recipe(ref, ['algo.env={kind="python", target="my_env:build"}'])[1], "w")
    assert error_of(check_recipe, load_recipe(ref, ['algo.env={kind="python", target="my_env:nope"}'])[1], "w") == (
        "w: algo.env.target: cannot import 'my_env:nope': AttributeError: module 'my_env' has no attribute 'nope'"
    )
    judge = 'algo.env={kind="preference", judge="my_env:missing"}'
    assert error_of(check_recipe, load_recipe(ref, [judge])[1], "w").startswith("w: algo.env.judge: cannot import")


def test_check_binds_target_args(workdir: Path, isolated_imports: None) -> None:
    """`runner check` catches args that the python env builder or data function cannot take, without calling it."""
    ref = f"{write(RL_GOOD)}#arith"
    (workdir / "my_env2.py").write_text(
        "CALLS = []\n"
        "def build(n_problems, offset=0):\n    CALLS.append(1)\n    return lambda ctx: (None, None)\n"
        "def anything(**kw):\n    CALLS.append(1)\n"
    )
    env = 'algo.env={kind="python", target="my_env2:%s", args=%s}'
    check_recipe(load_recipe(ref, [env % ("build", "{n_problems=3}")])[1], "w")
    check_recipe(load_recipe(ref, [env % ("anything", "{x=1, y=2}")])[1], "w")
    assert error_of(check_recipe, load_recipe(ref, [env % ("build", "{n_problems=3, bogus=1}")])[1], "w") == (
        "w: algo.env.args: 'my_env2:build' cannot be called with args ['bogus', 'n_problems']: "
        "got an unexpected keyword argument 'bogus'"
    )
    assert error_of(check_recipe, load_recipe(ref, [env % ("build", "{offset=1}")])[1], "w") == (
        "w: algo.env.args: 'my_env2:build' cannot be called with args ['offset']: "
        "missing a required argument: 'n_problems'"
    )
    sft = f"{write(GOOD)}#sl_basic"
    data = 'algo.data={kind="python", target="my_env2:build", args={n=1}}'
    assert error_of(check_recipe, load_recipe(sft, [data])[1], "w").startswith(
        "w: algo.data.args: 'my_env2:build' cannot be called with args ['n']: "
    )
    assert sys.modules["my_env2"].CALLS == []  # checked, never called


CONCURRENT_LOADS = """
import sys, threading
from runner.recipe.load import load_recipe
barrier = threading.Barrier(32)
def load():
    barrier.wait()
    load_recipe(sys.argv[1])
threads = [threading.Thread(target=load) for _ in range(32)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("loaded")
"""


def test_recipes_load_on_many_threads_at_once() -> None:
    """`runner serve` loads run dirs' recipes on its request threads. msgspec builds a type's decoding info on first
    use and a second thread could read it half-built: a segfault (3 fresh processes in 4, 32 threads loading one
    recipe), which took the server down. Each try is a fresh process, so the first use is under the threads."""
    import subprocess

    ref = str(Path(__file__).resolve().parents[1] / "recipes.toml") + "#rl_basic"
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", CONCURRENT_LOADS, ref], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "loaded", (out.returncode, out.stderr[-500:])


def test_a_seed_past_64_bits_is_refused_at_check(workdir: Path) -> None:
    """torch seeds are signed 64-bit: seed = 2**63 passed check and the run failed at its first client with
    "Overflow when unpacking long long". The largest seed, 2**63 - 1, is accepted (the local backend's derived
    seeds wrap: tests/test_local_backend.py)."""
    path = write(f"[recipes.sl_basic]\nseed = {2**63}\nalgo = {{kind = \"sft\", {DATA}}}\n")
    assert error_of(load_recipe, f"{path}#sl_basic") == f"recipes.toml#sl_basic: seed: expected int <= {2**63 - 1}, got {2**63}"
    path = write(f"[recipes.sl_basic]\nseed = {2**63 - 1}\nalgo = {{kind = \"sft\", {DATA}}}\n")
    assert load_recipe(f"{path}#sl_basic")[1].seed == 2**63 - 1
