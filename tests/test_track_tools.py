"""TensorBoard, MLflow and Trackio from the recipe's `log` table (runner/engine/track_*.py), each read back with the
tool's own reader: TensorBoard's event accumulator, MlflowClient's metric history (a local sqlite store), Trackio's
local SQLite store. Every (metric, step) -> value that metrics.jsonl holds is what the tool holds, with no two points
at one step of one metric, after a run, after a crash and its resume, and (slow) after a real kill -9 of rl_basic and
its resume, with W&B (offline) on too; a sweep's points are grouped in each tool. Each test skips, naming the
package, when a tool's extra is not installed.

Run: pytest tests/test_track_tools.py   (about 30 s on 2 cores with the three extras; the rl_basic test is slow)
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from backends.base import BackendError
from backends.fake import FakeBackend
from backends.local.tiny import build_tokenizer
from runner.engine.loop import run
from runner.engine.track_common import scalars
from runner.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parents[1]
Points = dict[tuple[str, int], float]


@pytest.fixture(scope="module", autouse=True)
def trackio_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Trackio's store for these tests (trackio reads TRACKIO_DIR once, when first imported)."""
    folder = tmp_path_factory.mktemp("trackio")
    old = os.environ.get("TRACKIO_DIR")
    os.environ["TRACKIO_DIR"] = str(folder)
    if "trackio.utils" in sys.modules:  # imported by an earlier test module: point it here too
        import trackio.utils  # pyright: ignore[reportMissingImports]

        if trackio.utils.TRACKIO_DIR != folder:
            pytest.skip("trackio was imported before this module set TRACKIO_DIR")
    yield folder
    if old is None:
        os.environ.pop("TRACKIO_DIR", None)
    else:
        os.environ["TRACKIO_DIR"] = old


def need(*modules: str) -> None:
    for m in modules:
        pytest.importorskip(m, reason=f"the {m} package is not installed (its extra: docs/tracking.md)")


def sft_recipe(tmp_path: Path, steps: int, log: dict[str, Any], depth: int = 1) -> Recipe:
    data = tmp_path / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return msgspec.convert({
        "algo": {"kind": "sft", "data": {"kind": "jsonl", "path": str(data)}, "batch_size": 4, "test_size": 4},
        "lr": 0.05, "max_steps": steps, "eval_every": 2, "save_every": 2, "depth": depth,
        "log_dir": str(tmp_path / "run"), "log": log,
    }, Recipe)


def resumes_at(run_dir: Path) -> int:
    """The step a resume starts at (the last checkpoint's): a crash with steps in flight (depth 2, the 7th
    forward_backward fails) logged step 6 before it, so the resume logs step 6 again."""
    return json.loads((run_dir / "checkpoints.jsonl").read_text().splitlines()[-1])["next_step"]


# ---------------------------------------------------------------- what each tool holds, read with its own reader


def jsonl_points(run_dir: Path, key: Any = None) -> Points:
    """(metric, step) -> value of every number in metrics.jsonl (keys mapped as the tool maps them)."""
    out: Points = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for k, v in scalars(row).items():
            out[(key(k) if key else k, row["step"])] = v
    return out


def no_two(points: list[tuple[str, int, float]]) -> Points:
    """The points as a dict, after checking that no (metric, step) occurs twice."""
    twice = [kv for kv, n in Counter((k, s) for k, s, _ in points).items() if n > 1]
    assert not twice, f"two points at one step: {twice[:5]}"
    return {(k, s): v for k, s, v in points}


def tensorboard_points(folder: Path) -> Points:
    from tensorboard.backend.event_processing import event_accumulator as ea  # pyright: ignore

    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return no_two([(tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)])


def tensorboard_hparams(folder: Path) -> dict[str, Any]:
    from tensorboard.backend.event_processing import event_accumulator as ea  # pyright: ignore
    from tensorboard.plugins.hparams import plugin_data_pb2  # pyright: ignore

    acc = ea.EventAccumulator(str(folder))
    acc.Reload()
    data = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
            for k, v in data.session_start_info.hparams.items()}


def mlflow_run(run_dir: Path) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient  # pyright: ignore

    stored = json.loads((run_dir / "mlflow.json").read_text())
    client = MlflowClient(tracking_uri=stored["tracking_uri"])
    return client, client.get_run(stored["run_id"])


def mlflow_points(run_dir: Path) -> Points:
    client, r = mlflow_run(run_dir)
    return no_two([(k, m.step, m.value) for k in r.data.metrics
                   for m in client.get_metric_history(r.info.run_id, k)])


