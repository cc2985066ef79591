"""Hub models download on first use (backends/hub.py), through a fake hub on 127.0.0.1 (tests/fake_hub.py) with
the real huggingface_hub client: progress on stderr, the Hugging Face cache, HF_HUB_OFFLINE=1 and local_files_only
respected, one line when it cannot be had. Never the network. The cases of backends/hub.py run in a fresh process:
huggingface_hub reads HF_ENDPOINT and HF_HOME when it is imported. The runner commands (run, check, a tokenizer by
hub id) run in this one, with huggingface_hub's cache and offline flag patched to the test's (`hub_home`), so torch
and transformers are not imported again per test; the download itself is a child process either way.

    pytest tests/test_hub_download.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fake_hub import fake_hub

from runner.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "backends" / "local" / "assets" / "tiny"
REPO = "someorg/tiny-chat"
FIX = f"download it first (hf download {REPO}) or name a local folder"


HUB_VARS = ("HF_", "TRANSFORMERS_")  # the machine's own settings of these are left out of every case


def hub_env(cwd: Path) -> dict[str, str]:
    """The Hugging Face settings of a case: its cache (HF_HOME) in `cwd`, no telemetry."""
    return {"HF_HOME": str(cwd / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture
def hub_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process as `python()` starts a child: no HF_/TRANSFORMERS_ variables, HF_HOME in tmp_path (which a
    download child reads), and huggingface_hub's constants, read when it was imported, set to the same."""
    import huggingface_hub.constants

    for name in [k for k in os.environ if k.startswith(HUB_VARS)]:
        monkeypatch.delenv(name)
    for name, value in hub_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def child_env(cwd: Path, **env: str) -> dict[str, str]:
    """A child's environment: this one without the machine's HF_/TRANSFORMERS_ variables, the repo on the path,
    hub_env(cwd), then `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(HUB_VARS)}
    return {**clean, "PYTHONPATH": str(ROOT), **hub_env(cwd), **env}


def python(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=child_env(cwd, **env), capture_output=True,
                          text=True, timeout=240)


# Each case prints one JSON line: the folder, or the UserError's message.
CASES = textwrap.dedent(f"""
    import json, os, sys
    import huggingface_hub.constants  # reads HF_HUB_OFFLINE (unset) now: the cases below set it for our own check only
    from backends.errors import UserError
    from backends.hub import snapshot

    def case(repo, **kw):
        try:
            out = str(snapshot(repo, "model", **kw))
        except UserError as e:
            out = "error: " + str(e)
        print(json.dumps(out), flush=True)
        print("--- end of case", file=sys.stderr, flush=True)

    os.environ["HF_HUB_OFFLINE"] = "1"
    case("{REPO}")                          # offline: the cache only
    del os.environ["HF_HUB_OFFLINE"]
    case("{REPO}", local_files_only=True)   # the backend's local_files_only: the same
    print("REQUESTS", file=sys.stderr, flush=True)
    case("{REPO}")                          # downloads
    case("{REPO}")                          # from the cache
    os.environ["HF_HUB_OFFLINE"] = "1"
    case("{REPO}")                          # offline, cached: fine
    del os.environ["HF_HUB_OFFLINE"]
    case("someorg/not-there")               # the hub says 404
    os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there
    case("someorg/other")
""")


def test_snapshot_downloads_once_and_respects_offline(tmp_path: Path) -> None:
    with fake_hub({REPO: TINY}) as hub:
        proc = python(["-c", CASES], tmp_path, HF_ENDPOINT=hub.url)
        assert proc.returncode == 0, proc.stderr
        offline, pinned, first, cached, cached_offline, missing, down = map(json.loads, proc.stdout.splitlines())
        assert offline == (f"error: model {REPO!r} is not in the Hugging Face cache and downloads are off "
                           f"(HF_HUB_OFFLINE=1); {FIX}")
        assert pinned == (f"error: model {REPO!r} is not in the Hugging Face cache and downloads are off "
                          f"(local_files_only = true); {FIX}")
        cache = tmp_path / "hf-home" / "hub"
        assert first == cached == cached_offline and Path(first).parent.parent == cache / "models--someorg--tiny-chat"
        assert (Path(first) / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()
        assert {p.name for p in Path(first).iterdir()} == {p.name for p in TINY.iterdir()}
        # Progress on stderr: our line, then huggingface_hub's bars; the first two cases asked the hub nothing.
        stderr_cases = proc.stderr.split("--- end of case")
        assert stderr_cases[0].strip() == "" and stderr_cases[1].strip() == ""
        assert f"model {REPO}: not in the Hugging Face cache, downloading it from {hub.url} into {cache}" in stderr_cases[2]
        assert "Fetching" in stderr_cases[2] and "downloading" not in stderr_cases[3] + stderr_cases[4]
        gets = [r for r in hub.requests if r.startswith("GET ") and r.endswith("/model.safetensors")]
        assert len(gets) == 1  # downloaded once
        assert missing.startswith(f"error: cannot download model 'someorg/not-there' from {hub.url} (")
        assert missing.endswith("or name a local folder") and "\n" not in missing
        assert down == ("error: model 'someorg/other' is not in the Hugging Face cache and the hub "
                        "(http://127.0.0.1:9) cannot be reached; download it first (hf download someorg/other) or "
                        "name a local folder")


def test_runner_run_trains_a_hub_model_it_downloads(hub_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    tmp_path = hub_home
    (tmp_path / "r.toml").write_text(f"""\
