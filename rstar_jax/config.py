"""Config loading, command-line style overrides and validation (ml-collections).

`configs/base.py` is the schema: a config may only hold the keys it defines, with the same types.
`validate` runs before any heavy work and stops a run with a message naming the field:
types, ranges, enums, cross-field rules and the existence of input files. The mesh product
against the device count is checked at run time by `check_mesh` (device count is not known here).

    config = load_config("configs/stage1.py", ["--config.rl.clip_high=0.3"])
    config = validate(config)          # locked against new keys
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from collections.abc import Sequence
from typing import Any

import ml_collections

from rstar_jax.agent.template import TEMPLATE_STYLES

REPO_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = REPO_CONFIGS / "tiny.py"
BASE_CONFIG = REPO_CONFIGS / "base.py"

MODES = ("rl", "sft", "eval", "demo")
MESH_AXES = ("data", "fsdp", "tensor")
TOKENIZER_KINDS = ("byte", "hf")
DATA_FORMATS = ("auto", "json", "jsonl", "parquet")
BAD_ROW_POLICIES = ("error", "skip")
ROLLOUT_BACKENDS = ("jax", "sglang")
SCHEDULERS = ("kv", "round_robin")
OBSERVATION_STYLES = ("release", "paper")
ROC_VARIANTS = ("paper", "release")
LR_SCHEDULES = ("constant", "cosine")
VERIFY_VIA = ("sandbox", "local")


class ConfigError(ValueError):
    """An invalid config; the message names the field."""


# -- loading --------------------------------------------------------------------------------------

def load_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
    """Executes a config file and returns its `get_config()`."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_rstar_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config()")
    config = module.get_config()
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"config file {path}: get_config() returned {type(config).__name__}, not a ConfigDict")
    return config


def sibling_config(config_file: str | pathlib.Path, name: str) -> ml_collections.ConfigDict:
    """`get_config()` of `<name>.py` next to `config_file`: how stage files start from base."""
    return load_config_file(pathlib.Path(config_file).resolve().parent / f"{name}.py")


def base_config() -> ml_collections.ConfigDict:
    return load_config_file(BASE_CONFIG)


