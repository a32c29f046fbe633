"""The library of `python -m rstar_jax.serve`: `sglang.launch_server`'s command line (what RL and
evaluation use of it) over `JaxEngine`. `parser()` and `check(args)` read and validate the flags,
`run(args)` loads the policy (`builders.serving_policy`), the tokenizer and its chat template, sizes
the KV pool and serves `rstar_jax.engine.server` until cancelled. Flag meanings: the command's
docstring (`rstar_jax/serve.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import pathlib

from rstar_jax.agent.tokenizer import HFTokenizer
from rstar_jax.errors import UserError
from rstar_jax.engine.settings import DECODE_ATTENTIONS, DEFAULT_DECODE_ATTENTION, DEFAULT_LAYER_LAYOUT, LAYER_LAYOUTS
from rstar_jax.engine.textgen import JinjaChatTemplate
from rstar_jax.app.kv_pool import kv_pool_tokens

log = logging.getLogger("rstar_jax.serve")

DEFAULT_MEM_FRACTION_STATIC = 0.85


def load_text(args) -> tuple[HFTokenizer | None, str | None, JinjaChatTemplate | None]:
    """The tokenizer (None: token ids only), where it came from, and its chat template."""
    model_dir = pathlib.Path(args.model_path).is_dir()
    path = args.tokenizer_path or (args.model_path if model_dir else None)
    if args.skip_tokenizer_init:
        return None, None, None
    if path is None:
        log.info("--model-path %s is a preset with no tokenizer: serving token ids only (as --skip-tokenizer-init)",
                 args.model_path)
        return None, None, None
    if not (pathlib.Path(path) / "tokenizer.json").is_file():
        flag = "--tokenizer-path" if args.tokenizer_path else "--model-path"
        raise UserError(f"{flag} {path}: no tokenizer.json there; pass --tokenizer-path DIR, or "
                        f"--skip-tokenizer-init to serve token ids only")
    try:
        tokenizer = HFTokenizer(path)
    except (OSError, ValueError) as e:
        raise UserError(f"--tokenizer-path {path}: {e}") from None
    template = JinjaChatTemplate.from_dir(path)
    if template is None:
        log.warning("%s has no chat template: /v1/chat/completions will answer 400", path)
    elif importlib.util.find_spec("jinja2") is None:
        log.warning("jinja2 is not installed: /v1/chat/completions cannot render %s's chat template", path)
    return tokenizer, str(path), template


async def run(args) -> None:
    """Serves as `args` (from `parser()`, checked by `check`) say, until cancelled."""
    # Here rather than at the top: `python -m rstar_jax.serve --help` and bad flags need none of it.
    from rstar_jax.app.builders import engine_for, serving_policy
    from rstar_jax.engine.server import serve
    from rstar_jax.engine.weights import extra_bytes_per_device
    from rstar_jax.model.hf import hf_tensor, update_from_hf_tensors

    tokenizer, tokenizer_path, chat_template = await asyncio.to_thread(load_text, args)
    model, mesh, eos, load_weights = await asyncio.to_thread(serving_policy, args.model_path, tp_size=args.tp_size,
                                                             seed=args.random_seed)
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"--tokenizer-path {tokenizer_path}: {tokenizer.vocab_size} tokens, more than the model's "
                        f"{model.config.vocab_size}-row embedding")
    context_length = args.context_length or model.config.max_position_embeddings
    max_total_tokens = args.max_total_tokens or kv_pool_tokens(
        model, mesh, mem_fraction=args.mem_fraction_static, context_length=context_length,
        fallback=args.max_running_requests * context_length, report=log.info,
        reserved_bytes=extra_bytes_per_device(model, args.layer_layout))
    engine = engine_for(model, mesh, slots=args.max_running_requests, max_length=context_length,
                        max_total_tokens=max_total_tokens, page_size=args.page_size, seed=args.random_seed,
                        chunked_prefill_size=args.chunked_prefill_size, layer_layout=args.layer_layout,
                        decode_attention=args.decode_attention)
    del model  # the engine holds what it serves: with per-layer weights, the stacked ones are freed here
    try:
        await serve(engine, host=args.host, port=args.port, model_path=args.model_path, eos_token_ids=eos,
                    load_weights=load_weights, tp_size=args.tp_size, port_file=args.port_file,
                    load_tensors=update_from_hf_tensors, read_tensor=hf_tensor,
                    tokenizer=tokenizer, tokenizer_path=tokenizer_path, chat_template=chat_template,
                    served_model_name=args.served_model_name, deterministic=args.enable_deterministic_inference,
                    enable_metrics=args.enable_metrics, server_args=server_args(args, context_length))
    finally:
        engine.close()


def server_args(args, context_length: int) -> dict:
    """What /get_server_info reports of the command line, under SGLang's ServerArgs names."""
    return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path, "host": args.host,
            "port": args.port, "context_length": context_length, "max_running_requests": args.max_running_requests,
            "mem_fraction_static": args.mem_fraction_static, "page_size": args.page_size,
            "chunked_prefill_size": args.chunked_prefill_size, "layer_layout": args.layer_layout,
            "decode_attention": args.decode_attention,
            "tp_size": args.tp_size,
            "dp_size": args.dp_size, "random_seed": args.random_seed, "skip_tokenizer_init": args.skip_tokenizer_init,
            "enable_deterministic_inference": args.enable_deterministic_inference,
            "enable_metrics": args.enable_metrics, "served_model_name": args.served_model_name or args.model_path,
            "sampling_defaults": args.sampling_defaults, "log_level": args.log_level}


