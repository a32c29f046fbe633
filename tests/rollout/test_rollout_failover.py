"""A step that survives its generators: failover, partial rollout after an abort, rejected requests.

The fast tests drive the real loop, orchestrator and schedulers with a deterministic scripted model
(its next tokens are a function of the context alone, as a greedy LM's are), so a resumed trajectory
can be compared token for token with an uninterrupted one. The slow test kills a real
`python -m rstar_jax.serve` process in the middle of a step.
"""

import asyncio
import os
import signal
import socket
import threading
import time

import pytest
from aiohttp import web

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
from rstar_jax.rollout.loop import LoopConfig, run_trajectory
from rstar_jax.rollout.orchestrator import Orchestrator, trajectory_runner
from rstar_jax.rollout.protocol import (
    Capacity,
    GenerateResult,
    GeneratorUnavailable,
    RequestRejected,
    SamplingParams,
)
from rstar_jax.rollout.tool_env import ToolEnv
from rstar_jax.rollout.records import trajectory_record
from rstar_jax.rollout.scheduler import KvScheduler, RoundRobinScheduler
from rstar_jax.rollout.sglang import SGLangGenerator, SGLangRejected, SGLangUnavailable
from rstar_jax.rollout.stats import record_stats, rollout_stats
from rstar_jax.rollout.trajectory import STOP_ABORTED, STOP_CONTEXT, STOP_NO_TOOL_CALL, STOP_REJECTED
from tests.rollout.test_rollout_loop import FakeExecutor, call, exact_scorer

TOK = ByteTokenizer()
SCRIPT = [f"Let me compute. {call('print(6*7)')}{IM_END}", f"Two more. {call('print(42)')}{IM_END}",
          f"It is 42.</reason><answer>\\boxed{{42}}</answer>{IM_END}"]
CONFIG = LoopConfig(max_turns=5, response_budget=4096, tool_env=ToolEnv.preset_defaults("rich", observation_max_chars=64))


class ScriptModel:
    """A deterministic model: from any context it continues the current turn of SCRIPT (the turn
    index is the number of assistant headers in the context, minus the prompt's). The log-prob of the
    token at response position p is -p / 1000, so it depends on the context only, like the tokens.

    abort_after: (request number, tokens): that request stops early with finish reason "abort" and the
    version then moves on (a weight update). fail_at: request numbers that raise `error`."""

    def __init__(self, name="model", *, abort_after=None, fail_at=(), error=None, version=1):
        self.name, self.abort_after, self.fail_at = name, abort_after, set(fail_at)
        self.error = error or GeneratorUnavailable(f"{name}: connection refused")
        self._version, self.requests, self.contexts = version, 0, []
        self.scheduler, self.requests_while_down = None, 0

    async def generate(self, input_ids, sampling, rid=None):
        self.requests += 1
        self.requests_while_down += int(self.scheduler is not None and self.scheduler.is_down(self))
        self.contexts.append(list(input_ids))
        await asyncio.sleep(0.001)
        if self.requests in self.fail_at:
            raise self.error
        text = TOK.decode(input_ids)
        turn = SCRIPT[text.count("<|im_start|>assistant") - 1]
        done = max(k for k in range(len(turn) + 1) if text.endswith(turn[:k]))  # this turn's tokens so far
        ids = TOK.encode(turn[done:])
        start = len(input_ids) - self.prompt_length
        finish, version = "stop", self._version
        if self.abort_after and self.abort_after[0] == self.requests:
            ids, finish = ids[:self.abort_after[1]], "abort"
            self._version += 1
        ids = ids[:sampling.max_new_tokens]
        return GenerateResult(ids, [-(start + k) / 1000 for k in range(len(ids))], finish, weight_version=version)

    async def capacity(self):
        return Capacity(total_tokens=1 << 20)

    async def abort(self, rid):
        pass

    @property
    def version(self):
        return self._version


def _prompt_length(question):
    return len(ChatTemplate().prompt_ids(TOK, question))


def _trajectory(generator=None, scheduler=None, question="Q", config=CONFIG):
    for model in ([generator] if generator else scheduler.generators):
        model.prompt_length = _prompt_length(question)
    return asyncio.run(run_trajectory(generator, TOK, FakeExecutor(), question, "42", config=config,
                                      scorer=exact_scorer, scheduler=scheduler))


def _reference():
    return _trajectory(ScriptModel())


