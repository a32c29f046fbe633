"""Config files and their validation (ml-collections).

`configs/base.py` is the schema: a config may only hold the fields it defines, with the same types.
Configs come from a file, then change on the command line (`--config.a.b=v`, parsed by
`ml_collections.config_flags` in `rstar_jax.config.cli`) or in code:

    config = load_config_file("configs/stage1.py")
    config.update_from_flattened_dict({"rl.clip_high": 0.3})
    config = validate(config)          # every problem at once; locked against new fields

`validate` runs before any heavy work and raises one `ConfigError` listing every problem, one line
each, naming the field (`config.rl.clip_high: must be >= 0, got -1`): unknown and missing
fields (with did-you-mean suggestions), types, ranges, enums and cross-field rules. With
`check_files=True` (what `launch`, `evaluate` and `filter_hard` use) it also checks the run's
inputs: the files and directories the mode reads (training, SFT and evaluation files, the policy,
the tokenizer) are named and exist. The mesh product against the device count is checked at run
time by `check_mesh` (the device count is not known here).

`python -m rstar_jax.config --config=FILE [--config.a.b=v ...] [--check_files]` checks and prints a
config without starting any work: it validates every value and prints the config as JSON (exit 2
with one `error:` line per problem otherwise). The shipped stage configs leave the run's inputs to
the command line (`data.train_files`, `model.hf_path`, ...; stage 3 trains on a file that
`filter_hard` writes first), so without `--check_files` missing inputs do not fail the check: they
are listed on stderr as `note:` lines naming the fields to set. `--check_files` makes them errors,
as a run does.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import pathlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import ml_collections

# The libraries' enums, from their jax-free modules, and their settings types through `resolve`:
# checking a config imports no JAX (tests/config/test_config_check.py), and each rule lives once, with the
# type that holds the value.
from rstar_jax.agent.conversation import CONVERSATION_TEMPLATES
from rstar_jax.agent.reward import SCORER_MODES
from rstar_jax.agent.template import TEMPLATE_STYLES
from rstar_jax.config import resolve
from rstar_jax.data.synthetic import BEHAVIOURS, FIX_BUGS, GENERATORS
from rstar_jax.engine.settings import DECODE_ATTENTIONS, LAYER_LAYOUTS
from rstar_jax.engine.weight_transfer import BACKENDS as WEIGHT_SYNC_BACKENDS
from rstar_jax.errors import ConfigError, UserError  # noqa: F401  (re-exported)
from rstar_jax.model.config import DTYPE_NAMES, MESH_AXES
from rstar_jax.rollout.scheduler import RESERVATIONS
from rstar_jax.train.run_files import CheckpointError, stored_config
from rstar_jax.train.settings import SYNC_METHODS, SYNC_MODES

T = TypeVar("T")

SANDBOX_APIS = ("grpc", "sandbox_fusion")  # config.sandbox.api
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")  # sandbox.preimport_modules
REPO_CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = REPO_CONFIGS / "tiny.py"
BASE_CONFIG = REPO_CONFIGS / "base.py"

# The enums of fields that no settings dataclass checks; the others (RoC variant, observation
# style, LR schedule, ...) are checked by building the dataclass that holds them (`resolve`).
MODES = ("rl", "sft", "eval")
TOKENIZER_KINDS = ("byte", "hf")
DATA_FORMATS = ("auto", "json", "jsonl", "parquet")
BAD_ROW_POLICIES = ("error", "skip")
ROLLOUT_BACKENDS = ("jax", "sglang")
SCHEDULERS = ("kv", "round_robin")
FILTER_HARD_FORMATS = ("json", "jsonl", "parquet")

# Bounds on values that pass as numbers but cannot work.
MAX_TEMPERATURE = 10.0  # generous: past a few, sampling is near uniform over the vocabulary
MAX_LR = 1.0  # Adam moves each weight by about the rate per step: more wipes out any initialisation
MAX_SECONDS = 86400.0  # timeouts and intervals: a day (the local verifier's poll() overflows at ~24.8 days)
MAX_SEED = 2**63  # jax.random.key takes an int64
LOW_PRECISION_DTYPES = ("bfloat16", "float16")  # model.param_dtype values optim.master_weights keeps a master of
# What the local sandbox server (sandbox.launch_local) accepts per call: sandbox_service.server's
# ServerOptions defaults (--max_timeout_s, --max_memory_mb), which `builders.sandbox` leaves as they are.
LOCAL_SANDBOX_MAX_TIMEOUT_S = 300.0
LOCAL_SANDBOX_MAX_MEMORY_MB = 32768


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


# -- field names and suggestions ------------------------------------------------------------------

def leaf_paths(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Dotted paths of every non-section field, in definition order."""
    paths = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            paths.extend(leaf_paths(value, f"{prefix}{key}."))
        else:
            paths.append(f"{prefix}{key}")
    return paths


def did_you_mean(path: str, candidates: Sequence[str]) -> str:
    """The " did you mean a or b?" hint for a mistyped dotted path ("" when nothing is close).

    Close spellings (`rl.clip_hihg` -> rl.clip_high) come first, then fields of the same name in
    other sections (`train.lr` -> optim.lr, sft.lr): a field put in the wrong section.
    """
    name = path.rpartition(".")[2]
    scored = sorted(((difflib.SequenceMatcher(None, path, c).ratio(), c) for c in candidates), reverse=True)
    best = scored[0][0] if scored else 0.0
    # Only the spellings about as close as the closest: input_file -> input_files, not output_file.
    close = [c for score, c in scored[:3] if score >= max(0.75, best - 0.05)]
    same_name = [c for c in candidates if c.rpartition(".")[2] == name]
    picks = [c for c in dict.fromkeys(close + same_name) if c != path][:3]
    if not picks:
        return ""
    return " did you mean " + (picks[0] if len(picks) == 1 else ", ".join(picks[:-1]) + " or " + picks[-1]) + "?"


