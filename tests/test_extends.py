"""Recipe reuse: `extends` and `[defaults]` (runner/recipe/compose.py), `runner show --explain`.

    pytest tests/test_extends.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.errors import UserError
from runner.cli import main
from runner.recipe.compose import deep_merge
from runner.recipe.load import decode_recipe, load_recipe, read_tables

REPO = Path(__file__).resolve().parent.parent
DATA = 'algo = {kind = "sft", data = {kind = "jsonl", path = "data.jsonl"}, batch_size = 4, max_length = 64}'


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return tmp_path


def write(text: str, name: str = "r.toml") -> str:
    Path(name).write_text(text)
    return name


def error_of(ref: str) -> str:
    with pytest.raises(UserError) as info:
        load_recipe(ref)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_merge_rules() -> None:
    base = {"a": {"x": 1, "y": [1, 2]}, "b": 1, "t": {"kind": "local", "device": "cpu"}}
    over = {"a": {"y": [3]}, "b": {"k": 1}, "t": {"kind": "tinker"}}
    assert deep_merge(base, over) == {
        "a": {"x": 1, "y": [3]},  # a table merges, a list replaces
        "b": {"k": 1},  # a scalar under a table: replaced
        "t": {"kind": "tinker"},  # another variant replaces the whole table
    }
    assert base["a"] == {"x": 1, "y": [1, 2]}  # inputs untouched
    assert deep_merge(base, {"t": {"device": "cuda"}})["t"] == {"kind": "local", "device": "cuda"}


def test_extends_chain_and_defaults(workdir: Path) -> None:
    write(f"""
[defaults]
model = "tiny"
lr = 1e-3
lora = {{rank = 4, train_mlp = false}}

[recipes.a]
{DATA}
max_steps = 3

[recipes.b]
extends = "a"
lr = 2e-3
algo = {{batch_size = 8}}

[recipes.c]
extends = "b"
lora = {{rank = 16}}
""")
    _, c = load_recipe("r.toml#c")
    assert c.model == "tiny" and c.lr == 2e-3 and c.max_steps == 3
    assert c.algo.batch_size == 8 and c.algo.max_length == 64  # type: ignore[union-attr]
    assert c.lora.rank == 16 and c.lora.train_mlp is False  # defaults table merged under the chain
    _, a = load_recipe("r.toml#a")
    assert a.lr == 1e-3 and a.lora.rank == 4
    # Overrides still win over everything.
    _, b = load_recipe("r.toml#b", ["lr=5e-4", "algo.batch_size=2"])
    assert b.lr == 5e-4 and b.algo.batch_size == 2  # type: ignore[union-attr]


def test_cycles_and_bad_bases_are_one_line_errors(workdir: Path) -> None:
    write(f"""