def _same_tokens(a, b):
    assert a.response_ids == b.response_ids
    assert a.loss_mask == b.loss_mask and a.sampler_logprobs == b.sampler_logprobs
    assert (a.n_turns, a.n_tool_calls, a.reward, a.finish_reason) == (b.n_turns, b.n_tool_calls, b.reward,
                                                                       b.finish_reason)


def test_an_aborted_turn_continues_from_its_partial_output():
    reference = _reference()
    assert reference.finish_reason == STOP_NO_TOOL_CALL and reference.reward == 1.0 and reference.n_turns == 3
    # The second request (turn 2) is aborted after 4 tokens by a weight update: the turn goes on.
    model = ScriptModel(abort_after=(2, 4))
    traj = _trajectory(model)
    _same_tokens(traj, reference)
    assert traj.n_abort_resumes == 1 and model.requests == 4
    sampled_versions = [v for v, m in zip(traj.policy_versions, traj.loss_mask) if m]
    first = len(TOK.encode(SCRIPT[0]))
    assert sampled_versions[:first + 4] == [1] * (first + 4)  # the partial turn keeps the version that sampled it
    assert set(sampled_versions[first + 4:]) == {2} and traj.policy_version == 1
    # Past max_abort_resumes the trajectory ends unscored, as before partial rollout.
    traj = _trajectory(ScriptModel(abort_after=(2, 4)), config=LoopConfig(max_abort_resumes=0))
    assert traj.finish_reason == STOP_ABORTED and traj.reward == 0.0 and traj.n_turns == 2


def test_a_failed_generator_leaves_the_rotation_and_the_trajectory_resumes_elsewhere():
    reference = _reference()
    # A fails on its second request (turn 2, after a tool call); B picks the trajectory up.
    a, b = ScriptModel("a", fail_at={2}), ScriptModel("b")
    scheduler = KvScheduler([a, b])
    traj = _trajectory(scheduler=scheduler)
    _same_tokens(traj, reference)
    assert traj.n_failovers == 1 and scheduler.is_down(a) and not scheduler.is_down(b)
    assert "connection refused" in scheduler.down[0]
    # B continued from the last complete turn: its first context is A's failed one.
    assert b.contexts[0] == a.contexts[1]
    # A turn aborted part-way and then lost with its generator restarts whole on the other one.
    a, b = ScriptModel("a", abort_after=(2, 4), fail_at={3}), ScriptModel("b")
    traj = _trajectory(scheduler=RoundRobinScheduler([a, b]))
    _same_tokens(traj, reference)
    assert (traj.n_failovers, traj.n_abort_resumes) == (1, 1) and b.contexts[0] == a.contexts[1]


def test_a_step_completes_without_the_failed_generator_and_counts_it():
    a, b = ScriptModel("a", fail_at={3, 4, 5}), ScriptModel("b")
    scheduler = KvScheduler([a, b])
    for model in (a, b):
        model.prompt_length, model.scheduler = _prompt_length("Q"), scheduler
    run_one = trajectory_runner(None, TOK, FakeExecutor(), config=CONFIG, scorer=exact_scorer, scheduler=scheduler)
    trajectories = asyncio.run(Orchestrator(run_one, max_concurrency=8).collect([("Q", "42")] * 3, 4))
    assert len(trajectories) == 12 and all(t.reward == 1.0 for t in trajectories)
    assert sorted((t.group_id, t.sample_index) for t in trajectories) == [(g, i) for g in range(3) for i in range(4)]
    stats = rollout_stats(trajectories)
    assert stats["failovers"] >= 1 and stats["failovers"] == sum(t.n_failovers for t in trajectories)
    assert scheduler.live() == [b] and a.requests >= 3 and a.requests_while_down == 0  # none sent after
    records = [trajectory_record(t, TOK.decode) for t in trajectories]
    assert record_stats(records) == stats


def test_a_rejected_request_is_a_truncated_zero_reward_trajectory():
    rejecting = ScriptModel("a", fail_at={2}, error=RequestRejected("a: HTTP 400: 900 tokens exceed the context"))
    scheduler = KvScheduler([rejecting])
    traj = _trajectory(scheduler=scheduler)
    assert traj.finish_reason == STOP_REJECTED and traj.truncated and traj.reward == 0.0
    assert "exceed the context" in traj.extra["error"] and traj.n_turns == 1
    assert not scheduler.is_down(rejecting)  # the server is fine; the request was not
    stats = rollout_stats([traj, _reference()])
    assert stats["rejected"] == 1 and stats["truncation_ratio"] == 0.5


