"""`runner sample | chat | eval` on any checkpoint of a run (runner/tools/talk.py), local and over the tinker SDK."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runner.cli import main
from runner.engine.log import read_jsonl
from scripts.tiny_build import sft_conversations

SFT = """
[recipes.s]
lr = 0.02
max_steps = 4
eval_every = 2
save_every = 2
{extra}
algo = {{kind = "sft", data = {{kind = "jsonl", path = "chats.jsonl"}}, batch_size = 8, test_size = 8}}
lora = {{rank = 4}}
"""
RL = """
[recipes.r]
lr = 0.01
max_steps = 2
eval_every = 1
save_every = 0
backend = {kind = "local", device = "cpu"}
lora = {rank = 4}
algo = {kind = "rl", env = {kind = "arithmetic", max_value = 9, test_size = 4}, group_size = 2, groups_per_batch = 2, \
max_tokens = 4}
"""
LOCAL = 'backend = {kind = "local", device = "cpu"}'


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return _project(tmp_path)


def _project(folder: Path) -> Path:
    (folder / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_conversations(48, seed=2)))
    (folder / "p.jsonl").write_text('{"prompt": "How many legs does a vexle have?"}\n'
                                    '{"messages": [{"role": "user", "content": "Who are you?"}]}\n')
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The local SFT run, trained once for the module: each test gets a copy (sft_run)."""
    folder = _project(tmp_path_factory.mktemp("trained"))
    (folder / "r.toml").write_text(SFT.format(extra=LOCAL))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        assert main(["run", "r.toml#s"]) == 0
    return folder / "runs" / "s"


@pytest.fixture
def sft_run(proj: Path, trained: Path) -> Path:
    """A copy of the trained run in this test's project (the run dir's paths are relative to it: checkpoints.jsonl
    "paths": "run"), so what one test writes there (evals.jsonl) no other test sees."""
    (proj / "r.toml").write_text(SFT.format(extra=LOCAL))
    shutil.copytree(trained, proj / "runs" / "s")
    return proj / "runs" / "s"


