"""SGLang-compatible HTTP server over `JaxEngine` (routes and semantics: `rstar_jax.rollout.server`).

    python -m rstar_jax.serve --model PATH_OR_PRESET --port 30000 [--host 127.0.0.1] [--slots N]
        [--max-length N] [--max-total-tokens N] [--page-size N] [--tp-size N] [--port-file F] [--seed S]

`--model` is a Hugging Face Qwen3 directory or a preset name (`tiny`, `qwen3-1.7b`, ...) served with
random weights. `--port 0` picks a free port; `--port-file` receives the bound port once the server
is warm. `--max-total-tokens` sizes the paged KV pool (SGLang's `max_total_num_tokens`); below
slots x max-length the server overcommits it and retracts requests under pressure, as SGLang does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from rstar_jax.errors import UserError
from rstar_jax.rollout.server import serve
from rstar_jax.train.builders import engine_for, serving_policy


async def _serve(args) -> None:
    model, mesh, eos, load_weights = await asyncio.to_thread(serving_policy, args.model, tp_size=args.tp_size,
                                                             seed=args.seed)
    engine = engine_for(model, mesh, slots=args.slots, max_length=args.max_length,
                        max_total_tokens=args.max_total_tokens, page_size=args.page_size, seed=args.seed)
    try:
        await serve(engine, host=args.host, port=args.port, model_path=args.model, eos_token_ids=eos,
                    load_weights=load_weights, tp_size=args.tp_size, port_file=args.port_file)
    finally:
        engine.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rstar_jax.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF Qwen3 directory or preset name (random weights)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    parser.add_argument("--slots", type=int, default=8, help="decode slots (SGLang's max_running_requests)")
    parser.add_argument("--max-length", type=int, default=2048, help="context length (prompt + output)")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool size in tokens (SGLang's max_total_num_tokens); default slots x max-length")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--tp-size", type=int, default=1, help="devices the model is split over (tensor parallel)")
    parser.add_argument("--port-file", help="write the bound port here once ready")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(args))
    except (UserError, ValueError) as e:  # bad flags or a bad checkpoint: no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