def _parse_value(text: str, current: Any, kind: type | None, field: str) -> Any:
    """Parses an override string by the type the field already has."""
    if kind is str:
        return text
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ConfigError(f"config.{field}: expected a boolean, got {text!r}")
    if kind in (tuple, list):
        stripped = text.strip()
        if stripped == "":
            return ()
        if stripped[0] in "([":
            try:
                value = ast.literal_eval(stripped)
            except (ValueError, SyntaxError):
                raise ConfigError(f"config.{field}: cannot parse {text!r} as a tuple") from None
            return tuple(value)
        return tuple(part.strip() for part in stripped.split(","))  # a,b,c
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if kind is None and current is None:
            return text
        raise ConfigError(f"config.{field}: cannot parse {text!r} as {getattr(kind, '__name__', kind)}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: Sequence[str]) -> ml_collections.ConfigDict:
    """Applies `a.b=v` or `--config.a.b=v` strings; unknown fields raise ConfigError naming them."""
    for item in overrides:
        text = item[len("--config."):] if item.startswith("--config.") else item
        if "=" not in text:
            raise ConfigError(f"override {item!r} is not of the form --config.a.b=value")
        field, raw = text.split("=", 1)
        parts = field.split(".")
        node = config
        for depth, part in enumerate(parts[:-1]):
            if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
                raise ConfigError(f"config.{'.'.join(parts[:depth + 1])}: no such field (override {item!r})")
            node = node[part]
        leaf = parts[-1]
        if leaf not in node:
            raise ConfigError(f"config.{field}: no such field (override {item!r})")
        if isinstance(node[leaf], ml_collections.ConfigDict):
            raise ConfigError(f"config.{field} is a section; override one of its fields")
        current = node[leaf]
        value = _parse_value(raw, current, node.get_type(leaf), field)
        try:
            node[leaf] = value
        except TypeError as e:
            raise ConfigError(f"config.{field}: {e}") from None
    return config


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """Loads a config file and applies overrides (unvalidated; call `validate` next)."""
    return apply_overrides(load_config_file(path), overrides)


# -- validation -----------------------------------------------------------------------------------

def _fail(field: str, message: str) -> None:
    raise ConfigError(f"config.{field}: {message}")


def _require(cond: bool, field: str, message: str) -> None:
    if not cond:
        _fail(field, message)


def _check_schema(config: ml_collections.ConfigDict, schema: ml_collections.ConfigDict, prefix: str) -> None:
    """Same keys as the schema (base.py), same leaf types (int may stand where float is expected)."""
    for key in config.keys():
        field = f"{prefix}{key}"
        if key not in schema:
            _fail(field, "unknown field (not in configs/base.py)")
        value, expected = config[key], schema[key]
        if isinstance(expected, ml_collections.ConfigDict):
            _require(isinstance(value, ml_collections.ConfigDict), field, "must be a section")
            _check_schema(value, expected, f"{field}.")
            continue
        kind = schema.get_type(key)
        if value is None or kind is type(None):
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if kind in (tuple, list):
            _require(isinstance(value, (tuple, list)), field, f"must be a tuple, got {value!r}")
            continue
        _require(isinstance(value, kind) and not (kind is int and isinstance(value, bool)), field,
                 f"must be {kind.__name__}, got {type(value).__name__} {value!r}")
    for key in schema.keys():
        if key not in config:
            _fail(f"{prefix}{key}", "missing (every field of configs/base.py must be present)")


def _positive_int(config, field: str, allow_zero: bool = False) -> None:
    value = _get(config, field)
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value >= 1)
    _require(ok, field, f"must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")


def _enum(config, field: str, choices: Sequence[str]) -> None:
    value = _get(config, field)
    _require(value in choices, field, f"must be one of {tuple(choices)}, got {value!r}")


def _range(config, field: str, low: float | None, high: float | None, *, low_open=False, high_open=False) -> None:
    value = _get(config, field)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    lo = "(" if low_open else "["
    hi = ")" if high_open else "]"
    _require(ok, field, f"must be in {lo}{low if low is not None else '-inf'}, "
                        f"{high if high is not None else 'inf'}{hi}, got {value!r}")


def _get(config, field: str):
    node = config
    for part in field.split("."):
        node = node[part]
    return node


def _strings(config, field: str) -> tuple[str, ...]:
    value = _get(config, field)
    _require(isinstance(value, (tuple, list)) and all(isinstance(v, str) and v for v in value), field,
             f"must be a tuple of non-empty strings, got {value!r}")
    return tuple(value)


def _existing(config, field: str, paths: Sequence[str]) -> None:
    for path in paths:
        _require(pathlib.Path(path).exists(), field, f"{path} does not exist")


def _top_k(config, field: str) -> None:
    value = _get(config, field)
    _require(value == -1 or (isinstance(value, int) and not isinstance(value, bool) and value >= 1), field,
             f"must be -1 (off) or a positive integer, got {value!r}")


def _optional_step(config, field: str) -> None:
    value = _get(config, field)
    _require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0), field,
             f"must be None (the latest checkpoint) or a non-negative step, got {value!r}")


def _urls(config, field: str) -> tuple[str, ...]:
    urls = _strings(config, field)
    for url in urls:
        _require(url.startswith(("http://", "https://")), field, f"{url!r} is not an http(s) base URL")
    return urls


FILTER_HARD_FORMATS = ("json", "jsonl", "parquet")