[recipes.hub]
model = "{REPO}"
max_steps = 1
save_every = 0
eval_every = 0
backend = {{kind = "local", device = "cpu"}}
algo = {{kind = "sft", data = {{kind = "jsonl", path = "d.jsonl"}}, batch_size = 2, max_length = 64}}
""")
    (tmp_path / "d.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 4)
    with fake_hub({REPO: TINY}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        code = main(["run", "r.toml#hub"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"model {REPO}: not in the Hugging Face cache, downloading it from {hub.url}" in err
    assert any(r.endswith("/model.safetensors") for r in hub.requests), hub.requests
    rows = [json.loads(line) for line in (tmp_path / "runs/hub/metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["train_mean_nll"] > 0


def test_local_files_only_is_not_part_of_a_runs_identity() -> None:
    """Keeping to the cache on a rerun resumes the run: where the files come from is not what trains."""
    from runner.engine.rundir import recipe_diff
    from runner.recipe.load import decode_recipe

    def recipe(**backend: object):
        return decode_recipe({"algo": {"kind": "sft", "data": {"kind": "jsonl", "path": "d.jsonl"}},
                              "backend": {"kind": "local", **backend}}, "t")

    assert recipe_diff(recipe(), recipe(local_files_only=True)) == []
    assert recipe_diff(recipe(), recipe(lora_alpha=8.0)) == ["backend.lora_alpha"]


# ------------------------------------------------------------------ a hub that misbehaves (issue #43)
# One download in a fresh process: prints {"out": folder or the UserError's message, "s": seconds it took}.
ONE = textwrap.dedent("""
    import json, sys, time
    from backends.errors import UserError
    from backends.hub import snapshot
    start = time.monotonic()
    try:
        out = str(snapshot(sys.argv[1], "model"))
    except UserError as e:
        out = "error: " + str(e)
    print(json.dumps({"out": out, "s": time.monotonic() - start}), flush=True)
""")
BIG = 1 << 20


def big_repo(tmp_path: Path, size: int = BIG) -> Path:
    """A repo with a weights file of random bytes (the download does not parse it)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text('{"model_type": "llama"}')
    (repo / "model.safetensors").write_bytes(os.urandom(size))
    return repo


