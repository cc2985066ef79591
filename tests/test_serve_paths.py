"""What a /v1 request's `model` may name on `runner serve` (runner/tools/openai_serve.py, backends/serve/files.py):
served models, the server's own tinker:// checkpoints and run dirs under the operator's `--runs` folders, never an
arbitrary path; a run's code (a planted `renderer = {kind = "python", target = "mod:fn"}`, or an older run's
`renderer = "mod:fn"`) is imported only under `--trust-code`; files are
opened as regular files (a FIFO checkpoint is refused at once and healthz keeps answering); nothing outside the
server's storage is written (a torn checkpoints.jsonl stays byte-identical)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from backends.serve.http import ServeConfig, build_service, running
from runner.tools.openai_serve import serve_hooks

ASK = [{"role": "user", "content": "hi"}]


@contextlib.contextmanager
def serving(tmp: Path, runs: list[Path] | None = None, trust: list[Path] | None = None) -> Iterator[str]:
    svc = build_service(ServeConfig(storage=tmp / "storage", device="cpu",
                                    openai=serve_hooks(None, runs or [], trust or [])))
    try:
        with running(svc) as srv:
            yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        svc.close()


# 120 s: a chat that loads a run's weights took over 30 s (httpx ReadTimeout) at load 12 on 2 cores; the tests assert
# what is answered or written, not how fast (the FIFO test passes its own 10 s).
def _chat(url: str, model: str, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 2},
                      timeout=timeout)


def _run_dir(root: Path, name: str, renderer: str = "auto", rows: str | None = None, short: bool = False) -> Path:
    """A run dir as `runner run` leaves it: config.toml (a user's renderer "mod:fn" written as runner writes it,
    `{kind = "python", target = "mod:fn"}`; `short`: as an older run's, the string), checkpoints.jsonl naming a
    sampler folder."""
    run = root / name
    folder = run / "checkpoints" / "sampler_weights" / "final"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny", "r": 8,
                                                            "lora_alpha": 32, "target_modules": ["q_proj"],
                                                            "peft_type": "LORA"}))
    (run / "data.jsonl").write_text("")
    spelled = f'{{kind = "python", target = "{renderer}"}}' if ":" in renderer and not short else f'"{renderer}"'
    (run / "config.toml").write_text(f'[recipes.x]\nmodel = "tiny"\nrenderer = {spelled}\n[recipes.x.algo]\n'
                                     f'kind = "sft"\ndata = {{ kind = "jsonl", path = "{run / "data.jsonl"}" }}\n')
    row = {"name": "final", "step": 1, "sampler_path": "checkpoints/sampler_weights/final", "paths": "run"}
    (run / "checkpoints.jsonl").write_text(rows if rows is not None else json.dumps(row) + "\n")
    return run


def _plant(run: Path, module: str, marker: Path) -> None:
    (run / f"{module}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef make(tok):\n    raise ValueError(\"planted\")\n")


def test_a_planted_renderer_is_never_imported_unless_its_root_is_trusted(tmp_path):
    """A foreign folder's config.toml with `renderer = {kind = "python", target = "mod:fn"}` and mod.py beside it:
    named by absolute path (no --runs), under --runs without --trust-code: refused, mod never imported (nor an older
    run's `renderer = "mod:fn"`). Under --trust-code it is imported (the test can see an import)."""
    root = tmp_path / "runs"
    marker = tmp_path / "marker"
    mods = []
    for i in range(4):
        mods.append(f"planted_renderer_{os.getpid()}_{i}")
        _plant(_run_dir(root, f"evil{i}", f"{mods[-1]}:make", short=i == 3), mods[-1], marker)
    assert 'renderer = {kind = "python", target = ' in (root / "evil0" / "config.toml").read_text()
    with serving(tmp_path / "a") as url:  # no --runs: a path names nothing
        r = _chat(url, str(root / "evil0"))
        assert r.status_code == 404 and "--runs" in r.json()["error"]["message"], r.text
    with serving(tmp_path / "b", runs=[root]) as url:
        r = _chat(url, str(root / "evil1"))
        assert r.status_code == 400 and "--trust-code" in r.json()["error"]["message"], r.text
        r = _chat(url, "evil1")  # relative to the --runs folder: the same run, the same refusal
        assert r.status_code == 400 and "--trust-code" in r.json()["error"]["message"], r.text
        r = _chat(url, "evil3")  # an older run's short spelling: the same refusal
        assert r.status_code == 400 and "--trust-code" in r.json()["error"]["message"], r.text
        for name in ("this:x", "antigravity:x", "code:interact"):  # a renderer naming a stdlib module: same
            run = _run_dir(root, name.split(":")[0], name)
            assert _chat(url, str(run)).status_code == 400
    assert not marker.exists() and not any(m in sys.modules for m in (*mods[:2], mods[3]))
    with serving(tmp_path / "c", runs=[root], trust=[root]) as url:
        r = _chat(url, str(root / "evil2"))
        assert r.status_code >= 400  # its factory raises; what matters is that it was imported
    assert marker.read_text() == "ran"


def test_paths_outside_the_runs_folders_name_nothing(tmp_path):
    root, outside = tmp_path / "runs", tmp_path / "outside"
    _run_dir(outside, "victim")
    _run_dir(root, "ok")
    (root / "link").symlink_to(outside / "victim")
    with serving(tmp_path / "s", runs=[root]) as url:
        for model, status in [(str(outside / "victim"), 404), ("../outside/victim", 400), ("link", 404),
                              (str(root / "link"), 404), (f"{root}/../outside/victim", 400), ("/etc", 404),
                              ("ok/../../outside/victim", 400), ("a" * 300, 400), ("b/" * 2000, 404)]:
            r = _chat(url, model)
            assert r.status_code == status, (model[:40], r.text)
            assert "model" in r.json()["error"]["message"]


def test_a_fifo_checkpoint_is_refused_at_once_and_health_keeps_answering(tmp_path):
    root = tmp_path / "runs"
    run = _run_dir(root, "fifo")
    os.mkfifo(run / "checkpoints" / "sampler_weights" / "final" / "adapter_model.safetensors")
    with serving(tmp_path / "s", runs=[root]) as url, ThreadPoolExecutor(1) as ex:
        t = time.monotonic()
        fut = ex.submit(_chat, url, str(run), 10)
        assert httpx.get(f"{url}/api/v1/healthz", timeout=5).json() == {"status": "ok"}
        r = fut.result(timeout=15)
        assert r.status_code == 400 and "not a regular file" in r.json()["error"]["message"], r.text
        # Refused, not hung on the FIFO (a blocking open would have ended in _chat's 10 s ReadTimeout): the bound is
        # that timeout, not how fast a loaded machine answers (was 5 s).
        assert time.monotonic() - t < 15


def test_a_foreign_checkpoints_file_is_never_written(tmp_path):
    root = tmp_path / "runs"
    good = json.dumps({"name": "final", "sampler_path": "checkpoints/sampler_weights/final", "paths": "run"})
    torn = _run_dir(root, "torn", rows=good + "\n" + good[:20])
    unended = _run_dir(root, "unended", rows=good)
    before = {p: p.read_bytes() for p in (torn / "checkpoints.jsonl", unended / "checkpoints.jsonl")}
    with serving(tmp_path / "s", runs=[root]) as url:
        for model in (str(torn), str(unended), f"{torn}:final", "torn"):
            _chat(url, model)
    assert {p: p.read_bytes() for p in before} == before


def test_runs_flags_are_checked(tmp_path, capsys):
    from runner.cli import main

    assert main(["serve", "--runs", str(tmp_path / "nope")]) == 2
    assert "--runs" in capsys.readouterr().err




def test_port_0_without_a_port_file_says_the_port(tmp_path):
    """`runner serve --port 0` alone (was refused: --port-file required): the bound URL is one line on stderr."""
    import re
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "runner", "serve", "--port", "0", "--storage", str(tmp_path / "s")],
                            cwd=repo, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        assert proc.stderr is not None
        deadline, url = time.monotonic() + 120, None  # start-up imports torch: ~11 s idle, more under load
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "runner serve exited"
            if m := re.search(r"runner serve: (http://127\.0\.0\.1:(\d+)) ", line):
                url = m.group(1)
        assert url is not None and not url.endswith(":0")
        assert httpx.get(f"{url}/api/v1/healthz", timeout=10).json() == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
