"""SFT: masks cover exactly the assistant text; training lowers held-out assistant-token loss."""

import jax
import numpy as np
import pytest
from flax import nnx

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
from rstar_jax.data.synthetic import generate_problems, sft_conversation
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.train.sft import SftBatches, as_device_batch, conversation_ids, eval_nll, sft_sequences, sft_step
from rstar_jax.train.step import OptimizerConfig, make_optimizer

TOK = ByteTokenizer()
# A short system prompt keeps CPU test sequences small; the real template is tested elsewhere.
TEMPLATE = ChatTemplate(system_prompt="Solve it.")


def test_mask_covers_assistant_text_only():
    messages = [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "call"},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "done"}]
    ids, mask = conversation_ids(TEMPLATE, TOK, messages)
    trained = TOK.decode([i for i, m in zip(ids, mask) if m])
    assert trained == f"call{IM_END}done{IM_END}"
    assert TOK.decode(ids).endswith(f"<|im_start|>assistant\n<reason>done{IM_END}")


def test_sft_lowers_held_out_assistant_loss():
    problems = generate_problems(28, seed=0, difficulty=1)
    conversations = [sft_conversation(p) for p in problems]
    train = sft_sequences(TEMPLATE, TOK, conversations[:24], max_length=2048)
    held_out = sft_sequences(TEMPLATE, TOK, conversations[24:], max_length=2048)
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in train + held_out)
    row_length = -(-longest // 128) * 128
    batches = SftBatches(train, conversations_per_step=4, rows=2, row_length=row_length)
    held = SftBatches(held_out, conversations_per_step=4, rows=2, row_length=row_length)
    model = Qwen3(Qwen3Config.tiny(max_position_embeddings=row_length), rngs=nnx.Rngs(0))
    opt = make_optimizer(model, OptimizerConfig(lr=3e-3, warmup_steps=1, schedule="cosine", total_steps=6))
    held_batch = as_device_batch(next(iter(held.epoch(0))))
    before = float(eval_nll(model, held_batch, chunk_size=256))
    losses = []
    for epoch in range(1):
        for batch in batches.epoch(epoch):
            losses.append(float(sft_step(model, opt, as_device_batch(batch), 256)["loss"]))
    after = float(eval_nll(model, held_batch, chunk_size=256))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert after < before - 0.5, (before, after)  # from ~log(320) = 5.8 nats per token


def test_overlong_conversation_is_an_error():
    with pytest.raises(ValueError, match="more than sft.max_length=10"):
        sft_sequences(TEMPLATE, TOK, [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]], 10)
