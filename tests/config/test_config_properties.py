"""A property over the whole schema: a bad value is refused naming its field, or it is a value the
libraries take.

Every int and float field of the shipped configs is set to 0, to a negative value and to absurd ones
(1e12, 1e30, nan, inf), and every string field to a name no enum has. Each such config is either

- accepted by `validate` (what every command runs), and then every `rstar_jax.config.resolve`
  function builds its settings from it without raising; or
- refused with a ConfigError whose lines are all `config.<field>: <message>`: exactly one on the field
  that was set, any other one a cross-field rule whose message names that field; never another
  exception, and never a settings dataclass's own name (`BatchConfig.rows`, `RocConfig.epsilon`).

Non-finite floats are never accepted. Values that cannot work (a temperature of 1e30, a negative
seed, a timeout past what the local sandbox takes) are refused, with the range that is allowed.
The slow tests run a sample through the real commands: one `error: config.<field>` line, exit 2.
"""

import copy
import dataclasses
import math
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from rstar_jax.config import REPO_CONFIGS, ConfigError, leaf_paths, load_config_file, resolve, validate

REPO = REPO_CONFIGS.parent
# tiny is the embedded default; stage3 holds the filter_hard settings; sft and eval the other modes.
CONFIGS = ("base", "tiny", "stage3", "sft", "eval")
BAD_INTS = (0, -1, 10**12)
BAD_FLOATS = (0.0, -0.5, 1e30, math.nan, math.inf, -math.inf)
BAD_NAME = "no_such_name"
# A settings dataclass's name in a message: the user set a config field, not `RocConfig.epsilon`.
INTERNAL = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:Config|Settings|Env|Scheduler)\b")
PROBLEM = re.compile(r"^config\.[A-Za-z0-9_.\[\]]+: \S")
# Fields whose valid values are a fixed set of names (`Checker.enum` or a settings dataclass's check).
ENUMS = {
    "mode", "model.preset", "model.dtype", "model.param_dtype", "model.remat_policy", "model.attention_impl",
    "tokenizer.kind", "data.format", "data.on_bad_row", "rollout.backend", "rollout.scheduler",
    "rollout.kv_scheduler.reservation", "rollout.template", "rollout.observation_style", "rollout.tool_call_parsing",
    "rl.roc_variant", "rl.roc_zero_advantage", "rl.policy_loss", "rl.advantage_estimator", "optim.schedule",
    "rl.loss_agg_mode", "rl.ratio_level", "rl.rollout_is", "rl.rollout_rs",
    "sft.schedule", "sandbox.api", "sandbox.preset", "sandbox.error_format", "sandbox.verify_via",
    "weight_sync.method", "weight_sync.mode", "weight_sync.dtype", "weight_sync.backend", "checkpoint.export_dtype",
}


def _field_type(config: ml_collections.ConfigDict, path: str):
    *sections, name = path.split(".")
    node = config
    for section in sections:
        node = node[section]
    return node.get_type(name)


def _set(config: ml_collections.ConfigDict, path: str, value) -> None:
    *sections, name = path.split(".")
    node = config
    for section in sections:
        node = node[section]
    node[name] = value


def cases(config: ml_collections.ConfigDict):
    """(field, value) for every int, float and string leaf (booleans and tuples aside)."""
    for path in leaf_paths(config):
        kind = _field_type(config, path)
        values = {int: BAD_INTS, float: BAD_FLOATS, str: (BAD_NAME,)}.get(kind, ())
        for value in values:
            yield path, value


def resolve_all(config: ml_collections.ConfigDict) -> None:
    """Every settings type a command builds from a validated config."""
    resolve.model_config(config)
    resolve.tool_env(config)
    rollout = resolve.loop_config(config)
    resolve.loop_config(config, "eval")
    resolve.roc_config(config)
    resolve.loss_config(config)
    resolve.optimizer_config(config)
    for total_steps in (1, 7, 1000):  # the SFT schedule over however many steps the data makes
        resolve.sft_optimizer_config(config, total_steps)
    for data_parallel in (1, 8):
        resolve.batch_config(config, data_parallel)
        resolve.rl_settings(config, data_parallel)
    # filter_hard samples at the rollout settings with its own temperature and turns where set
    # (rstar_jax.app.held_out.filter_hard_loop).
    f = config.filter_hard
    dataclasses.replace(rollout, **{name: f[name] for name in ("temperature", "max_turns") if f[name] is not None})


def _mentions(message: str, path: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(path)}(?!\w)", message) is not None


def report_problem(path: str, problems: list[str]) -> str | None:
    """What is wrong with a refusal of `path` (None: a good one)."""
    malformed = [p for p in problems if not PROBLEM.match(p)]
    internal = [p for p in problems if INTERNAL.search(p)]
    own = [p for p in problems if p.startswith(f"config.{path}:")]
    stray = [p for p in problems if not p.startswith(f"config.{path}:") and not _mentions(p.partition(": ")[2], path)]
    if malformed or internal or len(own) > 1 or stray or not problems:
        return f"refused with {problems}"
    return None


