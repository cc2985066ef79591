"""The local backend in bfloat16 on the CPU: the stand-in for the GPU path (cuda picks bfloat16), which CI lacks.

What it proves: every tensor a client creates takes its dtype from backends/local/device.py (base weights, KV cache
and merged snapshots bfloat16; LoRA adapters, their optimizer state and logits float32); the sampler (fast path and
HF path), merged and unmerged sampling clients, snapshots, save/load and export work and agree with the trainer
within the stated bfloat16 tolerances; every algorithm runs end to end; `runner conformance` passes against
`runner serve --dtype bfloat16`; and device = "auto" keeps a small model on the CPU where CUDA exists.

The tolerances (max |dlogprob| over every target token), measured on the tiny model and stated with ~2.5x room:
- bfloat16 vs float32 on the same weights: 0.20 measured (mean 0.03): TOL_VS_FP32 = 0.5, mean 0.08. This is the
  format's own noise (8 mantissa bits on logits of magnitude ~10), the same for the packed trainer and HF's modules.
- sampler vs trainer on the same weights, adapters unmerged ("lora", what "auto" picks in bfloat16): 0.039 measured
  here (0.035 on other data): TOL_LORA = 0.1. The packed trainer (backends/local/packed.py) and the sampler's HF
  modules run the same math in other op orders, each rounding to bfloat16 (the padded trainer, HF's modules too,
  gives 0.006).
- merged ("merged": W + s B A rounded to bfloat16 once more): 0.045 measured here, 0.12 on other data:
  TOL_MERGED = 0.25.
- a sample's own logprobs vs compute_logprobs of the same sequence by the same client: 5e-7 measured: 1e-3.
- a training step's LoRA B gradient, bfloat16 vs float32: cosine 0.996 measured: GRAD_COS = 0.98.
"""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.local import model as M
from backends.local.backend import LocalBackend
from backends.local.device import CPU_MAX_PARAMS, model_parameters, place
from backends.local.llama import LoraDelta, Slots
from backends.local.local_config import Local
from backends.local.tiny import TINY_DIR
from backends.types import AdamParams, Datum, LoraSpec, SamplingParams
from runner.cli import main

REPO = Path(__file__).resolve().parent.parent
SPEC = LoraSpec("tiny", rank=8, seed=3)
TOL_VS_FP32, MEAN_VS_FP32 = 0.5, 0.08
TOL_LORA, TOL_MERGED, TOL_OWN = 0.1, 0.25, 1e-3
GRAD_COS = 0.98  # cosine of a bf16 step's LoRA B gradient with float32's on the same data: 0.996 measured
TEXTS = ["hello there, how are you", "the quick brown fox jumps", "2+2=4 and 3+3=6"]


def _data(tok) -> list[Datum]:
    out = []
    for t in TEXTS:
        ids = tok.encode(t)
        out.append(Datum(ids[:-1], np.array(ids[1:]), weights=np.ones(len(ids) - 1)))
    return out


def _backend(tmp: Path, dtype: str = "bfloat16", sampler_weights: str = "auto") -> LocalBackend:
    return LocalBackend(Local(device="cpu", dtype=dtype, sampler_weights=sampler_weights), "tiny", None, tmp, seed=0)  # type: ignore[arg-type]


def _trained(backend: LocalBackend, data: list[Datum], steps: int = 3):
    tc = backend.create_training_client(SPEC).result()
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    return tc


def _worst(sampler, data: list[Datum], trainer_lps: list[np.ndarray]) -> float:
    worst = 0.0
    for d, lp in zip(data, trainer_lps, strict=True):
        seq = [*d.model_input, int(d.target_tokens[-1])]
        got = np.array(sampler.compute_logprobs(seq).result()[1:])
        worst = max(worst, float(np.abs(got - lp).max()))
    return worst


def _own_logprobs_gap(sampler, tok) -> float:
    """A seeded sample's reported logprobs vs compute_logprobs of the same sequence (same client)."""
    prompt = tok.encode("hello")
    out = sampler.sample(prompt, 4, SamplingParams(max_tokens=12, temperature=1.0, seed=1)).result()
    worst = 0.0
    for s in out.sequences:
        assert s.tokens and all(math.isfinite(x) for x in s.logprobs)
        again = sampler.compute_logprobs(prompt + s.tokens).result()[len(prompt):]
        worst = max(worst, float(np.abs(np.array(again) - np.array(s.logprobs)).max()))
    return worst


