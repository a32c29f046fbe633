"""Non-reasoning SFT before RL: 3 epochs, lr 5e-6, 4% warm-up, cosine decay, batch 128 (spec §5.1).

The paper's SFT data (function calling, instruction following, chat) is unreleased; pass
conversations with `--config.sft.train_files=...` (jsonl rows of {"messages": [...]}).
"""

import ml_collections

from rstar_jax.config import sibling_config


def get_config() -> ml_collections.ConfigDict:
    c = sibling_config(__file__, "base")
    c.mode = "sft"
    c.stage = "sft"
    c.run_dir = "runs/sft"
    c.sandbox.preset = "release"  # tool results in synthetic SFT data render as the RL stages will show them
    c.checkpoint.every_steps = 200
    c.checkpoint.export_hf_every = 0  # the SFT trainer exports the final policy for stage 1
    return c
