"""The jitted, sharded, donated GRPO train step with exact token-mean micro-batch accumulation.

policy forward -> chunked token log-probs -> the policy loss named in LossConfig (grpo_loss by
default) -> gradients (accumulated as sums over a `lax.scan` of micro-batches) -> divide once by the
global token count -> AdamW with global-norm clipping. Because numerators and denominators are
summed separately, one batch, the same batch in micro-batches and the same sequences packed all
give the same loss and gradients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rstar_jax.rl.logprobs import token_logprobs
from rstar_jax.rl.loss import LossConfig, combine_metrics, empty_metrics
from rstar_jax.rl.registry import get_policy_loss
# Re-exported: defined apart so configs are checked without jax.
from rstar_jax.train.settings import LR_SCHEDULES, OptimizerConfig  # noqa: F401


def lr_schedule(config: OptimizerConfig) -> optax.Schedule:
    warmup = optax.linear_schedule(0.0, config.lr, max(config.warmup_steps, 1))
    after_warmup = config.total_steps - config.warmup_steps
    if config.schedule == "constant":
        rest = optax.constant_schedule(config.lr)
    elif config.schedule == "cosine":
        rest = optax.cosine_decay_schedule(config.lr, after_warmup, alpha=config.min_lr_ratio)
    else:
        decay = config.total_steps - wsd_decay_start(config)
        rest = optax.join_schedules(
            [optax.constant_schedule(config.lr),
             optax.cosine_decay_schedule(config.lr, decay, alpha=config.min_lr_ratio)], [after_warmup - decay])
    if config.warmup_steps == 0:
        return rest
    return optax.join_schedules([warmup, rest], [config.warmup_steps])


def wsd_decay_start(config: OptimizerConfig) -> int:
    """The step at which a "wsd" schedule starts to decay."""
    after_warmup = config.total_steps - config.warmup_steps
    return config.total_steps - min(after_warmup, max(1, round(config.decay_ratio * config.total_steps)))


def make_tx(config: OptimizerConfig = OptimizerConfig()) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on `config`'s schedule."""
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(lr_schedule(config), b1=config.b1, b2=config.b2, weight_decay=config.weight_decay),
    )


class MasterWeightsOptimizer(nnx.Optimizer):
    """An `nnx.Optimizer` that keeps a higher-precision master copy of the parameters in its state
    (mixed precision with master weights, as Megatron and MaxText train): the model holds low-precision
    parameters (bf16: no cast before each matmul), `master` holds them in `master_dtype`, and the
    optax state (AdamW's moments) is of the master. An update casts the gradients to `master_dtype`
    (clipping's global norm is theirs), applies `tx` to the master and writes the master, rounded to
    the parameters' dtype, back into the model: updates far below the parameters' resolution (lr
    1e-6 on weights of 1e-2 in bf16) accumulate in the master until they move the parameters.

    `master` is created from the parameters as they are (same metadata, so the same shardings) and
    is saved and restored with the rest of the optimizer's state.
    """

    def __init__(self, model, tx: optax.GradientTransformation, *, wrt=nnx.Param, master_dtype="float32"):
        # Not nnx.Optimizer.__init__: its optax state would be of the low-precision parameters.
        self.master_dtype = jnp.dtype(master_dtype)
        master = jax.tree.map(lambda p: p.astype(self.master_dtype), nnx.state(model, wrt))
        self.step = nnx.OptState(jnp.array(0, dtype=jnp.uint32))
        self.tx = tx
        self.wrt = wrt
        self.opt_state = nnx.data(nnx.optimizer.to_opt_state(tx.init(master)))
        self.master = nnx.data(nnx.optimizer.to_opt_state(master))

    def update(self, model, grads, /, **kwargs) -> optax.Updates:
        grad_arrays = jax.tree.map(lambda g: g.astype(self.master_dtype), nnx.as_pure(nnx.state(grads, self.wrt)))
        master = nnx.as_pure(self.master)
        updates, new_opt_state = self.tx.update(grad_arrays, nnx.as_pure(self.opt_state), master,
                                                **nnx.as_pure(kwargs))
        new_master = optax.apply_updates(master, updates)
        params = nnx.as_pure(nnx.state(model, self.wrt))
        nnx.update(model, jax.tree.map(lambda m, p: m.astype(p.dtype), new_master, params))
        nnx.update(self.master, nnx.state(new_master))
        nnx.update(self.opt_state, nnx.state(new_opt_state))
        self.step[...] += 1
        return updates


def master_dtype_of(optimizer) -> Any:
    """The dtype of `optimizer`'s master weights, None when the parameters are their own master."""
    return getattr(optimizer, "master_dtype", None)


def with_master_weights(model: nnx.Module, optimizer) -> nnx.Module:
    """`model`, or when `optimizer` keeps master weights a copy of it whose parameters are the master
    (full precision, for an HF export; buffers shared, nothing copied)."""
    if master_dtype_of(optimizer) is None:
        return model
    view = nnx.clone(model)
    params = nnx.state(view, optimizer.wrt)
    nnx.replace_by_pure_dict(params, nnx.to_pure_dict(optimizer.master))
    nnx.update(view, params)
    return view


