"""The routes of `rstar_jax.serve` that report on the server, as SGLang serves them: `/v1/loads`
(`?include=queues` adds the queue section), `/get_load`, `/get_server_info`, `/get_model_info` and
`/metrics` (Prometheus text with SGLang's names, with `enable_metrics`), and the request counters
and latency histograms behind them."""

from __future__ import annotations

import collections
import time
from typing import Any

from aiohttp import web

from rstar_jax import __version__ as package_version
from rstar_jax.engine.http_common import json_response
from rstar_jax.engine.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from rstar_jax.engine.prometheus import Exposition, Histogram

# SGLang's bucket bounds (seconds) for its latency histograms.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)
THROUGHPUT_WINDOW_S = 10.0  # gen_throughput: tokens per second over at least this long


class StatusRoutes:
    """The load, info and metrics routes over an `EngineServer` (its engine and settings), and the
    counters of finished requests that /metrics reports (`record_request`)."""

    def __init__(self, server):
        self.server = server
        engine = server.engine
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_total = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e_latency = Histogram(E2E_BUCKETS)
        engine.on_first_token = self.ttft.observe
        self._throughput_samples = collections.deque([(time.monotonic(), engine.generated_tokens)])

    def routes(self, *, metrics: bool) -> list[tuple[str, str, Any]]:
        """The routes, /metrics only with `metrics`."""
        routes = [
            ("GET", "/get_server_info", self.server_info), ("GET", "/server_info", self.server_info),
            ("GET", "/get_model_info", self.model_info), ("GET", "/model_info", self.model_info),
            ("GET", "/v1/loads", self.loads), ("GET", "/get_load", self.get_load),
        ]
        if metrics:
            routes.append(("GET", "/metrics", self.metrics))
        return routes

    @property
    def engine(self):
        return self.server.engine

    def record_request(self, prompt_tokens: int, result, start: float) -> None:
        """Counts one finished request for /metrics."""
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += len(result.token_ids)
        self.e2e_latency.observe(time.perf_counter() - start)

    async def _load_row(self) -> dict:
        cap = await self.engine.capacity()
        return {
            "dp_rank": 0,
            "num_running_reqs": cap.running_requests,
            "num_waiting_reqs": cap.queued_requests,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": cap.used_tokens,
            "num_total_tokens": cap.total_tokens,
            "max_total_num_tokens": cap.total_tokens,
            "max_running_requests": self.engine.slots,
            "token_usage": cap.used_tokens / cap.total_tokens,
            "gen_throughput": self._throughput(),
            "cache_hit_rate": self.engine.cached_tokens / max(self.engine.prompt_tokens, 1),
            "utilization": cap.running_requests / self.engine.slots,
            "queues": {"waiting": cap.queued_requests - cap.retracted_requests, "grammar": 0,
                       "paused": cap.running_requests if self.engine.paused else 0,
                       "retracted": cap.retracted_requests},
        }

    def _throughput(self) -> float:
        """Tokens per second over the last THROUGHPUT_WINDOW_S or more (since the previous query
        when queries are further apart), as SGLang's gen_throughput covers its last log interval."""
        now, total = time.monotonic(), self.engine.generated_tokens
        samples = self._throughput_samples
        if now - samples[-1][0] >= 0.5:  # a bounded history however often this is asked
            samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= THROUGHPUT_WINDOW_S:
            samples.popleft()
        then, before = samples[0]
        return (total - before) / (now - then) if now > then else 0.0

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text with SGLang's metric names, labelled with the served model name."""
        row = await self._load_row()
        e = Exposition({"model_name": self.server.served_model_name})
        e.gauge("sglang:num_running_reqs", row["num_running_reqs"], "The number of running requests.")
        e.gauge("sglang:num_queue_reqs", row["num_waiting_reqs"], "The number of requests in the waiting queue.")
        e.gauge("sglang:num_used_tokens", row["num_used_tokens"], "The number of used tokens.")
        e.gauge("sglang:max_total_num_tokens", row["max_total_num_tokens"], "The KV cache pool size in tokens.")
        e.gauge("sglang:token_usage", row["token_usage"], "The token usage.")
        e.gauge("sglang:cache_hit_rate", row["cache_hit_rate"], "The prefix cache hit rate.")
        e.gauge("sglang:gen_throughput", row["gen_throughput"], "The generation throughput (token/s).")
        e.counter("sglang:prompt_tokens_total", self.prompt_tokens_total, "Number of prefill tokens processed.")
        e.counter("sglang:generation_tokens_total", self.generation_tokens_total,
                  "Number of generation tokens processed.")
        e.counter("sglang:num_requests_total", self.requests_total, "Number of requests processed.")
        e.histogram("sglang:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds.")
        e.histogram("sglang:e2e_request_latency_seconds", self.e2e_latency,
                    "Histogram of End-to-end request latency in seconds")
        return web.Response(body=e.text().encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def loads(self, request: web.Request) -> web.Response:
        row = await self._load_row()
        include = set(request.query.get("include", "core").split(","))
        if not include & {"queues", "all"}:
            row.pop("queues")
        return json_response({"loads": [row]})

    async def get_load(self, request: web.Request) -> web.Response:
        row = await self._load_row()
        return json_response([{"dp_rank": 0, "num_reqs": row["num_running_reqs"],
                                   "num_waiting_reqs": row["num_waiting_reqs"], "num_tokens": row["num_used_tokens"]}])

    async def server_info(self, request: web.Request) -> web.Response:
        s = self.server
        total = self.engine.max_total_tokens
        row = await self._load_row()
        return json_response({
            **s.server_args,
            "model_path": s.model_path,
            "tokenizer_path": s.tokenizer_path,
            "served_model_name": s.served_model_name,
            "enable_deterministic_inference": s.deterministic,
            "enable_metrics": s.enable_metrics,
            "context_length": self.engine.max_length,
            "max_running_requests": self.engine.slots,
            "max_total_num_tokens": total,
            "max_req_input_len": self.engine.max_length,  # SGLang's meaning: inputs shorter than this
            "vocab_size": self.engine.vocab_size,  # rstar_jax: SGLang's clients cannot learn it otherwise
            "page_size": self.engine.page_size,
            "tp_size": s.tp_size,
            "dp_size": 1,
            "weight_update_ranks": 1,  # rstar_jax: ranks it joins a weight-update group with (SGLang: tp_size)
            "skip_tokenizer_init": s.tokenizer is None,
            "weight_version": s.weight_version,
            "internal_states": [{
                "last_gen_throughput": row["gen_throughput"],
                "memory_usage": {"token_capacity": total},
                "effective_max_running_requests_per_dp": self.engine.slots,
                "load": row["num_running_reqs"] + row["num_waiting_reqs"],
            }],
            "version": f"rstar_jax-{package_version}",
        })

    async def model_info(self, request: web.Request) -> web.Response:
        s = self.server
        return json_response({"model_path": s.model_path, "tokenizer_path": s.tokenizer_path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": s.weight_version})