@pytest.mark.parametrize("mode", ["lora", "merged"])
def test_every_tensor_takes_its_dtype_from_the_placement(tmp_path, mode):
    backend = _backend(tmp_path, sampler_weights=mode)
    try:
        assert backend.placement.dtype == torch.bfloat16 and backend.placement.adapter_dtype == torch.float32
        base = backend.base()
        assert {p.dtype for p in base.parameters()} == {torch.bfloat16}
        tc = _trained(backend, _data(backend.get_tokenizer()), steps=1)
        trained = M.trainable_params(tc.model)
        assert trained and all(p.dtype == torch.float32 for _, p in trained)  # LoRA A/B: float32 masters
        moments = [t for s in tc.optimizer.state.values() for t in s.values() if t.dim() > 0]
        assert moments and all(t.dtype == torch.float32 for t in moments)
        frozen = {p.dtype for n, p in tc.model.named_parameters() if not p.requires_grad}
        assert frozen == {torch.bfloat16}
        sc = tc.save_weights_and_get_sampling_client().result()
        snap = sc.model
        deltas = [m for m in snap.modules() if isinstance(m, LoraDelta)]
        if mode == "lora":
            assert deltas and all(d.a_t.dtype == d.b_t.dtype == torch.float32 for d in deltas)
            assert all(d.base.weight.dtype == torch.bfloat16 for d in deltas)
        else:
            assert not deltas and {p.dtype for p in snap.parameters()} == {torch.bfloat16}
        fast = sc._sampler.fast
        assert fast is not None  # the plain-tensor decode path runs in bfloat16 too
        cache = fast.new_cache(4, 16, Slots())
        assert {t.dtype for t in cache.keys + cache.values} == {torch.bfloat16}
    finally:
        backend.close()


def test_bf16_training_step_tracks_float32(tmp_path):
    lps, grads = {}, {}
    for dtype in ("float32", "bfloat16"):
        backend = _backend(tmp_path / dtype, dtype)
        try:
            tc = backend.create_training_client(SPEC).result()
            data = _data(backend.get_tokenizer())
            out = tc.forward(data, "cross_entropy").result()
            lps[dtype] = out.logprobs
            assert all(lp.dtype == np.float32 for lp in out.logprobs)  # logits -> float32 before the logprobs
            tc.forward_backward(data, "cross_entropy").result()
            grads[dtype] = torch.cat([p.grad.float().flatten() for n, p in M.trainable_params(tc.model)
                                      if "lora_B" in n])
        finally:
            backend.close()
    assert torch.nn.functional.cosine_similarity(grads["float32"], grads["bfloat16"], dim=0) >= GRAD_COS
    gaps = [np.abs(a - b) for a, b in zip(lps["float32"], lps["bfloat16"], strict=True)]
    assert max(g.max() for g in gaps) <= TOL_VS_FP32
    assert np.mean([g.mean() for g in gaps]) <= MEAN_VS_FP32
    assert max(g.max() for g in gaps) > 0  # really computed in bfloat16


@pytest.mark.parametrize(("mode", "tol"), [("lora", TOL_LORA), ("merged", TOL_MERGED)])
def test_samplers_agree_with_the_trainer(tmp_path, mode, tol):
    backend = _backend(tmp_path, sampler_weights=mode)
    try:
        tok = backend.get_tokenizer()
        data = _data(tok)
        pristine = {k: v.clone() for k, v in backend.base().state_dict().items()}
        tc = _trained(backend, data)
        lps = tc.forward(data, "cross_entropy").result().logprobs
        snap = tc.save_weights_and_get_sampling_client().result()
        assert _worst(snap, data, lps) <= tol
        assert _own_logprobs_gap(snap, tok) <= TOL_OWN  # fast path
        snap._sampler.fast = None
        assert _own_logprobs_gap(snap, tok) <= TOL_OWN  # HF's modules
        # Saved sampler weights (a PEFT folder) and a saved state give the same sampler as the snapshot.
        for path in (tc.save_weights_for_sampler("s").result(), tc.save_state("w").result()):
            sc = backend.create_sampling_client(model_path=path).result()
            assert _worst(sc, data, lps) <= tol
        # load_state: the same float32 adapters over the same bfloat16 base: the very same logprobs.
        loaded = backend.create_training_client_from_state(tc.save_state("w2").result(), SPEC).result()
        again = loaded.forward(data, "cross_entropy").result().logprobs
        assert all(np.array_equal(a, b) for a, b in zip(again, lps, strict=True))
        assert loaded.step == tc.step == 3
        # The clients share the base's tensors (snapshots, loaded adapters): none of them wrote to it.
        assert all(torch.equal(v, pristine[k]) for k, v in backend.base().state_dict().items())
    finally:
        backend.close()