def test_with_every_generator_down_the_step_fails_naming_them():
    a = ScriptModel("a", fail_at={1})
    with pytest.raises(GeneratorUnavailable, match=r"every generator is out of rotation \(a: a: connection refused"):
        _trajectory(scheduler=KvScheduler([a]))
    with pytest.raises(GeneratorUnavailable, match="connection refused"):
        _trajectory(ScriptModel("solo", fail_at={1}))  # no scheduler: nothing to fail over to


def test_a_generator_that_cannot_report_its_capacity_leaves_the_rotation():
    class Unreachable(ScriptModel):
        async def capacity(self):
            raise GeneratorUnavailable("a: /get_server_info: connection refused")

    a, b = Unreachable("a"), ScriptModel("b")
    scheduler = KvScheduler([a, b])
    traj = _trajectory(scheduler=scheduler)
    assert traj.reward == 1.0 and a.requests == 0 and scheduler.is_down(a)

    async def waiting_trajectories_fail_when_the_last_generator_goes():
        solo = ScriptModel("solo")
        kv = KvScheduler([solo], capacities=[100], reservation="worst-case")

        async def turn(tid):
            async with kv.trajectory(tid) as session, session.turn(20, 60):
                await asyncio.sleep(3600)

        running = asyncio.ensure_future(turn("t1"))
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(turn("t2"))
        await asyncio.sleep(0.01)
        assert kv.queued == 1
        kv.mark_down(solo, "killed")
        with pytest.raises(GeneratorUnavailable, match="solo: killed"):
            await waiting
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    asyncio.run(waiting_trajectories_fail_when_the_last_generator_goes())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_client_classifies_failures_as_sglang_reports_them():
    """400 and a validation abort (finish_reason status 400) reject the request; 500, a refused
    connection and a generation past generate_timeout_s make the server unavailable."""

    async def scenario():
        async def generate(request):
            body = await request.json()
            mode = body["input_ids"][0]
            if mode == 1:
                return web.json_response({"error": {"message": "The input (900 tokens) is longer than the "
                                                               "model's context length (512 tokens)."}}, status=400)
            if mode == 2:
                return web.json_response({"error": {"message": "boom"}}, status=500)
            if mode == 3:
                finish = {"type": "abort", "message": "Input length exceeds", "status_code": 400,
                          "err_type": "BadRequestError"}
                return web.json_response({"output_ids": [], "meta_info": {"finish_reason": finish,
                                                                          "output_token_logprobs": []}})
            await asyncio.sleep(1)  # past the client's 0.3 s; the runner's cleanup waits for it
            return web.json_response({})

        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        sampling = SamplingParams(max_new_tokens=4)
        try:
            async with SGLangGenerator(f"http://127.0.0.1:{port}", generate_timeout_s=0.3, retries=0) as gen:
                with pytest.raises(SGLangRejected, match="longer than the model's context length"):
                    await gen.generate([1], sampling)
                with pytest.raises(SGLangUnavailable, match="HTTP 500: boom"):
                    await gen.generate([2], sampling)
                with pytest.raises(SGLangRejected, match="aborted with status 400: Input length exceeds"):
                    await gen.generate([3], sampling)
                with pytest.raises(SGLangUnavailable, match="TimeoutError"):
                    await gen.generate([4], sampling)
        finally:
            await runner.cleanup()
        async with SGLangGenerator(f"http://127.0.0.1:{_free_port()}", retries=1, backoff_s=0.01) as gone:
            with pytest.raises(SGLangUnavailable, match="failed after 2 attempt"):
                await gone.generate([1], sampling)

    asyncio.run(scenario())
    assert issubclass(SGLangRejected, RequestRejected) and issubclass(SGLangUnavailable, GeneratorUnavailable)