def unknown_field(path: str, candidates: Sequence[str]) -> str:
    """The problem line for a field that is not in the schema."""
    hint = did_you_mean(path, candidates)
    return f"config.{path}: unknown field (not in configs/base.py)" + (f";{hint}" if hint else "")


# -- the problem collector ------------------------------------------------------------------------

_FIELD = re.compile(r"^config\.([^:\s]+):")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Checker:
    """Collects every problem of a config instead of stopping at the first.

    Each check records `config.<field>: <message>` and returns whether it passed. A check on a
    field that already failed (or whose section did) is skipped, so rules that combine fields run
    only on valid inputs: guard them with `ok(...)` or with the results of earlier checks.
    """

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config
        self.problems: list[str] = []
        self._failed: list[str] = []

    def fail(self, field: str, message: str) -> bool:
        self.problems.append(f"config.{field}: {message}")
        self._failed.append(field)
        return False

    def require(self, condition: bool, field: str, message: str) -> bool:
        return True if condition else self.fail(field, message)

    def ok(self, *fields: str) -> bool:
        """No problem recorded so far on these fields, their sections or their sub-fields."""
        def related(a: str, b: str) -> bool:
            return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))
        return not any(related(field, bad) for field in fields for bad in self._failed)

    def build(self, make: Callable[[], T]) -> T | None:
        """`make()`, or None after recording its ConfigError's problems: how a settings dataclass's
        own checks (`resolve.loss_config(config)`, built with `errors.from_fields`) join these."""
        try:
            return make()
        except TypeError:
            if not self.problems:
                raise  # no mistyped field to explain it: a bug, not the user's
            return None  # a field of the wrong type, already reported by the schema check
        except ConfigError as e:
            for problem in e.problems:
                match = _FIELD.match(problem)
                field = match.group(1) if match else ""
                if field and not self.ok(field):
                    continue  # already reported by an earlier check (a nan the dataclass also refuses)
                self.problems.append(problem)
                self._failed.append(field)
            return None

    def value(self, field: str) -> Any:
        return resolve.config_value(self.config, field)

    def raise_if_any(self) -> None:
        if self.problems:
            raise ConfigError(list(dict.fromkeys(self.problems)))

    # -- field checks -----------------------------------------------------------------------------

    def positive_int(self, field: str, allow_zero: bool = False) -> bool:
        if not self.ok(field):
            return False
        value = self.value(field)
        good = _is_int(value) and (value >= 0 if allow_zero else value >= 1)
        return self.require(good, field, f"must be a {'non-negative' if allow_zero else 'positive'} integer, "
                                         f"got {value!r}")

    def enum(self, field: str, choices: Sequence[str]) -> bool:
        if not self.ok(field):
            return False
        value = self.value(field)
        return self.require(value in choices, field, f"must be one of {tuple(choices)}, got {value!r}")

    def range(self, field: str, low: float | None, high: float | None, *, low_open: bool = False,
              high_open: bool = False) -> bool:
        if not self.ok(field):
            return False
        value = self.value(field)
        good = _is_number(value)
        if good and low is not None:
            good = value > low if low_open else value >= low
        if good and high is not None:
            good = value < high if high_open else value <= high
        if high is None and low is not None:
            allowed = f"{'>' if low_open else '>='} {low}"
        elif low is None and high is not None:
            allowed = f"{'<' if high_open else '<='} {high}"
        else:
            allowed = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        return self.require(good, field, f"must be {allowed}, got {value!r}")

    def strings(self, field: str) -> tuple[str, ...]:
        """The field as a tuple of non-empty strings (() after a problem)."""
        if not self.ok(field):
            return ()
        value = self.value(field)
        good = isinstance(value, (tuple, list)) and all(isinstance(v, str) and v for v in value)
        if not self.require(good, field, f"must be a tuple of non-empty strings, got {value!r}"):
            return ()
        return tuple(value)

    def urls(self, field: str) -> tuple[str, ...]:
        urls = self.strings(field)
        bad = [url for url in urls if not url.startswith(("http://", "https://"))]
        if bad:
            self.fail(field, f"{bad[0]!r} is not an http(s) base URL")
            return ()
        return urls

    def top_k(self, field: str) -> bool:
        if not self.ok(field):
            return False
        value = self.value(field)
        return self.require(value == -1 or (_is_int(value) and value >= 1), field,
                            f"must be -1 (off) or a positive integer, got {value!r}")

    def optional_step(self, field: str) -> bool:
        if not self.ok(field):
            return False
        value = self.value(field)
        return self.require(value is None or (_is_int(value) and value >= 0), field,
                            f"must be None (the latest checkpoint) or a non-negative step, got {value!r}")

    def non_empty(self, field: str, what: str) -> bool:
        if not self.ok(field):
            return False
        value = self.value(field)
        return self.require(isinstance(value, str) and value != "", field, f"must be {what}, got {value!r}")

    def existing(self, field: str, paths: Iterable[str], hint: Callable[[str], str] = lambda path: "") -> bool:
        good = True
        for path in paths:
            if not pathlib.Path(path).exists():
                good = self.fail(field, f"{path} does not exist{hint(path)}")
        return good


# -- schema ---------------------------------------------------------------------------------------

