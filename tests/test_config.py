"""Configs: recipe values per stage, overrides, and validation errors that name the field."""

import json
import os
import subprocess
import sys

import ml_collections
import pytest

from rstar_jax.config import (
    REPO_CONFIGS,
    ConfigError,
    apply_overrides,
    base_config,
    check_mesh,
    load_config,
    model_config,
    validate,
)

ALL_CONFIGS = ("base", "stage1", "stage2", "stage3", "sft", "eval", "tiny")


def _load(name, *overrides):
    return load_config(REPO_CONFIGS / f"{name}.py", list(overrides))


@pytest.fixture
def inputs(tmp_path):
    """Files the stage configs point at, so validation with file checks can pass."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "train.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    (tmp_path / "sft.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "ckpt").mkdir()
    return tmp_path


def _runnable(name, tmp):
    return _load(name, f"model.hf_path={tmp / 'hf'}", f"data.train_files={tmp / 'train.jsonl'}",
                 f"sft.train_files={tmp / 'sft.jsonl'}", f"eval.files={tmp / 'train.jsonl'}",
                 f"train.init_from={tmp / 'ckpt'}", f"run_dir={tmp / 'run'}")


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_config_validates_and_locks(name, inputs):
    config = validate(_runnable(name, inputs))
    with pytest.raises(AttributeError):
        config.new_field = 1  # locked
    assert set(config.keys()) == set(base_config().keys())


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
        assert c.rollout.max_prompt_length == 2048 and c.sandbox.timeout_s == 4.0
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
                                                    "c.filter_hard", "c.data.train_files"))]
        assert changed and all("# spec §5.3" in line for line in changed), changed


def test_mesh_rules_match_the_parallel_module():
    from rstar_jax.parallel import DEFAULT_RULES

    assert tuple(base_config().mesh.rules) == tuple(DEFAULT_RULES)


def test_tiny_config_describes_a_tiny_model():
    config = _load("tiny")
    model = model_config(config)
    assert model.num_layers == 2 and model.max_position_embeddings == 1024
    assert config.mode == "rl" and config.rollout.template == "compact"
    assert config.tokenizer.kind == "byte" and config.data.synthetic.enabled and config.sft.before_rl
    assert config.sandbox.launch_local and config.rollout.backend == "jax"
    # The RL run it describes needs no input files: everything is synthetic.
    validate(config)
    with pytest.raises(ConfigError, match="config.demo.new_tokens: must be a positive integer, got 0"):
        validate(_load("tiny", "demo.new_tokens=0"))


def test_overrides_parse_by_field_type():
    config = _load("stage1", "--config.rl.clip_high=0.3", "optim.warmup_steps=5", "sandbox.launch_local=false",
                   "rollout.servers=http://a:1,http://b:2", "data.train_files=('x.parquet', 'y.jsonl')",
                   "rl.dual_clip=3", "model.overrides.num_layers=4", "model.hf_path=/some/where")
    assert config.rl.clip_high == 0.3 and config.optim.warmup_steps == 5 and config.sandbox.launch_local is False
    assert config.rollout.servers == ("http://a:1", "http://b:2")
    assert config.data.train_files == ("x.parquet", "y.jsonl")
    assert config.rl.dual_clip == 3.0 and isinstance(config.rl.dual_clip, float)
    assert config.model.overrides.num_layers == 4 and model_config(config).num_layers == 4
    assert config.model.hf_path == "/some/where"


@pytest.mark.parametrize("override,message", [
    ("rl.no_such=1", r"config.rl.no_such: no such field"),
    ("nosection.x=1", r"config.nosection: no such field"),
    ("optim.lr=fast", r"config.optim.lr: cannot parse 'fast'"),
    ("train.steps=1.5", r"config.train.steps: "),
    ("sandbox.launch_local=maybe", r"config.sandbox.launch_local: expected a boolean"),
    ("rl=1", r"config.rl is a section"),
    ("optim.lr", r"not of the form"),
])
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        _load("stage1", override)


@pytest.mark.parametrize("override,message", [
    ("mode=train", r"config.mode: must be one of \('rl', 'sft', 'eval', 'demo'\), got 'train'"),
    ("rl.clip_low=1.5", r"config.rl.clip_low: must be in \[0.0, 1.0\), got 1.5"),
    ("rl.group_size=33", r"config.rl.group_size: must not exceed rollout.rollouts_per_prompt \(32\)"),
    ("rl.micro_batch_tokens=4096", r"config.rl.micro_batch_tokens: must be >= rollout.max_prompt_length \+ "
                                   r"rollout.response_budget = 10240"),
    ("rollout.engine.max_length=9000", r"config.rollout.engine.max_length: must be >= .* = 10240"),
    ("rollout.engine.max_total_tokens=4096", r"config.rollout.engine.max_total_tokens: must be 0 .* or >= "
                                             r"rollout.engine.max_length \(10240\)"),
    ("rollout.engine.page_size=0", r"config.rollout.engine.page_size: must be a positive integer, got 0"),
    ("rollout.temperature=0", r"config.rollout.temperature: must be in \(0.0, inf\]"),
    ("rollout.top_k=0", r"config.rollout.top_k: must be -1 \(off\) or a positive integer"),
    ("rollout.scheduler=random", r"config.rollout.scheduler: must be one of \('kv', 'round_robin'\)"),
    ("rollout.backend=sglang", r"config.rollout.servers: the sglang backend needs at least one server"),
    ("data.on_bad_row=ignore", r"config.data.on_bad_row: must be one of \('error', 'skip'\)"),
    ("data.answer_key=a..b", r"config.data.answer_key: must be 'auto' or a dotted path"),
    ("data.synthetic.kinds=nope", r"config.data.synthetic.kinds: unknown kind 'nope'"),
    ("optim.schedule=linear", r"config.optim.schedule: must be one of \('constant', 'cosine'\)"),
    ("mesh.tensor=0", r"config.mesh.tensor: must be a positive integer or -1, got 0"),
    ("mesh.data=-1", r"config.mesh: at most one axis may be -1"),
    ("mesh.rules=(('batch', 'model'),)", r"config.mesh.rules\[0\]: mesh axes must be None or names"),
    ("model.preset=qwen3-99b", r"config.model: unknown model preset 'qwen3-99b'"),
    ("model.overrides.num_heads=-2", r"config.model: "),
    ("sandbox.targets=127.0.0.1:1", r"config.sandbox.launch_local: set it to False"),
    ("sandbox.launch_local=false", r"config.sandbox.targets: tool calls need a sandbox"),
    ("data.train_files=()", r"config.data.train_files: RL needs training problems"),
    ("data.train_files=/does/not/exist.jsonl", r"config.data.train_files: /does/not/exist.jsonl does not exist"),
    ("sft.max_length=50000", r"config.sft.max_length: exceeds the model's max_position_embeddings 40960"),
    ("checkpoint.export_hf_every=15", r"config.checkpoint.export_hf_every: must be 0 or a multiple of "
                                      r"checkpoint.every_steps \(10\)"),
    ("model.hf_path=/does/not/exist", r"config.model.hf_path: /does/not/exist does not exist"),
])
def test_invalid_values_are_rejected_naming_the_field(override, message, inputs):
    config = _runnable("stage1", inputs)
    with pytest.raises(ConfigError, match=message):
        validate(apply_overrides(config, [override]))


def test_unknown_and_missing_keys_and_types_in_config_files(inputs):
    config = _runnable("stage1", inputs)
    config.rl.typo_field = 1
    with pytest.raises(ConfigError, match=r"config.rl.typo_field: unknown field \(not in configs/base.py\)"):
        validate(config)
    config = _runnable("stage1", inputs)
    del config.optim["b2"]
    with pytest.raises(ConfigError, match=r"config.optim.b2: missing"):
        validate(config)
    config = _runnable("stage1", inputs)
    config.train = ml_collections.ConfigDict({**config.train.to_dict(), "steps": "300"})
    with pytest.raises(ConfigError, match=r"config.train.steps: must be int, got str '300'"):
        validate(config)


def test_check_mesh_at_run_time():
    config = _load("stage1")
    assert check_mesh(config, 8) == (1, 8, 1)
    apply_overrides(config, ["mesh.tensor=3"])
    with pytest.raises(ConfigError, match="8 devices are not divisible by the fixed axes' product 3"):
        check_mesh(config, 8)
    apply_overrides(config, ["mesh.fsdp=2", "mesh.tensor=2"])
    with pytest.raises(ConfigError, match=r"data\*fsdp\*tensor = 4 but 8 devices"):
        check_mesh(config, 8)


def test_command_line_overrides_through_config_flags(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = [sys.executable, "-m", "rstar_jax.config", f"--config={REPO_CONFIGS / 'stage3.py'}", "--check_files=false",
            "--config.model.hf_path=/x", "--config.rollout.servers=('http://a:1','http://b:2')",
            "--config.rollout.backend=sglang", "--config.rl.dual_clip=3.0"]
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = json.loads(result.stdout)
    assert printed["stage"] == "stage3" and printed["rollout"]["max_turns"] == 15
    assert printed["rollout"]["servers"] == ["http://a:1", "http://b:2"] and printed["rl"]["dual_clip"] == 3.0
    bad = subprocess.run(args + ["--config.rl.clip_high=-1"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "config.rl.clip_high: must be in [0.0, inf], got -1" in bad.stderr
    unknown = subprocess.run(args + ["--config.rl.nosuch=1"], capture_output=True, text=True, env=env, timeout=120)
    assert unknown.returncode != 0 and "nosuch" in unknown.stderr