def test_lora_is_the_auto_choice_in_bf16(tmp_path):
    """auto merges only in float32: merging into bfloat16 weights rounds away most of a small update."""
    bf, fp = _backend(tmp_path / "bf"), _backend(tmp_path / "fp", "float32")
    try:
        assert not bf.merge_samplers() and fp.merge_samplers()
    finally:
        bf.close()
        fp.close()


# ---------------------------------------------------------------- recipes and commands end to end


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(("file", "name"), [("recipes.toml", "sl_basic"), ("recipes.toml", "rl_basic"),
                                            ("examples/rl_async.toml", "rl_async"), ("recipes.toml", "dpo_basic"),
                                            ("recipes.toml", "distill_on_policy")])
def test_recipes_run_in_bf16(tmp_path, monkeypatch, capsys, file, name):
    """Each algorithm (SFT, RL sync and async, DPO, on-policy distillation with its teacher stage) runs 2 steps in
    bfloat16 (--smoke: its data, 2 steps) and logs finite metrics; then sample, chat and eval on the SFT run and
    export of it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    ref = f"{REPO / file}#{name}"
    assert main(["run", ref, "--smoke", "backend.device=cpu", "backend.dtype=bfloat16"]) == 0
    assert "device: cpu bfloat16 (device = 'cpu'; dtype = 'bfloat16')" in capsys.readouterr().err
    run_dir = tmp_path / "runs" / f"{name}-smoke"
    rows = _metrics(run_dir)
    assert rows and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert "bfloat16" in (run_dir / "config.toml").read_text()
    if name != "sl_basic":
        return
    capsys.readouterr()
    assert main(["sample", str(run_dir), "hi", "--seed", "0", "--max-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main(["eval", str(run_dir)]) == 0
    assert math.isfinite(json.loads((run_dir / "evals.jsonl").read_text().splitlines()[-1])["test/nll"])
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", str(run_dir), "--max-tokens", "8"]) == 0
    for merged in ([], ["--merged"]):
        out = tmp_path / f"export{len(merged)}"
        assert main(["export", str(run_dir), str(out), *merged]) == 0
        assert (out / ("config.json" if merged else "adapter_config.json")).is_file()


# ---------------------------------------------------------------- device = "auto"


def _fake_model(folder: Path, params: int) -> Path:
    """A model folder whose safetensors header declares `params` parameters (model_parameters reads only that)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    header = json.dumps({"__metadata__": {}, "w": {"dtype": "BF16", "shape": [params], "data_offsets": [0, 0]}})
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    return folder