def test_sample_is_seeded_and_follows_the_checkpoint(sft_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sample", str(sft_run), "--file", "p.jsonl", "--n", "2", "--seed", "3", "--json", "--max-tokens", "12"]
    assert main(args) == 0
    first = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(args) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == first
    assert [len(r["completions"]) for r in first] == [2, 2] and first[0]["checkpoint"] == "final"
    assert main([*args, "--checkpoint", "base"]) == 0
    base = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert base[0]["checkpoint"] == "base" and base != first
    assert main(["sample", "r.toml#s", "Who are you?", "--checkpoint", "000002", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("> Who are you?\n")


def test_eval_repeats_the_logged_held_out_nll(sft_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The eval before step 2 saw the weights after 2 steps: checkpoint 000002's."""
    assert main(["eval", str(sft_run), "--checkpoint", "000002"]) == 0
    logged = next(r["test/nll"] for r in read_jsonl(sft_run / "metrics.jsonl") if r["step"] == 2)
    [row] = read_jsonl(sft_run / "evals.jsonl")
    assert row["checkpoint"] == "000002" and row["test/nll"] == pytest.approx(logged, rel=1e-4)
    assert "test/nll" in capsys.readouterr().out
    # The same checkpoint by the steps it was saved after.
    assert main(["eval", str(sft_run), "--checkpoint", "2"]) == 0
    assert read_jsonl(sft_run / "evals.jsonl")[-1]["checkpoint"] == "000002"


def test_eval_of_rl_repeats_the_final_eval(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (proj / "r.toml").write_text(RL)
    assert main(["run", "r.toml#r"]) == 0
    final = read_jsonl(proj / "runs" / "r" / "metrics.jsonl")[-1]
    capsys.readouterr()
    assert main(["eval", "r.toml#r"]) == 0
    [row] = read_jsonl(proj / "runs" / "r" / "evals.jsonl")
    assert row["test/env/all/reward/total"] == final["test/env/all/reward/total"]
    # The recipe's main metric first (of many: the env's counters, token counts), then the rest alphabetically.
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert keys[0] == "test/env/all/reward/total" and len(keys) > 5
    assert keys[1:] == sorted(keys[1:])


def test_chat_through_a_pipe(sft_run: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """stdin not a terminal (in this process: test_chat_through_a_terminal runs the command's own process)."""
    stdin = io.StringIO("Who are you?\n/reset\n\nHello!\n/quit\nnot read\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["chat", str(sft_run), "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    # One reply per message, each a JSON string on its own line; /reset and the blank line answer nothing.
    assert len(out.splitlines()) == 2
    assert err == "(conversation reset: the next message starts a new chat)\n"  # /reset says so (it was silent)
    assert all(isinstance(json.loads(line), str) for line in out.splitlines())
    assert stdin.read() == "not read\n"  # /quit stopped the reading


def test_chat_through_a_terminal(sft_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stdin and stdout a terminal: a pseudo-terminal's end, in this process, as `runner chat` is wired (cmd_chat
    hands chat() sys.stdin and sys.stdout; chat asks stdin.isatty() and reads stdin.readline(), no readline
    module), so it runs in a thread here rather than in a process of its own that imports torch again."""
    master, slave = pty.openpty()
    tty_in = open(slave, encoding="utf-8", closefd=False)  # noqa: SIM115 - closed below
    tty_out = open(slave, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    assert tty_in.isatty()
    monkeypatch.setattr(sys, "stdin", tty_in)
    monkeypatch.setattr(sys, "stdout", tty_out)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(["chat", str(sft_run), "--max-tokens", "8"])),
                              daemon=True)
    seen = b""

    def read_until(marker: bytes, timeout: float = 120) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while marker not in seen and time.monotonic() < end:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        assert marker in seen, seen[-500:]

    try:
        thread.start()
        read_until(b"you> ")
        os.write(master, b"Who are you?\n")
        read_until(b"s> ")  # the reply, labelled with the run's name
        os.write(master, b"/reset\n")
        read_until(b"(conversation reset: the next message starts a new chat)")
        os.write(master, b"/quit\n")
        thread.join(timeout=120)
        assert not thread.is_alive() and codes == [0]
        assert b"chatting with s (checkpoint final)" in seen
    finally:
        monkeypatch.undo()
        tty_in.close()
        tty_out.close()
        os.close(slave)
        os.close(master)


def test_one_line_errors(proj: Path, trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (proj / "r.toml").write_text(SFT.format(extra=LOCAL))
    cases = [
        (["sample", "nowhere", "hi"], "neither a run dir nor a recipe FILE#name"),
        (["sample", "r.toml#s", "hi"], "has no checkpoint yet"),
        (["eval", "r.toml#s"], "has no checkpoint yet (run it first)"),
        (["eval", "r.toml#s", "--checkpoint", "base"], "not base: the held-out evals of the base model are the run's "
                                                        "step-0 eval row"),
        (["sample", "r.toml#s"], "give a prompt or --file"),
        (["sample", "r.toml#s", "hi", "--n", "0"], "--n must be >= 1"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    shutil.copytree(trained, proj / "runs" / "s")  # the recipe, run (the module's run: the same recipe and data)
    (proj / "bad.jsonl").write_text('{"prompt": "ok"}\n[1, 2]\n')
    for argv, message in [(["sample", "r.toml#s", "hi", "--checkpoint", "nope"], "no checkpoint 'nope'; available: "
                                                                                   "000002 (step 2), final (step 4), base"),
                          (["sample", "r.toml#s", "--file", "bad.jsonl"], "bad.jsonl:2: expected")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_sample_over_the_tinker_sdk(proj: Path, mocked_tinker: None, capsys: pytest.CaptureFixture[str]) -> None:
    remote = 'model = "Qwen/Qwen3-8B"\ntokenizer = "tiny"\nbackend = {kind = "tinker"}'
    # 2 steps (one eval, one save, then the final): what sampling and evaluating over the SDK need (4: 6.2 s, 2: 3.9 s).
    (proj / "r.toml").write_text(SFT.format(extra=remote).replace("max_steps = 4", "max_steps = 2"))
    assert main(["run", "r.toml#s"]) == 0
    capsys.readouterr()
    assert main(["sample", "r.toml#s", "Who are you?", "--n", "2", "--json", "--max-tokens", "6"]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(row["completions"]) == 2
    assert main(["eval", "r.toml#s"]) == 0
    assert "test/nll" in read_jsonl(proj / "runs" / "s" / "evals.jsonl")[0]


def test_eval_of_a_dpo_run(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = Path(__file__).resolve().parent.parent / "examples" / "data" / "comparisons.jsonl"
    (proj / "r.toml").write_text(f"""
[recipes.d]
lr = 0.01
max_steps = 2
eval_every = 0
save_every = 0
{LOCAL}
lora = {{rank = 4}}
algo = {{kind = "dpo", data = {{kind = "jsonl", path = "{data}"}}, batch_size = 4, test_size = 8}}
""")
    assert main(["run", "r.toml#d"]) == 0
    assert main(["eval", "r.toml#d"]) == 0
    [row] = read_jsonl(proj / "runs" / "d" / "evals.jsonl")
    assert 0.0 <= row["test/accuracy"] <= 1.0 and "test/dpo_loss" in row


def test_invalid_utf8_is_a_one_line_error(sft_run: Path, proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Undecodable bytes in a prompt (argv, a --file, chat's stdin) reached the tokenizer as lone surrogates and
    ended in a TypeError traceback; now each is a one-line error, exit 2."""
    capsys.readouterr()
    (proj / "latin1.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    (proj / "surrogate.jsonl").write_text('{"prompt": "a\\ud800"}\n')
    cases = [(["sample", str(sft_run), "caf\udce9"], "the prompt: not valid UTF-8"),
             (["sample", str(sft_run), "hi", "--system", "\udcff"], "--system: not valid UTF-8"),
             (["sample", str(sft_run), "--file", "latin1.jsonl"], "latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 16)"),
             (["sample", str(sft_run), "--file", "surrogate.jsonl"], "surrogate.jsonl:1: not valid UTF-8"),
             (["chat", str(sft_run), "--temperature", "-1"], "--temperature must be >= 0")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    # chat's stdin: these bytes, decoded as a fresh interpreter decodes a piped stdin (its encoding and error
    # handler, asked of one without torch: cmd_chat hands chat() sys.stdin as it is), here rather than in a
    # `runner chat` process that imports torch again.
    how = subprocess.run([sys.executable, "-c", "import sys; print(sys.stdin.encoding, sys.stdin.errors)"],
                         input="", capture_output=True, text=True, timeout=60, check=True).stdout.split()
    stdin = io.TextIOWrapper(io.BytesIO(b"Hello!\ncaf\xe9\n"), encoding=how[0], errors=how[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stdin", stdin)
        assert main(["chat", str(sft_run), "--max-tokens", "4"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "error: stdin: not valid UTF-8 text (at character 3)"
    assert len(out.splitlines()) == 1  # the first line was answered
