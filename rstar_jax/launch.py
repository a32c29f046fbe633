"""The main job: `python -m rstar_jax.launch [--config=configs/tiny.py] [--config.a.b=v ...]`.

Without --config the embedded default `configs/tiny.py` runs. `config.mode` picks the stage: "sft",
"rl" (with the SFT warm-up when `sft.before_rl`) or "eval" (the same run as `rstar_jax.evaluate`).
"""

from __future__ import annotations

from rstar_jax.config.cli import config_command
from rstar_jax.config import DEFAULT_CONFIG

SUMMARY_KEYS = ("sft/loss", "rollout/reward_mean", "update/loss")
# What run() imports (JAX and the rest): after the flags are parsed, so that --help and config
# mistakes answer at once.
LIBRARIES = ("rstar_jax.app.held_out", "rstar_jax.app.stage")


def run(config) -> None:
    from rstar_jax.app.held_out import run_evaluation
    from rstar_jax.app.stage import run_stage
    from rstar_jax.parallel import maybe_initialize_distributed, multihost

    if config.mode == "eval":
        run_evaluation(config)
        return
    maybe_initialize_distributed()
    with multihost.exit_job_on_failure():
        summary = run_stage(config)
    line = " ".join(f"{k}={v:.4g}" for k, v in summary.items() if isinstance(v, float) and k in SUMMARY_KEYS)
    if "eval/pass@1_first" in summary:  # held-out pass@1 where RL started and where it ended
        line += (f" eval/pass@1 {summary['eval/pass@1_first']:.3f} (step {summary['eval/first_step']}) -> "
                 f"{summary['eval/pass@1']:.3f} +- {summary['eval/pass@1_stderr']:.3f} (step {summary['step']}, "
                 f"{summary['eval/num_problems']} problems)")
    print(f"[{config.mode}] done: {config.run_dir} {line}")


def main() -> None:
    config_command(DEFAULT_CONFIG, run, libraries=LIBRARIES)


if __name__ == "__main__":
    main()
