"""The main job: `python -m rstar_jax.launch [--config=configs/tiny.py] [--config.a.b=v ...]`.

Without --config the embedded default `configs/tiny.py` runs. `config.mode` picks the stage: "sft",
"rl" (with the SFT warm-up when `sft.before_rl`) or "eval" (the same run as `rstar_jax.evaluate`).
"""

from __future__ import annotations

from rstar_jax.cli import config_command
from rstar_jax.config import DEFAULT_CONFIG
from rstar_jax.parallel import maybe_initialize_distributed
from rstar_jax.train.held_out import run_evaluation
from rstar_jax.train.run import run_stage

SUMMARY_KEYS = ("sft/loss", "rollout/reward_mean", "update/loss", "eval/pass@1")


def run(config) -> None:
    if config.mode == "eval":
        run_evaluation(config)
        return
    maybe_initialize_distributed()
    summary = run_stage(config)
    print(f"[{config.mode}] done: {config.run_dir} " + " ".join(
        f"{k}={v:.4g}" for k, v in summary.items() if isinstance(v, float) and k.startswith(SUMMARY_KEYS)))


def main() -> None:
    config_command(DEFAULT_CONFIG, run)


if __name__ == "__main__":
    main()
