"""Dataset formats: how the columns of a public dataset's row become what an algorithm reads.

A data source (`jsonl`, `file`, `hf`) names a `format` and, optionally, `fields` (a column for each of the format's
logical fields, e.g. `fields = {prompt = "question", response = "answer"}`). Each format turns a row into up to three
canonical shapes:
  - a conversation  {"messages": [{"role", "content"}, ...]}            (SFT, distillation and generate prompts)
  - a comparison    {"prompt": [...], "chosen": [...], "rejected": [...]} (DPO, the reward model)
  - a problem       {"question": str, "answer": str}                     (RL envs: runner/data/problems.py)
A mapper returns None for a row the cookbook drops (an HH-RLHF pair whose transcripts do not differ in exactly the last
turn; a gsm8k/MATH solution without a final answer); the loaders count those and say so.

Formats (the cookbook's datasets):
  messages         {"messages": [...]}                    no_robots, tulu3 (sft)
  prompt_response  {"prompt": str, "response": str}       any instruction set
  hh_rlhf          {"chosen": str, "rejected": str}       Anthropic/hh-rlhf: full "\\n\\nHuman: ...\\n\\nAssistant: ..."
                                                           transcripts, split as tinker_cookbook/recipes/preference
  gsm8k            {"question": str, "answer": str}       answer = the text after the last "####"
  math             {"problem": str, "solution": str}      answer = the content of the last \\boxed{...}
"auto" (the default) takes rows as they are. A new format is one entry in FORMATS.
This module is pure (no I/O, no recipe types) so that the schema can validate `format` and `fields` against it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# A canonical row (a conversation, comparison or problem), checked by its reader (runner/data/).
Row = dict[str, object]
# A mapper reads the row's logical fields (already looked up through `fields`: each column's raw value) and returns a
# canonical row, or None.
Mapper = Callable[[Mapping[str, object]], "Row | None"]


class FormatError(ValueError):
    """A row that does not fit its format (the loader adds where the row is)."""


@dataclass(frozen=True)
class Format:
    # Logical field -> the column it is read from by default.
    fields: dict[str, str]
    conversation: Mapper | None = None
    comparison: Mapper | None = None
    problem: Mapper | None = None
    # Canonical shapes this format gives, for error messages.
    doc: str = ""

    def mapper(self, shape: str) -> Mapper | None:
        return {"conversation": self.conversation, "comparison": self.comparison, "problem": self.problem}[shape]


def _text(cols: Mapping[str, object], key: str) -> str:
    value = cols[key]
    if not isinstance(value, str):
        raise FormatError(f"field {key!r} must be a string, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------- answers


def gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8K solution: the text after "####" on the last line that starts with it (commas
    dropped), as the cookbook's extract_gsm8k_final_answer; None when there is none."""
    for line in reversed(text.splitlines()):
        s = line.strip()
        if s.startswith("####"):
            content = s[4:].strip()
            if content.startswith(":"):
                content = content[1:].strip()
            return content.replace(",", "").strip()
    matches = re.findall(r"####\s*(.+)", text)
    return matches[-1].strip() if matches else None


def boxed_answer(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces kept), or of "\\boxed 2" without braces, as the cookbook's
    extract_boxed; None when there is none or the braces do not match."""
    boxed, stack = [], []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}":
            if not stack:
                return None
            start = stack.pop()
            if text[:start].endswith("\\boxed"):
                boxed.append(text[start + 1 : i])
    if boxed:
        return boxed[-1]
    match = re.search(r"\\boxed\s+([a-zA-Z0-9]+)", text)
    return match.group(1) if match else None


def hh_transcript(text: str) -> list[dict[str, str]]:
    """An HH-RLHF transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") as messages, split on "Human:" / "Assistant:" with
    each content stripped (tinker_cookbook/recipes/preference/datasets.py)."""
    parts = re.split(r"(Human:|Assistant:)", text)
    if not parts[0].strip():
        parts = parts[1:]
    out = []
    for i in range(0, len(parts) - 1, 2):
        delimiter, content = parts[i].strip(), parts[i + 1].strip()
        if delimiter == "Human:":
            out.append({"role": "user", "content": content})
        elif delimiter == "Assistant:":
            out.append({"role": "assistant", "content": content})
    return out


# ---------------------------------------------------------------- the formats


def _chat(user: str, assistant: str) -> Row:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def _hh_comparison(cols: Mapping[str, object]) -> Row | None:
    """The cookbook's hhh_example_to_comparison: both transcripts agree on every turn but the last; None otherwise."""
    chosen, rejected = hh_transcript(_text(cols, "chosen")), hh_transcript(_text(cols, "rejected"))
    if not chosen or len(chosen) != len(rejected):
        return None
    same = [a == b for a, b in zip(chosen, rejected, strict=True)]
    if same != [True] * (len(same) - 1) + [False]:
        return None
    return {"prompt": chosen[:-1], "chosen": [chosen[-1]], "rejected": [rejected[-1]]}


