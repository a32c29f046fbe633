"""RL stage 1 of the rStar2-Agent recipe: 8K response budget, all problems, 300 steps (spec §5.3).

Stage 1 is the base config; this file exists so every stage is launched the same way:
`python -m rstar_jax.launch --config=configs/stage1.py --config.data.train_files="('dapo.parquet',)"`
(after SFT: `--config.model.hf_path=<SFT export>`).
"""

import ml_collections

from rstar_jax.config import sibling_config


def get_config() -> ml_collections.ConfigDict:
    c = sibling_config(__file__, "base")
    c.stage = "stage1"
    c.run_dir = "runs/stage1"
    c.sandbox.preset = "release"  # spec §2.3, §3.2: the tool environment of the release's RL run
    return c
