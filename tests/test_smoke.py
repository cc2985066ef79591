"""`--smoke` (runner/tools/smoke.py): every shipped recipe runs offline in seconds, Tinker recipes without a key or the
network, hub data without a stand-in is one line, `show --smoke` prints what runs, and a recipe whose model config and
tokenizer are local gets a small random-init model of its family."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import tomllib
from pathlib import Path

import pytest

from runner.cli import main
from runner.recipe.load import read_tables

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory that sees the repo's examples/ (recipes name data relative to the repo root), a
    private stand-in model cache, no Tinker key, and no network: any TCP connection fails the test."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    shutil.copy(REPO / "recipes.toml", tmp_path / "recipes.toml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUNNER_SMOKE_CACHE", str(tmp_path / "models"))
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.setenv("TINKER_BASE_URL", "http://192.0.2.1:9")  # unroutable: a client that tried would hang/fail
    real_connect = socket.socket.connect

    def connect(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"--smoke opened a network connection to {address}")
        real_connect(self, address)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", connect)
    return tmp_path


def _table(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("recipe "))
    return {line.split()[0]: line.split()[1:] for line in lines[start + 1:] if line.strip()}


@pytest.mark.slow  # every shipped recipe run 2 steps: ~55 s
def test_smoke_every_shipped_recipe(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`runner smoke recipes.toml` and `runner smoke examples/cookbook.toml`: every recipe ok, 2 steps, chains in
    stages, Tinker recipes on the local backend, run dirs <name>-smoke."""
    assert main(["smoke", "recipes.toml"]) == 0
    rows = _table(capsys.readouterr().out)
    names = tomllib.loads((REPO / "recipes.toml").read_text())["recipes"]
    assert set(rows) == set(names)
    for name, (stages, steps, _, result) in rows.items():
        assert result == "ok", (name, rows[name])
        assert steps == "2", name
    assert rows["rlhf_rl"][0] == "3" and rows["prompt_distill"][0] == "2" and rows["sl_basic"][0] == "1"
    # A local JSONL file is smoked on its first rows.
    sl = tomllib.loads((workdir / "runs" / "sl_basic-smoke" / "config.toml").read_text())["recipes"]["sl_basic"]
    head = Path(sl["algo"]["data"]["path"])
    assert head == Path("runs/.smoke/data/sl_basic.algo.data.jsonl")
    full = (REPO / "examples" / "data" / "chat_sft.jsonl").read_text().splitlines(keepends=True)
    assert len(full) > 256 and head.read_text() == "".join(full[:256])

    assert main(["smoke", "examples/cookbook.toml"]) == 0
    rows = _table(capsys.readouterr().out)
    cookbook = read_tables(str(REPO / "examples" / "cookbook.toml"))  # [defaults] and extends merged in
    assert set(rows) == set(cookbook) >= {"chat_sl", "dpo_hhh", "rlhf_sft", "rlhf_rm", "rlhf_rl", "distillation",
                                          "prompt_distillation"}
    assert all(r[3] == "ok" and r[1] == "2" for r in rows.values()), rows
    for name, raw in cookbook.items():
        assert raw["backend"]["kind"] == "tinker" and "smoke" in raw, name  # real service configs, each smokable
        config = tomllib.loads((workdir / "runs" / f"{name}-smoke" / "config.toml").read_text())["recipes"][name]
        assert config["backend"]["kind"] == "local" and config["model"] == "tiny" and config["max_steps"] == 2
    # The multi-teacher set kept its two prompt sets, each from its own stand-in file.
    dist = tomllib.loads((workdir / "runs" / "distillation-smoke" / "config.toml").read_text())["recipes"]
    paths = [d["prompts"]["args"]["path"] for d in dist["distillation"]["algo"]["datasets"]]
    # (found next to the recipe file, so recorded as absolute paths: the smoke runs from anywhere)
    assert [p.split("examples/")[-1] for p in paths] == ["data/deepmath_sample.jsonl", "data/tulu3_sample.jsonl"]


