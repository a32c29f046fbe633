"""SFT: masks cover exactly the assistant text; training lowers held-out assistant-token loss."""

import pytest
from flax import nnx

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
from rstar_jax.data.synthetic import generate_problems, sft_conversation
from rstar_jax.model.qwen3 import Qwen3
from rstar_jax.train.sft import SftBatches, conversation_ids, eval_nll, sft_sequences
from rstar_jax.train.step import place_batch

TOK = ByteTokenizer()
# The compact prompt keeps CPU test sequences small; the release's template is tested elsewhere.
TEMPLATE = ChatTemplate.compact()


def test_mask_covers_assistant_text_only():
    messages = [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "call"},
                {"role": "tool", "content": "42"}, {"role": "assistant", "content": "done"}]
    ids, mask = conversation_ids(TEMPLATE, TOK, messages)
    trained = TOK.decode([i for i, m in zip(ids, mask) if m])
    assert trained == f"call{IM_END}done{IM_END}"
    assert TOK.decode(ids).endswith(f"<|im_start|>assistant\n<reason>done{IM_END}")


def test_overlong_conversation_is_an_error():
    with pytest.raises(ValueError, match="more than sft.max_length=10"):
        sft_sequences(TEMPLATE, TOK, [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]], 10)


@pytest.mark.slow
def test_the_tiny_runs_warm_up_teaches_well_formed_tool_calls(tiny_run_dir):
    """After the default run's SFT warm-up, greedy first turns on held-out problems are well-formed
    tool calls (JSON with the tool's name and code) on most problems; the random initial policy
    makes none."""
    import asyncio

    from rstar_jax.agent.tool_calls import ToolCall, parse_tool_calls
    from rstar_jax.data.datasets import read_examples
    from rstar_jax.model.hf import load_pretrained
    from rstar_jax.rollout.engine import JaxEngine
    from rstar_jax.rollout.protocol import SamplingParams

    template = ChatTemplate.compact()
    held_out, _ = read_examples(tiny_run_dir / "data" / "eval.jsonl")
    prompts = [template.prompt_ids(TOK, ex.question) for ex in held_out]
    width = max(map(len, prompts))
    greedy = SamplingParams(max_new_tokens=224, temperature=0.0, stop_token_ids=(TOK.eos_id,))

    def well_formed_rate(model) -> float:
        # One prefill bucket and room for every prompt plus its budget keep compilations few.
        engine = JaxEngine(model, slots=len(prompts), max_length=width + greedy.max_new_tokens,
                           prefill_buckets=(width,))

        async def generate_all():
            return await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])

        try:
            results = asyncio.run(generate_all())
        finally:
            engine.close()
        good = 0
        for row in (r.token_ids for r in results):
            text = TOK.decode(row[:row.index(TOK.eos_id)] if TOK.eos_id in row else row)
            calls = parse_tool_calls(text, tool_names=(template.tool_name,))
            good += bool(calls) and isinstance(calls[0], ToolCall) and "print(" in calls[0].code
        return good / len(prompts)

    warm = load_pretrained(tiny_run_dir / "hf" / "sft_warmup")
    initial = Qwen3(warm.config, rngs=nnx.Rngs(0))
    assert len(prompts) == 16
    rate = well_formed_rate(warm)
    print(f"well-formed tool calls after the warm-up: {rate:.2f}")
    assert rate >= 0.75
    assert well_formed_rate(initial) == 0.0

    # The assistant-token loss on held-out solved conversations (problems the warm-up never saw:
    # the run's eval set, regenerated from its seed to get the reference programs).
    from rstar_jax.agent.tool_calls import format_observation

    class _Ok:
        status, stderr, duration_s = "ok", "", 0.0

        def __init__(self, stdout):
            self.stdout = stdout

    problems = generate_problems(16, seed=1, kinds=("last_digit_power", "modular_power"), difficulty=1)
    assert [p.question for p in problems] == [ex.question for ex in held_out]
    solved = [sft_conversation(p, format_observation=lambda out: format_observation(_Ok(out), style="paper",
                                                                                    max_chars=64))
              for p in problems]
    sequences = sft_sequences(template, TOK, solved, max_length=1024)
    batch = place_batch(next(iter(SftBatches(sequences, conversations_per_step=16, rows=16,
                                                 row_length=1024).epoch(0))))
    before, after = float(eval_nll(initial, batch, 256)), float(eval_nll(warm, batch, 256))
    print(f"held-out assistant NLL {before:.3f} -> {after:.3f}")
    assert after < 0.25 * before, (before, after)  # from ~log(320) = 5.8 nats per byte
