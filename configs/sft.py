"""Non-reasoning SFT before RL: 3 epochs, lr 5e-6, 4% warm-up, cosine decay, batch 128 (spec §5.1).

The paper's SFT data is unreleased; pass conversations with `--config.sft.train_files=...`: jsonl,
json or parquet rows of {"messages": [...], "tools": [...]} in the messages format of Hugging Face
chat templates and OpenAI (system prompts, multi-turn dialogue, structured tool calls, tool results).
The paper's mix (spec §5.1: ToolACE, APIGen-MT, Glaive and Magicoder as JSON function calls, Tulu3
instruction following, Llama-Nemotron chat) is general data, so it is rendered with Qwen3's stock
chat template; a math tool-use file in the RL layout takes "rstar2" in its place in sft.templates.
"""

import ml_collections

from rstar_jax.config import sibling_config


def get_config() -> ml_collections.ConfigDict:
    c = sibling_config(__file__, "base")
    c.mode = "sft"
    c.stage = "sft"
    c.run_dir = "runs/sft"
    # The release's SFT checkpoint name (...qwen_template_general_data...) suggests the stock template.
    c.sft.templates = ("qwen3",)
    c.sandbox.preset = "release"  # tool results in synthetic SFT data render as the RL stages will show them
    c.checkpoint.every_steps = 200
    c.checkpoint.export_hf_every = 0  # the SFT trainer exports the final policy for stage 1
    return c