def download(tmp_path: Path, hub_url: str, repo: str = REPO, **env: str) -> dict[str, object]:
    proc = python(["-c", ONE, repo], tmp_path, HF_ENDPOINT=hub_url, HF_HUB_DISABLE_PROGRESS_BARS="1", **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_dropped_download_resumes_where_the_hub_serves_ranges(tmp_path: Path) -> None:
    """The connection drops after every 12 MiB of a 24 MiB file: the hub client asks for the rest from its last
    whole 10 MiB chunk (Range) and the file completes, sent about once."""
    repo = big_repo(tmp_path, 24 * BIG)
    with fake_hub({REPO: repo}, drop_after=12 * BIG) as hub:
        got = download(tmp_path, hub.url)
        assert (Path(str(got["out"])) / "model.safetensors").read_bytes() == (repo / "model.safetensors").read_bytes()
        assert any(r.endswith(f"/model.safetensors bytes={10 * BIG}-") for r in hub.requests), hub.requests
        assert hub.sent < 1.5 * 24 * BIG


def test_a_hub_that_resends_from_the_start_gives_up_after_the_retries(tmp_path: Path) -> None:
    """Dropped after 256 KiB and no ranges: the hub client started over forever (the issue: 51 GB in 200 s with
    no error). Now no new byte for RUNNER_HUB_STALL_S ends a try, and RUNNER_HUB_RETRIES bounds the tries."""
    with fake_hub({REPO: big_repo(tmp_path)}, drop_after=BIG // 4, ranges=False) as hub:
        got = download(tmp_path, hub.url, RUNNER_HUB_STALL_S="2", RUNNER_HUB_RETRIES="1")
        assert got["out"] == (f"error: cannot download model {REPO!r} from {hub.url} (no progress for 2 s, "
                              f"RUNNER_HUB_STALL_S; gave up after 2 tries, RUNNER_HUB_RETRIES); {FIX}")
        assert float(str(got["s"])) < 30 and hub.sent < 20 * BIG


def test_a_metadata_request_that_never_answers_times_out(tmp_path: Path) -> None:
    with fake_hub({REPO: big_repo(tmp_path)}, stall="/api/models/") as hub:
        got = download(tmp_path, hub.url, RUNNER_HUB_STALL_S="1", RUNNER_HUB_RETRIES="0")
        assert got["out"] == (f"error: cannot download model {REPO!r} from {hub.url} (no progress for 1 s, "
                              f"RUNNER_HUB_STALL_S; gave up after 1 try, RUNNER_HUB_RETRIES); {FIX}")
        assert float(str(got["s"])) < 60  # never answered: without the bound it waits for python()'s 240 s


def test_a_download_past_the_overall_timeout_stops(tmp_path: Path) -> None:
    """4 KiB every 0.1 s (a 1 MiB file in 25 s): progress all along, stopped by RUNNER_HUB_TIMEOUT_S (well before
    the file could have come: the bound is the 25 s, not how busy the machine is)."""
    with fake_hub({REPO: big_repo(tmp_path)}, trickle=4096) as hub:
        got = download(tmp_path, hub.url, RUNNER_HUB_TIMEOUT_S="1.5", RUNNER_HUB_STALL_S="20")
        assert got["out"] == (f"error: cannot download model {REPO!r} from {hub.url} (not done after 1.5 s, "
                              f"RUNNER_HUB_TIMEOUT_S); {FIX}")
        assert float(str(got["s"])) < 20


def test_bad_bounds_are_one_line(tmp_path: Path) -> None:
    with fake_hub({REPO: big_repo(tmp_path)}) as hub:
        got = download(tmp_path, hub.url, RUNNER_HUB_STALL_S="soon")
    assert got["out"] == "error: RUNNER_HUB_STALL_S must be a number of seconds > 0, got 'soon'"


def test_ctrl_c_during_a_stalled_download_exits_within_seconds(tmp_path: Path) -> None:
    """The issue measured 54 s (the hub client's threads). The child that downloads is gone too."""
    repo = f"someorg/ctrl-c-{os.getpid()}"
    with fake_hub({repo: big_repo(tmp_path)}, stall="/api/models/") as hub:
        proc = subprocess.Popen([sys.executable, "-c", ONE, repo], cwd=tmp_path, env=child_env(tmp_path, HF_ENDPOINT=hub.url),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "downloading it from" in line, line
        # Until the download's child asks for the repo's metadata, which never comes (polled: a fixed 1 s was more
        # than an idle machine needs and perhaps less than a loaded one does).
        deadline = time.monotonic() + 60
        while not any(r.startswith("GET /api/models/") for r in hub.requests) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(r.startswith("GET /api/models/") for r in hub.requests), hub.requests
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        proc.communicate(timeout=30)
        # The bug took 54 s (the hub client's threads); an idle machine exits in ~0.1 s. 10 s tells the two apart
        # with room for a loaded CI machine.
        assert time.monotonic() - start < 10.0
        time.sleep(0.3)
        alive = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if repo.encode() in cmdline.read_bytes():
                    alive.append(cmdline)
            except OSError:
                pass
        assert alive == []


def test_check_says_when_an_uncached_hub_model_cannot_be_had(hub_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """issue #39: with HF_HUB_OFFLINE=1 `runner check` said ok for a hub model not in the cache, and the run failed
    seconds later. Now check stops with the run's line (local_files_only too); once cached, ok."""
    tmp_path = hub_home
    (tmp_path / "r.toml").write_text(f"""\
[recipes.l]
model = "{REPO}"
max_steps = 1
algo = {{kind = "sft", data = {{kind = "jsonl", path = "d.jsonl"}}, batch_size = 2}}
""")
    (tmp_path / "d.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 4)
    check = ["check", "r.toml#l"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(check) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: r.toml#l: model {REPO!r} is not in the Hugging Face cache and downloads are off (HF_HUB_OFFLINE=1); "
        f"{FIX}")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert main([*check, "backend.local_files_only=true"]) == 2
    assert "downloads are off (local_files_only = true)" in capsys.readouterr().err
    with fake_hub({REPO: TINY}) as hub:
        assert "error" not in download(tmp_path, hub.url)["out"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(check)
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() == "ok  r.toml#l", err


def test_a_tokenizer_by_hub_id_downloads_its_files_only(hub_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """load_tokenizer (the Tinker backend's, dry runs') downloads through the same bounded child, and only the
    tokenizer's files: no weights."""
    from backends.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with fake_hub({REPO: TINY}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert len(load_tokenizer(REPO).encode("hi")) == 2
        err = capsys.readouterr().err
        assert f"tokenizer {REPO}: not in the Hugging Face cache, downloading it from {hub.url}" in err
        gets = [r for r in hub.requests if r.startswith("GET /someorg/")]
        assert any(r.endswith("/tokenizer.json") for r in gets) and not any("safetensors" in r for r in gets), gets
