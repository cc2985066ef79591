"""One of each extension kind from a temporary package, the way a user adds them (docs/extending.md): a renderer
(`renderer = "pkg.mod:NAME"`), an RL env, a loss and a pinned eval (`kind = "python"`), a data source for SFT, and an
algorithm (`kind = "custom"`); `runner check` accepts them all, and short local runs use every one of them."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from backends.tokenizer import load_tokenizer
from runner.cli import main
from runner.engine.log import read_jsonl

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


def rows(n=8):
    return [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}]}
            for i in range(n)]
'''

LOCAL = 'backend = {kind = "local", device = "cpu"}\nlora = {rank = 4}\nsave_every = 0\n'
RECIPES = f'''
[recipes.rl]
{LOCAL}renderer = "myext.parts:Plain"
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
algo = {{kind = "custom", spec = "myext.custom_algo:SPEC", args = {{path = "completions.jsonl", batch_size = 2}}}}
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