def test_auto_keeps_a_small_model_on_the_cpu_where_cuda_exists(tmp_path, monkeypatch):
    monkeypatch.delenv("RUNNER_LOCAL_DEVICE", raising=False)
    base = M.load_base(TINY_DIR, torch.device("cpu"), torch.float32)
    assert model_parameters(TINY_DIR) == sum(p.numel() for p in base.parameters())  # tied lm_head counted once
    tiny = place(Local(), TINY_DIR, cuda=True)
    assert (tiny.device.type, tiny.dtype) == ("cpu", torch.float32)
    assert "0.82M parameters" in tiny.reason
    big = place(Local(), _fake_model(tmp_path / "big", CPU_MAX_PARAMS), cuda=True)
    assert (big.device.type, big.dtype) == ("cuda", torch.bfloat16)
    assert "50.00M parameters on a CUDA device" in big.reason
    unknown = place(Local(), None, cuda=True)
    assert unknown.device.type == "cuda"
    assert place(Local(), _fake_model(tmp_path / "b2", 10**9), cuda=False).device.type == "cpu"
    pinned = place(Local(device="cuda", dtype="float32"), TINY_DIR, cuda=True)
    assert (pinned.device.type, pinned.dtype) == ("cuda", torch.float32)
    # The same decision with torch's own answer mocked, as --dry-run and the run's first line print it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Local().describe("tiny") == f"device: {tiny.describe()}"
    assert Local().describe(str(tmp_path / "big")).startswith("device: cuda bfloat16 (auto: 50.00M parameters")


def test_dry_run_and_the_run_say_where_they_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    ref = f"{REPO / 'recipes.toml'}#sl_basic"
    assert main(["run", ref, "--dry-run", "backend.dtype=bfloat16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("device: cpu bfloat16 (") and "dtype = 'bfloat16'" in out[1]


# ---------------------------------------------------------------- runner serve --dtype bfloat16


def conformance_results(service):
    """`runner conformance` against `service` (closed after) on a loopback port, numeric checks at atol = rtol =
    5e-3 (bfloat16's tolerance: below); the check results. tests/test_gpu.py runs it on cuda."""
    from backends.serve.http import running
    from runner.tools.conformance.core import Ctx, run_suite

    try:
        with running(service) as srv:
            ctx = Ctx(f"http://127.0.0.1:{srv.server_address[1]}", "tml-test", None, atol=5e-3, rtol=5e-3)
            try:
                return run_suite(ctx, ())[1]
            finally:
                ctx.close()
    finally:
        service.close()


@pytest.mark.slow  # back from conformance_results (a helper: no effect there), where b6b20d4 left it
def test_conformance_against_serve_in_bf16(tmp_path, monkeypatch, caplog):
    """Every conformance check passes against `runner serve --dtype bfloat16`, with the numeric checks at
    atol = rtol = 5e-3 (their sampler-vs-trainer checks then allow max |dlogprob| 0.05; measured 0.0174 for
    sampler_weights, 0.0015 for prompt_logprobs; the default 2e-3 allows 0.02 and passes too, narrowly)."""
    pytest.importorskip("tinker")
    import logging

    from backends.serve.http import ServeConfig, build_service

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with caplog.at_level(logging.INFO):
        service = build_service(ServeConfig(storage=tmp_path / "storage", device="cpu", dtype="bfloat16"))
    assert "model tiny: device: cpu bfloat16" in caplog.text
    results = conformance_results(service)
    assert len(results) >= 42
    assert [(r.check, r.detail) for r in results if r.result != "pass"] == []


def test_serve_takes_a_dtype(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--dtype", "float16"])
    assert e.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err


def test_the_env_sets_what_auto_picks(monkeypatch):
    from backends.errors import UserError

    monkeypatch.setenv("RUNNER_LOCAL_DEVICE", "cuda")
    assert place(Local(), TINY_DIR, cuda=True).device.type == "cuda"  # a small model too
    assert place(Local(device="cpu"), TINY_DIR, cuda=True).device.type == "cpu"  # an explicit device wins
    with pytest.raises(UserError, match="RUNNER_LOCAL_DEVICE=cuda but torch sees no CUDA device"):
        place(Local(), TINY_DIR, cuda=False)
    monkeypatch.setenv("RUNNER_LOCAL_DEVICE", "tpu")
    with pytest.raises(UserError, match="expected cpu or cuda"):
        place(Local(), TINY_DIR, cuda=True)


@pytest.mark.slow
def test_numerics_check_passes_in_bf16(tmp_path, monkeypatch, capsys):
    """`runner numerics`: sampler, compute_logprobs and trainer agree on sampled tokens under the default gate."""
    monkeypatch.chdir(tmp_path)
    ref = f"{REPO / 'recipes.toml'}#rl_basic"
    assert main(["numerics", ref, "backend.device=cpu", "backend.dtype=bfloat16"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("ok (max_kl 0.01)")
