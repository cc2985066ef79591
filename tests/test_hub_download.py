"""Hub models download on first use (backends/hub.py), through a fake hub on 127.0.0.1 (tests/fake_hub.py) with
the real huggingface_hub client: progress on stderr, the Hugging Face cache, HF_HUB_OFFLINE=1 and local_files_only
respected, one line when it cannot be had. Never the network. Each case runs in a fresh process: huggingface_hub
reads HF_ENDPOINT and HF_HOME when it is imported.

    pytest tests/test_hub_download.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fake_hub import fake_hub

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "backends" / "local" / "assets" / "tiny"
REPO = "someorg/tiny-chat"
FIX = f"download it first (hf download {REPO}) or name a local folder"


def python(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    full = {**clean, "PYTHONPATH": str(ROOT), "HF_HOME": str(cwd / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
            **env}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=240)


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


def test_runner_run_trains_a_hub_model_it_downloads(tmp_path: Path) -> None:
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
        proc = python(["-m", "runner", "run", "r.toml#hub"], tmp_path, HF_ENDPOINT=hub.url)
    assert proc.returncode == 0, proc.stderr
    assert f"model {REPO}: not in the Hugging Face cache, downloading it from {hub.url}" in proc.stderr
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
