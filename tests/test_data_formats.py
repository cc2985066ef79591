"""Data sources: the cookbook's dataset formats, file kinds, streaming reads, and data-file errors.

    pytest tests/test_data_formats.py

Every file is written here (no hub access). Where tinker_cookbook imports, its own parsers (HH-RLHF transcripts,
the gsm8k "####" answer, MATH's last \\boxed{}) are the reference.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from backends.errors import UserError
from runner.cli import main
from runner.data import files
from runner.data.comparisons import load_pairs
from runner.data.conversations import ROLES, load_conversations
from runner.data.files import iter_rows
from runner.data.problems import Problem, load_problems
from runner.recipe.formats import FORMATS, boxed_answer, gsm8k_answer, hh_transcript
from runner.recipe.load import check_recipe, load_recipe
from runner.recipe.sources import HF, File, Jsonl

NO_ROBOTS = [  # no_robots / tulu3 rows: "messages" plus other columns; one row has a "name" the others lack
    {"prompt": "Say hi", "prompt_id": "a1", "category": "Chat",
     "messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}]},
    {"prompt": "Add", "prompt_id": "a2", "category": "Math",
     "messages": [{"role": "system", "content": "Be brief.", "name": "sys"}, {"role": "user", "content": "1+1?"},
                  {"role": "assistant", "content": "2"}]},
]
HH = [  # Anthropic/hh-rlhf: two full transcripts that differ in the last assistant turn
    {"chosen": "\n\nHuman: What is 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?\n\nAssistant: 6.",
     "rejected": "\n\nHuman: What is 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?\n\nAssistant: No idea."},
    {"chosen": "\n\nHuman: Hello\n\nAssistant: Hi there.", "rejected": "\n\nHuman: Hello\n\nAssistant: Go away."},
    # malformed (the transcripts differ before the last turn): the cookbook drops it
    {"chosen": "\n\nHuman: A\n\nAssistant: B", "rejected": "\n\nHuman: C\n\nAssistant: D"},
]
GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A big sum?", "answer": "It is 1,000 + 234.\n#### 1,234"},
    {"question": "No final answer", "answer": "I forgot the marker"},
]
MATH = [
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{2}$?", "solution": "It is $\\boxed{1}$.", "level": "Level 1"},
    {"problem": "Simplify.", "solution": "First \\boxed{2}, then finally $\\boxed{\\frac{a}{b}}$.", "level": "L2"},
    {"problem": "Unanswered", "solution": "no box here", "level": "L3"},
]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- formats


def test_messages_format_from_parquet_drops_arrow_none_keys(tmp_path: Path) -> None:
    path = tmp_path / "no_robots.parquet"
    pq.write_table(pa.Table.from_pylist(NO_ROBOTS), path)
    convs, where = load_conversations(File(path=str(path), format="messages"))
    # Arrow gives every message a "name" key (None where absent): dropped, the real one kept.
    assert convs == [NO_ROBOTS[0]["messages"], NO_ROBOTS[1]["messages"]]
    assert where == [f"{path}[0]", f"{path}[1]"]


def test_prompt_response_with_fields(tmp_path: Path) -> None:
    rows = [{"instruction": "Name a colour.", "output": "Blue.", "id": 1}]
    src = Jsonl(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), fields={"prompt": "instruction",
                                                                           "response": "output"})
    assert src.format == "auto"  # fields alone pick the format whose fields they are
    convs, _ = load_conversations(src)
    assert convs == [[{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]]
    problems = load_problems(Jsonl(path=src.path, format="prompt_response",
                                   fields={"prompt": "instruction", "response": "output"}))
    assert problems == [Problem("Name a colour.", "Blue.", f"{src.path}:1")]


def test_hh_rlhf_comparisons_split_as_the_cookbook(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "hh.jsonl", HH)
    pairs = load_pairs(Jsonl(path=str(path), format="hh_rlhf"))
    assert (pairs.rows, pairs.dropped, len(pairs.pairs)) == (3, 1, 2)
    assert "1 row dropped" in capsys.readouterr().err  # one row, singular (it said "1 rows")
    first = pairs.pairs[0]
    assert first.prompt == [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                            {"role": "user", "content": "And 3+3?"}]
    assert first.chosen == [{"role": "assistant", "content": "6."}]
    assert first.rejected == [{"role": "assistant", "content": "No idea."}]
    assert first.where == f"{path}:1"
    # SFT on the same file trains the chosen transcripts.
    convs, _ = load_conversations(Jsonl(path=str(path), format="hh_rlhf"))
    assert convs[1] == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}]


@pytest.mark.extras("cookbook")
def test_hh_rlhf_parsing_is_the_cookbooks(tmp_path: Path) -> None:
    from tinker_cookbook.recipes.preference.datasets import _hhh_parse_conversation, hhh_example_to_comparison

    pairs = load_pairs(Jsonl(path=str(write_jsonl(tmp_path / "hh.jsonl", HH)), format="hh_rlhf"))
    odd = ["Preamble\n\nHuman: hi\n\nAssistant:", "Human: a Assistant: b Human:", "", "\n\nAssistant: x: y"]
    for text in [*(r["chosen"] for r in HH), *odd]:
        assert hh_transcript(text) == _hhh_parse_conversation(text), text
    for row, pair in zip(HH[:2], pairs.pairs, strict=True):
        ref = hhh_example_to_comparison(row)
        assert ref is not None
        c = ref.comparison
        assert (pair.prompt, pair.chosen, pair.rejected) == (c.prompt_conversation, c.completion_A, c.completion_B)
    assert hhh_example_to_comparison(HH[2]) is None


def test_gsm8k_and_math_problems(tmp_path: Path) -> None:
    gsm = load_problems(Jsonl(path=str(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)), format="gsm8k"))
    assert [(p.question, p.answer) for p in gsm] == [(GSM8K[0]["question"], "7"), (GSM8K[1]["question"], "1234")]
    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH), path)
    math = load_problems(File(path=str(path), format="math"))
    assert [(p.question, p.answer, p.where) for p in math] == [
        (MATH[0]["problem"], "1", f"{path}[0]"), (MATH[1]["problem"], "\\frac{a}{b}", f"{path}[1]")]
    # As conversations: the question and the full worked solution.
    convs, _ = load_conversations(File(path=str(path), format="math"))
    assert convs[0][1] == {"role": "assistant", "content": MATH[0]["solution"]}


@pytest.mark.extras("cookbook")
def test_gsm8k_and_math_answers_are_the_cookbooks() -> None:
    from tinker_cookbook.recipes.math_rl.math_env import extract_gsm8k_final_answer
    from tinker_cookbook.recipes.math_rl.math_grading import extract_boxed

    texts = [r["answer"] for r in GSM8K[:2]] + ["#### : 12", "a\n#### 5\nmore\n#### 6 \n", "x ####3"]
    for text in texts:
        assert gsm8k_answer(text) == extract_gsm8k_final_answer(text)
    for text in [r["solution"] for r in MATH[:2]] + ["\\boxed 7 is it", "\\boxed{\\boxed{x}}", "\\boxed{{a}{b}}"]:
        assert boxed_answer(text) == extract_boxed(text)


def test_problems_as_they_are_and_their_errors(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1?", "answer": 2}, {"question": "2+2?", "answer": "4"}])
    assert load_problems(Jsonl(path=str(path))) == [Problem("1+1?", "2", f"{path}:1"), Problem("2+2?", "4", f"{path}:2")]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"q": "1+1?", "a": 2}])
    with pytest.raises(UserError, match=r"bad.jsonl:1: expected an object with \"question\" and \"answer\" "
                                        r"\(got: 'q', 'a'\)"):
        load_problems(Jsonl(path=str(bad)))
    with pytest.raises(UserError, match="format 'hh_rlhf' gives comparisons, conversations .*, not problems"):
        load_problems(Jsonl(path=str(write_jsonl(tmp_path / "hh.jsonl", HH)), format="hh_rlhf"))


def test_missing_mapped_column_names_the_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": "x", "completion": "y"}])
    with pytest.raises(UserError) as e:
        load_conversations(Jsonl(path=str(path), format="prompt_response", fields={"response": "completion"}))
    assert str(e.value) == (f"{path}:1: no column 'prompt' (format 'prompt_response' reads prompt from it); the "
                            "row's columns: 'query', 'completion'")
    with pytest.raises(UserError, match=r"d.jsonl:1: expected an object with a \"messages\" list \(the row's columns: 'query', 'completion'\)"):
        load_conversations(Jsonl(path=str(path)))


def test_format_and_fields_are_checked_when_the_recipe_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", NO_ROBOTS)

    def recipe(data: str) -> str:
        (tmp_path / "r.toml").write_text(f'[recipes.x.algo]\nkind = "sft"\ndata = {data}\n')
        return "r.toml#x"

    with pytest.raises(UserError, match="unknown format 'alpaca'; expected one of: auto, " + ", ".join(FORMATS)):
        load_recipe(recipe('{kind = "jsonl", path = "d.jsonl", format = "alpaca"}'))
    with pytest.raises(UserError, match="'question' is not a field of format 'math' .*problem, solution"):
        load_recipe(recipe('{kind = "jsonl", path = "d.jsonl", format = "math", fields = {question = "q"}}'))
    with pytest.raises(UserError, match=r"fields \['prompt'\] fit no single format"):
        load_recipe(recipe('{kind = "jsonl", path = "d.jsonl", fields = {prompt = "q"}}'))
    loaded = load_recipe(recipe('{kind = "file", path = "d.jsonl", format = "messages", max_rows = 1}'))[1]
    check_recipe(loaded, "r.toml#x")
    assert len(load_conversations(loaded.algo.data)[0]) == 1  # pyright: ignore[reportAttributeAccessIssue]


# ---------------------------------------------------------------- file kinds


def _write_all_kinds(tmp_path: Path) -> dict[str, Path]:
    import datasets

    table = pa.Table.from_pylist(GSM8K)
    out = {"jsonl": write_jsonl(tmp_path / "g.jsonl", GSM8K), "json": tmp_path / "g.json",
           "parquet": tmp_path / "g.parquet", "arrow_file": tmp_path / "g.arrow", "disk": tmp_path / "disk",
           "disk_dict": tmp_path / "disk_dict"}
    out["json"].write_text(json.dumps(GSM8K, indent=1))
    pq.write_table(table, out["parquet"], row_group_size=2)
    with pa.ipc.new_file(str(out["arrow_file"]), table.schema) as w:
        w.write_table(table, max_chunksize=2)
    ds = datasets.Dataset.from_list(GSM8K)
    ds.save_to_disk(str(out["disk"]))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(out["disk_dict"]))
    # The Arrow IPC *stream* datasets writes inside a save_to_disk folder, as a file of its own.
    out["arrow_stream"] = next(out["disk"].glob("*.arrow"))
    return out


def test_every_file_kind_reads_the_same_rows(tmp_path: Path) -> None:
    kinds = _write_all_kinds(tmp_path)
    for kind, path in kinds.items():
        for streaming in (False, True):
            rows = [r for r, _ in iter_rows(File(path=str(path), streaming=streaming))]
            assert rows == GSM8K, (kind, streaming)
            problems = load_problems(File(path=str(path), format="gsm8k", streaming=streaming))
            assert [p.answer for p in problems] == ["7", "1234"], (kind, streaming)
    test = [r for r, _ in iter_rows(File(path=str(kinds["disk_dict"]), split="test"))]
    assert test == GSM8K[:1]
    # The hf kind reads a local save_to_disk folder too, streaming or not.
    for streaming in (False, True):
        assert [r for r, _ in iter_rows(HF(name=str(kinds["disk_dict"]), streaming=streaming))] == GSM8K
    with pytest.raises(UserError, match="no split 'validation'; it has: train, test"):
        list(iter_rows(File(path=str(kinds["disk_dict"]), split="validation")))
    csv = tmp_path / "g.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(UserError, match=r"unknown kind '.csv'; expected one of .jsonl, .ndjson, .json, .parquet"):
        list(iter_rows(File(path=str(csv))))


def test_streaming_reads_only_what_it_yields(tmp_path: Path) -> None:
    """A parquet file whose last row group is corrupt: streaming with max_rows never touches it; a whole read says
    so in one line. The same for a JSONL file with a bad line after the rows taken."""
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(3000)]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1000, compression="NONE")
    meta = pq.ParquetFile(path).metadata
    last = meta.row_group(meta.num_row_groups - 1).column(0)
    data = bytearray(path.read_bytes())
    data[last.data_page_offset : last.data_page_offset + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    src = File(path=str(path), format="gsm8k", streaming=True, max_rows=1500)
    assert [p.answer for p in load_problems(src)] == [str(i) for i in range(1500)]
    with pytest.raises(UserError, match=r"big.parquet: cannot read it as parquet: "):
        load_problems(File(path=str(path), format="gsm8k"))
    jsonl = tmp_path / "big.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows[:100]) + "{oops\n")
    assert len(load_problems(File(path=str(jsonl), streaming=True, max_rows=100))) == 100
    with pytest.raises(UserError, match=r"big.jsonl:101: not valid JSON"):
        load_problems(Jsonl(path=str(jsonl)))


def test_streaming_parquet_reads_only_the_mapped_columns(tmp_path: Path) -> None:
    path = tmp_path / "wide.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "blob": "x" * 1000} for r in MATH]), path)
    seen = [r for r, _ in iter_rows(File(path=str(path), format="math", streaming=True))]
    assert all(set(r) == {"problem", "solution"} for r in seen)


# ---------------------------------------------------------------- errors: roles, encoding, permissions


CHECK_RECIPE = '[recipes.x.algo]\nkind = "sft"\ndata = {kind = "%s", path = "%s"}\n'


def _check_and_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, path: str) -> list[str]:
    """`runner check` and `runner run` of a recipe on the data: each must exit 2 with one line; those lines."""
    (tmp_path / "r.toml").write_text(CHECK_RECIPE % (kind, path))
    lines = []
    for command in ("check", "run"):
        assert main([command, "r.toml#x"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: r.toml#x: algo.data: "), err
        lines.append(err.strip())
    assert lines[0] == lines[1]
    return lines


def test_unknown_role_is_rejected_by_check_and_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "yo"}]}
    write_jsonl(tmp_path / "d.jsonl", [good, good, bad])
    (line,) = set(_check_and_run(tmp_path, capsys, "jsonl", "d.jsonl"))
    assert line.endswith(f"d.jsonl:3: messages[1].role 'asistant' is not a role; expected one of: {', '.join(ROLES)}")
    with pytest.raises(UserError, match=r"d.jsonl:3: messages\[1\].role 'asistant' is not a role"):
        load_conversations(Jsonl(path="d.jsonl"))  # what `run` loads, not only what `check` reads
    # In a parquet file too, and in the prompt of a comparison.
    pq.write_table(pa.Table.from_pylist([good, bad]), tmp_path / "d.parquet")
    assert _check_and_run(tmp_path, capsys, "file", "d.parquet")[0].endswith("d.parquet[1]: messages[1].role "
                                                                              "'asistant' is not a role; expected "
                                                                              f"one of: {', '.join(ROLES)}")
    pair = {"prompt": [{"role": "human", "content": "q"}], "chosen": "a", "rejected": "b"}
    with pytest.raises(UserError, match=r"c.jsonl:1: prompt\[0\].role 'human' is not a role"):
        load_pairs(Jsonl(path=str(write_jsonl(tmp_path / "c.jsonl", [pair]))))


def test_non_utf8_file_is_one_line_from_check_and_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    latin1 = json.dumps({"messages": [{"role": "user", "content": "caf"}]}).encode().replace(b"caf", b"caf\xe9")
    (tmp_path / "d.jsonl").write_bytes(good + b"\n" + latin1 + b"\n")
    (line,) = set(_check_and_run(tmp_path, capsys, "jsonl", "d.jsonl"))
    assert line.endswith("d.jsonl:2: not UTF-8 text (byte 0xe9 at column 47); save the file as UTF-8")
    (tmp_path / "d.json").write_bytes(b"[" + good + b",\n" + latin1 + b"]")
    (line,) = set(_check_and_run(tmp_path, capsys, "file", "d.json"))
    assert line.endswith("d.json:2: not UTF-8 text (byte 0xe9 at column 47); save the file as UTF-8")


def test_unreadable_file_is_one_line_from_check_and_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    pq.write_table(pa.Table.from_pylist(NO_ROBOTS), tmp_path / "d.parquet")
    if os.geteuid() != 0:  # a real chmod (root reads anything): the OS refuses
        for name in ("d.jsonl", "d.parquet"):
            (tmp_path / name).chmod(0)
            (line,) = set(_check_and_run(tmp_path, capsys, "file", name))
            assert line.endswith(f"data file {name}: cannot read it (permission denied)")
            (tmp_path / name).chmod(0o644)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files, "open", refuse, raising=False)  # the reader's open() refuses, as for another user
    for kind, name in (("jsonl", "d.jsonl"), ("file", "d.parquet")):
        (line,) = set(_check_and_run(tmp_path, capsys, kind, name))
        assert line.endswith(f"data file {name}: cannot read it (permission denied)")


def test_check_names_a_row_of_no_known_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}, {"text": "raw"}])
    (line,) = set(_check_and_run(tmp_path, capsys, "jsonl", "d.jsonl"))
    assert "d.jsonl:2: a row of no known shape (columns: 'text'); expected \"messages\"" in line
    # With a format, the check maps each row as the run will: a missing column names the columns there are.
    (tmp_path / "r.toml").write_text('[recipes.x.algo]\nkind = "sft"\n'
                                     'data = {kind = "jsonl", path = "d.jsonl", format = "gsm8k"}\n')
    assert main(["check", "r.toml#x"]) == 2
    assert capsys.readouterr().err == ("error: r.toml#x: algo.data: d.jsonl:1: no column 'question' (format 'gsm8k' "
                                       "reads question from it); the row's columns: 'messages'\n")


def test_unreadable_or_non_utf8_recipe_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.toml").write_bytes(b'[recipes.x]\nmodel = "caf\xe9"\n')
    assert main(["check", "r.toml#x"]) == 2
    assert capsys.readouterr().err == "error: r.toml: not UTF-8 text\n"
    real = Path.read_bytes

    def refuse(self: Path) -> bytes:
        if self.name == "r.toml":
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", refuse)
    for command in ("check", "run", "show"):
        assert main([command, "r.toml#x"]) == 2
        assert capsys.readouterr().err == "error: r.toml: cannot read it (permission denied)\n"


def test_check_reads_a_file_once_until_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.data import check

    path = write_jsonl(tmp_path / "d.jsonl", NO_ROBOTS)
    reads: list[Path] = []
    real = files.read_jsonl
    monkeypatch.setattr(files, "read_jsonl", lambda p: reads.append(p) or real(p))
    src = Jsonl(path=str(path))
    assert check.check_source(src) == check.check_source(Jsonl(path=str(path))) == 2  # a sweep's points: one read
    assert reads == [path]
    write_jsonl(path, [*NO_ROBOTS, {"messages": [{"role": "gpt", "content": "x"}]}])
    os.utime(path, ns=(1, 1))  # a new mtime even on a coarse clock
    with pytest.raises(UserError, match=r"d.jsonl:3: messages\[0\].role 'gpt' is not a role"):
        check.check_source(src)


def test_run_reads_its_data_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`runner run` of a recipe that runs alone: the up-front check's rows go to the loader (files.keep_rows), so the
    file is read once; the loader gets exactly what a fresh read gives, and a file changed in between is read again."""
    from runner.data import check

    monkeypatch.setattr(files, "_KEPT", {})
    path = write_jsonl(tmp_path / "d.jsonl", NO_ROBOTS)
    reads: list[Path] = []
    real = files.read_jsonl
    monkeypatch.setattr(files, "read_jsonl", lambda p: reads.append(p) or real(p))
    src = Jsonl(path=str(path))
    fresh = load_conversations(Jsonl(path=str(path)))
    reads.clear()
    assert check._check(src, keep=True) == 2
    assert load_conversations(src) == fresh and reads == [path]  # handed over, not read again
    assert load_conversations(src) == fresh and reads == [path, path]  # taken once: the next read reads
    # Changed between the check and the load: read again.
    check._check(src, keep=True)
    write_jsonl(path, NO_ROBOTS[:1])
    os.utime(path, ns=(1, 1))
    assert load_conversations(src)[0] == fresh[0][:1] and len(reads) == 4
    assert not files._KEPT  # nothing left behind: the stale entry went with the read
    # Over the cap: not kept.
    monkeypatch.setattr(files, "KEEP_ROWS", 0)  # the file holds 1 row now
    check._check(src, keep=True)
    assert not files._KEPT
    # End to end: `runner run` reads the data file once (check + load), `runner check` keeps nothing.
    monkeypatch.setattr(files, "KEEP_ROWS", 2_000_000)
    monkeypatch.chdir(tmp_path)
    write_jsonl(path, NO_ROBOTS * 4)
    (tmp_path / "r.toml").write_text(CHECK_RECIPE % ("jsonl", "d.jsonl") + "[recipes.x]\nmax_steps = 1\neval_every = 0\n")
    reads.clear()
    assert main(["check", "r.toml#x"]) == 0 and not files._KEPT
    reads.clear()
    check._CHECKED.clear()
    assert main(["run", "r.toml#x", f"log_dir={tmp_path / 'run'}", "algo.batch_size=2"]) == 0
    assert [p.name for p in reads] == ["d.jsonl"] and not files._KEPT
