"""Wall time of the local backend's sampling CLIENTS (worker threads, batching), not the engine.

Four variants, each in a fresh subprocess (torch's OpenMP state is per process), interleaved over rounds:
  old      sampling workers use torch's default thread count and run whatever is queued at once
  threads  + sampling workers run torch single-threaded on the CPU (backend.SAMPLER_CPU_THREADS)
  new      + the worker coalesces requests that arrive a few ms apart (worker.Worker._gather)
  stream   + continuous batching: requests arriving while a batch decodes join it, and each is delivered as
           soon as it finishes (Sampler.sample_stream; the other variants run Sampler.sample_batch)
Scenarios (tiny model, CPU):
  lone      the base-model client used alone (the KL/DPO reference case): one 16-token sample, then 32
            concurrent ones; then the same on a snapshot client
  episodes  N asyncio episodes x K sequential turns of sample(prompt, 1, params) on a snapshot; each turn
            appends the reply and 3 tokens to the prompt and busy-waits --env-ms (the env's work)
  twentyq   runner.rl rollout_batch of twenty_questions groups on a snapshot (long, growing prompts)
Wall time is what is measured (waiting is the point), so the machine's load shows: compare within a round.

    python bench/bench_sampling_clients.py                       # all scenarios, 2 rounds
    python bench/bench_sampling_clients.py --scenarios episodes --variants threads new --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("old", "threads", "new", "stream")
SCENARIOS = ("lone", "episodes", "twentyq")


def _backend(variant: str):
    import torch

    from backends.local import backend as B
    from backends.local import worker as W
    from backends.local.local_config import Local

    if variant == "old":
        B.SAMPLER_CPU_THREADS = torch.get_num_threads()
    if variant in ("old", "threads"):  # no waiting: the batch starts with what is queued (the old drain)
        W.COLD_GAP_S = W.WAIT_FRACTION = 0.0
    if variant != "stream":  # one sample_batch per drained batch, results when the whole batch is done

        def whole_batch(self, samples, jobs):
            self._run(samples, self._sampler.sample_batch, B._sample_request)

        B.LocalSamplingClient._stream = whole_batch
    return B.LocalBackend(Local(), "tiny", None, Path(tempfile.mkdtemp()), seed=0)


def _snapshot(be):
    from backends.types import LoraSpec

    tc = be.create_training_client(LoraSpec("tiny", rank=4, seed=1)).result()
    return tc.save_weights_and_get_sampling_client().result()


def count_batches(sc) -> list[int]:
    """Requests per decode run: a sample_batch call's, or a sample_stream's (those it started with plus those
    that joined it)."""
    sizes: list[int] = []
    batch, stream = sc._sampler.sample_batch, sc._sampler.sample_stream

    def counted(reqs):
        sizes.append(len(reqs))
        return batch(reqs)

    def counted_stream(reqs, more, done):
        sizes.append(len(reqs))

        def joined():
            got = more()
            sizes[-1] += len(got)
            return got
        return stream(reqs, joined, done)

    sc._sampler.sample_batch = counted
    sc._sampler.sample_stream = counted_stream
    return sizes


def lone(variant: str, args) -> dict:
    from backends.types import SamplingParams

    be = _backend(variant)
    params = SamplingParams(max_tokens=16, temperature=1.0, stop=[])
    prompt = list(range(10, 40))
    out = {}
    for name, make in (("base", lambda: be.create_sampling_client(base_model="tiny").result()), ("snap", None)):
        sc = make() if make else _snapshot(be)
        sc.sample(prompt, 1, params).result()  # warm-up
        t = time.perf_counter()
        sc.sample(prompt, 1, params).result()
        out[f"{name}_one_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for f in [sc.sample(prompt, 1, params) for _ in range(32)]:
            f.result()
        out[f"{name}_32_s"] = time.perf_counter() - t
    be.close()
    return out


def episodes(variant: str, args) -> dict:
    from backends.types import SamplingParams

    be = _backend(variant)
    sc = _snapshot(be)
    sizes = count_batches(sc)

    async def episode(i: int) -> None:
        prompt = [10 + i % 50] * 20
        for turn in range(args.turns):
            p = SamplingParams(max_tokens=16, temperature=1.0, seed=1000 * i + turn)
            out = await sc.sample(prompt, 1, p)
            end = time.perf_counter() + args.env_ms / 1000
            while time.perf_counter() < end:  # the env's (synchronous) work
                pass
            prompt = prompt + out.sequences[0].tokens + [5, 6, 7]

    async def run() -> None:
        await asyncio.gather(*(episode(i) for i in range(args.episodes)))

    t = time.perf_counter()
    asyncio.run(run())
    wall = time.perf_counter() - t
    be.close()
    return {"wall_s": wall, "batches": len(sizes), "mean_batch": statistics.mean(sizes)}


def twentyq(variant: str, args) -> dict:
    from backends.types import SamplingParams
    from runner.renderers.chat import ChatRenderer
    from runner.rl.envs import EnvContext, build_datasets
    from runner.rl.envs.twenty_questions_config import TwentyQuestions
    from runner.rl.rollouts import rollout_batch

    be = _backend(variant)
    ctx = EnvContext(ChatRenderer(be.get_tokenizer()), args.group_size, 1, args.groups, 0)
    train, _ = build_datasets(TwentyQuestions(train_size=40, test_size=0, max_turns=args.max_turns), ctx)
    sc = _snapshot(be)
    sizes = count_batches(sc)
    t = time.perf_counter()
    asyncio.run(rollout_batch(train.get_batch(0), sc, SamplingParams(max_tokens=32), max_context=2048))
    wall = time.perf_counter() - t
    be.close()
    return {"wall_s": wall, "batches": len(sizes), "mean_batch": statistics.mean(sizes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--env-ms", type=float, default=1.0)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=5)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--one", nargs=2, metavar=("SCENARIO", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one measurement, one JSON line
        scenario, variant = args.one
        print(json.dumps(globals()[scenario](variant, args)))
        return
    forward = [a for a in sys.argv[1:] if a != "--one"]
    for scenario in args.scenarios:
        results: dict[str, list[dict]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):
            for v in args.variants:
                cmd = [sys.executable, __file__, *forward, "--one", scenario, v]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                results[v].append(json.loads(out.strip().splitlines()[-1]))
        print(f"{scenario}:")
        for v, runs in results.items():
            keys = runs[0].keys()
            print(f"  {v:8}" + "  ".join(f"{k} {statistics.median(r[k] for r in runs):.3f}" for k in keys))


if __name__ == "__main__":
    main()
