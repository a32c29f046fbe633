"""SGLangGenerator against stand-ins for two SGLang 0.5.x server generations.

"late-2025": the route set of sgl-project/sglang `http_server.py` @0025436e: no `/v1/loads`;
`/get_load` returns a bare JSON list of `GetLoadReqOutput` (`dp_rank, num_reqs, num_waiting_reqs,
num_tokens`, plus the `BaseReq` fields `rid`/`http_worker_ipc` as null); `/pause_generation` and
`/continue_generation` read no body (a body is ignored, always abort); `/get_server_info` is ServerArgs
+ scheduler info (`max_total_num_tokens` of one DP rank) + `internal_states`, with no
`enable_deterministic_inference` field; `/health_generate` answers 503 while starting.
"2026": `/v1/loads` (PR #16976) with one core snapshot per DP rank in a `{"loads": [...]}` envelope,
`/pause_generation` taking `{"mode": ...}` (PR #10071).
All servers listen on 127.0.0.1 only.
"""

import asyncio
import json
import logging
import time

import pytest
from aiohttp import web

from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer
from rstar_jax.rollout import sglang as sglang_module
from rstar_jax.rollout.loop import LoopConfig, run_trajectory
from rstar_jax.rollout.protocol import RequestRejected, SamplingParams
from rstar_jax.rollout.scheduler import KvScheduler
from rstar_jax.rollout.sglang import SGLangError, SGLangGenerator

TOK = ByteTokenizer()
ANSWER = TOK.encode("The answer is \\boxed{42}" + IM_END)
PAUSE_MODES = ("abort", "retract", "in_place")


class StandIn:
    """One stand-in server; `version` is "late-2025" or "2026"."""

    def __init__(self, version, *, dp=2, rank_tokens=2048, starting_probes=0, deterministic=None,
                 pause_rejects_body=False):
        self.version, self.dp, self.rank_tokens = version, dp, rank_tokens
        self.starting_probes = starting_probes  # /health_generate answers 503 this many times
        self.deterministic = deterministic  # None: the field is absent (late 2025)
        self.pause_rejects_body = pause_rejects_body
        self.calls = []  # (route, body)
        self.ready_at = None
        self.in_flight = [0] * dp  # tokens held per rank by running requests
        self.peak_total = 0
        self.paused = False
        self.weight_version = "0"
        self.next_rank = 0
        self.url = None
        self.runner = None

    def routes(self):
        """(method, path, handler) of every route this server version has."""
        routes = [("GET", "/health_generate", self.health_generate), ("GET", "/get_server_info", self.server_info),
                  ("GET", "/get_load", self.get_load), ("POST", "/generate", self.generate),
                  ("POST", "/pause_generation", self.pause), ("POST", "/continue_generation", self.resume),
                  ("POST", "/update_weights_from_disk", self.update_weights),
                  ("GET", "/get_weight_version", self.get_weight_version)]
        if self.version == "2026":
            routes.append(("GET", "/v1/loads", self.v1_loads))
        return routes

    def app(self):
        app = web.Application()
        for method, path, handler in self.routes():
            app.router.add_route(method, path, handler)
        return app

    async def start(self):
        self.runner = web.AppRunner(self.app())
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self):
        await self.runner.cleanup()

    async def health_generate(self, request):
        self.calls.append(("/health_generate", None))
        if self.starting_probes > 0:
            self.starting_probes -= 1
            return web.Response(status=503)
        if self.ready_at is None:
            self.ready_at = time.monotonic()
        return web.Response(status=200)

    async def server_info(self, request):
        self.calls.append(("/get_server_info", None))
        info = {"model_path": "m", "tp_size": 1, "dp_size": self.dp, "page_size": 1, "context_length": 4096,
                "max_total_num_tokens": self.rank_tokens, "max_req_input_len": 4095,
                "internal_states": [{"memory_usage": {"token_capacity": self.rank_tokens}}
                                    for _ in range(self.dp)],
                "version": "0.5.4" if self.version == "late-2025" else "0.5.9"}
        if self.deterministic is not None:
            info["enable_deterministic_inference"] = self.deterministic
        return web.json_response(info)

    async def get_load(self, request):
        self.calls.append(("/get_load", None))
        return web.json_response([{"rid": None, "http_worker_ipc": None, "dp_rank": i, "num_reqs": int(used > 0),
                                   "num_waiting_reqs": 0, "num_tokens": used} for i, used in enumerate(self.in_flight)])

    async def v1_loads(self, request):
        self.calls.append(("/v1/loads", request.query.get("include")))
        return web.json_response({"loads": [
            {"dp_rank": i, "num_running_reqs": int(used > 0), "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0,
             "num_used_tokens": used, "num_total_tokens": self.rank_tokens, "max_total_num_tokens": self.rank_tokens,
             "max_running_requests": 64, "token_usage": used / self.rank_tokens, "gen_throughput": 0.0,
             "cache_hit_rate": 0.0, "utilization": 0.0} for i, used in enumerate(self.in_flight)]})

    async def generate(self, request):
        body = await request.json()
        self.calls.append(("/generate", body))
        rank = self.next_rank % self.dp
        self.next_rank += 1
        ids = ANSWER[:body["sampling_params"]["max_new_tokens"]]
        held = len(body["input_ids"]) + len(ids)
        self.in_flight[rank] += held
        self.peak_total = max(self.peak_total, sum(self.in_flight))
        await asyncio.sleep(0.01)
        self.in_flight[rank] -= held
        finish = {"type": "stop", "matched": ids[-1]} if ids == ANSWER else {"type": "length", "length": len(ids)}
        return web.json_response({"output_ids": ids, "meta_info": {
            "id": body["rid"], "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": self.weight_version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}})

    async def pause(self, request):
        text = await request.text()
        # The body as the standard library writes it (the client's orjson leaves out the spaces); "" for none.
        self.calls.append(("/pause_generation", json.dumps(json.loads(text)) if text else text))
        if self.version == "late-2025":
            if text and self.pause_rejects_body:
                return web.json_response({"detail": [{"msg": "Extra inputs are not permitted"}]}, status=422)
            self.paused = "abort"  # the handler reads no body: always abort
        else:
            mode = (await request.json()).get("mode", "abort") if text else "abort"
            if mode not in PAUSE_MODES:
                return web.json_response({"error": {"message": f"bad mode {mode}"}}, status=400)
            self.paused = mode
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request):
        self.calls.append(("/continue_generation", None))
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights(self, request):
        body = await request.json()
        self.calls.append(("/update_weights_from_disk", body))
        if self.ready_at is None:  # a real server still loading refuses the connection
            return web.Response(status=503)
        self.weight_version = body.get("weight_version", self.weight_version)
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def get_weight_version(self, request):
        return web.json_response({"weight_version": self.weight_version})


