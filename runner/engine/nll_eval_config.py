"""The `nll` pinned eval's recipe table (`[[recipes.x.evals]] kind = "nll"`), implemented by runner/engine/nll_eval.py."""

from __future__ import annotations

from runner.recipe.common import DataSource, PinnedEvalBase, PosInt, TrainOnWhat


class NLLPinned(PinnedEvalBase, tag="nll"):
    """Mean per-token NLL of conversations (`{"messages": [...]}` rows) under the weights: test/eval/<name>/nll."""

    data: DataSource
    train_on_what: TrainOnWhat = "last_assistant_message"
    # The first max_rows conversations (None: all).
    max_rows: PosInt | None = None
