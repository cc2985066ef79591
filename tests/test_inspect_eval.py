"""Pinned evals of kind "inspect" (runner/engine/inspect_eval.py, inspect_model.py): an inspect_ai task, built here
(a few samples, includes/exact scorers), run offline on the tiny model through the runner model provider. The metric
logged is what the scorer gives for the replies the same weights sample directly; bad task names and a missing extra
are one-line errors. All but the missing-extra test need the `inspect` extra (pip install inspect_ai)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from test_pinned_evals import recipe_text  # the same SFT recipe around its evals

from backends.errors import UserError
from runner.cli import main
from runner.engine.evals import names, run_evals
from runner.engine.inspect_eval_config import InspectPinned
from runner.engine.inspect_eval_config import task_name as default_name
from runner.engine.loop import run
from runner.recipe.load import load_recipe

INPUTS = ["What is 2+2?", "Say hi", "Name a colour", "Count to three"]
MAX_TOKENS = 8
NEVER = "zq#never#qz"  # a target no reply of the tiny model holds

TASKS = '''
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import exact, includes
from inspect_ai.solver import generate
from inspect_ai.tool import tool


def _samples(inputs, targets):
    return [Sample(input=i, target=t) for i, t in zip(inputs, targets, strict=True)]


@task
def echo(inputs: list[str], targets: list[str]) -> Task:
    return Task(dataset=_samples(inputs, targets), solver=generate(), scorer=includes())


@task
def two_scorers(inputs: list[str], targets: list[str]) -> Task:
    return Task(dataset=_samples(inputs, targets), solver=generate(), scorer=[includes(), exact()])


@tool
def add():
    async def run(x: int, y: int) -> int:
        """Add.

        Args:
            x: one.
            y: two.
        """
        return x + y

    return run


@task
def with_tools() -> Task:
    from inspect_ai.solver import use_tools

    return Task(dataset=_samples(["add 1 and 2"], ["3"]), solver=[use_tools(add()), generate()], scorer=includes())


def not_a_task():
    return 3


@task
def from_file(path: str) -> Task:
    import json

    rows = [json.loads(line) for line in open(path)]
    return Task(dataset=_samples([r["q"] for r in rows], [r["a"] for r in rows]), solver=generate(), scorer=includes())
'''


@pytest.fixture(autouse=True)
def offline_inspect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's task module importable; inspect's data, cache and log dirs under tmp_path, no telemetry hook."""
    (tmp_path / "inspect_tasks.py").write_text(TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    for var in ("INSPECT_LOG_DIR", "INSPECT_TELEMETRY", "INSPECT_API_KEY_OVERRIDE", "INSPECT_EVAL_MODEL"):
        monkeypatch.delenv(var, raising=False)


needs_inspect = pytest.mark.extras("inspect")


def direct_replies(sampler: Any, tokenizer: Any, inputs: list[str]) -> list[str]:
    """Greedy replies of `sampler`'s weights, rendered and parsed as the recipe's renderer ("auto") does."""
    from backends.types import SamplingParams
    from runner.renderers import get_renderer
    from runner.renderers.chat import ChatRenderer

    chat = ChatRenderer(get_renderer("auto", tokenizer, model_name="tiny"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=chat.stop)

    async def one(q: str) -> str:
        out = await sampler.sample(chat.build_prompt([{"role": "user", "content": q}]), 1, params)
        return chat.parse(list(out.sequences[0].tokens)).text

    async def every() -> list[str]:
        return list(await asyncio.gather(*(one(q) for q in inputs)))

    return asyncio.run(every())


def with_backend(fn: Any, path: str | None = None) -> Any:
    """fn(sampler, tokenizer) on the tiny model's base weights, or a saved sampler checkpoint."""
    from backends.local import LocalBackend
    from backends.local.local_config import Local

    backend = LocalBackend(Local(device="cpu"), "tiny", None, Path("store").resolve(), seed=0)
    try:
        return fn(backend.create_sampling_client(path, None if path else "tiny").result(), backend.get_tokenizer())
    finally:
        backend.close()


def includes_accuracy(replies: list[str], targets: list[str]) -> float:
    """inspect's includes() scorer: the target inside the reply, case ignored."""
    return sum(t.lower() in r.lower() for r, t in zip(replies, targets, strict=True)) / len(replies)


@needs_inspect
def test_metrics_are_the_scorers_on_the_sampled_replies(capsys: pytest.CaptureFixture[str]) -> None:
    hook, level = sys.excepthook, logging.getLogger().level

    def check(sampler: Any, tokenizer: Any) -> None:
        replies = direct_replies(sampler, tokenizer, INPUTS)
        targets = [replies[0], replies[1], NEVER, NEVER]
        assert all(NEVER not in r for r in replies)
        args = {"inputs": INPUTS, "targets": targets}

        def evals(*es: InspectPinned) -> dict[str, float]:
            return asyncio.run(run_evals(list(es), sampler, tokenizer, "auto", "tiny"))

        got = evals(InspectPinned(task="inspect_tasks:echo", task_args=args, max_tokens=MAX_TOKENS))
        assert got["test/eval/echo/accuracy"] == includes_accuracy(replies, targets) == 0.5
        assert got["test/eval/echo/samples"] == 4 and got["test/eval/echo/stderr"] > 0
        # limit: the first two samples (both right); a file spec names the same task; two scorers: <scorer>/<metric>
        got = evals(InspectPinned(task="inspect_tasks.py@echo", task_args=args, limit=2, max_tokens=MAX_TOKENS),
                    InspectPinned(task="inspect_tasks:two_scorers", task_args=args, max_tokens=MAX_TOKENS))
        assert got["test/eval/echo/accuracy"] == 1.0 and got["test/eval/echo/samples"] == 2
        assert got["test/eval/two_scorers/includes/accuracy"] == 0.5
        assert got["test/eval/two_scorers/exact/mean"] == 0.5  # exact() reports a mean; the full reply matches

    with_backend(check)
    assert capsys.readouterr() == ("", "")  # inspect's display is off
    assert (sys.excepthook, logging.getLogger().level) == (hook, level)  # and the runner's hook and log level stay


@needs_inspect
def test_sampling_at_temperature_is_seeded_per_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from inspect_ai.log import list_eval_logs, read_eval_log

    def completions(sampler: Any, tokenizer: Any, seed: int, logs: str) -> list[str]:
        monkeypatch.setenv("INSPECT_LOG_DIR", str(tmp_path / logs))
        e = InspectPinned(task="inspect_tasks:echo", task_args={"inputs": INPUTS * 2, "targets": [NEVER] * 8},
                          temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
        asyncio.run(run_evals([e], sampler, tokenizer, "auto", "tiny"))
        [info] = list_eval_logs(str(tmp_path / logs))
        samples = read_eval_log(info).samples or []
        return [s.output.completion for s in sorted(samples, key=lambda s: int(s.id))]

    def check(sampler: Any, tokenizer: Any) -> None:
        first, again, other = (completions(sampler, tokenizer, seed, logs)
                               for seed, logs in ((0, "a"), (0, "b"), (1, "c")))
        assert len(first) == 8 and first == again  # the same seed: the same replies, whatever the order they ran in
        assert first[:4] != first[4:]  # seeds per sample (id, epoch): the same prompts, other replies
        assert first != other  # another seed, other replies

    with_backend(check)




def inspect_table(task: str, args: dict[str, Any] | None = None) -> str:
    args_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in (args or {}).items())
    return (f'\n[[recipes.p.evals]]\nkind = "inspect"\ntask = "{task}"\ntask_args = {{ {args_toml} }}\n'
            f"max_tokens = {MAX_TOKENS}\n")


@needs_inspect
def test_logged_at_eval_steps_final_row_and_by_runner_eval(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    base = with_backend(lambda s, t: direct_replies(s, t, INPUTS))
    targets = [base[0], base[1], NEVER, NEVER]
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, inspect_table("inspect_tasks:echo", {"inputs": INPUTS, "targets": targets})))
    assert main(["check", str(path)]) == 0
    name, recipe = load_recipe(f"{path}#p")
    run(recipe, name)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["test/eval/echo/accuracy"] for r in rows if "test/eval/echo/accuracy" in r}
    assert sorted(logged) == [0, 2, 3]  # before steps 0 and 2, and the final row
    assert logged[0] == includes_accuracy(base, targets) == 0.5  # step 0: the base weights (LoRA's B is zero)
    assert "eval/echo/accuracy" in capsys.readouterr().err  # the progress line shows it

    # The final row is what includes() gives for the final checkpoint's own replies, sampled directly.
    ckpt = [json.loads(line) for line in (tmp_path / "run/checkpoints.jsonl").read_text().splitlines()][-1]
    sampler_path = str((tmp_path / "run" / ckpt["sampler_path"]).resolve())
    final = with_backend(lambda s, t: direct_replies(s, t, INPUTS), sampler_path)
    assert logged[3] == includes_accuracy(final, targets)

    assert main(["eval", str(tmp_path / "run")]) == 0
    assert "test/eval/echo/accuracy" in capsys.readouterr().out
    evals = [json.loads(line) for line in (tmp_path / "run/evals.jsonl").read_text().splitlines()]
    assert evals[-1]["test/eval/echo/accuracy"] == logged[3]
    assert main(["compare", str(tmp_path / "run")]) == 0  # a default column, as the other pinned evals
    assert "test/eval/echo/accuracy" in capsys.readouterr().out