def _check_schema(check: Checker, config: ml_collections.ConfigDict, schema: ml_collections.ConfigDict,
                  prefix: str = "", leaves: Sequence[str] | None = None) -> bool:
    """Same fields as the schema (base.py) and the same leaf types (an int may stand for a float).

    Records every unknown, missing or mistyped field; returns False when the config's shape differs
    (a missing field or section), after which the value checks cannot run.
    """
    leaves = leaf_paths(schema) if leaves is None else leaves
    complete = True
    for key in config.keys():
        field = f"{prefix}{key}"
        if key not in schema:
            check.problems.append(unknown_field(field, leaves))
            continue
        value, expected = config[key], schema[key]
        if isinstance(expected, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                complete = check.fail(field, f"must be a section (of {', '.join(expected.keys())}), got {value!r}")
                continue
            complete &= _check_schema(check, value, expected, f"{field}.", leaves)
            continue
        if isinstance(value, ml_collections.ConfigDict):
            complete = check.fail(field, "must be a value, not a section")
            continue
        kind = schema.get_type(key)
        if value is None or kind is type(None):
            continue
        if kind is float and _is_int(value):
            continue
        if kind in (tuple, list):
            check.require(isinstance(value, (tuple, list)), field, f"must be a tuple, got {value!r}")
            continue
        if check.require(isinstance(value, kind) and not (kind is int and isinstance(value, bool)), field,
                         f"must be {kind.__name__}, got {type(value).__name__} {value!r}") and kind is float:
            # nan passes every `x < bound` check, and no field means anything by inf.
            check.require(math.isfinite(value), field, f"must be a finite number, got {value!r}")
    for key in schema.keys():
        if key not in config:
            complete = check.fail(f"{prefix}{key}", "missing (every field of configs/base.py must be present)")
    return complete


# -- model and mesh -------------------------------------------------------------------------------

def _check_mesh_fields(check: Checker) -> None:
    mesh = check.config.mesh
    sizes_ok = True
    for axis in MESH_AXES:
        value = mesh.get(axis)
        sizes_ok &= check.require(_is_int(value) and (value >= 1 or value == -1), f"mesh.{axis}",
                                  f"must be a positive integer or -1, got {value!r}")
    remaining = [a for a in MESH_AXES if mesh[a] == -1] if sizes_ok else []
    # Blame the axes beside the one that takes the rest: fsdp, where base.py puts it.
    keep = "fsdp" if "fsdp" in remaining else remaining[0] if remaining else None
    for axis in remaining:
        if axis != keep:
            check.fail(f"mesh.{axis}", f"only one axis may be -1 (the remaining devices) and mesh.{keep} is -1: "
                                       f"give mesh.{axis} a size, got -1")
    rules = mesh.rules
    if not check.require(isinstance(rules, (tuple, list)), "mesh.rules",
                         "must be a tuple of (logical name, mesh axes) pairs"):
        return
    for i, rule in enumerate(rules):
        if not check.require(isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str),
                             f"mesh.rules[{i}]", f"must be a (logical name, mesh axes) pair, got {rule!r}"):
            continue
        axes = rule[1]
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        check.require(isinstance(axes, (tuple, list)) and all(a in MESH_AXES for a in axes), f"mesh.rules[{i}]",
                      f"mesh axes must be None or names from {MESH_AXES}, got {rule[1]!r}")


# -- filter_hard's preconditions ------------------------------------------------------------------

def _check_tokenizer_source(check: Checker) -> None:
    config = check.config
    if config.tokenizer.kind == "hf":
        check.require(bool(config.tokenizer.path or config.model.hf_path or config.train.init_from), "tokenizer.path",
                      "an hf tokenizer needs files: set tokenizer.path or model.hf_path (or continue a run with "
                      "train.init_from)")


def missing_tokenizer(init_from: str) -> str:
    """The problem with an hf tokenizer that names no files: only `train.init_from`, whose run names none."""
    return (f"an hf tokenizer needs files: tokenizer.path and model.hf_path are unset, and train.init_from="
            f"{init_from!r} holds no run that names its tokenizer (a stage's checkpoints store their config); "
            f"set tokenizer.path or model.hf_path")


def _check_previous_run_tokenizer(check: Checker) -> None:
    """With only `train.init_from` naming the tokenizer, the run there must name one (as launch reads it)."""
    config = check.config
    if config.tokenizer.kind != "hf" or config.tokenizer.path or config.model.hf_path or not config.train.init_from \
            or not pathlib.Path(config.train.init_from).exists() or not check.ok("tokenizer.path", "train.init_from"):
        return
    try:
        stored = stored_config(config.train.init_from) or {}
    except CheckpointError as e:
        check.fail("train.init_from", str(e))
        return
    model, tokenizer = stored.get("model") or {}, stored.get("tokenizer") or {}
    check.require(bool(tokenizer.get("path") or model.get("hf_path")), "tokenizer.path",
                  missing_tokenizer(config.train.init_from))


