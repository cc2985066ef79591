"""Recipe chaining (`init_from`, runner/engine/chain.py): upstream recipes run first, the downstream starts from their final
weights (fresh optimizer, step 0), and every bad chain is one line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cli import main
from runner.engine.log import read_jsonl
from scripts.tiny_build import sft_conversations

STAGE = """
[recipes.{name}]
lr = 0.05
max_steps = {steps}
eval_every = 0
save_every = 0
{extra}
algo = {{kind = "sft", data = {{kind = "jsonl", path = "data.jsonl"}}, batch_size = 4}}
lora = {{rank = 4}}
backend = {{kind = "local", device = "cpu"}}
"""


def stage(name: str, steps: int, extra: str = "") -> str:
    return STAGE.format(name=name, steps=steps, extra=extra)


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    rows = sft_conversations(64, seed=3)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def nll(run_dir: Path) -> list[float]:
    return [r["train_mean_nll"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train_mean_nll" in r]


def test_chain_runs_the_upstream_first_and_starts_from_its_final_weights(
        proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (proj / "recipes.toml").write_text(stage("warm", 8) + stage("next", 2, 'init_from = "#warm"'))
    assert main(["run", "recipes.toml#next"]) == 0
    warm, nxt = nll(proj / "runs" / "warm"), nll(proj / "runs" / "next")
    assert len(warm) == 8 and len(nxt) == 2
    # The downstream's first step sees the upstream's trained weights, not the base model's.
    assert nxt[0] < warm[0] - 0.5 and abs(nxt[0] - warm[-1]) < 0.5 * (warm[0] - warm[-1])
    init = json.loads((proj / "runs" / "next" / "init_from.json").read_text())
    assert init["name"] == "warm" and init["checkpoint"] == "final" and "[recipes.warm]" in init["recipe"]
    # config.toml names the upstream absolutely, so the run dir's recipe is runnable from anywhere.
    config = (proj / "runs" / "next" / "config.toml").read_text()
    assert f'init_from = "{(proj / "recipes.toml").resolve()}#warm"' in config
    # Again: both finished, nothing reruns (no new session in either).
    sessions = [len(read_jsonl(proj / "runs" / n / "sessions.jsonl")) for n in ("warm", "next")]
    assert main(["run", "recipes.toml#next"]) == 0
    assert [len(read_jsonl(proj / "runs" / n / "sessions.jsonl")) for n in ("warm", "next")] == sessions


def test_chain_of_three_through_a_file_reference_and_a_run_dir(proj: Path) -> None:
    (proj / "up.toml").write_text(stage("first", 3))
    (proj / "recipes.toml").write_text(stage("second", 2, 'init_from = "up.toml#first"')
                                       + stage("third", 1, 'init_from = "#second"'))
    assert main(["check", "recipes.toml"]) == 0
    assert main(["run", "recipes.toml#third"]) == 0
    assert [len(nll(proj / "runs" / n)) for n in ("first", "second", "third")] == [3, 2, 1]
    # A run dir as the reference: used as it is.
    (proj / "fromdir.toml").write_text(stage("fourth", 1, 'init_from = "runs/third"'))
    assert main(["run", "fromdir.toml#fourth"]) == 0
    assert json.loads((proj / "runs" / "fourth" / "init_from.json").read_text())["name"] == "third"


@pytest.mark.parametrize("recipes, message", [
    (stage("a", 1, 'init_from = "#b"') + stage("b", 1, 'init_from = "#a"'), "cycle (#a -> #b -> #a)"),
    (stage("a", 1, 'init_from = "#nope"'), "no recipe named 'nope'"),
    (stage("a", 1, 'init_from = "other.toml#x"'), "recipe file not found: other.toml"),
    (stage("a", 1, 'init_from = "no/such/dir"'), "nor a run dir"),
    (stage("a", 1, 'init_from = "#b"') + stage("b", 1).replace("rank = 4", "rank = 8"), "lora.rank 8 vs 4"),
])
def test_bad_chains_are_one_line_exit_2_nothing_written(
        proj: Path, capsys: pytest.CaptureFixture[str], recipes: str, message: str) -> None:
    (proj / "recipes.toml").write_text(recipes)
    for argv in (["check", "recipes.toml#a"], ["run", "recipes.toml#a"], ["run", "recipes.toml#a", "--dry-run"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (proj / "runs").exists()


def test_changing_the_upstream_after_the_downstream_trained_is_refused(
        proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (proj / "recipes.toml").write_text(stage("warm", 2) + stage("next", 2, 'init_from = "#warm"'))
    assert main(["run", "recipes.toml#next"]) == 0
    # The upstream's recipe changes: its own run dir refuses it first ...
    (proj / "recipes.toml").write_text(stage("warm", 2).replace("lr = 0.05", "lr = 0.01")
                                       + stage("next", 3, 'init_from = "#warm"'))
    assert main(["run", "recipes.toml#next"]) == 2
    assert "runs/warm holds a different recipe (differs in: lr)" in capsys.readouterr().err
    # ... and once it is re-run, the downstream that trained from the old one is refused, never silently mixed.
    (proj / "recipes.toml").write_text(stage("warm", 2, 'if_exists = "overwrite"').replace("lr = 0.05", "lr = 0.01")
                                       + stage("next", 3, 'init_from = "#warm"'))
    assert main(["run", "recipes.toml#next"]) == 2
    err = capsys.readouterr().err
    assert "was trained from init_from #warm as it was then, which has changed (its recipe differs in: lr)" in err
    assert len(nll(proj / "runs" / "next")) == 2


def test_dry_run_and_show_name_the_chain(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (proj / "recipes.toml").write_text(stage("warm", 2) + stage("next", 2, 'init_from = "#warm"'))
    assert main(["run", "recipes.toml#next", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "chain: #warm (new) -> next" in out and "init_from: #warm" in out
    assert not (proj / "runs").exists()
    assert main(["show", "recipes.toml#next"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("# chain (init_from): #warm (") and "[recipes.next]" in shown


def test_chain_on_the_tinker_backend(proj: Path, mocked_tinker: None) -> None:
    """The downstream starts from the upstream's tinker:// state, weights only (the SDK's create from state without
    optimizer)."""
    remote = 'model = "Qwen/Qwen3-8B"\ntokenizer = "tiny"\n'
    text = (stage("warm", 3, remote) + stage("next", 2, remote + 'init_from = "#warm"'))
    text = text.replace("lr = 0.05", "lr = 0.02")  # qwen3-rendered rows: 0.05 overshoots at the third step
    (proj / "recipes.toml").write_text(text.replace('{kind = "local", device = "cpu"}', '{kind = "tinker"}'))
    assert main(["run", "recipes.toml#next"]) == 0
    init = json.loads((proj / "runs" / "next" / "init_from.json").read_text())
    assert init["state_path"].startswith("tinker://")
    warm, nxt = nll(proj / "runs" / "warm"), nll(proj / "runs" / "next")
    # The downstream's first step sees the upstream's final weights: below even the upstream's last step.
    assert nxt[0] < warm[-1] < warm[0], (warm, nxt)


def test_check_of_a_long_chain_loads_each_recipe_once(proj: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`runner check` of a file holding an init_from chain of 40 recipes: each recipe is loaded a bounded number of
    times and its data checked once (the walk was exponential: 4,095 dependency walks for 12 recipes, > 600 s for
    50), and a chain past MAX_CHAIN is one line."""
    import runner.engine.chain as chain

    n = 40
    text = stage("r0", 1) + "".join(stage(f"r{i}", 1, f'init_from = "#r{i - 1}"') for i in range(1, n))
    (proj / "r.toml").write_text(text)
    loads = checks = 0
    real_load, real_check = chain.load_recipe, chain.check_recipe

    def load(*a, **k):  # type: ignore[no-untyped-def]
        nonlocal loads
        loads += 1
        return real_load(*a, **k)

    def check(*a, **k):  # type: ignore[no-untyped-def]
        nonlocal checks
        checks += 1
        return real_check(*a, **k)

    monkeypatch.setattr(chain, "load_recipe", load)
    monkeypatch.setattr(chain, "check_recipe", check)
    assert main(["check", "r.toml"]) == 0
    assert capsys.readouterr().out.count("ok  ") == n
    assert loads <= n and checks <= 2 * n, (loads, checks)  # a quadratic walk: 780 loads

    monkeypatch.setattr(chain, "MAX_CHAIN", 10)
    assert main(["check", f"r.toml#r{n - 1}"]) == 2
    err = capsys.readouterr().err
    assert "init_from chain longer than 10 runs" in err and err.count("\n") == 1