def check_filter_hard(config: ml_collections.ConfigDict, *, check_files: bool = True) -> tuple[str, ...]:
    """What `python -m rstar_jax.filter_hard` needs beyond `validate`; returns the input files.

    The inputs are filter_hard.input_files, else data.train_files (a stage-3 config's train_files
    is the hard subset this command writes, so it names the full set in filter_hard.input_files).
    """
    f = config.filter_hard
    output = f.output_file
    _require(isinstance(output, str) and output != "", "filter_hard.output_file", "must name the file to write")
    suffix = pathlib.Path(output).suffix.lower().lstrip(".")
    _require(suffix in FILTER_HARD_FORMATS, "filter_hard.output_file",
             f"must end in one of {tuple('.' + s for s in FILTER_HARD_FORMATS)}, got {output!r}")
    inputs = tuple(f.input_files) or tuple(config.data.train_files)
    field = "filter_hard.input_files" if f.input_files else "data.train_files"
    _require(len(inputs) > 0, "filter_hard.input_files",
             "no problems to filter: list files here or in data.train_files")
    resolved_output = pathlib.Path(output).resolve()
    for path in inputs:
        _require(pathlib.Path(path).resolve() != resolved_output, field,
                 f"{path} is also filter_hard.output_file; name the full problem set in filter_hard.input_files")
    _require(not (f.checkpoint_dir and config.model.hf_path), "filter_hard.checkpoint_dir",
             "set either model.hf_path (an HF directory) or filter_hard.checkpoint_dir (an orbax run), not both")
    _require(bool(f.checkpoint_dir or config.model.hf_path or config.train.init_from or f.generator_urls),
             "filter_hard.checkpoint_dir", "filtering needs a policy: set filter_hard.checkpoint_dir, "
             "model.hf_path, train.init_from or filter_hard.generator_urls")
    if check_files:
        _existing(config, field, inputs)
        if f.checkpoint_dir:
            _existing(config, "filter_hard.checkpoint_dir", [f.checkpoint_dir])
        elif config.train.init_from and not config.model.hf_path and not f.generator_urls:
            _existing(config, "train.init_from", [config.train.init_from])
    return inputs


def model_config(config: ml_collections.ConfigDict):
    """The `Qwen3Config` the config describes (preset plus non-None overrides)."""
    from rstar_jax.model.qwen3 import Qwen3Config

    overrides = {k: v for k, v in config.model.overrides.items() if v is not None}
    return Qwen3Config.preset(config.model.preset, dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                              remat_policy=config.model.remat_policy, attention_impl=config.model.attention_impl,
                              **overrides)


def _validate_mesh(config) -> None:
    for axis in MESH_AXES:
        value = config.mesh.get(axis)
        _require(isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1),
                 f"mesh.{axis}", f"must be a positive integer or -1, got {value!r}")
    _require(sum(config.mesh[a] == -1 for a in MESH_AXES) <= 1, "mesh", "at most one axis may be -1")
    rules = config.mesh.rules
    _require(isinstance(rules, (tuple, list)), "mesh.rules", "must be a tuple of (logical name, mesh axes) pairs")
    for i, rule in enumerate(rules):
        _require(isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str),
                 f"mesh.rules[{i}]", f"must be a (logical name, mesh axes) pair, got {rule!r}")
        axes = rule[1]
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        _require(isinstance(axes, (tuple, list)) and all(a in MESH_AXES for a in axes), f"mesh.rules[{i}]",
                 f"mesh axes must be None or names from {MESH_AXES}, got {rule[1]!r}")


def check_mesh(config: ml_collections.ConfigDict, device_count: int) -> tuple[int, int, int]:
    """Resolves -1 and checks the mesh product against the device count (run time)."""
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


