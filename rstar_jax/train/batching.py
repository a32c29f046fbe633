"""Trajectories -> fixed-shape training micro-batches (padded or packed).

Every array is aligned to *targets*: position j of a row predicts token j+1 of its sequence, so
`loss_mask[j]` is 1 exactly when token j+1 was sampled by the policy, and `old_logprobs[j]` /
`advantages[j]` belong to that token. Shapes are fixed ([num_micro_batches, rows, row_length]), and
a caller that fixes `num_micro_batches` to its worst case gets one shape for the whole run: the
jitted step compiles once whatever RoC kept (the step skips the empty micro-batches).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

FIELDS = ("input_ids", "targets", "positions", "segment_ids", "loss_mask", "advantages", "old_logprobs",
          "sampler_logprobs")


@dataclasses.dataclass(frozen=True)
class TrainingSequence:
    """One training sequence: prompt + response with the response's mask and log-probs."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    loss_mask: Sequence[int]  # per response token
    advantage: float
    old_logprobs: Sequence[float] | None = None  # π_old per response token; None: recomputed by the trainer
    sampler_logprobs: Sequence[float] | None = None  # the generator's, per response token (drift metric)


def _sequence_arrays(seq: TrainingSequence) -> dict[str, np.ndarray]:
    prompt = np.asarray(seq.prompt_ids, np.int32)
    response = np.asarray(seq.response_ids, np.int32)
    mask = np.asarray(seq.loss_mask, np.float32)
    if len(prompt) == 0:
        raise ValueError("training sequence has an empty prompt")
    if len(mask) != len(response):
        raise ValueError(f"training sequence: {len(response)} response tokens but {len(mask)} mask entries")
    tokens = np.concatenate([prompt, response])
    n = len(tokens) - 1
    target_mask = np.zeros(n, np.float32)
    target_mask[len(prompt) - 1:] = mask

    def aligned(values, name):
        out = np.zeros(n, np.float32)
        if values is not None:
            values = np.asarray(values, np.float32)
            if len(values) != len(response):
                raise ValueError(f"training sequence: {len(response)} response tokens but {len(values)} {name}")
            out[len(prompt) - 1:] = values
        return out

    return {
        "input_ids": tokens[:-1],
        "targets": tokens[1:],
        "positions": np.arange(n, dtype=np.int32),
        "loss_mask": target_mask,
        "advantages": target_mask * np.float32(seq.advantage),
        "old_logprobs": aligned(seq.old_logprobs, "old log-probs"),
        "sampler_logprobs": aligned(seq.sampler_logprobs, "sampler log-probs"),
    }


def _empty(shape) -> dict[str, np.ndarray]:
    out = {}
    for f in FIELDS:
        dtype = np.int32 if f in ("input_ids", "targets", "positions", "segment_ids") else np.float32
        out[f] = np.zeros(shape, dtype)
    return out


def make_micro_batches(
    sequences: Sequence[TrainingSequence],
    *,
    rows: int,
    row_length: int,
    packed: bool = True,
    num_micro_batches: int | None = None,
) -> dict[str, np.ndarray]:
    """Lays sequences into [M, rows, row_length] arrays.

    packed: first-fit-decreasing packing of several sequences per row (segment ids 1, 2, ...,
    positions restarting per sequence); otherwise one sequence per row. A sequence longer than
    row_length is an error (never truncated silently). Padding has segment id 0 and mask 0.
    num_micro_batches: M exactly, the rest being empty micro-batches (an error if the sequences need
    more); None: as many as the sequences need (at least one).
    """
    if rows < 1 or row_length < 2:
        raise ValueError(f"make_micro_batches: rows ({rows}) must be >= 1 and row_length ({row_length}) >= 2")
    items = [_sequence_arrays(s) for s in sequences]
    for i, item in enumerate(items):
        if len(item["input_ids"]) > row_length:
            raise ValueError(
                f"make_micro_batches: sequence {i} has {len(item['input_ids']) + 1} tokens, more than "
                f"row_length + 1 = {row_length + 1}"
            )
    # Assign sequences to rows.
    row_contents: list[list[int]] = []
    row_fill: list[int] = []
    order = sorted(range(len(items)), key=lambda i: -len(items[i]["input_ids"])) if packed else range(len(items))
    for i in order:
        length = len(items[i]["input_ids"])
        placed = False
        if packed:
            for r, fill in enumerate(row_fill):
                if fill + length <= row_length:
                    row_contents[r].append(i)
                    row_fill[r] += length
                    placed = True
                    break
        if not placed:
            row_contents.append([i])
            row_fill.append(length)
    needed = max(1, -(-len(row_contents) // rows))
    if num_micro_batches is not None and needed > num_micro_batches:
        raise ValueError(f"make_micro_batches: the sequences fill {len(row_contents)} rows, more than "
                         f"num_micro_batches x rows = {num_micro_batches} x {rows}")
    m = needed if num_micro_batches is None else num_micro_batches
    out = _empty((m * rows, row_length))
    for r, members in enumerate(row_contents):
        offset = 0
        for seg, i in enumerate(members, start=1):
            item = items[i]
            n = len(item["input_ids"])
            for f in FIELDS:
                if f == "segment_ids":
                    out[f][r, offset:offset + n] = seg
                else:
                    out[f][r, offset:offset + n] = item[f]
            offset += n
    return {f: a.reshape(m, rows, row_length) for f, a in out.items()}


def bucket_length(length: int, multiple: int = 128) -> int:
    """Rounds a row length up so step shapes come from a small set."""
    return max(multiple, -(-length // multiple) * multiple)
