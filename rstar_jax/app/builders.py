"""The composition root: the one place a config becomes live objects.

Every command and stage gets its policy, mesh, engine, data, sandbox, generators and settings from
here, so a config field is read in one place and the production path is the one the tests run:

    model, mesh = build_policy(config)                 # HF checkpoint, orbax checkpoint or sharded init
    engine = make_engine(config, model, mesh)          # always on the policy's mesh
    with sandbox(config) as targets:                   # a local sandbox server, or the configured ones
        async with rollout_resources(config, targets, engine=engine) as resources:
            ...                                        # tool executor, scorer, generators, scheduler

The libraries' settings (the model's shape, the loop, RoC, the loss, the optimizer, the batches, the
tool environment) are resolved from the config by `rstar_jax.config.resolve`; its errors name the
config field.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Protocol

import jax
from flax import nnx
from jax.sharding import Mesh

from rstar_jax.agent.conversation import ConversationError
from rstar_jax.agent.reward import make_scorer
from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import Tokenizer, load_tokenizer
from rstar_jax.agent.tool_calls import format_observation
from rstar_jax.config import missing_tokenizer, resolve
from rstar_jax.data.datasets import (
    DataError,
    LoadReport,
    PromptIterator,
    filter_overlong_prompts,
    load_examples,
    read_conversations,
)
from rstar_jax.data.synthetic import prepare_synthetic_data, write_held_out
from rstar_jax.errors import ConfigError, UserError
from rstar_jax.evaluation.questions import Question, load_questions
from rstar_jax.model.hf import load_pretrained, save_pretrained
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.parallel import MESH_AXES, create_sharded_model, make_mesh, multihost, shard_model
from rstar_jax.engine.jax_engine import JaxEngine, check_decode_attention
from rstar_jax.engine.settings import DEFAULT_DECODE_ATTENTION, DEFAULT_LAYER_LAYOUT
from rstar_jax.engine.weights import extra_bytes_per_device
from rstar_jax.engine.local_server import LocalServer
from rstar_jax.rollout.loop import Scorer, ToolExecutor
from rstar_jax.rollout.protocol import Scheduler
from rstar_jax.rollout.scheduler import KvScheduler, RoundRobinScheduler
from rstar_jax.rollout.sglang import SGLangGenerator
from rstar_jax.rollout.workers import RolloutWorkers, WorkerSpec
from rstar_jax.train.checkpoint import Checkpointer, CheckpointError, PolicySource, stored_config
from rstar_jax.app.kv_pool import CONFIG_NAMES, kv_pool_tokens
from rstar_jax.train.metrics import MetricsWriter
from rstar_jax.train.rl_batch import row_length_for
from rstar_jax.train.sft import SftBatches, SftSkips, sft_sequences
from rstar_jax.train.step import master_dtype_of, with_master_weights
from rstar_jax.train.weight_sync import DiskSync, DistributedSync, EngineSync, WeightSync
from sandbox_service import selftest
from sandbox_service.client import SandboxClient
from sandbox_service.fusion_client import SandboxFusionExecutor
from sandbox_service.launcher import LocalSandbox

# Prompt-length buckets the engine compiles prefill for (plus its context length).
PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


# -- policy and mesh -------------------------------------------------------------------------------

def mesh_rules(config) -> tuple:
    """`config.mesh.rules` as hashable (logical name, mesh axes) pairs."""
    return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes) for name, axes in config.mesh.rules)


def check_mesh(config, device_count: int) -> tuple[int, int, int]:
    """Resolves -1 and checks the mesh product against the device count (known only at run time)."""
    sizes = [config.mesh[a] for a in MESH_AXES]
    fixed = 1
    for s in sizes:
        fixed *= s if s != -1 else 1
    if -1 in sizes:
        if device_count % fixed:
            raise ConfigError(f"config.mesh: {device_count} devices are not divisible by the fixed axes' "
                              f"product {fixed}")
        sizes[sizes.index(-1)] = device_count // fixed
    product = sizes[0] * sizes[1] * sizes[2]
    if product != device_count:
        raise ConfigError(f"config.mesh: data*fsdp*tensor = {product} but {device_count} devices are available")
    return tuple(sizes)


def build_mesh(config) -> Mesh:
    return make_mesh(*check_mesh(config, jax.device_count()))


def data_parallel(mesh: Mesh | None) -> int:
    """Ways the batch is split: the data-parallel axes of the "batch" rule (data x fsdp)."""
    return 1 if mesh is None else int(mesh.shape["data"] * mesh.shape["fsdp"])


def previous_stage(config) -> tuple[str, str]:
    """(model.hf_path, tokenizer files) the run `train.init_from` started from, from its stored
    config ("" where it stored none): a stage continuing another has that model shape and tokenizer."""
    if not config.train.init_from:
        return "", ""
    try:
        stored = stored_config(config.train.init_from) or {}
    except CheckpointError:
        return "", ""
    model, tokenizer = stored.get("model") or {}, stored.get("tokenizer") or {}
    hf_path = model.get("hf_path") or ""
    return hf_path, tokenizer.get("path") or hf_path


def continue_previous_stage(config) -> None:
    """An RL stage that continues another (`train.init_from`) without its own `model.hf_path` starts
    from the model the previous stage started from (its shape; the weights then come from the
    checkpoint) with its tokenizer, so stages 2 and 3 need only `train.init_from`. Sets the fields
    in place."""
    if config.mode == "rl" and config.train.init_from and not config.model.hf_path:
        hf_path, tokenizer_files = previous_stage(config)
        config.model.hf_path = hf_path
        config.tokenizer.path = config.tokenizer.path or tokenizer_files


def build_policy(config, source: PolicySource | None = None) -> tuple[Qwen3, Mesh]:
    """The policy on the config's mesh: an orbax checkpoint (`source`), else `model.hf_path`, else a
    sharded random init. A checkpoint's model shape comes from the config it stores."""
    mesh = build_mesh(config)
    rules = mesh_rules(config)
    if source is not None and source.kind == "servers":
        raise ConfigError(f"config.{source.field}: the policy lives on the servers; there is nothing to load here")
    if source is not None and source.kind == "checkpoint":
        stored = stored_config(source.path, source.step) or {}
        stored_hf = (stored.get("model") or {}).get("hf_path") or ""
        if stored_hf and pathlib.Path(stored_hf, "config.json").is_file():  # the shape that run loaded
            model = load_pretrained(stored_hf, mesh=mesh, rules=rules, dtype=config.model.dtype,
                                    param_dtype=config.model.param_dtype)
        else:
            model = create_sharded_model(resolve.model_config(config, stored), mesh, rules, seed=config.seed)
        with Checkpointer(source.path, async_save=False) as ckpt:
            try:
                ckpt.restore(source.step, model=model)
            except CheckpointError as e:
                raise ConfigError(f"config.{source.field}: {e}") from None
        return model, mesh
    hf_path = source.path if source is not None else config.model.hf_path
    if hf_path:
        return load_pretrained(hf_path, mesh=mesh, rules=rules, dtype=config.model.dtype,
                               param_dtype=config.model.param_dtype), mesh
    return create_sharded_model(resolve.model_config(config), mesh, rules, seed=config.seed), mesh


