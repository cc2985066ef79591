"""The `reward_model` algorithm's recipe table (`algo = {kind = "reward_model", ...}`), implemented by
runner/algos/reward_model.py."""

from __future__ import annotations

from runner.recipe.common import AlgoBase, DataSource, NonNegInt, PosInt


class RewardModel(AlgoBase, tag="reward_model"):
    """A pairwise judge (the cookbook's RLHF stage 2): SFT on "which completion is better, A or B?" with the
    preferred label as the one trained token, every comparison in both orders (A/B swapped) so position carries
    no signal. runner/rewards/judge.py turns the trained weights into P(a better)."""


    data: DataSource
    # Comparisons per step (each is two datums: both orders).
    batch_size: PosInt = 16
    epochs: PosInt = 1
    # Longest judge prompt (tokens); a comparison that renders longer is an error naming its row.
    max_length: PosInt = 2048
    # Comparisons held out for test/accuracy and test/nll; 0 = no eval.
    test_size: NonNegInt = 0