def check_filter_hard(config: ml_collections.ConfigDict, *, check_files: bool = True) -> tuple[str, ...]:
    """What `python -m rstar_jax.filter_hard` needs beyond `validate`; returns the input files.

    The inputs are filter_hard.input_files, else data.train_files (a stage-3 config's train_files
    is the hard subset this command writes, so it names the full set in filter_hard.input_files).
    Raises one ConfigError listing every problem.
    """
    check = Checker(config)
    f = config.filter_hard
    output = f.output_file
    if check.non_empty("filter_hard.output_file", "the path of the file to write"):
        suffix = pathlib.Path(output).suffix.lower().lstrip(".")
        check.require(suffix in FILTER_HARD_FORMATS, "filter_hard.output_file",
                      f"must end in one of {tuple('.' + s for s in FILTER_HARD_FORMATS)}, got {output!r}")
    inputs = tuple(f.input_files) or tuple(config.data.train_files)
    field = "filter_hard.input_files" if f.input_files else "data.train_files"
    check.require(len(inputs) > 0, "filter_hard.input_files",
                  "no problems to filter: list files here or in data.train_files")
    if output:
        resolved_output = pathlib.Path(output).resolve()
        for path in inputs:
            check.require(pathlib.Path(path).resolve() != resolved_output, field,
                          f"{path} is also filter_hard.output_file; name the full problem set in "
                          f"filter_hard.input_files")
    check.require(not (f.checkpoint_dir and config.model.hf_path), "filter_hard.checkpoint_dir",
                  "set either model.hf_path (an HF directory) or filter_hard.checkpoint_dir (an orbax run), not both")
    check.require(bool(f.checkpoint_dir or config.model.hf_path or config.train.init_from or f.generator_urls),
                  "filter_hard.checkpoint_dir", "filtering needs a policy: set filter_hard.checkpoint_dir, "
                  "model.hf_path, train.init_from or filter_hard.generator_urls")
    _check_tokenizer_source(check)
    if check_files:
        if check.ok(field):
            check.existing(field, inputs)
        if f.checkpoint_dir:
            check.existing("filter_hard.checkpoint_dir", [f.checkpoint_dir])
        elif config.train.init_from and not config.model.hf_path and not f.generator_urls:
            check.existing("train.init_from", [config.train.init_from])
    check.raise_if_any()
    return inputs


# -- validation -----------------------------------------------------------------------------------

def validate(config: ml_collections.ConfigDict, *, check_files: bool = True) -> ml_collections.ConfigDict:
    """Checks the whole config; returns it locked against new fields.

    Raises one ConfigError listing every problem (`config.<field>: <message>` per line). Rules that
    depend on a field with a problem are skipped rather than reported twice. `check_files`: also
    check the run's inputs (named and existing; see the module docstring).
    """
    check = Checker(config)
    if not _check_schema(check, config, base_config()):
        check.raise_if_any()  # a missing field or section: the value checks below would need it
    _check_values(check)
    if check_files:
        _check_inputs(check)
    check.raise_if_any()
    config.lock()
    return config