def serving_policy(model: str, *, tp_size: int = 1, seed: int = 0):
    """`python -m rstar_jax.serve`'s policy: an HF directory, or a preset with random weights, on a
    mesh of `tp_size` devices along "tensor". Returns (model, mesh, eos token ids, load_weights)."""
    devices = jax.devices()
    if not 1 <= tp_size <= len(devices):
        raise ConfigError(f"--tp-size {tp_size}: this host has {len(devices)} device(s)")
    mesh = make_mesh(data=1, fsdp=1, tensor=tp_size, devices=devices[:tp_size])
    eos: tuple[int, ...] = ()
    if os.path.isdir(model):
        qwen = load_pretrained(model, mesh=mesh)
        generation_config = pathlib.Path(model) / "generation_config.json"
        if generation_config.exists():
            value = json.loads(generation_config.read_text()).get("eos_token_id")
            eos = tuple(value) if isinstance(value, list) else (() if value is None else (int(value),))
    else:
        try:
            qwen = create_sharded_model(Qwen3Config.preset(model), mesh, seed=seed)
        except ValueError as e:
            raise ConfigError(f"--model {model!r} is neither a checkpoint directory nor a preset: {e}") from None
    return qwen, mesh, eos, lambda path: load_pretrained(path, mesh=mesh)


def engine_for(model: Qwen3, mesh: Mesh | None, *, slots: int, max_length: int, max_total_tokens: int | None = None,
               page_size: int = 16, seed: int = 0, chunked_prefill_size: int | None = None,
               layer_layout: str = DEFAULT_LAYER_LAYOUT, decode_attention: str = DEFAULT_DECODE_ATTENTION) -> JaxEngine:
    """The one JaxEngine construction: on the policy's mesh, prefill compiled per prompt bucket.
    chunked_prefill_size: None, 0 or -1 (SGLang's "off") for no chunking. layer_layout: how the
    engine holds the layer weights; decode_attention: how decode steps attend over the KV pool
    (both `rstar_jax.engine.settings`)."""
    if max_total_tokens is not None:
        max_total_tokens = max(max_total_tokens, max_length)  # one request always fits
    buckets = tuple(b for b in PREFILL_BUCKETS if b < max_length)
    return JaxEngine(model, slots=slots, max_length=max_length, max_total_tokens=max_total_tokens,
                     page_size=page_size, prefill_buckets=buckets, seed=seed, mesh=mesh,
                     chunked_prefill_size=max(chunked_prefill_size or 0, 0) or None, layer_layout=layer_layout,
                     decode_attention=decode_attention)


