"""An independent JAX program reusing the GRPO-RoC loss, as the README's section "Reusing the
GRPO-RoC loss in another JAX project" shows it, on a mesh made by `jax.make_mesh`.

The program has its own tiny language model (two pure-JAX residual layers, no flax, nothing of
ours), its own optax optimizer, and the batch sharded over `data`, as two micro-batches whose
(loss_sum, n_tokens) are added before one division. It imports only the README's names. Its loss and
gradient must equal a naive re-derivation written out here (full-vocabulary log_softmax, the clipped
surrogate with clip-higher 0.2 / 0.28, one token mean) on Explicit meshes (`jax.make_mesh`'s
default since jax 0.10) and on Auto ones, on 2 devices and on 8.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from rstar_jax.rl import RocConfig, group_advantages, grpo_loss, paper_penalty, resample_on_correct, token_logprobs

V, D, T, PROMPT = 256, 32, 12, 4
GROUPS, SAMPLED, KEPT = 4, 8, 4  # 4 prompts, 8 rollouts each, RoC keeps 4: 16 rows, 2 micro-batches of 8


def init_params(key):
    k = jax.random.split(key, 4)
    return {"embed": jax.random.normal(k[0], (V, D)) * 0.5,
            "w1": jax.random.normal(k[1], (2, D, 2 * D)) / np.sqrt(D),
            "w2": jax.random.normal(k[2], (2, 2 * D, D)) / np.sqrt(2 * D),
            "unembed": jax.random.normal(k[3], (D, V)) / np.sqrt(D)}


def hidden_states(params, input_ids):
    # A one-hot product rather than a gather: under Explicit axes a gather by batch-sharded ids
    # must be told its output's sharding, a product infers it (and the vocabulary is small).
    h = jax.nn.one_hot(input_ids, V) @ params["embed"]
    for layer in range(2):
        h = h + jnp.tanh(h @ params["w1"][layer]) @ params["w2"][layer]
    return h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def loss_fn(params, batch):
    hidden = hidden_states(params, batch["input_ids"])
    logp = token_logprobs(hidden, params["unembed"], batch["targets"], chunk_size=5)
    loss_sum, n_tokens, metrics = grpo_loss(logp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"])
    return loss_sum, (n_tokens, metrics)


def naive_loss(params, batch):
    """Everything written out: the full [B, T, V] log_softmax and the PPO clip with clip-higher."""
    logits = hidden_states(params, batch["input_ids"]) @ params["unembed"]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), batch["targets"][..., None], axis=-1)[..., 0]
    ratio = jnp.exp(logp - batch["old_logprobs"])
    adv = batch["advantages"][:, None]
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - 0.2, 1.0 + 0.28))
    mask = batch["loss_mask"]
    return jnp.sum(per_token * mask) / jnp.sum(mask), ratio


@jax.jit
def accumulated_grad(params, micro_batches):
    """Sums each micro-batch's loss_sum gradient and token count, then divides once."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    total_loss, total_grad, total_tokens = 0.0, jax.tree.map(jnp.zeros_like, params), 0.0
    for mb in micro_batches:
        (loss_sum, (n_tokens, _)), grad = grad_fn(params, mb)
        total_loss, total_tokens = total_loss + loss_sum, total_tokens + n_tokens
        total_grad = jax.tree.map(jnp.add, total_grad, grad)
    n = jnp.maximum(total_tokens, 1.0)
    return total_loss / n, jax.tree.map(lambda g: g / n, total_grad)


@pytest.fixture(scope="module")
def rollouts():
    """A kept batch as the program builds it: RoC over 2G rollouts per prompt, then advantages."""
    rng = np.random.default_rng(0)
    n = GROUPS * SAMPLED
    group_ids = np.repeat(np.arange(GROUPS), SAMPLED)
    rewards = np.tile(np.array([1, 0, 1, 0, 0, 1, 0, 0], np.float32), GROUPS)  # every group mixed
    calls = rng.integers(0, 4, n)
    penalties = paper_penalty(calls, rng.integers(0, calls + 1), rng.integers(1, 3, n), np.full(n, 2))
    roc = resample_on_correct(rewards, group_ids, penalties, RocConfig(group_size=KEPT), seed=0)
    kept = roc.kept_indices
    assert len(kept) == GROUPS * KEPT
    advantages = group_advantages(rewards[kept], group_ids[kept])
    tokens = rng.integers(1, V, (len(kept), T + 1)).astype(np.int32)
    mask = np.zeros((len(kept), T), np.float32)
    for row, length in enumerate(rng.integers(T // 2, T + 1, len(kept))):
        mask[row, PROMPT - 1:length] = 1.0  # the response's tokens only; the rest is prompt or padding
    params = init_params(jax.random.key(0))
    # pi_old: a nearby policy, so ratios spread past both clip bounds.
    old_params = jax.tree.map(lambda p, k: p + 0.3 * jax.random.normal(k, p.shape), params,
                              dict(zip(params, jax.random.split(jax.random.key(1), len(params)))))
    batch = {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "advantages": advantages, "loss_mask": mask}
    logits = hidden_states(old_params, batch["input_ids"]) @ old_params["unembed"]
    batch["old_logprobs"] = np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None],
                                                           axis=-1)[..., 0])
    return jax.tree.map(np.asarray, params), batch


# (mesh shape, axis names): data-parallel on 2 and on 8 devices, and on 8 with the program's
# unembedding vocab-sharded over its own "model" axis.
MESHES = {"data2": ((2,), ("data",)), "data8": ((8,), ("data",)), "data4_model2": ((4, 2), ("data", "model"))}


@pytest.mark.parametrize("layout", list(MESHES))
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_reused_loss_equals_the_naive_rederivation_and_trains(rollouts, axis_type, layout):
    params, batch = rollouts
    shape, axes = MESHES[layout]
    with jax.default_matmul_precision("highest"):
        (want_loss, ratio), want_grad = jax.value_and_grad(naive_loss, has_aux=True)(params, batch)
        on = batch["loss_mask"] > 0
        assert np.any(on & (np.asarray(ratio) > 1.28)) and np.any(on & (np.asarray(ratio) < 0.8))

        mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes),
                             devices=jax.devices()[:int(np.prod(shape))])
        with jax.set_mesh(mesh):
            rows = NamedSharding(mesh, P("data"))
            half = len(batch["targets"]) // 2
            micro_batches = [jax.device_put({k: v[i * half:(i + 1) * half] for k, v in batch.items()}, rows)
                             for i in range(2)]
            specs = {name: P(None, "model") if name == "unembed" and "model" in axes else P() for name in params}
            sharded_params = {name: jax.device_put(p, NamedSharding(mesh, specs[name])) for name, p in params.items()}
            loss, grad = accumulated_grad(sharded_params, micro_batches)
            np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
            for name in params:
                np.testing.assert_allclose(grad[name], want_grad[name], rtol=1e-4, atol=1e-5, err_msg=name)
                if axis_type == AxisType.Explicit:
                    assert jax.typeof(grad[name]).sharding.spec == jax.typeof(sharded_params[name]).sharding.spec

            optimizer = optax.adam(1e-2)

            @jax.jit
            def train_step(params, opt_state, micro_batches):
                loss, grad = accumulated_grad(params, micro_batches)
                updates, opt_state = optimizer.update(grad, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            opt_state = optimizer.init(sharded_params)
            losses, current = [], sharded_params
            for _ in range(3):
                current, opt_state, loss = train_step(current, opt_state, micro_batches)
                losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert not np.allclose(current["unembed"], params["unembed"])