def _check_values(check: Checker) -> None:
    config = check.config
    check.enum("mode", MODES)
    check.non_empty("run_dir", "a non-empty path")
    if check.ok("seed"):  # numpy's SeedSequence refuses negative seeds (sampling seeds, RoC's draw)
        check.require(_is_int(config.seed) and 0 <= config.seed < MAX_SEED, "seed",
                      f"must be an integer in [0, 2**63) (numpy and JAX seeds), got {config.seed!r}")
    check.non_empty("stage", "a non-empty label")

    model = check.build(lambda: resolve.model_config(config)) if check.ok("model") else None
    _check_mesh_fields(check)
    check.enum("tokenizer.kind", TOKENIZER_KINDS)

    # Data.
    check.enum("data.format", DATA_FORMATS)
    check.enum("data.on_bad_row", BAD_ROW_POLICIES)
    for key in ("question_key", "answer_key"):
        value = config.data[key]
        check.require(isinstance(value, str) and value and all(value.split(".")), f"data.{key}",
                      f"must be 'auto' or a dotted path like 'reward_model.ground_truth', got {value!r}")
    check.positive_int("data.num_prompts_per_step")
    check.positive_int("data.shuffle_seed", allow_zero=True)  # numpy's default_rng refuses negative seeds
    check.positive_int("data.synthetic.num_train")
    check.positive_int("data.synthetic.num_eval")
    if check.ok("data.synthetic.sft_stages"):
        stages = config.data.synthetic.sft_stages

        def good_stage(stage) -> bool:
            if not (isinstance(stage, (tuple, list)) and len(stage) == 2 and _is_int(stage[0]) and stage[0] >= 0):
                return False
            mix = stage[1]
            return (isinstance(mix, (tuple, list)) and len(mix) == len(BEHAVIOURS)
                    and all(_is_number(w) and w >= 0 for w in mix) and sum(mix) > 0)

        check.require(len(stages) > 0 and all(map(good_stage, stages)), "data.synthetic.sft_stages",
                      f"must be (conversations >= 0, ({len(BEHAVIOURS)} non-negative weights for {BEHAVIOURS} with a "
                      f"positive sum)) per stage, got {stages!r}")
    check.range("data.synthetic.difficulty", 1, 3)
    check.enum("data.synthetic.fix_bug", FIX_BUGS)
    for kind in check.strings("data.synthetic.kinds"):
        check.require(kind in GENERATORS, "data.synthetic.kinds", f"unknown kind {kind!r}; known: {sorted(GENERATORS)}")
    train_files = check.strings("data.train_files")
    check.strings("data.eval_files")
    if config.data.synthetic.enabled and train_files:  # builders.prepare_data would ignore them
        check.fail("data.train_files", "data.synthetic.enabled=True generates the training problems into run_dir, "
                                       "so these files would be ignored: set data.synthetic.enabled=False to train "
                                       "on them, or leave data.train_files empty")

    # Rollout.
    r = config.rollout
    check.enum("rollout.backend", ROLLOUT_BACKENDS)
    servers = check.strings("rollout.servers")
    check.enum("rollout.scheduler", SCHEDULERS)
    check.enum("rollout.kv_scheduler.reservation", RESERVATIONS)
    check.range("rollout.kv_scheduler.new_token_ratio", 0, 1, low_open=True)
    check.range("rollout.kv_scheduler.budget_fraction", 0, 1, low_open=True)
    check.range("rollout.kv_scheduler.reconcile_interval_s", 0.0, MAX_SECONDS)
    check.positive_int("rollout.kv_scheduler.group_block")
    check.enum("rollout.template", TEMPLATE_STYLES)
    # Turns, budget, sampling and the tool protocol: the rollout loop's own checks, for RL's
    # settings and for the evaluation protocol's.
    check.build(lambda: resolve.loop_config(config))
    check.build(lambda: resolve.loop_config(config, "eval"))
    for field in ("rollouts_per_prompt", "max_prompt_length", "max_concurrency", "engine.slots", "engine.max_length",
                  "engine.page_size"):
        check.positive_int(f"rollout.{field}")
    if check.positive_int("rollout.workers") and r.workers > 1 and check.ok("rollout.backend"):
        check.require(r.backend == "sglang", "rollout.workers",
                      f"worker processes reach generators over HTTP: {r.workers} workers need "
                      f"rollout.backend='sglang' (the in-process JaxEngine has rollout.workers = 1), "
                      f"got rollout.backend={r.backend!r}")
    if check.positive_int("rollout.engine.max_total_tokens", allow_zero=True) and check.ok("rollout.engine.max_length"):
        pool = r.engine.max_total_tokens
        check.require(pool == 0 or pool >= r.engine.max_length, "rollout.engine.max_total_tokens",
                      f"must be 0 (slots x max_length) or >= rollout.engine.max_length ({r.engine.max_length}) "
                      f"so that one sequence fits, got {pool}")
    check.range("rollout.engine.mem_fraction_static", 0, 1, high_open=True)
    if check.ok("rollout.engine.chunked_prefill_size"):
        chunk = r.engine.chunked_prefill_size
        check.require(_is_int(chunk) and chunk >= -1, "rollout.engine.chunked_prefill_size",
                      f"must be a positive integer, or 0 or -1 (off), got {chunk!r}")
    check.enum("rollout.engine.layer_layout", LAYER_LAYOUTS)
    check.enum("rollout.engine.decode_attention", DECODE_ATTENTIONS)
    # Training log-probs divide the logits by the sampling temperature: RL cannot sample greedily.
    check.range("rollout.temperature", 0.0, MAX_TEMPERATURE, low_open=True)
    check.range("eval.temperature", 0.0, MAX_TEMPERATURE)  # 0: greedy
    f = config.filter_hard  # None: the rollout's
    if check.ok("filter_hard.temperature") and f.temperature is not None:
        check.require(0 <= f.temperature <= MAX_TEMPERATURE, "filter_hard.temperature",
                      f"must be >= 0 and <= {MAX_TEMPERATURE} (or None: rollout.temperature), got {f.temperature!r}")
    if check.ok("filter_hard.max_turns") and f.max_turns is not None:
        check.require(f.max_turns >= 1, "filter_hard.max_turns",
                      f"must be >= 1 (or None: rollout.max_turns), got {f.max_turns!r}")
    check.non_empty("rollout.tool_name", "the tool's name")
    local_servers_ok = check.positive_int("rollout.local_servers", allow_zero=True)
    if r.backend == "sglang" and local_servers_ok and check.ok("rollout.servers"):
        check.require(len(servers) > 0 or r.local_servers > 0, "rollout.servers",
                      "the sglang backend needs at least one server URL (or rollout.local_servers > 0)")
        check.require(not (servers and r.local_servers), "rollout.local_servers",
                      "set either rollout.servers (running servers) or rollout.local_servers (started here), not both")
    sequence = None
    if check.ok("rollout.max_prompt_length", "rollout.response_budget"):
        sequence = r.max_prompt_length + r.response_budget
    # Our engine holds whole sequences: in-process, or behind rstar_jax.serve (local servers).
    if (r.backend == "jax" or (local_servers_ok and r.local_servers)) and check.ok("rollout.engine.max_length"):
        if sequence is not None:
            check.require(r.engine.max_length >= sequence, "rollout.engine.max_length",
                          f"must be >= rollout.max_prompt_length + rollout.response_budget = {sequence}, "
                          f"got {r.engine.max_length}")
        if model is not None:
            check.require(model.max_position_embeddings >= r.engine.max_length, "rollout.engine.max_length",
                          f"exceeds the model's max_position_embeddings {model.max_position_embeddings}")

    # RL: RoC's and the loss's own checks, then what spans fields.
    rl = config.rl
    check.build(lambda: resolve.roc_config(config))
    if check.ok("rl.roc_min_per_class", "rl.group_size"):  # more makes the release counts in rl/roc.py negative
        check.require(rl.roc_min_per_class <= rl.group_size, "rl.roc_min_per_class",
                      f"must be at most rl.group_size = {rl.group_size} (the release variant keeps at least this "
                      f"many of each class among rl.group_size), got {rl.roc_min_per_class}")
    check.build(lambda: resolve.loss_config(config))
    if check.positive_int("rl.max_staleness", allow_zero=True) and rl.max_staleness >= 1 \
            and r.backend != "jax" and check.ok("weight_sync.mode"):
        check.require(config.weight_sync.mode in ("pause", "in_place", "abort"), "weight_sync.mode",
                      f"must be 'pause', 'in_place' or 'abort' under rl.max_staleness={rl.max_staleness}: weights are pushed "
                      f"while rollouts run, and 'wait' holds each push until the servers drain, got "
                      f"{config.weight_sync.mode!r}")
    for field in ("rl.rollout_is", "rl.rollout_rs"):
        if resolve.config_value(config, field) is not None and rl.use_sampler_logprobs:
            check.fail(field, "compares the trainer's recomputed log-probs with the sampler's, which "
                              "rl.use_sampler_logprobs=True makes the same: set it to False")
    # Equal sizes are allowed: G of G is plain GRPO with tools, the paper's RoC ablation (§5.3).
    if check.ok("rl.group_size", "rollout.rollouts_per_prompt"):
        check.require(rl.group_size <= r.rollouts_per_prompt, "rl.group_size",
                      f"must not exceed rollout.rollouts_per_prompt ({r.rollouts_per_prompt}): RoC keeps "
                      f"group_size of the rollouts, got {rl.group_size}")
    if check.range("rl.kl_coef", 0.0, None):
        check.require(rl.kl_coef == 0, "rl.kl_coef", "must be 0: the KL term needs a reference policy, which this "
                                                     "trainer does not keep (GRPO-RoC has no KL term, spec §5.3)")
    check.positive_int("rl.logprob_chunk_size")
    if check.positive_int("rl.micro_batch_tokens") and sequence is not None:
        if check.require(rl.micro_batch_tokens >= sequence, "rl.micro_batch_tokens",
                         f"must be >= rollout.max_prompt_length + rollout.response_budget = {sequence} (one whole "
                         f"trajectory per micro-batch at least), got {rl.micro_batch_tokens}") \
                and check.ok("rl.group_size", "data.num_prompts_per_step"):  # the micro-batch count's inputs
            check.build(lambda: resolve.batch_config(config))
    check.positive_int("sft.micro_batch_tokens")

    # Optimiser and schedule (AdamW's own checks), steps and evaluations.
    if check.positive_int("train.steps"):
        check.build(lambda: resolve.optimizer_config(config))
    if check.positive_int("train.eval_every", allow_zero=True) and config.train.eval_every and config.mode == "rl":
        # RL's held-out evaluation samples at config.eval's settings on the training engine.
        if r.backend == "jax" and check.ok("rollout.max_prompt_length", "eval.response_budget",
                                           "rollout.engine.max_length"):
            need = r.max_prompt_length + config.eval.response_budget
            check.require(need <= r.engine.max_length, "eval.response_budget",
                          f"rollout.max_prompt_length + eval.response_budget = {need} must fit the training engine's "
                          f"rollout.engine.max_length ({r.engine.max_length}): RL's held-out evaluation "
                          f"(train.eval_every) samples on it")
    check.positive_int("train.log_every")

    # SFT.
    check.positive_int("sft.epochs")
    if check.range("sft.warmup_ratio", 0.0, 1.0):  # the SFT warm-up is round(warmup_ratio x steps)
        check.build(lambda: resolve.sft_optimizer_config(config, 1 << 30))
    _check_optimizer_bounds(check)
    check.positive_int("sft.advance_window")
    check.positive_int("sft.advance_every")
    check.positive_int("sft.advance_probe")
    check.positive_int("sft.advance_consecutive")  # like advance_every and advance_probe: inert without advance_exact
    for field in ("sft.advance_loss", "sft.advance_exact"):
        upper = 1.0 if field == "sft.advance_exact" else None
        if check.range(field, 0.0, upper) and check.value(field) and check.ok("sft.epochs"):
            check.require(config.sft.epochs == 1, field,
                          f"ends a stage early within the one pass over the stages: needs sft.epochs=1, got "
                          f"{config.sft.epochs} (or set it to 0)")
    check.positive_int("sft.batch_size")
    if check.positive_int("sft.max_length") and model is not None:
        check.require(config.sft.max_length <= model.max_position_embeddings, "sft.max_length",
                      f"exceeds the model's max_position_embeddings {model.max_position_embeddings}")
    sft_files = check.strings("sft.train_files")
    if config.data.synthetic.enabled and sft_files:  # builders.prepare_data would ignore them
        check.fail("sft.train_files", "data.synthetic.enabled=True generates the SFT conversations into run_dir "
                                      "(data.synthetic.sft_stages), so these files would be ignored: set "
                                      "data.synthetic.enabled=False to train on them, or leave sft.train_files empty")
    templates = check.strings("sft.templates")
    check.require(all(t in CONVERSATION_TEMPLATES for t in templates), "sft.templates",
                  f"each must be one of {CONVERSATION_TEMPLATES}, got {templates!r}")
    if config.data.synthetic.enabled:
        check.require(templates == ("rstar2",), "sft.templates",
                      f"synthetic conversations are rStar2 tool-use data: ('rstar2',), got {templates!r}")
    else:
        check.require(len(templates) in (1, len(sft_files)), "sft.templates",
                      f"one template for all files or one per file ({len(sft_files)} in sft.train_files), "
                      f"got {len(templates)}")

    # Sandbox, checkpoints, evaluation, filter_hard.
    s = config.sandbox
    fusion = check.enum("sandbox.api", SANDBOX_APIS) and s.api == "sandbox_fusion"
    targets = check.strings("sandbox.targets")
    bad = [t for t in targets if fusion and not t.startswith(("http://", "https://"))]
    if bad:
        check.fail("sandbox.targets", f"{bad[0]!r} is not an http(s) base URL: sandbox.api='sandbox_fusion' takes "
                                      "SandboxFusion URLs ('http://host:port')")
        targets = ()
    check.positive_int("sandbox.workers")
    bad = [m for m in check.strings("sandbox.preimport_modules") if not _MODULE_NAME.fullmatch(m)]
    check.require(not bad, "sandbox.preimport_modules",
                  f"{bad[0] if bad else ''!r} is not a module name (dotted Python identifiers, e.g. 'scipy.stats')")
    env = check.build(lambda: resolve.tool_env(config))  # sandbox.preset and the fields that override it
    _check_sandbox_limits(check, env)
    if check.enum("sandbox.verify_via", SCORER_MODES) and fusion:
        check.require(s.verify_via == "local", "sandbox.verify_via",
                      "must be 'local' with sandbox.api='sandbox_fusion': SandboxFusion has no Verify")
    if env is not None and fusion:  # what a SandboxFusion server cannot do (sandbox_service.fusion_client)
        check.require(not env.preimports, "sandbox.preimports",
                      f"must be False with sandbox.api='sandbox_fusion', got True (preset {env.preset!r}): "
                      "SandboxFusion starts a fresh interpreter per call, nothing pre-imported; set "
                      "sandbox.preimports=False or sandbox.preset='release'")
        check.require(env.memory_address_space, "sandbox.memory_address_space",
                      f"must be True with sandbox.api='sandbox_fusion', got False (preset {env.preset!r}): "
                      "SandboxFusion's memory_limit_MB bounds the address space, not resident memory; set "
                      "sandbox.memory_address_space=True or sandbox.preset='release'")
    check.require(not (s.launch_local and targets), "sandbox.launch_local",
                  "set it to False when sandbox.targets lists running servers")
    if check.range("sandbox.inject_timeout_rate", 0.0, 1.0, high_open=True) and s.inject_timeout_rate > 0:
        check.require(s.launch_local is True, "sandbox.inject_timeout_rate",
                      "is a flag of the local sandbox server the launcher starts (sandbox.launch_local=True); "
                      "start a running server with --inject-timeout-rate instead")
    if config.mode in ("rl", "eval") and check.ok("sandbox.targets"):
        check.require(s.launch_local or len(targets) > 0, "sandbox.targets",
                      "tool calls need a sandbox: list targets or set sandbox.launch_local=True")
    check.range("rollout.ready_timeout_s", 0.0, MAX_SECONDS, low_open=True)
    if check.ok("rollout.generate_timeout_s"):
        timeout = config.rollout.generate_timeout_s
        check.require(_is_number(timeout) and 0 <= timeout <= MAX_SECONDS, "rollout.generate_timeout_s",
                      f"must be in [0.0, {MAX_SECONDS}] (0: no limit), got {timeout!r}")
    every_ok = check.positive_int("checkpoint.every_steps")
    check.require(config.checkpoint.export_dtype in ("", *DTYPE_NAMES), "checkpoint.export_dtype",
                  f"must be '' (the precision the run trains in: optim.master_weights, else model.param_dtype) "
                  f"or one of {DTYPE_NAMES}, got {config.checkpoint.export_dtype!r}")
    _check_weight_sync(check)
    check.positive_int("checkpoint.max_to_keep")
    if check.positive_int("checkpoint.export_hf_every", allow_zero=True) and every_ok:
        export_every, every = config.checkpoint.export_hf_every, config.checkpoint.every_steps
        check.require(export_every % every == 0, "checkpoint.export_hf_every",
                      f"must be 0 or a multiple of checkpoint.every_steps ({every}): exports happen at saves, "
                      f"got {export_every}")
    check.strings("eval.files")
    check.positive_int("eval.k")
    check.optional_step("eval.checkpoint_step")
    check.urls("eval.generator_urls")
    check.require(not (config.model.hf_path and config.eval.checkpoint_dir), "eval.checkpoint_dir",
                  "set either model.hf_path (an HF directory) or eval.checkpoint_dir (an orbax run), not both")
    check.positive_int("filter_hard.k")
    check.strings("filter_hard.input_files")
    check.optional_step("filter_hard.checkpoint_step")
    check.urls("filter_hard.generator_urls")


