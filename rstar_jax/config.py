"""Config loading and validation for `python -m rstar_jax.launch` (ml-collections).

Validation happens before any heavy work: an unknown key or an invalid value stops the run with a
message naming the field.
"""

from __future__ import annotations

import importlib.util
import pathlib

import ml_collections

REPO_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = REPO_CONFIGS / "tiny.py"

MODES = ("demo",)


class ConfigError(ValueError):
    """An invalid config; the message names the field."""


def load_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
    path = pathlib.Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_rstar_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config()")
    return module.get_config()


def _require(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"config.{field}: {message}")


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks types, ranges and enums; returns the config locked against new keys."""
    from rstar_jax.model.qwen3 import Qwen3Config

    _require(config.get("mode") in MODES, "mode", f"must be one of {MODES}, got {config.get('mode')!r}")
    _require(isinstance(config.get("run_dir"), str) and config.run_dir != "", "run_dir", "must be a non-empty path")
    _require(isinstance(config.get("seed"), int), "seed", f"must be an integer, got {config.get('seed')!r}")
    try:
        Qwen3Config.preset(config.model.preset, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                           remat_policy=config.model.remat_policy, attention_impl=config.model.attention_impl)
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from None
    for axis in ("data", "fsdp", "tensor"):
        value = config.mesh.get(axis)
        _require(isinstance(value, int) and (value >= 1 or value == -1), f"mesh.{axis}",
                 f"must be a positive integer or -1, got {value!r}")
    if config.mode == "demo":
        for field in ("batch_size", "prompt_length", "new_tokens"):
            value = config.demo.get(field)
            _require(isinstance(value, int) and value >= 1, f"demo.{field}", f"must be a positive integer, got {value!r}")
    config.lock()
    return config