def test_run_smoke_of_a_tinker_recipe_and_rerun(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Tinker recipe (a hub model, hub data) runs with --smoke without a key; running again starts over."""
    assert main(["run", "examples/cookbook.toml#chat_sl", "--smoke"]) == 0
    run = workdir / "runs" / "chat_sl-smoke"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {0, 1, 2} and "test/nll" in rows[0]  # 2 steps, the final eval at 2
    (run / "marker").write_text("old")
    assert main(["run", "examples/cookbook.toml#chat_sl", "--smoke", "lr=3e-4"]) == 0
    assert not (run / "marker").exists()
    assert tomllib.loads((run / "config.toml").read_text())["recipes"]["chat_sl"]["lr"] == 3e-4
    capsys.readouterr()


def test_hub_data_without_a_stand_in_is_one_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "r.toml").write_text('[recipes.x]\nmodel = "Qwen/Qwen3-8B"\nbackend = {kind = "tinker"}\n'
                                    '[recipes.x.algo]\nkind = "sft"\n'
                                    'data = {kind = "hf", name = "HuggingFaceH4/no_robots"}\n')
    assert main(["run", "r.toml#x", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: r.toml#x: --smoke: algo.data is the hub dataset")
    assert 'set smoke.data."algo.data" = {kind = "jsonl"' in err
    (workdir / "r.toml").write_text((workdir / "r.toml").read_text() + (workdir / "r.toml").read_text().replace(
        "recipes.x", "recipes.y"))
    assert main(["smoke", "r.toml"]) == 1
    out, err = capsys.readouterr()
    assert "FAILED: r.toml#x: --smoke: algo.data is the hub dataset" in out
    assert not (workdir / "runs" / "x-smoke").exists()
    # Each recipe's log starts with a line naming it (it did not: a log streamed with no recipe's name on it).
    assert [line for line in err.splitlines() if line.startswith("== smoke")] == [
        "== smoke r.toml#x (1/2)", "== smoke r.toml#y (2/2)"]


def test_smoke_table_is_validated(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = '[recipes.x]\n[recipes.x.algo]\nkind = "sft"\ndata = {kind = "jsonl", path = "examples/data/chat_sft.jsonl"}\n'
    (workdir / "a.toml").write_text(base + "[recipes.x.smoke]\nstepz = 3\n")
    assert main(["check", "a.toml"]) == 2
    assert "smoke.stepz: unknown key; did you mean `steps`?" in capsys.readouterr().err
    (workdir / "b.toml").write_text(base + '[recipes.x.smoke.data]\n"algo.dta" = {kind = "jsonl", path = "examples/data/chat_sft.jsonl"}\n')
    assert main(["show", "b.toml#x", "--smoke"]) == 2
    err = capsys.readouterr().err
    assert "smoke.data: 'algo.dta' is not a data source of this recipe (its data sources: algo.data)" in err
    assert main(["check", "b.toml"]) == 2  # `runner check` smokes the smoke table too
    assert "smoke.data: 'algo.dta' is not a data source" in capsys.readouterr().err
    (workdir / "c.toml").write_text(base + '[recipes.x.smoke]\nenv = {kind = "arithmetic"}\n')
    assert main(["show", "c.toml#x", "--smoke"]) == 2
    assert "smoke.env: algo kind 'sft' has no env" in capsys.readouterr().err


def test_show_smoke_prints_every_stage(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "examples/cookbook.toml#rlhf_rl", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# --smoke: runs") and "#rlhf_sft -> #rlhf_rm -> #rlhf_rl" in out.splitlines()[0]
    doc = tomllib.loads(out)["recipes"]
    assert list(doc) == ["rlhf_sft", "rlhf_rm", "rlhf_rl"]
    rl = doc["rlhf_rl"]
    smoke_file = str((workdir / "runs" / ".smoke" / "cookbook.toml").resolve())
    assert rl["init_from"] == f"{smoke_file}#rlhf_sft"
    assert rl["algo"]["env"]["judge"]["init_from"] == f"{smoke_file}#rlhf_rm"
    assert (rl["backend"]["kind"], rl["model"], rl["max_steps"], rl["log_dir"]) == ("local", "tiny", 2,
                                                                                    "runs/rlhf_rl-smoke")
    assert (rl["algo"]["group_size"], rl["algo"]["groups_per_batch"], rl["algo"]["max_tokens"]) == (2, 2, 16)
    assert "smoke" not in rl and rl["save_every"] == 0
    assert doc["rlhf_rm"]["algo"]["data"]["path"].endswith("examples/data/hh_rlhf_sample.jsonl")
    assert not Path(smoke_file).exists()  # show writes nothing


def test_show_smoke_does_not_import_torch(workdir: Path) -> None:
    import subprocess

    code = ("import sys; from runner.cli import main; "
            "assert main(['show', 'examples/cookbook.toml#distillation', '--smoke']) == 0; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={
        "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(workdir)}, cwd=workdir, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "teacher" in out.stdout


def test_stand_in_of_the_same_family(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model whose config and tokenizer are local (here: the tiny model's config and tokenizer, no weights) gets a
    small random-init model of that family with the very same tokenizer; a chain's stages share it."""
    src = workdir / "family"
    src.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(REPO / "backends" / "local" / "assets" / "tiny" / f, src / f)
    (workdir / "f.toml").write_text(f'''
[recipes.sft]
model = "{src}"
backend = {{kind = "tinker"}}
[recipes.sft.algo]
kind = "sft"
data = {{kind = "hf", name = "HuggingFaceH4/no_robots"}}
[recipes.sft.smoke]
data = {{"algo.data" = {{kind = "jsonl", path = "examples/data/chat_sft.jsonl"}}}}

[recipes.rl]
model = "{src}"
backend = {{kind = "tinker"}}
init_from = "#sft"
[recipes.rl.algo]
kind = "rl"
env = {{kind = "arithmetic", max_value = 9}}
''')
    assert main(["smoke", "f.toml", "rl"]) == 0
    assert "rl " in capsys.readouterr().out
    built = list((workdir / "models").iterdir())
    assert len(built) == 1
    cfg = json.loads((built[0] / "config.json").read_text())
    original = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == original["model_type"] and cfg["vocab_size"] == original["vocab_size"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (64, 2) != (original["hidden_size"],
                                                                         original["num_hidden_layers"])
    assert (built[0] / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    for name in ("sft", "rl"):
        config = tomllib.loads((workdir / "runs" / f"{name}-smoke" / "config.toml").read_text())["recipes"][name]
        assert config["model"] == str(built[0])


def test_cookbook_hh_rlhf_conversion() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("cookbook_data", REPO / "examples" / "cookbook_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hh_comparison, hh_rlhf = module.hh_comparison, module.hh_rlhf
    row = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 4",
           "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: 5"}
    assert hh_comparison(row) == {
        "prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": "2+2?"}],
        "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]}
    assert hh_comparison({"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: c\n\nAssistant: d"}) is None
    rows = hh_rlhf(path=str(REPO / "examples" / "data" / "hh_rlhf_sample.jsonl"))
    assert len(rows) == 10  # of 11: the malformed one is skipped


def test_stand_in_of_a_cached_hub_model(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A hub id whose config and tokenizer are in the Hugging Face cache (no weights needed) is stood in for by a
    small model of its family; one that is not cached by the tiny model. Neither touches the network."""
    import huggingface_hub.constants

    snapshot = workdir / "hub" / "models--acme--Chat-8B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (workdir / "hub" / "models--acme--Chat-8B" / "refs").mkdir()
    (workdir / "hub" / "models--acme--Chat-8B" / "refs" / "main").write_text("abc123")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(REPO / "backends" / "local" / "assets" / "tiny" / f, snapshot / f)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(workdir / "hub"))
    body = ('[recipes.{name}]\nmodel = "{model}"\nbackend = {{kind = "tinker"}}\n[recipes.{name}.algo]\nkind = "rl"\n'
            'env = {{kind = "arithmetic", max_value = 9}}\n')
    (workdir / "h.toml").write_text(body.format(name="cached", model="acme/Chat-8B")
                                    + body.format(name="absent", model="acme/Other-70B"))
    assert main(["smoke", "h.toml"]) == 0
    capsys.readouterr()
    models = {name: tomllib.loads((workdir / "runs" / f"{name}-smoke" / "config.toml").read_text())["recipes"][name]
              ["model"] for name in ("cached", "absent")}
    assert models["absent"] == "tiny"
    assert Path(models["cached"]).parent == workdir / "models" and "acme_Chat-8B" in models["cached"]
    assert json.loads((Path(models["cached"]) / "config.json").read_text())["num_hidden_layers"] == 2
