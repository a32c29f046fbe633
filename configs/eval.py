"""avg@16 evaluation with the agentic loop: temperature 0.6, T = 30, up to 30K tokens (spec §5.4).

`python -m rstar_jax.evaluate --config=configs/eval.py --config.model.hf_path=<policy>
 --config.eval.files="('aime2024_test.json',)"` (JSON lists of {index, question, answer}).
The policy may instead be an orbax run (`--config.eval.checkpoint_dir=runs/stage3`, optionally
`--config.eval.checkpoint_step=N`) or SGLang-compatible servers already serving it
(`--config.eval.generator_urls="('http://host:30000',)"`, with `--config.tokenizer.path`).
Sampling reads config.eval; the in-process engine holds max_prompt_length + eval.response_budget
tokens per slot. A restarted run resumes per question from `<run_dir>/samples.jsonl`.
"""

import ml_collections

from rstar_jax.config import sibling_config


def get_config() -> ml_collections.ConfigDict:
    c = sibling_config(__file__, "base")
    c.mode = "eval"
    c.stage = "eval"
    c.run_dir = "runs/eval"
    c.sandbox.preset = "release"  # evaluate the policy in the tool environment the recipe trains it in
    c.rollout.temperature = c.eval.temperature
    c.rollout.top_p = c.eval.top_p
    c.rollout.max_turns = c.eval.max_turns
    c.rollout.response_budget = c.eval.response_budget
    c.rollout.engine.max_length = c.rollout.max_prompt_length + c.eval.response_budget
    c.rl.micro_batch_tokens = c.rollout.max_prompt_length + c.eval.response_budget
    return c
