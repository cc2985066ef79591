"""`runner conformance` against `runner serve` (tiny, in a thread, driven by the real tinker SDK): every check
passes; a server with one loss off by 2x is reported as FAILED with the numbers (or as a known gap when the
server is named in known_gaps); a hanging check fails by its timeout instead of hanging the suite."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("tinker")

import backends.local.backend as local_backend
from backends.serve.http import ServeConfig, build_service, running
from runner.cli import main
from runner.tools.conformance import core
from runner.tools.conformance.core import Check, Ctx, run_suite

KEY = "tml-test"


@pytest.fixture
def url(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service = build_service(ServeConfig(storage=tmp_path / "storage", device="cpu"))
    with running(service) as srv:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    service.close()


def _run(url: str, only: tuple[str, ...] = (), **kw):
    ctx = Ctx(url, KEY, None)
    try:
        return run_suite(ctx, only, **kw)
    finally:
        ctx.close()


def test_runner_serve_passes_every_check(url):
    server, results = _run(url)
    assert server == "runner-serve"
    by = {r.check: r for r in results}
    assert {r.group for r in results} == set(core.GROUPS)
    bad = [(r.check, r.result, r.detail) for r in results if r.result not in ("pass", "known gap")]
    assert not bad
    # The losses are checked against formulas computed here, not against the server's own numbers.
    for name in ("loss/cross_entropy", "loss/importance_sampling", "loss/ppo", "loss/ppo_defaults", "loss/cispo",
                 "loss/cispo_defaults", "loss/dro", "loss/gspo"):
        assert by[name].result == "pass", name
    assert "HTTP 400" in by["error/unknown_model"].detail


def test_a_loss_off_by_2x_fails_with_the_numbers(url, monkeypatch):
    real = local_backend.batch_loss

    def broken(loss_fn, *args, **kw):
        out = real(loss_fn, *args, **kw)
        return out * 2 if loss_fn == "ppo" else out

    monkeypatch.setattr(local_backend, "batch_loss", broken)
    _, results = _run(url, ("losses",))
    by = {r.check: r for r in results}
    for name in ("loss/ppo", "loss/ppo_defaults"):
        assert by[name].result == "FAIL"
        assert "documented formula gives" in by[name].detail and "2x" in by[name].detail
    assert by["loss/importance_sampling"].result == "pass" and by["loss/cispo"].result == "pass"
    assert core.failed(results)

    # Named in known_gaps, the same failure is a known gap with its reason, and the run does not fail.
    gaps = {"runner-serve": {"loss/ppo": "ppo is doubled on purpose", "loss/ppo_defaults": "same"}}
    _, results = _run(url, ("loss/ppo", "loss/ppo_defaults"), known_gaps=gaps)
    assert [r.result for r in results] == ["known gap", "known gap"]
    assert results[0].detail.startswith("ppo is doubled on purpose (observed: forward ppo loss:sum")
    assert not core.failed(results)


def test_a_hanging_check_fails_by_its_timeout(monkeypatch):
    def hangs(ctx):
        time.sleep(300)  # a daemon thread, abandoned by the suite

    monkeypatch.setattr(core, "CHECKS", [Check("hangs", "sessions", hangs, 0.3)])
    monkeypatch.setattr(Ctx, "server_name", lambda self: None)
    t0 = time.monotonic()
    server, results = run_suite(Ctx("http://127.0.0.1:9", KEY, "tiny"), ["hangs"])
    assert time.monotonic() - t0 < 60  # the check's 0.3 s, not the hang's 300 s
    assert server == "unknown"
    assert results[0].result == "FAIL" and "no answer within 0.3s" in results[0].detail


def test_cli_json_and_exit_codes(url, capsys, monkeypatch):
    monkeypatch.setenv("CONF_KEY", KEY)
    assert main(["conformance", "--base-url", url, "--api-key-env", "CONF_KEY", "--only", "sessions", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["server"] == "runner-serve" and out["sdk_version"]
    assert {r["check"] for r in out["results"]} >= {"capabilities", "create_training_client", "tokenizer"}
    assert all(r["result"] == "pass" for r in out["results"])
    assert main(["conformance", "--base-url", url, "--only", "nonsense"]) == 2
    assert "--only nonsense: not a group or check" in capsys.readouterr().err
    # Nothing listening: one clear line, before any SDK client (which would retry for minutes).
    assert main(["conformance", "--base-url", "http://127.0.0.1:9"]) == 2
    assert "--base-url http://127.0.0.1:9: nothing answers there" in capsys.readouterr().err
    # A failing check: exit 1, FAIL in the table (--timeout caps each check).
    monkeypatch.setattr(core.Ctx, "capabilities", lambda self: time.sleep(300))
    t0 = time.monotonic()
    assert main(["conformance", "--base-url", url, "--only", "capabilities", "--timeout", "1"]) == 1
    assert time.monotonic() - t0 < 60  # the 1 s timeout and the SDK client's set-up, not the 300 s hang
    assert "capabilities  sessions  FAIL    no answer within 1s" in capsys.readouterr().out


def test_known_gaps_scoped_by_sdk_version():
    gaps = {"load_state@sdk<0.38": "old SDKs load into an existing run", "capabilities": "always"}
    assert core.gap_reason(gaps, "load_state", "0.36.0") == "old SDKs load into an existing run"
    assert core.gap_reason(gaps, "load_state", "0.38.0") is None
    assert core.gap_reason(gaps, "capabilities", "0.38.0") == "always"
    assert core.gap_reason(gaps, "tokenizer", "0.25.0") is None
    # Every shipped known gap names a registered check (a renamed check must not leave a stale gap behind).
    names = {c.name for c in core.select()}
    assert all(key.partition("@")[0] in names for gaps in core.KNOWN_GAPS.values() for key in gaps)


def test_a_5xx_for_bad_input_fails(url, monkeypatch):
    """A server that answers an unknown model with a 500 (which the SDK retries for minutes) fails the check
    by its timeout, with the reason, instead of hanging the suite."""
    from backends.serve import service as serve_service

    def served(self, name):
        raise serve_service.ApiError(500, "internal error")

    monkeypatch.setattr(serve_service.Service, "_served", served)
    t0 = time.monotonic()
    _, results = _run(url, ("error/unknown_model",), max_timeout_s=2)
    assert time.monotonic() - t0 < 60  # the 2 s cap, not the SDK's minutes of retries
    assert results[0].result == "FAIL" and "no answer within 2s" in results[0].detail


def test_without_a_tokenizer_the_checks_use_raw_token_ids(url, monkeypatch):
    """A client that cannot load the tokenizer (the service's come from the Hub) still runs the numeric checks."""
    monkeypatch.setattr(Ctx, "tokenizer", lambda self: None)
    _, results = _run(url, ("losses", "stop_token", "stop_string"))
    by = {r.check: r.result for r in results}
    assert by.pop("stop_string") == "skip"
    assert set(by.values()) == {"pass"}


def test_a_server_that_reuses_the_seed_per_row_fails(url, monkeypatch):
    """A seeded num_samples=4 request answered with 4 copies of one sample (a seed reused per row) fails
    seeded_rows_differ: runner's RL sends a group's first turn as one such request."""
    from backends.local.sampler import Sampler
    from backends.types import SampleOutput

    real = Sampler.sample_stream  # the local sampling client's path (continuous batching)

    def copies(self, requests, more, done):
        def first_only(i, out):
            done(i, out if isinstance(out, ValueError) else SampleOutput(sequences=[out.sequences[0]] * len(out.sequences)))
        return real(self, requests, more, first_only)

    _, results = _run(url, ("seeded_rows_differ",))
    assert [r.result for r in results] == ["pass"] and "distinct rows of 4" in results[0].detail
    monkeypatch.setattr(Sampler, "sample_stream", copies)
    _, results = _run(url, ("seeded_rows_differ",))
    assert [r.result for r in results] == ["FAIL"], results
    assert "the seed is reused for every row" in results[0].detail
