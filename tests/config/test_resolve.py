"""`rstar_jax.config.resolve`: each config field reaches the settings field it names, by the generic
conversion, and a refused value names the config field."""

import pytest

from rstar_jax.config import REPO_CONFIGS, ConfigError, load_config_file, resolve

# (config path, a valid value other than tiny.py's, resolver, the settings attribute it sets)
CARRIED = [
    ("rl.clip_low", 0.15, resolve.loss_config, "clip_low"),
    ("rl.clip_high", 0.3, resolve.loss_config, "clip_high"),
    ("rl.dual_clip", 2.5, resolve.loss_config, "dual_clip"),
    ("rl.entropy_coef", 0.01, resolve.loss_config, "entropy_coef"),
    ("rl.loss_agg_mode", "seq-mean-token-sum", resolve.loss_config, "loss_agg_mode"),
    ("rl.loss_scale_factor", 123.0, resolve.loss_config, "loss_scale_factor"),
    ("rollout.response_budget", 77, resolve.loss_config, "loss_scale_factor"),  # Dr.GRPO's H when unset
    ("rl.rollout_is", "sequence", resolve.loss_config, "rollout_is"),
    ("rl.rollout_is_threshold", 3.5, resolve.loss_config, "rollout_is_threshold"),
    ("rl.rollout_rs_threshold", 5.0, resolve.loss_config, "rollout_rs_threshold"),
    ("rl.rollout_rs_threshold_lower", 0.25, resolve.loss_config, "rollout_rs_threshold_lower"),
    ("rl.group_size", 2, resolve.roc_config, "group_size"),
    ("rl.roc_variant", "release", resolve.roc_config, "variant"),
    ("rl.roc_epsilon", 0.05, resolve.roc_config, "epsilon"),
    ("rl.roc_min_per_class", 1, resolve.roc_config, "min_per_class"),
    ("rl.roc_min_negatives", 1, resolve.roc_config, "min_negatives"),
    ("rl.roc_zero_advantage", "drop", resolve.roc_config, "zero_advantage"),
    ("seed", 17, resolve.rl_settings, "seed"),
    ("rollout.max_turns", 5, resolve.loop_config, "max_turns"),
    ("rollout.max_tool_calls_per_turn", 2, resolve.loop_config, "max_calls_per_turn"),
    ("rollout.tools", False, resolve.loop_config, "use_tools"),
    ("rollout.max_abort_resumes", 3, resolve.loop_config, "max_abort_resumes"),
    ("optim.lr", 3e-6, resolve.optimizer_config, "lr"),
    ("optim.b2", 0.95, resolve.optimizer_config, "b2"),
    ("train.steps", 77, resolve.optimizer_config, "total_steps"),
    ("rl.use_sampler_logprobs", True, resolve.batch_config, "use_sampler_logprobs"),
    ("sandbox.memory_mb", 777, resolve.tool_env, "memory_mb"),
    ("rollout.observation_max_chars", 99, resolve.tool_env, "observation_max_chars"),
]


def _tiny():
    return load_config_file(REPO_CONFIGS / "tiny.py")


@pytest.mark.parametrize("path, value, resolver, attribute", CARRIED)
def test_a_config_field_reaches_its_settings_field(path, value, resolver, attribute):
    config = _tiny()
    before = getattr(resolver(config), attribute)
    assert before != value, "pick a value the test can tell from tiny.py's"
    config.update_from_flattened_dict({path: value})
    assert getattr(resolver(config), attribute) == value


def test_the_evaluation_loop_samples_from_the_eval_section_and_calls_tools_as_the_rollout_does():
    config = _tiny()
    config.update_from_flattened_dict({"eval.temperature": 0.0, "eval.max_turns": 2, "rollout.tool_name": "py"})
    loop = resolve.loop_config(config, "eval")
    assert (loop.temperature, loop.max_turns, loop.tool_name) == (0.0, 2, "py")
    assert loop.tool_env == resolve.tool_env(config)


def test_the_sft_optimizer_takes_adamw_from_optim_and_its_schedule_from_sft():
    config = _tiny()
    config.update_from_flattened_dict({"optim.weight_decay": 0.2, "sft.lr": 5e-5, "sft.warmup_ratio": 0.5})
    sft = resolve.sft_optimizer_config(config, total_steps=100)
    assert (sft.weight_decay, sft.lr, sft.warmup_steps, sft.total_steps) == (0.2, 5e-5, 50, 100)


def test_sft_has_its_own_second_moment_decay_and_rl_keeps_optims():
    config = _tiny()
    config.update_from_flattened_dict({"sft.b2": 0.9, "optim.b2": 0.99})
    assert resolve.sft_optimizer_config(config, total_steps=100).b2 == 0.9
    assert resolve.optimizer_config(config).b2 == 0.99


@pytest.mark.parametrize("path, value, resolver, named", [
    ("rl.roc_epsilon", -1.0, resolve.roc_config, "config.rl.roc_epsilon"),
    ("rollout.max_tool_calls_per_turn", 0, resolve.loop_config, "config.rollout.max_tool_calls_per_turn"),
    ("optim.b1", 1.5, resolve.optimizer_config, "config.optim.b1"),
    ("sft.b2", 1.0, lambda c: resolve.sft_optimizer_config(c, 100), "config.sft.b2"),
    ("rl.policy_loss", "nope", resolve.loss_config, "config.rl.policy_loss"),
])
def test_a_refused_value_names_the_config_field(path, value, resolver, named):
    config = _tiny()
    config.update_from_flattened_dict({path: value})
    with pytest.raises(ConfigError, match=named.replace(".", r"\.") + ":"):
        resolver(config)


@pytest.mark.parametrize("field", ["advance_exact", "advance_loss"])
@pytest.mark.parametrize("overrides, stages, message", [
    ({}, [100], r"there is one stage"),
    ({"sft.schedule": "cosine"}, [100, 20], r"sft.schedule='cosine' decays over every step: use 'wsd' with a "
                                            r"sft.decay_ratio of at most 0.1667, or 'constant'"),
    ({"sft.decay_ratio": 0.25}, [100, 20], r"until the last stage starts \(step 100\), but sft.schedule='wsd' "
                                           r"decays from step 90"),
])
def test_a_stage_that_may_end_early_needs_a_constant_rate_until_the_last_stage(overrides, stages, message, field):
    from rstar_jax.app.stage import _stage_advance

    config = _tiny()
    config.update_from_flattened_dict({"sft.advance_exact": 0.0, "sft.advance_loss": 0.0, f"sft.{field}": 0.5,
                                       **overrides})
    with pytest.raises(ConfigError, match=rf"config\.sft\.{field}: .*" + message):
        _stage_advance(config, stages, resolve.sft_optimizer_config(config, sum(stages)))
    config.sft[field] = 0.0
    assert _stage_advance(config, stages, resolve.sft_optimizer_config(config, sum(stages))) is None


def test_the_default_runs_warm_up_ends_its_first_stage_on_held_out_reproduction():
    from rstar_jax.app.stage import _stage_advance

    config = _tiny()
    probe = config.sft.advance_probe
    stages = [(n - probe) // config.sft.batch_size for n, _ in config.data.synthetic.sft_stages[:1]]
    stages += [n // config.sft.batch_size for n, _ in config.data.synthetic.sft_stages[1:]]
    optimizer = resolve.sft_optimizer_config(config, sum(stages))
    advance = _stage_advance(config, stages, optimizer, probe=lambda stage: (0, 1))
    assert (advance.exact, advance.every, advance.loss) == (0.95, 25, 0.0)
    assert advance.after_step == optimizer.warmup_steps