def parser(description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rstar_jax.serve", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    hidden = argparse.SUPPRESS

    def alias(name: str, dest: str, type_=None) -> None:  # a deprecated name of an SGLang flag
        p.add_argument(name, dest=dest, type=type_, default=hidden, help=hidden)

    p.add_argument("--model-path", help="Hugging Face Qwen3 directory, or a preset name (random weights)")
    alias("--model", "model_path")
    p.add_argument("--tokenizer-path", help="tokenizer directory (default: the model's)")
    p.add_argument("--served-model-name", help="the model's name in /v1/models and metrics (default: model path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    p.add_argument("--context-length", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's max_position_embeddings)")
    alias("--max-length", "context_length", int)
    p.add_argument("--max-running-requests", type=int, default=8, help="requests decoded together (decode slots)")
    alias("--slots", "max_running_requests", int)
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: from --mem-fraction-static)")
    p.add_argument("--mem-fraction-static", type=float, default=DEFAULT_MEM_FRACTION_STATIC,
                   help="fraction of device memory for weights and KV pool (default %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="prefill tokens per engine step: longer contexts are prefilled in chunks while others "
                        "decode (-1 or 0: off, the default)")
    p.add_argument("--layer-layout", default=DEFAULT_LAYER_LAYOUT,
                   help=f"how the engine holds the decoder layers' weights, one of {LAYER_LAYOUTS} (ours; "
                        f"default %(default)s): per_layer runs the layers unrolled over per-layer arrays")
    p.add_argument("--decode-attention", default=DEFAULT_DECODE_ATTENTION,
                   help=f"how decode steps attend over the KV pool, one of {DECODE_ATTENTIONS} (ours; default "
                        f"%(default)s): pallas runs the Pallas GPU paged-attention kernel over a heads-first pool "
                        f"(interpreted, slowly, on other backends)")
    p.add_argument("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                   help="devices one model is split over (tensor parallel)")
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1,
                   help="data-parallel replicas: 1 only (start one server per replica)")
    p.add_argument("--random-seed", type=int, default=0, help="seeds the unseeded sampling")
    alias("--seed", "random_seed", int)
    p.add_argument("--skip-tokenizer-init", action="store_true", help="load no tokenizer: token ids only")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="honour sampling_seed (ignored without it, as SGLang)")
    p.add_argument("--enable-metrics", action="store_true", help="serve /metrics (Prometheus text)")
    p.add_argument("--sampling-defaults", default="openai",
                   help="openai only: omitted sampling settings get neutral defaults (temperature 1, top_p 1)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"))
    p.add_argument("--port-file", help="write the bound port here as soon as the socket is bound")
    return p


def check(args) -> list[str]:
    """The flags' problems, one line each (empty: fine)."""
    problems = []
    if not args.model_path:
        problems.append("--model-path is required")
    if args.dp_size != 1:
        problems.append(f"--dp-size {args.dp_size}: only 1 is supported; start one server per replica and "
                        f"spread requests over them (the rollout scheduler, or sglang-router)")
    for flag, value, low in (("--max-running-requests", args.max_running_requests, 1),
                             ("--page-size", args.page_size, 1), ("--tp-size", args.tp_size, 1),
                             ("--context-length", args.context_length, 2),
                             ("--max-total-tokens", args.max_total_tokens, 1)):
        if value is not None and value < low:
            problems.append(f"{flag} must be >= {low}, got {value}")
    if args.chunked_prefill_size is not None and args.chunked_prefill_size < -1:
        problems.append(f"--chunked-prefill-size must be -1 or 0 (off) or >= 1, got {args.chunked_prefill_size}")
    if args.layer_layout not in LAYER_LAYOUTS:
        problems.append(f"--layer-layout must be one of {LAYER_LAYOUTS}, got {args.layer_layout!r}")
    if args.decode_attention not in DECODE_ATTENTIONS:
        problems.append(f"--decode-attention must be one of {DECODE_ATTENTIONS}, got {args.decode_attention!r}")
    if args.sampling_defaults != "openai":
        problems.append(f"--sampling-defaults {args.sampling_defaults}: only 'openai' is supported (a request's "
                        f"omitted settings get neutral defaults; generation_config.json's are not read)")
    if not 0 < args.mem_fraction_static <= 1:
        problems.append(f"--mem-fraction-static must be in (0, 1], got {args.mem_fraction_static}")
    return problems
