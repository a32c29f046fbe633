import numpy as np
import pytest

from rstar_jax.analysis.entropy import (
    LABEL_CODE,
    LABEL_FORKING,
    LABEL_REFLECTION,
    analyse_trajectory,
    classify_tokens,
    flag_high_entropy,
)


def test_flag_top_fraction_of_sampled_tokens_only():
    entropy = np.array([5.0, 0.1, 0.2, 9.0, 0.3, 0.4, 0.5, 0.6, 0.7, 3.0, 0.8, 0.9])
    mask = np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1])  # index 3 is a tool token
    flags = flag_high_entropy(entropy, mask, 0.2)
    # 11 sampled tokens -> round(2.2) = 2 flagged: the 5.0 and the 3.0; never the masked 9.0.
    assert np.flatnonzero(flags).tolist() == [0, 9]


def test_flag_rejects_shape_mismatch_and_handles_all_masked():
    with pytest.raises(ValueError, match="shape"):
        flag_high_entropy(np.zeros(3), np.zeros(4))
    assert not flag_high_entropy(np.ones(4), np.zeros(4)).any()


def test_classification_on_constructed_trajectory():
    # Turn 1 (sampled): reasoning, a tool call; tool response (not sampled); turn 2 (sampled).
    pieces = (
        ["Let", " me", " try", " <tool_call>", '{"code":', " print(1)", "}", "</tool_call>", "<|im_end|>"]
        + ["<|im_start|>user\n", "<tool_response>\n1\n</tool_response>", "<|im_end|>\n", "<|im_start|>assistant\n<reason>"]
        + ["Wait", ",", " the", " output", " is", " 1", ".", " But", " check"]
    )
    mask = [1] * 9 + [0] * 4 + [1] * 9
    flags = [False] * len(pieces)
    for i in (1, 5, 13, 14, 20):  # " me", " print(1)", "Wait", ",", " But"
        flags[i] = True
    labels = classify_tokens(pieces, mask, flags, reflection_window=3)
    assert labels[1] == LABEL_FORKING
    assert labels[5] == LABEL_CODE
    assert labels[13] == LABEL_REFLECTION and labels[14] == LABEL_REFLECTION
    assert labels[20] == LABEL_FORKING  # beyond the 3-token reflection window
    assert all(labels[i] == "" for i in range(len(pieces)) if not flags[i])


def test_analyse_trajectory_zeroes_tool_entropy_and_counts():
    ids = list(range(10))
    mask = [1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    entropy = [0.1, 2.0, 0.1, 7.0, 7.0, 3.0, 0.1, 0.1, 0.1, 0.1]
    rec = analyse_trajectory(ids, mask, entropy, lambda t: f"t{t} ", top_fraction=0.25, reflection_window=2)
    assert rec.entropy[3] == 0.0 and rec.entropy[4] == 0.0
    assert rec.flagged == [False, True, False, False, False, True, False, False, False, False]
    assert rec.counts() == {LABEL_FORKING: 1, LABEL_REFLECTION: 1, LABEL_CODE: 0}


def test_trajectory_entropies_equal_full_softmax():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rstar_jax.analysis.entropy import trajectory_entropies
    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config

    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompt, response = rng.integers(1, 320, 7).tolist(), rng.integers(1, 320, 13).tolist()
    with jax.default_matmul_precision("highest"):
        ent = trajectory_entropies(model, prompt, response, chunk_size=5)
        logits = model(jnp.asarray([prompt + response]))[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    full = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    # Response token i is predicted at position len(prompt) - 1 + i.
    np.testing.assert_allclose(ent, np.asarray(full[len(prompt) - 1:len(prompt) - 1 + len(response)]), atol=1e-5)
