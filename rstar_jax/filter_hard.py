"""The stage-3 hard set (spec §5.3): drop the training problems the current policy solves k of k.

    python -m rstar_jax.filter_hard --config=configs/stage3.py \\
        --config.filter_hard.input_files="('dapo.parquet',)" [--config.model.hf_path=runs/stage2/hf/final]

`filter_hard.k` rollouts per problem of `filter_hard.input_files` (else `data.train_files`) at the
config's rollout settings, sampled by the same resumable code as `rstar_jax.evaluate` (records in
`<run_dir>/filter_hard/samples.jsonl`); every problem not solved k of k is written to
`filter_hard.output_file` with its original row content, in the input's format. The policy:
filter_hard.checkpoint_dir (an orbax run), model.hf_path, or train.init_from (a stage-3 config's:
the stage-2 checkpoints).
"""

from __future__ import annotations

from rstar_jax.config.cli import config_command
from rstar_jax.config import DEFAULT_CONFIG, check_filter_hard

LIBRARIES = ("rstar_jax.app.held_out",)  # imported by run(), after the flags are parsed


def run(config) -> None:
    from rstar_jax.app.held_out import run_filter_hard

    run_filter_hard(config)


def main() -> None:
    # A stage-3 config's data.train_files is this command's output: it need not exist yet, so the
    # file checks are those of check_filter_hard (inputs, policy), not the RL mode's.
    config_command(DEFAULT_CONFIG, run, check_files=False, check=check_filter_hard, libraries=LIBRARIES)


if __name__ == "__main__":
    main()
