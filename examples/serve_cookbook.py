"""Run tinker-cookbook's own training entry points against `runner serve`, offline, on the embedded tiny model:

  sft   supervised.train.main on examples/data/chat_sft.jsonl (FromConversationFileBuilder)
  rl    rl.train.main on the cookbook's arithmetic env (operands 0-9 by default), loss_fn importance_sampling
  sr    the same with loss_fn stable_reinforce (the cookbook's default for async runs)
  dpo   preference.train_dpo.main on examples/data/preferences.jsonl (ComparisonBuilderFromJsonl)

Each writes its cookbook log dir (metrics.jsonl, checkpoints.jsonl) under --out; the script prints the curves.
The cookbook resolves a tokenizer from the model name, so "tiny" is registered with its tokenizer_utils first
(runner serve's get_info also names a local tokenizer folder, which TrainingClient.get_tokenizer() loads).

    pip install --no-deps tinker-cookbook==0.6.1 && pip install aiohttp blobfile chz cloudpickle pillow pyrage \\
        termcolor tiktoken math-verify pylatexenc datasets
    python examples/serve_cookbook.py                       # starts runner serve itself (~2-4 min on 2 cores)
    python examples/serve_cookbook.py --base-url http://127.0.0.1:8000 --only rl sr
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny"
RENDERER = "qwen3_instruct"  # ChatML without thinking: the tiny tokenizer's own format
TEMPERATURE = 1.5  # at 1.0 tiny already gets most single-digit sums right; at 2.0 rl_basic starts near 45%
RL_LR = 2e-3


COOKBOOK_TRAINING_DEPS = ("tinker_cookbook", "chz", "termcolor", "aiohttp", "blobfile", "cloudpickle", "PIL", "tiktoken",
                          "math_verify", "pylatexenc", "datasets")
INSTALL = ("pip install --no-deps tinker-cookbook==0.6.1 chz termcolor && pip install aiohttp blobfile cloudpickle "
           "pillow pyrage tiktoken math-verify pylatexenc datasets")


def missing_cookbook_deps() -> list[str]:
    """The modules the cookbook's training loops import that are not installed here."""
    import importlib.util

    return [m for m in COOKBOOK_TRAINING_DEPS if importlib.util.find_spec(m) is None]


@contextlib.contextmanager
def runner_serve(storage: Path) -> Iterator[str]:
    port_file = storage.parent / "serve.port"
    with open(storage.parent / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "runner", "serve", "--port", "0", "--port-file", str(port_file),
                                 "--storage", str(storage)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            while not port_file.exists():
                if proc.poll() is not None:
                    raise SystemExit((storage.parent / "serve.log").read_text())
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port_file.read_text().strip()}"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def register_tiny() -> None:
    from tinker_cookbook.tokenizer_utils import register_tokenizer
    from transformers import AutoTokenizer

    from backends.local.tiny import TINY_DIR

    tok = AutoTokenizer.from_pretrained(TINY_DIR)
    register_tokenizer(MODEL, lambda: tok)


def sft(base_url: str, out: Path, steps: int) -> Path:
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name=RENDERER, max_length=512,
                                            batch_size=8)
    cfg = train.Config(log_path=str(out / "sft"), model_name=MODEL, recipe_name="serve_sft", renderer_name=RENDERER,
                       dataset_builder=FromConversationFileBuilder(
                           common_config=common, file_path=str(REPO / "examples/data/chat_sft.jsonl"), test_size=16),
                       learning_rate=1e-2, lora_rank=16, base_url=base_url, eval_every=5, save_every=10,
                       max_steps=steps, ttl_seconds=None)
    asyncio.run(train.main(cfg))
    return out / "sft"


def single_digit_builder(max_value: int):
    """The cookbook's arithmetic env and dataset with operands 0..max_value. Its own builder draws 0..100, and
    the tiny model cannot add two-digit numbers at all (reward 0 throughout: nothing to learn from)."""
    from functools import partial

    import chz
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset, ArithmeticEnv
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
    from tinker_cookbook.rl.types import RLDatasetBuilder
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    class SmallSums(ArithmeticDataset):
        def _make_env_group_builder(self, rng):
            x, y = rng.randint(0, max_value + 1), rng.randint(0, max_value + 1)
            return ProblemGroupBuilder(env_thunk=partial(ArithmeticEnv, x, y, renderer=self.renderer,
                                                         convo_prefix=ArithmeticEnv.standard_fewshot_prefix()),
                                       num_envs=self.group_size)

    @chz.chz
    class SmallSumsBuilder(RLDatasetBuilder):
        batch_size: int
        group_size: int
        n_batches: int

        async def __call__(self):
            renderer = renderers.get_renderer(RENDERER, tokenizer=get_tokenizer(MODEL))
            return SmallSums(batch_size=self.batch_size, renderer=renderer, group_size=self.group_size,
                             n_batches=self.n_batches), None

    return SmallSumsBuilder


