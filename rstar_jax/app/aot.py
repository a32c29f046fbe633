"""Ahead-of-time compile of a recipe's training steps on an abstract cluster (as MaxText's
`train_compile.py` does for TPU topologies): no weights are materialised and no accelerator is
needed; fake CPU devices stand in for the cluster's. The command is `python -m rstar_jax.aot`.

Lowers and compiles the production GRPO-RoC update (`train.step._train_step`: micro-batch scan,
chunked log-probs, clip-higher loss, AdamW) and the SFT step for the config's model over
a mesh of abstract devices with the config's mesh, remat policy and micro-batch sizes, and prints XLA's
per-device memory analysis (arguments, outputs, temporaries) beside the memory plan
(`parallel.memory`) and the memory of an MI300X (192 GB) and an H100 (80 GB). Compiling on CPU
checks that the program partitions and what it holds; XLA:GPU's temporaries differ somewhat
(other fusions, its own collective buffers).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar_jax.config import resolve
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.model.sharding import set_activation_shardings, state_shardings
from rstar_jax.parallel import make_mesh
from rstar_jax.parallel.memory import GIB, memory_plan
from rstar_jax.rl.loss import LossConfig
from rstar_jax.engine.jax_engine import check_decode_attention, decode_step, pool_sharding, prefill_step
from rstar_jax.engine.weights import EngineWeights
from rstar_jax.app import builders
from rstar_jax.train.batching import TrainingSequence, make_micro_batches
from rstar_jax.train.rl_batch import row_length_for
from rstar_jax.train.sft import _sft_step
from rstar_jax.train.step import OptimizerConfig, _train_step, batch_sharding, optimizer_for

DEVICE_MEMORY = {"MI300X": 192e9, "H100": 80e9}


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    name: str
    argument_bytes: int  # per device: parameters, optimizer state and the batch
    output_bytes: int
    alias_bytes: int  # outputs written into donated arguments
    temp_bytes: int
    data_bytes: int  # per device, of argument_bytes: the batch (training) or the KV page pool (engine)
    compile_s: float
    host_temp_bytes: int = 0  # temporaries in host memory: activations a remat policy offloads there

    @property
    def peak_bytes(self) -> int:
        """Live at once: arguments, outputs not aliased to donated arguments, temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _per_device_bytes(abstract_tree) -> int:
    total = 0
    for x in jax.tree.leaves(abstract_tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * jnp.dtype(x.dtype).itemsize
    return total


def _abstract_batch(mesh, num_micro_batches: int, rows: int, row_length: int) -> dict:
    """The [M, rows, T] arrays the trainer places (the same keys and dtypes), rows over data x fsdp."""
    example = make_micro_batches([TrainingSequence(prompt_ids=[1], response_ids=[2], loss_mask=[1], advantage=1.0,
                                                   old_logprobs=[0.0], sampler_logprobs=[0.0])],
                                 rows=1, row_length=2, packed=True, num_micro_batches=1)
    sharding = batch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct((num_micro_batches, rows, row_length), v.dtype, sharding=sharding)
            for k, v in example.items()}


def _compile(name: str, step_fn, model_state, opt_state, batch) -> CompiledStep:
    def update(model_state, opt_state, batch):
        model, optimizer = nnx.merge(*model_state), nnx.merge(*opt_state)
        metrics = step_fn(model, optimizer, batch)
        return nnx.state(model), nnx.state(optimizer), metrics

    model_def, model_abstract = model_state
    opt_def, opt_abstract = opt_state
    out_shardings = (jax.tree.map(lambda x: x.sharding, model_abstract),
                     jax.tree.map(lambda x: x.sharding, opt_abstract), None)
    jitted = jax.jit(lambda m, o, b: update((model_def, m), (opt_def, o), b), out_shardings=out_shardings,
                     donate_argnums=(0, 1), keep_unused=True)  # the placed batch is on the devices either way
    return _measure(name, jitted, (model_abstract, opt_abstract, batch), data=batch)


def _measure(name: str, jitted, args, *, data) -> CompiledStep:
    """Compiles `jitted` for the abstract `args`; `data` is the part of them reported as data."""
    t0 = time.perf_counter()
    memory = jitted.lower(*args).compile().memory_analysis()
    return CompiledStep(name, int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes),
                        int(memory.alias_size_in_bytes), int(memory.temp_size_in_bytes), _per_device_bytes(data),
                        time.perf_counter() - t0, int(getattr(memory, "host_temp_size_in_bytes", 0) or 0))


