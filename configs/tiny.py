"""Embedded default: the whole pipeline on one CPU machine in minutes.

A tiny Qwen3 with the byte tokenizer, synthetic tool-use math problems generated into the run
directory, a short SFT warm-up that teaches the tool-call and answer format, then a few GRPO-RoC
steps with small groups and budgets against a local sandbox and the in-process JaxEngine.

`mode` stays "demo" (the launcher's foundation demonstration: sharded init, HF export/reload,
KV-cache decode) until the launcher dispatches "rl"; every field the RL run needs is set below.
"""

import ml_collections

from rstar_jax.config import sibling_config


def get_config() -> ml_collections.ConfigDict:
    c = sibling_config(__file__, "base")
    c.mode = "demo"
    c.stage = "tiny"
    c.run_dir = "runs/tiny"

    c.model.preset = "tiny"
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "none"
    c.model.attention_impl = "xla"
    c.model.overrides.max_position_embeddings = 4096  # room for the ~2.3K-byte rStar2 prompt

    c.tokenizer.kind = "byte"

    c.data.synthetic.enabled = True
    c.data.synthetic.num_train = 256
    c.data.synthetic.num_eval = 16
    c.data.synthetic.difficulty = 1
    c.data.num_prompts_per_step = 2

    c.rollout.rollouts_per_prompt = 4
    c.rollout.max_turns = 2
    c.rollout.response_budget = 256
    # The rStar2 system prompt, tools block and user prefix are ~2.3K bytes: one token each here.
    c.rollout.max_prompt_length = 2560
    c.rollout.observation_max_chars = 64
    c.rollout.max_concurrency = 8
    c.rollout.engine.slots = 8
    c.rollout.engine.max_length = 2816

    c.rl.group_size = 2
    c.rl.logprob_chunk_size = 256
    c.rl.micro_batch_tokens = 5632  # two whole trajectories

    c.optim.lr = 1e-4  # a random tiny model needs a far larger step than the 14B recipe
    c.optim.warmup_steps = 1

    c.train.steps = 4
    c.train.eval_every = 0
    c.train.log_every = 1

    c.sft.before_rl = True
    c.sft.epochs = 1
    c.sft.lr = 3e-3
    c.sft.batch_size = 8
    c.sft.max_length = 3584  # prompt plus a solved tool-call conversation

    c.sandbox.launch_local = True
    c.sandbox.workers = 2
    c.sandbox.memory_mb = 512
    c.sandbox.verify_via = "local"

    c.checkpoint.every_steps = 2
    c.checkpoint.max_to_keep = 2

    c.eval.k = 2
    c.eval.max_turns = 2
    c.eval.response_budget = 256
    return c
