"""GRPO-RoC: chunked token log-probs, the clipped policy loss, Resample-on-Correct, advantages.

Pure functions with no I/O and no text parsing, usable with any JAX model:

    from rstar_jax.rl import grpo_loss, token_logprobs, resample_on_correct, group_advantages
"""

from rstar_jax.rl.advantages import group_advantages
from rstar_jax.rl.logprobs import naive_token_logprobs, token_logprobs
from rstar_jax.rl.loss import LossConfig, combine_metrics, empty_metrics, finalize_metrics, grpo_loss
from rstar_jax.rl.roc import RocConfig, RocResult, paper_penalty, release_penalty, resample_on_correct

__all__ = [
    "token_logprobs", "naive_token_logprobs", "grpo_loss", "LossConfig", "combine_metrics", "empty_metrics",
    "finalize_metrics", "resample_on_correct", "RocConfig", "RocResult", "paper_penalty", "release_penalty",
    "group_advantages",
]
