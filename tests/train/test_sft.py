"""SFT: masks cover exactly the assistant text; training lowers held-out assistant-token loss."""

import pytest
from flax import nnx

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
from rstar_jax.data.synthetic import generate_problems, sft_conversation
from rstar_jax.model.qwen3 import Qwen3
from rstar_jax.train.sft import SftBatches, SftSkips, conversation_ids, eval_nll, sft_sequences
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


def test_overlong_conversations_are_skipped_and_counted():
    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    long = [{"role": "user", "content": "q" * 500}, {"role": "assistant", "content": "a"}]
    skips = SftSkips()
    kept = sft_sequences(TEMPLATE, TOK, [short, long, short], 400, skips=skips)
    assert len(kept) == 2 and (skips.overlong, skips.total) == (1, 1)
    assert "conversation 1: " in skips.examples[0] and "more than sft.max_length=400" in skips.examples[0]


@pytest.mark.slow
def test_the_tiny_runs_warm_up_teaches_the_protocol(tiny_run_dir):
    """After the default run's SFT warm-up (its two stages, shortened by TINY_RUN_OVERRIDES), sampled
    first turns on held-out problems are well-formed: a tool call (JSON with the tool's name and code)
    or a boxed answer, as the warm-up's behaviours are; some of each. The random initial policy makes
    none. The assistant-token loss on held-out solved conversations falls far."""
    import asyncio

    from rstar_jax.agent.tool_calls import ToolCall, format_observation, parse_tool_calls
    from rstar_jax.data.datasets import read_examples
    from rstar_jax.model.hf import load_pretrained
    from rstar_jax.engine.jax_engine import JaxEngine
    from rstar_jax.rollout.protocol import SamplingParams

    template = ChatTemplate.bare("python")  # configs/tiny.py's template and tool name
    held_out, _ = read_examples(tiny_run_dir / "data" / "eval.jsonl")
    prompts = [template.prompt_ids(TOK, ex.question) for ex in held_out]
    width = max(map(len, prompts))
    # The evaluation temperature; each prompt its own seed (one shared seed would make every row's first
    # draw the same).
    sampled = [SamplingParams(max_new_tokens=224, temperature=0.6, stop_token_ids=(TOK.eos_id,), seed=i)
               for i in range(len(prompts))]

    def first_turns(model) -> tuple[int, int]:
        # One prefill bucket and room for every prompt plus its budget keep compilations few.
        engine = JaxEngine(model, slots=len(prompts), max_length=width + sampled[0].max_new_tokens,
                           prefill_buckets=(width,))

        async def generate_all():
            return await asyncio.gather(*[engine.generate(p, params) for p, params in zip(prompts, sampled)])

        try:
            results = asyncio.run(generate_all())
        finally:
            engine.close()
        calls = answers = 0
        for row in (r.token_ids for r in results):
            text = TOK.decode(row[:row.index(TOK.eos_id)] if TOK.eos_id in row else row)
            parsed = parse_tool_calls(text, tool_names=(template.tool_name,))
            calls += bool(parsed) and isinstance(parsed[0], ToolCall) and "print(" in parsed[0].code
            answers += not parsed and text.endswith("</answer>") and "\\boxed{" in text
        return calls, answers

    warm = load_pretrained(tiny_run_dir / "hf" / "sft_warmup")
    initial = Qwen3(warm.config, rngs=nnx.Rngs(0))
    assert len(prompts) == 16
    calls, answers = first_turns(warm)
    print(f"after the warm-up: {calls} tool calls and {answers} boxed answers in 16 first turns")
    assert calls + answers >= 12 and calls > 0 and answers > 0
    assert first_turns(initial) == (0, 0)

    # The assistant-token loss on held-out solved conversations (problems the warm-up never saw:
    # the run's eval set, regenerated from its seed to get the reference programs).
    problems = generate_problems(16, seed=1, kinds=("last_digit_power",), difficulty=1)
    assert [p.question for p in problems] == [ex.question for ex in held_out]
    solved = [sft_conversation(p, tool_name="python",
                               format_observation=lambda r: format_observation(r, style="paper", max_chars=64))
              for p in problems]
    sequences = sft_sequences(template, TOK, solved, max_length=1024)
    batch = place_batch(next(iter(SftBatches(sequences, conversations_per_step=16, rows=16,
                                             row_length=1024).epoch(0))))
    before, after = float(eval_nll(initial, batch, 256)), float(eval_nll(warm, batch, 256))
    print(f"held-out assistant NLL {before:.3f} -> {after:.3f}")
    assert after < 0.25 * before, (before, after)  # from ~log(320) = 5.8 nats per byte