def optimizer_for(model: nnx.Module, config: OptimizerConfig = OptimizerConfig()) -> nnx.Optimizer:
    """`make_tx(config)` over `model`'s parameters, with a master copy under `config.master_weights`,
    placed where the arrays are (`make_optimizer` places it as the step returns it)."""
    if not config.master_weights:
        return nnx.Optimizer(model, make_tx(config), wrt=nnx.Param)
    master = jnp.dtype(config.master_weights)
    for path, p in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        if jnp.finfo(p.dtype).bits >= jnp.finfo(master).bits:
            raise ValueError(f"OptimizerConfig.master_weights={config.master_weights!r} keeps a master copy of "
                             f"lower-precision parameters, but parameter {jax.tree_util.keystr(path)} is "
                             f"{p.dtype} (set the model's param_dtype to bfloat16, or master_weights to '')")
    return MasterWeightsOptimizer(model, make_tx(config), wrt=nnx.Param, master_dtype=master)


def make_optimizer(model: nnx.Module, config: OptimizerConfig = OptimizerConfig()) -> nnx.Optimizer:
    """`optimizer_for(model, config)` with its state placed as the jitted step returns it."""
    optimizer = optimizer_for(model, config)
    meshes = {x.sharding.mesh for x in jax.tree.leaves(nnx.state(model))
              if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)}
    if len(meshes) == 1:
        mesh = meshes.pop()
        for obj in (model, optimizer):
            nnx.update(obj, jax.tree.map(lambda x: _as_step_output(x, mesh), nnx.state(obj)))
    return optimizer


def skip_schedule_to(optimizer: nnx.Optimizer, step: int) -> None:
    """Moves the learning-rate schedule of `make_tx`'s optimizer to `step`, leaving AdamW's moments
    and bias correction as the updates made them: the schedule skips the steps between."""
    def of_schedule(path, _) -> bool:
        return getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"

    counts = optax.tree_utils.tree_get_all_with_path(optimizer.opt_state, "count", filtering=of_schedule)
    if not counts:
        raise ValueError("the optimizer has no learning-rate schedule to move (optax ScaleByScheduleState)")
    for _, count in counts:
        current = count.get_value()
        count.set_value(jax.device_put(jnp.asarray(step, current.dtype), current.sharding))


def _as_step_output(x, mesh: jax.sharding.Mesh):
    """The placement a jitted step returns for `x` on `mesh`: a NamedSharding without trailing
    unsplit dimensions, replication as P(). Model and optimizer state start out placed that way, so
    the donated step's outputs are its next inputs to the letter and it does not compile twice."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or sharding is None or mesh.size == 1:
        return x
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh:
        spec = list(sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        canonical = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    elif sharding.is_fully_replicated:  # scalars such as step counts start on one device
        canonical = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    else:
        return x
    return x if canonical == sharding else jax.device_put(x, canonical)


def _policy_micro_loss(model, mb: dict, loss_config: LossConfig, chunk_size: int, temperature):
    hidden = model.hidden_states(mb["input_ids"], mb["positions"], mb["segment_ids"])
    logprobs, entropy = token_logprobs(hidden, model.unembedding(), mb["targets"], chunk_size=chunk_size,
                                       temperature=temperature, return_entropy=True)
    # The loss registered under `loss_config.policy_loss` ("grpo": grpo_loss) gets the settings whole.
    policy_loss = get_policy_loss(loss_config.policy_loss)
    return policy_loss(loss_config, logprobs, mb["old_logprobs"], mb["advantages"], mb["loss_mask"],
                       entropy=jax.lax.stop_gradient(entropy), sampler_logprobs=mb["sampler_logprobs"],
                       segment_ids=mb["segment_ids"])


def _has_tokens(mb: dict):
    # Micro-batches with nothing to train on are the fixed-shape padding (see rl_batch.BatchConfig).
    return jnp.any(mb["loss_mask"] > 0)


def _unless_empty(mb: dict, compute, empty):
    """`compute()`, skipped for a micro-batch without a trained token (`empty()` instead).

    Only within one process: across jax.distributed processes (gloo on CPU) a conditional whose
    branch holds collectives left the processes in different collectives (a 10240-byte all-reduce
    met a 4-byte one) on some batches, so there every micro-batch is computed, padding adding zeros.
    """
    if jax.process_count() > 1:
        return compute()
    return jax.lax.cond(_has_tokens(mb), compute, empty)


def accumulate_grads(model: nnx.Module, batch: dict, micro_loss, grad_dtype: Any = None):
    """Sums `micro_loss` numerators, gradients and metrics over the micro-batches of `batch`.

    micro_loss(model, micro_batch) -> (loss_sum, denominator, metrics): the denominator is the
    token count of a token mean, or the sequence count of a sequence mean (`grpo_loss`'s
    `loss_agg_mode`). Returns (loss, grads, metrics) with loss and grads divided once by the total
    denominator: the exact mean over the whole batch. Micro-batches without a trained token are
    skipped within one process (they would add exactly nothing; `_unless_empty`). The gradients are
    in `grad_dtype` (None: each parameter's dtype; a master-weights optimizer takes float32).
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of_params(p, mb):
        loss_sum, denominator, metrics = micro_loss(nnx.merge(graphdef, p, rest), mb)
        # A loss that reports no token count of its own (SFT's) counts what it divides by.
        return loss_sum, {"token_count": denominator, **metrics, "loss_denominator": denominator,
                          "loss_sum": loss_sum}

    grad_fn = jax.grad(loss_of_params, has_aux=True)
    # Sums are kept in float32 whatever the parameter dtype: many bf16 additions would lose the
    # small per-micro-batch contributions.
    zero_grads = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    _, metric_shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], batch))
    no_metrics = empty_metrics(metric_shapes)

    def body(carry, mb):
        grads_acc, metrics_acc = carry

        def compute():
            grads, metrics = grad_fn(params, mb)
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads), metrics

        grads, metrics = _unless_empty(mb, compute, lambda: (zero_grads, no_metrics))
        return (jax.tree.map(jnp.add, grads_acc, grads), combine_metrics(metrics_acc, metrics)), None

    (grads_sum, metrics), _ = jax.lax.scan(body, (zero_grads, no_metrics), batch)
    total = jnp.maximum(metrics["loss_denominator"], 1.0)
    grads = jax.tree.map(lambda g, p: (g / total).astype(grad_dtype or p.dtype), grads_sum, params)
    return metrics["loss_sum"] / total, grads, metrics