@needs_inspect
def test_on_the_tinker_backend(tmp_path: Path, mocked_tinker: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real tinker SDK against the mocked service: the provider samples through a Tinker sampling client.
    # With $INSPECT_LOG_DIR set, inspect's logs are kept there.
    monkeypatch.setenv("INSPECT_LOG_DIR", str(tmp_path / "inspect-logs"))
    targets = [NEVER] * len(INPUTS)
    remote = 'model = "Qwen/Qwen3-8B"\ntokenizer = "tiny"\nbackend = {kind = "tinker"}\n'
    text = recipe_text(tmp_path, inspect_table("inspect_tasks:echo", {"inputs": INPUTS, "targets": targets}), 1)
    (tmp_path / "r.toml").write_text(text.replace("[recipes.p]\n", "[recipes.p]\n" + remote))
    assert main(["run", f"{tmp_path / 'r.toml'}#p"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "test/eval/echo/samples" in r]
    assert [r["step"] for r in scored] == [0, 1] and all(r["test/eval/echo/samples"] == 4 for r in scored)
    assert all(r["test/eval/echo/accuracy"] == 0.0 for r in scored)
    from inspect_ai.log import list_eval_logs, read_eval_log

    logs = [read_eval_log(info) for info in list_eval_logs(str(tmp_path / "inspect-logs"))]
    assert len(logs) == 2 and all(log.eval.model == "runner/Qwen/Qwen3-8B" for log in logs)
    for log in logs:
        assert log.samples is not None and len(log.samples) == 4
        assert all(s.output.usage is not None and s.output.usage.output_tokens > 0 for s in log.samples)


@pytest.mark.parametrize(
    ("task", "args", "message"),
    [
        ("no_such_pkg/nothing", {}, "evals[0].task: no inspect task named 'no_such_pkg/nothing': the package "
                                    "'no_such_pkg' is not installed"),
        ("nothing_by_that_name", {}, "evals[0].task: no inspect task named 'nothing_by_that_name'; name a task of"),
        ("inspect_tasks:missing", {}, "evals[0].task: cannot import 'inspect_tasks:missing'"),
        ("missing_file.py@echo", {}, "evals[0].task: inspect task file not found: missing_file.py"),
        ("inspect_tasks:echo", {"inputs": ["a"]}, "cannot be called with task_args ['inputs']: missing a required"),
    ],
)
@needs_inspect
def test_bad_task_is_a_one_line_error_for_check_and_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        task: str, args: dict[str, Any], message: str) -> None:
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, inspect_table(task, args), 1))
    for command in (["check", str(path)], ["run", f"{path}#p"]):
        capsys.readouterr()
        assert main(command) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run/metrics.jsonl").exists()  # refused before training


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("inspect_tasks:with_tools", "inspect eval 'inspect_tasks:with_tools' failed: .*offers tools \\(add\\)"),
        ("inspect_tasks:not_a_task", "inspect task 'inspect_tasks:not_a_task' returned int, not an inspect_ai Task"),
    ],
)
@needs_inspect
def test_task_failures_stop_the_run_with_one_line(tmp_path: Path, task: str, message: str) -> None:
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, inspect_table(task), 1))
    name, recipe = load_recipe(f"{path}#p")
    with pytest.raises(UserError, match=message):
        run(recipe, name)


