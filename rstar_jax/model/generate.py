"""Greedy generation with the preallocated KV cache (prefill, then a jitted decode loop).

A compact reference decoder: the serving engine (`rstar_jax.rollout.engine`) adds continuous
batching and sampling on top of the same `forward_with_cache`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from rstar_jax.model.qwen3 import Qwen3


@functools.partial(nnx.jit, static_argnames=("max_new_tokens",))
def greedy_generate(model: Qwen3, prompt_ids: jax.Array, prompt_lengths: jax.Array, max_new_tokens: int):
    """Greedy continuation of right-padded prompts.

    prompt_ids: [B, T] right-padded; prompt_lengths: [B]. Returns (new_ids [B, max_new_tokens],
    logprobs [B, max_new_tokens]) — every row generates exactly max_new_tokens tokens.
    """
    b, t = prompt_ids.shape
    cache = model.init_cache(b, t + max_new_tokens)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, cache = model.forward_with_cache(prompt_ids, positions, cache)
    # Padding wrote K/V past each prompt's end; decode overwrites those slots before attending them.
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

    def step(carry, _):
        cache, last_logits, pos = carry
        token = jnp.argmax(last_logits, axis=-1).astype(jnp.int32)
        logprob = jnp.take_along_axis(jax.nn.log_softmax(last_logits, axis=-1), token[:, None], axis=1)[:, 0]
        logits, cache = model.forward_with_cache(token[:, None], pos[:, None], cache)
        return (cache, logits[:, 0], pos + 1), (token, logprob)

    _, (tokens, logprobs) = jax.lax.scan(step, (cache, last, prompt_lengths.astype(jnp.int32)), None,
                                         length=max_new_tokens)
    return tokens.T, logprobs.T