def _check_optimizer_bounds(check: Checker) -> None:
    """What AdamW's settings (`OptimizerConfig`, built above) take but no run survives."""
    config = check.config
    for field in ("optim.lr", "sft.lr"):
        check.range(field, 0.0, MAX_LR, low_open=True)
    if check.ok("optim.grad_clip"):
        check.require(config.optim.grad_clip > 0, "optim.grad_clip",
                      f"must be > 0.0 (gradients are clipped to this global norm: 0 zeroes every update), "
                      f"got {config.optim.grad_clip!r}")
    # A master copy is of lower-precision parameters: of fp32 ones it would only double their memory.
    if check.ok("optim.master_weights", "model.param_dtype") and config.optim.master_weights:
        check.require(config.model.param_dtype in LOW_PRECISION_DTYPES, "optim.master_weights",
                      f"{config.optim.master_weights!r} keeps an fp32 master copy of lower-precision parameters: "
                      f"it needs model.param_dtype in {LOW_PRECISION_DTYPES}, got "
                      f"model.param_dtype={config.model.param_dtype!r} (or set optim.master_weights='')")
    # Decoupled decay scales the weights by 1 - lr x weight_decay each step, RL's rate and SFT's alike.
    if check.ok("optim.weight_decay", "optim.lr", "sft.lr"):
        o = config.optim
        check.require(o.weight_decay * max(o.lr, config.sft.lr) < 1, "optim.weight_decay",
                      f"must be >= 0 with weight_decay x the learning rate below 1 (AdamW scales the weights by "
                      f"1 - lr x weight_decay each step; optim.lr {o.lr:g}, sft.lr {config.sft.lr:g}), "
                      f"got {o.weight_decay!r}")