def run_with(servers, body):
    """Starts the stand-ins, runs `body(*servers)` and stops them."""
    async def main():
        for s in servers:
            await s.start()
        try:
            return await body(*servers)
        finally:
            for s in servers:
                await s.stop()
    return asyncio.run(main())


@pytest.fixture
def late_2025():
    return StandIn("late-2025")


@pytest.fixture
def v2026():
    return StandIn("2026", deterministic=True)


def routes(server):
    return [route for route, _ in server.calls]


def test_capacity_sums_every_dp_rank(late_2025, v2026):
    async def body(old, new):
        async with SGLangGenerator(old.url) as a, SGLangGenerator(new.url) as b:
            old.in_flight[:] = [100, 50]
            new.in_flight[:] = [10, 20]
            first = await a.capacity(), await b.capacity()
            second = await a.capacity(), await b.capacity()
            return first, second

    (old_cap, new_cap), again = run_with([late_2025, v2026], body)
    assert (old_cap.total_tokens, old_cap.used_tokens, old_cap.ranks, old_cap.running_requests) == (4096, 150, 2, 2)
    assert (new_cap.total_tokens, new_cap.used_tokens, new_cap.ranks) == (4096, 30, 2)
    assert again == (old_cap, new_cap)
    # Detected once: the late-2025 server got one /v1/loads probe (404), then only /get_load.
    assert routes(late_2025).count("/get_load") == 2 and "/v1/loads" not in routes(late_2025)
    assert routes(v2026).count("/v1/loads") == 2 and "/get_load" not in routes(v2026)
    assert routes(late_2025).count("/get_server_info") == 1


def test_capacity_without_any_load_route_uses_server_info():
    class InfoOnly(StandIn):
        def routes(self):
            return [("GET", "/get_server_info", self.server_info)]

    async def body(server):
        async with SGLangGenerator(server.url) as gen:
            return await gen.capacity(), await gen.loads()

    capacity, loads = run_with([InfoOnly("late-2025", dp=4, rank_tokens=1000)], body)
    assert (capacity.total_tokens, capacity.used_tokens, capacity.ranks) == (4000, 0, 4) and loads == []