def _advance_setup(seed: int = 0):
    from rstar_jax.model.qwen3 import Qwen3Config
    from rstar_jax.train.settings import OptimizerConfig
    from rstar_jax.train.step import make_optimizer

    problems = generate_problems(24, seed=seed, kinds=("product",), difficulty=1)
    sequences = sft_sequences(TEMPLATE, TOK, [sft_conversation(p, tool_name="python") for p in problems], 512)
    # Stages of 16 and 8 conversations: 8 and 4 steps of 2.
    batches = SftBatches(sequences, conversations_per_step=2, rows=2, row_length=512, stage_sizes=(16, 8))
    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(seed))
    # "wsd" decaying over the last stage's 4 steps: constant over the steps stage 1 may skip.
    optimizer = make_optimizer(model, OptimizerConfig(lr=1e-2, warmup_steps=1, schedule="wsd", total_steps=12,
                                                      decay_ratio=4 / 12))
    return model, optimizer, batches


class _Records:
    def __init__(self):
        self.lines = []

    def write(self, step, record):
        self.lines.append((step, record))


def test_a_stage_ends_early_and_the_schedule_skips_its_remaining_steps():
    """Under sft.advance_loss a stage ends once its recent mean loss is low enough: the later stage
    keeps its planned step numbers and learning rates (the schedule skips the steps not taken), and
    a run resumed from any step in between, with the state its saves carried, ends the same."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from rstar_jax.train.loop import StageAdvance, sft_loop
    from rstar_jax.train.step import lr_schedule
    from rstar_jax.train.settings import OptimizerConfig

    plan = lr_schedule(OptimizerConfig(lr=1e-2, warmup_steps=1, schedule="wsd", total_steps=12, decay_ratio=4 / 12))
    model, optimizer, batches = _advance_setup()
    saves, metrics = {}, _Records()

    def save(step, final, state):
        # Copies: the step donates the buffers it is given.
        saves[step] = (jax.tree.map(jnp.copy, nnx.state(model)), jax.tree.map(jnp.copy, nnx.state(optimizer)), state)

    # A threshold every loss meets: stage 1 ends as soon as its window of 3 is full.
    advance = StageAdvance(loss=1e9, window=3, after_step=1)
    sft_loop(model, optimizer, batches, epochs=1, mesh=None, chunk_size=256, metrics=metrics, save=save,
             progress=False, advance=advance)
    assert [step for step, _ in metrics.lines] == [1, 2, 3, 9, 10, 11, 12]
    assert [r["sft/stage"] for _, r in metrics.lines] == [1, 1, 1, 2, 2, 2, 2]
    # The schedule's count is the plan's step; AdamW's own count is the updates made.
    counts = dict((p[-1].tuple_name, int(v.get_value())) for p, v in
                  optax.tree_utils.tree_get_all_with_path(optimizer.opt_state, "count"))
    assert counts == {"ScaleByScheduleState": 12, "ScaleByAdamState": 7}
    assert plan(8) == np.float32(1e-2) and plan(11) < np.float32(1e-2)  # stage 2 decays as planned
    assert len(saves[3][2]["stage_losses"]) == 3 and saves[9][2]["stage_losses"] == []
    final = nnx.state(model)

    # Resumed at step 2 (inside stage 1: its two losses come back) and at step 3 (the step that ended it).
    for start in (2, 3):
        model, optimizer, batches = _advance_setup()
        model_state, optimizer_state, state = saves[start]
        nnx.update(model, model_state)
        nnx.update(optimizer, optimizer_state)
        resumed = _Records()
        sft_loop(model, optimizer, batches, epochs=1, mesh=None, chunk_size=256, metrics=resumed, start=start,
                 progress=False, advance=advance, resumed_state=state)
        assert [step for step, _ in resumed.lines] == [s for s, _ in metrics.lines if s > start]
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(nnx.state(model))))

    # Without advancing, every step of the plan is taken.
    model, optimizer, batches = _advance_setup()
    whole = _Records()
    sft_loop(model, optimizer, batches, epochs=1, mesh=None, chunk_size=256, metrics=whole, progress=False,
             advance=StageAdvance(loss=0.0, window=3))
    assert [step for step, _ in whole.lines] == list(range(1, 13))



@pytest.mark.parametrize("data_parallel", [1, 8])
def test_greedy_reproduced_counts_the_sequences_greedy_decoding_writes(data_parallel):
    """`greedy_reproduced` counts a packed sequence as reproduced exactly when every trained token
    holds more than half the probability (so greedy decoding writes it), per sequence and not per
    row, on one device and with the rows split over eight; a NumPy softmax over the model's own
    logits agrees."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rstar_jax.model.qwen3 import Qwen3Config
    from rstar_jax.parallel import make_mesh
    from rstar_jax.train.batching import TrainingSequence, make_micro_batches
    from rstar_jax.train.sft import greedy_reproduced

    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(3))
    model.lm_head[...] = model.lm_head[...] * 300.0  # near one-hot: the greedy token holds ~all the probability
    rng = np.random.default_rng(0)

    def greedy(prompt, n):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(np.asarray(model(jnp.asarray([ids])))[0, -1].argmax()))
        return ids

    sequences, expected = [], []
    for i in range(12):
        prompt = rng.integers(1, 300, size=int(rng.integers(2, 6))).tolist()
        ids = greedy(prompt, int(rng.integers(3, 9)))
        mask = [0] * (len(prompt) - 1) + [1] * (len(ids) - len(prompt))  # the greedy tokens are trained
        if i % 3 == 1:  # one trained token that is not the greedy one
            j = int(rng.integers(len(prompt), len(ids)))
            ids[j] = (ids[j] + 7) % 300 + 1
        elif i % 3 == 2:  # a token that is not the greedy one, but not trained: context only
            j = len(prompt) + 1
            ids[j] = (ids[j] + 7) % 300 + 1
            mask[j - 1:] = [0] * (len(mask) - j + 1)
        expected.append(i % 3 != 1)
        sequences.append(TrainingSequence(prompt_ids=ids[:1], response_ids=ids[1:], loss_mask=mask, advantage=1.0))
    batch = make_micro_batches(sequences, rows=8, row_length=32, packed=True)
    assert batch["segment_ids"].max() > 1  # several sequences share a row

    logits = np.asarray(model(jnp.asarray(batch["input_ids"][0]), jnp.asarray(batch["positions"][0]),
                              jnp.asarray(batch["segment_ids"][0])), np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    target_prob = np.take_along_axis(probs, batch["targets"][0][..., None], -1)[..., 0]
    by_numpy = [bool(np.all(target_prob[r][(batch["segment_ids"][0][r] == s) & (batch["loss_mask"][0][r] > 0)] > 0.5))
                for r in range(8) for s in range(1, batch["segment_ids"][0][r].max() + 1)]
    assert sorted(by_numpy) == sorted(expected)

    mesh = make_mesh(data=data_parallel, fsdp=1, tensor=1, devices=jax.devices()[:data_parallel])
    reproduced, total = greedy_reproduced(model, place_batch(batch, mesh), chunk_size=16)
    assert (int(reproduced), int(total)) == (sum(expected), len(expected)) == (8, 12)


def test_a_stage_ends_once_its_held_out_conversations_are_reproduced(capsys):
    """Under sft.advance_exact a stage ends after the first measurement (every `every` steps) whose
    share of reproduced held-out conversations reaches the threshold, saying so with the counts; the
    measurements are logged; a run resumed at the step that ended it ends it too; a stage that
    never meets it takes all its steps and says so."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rstar_jax.train.loop import StageAdvance, sft_loop

    calls = []

    def probe(stage):  # 1 of 4 reproduced at step 2, 3 of 4 at step 4, ...
        calls.append(stage)
        return min(4, len(calls) * 2 - 1), 4

    model, optimizer, batches = _advance_setup()
    saves, metrics = {}, _Records()

    def save(step, final, state):
        saves[step] = (jax.tree.map(jnp.copy, nnx.state(model)), jax.tree.map(jnp.copy, nnx.state(optimizer)), state)

    advance = StageAdvance(exact=0.75, every=2, after_step=1, probe=probe)
    sft_loop(model, optimizer, batches, epochs=1, mesh=None, chunk_size=256, metrics=metrics, save=save,
             progress=False, advance=advance)
    assert [step for step, _ in metrics.lines] == [1, 2, 3, 4, 9, 10, 11, 12]
    assert [(step, r["sft/held_out_reproduced"]) for step, r in metrics.lines if "sft/held_out_reproduced" in r] == \
        [(2, 0.25), (4, 0.75)]
    assert calls == [0, 0]  # stage 1 only: the last stage cannot end early
    out = capsys.readouterr().out
    assert ("[sft] stage 1 ended at step 4 of 8: 3 of its 4 held-out conversations reproduced by greedy decoding "
            "(0.750 >= sft.advance_exact 0.75)") in out
    assert "stage_ended" in saves[4][2] and "stage_ended" not in saves[3][2]
    final = nnx.state(model)

    model, optimizer, batches = _advance_setup()
    model_state, optimizer_state, state = saves[4]
    nnx.update(model, model_state)
    nnx.update(optimizer, optimizer_state)
    resumed = _Records()
    sft_loop(model, optimizer, batches, epochs=1, mesh=None, chunk_size=256, metrics=resumed, start=4,
             progress=False, advance=advance, resumed_state=state)
    assert [step for step, _ in resumed.lines] == [9, 10, 11, 12] and calls == [0, 0]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(nnx.state(model))))

    model, optimizer, batches = _advance_setup()
    never = _Records()
    sft_loop(model, optimizer, batches, epochs=1, mesh=None, chunk_size=256, metrics=never, progress=False,
             advance=StageAdvance(exact=1.0, every=3, probe=lambda stage: (2, 4)))
    assert [step for step, _ in never.lines] == list(range(1, 13))
    assert ("[sft] stage 1 took all its steps, to 8, no criterion met: 2 of its 4 held-out conversations reproduced "
            "by greedy decoding when last measured") in capsys.readouterr().out


def test_a_stage_ends_once_its_held_out_conversations_are_reproduced_at_measurements_in_a_row(capsys):
    """Under sft.advance_consecutive the threshold must hold at that many measurements in a row: one
    at the threshold followed by one below it starts the count again (a skill caught in passing);
    the count travels in the saves, so a run resumed in the middle of a streak ends where the
    uninterrupted run did."""
    import jax
    import jax.numpy as jnp

    from rstar_jax.train.loop import StageAdvance, sft_loop

    shares = [4, 2, 4, 4, 4]  # of 4, at steps 1, 2, 3, 4, ...

    def run(start=0, state=None, restored=None):
        calls = []

        def probe(stage):
            calls.append(stage)
            return shares[len(calls) - 1 + (start or 0)], 4

        model, optimizer, batches = _advance_setup()
        if restored is not None:
            nnx.update(model, restored[0])
            nnx.update(optimizer, restored[1])
        saves, metrics = {}, _Records()

        def save(step, final, saved_state):
            saves[step] = (jax.tree.map(jnp.copy, nnx.state(model)), jax.tree.map(jnp.copy, nnx.state(optimizer)),
                           saved_state)

        sft_loop(model, optimizer, batches, epochs=1, mesh=None, chunk_size=256, metrics=metrics, save=save,
                 progress=False, start=start, resumed_state=state,
                 advance=StageAdvance(exact=1.0, every=1, after_step=1, probe=probe, consecutive=2))
        return metrics, saves, calls

    metrics, saves, calls = run()
    assert [step for step, _ in metrics.lines] == [1, 2, 3, 4, 9, 10, 11, 12]
    assert [r["sft/held_out_reproduced"] for _, r in metrics.lines if "sft/held_out_reproduced" in r] == \
        [1.0, 0.5, 1.0, 1.0]
    assert ("[sft] stage 1 ended at step 4 of 8: 4 of its 4 held-out conversations reproduced by greedy decoding "
            "(1.000 >= sft.advance_exact 1, 2 measurements in a row)") in capsys.readouterr().out
    assert [saves[step][2].get("stage_streak", 0) for step in (1, 2, 3)] == [1, 0, 1]

    resumed, _, calls = run(start=3, state=saves[3][2], restored=saves[3][:2])
    assert [step for step, _ in resumed.lines] == [4, 9, 10, 11, 12] and calls == [0]
    assert "stage 1 ended at step 4 of 8" in capsys.readouterr().out

    import pytest
    with pytest.raises(ValueError, match="consecutive must be at least 1"):
        StageAdvance(exact=1.0, probe=lambda stage: (1, 1), consecutive=0)
