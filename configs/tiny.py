"""Embedded default: the whole pipeline on one CPU machine in minutes, and RL that visibly teaches.

The task: "What is (47*38)?". The product is beyond the model's mental arithmetic, so an answer is
right only if the model copies both factors into `print(47*38)`, calls the tool and copies its
output into `\\boxed{}`. A one-layer, width-128 Qwen3 over bytes (0.28M parameters) with no system
turn (the `bare` template: every prompt byte is compute) learns this in a two-stage SFT warm-up:

1. Correct tool use only, at a constant 1e-2 after the warm-up, until the copy holds: every 25
   steps the stage measures 64 of its conversations that it holds out of training, and it ends once
   greedy decoding reproduces 95% of them (`sft.advance_exact`: every trained token above
   probability one half, so the factors are in the call and the tool's output in the answer) at
   three measurements in a row (`sft.advance_consecutive`), at step 992 (its other 7936
   conversations) at the latest. Just after it forms, the copy can fall back under the same
   constant rate: on a 2-core AVX2-only EPYC, seed 0 reproduced 100% at step 325, then 86%, 95%,
   81% and 94%, and held from step 450 (loss below 5e-5). Ended at step 325, that run went into the
   second stage with a copy that had not settled and ended RL at 0.81; three in a row ended it at
   500 and RL at 0.92. The model copies by distance: an
   attention head reads the character a fixed number of positions back, which the fixed wording
   makes the same for every problem (moving the reply one position further from the question drops
   the exact copies from 1.00 to 0.02; benchmarks/copy_heads.py). That head appears in a phase
   change, and eight conversations per step make it arrive on time. With four per step, the
   gradient that points a head at the source is mostly noise, and when the head formed depended on
   the seed, the data order and the last bits of XLA:CPU's arithmetic: on one machine and seed, the
   same run formed it at step 400 compiled for AVX2 and at 1625 for SSE4.2, and a 2-core AVX2-only
   EPYC ran into the old 2000-step cap with a half-formed copy, ending RL at 0.53. With eight it
   formed after 1,800 to 3,000 conversations in every probe, and the stage ended at steps 150 to
   500 in 25 runs of the default at the first measurement: seeds 0 to 4 under five kinds of
   arithmetic (benchmarks/default_run_spread.py; benchmarks/RESULTS.md, "The default run on every
   machine"); at three in a row, at 225 to 500 in 14 of 15 runs on the AVX2-only EPYC and at 875
   in one whose copy formed late ("The default run on an AVX2-only EPYC"). The criterion
   is what RL needs, not a loss threshold: after the copy forms, the loss at this rate hovers at
   0.001 to 0.006, so a threshold of 0.002 ended some stages late or never. The copy needs unique
   problems: 512 problems repeated over epochs are memorised instead. A mixture of behaviours from
   the start delays it, and so does a cosine schedule, whose rate has mostly decayed by then.
   AdamW's second-moment decay is 0.95 here (`sft.b2`), not 0.999: the first 100 steps learn the
   conversations' fixed text with gradient norms of 2 to 4 (clipped to 1) against about 0.15
   after, and 0.999 averages squared gradients over about 1000 steps, so it kept the steps small
   long after.
2. 600 conversations (75 steps, over which the rate decays: the "wsd" schedule, laid out for the
   planned 1067 steps; the steps stage 1 did not take are skipped in it too) mixing answers
   without the tool (a leading-digit estimate, so almost always wrong), correct tool use, and a broken
   call (a missing parenthesis) followed by its fix, weighted 2:1:1. With the decay, the warmed-up
   policy samples each behaviour about as often as this stage shows it. At a constant rate it samples
   whatever the last few batches showed.

So RL starts from a policy that often skips the tool: room to improve. It does not recover from a
broken call (the fix's copy sits at another distance): in none of those 25 runs does a
correct held-out trajectory at step 0 hold a failed call, so RoC has none to filter here
(benchmarks/roc_effect.py's task, whose errors end with the failed line
at one distance from the fix, is built for that). This stage also breaks part of the copy again,
on every seed and with every mixture and smaller rate tried: 26% to 86% of the held-out tool calls
at step 0 miscopy the factors. 7% to 34% of held-out problems are solved at step 0; 20 GRPO-RoC
steps turn the policy to the tool and repair the copies from the reward: held-out pass@1 ends at
0.902 to 1.000 in 15 runs on a 2-core AVX2-only EPYC (seeds 0 to 4: both cores, one, fusion
emitters off), where the first stage's old end at the first measurement ended seed 0 at 0.812;
before the three measurements in a row, 25 runs on an AVX-512 EPYC ended at 0.969 to 1.000.

Held-out problems are drawn from their own seed and never appear among the RL or SFT problems.
`train.eval_every` evaluates them (128 problems, 2 samples each) at steps 0, 10 and 20, with the same
agentic loop as `python -m rstar_jax.evaluate`. Rollouts run on the in-process JaxEngine against a
local sandbox server, which the launcher starts and stops. The run takes under 10 minutes on 2
cores: 2 to 4.2 on a 2-core AMD EPYC with AVX-512, 3.7 to 6 on an AVX2-only one (7.7 to 12 pinned
to one of its cores).
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
    c.model.overrides.num_layers = 1  # see the docstring: one layer copies soonest
    c.model.overrides.hidden_size = 128
    c.model.overrides.num_heads = 4
    c.model.overrides.num_kv_heads = 2
    c.model.overrides.head_dim = 32
    c.model.overrides.intermediate_size = 384
    c.model.overrides.max_position_embeddings = 1024

    c.tokenizer.kind = "byte"

    c.data.synthetic.enabled = True
    c.data.synthetic.kinds = ("product",)
    c.data.synthetic.difficulty = 1  # two-digit factors: four-digit products
    c.data.synthetic.num_train = 512
    c.data.synthetic.num_eval = 128
    # (conversations, weights over (direct, tool, fix)) per SFT stage; see the docstring.
    c.data.synthetic.sft_stages = ((8000, (0.0, 1.0, 0.0)), (600, (0.5, 0.25, 0.25)))
    c.data.num_prompts_per_step = 4

    c.rollout.template = "bare"
    c.rollout.tool_name = "python"  # the tool's name is written in every call: short is cheap
    c.rollout.rollouts_per_prompt = 8
    c.rollout.max_turns = 3
    c.rollout.response_budget = 448
    c.rollout.max_prompt_length = 64
    # The paper's bare-stdout observations: short, and free of timings, so the run is reproducible
    # token for token (and resumes exactly).
    c.rollout.observation_style = "paper"
    c.rollout.observation_max_chars = 64
    c.rollout.max_concurrency = 32
    c.rollout.engine.slots = 32
    c.rollout.engine.max_length = 512

    c.rl.group_size = 4
    c.rl.logprob_chunk_size = 256
    c.rl.micro_batch_tokens = 4096  # eight whole trajectories

    c.optim.lr = 3e-4  # a tiny model needs a far larger step than the 14B recipe; 1e-3 collapses
    c.optim.warmup_steps = 1

    c.train.steps = 20
    c.train.eval_every = 10
    c.train.log_every = 1

    c.sft.before_rl = True
    c.sft.epochs = 1  # every conversation a new problem (see the docstring)
    c.sft.lr = 1e-2
    c.sft.schedule = "wsd"
    c.sft.decay_ratio = 0.0703  # the second stage's 75 steps of the 1067 planned
    # Stage 1 ends once greedy decoding reproduces 95% of 64 held-out tool conversations (measured
    # every 25 steps), at step 992 at the latest (its other 7936 conversations).
    c.sft.advance_exact = 0.95
    c.sft.advance_consecutive = 3  # see the docstring: the copy can fall back just after it forms
    c.sft.advance_every = 25
    c.sft.advance_probe = 64
    c.sft.advance_loss = 0.0
    c.sft.b2 = 0.95  # see the docstring: the copy's phase change comes earlier
    c.sft.batch_size = 8  # see the docstring: four made the copy's step depend on the arithmetic
    # Rows of 512 tokens, four per micro-batch: eight tool-only conversations (~250 tokens) pack into
    # one micro-batch.
    c.sft.max_length = 512
    c.sft.micro_batch_tokens = 2048

    c.sandbox.preset = "rich"  # the environment this run's results (benchmarks/RESULTS.md) were measured in
    c.sandbox.launch_local = True
    c.sandbox.workers = 2
    c.sandbox.memory_mb = 512
    c.sandbox.verify_via = "local"

    c.checkpoint.every_steps = 10
    c.checkpoint.max_to_keep = 2
    c.checkpoint.export_hf_every = 10
    c.checkpoint.export_dtype = ""  # float32, as trained: a stage that starts from an export continues exactly
    c.weight_sync.dtype = ""  # servers (rollout.backend="sglang") sample the float32 policy the trainer scores

    c.eval.k = 2
    c.eval.max_turns = 3
    c.eval.response_budget = 448
    return c
