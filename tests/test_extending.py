"""One of each extension kind, both ways docs/extending.md gives.

Your own code from a temporary package, spelled one way for every kind (`kind = "python", target = "pkg.mod:NAME"`):
a renderer, an RL env, a loss, a pinned eval, a backend, a data source for SFT and an algorithm; `runner check` accepts
them all, and short local runs use every one of them.

A built-in of each kind (algorithm, env, pinned eval, loss, renderer, backend) added to a copy of the repo as new files
in one folder each: every existing file hashes the same afterwards (0 edits), the new files are exactly the ones added,
and `runner check` and `runner run` use them all."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import msgspec
import pytest

from backends import losses
from backends.backend_config import BackendConfig
from backends.configs import implementation_of, variants
from backends.tokenizer import load_tokenizer
from runner.algos.rl_config import Loss
from runner.cli import main
from runner.engine.evals import EvalKind, kind_of
from runner.engine.log import read_jsonl
from runner.engine.math_eval_config import MathPinned
from runner.engine.spec import AlgoSpec
from runner.recipe.envs import ENV_VARIANTS
from runner.recipe.load import load_recipe
from runner.recipe.pinned import PINNED_VARIANTS
from runner.recipe.python_backend import PythonBackend
from runner.recipe.schema import ALGO_VARIANTS, BACKEND_VARIANTS, Backend
from runner.recipe.sources import Jsonl
from runner.rl.envs.common import EnvKind

ROOT = Path(__file__).resolve().parent.parent

PARTS = '''
from backends import losses
from runner.renderers.role_colon import RoleColonRenderer
from runner.rl.envs.arithmetic import ArithmeticEnv
from runner.rl.envs.common import ListDataset, RepeatGroupBuilder

BUILT = []


class Plain(RoleColonRenderer):
    """A renderer of my own: role_colon's format, counting how often it is built."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        BUILT.append(type(self).__name__)


def make_env(top=9):
    def builder(ctx):
        group = lambda i: RepeatGroupBuilder(lambda: ArithmeticEnv(ctx.renderer, i % top, 1), ctx.group_size, ["mine"])
        return ListDataset(range(8), group, ctx.groups_per_batch), ListDataset(range(2), group, 2, drop_last=False)
    return builder


LOSS_CALLS = []


def _pg(lp, inp, cfg):
    LOSS_CALLS.append(cfg["coef"])
    return -cfg["coef"] * lp * inp.advantages


PG = losses.register(losses.LossSpec("myext_pg", _pg, inputs=("advantages",),
                                     fields=(losses.LossField("coef", "coef", 1.0, gt=0.0),)))

EVALS = []


def tokens_of_hi(sampler, tokenizer, word="hi"):
    EVALS.append(word)
    return {"tokens": len(tokenizer.encode(word))}


MADE = []


def fake_backend(model, tokenizer, storage_dir, seed, label="x"):
    """A backend of my own: the deterministic fake (backends/fake.py), saving its checkpoints in the run dir."""
    from backends.fake import FakeBackend
    from backends.tokenizer import load_tokenizer

    MADE.append((model, seed, label, storage_dir.name))
    return FakeBackend(load_tokenizer(tokenizer or model), storage_dir=storage_dir)


def not_a_backend(model, tokenizer, storage_dir, seed):
    return "a string"


def a_backend_that_exits(model, tokenizer, storage_dir, seed):
    import sys

    sys.exit(3)


def a_backend_class(model, tokenizer, storage_dir, seed):
    from backends.fake import FakeBackend

    return FakeBackend  # the class, not one: it has every method the Backend protocol's isinstance looks for


def renderer_raises(tokenizer):
    raise RuntimeError("no such format")


def renderer_not_one(tokenizer):
    return 5


def renderer_without_tokenizer():
    return None


def rows(n=8):
    return [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}]}
            for i in range(n)]
'''

LOCAL = 'backend = {kind = "local", device = "cpu"}\nlora = {rank = 4}\nsave_every = 0\n'
RECIPES = f'''
[recipes.rl]
{LOCAL}renderer = {{kind = "python", target = "myext.parts:Plain"}}
max_steps = 2
eval_every = 1
evals = [{{kind = "python", target = "myext.parts:tokens_of_hi", args = {{word = "hello"}}}}]
algo = {{kind = "rl", env = {{kind = "python", target = "myext.parts:make_env", args = {{top = 5}}}}, group_size = 2, groups_per_batch = 2, max_tokens = 4, loss = {{kind = "python", target = "myext.parts:PG", args = {{coef = 0.5}}}}}}

