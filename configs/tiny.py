"""Embedded default: the whole pipeline's first stage on one CPU machine in seconds.

Until the RL trainer lands, `mode="demo"` runs the foundation end to end: a tiny random Qwen3 policy
created sharded over every local device, exported as a Hugging Face checkpoint, reloaded (checked
bitwise), and decoded greedily with the KV cache (checked against full-forward argmax).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.mode = "demo"
    config.run_dir = "runs/tiny"
    config.seed = 0

    config.model = ml_collections.ConfigDict()
    config.model.preset = "tiny"
    config.model.dtype = "float32"
    config.model.param_dtype = "float32"
    config.model.remat_policy = "none"
    config.model.attention_impl = "xla"

    # Product must equal the device count; -1 takes what remains.
    config.mesh = ml_collections.ConfigDict()
    config.mesh.data = 1
    config.mesh.fsdp = -1
    config.mesh.tensor = 1

    config.demo = ml_collections.ConfigDict()
    config.demo.batch_size = 4
    config.demo.prompt_length = 16
    config.demo.new_tokens = 24
    return config