def trackio_points(run_dir: Path) -> Points:
    from trackio.sqlite_storage import SQLiteStorage  # pyright: ignore

    stored = json.loads((run_dir / "trackio.json").read_text())
    logs = SQLiteStorage.get_logs(stored["project"], stored["name"], run_id=stored["id"])
    return no_two([(k, row["step"], v) for row in logs for k, v in row.items() if k not in ("step", "timestamp")])


def same(got: Points, want: Points, first_kept_from: int | None = None) -> None:
    """The same (metric, step) pairs with the same values. `first_kept_from`: a resume's first step, from which on
    MLflow and Trackio keep the value the killed session logged (they cannot replace a point), so the time/*
    metrics, which no rerun reproduces, are left out there (as tests/test_resume.py leaves them out)."""
    assert set(got) == set(want), (sorted(set(got) - set(want))[:5], sorted(set(want) - set(got))[:5])
    bad = [kv for kv in want if not math.isclose(got[kv], want[kv], rel_tol=1e-6, abs_tol=1e-9)
           and not (first_kept_from is not None and kv[1] >= first_kept_from and kv[0].startswith("time/"))]
    assert not bad, [(kv, got[kv], want[kv]) for kv in bad[:5]]


def tb_key(k: str) -> str:
    from runner.engine.track_tensorboard import tb_tag

    return tb_tag(k)


def ml_key(k: str) -> str:
    from runner.engine.track_mlflow import mlflow_key

    return mlflow_key(k)


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_holds_the_rows_after_an_extension_and_a_crash(tmp_path: Path) -> None:
    need("tensorboardX", "tensorboard")
    fb = FakeBackend(build_tokenizer())
    run(sft_recipe(tmp_path, 3, {"tensorboard": {}}), "r", backend=fb)
    run_dir = tmp_path / "run"
    same(tensorboard_points(run_dir), jsonl_points(run_dir, tb_key))
    hp = tensorboard_hparams(run_dir)
    assert hp["lr"] == 0.05 and hp["algo.kind"] == "sft" and hp["max_steps"] == 3
    # Extended: session 1's final eval row at step 3 is replaced by the training row metrics.jsonl now holds.
    run(sft_recipe(tmp_path, 5, {"tensorboard": {}}), "r", backend=fb)
    assert ("test/nll", 3) not in jsonl_points(run_dir)
    same(tensorboard_points(run_dir), jsonl_points(run_dir, tb_key))
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # the session's file holds the run, the older went

    # A crash with steps in flight (depth 2): the rows after the last checkpoint are logged again on resume.
    crash = tmp_path / "crash"
    crash.mkdir()
    recipe = sft_recipe(crash, 8, {"tensorboard": {"dir": str(tmp_path / "tb")}}, depth=2)
    with pytest.raises(BackendError):
        run(recipe, "r", backend=FakeBackend(build_tokenizer(), fail="fb#7", storage_dir=crash / "states"))
    folder = tmp_path / "tb" / "run"  # <dir>/<name>: the run dir's name, outside runs/
    assert resumes_at(crash / "run") == 6 and max(s for _, s in tensorboard_points(folder)) == 6
    run(recipe, "r", backend=FakeBackend(build_tokenizer(), storage_dir=crash / "states"))
    same(tensorboard_points(folder), jsonl_points(crash / "run", tb_key))


# ---------------------------------------------------------------- MLflow


def test_mlflow_holds_the_rows_and_the_status_after_a_crash_and_its_resume(tmp_path: Path) -> None:
    need("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recipe = sft_recipe(tmp_path, 8, {"mlflow": {"experiment": "e", "tracking_uri": uri}}, depth=2)
    with pytest.raises(BackendError):
        run(recipe, "r", backend=FakeBackend(build_tokenizer(), fail="fb#7", storage_dir=tmp_path / "states"))
    run_dir = tmp_path / "run"
    client, r = mlflow_run(run_dir)
    assert r.info.status == "FAILED" and r.info.run_name == "run"
    first = r.info.run_id
    assert resumes_at(run_dir) == 6 and max(s for _, s in mlflow_points(run_dir)) == 6
    run(recipe, "r", backend=FakeBackend(build_tokenizer(), storage_dir=tmp_path / "states"))
    client, r = mlflow_run(run_dir)
    assert r.info.run_id == first and r.info.status == "FINISHED"
    same(mlflow_points(run_dir), jsonl_points(run_dir, ml_key), first_kept_from=6)
    params = r.data.params
    assert params["lr"] == "0.05" and params["algo.kind"] == "sft" and params["max_steps"] == "8"
    # Extended: MLflow params never change, so the new value is a tag.
    run(msgspec.structs.replace(recipe, max_steps=10), "r", backend=FakeBackend(build_tokenizer(),
                                                                               storage_dir=tmp_path / "states"))
    client, r = mlflow_run(run_dir)
    assert r.data.params["max_steps"] == "8" and r.data.tags["runner.changed.max_steps"] == "10"
    got, want = mlflow_points(run_dir), jsonl_points(run_dir, ml_key)
    # Every point but those of step 8, where MLflow keeps the first value (the final eval row of the run before
    # it was extended), is metrics.jsonl's.
    same({kv: v for kv, v in got.items() if kv[1] != 8}, {kv: v for kv, v in want.items() if kv[1] != 8},
         first_kept_from=6)
    assert {kv for kv in want if kv[1] == 8} <= set(got)


def test_mlflow_an_interrupted_session_is_killed_and_only_numbers_are_metrics(tmp_path: Path) -> None:
    need("mlflow")
    from runner.engine.track_mlflow import MlflowTracker
    from runner.recipe.schema import MLflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "run").mkdir()
    tracker = MlflowTracker(MLflow(experiment="e", tracking_uri=uri), tmp_path / "run", {"lr": 1.0}, [])
    tracker.log({"step": 0, "loss": 1.5, "note": "text is not a metric"})
    tracker.finish("interrupted")
    client, r = mlflow_run(tmp_path / "run")
    assert r.info.status == "KILLED" and r.data.metrics == {"loss": 1.5}