def _abstract_model(config, mesh):
    """(graphdef, abstract state placed on `mesh`) of the config's model, and the abstract module."""
    return _abstract_model_for(resolve.model_config(config), mesh, builders.mesh_rules(config))


def _abstract_model_for(model_config: Qwen3Config, mesh, rules):
    model = set_activation_shardings(nnx.eval_shape(lambda: Qwen3(model_config, rngs=nnx.Rngs(0))), mesh, rules)
    graphdef, state = nnx.split(model)
    return (graphdef, _abstract(state, state_shardings(state, mesh, rules))), model


def abstract_policy(config, mesh):
    """(graphdef, abstract state) of the model and of its optimizer, placed as the run places them."""
    return abstract_policy_for(resolve.model_config(config), resolve.optimizer_config(config), mesh,
                               builders.mesh_rules(config))


def abstract_policy_for(model_config: Qwen3Config, optimizer_config: OptimizerConfig, mesh, rules):
    """`abstract_policy` without a recipe config: a model config, an optimizer config and rules."""
    optimizer = nnx.eval_shape(lambda: optimizer_for(Qwen3(model_config, rngs=nnx.Rngs(0)), optimizer_config))
    opt_def, opt_state = nnx.split(optimizer)
    opt_abstract = _abstract(opt_state, state_shardings(opt_state, mesh, rules))
    return _abstract_model_for(model_config, mesh, rules)[0], (opt_def, opt_abstract)


def compile_grpo_update(model_state, opt_state, mesh, micro_batches: int, rows: int, row_length: int,
                        loss_config: LossConfig, chunk: int, temperature) -> CompiledStep:
    """The GRPO update (`_train_step`) for abstract policy state and a [micro_batches, rows, row_length]
    batch on `mesh`: XLA's memory analysis, nothing run."""
    batch = _abstract_batch(mesh, micro_batches, rows, row_length)
    return _compile("grpo update", lambda m, o, b: _train_step(m, o, b, loss_config, chunk, temperature),
                    model_state, opt_state, batch)


