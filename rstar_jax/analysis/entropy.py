"""Token-entropy analysis of trajectories: high-entropy "forking" and "reflection" tokens.

Reproduces the analysis of rStar2-Agent §5.4 (Figs. 10–11): per-token entropy of the policy's
next-token distribution along sampled trajectories, tool tokens masked out, the top 20% of each
trajectory's sampled tokens flagged, and each flagged token classified:

- ``reflection``: within the first ``reflection_window`` sampled tokens after a tool response (the
  agentic pattern the paper highlights: the model reacting to execution feedback);
- ``code``: inside a ``<tool_call> ... </tool_call>`` block (mostly low entropy in the paper);
- ``forking``: any other flagged token of the model's own reasoning ("But before", "double-check").

Entropies come from the same chunked pass as the loss (`rstar_jax.rl.token_logprobs`), so the
[length, vocab] logits are never materialised.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

LABEL_NONE = ""
LABEL_FORKING = "forking"
LABEL_REFLECTION = "reflection"
LABEL_CODE = "code"

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def flag_high_entropy(entropy: np.ndarray, loss_mask: np.ndarray, top_fraction: float = 0.2) -> np.ndarray:
    """Flags the top `top_fraction` highest-entropy tokens among those with loss_mask 1.

    The threshold is the (1 - top_fraction) quantile of the trajectory's sampled-token entropies
    (the paper thresholds each trajectory at its 80th percentile); tool tokens are never flagged.
    """
    entropy = np.asarray(entropy, np.float64)
    mask = np.asarray(loss_mask).astype(bool)
    if entropy.shape != mask.shape:
        raise ValueError(f"flag_high_entropy: entropy shape {entropy.shape} != loss_mask shape {mask.shape}")
    if not 0.0 < top_fraction <= 1.0:
        raise ValueError(f"flag_high_entropy: top_fraction must be in (0, 1], got {top_fraction}")
    flags = np.zeros(mask.shape, bool)
    sampled = np.flatnonzero(mask)
    if sampled.size == 0:
        return flags
    n_flag = max(1, int(round(top_fraction * sampled.size)))
    # Stable ordering: ties broken by position so the result is deterministic.
    order = sampled[np.argsort(-entropy[sampled], kind="stable")]
    flags[order[:n_flag]] = True
    return flags


def _char_spans(pieces: Sequence[str]) -> np.ndarray:
    starts = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum([len(p) for p in pieces], out=starts[1:])
    return starts


def classify_tokens(
    token_texts: Sequence[str],
    loss_mask: Sequence[int],
    flags: Sequence[bool],
    reflection_window: int = 16,
) -> list[str]:
    """Labels every flagged token as reflection / code / forking ('' for unflagged tokens).

    `token_texts` are the decoded pieces of the response tokens (one per token), so character
    positions of `<tool_call>` blocks map back to tokens. A token is a reflection token when it is
    among the first `reflection_window` sampled tokens after a run of non-sampled (tool response)
    tokens; code when it lies inside a tool-call block; forking otherwise.
    """
    n = len(token_texts)
    if not (len(loss_mask) == len(flags) == n):
        raise ValueError(
            f"classify_tokens: {n} token texts, {len(loss_mask)} mask entries, {len(flags)} flags"
        )
    mask = np.asarray(loss_mask).astype(bool)
    starts = _char_spans(token_texts)
    text = "".join(token_texts)

    in_code = np.zeros(n, bool)
    pos = 0
    while True:
        open_at = text.find(TOOL_CALL_OPEN, pos)
        if open_at < 0:
            break
        close_at = text.find(TOOL_CALL_CLOSE, open_at)
        end = len(text) if close_at < 0 else close_at + len(TOOL_CALL_CLOSE)
        # Tokens whose first character lies inside the block (tags included).
        first = np.searchsorted(starts[:-1], open_at, side="right") - 1
        last = np.searchsorted(starts[:-1], end, side="left")
        in_code[max(first, 0):last] = True
        pos = end

    since_tool = np.full(n, np.iinfo(np.int64).max, np.int64)
    seen_tool = False
    count = 0
    for i in range(n):
        if not mask[i]:
            seen_tool = True
            count = 0
            continue
        if seen_tool:
            since_tool[i] = count
            count += 1

    labels = []
    for i in range(n):
        if not flags[i]:
            labels.append(LABEL_NONE)
        elif since_tool[i] < reflection_window and not in_code[i]:
            labels.append(LABEL_REFLECTION)
        elif in_code[i]:
            labels.append(LABEL_CODE)
        else:
            labels.append(LABEL_FORKING)
    return labels


@dataclasses.dataclass
class TokenEntropyRecord:
    """Per-token entropy and classification of one trajectory."""

    token_ids: list[int]
    token_texts: list[str]
    loss_mask: list[int]
    entropy: list[float]
    flagged: list[bool]
    labels: list[str]

    def counts(self) -> dict[str, int]:
        out = {LABEL_FORKING: 0, LABEL_REFLECTION: 0, LABEL_CODE: 0}
        for label in self.labels:
            if label:
                out[label] += 1
        return out


def analyse_trajectory(
    token_ids: Sequence[int],
    loss_mask: Sequence[int],
    entropy: Sequence[float],
    decode_token,
    *,
    top_fraction: float = 0.2,
    reflection_window: int = 16,
) -> TokenEntropyRecord:
    """Flags and classifies one trajectory's response tokens given their entropies.

    `decode_token(id) -> str` renders one token (special tokens kept).
    """
    entropy_arr = np.asarray(entropy, np.float64)
    mask_arr = np.asarray(loss_mask, np.int64)
    if len(token_ids) != len(mask_arr) or len(token_ids) != len(entropy_arr):
        raise ValueError(
            f"analyse_trajectory: {len(token_ids)} tokens, {len(mask_arr)} mask entries, {len(entropy_arr)} entropies"
        )
    # Tool tokens carry no policy entropy worth studying: zero them so plots are not misleading.
    entropy_arr = np.where(mask_arr.astype(bool), entropy_arr, 0.0)
    texts = [decode_token(int(t)) for t in token_ids]
    flags = flag_high_entropy(entropy_arr, mask_arr, top_fraction)
    labels = classify_tokens(texts, mask_arr, flags, reflection_window)
    return TokenEntropyRecord(
        token_ids=[int(t) for t in token_ids],
        token_texts=texts,
        loss_mask=mask_arr.tolist(),
        entropy=entropy_arr.tolist(),
        flagged=flags.tolist(),
        labels=labels,
    )


def trajectory_entropies(model, prompt_ids: Sequence[int], response_ids: Sequence[int], *,
                         chunk_size: int = 1024) -> np.ndarray:
    """Entropy of the policy's next-token distribution at every response position.

    Position i of the result is the entropy of the distribution that produced response token i
    (conditioned on the prompt and response[:i]), computed with the chunked pass of
    `rstar_jax.rl.token_logprobs`, so the [length, vocab] logits are never materialised.
    """
    import jax.numpy as jnp

    from rstar_jax.rl.logprobs import token_logprobs

    if len(prompt_ids) == 0 or len(response_ids) == 0:
        raise ValueError("trajectory_entropies: prompt and response must both be non-empty")
    tokens = np.concatenate([np.asarray(prompt_ids, np.int32), np.asarray(response_ids, np.int32)])
    inputs = jnp.asarray(tokens[None, :-1])
    targets = jnp.asarray(tokens[None, 1:])
    hidden = model.hidden_states(inputs)
    _, entropy = token_logprobs(hidden, model.unembedding(), targets, chunk_size=chunk_size, return_entropy=True)
    return np.asarray(entropy[0, len(prompt_ids) - 1:])