# ---------------------------------------------------------------- Trackio


def test_trackio_holds_the_rows_after_a_crash_and_its_resume(tmp_path: Path) -> None:
    need("trackio")
    from trackio.sqlite_storage import SQLiteStorage  # pyright: ignore

    project = f"t-{tmp_path.name}"
    recipe = sft_recipe(tmp_path, 8, {"trackio": {"project": project}}, depth=2)
    with pytest.raises(BackendError):
        run(recipe, "r", backend=FakeBackend(build_tokenizer(), fail="fb#7", storage_dir=tmp_path / "states"))
    run_dir = tmp_path / "run"
    stored = json.loads((run_dir / "trackio.json").read_text())
    assert resumes_at(run_dir) == 6 and max(s for _, s in trackio_points(run_dir)) == 6
    run(recipe, "r", backend=FakeBackend(build_tokenizer(), storage_dir=tmp_path / "states"))
    assert json.loads((run_dir / "trackio.json").read_text())["id"] == stored["id"]
    same(trackio_points(run_dir), jsonl_points(run_dir), first_kept_from=6)
    config = SQLiteStorage.get_run_config(project, stored["name"], run_id=stored["id"])
    assert config is not None and config["lr"] == 0.05 and config["algo.kind"] == "sft"
    alerts = SQLiteStorage.get_alerts(project)
    assert [a["title"] for a in alerts] == ["run error"]  # Trackio has no run status: the crash is an alert


# ---------------------------------------------------------------- sweeps


