"""Preference data: labelled comparisons of two completions of one prompt, for DPO and the reward model.

Rows (any data source of runner/data/files.py; a source with `format = "hh_rlhf"` maps the HH-RLHF transcripts first,
runner/recipe/formats.py), one of:
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
  {"comparison": {"prompt_conversation": [...], "completion_A": [...], "completion_B": [...]},
   "label": "A" | "B" | "Tie"}                                    (the cookbook's LabeledComparison)
A completion may also be a plain string (one assistant message). A "Tie" says nothing about which side is better,
so it is dropped and counted (the cookbook silently makes B the winner). A bad row is one UserError naming its
file and line.

Rendering (shared by DPO, the reward model and runner/rewards/judge.py):
  - `render_completion`: prompt + completion through the recipe's renderer (or the tokenizer's chat template); weight 1 on every token after
    the prompt's generation header (the completion's content and end-of-turn), 0 on the prompt;
  - `judge_messages`: the reward model's input, one user message showing the conversation and both completions and
    asking which is better; the target is the assistant reply "A" or "B". One user message (not the cookbook's
    system separators between turns) so that any chat template renders it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from backends.errors import UserError
from runner.data.conversations import Conversation, describe, mapped_rows, messages_of
from runner.data.position import check_resume
from runner.recipe.common import DataSource, Json
from runner.renderers.chat_template import encode, prefix_len, template

if TYPE_CHECKING:
    from runner.renderers.base import Renderer, Tokenizer

LABELS = ("A", "B", "Tie")
T = TypeVar("T")


@dataclass(frozen=True)
class Pair:
    """A comparison with a winner."""

    prompt: Conversation
    chosen: Conversation
    rejected: Conversation
    where: str


@dataclass(frozen=True)
class Pairs:
    pairs: list[Pair]
    # Rows labelled "Tie", dropped.
    ties: int
    rows: int
    source: str
    # Rows the source's format drops (an HH-RLHF pair whose transcripts differ in more than the last turn).
    dropped: int = 0


_NOTED: set[str] = set()


def load_pairs(source: DataSource) -> Pairs:
    """Every row of `source` as a Pair (ties dropped and counted); UserError on the first bad row."""
    rows, where, dropped = mapped_rows(source, "comparison")
    pairs, ties = [], 0
    for row, w in zip(rows, where, strict=True):
        pair = parse_row(row, w)
        if pair is None:
            ties += 1
        else:
            pairs.append(pair)
    name = describe(source)
    if not pairs:
        raise UserError(f"data source {name} has no comparisons with a winner ({len(rows)} rows, {ties} ties, "
                        f"{dropped} dropped)")
    note = f"note: {name}: {ties} of {len(rows)} rows are ties (label \"Tie\"), dropped: a tie says nothing " \
           "about which completion is better"
    if ties and note not in _NOTED:  # once per process: a chain's dry run reads the same file in two stages
        _NOTED.add(note)
        print(note, file=sys.stderr)
    return Pairs(pairs, ties, len(rows) + dropped, name, dropped)


def parse_row(row: object, where: str) -> Pair | None:
    """One row as a Pair; None for a tie."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object with \"prompt\", \"chosen\", \"rejected\" (or \"comparison\" "
                        "and \"label\")")
    if "comparison" in row:
        c, label = row["comparison"], row.get("label")
        if not isinstance(c, dict):
            raise UserError(f"{where}: \"comparison\" must be an object with \"prompt_conversation\", "
                            "\"completion_A\", \"completion_B\"")
        missing = [k for k in ("prompt_conversation", "completion_A", "completion_B") if k not in c]
        if missing:
            raise UserError(f"{where}: comparison has no {', '.join(repr(k) for k in missing)}")
        if label not in LABELS:
            raise UserError(f"{where}: \"label\" must be one of \"A\", \"B\", \"Tie\", got {label!r}")
        prompt = messages_of(c["prompt_conversation"], where, "comparison.prompt_conversation")
        a = _completion(c["completion_A"], where, "comparison.completion_A")
        b = _completion(c["completion_B"], where, "comparison.completion_B")
        if label == "Tie":
            return None
        return Pair(prompt, a, b, where) if label == "A" else Pair(prompt, b, a, where)
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        raise UserError(f"{where}: no {', '.join(repr(k) for k in missing)} (expected \"prompt\", \"chosen\", "
                        "\"rejected\", or the cookbook's \"comparison\" and \"label\")")
    return Pair(messages_of(row["prompt"], where, "prompt"), _completion(row["chosen"], where, "chosen"),
                _completion(row["rejected"], where, "rejected"), where)