def rl(base_url: str, out: Path, steps: int, loss_fn: str, max_value: int) -> Path:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    name = f"rl_{loss_fn}"
    if max_value >= 100:
        data = ArithmeticDatasetBuilder(batch_size=8, model_name_for_tokenizer=MODEL, renderer_name=RENDERER,
                                        n_batches=steps, group_size=8)
    else:
        data = single_digit_builder(max_value)(batch_size=8, group_size=8, n_batches=steps)
    cfg = train.Config(log_path=str(out / name), model_name=MODEL, recipe_name=name, renderer_name=RENDERER,
                       dataset_builder=data, learning_rate=RL_LR, max_tokens=8, lora_rank=16, base_url=base_url,
                       loss_fn=loss_fn, temperature=TEMPERATURE, eval_every=0, save_every=10, max_steps=steps,
                       ttl_seconds=None, num_groups_to_log=0)
    asyncio.run(train.main(cfg))
    return out / name


def dpo(base_url: str, out: Path, steps: int) -> Path:
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    # examples/data/preferences.jsonl ({prompt, chosen, rejected}) in the cookbook's comparison format.
    rows = [json.loads(line) for line in (REPO / "examples/data/preferences.jsonl").read_text().splitlines() if line]
    comparisons = out / "comparisons.jsonl"
    comparisons.write_text("".join(json.dumps({"comparison": {"prompt_conversation": r["prompt"], "completion_A": r["chosen"],
                                                              "completion_B": r["rejected"]}, "label": "A"}) + "\n"
                                   for r in rows))
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name=RENDERER, max_length=512,
                                            batch_size=8)
    cfg = train_dpo.Config(log_path=str(out / "dpo"), model_name=MODEL, recipe_name="serve_dpo", renderer_name=RENDERER,
                           dataset_builder=DPODatasetBuilderFromComparisons(
                               common_config=common, comparison_builder=ComparisonBuilderFromJsonl(train_path=str(comparisons))),
                           learning_rate=1e-3, lora_rank=16, base_url=base_url, dpo_beta=0.1, eval_every=0,
                           save_every=10, max_steps=steps, ttl_seconds=None)
    train_dpo.main(cfg)
    return out / "dpo"


CURVES = {"sft": ["train_mean_nll", "test/nll"], "rl_importance_sampling": ["env/all/reward/total", "env/all/correct"],
          "rl_stable_reinforce": ["env/all/reward/total", "env/all/correct"], "dpo": ["dpo_loss", "accuracy"]}


def curves(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out: dict[str, list[tuple[int, float]]] = {}
    for key in CURVES[log_dir.name]:
        out[key] = [(int(r.get("step", i)), float(r[key])) for i, r in enumerate(rows) if key in r]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running runner serve (default: start one on a temporary storage)")
    ap.add_argument("--out", type=Path, help="where the cookbook log dirs go (default: a temporary folder)")
    ap.add_argument("--only", nargs="*", choices=["sft", "rl", "sr", "dpo"], default=["sft", "rl", "sr", "dpo"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-value", type=int, default=9,
                    help="largest operand of the arithmetic env (the cookbook's own: 100; tiny cannot add those)")
    ap.add_argument("--json", type=Path, help="also write the curves here")
    args = ap.parse_args()
    missing = missing_cookbook_deps()
    if missing:
        print(f"error: the cookbook's training loops need {', '.join(missing)}: {INSTALL}", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    register_tiny()
    with tempfile.TemporaryDirectory(prefix="serve-cookbook-") as tmp_:
        out = args.out or Path(tmp_)
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            url = args.base_url or stack.enter_context(runner_serve(Path(tmp_) / "storage"))
            jobs = {"sft": lambda: sft(url, out, args.steps), "rl": lambda: rl(url, out, args.steps, "importance_sampling", args.max_value),
                    "sr": lambda: rl(url, out, args.steps, "stable_reinforce", args.max_value), "dpo": lambda: dpo(url, out, args.steps)}
            report = {}
            for name in args.only:
                t = time.perf_counter()
                log_dir = jobs[name]()
                report[log_dir.name] = {"seconds": round(time.perf_counter() - t, 1), **curves(log_dir)}
        for name, res in report.items():
            print(f"\n{name} ({res['seconds']} s)")
            for key, pts in res.items():
                if key == "seconds" or not pts:
                    continue
                shown = pts if len(pts) <= 8 else [*pts[:4], *pts[-4:]]
                print(f"  {key:24s} " + "  ".join(f"{s}:{v:.3f}" for s, v in shown))
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