def loss_and_grads(model: nnx.Module, batch: dict, loss_config: LossConfig, chunk_size: int = 1024,
                   temperature: Any = 1.0, grad_dtype: Any = None):
    """Exact token-mean policy loss (`loss_config.policy_loss`) and gradients over all micro-batches of
    `batch` ([M, B, T] arrays), in `grad_dtype` (None: the parameters')."""
    return accumulate_grads(
        model, batch, lambda m, mb: _policy_micro_loss(m, mb, loss_config, chunk_size, temperature), grad_dtype)


def _train_step(model, optimizer, batch, loss_config: LossConfig, chunk_size: int, temperature):
    # Under master weights the gradients stay float32: clipping's norm and the update are of those.
    loss, grads, metrics = loss_and_grads(model, batch, loss_config, chunk_size, temperature,
                                          master_dtype_of(optimizer))
    grad_norm = optax.tree.norm(grads)
    optimizer.update(model, grads)
    return {**metrics, "loss": loss, "grad_norm": grad_norm}


train_step = nnx.jit(_train_step, static_argnames=("loss_config", "chunk_size"), donate_argnums=(0, 1))
"""train_step(model, optimizer, batch, loss_config, chunk_size, temperature) -> metrics (device arrays).

`batch` holds [M, B, T] arrays (see `rstar_jax.train.batching`). The model and optimizer are
updated in place; their buffers are donated.
"""


@nnx.jit(static_argnames=("chunk_size",))
def compute_logprobs(model, batch, chunk_size: int = 1024, temperature=1.0):
    """Per-token log-probs and entropies of `batch` targets under `model` ([M, B, T] each), with the
    logits divided by `temperature` (the sampling temperature, as the sampler's log-probs are)."""

    def one(mb):
        def compute():
            hidden = model.hidden_states(mb["input_ids"], mb["positions"], mb["segment_ids"])
            return token_logprobs(hidden, model.unembedding(), mb["targets"], chunk_size=chunk_size,
                                  temperature=temperature, return_entropy=True)

        empty = jnp.zeros(mb["targets"].shape, jnp.float32)
        return _unless_empty(mb, compute, lambda: (empty, empty))

    return jax.lax.map(one, {k: batch[k] for k in ("input_ids", "positions", "segment_ids", "targets", "loss_mask")})


def batch_sharding(mesh: jax.sharding.Mesh, batch_axes=("data", "fsdp")) -> jax.sharding.NamedSharding:
    """[M, rows, T] training arrays: rows split over the data-parallel mesh axes (the "batch" rule)."""
    axes = tuple(a for a in batch_axes if mesh.shape[a] > 1)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, axes or None, None))


def place_batch(batch: dict, mesh: jax.sharding.Mesh | None = None) -> dict:
    """Puts a host batch of [M, rows, T] arrays on the mesh, rows split over the data-parallel axes:
    the placement the RL and SFT steps train with."""
    if mesh is None or mesh.size == 1:
        # Measured on XLA:CPU: committed inputs (device_put, NamedSharding) made the same step 3-4x
        # slower than default-placed arrays; on one device they are equivalent.
        return {k: jnp.asarray(v) for k, v in batch.items()}
    sharding = batch_sharding(mesh)
    if jax.process_count() > 1:
        # Every process holds the same host batch (see RLTrainer.rollout_shared and SftBatches):
        # each materialises only the rows of its own devices.
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
                for k, v in batch.items()}
    return {k: jax.device_put(v, sharding) for k, v in batch.items()}
