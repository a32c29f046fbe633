"""Embedded default: the whole pipeline on one CPU machine in minutes.

A tiny Qwen3 with the byte tokenizer, synthetic tool-use math problems generated into the run
directory, a short SFT warm-up that teaches the tool-call and answer format, then GRPO-RoC steps
with small groups and budgets against a local sandbox server (started and stopped by the launcher)
and the in-process JaxEngine. The chat template is the compact style: the release's ~2.3K-character
system prompt would be ~2.3K byte tokens of every sequence.
"""

import ml_collections

from rstar_jax.config import sibling_config


def get_config() -> ml_collections.ConfigDict:
    c = sibling_config(__file__, "base")
    c.mode = "rl"
    c.stage = "tiny"
    c.run_dir = "runs/tiny"

    c.model.preset = "tiny"
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "none"
    c.model.attention_impl = "xla"
    c.model.overrides.max_position_embeddings = 1024

    c.tokenizer.kind = "byte"

    c.data.synthetic.enabled = True
    c.data.synthetic.num_train = 512
    c.data.synthetic.num_eval = 16
    c.data.synthetic.difficulty = 1
    # One-line `pow` programs a 2-layer byte model learns to write in a short warm-up; last-digit
    # problems have one-digit answers, so even the weak warmed-up policy solves some and its groups
    # are mixed: RoC keeps them and RL has a signal from the first step.
    c.data.synthetic.kinds = ("last_digit_power", "modular_power")
    c.data.num_prompts_per_step = 4

    c.rollout.template = "compact"
    c.rollout.rollouts_per_prompt = 8
    c.rollout.max_turns = 2
    c.rollout.response_budget = 448
    c.rollout.max_prompt_length = 384
    # The paper's bare-stdout observations: short, and free of timings, so the run is reproducible
    # token for token (and resumes exactly).
    c.rollout.observation_style = "paper"
    c.rollout.observation_max_chars = 64
    c.rollout.max_concurrency = 32
    c.rollout.engine.slots = 32
    c.rollout.engine.max_length = 832

    c.rl.group_size = 4
    c.rl.logprob_chunk_size = 256
    c.rl.micro_batch_tokens = 6656  # eight whole trajectories

    c.optim.lr = 1e-4  # a tiny model needs a far larger step than the 14B recipe
    c.optim.warmup_steps = 1

    c.train.steps = 4
    c.train.eval_every = 0
    c.train.log_every = 1

    c.sft.before_rl = True
    # ~380 small steps teach the format: ~97% of greedy first turns are well-formed tool calls after
    # two epochs (tests/test_sft.py measures the rate on a shorter warm-up).
    c.sft.epochs = 3
    c.sft.lr = 1e-2
    c.sft.batch_size = 4
    c.sft.micro_batch_tokens = 3072  # four rows of 768: one conversation per row
    c.sft.max_length = 768

    c.sandbox.launch_local = True
    c.sandbox.workers = 2
    c.sandbox.memory_mb = 512
    c.sandbox.verify_via = "local"

    c.checkpoint.every_steps = 2
    c.checkpoint.max_to_keep = 2
    c.checkpoint.export_hf_every = 2

    c.eval.k = 2
    c.eval.max_turns = 2
    c.eval.response_budget = 448
    return c