def engine_policy(config, model: Qwen3, mesh: Mesh) -> tuple[Qwen3, Mesh]:
    """The policy the in-process engine samples from: the trained one on its mesh, or under several
    processes a host-local replica on this host's devices (each process generates its own share of
    the trajectories, at its own pace, which one program over the global mesh cannot)."""
    if jax.process_count() == 1:
        return model, mesh
    devices = multihost.engine_devices(dict(mesh.shape))
    local_mesh = make_mesh(data=1, fsdp=1, tensor=len(devices), devices=devices)
    graphdef, _ = nnx.split(model)
    return shard_model(nnx.merge(graphdef, multihost.host_state(model)), local_mesh, mesh_rules(config)), local_mesh


def make_engine(config, model: Qwen3, mesh: Mesh | None, *, max_length: int | None = None) -> JaxEngine:
    """`config.rollout.engine`'s engine (context `max_length` when given, e.g. an evaluation's budget).
    Its KV pool: `max_total_tokens`, else `mem_fraction_static` of device memory (SGLang's sizing,
    beside what is in use now: the weights and, in RL, the optimizer state, and what the engine's
    `layer_layout` will hold), else slots x max_length."""
    e = config.rollout.engine
    if mesh is not None:
        model, mesh = engine_policy(config, model, mesh)
    max_length = max_length or e.max_length
    try:  # before any pool sizing: shapes the Pallas kernel cannot serve are the config's to change
        check_decode_attention(e.decode_attention, model.config, e.page_size, model.config.dtype, mesh)
    except ValueError as err:
        raise ConfigError(f"config.rollout.engine.decode_attention: {err}") from None
    pool = e.max_total_tokens or None
    if pool is None and e.mem_fraction_static > 0:
        pool = kv_pool_tokens(model, mesh, mem_fraction=e.mem_fraction_static, context_length=max_length,
                              fallback=e.slots * max_length, names=CONFIG_NAMES,
                              report=lambda line: print(f"[engine] {line}", flush=True),
                              reserved_bytes=extra_bytes_per_device(model, e.layer_layout))
    return engine_for(model, mesh, slots=e.slots, max_length=max_length, max_total_tokens=pool,
                      page_size=e.page_size, seed=config.seed, chunked_prefill_size=e.chunked_prefill_size,
                      layer_layout=e.layer_layout, decode_attention=e.decode_attention)


# -- protocol and data -----------------------------------------------------------------------------

def tokenizer(config) -> Tokenizer:
    """`tokenizer.path`, else `model.hf_path`'s files, else those of the run `train.init_from` continues.
    Generation stops on the model's EOS set: its `generation_config.json` where the model has one."""
    return load_tokenizer(*tokenizer_source(config))


def tokenizer_source(config) -> tuple[str, str | None, str | None]:
    """`load_tokenizer`'s arguments for `tokenizer` (what a rollout worker process loads it from)."""
    previous_model, previous_tokenizer = ("", "") if config.model.hf_path else previous_stage(config)
    path = config.tokenizer.path or config.model.hf_path or previous_tokenizer
    if config.tokenizer.kind == "hf" and not path:  # validation saw train.init_from exist, not what it holds
        raise ConfigError(f"config.tokenizer.path: {missing_tokenizer(config.train.init_from)}")
    model_dir = config.model.hf_path or previous_model
    generation = pathlib.Path(model_dir) / "generation_config.json" if model_dir else None
    return (config.tokenizer.kind, str(path) if path else None,
            str(generation) if generation is not None and generation.is_file() else None)


def template(config) -> ChatTemplate:
    return ChatTemplate.from_style(config.rollout.template, config.rollout.tool_name, tools=config.rollout.tools)


def _synthetic(config) -> tuple[pathlib.Path, dict]:
    s = config.data.synthetic
    return pathlib.Path(config.run_dir) / "data", dict(num_eval=s.num_eval, seed=s.seed, kinds=tuple(s.kinds),
                                                        difficulty=s.difficulty)


