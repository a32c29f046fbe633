"""`python -m rstar_jax.config --config=FILE [--config.a.b=v ...] [--check_files]`: check and print a
config without starting any work (see `rstar_jax.config`)."""

from __future__ import annotations

import sys

from absl import flags

from rstar_jax.config.cli import config_command
from rstar_jax.config import DEFAULT_CONFIG, input_problems


def main() -> None:
    check_files = flags.DEFINE_bool(
        "check_files", False, "Also check the run's inputs (data, SFT and evaluation files, policy, tokenizer): "
        "named and existing. Without it, missing inputs are listed as notes.")

    def run(config) -> None:
        print(config.to_json_best_effort(indent=2))
        if not check_files.value:
            missing = input_problems(config)
            if missing:
                print("note: a run also needs these inputs (--check_files makes them errors):", file=sys.stderr)
                for problem in missing:
                    print(f"note: {problem}", file=sys.stderr)

    config_command(DEFAULT_CONFIG, run, check_files=check_files)


if __name__ == "__main__":
    main()
