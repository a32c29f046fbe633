"""RL stage 2: the response budget grows to 12K on all problems for 85 steps (spec §5.3).

Continue from stage 1: `--config.train.init_from=runs/stage1/checkpoints`.
"""

import ml_collections

from rstar_jax.config import sibling_config


def get_config() -> ml_collections.ConfigDict:
    c = sibling_config(__file__, "stage1")
    c.stage = "stage2"
    c.run_dir = "runs/stage2"
    c.sandbox.preset = "release"  # spec §5.3: stage 2 continues stage 1's run, in its tool environment
    c.rollout.response_budget = 12288  # spec §5.3: 8K -> 12K in stage 2
    c.rollout.engine.max_length = c.rollout.max_prompt_length + c.rollout.response_budget
    # One 14K row per micro-batch, its attention heads split over 2 devices: the ahead-of-time
    # compile of the 14B update on 64 devices peaks at 79 GiB per device (147 GiB with FSDP alone).
    c.rl.micro_batch_tokens = c.rollout.max_prompt_length + c.rollout.response_budget
    c.mesh.tensor = 2
    c.train.steps = 85  # spec §5.3: 85 steps (stage 2 ends at step 385)
    c.train.init_from = "runs/stage1/checkpoints"
    return c