[recipes.a]
extends = "c"
{DATA}
[recipes.b]
extends = "a"
[recipes.c]
extends = "b"
[recipes.self]
extends = "self"
[recipes.missing]
extends = "nope"
[recipes.nofile]
extends = "other.toml#a"
[recipes.notstr]
extends = 3
""")
    assert error_of("r.toml#b") == "r.toml#b: extends makes a cycle: r.toml#b -> r.toml#a -> r.toml#c -> r.toml#b"
    assert error_of("r.toml#self") == "r.toml#self: extends makes a cycle: r.toml#self -> r.toml#self"
    assert error_of("r.toml#missing") == ("r.toml#missing: extends 'nope': no recipe named 'nope' in r.toml; "
                                          "available: a, b, c, missing, nofile, notstr, self")
    assert error_of("r.toml#nofile") == "r.toml#nofile: extends 'other.toml#a': file not found: other.toml"
    assert error_of("r.toml#notstr") == "r.toml#notstr: extends: expected a recipe name or 'FILE#name', got 3"


def test_defaults_table_rules(workdir: Path) -> None:
    write(f'[defaults]\nextends = "a"\n[recipes.a]\n{DATA}\n')
    assert error_of("r.toml#a") == "r.toml: defaults.extends: not allowed in [defaults]; set it on a recipe"
    write(f'defaults = 3\n[recipes.a]\n{DATA}\n')
    assert error_of("r.toml#a") == "r.toml: defaults: expected a table [defaults], got int 3"
    write(f'[defaults]\nbatch = 3\n[recipes.a]\n{DATA}\n')  # a bad key in [defaults] is reported per recipe
    assert error_of("r.toml#a").startswith("r.toml#a: batch: unknown key")


def test_extends_another_file_and_its_sweep_is_not_inherited(workdir: Path) -> None:
    Path("lib").mkdir()
    write(f'[defaults]\nseed = 7\n[recipes.base]\n{DATA}\nlr = 1e-4\nsweep = {{lr = [1e-4, 2e-4]}}\n',
          "lib/base.toml")
    write('[defaults]\nmax_steps = 9\nseed = 1\n[recipes.v]\nextends = "lib/base.toml#base"\nlr = 3e-4\n')
    tables = read_tables("r.toml")
    assert "sweep" not in tables["v"] and "sweep" in read_tables("lib/base.toml")["base"]
    _, v = load_recipe("r.toml#v")
    # This file's [defaults] sit under the base's chain (whose own [defaults] set seed 7).
    assert (v.lr, v.max_steps, v.seed) == (3e-4, 9, 7)


def test_show_explain_names_each_source(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(f'[defaults]\nmodel = "tiny"\n[recipes.a]\n{DATA}\n[recipes.b]\nextends = "a"\nlr = 2e-3\n')
    assert main(["show", "r.toml#b", "--explain", "lora.rank=4"]) == 0
    lines = {line.split(" = ")[0]: line.rsplit("# ", 1)[1] for line in capsys.readouterr().out.splitlines()}
    assert lines["model"] == "[defaults] of r.toml"
    assert lines["algo.batch_size"] == "r.toml#a (extends)"
    assert lines["algo.epochs"] == "default"  # inside a table a base set, a key it did not set
    assert lines["lr"] == "r.toml#b"
    assert lines["lora.rank"] == "override lora.rank=4"
    assert lines["seed"] == "default"


def test_cycle_exits_2_from_the_cli(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write('[recipes.a]\nextends = "b"\n[recipes.b]\nextends = "a"\n')
    assert main(["check", "r.toml"]) == 2
    err = capsys.readouterr().err
    assert "extends makes a cycle: r.toml#a -> r.toml#b -> r.toml#a" in err and "Traceback" not in err


def test_show_prints_no_empty_tables(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(f"[recipes.a]\n{DATA}\n")
    assert main(["show", "r.toml#a"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("[")]
    body = out.split("\n[")
    assert all(chunk.strip().count("\n") >= 1 for chunk in body), out  # every table has a key under it
    assert "[recipes.a.log]" not in headers
    write(out, "shown.toml")
    assert load_recipe("shown.toml#a")[1] == load_recipe("r.toml#a")[1]


def test_cookbook_resolves_to_what_it_did_before_extends() -> None:
    """examples/cookbook.toml uses [defaults] and extends; each recipe is still the one it was as a flat copy."""
    now, before = read_tables(str(REPO / "examples/cookbook.toml")), read_tables(str(REPO / "tests/data/cookbook_flat.toml"))
    assert [n for n in now if n in before] == list(before)  # recipes added since (e.g. shorter) have no flat copy
    for name in before:
        assert decode_recipe(now[name], name) == decode_recipe(before[name], name), name
    text = (REPO / "examples/cookbook.toml").read_text()
    assert "[defaults]" in text and text.count("extends = ") >= 3


def test_a_long_chain_resolves_and_one_too_long_is_one_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A chain of 999 bases (1,000 recipes: MAX_EXTENDS) loads; one more is one line, exit 2 (both were a
    RecursionError traceback from 990 on)."""
    from runner.recipe.compose import MAX_EXTENDS

    def chain(n: int) -> str:
        return f"[recipes.r0]\n{DATA}\n" + "".join(f'[recipes.r{i}]\nextends = "r{i - 1}"\nseed = {i}\n'
                                                   for i in range(1, n))
    write(chain(MAX_EXTENDS))
    _, top = load_recipe(f"r.toml#r{MAX_EXTENDS - 1}")
    assert top.seed == MAX_EXTENDS - 1 and top.algo.batch_size == 4  # type: ignore[union-attr]
    write(chain(MAX_EXTENDS + 1))
    assert error_of(f"r.toml#r{MAX_EXTENDS}").startswith(
        f"r.toml#r{MAX_EXTENDS}: extends chain longer than {MAX_EXTENDS} recipes")
    assert main(["show", f"r.toml#r{MAX_EXTENDS}", "--explain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_whole_chain_resolves_in_linear_time(workdir: Path) -> None:
    """read_tables of a 600-recipe chain merges each recipe once over its base (it took seconds per hundred,
    cubic, before): counted in deep_merge calls, which a quadratic walk would multiply."""
    import runner.recipe.compose as compose

    write(f"[recipes.r0]\n{DATA}\n" + "".join(f'[recipes.r{i}]\nextends = "r{i - 1}"\nseed = {i}\n'
                                              for i in range(1, 600)))
    calls = 0
    real = compose.deep_merge

    def counting(base: dict, over: dict) -> dict:  # type: ignore[type-arg]
        nonlocal calls
        calls += 1
        return real(base, over)

    compose.deep_merge = counting  # type: ignore[assignment]
    try:
        tables = read_tables("r.toml")
    finally:
        compose.deep_merge = real  # type: ignore[assignment]
    assert tables["r599"]["seed"] == 599 and tables["r599"]["algo"]["batch_size"] == 4
    assert calls < 2 * 600, calls  # a fresh merge of each chain: 180,000


@pytest.mark.parametrize("text", [
    "[recipes.a]\nx = " + "[" * 50_000 + "]" * 50_000 + "\n",  # deep arrays: tomllib recurses on them
    "[recipes.a]\nx = " + "{a = " * 5_000 + "1" + "}" * 5_000 + "\n",  # deep inline tables: the same
    "[recipes.a." + ".".join(["t"] * 5_000) + "]\nx = 1\n",  # a deep table header: parsed, then walked
    "[recipes.a]\nargs = " + "[" * 70 + "]" * 70 + "\n",  # just past the bound
])
def test_deep_nesting_is_one_line(workdir: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    write(text)
    message = error_of("r.toml#a")
    assert message.startswith("r.toml: arrays or tables nested") and "more than 64" in message
    assert main(["check", "r.toml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_deep_override_is_one_line(workdir: Path) -> None:
    write(f"[recipes.a]\n{DATA}\n")
    with pytest.raises(UserError, match=r"^override args=\.\.\.: arrays or tables nested"):
        load_recipe("r.toml#a", ["args=" + "[" * 50_000 + "]" * 50_000])
    with pytest.raises(UserError, match=r"^override lr=\.\.\.: 1,000,001 characters, more than 1,000,000"):
        load_recipe("r.toml#a", ["lr=" + "1" * 1_000_001])


def test_show_explain_names_files_normalised(workdir: Path, tmp_path_factory: pytest.TempPathFactory,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A base reached through `../` is named by its path from the working directory ('base.toml', not
    'a/b/../../base.toml'); one outside it by its absolute path."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "far.toml").write_text("[defaults]\nseed = 3\n[recipes.far]\nlr = 1e-3\n")
    write(f'[defaults]\nmodel = "tiny"\n[recipes.b]\n{DATA}\nextends = "{outside}/far.toml#far"\n', "base.toml")
    Path("a/b").mkdir(parents=True)
    write('[recipes.v]\nextends = "../../base.toml#b"\nmax_steps = 2\n', "a/b/r.toml")
    assert main(["show", "a/b/r.toml#v", "--explain"]) == 0
    lines = {line.split(" = ")[0]: line.rsplit("# ", 1)[1] for line in capsys.readouterr().out.splitlines()}
    assert lines["model"] == "[defaults] of base.toml"
    assert lines["algo.batch_size"] == "base.toml#b (extends)"
    assert lines["lr"] == f"{outside.resolve()}/far.toml#far (extends)"
    assert lines["seed"] == f"[defaults] of {outside.resolve()}/far.toml"
    assert lines["max_steps"] == "a/b/r.toml#v"
