"""The launcher's `sft` and `rl` modes: build every piece from the config and run the stage.

    run_stage(config)   # config validated by rstar_jax.config.validate

RL: tokenizer -> policy (HF checkpoint or sharded init) -> optional SFT warm-up -> optimizer ->
checkpoint restore (exact resume: parameters, optimizer, data position) -> in-process JaxEngine ->
sandbox (a local server started and stopped here, or remote targets) -> steps of
`RLTrainer` -> metrics (JSONL, TensorBoard, progress bar) -> checkpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time

import jax
import numpy as np

from rstar_jax.agent.reward import make_scorer
from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import load_tokenizer
from rstar_jax.agent.tool_calls import format_observation
from rstar_jax.config import check_mesh, model_config
from rstar_jax.data.datasets import prompt_iterator_from_config, read_conversations
from rstar_jax.data.synthetic import prepare_synthetic_data
from rstar_jax.model.hf import load_pretrained, save_pretrained
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.rl.loss import LossConfig
from rstar_jax.rl.roc import RocConfig
from rstar_jax.rollout.engine import JaxEngine
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.rollout.scheduler import KvScheduler, RoundRobinScheduler
from rstar_jax.rollout.sglang import SGLangGenerator, sync_weights_via_disk
from rstar_jax.rollout.records import rollout_path, trajectory_record, write_records
from rstar_jax.train.checkpoint import Checkpointer
from rstar_jax.train.metrics import MetricsWriter, ProgressBar, rl_step_stats
from rstar_jax.train.rl_batch import BatchConfig, row_length_for
from rstar_jax.train.sft import SftBatches, as_device_batch, sft_sequences, sft_step
from rstar_jax.train.step import OptimizerConfig, lr_schedule, make_optimizer
from rstar_jax.train.trainer import RLSettings, RLTrainer


def _rules(config):
    return tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes) for name, axes in config.mesh.rules)


def build_policy(config):
    data, fsdp, tensor = check_mesh(config, jax.device_count())
    mesh = make_mesh(data, fsdp, tensor)
    if config.model.hf_path:
        model = load_pretrained(config.model.hf_path, mesh=mesh, rules=_rules(config), dtype=config.model.dtype,
                                param_dtype=config.model.param_dtype)
    else:
        model = create_sharded_model(model_config(config), mesh, _rules(config), seed=config.seed)
    return model, mesh


def _observation_formatter(config):
    class _Ok:  # the reference solution's real output, rendered as a successful call would be
        def __init__(self, stdout):
            self.status, self.stdout, self.stderr, self.duration_s = "ok", stdout, "", 0.0

    return lambda stdout: format_observation(_Ok(stdout), style=config.rollout.observation_style,
                                             max_chars=config.rollout.observation_max_chars)


def run_sft(config, model, tokenizer, template, conversations_file, metrics: MetricsWriter,
            checkpointer: Checkpointer | None = None) -> dict:
    """The SFT stage (or the RL run's warm-up): assistant-token NLL, packed, cosine schedule.

    With a checkpointer (the `sft` mode) it saves every `checkpoint.every_steps` steps and at the
    end, and resumes from the latest save: the batch order is a function of (seed, epoch), so the
    resumed run skips exactly the steps already taken.
    """
    c = config.sft
    conversations = read_conversations(conversations_file)
    sequences = sft_sequences(template, tokenizer, conversations, c.max_length)
    row_length = row_length_for(c.max_length, 1)
    rows = max(1, c.micro_batch_tokens // row_length)
    batches = SftBatches(sequences, conversations_per_step=min(c.batch_size, len(sequences)), rows=rows,
                         row_length=row_length, seed=config.seed)
    total = c.epochs * batches.steps_per_epoch()
    warmup = max(0, int(round(c.warmup_ratio * total)))
    schedule = c.schedule if total > warmup else "constant"
    optimizer = make_optimizer(model, OptimizerConfig(
        lr=c.lr, warmup_steps=warmup, schedule=schedule, total_steps=total, b1=config.optim.b1,
        b2=config.optim.b2, weight_decay=config.optim.weight_decay, grad_clip=config.optim.grad_clip))
    start = 0
    if checkpointer is not None and checkpointer.latest_step() is not None:
        start = checkpointer.restore(model=model, optimizer=optimizer).step
        metrics.discard_after(start, where=lambda record: "sft/loss" in record)
        print(f"[sft] resumed from step {start}", flush=True)
    bar = ProgressBar(total, desc="sft") if config.metrics.progress_bar else None
    step = 0
    last = {}
    for epoch in range(c.epochs):
        for batch in batches.epoch(epoch):
            step += 1
            if step <= start:
                continue
            t0 = time.perf_counter()
            out = jax.device_get(sft_step(model, optimizer, as_device_batch(batch), config.rl.logprob_chunk_size))
            last = {"sft/loss": float(out["loss"]), "sft/tokens": float(out["tokens"]),
                    "sft/grad_norm": float(out["grad_norm"]), "time/sft_step_s": time.perf_counter() - t0}
            metrics.write(step, last)
            if checkpointer is not None:
                checkpointer.save(step, model=model, optimizer=optimizer, data_state={"sft_step": step},
                                  stage=config.stage, config=config.to_dict(), force=step == total)
            if bar:
                bar.update(step, loss=f"{last['sft/loss']:.3f}")
    if bar:
        bar.close()
    return last


def run_stage(config) -> dict:
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(config.tokenizer.kind, config.tokenizer.path or config.model.hf_path or None)
    template = ChatTemplate.from_style(config.rollout.template, config.rollout.tool_name)
    train_files = tuple(config.data.train_files)
    sft_file = config.sft.train_files[0] if config.sft.train_files else None
    if config.data.synthetic.enabled:
        files = prepare_synthetic_data(config, format_observation=_observation_formatter(config))
        train_files, sft_file = (str(files.train),), str(files.sft)
    model, _ = build_policy(config)
    metrics = MetricsWriter.from_config(config)
    checkpointer = Checkpointer.from_config(config, export_hf=lambda _, path: save_pretrained(model, path))
    summary: dict = {}
    try:
        # A resumed RL run restores the policy from its checkpoint: the warm-up already happened.
        warm_up = config.mode == "rl" and config.sft.before_rl and checkpointer.latest_step() is None
        if config.mode == "sft" or warm_up:
            if sft_file is None:
                raise ValueError("config.sft.train_files: the SFT stage needs a conversations file")
            summary.update(run_sft(config, model, tokenizer, template, sft_file, metrics,
                                   checkpointer if config.mode == "sft" else None))
            if warm_up and config.checkpoint.export_hf_final:
                save_pretrained(model, run_dir / "hf" / "sft_warmup")  # the policy RL starts from
        if config.mode == "rl":
            summary.update(run_rl(config, model, tokenizer, template, train_files, metrics, checkpointer))
        if config.checkpoint.export_hf_final:
            # The next stage starts from here: `--config.model.hf_path=<run_dir>/hf/final`.
            save_pretrained(model, run_dir / "hf" / "final")
    finally:
        checkpointer.wait()
        checkpointer.close()
        metrics.close()
    return summary


def run_rl(config, model, tokenizer, template, train_files, metrics: MetricsWriter,
           checkpointer: Checkpointer) -> dict:
    from sandbox_service.client import SandboxClient
    from sandbox_service.launcher import LocalSandbox

    from rstar_jax.serve import LocalServer

    r, rl = config.rollout, config.rl
    optimizer = make_optimizer(model, OptimizerConfig(
        lr=config.optim.lr, warmup_steps=config.optim.warmup_steps, schedule=config.optim.schedule,
        total_steps=config.train.steps, b1=config.optim.b1, b2=config.optim.b2,
        weight_decay=config.optim.weight_decay, grad_clip=config.optim.grad_clip))
    iterator, report = prompt_iterator_from_config(config, train_files)
    start = 0
    if checkpointer.latest_step() is not None:
        # This stage's own checkpoint: everything continues exactly (optimizer and data position).
        restored = checkpointer.restore(model=model, optimizer=optimizer)
        start = restored.step
        if restored.data_state is not None:
            iterator.set_state(restored.data_state)
        metrics.discard_after(start, where=lambda record: "rollout/reward_mean" in record)
        print(f"[rl] resumed from step {start}", flush=True)
    elif config.train.init_from:
        # The previous stage's latest checkpoint: its policy, and its optimizer state unless the
        # recipe resets it (stage 3). The data stream and step count start afresh.
        source = pathlib.Path(config.train.init_from)
        source = source / "checkpoints" if (source / "checkpoints").is_dir() else source
        with contextlib.closing(Checkpointer(source, async_save=False)) as previous:
            restored = previous.restore(model=model, optimizer=optimizer,
                                        reset_optimizer=config.optim.reset_at_start)
        print(f"[rl] initialised from {source} step {restored.step}"
              + (" (optimizer reset)" if config.optim.reset_at_start else ""), flush=True)
    row_length = row_length_for(r.max_prompt_length, r.response_budget)
    settings = RLSettings(
        rollouts_per_prompt=r.rollouts_per_prompt,
        loop=LoopConfig(max_turns=r.max_turns, response_budget=r.response_budget, temperature=r.temperature,
                        top_p=r.top_p, top_k=r.top_k, tool_name=r.tool_name,
                        max_calls_per_turn=r.max_tool_calls_per_turn, observation_style=r.observation_style,
                        observation_max_chars=r.observation_max_chars, tool_timeout_s=config.sandbox.timeout_s,
                        reward_mode="local" if config.sandbox.verify_via == "local" else "sandbox",
                        seed=config.seed if r.seeded_sampling else None),
        roc=RocConfig(group_size=rl.group_size, variant=rl.roc_variant, epsilon=rl.roc_epsilon,
                      min_per_class=rl.roc_min_per_class, seed=config.seed),
        loss=LossConfig(clip_low=rl.clip_low, clip_high=rl.clip_high, dual_clip=rl.dual_clip,
                        kl_coef=rl.kl_coef, entropy_coef=rl.entropy_coef),
        batch=BatchConfig(rows=max(1, rl.micro_batch_tokens // row_length), row_length=row_length, packed=True,
                          use_sampler_logprobs=rl.use_sampler_logprobs),
        chunk_size=rl.logprob_chunk_size,
        max_concurrency=r.max_concurrency,
    )
    engine = (JaxEngine(model, slots=r.engine.slots, max_length=r.engine.max_length,
                        max_total_tokens=r.engine.max_total_tokens or None, page_size=r.engine.page_size,
                        seed=config.seed)
              if r.backend == "jax" else None)
    opt_config = OptimizerConfig(lr=config.optim.lr, warmup_steps=config.optim.warmup_steps,
                                 schedule=config.optim.schedule, total_steps=config.train.steps)
    sandbox = (LocalSandbox(workers=config.sandbox.workers) if config.sandbox.launch_local
               else contextlib.nullcontext(None))

    async def loop(targets, server_urls) -> dict:
        # One event loop for the whole stage: the sandbox client's channels and the generators'
        # HTTP sessions belong to it.
        last: dict = {}
        client = SandboxClient(targets)
        scorer = make_scorer(settings.loop.reward_mode, timeout_s=10.0, sandbox_client=client)
        generators, scheduler, sync = [], None, None
        if engine is None:
            generators = [SGLangGenerator(url) for url in server_urls]
            scheduler = (KvScheduler(generators) if r.scheduler == "kv" else RoundRobinScheduler(generators))
            sync_dir = pathlib.Path(config.run_dir) / "weights_sync"
            sync = lambda m: sync_weights_via_disk(m, generators, sync_dir,  # noqa: E731
                                                   version=trainer.weights_version, mode="wait")
            # Servers may start from any weights: they sample from the trainer's policy from step one.
            await sync_weights_via_disk(model, generators, sync_dir, version=start, mode="wait")
        trainer = RLTrainer(model, optimizer, tokenizer, settings, executor=client, scorer=scorer, engine=engine,
                            scheduler=scheduler, template=template, sync_weights=sync)
        trainer.weights_version = start
        if engine is not None and start:
            engine.update_weights(model, version=start)  # versions continue across a resume
        bar = ProgressBar(config.train.steps, desc="rl") if config.metrics.progress_bar else None
        try:
            for step in range(start, config.train.steps):
                prompts = [(ex.question, ex.answer) for ex in next(iterator)]
                step_metrics, trajectories = await trainer.astep(prompts, step=step)
                step_metrics.update({f"rollout/{k}": v for k, v in rl_step_stats(trajectories).items()})
                if config.metrics.save_rollouts:
                    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
                    write_records(rollout_path(config.run_dir, step + 1),
                                  (trajectory_record(t, decode, step=step + 1, stage=config.stage)
                                   for t in trajectories))
                step_metrics["lr"] = float(lr_schedule(opt_config)(step))
                if scheduler is not None:
                    step_metrics.update({f"scheduler/admitted_{i}": n
                                         for i, n in enumerate(scheduler.admitted_per_generator())})
                last = metrics.write(step + 1, step_metrics)
                checkpointer.save(step + 1, model=model, optimizer=optimizer, data_state=iterator.get_state(),
                                  stage=config.stage, config=config.to_dict(),
                                  force=step + 1 == config.train.steps)
                if bar:
                    bar.update(step + 1, reward=f"{step_metrics['rollout/reward_mean']:.2f}",
                               skipped=step_metrics.get("update/skipped", 0))
        finally:
            if bar:
                bar.close()
            for closer in (getattr(scorer, "close", None), getattr(client, "close", None),
                           *(g.close for g in generators)):
                if closer is not None:
                    result = closer()
                    if asyncio.iscoroutine(result):
                        await result
        return last

    try:
        with sandbox as local, contextlib.ExitStack() as servers:
            urls = list(r.servers)
            if engine is None and r.local_servers:
                # Single-node SGLang-style topology: our own `rstar_jax.serve` processes, started from
                # the current policy and stopped with the run.
                initial = save_pretrained(model, pathlib.Path(config.run_dir) / "weights_sync")
                urls = [servers.enter_context(LocalServer(
                            str(initial), slots=r.engine.slots, max_length=r.engine.max_length,
                            max_total_tokens=r.engine.max_total_tokens or None, page_size=r.engine.page_size,
                            seed=config.seed)).url
                        for _ in range(r.local_servers)]
                print(f"[rl] generator servers: {' '.join(urls)}", flush=True)
            targets = [local.target] if local is not None else list(config.sandbox.targets)
            return asyncio.run(loop(targets, urls))
    finally:
        if engine is not None:
            engine.close()
