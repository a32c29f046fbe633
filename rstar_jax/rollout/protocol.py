"""The contract between the rollout loop and whatever generates tokens.

Token in, token out: a generator receives the full context as token ids and returns only the new
ids, their sampler log-probs and why it stopped. The conversation is never re-tokenized. Both the
in-process `JaxEngine` and the SGLang HTTP client implement `Generator`.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import AsyncContextManager, Hashable, Protocol, Sequence, runtime_checkable

RID_HEX_DIGITS = 16  # fixed width: SGLang aborts by rid prefix, so no rid may prefix another


def new_rid() -> str:
    """A random fixed-width hex request id."""
    return secrets.token_hex(RID_HEX_DIGITS // 2)


# SGLang's finish reasons (meta_info.finish_reason.type), plus "abort" for a cancelled request.
FINISH_STOP = "stop"  # an EOS / stop token id was sampled (the token is included in the output)
FINISH_LENGTH = "length"  # max_new_tokens or the context limit was reached
FINISH_ABORT = "abort"  # aborted by the client, a weight update or a server shutdown
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)


class GeneratorError(RuntimeError):
    """A generator could not complete a request."""


class GeneratorUnavailable(GeneratorError):
    """The generator cannot serve: it refused connections, timed out or answered 5xx. The scheduler
    takes it out of rotation and the trajectory resumes on another generator from its last complete turn."""


class RequestRejected(GeneratorError):
    """The generator refused this request (a 4xx, e.g. a context longer than it serves). The generator
    stays in rotation; the trajectory ends there, like a truncated one."""


class ContextLengthExceeded(RequestRejected):
    """The context leaves no room for one new token within the generator's context length: raised
    before the request is sent (or before it is placed), never by a server's 400. The trajectory ends
    truncated at the context length."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; every field is always sent to SGLang (its defaults come from the model)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        # SGLang treats temperature in [0, 1e-6) as greedy.
        return self.temperature < 1e-6 or self.top_k == 1


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What one generate call produced: new token ids only, aligned with their log-probs."""

    token_ids: list[int]
    logprobs: list[float]  # log p(token | context) under the sampling distribution's model logits
    finish_reason: str  # one of FINISH_REASONS
    weight_version: int = 0  # policy version that produced the tokens (the last one, if it changed)
    num_retractions: int = 0  # times KV pressure retracted the request (its tokens were recomputed)
    cached_tokens: int = 0  # context tokens whose KV a prefix cache supplied (not prefilled again)
    # The version that sampled each token, where the generator reports it (the in-process engine and
    # servers whose weights an in-place update changed under a running request); None: every token
    # is `weight_version`'s.
    token_versions: tuple[int, ...] | None = None

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"GenerateResult: {len(self.token_ids)} token ids but {len(self.logprobs)} log-probs"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"GenerateResult: {len(self.token_ids)} token ids but "
                             f"{len(self.token_versions)} token versions")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"GenerateResult.finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")


@dataclasses.dataclass(frozen=True)
class Capacity:
    """KV-cache capacity of one generator, in tokens, summed over its data-parallel ranks (each
    SGLang DP rank has its own pool of max_total_num_tokens; one request lives on one rank)."""

    total_tokens: int  # sum over ranks of SGLang's max_total_num_tokens
    used_tokens: int = 0  # sum over ranks
    running_requests: int = 0
    queued_requests: int = 0
    retracted_requests: int = 0  # queued requests holding partial output after a retraction
    ranks: int = 1  # DP ranks the totals cover; total_tokens // ranks is the most one request can use
    # Per request: the context plus its new tokens may hold at most `context_length` tokens, and the
    # context alone at most `max_input_tokens` (SGLang: --context-length, and max_req_input_len - 1,
    # which the KV pool's size can lower). None: not reported, no limit known.
    context_length: int | None = None
    max_input_tokens: int | None = None

    def room_for(self, context_tokens: int) -> int | None:
        """The most new tokens one request with this context may ask for: 0 when the context cannot be
        sent at all, None when no limit is known."""
        if self.max_input_tokens is not None and context_tokens > self.max_input_tokens:
            return 0
        if self.context_length is None:
            return None
        return max(0, self.context_length - context_tokens)


@runtime_checkable
class Generator(Protocol):
    """An engine the rollout loop can drive: the in-process JaxEngine or an SGLang server."""

    name: str

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: str | None = None
    ) -> GenerateResult: ...

    async def capacity(self) -> Capacity: ...

    async def abort(self, rid: str) -> None: ...

    @property
    def version(self) -> int: ...


class Session(Protocol):
    """One trajectory's handle on a scheduler, for its life."""

    def turn(self, context_tokens: int, max_new_tokens: int) -> AsyncContextManager[Generator]:
        """The generator for one request of the trajectory (its whole context is `context_tokens`);
        waits while none has room. Whatever the scheduler reserved for it is released on exit."""
        ...

    def record(self, generated_tokens: int, *, complete: bool = True) -> None:
        """What the turn in flight generated (`complete=False` for one cut short by an abort)."""
        ...


@runtime_checkable
class Scheduler(Protocol):
    """Places trajectories' turns on generators.

    A trajectory opens a session for its life and asks it for a generator turn by turn; between turns
    (its tool calls) it holds none. Turns of one trajectory go back to the generator that holds its
    prefix unless the scheduler moves them (see rstar_jax.rollout.scheduler).
    """

    def trajectory(self, trajectory_id: str, *, group: Hashable | None = None) -> AsyncContextManager[Session]: ...

    def mark_down(self, generator: Generator, reason: str) -> None:
        """Takes a failed generator out of rotation: no new turn goes to it."""
        ...

    def stats(self) -> dict[str, float]:
        """Figures since the scheduler started, by name, for the step metrics (`scheduler/<name>`)."""
        ...
