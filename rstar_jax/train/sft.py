"""Supervised fine-tuning on chat conversations: loss on assistant tokens only, packed batches.

Conversations (the messages format, `rstar_jax.agent.conversation`) are rendered with the run's RL
template (`ChatTemplate.sft_segments`, math tool-use data) or Qwen3's stock chat template (general
data), chosen per file: system prompts, tools blocks, user turns, tool responses and headers are
context (mask 0); assistant text and its closing `<|im_end|>` are trained (mask 1). Conversations
longer than `sft.max_length` are skipped and counted. The loss is the exact token-mean negative
log-likelihood over the global batch, computed with the chunked log-probs and the same micro-batch
accumulation as the RL step.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar_jax.agent.conversation import (
    CONVERSATION_TEMPLATES,
    Conversation,
    ConversationError,
    encode_pieces,
    encode_whole,
    parse_conversation,
    qwen3_segments,
)
from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import Tokenizer
from rstar_jax.rl.logprobs import token_logprobs
from rstar_jax.train.batching import TrainingSequence, make_micro_batches
from rstar_jax.train.step import accumulate_grads, master_dtype_of


def conversation_ids(template: ChatTemplate, tokenizer: Tokenizer, conversation: Conversation | Sequence[dict],
                     style: str = "rstar2") -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its mask (1 on trained assistant tokens).

    style "rstar2": the run's RL template, each segment encoded on its own as the rollout loop lays
    out a trajectory; "qwen3": Qwen3's stock chat template, one encode of the whole text (the ids of
    `apply_chat_template`).
    """
    if not isinstance(conversation, Conversation):
        conversation = parse_conversation({"messages": list(conversation)})
    if style == "rstar2":
        return encode_pieces(tokenizer, template.sft_segments(conversation))
    if style == "qwen3":
        return encode_whole(tokenizer, qwen3_segments(conversation))
    raise ValueError(f"conversation_ids: style must be one of {CONVERSATION_TEMPLATES}, got {style!r}")


@dataclasses.dataclass
class SftSkips:
    """Conversations left out of SFT, by reason (nothing is dropped silently)."""

    overlong: int = 0  # more tokens than sft.max_length
    untrained: int = 0  # no assistant token to train on
    examples: list[str] = dataclasses.field(default_factory=list)  # the first few, "where: why"

    def add(self, reason: str, where: str, why: str) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {why}")

    @property
    def total(self) -> int:
        return self.overlong + self.untrained


def sft_sequences(template: ChatTemplate, tokenizer: Tokenizer, conversations: Iterable[Conversation | Sequence[dict]],
                  max_length: int, style: str = "rstar2",
                  skips: SftSkips | None = None) -> list[TrainingSequence]:
    """Training sequences (the first token as the 'prompt', the rest scored where trained).
    Conversations longer than `max_length` tokens or with nothing to train are skipped and counted
    in `skips`; a ConversationError (the template cannot render one) names it."""
    skips = skips if skips is not None else SftSkips()
    out = []
    for i, conversation in enumerate(conversations):
        where = getattr(conversation, "source", "") or f"conversation {i}"
        try:
            ids, mask = conversation_ids(template, tokenizer, conversation, style)
        except ConversationError as e:
            raise ConversationError(f"{where}: {e}") from None
        if len(ids) > max_length:
            skips.add("overlong", where, f"{len(ids)} tokens, more than sft.max_length={max_length}")
            continue
        if sum(mask[1:]) == 0:
            skips.add("untrained", where, "no assistant tokens to train on")
            continue
        out.append(TrainingSequence(prompt_ids=ids[:1], response_ids=ids[1:], loss_mask=mask[1:], advantage=1.0))
    return out


def _nll_micro_loss(model, mb, chunk_size: int):
    hidden = model.hidden_states(mb["input_ids"], mb["positions"], mb["segment_ids"])
    logprobs = token_logprobs(hidden, model.unembedding(), mb["targets"], chunk_size=chunk_size)
    mask = mb["loss_mask"]
    nll_sum = -jnp.sum(jnp.where(mask > 0, logprobs, 0.0))
    return nll_sum, jnp.sum(mask), {}


def _sft_step(model, optimizer, batch, chunk_size: int):
    loss, grads, metrics = accumulate_grads(model, batch, lambda m, mb: _nll_micro_loss(m, mb, chunk_size),
                                            master_dtype_of(optimizer))
    optimizer.update(model, grads)
    return {"loss": loss, "tokens": metrics["token_count"], "grad_norm": jnp.sqrt(
        sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))}


sft_step = nnx.jit(_sft_step, static_argnames=("chunk_size",), donate_argnums=(0, 1))
"""sft_step(model, optimizer, batch, chunk_size) -> {"loss", "tokens", "grad_norm"}; updates in place."""


@nnx.jit(static_argnames=("chunk_size",))
def eval_nll(model, batch, chunk_size: int = 1024):
    """Token-mean NLL of the trained tokens of `batch` (no update)."""
    _, _, metrics = accumulate_grads(model, batch, lambda m, mb: _nll_micro_loss(m, mb, chunk_size))
    return metrics["loss_sum"] / jnp.maximum(metrics["token_count"], 1.0)