[recipes.sft]
{LOCAL}max_steps = 2
eval_every = 0
algo = {{kind = "sft", data = {{kind = "python", target = "myext.parts:rows", args = {{n = 6}}}}, batch_size = 2, test_size = 2}}

[recipes.algo]
{LOCAL}max_steps = 2
eval_every = 0
algo = {{kind = "python", target = "myext.custom_algo:SPEC", args = {{path = "completions.jsonl", batch_size = 2}}}}

[recipes.mine]
backend = {{kind = "python", target = "myext.parts:fake_backend", args = {{label = "mine"}}}}
seed = 3
max_steps = 3
eval_every = 0
save_every = 0
evals = [{{kind = "python", target = "myext.parts:tokens_of_hi"}}]
algo = {{kind = "sft", data = {{kind = "python", target = "myext.parts:rows", args = {{n = 8}}}}, batch_size = 2, test_size = 2}}
'''


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "myext").mkdir()
    (tmp_path / "myext" / "__init__.py").write_text("")
    (tmp_path / "myext" / "parts.py").write_text(PARTS)
    shutil.copy(ROOT / "examples" / "custom_algo.py", tmp_path / "myext" / "custom_algo.py")
    shutil.copy(ROOT / "examples" / "data" / "completions.jsonl", tmp_path / "completions.jsonl")
    (tmp_path / "r.toml").write_text(RECIPES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "myext" or m.startswith("myext.")]:
        sys.modules.pop(name)
    losses._REGISTRY.pop("myext_pg", None)  # the next test's fresh import registers its own (a different function)


def test_one_of_each_kind_from_a_user_package(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "r.toml"]) == 0
    import myext.parts as parts  # the module the runs import: what they did is recorded in it

    assert main(["run", "r.toml#rl"]) == 0
    rl = list(read_jsonl(proj / "runs" / "rl" / "metrics.jsonl"))
    assert parts.BUILT and set(parts.BUILT) == {"Plain"}  # the user's renderer rendered the env's prompts
    evals = [r["test/eval/python/tokens"] for r in rl if "test/eval/python/tokens" in r]
    assert evals and set(evals) == {len(load_tokenizer("tiny").encode("hello"))} and "hello" in parts.EVALS
    assert parts.LOSS_CALLS and set(parts.LOSS_CALLS) == {0.5}  # the user's loss, with the recipe's coef
    assert len([r for r in rl if "env/all/reward/total" in r]) == 2  # the user's env: two training steps

    assert main(["run", "r.toml#sft"]) == 0
    sft = [r for r in read_jsonl(proj / "runs" / "sft" / "metrics.jsonl") if "train_mean_nll" in r]
    assert len(sft) == 2  # 4 training rows of the user's 6, batches of 2

    assert main(["run", "r.toml#algo"]) == 0
    algo = [r for r in read_jsonl(proj / "runs" / "algo" / "metrics.jsonl") if "completion_nll" in r]
    assert len(algo) == 2
    capsys.readouterr()
    assert main(["check", "r.toml", "algo.args.batch_sise=3"]) == 2  # the user's config struct checks its args
    assert "did you mean `batch_size`?" in capsys.readouterr().err


def test_every_example_in_docs_extending_passes_check(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/extending.md's TOML blocks, each checked as written against this file's user package; and the old spelling
    of a user's algorithm is one line giving the new one."""
    text = (ROOT / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert len(blocks) == 7
    for block in blocks:
        (proj / "doc.toml").write_text(block)
        assert main(["check", "doc.toml"]) == 0, (block, capsys.readouterr().err)
    capsys.readouterr()
    (proj / "old.toml").write_text('[recipes.old]\nalgo = {kind = "custom", spec = "myext.custom_algo:SPEC"}\n')
    assert main(["check", "old.toml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith('algo: kind "custom" is now spelled {kind = "python", target = "myext.custom_algo:SPEC", '
                        'args = {...}}') and len(err.splitlines()) == 1, err


def test_a_backend_of_my_own_runs_a_recipe(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "r.toml#mine"]) == 0
    import myext.parts as parts

    assert parts.MADE == []  # checked (imported, args bound), not called
    assert main(["run", "r.toml#mine"]) == 0
    assert parts.MADE == [("tiny", 3, "mine", "checkpoints")]  # the recipe's model, seed and args; the run dir's
    rows = list(read_jsonl(proj / "runs" / "mine" / "metrics.jsonl"))
    train = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(train) == 3 and all(x > 0 for x in train)  # three steps on the user's backend
    assert rows[-1]["test/eval/python/tokens"] == len(load_tokenizer("tiny").encode("hi"))  # evals sample on it too
    capsys.readouterr()


@pytest.mark.parametrize(("override", "command", "message"), [
    ("backend.args.lable=1", "check", "backend.args: 'myext.parts:fake_backend' cannot be called with args ['label', 'lable']: got an unexpected keyword argument 'lable'"),
    ("backend.args.seed=1", "check", "backend: args may not set seed: runner passes them"),
    ("backend.target=myext.parts:nothing", "check", "backend.target: cannot import 'myext.parts:nothing'"),
    ("backend={kind=\"python\", target=\"myext.parts:not_a_backend\"}", "run",
     "backend target 'myext.parts:not_a_backend' returned str, not a backends.base.Backend"),
    ("backend={kind=\"python\", target=\"myext.parts:a_backend_that_exits\"}", "run",
     "backend target 'myext.parts:a_backend_that_exits': calling it with args [] raised SystemExit: 3"),
    ("backend={kind=\"python\", target=\"myext.parts:a_backend_class\"}", "run",
     "backend target 'myext.parts:a_backend_class' returned the class FakeBackend (call it), not a backends.base"),
])
def test_a_bad_backend_of_my_own_is_one_line(proj: Path, capsys: pytest.CaptureFixture[str], override: str,
                                             command: str, message: str) -> None:
    capsys.readouterr()
    assert main([command, "r.toml#mine", override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("how", ["file", "override", "smoke"])
def test_the_old_short_renderer_spelling_is_refused_with_the_new_one(proj: Path, capsys: pytest.CaptureFixture[str],
                                                                   how: str) -> None:
    """User code is spelled one way for every kind: `renderer = "pkg.mod:NAME"` (in the recipe file, as an override,
    or in the recipe's smoke.overrides) is refused by `runner check` in one line naming the recipe, the key and
    `{kind = "python", ...}`."""
    if how == "file":
        (proj / "r.toml").write_text(RECIPES.replace('renderer = {kind = "python", target = "myext.parts:Plain"}',
                                                     'renderer = "myext.parts:Plain"'))
    if how == "smoke":
        (proj / "r.toml").write_text(RECIPES + '\n[recipes.rl.smoke]\noverrides = {renderer = "myext.parts:Plain"}\n')
    capsys.readouterr()
    assert main(["check", "r.toml#rl", *(["renderer=myext.parts:Plain"] if how == "override" else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    key = "smoke.overrides: renderer: " if how == "smoke" else "renderer: "
    assert f"r.toml#rl: {key}" in err and 'renderer = {kind = "python", target = "myext.parts:Plain"}' in err, err


def test_show_writes_my_renderer_as_the_table_and_it_loads_back(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`runner show` (and a run's config.toml: the same dump) writes a user's renderer as it must be spelled, and
    what it writes loads back to the same recipe; a built-in renderer stays a string."""
    capsys.readouterr()
    assert main(["show", "r.toml#rl"]) == 0
    shown = capsys.readouterr().out
    assert tomllib.loads(shown)["recipes"]["rl"]["renderer"] == {"kind": "python", "target": "myext.parts:Plain"}
    (proj / "shown.toml").write_text(shown)
    assert load_recipe("shown.toml#rl")[1] == load_recipe("r.toml#rl")[1]
    assert main(["show", "r.toml#sft"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["recipes"]["sft"]["renderer"] == "auto"


@pytest.mark.parametrize(("override", "command", "message"), [
    ("renderer={kind=\"python\", target=\"myext.parts:renderer_raises\"}", "render",
     "renderer 'myext.parts:renderer_raises': calling it with the tokenizer raised RuntimeError: no such format"),
    ("renderer={kind=\"python\", target=\"myext.parts:renderer_not_one\"}", "render",
     "renderer 'myext.parts:renderer_not_one' returned int, not a Renderer"),
    ("renderer={kind=\"python\", target=\"myext.parts:renderer_without_tokenizer\"}", "check",
     "renderer 'myext.parts:renderer_without_tokenizer' cannot be called with a tokenizer: too many positional"),
    ("renderer={kind=\"python\", target=\"myext.parts:nothing\"}", "check",
     "renderer 'myext.parts:nothing': myext.parts has no nothing"),
    ("renderer={kind=\"python\", target=\"myext.nowhere:Plain\"}", "check",
     "renderer 'myext.nowhere:Plain': cannot import myext.nowhere: ModuleNotFoundError: No module named 'myext.nowhere'"),
])
def test_a_bad_renderer_of_my_own_is_one_line(proj: Path, capsys: pytest.CaptureFixture[str], override: str,
                                              command: str, message: str) -> None:
    """`runner check` imports a user's renderer and binds a tokenizer to it (it passed any "pkg.mod:NAME" unread);
    building one that raises or returns something else is one line, not a traceback."""
    capsys.readouterr()
    assert main([command, "r.toml#sft", override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("override", ["backend={kind=\"python\", target=\"myext.exits:fn\"}", "renderer={kind=\"python\", target=\"myext.exits:fn\"}",
                                      "algo.data={kind=\"python\", target=\"myext.exits:fn\"}"])
def test_a_module_that_exits_on_import_fails_check(proj: Path, capsys: pytest.CaptureFixture[str],
                                                   override: str) -> None:
    """A user module that exits as it is imported (sys.exit(0) at top level) ended `runner check` with exit code 0
    and no line: it looked like a pass."""
    (proj / "myext" / "exits.py").write_text("import sys\n\nsys.exit(0)\n\n\ndef fn(**kw):\n    return []\n")
    capsys.readouterr()
    assert main(["check", "r.toml#sft", override]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot import" in err and err.endswith("SystemExit: 0") and len(err.splitlines()) == 1, err


def test_the_backend_union_is_every_backend_config() -> None:
    """Nothing lists backends: each backends/NAME/NAME_config.py declares its variant and the union takes them all,
    built-in ones first (local: the default, the first a message offers), then a user's python backend."""
    assert BACKEND_VARIANTS == (*(v for v in BACKEND_VARIANTS if v.__module__.startswith("backends.")), PythonBackend)
    assert [v.__struct_config__.tag for v in BACKEND_VARIANTS] == ["local", "tinker", "python"]
    assert set(BACKEND_VARIANTS) == set(variants(BackendConfig))
    files = sorted(p.parent.name for p in (ROOT / "backends").glob("*/*_config.py") if p.stem == f"{p.parent.name}_config")
    assert [v.__module__.split(".")[1] for v in BACKEND_VARIANTS[:-1]] == files
    decoded = msgspec.convert({"kind": "python", "target": "a.b:c"}, Backend)  # type: ignore[arg-type]
    assert isinstance(decoded, PythonBackend) and decoded.args == {}


def test_every_builtin_is_a_config_file_beside_its_implementation() -> None:
    """Each built-in algorithm, env, pinned eval and loss is a struct in a `*_config.py` of its kind's folder, whose
    implementation (the module beside it) declares what the engine reads; no struct names its module in a string."""
    python = {v for v in (*ALGO_VARIANTS, *ENV_VARIANTS, *PINNED_VARIANTS)
              if v.__struct_config__.tag in ("python", "custom")}
    for variants_, folder, name, kind in [(ALGO_VARIANTS, "runner.algos", "SPEC", AlgoSpec),
                                          (ENV_VARIANTS, "runner.rl.envs", "ENV", EnvKind),
                                          (PINNED_VARIANTS, "runner.engine", "EVAL", EvalKind)]:
        assert len([v for v in variants_ if v not in python]) >= 3, variants_
        for variant in variants_:
            assert variant.__module__.startswith(folder + ".") and variant.__module__.endswith("_config"), variant
            assert not hasattr(variant, "implementation"), variant
            if variant not in python or variant in PINNED_VARIANTS or variant in ENV_VARIANTS:
                declared = getattr(importlib.import_module(implementation_of(variant)), name, None)
                assert isinstance(declared, kind), variant
    loss_variants = Loss.__args__  # type: ignore[attr-defined]  # the union built at import
    assert [v.__struct_config__.tag for v in loss_variants] == ["cispo", "dro", "importance_sampling", "ppo", "python"]
    for variant in loss_variants[:-1]:
        assert variant.__module__.startswith("backends.losses.") and variant.__module__.endswith("_config")
        assert losses.get(variant.__struct_config__.tag) is variant.loss_spec
    assert [v.__struct_config__.tag for v in PINNED_VARIANTS] == ["inspect", "math", "nll", "python"]
    engine = (ROOT / "runner" / "engine" / "evals.py").read_text()
    assert not any(v.__name__ in engine for v in PINNED_VARIANTS)  # no per-kind branch left


def test_an_implementation_without_its_declaration_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MathPinned, "__module__", "runner.engine.evals_config")
    with pytest.raises(TypeError, match=r"MathPinned: its implementation runner.engine.evals declares no EVAL"):
        kind_of(MathPinned(data=Jsonl(path="x.jsonl")))


# A built-in of each kind, as someone adding one to runner writes it: new files in one folder each (docs/extending.md).
BUILTINS = {
    "runner/algos/echo_sft_config.py": '''
        """The `echo_sft` algorithm's recipe table: SFT under another name."""
        from runner.recipe.common import AlgoBase, DataSource, PosInt


        class EchoSft(AlgoBase, tag="echo_sft"):
            data: DataSource
            batch_size: PosInt = 2
    ''',
    "runner/algos/echo_sft.py": '''
        from runner.algos import sft
        from runner.algos.sft_config import SFT
        from runner.engine.spec import AlgoSpec


        def build(cfg, args):
            return sft.build(SFT(data=cfg.data, batch_size=cfg.batch_size), args)


        SPEC = AlgoSpec(build=build, headline=[("train_mean_nll", "nll")])
    ''',
    "runner/rl/envs/countdown_config.py": '''
        from runner.recipe.common import EnvBase


        class Countdown(EnvBase):
            top: int = 5
    ''',
    "runner/rl/envs/countdown.py": '''
        from runner.rl.envs import arithmetic
        from runner.rl.envs.arithmetic_config import Arithmetic
        from runner.rl.envs.common import EnvKind


        def build(cfg, ctx):
            return arithmetic.ENV.build(Arithmetic(max_value=cfg.top, train_size=cfg.train_size,
                                                   test_size=cfg.test_size), ctx)


        ENV = EnvKind(build)
    ''',
    "runner/engine/length_eval_config.py": '''
        from runner.recipe.common import PinnedEvalBase


        class LengthPinned(PinnedEvalBase, tag="length"):
            word: str = "hi"
    ''',
    "runner/engine/length_eval.py": '''
        from runner.engine.evals import EvalKind


        async def run(cfg, ctx):
            return {"tokens": float(len(ctx.tokenizer.encode(cfg.word)))}


        EVAL = EvalKind(run)
    ''',
    "backends/losses/half_is_config.py": '''
        import os

        from backends.losses import LossField, LossSpec, loss_config, need, ratio, register


        def token_loss(lp, inp, cfg):
            with open(os.environ["ZZ_LOG"], "a") as f:
                f.write(f"loss {cfg['scale']}\\n")
            return -cfg["scale"] * ratio(lp, inp) * need(inp.advantages)


        SPEC = register(LossSpec("half_is", token_loss, fields=(LossField("scale", "scale", 0.5, gt=0.0),)))
        HalfIs = loss_config(SPEC, __name__)
    ''',
    "runner/renderers/zz_shout.py": '''
        import os

        from runner.renderers.base import register
        from runner.renderers.role_colon import RoleColonRenderer


        @register("zz_shout")
        class Shout(RoleColonRenderer):
            def __init__(self, tokenizer):
                super().__init__(tokenizer)
                with open(os.environ["ZZ_LOG"], "a") as f:
                    f.write("renderer\\n")

            def render_message(self, message, ctx):
                return super().render_message({**message, "content": str(message["content"]).upper()}, ctx)
    ''',
    "backends/zz_fake/zz_fake_config.py": '''
        from backends.backend_config import BackendConfig


        class ZzFake(BackendConfig, tag="zz_fake"):
            def make(self, model, tokenizer, storage_dir, seed):
                from backends.fake import FakeBackend
                from backends.tokenizer import load_tokenizer

                return FakeBackend(load_tokenizer(tokenizer or model), storage_dir=storage_dir)
    ''',
}

BUILTIN_RECIPES = """
[recipes.rl]
backend = {kind = "zz_fake"}
renderer = "zz_shout"
max_steps = 2
eval_every = 1
save_every = 0
evals = [{kind = "length", word = "hello"}]
algo = {kind = "rl", env = {kind = "countdown", top = 5, test_size = 4}, group_size = 2, groups_per_batch = 2, max_tokens = 4, loss = {kind = "half_is", scale = 0.25}}

[recipes.algo]
backend = {kind = "zz_fake"}
max_steps = 2
eval_every = 0
save_every = 0
algo = {kind = "echo_sft", data = {kind = "jsonl", path = "rows.jsonl"}, batch_size = 2}
"""


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


COMMANDS = r"""
import json, sys
from runner.cli import main
codes = []
for args in json.loads(sys.argv[1]):
    print("--- runner " + " ".join(args), file=sys.stderr, flush=True)
    codes.append(main(args))
print(json.dumps(codes))
"""


def test_a_builtin_of_each_kind_is_new_files_in_one_folder(tmp_path: Path) -> None:
    """Adding a built-in algorithm, env, pinned eval, loss, renderer and backend to a copy of runner: 9 new files in 6
    folders and not one existing file edited (every file hashes the same), and a recipe check and runs use them all."""
    repo, work = tmp_path / "repo", tmp_path / "work"
    for package in ("runner", "backends"):
        shutil.copytree(ROOT / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = _hashes(repo)
    for rel, text in BUILTINS.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(textwrap.dedent(text).lstrip())
    work.mkdir()
    (work / "r.toml").write_text(BUILTIN_RECIPES)
    (work / "rows.jsonl").write_text("".join(
        f'{{"messages": [{{"role": "user", "content": "say {i}"}}, {{"role": "assistant", "content": "{i}"}}]}}\n'
        for i in range(6)))
    env = {**os.environ, "PYTHONPATH": str(repo), "ZZ_LOG": str(work / "log.txt")}

    # `runner check r.toml`, `runner run r.toml#rl`, `runner run r.toml#algo`, one after another in one process that
    # imports the copy (torch once, not three times): each command's exit code, in order.
    commands = [["check", "r.toml"], ["run", "r.toml#rl"], ["run", "r.toml#algo"]]
    proc = subprocess.run([sys.executable, "-c", COMMANDS, json.dumps(commands)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0, 0, 0], proc.stderr[-3000:]

    after = _hashes(repo)
    assert {k: after[k] for k in before} == before  # 0 existing files edited
    added = sorted(set(after) - set(before))
    assert added == sorted(BUILTINS)
    assert len(added) == 9 and len({str(Path(a).parent) for a in added}) == 6
    rl = list(read_jsonl(work / "runs" / "rl" / "metrics.jsonl"))
    assert len([r for r in rl if "env/all/reward/total" in r]) == 2  # the env: two training steps
    evals = [r["test/eval/length/tokens"] for r in rl if "test/eval/length/tokens" in r]
    assert evals and set(evals) == {len(load_tokenizer("tiny").encode("hello"))}  # the pinned eval
    log = (work / "log.txt").read_text().splitlines()
    assert "renderer" in log and "loss 0.25" in log  # the renderer rendered, the loss trained with the recipe's scale
    algo = [r for r in read_jsonl(work / "runs" / "algo" / "metrics.jsonl") if "train_mean_nll" in r]
    assert len(algo) == 2  # the algorithm, on the backend


@pytest.mark.parametrize("module", ["runner.algos.rl_config", "runner.algos.generate_config",
                                    "runner.rl.envs.tictactoe_config", "runner.engine.inspect_eval_config",
                                    "backends.losses.ppo_config", "backends.local.local_config"])
def test_the_unions_are_whole_whichever_config_module_is_imported_first(module: str) -> None:
    """A config module imported before the schema (a fresh interpreter) still ends up in its union, whole: the finder
    loads config modules by file and none imports the module that finds its own kind (tests/test_import_graph.py)."""
    counts = ("len(ALGO_VARIANTS), len(ENV_VARIANTS), len(PINNED_VARIANTS), len(Loss.__args__), "
              "len(BACKEND_VARIANTS)")
    code = (f"import {module}\nfrom runner.recipe.schema import ALGO_VARIANTS, BACKEND_VARIANTS\n"
            "from runner.recipe.envs import ENV_VARIANTS\nfrom runner.recipe.pinned import PINNED_VARIANTS\n"
            f"from runner.algos.rl_config import Loss\nprint({counts})")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(n) for n in (len(ALGO_VARIANTS), len(ENV_VARIANTS), len(PINNED_VARIANTS),
                                                   len(Loss.__args__), len(BACKEND_VARIANTS))]  # type: ignore[attr-defined]
