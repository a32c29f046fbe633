"""The whole config tree with the rStar2-Agent recipe values (RL stage 1 on Qwen3-14B-Base).

Every other config file starts from `get_config()` here and changes only what its recipe changes.
"spec §x" comments cite the rStar2-Agent specification: PAPER = arXiv 2508.20722, CODE = the
microsoft/rStar release and its verl fork. `rstar_jax.config.validate` rejects any key that is not
in this tree, so this file is also the schema.
"""

import ml_collections
from ml_collections import config_dict

from rstar_jax.model.config import DEFAULT_RULES  # jax-free: checking a config imports no jax


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.run_dir = "runs/stage1"
    c.seed = 0
    c.mode = "rl"  # "rl" | "sft" | "eval"
    c.stage = "stage1"  # a label recorded in checkpoints and metrics

    c.model = ml_collections.ConfigDict()
    c.model.preset = "qwen3-14b"  # spec §5.1: base model Qwen3-14B-Base
    c.model.hf_path = ""  # a Hugging Face checkpoint directory to start from ("" = random init)
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat_policy = "full"  # spec §5.3: gradient checkpointing in the release run script
    c.model.attention_impl = "xla"
    # Per-field overrides of the preset (None = keep the preset's value).
    c.model.overrides = ml_collections.ConfigDict()
    for name, kind in (("vocab_size", int), ("hidden_size", int), ("intermediate_size", int),
                       ("num_layers", int), ("num_heads", int), ("num_kv_heads", int), ("head_dim", int),
                       ("max_position_embeddings", int), ("rope_theta", float), ("rms_norm_eps", float),
                       ("tie_word_embeddings", bool)):
        c.model.overrides[name] = config_dict.placeholder(kind)

    # Sizes multiply to the device count; -1 takes the remaining devices (checked at run time).
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1  # spec §5.3: the release trains with FSDP
    c.mesh.tensor = 1
    # Logical axis -> mesh axes: weights FSDP-sharded on the embedding dim, tensor-parallel on
    # heads / MLP / vocabulary, the batch over both data-parallel axes.
    c.mesh.rules = DEFAULT_RULES

    c.tokenizer = ml_collections.ConfigDict()
    c.tokenizer.kind = "hf"  # "byte" | "hf"
    c.tokenizer.path = ""  # tokenizer.json or its directory ("" = model.hf_path)

    c.data = ml_collections.ConfigDict()
    # spec §5.2: the paper's 42K integer-answer set is unreleased; the release trains on
    # open-r1/DAPO-Math-17k-Processed in the rStar2 parquet layout (spec §7). Set on the command line.
    c.data.train_files = ()
    c.data.eval_files = ()
    # Dotted paths into a row ("prompt.0.content"); "auto" picks `question`/`answer`, else the
    # rStar2 parquet layout (prompt[-1].content, reward_model.ground_truth), decided per file.
    c.data.question_key = "auto"
    c.data.answer_key = "auto"
    c.data.format = "auto"  # "auto" (by extension) | "json" | "jsonl" | "parquet"
    c.data.shuffle_seed = 0
    c.data.on_bad_row = "error"  # "error" | "skip" (skipped rows are counted and reported)
    # Drop (and count) RL prompts longer than rollout.max_prompt_length tokens, chat template and tools
    # block included, as the release (filter_overlong_prompts=True); False refuses them naming the row.
    c.data.filter_overlong_prompts = True
    c.data.num_prompts_per_step = 512  # spec §5.3: 512 prompts per step (PAPER §4.3)
    c.data.synthetic = ml_collections.ConfigDict()
    c.data.synthetic.enabled = False  # generate tool-use problems into run_dir instead of train_files
    c.data.synthetic.num_train = 2048
    c.data.synthetic.num_eval = 64
    # Solved SFT conversations, stage after stage: (conversations, weights of their behaviours), the
    # behaviours (rstar_jax.data.synthetic.BEHAVIOURS) being an answer without the tool, one correct
    # call, a failing call then the fix; 0 conversations = num_train.
    c.data.synthetic.sft_stages = ((0, (0.0, 1.0, 0.0)),)
    # How the "fix" behaviour's first call fails: "unclosed" (its ")" left out) | "unmatched" (doubled);
    # rstar_jax.data.synthetic.FIX_BUGS says why the second is the easier recovery to learn.
    c.data.synthetic.fix_bug = "unclosed"
    c.data.synthetic.seed = 0
    c.data.synthetic.kinds = ()  # () = every generator in rstar_jax.data.synthetic.GENERATORS
    c.data.synthetic.difficulty = 1  # 1 (tiny runs) .. 3 (answers far beyond mental arithmetic)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.backend = "jax"  # "jax" (in-process JaxEngine) | "sglang" (HTTP servers)
    c.rollout.servers = ()  # SGLang base URLs, e.g. ("http://10.0.0.5:30000",)
    # sglang backend on one machine: start this many `python -m rstar_jax.serve` processes (our
    # SGLang-compatible server) from the policy and stop them with the run; servers = () then.
    c.rollout.local_servers = 0
    # Rollout worker processes per trainer process (rstar_jax/rollout/workers.py), each with its own
    # event loop and share of a step's groups, servers and sandbox targets; 1: the rollout runs in the
    # trainer process. Only with servers (rollout.backend="sglang"): the JaxEngine lives in-process.
    c.rollout.workers = 1
    c.rollout.scheduler = "kv"  # spec §4.1: KV-cache-aware load balancing | "round_robin"
    # The "kv" scheduler (rstar_jax/rollout/scheduler.py; benchmarks/rollout_sim.py measures it): a
    # turn reserves its context plus new_token_ratio x its expected output ("expected"; "worst-case":
    # its whole remaining budget) on a server, up to budget_fraction of the server's KV pool; the
    # servers' reported use is read every reconcile_interval_s seconds (0: only before the first turn).
    # A group's rollouts start group_block at a time on one server (they share their prompt's KV
    # there); the next block goes to the least loaded server, so that one long group does not make
    # one server's tail.
    c.rollout.kv_scheduler = ml_collections.ConfigDict()
    c.rollout.kv_scheduler.reservation = "expected"
    c.rollout.kv_scheduler.new_token_ratio = 0.65
    c.rollout.kv_scheduler.budget_fraction = 1.0
    c.rollout.kv_scheduler.reconcile_interval_s = 10.0
    c.rollout.kv_scheduler.group_block = 8
    c.rollout.rollouts_per_prompt = 32  # spec §5.3: 32 rollouts per prompt, RoC keeps 16
    c.rollout.temperature = 1.0  # spec §5.3: rollout temperature 1.0
    c.rollout.top_p = 1.0  # spec §5.3: verl default
    c.rollout.top_k = -1  # spec §5.3: verl default (disabled)
    c.rollout.max_turns = 10  # spec §5.3: T = 10 in stages 1-2
    c.rollout.response_budget = 8192  # spec §5.3: 8K stage 1; model and tool tokens share it
    c.rollout.max_prompt_length = 2048  # spec §5.3: CODE run script
    c.rollout.tool_name = "python_code_with_standard_io"  # spec §2.2: the release's tool name
    # False: the ablation without the tool (paper Fig. 9's "no tool"): the prompt leaves it out and
    # tool calls are never executed.
    c.rollout.tools = True
    # "rstar2": the release's system prompt, tools block and user prefix character for character
    # (spec §2.1-2.2); "compact": the same tags and tool-call format in a ~190-character prompt.
    c.rollout.template = "rstar2"
    # Per-trajectory sampling seeds derived from (seed, group, sample) — SGLang's `sampling_seed`:
    # a trajectory's draws do not depend on batching or timing, so runs repeat and resume exactly.
    c.rollout.seeded_sampling = True
    # The tool observations and call parsing; None = sandbox.preset's (rstar_jax/rollout/tool_env.py).
    c.rollout.observation_style = config_dict.placeholder(str)  # "release" | "paper" (spec §2.3)
    c.rollout.observation_max_chars = config_dict.placeholder(int)  # middle-truncated to this many characters
    c.rollout.tool_call_parsing = config_dict.placeholder(str)  # "release" | "rich": malformed calls
    c.rollout.max_tool_calls_per_turn = 1  # spec §6.9: the release executes only the first call
    c.rollout.max_concurrency = 512  # trajectories in flight
    # Before the first step, every generator must answer /health_generate and every sandbox Info (or
    # SandboxFusion's /v1/ping) within this many seconds (servers loading a 14B checkpoint take minutes).
    c.rollout.ready_timeout_s = 900.0
    # A server that refuses connections, answers 5xx or runs one generation longer than
    # generate_timeout_s (0: no limit) leaves the rotation, and its trajectories resume on the others
    # from their last complete turn. A turn a server aborts (a weight update, a pause) is continued
    # from its partial output up to max_abort_resumes times per trajectory.
    c.rollout.generate_timeout_s = 0.0
    c.rollout.max_abort_resumes = 8
    c.rollout.engine = ml_collections.ConfigDict()  # in-process JaxEngine
    c.rollout.engine.slots = 64  # concurrent sequences (max_running_requests)
    c.rollout.engine.max_length = 10240  # prompt + response budget
    # KV page pool in tokens (SGLang's max_total_num_tokens); 0 means slots x max_length. Set it to
    # what memory holds: below slots x max_length the engine overcommits and retracts under pressure.
    c.rollout.engine.max_total_tokens = 0
    # SGLang's --mem-fraction-static: with max_total_tokens 0 and this > 0, that fraction of each
    # device's memory limit holds what is in use when the engine starts (weights, optimizer state)
    # and the pool, which gets the rest. Training activations come later: leave them room. 0: off
    # (slots x max_length); devices without memory statistics (CPU) fall back to that too.
    c.rollout.engine.mem_fraction_static = 0.0
    c.rollout.engine.page_size = 16  # tokens per KV page
    # SGLang's --chunked-prefill-size (its default on large GPUs): one engine step prefills at most
    # this many tokens, so a long context (a retracted trajectory's recompute) is prefilled over
    # several steps while the others decode, and a prefill's activations stay bounded. 0: off.
    c.rollout.engine.chunked_prefill_size = 8192
    # How the engine holds the decoder layers' weights: "stacked" (a scan over [layers, ...] arrays;
    # on GPU each layer-step copies its weights' slices) or "per_layer" (each layer's weights their own
    # arrays, cut from the trainer's at every weight sync, and the layers unrolled: more compile time
    # and one more copy of the layer weights in memory). Also `python -m rstar_jax.serve --layer-layout`.
    c.rollout.engine.layer_layout = "stacked"
    # How decode steps attend over the KV pool: "xla" (each row's pages gathered, then reduced) or
    # "pallas" (the Pallas GPU paged-attention kernel over a pool laid out heads first; on a non-GPU
    # backend it runs interpreted, slowly: for tests). Also `python -m rstar_jax.serve --decode-attention`.
    c.rollout.engine.decode_attention = "xla"

    c.rl = ml_collections.ConfigDict()
    c.rl.group_size = 16  # spec §5.3: RoC keeps 16 of 32
    c.rl.roc_variant = "paper"  # "paper" (spec §1.4) | "release" (spec §1.3)
    # Paper variant: positives drawn with weight 1 / (p_total + epsilon). The paper gives no epsilon;
    # at 1e-3 a zero-penalty positive weighs ~500x one without tool calls, so the draw is nearly the
    # release's lowest-penalty-first (rstar_jax/rl/roc.py explains; ~0.1 keeps it visibly random).
    c.rl.roc_epsilon = 1e-3
    c.rl.roc_min_per_class = 2  # spec §1.3: release variant keeps at least 2 negatives and 2 positives
    # Paper variant: at least this many negatives kept (0 = the paper's floor(n_neg / 2): a group with
    # one negative in 32 keeps none, and its 16 positives all get advantage 0).
    c.rl.roc_min_negatives = 0
    # A kept group whose kept rewards are all equal (advantage 0): "keep" (the paper read literally;
    # its tokens still count in the token-mean denominator, diluting the other groups' gradient) or
    # "drop" (removed after selection, as if all-equal from the start).
    c.rl.roc_zero_advantage = "keep"
    c.rl.clip_low = 0.2  # spec §5.3: clip 0.2 / 0.28 (clip-higher)
    c.rl.clip_high = 0.28
    # Dual-clip: for A < 0 the loss is at most -A * 3.0. The release always applies it (verl's
    # clip_ratio_c = 3.0); it binds only where the ratio is far from 1 (a ratio above 3 with a negative
    # advantage). None turns it off; GSPO (rl.ratio_level = "sequence") has none.
    c.rl.dual_clip = config_dict.FieldReference(3.0, field_type=float)
    # Beyond the paper, with verl's names and semantics (rstar_jax/rl/loss.py has each formula).
    # Loss aggregation: "token-mean" (the paper's) | "seq-mean-token-mean" | "seq-mean-token-sum" |
    # "seq-mean-token-sum-norm" (Dr.GRPO: token sums over sequences x H; H = loss_scale_factor,
    # None = rollout.response_budget, fixed because padded widths vary between micro-batches).
    c.rl.loss_agg_mode = "token-mean"
    c.rl.loss_scale_factor = config_dict.placeholder(float)
    c.rl.ratio_level = "token"  # "sequence": GSPO (with loss_agg_mode "seq-mean-token-mean", dual_clip None)
    # Rollout correction for the sampler-trainer mismatch (verl's decoupled reading): the ratio
    # rho = pi_old / mu of the trainer's recomputed log-probs to the sampler's. rollout_is ("token" |
    # "sequence") weights each token's loss by min(rho, rollout_is_threshold); rollout_rs ("token" |
    # "sequence" | "geometric") drops tokens or sequences whose rho leaves [rollout_rs_threshold_lower
    # (None: 1/upper; 0: none), rollout_rs_threshold]. Off in the paper; the mismatch is always logged
    # (mismatch/kl_k1, mismatch/kl_k3). Needs rl.use_sampler_logprobs=False (pi_old recomputed).
    c.rl.rollout_is = config_dict.placeholder(str)
    c.rl.rollout_is_threshold = 2.0  # verl's default cap (SkyRL recommends 2 for TIS)
    c.rl.rollout_rs = config_dict.placeholder(str)
    c.rl.rollout_rs_threshold = config_dict.placeholder(float)
    c.rl.rollout_rs_threshold_lower = config_dict.placeholder(float)
    c.rl.kl_coef = 0.0  # spec §5.3: no KL term (validation refuses > 0: there is no reference policy)
    c.rl.entropy_coef = 0.0  # spec §5.3: no entropy term
    # The objective by name (rstar_jax.rl.registry): a new variant is a registered function and this value.
    c.rl.policy_loss = "grpo"  # clip-higher PPO, token mean (spec §2.2.1)
    c.rl.advantage_estimator = "grpo"  # group-normalised outcome rewards (spec §2.2.1)
    c.rl.logprob_chunk_size = 1024  # tokens per chunk of the vocab projection in token_logprobs
    # Tokens per micro-batch on each data-parallel shard (the release's ppo_max_token_len_per_gpu,
    # 20480 in spec §5.3): every device along the data/fsdp axes holds this many per micro-batch.
    # Here one 8K + 2K row: XLA attention holds each row's T x T scores, and the ahead-of-time
    # compile of the 14B update on 64 devices (benchmarks/RESULTS.md, `python -m
    # rstar_jax.aot`) peaks at 82 GiB per device with one row, 153 GiB with the release's two.
    c.rl.micro_batch_tokens = 10240
    c.rl.use_sampler_logprobs = False  # False: recompute old log-probs with the trainer, as verl does
    # Asynchronous RL with bounded staleness. 0: synchronous, as the paper (a step generates, then
    # trains, then pushes). K >= 1: generation runs up to K steps' worth of groups ahead and each
    # update takes the first complete groups (group streaming), so generation overlaps the update
    # and no update waits for the long tail unless a group would become too stale; weights are pushed while
    # rollouts run (the in-process engine swaps between two decode steps; servers need
    # weight_sync.mode "pause", "in_place" or "abort"); every trained token is at most K updates old; and the
    # rollout correction is on (rl.rollout_is defaults to "token" when not set).
    c.rl.max_staleness = 0

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6  # spec §5.3: constant lr 1e-6 after a 20-step linear warm-up
    c.optim.warmup_steps = 20
    c.optim.schedule = "constant"  # "constant" | "cosine" | "wsd" (constant, then a cosine decay at the end)
    c.optim.decay_ratio = 0.1  # "wsd": the fraction of the steps over which the rate decays
    c.optim.b1 = 0.9  # spec §5.3: AdamW betas (0.9, 0.999), verl defaults
    c.optim.b2 = 0.999
    c.optim.weight_decay = 0.01  # spec §5.3: verl default
    c.optim.grad_clip = 1.0  # spec §5.3: verl default
    c.optim.reset_at_start = False  # spec §5.3: True for stage 3 (optimizer state reset)
    # "float32": with model.param_dtype = "bfloat16" the optimizer state keeps an fp32 master copy of
    # the weights and AdamW updates it (rounded into the bf16 parameters after each step): bf16 matmuls
    # without a cast per step, and updates below bf16's resolution (lr 1e-6 on weights ~1e-2) still
    # accumulate. "" = the parameters are the master (what model.param_dtype = "float32" needs).
    c.optim.master_weights = ""

    c.train = ml_collections.ConfigDict()
    # spec §5.3: stage 1 runs 300 steps. A step whose groups RoC all dropped (all-equal rewards)
    # makes no update (`update/skipped`) but counts: a stage consumes exactly `steps` prompt
    # batches. The release instead does not advance its step counter on such a batch, so it makes
    # `steps` updates; at the recipe's 2G = 32 rollouts per prompt and 64 prompts such a step is rare.
    c.train.steps = 300
    # Held-out evaluation of the policy being trained, at step 0, every eval_every steps and after the
    # last: config.eval's k and sampling on data.eval_files, through the run's own generators (so
    # max_prompt_length + eval.response_budget must fit rollout.engine.max_length). 0 = off.
    c.train.eval_every = 0
    c.train.log_every = 1
    # Checkpoint directory of the previous stage ("" = model.hf_path / init). The stage continues
    # that run: its step numbers (group ids, sampling seeds, RoC draws, weight versions) go on from
    # the previous stage's, and its prompt stream too when the data is the same (after an
    # asynchronous stage, past every batch it trained a group of: none is trained twice).
    c.train.init_from = ""

    c.sft = ml_collections.ConfigDict()
    # Conversations in the messages format of HF chat templates / OpenAI (system, user, assistant with
    # content and/or tool_calls, tool; per-conversation "tools"), jsonl/json/parquet rows of
    # {"messages": [...], "tools": [...]}, trained file after file; synthetic when enabled.
    c.sft.train_files = ()
    # How each file is rendered, one entry per file or one for all: "qwen3" (Qwen3's stock chat
    # template, for general data with its own system prompts and tools: the paper's function-calling,
    # instruction and chat mix) or "rstar2" (the RL prompt of rollout.template, for math tool-use data).
    c.sft.templates = ("rstar2",)
    c.sft.epochs = 3  # spec §5.1: 3 epochs, lr 5e-6, 4% warm-up, cosine decay, batch 128
    c.sft.lr = 5e-6
    c.sft.warmup_ratio = 0.04
    c.sft.schedule = "cosine"  # "constant" | "cosine" | "wsd" (constant, then a cosine decay at the end)
    c.sft.decay_ratio = 0.1  # "wsd": the fraction of the steps over which the rate decays
    # AdamW's second-moment decay for SFT (the paper gives none; optim.b2 is RL's). Its time constant,
    # 1 / (1 - b2) steps, is how long the first steps' large gradients keep later steps small.
    c.sft.b2 = 0.999
    # A stage other than the last (a file of sft.train_files, an entry of data.synthetic.sft_stages)
    # ends early once the mean loss of its last sft.advance_window steps falls below this: its
    # conversations are then a cap, and the schedule skips its remaining steps (so it must hold the
    # rate constant until the last stage). 0: every stage runs whole.
    c.sft.advance_loss = 0.0
    c.sft.advance_window = 50
    # Or once this share of its sft.advance_probe held-out conversations (the last ones of its file,
    # then not trained on) is what greedy decoding writes (every trained token above probability one
    # half, given the conversation's other turns), measured every sft.advance_every steps: for a stage
    # whose answers follow from their prompts, the criterion that it has learned them. 0: not used.
    c.sft.advance_exact = 0.0
    # ... at this many measurements in a row: a skill that has just formed can fall back under the
    # same constant rate, and one measurement may catch it in passing. 1: the first one ends it.
    c.sft.advance_consecutive = 1
    c.sft.advance_every = 25
    c.sft.advance_probe = 64
    c.sft.batch_size = 128
    c.sft.max_length = 8192  # spec §5.1: not given in the paper; our choice
    c.sft.pack = True
    # Tokens per micro-batch (gradient accumulation) on each data-parallel shard, as
    # rl.micro_batch_tokens: every device along the data/fsdp axes holds this many. One row of
    # sft.max_length: the 14B SFT step then peaks at 57 GiB per device (102 GiB with two rows).
    c.sft.micro_batch_tokens = 8192
    c.sft.before_rl = False  # run this SFT first, then RL from its result (tiny runs)

    c.sandbox = ml_collections.ConfigDict()
    # How tool calls reach the sandbox: "grpc" (this project's server, sandbox_service) or
    # "sandbox_fusion" (SandboxFusion's HTTP API, e.g. a deployment verl already uses: targets are then
    # its base URLs, "http://host:port"; it has no Verify, so verify_via must be "local", and it runs a
    # fresh interpreter with an address-space limit per call, so preimports=False and
    # memory_address_space=True, as in the release preset). With launch_local, our own server is
    # started with its SandboxFusion-compatible HTTP endpoint and the calls go through that.
    c.sandbox.api = "grpc"
    c.sandbox.launch_local = True  # start `python -m sandbox_service` on this host for the run (and stop it)
    c.sandbox.targets = ()  # running servers: gRPC "host:port" or SandboxFusion URLs (then launch_local=False)
    c.sandbox.workers = 32
    # The tool environment: "release" (spec §2.3, §3.2: code-judge under the release's agent loop: no
    # pre-imports, 384 MB of address space, streams cut at 1000 characters, one-line errors,
    # 256-character observations) or "rich" (numpy/sympy pre-imported, 2048 MB resident, full
    # tracebacks, 4096 characters).
    # The fields below and rollout.observation_* / tool_call_parsing default (None) to the preset's.
    c.sandbox.preset = "release"  # the only published description of the recipe's tool environment
    c.sandbox.timeout_s = config_dict.placeholder(float)  # wall-clock seconds per call (both presets: 4)
    c.sandbox.memory_mb = config_dict.placeholder(int)
    c.sandbox.memory_address_space = config_dict.placeholder(bool)  # True: memory_mb bounds RLIMIT_AS, not RSS
    c.sandbox.stream_cap_chars = config_dict.placeholder(int)  # > 0: cut stdout/stderr there; 0: kill past 64 KiB
    c.sandbox.error_format = config_dict.placeholder(str)  # "release" (one line) | "traceback"
    c.sandbox.preimports = config_dict.placeholder(bool)  # False: numpy/sympy imports count against timeout_s
    # Modules tool code needs beside numpy, sympy and mpmath (e.g. ("scipy",)): the local sandbox
    # pre-imports them (`--preimport`), and the run refuses a sandbox whose start-up self-test cannot
    # import one (a running server must have been started with `--preimport` for each).
    c.sandbox.preimport_modules = ()
    c.sandbox.verify_via = "sandbox"  # "sandbox" (Verify RPC) | "local" (process pool)
    # Seconds one reward verification may take before it scores 0 (RL and evaluation alike); our choice.
    c.sandbox.verify_timeout_s = 10.0
    # A noisy environment, for experiments (benchmarks/roc_effect.py): the local sandbox answers this
    # share of tool calls as timeouts without running them (seeded by `seed`); 0: none.
    c.sandbox.inject_timeout_rate = 0.0

    # How the policy reaches SGLang(-compatible) servers after each update (rollout.backend="sglang";
    # the in-process engine swaps its parameters in place). rstar_jax/train/weight_sync.py explains.
    c.weight_sync = ml_collections.ConfigDict()
    # "disk": an HF export every server loads (/update_weights_from_disk); "distributed": SGLang's
    # torch.distributed broadcast from the trainer (/update_weights_from_distributed; needs torch,
    # the `distributed-sync` extra, on both sides).
    c.weight_sync.method = "disk"
    # "wait": running requests finish on the old weights; "abort": they end with partial output;
    # "pause": pause (abort), update, continue; "in_place": pause in place (running requests freeze
    # with their KV), update, continue: they go on under the new weights, each token's version
    # reported (SGLang >= 0.5.23's meta_info.weight_versions; older servers: the older version).
    c.weight_sync.mode = "wait"
    # The tensors' dtype ("" = model.param_dtype): bf16 halves the bytes; SGLang serves in bf16 anyway.
    c.weight_sync.dtype = "bfloat16"
    # disk: where the export goes ("" = <run_dir>/weights_sync), read by every server; node-local
    # tmpfs (e.g. /dev/shm/<run>) when they share the node. Shards of at most max_shard_bytes are
    # written by writer_threads threads.
    c.weight_sync.directory = ""
    c.weight_sync.max_shard_bytes = 4 << 30
    c.weight_sync.writer_threads = 8
    # distributed: the trainer is rank 0 of the group every server joins at
    # master_address:master_port ("" = the address the servers reach this host by; 0 = a free port).
    c.weight_sync.master_address = ""
    c.weight_sync.master_port = 0
    c.weight_sync.backend = ""  # "nccl" | "gloo" ("" = nccl when the policy is on GPUs, else gloo)
    c.weight_sync.group_name = "weight_update_group"  # SGLang's default
    # Tensors per /update_weights_from_distributed call are bounded by this many bytes (one larger
    # tensor goes alone): what a server holds received before it loads them.
    c.weight_sync.bucket_bytes = 1 << 30

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 10
    c.checkpoint.max_to_keep = 3
    c.checkpoint.async_save = True
    c.checkpoint.export_hf_every = 0  # 0 = never; else every N steps (weights for SGLang servers)
    c.checkpoint.export_hf_final = True  # <run_dir>/hf/final at the end of the stage: the next stage's hf_path
    # HF exports hold the tensors in this dtype ("" = the precision the run trains in: the master's
    # under optim.master_weights, else model.param_dtype), the run's tokenizer files and
    # a generation config that stops on the chat model's stop tokens: a whole checkpoint to serve.
    c.checkpoint.export_dtype = "bfloat16"

    c.metrics = ml_collections.ConfigDict()
    c.metrics.tensorboard = True
    c.metrics.jsonl = True
    c.metrics.progress_bar = True
    # Every trajectory of every step as JSON lines in <run_dir>/rollouts/ (token ids, text, tool
    # statuses, reward): what the analysis notebooks read.
    c.metrics.save_rollouts = True

    c.eval = ml_collections.ConfigDict()
    c.eval.files = ()
    c.eval.k = 16  # spec §5.4: 16 samples per question, avg@16
    c.eval.temperature = 0.6  # spec §5.4
    c.eval.top_p = 1.0  # spec §5.4: not stated; verl default
    c.eval.max_turns = 30  # spec §5.4: T = 30
    c.eval.response_budget = 30000  # spec §5.4: up to 30K tokens per response
    c.eval.top_k = -1  # spec §5.4: not stated; verl default (off)
    # The policy to evaluate: model.hf_path (an HF directory), or an orbax run directory (or its
    # checkpoints/ directory) and a step (None = the latest). Not needed with generator_urls.
    c.eval.checkpoint_dir = ""
    c.eval.checkpoint_step = config_dict.placeholder(int)
    # SGLang-compatible servers already serving the policy ("http://host:port"); () = sample with
    # the in-process JaxEngine (rollout.engine.slots sequences at a time).
    c.eval.generator_urls = ()

    # `python -m rstar_jax.filter_hard`: spec §5.3 stage-3 hard set, drop problems solved k of k.
    # Sampling uses the config's rollout settings (response budget, top_p, top_k), with the
    # temperature and turns below (None = rollout's): stage 3's config sets stage 2's, since the
    # paper filters with the stage-2 policy as stage 2 sampled.
    c.filter_hard = ml_collections.ConfigDict()
    c.filter_hard.k = 8  # spec §5.3: 8 rollouts per problem
    c.filter_hard.temperature = config_dict.placeholder(float)
    c.filter_hard.max_turns = config_dict.placeholder(int)
    c.filter_hard.output_file = ""
    c.filter_hard.input_files = ()  # the problems to filter; () = data.train_files
    # The policy (spec §5.3: the latest stage-2 policy): this orbax run/checkpoints directory, else
    # model.hf_path, else train.init_from. checkpoint_step None = the latest.
    c.filter_hard.checkpoint_dir = ""
    c.filter_hard.checkpoint_step = config_dict.placeholder(int)
    c.filter_hard.generator_urls = ()  # as eval.generator_urls
    return c
