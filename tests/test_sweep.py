"""`runner sweep`: the grid (product, zip, pins, array-typed keys), one-line errors before anything starts, point
dirs and their status, the scheduler (parallel, failures), and end to end on the tiny model: a sweep, a rerun
that reruns nothing, and a kill -9 mid-sweep that the same command completes.

Run: pytest tests/test_sweep.py   (about 20 s on 2 cores; the kill -9 test and the end-to-end sweep are marked slow)
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runner.cli import main
from runner.tools.compare import read_rows
from runner.tools.sweep import plan, point_name, run_sweep, toml_value

REPO = Path(__file__).resolve().parent.parent

RECIPES = """\
[recipes.sl]
lr = 4e-3
max_steps = 3
algo = {kind = "sft", data = {kind = "jsonl", path = "data.jsonl"}, batch_size = 2}

[recipes.grid]
max_steps = 3
algo = {kind = "sft", data = {kind = "jsonl", path = "data.jsonl"}, batch_size = 2}

[recipes.grid.sweep]
lr = [1e-3, 4e-3]
lora.rank = [4, 8]

[recipes.pref]
algo = {kind = "rl", env = {kind = "preference"}, group_size = 2, groups_per_batch = 2, max_tokens = 4}
"""


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "recipes.toml").write_text(RECIPES)
    return tmp_path


def names(sweep: Any) -> list[str]:
    return [p.name for p in sweep.points]


# ---------------------------------------------------------------- the grid

def test_product_zip_pins_and_the_recipes_sweep_table(workdir: Path) -> None:
    s = plan("recipes.toml#sl", ["lr=[1e-3,4e-3]", "lora.rank=[8,16]", "seed=3"])
    # Points in grid order (the first axis slowest); dir names list the keys sorted, so they do not depend on it.
    assert names(s) == ["lora.rank=8,lr=0.001", "lora.rank=16,lr=0.001", "lora.rank=8,lr=0.004",
                        "lora.rank=16,lr=0.004"]
    assert names(plan("recipes.toml#sl", ["lora.rank=[8,16]", "lr=[1e-3,4e-3]"])) == [
        "lora.rank=8,lr=0.001", "lora.rank=8,lr=0.004", "lora.rank=16,lr=0.001", "lora.rank=16,lr=0.004"]
    assert s.dir == Path("runs/sl") and s.plain == ["seed=3"]
    p = s.points[1]
    assert (p.recipe.lr, p.recipe.lora.rank, p.recipe.seed) == (1e-3, 16, 3)
    assert p.recipe.log_dir == "runs/sl/lora.rank=16,lr=0.001" and p.status == "new"

    zipped = plan("recipes.toml#sl", ["lr=[1e-3,4e-3]", "lora.rank=[8,16]", "seed=[7]"], zip_=True)
    assert names(zipped) == ["lora.rank=8,lr=0.001,seed=7", "lora.rank=16,lr=0.004,seed=7"]

    # The recipe's own sweep table; a plain value pins one of its axes (a slice, same dirs); an array replaces it.
    assert names(plan("recipes.toml#grid")) == ["lora.rank=4,lr=0.001", "lora.rank=8,lr=0.001",
                                                "lora.rank=4,lr=0.004", "lora.rank=8,lr=0.004"]
    assert names(plan("recipes.toml#grid", ["lr=4e-3"])) == ["lora.rank=4,lr=0.004", "lora.rank=8,lr=0.004"]
    assert names(plan("recipes.toml#grid", ["lora.rank=[2]", "log_dir=sweeps/g"])) == [
        "lora.rank=2,lr=0.001", "lora.rank=2,lr=0.004"]
    assert plan("recipes.toml#grid", ["log_dir=sweeps/g"]).points[0].recipe.log_dir == "sweeps/g/lora.rank=4,lr=0.001"


def test_a_key_that_takes_an_array_is_swept_by_an_array_of_arrays(workdir: Path) -> None:
    # algo.env.prompts is list[str]: an array is its value (every point), as in `runner run` ...
    one = plan("recipes.toml#pref", ['algo.env.prompts=["a", "b"]', "lr=[1e-3,1e-2]"])
    assert names(one) == ["lr=0.001", "lr=0.01"]
    assert all(p.recipe.algo.env.prompts == ["a", "b"] for p in one.points)  # type: ignore[union-attr]
    # ... and an array of arrays sweeps it.
    two = plan("recipes.toml#pref", ['algo.env.prompts=[["a"], ["b", "c"]]'])
    assert names(two) == ["algo.env.prompts=a", "algo.env.prompts=b+c"]
    assert [p.recipe.algo.env.prompts for p in two.points] == [["a"], ["b", "c"]]  # type: ignore[union-attr]
    # W&B: the points of a sweep are one group; a name the recipe gives gets the point added.
    w = plan("recipes.toml#sl", ["lr=[1e-3]", 'log={wandb={project="p"}}']).points[0].recipe.log.wandb
    assert w is not None and (w.group, w.name) == ("sl", None)
    named = 'log={wandb={project="p", name="n", group="g"}}'
    w = plan("recipes.toml#sl", ["lr=[1e-3]", named]).points[0].recipe.log.wandb
    assert w is not None and (w.group, w.name) == ("g", "n/lr=0.001")
    # A table is set before the keys inside it, whichever of them is swept.
    inner = plan("recipes.toml#sl", ["backend.lora_alpha=[16.0,32.0]", 'backend={kind="local", device="cpu"}'])
    assert [msgspec.to_builtins(p.recipe.backend) for p in inner.points] == [
        {"kind": "local", "device": "cpu", "dtype": "auto", "lora_alpha": a, "full_finetune": False, "packed": True,
         "attention": "auto", "sampler_weights": "auto", "local_files_only": False}
        for a in (16, 32)]
    outer = plan("recipes.toml#sl", ["backend.device=cpu", 'backend=[{kind="local", lora_alpha=8.0}]'])
    assert msgspec.to_builtins(outer.points[0].recipe.backend) == {
        "kind": "local", "device": "cpu", "dtype": "auto", "lora_alpha": 8.0, "full_finetune": False, "packed": True, "attention": "auto",
        "sampler_weights": "auto", "local_files_only": False}
    # A table value names its keys.
    three = plan("recipes.toml#sl", ['backend=[{kind="local", device="cpu"}, {kind="tinker"}]'])
    assert names(three) == ["backend.device=cpu,backend.kind=local", "backend.kind=tinker"]


def test_point_names_are_stable_safe_and_unique() -> None:
    assert point_name({"lr": 1e-5, "lora.rank": 8, "x": True}) == "lora.rank=8,lr=1e-05,x=true"
    assert point_name({"x": True, "lora.rank": 8, "lr": 1e-5}) == "lora.rank=8,lr=1e-05,x=true"
    odd = point_name({"model": "Qwen/Qwen3-8B"})
    assert odd.startswith("model=Qwen_Qwen3-8B-") and odd == point_name({"model": "Qwen/Qwen3-8B"})
    assert odd != point_name({"model": "Qwen_Qwen3-8B"})  # replaced characters add a hash of the exact value
    long = point_name({"algo.env.prompts": ["word " * 40]})
    assert len(long) <= 120 and "/" not in long
    for v in [1e-3, -2, "a\"b\\c\x7f", [1, {"k": "v"}], {"a b": 1}, True, 1.5e300]:
        import tomllib

        assert tomllib.loads(f"v = {toml_value(v)}")["v"] == v


# ---------------------------------------------------------------- errors: one line, exit 2, nothing started

@pytest.mark.parametrize(("args", "expected"), [
    (["lr=[]"], "error: recipes.toml#sl: lr: empty list: nothing to sweep (give at least one value)\n"),
    (["lr2=[1e-3,2e-3]"], "error: recipes.toml#sl point lr2=0.001: lr2: unknown key; did you mean `lr`?"),
    (["lr=[1e-3,-1.0]"], "error: recipes.toml#sl point lr=-1.0: lr: expected float > 0.0, got -1.0\n"),
    (["lora.rank=[8,\"x\"]", "lr=[1e-3]"],
     "error: recipes.toml#sl point lora.rank=x,lr=0.001: lora.rank: expected int, got str 'x'\n"),
    (["lr=[1e-3,2e-3]", "algo.batch_size=0"],
     "error: recipes.toml#sl point lr=0.001: algo.batch_size: expected int >= 1, got 0\n"),
    (["lr=[1e-3,2e-3]", "seed=[1,2,3]", "--zip"],
     "error: recipes.toml#sl: --zip pairs the values, so every swept key needs as many (lr has 2, seed has 3)\n"),
    (["lr=[1e-3,1e-3]"], "error: recipes.toml#sl: point lr=0.001 appears twice in the grid (a value repeated?)\n"),
    (['log_dir=["a","b"]'], "error: recipes.toml#sl: log_dir: cannot be swept"),
    (["lr=1e-3"], "error: recipes.toml#sl: nothing to sweep: give KEY=[v1, v2, ...]"),
    # A grid over MAX_POINTS (1,000) is refused before a point is built; a 53 MB argument took > 300 s to parse.
    (["lr=[" + ",".join(f"{i}e-6" for i in range(1, 101)) + "]", "seed=[" + ",".join(map(str, range(20))) + "]"],
     "error: recipes.toml#sl: the grid has 2,000 points (100 lr x 20 seed), more than 1,000; sweep fewer values"),
    (["lr=[" + ",".join(f"{i}e-6" for i in range(1, 1002)) + "]", "--zip"],
     "error: recipes.toml#sl: --zip makes 1,001 points, more than 1,000"),
    (["seed=[" + ",".join(map(str, range(200_000))) + "]"],
     "error: override seed=...: 1,288,891 characters, more than 1,000,000; put a value that large in the recipe"),
    (["lr=[1e-3,2e-3]", "algo.data.path=gone.jsonl"],
     "error: recipes.toml#sl point lr=0.001: algo.data.path: data file not found: gone.jsonl"),
])
def test_bad_sweeps_are_one_line_and_start_nothing(workdir: Path, capsys: pytest.CaptureFixture[str],
                                                   args: list[str], expected: str) -> None:
    assert main(["sweep", "recipes.toml#sl", *args]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert out == "" and not (workdir / "runs").exists()


def test_a_bad_value_in_the_recipes_sweep_table_is_found_by_check(workdir: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "recipes.toml#grid"]) == 0
    assert capsys.readouterr().out == "ok  recipes.toml#grid (sweep: 4 points)\n"
    (workdir / "recipes.toml").write_text(RECIPES.replace("rank = [4, 8]", "rank = [4, 0]"))
    assert main(["check"]) == 2
    out, err = capsys.readouterr()
    assert out == "ok  recipes.toml#sl\nok  recipes.toml#pref\n"
    assert err == "error: recipes.toml#grid point lora.rank=0,lr=0.001: lora.rank: expected int >= 1, got 0\n"
    (workdir / "recipes.toml").write_text(RECIPES.replace("lr = [1e-3, 4e-3]", "lr = 1e-3"))
    assert main(["sweep", "recipes.toml#grid"]) == 2
    assert capsys.readouterr().err.startswith("error: recipes.toml#grid: sweep.lr: expected an array of the values")


def test_run_refuses_a_sweep_recipe_and_show_round_trips_it(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "recipes.toml#grid"]) == 2
    assert capsys.readouterr().err == (
        "error: recipes.toml#grid sweeps lr, lora.rank ([recipes.grid.sweep]): run it with `runner sweep "
        "recipes.toml#grid` (KEY=VALUE there runs one slice of the grid)\n")
    assert main(["show", "recipes.toml#grid", "seed=[1,2]"]) == 0
    (workdir / "shown.toml").write_text(capsys.readouterr().out)
    shown, original = plan("shown.toml#grid"), plan("recipes.toml#grid", ["seed=[1,2]"])
    assert sorted(names(shown)) == sorted(names(original)) and len(shown.points) == 8
    assert {p.name: p.recipe for p in shown.points} == {p.name: p.recipe for p in original.points}
    assert main(["check", "shown.toml"]) == 0


def test_a_point_dir_holding_another_recipe_stops_the_sweep_before_it_starts(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = plan("recipes.toml#sl", ["lr=[1e-3,4e-3]"])
    other = sweep.points[1]
    run_dir = Path(other.recipe.log_dir or "")
    run_dir.mkdir(parents=True)
    from runner.engine.rundir import dump_config

    (run_dir / "config.toml").write_text(dump_config("sl", other.recipe))
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "progress/done_frac": 0.3}\n')
    assert main(["sweep", "recipes.toml#sl", "lr=[1e-3,4e-3]", "seed=5"]) == 2
    assert capsys.readouterr().err == (
        "error: recipes.toml#sl point lr=0.004: run dir runs/sl/lr=0.004 holds a different recipe (differs in: seed); "
        "set if_exists = \"overwrite\" (moves it aside) or another log_dir\n")
    assert not (workdir / "runs/sl/lr=0.001").exists()
    # A sweep dir that is a run dir is refused too.
    (workdir / "runs/x").mkdir(parents=True)
    (workdir / "runs/x/config.toml").write_text("")
    assert main(["sweep", "recipes.toml#sl", "lr=[1e-3,4e-3]", "log_dir=runs/x"]) == 2
    assert "runs/x is a run dir (it has config.toml), not a sweep dir" in capsys.readouterr().err


# ---------------------------------------------------------------- status and the scheduler (no training)

def fake_run(run_dir: Path, steps: int, final: bool) -> None:
    rows = [{"step": s, "train_mean_nll": 5.0 - s, "progress/done_frac": (s + 1) / 3} for s in range(steps)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = {"name": "final" if final else f"{steps:06d}", "step": steps - 1, "next_step": steps, "state_path": "x"}
    (run_dir / "checkpoints.jsonl").write_text(json.dumps(ckpt) + "\n")


def test_dry_run_says_what_each_point_holds(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = plan("recipes.toml#sl", ["lr=[1e-3,2e-3,4e-3]"])
    from runner.engine.rundir import dump_config

    for p, (steps, final) in zip(sweep.points[:2], [(3, True), (2, False)], strict=True):
        d = Path(p.recipe.log_dir or "")
        d.mkdir(parents=True)
        (d / "config.toml").write_text(dump_config("sl", p.recipe))
        fake_run(d, steps, final)
    (Path(sweep.points[1].recipe.log_dir or "") / "metrics.jsonl").open("a").write('{"step": 2, "trai')  # torn
    assert main(["sweep", "recipes.toml#sl", "lr=[1e-3,2e-3,4e-3]", "--dry-run", "--parallel", "4"]) == 0
    assert capsys.readouterr().out == (
        "sweep runs/sl: 3 points (lr); 2 to run, 2 at a time\n"
        "  runs/sl/lr=0.001  finished (3 steps)\n"
        "  runs/sl/lr=0.002  partial: 2 steps checkpointed, resumes at step 2\n"
        "  runs/sl/lr=0.004  new\n")
    assert (Path(sweep.points[1].recipe.log_dir or "") / "metrics.jsonl").read_text().endswith('"trai')  # read only
    # A larger max_steps extends the finished point.
    assert plan("recipes.toml#sl", ["lr=[1e-3]", "max_steps=5"]).points[0].status.startswith("partial: 3 steps")


FAKE_POINT = """\
import json, pathlib, sys, time
config = pathlib.Path(sys.argv[1])
d = config.parent
(d / "events").open("a").write(f"start {time.monotonic()}\\n")
time.sleep(2.0)
if "0.002" in d.name:
    print("error: this point is broken")
    sys.exit(2)
