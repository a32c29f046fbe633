"""A validated config, resolved into the libraries' typed settings: the one place a ConfigDict is read.

Below the composition layer (`rstar_jax.app`) no module reads a ConfigDict: the model, the loss,
RoC, the rollout loop, the tool environment, the optimizer and the batch shapes take their own frozen
dataclasses, and this module builds them. One generic conversion does it (`build`): each dataclass
field is read from the config section field of the same name (`rl.clip_low` -> `LossConfig.clip_low`),
or of the same name after the section's prefix (`rl.roc_variant` -> `RocConfig.variant`); the few
fields whose names differ are named at the call. A value a dataclass refuses becomes a ConfigError
naming the config field the user set (`config.rl.roc_variant: ...`), not the dataclass's.

The settings types come from their packages' jax-free modules, so resolving (and so validating, which
builds them) imports no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import ml_collections

from rstar_jax.errors import ConfigError, from_fields
from rstar_jax.model.config import Qwen3Config
from rstar_jax.rl.roc import RocConfig
from rstar_jax.rl.settings import LossConfig
from rstar_jax.rollout.loop import LoopConfig
from rstar_jax.rollout.tool_env import PRESETS, ToolEnv
from rstar_jax.train.settings import BatchConfig, OptimizerConfig, RLSettings, row_length_for

T = TypeVar("T")


def config_value(config: ml_collections.ConfigDict, path: str) -> Any:
    """The value at a dotted path of a config (`config_value(c, "rl.clip_low")`)."""
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def build(cls: type[T], config: ml_collections.ConfigDict, section: str, *, prefix: str = "",
          fallback: str | None = None, rename: Mapping[str, str] | None = None,
          given: Mapping[str, tuple[str, Any]] | None = None) -> T:
    """`cls` from `config.<section>`: each field from `<section>.<prefix><name>`, else
    `<section>.<name>`, else `<fallback>.<name>` (`rename` maps a field to another config name);
    `given` supplies fields as (config path named in errors, value). Fields the config lacks keep
    the dataclass's defaults."""
    rename, given = rename or {}, given or {}
    fields: dict[str, tuple[str, Any]] = {}
    for field in dataclasses.fields(cls):
        if field.name in given:
            fields[field.name] = given[field.name]
            continue
        name = rename.get(field.name, field.name)
        for path in (f"{section}.{prefix}{name}" if prefix else None, f"{section}.{name}",
                     f"{fallback}.{name}" if fallback else None):
            if path is not None and _has(config, path):
                fields[field.name] = (path, config_value(config, path))
                break
    return from_fields(cls, fields)


def _has(config: ml_collections.ConfigDict, path: str) -> bool:
    section, _, name = path.rpartition(".")
    node = config_value(config, section) if section else config
    return isinstance(node, ml_collections.ConfigDict) and name in node and \
        not isinstance(node[name], ml_collections.ConfigDict)


# -- the libraries' settings ---------------------------------------------------------------------

def model_config(config: ml_collections.ConfigDict, stored: dict | None = None) -> Qwen3Config:
    """The shape `config.model` describes: its preset plus the non-None overrides, with its compute
    settings. `stored`: a checkpoint's stored run config, whose model shape (preset, overrides,
    parameter dtype) wins."""
    m = config.model
    preset, param_dtype = m.preset, m.param_dtype
    overrides = {k: v for k, v in m.overrides.items() if v is not None}
    where = "config.model"
    saved = (stored or {}).get("model")
    if isinstance(saved, dict):
        where = "the checkpoint's stored config.model"
        preset, param_dtype = saved.get("preset", preset), saved.get("param_dtype", param_dtype)
        if isinstance(saved.get("overrides"), dict):  # the stored shape, not a mix with this config's
            overrides = {k: v for k, v in saved["overrides"].items() if v is not None}
    try:
        return Qwen3Config.preset(preset, dtype=m.dtype, param_dtype=param_dtype, remat_policy=m.remat_policy,
                                  attention_impl=m.attention_impl, **overrides)
    except TypeError as e:
        raise ConfigError(f"{where}.overrides: {e}") from None
    except ValueError as e:
        message = " ".join(str(e).split())
        if message.startswith("unknown model preset"):
            raise ConfigError(f"{where}.preset: {message}") from None
        name, _, rest = message.removeprefix("Qwen3Config.").partition(" ")
        if message.startswith("Qwen3Config.num_heads (") and "multiple of num_kv_heads" in message:
            raise ConfigError(_heads_problem(where, preset, overrides)) from None
        if message.startswith("Qwen3Config.") and name in ("dtype", "param_dtype", "remat_policy", "attention_impl"):
            raise ConfigError(f"{where}.{name}: {rest}") from None
        if message.startswith("Qwen3Config.") and name in m.overrides:
            raise ConfigError(f"{where}.overrides.{name}: {rest}") from None
        raise ConfigError(f"{where}: {message}") from None


def _heads_problem(where: str, preset: str, overrides: dict) -> str:
    """num_heads not a multiple of num_kv_heads, on the one the user set: num_kv_heads when it is
    overridden (alone, or above num_heads), else num_heads."""
    heads = overrides.get("num_heads")
    kv_heads = overrides.get("num_kv_heads")
    shape = Qwen3Config.preset(preset)  # a known preset: the heads rule runs after the name is checked
    given = {"num_heads": shape.num_heads if heads is None else heads,
             "num_kv_heads": shape.num_kv_heads if kv_heads is None else kv_heads}
    whose = {name: "" if name in overrides else f", {preset}'s" for name in given}
    section = where.rpartition("config.")[2]
    if kv_heads is not None and (heads is None or kv_heads > heads):
        return (f"{where}.overrides.num_kv_heads: must divide {section}.overrides.num_heads "
                f"({given['num_heads']}{whose['num_heads']}), got {kv_heads}")
    return (f"{where}.overrides.num_heads: must be a multiple of {section}.overrides.num_kv_heads "
            f"({given['num_kv_heads']}{whose['num_kv_heads']}), got {given['num_heads']}")