@needs_inspect
def test_task_file_and_path_args_are_found_next_to_the_recipe(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "qa_tasks.py").write_text(TASKS)
    (proj / "qa.jsonl").write_text("".join(json.dumps({"q": q, "a": NEVER}) + "\n" for q in INPUTS[:3]))
    path = proj / "r.toml"  # run from tmp_path (the fixture's working directory), not proj
    path.write_text(recipe_text(tmp_path, inspect_table("qa_tasks.py@from_file", {"path": "qa.jsonl"}), 1))
    assert main(["check", str(path)]) == 0
    _, recipe = load_recipe(f"{path}#p")
    e = recipe.evals[0]
    assert isinstance(e, InspectPinned)
    assert (e.task, e.task_args) == (f"{proj / 'qa_tasks.py'}@from_file", {"path": str(proj / "qa.jsonl")})
    got = with_backend(lambda s, t: asyncio.run(run_evals(recipe.evals, s, t, "auto", "tiny")))
    assert got["test/eval/from_file/samples"] == 3 and got["test/eval/from_file/accuracy"] == 0.0


def test_without_the_extra_check_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "inspect_ai", None)  # what an environment without inspect_ai imports
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, inspect_table("inspect_evals/gsm8k"), 1))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {path}#p: evals[0].task: kind = \"inspect\" needs the inspect_ai package: "
                   "pip install 'runner[inspect]' (or pip install inspect_ai)")