@pytest.mark.slow
def test_two_real_servers_one_killed_mid_step(tmp_path):
    """Two `python -m rstar_jax.serve` processes; one is SIGKILLed while it generates. The step
    completes on the other, every trajectory is accounted for, and the failure is counted. A prompt
    longer than the servers' context is a rejected, zero-reward trajectory."""
    from concurrent.futures import ThreadPoolExecutor

    from flax import nnx

    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
    from rstar_jax.engine.local_server import LocalServer
    from rstar_jax.train.weight_sync import DiskSync, DistributedSync

    servers = [LocalServer("tiny", slots=4, max_length=256, max_total_tokens=2048, page_size=16)
               for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda s: s.__enter__(), servers))
    try:
        config = LoopConfig(max_turns=2, response_budget=160, temperature=1.0, seed=0,
                            tool_env=ToolEnv.preset_defaults("rich", observation_max_chars=64))

        async def step():
            generators = [SGLangGenerator(s.url) for s in servers]
            scheduler = KvScheduler(generators)
            run_one = trajectory_runner(None, TOK, FakeExecutor(), config=config, scorer=exact_scorer,
                                        scheduler=scheduler, template=ChatTemplate.bare())
            killed = threading.Event()

            async def kill_when_busy():
                # Once the first server is generating for several trajectories, kill it outright.
                while (await generators[0].capacity()).running_requests < 2:
                    await asyncio.sleep(0.02)
                os.kill(servers[0].process.pid, signal.SIGKILL)
                killed.set()

            killer = asyncio.ensure_future(kill_when_busy())
            prompts = [(f"What is {k} times 7?", "42") for k in range(4)] + [("x" * 300, "42")]
            try:
                trajectories = await Orchestrator(run_one, max_concurrency=16).collect(prompts, 4)
                # The next weight sync goes to the server left, by either method.
                model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(5))
                await DiskSync(generators, tmp_path / "weights", rotation=scheduler).push(model, 1)
                distributed = DistributedSync(generators, rotation=scheduler)
                try:
                    await distributed.push(model, 2)
                finally:
                    await distributed.close()
                versions = [await g.weight_version() for g in generators[1:]]
            finally:
                killer.cancel()
                for g in generators:
                    await g.close()
            return trajectories, scheduler, generators, killed.is_set(), versions

        t0 = time.monotonic()
        trajectories, scheduler, generators, killed, versions = asyncio.run(step())
        assert versions == ["2"]
        assert killed, "the server was never busy enough to be killed mid-step"
        assert sorted((t.group_id, t.sample_index) for t in trajectories) == [(g, i) for g in range(5) for i in range(4)]
        assert scheduler.is_down(generators[0]) and not scheduler.is_down(generators[1])
        stats = rollout_stats(trajectories)
        assert stats["failovers"] >= 1, stats
        long_prompt = [t for t in trajectories if t.group_id == 4]  # longer than any server's context
        assert all(t.finish_reason == STOP_CONTEXT and t.reward == 0.0 and t.truncated for t in long_prompt)
        assert "leaves no room for a new token" in long_prompt[0].extra["error"]
        assert stats["context_truncated"] == 4 and stats["rejected"] == 0
        for t in trajectories:
            t.check()
            if t.finish_reason != STOP_CONTEXT:
                assert t.num_sampled_tokens > 0
        print(f"step with a killed server: {time.monotonic() - t0:.1f}s, {stats['failovers']} failovers")
    finally:
        for s in servers:
            s.__exit__(None, None, None)


def test_a_server_that_fails_its_weight_update_leaves_the_rotation(tmp_path):
    from flax import nnx

    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
    from rstar_jax.train.weight_sync import DiskSync

    class Server:
        def __init__(self, name, failing=False):
            self.name, self.base_url, self.failing, self.ready, self.loaded = name, f"http://{name}", failing, True, []

        async def update_weights_from_disk(self, path, *, abort_all_requests=False, weight_version=None, flush_cache=True):
            if self.failing:
                raise SGLangUnavailable(f"{self.base_url}/update_weights_from_disk: connection refused")
            self.loaded.append(weight_version)

    a, b, c = Server("a"), Server("b", failing=True), Server("c")
    scheduler = RoundRobinScheduler([a, b, c])
    scheduler.mark_down(c, "killed mid-step")
    sync = DiskSync([a, b, c], tmp_path, rotation=scheduler)
    model = Qwen3(Qwen3Config.tiny(num_layers=1), rngs=nnx.Rngs(0))
    asyncio.run(sync.push(model, 1))
    assert a.loaded == [1] and c.loaded == [] and sync.version == 1  # c was out; b failed and left
    assert scheduler.is_down(b) and "connection refused" in scheduler.down[1]
    asyncio.run(sync.push(model, 2))
    assert a.loaded == [1, 2]
    a.failing = True
    with pytest.raises(SGLangUnavailable, match="connection refused"):  # the last one: the push fails
        asyncio.run(sync.push(model, 3))
