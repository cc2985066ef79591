"""`runner check` looks at the tokenizer when it is here (the embedded one always, a local folder, the HF cache) and
checks the renderer against it; errors raised while a run runs name FILE#recipe too; a run that fails before it
writes anything leaves no run dir behind.

    pytest tests/test_check_renderer.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.local.tiny import build_core_tokenizer
from runner.cli import main

RECIPE = """\
[recipes.x]
model = "tiny"
max_steps = 1
save_every = 0
eval_every = 0
algo = {kind = "sft", data = {kind = "jsonl", path = "d.jsonl"}, batch_size = 2, max_length = 64}
"""
LLAMA3 = "<|begin_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|>"


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # an empty cache: no hub id is here
    (tmp_path / "r.toml").write_text(RECIPE)
    (tmp_path / "d.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 4)
    return tmp_path


def test_check_refuses_a_renderer_the_tiny_tokenizer_cannot_write(workdir: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "r.toml", "renderer=llama3"]) == 2
    assert capsys.readouterr().err == (
        f"error: r.toml#x: renderer 'llama3': the tokenizer (tiny) does not have {LLAMA3} as single tokens, which "
        'this format writes: pick the renderer of the model\'s family (or "hf": its chat template)\n')
    assert main(["check", "r.toml", "renderer=qwen3"]) == 0  # tiny has <|im_start|> and <|im_end|>
    assert main(["check", "r.toml", "renderer=role_colon"]) == 0


def test_check_reads_a_local_tokenizer_folder_and_trusts_a_hub_id_not_here(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "tok").mkdir()
    build_core_tokenizer().save(str(workdir / "tok" / "tokenizer.json"))
    assert main(["check", "r.toml#x", "renderer=kimi_k2", "tokenizer=tok"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: r.toml#x: renderer 'kimi_k2': the tokenizer (tok) does not have <|im_user|>")
    # "hf" needs a chat template: the folder has none (tiny's own is built in code).
    (workdir / "tok" / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    assert main(["check", "r.toml#x", "renderer=hf", "tokenizer=tok"]) == 2
    assert capsys.readouterr().err == ("error: r.toml#x: renderer 'hf': the tokenizer (tok) has no chat template; set "
                                       "renderer = \"role_colon\" (a base model) or the model family's renderer\n")
    (workdir / "tok" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert main(["check", "r.toml#x", "renderer=hf", "tokenizer=tok"]) == 0
    assert main(["check", "r.toml#x", "renderer=hf"]) == 0  # tiny
    # Not on this machine: nothing to look at (and nothing downloads); the run checks it when it loads it.
    assert main(["check", "r.toml#x", "renderer=llama3", "tokenizer=someone/not-downloaded"]) == 0


def test_a_run_that_fails_before_it_starts_names_the_recipe_and_leaves_no_run_dir(
        workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "r.toml#x", "model=./no-such-model"]) == 2
    assert capsys.readouterr().err == "error: r.toml#x: model folder './no-such-model' does not exist\n"
    assert not (workdir / "runs").exists()
    # A dir that holds only a lock (a run killed at that moment): the next run takes it over without a word.
    (workdir / "runs" / "x").mkdir(parents=True)
    (workdir / "runs" / "x" / ".lock").write_text("")
    assert main(["run", "r.toml#x"]) == 0
    out, err = capsys.readouterr()
    assert "error" not in err and "exists" not in out + err and "starts over" not in out + err
    assert (workdir / "runs" / "x" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("renderer", ["gpt_oss_no_sysprompt", "gpt_oss_low_reasoning", "gpt_oss_high_reasoning"])
def test_check_refuses_gpt_oss_on_a_tokenizer_without_its_tokens(workdir: Path, capsys: pytest.CaptureFixture[str],
                                                                 renderer: str) -> None:
    """gpt_oss_* were registered as lambdas, whose required tokens check could not see: it said ok, run failed."""
    assert main(["check", "r.toml", f"renderer={renderer}"]) == 2
    assert capsys.readouterr().err == (
        f"error: r.toml#x: renderer {renderer!r}: the tokenizer (tiny) does not have <|start|>, <|end|>, "
        "<|message|>, <|channel|>, <|return|>, <|call|> as single tokens, which this format writes: pick the "
        'renderer of the model\'s family (or "hf": its chat template)\n')
