"""Per-sequence reductions over [..., T] token arrays whose rows may pack several sequences.

A row holds one sequence, or several packed end to end and told apart by `segment_ids` (1..k in
order along the row, 0 for padding; each sequence contiguous). Sequence-level losses need, at every
token, a figure of the whole sequence it belongs to (its token count, its summed log-ratio). These
are computed along the row only — a segmented scan, then a gather within the row — so a batch
sharded over its leading axes stays sharded and nothing of size T × T is formed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segments_of(loss_mask, segment_ids=None):
    """`segment_ids` as int32, or every row one sequence (1 everywhere) when None."""
    if segment_ids is None:
        return jnp.ones(loss_mask.shape, jnp.int32)
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape != loss_mask.shape:
        raise ValueError(f"segment_ids of shape {segment_ids.shape} must match loss_mask's {loss_mask.shape}")
    return segment_ids.astype(jnp.int32)


def _starts_and_running(values, segments):
    starts = jnp.concatenate([jnp.ones_like(segments[..., :1], bool), segments[..., 1:] != segments[..., :-1]],
                             axis=-1)

    def combine(a, b):
        a_start, a_sum = a
        b_start, b_sum = b
        return a_start | b_start, jnp.where(b_start, b_sum, a_sum + b_sum)

    _, running = jax.lax.associative_scan(combine, (starts, values), axis=values.ndim - 1)
    return running


def segment_totals(values, segments):
    """At each position, the sum of `values` over the contiguous run of equal `segments` it is in.

    values: [..., T] float; segments: [..., T] int. Sums restart where the segment id changes, so
    each packed sequence (and the padding run) sums on its own.
    """
    running = _starts_and_running(values, segments)
    # The running sum at a segment's last position is its total; every position gathers that one.
    ends = jnp.concatenate([segments[..., 1:] != segments[..., :-1], jnp.ones_like(segments[..., :1], bool)],
                           axis=-1)
    positions = jnp.broadcast_to(jnp.arange(values.shape[-1], dtype=jnp.int32), values.shape)
    last = jax.lax.cummin(jnp.where(ends, positions, values.shape[-1] - 1), axis=values.ndim - 1, reverse=True)
    return jnp.take_along_axis(running, last, axis=-1)


def sequence_weights(mask, segments):
    """(per-token 1 / tokens of its sequence (0 off the mask), number of sequences with a token).

    Summing `w * x` over tokens gives the sum over sequences of each sequence's token mean of x.
    The count is exact: each sequence counts at its first token on the mask. mask: [..., T] 0/1.
    """
    counts = segment_totals(mask, segments)
    weights = jnp.where(mask > 0, mask / jnp.maximum(counts, 1.0), 0.0)
    return weights, count_sequences(mask, segments)


def count_sequences(mask, segments, where=None):
    """The number of sequences with a token on `mask` (and, given `where` [..., T], whose tokens
    satisfy it), exactly: each counts at its first token on the mask."""
    first = (mask > 0) & (_starts_and_running((mask > 0).astype(jnp.float32), segments) == 1.0)
    if where is not None:
        first = first & where
    return jnp.sum(first.astype(jnp.float32))