def violation(shipped: ml_collections.ConfigDict, path: str, value) -> str | None:
    config = copy.deepcopy(shipped)
    _set(config, path, value)
    try:
        validate(config, check_files=False)
    except ConfigError as e:
        return report_problem(path, e.problems)
    except Exception as e:  # noqa: BLE001  (what the property is about)
        return f"validate raised {type(e).__name__}: {e}"
    if isinstance(value, float) and not math.isfinite(value):
        return "accepted a non-finite value"
    try:
        resolve_all(config)
    except Exception as e:  # noqa: BLE001
        return f"accepted, then resolving raised {type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("name", CONFIGS)
def test_every_bad_value_is_refused_naming_its_field_or_resolves(name):
    shipped = load_config_file(REPO_CONFIGS / f"{name}.py")
    validate(copy.deepcopy(shipped), check_files=False)  # valid as shipped: each case changes one field
    found = [f"{path}={value!r}: {problem}" for path, value in cases(shipped)
             if (problem := violation(shipped, path, value)) is not None]
    assert not found, f"configs/{name}.py:\n" + "\n".join(found)


def test_the_cases_cover_every_numeric_and_enum_field():
    config = load_config_file(REPO_CONFIGS / "base.py")
    fields = {path for path, _ in cases(config)}
    assert {"seed", "rl.group_size", "optim.lr", "rollout.temperature", "sandbox.timeout_s",
            "filter_hard.temperature", "model.overrides.rope_theta"} <= fields  # placeholders included
    assert ENUMS <= fields


@pytest.mark.parametrize("name", ("base", "tiny"))
def test_every_enum_refuses_a_bad_name(name):
    refused = set()
    for path in sorted(ENUMS):
        config = load_config_file(REPO_CONFIGS / f"{name}.py")
        _set(config, path, BAD_NAME)
        with pytest.raises(ConfigError) as info:
            validate(config, check_files=False)
        assert [p for p in info.value.problems if p.startswith(f"config.{path}:")], (path, info.value.problems)
        refused.add(path)
    assert refused == ENUMS


# Values that may pass as numbers but cannot work: refused, saying what is allowed.
CANNOT_WORK = [
    ("base", "rollout.temperature", 1e30, r"must be in \(0\.0, 10\.0\]"),
    ("base", "eval.temperature", 1e30, r"must be in \[0\.0, 10\.0\]"),
    ("stage3", "filter_hard.temperature", -0.5, r"must be >= 0 and <= 10\.0 \(or None: rollout\.temperature\)"),
    ("stage3", "filter_hard.temperature", 1e30, r"must be >= 0 and <= 10\.0"),
    ("stage3", "filter_hard.max_turns", 0, r"must be >= 1 \(or None: rollout\.max_turns\), got 0"),
    ("base", "rollout.top_p", 2.0, r"must be in \(0, 1\]"),
    ("base", "optim.lr", math.nan, r"must be a finite number, got nan"),
    ("base", "rl.clip_high", math.inf, r"must be a finite number, got inf"),
    ("base", "optim.lr", 1e30, r"must be in \(0\.0, 1\.0\]"),
    ("tiny", "sft.lr", 1e30, r"must be in \(0\.0, 1\.0\]"),
    ("base", "optim.weight_decay", 1e30, r"weight_decay x the learning rate below 1"),
    ("base", "optim.grad_clip", 0.0, r"must be > 0\.0"),
    ("base", "seed", -1, r"must be an integer in \[0, 2\*\*63\)"),
    ("base", "seed", 2**64, r"must be an integer in \[0, 2\*\*63\)"),
    ("base", "data.shuffle_seed", -1, r"must be a non-negative integer, got -1"),
    ("base", "sandbox.timeout_s", -1.0, r"must be > 0"),
    ("base", "sandbox.timeout_s", 1e30, r"at most 300 s with sandbox\.launch_local=True"),
    ("base", "sandbox.verify_timeout_s", 1e30, r"at most 300 s with sandbox\.launch_local=True"),
    ("base", "sandbox.memory_mb", 10**12, r"at most 32768 with sandbox\.launch_local=True"),
    ("base", "rollout.ready_timeout_s", -1.0, r"must be in \(0\.0, 86400\.0\]"),
    ("base", "rollout.ready_timeout_s", 1e30, r"must be in \(0\.0, 86400\.0\]"),
    ("base", "rollout.generate_timeout_s", -1.0, r"must be in \[0\.0, 86400\.0\] \(0: no limit\)"),
    ("base", "rollout.kv_scheduler.reconcile_interval_s", 1e30, r"must be in \[0\.0, 86400\.0\]"),
    ("base", "sft.warmup_ratio", math.nan, r"must be a finite number"),
    ("base", "rl.roc_min_per_class", 10**12, r"must be at most rl\.group_size = 16"),
    ("base", "mesh.data", -1, r"only one axis may be -1 \(the remaining devices\) and mesh\.fsdp is -1"),
    ("base", "model.overrides.num_kv_heads", 10**12, r"must divide model\.overrides\.num_heads"),
    ("tiny", "model.overrides.num_heads", 3, r"must be a multiple of model\.overrides\.num_kv_heads \(2\)"),
]