def prepare_data(config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(RL problem files, SFT conversation files, trained in order): generated into `<run_dir>/data`
    for a synthetic config (tool results as the run's tool environment reports them and the rollout
    loop renders them; conversations only where the run trains on them), else the configured files."""
    if not config.data.synthetic.enabled:
        return tuple(config.data.train_files), tuple(config.sft.train_files)
    r, syn, env = config.rollout, config.data.synthetic, resolve.tool_env(config)

    def observation(result) -> str:  # the sandbox's stream cut, then the rollout loop's rendering
        if env.stream_cap_chars:
            result = dataclasses.replace(result, stdout=result.stdout[:env.stream_cap_chars],
                                         stderr=result.stderr[:env.stream_cap_chars])
        return format_observation(result, style=env.observation_style, max_chars=env.observation_max_chars)

    out, kw = _synthetic(config)
    # An RL stage without a warm-up reads no conversations: generating and solving them costs seconds.
    sft_runs = config.mode == "sft" or (config.mode == "rl" and config.sft.before_rl)
    files = prepare_synthetic_data(out, num_train=syn.num_train,
                                   sft_stages=tuple((n, tuple(mix)) for n, mix in syn.sft_stages) if sft_runs else (),
                                   tool_name=r.tool_name, format_observation=observation,
                                   error_format=env.error_format, fix_bug=syn.fix_bug, **kw)
    return (str(files.train),), tuple(map(str, files.sft))


def held_out_files(config, *, files: Sequence[str] = (), field: str = "data.eval_files") -> tuple[str, ...]:
    """Evaluation problems: `files` when given, else the synthetic held-out set (written into the run
    directory; the same draw as the training run's)."""
    if files:
        return tuple(files)
    if not config.data.synthetic.enabled:
        raise ConfigError(f"config.{field}: evaluation needs at least one file")
    out, kw = _synthetic(config)
    return (str(write_held_out(out, **kw)),)


def questions(config, files: Sequence[str], *, field: str) -> tuple[list[Question], LoadReport]:
    d = config.data
    return load_questions(files, fmt=d.format, question_key=d.question_key, answer_key=d.answer_key,
                          on_bad_row=d.on_bad_row, field=field)


def prompt_length(tokenizer: Tokenizer, template: ChatTemplate):
    """question -> len(template.prompt_ids(tokenizer, question)), encoding only the user turn: the
    prompt is encoded in pieces split at special tokens (system, user, generation prompt), and the
    system block (~500 tokens with the release's tools) is the same for every question."""
    fixed = len(template.prompt_ids(tokenizer, "")) - len(tokenizer.encode(template.user_text("")))
    return lambda question: fixed + len(tokenizer.encode(template.user_text(question)))


def prompt_iterator(config, files: Sequence[str], tokenizer: Tokenizer, *,
                    seed: int | None = None) -> tuple[PromptIterator, LoadReport]:
    """The RL prompt stream of `config.data` over `files`, shuffled with `seed` (default
    `data.shuffle_seed`). Prompts longer than `rollout.max_prompt_length` tokens are dropped and
    counted (`data.filter_overlong_prompts`, as the release) or refused naming their row: one would
    otherwise shrink its trajectories' response budget or overflow the engine."""
    d = config.data
    examples, report = load_examples(tuple(files), fmt=d.format, question_key=d.question_key,
                                     answer_key=d.answer_key, on_bad_row=d.on_bad_row)
    examples = filter_overlong_prompts(examples, prompt_length(tokenizer, template(config)),
                                       config.rollout.max_prompt_length, report, skip=d.filter_overlong_prompts)
    if report.skipped.get("overlong_prompt"):
        print(f"[data] dropped {report.skipped['overlong_prompt']} of {report.rows_read} prompts longer than "
              f"rollout.max_prompt_length={config.rollout.max_prompt_length} tokens (data.filter_overlong_prompts)",
              flush=True)
    return PromptIterator(examples, d.num_prompts_per_step, seed=d.shuffle_seed if seed is None else seed), report


def sft_templates(config, files: Sequence[str]) -> tuple[str, ...]:
    """The conversation template of each SFT file: `sft.templates` has one per file, or one for all."""
    templates = tuple(config.sft.templates)
    return templates * len(files) if len(templates) == 1 else templates


def sft_batches(config, tokenizer: Tokenizer, template: ChatTemplate, files: Sequence[str],
                mesh: Mesh | None) -> SftBatches:
    """The conversations of each file (an SFT stage), trained file after file, each rendered with its
    `sft.templates` entry. Conversations longer than `sft.max_length` are skipped and counted.
    `sft.micro_batch_tokens` per data-parallel shard: each micro-batch holds that many tokens on
    every shard."""
    c = config.sft
    stages = []
    for path, style in zip(files, sft_templates(config, files), strict=True):
        conversations, report = read_conversations(path, fmt=config.data.format, on_bad_row=config.data.on_bad_row)
        skips = SftSkips()
        try:
            stage = sft_sequences(template, tokenizer, conversations, c.max_length, style, skips)
        except ConversationError as e:
            raise DataError(f"{e} (sft.templates renders this file with {style!r})") from None
        dropped = {**report.skipped, **({"overlong": skips.overlong} if skips.overlong else {}),
                   **({"no_assistant_tokens": skips.untrained} if skips.untrained else {})}
        if dropped:
            print(f"[sft] {path}: skipped {sum(dropped.values())} of {report.rows_read} conversations {dropped}, "
                  f"e.g. {(report.examples_of_skipped + skips.examples)[:2]}", flush=True)
        if not stage:
            raise DataError(f"{path}: no conversation left to train on ({dropped}; sft.max_length={c.max_length})")
        stages.append(stage)
    # sft.advance_exact measures each stage that can end early on its last sft.advance_probe
    # conversations, which it then does not train on.
    held_out: list[list] = [[] for _ in stages]
    if c.advance_exact:
        for i, (path, stage) in enumerate(zip(files[:-1], stages[:-1])):
            if len(stage) <= c.advance_probe:
                raise ConfigError(f"config.sft.advance_probe: holds out {c.advance_probe} conversations of {path} to "
                                  f"measure sft.advance_exact on, but it has only {len(stage)} to train on")
            stages[i], held_out[i] = stage[:-c.advance_probe], stage[-c.advance_probe:]
    sequences = [sequence for stage in stages for sequence in stage]
    row_length = row_length_for(c.max_length, 1)
    per_shard = max(1, c.micro_batch_tokens // row_length)  # one row of sft.max_length at least
    return SftBatches(sequences, conversations_per_step=min(c.batch_size, min(map(len, stages))),
                      rows=data_parallel(mesh) * per_shard, row_length=row_length, seed=config.seed,
                      stage_sizes=tuple(len(stage) for stage in stages), held_out=tuple(map(tuple, held_out)))


def metrics_writer(config) -> MetricsWriter:
    """The run's metrics; under several processes only the writer process writes files (every
    process computes the same aggregated figures)."""
    writer = multihost.is_writer()
    return MetricsWriter(config.run_dir, tensorboard=config.metrics.tensorboard and writer,
                         jsonl=config.metrics.jsonl and writer)




def export_hf(config, model: Qwen3, tokenizer: Tokenizer, path: str | os.PathLike, optimizer=None) -> pathlib.Path:
    """A run's HF export: `checkpoint.export_dtype`, the tokenizer files of an `hf` tokenizer (from
    `tokenizer.path`, else `model.hf_path`) and a generation config stopping on the tokenizer's `stop_ids`, so
    the next stage, `evaluate`, transformers and SGLang can all start from the directory. With an
    `optimizer` that keeps master weights (`optim.master_weights`) the tensors are the master's, cast
    to the export dtype (an fp32 export carries their full precision); `export_dtype = ""` is then the
    master's dtype, the precision the run trains in, so a stage that starts from the export continues
    from the master rather than from its bf16 rounding."""
    master = master_dtype_of(optimizer)
    dtype = config.checkpoint.export_dtype or (jax.numpy.dtype(master).name if master is not None else None)
    model = with_master_weights(model, optimizer)
    source = config.tokenizer.path or config.model.hf_path
    tokenizer_dir = None
    if config.tokenizer.kind == "hf" and source:
        tokenizer_dir = pathlib.Path(source) if pathlib.Path(source).is_dir() else pathlib.Path(source).parent
    return save_pretrained(model, path, dtype=dtype, tokenizer_dir=tokenizer_dir,
                           stop_token_ids=tokenizer.stop_ids)


def checkpointer(config, model: Qwen3, tokenizer: Tokenizer) -> Checkpointer:
    """`<run_dir>/checkpoints`; HF exports (the live model, `export_hf`) to `<run_dir>/hf/step_N`."""
    run_dir, c = pathlib.Path(config.run_dir), config.checkpoint
    return Checkpointer(run_dir / "checkpoints", max_to_keep=c.max_to_keep, async_save=c.async_save,
                        save_every=c.every_steps, export_hf=lambda _, path, optimizer: export_hf(config, model, tokenizer, path, optimizer),
                        export_every=c.export_hf_every, export_dir=run_dir / "hf")


def warm_up_checkpointer(config) -> Checkpointer:
    """`<run_dir>/checkpoints_sft_warmup`: RL's SFT warm-up, saved every `checkpoint.every_steps`
    steps so that a run killed in it resumes there. Apart from `checkpoints/`, whose steps are RL's
    (a later stage's `train.init_from` reads those); the latest save only, no HF exports."""
    c = config.checkpoint
    return Checkpointer(pathlib.Path(config.run_dir) / "checkpoints_sft_warmup", max_to_keep=1,
                        async_save=c.async_save, save_every=c.every_steps)


# -- sandbox, generators and the rollout loop's resources -------------------------------------------

@contextlib.contextmanager
def sandbox(config) -> Iterator[list[str]]:
    """The sandbox targets for the run: a local server started here and stopped on exit
    (`sandbox.launch_local`; its default limits are the tool environment's, which every call also
    sends; with sandbox.api="sandbox_fusion" its SandboxFusion HTTP endpoint's URL), else
    `sandbox.targets`."""
    s = config.sandbox
    if not s.launch_local:
        yield list(s.targets)
        return
    env = resolve.tool_env(config)
    fusion = s.api == "sandbox_fusion"
    noise = {"inject_timeout_rate": s.inject_timeout_rate, "inject_seed": config.seed} if s.inject_timeout_rate else {}
    with LocalSandbox(workers=s.workers, memory_mb=env.memory_mb, timeout_s=env.timeout_s,
                      verify_timeout_s=s.verify_timeout_s, http_port=0 if fusion else None,
                      preimport=tuple(s.preimport_modules), **noise) as local:
        yield [local.http_url if fusion else local.target]


def local_server_flags(engine) -> list[str]:
    """`rstar_jax.serve` flags for `rollout.engine`'s settings beyond LocalServer's own arguments,
    where they differ from the command's defaults."""
    flags = []
    if engine.chunked_prefill_size > 0:
        flags += ["--chunked-prefill-size", str(engine.chunked_prefill_size)]
    if engine.mem_fraction_static > 0:
        flags += ["--mem-fraction-static", str(engine.mem_fraction_static)]
    if engine.layer_layout != DEFAULT_LAYER_LAYOUT:  # ours, not SGLang's
        flags += ["--layer-layout", engine.layer_layout]
    if engine.decode_attention != DEFAULT_DECODE_ATTENTION:  # ours too
        flags += ["--decode-attention", engine.decode_attention]
    return flags


@contextlib.contextmanager
def local_servers(config, model: Qwen3) -> Iterator[list[str]]:
    """`rollout.local_servers` `python -m rstar_jax.serve` processes started from `model` (exported to
    `weight_sync_directory`, as `weight_sync` exports), stopped on exit; else the configured
    `rollout.servers`."""
    r = config.rollout
    if not r.local_servers:
        yield list(r.servers)
        return
    if jax.process_count() > 1:
        raise ConfigError("config.rollout.local_servers: servers started by each trainer process are reachable only "
                          "from its host; under several processes start SGLang servers and list them in "
                          "rollout.servers (or use rollout.backend='jax')")
    w = config.weight_sync
    initial = save_pretrained(model, weight_sync_directory(config), dtype=w.dtype or None,
                              max_shard_bytes=w.max_shard_bytes, writer_threads=w.writer_threads)  # as DiskSync
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(LocalServer(
            str(initial), slots=r.engine.slots, max_length=r.engine.max_length,
            max_total_tokens=r.engine.max_total_tokens or None, page_size=r.engine.page_size, seed=config.seed,
            extra_args=tuple(local_server_flags(r.engine)))).url
            for _ in range(r.local_servers)]


class ToolService(ToolExecutor, Protocol):
    """The sandbox servers a run opens: a SandboxClient (sandbox.api="grpc"; it also has `verify` and
    `info`) or a SandboxFusionExecutor ("sandbox_fusion")."""

    targets: list[str]
    ready_probe: str  # what `ready` asks, for messages

    async def ready(self, target: str, modules: Sequence[str]) -> tuple[str, list[str]] | None:
        """None while `target` does not answer; then its report line and its self-test's problems."""
        ...


@dataclasses.dataclass
class RolloutResources:
    """What the rollout loop runs against; `rollout_resources` opens and closes it."""

    client: ToolService  # executes tool calls
    scorer: Scorer
    engine: JaxEngine | None = None  # the in-process generator, or
    generators: list[SGLangGenerator] = dataclasses.field(default_factory=list)  # servers, placed by
    scheduler: Scheduler | None = None  # the KV-aware (or round-robin) scheduler
    closers: list = dataclasses.field(default_factory=list)  # async callables run first on exit (weight sync)
    # `rollout.workers` > 1: the processes that run the rollouts (on their own clients of the same
    # servers and sandboxes); `generators` and `scheduler` here then serve weight sync and readiness.
    workers: RolloutWorkers | None = None
    # Per sandbox server, once ready: the isolation in force and what tool code imports (its self-test).
    sandbox_reports: list[str] = dataclasses.field(default_factory=list)


@contextlib.asynccontextmanager
async def rollout_resources(config, targets: Sequence[str], *, engine: JaxEngine | None = None,
                            urls: Sequence[str] = (), vocab_size: int | None = None,
                            workers: int = 1) -> AsyncIterator[RolloutResources]:
    """The tool executor for `targets` (`sandbox.api`: a gRPC SandboxClient or a SandboxFusion
    executor; the tool environment travels with each call, `LoopConfig.tool_env`), the scorer
    (`sandbox.verify_via`, one timeout `sandbox.verify_timeout_s`) and the generators: `engine`, or
    SGLang clients for `urls` behind `rollout.scheduler`. Everything belongs to the running event
    loop and is closed on exit. `vocab_size`: the policy's, which the servers' input ids are checked
    against (unknown: the clients read it from the served model's config.json where they can).
    `workers` > 1 (RL's `rollout.workers`; servers only): that many rollout worker processes on this
    process's share of the servers, started once everything is ready (`resources.workers`)."""
    s = config.sandbox
    client = tool_client(config, targets)
    scorer = make_scorer(s.verify_via, timeout_s=s.verify_timeout_s, sandbox_client=client)
    resources = RolloutResources(client=client, scorer=scorer, engine=engine)
    try:
        if engine is None:
            if not urls:
                raise ConfigError("config.rollout.servers: no generator: the sglang backend needs server URLs "
                                  "(or rollout.local_servers > 0)")
            resources.generators = [SGLangGenerator(url, generate_timeout_s=config.rollout.generate_timeout_s or None,
                                                    vocab_size=vocab_size) for url in urls]
            share = generation_share(resources.generators)
            if config.rollout.scheduler == "kv":
                k = config.rollout.kv_scheduler
                resources.scheduler = KvScheduler(share, budget_fraction=k.budget_fraction, reservation=k.reservation,
                                                  new_token_ratio=k.new_token_ratio, group_block=k.group_block,
                                                  reconcile_interval=k.reconcile_interval_s or None)
            else:
                resources.scheduler = RoundRobinScheduler(share)
        # The writer loads weights on every server; the others generate on their share only.
        await wait_until_ready(resources, config.rollout.ready_timeout_s,
                               generators=None if multihost.is_writer() else generation_share(resources.generators),
                               modules=tool_modules(config))
        if workers > 1:
            if engine is not None:
                raise ConfigError(f"config.rollout.workers: {workers} worker processes need rollout.backend='sglang': "
                                  f"the in-process JaxEngine cannot be reached from them")
            spec = worker_spec(config, targets, [g.base_url for g in generation_share(resources.generators)],
                               vocab_size=vocab_size)
            resources.workers = await RolloutWorkers(spec, workers).start()
            print(f"[rl] rollout: {workers} worker processes (pids {' '.join(map(str, resources.workers.pids))})",
                  flush=True)
        yield resources
    finally:
        if resources.workers is not None:
            await resources.workers.close()
        for close in resources.closers:
            await close()
        scorer.close()
        await client.close()
        for generator in resources.generators:
            await generator.close()


def worker_spec(config, targets: Sequence[str], urls: Sequence[str], *, vocab_size: int | None = None) -> WorkerSpec:
    """What `rollout.workers` worker processes build their rollout from: RL's loop and template, the
    tokenizer's files, `urls` (this process's servers) and the sandbox `targets`, each shared out
    among the workers (rstar_jax.rollout.workers)."""
    r, s, k = config.rollout, config.sandbox, config.rollout.kv_scheduler
    return WorkerSpec(
        urls=tuple(urls), sandbox_targets=tuple(targets), loop=resolve.loop_config(config), template=template(config),
        tokenizer=tokenizer_source(config), sandbox_api=s.api, verify_via=s.verify_via,
        verify_timeout_s=s.verify_timeout_s, scheduler=r.scheduler,
        kv_scheduler=dict(budget_fraction=k.budget_fraction, reservation=k.reservation,
                          new_token_ratio=k.new_token_ratio, group_block=k.group_block,
                          reconcile_interval=k.reconcile_interval_s or None),
        generator=dict(generate_timeout_s=r.generate_timeout_s or None, vocab_size=vocab_size),
        max_concurrency=r.max_concurrency)


def tool_client(config, targets: Sequence[str]) -> ToolService:
    """The tool executor for `targets` (`sandbox.api`: a gRPC SandboxClient or a SandboxFusion
    executor). The tool environment's options travel with each call (`LoopConfig.tool_env`)."""
    if config.sandbox.api == "sandbox_fusion":  # validate() has refused what it cannot honour
        return SandboxFusionExecutor(list(targets))
    return SandboxClient(list(targets))


def tool_modules(config) -> tuple[str, ...]:
    """What tool code must be able to import: numpy, sympy, mpmath and `sandbox.preimport_modules`."""
    return (*selftest.STANDARD_MODULES, *config.sandbox.preimport_modules)


def check_sandboxes(config, targets: Sequence[str]) -> list[str]:
    """Before any work: waits (`rollout.ready_timeout_s`) for the sandboxes and refuses, with a
    UserError, one whose tool code cannot import `tool_modules` (`wait_until_ready`). Returns a line
    per sandbox: its isolation and what tool code imports."""
    async def check() -> list[str]:
        client = tool_client(config, targets)
        try:
            resources = RolloutResources(client=client, scorer=None)
            await wait_until_ready(resources, config.rollout.ready_timeout_s, generators=[],
                                   modules=tool_modules(config))
            return resources.sandbox_reports
        finally:
            await client.close()

    return asyncio.run(check())


def generation_share(generators: Sequence) -> list:
    """The servers this process generates on: under P processes, every P-th from its index when
    there are at least P servers (each server has one client process), else all of them (their
    schedulers balance on the load the servers report)."""
    count = jax.process_count()
    if count == 1 or len(generators) < count:
        return list(generators)
    return list(generators)[jax.process_index()::count]


async def wait_until_ready(resources: RolloutResources, timeout_s: float, interval_s: float = 1.0, *,
                           generators: Sequence | None = None, modules: Sequence[str] = selftest.STANDARD_MODULES) -> None:
    """Waits until every generator server (`generators`, default all of `resources`') completes a
    generation (`/health_generate`) and every sandbox server answers `Info` (SandboxFusion: `/v1/ping`):
    a 14B server may load for minutes, and the first weight sync and step must not fail on it. A
    ConfigError names the endpoints still not ready after `timeout_s`.

    A sandbox that answers must also import `modules` in tool code: its start-up self-test (Info;
    on SandboxFusion, the same probe run as a call). One that cannot is refused at once with a
    UserError naming the module and where it is installed: otherwise every call importing it would
    fail, and read to the policy like its own mistake. `resources.sandbox_reports` gets a line per
    sandbox: its isolation and what tool code imports."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    reports: dict[str, str] = {}

    async def sandbox_ready(target: str) -> bool:
        answer = await resources.client.ready(target, modules)
        if answer is None:
            return False
        reports[target], problems = answer
        if problems:
            raise UserError("\n".join([f"the sandbox at {target} failed its start-up self-test:", *problems]))
        return True

    generators = resources.generators if generators is None else generators
    waiting = {**{g.base_url: g.health for g in generators},
               **{t: functools.partial(sandbox_ready, t) for t in resources.client.targets}}
    while True:
        ready = await asyncio.gather(*(probe() for probe in waiting.values()))
        waiting = {name: probe for (name, probe), ok in zip(waiting.items(), ready) if not ok}
        if not waiting:
            resources.sandbox_reports = [reports[t] for t in resources.client.targets if t in reports]
            return
        if loop.time() >= deadline:
            raise ConfigError(f"config.rollout.ready_timeout_s: not ready after {timeout_s:g} s: {', '.join(waiting)} "
                              f"(generators must answer /health_generate, sandboxes {resources.client.ready_probe})")
        await asyncio.sleep(min(interval_s, max(0.0, deadline - loop.time())))


def weight_sync_directory(config) -> pathlib.Path:
    """`weight_sync.directory`, else `<run_dir>/weights_sync`: where server weights are exported."""
    return pathlib.Path(config.weight_sync.directory or pathlib.Path(config.run_dir) / "weights_sync")


def weight_sync(config, resources: RolloutResources) -> WeightSync:
    """In-place swap for the in-process engine; for servers `weight_sync.method`'s: an HF export and
    `/update_weights_from_disk`, or SGLang's distributed update (its group is destroyed when
    `resources` close)."""
    if resources.engine is not None:
        return EngineSync(resources.engine, in_place=config.rl.max_staleness >= 1)
    w = config.weight_sync
    dtype = w.dtype or config.model.param_dtype
    if w.method == "distributed":
        sync = DistributedSync(resources.generators, master_address=w.master_address, master_port=w.master_port,
                               backend=w.backend, group_name=w.group_name, bucket_bytes=w.bucket_bytes,
                               dtype=dtype, mode=w.mode, ready_timeout_s=config.rollout.ready_timeout_s,
                               rotation=resources.scheduler)
        resources.closers.append(sync.close)
        how = f"torch.distributed {sync.backend} broadcast"
    else:
        sync = DiskSync(resources.generators, weight_sync_directory(config), mode=w.mode, dtype=dtype,
                        max_shard_bytes=w.max_shard_bytes, writer_threads=w.writer_threads,
                        ready_timeout_s=config.rollout.ready_timeout_s, rotation=resources.scheduler)
        how = f"HF export to {sync.directory}"
    if multihost.is_writer():
        print(f"[rl] weight sync: {how} ({dtype}, mode {w.mode}) to {len(resources.generators)} server(s)", flush=True)
    return sync