def _completion(value: object, where: str, key: str) -> Conversation:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return messages_of(value, where, key)


# ---------------------------------------------------------------- rendering


def render_completion(renderer: Renderer, prompt: Conversation, completion: Conversation) -> tuple[list[int], list[float]]:
    """Tokens of prompt + completion and their weights, with the recipe's renderer (or a tokenizer: its chat
    template). Chat template: 1 from the end of the prompt's generation header (when the completion starts with
    an assistant turn) to the end, 0 before. A named renderer: as its supervised example trains the completion
    (one assistant message: last_assistant_message; several: each completion message's content)."""
    from runner.renderers import Renderer
    from runner.renderers.hf import HFTemplateRenderer

    if isinstance(renderer, Renderer) and not isinstance(renderer, HFTemplateRenderer):
        if len(completion) == 1 and completion[0]["role"] == "assistant":
            return renderer.build_supervised_example([*prompt, *completion], "last_assistant_message")
        flagged = [{**m, "trainable": False} for m in prompt] + [{**m, "trainable": True} for m in completion]
        return renderer.build_supervised_example(flagged, "customized")
    tokenizer = renderer.tokenizer if isinstance(renderer, Renderer) else renderer
    tokens = encode(tokenizer, template(tokenizer, prompt + completion, False))
    start = prefix_len(tokenizer, prompt, tokens, completion[0]["role"] == "assistant")
    return tokens, [0.0] * start + [1.0] * (len(tokens) - start)


def _text(messages: Conversation) -> str:
    """Messages as plain lines; a completion that is one assistant message is its content alone."""
    if len(messages) == 1 and messages[0]["role"] == "assistant":
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def judge_messages(prompt: Conversation, a: Conversation, b: Conversation) -> Conversation:
    """The reward model's question about completions a (shown as A) and b (shown as B)."""
    conversation = "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    text = f"{conversation}\n\nCompletion A: {_text(a)}\n\nCompletion B: {_text(b)}\n\nWhich completion is better, A or B?"
    return [{"role": "user", "content": text}]


def render_judge(renderer: Renderer | Tokenizer, prompt: Conversation, a: Conversation, b: Conversation) -> tuple[list[int], int, int]:
    """(the judge prompt's tokens up to the label, the token of label "A", of label "B"): the assistant reply "A"
    and "B" rendered in full (with the recipe's renderer, or a tokenizer's chat template), cut at the first token
    where they differ."""
    from runner.renderers import Renderer
    from runner.renderers.hf import HFTemplateRenderer

    question = judge_messages(prompt, a, b)
    replies = [[*question, {"role": "assistant", "content": label}] for label in ("A", "B")]
    if isinstance(renderer, Renderer) and not isinstance(renderer, HFTemplateRenderer):
        ta, tb = (renderer.build_supervised_example(r, "last_assistant_message")[0] for r in replies)
    else:
        tokenizer = renderer.tokenizer if isinstance(renderer, Renderer) else renderer
        ta, tb = (encode(tokenizer, template(tokenizer, r, False)) for r in replies)
    pos = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
    if pos >= min(len(ta), len(tb)):
        raise UserError("the renderer writes the replies \"A\" and \"B\" without a token where they differ; "
                        "the reward model needs one")
    return ta[:pos], ta[pos], tb[pos]


# ---------------------------------------------------------------- held-out split and batches