def test_kv_scheduled_trajectories_on_both_versions():
    class Executor:
        async def execute(self, code, stdin="", **kw):
            raise AssertionError("no tool calls expected")

    async def scorer(text, gold, truncated=False):
        return float("\\boxed{42}" in text)

    async def body(old, new):
        async with SGLangGenerator(old.url) as a, SGLangGenerator(new.url) as b:
            scheduler = KvScheduler([a, b], budget_fraction=0.9, reservation="worst-case")
            cfg = LoopConfig(max_turns=2, response_budget=600)
            trajs = await asyncio.gather(*(run_trajectory(None, TOK, Executor(), f"Q{i}", "42", config=cfg,
                                                          scorer=scorer, scheduler=scheduler, group_id=i)
                                           for i in range(12)))
            # A request lives in one rank's pool: a 4096-token context fits 8192 tokens but no rank's 4096.
            with pytest.raises(RequestRejected, match=r"a context of 4096 tokens does not fit any generator in "
                                                      r"rotation \(the largest pool of one DP rank holds 4096\)"):
                async with scheduler.trajectory("too-big-for-a-rank") as session, session.turn(4096, 10):
                    pass
            return trajs, scheduler

    old, new = StandIn("late-2025", rank_tokens=4096), StandIn("2026", rank_tokens=4096)
    trajs, scheduler = run_with([old, new], body)
    assert all(t.reward == 1.0 for t in trajs) and len(trajs) == 12
    # 4096 per rank x 2 ranks: a budget of 0.9 x 8192 holds two worst-case turns of ~2.5k tokens per server.
    assert [(ledger.capacity, ledger.ranks) for ledger in scheduler.ledgers] == [(8192, 2), (8192, 2)]
    assert all(ledger.peak_reserved <= scheduler.budget(i) for i, ledger in enumerate(scheduler.ledgers))
    assert sum(scheduler.admitted_per_generator()) == 12 and min(scheduler.admitted_per_generator()) > 0
    assert scheduler.max_queue > 0  # admission control actually held some back


def test_pause_on_each_version(late_2025, v2026):
    async def body(old, new):
        async with SGLangGenerator(old.url) as a, SGLangGenerator(new.url) as b:
            await a.pause("abort")
            await a.resume()
            with pytest.raises(SGLangError, match=r"does not support pause mode 'retract'"):
                await a.pause("retract")
            await b.pause("retract")
            retract = new.paused
            await b.resume()
            await b.pause("abort")
            return retract

    retract = run_with([late_2025, v2026], body)
    pauses_old = [b for r, b in late_2025.calls if r == "/pause_generation"]
    assert pauses_old == ['{"mode": "abort"}']  # accepted (and ignored) by the late-2025 handler
    assert retract == "retract" and v2026.paused == "abort"


def test_pause_retries_without_a_body_when_the_server_refuses_one():
    server = StandIn("late-2025", pause_rejects_body=True)

    async def body(s):
        async with SGLangGenerator(s.url) as gen:
            await gen.pause("abort")
            await gen.pause("abort")  # remembered: no body, no second refusal
            with pytest.raises(SGLangError, match=r"/pause_generation.*does not support pause mode 'in_place'"):
                await gen.pause("in_place")

    run_with([server], body)
    assert [b for r, b in server.calls if r == "/pause_generation"] == ['{"mode": "abort"}', "", ""]


@pytest.mark.parametrize("version", ["late-2025", "2026"])
def test_first_weight_sync_waits_until_the_server_is_ready(version, tmp_path, monkeypatch):
    from rstar_jax.train import weight_sync

    monkeypatch.setattr(weight_sync, "save_pretrained", lambda model, directory, **export: directory)
    server = StandIn(version, starting_probes=2)

    async def body(s):
        async with SGLangGenerator(s.url, backoff_s=0.01) as gen:
            wait_ready = gen.wait_ready
            gen.wait_ready = lambda timeout_s: wait_ready(timeout_s, interval_s=0.01)  # fast polling here
            sync = weight_sync.DiskSync([gen], tmp_path, mode="pause", ready_timeout_s=10)
            await sync.push(None, 3)
            await sync.push(None, 4)  # already seen ready: no further probe
            return gen.version

    assert run_with([server], body) == 4
    seen = routes(server)
    first_update = seen.index("/update_weights_from_disk")
    assert seen[:first_update].count("/health_generate") == 3 and seen.count("/health_generate") == 3
    assert seen.count("/update_weights_from_disk") == 2 and seen.count("/continue_generation") == 2