def _problem(question: str, answer: str | None) -> Row | None:
    return None if answer is None else {"question": question, "answer": answer}


FORMATS: dict[str, Format] = {
    "messages": Format(
        {"messages": "messages"},
        conversation=lambda c: {"messages": c["messages"]},
        doc="conversations"),
    "prompt_response": Format(
        {"prompt": "prompt", "response": "response"},
        conversation=lambda c: _chat(_text(c, "prompt"), _text(c, "response")),
        problem=lambda c: {"question": _text(c, "prompt"), "answer": _text(c, "response")},
        doc="conversations, problems"),
    "hh_rlhf": Format(
        {"chosen": "chosen", "rejected": "rejected"},
        conversation=lambda c: {"messages": m} if (m := hh_transcript(_text(c, "chosen"))) else None,
        comparison=_hh_comparison,
        doc="comparisons, conversations (the chosen transcript)"),
    "gsm8k": Format(
        {"question": "question", "answer": "answer"},
        conversation=lambda c: _chat(_text(c, "question"), _text(c, "answer")),
        problem=lambda c: _problem(_text(c, "question"), gsm8k_answer(_text(c, "answer"))),
        doc="problems, conversations (question -> full solution)"),
    "math": Format(
        {"problem": "problem", "solution": "solution"},
        conversation=lambda c: _chat(_text(c, "problem"), _text(c, "solution")),
        problem=lambda c: _problem(_text(c, "problem"), boxed_answer(_text(c, "solution"))),
        doc="problems, conversations (problem -> full solution)"),
}
AUTO = "auto"


def resolve_format(name: str, fields: Mapping[str, str]) -> str:
    """The format a source uses: `name`, or for "auto" with `fields` the one format whose logical fields are exactly
    the keys given ("auto" without fields: rows as they are). ValueError (the schema's message) when that fails or a
    field is not one of the format's."""
    if name == AUTO:
        if not fields:
            return AUTO
        fits = [n for n, f in FORMATS.items() if set(f.fields) == set(fields)]
        if len(fits) != 1:
            raise ValueError(f"fields {sorted(fields)} fit no single format; also give format = one of: "
                             f"{', '.join(FORMATS)}")
        return fits[0]
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; expected one of: {AUTO}, {', '.join(FORMATS)}")
    unknown = [k for k in fields if k not in FORMATS[name].fields]
    if unknown:
        raise ValueError(f"fields: {', '.join(map(repr, unknown))} is not a field of format {name!r} (its fields: "
                         f"{', '.join(FORMATS[name].fields)})")
    return name


def columns(name: str, fields: Mapping[str, str]) -> dict[str, str]:
    """Logical field -> column, for a resolved format (not "auto")."""
    return {**FORMATS[name].fields, **fields}


def map_row(row: object, name: str, fields: Mapping[str, str], shape: str) -> Row | None:
    """`row` as the canonical `shape` ("conversation", "comparison", "problem") under format `name` (resolved, not
    "auto"). FormatError: not an object, a missing column (naming those that exist), a field of the wrong type, or a
    format that does not give `shape`. None: a row the cookbook drops."""
    fmt = FORMATS[name]
    mapper = fmt.mapper(shape)
    if mapper is None:
        raise FormatError(f"format {name!r} gives {fmt.doc}, not {shape}s")
    if not isinstance(row, dict):
        raise FormatError(f"expected an object with columns, got {type(row).__name__}")
    cols: dict[str, object] = {}
    for key, column in columns(name, fields).items():
        if column not in row:
            have = ", ".join(map(repr, row)) or "none"
            raise FormatError(f"no column {column!r} (format {name!r} reads {key} from it); the row's columns: {have}")
        cols[key] = row[column]
    return mapper(cols)
