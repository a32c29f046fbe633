"""avg@k evaluation with the agentic loop: `python -m rstar_jax.evaluate --config=configs/eval.py`.

    python -m rstar_jax.evaluate --config=configs/eval.py --config.model.hf_path=<HF dir> \\
        --config.eval.files="('aime24.json','aime25.json')" --config.run_dir=runs/eval_aime

Every question of `eval.files` gets `eval.k` responses from the multi-turn tool-using loop at the
protocol's settings (spec §5.4), on the in-process engine or on SGLang-compatible servers
(`eval.generator_urls`). The run directory gets `samples.jsonl` (resumable: a rerun samples only
the questions without a complete group; changed settings are refused), `eval_settings.json` and
`report.json` (per file and overall avg@k with its standard error, pass@j, lengths, tool use).
Any stage config evaluates its policy the same way (the mode is set to "eval").
"""

from __future__ import annotations

from rstar_jax.config.cli import config_command
from rstar_jax.config import REPO_CONFIGS

LIBRARIES = ("rstar_jax.app.held_out",)  # imported by run(), after the flags are parsed


def run(config) -> None:
    from rstar_jax.app.held_out import run_evaluation

    run_evaluation(config)


def main() -> None:
    def prepare(config) -> None:
        config.mode = "eval"

    config_command(REPO_CONFIGS / "eval.py", run, prepare=prepare, libraries=LIBRARIES)


if __name__ == "__main__":
    main()