# A trained token whose probability is above one half is the greedy choice, whatever the vocabulary.
_LOG_HALF = float(np.log(0.5))


def _greedy_counts(model, mb, chunk_size: int):
    """(sequences of micro-batch `mb` whose every trained token has probability above one half,
    sequences with a trained token): a sequence counted in the first is what greedy decoding
    writes, token for token, given its context turns. Sequences are (row, segment) pairs."""
    hidden = model.hidden_states(mb["input_ids"], mb["positions"], mb["segment_ids"])
    logprobs = token_logprobs(hidden, model.unembedding(), mb["targets"], chunk_size=chunk_size)
    trained = mb["loss_mask"] > 0
    unsure = trained & (logprobs <= _LOG_HALF)
    segments = mb["segment_ids"]
    per_segment = jax.vmap(lambda values, ids: jax.ops.segment_sum(values, ids, num_segments=segments.shape[-1] + 1))
    trained_tokens = per_segment(trained.astype(jnp.int32), segments)
    unsure_tokens = per_segment(unsure.astype(jnp.int32), segments)
    has_trained = trained_tokens > 0
    return jnp.sum(has_trained & (unsure_tokens == 0)), jnp.sum(has_trained)


@nnx.jit(static_argnames=("chunk_size",))
def greedy_reproduced(model, batch, chunk_size: int = 1024):
    """(reproduced, sequences) over the [M, rows, T] micro-batches of `batch`: how many of its
    sequences greedy decoding reproduces with a margin (every trained token above probability one
    half; with the other tokens as context, as teacher forcing gives them). For a stage whose
    conversations follow from their prompts (the tiny run's tool calls: the factors copied into
    the call, the tool's output into the answer) it is the share a policy gets right by itself."""
    reproduced, total = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    for m in range(batch["input_ids"].shape[0]):
        r, t = _greedy_counts(model, {k: v[m] for k, v in batch.items()}, chunk_size)
        reproduced, total = reproduced + r, total + t
    return reproduced, total


@dataclasses.dataclass
class SftBatches:
    """Packs sequences into fixed-shape batches of `conversations_per_step` conversations.

    stage_sizes: consecutive slices of `sequences` trained one after the other in each epoch (a
    curriculum: one file after another), each shuffled on its own; () is one stage of everything.
    """

    sequences: list[TrainingSequence]
    conversations_per_step: int
    rows: int
    row_length: int
    seed: int = 0
    stage_sizes: Sequence[int] = ()
    # Per stage, conversations kept out of training to measure it on (`sft.advance_exact`).
    held_out: Sequence[Sequence[TrainingSequence]] = ()

    def _stages(self) -> list[range]:
        sizes = list(self.stage_sizes) or [len(self.sequences)]
        if sum(sizes) != len(self.sequences) or any(n < 1 for n in sizes):
            raise ValueError(f"SftBatches.stage_sizes {sizes} must be positive and sum to the {len(self.sequences)} "
                             f"sequences")
        starts = np.cumsum([0] + sizes)
        return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]

    def stage_steps(self) -> list[int]:
        """Each stage's steps in one epoch."""
        return [max(1, len(stage) // self.conversations_per_step) for stage in self._stages()]

    def steps_per_epoch(self) -> int:
        return sum(self.stage_steps())

    def epoch(self, epoch: int) -> Iterable[dict[str, np.ndarray]]:
        for stage in self.epoch_stages(epoch):
            yield from stage

    def epoch_stages(self, epoch: int) -> Iterator[Iterator[dict[str, np.ndarray]]]:
        """`epoch`'s batches, stage by stage: each stage's batches are packed only as they are
        taken, so a stage left early (or skipped on resume) costs nothing."""
        rng = np.random.default_rng(self.seed + epoch)
        for stage in self._stages():
            yield self._batches(np.asarray(stage)[rng.permutation(len(stage))])

    def _batches(self, order: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        n = self.conversations_per_step
        for s in range(max(1, len(order) // n)):
            chosen = [self.sequences[i] for i in order[s * n:(s + 1) * n]]
            yield make_micro_batches(chosen, rows=self.rows, row_length=self.row_length, packed=True,
                                     num_micro_batches=self.num_micro_batches())

    def held_out_batch(self, stage: int) -> dict[str, np.ndarray] | None:
        """Stage `stage`'s held-out sequences in as many micro-batches as they need (None: none)."""
        sequences = self.held_out[stage] if stage < len(self.held_out) else ()
        return make_micro_batches(sequences, rows=self.rows, row_length=self.row_length, packed=True) if sequences else None

    def num_micro_batches(self) -> int:
        """Every step's count: what `conversations_per_step` of the longest conversation need, so
        the step compiles once (a row holds at least row_length // longest conversations)."""
        longest = max(len(s.prompt_ids) + len(s.response_ids) for s in self.sequences)
        per_row = max(1, self.row_length // longest)
        return -(-self.conversations_per_step // (per_row * self.rows))
