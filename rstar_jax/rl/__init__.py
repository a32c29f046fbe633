"""GRPO-RoC: chunked token log-probs, the clipped policy loss, Resample-on-Correct, advantages.

Pure functions with no I/O and no text parsing, usable with any JAX model:

    from rstar_jax.rl import grpo_loss, token_logprobs, resample_on_correct, group_advantages

A new policy loss or advantage estimator is a function registered by name (`rstar_jax.rl.registry`)
and that name in `LossConfig`.

The names are loaded on first access (PEP 562), so importing the jax-free submodules
(`rstar_jax.rl.settings`, `.roc`, `.registry`) does not import jax: configs are checked without it.
"""

from __future__ import annotations

from rstar_jax.lazy import lazy_exports

# name -> the submodule that defines it
_EXPORTS = {
    **{name: "rstar_jax.rl.advantages" for name in ("group_advantages",)},
    **{name: "rstar_jax.rl.logprobs" for name in ("naive_token_logprobs", "token_logprobs")},
    **{name: "rstar_jax.rl.loss" for name in ("combine_metrics", "empty_metrics", "finalize_metrics", "grpo_loss",
                                              "grpo_policy_loss")},
    **{name: "rstar_jax.rl.settings" for name in ("LossConfig",)},
    **{name: "rstar_jax.rl.registry" for name in ("advantage_estimator_names", "get_advantage_estimator",
                                                  "get_policy_loss", "policy_loss_names",
                                                  "register_advantage_estimator", "register_policy_loss")},
    **{name: "rstar_jax.rl.roc" for name in ("RocConfig", "RocResult", "paper_penalty", "release_penalty",
                                             "resample_on_correct")},
}

__all__ = [
    "token_logprobs", "naive_token_logprobs", "grpo_loss", "LossConfig", "combine_metrics", "empty_metrics",
    "finalize_metrics", "resample_on_correct", "RocConfig", "RocResult", "paper_penalty", "release_penalty",
    "group_advantages", "grpo_policy_loss", "register_policy_loss", "get_policy_loss", "policy_loss_names",
    "register_advantage_estimator", "get_advantage_estimator", "advantage_estimator_names",
]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
