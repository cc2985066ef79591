"""The `sft` algorithm's recipe table (`algo = {kind = "sft", ...}`), implemented by runner/algos/sft.py."""

from __future__ import annotations

from typing import Literal

from runner.recipe.common import AlgoBase, DataSource, NonNegInt, PosInt, TrainOnWhat


class SFT(AlgoBase):
    """Supervised fine-tuning on conversations: {"messages": [{"role", "content"}, ...]} per row."""


    data: DataSource
    # Conversations per step.
    batch_size: PosInt = 16
    epochs: PosInt = 1
    # Truncate rendered conversations (tokens) from the right. Always set (TOML has no null): use a large
    # value to keep whole conversations, at most the model's context (runner/models.toml; `runner check`).
    max_length: PosInt = 1024
    # Which tokens carry loss (the cookbook's TrainOnWhat): "last_assistant_turn" = the assistant messages after
    # the last user one; "all_messages" = every message's content, not its role header ("hf": every token);
    # "all_tokens" = everything; "customized" = the messages with "trainable": true.
    train_on_what: TrainOnWhat = "all_assistant_messages"
    # "mean": each conversation's token weights sum to 1 (the cookbook's default); "none": 1 per token.
    reduction: Literal["mean", "none"] = "mean"
    # Rows held out (after the seeded shuffle) for the eval NLL; 0 = no eval.
    test_size: NonNegInt = 0
    # After the last step, the final weights answer each held-out conversation's last user turn (greedy) and
    # test/agreement is the share of answers equal to the data's (prompt distillation: the student answers like
    # the prompted teacher). Needs test_size > 0.
    agreement: bool = False