def test_smoke_caps_the_samples_and_leaves_task_args_alone(tmp_path: Path) -> None:
    from runner.tools.smoke import smoke_recipe

    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, inspect_table("inspect_tasks:echo", {"max_tokens": 999}), 1))
    name, recipe = load_recipe(f"{path}#p")
    [e] = smoke_recipe(recipe, name, f"{path}#p").evals
    assert isinstance(e, InspectPinned)
    assert (e.limit, e.task_args) == (2, {"max_tokens": 999}) and e.max_tokens <= MAX_TOKENS


def test_default_names_are_the_tasks() -> None:
    assert [default_name(t) for t in ("inspect_evals/gsm8k", "pkg.mod:my_task", "dir/tasks.py@qa", "dir/tasks.py")] \
        == ["gsm8k", "my_task", "qa", "tasks"]
    two = [InspectPinned(task="inspect_evals/gsm8k"), InspectPinned(task="inspect_evals/gsm8k", limit=5)]
    assert names(two) == ["gsm8k_0", "gsm8k_1"]
    assert names([two[0], InspectPinned(task="x:y", name="mine")]) == ["gsm8k", "mine"]


@needs_inspect
def test_a_task_file_is_checked_for_the_task_it_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`file.py@name`: check reads the file (without running it) for a @task function registered as `name`."""
    (tmp_path / "tasks_here.py").write_text(
        "from inspect_ai import task\n\n@task\ndef qa():\n    pass\n\n@task(name='renamed')\ndef other():\n    pass\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    cases = {"tasks_here.py@qa": None, "tasks_here.py@renamed": None, "tasks_here.py": None,
             "tasks_here.py@qax": "no @task function named 'qax' in ",
             "tasks_here.py@other": "no @task function named 'other' in ",
             "broken.py@qa": "broken.py: SyntaxError"}
    for task, message in cases.items():
        path = tmp_path / "r.toml"
        path.write_text(recipe_text(tmp_path, inspect_table(task), 1))
        capsys.readouterr()
        assert main(["check", str(path)]) == (0 if message is None else 2), task
        err = capsys.readouterr().err
        if message is not None:
            assert message in err and len(err.strip().splitlines()) == 1, err
            if "qax" in message:
                assert "(its @task functions: qa, renamed)" in err