def _check_sandbox_limits(check: Checker, env) -> None:
    """Per-call limits the sandbox takes: the local server's (launch_local) refuses to start past its
    maxima; any timeout is at most a day."""
    s = check.config.sandbox
    local = s.launch_local is True
    limit = LOCAL_SANDBOX_MAX_TIMEOUT_S if local else MAX_SECONDS
    why = ("with sandbox.launch_local=True: the local sandbox server refuses longer calls (its --max_timeout_s)"
           if local else "(a day)")
    if check.ok("sandbox.verify_timeout_s"):
        timeout = s.verify_timeout_s
        check.require(_is_number(timeout) and 0 < timeout <= limit, "sandbox.verify_timeout_s",
                      f"must be > 0 and at most {limit:g} s {why}, got {timeout!r}")
    if env is None:
        return
    if s.timeout_s is not None:  # the presets' own are within both
        check.require(env.timeout_s <= limit, "sandbox.timeout_s", f"must be at most {limit:g} s {why}, "
                                                                   f"got {env.timeout_s!r}")
    if local and s.memory_mb is not None:
        check.require(env.memory_mb <= LOCAL_SANDBOX_MAX_MEMORY_MB, "sandbox.memory_mb",
                      f"must be at most {LOCAL_SANDBOX_MAX_MEMORY_MB} with sandbox.launch_local=True: the local "
                      f"sandbox server refuses more (its --max_memory_mb), got {env.memory_mb!r}")


