"""The `dpo` algorithm's recipe table (`algo = {kind = "dpo", ...}`), implemented by runner/algos/dpo.py."""

from __future__ import annotations

from runner.recipe.common import AlgoBase, DataSource, NonNegInt, PosFloat, PosInt


class DPO(AlgoBase):
    """Direct preference optimisation on comparisons (runner/data/comparisons.py has the row formats): per pair,
    loss = −log σ(β·((π_c − ref_c) − (π_r − ref_r))), sequence logprobs summed over the completion's tokens; the
    reference is the run's initial weights (the base model), also after a resume."""


    data: DataSource
    # Pairs per step (each is two datums: chosen and rejected).
    batch_size: PosInt = 16
    epochs: PosInt = 1
    # Truncate each rendered prompt + completion (tokens) from the right.
    max_length: PosInt = 1024
    # Strength of the implicit KL to the reference: small β lets the policy move further (cookbook default 0.1).
    beta: PosFloat = 0.1
    # Pairs held out (after the seeded shuffle) for test/dpo_loss, test/accuracy, test/margin; 0 = no eval.
    test_size: NonNegInt = 0
