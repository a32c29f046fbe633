"""GRPO-RoC: chunked token log-probs, the clipped policy loss, Resample-on-Correct, advantages.

Pure functions with no I/O and no text parsing, usable with any JAX model:

    from rstar_jax.rl import grpo_loss, token_logprobs, resample_on_correct, group_advantages

A new policy loss or advantage estimator is a function registered by name (`rstar_jax.rl.registry`)
and that name in `LossConfig`.

The names are loaded on first access (PEP 562), so importing the jax-free submodules
(`rstar_jax.rl.settings`, `.roc`, `.registry`) does not import jax: configs are checked without it.
"""

from __future__ import annotations

import importlib

# name -> the submodule that defines it
_EXPORTS = {
    "group_advantages": "advantages",
    "naive_token_logprobs": "logprobs", "token_logprobs": "logprobs",
    "combine_metrics": "loss", "empty_metrics": "loss", "finalize_metrics": "loss", "grpo_loss": "loss",
    "grpo_policy_loss": "loss",
    "LossConfig": "settings",
    "advantage_estimator_names": "registry", "get_advantage_estimator": "registry", "get_policy_loss": "registry",
    "policy_loss_names": "registry", "register_advantage_estimator": "registry", "register_policy_loss": "registry",
    "RocConfig": "roc", "RocResult": "roc", "paper_penalty": "roc", "release_penalty": "roc",
    "resample_on_correct": "roc",
}

__all__ = [
    "token_logprobs", "naive_token_logprobs", "grpo_loss", "LossConfig", "combine_metrics", "empty_metrics",
    "finalize_metrics", "resample_on_correct", "RocConfig", "RocResult", "paper_penalty", "release_penalty",
    "group_advantages", "grpo_policy_loss", "register_policy_loss", "get_policy_loss", "policy_loss_names",
    "register_advantage_estimator", "get_advantage_estimator", "advantage_estimator_names",
]


def __getattr__(name: str):
    try:
        submodule = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted({*globals(), *__all__})
