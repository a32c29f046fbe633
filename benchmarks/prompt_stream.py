"""Prompt-stream throughput: rstar_jax's PromptIterator against grain's own shuffle/repeat pipeline.

Both produce the same kind of stream (an endless sequence of seeded per-epoch permutations, batched
as Python lists, no prefetch threads) over the same examples. Prints microseconds per prompt for
each, and the ratio.

    python benchmarks/prompt_stream.py [--examples 2048] [--batch 512] [--epochs 2]
"""

from __future__ import annotations

import argparse
import time

import grain

from rstar_jax.data import Example, PromptIterator


def _time_batches(iterator, n_batches: int) -> float:
    start = time.perf_counter()
    for _ in range(n_batches):
        next(iterator)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    examples = [Example(question=f"question {i}", answer=str(i), source="bench", row=i) for i in range(args.examples)]
    n_batches = args.examples * args.epochs // args.batch
    prompts = n_batches * args.batch

    ours = _time_batches(PromptIterator(examples, args.batch, seed=0), n_batches)
    baseline_ds = (grain.MapDataset.source(examples).shuffle(seed=0).repeat(None)
                   .batch(args.batch, drop_remainder=True, batch_fn=list)
                   .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    baseline = _time_batches(iter(baseline_ds), n_batches)

    print(f"{prompts} prompts ({args.examples} examples x {args.epochs} epochs, batches of {args.batch})")
    print(f"rstar_jax PromptIterator        : {1e6 * ours / prompts:9.2f} us/prompt ({ours:.3f} s)")
    print(f"grain shuffle().repeat() (base) : {1e6 * baseline / prompts:9.2f} us/prompt ({baseline:.3f} s)")
    print(f"speed-up: {baseline / ours:.1f}x")


if __name__ == "__main__":
    main()
