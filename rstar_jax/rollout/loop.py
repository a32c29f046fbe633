"""One multi-turn trajectory: generate -> parse tool call -> execute in the sandbox -> observe.

Token bookkeeping (rStar2 spec §2.3, §6.5): the conversation grows by appending ids — sampled ids
with loss mask 1 and their sampler log-probs, observation ids (including the forced `<reason>` of
the next turn) with mask 0 — and is never re-tokenized. Model and tool tokens share one response
budget; an observation that would reach the budget is not appended and the trajectory stops, so it
never ends on a user turn.

Failures (token in, token out makes each resumption exact):
- A generator that is unavailable (refused connection, timeout, 5xx) is taken out of the scheduler's
  rotation and the turn goes to another generator, continuing from the last complete turn (the lost
  turn's tokens were never appended).
- A turn the generator aborts (a weight update with `abort_all_requests`, a pause, an operator's
  abort) keeps its partial tokens and is continued by the next request, up to `max_abort_resumes`
  times (partial rollout): the sampled tokens carry the weight version that produced them.
- A request the generator rejects (a 4xx) ends the trajectory as truncated, scored 0, with
  `finish_reason` "rejected".
- A generator's context length bounds every request: the generator asks for at most what fits
  (SGLang answers 400 otherwise), so a trajectory whose context reaches it before its response budget
  runs out ends truncated with `finish_reason` "context_length" (its turns so far kept), as does one
  whose context no generator can take.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Any, Awaitable, Callable, Protocol

import numpy as np

from rstar_jax.agent.stats import PARSE_ERROR, count_answer_tags, is_tool_error
from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import Tokenizer
from rstar_jax.agent.tool_calls import ToolCallError, format_observation, parse_tool_calls
from rstar_jax.rollout.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    ContextLengthExceeded,
    Generator,
    GeneratorUnavailable,
    RequestRejected,
    SamplingParams,
    Scheduler,
)
from rstar_jax.rollout.scheduler import DirectSession
from rstar_jax.rollout.tokens import TokenArray
from rstar_jax.rollout.tool_env import ToolEnv
from rstar_jax.rollout.trajectory import (
    STOP_ABORTED,
    STOP_BUDGET,
    STOP_CONTEXT,
    STOP_MAX_TURNS,
    STOP_NO_TOOL_CALL,
    STOP_REJECTED,
    TOKEN_BUFFERS,
    Trajectory,
)


class ToolExecutor(Protocol):
    """Runs untrusted code (the sandbox client). The result has status, stdout, stderr, duration_s."""

    async def execute(self, code: str, stdin: str = "", **kwargs) -> Any: ...


Scorer = Callable[..., Awaitable[float]]  # async (model_text, gold, truncated=...) -> reward

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    max_turns: int = 10  # assistant turns (T = 10 in RL stages 1-2, spec §5.3)
    response_budget: int = 8192  # model + tool tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tool_name: str = "python_code_with_standard_io"
    max_calls_per_turn: int = 1
    # The one tool environment the calls meet (rstar_jax.rollout.tool_env): the sandbox's per-call
    # options, sent with every call, and how results and malformed calls read to the policy.
    tool_env: ToolEnv = dataclasses.field(default_factory=lambda: ToolEnv.preset_defaults("rich"))
    use_tools: bool = True  # False: tool calls are never executed (the first turn is the last)
    # Seeded sampling: each trajectory draws from a seed derived from (seed, group_id, sample_index),
    # so its tokens do not depend on batching or timing (reproducible runs, exact resume).
    # None: the generator's own random stream.
    seed: int | None = None
    # A turn the generator aborts is continued from its partial output this many times per
    # trajectory (partial rollout); the next abort ends the trajectory unscored.
    max_abort_resumes: int = 8
    # How a trajectory holds its per-token fields (rstar_jax.rollout.trajectory.TOKEN_BUFFERS):
    # "array", typed TokenArrays (13 bytes a token); "list", Python lists (the baseline that
    # benchmarks/host_rollout.py measures beside them).
    token_buffers: str = "array"

    def __post_init__(self):
        if self.max_calls_per_turn < 1:
            raise ValueError(f"LoopConfig.max_calls_per_turn must be >= 1, got {self.max_calls_per_turn}")
        if self.max_turns < 1:
            raise ValueError(f"LoopConfig.max_turns must be >= 1, got {self.max_turns}")
        if self.response_budget < 1:
            raise ValueError(f"LoopConfig.response_budget must be >= 1, got {self.response_budget}")
        if not self.temperature >= 0:  # 0 is greedy (evaluation may use it; RL needs > 0)
            raise ValueError(f"LoopConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"LoopConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"LoopConfig.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_abort_resumes < 0:
            raise ValueError(f"LoopConfig.max_abort_resumes must be >= 0, got {self.max_abort_resumes}")
        if self.token_buffers not in TOKEN_BUFFERS:
            raise ValueError(f"LoopConfig.token_buffers must be one of {TOKEN_BUFFERS}, got {self.token_buffers!r}")

_rid_counter = itertools.count()


def set_rid_base(base: int) -> None:
    """This process's request ids count from `base` (< 16**16): processes that share servers (rollout
    worker processes) take disjoint ranges, so no two requests on a server share an id."""
    global _rid_counter
    if not 0 <= base < 16**16:
        raise ValueError(f"set_rid_base: base must be in [0, 16**16), got {base}")
    _rid_counter = itertools.count(base)


def trajectory_seed(seed: int, group_id: int, sample_index: int) -> int:
    """A well-mixed 31-bit sampling seed for one trajectory (stable across runs and processes)."""
    return int(np.random.SeedSequence([seed, group_id, sample_index]).generate_state(1)[0]) % (2**31 - 1)


def _new_turn(config: LoopConfig):
    return TokenArray() if config.token_buffers == "array" else []


def _new_rid() -> str:
    # Fixed width: SGLang aborts by rid prefix, so no rid may be a prefix of another.
    return f"{next(_rid_counter):016x}"


async def _generate(gen: Generator, input_ids: list[int], sampling: SamplingParams, rid: str):
    """generate, aborting the request on the engine when the trajectory is cancelled."""
    try:
        return await gen.generate(input_ids, sampling, rid)
    except asyncio.CancelledError:
        try:
            await gen.abort(rid)
        except Exception as e:  # the cancellation must still propagate; the engine ends the request itself
            log.warning("abort of request %s on %s failed: %s", rid, getattr(gen, "name", gen), e)
        raise


async def _run_call(call, executor: ToolExecutor, config: LoopConfig) -> tuple[str, str]:
    if isinstance(call, ToolCallError):
        return PARSE_ERROR, format_observation(call, max_chars=config.tool_env.observation_max_chars)
    env = config.tool_env
    result = await executor.execute(call.code, call.stdin, **env.sandbox_options())
    return result.status, format_observation(result, style=env.observation_style, max_chars=env.observation_max_chars)


async def run_trajectory(
    generator: Generator | None,
    tokenizer: Tokenizer,
    executor: ToolExecutor,
    question: str,
    gold_answer: str,
    *,
    config: LoopConfig,
    scorer: Scorer,
    template: ChatTemplate | None = None,
    scheduler: Scheduler | None = None,
    group_id: int = 0,
    sample_index: int = 0,
) -> Trajectory:
    """Runs one trajectory to its end and scores it.

    generator: used for every turn when no scheduler is given; with a scheduler, the trajectory
    holds a session for its life and asks it for a generator turn by turn (the scheduler reserves
    each turn's expected KV and keeps its prefix between turns; see rstar_jax.rollout.scheduler), and
    a turn whose generator fails goes to another (see the module docstring). scorer: an async
    (model_text, gold, truncated=...) -> reward that never blocks the event loop
    (`rstar_jax.agent.reward.make_scorer`). Cancelling the task aborts the in-flight generation
    and the in-flight tool call.
    """
    template = template or ChatTemplate(tool_name=config.tool_name)
    traj = Trajectory.begin(template.prompt_ids(tokenizer, question), buffers=config.token_buffers,
                            group_id=group_id, sample_index=sample_index, question=question, gold_answer=gold_answer)
    prompt_ids = traj.prompt_ids
    trajectory_rid = _new_rid()
    seed = None if config.seed is None else trajectory_seed(config.seed, group_id, sample_index)
    if scheduler is None and generator is None:
        raise ValueError("run_trajectory needs a generator or a scheduler")
    model_text: list[str] = []
    # The current turn's sampled ids (it may span aborted requests), held as the trajectory's are.
    turn_ids = _new_turn(config)
    min_observation = len(template.tool_response_ids(tokenizer, ""))
    session_context = (scheduler.trajectory(trajectory_rid, group=group_id) if scheduler is not None
                       else contextlib.nullcontext(DirectSession(generator)))
    async with session_context as session:
        while True:
            remaining = config.response_budget - len(traj.response_ids)
            sampling = SamplingParams(max_new_tokens=remaining, temperature=config.temperature,
                                      top_p=config.top_p, top_k=config.top_k,
                                      stop_token_ids=tokenizer.stop_ids, seed=seed)
            context = prompt_ids + traj.response_ids
            result = None
            try:
                async with session.turn(len(context), remaining) as gen:
                    try:
                        result = await _generate(gen, context, sampling, _new_rid())
                    except GeneratorUnavailable as e:
                        if scheduler is None:
                            raise
                        scheduler.mark_down(gen, str(e))  # the turn goes to a generator still in rotation
                    else:
                        session.record(len(result.token_ids), complete=result.finish_reason != FINISH_ABORT)
            except ContextLengthExceeded as e:
                traj.finish_reason, traj.truncated = STOP_CONTEXT, True
                traj.extra["error"] = str(e)
                break
            except RequestRejected as e:
                traj.finish_reason, traj.truncated = STOP_REJECTED, True
                traj.extra["error"] = str(e)
                log.warning("trajectory %s (group %d, sample %d): %s", trajectory_rid, group_id, sample_index, e)
                break
            if result is None:
                traj.n_failovers += 1
                traj.truncate_response(len(traj.response_ids) - len(turn_ids))  # the turn restarts whole
                turn_ids = _new_turn(config)
                continue
            traj.extend_sampled(result.token_ids, result.logprobs,
                                result.token_versions if result.token_versions is not None
                                else int(result.weight_version))
            traj.n_retractions += result.num_retractions
            turn_ids += result.token_ids
            if result.finish_reason == FINISH_ABORT:
                if traj.n_abort_resumes < config.max_abort_resumes and len(traj.response_ids) < config.response_budget:
                    traj.n_abort_resumes += 1  # partial rollout: the turn goes on from its partial output
                    continue
                traj.n_turns += 1
                model_text.append(tokenizer.decode(turn_ids))
                traj.finish_reason = STOP_ABORTED
                break
            traj.n_turns += 1
            turn_text = tokenizer.decode(turn_ids)
            model_text.append(turn_text)
            turn_ids = _new_turn(config)
            if result.finish_reason == FINISH_LENGTH:
                # Short of the budget, the request was capped at the generator's context length.
                at_budget = len(traj.response_ids) >= config.response_budget
                traj.finish_reason, traj.truncated = (STOP_BUDGET if at_budget else STOP_CONTEXT), True
                break
            # A turn that ends with EOS exactly at the budget is complete: an answer there counts, and
            # a tool call there is stopped below because its observation cannot be appended.
            calls = parse_tool_calls(turn_text, tool_names=(template.tool_name,),
                                     max_calls=config.max_calls_per_turn, parsing=config.tool_env.tool_call_parsing)
            if not calls:
                traj.finish_reason = STOP_NO_TOOL_CALL
                break
            if traj.n_turns >= config.max_turns or not config.use_tools:
                traj.finish_reason = STOP_MAX_TURNS  # the turn limit: no further turn can use a result
                break
            if len(traj.response_ids) + min_observation >= config.response_budget:
                # Not even an empty observation fits: stop before spending a sandbox call.
                traj.finish_reason, traj.truncated = STOP_BUDGET, True
                break
            # Calls of one turn run concurrently (the release gathers them); each yields (status, text).
            t_tools = time.perf_counter()
            outcomes = await asyncio.gather(*(_run_call(call, executor, config) for call in calls))
            traj.tool_seconds += time.perf_counter() - t_tools
            for status, _ in outcomes:
                traj.n_tool_calls += 1
                traj.n_tool_errors += int(is_tool_error(status))
                traj.tool_statuses.append(status)
            observations = [text for _, text in outcomes]
            obs_ids = template.tool_response_ids(tokenizer, observations)
            if len(traj.response_ids) + len(obs_ids) >= config.response_budget:
                traj.finish_reason, traj.truncated = STOP_BUDGET, True
                break
            traj.extend_observation(obs_ids)
    traj.trim()  # held until the update: no spare capacity
    text = "".join(model_text)
    traj.n_answer_tags = count_answer_tags(text)
    traj.extra["model_text"] = text
    # An aborted trajectory never finished, so like a truncated (or rejected) one it earns nothing.
    traj.reward = await scorer(text, gold_answer, truncated=traj.truncated or traj.finish_reason == STOP_ABORTED)
    traj.check()
    return traj
