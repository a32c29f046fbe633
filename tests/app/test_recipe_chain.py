"""The recipe's stage chain through the commands the README gives, on tiny settings: SFT (general
messages-format data on Qwen3's template, then math tool use on the RL template) -> stage 1
(`model.hf_path=runs/sft/hf/final`) -> stage 2 (`train.init_from`, the config's default) ->
`filter_hard` -> stage 3 (optimizer reset, the hard subset) -> `evaluate` on stage 3's export.

It starts from a Hugging Face directory as users do: a tiny random transformers Qwen3 and a
byte-level BPE tokenizer with the ChatML specials, built here. Every stage reads what the previous
one wrote, at the paths the configs name (the commands run in a fresh working directory), on 8 CPU
devices (stage 2 and 3 train on fsdp x tensor 2, as their configs say).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from rstar_jax.data.synthetic import prepare_synthetic_data
from tests.agent.test_sft_conversations import ROWS as GENERAL_SFT_ROWS

pytestmark = pytest.mark.slow  # six launcher runs

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# What keeps every stage small: 2 prompts x 4 rollouts, 64-token responses after the ~1.9K-token
# rStar2 prompt (bytes), one step.
SMALL = ["--config.rollout.max_prompt_length=2048", "--config.rollout.response_budget=64",
         "--config.rollout.engine.max_length=2112", "--config.rollout.engine.slots=8",
         "--config.rl.micro_batch_tokens=2176", "--config.rollout.max_turns=2", "--config.metrics.progress_bar=False",
         "--config.sandbox.workers=1"]
RL = [*SMALL, "--config.data.num_prompts_per_step=2", "--config.rollout.rollouts_per_prompt=4",
      "--config.rl.group_size=2", "--config.train.steps=1"]


def _base_model(directory: pathlib.Path) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True)
    alphabet = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # 256 bytes
    tok = Tokenizer(models.BPE(vocab=alphabet, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)


def _run(cwd: pathlib.Path, module: str, config: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", module, f"--config=configs/{config}.py", *args], cwd=cwd,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, f"{module} {config}:\n{result.stderr[-4000:]}"
    return result.stdout


def test_the_readme_chain_from_a_hugging_face_checkpoint(tmp_path):
    import transformers

    work = tmp_path / "work"
    (work / "configs").mkdir(parents=True)
    for path in (pathlib.Path(__file__).resolve().parents[2] / "configs").glob("*.py"):
        (work / "configs" / path.name).write_text(path.read_text())
    base = work / "base_model"
    _base_model(base)
    files = prepare_synthetic_data(work / "data", num_train=16, num_eval=2, kinds=("product",),
                                   sft_stages=((8, (0.0, 1.0, 0.0)),))

    # The SFT mix as users have it: general messages-format data (system prompts, tools, structured
    # calls) on Qwen3's stock template, then the math tool-use file on the RL template.
    general = work / "data" / "general.jsonl"
    general.write_text("".join(json.dumps(row) + "\n" for row in GENERAL_SFT_ROWS))
    _run(work, "rstar_jax.launch", "sft", f"--config.model.hf_path={base}",
         f"--config.sft.train_files=('{general}','{files.sft[0]}')", "--config.sft.templates=('qwen3','rstar2')",
         *SMALL, "--config.sft.max_length=2176", "--config.sft.micro_batch_tokens=2176", "--config.sft.batch_size=4",
         "--config.sft.epochs=1")
    _run(work, "rstar_jax.launch", "stage1", "--config.model.hf_path=runs/sft/hf/final",
         f"--config.data.train_files=('{files.train}',)", *RL)
    stage2 = _run(work, "rstar_jax.launch", "stage2", f"--config.data.train_files=('{files.train}',)", *RL)
    assert "[rl] initialised from runs/stage1/checkpoints step 1; steps continue from 1, its prompt stream continued" \
        in stage2
    _run(work, "rstar_jax.filter_hard", "stage3", f"--config.filter_hard.input_files=('{files.train}',)",
         "--config.filter_hard.k=1", *SMALL)
    assert (work / "runs" / "stage3" / "hard_subset.jsonl").is_file()
    stage3 = _run(work, "rstar_jax.launch", "stage3", *RL)
    assert "[rl] initialised from runs/stage2/checkpoints step 1 (optimizer reset); steps continue from 2" in stage3
    final = work / "runs" / "stage3" / "hf" / "final"
    _run(work, "rstar_jax.evaluate", "eval", f"--config.model.hf_path={final}",
         f"--config.eval.files=('{files.eval}',)", "--config.eval.k=1", "--config.eval.response_budget=64",
         "--config.eval.max_turns=2", *SMALL)
    report = json.loads((work / "runs" / "eval" / "report.json").read_text())
    assert report["overall"]["num_questions"] == 2

    # The last export is a whole checkpoint: transformers loads model and tokenizer, and generation
    # stops on <|im_end|> (and <|endoftext|>).
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    im_end, endoftext = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.eos_token_id == [im_end, endoftext]
    assert tokenizer.decode(tokenizer("<|im_start|>user\n12 * 34?<|im_end|>")["input_ids"]) == \
        "<|im_start|>user\n12 * 34?<|im_end|>"
    assert json.loads((final / "config.json").read_text())["torch_dtype"] in ("bfloat16", None) or \
        json.loads((final / "config.json").read_text()).get("dtype") == "bfloat16"
