"""`runner serve` as a subprocess, driven by the real tinker SDK over real HTTP: SFT steps, sampling,
checkpoints, a server restart on the same --storage, and resuming from what the first server saved (the second server
requires an API key, which is never logged)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def runner_serve(storage: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`runner serve --port 0 --port-file F` in a subprocess; yields (base URL, process); stops it with SIGTERM."""
    port_file = storage.parent / f"{storage.name}.port"
    port_file.unlink(missing_ok=True)
    log = open(storage.parent / f"{storage.name}.log", "ab")  # noqa: SIM115 - open while the server runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "serve", "--port", "0", "--port-file", str(port_file),
         "--storage", str(storage), *args],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    try:
        deadline = time.monotonic() + 120  # start-up reads the models' shapes (http.py warm_shapes): ~20 s busy
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"runner serve did not start: {(storage.parent / f'{storage.name}.log').read_text()}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text().strip()}", proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def service_client(url: str, key: str = "tml-test") -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        yield sc
    finally:
        sc.close("success").result(timeout=30)


def _datums(tok) -> list[types.Datum]:
    out = []
    for text in ("The capital of France is Paris.", "Two plus two is four.", "Water boils at 100 degrees."):
        ids = tok.encode(text)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
    return out


@pytest.mark.slow  # two `runner serve` processes (a restart): ~28 s
def test_sft_sample_save_restart_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    storage = tmp_path / "storage"
    adam = types.AdamParams(learning_rate=1e-2)
    with runner_serve(storage) as (url, _), service_client(url) as sc:
        tc = sc.create_lora_training_client("tiny", rank=8, seed=0).result()
        tok = tc.get_tokenizer()  # get_info's tokenizer_id: a local folder, loaded offline
        data = _datums(tok)
        losses = []
        for _ in range(4):  # pipelined: fwd/bwd and optim submitted back to back
            fb, op = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
            losses.append(fb.result().metrics["loss:sum"])
            assert op.result().metrics["grad_norm:mean"] > 0
        assert losses[-1] < losses[0] * 0.9, losses

        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tok.encode("The capital"))
        res = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=1, temperature=1.0)).result()
        assert len(res.sequences) == 3 and len({s.sequence_id for s in res.sequences}) == 3
        for s in res.sequences:
            assert 1 <= len(s.tokens) <= 6 and len(s.logprobs) == len(s.tokens)
        again = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=1, temperature=1.0)).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]  # seeded: repeatable
        lps = sampler.compute_logprobs(prompt).result()
        assert lps[0] is None and len(lps) == prompt.length and all(x < 0 for x in lps[1:])

        state = tc.save_state("step4").result().path
        weights = tc.save_weights_for_sampler("step4").result().path
        assert state == f"tinker://{tc.model_id}/weights/step4"
        after = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        # The next step from the saved state, for comparison with the resumed server's.
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam).result()
        next_loss = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        first_run = tc.model_id

    # A new server process on the same storage: it lists, loads and resumes what the first one saved. This one requires
    # an API key (--api-key-env): the right key works, a wrong one is refused, and neither is logged.
    secret = "tml-secret-123"
    with runner_serve(storage, "--api-key-env", "SERVE_KEY", env={"SERVE_KEY": secret}) as (url, _), \
            service_client(url, secret) as sc:
        bad = tinker.ServiceClient(base_url=url, api_key="tml-wrong")
        with pytest.raises(tinker.AuthenticationError):
            bad.create_lora_training_client("tiny", rank=4).result()
        rc = tinker.RestClient(base_url=url, api_key=secret)
        runs = rc.list_training_runs().result().training_runs
        assert first_run in [r.training_run_id for r in runs]
        cps = {c.tinker_path for c in rc.list_checkpoints(first_run).result().checkpoints}
        assert {state, weights} <= cps
        tc2 = sc.create_training_client_from_state_with_optimizer(state).result()
        assert tc2.model_id != first_run  # session ids never repeat across restarts
        assert tc2.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(after, rel=1e-5)
        tc2.forward_backward(data, "cross_entropy")
        tc2.optim_step(adam).result()
        # Optimizer state came back too: the resumed step lands where the uninterrupted one did.
        assert tc2.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(next_loss, rel=1e-4)
        sampler2 = sc.create_sampling_client(model_path=weights).result()
        res2 = sampler2.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=1, temperature=1.0)).result()
        assert [s.tokens for s in res2.sequences] == [s.tokens for s in res.sequences]
    log = (storage.parent / "storage.log").read_text()  # both servers', each stopped
    assert "Traceback" not in log and "tml-test" not in log and secret not in log