def _check_weight_sync(check: Checker) -> None:
    w = check.config.weight_sync
    method_ok = check.enum("weight_sync.method", SYNC_METHODS)
    check.enum("weight_sync.mode", SYNC_MODES)
    check.require(w.dtype in ("", *DTYPE_NAMES), "weight_sync.dtype",
                  f"must be '' (the model's param_dtype) or one of {DTYPE_NAMES}, got {w.dtype!r}")
    check.positive_int("weight_sync.max_shard_bytes")
    check.positive_int("weight_sync.writer_threads")
    address = w.master_address
    check.require(isinstance(address, str) and not any(c in address for c in "/ \t"), "weight_sync.master_address",
                  f"must be '' (the address the servers reach this host by) or a host name or IP address, "
                  f"got {address!r}")
    port = w.master_port
    check.require(_is_int(port) and 0 <= port <= 65535, "weight_sync.master_port",
                  f"must be 0 (a free port) or a TCP port up to 65535, got {port!r}")
    check.enum("weight_sync.backend", ("", *WEIGHT_SYNC_BACKENDS))
    check.non_empty("weight_sync.group_name", "a non-empty group name")
    check.positive_int("weight_sync.bucket_bytes")
    if method_ok and w.method == "distributed" and check.ok("rollout.backend"):
        check.require(check.config.rollout.backend == "sglang", "weight_sync.method",
                      "'distributed' updates SGLang(-compatible) servers: it needs rollout.backend='sglang' (the "
                      "in-process engine swaps its parameters in place)")


def _check_inputs(check: Checker) -> None:
    """The run's inputs: what the mode reads is named (by the user: the stage configs leave it out)
    and exists."""
    config = check.config
    mode, synthetic = config.mode, config.data.synthetic.enabled
    sft = mode == "sft" or (mode == "rl" and config.sft.before_rl)
    train_files = check.strings("data.train_files")
    sft_files = check.strings("sft.train_files")
    eval_files = check.strings("eval.files")
    _check_tokenizer_source(check)
    if mode == "rl":
        check.require(synthetic or len(train_files) > 0, "data.train_files",
                      "RL needs training problems: list files here or set data.synthetic.enabled=True")
        if config.train.eval_every:
            check.require(synthetic or len(check.strings("data.eval_files")) > 0, "data.eval_files",
                          "train.eval_every evaluates on held-out problems: list files here (or set "
                          "train.eval_every=0)")
    if sft:
        check.require(synthetic or len(sft_files) > 0, "sft.train_files",
                      "SFT needs conversations: list files here or set data.synthetic.enabled=True")
    if mode == "eval":
        check.require(len(eval_files) > 0 or synthetic, "eval.files", "evaluation needs at least one file")
        check.require(bool(config.model.hf_path or config.eval.checkpoint_dir or config.eval.generator_urls),
                      "eval.checkpoint_dir",
                      "evaluation needs a policy: set model.hf_path, eval.checkpoint_dir or eval.generator_urls")

    def written_by_filter_hard(path: str) -> str:
        output = config.filter_hard.output_file
        if output and pathlib.Path(path).resolve() == pathlib.Path(output).resolve():
            return " (it is filter_hard.output_file: write it first with python -m rstar_jax.filter_hard)"
        return ""

    if mode == "rl" and not synthetic:
        check.existing("data.train_files", train_files, written_by_filter_hard)
    check.existing("data.eval_files", check.strings("data.eval_files"))
    if sft:
        check.existing("sft.train_files", sft_files)
    if mode == "eval":
        check.existing("eval.files", eval_files)
        if config.eval.checkpoint_dir:
            check.existing("eval.checkpoint_dir", [config.eval.checkpoint_dir])
    if config.model.hf_path:
        check.existing("model.hf_path", [config.model.hf_path])
    if config.tokenizer.kind == "hf" and config.tokenizer.path:
        check.existing("tokenizer.path", [config.tokenizer.path])
    if config.train.init_from and mode == "rl":
        check.existing("train.init_from", [config.train.init_from])
        _check_previous_run_tokenizer(check)


def input_problems(config: ml_collections.ConfigDict) -> list[str]:
    """What `validate(config, check_files=True)` adds for a config whose values are valid."""
    try:
        validate(config, check_files=True)
    except ConfigError as e:
        return e.problems
    return []
