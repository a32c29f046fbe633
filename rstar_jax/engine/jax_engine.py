"""In-process JAX generation engine with continuous batching over a paged KV pool.

A fixed number of decode slots share one pool of KV pages ([layers, pages, page_size, kv_heads,
head_dim], or heads first for the Pallas decode kernel; `max_total_tokens` in all, SGLang's `max_total_num_tokens`). A sequence holds only the
pages its length needs, so many short sequences fit where a dense [slots, max_length] cache would
hold few, and the pool can be smaller than slots x max_length. A background thread runs the engine
loop: it admits waiting requests into free slots (one batched prefill for the requests admitted
together, prompt lengths bucketed to limit recompiles) and then runs one jitted decode step for every
slot, so new requests are prefilled while others decode. Decode attention reads only the pages that
cover the longest live sequence, rounded up to 1/8, 1/4, 1/2 or all of the context. Per-slot
sampling settings are arrays (temperature, top-p, top-k are traced, never static). The asyncio
front (`await engine.generate(...)`) implements `rstar_jax.rollout.protocol.Generator`.

Admission and retraction follow SGLang's scheduler. A request is admitted when its context plus
`new_token_ratio` x its remaining output budget fits beside the same estimate for every running
request. The ratio starts at 0.7 and decays by 0.001 per decode step to 0.098, so the pool is
overcommitted on purpose. When a decode step needs a page and none is free, the running request
with the fewest output tokens (then the longest prompt) is retracted: its pages are released, it keeps
its tokens, and it goes back to the front of the queue. When it is re-admitted, prompt + output is
prefilled again (recomputed) and decoding goes on. The ratio then rises to SGLang's estimate.
Results count their retractions (`num_retractions`). Seeded rows draw per-position keys, so a
retracted request samples exactly what it would have sampled without retraction.

Prefix cache: a finished request leaves its KV pages behind, keyed by the tokens they hold. A later
request whose context starts with those tokens (the next turn of a multi-turn trajectory, sent to
the same engine by a sticky scheduler) takes the pages over and prefills only the new tokens
(`cached_tokens` in its result). Cached pages are evicted, least recently cached first, whenever
admission or decoding needs them, before any running request is retracted. A weight update or
`flush_cache()` drops the cache, since its KV came from the old weights.

Prefix sharing (as SGLang's radix cache, at page granularity): pages are reference counted, and every
full page a prefill writes is indexed by (the page before it, its tokens). A request whose context
starts with pages some running request or cached prefix holds shares them instead of prefilling
them: the 2G rollouts of one GRPO prompt prefill it once. Shared pages are full and never written
again (decode writes past a sequence's length). The last, partial page of a shared prefix is not
shared: its tokens, at most a page, are recomputed into a private page with the request's own
prefill (no copy kernel), and at least the context's last token is always prefilled, since its
logits give the first sample. When the head of the queue would share pages a request admitted in
the same step is about to write, that request is prefilled first and the head admitted after it.
A page returns to the free stack when its last holder (a request or a cached prefix) lets it go;
the admission estimate and `capacity()` count a shared page once. `shared_pages` and
`shared_tokens` count what sharing supplied (see `JaxEngine`). Sharing follows `prefix_cache` unless
`prefix_sharing` says otherwise; outputs are those without it (log-probs up to float rounding).
The page bookkeeping (references, the index of shareable pages) is `rstar_jax.engine.pages.PagePool`,
the prefix cache `rstar_jax.engine.prefix.PrefixCache`; this module schedules over them.

Chunked prefill (SGLang's `--chunked-prefill-size`): with `chunked_prefill_size`, one engine step
prefills at most that many tokens. A context that does not fit is prefilled a chunk per step, ending
on page boundaries, while the running requests decode a token per step beside it; its intermediate
chunks' samples are discarded (seeded draws depend only on the seed and position, so nothing later
changes) and it samples its first token after its last chunk. One request is chunked at a time, and
it goes before new admissions. A request retracted, aborted or paused mid-prefill is handled as any
running one (a retracted one starts its prefill over on re-admission).

Overlapped decode (SGLang's overlap scheduler): a decode step is dispatched before the previous
step's tokens are read back, taking them as its input on the device, so the host's bookkeeping of
step N (appending tokens, stop checks, the next step's arrays) runs while the device computes step
N + 1. A request that stopped at step N has had one more token computed, which is discarded; one
that finishes by length is not dispatched past its budget. Anything that changes a running request
from outside the engine loop (a pause, a weight swap) first reads back the step in flight, so its
tokens keep the version that sampled them.

Log-probs match SGLang (see `rstar_jax.engine.sampling`): log-softmax of the temperature-scaled
logits at the sampled token, before top-p / top-k truncation; `original_logprobs=True` gives the raw
logits' log-softmax (SGLANG_RETURN_ORIGINAL_LOGPROB). Greedy rows and temperature 1 give the raw
log-softmax either way, which is what the trainer recomputes.

Scoring (`score`): log-probs of given tokens and the top-k of each position's distribution, from
one jitted full forward over the sequence (no KV cache), for SGLang's `input_token_logprobs` and
`top_logprobs_num`. It runs beside the engine loop on the weights current at the call.

Streaming: `generate(..., on_token=f)` calls f(token, logprob) on the caller's event loop for each
token as it is sampled, before the call returns; f returning True ends the request (a stop string
was found), which then returns with reason "abort" and may hold a few tokens sampled meanwhile. A
cancelled `generate` (a client that went away) aborts exactly its own request at the next step.

Layer layout (`layer_layout`, see `rstar_jax.engine.settings`): "stacked" runs the programs as a scan
over the model's stacked layer weights; "per_layer" holds each layer's weights as arrays of their own,
cut from the stacked parameters at construction and at every weight update (`rstar_jax.engine.weights`),
and runs the layers unrolled, so that no step slices (on GPU, copies) a layer's weights out of a
stacked array. Outputs are the same either way (up to float rounding).

Decode attention (`decode_attention`, see `rstar_jax.engine.settings`): "xla" gathers each row's pages
and reduces over them; "pallas" lays the pool out heads first ([kv_heads, layers, pages, page_size,
head_dim]) and decode steps run the Pallas GPU paged-attention kernel over it (interpreted on other
backends, for tests); prefill attends by the XLA path either way. Outputs are the same (up to float
rounding).

Weight updates (`update_weights`) follow SGLang's `/update_weights_from_disk`. By default the call
stops admitting new requests, lets every running (and retracted) request finish on the old weights,
swaps the parameters and bumps the version; queued requests then run on the new weights. With
`abort_in_flight=True` (SGLang's `abort_all_requests`), running and retracted requests finish at once
with reason "abort" and their partial tokens, and the swap happens between two engine steps.

`pause(mode)` is SGLang's `/pause_generation`; new requests stay queued until `resume()`:
- "abort" aborts everything.
- "retract" moves running requests back to the queue and frees their KV; they are recomputed on
  resume, on whatever weights are current then.
- "in_place" freezes running requests with their KV kept.
While paused, a weight update swaps at once without draining (SGLang skips its update lock then), so
requests held in place continue on the new weights over KV computed with the old ones.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import queue
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar_jax.model import paged_attention
from rstar_jax.model.qwen3 import DECODE_ATTENTIONS as MODEL_DECODE_ATTENTIONS, PagedKVCache, Qwen3
from rstar_jax.rollout.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Capacity,
    ContextLengthExceeded,
    GenerateResult,
    SamplingParams,
)
from rstar_jax.engine.pages import PagePool
from rstar_jax.engine.prefix import PrefixCache
from rstar_jax.engine.sampling import row_keys, sample_tokens, truncating_rows
from rstar_jax.engine.settings import DECODE_ATTENTIONS, DEFAULT_DECODE_ATTENTION, DEFAULT_LAYER_LAYOUT
from rstar_jax.engine.weights import EngineWeights

MAX_STOP_IDS = 8
PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's defaults: SGLANG_INIT_NEW_TOKEN_RATIO 0.7, a floor of 0.14 x that, reached in 600 steps.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.7 * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_DECODE_STEPS = 20  # SGLang's headroom per running request in the post-retraction estimate
# Configs check names against the jax-free settings: each must be one the model runs.
if DECODE_ATTENTIONS != MODEL_DECODE_ATTENTIONS:
    raise ImportError("rstar_jax.engine.settings.DECODE_ATTENTIONS disagrees with rstar_jax.model.qwen3's")


def prefill_step(layout: EngineWeights, original_logprobs: bool, weights, cache: PagedKVCache, tables, ids, starts,
                 lengths, key, step, seeds, temperature, top_p, top_k):
    """The engine's prefill kernel (jitted with `layout` and `original_logprobs` bound, the cache
    donated; `weights`: `layout.place`'s): row r holds context[starts[r]:lengths[r]], written into its
    pages; one token sampled per row. `key` is the engine's, `step` its call counter (this call's key
    is their fold: a key split on the host costs a device round trip every step). Returns (cache,
    tokens, logprobs)."""
    key = jax.random.fold_in(key, step)
    model, layers = layout.model(weights)
    # Positions before starts[r] are already in row r's pages.
    positions = starts[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    logits, cache = model.forward_with_paged_cache(ids, positions, cache, tables, logits_at=lengths - starts - 1,
                                                   layers=layers)
    # The first sampled token sits at absolute position `length`.
    keys = row_keys(key, seeds, lengths)
    tokens, logprobs = sample_tokens(logits[:, 0], keys, temperature, top_p, top_k, original=original_logprobs)
    return cache, tokens, logprobs


def decode_step(layout: EngineWeights, original_logprobs: bool, truncation: bool, weights, cache: PagedKVCache,
                page_table, tokens, previous, from_previous, positions, key, step, seeds, temperature, top_p, top_k,
                *, attention: str = DEFAULT_DECODE_ATTENTION, mesh: jax.sharding.Mesh | None = None):
    """The engine's decode kernel: one token for every slot (`key`, `step`: as `prefill_step`'s).
    A slot's input token is `previous` (the last step's output, still on the device) where
    `from_previous`, else `tokens` (from the host). `truncation`: whether some slot samples with top-p
    or top-k, decided on the host (`sample_tokens`). `attention`, `mesh`: the engine's decode
    attention and mesh (bound with the others). Returns (cache, tokens, logprobs)."""
    key = jax.random.fold_in(key, step)
    tokens = jnp.where(from_previous, previous, tokens)
    model, layers = layout.model(weights)
    logits, cache = model.forward_with_paged_cache(tokens[:, None], positions[:, None], cache, page_table,
                                                   layers=layers, decode_attention=attention, mesh=mesh)
    keys = row_keys(key, seeds, positions + 1)  # the sampled token's absolute position
    next_tokens, logprobs = sample_tokens(logits[:, 0], keys, temperature, top_p, top_k, original=original_logprobs,
                                          truncation=truncation)
    return cache, next_tokens, logprobs


SCORE_CHUNK = 256  # positions unembedded at once when scoring: [chunk, vocab] logits live at a time


def score_step(layout: EngineWeights, top_k: int, weights, ids, targets, temperature):
    """The engine's scoring kernel (jitted with `layout` and `top_k` bound): ids, targets and
    temperature [T] (zero padded at the end). Position t's distribution is log_softmax(logits[t] /
    temperature[t]), that of the token after ids[t]. Returns (logprobs [T] of targets[t],
    top_logprobs [T, top_k], top_ids [T, top_k])."""
    model, layers = layout.model(weights)
    # [T, D]: causal, so the padding changes nothing before it.
    hidden = model.hidden_states(ids[None, :], layers=layers)[0]
    t = ids.shape[0]
    chunk = min(SCORE_CHUNK, t)
    pad = -t % chunk
    targets = jnp.pad(targets, (0, pad))
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    temperature = jnp.pad(temperature, (0, pad), constant_values=1.0)

    def one_chunk(args):
        h, target, temp = args
        logp = jax.nn.log_softmax(model.logits_from_hidden(h[None])[0] / temp[:, None], axis=-1)
        picked = jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
        if top_k:
            values, indices = jax.lax.top_k(logp, top_k)
        else:
            values, indices = jnp.zeros((chunk, 0), jnp.float32), jnp.zeros((chunk, 0), jnp.int32)
        return picked, values, indices

    n = (t + pad) // chunk
    picked, values, indices = jax.lax.map(one_chunk, (hidden.reshape(n, chunk, -1), targets.reshape(n, chunk),
                                                      temperature.reshape(n, chunk)))
    return picked.reshape(-1)[:t], values.reshape(t + pad, top_k)[:t], indices.reshape(t + pad, top_k)[:t]


def pool_sharding(mesh: jax.sharding.Mesh, kv_heads: int, heads_first: bool = False) -> jax.sharding.NamedSharding:
    """KV page pool [layers, pages, page_size, kv_heads, head_dim] placement (`heads_first`: [kv_heads,
    layers, pages, page_size, head_dim]): KV heads over "tensor" (as the attention activations are)
    when it divides. Any slot may own any page, so pages are not split over the data-parallel axes;
    scale data parallelism with more engines instead."""
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and kv_heads % tensor == 0 else None
    spec = (heads, None, None, None, None) if heads_first else (None, None, None, heads, None)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def check_decode_attention(attention: str, config, page_size: int, cache_dtype, mesh: jax.sharding.Mesh | None) -> None:
    """Refuses an unknown decode attention, or shapes the Pallas kernel cannot serve, naming why."""
    if attention not in DECODE_ATTENTIONS:
        raise ValueError(f"decode_attention must be one of {DECODE_ATTENTIONS}, got {attention!r}")
    if attention == "pallas":
        problems = paged_attention.unsupported(
            num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            page_size=page_size, dtype=cache_dtype, tensor=1 if mesh is None else mesh.shape.get("tensor", 1))
        if problems:
            raise ValueError(f"decode_attention 'pallas' cannot serve this model and pool: {'; '.join(problems)} "
                             f"(use 'xla')")


@dataclasses.dataclass
class _InFlight:
    """A dispatched decode step not yet read back: its outputs (on the device) and the request each
    decoded slot held when it was dispatched."""
    tokens: jax.Array
    logprobs: jax.Array
    requests: dict[int, "_Request"]


@dataclasses.dataclass
class _Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # the weights' version per sampled token
    retractions: int = 0
    cached_tokens: int = 0  # context tokens whose KV came from the prefix cache at first admission
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    on_token: Callable[[int, float], bool | None] | None = None  # called on `loop` per sampled token
    ended: bool = False  # its caller went away or asked to stop: aborted at the next step, whatever its rid

    @property
    def context_length(self) -> int:
        return len(self.prompt) + len(self.tokens)


def _row_seed(sampling: SamplingParams) -> int:
    # SGLang's `sampling_seed`; -1 marks an unseeded row. Folded into int32's non-negative range.
    return -1 if sampling.seed is None else int(sampling.seed) % (2**31 - 1)


class _Scheduler:
    """The engine thread's side of `JaxEngine`: the slots and queues, admission, chunked prefill,
    decode steps and retraction, and the device calls they make, over the engine's `PagePool` and
    `PrefixCache`. Its state is set up by `JaxEngine.__init__`; its methods run under the engine's
    lock, on the engine thread (or in a public method holding the lock)."""

    def _end(self, request: _Request) -> None:
        """Aborts this request (only: not every rid it prefixes) at the next engine step."""
        request.ended = True
        self._cancel_pending = True
        self._wake.set()

    def _next_step(self) -> np.uint32:
        """The device call's counter, folded into the engine's key on the device."""
        self._calls = (self._calls + 1) % 2**32
        return np.uint32(self._calls)

    def _resolve(self, request: _Request, reason: str) -> None:
        result = GenerateResult(list(request.tokens), list(request.logprobs), reason, self._version,
                                num_retractions=request.retractions, cached_tokens=request.cached_tokens,
                                token_versions=tuple(request.versions))
        request.loop.call_soon_threadsafe(lambda: request.future.done() or request.future.set_result(result))

    def _free_slot(self, slot: int, keep_prefix: bool = False) -> _Request:
        request = self._active[slot]
        pages = self._slot_pages[slot]
        written = int(self._positions[slot])  # KV holds positions [0, written): the last token was not fed
        if keep_prefix and self.prefix_cache and written > 0:
            self._prefixes.insert(tuple(self._context(request)[:written]), pages[:self._pages_for(written)])
        self._active[slot] = None
        self._positions[slot] = 0
        self._prefilling[slot] = False
        self._pool.ref(pages, slot=-1)
        self._slot_pages[slot] = []
        self._page_table[slot] = self.num_pages
        return request

    def _finish(self, slot: int, reason: str) -> None:
        self._resolve(self._free_slot(slot, keep_prefix=not self._stopped), reason)

    @staticmethod
    def _context(request: _Request) -> list[int]:
        return request.prompt + request.tokens if request.tokens else request.prompt

    def _plan(self, context: list[int]) -> tuple[list[int], tuple[int, ...] | None, int]:
        """How a request starts: (pages it takes, the cached prefix it takes over or None, tokens
        those pages hold). A cached prefix (with its partial last page) is taken over when it holds
        more than the shareable full pages; otherwise those are shared and the prefix stays cached."""
        shared = self._pool.shared_prefix(context) if self.prefix_sharing and self._pool.index else []
        hit = self._prefixes.lookup(context) if self._prefixes else None
        if hit is not None and len(hit) > len(shared) * self.page_size:
            return list(self._prefixes[hit]), hit, len(hit)
        return shared, None, len(shared) * self.page_size

    def _drop_prefixes(self) -> None:
        self._prefixes.clear()
        # Pages running requests still hold (frozen in place across a weight update) keep old-weight
        # KV: no new request may share them.
        self._pool.clear_index()

    def _retract(self, slot: int) -> None:
        """Frees the slot's pages and puts its request at the front of the queue, tokens kept."""
        request = self._free_slot(slot)
        request.retractions += 1
        self.retractions += 1
        self._retracted.appendleft(request)

    def _abort_in_flight(self) -> int:
        """Aborts running and retracted requests (they return their partial tokens)."""
        count = 0
        for slot, request in enumerate(self._active):
            if request is not None:
                self._finish(slot, FINISH_ABORT)
                count += 1
        while self._retracted:
            self._resolve(self._retracted.popleft(), FINISH_ABORT)
            count += 1
        return count

    def _check_stop(self, slot: int) -> None:
        request = self._active[slot]
        s = request.sampling
        if request.tokens[-1] in s.stop_token_ids:
            self._finish(slot, FINISH_STOP)
        elif len(request.tokens) >= s.max_new_tokens or request.context_length >= self.max_length:
            # The sequence (prompt + output) fills the context: the last token could not be fed back.
            self._finish(slot, FINISH_LENGTH)

    def _drain_incoming(self) -> None:
        while True:
            try:
                request = self._incoming.get_nowait()
            except queue.Empty:
                return
            self._waiting.append(request)
            if request.ended:  # ended before it was drained: its flag may have been cleared unseen
                self._cancel_pending = True

    def _apply_aborts(self) -> None:
        if not self._abort_rids and not self._cancel_pending:
            return
        self._cancel_pending = False  # cleared before the scan: a flag set during it is seen next step
        taken, self._abort_rids = self._abort_rids, set()  # swap: an add from another thread is never lost
        prefixes = tuple(taken)  # () matches no rid

        def aborted(request: _Request) -> bool:
            return request.ended or request.rid.startswith(prefixes)

        for slot, request in enumerate(self._active):
            if request is not None and aborted(request):
                self._finish(slot, FINISH_ABORT)
        for waiting in (self._retracted, self._waiting):
            kept = [r for r in waiting if not aborted(r)]
            for request in waiting:
                if aborted(request):
                    self._resolve(request, FINISH_ABORT)
            waiting.clear()
            waiting.extend(kept)

    def _remaining_budget(self, request: _Request) -> int:
        """Tokens the request may still generate: its max_new_tokens left, within the context length."""
        return max(0, min(request.sampling.max_new_tokens - len(request.tokens),
                          self.max_length - request.context_length))

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _span_pages(self, pages: int) -> int:
        """Page-table columns a kernel reads: the smallest of max_length's 1/8, 1/4, 1/2 and whole
        that holds `pages`, so attention costs about what the live sequences hold, at four shapes."""
        return next(b for b in self._span_buckets if b >= pages)

    def _chunk_end(self, start: int, length: int, budget: int | None) -> int:
        """Where this step's prefill of context[start:length] stops within `budget` tokens: the end,
        else a page boundary (unaligned only when less than a page fits in a whole chunk)."""
        if budget is None or length - start <= budget:
            return length
        end = (start + budget) // self.page_size * self.page_size
        if end <= start and budget == self.chunked_prefill_size:
            end = start + budget
        return max(end, start)

    def _pending_writes(self, context: list[int], start: int, group) -> bool:
        """Whether a request of `group` (admitted, not prefilled yet) is about to write the page after
        the `start` tokens `context` can take now, with the same tokens: then prefilling it first
        lets `context` share that page instead of computing it again."""
        upto = (start // self.page_size + 1) * self.page_size
        if upto > len(context) - 1:
            return False
        head = context[:upto]
        return any(s < upto <= e and self._context(r)[:upto] == head for _, r, s, e in group)

    def _admit(self) -> None:
        """This step's prefill: the chunked request's next chunk, then waiting requests in free slots
        (retracted ones first) while SGLang's estimate of the pool fits them, within
        `chunked_prefill_size` tokens when set."""
        if self._pause_mode is not None:
            return
        budget = self.chunked_prefill_size
        group: list[tuple[int, _Request, int, int]] = []  # (slot, request, first position to write, end)
        for slot in np.flatnonzero(self._prefilling).tolist():  # a chunked prefill goes first
            request = self._active[slot]
            start = int(self._positions[slot])
            end = self._chunk_end(start, request.context_length, budget)
            if end > start:
                group.append((slot, request, start, end))
                budget = None if budget is None else budget - (end - start)
        if (all(r is not None for r in self._active) or budget == 0
                or (not self._retracted and (not self._waiting or self._admission_blocks))):
            if group:
                self._prefill_group(group)
            return
        running = [r for r in self._active if r is not None]
        ratio = self._new_token_ratio
        reserved = ratio * sum(self._remaining_budget(r) for r in running)
        for slot in range(self.slots):
            if self._active[slot] is not None:
                continue
            if self._retracted:
                source = self._retracted  # retracted requests are in flight: a weight drain admits them
            elif self._waiting and not self._admission_blocks:
                source = self._waiting
            else:
                break
            request = source[0]
            context = self._context(request)
            held, hit, start = self._plan(context)
            if group and self.prefix_sharing and self._pending_writes(context, start, group):
                self._prefill_group(group)  # the leader first: this request then shares its pages
                group = []
                held, hit, start = self._plan(context)
            pages = self._pages_for(len(context))
            private = pages - len(held)
            # Evictable pages the request takes stop being room; shared pages are counted once.
            available = len(self._pool.free) + self._pool.evictable - sum(map(self._pool.is_evictable, held))
            estimate = ratio * self._remaining_budget(request)
            if running and (private > available or private * self.page_size + estimate
                            > available * self.page_size - reserved):
                break  # first come, first served: nothing overtakes the head of the queue
            end = self._chunk_end(start, len(context), budget)
            if end <= start:
                break  # no prefill budget left this step
            source.popleft()
            if hit is not None:
                self._prefixes.take(hit)
                self._pool.ref(held, slot=1, cache=-1)  # the cached prefix's references become the request's
            else:
                self._pool.ref(held, slot=1)
                self.shared_pages += len(held)
                self.shared_tokens += start
            self._prefixes.evict(private)
            new = self._pool.allocate(private)
            self._slot_pages[slot] = held + new
            self._page_table[slot, :pages] = self._slot_pages[slot]
            if not request.tokens and not request.retractions:  # a first admission
                request.cached_tokens = start
                self.prompt_tokens += len(context)
                self.cached_tokens += start
            group.append((slot, request, start, end))
            running.append(request)
            reserved += estimate
            if len(group) == self.prefill_batch:
                self._prefill_group(group)
                group = []
            if budget is not None:
                budget -= end - start
                if end < len(context) or budget <= 0:
                    break  # one chunked request at a time; the budget is spent
        if group:
            self._prefill_group(group)

    @staticmethod
    def _sampling_arrays(rows: int, requests: dict[int, _Request]) -> tuple[np.ndarray, ...]:
        """Per-row (seeds, temperature, top_p, top_k) for the requests at their rows; other rows get
        unseeded defaults (their outputs are ignored)."""
        seeds = np.full(rows, -1, np.int32)
        temperature, top_p, top_k = np.ones(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32)
        for row, request in requests.items():
            s = request.sampling
            seeds[row], temperature[row], top_p[row], top_k[row] = _row_seed(s), s.temperature, s.top_p, s.top_k
        return seeds, temperature, top_p, top_k

    def _prefill_group(self, group: list[tuple[int, _Request, int, int]]) -> None:
        """Prefills context[start:end] of each request's prompt + output so far (recomputing a
        retracted one) into its pages, in one call, and samples one token per request whose context
        is then complete (a chunk's sample is discarded). Unused rows write nothing."""
        rows = 1 if len(group) == 1 else self.prefill_batch
        longest = max(end - start for _, _, start, end in group)
        bucket = next(b for b in self.buckets if b >= longest)
        span = self._span_pages(max(self._pages_for(end) for _, _, _, end in group))
        ids = np.zeros((rows, bucket), np.int32)
        tables = np.full((rows, span), self.num_pages, np.int32)
        starts = np.zeros(rows, np.int32)
        lengths = np.ones(rows, np.int32)
        contexts = []
        for row, (slot, request, start, end) in enumerate(group):
            context = self._context(request)
            contexts.append(context)
            ids[row, :end - start] = context[start:end]
            tables[row] = self._page_table[slot, :span]
            starts[row], lengths[row] = start, end
        requests = {row: request for row, (_, request, _, _) in enumerate(group)}
        seeds, temperature, top_p, top_k = self._sampling_arrays(rows, requests)
        # NumPy arguments go to the jitted call as they are: its C++ path transfers them, where
        # jnp.asarray dispatches a staging computation for each (most of a decode step's host time on a GPU).
        self._cache, tokens, logprobs = self._prefill(
            self._weights, self._cache, tables, ids, starts, lengths, self._key, self._next_step(),
            seeds, temperature, top_p, top_k)
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        now = time.perf_counter()
        for row, (slot, request, start, end) in enumerate(group):
            self._active[slot] = request
            self._positions[slot] = end
            if self.prefix_sharing:
                self._pool.register(self._slot_pages[slot], contexts[row], start, end)
            self._prefilling[slot] = end < len(contexts[row])
            if self._prefilling[slot]:
                continue  # a chunk: the rest follows in the next steps
            if not request.tokens and self.on_first_token is not None:
                self.on_first_token(now - request.submitted)
            self._append(request, int(tokens[row]), float(logprobs[row]))
            self._last_token[slot] = int(tokens[row])
            self._check_stop(slot)

    def _append(self, request: _Request, token: int, logprob: float) -> None:
        request.tokens.append(token)
        request.logprobs.append(logprob)
        request.versions.append(self._version)
        self.generated_tokens += 1
        if request.on_token is not None:  # queued before the result: the caller sees every token first
            request.loop.call_soon_threadsafe(self._deliver, request, token, logprob)

    def _deliver(self, request: _Request, token: int, logprob: float) -> None:  # on the request's loop
        if request.on_token(token, logprob) and not request.ended:
            self._end(request)

    def _decoding(self) -> list[int]:
        """Slots that decode this step: running and done prefilling."""
        return [i for i, r in enumerate(self._active) if r is not None and not self._prefilling[i]]

    def _grow_pages(self) -> None:
        """Gives every decoding request the page its next position needs, retracting when the pool is out."""
        needy = [i for i in self._decoding()
                 if self._may_decode(i) and self._positions[i] // self.page_size >= len(self._slot_pages[i])]
        self._prefixes.evict(len(needy))  # cached prefixes go before any running request
        if len(needy) > len(self._pool.free):
            while len(needy) > len(self._pool.free):
                running = [i for i, r in enumerate(self._active) if r is not None]
                victim = min(running, key=lambda i: (len(self._active[i].tokens), -len(self._active[i].prompt)))
                self._retract(victim)
                if victim in needy:
                    needy.remove(victim)
                self._prefixes.evict(len(needy))  # pages the victim shared with cached prefixes only
            remaining = [r for r in self._active if r is not None]
            if remaining:  # SGLang's post-retraction estimate of the share of the budget still to come
                decoded = sum(len(r.tokens) for r in remaining) + RETRACT_DECODE_STEPS * len(remaining)
                budget = sum(r.sampling.max_new_tokens for r in remaining)
                self._new_token_ratio = min(1.0, decoded / max(budget, 1))
            else:
                self._new_token_ratio = INIT_NEW_TOKEN_RATIO
        new = self._pool.allocate(len(needy))
        for i, page in zip(needy, new):
            self._page_table[i, len(self._slot_pages[i])] = page
            self._slot_pages[i].append(page)

    def _in_flight_request(self, slot: int) -> bool:
        """Whether the step in flight samples a token for the request running in `slot`."""
        return self._in_flight is not None and self._in_flight.requests.get(slot) is self._active[slot]

    def _decode_step(self) -> None:
        """Dispatches the next decode step, then reads back the one before it (see the module
        docstring: the two overlap)."""
        if self._pause_mode is not None or not any(r is not None for r in self._active):
            self._settle()
            return
        self._grow_pages()
        active = [i for i in self._decoding() if self._may_decode(i)]
        if not active:  # only a chunked prefill is running, every request is at its budget, or retracted
            self._settle()
            return
        seeds, temperature, top_p, top_k = self._sampling_arrays(self.slots, {i: self._active[i] for i in active})
        positions = np.full(self.slots, self._span, np.int32)  # idle slots: writes are dropped
        positions[active] = self._positions[active]
        span = self._span_pages(max(len(self._slot_pages[i]) for i in active))
        previous = self._in_flight
        from_previous = np.zeros(self.slots, bool)
        from_previous[[i for i in active if self._in_flight_request(i)]] = True
        # Copies of the engine's own arrays: a CPU device may read a NumPy argument in place, later.
        truncation = bool(np.any(truncating_rows(temperature, top_p, top_k, self.vocab_size)))
        self._cache, tokens, logprobs = self._decode[truncation](
            self._weights, self._cache, self._page_table[:, :span].copy(), self._last_token.copy(),
            self._no_tokens if previous is None else previous.tokens, from_previous, positions,
            self._key, self._next_step(), seeds, temperature, top_p, top_k)
        self._in_flight = _InFlight(tokens, logprobs, {i: self._active[i] for i in active})
        self._positions[active] += 1  # the step writes their KV at the old positions
        self._new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self._new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if previous is not None:
            self._settle(previous)

    def _may_decode(self, slot: int) -> bool:
        """Whether the request in `slot` still has room for a token beyond the one in flight for it."""
        request = self._active[slot]
        pending = int(self._in_flight_request(slot))
        return (len(request.tokens) + pending < request.sampling.max_new_tokens
                and request.context_length + pending < self.max_length)

    def _settle(self, step: "_InFlight | None" = None) -> None:
        """Reads back a dispatched decode step (by default the one in flight) and hands its tokens to
        the requests that still run in its slots; tokens of slots whose request ended are dropped."""
        if step is None:
            step, self._in_flight = self._in_flight, None
            if step is None:
                return
        tokens, logprobs = np.asarray(step.tokens), np.asarray(step.logprobs)
        for i, request in step.requests.items():
            if self._active[i] is not request:
                continue  # finished, aborted or retracted since: its token is not wanted
            self._append(request, int(tokens[i]), float(logprobs[i]))
            self._last_token[i] = tokens[i]
            self._check_stop(i)

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                self._drain_incoming()
                self._apply_aborts()
                self._admit()
                self._decode_step()
                self.steps += 1
                if self._pause_mode is not None:
                    busy = False
                else:
                    busy = (any(r is not None for r in self._active) or bool(self._retracted)
                            or (bool(self._waiting) and not self._admission_blocks) or self._in_flight is not None)
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
            else:
                time.sleep(0)  # let a thread waiting on the lock (capacity, pause, updates) take it
        with self._lock:
            self._settle()
            self._drain_incoming()
            self._abort_in_flight()
            while self._waiting:
                self._resolve(self._waiting.popleft(), FINISH_ABORT)


class JaxEngine(_Scheduler):
    """Continuous-batching generator over a Qwen3 model. Thread-safe; asyncio front end.

    slots: concurrent requests (SGLang's max_running_requests). max_length: context length, prompt
    + output of one request. max_total_tokens: the KV pool in tokens (default slots x max_length,
    never overcommitted); at least max_length, so one request always fits. page_size: tokens per page.
    prefill_batch: requests admitted in one step are prefilled together, this many rows per call
    (a lone request runs as one row, so there are two compiled shapes per prompt bucket).
    prefix_cache: keep finished requests' KV for requests that continue them (see the module docstring).
    prefix_sharing: share full KV pages between requests whose contexts start alike (default: as
    prefix_cache). chunked_prefill_size: prefill tokens per engine step (None or 0: no limit).
    Counters: `shared_pages`, the pages admissions took from another holder (a running request or a
    cached prefix) instead of prefilling them, and `shared_tokens`, the context tokens those pages
    held, both cumulative over every admission (re-admissions after retraction included).
    layer_layout: how the engine holds the decoder layers' weights, "stacked" or "per_layer" (see the
    module docstring and `rstar_jax.engine.settings`); `extra_weight_bytes` is what the layout holds
    per device beside the model's parameters.
    decode_attention: "xla" or "pallas", how decode steps attend over the pool (the module docstring,
    `rstar_jax.engine.settings`); "pallas" lays the pool out heads first.
    The attribute `on_first_token` (default None), if set, is called from the engine thread with each
    request's seconds from submission to its first token, e.g. for a metrics histogram; it must be quick.
    """

    name = "jax"

    def __init__(self, model: Qwen3, *, slots: int = 8, max_length: int = 2048,
                 max_total_tokens: int | None = None, page_size: int = 16, prefill_batch: int = 8,
                 prefix_cache: bool = True, prefix_sharing: bool | None = None,
                 chunked_prefill_size: int | None = None,
                 prefill_buckets: Sequence[int] = (64, 128, 256, 512, 1024, 2048, 4096, 8192),
                 seed: int = 0, cache_dtype: str | None = None, original_logprobs: bool = False,
                 mesh: jax.sharding.Mesh | None = None, layer_layout: str = DEFAULT_LAYER_LAYOUT,
                 decode_attention: str = DEFAULT_DECODE_ATTENTION):
        if slots < 1 or max_length < 2:
            raise ValueError(f"JaxEngine: slots ({slots}) must be >= 1 and max_length ({max_length}) >= 2")
        if page_size < 1 or prefill_batch < 1:
            raise ValueError(f"JaxEngine: page_size ({page_size}) and prefill_batch ({prefill_batch}) must be >= 1")
        if chunked_prefill_size is not None and chunked_prefill_size < 0:
            raise ValueError(f"JaxEngine: chunked_prefill_size ({chunked_prefill_size}) must be >= 0 (0: off)")
        total = slots * max_length if max_total_tokens is None else int(max_total_tokens)
        if total < max_length:
            raise ValueError(f"JaxEngine: max_total_tokens ({total}) must be >= max_length ({max_length}) "
                             f"so that one request always fits")
        self.slots = slots
        self.max_length = max_length
        self.page_size = page_size
        self.prefill_batch = min(prefill_batch, slots)
        self.pages_per_sequence = -(-max_length // page_size)
        self.num_pages = -(-total // page_size)
        self.max_total_tokens = self.num_pages * page_size
        self._span = self.pages_per_sequence * page_size  # positions a page-table row addresses
        self._span_buckets = sorted({-(-self.pages_per_sequence // d) for d in (8, 4, 2, 1)})
        self.vocab_size = model.config.vocab_size
        self.buckets = sorted({min(b, max_length) for b in prefill_buckets} | {max_length})
        graphdef, state = nnx.split(model)
        try:
            self._layout = EngineWeights(graphdef, state, layer_layout)
            check_decode_attention(decode_attention, model.config, page_size,
                                   model.config.dtype if cache_dtype is None else cache_dtype, mesh)
        except ValueError as e:
            raise ValueError(f"JaxEngine: {e}") from None
        self.decode_attention = decode_attention
        self.layer_layout = layer_layout
        self.extra_weight_bytes = self._layout.extra_bytes_per_device()
        self._weights = self._layout.place(state)
        heads_first = decode_attention == "pallas"  # the kernel's layout: no per-layer transpose or copy
        self._cache = model.init_paged_cache(self.num_pages, page_size, cache_dtype, heads_first=heads_first)
        if mesh is not None:
            self._cache = jax.device_put(self._cache, pool_sharding(mesh, model.config.num_kv_heads, heads_first))
        self._pool = PagePool(self.num_pages, page_size)
        self._slot_pages: list[list[int]] = [[] for _ in range(slots)]
        self._page_table = np.full((slots, self.pages_per_sequence), self.num_pages, np.int32)  # unallocated
        self.prefix_cache = prefix_cache
        self.prefix_sharing = prefix_cache if prefix_sharing is None else prefix_sharing
        self.chunked_prefill_size = chunked_prefill_size or None
        self._prefilling = np.zeros(slots, bool)  # admitted, context not all prefilled yet (chunked)
        self.shared_pages = 0
        self.shared_tokens = 0
        self._prefixes = PrefixCache(self._pool, share_pages=self.prefix_sharing)
        self.prompt_tokens = 0  # context tokens of first admissions, and those the cache supplied
        self.cached_tokens = 0
        self._key = jax.random.key(seed)
        self._calls = 0  # prefill and decode calls so far: each one's key is fold_in(key, calls)
        self._version = 0
        self._incoming: queue.Queue[_Request] = queue.Queue()  # from the event loop; drained by the engine
        self._waiting: collections.deque[_Request] = collections.deque()
        self._retracted: collections.deque[_Request] = collections.deque()  # admitted before new requests
        self._active: list[_Request | None] = [None] * slots
        self._positions = np.zeros(slots, np.int32)  # next position to write per slot
        self._last_token = np.zeros(slots, np.int32)
        self._in_flight: _InFlight | None = None  # the decode step dispatched and not yet read back
        # `previous` for a step that follows none, placed as the decode step's outputs are.
        self._no_tokens = (jnp.zeros(slots, jnp.int32) if mesh is None else
                           jax.device_put(np.zeros(slots, np.int32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
        self._new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._lock = threading.RLock()  # held for a whole engine step and for weight swaps
        self._wake = threading.Event()
        self._stopped = False
        self._abort_rids: set[str] = set()
        self._original_logprobs = original_logprobs
        self.original_logprobs = original_logprobs  # output log-probs at temperature 1 (see the module docstring)
        self._admission_blocks = 0  # > 0 while a weight update drains running requests
        self._pause_mode: str | None = None
        self._thread = threading.Thread(target=self._run, name="jax-engine", daemon=True)
        self._rid_counter = itertools.count()
        self._cancel_pending = False  # some request was flagged `ended` since the last step
        self.generated_tokens = 0  # tokens sampled so far (every request, aborted ones included)
        self.on_first_token: Callable[[float], None] | None = None
        self._score = functools.lru_cache(maxsize=None)(
            lambda top_k: jax.jit(functools.partial(score_step, self._layout, top_k)))
        self._prefill = jax.jit(functools.partial(prefill_step, self._layout, original_logprobs), donate_argnums=(1,))
        self._decode = {truncation: jax.jit(functools.partial(decode_step, self._layout, original_logprobs, truncation,
                                                              attention=decode_attention, mesh=mesh),
                                            donate_argnums=(1,)) for truncation in (False, True)}
        self.steps = 0
        self.retractions = 0  # requests retracted so far (all of them)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self) -> Qwen3:
        """The model generation runs on now (the parameters of the last weight update), in variables of
        its own: changing them does not change the engine's."""
        return nnx.merge(self._layout.graphdef, self._layout.stacked(self._weights), copy=True)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None, *,
                       on_token: Callable[[int, float], bool | None] | None = None) -> GenerateResult:
        """Generates from `input_ids`. `on_token(token, logprob)` (optional) runs on this event loop
        for each token as it is sampled, all of them before this returns; True from it ends the request."""
        if self._stopped:
            raise RuntimeError("JaxEngine is closed")
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise ValueError("generate: input_ids must be non-empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"generate: input_ids must lie in [0, {self.vocab_size})")
        if len(prompt) >= self.max_length:
            raise ContextLengthExceeded(f"generate: prompt of {len(prompt)} tokens does not fit max_length "
                                        f"{self.max_length}")
        if len(sampling.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"generate: at most {MAX_STOP_IDS} stop token ids, got {len(sampling.stop_token_ids)}")
        loop = asyncio.get_running_loop()
        request = _Request(rid or f"{next(self._rid_counter):016x}", prompt, sampling, loop.create_future(), loop,
                           on_token=on_token)
        self._incoming.put(request)
        self._wake.set()
        try:
            return await asyncio.shield(request.future)
        except asyncio.CancelledError:
            self._end(request)  # the caller is gone: free the slot
            raise

    def score(self, token_ids: Sequence[int], *, start: int = 1, top_k: int = 0,
              temperature: Sequence[float] | float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log-probs of token_ids[t] given token_ids[:t], for t in [start, len(token_ids)), from one
        full forward on the current weights (blocking; call it from a worker thread).

        temperature: one value, or one per scored position (SGLang scales the distributions behind
        sampled tokens by the request's temperature, and reports prompt tokens at temperature 1).
        Returns (logprobs [n], top_logprobs [n, top_k], top_ids [n, top_k]), n = len(token_ids) - start:
        row i describes the distribution of position start + i."""
        ids = [int(t) for t in token_ids]
        n = len(ids) - start
        if not 1 <= start < len(ids):
            raise ValueError(f"score: start must be in [1, {len(ids)}), got {start}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"score: token ids must lie in [0, {self.vocab_size})")
        if not 0 <= top_k <= self.vocab_size:
            raise ValueError(f"score: top_k must be in [0, {self.vocab_size}], got {top_k}")
        inputs = ids[:-1]  # the last token is only ever a target
        bucket = next((b for b in self.buckets if b >= len(inputs)), len(inputs))
        padded, targets = np.zeros(bucket, np.int32), np.zeros(bucket, np.int32)
        padded[:len(inputs)], targets[:len(inputs)] = inputs, ids[1:]
        temps = np.ones(bucket, np.float32)
        temps[start - 1:len(inputs)] = np.broadcast_to(np.asarray(temperature, np.float32), (n,))
        # k rounded up to a power of two: a client asking for 3, then 5, reuses one compiled kernel.
        k = min(1 << (top_k - 1).bit_length(), self.vocab_size) if top_k else 0
        picked, values, indices = self._score(k)(self._weights, jnp.asarray(padded), jnp.asarray(targets),
                                                 jnp.asarray(temps))
        rows = slice(start - 1, len(inputs))
        return (np.asarray(picked)[rows], np.asarray(values)[rows, :top_k], np.asarray(indices)[rows, :top_k])

    async def abort(self, rid: str) -> None:
        """Aborts requests whose rid starts with `rid` (SGLang's prefix semantics); "" is ignored."""
        if not rid:
            return
        self._abort_rids.add(rid)
        self._wake.set()

    async def capacity(self) -> Capacity:
        with self._lock:
            running = sum(r is not None for r in self._active)
            used = self._pool.used * self.page_size
            queued = len(self._waiting) + len(self._retracted) + self._incoming.qsize()
            retracted = len(self._retracted)
        return Capacity(total_tokens=self.max_total_tokens, used_tokens=used, running_requests=running,
                        queued_requests=queued, retracted_requests=retracted, context_length=self.max_length,
                        max_input_tokens=self.max_length - 1)

    def update_weights(self, model_or_state, *, abort_in_flight: bool = False, in_place: bool = False,
                       version: int | None = None) -> int:
        """Swaps in new parameters (a `Qwen3` or its `nnx.State`) and returns the new version.

        Parameters are resharded onto the engine's placements when they live elsewhere, and laid out
        as the engine's `layer_layout` holds them (the per-layer layout's copy, before any wait). By default
        running and retracted requests finish on the old weights first (new ones wait); with
        `abort_in_flight` they end at once with reason "abort" and their partial tokens; with
        `in_place` the swap happens between two engine steps and they go on under the new weights
        (SGLang's in-place pause: their KV so far is the old weights'), each sampled token keeping
        the version that produced it (`GenerateResult.token_versions`). While the engine is paused
        the swap happens at once. Blocks until the swap is done.
        """
        if abort_in_flight and in_place:
            raise ValueError("update_weights: abort_in_flight and in_place exclude each other")
        state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
        abstract = self._layout.abstract
        if jax.tree.structure(state) != jax.tree.structure(abstract):
            raise ValueError("update_weights: the new parameters do not match the engine's model structure")
        for (path, new), old in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(abstract)):
            if new.shape != old.shape:
                raise ValueError(f"update_weights: {jax.tree_util.keystr(path)} has shape {new.shape}, "
                                 f"the engine's is {old.shape}")
        # device_put onto the engine's shardings reshards when the trainer's mesh differs.
        new_state = jax.tree.map(lambda new, old: jax.device_put(new.astype(old.dtype), old.sharding),
                                 state, abstract)
        new_weights = self._layout.place(new_state)
        with self._lock:
            self._admission_blocks += 1
        try:
            while True:
                with self._lock:
                    if abort_in_flight:
                        self._abort_in_flight()
                    drained = all(r is None for r in self._active) and not self._retracted
                    if drained or in_place or self._pause_mode is not None:
                        self._settle()  # tokens of the step in flight are the old weights'
                        self._drop_prefixes()  # their KV came from the old weights
                        self._weights = new_weights
                        self._version = self._version + 1 if version is None else int(version)
                        return self._version
                self._wake.set()
                time.sleep(0.002)  # running requests finish on the old weights
        finally:
            with self._lock:
                self._admission_blocks -= 1
            self._wake.set()

    def pause(self, mode: str = "abort") -> int:
        """SGLang's `/pause_generation`: "abort", "retract" or "in_place" (see the module docstring).

        New requests stay queued until `resume()`. Returns how many requests were aborted, retracted
        or frozen."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause: mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._lock:
            self._settle()  # the step in flight delivers its tokens first
            self._drain_incoming()
            self._pause_mode = mode
            running = [slot for slot, r in enumerate(self._active) if r is not None]
            if mode == "abort":
                affected = self._abort_in_flight()
                while self._waiting:
                    self._resolve(self._waiting.popleft(), FINISH_ABORT)
                    affected += 1
                return affected
            if mode == "retract":
                for slot in reversed(running):  # appendleft: the earliest slot ends up first
                    self._retract(slot)
            return len(running)

    def resume(self) -> None:
        """Ends a pause: retracted and queued requests are admitted again, frozen ones go on decoding."""
        with self._lock:
            self._pause_mode = None
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._pause_mode is not None

    def abort_all(self) -> int:
        """Aborts every running and queued request (they return their partial tokens); returns how many."""
        with self._lock:
            count = (sum(r is not None for r in self._active) + len(self._waiting) + len(self._retracted)
                     + self._incoming.qsize())
            self._abort_rids.add("")  # the empty prefix matches every rid
        self._wake.set()
        return count

    def flush_cache(self) -> bool:
        """SGLang's `/flush_cache`: drops the prefix cache; refused (False) while any request is in flight."""
        with self._lock:
            if not self.is_idle():
                return False
            self._drop_prefixes()
            return True

    def is_idle(self) -> bool:
        """True when no request is running or queued."""
        with self._lock:
            return (all(r is None for r in self._active) and not self._waiting and not self._retracted
                    and self._incoming.empty())

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- the page pool's bookkeeping, read by tests -------------------------------------------
    @property
    def _free_pages(self) -> list[int]:
        return self._pool.free

    @property
    def _slot_refs(self) -> list[int]:
        return self._pool.slot_refs

    @property
    def _cache_refs(self) -> list[int]:
        return self._pool.cache_refs

    @property
    def _evictable_pages(self) -> int:
        return self._pool.evictable

    @property
    def _page_index(self) -> dict:
        return self._pool.index
