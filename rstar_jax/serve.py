"""`python -m rstar_jax.serve`: `python -m sglang.launch_server`'s command line (what RL and
evaluation use of it) over `JaxEngine`; routes and semantics in `rstar_jax.engine.server`.

    python -m rstar_jax.serve --model-path PATH_OR_PRESET [--tokenizer-path DIR] [--host 127.0.0.1]
        [--port 30000] [--context-length N] [--max-running-requests N] [--max-total-tokens N]
        [--mem-fraction-static F] [--page-size N] [--chunked-prefill-size N] [--layer-layout L]
        [--decode-attention A] [--tp-size N] [--dp-size 1]
        [--random-seed S] [--served-model-name NAME] [--skip-tokenizer-init] [--enable-deterministic-inference]
        [--enable-metrics] [--sampling-defaults openai] [--log-level LEVEL] [--port-file F]

The flags are SGLang's, with its meanings:
- `--model-path`: a Hugging Face Qwen3 directory, or a preset name (`tiny`, `qwen3-1.7b`, ...) served
  with random weights and no tokenizer (token ids only, as with `--skip-tokenizer-init`).
- `--tokenizer-path` (default: the model's directory): its `tokenizer.json` is loaded, and with it
  `text` and `stop` strings in `/generate`, `/v1/completions`, and `/v1/chat/completions` with its
  chat template. `--skip-tokenizer-init` loads none: token ids only, and those routes answer 400.
- `--context-length`: prompt + output per request (default: the model's max_position_embeddings).
  `--max-running-requests`: requests decoded together (default 8).
- `--max-total-tokens`: the paged KV pool in tokens (SGLang's max_total_num_tokens). Without it the
  pool takes what `--mem-fraction-static` leaves, as SGLang sizes it: that fraction (default 0.85) of
  the device memory JAX may use holds the weights and the pool. A device without memory statistics
  (CPU) gets max-running-requests x context-length tokens (logged). A pool below that is
  overcommitted: requests are retracted under pressure, as SGLang does.
- `--chunked-prefill-size`: prefill tokens per engine step; a longer context is prefilled in chunks
  while running requests decode. Off by default (-1 or 0 also mean off).
- `--layer-layout` (ours): how the engine holds the decoder layers' weights: `stacked` (the default:
  the programs scan over [layers, ...] arrays) or `per_layer` (each layer's weights their own arrays,
  the layers unrolled: no per-step weight slices, longer compiles; see `rstar_jax.engine.settings`).
- `--decode-attention` (ours): how decode steps attend over the KV pool: `xla` (the default: the
  rows' pages gathered, then reduced) or `pallas` (the Pallas GPU paged-attention kernel over a
  heads-first pool, per device under `--tp-size`; interpreted, slowly, on CPU; shapes it cannot serve
  are refused; see `rstar_jax.engine.settings`).
- `--enable-deterministic-inference`: honour `sampling_seed` (OpenAI `seed`); without it the seed
  is ignored, as SGLang does (the engine's sampling is deterministic per seed and position either
  way). `--random-seed` seeds the unseeded draws.
- `--enable-metrics`: serve `/metrics` (Prometheus text, SGLang's metric names).
- `--sampling-defaults openai` (the only mode, and the default here; SGLang's default `model` reads
  generation_config.json): sampling settings a request leaves out get SGLang's neutral defaults.
- `--tp-size` (`--tp`, `--tensor-parallel-size`): devices one model is split over; `--dp-size` must
  be 1 (start one server per replica).
- `--port 0` picks a free port; `--port-file` (ours) receives the bound port as soon as the socket is
  bound. As SGLang, `/health` and `/health_generate` answer 503 until warm-up (compilation) is done.

Older names still work: `--model` (`--model-path`), `--slots` (`--max-running-requests`),
`--max-length` (`--context-length`) and `--seed` (`--random-seed`). Bad flags, checkpoints or
tokenizers print `error: ...` and exit with status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from rstar_jax.errors import UserError
from rstar_jax.app import serving


def main(argv=None) -> None:
    args = serving.parser(__doc__.split("\n\n")[0]).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    problems = serving.check(args)
    try:
        if problems:
            raise UserError("\n".join(problems))
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serving.run(args))
    except (UserError, ValueError) as e:  # bad flags, checkpoint or tokenizer: no traceback
        print("\n".join(f"error: {line}" for line in str(e).splitlines()), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