def validate(config: ml_collections.ConfigDict, *, check_files: bool = True) -> ml_collections.ConfigDict:
    """Checks the whole config; returns it locked against new keys. Raises ConfigError naming the field."""
    _check_schema(config, base_config(), "")
    _enum(config, "mode", MODES)
    _require(isinstance(config.run_dir, str) and config.run_dir != "", "run_dir", "must be a non-empty path")
    _require(isinstance(config.seed, int), "seed", f"must be an integer, got {config.seed!r}")
    _require(isinstance(config.stage, str) and config.stage != "", "stage", "must be a non-empty label")

    try:
        model = model_config(config)
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from None
    except TypeError as e:
        raise ConfigError(f"config.model.overrides: {e}") from None
    _validate_mesh(config)
    for field in ("batch_size", "prompt_length", "new_tokens"):
        _positive_int(config, f"demo.{field}")

    _enum(config, "tokenizer.kind", TOKENIZER_KINDS)
    if config.tokenizer.kind == "hf":
        _require(bool(config.tokenizer.path or config.model.hf_path), "tokenizer.path",
                 "an hf tokenizer needs tokenizer.path or model.hf_path")

    # Data.
    _enum(config, "data.format", DATA_FORMATS)
    _enum(config, "data.on_bad_row", BAD_ROW_POLICIES)
    for key in ("question_key", "answer_key"):
        value = config.data[key]
        _require(isinstance(value, str) and value and all(value.split(".")), f"data.{key}",
                 f"must be 'auto' or a dotted path like 'reward_model.ground_truth', got {value!r}")
    _positive_int(config, "data.num_prompts_per_step")
    _positive_int(config, "data.synthetic.num_train")
    _positive_int(config, "data.synthetic.num_eval")
    _range(config, "data.synthetic.difficulty", 1, 3)
    from rstar_jax.data.synthetic import GENERATORS

    for kind in _strings(config, "data.synthetic.kinds"):
        _require(kind in GENERATORS, "data.synthetic.kinds", f"unknown kind {kind!r}; known: {sorted(GENERATORS)}")
    train_files = _strings(config, "data.train_files")
    eval_files = _strings(config, "data.eval_files")

    # Rollout.
    _enum(config, "rollout.backend", ROLLOUT_BACKENDS)
    servers = _strings(config, "rollout.servers")
    _enum(config, "rollout.scheduler", SCHEDULERS)
    _enum(config, "rollout.observation_style", OBSERVATION_STYLES)
    _enum(config, "rollout.template", TEMPLATE_STYLES)
    for field in ("rollouts_per_prompt", "max_turns", "response_budget", "max_prompt_length",
                  "observation_max_chars", "max_tool_calls_per_turn", "max_concurrency", "engine.slots",
                  "engine.max_length", "engine.page_size"):
        _positive_int(config, f"rollout.{field}")
    _positive_int(config, "rollout.engine.max_total_tokens", allow_zero=True)
    pool = config.rollout.engine.max_total_tokens
    _require(pool == 0 or pool >= config.rollout.engine.max_length, "rollout.engine.max_total_tokens",
             f"must be 0 (slots x max_length) or >= rollout.engine.max_length "
             f"({config.rollout.engine.max_length}) so that one sequence fits, got {pool}")
    _range(config, "rollout.temperature", 0.0, None, low_open=True)
    _range(config, "rollout.top_p", 0.0, 1.0, low_open=True)
    top_k = config.rollout.top_k
    _require(top_k == -1 or (isinstance(top_k, int) and top_k >= 1), "rollout.top_k",
             f"must be -1 (off) or a positive integer, got {top_k!r}")
    _require(bool(config.rollout.tool_name), "rollout.tool_name", "must be non-empty")
    sequence = config.rollout.max_prompt_length + config.rollout.response_budget
    if config.rollout.backend == "sglang":
        _require(len(servers) > 0 or config.rollout.local_servers > 0, "rollout.servers",
                 "the sglang backend needs at least one server URL (or rollout.local_servers > 0)")
        _require(not (servers and config.rollout.local_servers), "rollout.local_servers",
                 "set either rollout.servers (running servers) or rollout.local_servers (started here), not both")
    local_servers = config.rollout.local_servers
    _require(isinstance(local_servers, int) and local_servers >= 0, "rollout.local_servers",
             f"must be a non-negative integer, got {local_servers!r}")
    if config.rollout.backend == "jax" or local_servers:  # our engine: in-process or behind rstar_jax.serve
        _require(config.rollout.engine.max_length >= sequence, "rollout.engine.max_length",
                 f"must be >= rollout.max_prompt_length + rollout.response_budget = {sequence}, "
                 f"got {config.rollout.engine.max_length}")
        _require(model.max_position_embeddings >= config.rollout.engine.max_length, "rollout.engine.max_length",
                 f"exceeds the model's max_position_embeddings {model.max_position_embeddings}")

    # RL.
    _positive_int(config, "rl.group_size")
    # Equal sizes are allowed: G of G is plain GRPO with tools, the paper's RoC ablation (§5.3).
    _require(config.rl.group_size <= config.rollout.rollouts_per_prompt, "rl.group_size",
             f"must not exceed rollout.rollouts_per_prompt ({config.rollout.rollouts_per_prompt}): RoC keeps "
             f"group_size of the rollouts, got {config.rl.group_size}")
    _enum(config, "rl.roc_variant", ROC_VARIANTS)
    _range(config, "rl.roc_epsilon", 0.0, None, low_open=True)
    _positive_int(config, "rl.roc_min_per_class", allow_zero=True)
    _range(config, "rl.clip_low", 0.0, 1.0, high_open=True)
    _range(config, "rl.clip_high", 0.0, None)
    if config.rl.dual_clip is not None:
        _range(config, "rl.dual_clip", 1.0, None, low_open=True)
    _range(config, "rl.kl_coef", 0.0, None)
    _range(config, "rl.entropy_coef", 0.0, None)
    _positive_int(config, "rl.logprob_chunk_size")
    _positive_int(config, "rl.micro_batch_tokens")
    _positive_int(config, "sft.micro_batch_tokens")
    _require(config.rl.micro_batch_tokens >= sequence, "rl.micro_batch_tokens",
             f"must be >= rollout.max_prompt_length + rollout.response_budget = {sequence} (one whole "
             f"trajectory per micro-batch at least), got {config.rl.micro_batch_tokens}")

    # Optimiser and schedule.
    _range(config, "optim.lr", 0.0, None, low_open=True)
    _positive_int(config, "optim.warmup_steps", allow_zero=True)
    _enum(config, "optim.schedule", LR_SCHEDULES)
    _range(config, "optim.b1", 0.0, 1.0, high_open=True)
    _range(config, "optim.b2", 0.0, 1.0, high_open=True)
    _range(config, "optim.weight_decay", 0.0, None)
    _range(config, "optim.grad_clip", 0.0, None)
    _positive_int(config, "train.steps")
    _positive_int(config, "train.eval_every", allow_zero=True)
    _positive_int(config, "train.log_every")

    # SFT.
    _positive_int(config, "sft.epochs")
    _range(config, "sft.lr", 0.0, None, low_open=True)
    _range(config, "sft.warmup_ratio", 0.0, 1.0)
    _enum(config, "sft.schedule", LR_SCHEDULES)
    _positive_int(config, "sft.batch_size")
    _positive_int(config, "sft.max_length")
    _require(config.sft.max_length <= model.max_position_embeddings, "sft.max_length",
             f"exceeds the model's max_position_embeddings {model.max_position_embeddings}")
    sft_files = _strings(config, "sft.train_files")

    # Sandbox, checkpoints, eval.
    targets = _strings(config, "sandbox.targets")
    _positive_int(config, "sandbox.workers")
    _range(config, "sandbox.timeout_s", 0.0, None, low_open=True)
    _positive_int(config, "sandbox.memory_mb")
    _enum(config, "sandbox.verify_via", VERIFY_VIA)
    _require(not (config.sandbox.launch_local and targets), "sandbox.launch_local",
             "set it to False when sandbox.targets lists running servers")
    if config.mode in ("rl", "eval"):
        _require(config.sandbox.launch_local or len(targets) > 0, "sandbox.targets",
                 "tool calls need a sandbox: list targets or set sandbox.launch_local=True")
    _positive_int(config, "checkpoint.every_steps")
    _positive_int(config, "checkpoint.max_to_keep")
    _positive_int(config, "checkpoint.export_hf_every", allow_zero=True)
    export_every, every = config.checkpoint.export_hf_every, config.checkpoint.every_steps
    _require(export_every % every == 0, "checkpoint.export_hf_every",
             f"must be 0 or a multiple of checkpoint.every_steps ({every}): exports happen at saves, "
             f"got {export_every}")
    eval_sets = _strings(config, "eval.files")
    _positive_int(config, "eval.k")
    _range(config, "eval.temperature", 0.0, None)
    _range(config, "eval.top_p", 0.0, 1.0, low_open=True)
    _positive_int(config, "eval.max_turns")
    _positive_int(config, "eval.response_budget")
    _top_k(config, "eval.top_k")
    _optional_step(config, "eval.checkpoint_step")
    eval_urls = _urls(config, "eval.generator_urls")
    _require(not (config.model.hf_path and config.eval.checkpoint_dir), "eval.checkpoint_dir",
             "set either model.hf_path (an HF directory) or eval.checkpoint_dir (an orbax run), not both")
    _positive_int(config, "filter_hard.k")
    _strings(config, "filter_hard.input_files")
    _optional_step(config, "filter_hard.checkpoint_step")
    _urls(config, "filter_hard.generator_urls")

    # What each mode reads.
    synthetic = config.data.synthetic.enabled
    if config.mode == "rl":
        _require(synthetic or len(train_files) > 0, "data.train_files",
                 "RL needs training problems: list files or set data.synthetic.enabled=True")
    if config.mode == "sft" or (config.mode == "rl" and config.sft.before_rl):
        _require(synthetic or len(sft_files) > 0, "sft.train_files",
                 "SFT needs conversations: list files or set data.synthetic.enabled=True")
    if config.mode == "eval":
        _require(len(eval_sets) > 0 or synthetic, "eval.files", "evaluation needs at least one file")
        _require(bool(config.model.hf_path or config.eval.checkpoint_dir or eval_urls), "eval.checkpoint_dir",
                 "evaluation needs a policy: set model.hf_path, eval.checkpoint_dir or eval.generator_urls")
    if check_files:
        if config.mode == "rl" and not synthetic:
            _existing(config, "data.train_files", train_files)
        _existing(config, "data.eval_files", eval_files)
        if config.mode == "sft" or (config.mode == "rl" and config.sft.before_rl):
            _existing(config, "sft.train_files", sft_files)
        if config.mode == "eval":
            _existing(config, "eval.files", eval_sets)
            if config.eval.checkpoint_dir:
                _existing(config, "eval.checkpoint_dir", [config.eval.checkpoint_dir])
        if config.model.hf_path:
            _existing(config, "model.hf_path", [config.model.hf_path])
        if config.tokenizer.kind == "hf" and config.tokenizer.path:
            _existing(config, "tokenizer.path", [config.tokenizer.path])
        if config.train.init_from and config.mode == "rl":
            _existing(config, "train.init_from", [config.train.init_from])
    config.lock()
    return config


# -- command line ---------------------------------------------------------------------------------

def main() -> None:
    """`python -m rstar_jax.config --config=configs/stage3.py [--config.a.b=v ...]`: validate and print.

    Exits with status 2 and a message naming the field when the config is invalid.
    """
    import sys

    from absl import app, flags
    from ml_collections import config_flags

    config_flag = config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), "Path to a config file.",
                                                  lock_config=True)
    check_files = flags.DEFINE_bool("check_files", True, "Check that input files exist.")

    def run(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        try:
            config = validate(config_flag.value, check_files=check_files.value)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print(config.to_json_best_effort(indent=2))

    app.run(run)


if __name__ == "__main__":
    main()
