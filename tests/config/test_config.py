"""Configs: recipe values per stage, and validation that reports every problem naming its field.

Configs are built as a user's code builds them (a file, then `update_from_flattened_dict`); the
command-line syntax is tested through the real entry points in test_cli.py.
"""

import ml_collections
import pytest

from rstar_jax.config import (
    REPO_CONFIGS,
    Checker,
    ConfigError,
    UserError,
    base_config,
    did_you_mean,
    leaf_paths,
    load_config_file,
    validate,
)
from rstar_jax.config import resolve
from rstar_jax.errors import from_fields
from rstar_jax.app.builders import check_mesh

ALL_CONFIGS = ("base", "stage1", "stage2", "stage3", "sft", "eval", "tiny")
# The sandbox on SandboxFusion's HTTP API (what it needs beside the release preset: a local verifier).
FUSION = {"sandbox.api": "sandbox_fusion", "sandbox.verify_via": "local"}


def _load(name, overrides=None):
    config = load_config_file(REPO_CONFIGS / f"{name}.py")
    config.update_from_flattened_dict(overrides or {})
    return config


@pytest.fixture
def inputs(tmp_path):
    """Files the stage configs point at, so validation with file checks can pass."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    (tmp_path / "sft.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "ckpt").mkdir()
    return tmp_path


def _runnable(name, tmp, overrides=None):
    # A synthetic config generates its training data: files beside it are refused.
    files = {} if _load(name).data.synthetic.enabled else {"data.train_files": (str(tmp / "train.jsonl"),),
                                                           "sft.train_files": (str(tmp / "sft.jsonl"),)}
    return _load(name, {"model.hf_path": str(tmp / "hf"), **files, "eval.files": (str(tmp / "train.jsonl"),),
                        "train.init_from": str(tmp / "ckpt"), "run_dir": str(tmp / "run"), **(overrides or {})})


def _problems(config, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(config, **kwargs)
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_config_validates_and_locks(name, inputs):
    config = validate(_runnable(name, inputs))
    with pytest.raises(AttributeError):
        config.new_field = 1  # locked
    assert set(config.keys()) == set(base_config().keys())


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_shipped_configs_are_valid_without_their_inputs_and_name_what_to_set(name, tmp_path, monkeypatch):
    """Every value of every shipped config is valid as shipped; what a run still needs from the
    user (inputs the stage files leave to the command line) names the fields to set."""
    monkeypatch.chdir(tmp_path)  # the stage configs' relative paths (runs/...) do not exist here
    validate(_load(name), check_files=False)
    if name == "tiny":
        validate(_load(name))  # everything synthetic: nothing to supply
        return
    problems = _problems(_load(name))
    assert problems and all(p.startswith("config.") for p in problems)
    if load_config_file(str(REPO_CONFIGS / f"{name}.py")).train.init_from:  # stages 2, 3: the tokenizer of the run they continue
        assert any(p.startswith("config.train.init_from: runs/") and "does not exist" in p for p in problems)
    else:
        assert any(p.startswith("config.tokenizer.path: an hf tokenizer needs files: set tokenizer.path or "
                                "model.hf_path") for p in problems)
    if name == "stage3":
        assert any(p.startswith("config.data.train_files: runs/stage3/hard_subset.jsonl does not exist (it is "
                                "filter_hard.output_file") for p in problems)


def test_recipe_values_per_stage():
    s1, s2, s3, sft, ev = (_load(n) for n in ("stage1", "stage2", "stage3", "sft", "eval"))
    for c in (s1, s2, s3):
        assert c.mode == "rl" and c.model.preset == "qwen3-14b"
        assert (c.optim.lr, c.optim.warmup_steps, c.optim.schedule) == (1e-6, 20, "constant")
        assert c.data.num_prompts_per_step == 512
        assert (c.rollout.rollouts_per_prompt, c.rl.group_size) == (32, 16)
        assert (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k) == (1.0, 1.0, -1)
        assert (c.rl.clip_low, c.rl.clip_high, c.rl.kl_coef, c.rl.entropy_coef) == (0.2, 0.28, 0.0, 0.0)
        assert (c.optim.b1, c.optim.b2, c.optim.weight_decay, c.optim.grad_clip) == (0.9, 0.999, 0.01, 1.0)
        assert c.rollout.max_prompt_length == 2048
    # spec §2.3, §3.2: every stage, the SFT data and evaluation meet the release's tool environment.
    for c in (s1, s2, s3, sft, ev):
        env = resolve.tool_env(c)
        assert (env.preset, env.timeout_s, env.memory_mb, env.stream_cap_chars, env.observation_max_chars) == \
            ("release", 4.0, 384, 1000, 256)
        assert (env.error_format, env.preimports, env.tool_call_parsing) == ("release", False, "release")
        assert env.memory_address_space
    tiny = resolve.tool_env(_load("tiny"))  # the project's own environment; the tiny run's explicit values win
    assert (tiny.preset, tiny.memory_mb, tiny.memory_address_space, tiny.stream_cap_chars) == ("rich", 512, False, 0)
    assert (tiny.error_format, tiny.preimports) == ("traceback", True)
    assert (tiny.observation_style, tiny.observation_max_chars, tiny.tool_call_parsing) == ("paper", 64, "rich")
    assert [c.rollout.max_turns for c in (s1, s2, s3)] == [10, 10, 15]
    assert [c.rollout.response_budget for c in (s1, s2, s3)] == [8192, 12288, 12288]
    assert [c.train.steps for c in (s1, s2, s3)] == [300, 85, 125]
    assert [c.optim.reset_at_start for c in (s1, s2, s3)] == [False, False, True]
    assert s3.data.train_files == (s3.filter_hard.output_file,) and s3.filter_hard.k == 8
    assert s2.train.init_from == "runs/stage1/checkpoints" and s3.train.init_from == "runs/stage2/checkpoints"
    assert sft.mode == "sft"
    assert (sft.sft.epochs, sft.sft.lr, sft.sft.warmup_ratio, sft.sft.schedule, sft.sft.batch_size) == \
        (3, 5e-6, 0.04, "cosine", 128)
    assert ev.mode == "eval" and (ev.eval.k, ev.eval.temperature, ev.eval.max_turns) == (16, 0.6, 30)
    assert (ev.rollout.temperature, ev.rollout.max_turns, ev.rollout.response_budget) == (0.6, 30, 30000)


def test_every_recipe_value_cites_the_spec():
    text = (REPO_CONFIGS / "base.py").read_text()
    for needle in ("c.optim.lr = 1e-6  # spec §5.3", "c.data.num_prompts_per_step = 512  # spec §5.3",
                   "c.rollout.rollouts_per_prompt = 32  # spec §5.3", "c.sft.epochs = 3  # spec §5.1",
                   "c.eval.k = 16  # spec §5.4"):
        assert needle in text
    for name in ("stage2", "stage3"):
        body = (REPO_CONFIGS / f"{name}.py").read_text()
        changed = [line for line in body.splitlines() if line.strip().startswith("c.") and "=" in line
                   and not line.strip().startswith(("c.stage", "c.run_dir", "c.train.init_from", "c.rollout.engine",
                                                    "c.filter_hard", "c.data.train_files",
                                                    # fitted to memory (rstar_jax.aot), not the recipe's
                                                    "c.rl.micro_batch_tokens", "c.mesh"))]
        assert changed and all("# spec §5.3" in line for line in changed), changed


def test_tiny_config_describes_a_tiny_model():
    config = _load("tiny")
    model = resolve.model_config(config)
    assert (model.num_layers, model.hidden_size, model.max_position_embeddings) == (1, 128, 1024)
    assert config.mode == "rl" and config.rollout.template == "bare" and config.data.synthetic.kinds == ("product",)
    # Held-out evaluation where RL starts, midway and at the end.
    assert (config.train.steps, config.train.eval_every) == (20, 10)
    assert config.tokenizer.kind == "byte" and config.data.synthetic.enabled and config.sft.before_rl
    assert config.sandbox.launch_local and config.rollout.backend == "jax"
    # The RL run it describes needs no input files: everything is synthetic.
    validate(config)
    assert _problems(_load("tiny", {"rollout.engine.slots": 0})) == \
        ["config.rollout.engine.slots: must be a positive integer, got 0"]
    # The micro-batch count derives from it: one line, on the field the user set.
    assert _problems(_load("tiny", {"rl.group_size": 0})) == ["config.rl.group_size: must be >= 1, got 0"]


@pytest.mark.parametrize("overrides,message", [
    ({"mode": "demo"}, r"config.mode: must be one of \('rl', 'sft', 'eval'\), got 'demo'"),
    ({"rl.clip_low": 1.5}, r"config.rl.clip_low: must be in \[0, 1\), got 1.5"),
    ({"rl.group_size": 33}, r"config.rl.group_size: must not exceed rollout.rollouts_per_prompt \(32\)"),
    ({"rl.kl_coef": 0.1}, r"config.rl.kl_coef: must be 0: the KL term needs a reference policy, which this "
                          r"trainer does not keep \(GRPO-RoC has no KL term, spec §5.3\)"),
    ({"rl.kl_coef": -1.0}, r"config.rl.kl_coef: must be >= 0.0, got -1.0"),
    ({"rl.micro_batch_tokens": 4096}, r"config.rl.micro_batch_tokens: must be >= rollout.max_prompt_length \+ "
                                      r"rollout.response_budget = 10240"),
    ({"rollout.engine.max_length": 9000}, r"config.rollout.engine.max_length: must be >= .* = 10240"),
    ({"rollout.engine.max_total_tokens": 4096}, r"config.rollout.engine.max_total_tokens: must be 0 .* or >= "
                                                r"rollout.engine.max_length \(10240\)"),
    ({"rollout.engine.page_size": 0}, r"config.rollout.engine.page_size: must be a positive integer, got 0"),
    ({"rollout.engine.mem_fraction_static": 1.0}, r"config.rollout.engine.mem_fraction_static: must be in "
                                                  r"\[0, 1\), got 1.0"),
    ({"rollout.engine.mem_fraction_static": -0.1}, r"config.rollout.engine.mem_fraction_static: must be in \[0, 1\)"),
    ({"rollout.engine.chunked_prefill_size": -2}, r"config.rollout.engine.chunked_prefill_size: must be a positive "
                                                  r"integer, or 0 or -1 \(off\), got -2"),
    ({"rollout.engine.layer_layout": "unrolled"}, r"config.rollout.engine.layer_layout: must be one of "
                                                  r"\('stacked', 'per_layer'\), got 'unrolled'"),
    ({"rollout.engine.decode_attention": "flash"}, r"config.rollout.engine.decode_attention: must be one of "
                                                   r"\('xla', 'pallas'\), got 'flash'"),
    ({"rollout.temperature": 0.0}, r"config.rollout.temperature: must be in \(0.0, 10.0\], got 0.0"),
    ({"rollout.top_k": 0}, r"config.rollout.top_k: must be -1 \(off\) or >= 1, got 0"),
    ({"rollout.scheduler": "random"}, r"config.rollout.scheduler: must be one of \('kv', 'round_robin'\)"),
    ({"rollout.kv_scheduler.reservation": "best"}, r"config.rollout.kv_scheduler.reservation: must be one of "
                                                   r"\('expected', 'worst-case'\)"),
    ({"rollout.kv_scheduler.new_token_ratio": 0.0}, r"config.rollout.kv_scheduler.new_token_ratio: must be in \(0"),
    ({"rollout.kv_scheduler.group_block": 0}, r"config.rollout.kv_scheduler.group_block: must be a positive integer"),
    ({"rollout.kv_scheduler.budget_fraction": 1.5}, r"config.rollout.kv_scheduler.budget_fraction: must be in \(0"),
    ({"rollout.kv_scheduler.reconcile_interval_s": -1.0}, r"config.rollout.kv_scheduler.reconcile_interval_s: "
                                                          r"must be in \[0.0, 86400.0\], got -1.0"),
    ({"rollout.backend": "sglang"}, r"config.rollout.servers: the sglang backend needs at least one server"),
    ({"data.on_bad_row": "ignore"}, r"config.data.on_bad_row: must be one of \('error', 'skip'\)"),
    ({"data.answer_key": "a..b"}, r"config.data.answer_key: must be 'auto' or a dotted path"),
    ({"data.synthetic.kinds": ("nope",)}, r"config.data.synthetic.kinds: unknown kind 'nope'"),
    ({"optim.schedule": "linear"}, r"config.optim.schedule: must be one of \('constant', 'cosine', 'wsd'\)"),
    ({"sft.decay_ratio": 0.0}, r"config.sft.decay_ratio: must be in \(0, 1\], got 0.0"),
    ({"sft.advance_loss": -0.1}, r"config.sft.advance_loss: must be >= 0.0, got -0.1"),
    ({"sft.advance_loss": 0.01}, r"config.sft.advance_loss: ends a stage early within the one pass over the "
                                 r"stages: needs sft.epochs=1, got 3"),
    ({"sft.advance_window": 0}, r"config.sft.advance_window: must be a positive integer, got 0"),
    ({"sft.advance_exact": 1.5}, r"config.sft.advance_exact: must be in \[0.0, 1.0\], got 1.5"),
    ({"sft.advance_exact": 0.9}, r"config.sft.advance_exact: ends a stage early within the one pass over the "
                                 r"stages: needs sft.epochs=1, got 3"),
    ({"sft.advance_every": 0}, r"config.sft.advance_every: must be a positive integer, got 0"),
    ({"sft.advance_consecutive": 0}, r"config.sft.advance_consecutive: must be a positive integer, got 0"),
    ({"sft.advance_probe": -1}, r"config.sft.advance_probe: must be a positive integer, got -1"),
    ({"rollout.ready_timeout_s": 0}, r"config.rollout.ready_timeout_s: must be in \(0.0, 86400.0\], got 0"),
    ({"checkpoint.export_dtype": "int8"}, r"config.checkpoint.export_dtype: must be '' \(the precision the run trains in"),
    ({"weight_sync.method": "nccl"}, r"config.weight_sync.method: must be one of \('disk', 'distributed'\)"),
    ({"weight_sync.method": "distributed"}, r"config.weight_sync.method: 'distributed' updates SGLang\(-compatible\) "
                                            r"servers: it needs rollout.backend='sglang'"),
    ({"weight_sync.mode": "drain"}, r"config.weight_sync.mode: must be one of \('abort', 'pause', 'in_place', 'wait'\)"),
    ({"weight_sync.dtype": "float8"}, r"config.weight_sync.dtype: must be '' \(the model's param_dtype\) or one of"),
    ({"weight_sync.max_shard_bytes": 0}, r"config.weight_sync.max_shard_bytes: must be a positive integer, got 0"),
    ({"weight_sync.writer_threads": 0}, r"config.weight_sync.writer_threads: must be a positive integer, got 0"),
    ({"weight_sync.master_address": "tcp://10.0.0.1"}, r"config.weight_sync.master_address: must be '' .* or a host "
                                                       r"name or IP address, got 'tcp://10.0.0.1'"),
    ({"weight_sync.master_port": 70000}, r"config.weight_sync.master_port: must be 0 \(a free port\) or a TCP port"),
    ({"weight_sync.backend": "mpi"}, r"config.weight_sync.backend: must be one of \('', 'gloo', 'nccl'\), got 'mpi'"),
    ({"weight_sync.group_name": ""}, r"config.weight_sync.group_name: must be a non-empty group name"),
    ({"weight_sync.bucket_bytes": -1}, r"config.weight_sync.bucket_bytes: must be a positive integer, got -1"),
    ({"mesh.tensor": 0}, r"config.mesh.tensor: must be a positive integer or -1, got 0"),
    ({"mesh.data": -1}, r"config.mesh.data: only one axis may be -1 \(the remaining devices\) and "
                        r"mesh.fsdp is -1: give mesh.data a size, got -1"),
    ({"mesh.rules": (("batch", "model"),)}, r"config.mesh.rules\[0\]: mesh axes must be None or names"),
    ({"model.preset": "qwen3-99b"}, r"config.model.preset: unknown model preset 'qwen3-99b'"),
    ({"model.overrides.num_heads": -2}, r"config.model.overrides.num_heads: must be a positive integer, got -2"),
    ({"model.remat_policy": "some"}, r"config.model.remat_policy: must be one of"),
    ({"sandbox.targets": ("127.0.0.1:1",)}, r"config.sandbox.launch_local: set it to False"),
    ({"sandbox.launch_local": False}, r"config.sandbox.targets: tool calls need a sandbox"),
    ({"sandbox.verify_timeout_s": 0.0}, r"config.sandbox.verify_timeout_s: must be > 0 and at most 300 s "
                                        r"with sandbox.launch_local=True: the local sandbox server refuses longer "
                                        r"calls \(its --max_timeout_s\), got 0.0"),
    ({"sandbox.inject_timeout_rate": 1.0}, r"config.sandbox.inject_timeout_rate: must be"),
    ({"sandbox.inject_timeout_rate": 0.1, "sandbox.launch_local": False, "sandbox.targets": ("127.0.0.1:1",)},
     r"config.sandbox.inject_timeout_rate: is a flag of the local sandbox server the launcher starts"),
    ({"sandbox.preset": "code-judge"}, r"config.sandbox.preset: must be one of \('release', 'rich'\)"),
    ({"sandbox.memory_mb": 8}, r"config.sandbox.memory_mb: must be an integer >= 16, got 8"),
    ({"sandbox.error_format": "short"}, r"config.sandbox.error_format: must be one of \('traceback', 'release'\)"),
    ({"sandbox.preimport_modules": ("scipy", "not a module")},
     r"config.sandbox.preimport_modules: 'not a module' is not a module name"),
    ({"sandbox.api": "http"}, r"config.sandbox.api: must be one of \('grpc', 'sandbox_fusion'\), got 'http'"),
    ({"sandbox.api": "sandbox_fusion"}, r"config.sandbox.verify_via: must be 'local' with "
                                        r"sandbox.api='sandbox_fusion': SandboxFusion has no Verify"),
    ({**FUSION, "sandbox.launch_local": False, "sandbox.targets": ("10.0.0.5:8080",)},
     r"config.sandbox.targets: '10.0.0.5:8080' is not an http\(s\) base URL: sandbox.api='sandbox_fusion' takes "
     r"SandboxFusion URLs"),
    ({**FUSION, "sandbox.preimports": True}, r"config.sandbox.preimports: must be False with "
                                             r"sandbox.api='sandbox_fusion', got True .*set sandbox.preimports=False"),
    ({**FUSION, "sandbox.memory_address_space": False},
     r"config.sandbox.memory_address_space: must be True with sandbox.api='sandbox_fusion', got False .*set "
     r"sandbox.memory_address_space=True or sandbox.preset='release'"),
    ({"rollout.tool_call_parsing": "lax"}, r"config.rollout.tool_call_parsing: must be one of"),
    ({"data.train_files": ()}, r"config.data.train_files: RL needs training problems"),
    ({"data.train_files": ("/does/not/exist.jsonl",)},
     r"config.data.train_files: /does/not/exist.jsonl does not exist"),
    ({"sft.max_length": 50000}, r"config.sft.max_length: exceeds the model's max_position_embeddings 40960"),
    ({"checkpoint.export_hf_every": 15}, r"config.checkpoint.export_hf_every: must be 0 or a multiple of "
                                         r"checkpoint.every_steps \(10\)"),
    ({"model.hf_path": "/does/not/exist"}, r"config.model.hf_path: /does/not/exist does not exist"),
])
def test_invalid_values_are_rejected_naming_the_field(overrides, message, inputs):
    with pytest.raises(ConfigError, match=message) as info:
        validate(_runnable("stage1", inputs, overrides))
    assert isinstance(info.value, UserError) and len(info.value.problems) == 1, info.value.problems


def test_a_sandbox_fusion_deployment_is_a_valid_sandbox(inputs):
    """SandboxFusion base URLs with the release preset and a local verifier; or our own server's HTTP
    endpoint (launch_local)."""
    config = validate(_runnable("stage1", inputs, {**FUSION, "sandbox.launch_local": False,
                                                   "sandbox.targets": ("http://10.0.0.5:8080", "https://sf.internal")}))
    assert config.sandbox.api == "sandbox_fusion"
    validate(_runnable("stage1", inputs, FUSION))


def test_every_problem_is_reported_at_once_and_dependent_rules_are_skipped(inputs):
    config = _runnable("stage1", inputs, {
        "rl.clip_low": 1.5, "optim.lr": -1.0, "eval.k": 0, "rollout.scheduler": "random",
        # An invalid model: the rules that need its max_position_embeddings are skipped, not crashed.
        "model.preset": "qwen3-99b", "sft.max_length": 50000,
        # An invalid budget: the rules that add it to max_prompt_length are skipped.
        "rollout.response_budget": 0, "rl.micro_batch_tokens": 16,
    })
    problems = _problems(config)
    assert problems[0].startswith("config.model.preset: unknown model preset 'qwen3-99b'; expected one of")
    assert problems[1:] == [
        "config.rollout.scheduler: must be one of ('kv', 'round_robin'), got 'random'",
        "config.rollout.response_budget: must be >= 1, got 0",
        "config.rl.clip_low: must be in [0, 1), got 1.5",
        "config.optim.lr: must be > 0, got -1.0",
        "config.eval.k: must be a positive integer, got 0",
    ]


def test_run_inputs_are_checked_only_with_check_files(inputs):
    config = _runnable("stage1", inputs, {"data.train_files": (), "model.hf_path": "", "train.init_from": "",
                                          "rl.clip_low": 1.5})
    assert _problems(config, check_files=False) == ["config.rl.clip_low: must be in [0, 1), got 1.5"]
    assert _problems(config) == [
        "config.rl.clip_low: must be in [0, 1), got 1.5",
        "config.tokenizer.path: an hf tokenizer needs files: set tokenizer.path or model.hf_path (or continue a run "
        "with train.init_from)",
        "config.data.train_files: RL needs training problems: list files here or set data.synthetic.enabled=True",
    ]


def test_unknown_missing_and_mistyped_fields_in_config_files(inputs):
    config = _runnable("stage1", inputs)
    config.rl.clip_hihg = 0.3
    config.train.lr = 1e-5
    config.train.typo_field = 1
    config.train = ml_collections.ConfigDict({**config.train.to_dict(), "steps": "300"})
    assert _problems(config) == [
        "config.rl.clip_hihg: unknown field (not in configs/base.py); did you mean rl.clip_high?",
        "config.train.lr: unknown field (not in configs/base.py); did you mean optim.lr or sft.lr?",
        "config.train.steps: must be int, got str '300'",
        "config.train.typo_field: unknown field (not in configs/base.py)",
    ]
    # A missing field stops before the value checks, which would need it.
    config = _runnable("stage1", inputs, {"rl.clip_low": 1.5})
    del config.optim["b2"]
    assert _problems(config) == ["config.optim.b2: missing (every field of configs/base.py must be present)"]


def test_did_you_mean_suggests_close_spellings_then_the_same_name_elsewhere():
    leaves = leaf_paths(base_config())
    assert "optim.lr" in leaves and "model.overrides.num_layers" in leaves and "model.overrides" not in leaves
    assert did_you_mean("train.lr", leaves) == " did you mean optim.lr or sft.lr?"
    assert did_you_mean("rl.clip_hihg", leaves) == " did you mean rl.clip_high?"
    assert did_you_mean("optm.warmup_steps", leaves) == " did you mean optim.warmup_steps?"
    assert did_you_mean("rl.no_such", leaves) == ""


def test_checker_collects_problems_from_settings_dataclasses():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Settings:
        variant: str
        size: int

        def __post_init__(self):
            if self.variant not in ("a", "b"):
                raise ValueError(f"Settings.variant must be one of ('a', 'b'), got {self.variant!r}")
            if self.size < 1:
                raise ValueError(f"size too small: {self.size}")

    def from_config(variant, size):
        return from_fields(Settings, {"variant": ("rl.roc_variant", variant), "size": ("rl.group_size", size)})

    assert from_config("a", 1) == Settings("a", 1)
    with pytest.raises(ConfigError) as info:
        from_config("x", 1)
    assert info.value.problems == ["config.rl.roc_variant: must be one of ('a', 'b'), got 'x'"]
    with pytest.raises(ConfigError, match=r"^config.rl: size too small: 0$"):
        from_config("a", 0)  # not about a named field: the section of the first field

    check = Checker(_load("stage1"))
    assert check.build(lambda: from_config("x", 1)) is None
    assert check.build(lambda: from_config("a", 2)) == Settings("a", 2)
    assert check.problems == ["config.rl.roc_variant: must be one of ('a', 'b'), got 'x'"]
    assert not check.ok("rl.roc_variant") and check.ok("rl.group_size")
    assert not check.enum("rl.roc_variant", ("x",))  # already failed: skipped, not reported twice
    assert len(check.problems) == 1
    assert ConfigError("config.a: x\nconfig.b: y").problems == ["config.a: x", "config.b: y"]


def test_check_mesh_at_run_time():
    config = _load("stage1")
    assert check_mesh(config, 8) == (1, 8, 1)
    config.mesh.tensor = 3
    with pytest.raises(ConfigError, match="8 devices are not divisible by the fixed axes' product 3"):
        check_mesh(config, 8)
    config.update_from_flattened_dict({"mesh.fsdp": 2, "mesh.tensor": 2})
    with pytest.raises(ConfigError, match=r"data\*fsdp\*tensor = 4 but 8 devices"):
        check_mesh(config, 8)


def test_check_files_reads_the_tokenizer_a_previous_run_names(tmp_path):
    """Stage 3 names its policy and tokenizer only through train.init_from: --check_files looks into
    that run's stored config, as launch will, instead of accepting any directory."""
    data = tmp_path / "hard.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    files = {"data.train_files": (str(data),), "data.eval_files": (str(data),)}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _problems(_load("stage3", {**files, "train.init_from": str(empty)}), check_files=True) == [
        f"config.tokenizer.path: an hf tokenizer needs files: tokenizer.path and model.hf_path are unset, and "
        f"train.init_from={str(empty)!r} holds no run that names its tokenizer (a stage's checkpoints store their "
        f"config); set tokenizer.path or model.hf_path"]
    stored = tmp_path / "stage2" / "checkpoints" / "85" / "config"
    stored.mkdir(parents=True)
    (stored / "metadata").write_text('{"model": {"hf_path": "runs/sft/hf/final"}, "tokenizer": {"path": ""}}')
    validate(_load("stage3", {**files, "train.init_from": str(tmp_path / "stage2")}), check_files=True)