@pytest.mark.parametrize("name, path, value, message", CANNOT_WORK)
def test_values_that_cannot_work_are_refused_with_the_allowed_range(name, path, value, message):
    config = load_config_file(REPO_CONFIGS / f"{name}.py")
    _set(config, path, value)
    with pytest.raises(ConfigError) as info:
        validate(config, check_files=False)
    assert len(info.value.problems) == 1, info.value.problems
    assert info.value.problems[0].startswith(f"config.{path}: "), info.value.problems
    assert re.search(message, info.value.problems[0]), info.value.problems


def test_values_that_mean_off_are_accepted():
    """0 (or -1) where it is documented as "off" or "default": accepted, and the settings build."""
    for name, path, value in [("base", "rollout.generate_timeout_s", 0.0), ("base", "train.eval_every", 0),
                              ("base", "rollout.engine.max_total_tokens", 0), ("base", "rl.clip_low", 0.0),
                              ("base", "rollout.engine.chunked_prefill_size", -1),
                              ("base", "rollout.kv_scheduler.reconcile_interval_s", 0.0),
                              ("base", "weight_sync.master_port", 0), ("base", "data.synthetic.seed", -1),
                              ("tiny", "sandbox.timeout_s", 300.0), ("tiny", "eval.temperature", 0.0)]:
        assert violation(load_config_file(REPO_CONFIGS / f"{name}.py"), path, value) is None, (name, path, value)
        config = load_config_file(REPO_CONFIGS / f"{name}.py")
        _set(config, path, value)
        resolve_all(validate(config, check_files=False))


def test_the_local_sandbox_limits_are_the_servers_defaults():
    """The limits `validate` puts on sandbox.* with launch_local are those the local server starts with."""
    from sandbox_service.server import ServerOptions

    from rstar_jax.config import LOCAL_SANDBOX_MAX_MEMORY_MB, LOCAL_SANDBOX_MAX_TIMEOUT_S

    options = ServerOptions()
    assert (LOCAL_SANDBOX_MAX_TIMEOUT_S, LOCAL_SANDBOX_MAX_MEMORY_MB) == (options.max_timeout_s, options.max_memory_mb)


# -- synthetic data and data.train_files ----------------------------------------------------------

@pytest.mark.parametrize("field", ["data.train_files", "sft.train_files"])
def test_files_beside_synthetic_data_are_refused(field):
    """With data.synthetic.enabled the run generates its problems and conversations; files listed
    beside them would be silently ignored."""
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    assert config.data.synthetic.enabled and not config.data.train_files and not config.sft.train_files
    _set(config, field, ("problems.jsonl",))
    with pytest.raises(ConfigError) as info:
        validate(config, check_files=False)
    assert len(info.value.problems) == 1, info.value.problems
    problem = info.value.problems[0]
    assert problem.startswith(f"config.{field}: ") and "data.synthetic.enabled=True" in problem, problem
    assert "set data.synthetic.enabled=False" in problem, problem
    _set(config, "data.synthetic.enabled", False)
    _set(config, "sft.templates", ("rstar2",))
    validate(config, check_files=False)  # the files are what the run trains on now


# -- the real commands ----------------------------------------------------------------------------

def _run(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env={**os.environ}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("module, override, field", [
    ("rstar_jax.config", "--config.rollout.temperature=1e30", "rollout.temperature"),
    ("rstar_jax.config", "--config.optim.lr=nan", "optim.lr"),
    ("rstar_jax.config", "--config.sandbox.timeout_s=-1", "sandbox.timeout_s"),
    ("rstar_jax.config", "--config.mesh.data=-1", "mesh.data"),
    ("rstar_jax.config", "--config.rl.roc_variant=no_such_name", "rl.roc_variant"),
    ("rstar_jax.config", "--config.model.overrides.num_kv_heads=1000000000000", "model.overrides.num_kv_heads"),
    ("rstar_jax.launch", "--config.seed=-1", "seed"),
])
def test_a_bad_value_on_the_command_line_is_one_error_line(module, override, field):
    result = _run(module, "--config=configs/tiny.py", override)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: config.{field}: "), result.stderr[-3000:]
    assert not INTERNAL.search(errors[0]), errors