def tool_env(config: ml_collections.ConfigDict) -> ToolEnv:
    """`sandbox.preset`'s environment, each value replaced by the field of the same name where it is
    set (not None): the sandbox's limits in `sandbox.*`, the observations and call parsing in
    `rollout.*`."""
    preset = config.sandbox.preset
    if preset not in PRESETS:
        raise ConfigError(f"config.sandbox.preset: must be one of {tuple(PRESETS)}, got {preset!r}")
    fields = {"preset": ("sandbox.preset", preset)}
    for name, default in PRESETS[preset].items():
        path = f"sandbox.{name}" if name in config.sandbox else f"rollout.{name}"
        value = config_value(config, path)
        fields[name] = (path, default if value is None else value)
    return from_fields(ToolEnv, fields)


def loop_config(config: ml_collections.ConfigDict, sampling: str = "rollout") -> LoopConfig:
    """Turns, budget and sampling from `config.<sampling>` ("rollout" for RL, "eval" for the
    evaluation protocol), the tool protocol from `config.rollout`, the tool environment whole."""
    seed = config.seed if config.rollout.seeded_sampling else None
    return build(LoopConfig, config, sampling, fallback="rollout",
                 rename={"max_calls_per_turn": "max_tool_calls_per_turn", "use_tools": "tools"},
                 given={"seed": ("seed", seed), "tool_env": ("sandbox.preset", tool_env(config))})


def roc_config(config: ml_collections.ConfigDict) -> RocConfig:
    """RoC from `config.rl.roc_*` and `rl.group_size` (its draw is seeded per step: `RLSettings.seed`)."""
    return build(RocConfig, config, "rl", prefix="roc_")


def loss_config(config: ml_collections.ConfigDict) -> LossConfig:
    """The objective from `config.rl`: clipping, aggregation, rollout correction, the policy loss and
    advantage estimator by name. Dr.GRPO's H (`rl.loss_scale_factor`) defaults to the response budget."""
    scale = config.rl.loss_scale_factor
    given = {"loss_scale_factor": ("rollout.response_budget", config.rollout.response_budget) if scale is None
             else ("rl.loss_scale_factor", scale)}
    if off_policy_correction_default(config):
        given["rollout_is"] = ("rl.max_staleness", "token")
    return build(LossConfig, config, "rl", given=given)


def off_policy_correction_default(config: ml_collections.ConfigDict) -> bool:
    """Under rl.max_staleness >= 1 the sampler's policy lags the trainer's: token-level rollout IS is
    on unless rl.rollout_is is set (it needs the trainer's recomputed pi_old beside the sampler's)."""
    rl = config.rl
    return (isinstance(rl.max_staleness, int) and rl.max_staleness >= 1 and rl.rollout_is is None
            and not rl.use_sampler_logprobs)


def optimizer_config(config: ml_collections.ConfigDict) -> OptimizerConfig:
    """The RL optimizer: `config.optim` over `train.steps`."""
    return build(OptimizerConfig, config, "optim", given={"total_steps": ("train.steps", config.train.steps)})


def sft_optimizer_config(config: ml_collections.ConfigDict, total_steps: int) -> OptimizerConfig:
    """The SFT optimizer: `config.sft`'s rate and schedule over `total_steps`, warm-up as a fraction
    of them (a schedule too short for its warm-up stays constant), AdamW from `config.optim`."""
    warmup = max(0, int(round(config.sft.warmup_ratio * total_steps)))
    schedule = config.sft.schedule if total_steps > warmup else "constant"
    return build(OptimizerConfig, config, "sft", fallback="optim",
                 given={"warmup_steps": ("sft.warmup_ratio", warmup), "total_steps": ("sft.epochs", total_steps),
                        "schedule": ("sft.schedule", schedule)})


def batch_config(config: ml_collections.ConfigDict, data_parallel: int = 1) -> BatchConfig:
    """`rl.micro_batch_tokens` per data-parallel shard (the release's ppo_max_token_len_per_gpu):
    each micro-batch holds `data_parallel` times that many rows. The micro-batch count is fixed at
    what the most RoC can keep (num_prompts_per_step x group_size trajectories, one per row)."""
    r, rl = config.rollout, config.rl
    row_length = row_length_for(r.max_prompt_length, r.response_budget)
    # Whole rows per shard; validation guarantees micro_batch_tokens >= one sequence.
    rows = data_parallel * max(1, rl.micro_batch_tokens // row_length)
    most_kept = config.data.num_prompts_per_step * rl.group_size
    return build(BatchConfig, config, "rl",
                 given={"rows": ("rl.micro_batch_tokens", rows), "row_length": ("rollout.response_budget", row_length),
                        "packed": ("rl", True), "num_micro_batches": ("rl.group_size", -(-most_kept // rows))})


def rl_settings(config: ml_collections.ConfigDict, data_parallel: int = 1) -> RLSettings:
    """Everything one RL step needs beside the model and the optimizer."""
    return RLSettings(rollouts_per_prompt=config.rollout.rollouts_per_prompt, loop=loop_config(config),
                      roc=roc_config(config), loss=loss_config(config), batch=batch_config(config, data_parallel),
                      seed=config.seed, chunk_size=config.rl.logprob_chunk_size,
                      max_concurrency=config.rollout.max_concurrency, max_staleness=config.rl.max_staleness)