def test_readiness_wait_times_out_clearly():
    server = StandIn("2026", starting_probes=10 ** 6)

    async def body(s):
        async with SGLangGenerator(s.url) as gen:
            t0 = time.monotonic()
            with pytest.raises(SGLangError) as info:
                await gen.wait_ready(timeout_s=0.3, interval_s=0.02, max_interval_s=0.05)
            return info.value, time.monotonic() - t0, gen.ready

    error, waited, ready = run_with([server], body)
    assert f"{server.url}/health_generate: server not ready after waiting" in str(error)
    assert "timeout 0.3 s" in str(error) and "HTTP 503" in str(error)
    assert 0.3 <= waited < 2.0 and not ready


def test_seeded_sampling_warns_once_when_determinism_is_off(caplog):
    old = StandIn("late-2025")  # no enable_deterministic_inference field: off
    off = StandIn("2026", deterministic=False)
    on = StandIn("2026", deterministic=True)
    seeded = SamplingParams(max_new_tokens=4, seed=7)

    async def body(*servers):
        for s in servers:
            async with SGLangGenerator(s.url) as gen:
                for _ in range(3):
                    await gen.generate([1, 2], seeded)
        async with SGLangGenerator(servers[0].url) as gen:  # a second client for the same server
            await gen.generate([1, 2], seeded)
            await gen.generate([1, 2], SamplingParams(max_new_tokens=4))

    sglang_module._warned_nondeterministic.clear()
    with caplog.at_level(logging.WARNING, logger="rstar_jax.rollout.sglang"):
        run_with([old, off, on], body)
    warnings = [r.getMessage() for r in caplog.records if "enable_deterministic_inference" in r.getMessage()]
    assert len(warnings) == 2
    assert warnings[0].startswith(old.url) and warnings[1].startswith(off.url)
    assert all(body["sampling_params"]["sampling_seed"] == 7 for r, body in on.calls if r == "/generate")


