"""Compiled memory of the chunked log-prob head against the naive one, forward + backward.

The head is what the GRPO loss differentiates through: final hidden states [B, T, D] and the
unembedding [D, V] -> per-token log-probs (and entropies) -> a scalar -> gradients for both inputs.
`rstar_jax.rl.logprobs.token_logprobs` computes it chunk by chunk along T; the naive head
(`naive_token_logprobs`) materialises the [B, T, V] fp32 logits and keeps what autodiff needs of them.
Both are compiled for the same shapes on the default backend, nothing is run, and XLA's own buffer
assignment (`Compiled.memory_analysis()`) is printed: the scratch each needs beyond its inputs and
outputs ("temp"), and the peak (arguments + outputs + temp, less what is aliased).

    python benchmarks/logprob_head_memory.py                       # V=151,936, T=8,192, D=2,048
    python benchmarks/logprob_head_memory.py --chunk 512 --entropy
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rstar_jax.rl.logprobs import naive_token_logprobs, token_logprobs  # noqa: E402


def compiled_memory(head, batch: int, length: int, hidden: int, vocab: int, dtype, param_dtype) -> dict:
    """XLA's memory figures for d/d(hidden, unembedding) of sum(logprobs * weights [+ entropies])."""

    def loss(h, w, targets, weights):
        out = head(h, w, targets)
        if isinstance(out, tuple):
            logprobs, entropy = out
            return jnp.sum(logprobs * weights) + 1e-3 * jnp.sum(entropy * weights)
        return jnp.sum(out * weights)

    args = (jax.ShapeDtypeStruct((batch, length, hidden), dtype),
            jax.ShapeDtypeStruct((hidden, vocab), param_dtype),
            jax.ShapeDtypeStruct((batch, length), jnp.int32),
            jax.ShapeDtypeStruct((batch, length), jnp.float32))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    m = compiled.memory_analysis()
    if m is None:
        raise SystemExit(f"the {jax.default_backend()} backend reports no memory analysis")
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {"temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
            "output_bytes": m.output_size_in_bytes, "peak_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--length", type=int, default=8_192)
    parser.add_argument("--hidden", type=int, default=2_048, help="model width (Qwen3-1.7B: 2,048)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=1_024, help="the chunked head's sequence chunk")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="hidden states' (compute) dtype")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"), help="the unembedding's dtype")
    parser.add_argument("--entropy", action="store_true", help="also differentiate through the entropies")
    args = parser.parse_args()

    dtype, param_dtype = jnp.dtype(args.dtype), jnp.dtype(args.param_dtype)
    shapes = (args.batch, args.length, args.hidden, args.vocab, dtype, param_dtype)
    chunked = compiled_memory(
        lambda h, w, t: token_logprobs(h, w, t, chunk_size=args.chunk, return_entropy=args.entropy), *shapes)
    naive = compiled_memory(lambda h, w, t: naive_token_logprobs(h, w, t, return_entropy=args.entropy), *shapes)
    gib = 2 ** 30
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); B={args.batch} T={args.length} "
          f"D={args.hidden} V={args.vocab}; hidden {args.dtype}, unembedding {args.param_dtype}; fwd+bwd"
          f"{' with entropy' if args.entropy else ''}")
    for name, m in ((f"chunked (chunk {args.chunk})", chunked), ("naive", naive)):
        print(f"{name:>20}: temp {m['temp_bytes'] / gib:7.3f} GiB  peak {m['peak_bytes'] / gib:7.3f} GiB  "
              f"(arguments {m['argument_bytes'] / gib:.3f}, outputs {m['output_bytes'] / gib:.3f})")
    temp_ratio = chunked["temp_bytes"] / naive["temp_bytes"]
    peak_ratio = chunked["peak_bytes"] / naive["peak_bytes"]
    print(f"chunked / naive: temp {temp_ratio:.3f} (1/{1 / temp_ratio:.1f}), peak {peak_ratio:.3f} (1/{1 / peak_ratio:.1f})")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "logprob_head_memory.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), "chunked": chunked,
                       "naive": naive, "temp_ratio": temp_ratio, "peak_ratio": peak_ratio}, f, indent=2)


if __name__ == "__main__":
    main()
