"""The main job: `python -m rstar_jax.launch [--config=configs/tiny.py] [--config.a.b=v ...]`.

Without --config the embedded default `configs/tiny.py` runs.
"""

from __future__ import annotations

import pathlib
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from rstar_jax.config import DEFAULT_CONFIG, ConfigError, validate
from rstar_jax.config import model_config as config_model

_CONFIG = config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), "Path to a config file (get_config()).",
                                          lock_config=True)


def run_demo(config) -> dict:
    """Foundation demonstration: sharded init -> HF export -> reload (bitwise) -> KV-cache greedy decode."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rstar_jax.model.generate import greedy_generate
    from rstar_jax.model.hf import load_pretrained, save_pretrained
    from rstar_jax.parallel import create_sharded_model, make_mesh

    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_config = config_model(config)
    mesh = make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    print(f"[demo] {jax.device_count()} device(s), mesh {dict(mesh.shape)}; "
          f"model {config.model.preset}: {model_config.num_params:,} parameters")
    t0 = time.perf_counter()
    model = create_sharded_model(model_config, mesh, tuple(map(tuple, config.mesh.rules)), seed=config.seed)
    hf_dir = save_pretrained(model, run_dir / "hf")
    reloaded = load_pretrained(hf_dir, mesh=mesh, rules=tuple(map(tuple, config.mesh.rules)))
    for name in type(model).LAYER_PARAMS + ("embed", "final_norm"):
        if not np.array_equal(np.asarray(getattr(model, name)[...]), np.asarray(getattr(reloaded, name)[...])):
            raise RuntimeError(f"export/reload round trip changed parameter {name}")
    print(f"[demo] exported and reloaded {hf_dir} bitwise ({time.perf_counter() - t0:.1f}s)")

    rng = np.random.default_rng(config.seed)
    b, t, n = config.demo.batch_size, config.demo.prompt_length, config.demo.new_tokens
    prompts = jnp.asarray(rng.integers(1, model_config.vocab_size, size=(b, t)), jnp.int32)
    lengths = jnp.asarray(rng.integers(t // 2, t + 1, size=(b,)), jnp.int32)
    t0 = time.perf_counter()
    tokens, _ = greedy_generate(reloaded, prompts, lengths, n)
    tokens = np.asarray(tokens)
    elapsed = time.perf_counter() - t0

    # Check the KV-cache decode against argmax over full forwards of the growing sequences.
    forward = nnx.jit(lambda m, x: m(x))
    for row in range(b):
        seq = np.concatenate([np.asarray(prompts[row, :lengths[row]]), tokens[row]])
        logits = np.asarray(forward(reloaded, jnp.asarray(seq[None])))[0]
        expected = logits[int(lengths[row]) - 1:-1].argmax(-1)
        if not np.array_equal(expected, tokens[row]):
            raise RuntimeError(f"KV-cache greedy decode disagrees with full forward on row {row}")
    print(f"[demo] greedy decode of {b}x{n} tokens with the KV cache matches full-forward argmax "
          f"({elapsed:.1f}s incl. compile)")
    print(f"[demo] done: {run_dir}")
    return {"tokens": tokens, "run_dir": str(run_dir)}


def maybe_initialize_distributed() -> None:
    """Joins a multi-process JAX job when launched as several processes (SLURM or explicit env)."""
    import os

    import jax

    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()  # cluster auto-detection reads SLURM's environment


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
    try:
        config = validate(_CONFIG.value)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if config.mode == "eval":  # the same code path as `python -m rstar_jax.evaluate`
        from rstar_jax.evaluate import run_or_exit, run_evaluation

        run_or_exit(run_evaluation, config)
        return
    maybe_initialize_distributed()
    if config.mode == "demo":
        run_demo(config)
    else:
        from rstar_jax.train.run import run_stage

        summary = run_stage(config)
        print(f"[{config.mode}] done: {config.run_dir} " + " ".join(
            f"{k}={v:.4g}" for k, v in summary.items() if isinstance(v, float) and k.startswith(("sft/loss", "rollout/reward_mean", "update/loss"))))


if __name__ == "__main__":
    app.run(main)