class StandIn0523(StandIn):
    """SGLang 0.5.23 as it answered this client: no `/get_weight_version` (404); the version an update
    sets is in `/model_info`; `/get_server_info` reports `context_length` and `max_req_input_len`
    (min(context, KV pool) - 6) but no vocabulary size; `/generate` answers 400 when input +
    max_new_tokens exceeds the context length; an input id at or past the vocabulary kills the server
    (the embedding's IndexError takes the process tree down)."""

    def __init__(self, *, context_length=4096, vocab_size=400, model_path="m", **kwargs):
        super().__init__("2026", dp=1, deterministic=False, **kwargs)
        self.context_length, self.vocab_size, self.model_path = context_length, vocab_size, model_path
        self.dead = False

    def routes(self):
        return [("GET", "/health_generate", self.health_generate), ("GET", "/get_server_info", self.server_info),
                ("GET", "/model_info", self.model_info), ("GET", "/v1/loads", self.v1_loads),
                ("POST", "/generate", self.generate), ("POST", "/update_weights_from_disk", self.update_weights)]

    async def server_info(self, request):
        self.calls.append(("/get_server_info", None))
        return web.json_response({
            "model_path": self.model_path, "tp_size": 1, "dp_size": 1, "page_size": 1,
            "context_length": self.context_length, "max_total_num_tokens": self.rank_tokens,
            "max_req_input_len": min(self.context_length, self.rank_tokens) - 6, "weight_version": "default",
            "enable_deterministic_inference": False, "version": "0.5.23"})

    async def model_info(self, request):
        self.calls.append(("/model_info", None))
        return web.json_response({"model_path": self.model_path, "is_generation": True,
                                  "weight_version": self.weight_version})

    async def generate(self, request):
        body = await request.json()
        self.calls.append(("/generate", body))
        if self.dead or any(t >= self.vocab_size for t in body["input_ids"]):
            self.dead = True
            raise ConnectionResetError("IndexError in the embedding: the server is down")
        total = len(body["input_ids"]) + body["sampling_params"]["max_new_tokens"]
        if total > self.context_length:
            return web.json_response({"error": {"message": (
                f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {total} tokens")}}, status=400)
        ids = ANSWER[:min(body["sampling_params"]["max_new_tokens"], self.context_length - len(body["input_ids"]) - 2)]
        finish = {"type": "stop", "matched": ids[-1]} if ids == ANSWER else {"type": "length", "length": len(ids)}
        return web.json_response({"output_ids": ids, "meta_info": {
            "id": body["rid"], "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": self.weight_version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}})


def test_weight_version_and_disk_update_on_0_5_23():
    """The version is read where 0.5.23 has it, and a successful load never ends in an exception."""
    server = StandIn0523()

    async def body(s):
        async with SGLangGenerator(s.url) as gen:
            before = await gen.weight_version()
            s.ready_at = time.monotonic()
            await gen.update_weights_from_disk("/ckpt/step_7", weight_version=7)
            with_version = (await gen.weight_version(), gen.version)
            s.weight_version = "9"  # another client's update (or the server's own default)
            await gen.update_weights_from_disk("/ckpt/step_9")  # no version given: read back
            return before, with_version, gen.version

    before, with_version, after = run_with([server], body)
    assert before == "0" and with_version == ("7", 7) and after == 9
    assert "/get_weight_version" not in routes(server)


def test_requests_are_capped_at_the_servers_context_length(caplog):
    """A response budget past the server's context length: the request asks for what fits, so the
    trajectory generates (it was an HTTP 400 and an empty, zero-reward trajectory before). One that
    reaches the context length ends truncated as "context_length" and is counted; a context with no
    room left is never sent."""
    from rstar_jax.rollout.stats import rollout_stats
    from rstar_jax.rollout.trajectory import STOP_CONTEXT, STOP_NO_TOOL_CALL

    class Executor:
        async def execute(self, code, stdin="", **kw):
            raise AssertionError("no tool calls expected")

    async def scorer(text, gold, truncated=False):
        return 0.0 if truncated else float("\\boxed{42}" in text)

    prompt_length = len(ChatTemplate(tool_name=LoopConfig().tool_name).prompt_ids(TOK, "Q"))
    roomy = StandIn0523(context_length=prompt_length + len(ANSWER) + 50)  # fits the answer, not the budget
    tight = StandIn0523(context_length=prompt_length + 12)  # cuts the answer short
    full = StandIn0523(context_length=prompt_length)  # no room for a single token

    async def body(*servers):
        trajectories = []
        for s in servers:
            async with SGLangGenerator(s.url) as gen:
                scheduler = KvScheduler([gen])
                cfg = LoopConfig(max_turns=2, response_budget=300)
                trajectories.append(await asyncio.gather(*(
                    run_trajectory(None, TOK, Executor(), "Q", "42", config=cfg, scorer=scorer, scheduler=scheduler,
                                   group_id=i) for i in range(4))))
        return trajectories

    roomy_trajs, tight_trajs, full_trajs = run_with([roomy, tight, full], body)
    assert all(t.finish_reason == STOP_NO_TOOL_CALL and t.reward == 1.0 for t in roomy_trajs)
    asked = [b["sampling_params"]["max_new_tokens"] for r, b in roomy.calls if r == "/generate"]
    assert asked == [len(ANSWER) + 50] * 4
    assert all(t.finish_reason == STOP_CONTEXT and t.truncated and 0 < len(t.response_ids) <= 12 for t in tight_trajs)
    assert all(t.finish_reason == STOP_CONTEXT and t.truncated and not t.response_ids for t in full_trajs)
    assert "/generate" not in routes(full)
    stats = rollout_stats([*roomy_trajs, *tight_trajs, *full_trajs])
    assert stats["context_truncated"] == 8 and stats["rejected"] == 0


def test_out_of_vocabulary_ids_never_reach_the_server(tmp_path):
    """An id a real server's embedding cannot look up would take the server down: the client refuses
    it with the position and the vocabulary, whether it was told the size or read the served model's
    config.json."""
    (tmp_path / "config.json").write_text('{"vocab_size": 400}')
    told, read = StandIn0523(vocab_size=400), StandIn0523(vocab_size=400, model_path=str(tmp_path))

    async def body(a, b):
        errors = []
        async with SGLangGenerator(a.url, vocab_size=400) as gen, SGLangGenerator(b.url) as gen_b:
            for g in (gen, gen_b):
                with pytest.raises(ValueError) as info:
                    await g.generate([1, 2, 400, 3], SamplingParams(max_new_tokens=4))
                errors.append(str(info.value))
                assert (await g.generate([1, 2, 399], SamplingParams(max_new_tokens=4))).token_ids
        return errors

    errors = run_with([told, read], body)
    assert all("input_ids[2] = 400 is outside the model's vocabulary [0, 400)" in e for e in errors)
    assert not told.dead and not read.dead


def test_an_sglang_router_is_refused_as_a_generator_with_what_to_do():
    """sglang-router's /get_server_info describes the router, and it answers 404 to pause, weight
    updates and loads: a router URL among the generators gets an error that says to list its workers."""
    class Router(StandIn):
        def routes(self):
            return [("GET", "/get_server_info", self.router_info)]

        async def router_info(self, request):
            return web.json_response({"router_manager": True, "routers_count": 1, "workers_count": 2})

    async def body(router):
        async with SGLangGenerator(router.url) as gen:
            with pytest.raises(SGLangError, match="is an sglang-router, not a server: list its workers"):
                await gen.capacity()

    run_with([Router("2026")], body)


class HeldGeneration(StandIn):
    """A 2026 stand-in whose generations answer only once `release` is set, with the weight version
    of that moment; with `spans`, also SGLang 0.5.23's `meta_info.weight_versions` for a request an
    update crossed (its first two tokens under the version it started with)."""

    def __init__(self, spans: bool):
        super().__init__("2026", deterministic=True)
        self.spans = spans
        self.started = self.release = None  # asyncio events, made on the test's loop

    async def generate(self, request):
        body = await request.json()
        self.calls.append(("/generate", body))
        started_under = self.weight_version
        self.started.set()
        await self.release.wait()
        ids = ANSWER[:body["sampling_params"]["max_new_tokens"]]
        meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": len(ids)},
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids), "cached_tokens": 0,
                "weight_version": self.weight_version, "output_token_logprobs": [[-0.5, t, None] for t in ids]}
        if self.spans and started_under != self.weight_version:
            meta["weight_versions"] = [{"version": started_under, "start": 0, "end": 2},
                                       {"version": self.weight_version, "start": 2, "end": len(ids)}]
        return web.json_response({"output_ids": ids, "meta_info": meta})


@pytest.mark.parametrize("spans", [True, False], ids=["per-token spans", "no spans"])
def test_an_in_place_push_under_a_running_request_labels_every_token_no_newer_than_its_sampler(
        spans, tmp_path, monkeypatch):
    """weight_sync.mode "in_place": the server is paused in place, updated without a cache flush (SGLang
    refuses one while requests are frozen) and continued; the running request comes back whole and
    its tokens carry SGLang's per-token versions, or, from a server without them, the version it
    was sent under: staleness overstated, never understated."""
    from rstar_jax.train import weight_sync

    monkeypatch.setattr(weight_sync, "save_pretrained", lambda model, directory, **export: directory)
    server = HeldGeneration(spans)

    async def body(s):
        s.started, s.release = asyncio.Event(), asyncio.Event()
        async with SGLangGenerator(s.url) as gen:
            sync = weight_sync.DiskSync([gen], tmp_path, mode="in_place", ready_timeout_s=10)
            await sync.push(None, 3)
            running = asyncio.ensure_future(gen.generate([1, 2], SamplingParams(max_new_tokens=6)))
            await s.started.wait()
            await sync.push(None, 4)
            s.release.set()
            return await running

    result = run_with([server], body)
    assert result.finish_reason == "length" and len(result.token_ids) == 6 and result.weight_version == 4
    assert result.token_versions == ((3, 3, 4, 4, 4, 4) if spans else (3,) * 6)
    assert [b for r, b in server.calls if r == "/pause_generation"] == ['{"mode": "in_place"}'] * 2
    assert [b["flush_cache"] for r, b in server.calls if r == "/update_weights_from_disk"] == [False, False]
    assert routes(server).count("/continue_generation") == 2


@pytest.mark.parametrize("spans, problem", [
    ([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 6}], "does not continue at token 2"),
    ([{"version": "3", "start": 0, "end": 4}], "covers 4 tokens, output_ids has 6"),
    ([{"version": "3", "start": 0}], "malformed"),
])
def test_malformed_weight_version_spans_are_refused_by_name(spans, problem):
    ids = ANSWER[:6]
    body = {"output_ids": ids, "meta_info": {
        "finish_reason": {"type": "length", "length": 6}, "weight_version": "4", "weight_versions": spans,
        "output_token_logprobs": [[-0.5, t, None] for t in ids]}}
    with pytest.raises(SGLangError, match=rf"meta_info\.weight_versions.*{problem}|{problem}"):
        sglang_module.parse_generate_response(body, url="http://127.0.0.1:1")
    body["meta_info"]["weight_versions"] = [{"version": "default", "start": 0, "end": 2},
                                            {"version": "4", "start": 2, "end": 6}]
    assert sglang_module.parse_generate_response(body).token_versions == (0, 0, 4, 4, 4, 4)
