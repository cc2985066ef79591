"""The training loop on the fake backend: pipelining order, checkpoints, resume, run-dir rules, schedules.

Run: pytest tests/test_loop.py   (a few seconds, CPU only)
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import msgspec
import pytest

from backends.errors import UserError
from backends.fake import FakeBackend
from backends.local.tiny import build_tokenizer
from runner.engine.loop import run
from runner.engine.rundir import METRICS, open_run_dir
from runner.engine.schedule import multiplier
from runner.recipe.schema import Recipe

TOK = build_tokenizer()


def write_data(path: Path, n: int = 40) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"answer {i * 7 % 13}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_recipe(tmp_path: Path, **over) -> Recipe:
    algo = {"kind": "sft", "data": {"kind": "jsonl", "path": str(write_data(tmp_path / "data.jsonl"))},
            "batch_size": 4, "test_size": 8, **over.pop("algo", {})}
    raw = {"algo": algo, "lr": 0.05, "log_dir": str(tmp_path / "run"), "eval_every": 3, "save_every": 2, **over}
    return msgspec.convert(raw, Recipe)


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def calls_of(backend: FakeBackend, prefix: str) -> list[str]:
    return [c for c in backend.calls if c.startswith(prefix)]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_pipelining_order(tmp_path, depth):
    recipe = make_recipe(tmp_path, depth=depth, max_steps=6)
    fb = FakeBackend(TOK, delay=0.005)
    run(recipe, "t", backend=fb)
    calls = fb.calls
    at = calls.index
    for k in range(6):
        # forward_backward and optim_step go out back to back...
        assert at(f"submit optim#{k}") == at(f"submit fb#{k}") + 1
        # ...and step k + depth + 1 is only submitted once step k has been awaited (the queue is bounded)...
        if k + depth + 1 < 6:
            assert at(f"await fb#{k}") < at(f"submit fb#{k + depth + 1}")
        # ...while with depth >= 1, step k + depth is submitted before step k's result is awaited.
        if depth and k + depth < 6:
            assert at(f"submit fb#{k + depth}") < at(f"await fb#{k}")
    # Checkpoints (after steps 2, 4 and the last) are queued right behind their step's optim_step.
    saves = calls_of(fb, "submit save#")
    assert len(saves) == 3
    for n, k in enumerate([1, 3, 5]):
        assert calls[at(f"submit optim#{k}") + 1] == f"submit save#{n}"
        assert calls[at(f"submit optim#{k}") + 2] == f"submit save_sampler#{n}"
    # Evals (before steps 0 and 3) are queued just ahead of their step's forward_backward.
    assert calls[at("submit fb#0") - 1] == "submit fwd#0"
    assert calls[at("submit fb#3") - 1] == "submit fwd#1"
    assert fb.closed == "success"


def test_depth_does_not_change_results(tmp_path):
    runs = []
    for depth in (0, 1, 3):
        d = tmp_path / f"d{depth}"
        d.mkdir()
        run(make_recipe(d, depth=depth), "t", backend=FakeBackend(TOK))
        runs.append([{k: v for k, v in r.items()} for r in metrics(d / "run")])
    assert runs[0] == runs[1] == runs[2]
    nll = [r["train_mean_nll"] for r in runs[0] if "train_mean_nll" in r]
    assert len(nll) == 8  # 32 training rows / batch 4
    assert nll[-1] < nll[0]  # the toy model learns the answer tokens' unigram
    # Evals before steps 0, 3 and 6, and the final weights' at step 8 (SFT evaluates its final weights).
    assert [r["step"] for r in runs[0] if "test/nll" in r] == [0, 3, 6, 8]
    assert runs[0][-1]["test/nll"] < runs[0][0]["test/nll"]


def test_metrics_rows(tmp_path):
    run(make_recipe(tmp_path, max_steps=4), "t", backend=FakeBackend(TOK))
    rows = [json.loads(line) for line in (tmp_path / "run" / METRICS).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # 4: the final weights' test/nll
    assert {k for k in rows[-1] if not k.startswith(("tokens/", "cost/"))} == {"step", "test/nll", "time/total"}
    rows = rows[:-1]
    first = rows[0]
    for key in ("train_mean_nll", "test/nll", "optim/lr", "optim/grad_norm", "progress/done_frac", "epoch",
                "num_sequences", "num_tokens", "num_loss_tokens", "time/step", "time/total"):
        assert key in first, key
    assert first["num_sequences"] == 4 and first["progress/done_frac"] == 0.25
    assert [r["optim/lr"] for r in rows] == pytest.approx([0.05 * (1 - s / 4) for s in range(4)])
    ckpts = [json.loads(line) for line in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    assert [(c["name"], c["step"], c["next_step"]) for c in ckpts] == [("000002", 1, 2), ("final", 3, 4)]
    assert ckpts[-1]["sampler_path"] and ckpts[-1]["state_path"]


def test_resume_after_crash_matches_uninterrupted(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    run(make_recipe(tmp_path / "a"), "t", backend=FakeBackend(TOK))
    want = metrics(tmp_path / "a" / "run")

    recipe = make_recipe(tmp_path / "b")
    store = tmp_path / "b" / "store"  # saved states outlive the crashed backend
    crashed = FakeBackend(TOK, fail="fb#5", storage_dir=store)
    with pytest.raises(Exception, match="injected failure"):
        run(recipe, "t", backend=crashed)
    assert crashed.closed == "error"
    # Steps 0-4 were finished (and logged); the last checkpoint is after step 4 (save_every 2).
    assert [r["step"] for r in metrics(tmp_path / "b" / "run")] == [0, 1, 2, 3, 4]
    resumed = FakeBackend(TOK, storage_dir=store)
    run(recipe, "t", backend=resumed)
    assert metrics(tmp_path / "b" / "run") == want
    assert resumed.calls[0] == "submit fb#0"  # no eval at step 4; the first call is step 4's batch
    assert len(calls_of(resumed, "submit fb#")) == 4  # steps 4..7: nothing replayed, nothing skipped
    assert (tmp_path / "b" / "run" / f"{METRICS}.pre_resume_000004").exists()  # the backup (step 4 row dropped)


def test_torn_lines_are_tolerated(tmp_path):
    recipe = make_recipe(tmp_path, max_steps=4)
    store = tmp_path / "store"
    with pytest.raises(Exception, match="injected"):
        run(recipe, "t", backend=FakeBackend(TOK, fail="fb#3", storage_dir=store))
    run_dir = tmp_path / "run"
    with open(run_dir / "checkpoints.jsonl", "a") as f:
        f.write('{"name": "000004", "step": 3, "next_st')  # kill -9 mid-write
    with open(run_dir / METRICS, "a") as f:
        f.write('{"step": 3, "train_')
    run(recipe, "t", backend=FakeBackend(TOK, storage_dir=store))
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2, 3, 4]
    names = [json.loads(line)["name"] for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert names == ["000002", "final-s2"]  # the second session's names never collide with the first's


def test_one_jsonl_parse_for_the_writer_and_the_read_only_readers(tmp_path):
    """parse_jsonl is the one line loop: read_jsonl cuts a torn last line off (and ends an unended whole one),
    `runner serve` skips it without writing, `runner compare` skips any bad line; a bad line in the middle is an
    error naming file:line for both of the first two, and so is a row that is not an object for read_jsonl."""
    from runner.engine.log import parse_jsonl, read_jsonl
    from runner.tools.compare import read_rows
    from runner.tools.openai_serve import _read_rows

    text = '{"a": 1}\n\n[2]\n{"b": 3}\n{"c": 4, "tor'
    parsed = parse_jsonl(text)
    assert (parsed.rows, parsed.others, parsed.corrupt) == ([{"a": 1}, {"b": 3}], [3], None)
    assert text[parsed.torn_at:] == '{"c": 4, "tor'
    assert parse_jsonl('{"a": 1}\nnope\n{"b": 2}').corrupt == 2
    assert parse_jsonl('{"a": 1}\nnope\n').torn_at is None  # a bad line ended by a newline is not a torn one

    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"a": 1}\n{"b": 2, "to')
    assert _read_rows(torn) == read_rows(torn) == [{"a": 1}]
    assert torn.read_text() == '{"a": 1}\n{"b": 2, "to'  # the read-only readers leave it
    assert read_jsonl(torn) == [{"a": 1}] and torn.read_text() == '{"a": 1}\n'  # the writer's reader cuts it
    unended = tmp_path / "unended.jsonl"
    unended.write_text('{"a": 1}')
    assert read_jsonl(unended) == [{"a": 1}] and unended.read_text() == '{"a": 1}\n'

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    for reader in (read_jsonl, _read_rows):
        with pytest.raises(UserError, match=rf"^{bad}:2: corrupt line \(not JSON\)"):
            reader(bad)
    assert read_rows(bad) == [{"a": 1}, {"b": 2}]
    array = tmp_path / "array.jsonl"
    array.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(UserError, match=rf"^{array}:2: corrupt line \(not a JSON object\)"):
        read_jsonl(array)
    assert _read_rows(array) == read_rows(array) == [{"a": 1}]


def test_finished_run_is_a_noop_and_can_be_extended(tmp_path, capsys):
    recipe = make_recipe(tmp_path, max_steps=4)
    store = tmp_path / "store"
    run(recipe, "t", backend=FakeBackend(TOK, storage_dir=store))
    again = FakeBackend(TOK, storage_dir=store)
    run(recipe, "t", backend=again)
    assert "already finished" in capsys.readouterr().err
    assert again.calls == []
    # A larger max_steps is the same recipe: it continues from the final checkpoint.
    longer = msgspec.structs.replace(recipe, max_steps=6)
    more = FakeBackend(TOK, storage_dir=store)
    run(longer, "t", backend=more)
    # The first run's final row (step 4) was dropped on resuming at step 4; the extended run has its own at 6.
    assert [r["step"] for r in metrics(tmp_path / "run")] == [0, 1, 2, 3, 4, 5, 6]
    assert len(calls_of(more, "submit fb#")) == 2


def test_different_recipe_is_refused(tmp_path):
    recipe = make_recipe(tmp_path, max_steps=2)
    run(recipe, "t", backend=FakeBackend(TOK))
    other = msgspec.structs.replace(recipe, lr=0.1, seed=3)
    with pytest.raises(UserError, match=r"differs in: lr, seed"):
        run(other, "t", backend=FakeBackend(TOK))
    with pytest.raises(UserError, match="already exists"):
        run(msgspec.structs.replace(recipe, if_exists="error"), "t", backend=FakeBackend(TOK))
    # overwrite moves the old run aside, never deletes it
    run(msgspec.structs.replace(other, if_exists="overwrite"), "t", backend=FakeBackend(TOK))
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / METRICS).exists()
    assert "lr = 0.1" in (tmp_path / "run" / "config.toml").read_text()


def test_a_run_that_trained_nothing_gives_way_to_a_fixed_recipe(tmp_path, capsys):
    """A run that failed before its first step left only config.toml and sessions.jsonl: running a corrected
    recipe into the same dir starts over (nothing can be lost), instead of "holds a different recipe"."""
    from crashing import CrashingBackend

    from backends.base import BackendError

    recipe = make_recipe(tmp_path, max_steps=2)
    with pytest.raises(BackendError, match="simulated crash"):
        run(recipe, "t", backend=CrashingBackend(FakeBackend(TOK), crash_at=0))
    assert (tmp_path / "run" / "config.toml").exists() and not (tmp_path / "run" / METRICS).exists()
    fixed = msgspec.structs.replace(recipe, lr=0.1)
    run(fixed, "t", backend=FakeBackend(TOK))
    assert "nothing trained: starts over" in capsys.readouterr().err
    assert "lr = 0.1" in (tmp_path / "run" / "config.toml").read_text()
    assert [r["step"] for r in metrics(tmp_path / "run")] == [0, 1, 2]
    # Once something trained, a different recipe is refused again.
    with pytest.raises(UserError, match=r"differs in: lr"):
        run(recipe, "t", backend=FakeBackend(TOK))


def test_overwrite_twice_within_a_second_keeps_both_old_runs(tmp_path, monkeypatch):
    """The aside name has one-second resolution: a second overwrite in the same second gets a suffix (before: an
    OSError traceback, "Directory not empty")."""
    import runner.engine.rundir

    monkeypatch.setattr(runner.engine.rundir.time, "strftime", lambda fmt: "20250101-000000")
    recipe = msgspec.structs.replace(make_recipe(tmp_path, max_steps=1), if_exists="overwrite")
    for i in range(3):
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / runner.engine.rundir.MARKER).touch()  # a run dir of ours: only those move aside
        (tmp_path / "run" / "mark").write_text(str(i))
        open_run_dir(recipe, "t")
    aside = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run.old-"))
    assert aside == ["run.old-20250101-000000", "run.old-20250101-000000-2", "run.old-20250101-000000-3"]
    assert [(tmp_path / a / "mark").read_text() for a in aside] == ["0", "1", "2"]


def test_dry_run_touches_nothing(tmp_path, capsys):
    recipe = make_recipe(tmp_path)
    run(recipe, "t", dry_run=True)
    out = capsys.readouterr().out
    assert not (tmp_path / "run").exists()
    assert "steps: 8" in out and "forward_backward(cross_entropy, 4 datums)" in out
    assert "checkpoints after steps: 2, 4, 6, 8" in out and "evals before steps: 0, 3, 6" in out


def test_schedules():
    def lr_curve(schedule: dict, total: int = 10) -> list[float]:
        s = msgspec.convert({"algo": {"kind": "sft", "data": {"kind": "jsonl", "path": "x"}}, "schedule": schedule},
                            Recipe).schedule
        return [multiplier(s, step, total) for step in range(total)]

    assert lr_curve({"kind": "constant"}) == [1.0] * 10
    # linear with no warmup is the cookbook's 1 - step/total
    assert lr_curve({"kind": "linear"}) == pytest.approx([1 - s / 10 for s in range(10)])
    assert lr_curve({"kind": "linear", "final_frac": 0.5})[5] == pytest.approx(0.75)
    cos = lr_curve({"kind": "cosine"})
    assert cos[0] == 1.0 and cos[5] == pytest.approx(0.5)
    assert cos[9] == pytest.approx(0.5 * (1 + math.cos(0.9 * math.pi)))
    warm = lr_curve({"kind": "cosine", "warmup_steps": 3, "final_frac": 0.1})
    assert warm[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a > b for a, b in itertools.pairwise(warm[3:])) and warm[-1] > 0.1


def test_sft_through_the_tinker_sdk(tmp_path, mock_tinker):
    """The same loop, unchanged, on backends/tinker/backend.py over the real SDK and backends/serve (faults from
    tests/tinker_mock.py unused here); make_backend picks the adapter from the recipe. A resume extends the run
    from the service-side final checkpoint, optimizer state included."""
    recipe = make_recipe(tmp_path, max_steps=4, depth=2, model="Qwen/Qwen3-8B", tokenizer="tiny",
                         backend={"kind": "tinker"})
    mock = mock_tinker
    run(recipe, "t")
    run(msgspec.structs.replace(recipe, max_steps=6), "t")
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(7))  # 6 steps and the final weights' eval
    assert rows[-2]["train_mean_nll"] < rows[0]["train_mean_nll"]
    ckpts = [json.loads(line) for line in (tmp_path / "run" / "checkpoints.jsonl").read_text().splitlines()]
    assert [c["name"] for c in ckpts] == ["000002", "final", "final-s2"]
    assert all(c["state_path"].startswith("tinker://") and "/sampler_weights/" in c["sampler_path"] for c in ckpts)
    # Per step the service saw forward_backward then optim_step, in seq_id order, 6 steps in all.
    routes = [r.route for r in mock.submits("forward_backward", "forward", "optim_step")]
    assert routes.count("optim_step") == 6


def test_progress_line():
    import io

    from runner.engine.log import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, plain = Tty(), io.StringIO()
    keys = [("train_mean_nll", "nll"), ("test/nll", "test/nll")]
    for stream in (tty, plain):
        p = Progress(total=3, start=0, keys=keys, stream=stream, every=3600)
        for step in range(3):
            p.update(step, {"train_mean_nll": 2.0 - step, **({"test/nll": 5.0} if step == 1 else {})})
        p.close()
    # A terminal: a live bar (tqdm) with the step count and the headline metric; the eval row as its own line.
    out = tty.getvalue()
    assert "3/3" in out and "nll 0.0000" in out and "\r" in out
    assert "eval at step 1  test/nll 5.0000\n" in out
    # Not a terminal, a short run: a plain line per step, and each eval row as a line.
    # The first step pays for the start (model load), so it gives no ETA.
    assert plain.getvalue().splitlines() == [
        "step 1/3  nll 2.0000  eta --", "eval at step 1  test/nll 5.0000", "step 2/3  nll 1.0000  eta 0m00s",
        "step 3/3  nll 0.0000  eta 0m00s"]
    counts = io.StringIO()
    p = Progress(total=2, start=0, keys=[("rows", "rows"), ("reply_chars", "reply_chars")], stream=counts)
    p.update(0, {"rows": 64, "reply_chars": 12.5})
    assert counts.getvalue().startswith("step 1/2  rows 64  reply_chars 12.5000")
    # A long run off a terminal: the first step, then one line per `every` seconds, and always the last step and
    # every eval.
    long = io.StringIO()
    p = Progress(total=100, start=0, keys=keys, stream=long, every=3600)
    for step in range(100):
        p.update(step, {"train_mean_nll": 1.0, **({"test/nll": 2.0} if step % 50 == 0 else {})})
    lines = long.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines] == ["eval at step 0", "step 1/100", "eval at step 50", "step 100/100"]


def test_progress_keys_per_algorithm():
    """The headline numbers follow the algorithm, and envs whose mean reward cannot move get one that does."""
    from runner.engine.spec import spec_of
    from runner.recipe.load import load_file

    def algo_keys(recipe):
        return spec_of(recipe.algo).progress_keys(recipe.algo)

    recipes = load_file("recipes.toml")
    assert [k for k, _ in algo_keys(recipes["sl_basic"])] == ["train_mean_nll", "test/nll"]
    pref = load_file("examples/rl_preference.toml")
    keys = [k for r in pref.values() for k, _ in algo_keys(r)]
    assert "env/all/reward/total" in keys and "env/all/ac_tokens_per_turn" in keys
    ttt = load_file("examples/rl_tictactoe.toml")
    assert "env/all/illegal" in [k for r in ttt.values() for k, _ in algo_keys(r)]



def test_max_steps_beyond_the_data_warns_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """max_steps is a cap: when the data gives fewer steps, one line at start says how many will run and why."""
    recipe = make_recipe(tmp_path, max_steps=30)
    run(recipe, "r", dry_run=True, backend=FakeBackend())
    out = capsys.readouterr().out
    assert "warning: max_steps = 30, but the data gives" in out and "Set algo.epochs" in out
    run(recipe, "r", backend=FakeBackend())
    err = capsys.readouterr().err
    assert err.count("warning: max_steps = 30") == 1
    steps = len([r for r in metrics(tmp_path / "run") if "train_mean_nll" in r])
    assert f"running {steps}." in err


def test_config_toml_records_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    recipe = msgspec.structs.replace(make_recipe(tmp_path, max_steps=1), log_dir=None)
    run(recipe, "named", backend=FakeBackend())
    text = (tmp_path / "runs" / "named" / "config.toml").read_text()
    assert 'log_dir = "runs/named"' in text
    run(recipe, "named", backend=FakeBackend())  # and it still resumes (log_dir may differ: it is the dir itself)
