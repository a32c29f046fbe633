"""The train package's settings dataclasses and enums, in a module that imports no jax.

The config package (`python -m rstar_jax.config`) checks a config by building these, so they live
apart from the jitted step (`train.step`), the batch builder (`train.rl_batch`) and the weight sync
(`train.weight_sync`), which import jax and re-export them from here.
"""

from __future__ import annotations

import dataclasses

from rstar_jax.rl.roc import RocConfig
from rstar_jax.rl.settings import LossConfig
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.train.batching import bucket_length  # numpy only

# `config.weight_sync.mode` and `.method`, as `train.weight_sync` implements them.
SYNC_MODES = ("abort", "pause", "in_place", "wait")
SYNC_METHODS = ("disk", "distributed")

LR_SCHEDULES = ("constant", "cosine", "wsd")
# `OptimizerConfig.master_weights`: "" (the parameters are their own master) or a master copy's dtype.
MASTER_WEIGHTS = ("", "float32")


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
    # "float32": the optimizer keeps an fp32 master copy of lower-precision (bf16) parameters and
    # updates it (`train.step.MasterWeightsOptimizer`); "": it updates the parameters themselves.
    master_weights: str = ""

    def __post_init__(self):
        if self.master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"OptimizerConfig.master_weights must be one of {MASTER_WEIGHTS}, got {self.master_weights!r}")
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

def row_length_for(max_prompt_length: int, response_budget: int, multiple: int = 128) -> int:
    """A row fits the longest possible sequence (inputs are one token shorter than the sequence)."""
    return bucket_length(max_prompt_length + response_budget - 1, multiple)


@dataclasses.dataclass(frozen=True)
class RLSettings:
    rollouts_per_prompt: int  # 2G
    loop: LoopConfig
    roc: RocConfig
    loss: LossConfig
    batch: BatchConfig
    seed: int  # the run's seed; RoC's draw at step s is seeded with (seed, s)
    chunk_size: int = 1024
    max_concurrency: int = 64
    max_staleness: int = 0  # K: every trained token at most K updates old (0: synchronous RL)

    def __post_init__(self):
        if self.rollouts_per_prompt < self.roc.group_size:
            raise ValueError(f"RLSettings.rollouts_per_prompt ({self.rollouts_per_prompt}) must be >= RoC's "
                             f"group_size ({self.roc.group_size})")
        if self.max_staleness < 0:
            raise ValueError(f"RLSettings.max_staleness must be >= 0, got {self.max_staleness}")
        if not self.loop.temperature > 0:
            raise ValueError(f"RLSettings: RL samples at a temperature > 0, got {self.loop.temperature}")