def compile_steps(config, mesh) -> list[CompiledStep]:
    """The RL update and the SFT step of `config` compiled for `mesh` (abstract arrays only)."""
    model_state, opt_state = abstract_policy(config, mesh)
    batch_config = resolve.batch_config(config, builders.data_parallel(mesh))
    loss_config = resolve.loss_config(config)
    chunk = config.rl.logprob_chunk_size
    temperature = jnp.float32(config.rollout.temperature)
    steps = [compile_grpo_update(model_state, opt_state, mesh, batch_config.num_micro_batches, batch_config.rows,
                                 batch_config.row_length, loss_config, chunk, temperature)]
    sft_row = row_length_for(config.sft.max_length, 1)
    sft_rows = builders.data_parallel(mesh) * max(1, config.sft.micro_batch_tokens // sft_row)
    sft_batch = _abstract_batch(mesh, -(-config.sft.batch_size // sft_rows), sft_rows, sft_row)
    steps.append(_compile("sft step", lambda m, o, b: _sft_step(m, o, b, chunk), model_state, opt_state, sft_batch))
    return steps


def report(config, mesh, steps: list[CompiledStep]) -> str:
    model_config = resolve.model_config(config)
    plan = memory_plan(model_config, mesh, rules=builders.mesh_rules(config), preset=config.model.preset,
                       grad_dtype="float32")
    mesh_text = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
    width = max([22] + [len(s.name) + 1 for s in steps])
    lines = [f"{config.model.preset}: {plan.num_params / 1e9:.2f}B parameters ({model_config.param_dtype}), "
             f"compute {model_config.dtype}, remat {model_config.remat_policy}, mesh {mesh_text} "
             f"({mesh.size} devices)",
             f"memory plan per device: parameters {plan.param_bytes / GIB:.2f} GiB, gradients (float32) "
             f"{plan.grad_bytes / GIB:.2f} GiB, optimizer state {plan.opt_state_bytes / GIB:.2f} GiB",
             f"{'per device, GiB':<{width}}{'arguments':>10}{'(data)':>9}{'outputs':>9}{'aliased':>9}{'temps':>9}"
             f"{'peak':>9}{'MI300X':>9}{'H100':>9}{'compile s':>11}"]
    for s in steps:
        fractions = [f"{s.peak_bytes / capacity:>8.0%}" for capacity in DEVICE_MEMORY.values()]
        lines.append(f"{s.name:<{width}}{s.argument_bytes / GIB:>10.3f}{s.data_bytes / GIB:>9.3f}"
                     f"{s.output_bytes / GIB:>9.3f}{s.alias_bytes / GIB:>9.3f}{s.temp_bytes / GIB:>9.3f}"
                     f"{s.peak_bytes / GIB:>9.3f} {' '.join(fractions)}{s.compile_s:>11.1f}")
    lines.append("peak = arguments + outputs - aliased (donated) + temporaries; (data): the batch or the KV page pool; "
                 "MI300X 192 GB, H100 80 GB")
    return "\n".join(lines)


def prefill_length(engine_config) -> int:
    """The longest prefill row `rollout.engine` runs: its context, or with chunked prefill (a step
    prefills at most chunked_prefill_size tokens) the prompt bucket that holds one chunk."""
    e = engine_config
    if e.chunked_prefill_size <= 0:
        return e.max_length
    return min(e.max_length, next((b for b in builders.PREFILL_BUCKETS if b >= e.chunked_prefill_size), e.max_length))


def compile_engine(config, tensor: int) -> list[CompiledStep]:
    """The in-process engine's prefill (a full prefill batch of the longest row it runs,
    `prefill_length`) and decode (every slot) at `tensor`-way tensor parallelism over the first
    `tensor` devices, with `rollout.engine`'s slots, KV page pool, layer layout and decode attention:
    what one generation replica of that size holds."""
    e = config.rollout.engine
    mesh = make_mesh(data=1, fsdp=1, tensor=tensor, devices=jax.devices()[:tensor])
    (graphdef, state), model = _abstract_model(config, mesh)
    layout = EngineWeights(graphdef, state, e.layer_layout)
    weights = layout.abstract_weights()
    total = e.max_total_tokens or e.slots * e.max_length
    num_pages, span = -(-max(total, e.max_length) // e.page_size), -(-e.max_length // e.page_size)
    heads_first = e.decode_attention == "pallas"  # the pool's layout follows the decode attention, as in JaxEngine
    cache = jax.eval_shape(lambda: model.init_paged_cache(num_pages, e.page_size, heads_first=heads_first))
    pool = pool_sharding(mesh, model.config.num_kv_heads, heads_first)
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=pool), cache)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    key = jax.eval_shape(lambda: jax.random.key(0))

    def arrays(*shapes_and_dtypes):
        return [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes_and_dtypes]

    def sampling(rows):
        return arrays(((rows,), jnp.int32), ((rows,), jnp.float32), ((rows,), jnp.float32), ((rows,), jnp.int32))

    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
    step = jax.ShapeDtypeStruct((), jnp.uint32, sharding=replicated)
    rows = min(8, e.slots)  # JaxEngine's prefill batch
    prefill_args = [weights, cache, *arrays(((rows, span), jnp.int32), ((rows, prefill_length(e)), jnp.int32),
                                            ((rows,), jnp.int32), ((rows,), jnp.int32)), key, step, *sampling(rows)]
    slots = e.slots
    decode_args = [weights, cache, *arrays(((slots, span), jnp.int32), ((slots,), jnp.int32), ((slots,), jnp.int32),
                                           ((slots,), jnp.bool_), ((slots,), jnp.int32)), key, step, *sampling(slots)]
    # The RL setting: full-vocabulary sampling, so decode has no top-p / top-k sort.
    prefill = functools.partial(prefill_step, layout, False)
    check_decode_attention(e.decode_attention, model.config, e.page_size, model.config.dtype, mesh)
    decode = functools.partial(decode_step, layout, False, False, attention=e.decode_attention, mesh=mesh)
    where = "".join(f", {v}" for v, default in ((e.layer_layout, "stacked"), (e.decode_attention, "xla"))
                    if v != default)
    return [_measure(name, jax.jit(kernel, donate_argnums=(1,)), args, data=cache)
            for name, kernel, args in ((f"engine prefill (tp {tensor}{where})", prefill, prefill_args),
                                       (f"engine decode (tp {tensor}{where})", decode, decode_args))]