with open(d / "metrics.jsonl", "a") as f:
    for s in range(3):
        f.write(json.dumps({"step": s, "train_mean_nll": 3.0 - s, "progress/done_frac": (s + 1) / 3}) + "\\n")
(d / "checkpoints.jsonl").write_text(json.dumps({"name": "final", "next_step": 3, "state_path": "x"}) + "\\n")
(d / "events").open("a").write(f"end {time.monotonic()}\\n")
"""


def test_points_run_in_parallel_and_one_failure_does_not_stop_the_others(
        workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = workdir / "fake_point.py"
    script.write_text(FAKE_POINT)
    monkeypatch.setattr("runner.tools.sweep.point_command", lambda config: [sys.executable, str(script), str(config)])
    sweep = plan("recipes.toml#sl", ["lr=[1e-3,2e-3,4e-3,8e-3]"])
    out = io.StringIO()
    assert run_sweep(sweep, parallel=2, out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("sweep runs/sl: 4 points (lr); 4 to run, 2 at a time")
    assert sum(line.split()[1] == "start" for line in lines[1:]) == 4
    [failed] = [line for line in lines if "FAILED" in line]
    assert "lr=0.002" in failed and "exit 2" in failed and "error: this point is broken" in failed
    assert "3 steps  train_mean_nll 1.0000" in next(line for line in lines if "done   lr=0.008" in line)
    assert lines[-1] == "sweep runs/sl: 3 of 4 points done; failed: lr=0.002"
    # Two at a time: the second started while the first still slept (each sleeps 2 s after its start: room for a
    # loaded machine's Python start, 1 s was tight), the third only once one had ended.
    ev = {p.name: (Path(p.recipe.log_dir or "") / "events").read_text().split() for p in sweep.points}
    starts = sorted(float(e[1]) for e in ev.values())
    assert starts[1] < starts[0] + 2.0 and starts[2] >= starts[0] + 2.0, starts
    # Each point has its config.toml (the command it ran) and its output; sweep.json records the grid.
    record = json.loads((workdir / "runs/sl/sweep.json").read_text())
    assert record["axes"] == {"lr": [0.001, 0.002, 0.004, 0.008]} and len(record["points"]) == 4
    assert "error: this point is broken" in (workdir / "runs/sl/lr=0.002/output.log").read_text()
    # Again: the finished points are not started, the failed one is.
    out = io.StringIO()
    assert run_sweep(plan("recipes.toml#sl", ["lr=[1e-3,2e-3,4e-3,8e-3]"]), parallel=2, out=out) == 1
    assert [line.split()[2] for line in out.getvalue().splitlines() if " start " in line] == ["lr=0.002"]


# ---------------------------------------------------------------- end to end on the tiny model

def sweep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "runner", "sweep", f"{REPO}/recipes.toml#sl_basic", "lr=[1e-3,4e-3]", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow  # a real sweep, run twice: ~30 s
def test_sweep_runs_every_point_and_a_second_time_reruns_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    done = subprocess.run(sweep_cmd("max_steps=5", "--parallel", "2"), cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    sweep_dir = tmp_path / "runs" / "sl_basic"
    for lr in ("0.001", "0.004"):
        run_dir = sweep_dir / f"lr={lr}"
        assert [r["step"] for r in read_rows(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]  # 5: final eval
        assert f"lr = {lr}" in (run_dir / "config.toml").read_text()
        assert f'log_dir = "runs/sl_basic/lr={lr}"' in (run_dir / "config.toml").read_text()
        assert f"done   lr={lr}" in done.stdout
    assert "report: runs/sl_basic/index.html" in done.stdout and (sweep_dir / "index.html").exists()
    before = {p: p.read_text() for p in sweep_dir.glob("*/*.jsonl")}

    again = subprocess.run(sweep_cmd("max_steps=5"), cwd=tmp_path, env=env(), capture_output=True, text=True,
                           timeout=120, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "all finished before: nothing to run" in again.stdout and " start " not in again.stdout
    assert {p: p.read_text() for p in sweep_dir.glob("*/*.jsonl")} == before  # no new rows, sessions, checkpoints

    # The comparison and the plot of it (in-process; tests/test_compare_plot.py has the details).
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "runs/sl_basic"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["run", "lr", "steps"] and len(rows) == 2
    # Both evals were at step 0 (the same test/nll), so the train NLL decides: the larger lr first.
    assert rows[0].split()[:3] == ["runs/sl_basic/lr=0.004", "0.004", "5"]
    assert rows[1].split()[:3] == ["runs/sl_basic/lr=0.001", "0.001", "5"]
    pytest.importorskip("matplotlib")
    assert main(["plot", "runs/sl_basic", "--metric", "train_mean_nll", "-o", "x.png"]) == 0
    assert capsys.readouterr().out == "wrote x.png (2 runs)\n"
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_kill_9_mid_sweep_then_the_same_command_completes_it(tmp_path: Path) -> None:
    args = ("max_steps=12", "save_every=4", "--parallel", "2")
    proc = subprocess.Popen(sweep_cmd(*args), cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    first = tmp_path / "runs/sl_basic/lr=0.001/checkpoints.jsonl"
    try:
        deadline = time.monotonic() + 300  # two points start at once: torch and the model, each, under load
        while not first.exists() or not first.read_text():
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    time.sleep(1.0)  # the points die with the sweep (PR_SET_PDEATHSIG): no row lands after this
    killed = {d.name: len(read_rows(d / "metrics.jsonl")) for d in (tmp_path / "runs/sl_basic").glob("lr=*")}
    time.sleep(1.0)
    assert killed == {d.name: len(read_rows(d / "metrics.jsonl")) for d in (tmp_path / "runs/sl_basic").glob("lr=*")}
    assert 0 < killed["lr=0.001"] < 12

    done = subprocess.run(sweep_cmd(*args), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lr=0.001  partial:" in done.stdout  # the start line says it resumes
    for lr in ("0.001", "0.004"):
        run_dir = tmp_path / f"runs/sl_basic/lr={lr}"
        assert [r["step"] for r in read_rows(run_dir / "metrics.jsonl")] == list(range(13))  # 12: final eval
    sessions = read_rows(tmp_path / "runs/sl_basic/lr=0.001/sessions.jsonl")
    assert len(sessions) == 2 and sessions[1]["start_step"] > 0  # resumed from its checkpoint, not from scratch


def test_a_list_of_bare_words_sweeps_those_strings(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`backend.dtype=[bfloat16,float32]` is not TOML (bare words), so it was one string and the sweep said
    "nothing to sweep: give KEY=[v1, v2, ...]", the form the user gave. Each word is a string, as an override's
    value that is not a TOML literal is; TOML lists and mixed ones still parse as before."""
    s = plan("recipes.toml#sl", ["backend.dtype=[bfloat16, float32,]", "lr=[1e-3]"])
    assert names(s) == ["backend.dtype=bfloat16,lr=0.001", "backend.dtype=float32,lr=0.001"]
    assert [p.recipe.backend.dtype for p in s.points] == ["bfloat16", "float32"]  # type: ignore[union-attr]
    assert [p.recipe.lora.rank for p in plan("recipes.toml#sl", ["lora.rank=[4,8]"]).points] == [4, 8]
    assert main(["sweep", "recipes.toml#sl", "backend.dtype=[bfloat16,float17]", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "point backend.dtype=float17: backend.dtype: invalid choice 'float17'" in err and err.count("\n") == 1