@pytest.mark.slow
def test_a_sweep_is_grouped_in_each_tool(tmp_path: Path) -> None:
    need("tensorboardX", "tensorboard", "mlflow", "trackio")
    from trackio.sqlite_storage import SQLiteStorage  # pyright: ignore

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    project = f"s-{tmp_path.name}"
    log = (f'log={{tensorboard={{dir="tb"}}, mlflow={{experiment="e", tracking_uri="{uri}"}}, '
           f'trackio={{project="{project}"}}}}')
    proc = subprocess.run([sys.executable, "-m", "runner", "sweep", f"{ROOT / 'recipes.toml'}#sl_basic",
                           "lr=[1e-3,4e-3]", "max_steps=2", log, "--parallel", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    points = ["lr=0.001", "lr=0.004"]
    # TensorBoard: a folder per sweep under `dir`, a run per point.
    assert sorted(p.name for p in (tmp_path / "tb" / "sl_basic").iterdir()) == points
    for p in points:
        same(tensorboard_points(tmp_path / "tb" / "sl_basic" / p), jsonl_points(tmp_path / "runs" / "sl_basic" / p, tb_key))
    # MLflow: the points nested under one parent run named by the sweep.
    runs = {}
    for p in points:
        client, r = mlflow_run(tmp_path / "runs" / "sl_basic" / p)
        runs[p] = r
        same(mlflow_points(tmp_path / "runs" / "sl_basic" / p), jsonl_points(tmp_path / "runs" / "sl_basic" / p, ml_key))
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs.values()}
    assert len(parents) == 1
    parent = client.get_run(parents.pop())
    assert parent.info.run_name == "sl_basic" and {r.data.tags["runner.sweep"] for r in runs.values()} == {"sl_basic"}
    assert {r.info.run_name for r in runs.values()} == {"sl_basic/lr=0.001", "sl_basic/lr=0.004"}
    # Trackio: one group.
    records = SQLiteStorage.get_run_records(project)
    assert sorted(r["name"] for r in records) == ["sl_basic/lr=0.001", "sl_basic/lr=0.004"]
    for r in records:
        assert SQLiteStorage.get_run_config(project, r["name"], run_id=r["id"])["_Group"] == "sl_basic"


# ---------------------------------------------------------------- rl_basic, all four, kill -9


def wandb_points(run_dir: Path) -> Points:
    """W&B's offline sessions read back (tests/test_track.py's reader): a later session's point at a step replaces
    an earlier one's, as the steps a resumed session logs again replace those in metrics.jsonl."""
    from test_track import records

    out: Points = {}
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        session: list[tuple[str, int, float]] = []
        for r in records(f):
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                step = items.pop("step")
                session += [(k, step, v) for k, v in items.items() if isinstance(v, (int, float))
                            and not k.startswith("_")]
        out |= no_two(session)
    return out


@pytest.mark.slow
def test_rl_basic_with_all_four_trackers_kill_9_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rl_basic (a few small steps) with W&B (offline), TensorBoard, MLflow and Trackio on: each holds the step/value
    pairs of metrics.jsonl after a first session and after it is resumed to run longer; then TensorBoard, MLflow and
    Trackio after a real kill -9 of a second run and its resume."""
    need("wandb", "tensorboardX", "tensorboard", "mlflow", "trackio")
    pytest.importorskip("wandb.proto.wandb_internal_pb2")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = (f'log={{wandb={{project="p"}}, tensorboard={{}}, mlflow={{experiment="rl", tracking_uri="{uri}"}}, '
           f'trackio={{project="rl-{tmp_path.name}"}}}}')
    small = ["algo.groups_per_batch=2", "algo.group_size=2", "algo.env.test_size=2", "eval_every=3", log]

    def check(run_dir: Path, first_kept_from: int | None = None, old_last: int | None = None,
              wandb: bool = True) -> None:
        """Each tool against metrics.jsonl. `old_last`: the last step of a run before it was extended, where MLflow
        and Trackio keep the point of its final eval row (tests above)."""
        want = jsonl_points(run_dir)
        same(tensorboard_points(run_dir), jsonl_points(run_dir, tb_key))
        for got, key in ((mlflow_points(run_dir), ml_key), (trackio_points(run_dir), None)):
            mapped = jsonl_points(run_dir, key)
            assert set(mapped) <= set(got)
            same({kv: v for kv, v in got.items() if kv[1] != old_last},
                 {kv: v for kv, v in mapped.items() if kv[1] != old_last}, first_kept_from)
        if wandb:
            deadline = time.monotonic() + 120  # wandb's service process may still be writing
            while set(wandb_points(run_dir)) != set(want) and time.monotonic() < deadline:
                time.sleep(0.2)
            same(wandb_points(run_dir), want)

    from runner.cli import main

    # One whole session, in this process; then extended by two steps (a resume at its end).
    whole = [f"{ROOT / 'recipes.toml'}#rl_basic", "log_dir=runs/whole", *small]
    assert main(["run", *whole, "max_steps=3"]) == 0
    check(tmp_path / "runs" / "whole")
    assert main(["run", *whole, "max_steps=5"]) == 0
    check(tmp_path / "runs" / "whole", first_kept_from=3, old_last=3)

    # kill -9 right after the first checkpoint row, then the same command resumes it.
    killed = tmp_path / "runs" / "killed"
    args = [f"{ROOT / 'recipes.toml'}#rl_basic", "max_steps=12", "save_every=2", "log_dir=runs/killed", *small]
    # Its own wandb service: wandb keeps this process's in the environment (WANDB_SERVICE), which a child would share.
    child_env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "runner", "run", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=child_env)
    try:
        deadline = time.monotonic() + 180
        while not (killed / "checkpoints.jsonl").exists() or not (killed / "checkpoints.jsonl").read_text():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(jsonl_points(killed)) and max(s for _, s in jsonl_points(killed)) < 11  # it really was interrupted
    _, r = mlflow_run(killed)
    assert r.info.status == "RUNNING"  # a kill -9 leaves it running until the resume
    resumed_at = json.loads((killed / "checkpoints.jsonl").read_text().splitlines()[-1])["next_step"]
    assert main(["run", *args]) == 0
    # W&B aside: the killed process's wandb service dies with it, and the W&B records it had not written yet (here
    # the first steps') are lost; W&B is checked across the clean resume above.
    check(killed, first_kept_from=resumed_at, wandb=False)
    _, r = mlflow_run(killed)
    assert r.info.status == "FINISHED"
