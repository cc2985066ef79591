"""The command line: output, exit codes, and that check/list never import torch.

    pytest tests/test_cli.py

Most tests call cli.main in-process (fast); a few run `python -m runner` to see real exit codes.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from backends.errors import UserError
from runner.cli import main
from runner.recipe.load import load_recipe

REPO = Path(__file__).resolve().parent.parent

RECIPES = """\
[recipes.sl_basic]
lr = 2e-3
algo = {kind = "sft", data = {kind = "jsonl", path = "data.jsonl"}}

[recipes.remote]
model = "Qwen/Qwen3-8B"
backend = {kind = "tinker"}
algo = {kind = "sft", data = {kind = "jsonl", path = "data.jsonl"}}
"""


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "recipes.toml").write_text(RECIPES)
    return tmp_path


@pytest.fixture
def fake_loop(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """runner.engine.loop replaced by a recorder; `calls[0]`, if set to an exception, is raised instead."""
    calls: list[Any] = []

    def run(recipe: Any, name: str, *, dry_run: bool = False, **_: Any) -> None:
        if calls and isinstance(calls[0], BaseException):
            raise calls[0]
        calls.append((name, recipe, dry_run))

    class Interrupted(Exception):
        pass

    monkeypatch.setitem(sys.modules, "runner.engine.loop", types.SimpleNamespace(run=run, Interrupted=Interrupted,
                                                                         InitWeights=object))
    return calls


def test_list(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    assert capsys.readouterr().out == (
        "sl_basic  sft  tiny           local\n"
        "remote    sft  Qwen/Qwen3-8B  tinker\n"
    )


def test_check_every_recipe_and_one(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check"]) == 0
    assert capsys.readouterr().out == "ok  recipes.toml#sl_basic\nok  recipes.toml#remote\n"
    assert main(["check", "recipes.toml#remote", "lr=1e-5"]) == 0
    assert capsys.readouterr().out == "ok  recipes.toml#remote\n"


def test_check_reports_each_bad_recipe(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "recipes.toml").write_text(RECIPES.replace('lr = 2e-3', 'lr = "fast"') + "\n[recipes.nodata]\n"
                                          'algo = {kind = "sft", data = {kind = "jsonl", path = "gone.jsonl"}}\n')
    assert main(["check"]) == 2
    out, err = capsys.readouterr()
    assert out == "ok  recipes.toml#remote\n"
    assert err == (
        "error: recipes.toml#sl_basic: lr: expected float, got str 'fast'\n"
        f"error: recipes.toml#nodata: algo.data.path: data file not found: gone.jsonl (looked in {workdir} and "
        "next to the recipe file)\n"
    )


def test_user_errors_exit_2_with_one_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        ("show", "recipes.toml#sl_basci"): "error: recipes.toml: no recipe named 'sl_basci' (did you mean "
        "recipes.toml#sl_basic?); available: remote, sl_basic\n",
        ("show", "recipes.toml#sl_basic", "lora.rnak=8"): "error: recipes.toml#sl_basic: lora.rnak: unknown key; "
        "did you mean `rank`? (valid: rank, train_attn, train_mlp, train_unembed)\n",
        ("check", "missing.toml"): "error: missing.toml: file not found\n",
        ("show", "recipes.toml#sl_basic", "lr"): "error: bad override 'lr': expected KEY=VALUE, "
        "e.g. lr=3e-4 or lora.rank=8\n",
    }
    for argv, expected in cases.items():
        assert main(list(argv)) == 2
        assert capsys.readouterr().err == expected


def test_show_output_checks_and_loads_back(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["lr=3e-4", "lora.rank=8", 'schedule={kind="cosine", warmup_steps=2}', "backend.device=cpu"]
    assert main(["show", "recipes.toml#sl_basic", *overrides]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("[recipes.sl_basic]\n")
    (workdir / "shown.toml").write_text(shown)
    assert main(["check", "shown.toml"]) == 0
    assert load_recipe("shown.toml") == load_recipe("recipes.toml#sl_basic", overrides)


def test_run_calls_the_loop(workdir: Path, fake_loop: list[Any]) -> None:
    # Overrides may come before or after --dry-run.
    assert main(["run", "recipes.toml#sl_basic", "lr=1e-3", "--dry-run", "max_steps=3"]) == 0
    [(name, recipe, dry_run)] = fake_loop
    assert (name, recipe.lr, recipe.max_steps, dry_run) == ("sl_basic", 1e-3, 3, True)
    fake_loop.clear()
    assert main(["run", "recipes.toml#remote"]) == 0
    assert fake_loop[0][0] == "remote" and fake_loop[0][2] is False


def test_run_checks_data_first(workdir: Path, fake_loop: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "recipes.toml#sl_basic", "algo.data.path=gone.jsonl"]) == 2
    assert fake_loop == []
    assert capsys.readouterr().err == (
        f"error: recipes.toml#sl_basic: algo.data.path: data file not found: gone.jsonl (looked in {workdir} and "
        "next to the recipe file)\n"
    )


def test_run_exit_codes(workdir: Path, fake_loop: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    from backends.base import BackendError

    ref = "recipes.toml#sl_basic"
    fake_loop.append(UserError("runs/sl_basic holds a different recipe"))
    assert main(["run", ref]) == 2
    # An error raised while it runs names the recipe, as the check's do.
    assert capsys.readouterr().err == "error: recipes.toml#sl_basic: runs/sl_basic holds a different recipe\n"
    fake_loop[0] = KeyboardInterrupt()
    assert main(["run", ref]) == 130
    # The backend's message names the request once (the CLI adds no second prefix).
    fake_loop[0] = BackendError("model not found", "create_model", user_error=True)
    assert main(["run", ref]) == 2
    assert capsys.readouterr().err.endswith("error: create_model: model not found\n")
    # A request the backend gave up on: one line, exit 1, no traceback.
    fake_loop[0] = BackendError("optim_step #3: retries exhausted", "optim_step #3")
    assert main(["run", ref]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: optim_step #3: retries exhausted (") and err.count("optim_step #3") == 1
    # Anything else is a bug: it propagates (the interpreter prints the traceback, exit 1).
    fake_loop[0] = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        main(["run", ref])


def test_run_prefers_passive_openmp_unless_the_user_chose(tmp_path):
    """`runner run` sets OMP_WAIT_POLICY=PASSIVE before torch loads; a user's own setting wins."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from runner.threads import prefer_passive_openmp\n"
        "print(prefer_passive_openmp(), os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "PASSIVE"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "ACTIVE"]
    out = subprocess.run([sys.executable, "-c", "import torch\n" + code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "None"]  # too late once torch is loaded: left alone


def test_check_a_whole_file_from_elsewhere_finds_data_and_modules_next_to_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`cd /tmp && runner check /path/to/recipes.toml` sees what `... recipes.toml#name` sees: data files and user
    modules next to the recipe file (before, checking a whole file skipped that fallback)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (proj / "my_data_mod_xyz.py").write_text("def rows():\n    return []\n")
    (proj / "recipes.toml").write_text(
        RECIPES + '\n[recipes.py]\nalgo = {kind = "sft", data = {kind = "python", target = "my_data_mod_xyz:rows"}}\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))
    ref = str(proj / "recipes.toml")
    assert main(["check", ref]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == f"ok  {ref}#sl_basic\nok  {ref}#remote\nok  {ref}#py\n"
    assert main(["check", f"{ref}#sl_basic"]) == 0
    assert main(["list", ref]) == 0


def test_help_names_only_the_algorithms_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from runner.recipe.schema import Algo

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    named = re.search(r"post-training \(([^)]*)\)", out.replace("\n", " "))
    assert named is not None
    # "custom" is the old spelling of "python", in the union only to be refused with the new one.
    kinds = {t.__struct_config__.tag for t in Algo.__args__} - {"custom"}  # type: ignore[attr-defined]
    named_words = re.findall(r"[A-Za-z_]+", named.group(1).split(":")[0])
    assert {w.lower() for w in named_words if w != "and"} == kinds


# ---------------------------------------------------------------- papercuts a newcomer hit (issue 39)

def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"runner {version('runner')}\n"
    with pytest.raises(SystemExit):
        main(["-h"])
    plot_line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("plot "))
    assert "matplotlib" not in plot_line  # a base dependency: the help said "(needs matplotlib)"


@pytest.mark.parametrize("argv, expected", [
    (["show", "recipes.toml#sl_basc"],
     "error: recipes.toml: no recipe named 'sl_basc' (did you mean recipes.toml#sl_basic?); available: remote, "
     "sl_basic\n"),
    (["check", "recipes.toml#sl_basic", "renderer=lama3"],
     "error: recipes.toml#sl_basic: renderer 'lama3' is unknown (did you mean 'llama3'?); choose one of: auto, hf, "),
    (["run", "sl_basic"], "error: sl_basic: file not found; did you mean recipes.toml#sl_basic?\n"),
    (["run", "sl_basc", "--dry-run"], "error: sl_basc: file not found; did you mean recipes.toml#sl_basic?\n"),
    (["run", "nothing_like_it"], "error: nothing_like_it: file not found\n"),
])
def test_did_you_mean(workdir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_dry_run_and_render_errors_name_the_recipe_as_run_does(workdir: Path, fake_loop: list[Any],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """An error raised while planning (the dry run) or rendering starts with FILE#name: as run's do (they did not),
    and what run checks first (a renderer the tokenizer cannot write) render checks too, in the same words."""
    fake_loop.append(UserError("algo.data: no rows"))
    assert main(["run", "recipes.toml#sl_basic", "--dry-run"]) == 2
    assert capsys.readouterr().err == "error: recipes.toml#sl_basic: algo.data: no rows\n"
    fake_loop.clear()
    errors = []
    for argv in (["run", "recipes.toml#sl_basic", "renderer=llama3"],
                 ["run", "recipes.toml#sl_basic", "renderer=llama3", "--dry-run"],
                 ["render", "recipes.toml#sl_basic", "renderer=llama3"]):
        assert main(argv) == 2
        errors.append(capsys.readouterr().err)
    assert errors[0].startswith("error: recipes.toml#sl_basic: renderer 'llama3': the tokenizer (tiny) does not have")
    assert errors[0] == errors[1] == errors[2]
    (workdir / "data.jsonl").write_text("")
    assert main(["render", "recipes.toml#sl_basic"]) == 2
    assert capsys.readouterr().err.startswith("error: recipes.toml#sl_basic: ")


def test_the_progress_bar_is_closed_before_the_ctrl_c_message() -> None:
    """On a terminal the tqdm bar was redrawn under "interrupted: ..." by the steps still finishing."""
    import io

    from runner.engine.log import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    progress = Progress(10, 0, stream=term)
    progress.update(0, {"train_mean_nll": 1.0})
    progress.interrupt("interrupted: finishing the submitted steps")
    assert progress.bar is None
    progress.update(1, {"train_mean_nll": 0.5})  # a step that was submitted before Ctrl-C finishes
    text = term.getvalue()
    assert text.endswith("interrupted: finishing the submitted steps\n"), repr(text[-200:])
    progress.message("interrupted after 2 of 10 steps")
    assert term.getvalue().endswith("steps\ninterrupted after 2 of 10 steps\n")
