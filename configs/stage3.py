"""RL stage 3: 12K on the hard subset, T = 15, optimizer reset, 125 steps (spec §5.3).

The hard subset (17.3K of 42K in the paper) comes from the stage-2 policy:
`python -m rstar_jax.filter_hard --config=configs/stage3.py` generates `filter_hard.k` = 8 rollouts
per training problem and drops the problems solved 8 of 8, writing `filter_hard.output_file`.
"""

import ml_collections

from rstar_jax.config import sibling_config


def get_config() -> ml_collections.ConfigDict:
    c = sibling_config(__file__, "stage2")
    # The hard set is what the stage-2 policy solves as stage 2 samples it (spec §5.3): its
    # temperature and T = 10, kept here before stage 3 raises T.
    c.filter_hard.temperature = c.rollout.temperature
    c.filter_hard.max_turns = c.rollout.max_turns
    c.stage = "stage3"
    c.run_dir = "runs/stage3"
    c.sandbox.preset = "release"  # spec §5.3: stage 3 continues the run in the same tool environment
    c.rollout.max_turns = 15  # spec §5.3: T rises to 15 in stage 3
    c.train.steps = 125  # spec §5.3: 125 more steps (510 in total)
    c.train.init_from = "runs/stage2/checkpoints"
    c.optim.reset_at_start = True  # spec §5.3: the optimizer state is reset for stage 3
    c.filter_hard.output_file = "runs/stage3/hard_subset.jsonl"
    c.data.train_files = (c.filter_hard.output_file,)  # spec §5.3: stage 3 trains on the hard subset
    return c
