"""In-process JAX generation engine with continuous batching over a preallocated KV cache.

A fixed number of decode slots share one KV cache ([layers, slots, max_length, kv_heads, head_dim]).
A background thread runs the engine loop: it admits waiting requests into free slots (prefill of
that slot's row, prompt lengths bucketed to limit recompiles) and then runs one jitted decode step
for every slot, so new requests are prefilled while others decode. Per-slot sampling settings are
arrays (temperature, top-p, top-k are traced, never static). The asyncio front
(`await engine.generate(...)`) implements `rstar_jax.rollout.protocol.Generator`.

Log-probs match SGLang (see `rstar_jax.rollout.sampling`): log-softmax of the temperature-scaled
logits at the sampled token, before top-p / top-k truncation; `original_logprobs=True` gives the raw
logits' log-softmax (SGLANG_RETURN_ORIGINAL_LOGPROB). Greedy rows and temperature 1 give the raw
log-softmax either way, which is what the trainer recomputes.

Weight updates (`update_weights`) follow SGLang's `/update_weights_from_disk`: by default the call
stops admitting new requests, lets every running request finish on the old weights, swaps the
parameters and bumps the version (queued requests then run on the new weights). With
`abort_in_flight=True` (SGLang's `abort_all_requests`) running requests finish at once with reason
"abort" and their partial tokens, and the swap happens between two engine steps. `pause()` is
SGLang's `/pause_generation` in abort mode: it aborts everything and holds new requests queued
until `resume()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rstar_jax.model.qwen3 import KVCache, Qwen3
from rstar_jax.rollout.protocol import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Capacity, GenerateResult, SamplingParams
from rstar_jax.rollout.sampling import row_keys, sample_tokens

MAX_STOP_IDS = 8


def cache_sharding(mesh: jax.sharding.Mesh, slots: int, kv_heads: int) -> jax.sharding.NamedSharding:
    """KV cache [layers, slots, length, kv_heads, head_dim] placement: slots over the data-parallel
    axes and KV heads over "tensor" (as the attention activations are), each only when it divides."""
    data_axes = tuple(a for a in ("data", "fsdp") if a in mesh.shape)
    data_size = int(np.prod([mesh.shape[a] for a in data_axes])) if data_axes else 1
    tensor = mesh.shape.get("tensor", 1)
    spec = jax.sharding.PartitionSpec(None, data_axes if data_axes and slots % data_size == 0 else None, None,
                                      "tensor" if tensor > 1 and kv_heads % tensor == 0 else None, None)
    return jax.sharding.NamedSharding(mesh, spec)


@dataclasses.dataclass
class _Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    aborted: bool = False
    submitted: float = dataclasses.field(default_factory=time.perf_counter)


def _row_seed(sampling: SamplingParams) -> int:
    # SGLang's `sampling_seed`; -1 marks an unseeded row. Folded into int32's non-negative range.
    return -1 if sampling.seed is None else int(sampling.seed) % (2**31 - 1)


class JaxEngine:
    """Continuous-batching generator over a Qwen3 model. Thread-safe; asyncio front end."""

    name = "jax"

    def __init__(self, model: Qwen3, *, slots: int = 8, max_length: int = 2048,
                 prefill_buckets: Sequence[int] = (64, 128, 256, 512, 1024, 2048, 4096, 8192),
                 seed: int = 0, cache_dtype: str | None = None, original_logprobs: bool = False,
                 mesh: jax.sharding.Mesh | None = None):
        if slots < 1 or max_length < 2:
            raise ValueError(f"JaxEngine: slots ({slots}) must be >= 1 and max_length ({max_length}) >= 2")
        self.slots = slots
        self.max_length = max_length
        self.vocab_size = model.config.vocab_size
        self.buckets = sorted({min(b, max_length) for b in prefill_buckets} | {max_length})
        self._graphdef, self._state = nnx.split(model)
        self._cache = model.init_cache(slots, max_length, cache_dtype)
        if mesh is not None:
            self._cache = jax.device_put(self._cache, cache_sharding(mesh, slots, model.config.num_kv_heads))
        self._key = jax.random.key(seed)
        self._version = 0
        self._waiting: queue.Queue[_Request] = queue.Queue()
        self._active: list[_Request | None] = [None] * slots
        self._positions = np.zeros(slots, np.int32)  # next position to write per slot
        self._last_token = np.zeros(slots, np.int32)
        self._lock = threading.RLock()  # held for a whole engine step and for weight swaps
        self._wake = threading.Event()
        self._stopped = False
        self._abort_rids: set[str] = set()
        self._original_logprobs = original_logprobs
        self._admission_blocks = 0  # > 0 while paused or while a weight update drains running requests
        self._paused = False
        self._thread = threading.Thread(target=self._run, name="jax-engine", daemon=True)
        self._rid_counter = itertools.count()
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        self.steps = 0
        self._thread.start()

    # -- jitted kernels -----------------------------------------------------------------------
    def _prefill_fn(self, state, cache: KVCache, slot, ids, length, key, seed, temperature, top_p, top_k):
        model = nnx.merge(self._graphdef, state)
        row = KVCache(k=jax.lax.dynamic_slice_in_dim(cache.k, slot, 1, axis=1),
                      v=jax.lax.dynamic_slice_in_dim(cache.v, slot, 1, axis=1))
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
        logits, row = model.forward_with_cache(ids, positions, row)
        cache = KVCache(k=jax.lax.dynamic_update_slice_in_dim(cache.k, row.k, slot, axis=1),
                        v=jax.lax.dynamic_update_slice_in_dim(cache.v, row.v, slot, axis=1))
        last = jax.lax.dynamic_index_in_dim(logits[0], length - 1, axis=0, keepdims=True)  # [1, V]
        # The first sampled token sits at absolute position `length`.
        keys = row_keys(key, seed[None], length[None])
        token, logprob = sample_tokens(last, keys, temperature[None], top_p[None], top_k[None],
                                       original=self._original_logprobs)
        return cache, token[0], logprob[0]

    def _decode_fn(self, state, cache: KVCache, tokens, positions, key, seeds, temperature, top_p, top_k):
        model = nnx.merge(self._graphdef, state)
        logits, cache = model.forward_with_cache(tokens[:, None], positions[:, None], cache)
        logits = logits[:, 0]
        keys = row_keys(key, seeds, positions + 1)  # the sampled token's absolute position
        next_tokens, logprobs = sample_tokens(logits, keys, temperature, top_p, top_k,
                                              original=self._original_logprobs)
        return cache, next_tokens, logprobs

    # -- public API ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None) -> GenerateResult:
        if self._stopped:
            raise RuntimeError("JaxEngine is closed")
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise ValueError("generate: input_ids must be non-empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"generate: input_ids must lie in [0, {self.vocab_size})")
        if len(prompt) >= self.max_length:
            raise ValueError(f"generate: prompt of {len(prompt)} tokens does not fit max_length {self.max_length}")
        if len(sampling.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"generate: at most {MAX_STOP_IDS} stop token ids, got {len(sampling.stop_token_ids)}")
        loop = asyncio.get_running_loop()
        request = _Request(rid or f"{next(self._rid_counter):016x}", prompt, sampling, loop.create_future(), loop)
        self._waiting.put(request)
        self._wake.set()
        try:
            return await asyncio.shield(request.future)
        except asyncio.CancelledError:
            self._abort_rids.add(request.rid)  # free the slot; the caller is gone
            raise

    async def abort(self, rid: str) -> None:
        """Aborts requests whose rid starts with `rid` (SGLang's prefix semantics); "" is ignored."""
        if not rid:
            return
        self._abort_rids.add(rid)
        self._wake.set()

    async def capacity(self) -> Capacity:
        with self._lock:
            running = [r for r in self._active if r is not None]
            used = int(sum(self._positions[i] for i, r in enumerate(self._active) if r is not None))
        return Capacity(total_tokens=self.slots * self.max_length, used_tokens=used,
                        running_requests=len(running), queued_requests=self._waiting.qsize())

    def update_weights(self, model_or_state, *, abort_in_flight: bool = False, version: int | None = None) -> int:
        """Swaps in new parameters (a `Qwen3` or its `nnx.State`) and returns the new version.

        Parameters are resharded onto the engine's placements when they live elsewhere. Without
        `abort_in_flight`, running requests finish on the old weights first (new ones wait); with it
        they end at once with reason "abort" and their partial tokens. Blocks until the swap is done.
        """
        state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
        if jax.tree.structure(state) != jax.tree.structure(self._state):
            raise ValueError("update_weights: the new parameters do not match the engine's model structure")
        for (path, new), old in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(self._state)):
            if new.shape != old.shape:
                raise ValueError(f"update_weights: {jax.tree_util.keystr(path)} has shape {new.shape}, "
                                 f"the engine's is {old.shape}")
        # device_put onto the engine's shardings reshards when the trainer's mesh differs.
        new_state = jax.tree.map(lambda new, old: jax.device_put(new.astype(old.dtype), old.sharding),
                                 state, self._state)
        with self._lock:
            self._admission_blocks += 1
        try:
            while True:
                with self._lock:
                    if abort_in_flight:
                        for slot, request in enumerate(self._active):
                            if request is not None:
                                self._finish(slot, FINISH_ABORT)
                    if all(r is None for r in self._active):
                        self._state = new_state
                        self._version = self._version + 1 if version is None else int(version)
                        return self._version
                self._wake.set()
                time.sleep(0.002)  # running requests finish on the old weights
        finally:
            with self._lock:
                self._admission_blocks -= 1
            self._wake.set()

    def pause(self) -> int:
        """SGLang's pause in abort mode: aborts running and queued requests, holds new ones queued.

        Returns how many requests were aborted."""
        with self._lock:
            if not self._paused:
                self._paused = True
                self._admission_blocks += 1
            aborted = 0
            for slot, request in enumerate(self._active):
                if request is not None:
                    self._finish(slot, FINISH_ABORT)
                    aborted += 1
            while True:
                try:
                    self._resolve(self._waiting.get_nowait(), FINISH_ABORT)
                    aborted += 1
                except queue.Empty:
                    break
        return aborted

    def resume(self) -> None:
        """Ends a pause: queued requests are admitted again."""
        with self._lock:
            if self._paused:
                self._paused = False
                self._admission_blocks -= 1
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused

    def abort_all(self) -> int:
        """Aborts every running and queued request (they return their partial tokens); returns how many."""
        with self._lock:
            count = sum(r is not None for r in self._active) + self._waiting.qsize()
            self._abort_rids.add("")  # the empty prefix matches every rid
        self._wake.set()
        return count

    def is_idle(self) -> bool:
        """True when no request is running or queued."""
        with self._lock:
            return all(r is None for r in self._active) and self._waiting.empty()

    def close(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- engine loop (background thread) ------------------------------------------------------
    def _next_key(self):
        self._key, key = jax.random.split(self._key)
        return key

    def _resolve(self, request: _Request, reason: str) -> None:
        result = GenerateResult(list(request.tokens), list(request.logprobs), reason, self._version)
        request.loop.call_soon_threadsafe(lambda: request.future.done() or request.future.set_result(result))

    def _finish(self, slot: int, reason: str) -> None:
        request = self._active[slot]
        self._active[slot] = None
        self._positions[slot] = 0
        self._resolve(request, reason)

    def _check_stop(self, slot: int) -> None:
        request = self._active[slot]
        s = request.sampling
        if request.tokens[-1] in s.stop_token_ids:
            self._finish(slot, FINISH_STOP)
        elif len(request.tokens) >= s.max_new_tokens or self._positions[slot] + 1 >= self.max_length:
            # The sequence (prompt + output) fills the cache: the last token could not be fed back.
            self._finish(slot, FINISH_LENGTH)

    def _apply_aborts(self) -> None:
        if not self._abort_rids:
            return
        taken, self._abort_rids = self._abort_rids, set()  # swap: an add from another thread is never lost
        prefixes = tuple(taken)
        for slot, request in enumerate(self._active):
            if request is not None and request.rid.startswith(prefixes):
                self._finish(slot, FINISH_ABORT)
        kept = []
        while True:
            try:
                request = self._waiting.get_nowait()
            except queue.Empty:
                break
            if request.rid.startswith(prefixes):
                self._resolve(request, FINISH_ABORT)
            else:
                kept.append(request)
        for request in kept:
            self._waiting.put(request)

    def _admit(self) -> None:
        if self._admission_blocks:
            return
        for slot in range(self.slots):
            if self._active[slot] is not None:
                continue
            try:
                request = self._waiting.get_nowait()
            except queue.Empty:
                return
            n = len(request.prompt)
            bucket = next(b for b in self.buckets if b >= n)
            ids = np.zeros((1, bucket), np.int32)
            ids[0, :n] = request.prompt
            s = request.sampling
            self._cache, token, logprob = self._prefill(
                self._state, self._cache, jnp.int32(slot), jnp.asarray(ids), jnp.int32(n), self._next_key(),
                jnp.int32(_row_seed(s)), jnp.float32(s.temperature), jnp.float32(s.top_p), jnp.int32(s.top_k))
            self._active[slot] = request
            self._positions[slot] = n
            request.tokens.append(int(token))
            request.logprobs.append(float(logprob))
            self._last_token[slot] = int(token)
            self._check_stop(slot)

    def _decode_step(self) -> None:
        active = [i for i, r in enumerate(self._active) if r is not None]
        if not active:
            return
        temperature = np.ones(self.slots, np.float32)
        top_p = np.ones(self.slots, np.float32)
        top_k = np.zeros(self.slots, np.int32)
        seeds = np.full(self.slots, -1, np.int32)
        positions = np.full(self.slots, self.max_length, np.int32)  # idle slots: writes are dropped
        for i in active:
            s = self._active[i].sampling
            temperature[i], top_p[i], top_k[i], seeds[i] = s.temperature, s.top_p, s.top_k, _row_seed(s)
            positions[i] = self._positions[i]
        self._cache, tokens, logprobs = self._decode(
            self._state, self._cache, jnp.asarray(self._last_token), jnp.asarray(positions), self._next_key(),
            jnp.asarray(seeds), jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k))
        tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
        for i in active:
            request = self._active[i]
            request.tokens.append(int(tokens[i]))
            request.logprobs.append(float(logprobs[i]))
            self._positions[i] += 1
            self._last_token[i] = tokens[i]
            self._check_stop(i)

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                self._apply_aborts()
                self._admit()
                self._decode_step()
                self.steps += 1
                running = any(r is not None for r in self._active)
                busy = running or (not self._waiting.empty() and not self._admission_blocks)
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        with self._lock:
            for slot, request in enumerate(self._active):
                if request is not None:
                    self._finish(slot, FINISH_ABORT)
            while not self._waiting.empty():
                self._resolve(self._waiting.get_nowait(), FINISH_ABORT)