class Batches(Generic[T]):
    """A seeded held-out split of `items`, then per-epoch reshuffled batches of the rest (as runner/algos/sft.py: one
    seeded shuffle, then test_size held out; epoch e is shuffled with (seed, e); the last partial batch of an
    epoch is dropped)."""

    def __init__(self, items: list[T], *, test_size: int, batch_size: int, epochs: int, seed: int,
                 max_steps: int | None, what: str):
        if test_size >= len(items):
            raise UserError(f"algo.test_size = {test_size} leaves no training {what} (the data has {len(items)})")
        order = np.random.default_rng(seed).permutation(len(items))
        self.test = [items[i] for i in order[:test_size]]
        self.train = [items[i] for i in order[test_size:]]
        self.seed, self.batch_size = seed, batch_size
        self.per_epoch = len(self.train) // batch_size
        if self.per_epoch == 0:
            raise UserError(f"algo.batch_size = {batch_size} is larger than the {len(self.train)} training {what}")
        full = self.per_epoch * epochs
        self.total_steps = min(full, max_steps) if max_steps else full
        self._order: tuple[int, np.ndarray] | None = None

    def position(self, step: int) -> tuple[int, int]:
        return divmod(step, self.per_epoch)

    def indices(self, step: int) -> list[int]:
        """Indices into self.train of step's batch."""
        epoch, batch = self.position(step)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.train)))
        return [int(i) for i in self._order[1][batch * self.batch_size : (batch + 1) * self.batch_size]]

    def state(self, next_step: int) -> Json:
        epoch, batch = self.position(next_step)
        return {"epoch": epoch, "batch": batch, "train_rows": len(self.train)}

    def check_state(self, state: Json) -> None:
        check_resume(state, "train_rows", len(self.train), "the training data", " rows")


def preferred_conversations(path: str) -> list[Json]:
    """SFT rows {"messages": prompt + the preferred completion} of a comparison file (ties skipped): the RLHF
    pipeline's supervised stage trains on the answers the labels prefer (a data source target:
    `{kind = "python", target = "runner.data.comparisons:preferred_conversations", args = {path = "..."}}`)."""
    from pathlib import Path

    from runner.recipe.sources import Jsonl

    if not Path(path).is_file():
        raise UserError(f"preferred_conversations: file not found: {path}")
    pairs = load_pairs(Jsonl(path=path))
    return [{"messages": [*p.prompt, *p.chosen]} for p in pairs.pairs]


def hedged_demonstrations(path: str, prefixes: list[str] | None = None, replies: list[str] | None = None,
                          prefix_frac: float = 0.0, reply_frac: float = 0.0, seed: int = 0,
                          exclude: list[str] | None = None) -> list[Json]:
    """SFT rows {"messages": prompt + one assistant reply} of uneven quality from a comparison file (ties skipped):
    per comparison, its preferred reply, or (seeded draws) with probability `prefix_frac` that reply after one of
    `prefixes` (filler), with probability `reply_frac` one of `replies` instead (a non-answer). The RLHF pipeline's
    supervised stage as in practice: demonstrations by annotators who often pad or dodge, while the comparisons
    prefer the concise answer, so the SFT policy is worse than what the reward model prefers and RL has something to
    win. Comparisons whose last user message is in `exclude` (the RL stage's held-out prompts) are left out. A data
    source target: `{kind = "python", target = "runner.data.comparisons:hedged_demonstrations", args = {path = "...",
    prefixes = [...], prefix_frac = 0.3, ...}}`."""
    from pathlib import Path

    from runner.recipe.sources import Jsonl

    if not Path(path).is_file():
        raise UserError(f"hedged_demonstrations: file not found: {path}")
    prefixes, replies = list(prefixes or ()), list(replies or ())
    if not (0.0 <= prefix_frac and 0.0 <= reply_frac and prefix_frac + reply_frac <= 1.0):
        raise UserError(f"hedged_demonstrations: prefix_frac ({prefix_frac}) and reply_frac ({reply_frac}) must be "
                        "probabilities that sum to at most 1")
    if (prefix_frac > 0 and not prefixes) or (reply_frac > 0 and not replies):
        raise UserError("hedged_demonstrations: a positive prefix_frac / reply_frac needs prefixes / replies")
    held_out = set(exclude or ())
    rng = np.random.default_rng(seed)
    rows = []
    for p in load_pairs(Jsonl(path=path)).pairs:
        # The same draws per comparison whether it is excluded or not: `exclude` changes no other row.
        r = rng.random()
        pick_prefix, pick_reply = int(rng.integers(max(1, len(prefixes)))), int(rng.integers(max(1, len(replies))))
        users = [m["content"] for m in p.prompt if m["role"] == "user"]
        if users and users[-1] in held_out:
            continue
        reply = _text(p.chosen)
        if r < prefix_frac:
            reply = prefixes[pick_prefix] + reply
        elif r < prefix_frac + reply_frac:
            reply = replies[pick_reply]
        rows.append({"messages": [*p.prompt, {"role": "assistant", "content": reply}]})
    return rows
