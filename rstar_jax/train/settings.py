"""The train package's settings dataclasses and enums, in a module that imports no jax.

The config package (`python -m rstar_jax.config`) checks a config by building these, so they live
apart from the jitted step (`train.step`), the batch builder (`train.rl_batch`) and the weight sync
(`train.weight_sync`), which import jax and re-export them from here.
"""

from __future__ import annotations

import dataclasses

from rstar_jax.errors import from_paths
from rstar_jax.train.batching import bucket_length  # numpy only

# `config.weight_sync.mode` and `.method`, as `train.weight_sync` implements them.
SYNC_MODES = ("abort", "pause", "wait")
SYNC_METHODS = ("disk", "distributed")

LR_SCHEDULES = ("constant", "cosine", "wsd")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6  # rStar2-Agent §5.3: constant 1e-6
    warmup_steps: int = 20  # linear warm-up over 20 rollout steps
    # "cosine" decays over all steps after the warm-up (SFT); "wsd" (warm-up, stable, decay) holds the
    # rate, then decays it with a cosine over the last `decay_ratio` of the steps.
    schedule: str = "constant"
    total_steps: int = 0  # needed by "cosine" and "wsd"
    decay_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule must be one of {LR_SCHEDULES}, got {self.schedule!r}")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"OptimizerConfig.total_steps must exceed warmup_steps for a {self.schedule} schedule")
        if not 0.0 < self.decay_ratio <= 1.0:
            raise ValueError(f"OptimizerConfig.decay_ratio must be in (0, 1], got {self.decay_ratio}")
        if self.lr <= 0:
            raise ValueError(f"OptimizerConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"OptimizerConfig.grad_clip must be >= 0, got {self.grad_clip}")

    @classmethod
    def from_config(cls, config) -> "OptimizerConfig":
        """The RL optimizer: `config.optim` over `train.steps`; a ConfigError names an invalid field."""
        return from_paths(cls, config, {**ADAMW_PATHS, "lr": "optim.lr", "warmup_steps": "optim.warmup_steps",
                                        "schedule": "optim.schedule", "total_steps": "train.steps",
                                        "decay_ratio": "optim.decay_ratio"})

    @classmethod
    def for_sft(cls, config, total_steps: int) -> "OptimizerConfig":
        """The SFT optimizer: `config.sft`'s rate and schedule over `total_steps`, warm-up as a
        fraction of them (a schedule too short for its warm-up stays constant), AdamW from `config.optim`."""
        warmup = max(0, int(round(config.sft.warmup_ratio * total_steps)))
        return from_paths(cls, config, {**ADAMW_PATHS, "lr": "sft.lr", "warmup_steps": "sft.warmup_ratio",
                                        "schedule": "sft.schedule", "total_steps": "sft.epochs",
                                        "decay_ratio": "sft.decay_ratio"},
                          warmup_steps=warmup, total_steps=total_steps,
                          schedule=config.sft.schedule if total_steps > warmup else "constant")


ADAMW_PATHS = {"b1": "optim.b1", "b2": "optim.b2", "weight_decay": "optim.weight_decay", "grad_clip": "optim.grad_clip"}


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    rows: int  # rows per micro-batch over the whole mesh: data-parallel shards x rows per shard
    row_length: int  # tokens per row (prompt + response - 1 for the largest sequence)
    packed: bool = True
    # Every step's batch has exactly this many micro-batches (its worst case), so the jitted step
    # compiles once per run; empty ones cost nothing. None: as many as each step needs.
    num_micro_batches: int | None = None
    use_sampler_logprobs: bool = True  # old log-probs from the sampler (else recomputed by the trainer)

    def __post_init__(self):
        if self.rows < 1:
            raise ValueError(f"BatchConfig.rows must be >= 1, got {self.rows}")
        if self.row_length < 2:
            raise ValueError(f"BatchConfig.row_length must be >= 2, got {self.row_length}")
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ValueError(f"BatchConfig.num_micro_batches must be >= 1 (or None), got {self.num_micro_batches}")

    @classmethod
    def from_config(cls, config, data_parallel: int = 1) -> "BatchConfig":
        """`rl.micro_batch_tokens` per data-parallel shard (the release's ppo_max_token_len_per_gpu):
        each micro-batch holds `data_parallel` times that many rows. The micro-batch count is fixed
        at what the most RoC can keep (num_prompts_per_step x group_size trajectories, one per row)."""
        r, rl = config.rollout, config.rl
        row_length = row_length_for(r.max_prompt_length, r.response_budget)
        # A row is the longest sequence rounded up to 128 tokens: a budget of at least one sequence
        # (what validation asks for) holds at least one row.
        per_shard = max(1, rl.micro_batch_tokens // row_length)
        rows = data_parallel * per_shard
        most_kept = config.data.num_prompts_per_step * rl.group_size
        return cls(rows=rows, row_length=row_length, packed=True, num_micro_batches=-(-most_kept // rows),
                   use_sampler_logprobs=rl.use_sampler_logprobs)


def row_length_for(max_prompt_length: int, response_budget: int, multiple: int = 128) -> int:
    """A row fits the longest possible sequence (inputs are one token shorter than the sequence)."""
    return bucket_length(max_prompt_length + response_budget - 1, multiple)
