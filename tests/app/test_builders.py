"""The composition root: the config's sandbox limits, verifier timeout and mesh reach the objects the
run uses (a real sandbox server on loopback)."""

import asyncio
import contextlib
import http.server
import threading
import time

import pytest

from rstar_jax.app import builders
from rstar_jax.config import REPO_CONFIGS, ConfigError, load_config_file
from rstar_jax.config import resolve

ALLOCATE = "x = bytearray(192 << 20)\nprint(len(x))"


@contextlib.contextmanager
def health_server(unhealthy_calls: int = 0):
    """A loopback HTTP server whose /health_generate answers 503 (a server still loading) for the
    first `unhealthy_calls` calls, then 200; yields (url, calls so far)."""
    calls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            calls.append(self.path)
            self.send_response(503 if self.path == "/health_generate" and len(calls) <= unhealthy_calls else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", calls
    finally:
        server.shutdown()
        server.server_close()


def _config(**overrides):
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    config.update_from_flattened_dict(overrides)
    return config


@pytest.mark.slow
def test_sandbox_limits_and_the_verifier_timeout_reach_every_tool_call():
    """sandbox.memory_mb bounds each call the rollout loop makes (the tool environment travels with
    every call); sandbox.verify_timeout_s is the scorer's, whichever verifier scores."""

    async def call(config, resources, code):  # as rollout.loop calls it
        options = resolve.loop_config(config).tool_env.sandbox_options()
        return await resources.client.execute(code, **options)

    async def run(config, targets):
        async with builders.rollout_resources(config, targets, urls=[url]) as resources:
            result = await call(config, resources, ALLOCATE)
            return result.status, resources.scorer.timeout_s

    tight = _config(**{"sandbox.memory_mb": 64, "sandbox.verify_timeout_s": 3.5})
    with builders.sandbox(tight) as targets, health_server() as (url, _):
        assert asyncio.run(run(tight, targets)) == ("memory_limit", 3.5)
        roomy = _config(**{"sandbox.memory_mb": 512, "sandbox.verify_via": "sandbox", "sandbox.verify_timeout_s": 7.0})
        assert asyncio.run(run(roomy, targets)) == ("ok", 7.0)

        async def flood(config):
            async with builders.rollout_resources(config, targets, urls=[url]) as resources:
                return (await call(config, resources, "print('x' * 5000)")).stdout

        # The tool environment's per-call options: the release preset's stream cut, the project's own
        # byte cap (far above this output).
        assert asyncio.run(flood(_config(**{"sandbox.preset": "release"}))) == "x" * 1000
        assert asyncio.run(flood(roomy)) == "x" * 5000 + "\n"


@pytest.mark.slow
def test_sandbox_inject_timeout_rate_reaches_the_local_sandbox():
    """sandbox.inject_timeout_rate (noisy-environment experiments) is the local server's flag: its
    share of the rollout loop's calls come back as timeouts, not run."""
    async def statuses(config, targets):
        async with builders.rollout_resources(config, targets, urls=[url]) as resources:
            options = resolve.loop_config(config).tool_env.sandbox_options()
            return [(await resources.client.execute("print(1)", **options)) for _ in range(30)]

    noisy = _config(**{"sandbox.inject_timeout_rate": 0.5})
    with builders.sandbox(noisy) as targets, health_server() as (url, _):
        results = asyncio.run(statuses(noisy, targets))
    timeouts = [r for r in results if r.status == "timeout"]
    assert 3 <= len(timeouts) <= 27 and all("injected" in r.message for r in timeouts)
    assert all(r.stdout == "1\n" for r in results if r.status != "timeout")


def test_the_policy_and_its_settings_follow_the_mesh():
    config = _config(**{"mesh.fsdp": 4, "mesh.data": 2, "rl.micro_batch_tokens": 1000})
    model, mesh = builders.build_policy(config)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1} and builders.data_parallel(mesh) == 8
    assert model.q_proj[...].sharding.mesh == mesh
    one, eight = resolve.rl_settings(config), resolve.rl_settings(config, builders.data_parallel(mesh))
    assert eight.batch.rows == 8 * one.batch.rows  # rl.micro_batch_tokens is per data-parallel shard
    # The micro-batch count is what RoC can keep at most (4 prompts x 4 kept), whatever a step kept.
    assert one.batch.num_micro_batches == 16 and eight.batch.num_micro_batches == 2
    assert one.loop.temperature == config.rollout.temperature and one.roc.group_size == config.rl.group_size
    with pytest.raises(ConfigError, match=r"config\.mesh: data\*fsdp\*tensor = 8 but 16 devices are available"):
        builders.check_mesh(config, 16)


@pytest.mark.slow
def test_the_first_step_waits_for_servers_that_are_still_loading(tmp_path):
    """Before the first weight sync, every generator must answer /health_generate and every sandbox
    Info: a generator that answers 503 twice and a sandbox that starts a second late are waited for;
    an endpoint that never answers ends the wait with an error naming it and the field."""
    import socket

    from sandbox_service.launcher import LocalSandbox

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        sandbox_port = s.getsockname()[1]
    config = _config(**{"rollout.ready_timeout_s": 60.0})

    async def ready(urls, targets) -> float:
        t0 = time.monotonic()
        async with builders.rollout_resources(config, targets, urls=urls):
            return time.monotonic() - t0

    late = LocalSandbox(workers=1, port=sandbox_port)
    starter = threading.Timer(1.0, late.__enter__)
    with health_server(unhealthy_calls=2) as (url, calls):
        starter.start()
        try:
            waited = asyncio.run(ready([url], [f"127.0.0.1:{sandbox_port}"]))
        finally:
            starter.join()
            late.__exit__(None, None, None)
        assert calls.count("/health_generate") >= 3 and waited >= 1.0

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        config.rollout.ready_timeout_s = 2.0
        with LocalSandbox(workers=1) as sandbox, pytest.raises(ConfigError) as error:
            asyncio.run(ready([url, dead], [sandbox.target]))
        assert str(error.value) == (f"config.rollout.ready_timeout_s: not ready after 2 s: {dead} "
                                    "(generators must answer /health_generate, sandboxes Info)")


def test_process_shares_cover_every_item_once_in_order():
    from rstar_jax.parallel.multihost import share

    for n in (0, 1, 5, 8, 13):
        for count in (1, 2, 3, 8):
            parts = [list(range(n))[share(n, i, count)] for i in range(count)]
            assert [x for part in parts for x in part] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_one_process_needs_no_collective():
    from rstar_jax.parallel import multihost

    assert multihost.is_writer() and multihost.allgather_json({"a": [1.5]}) == [{"a": [1.5]}]
    assert builders.generation_share(["s0", "s1", "s2"]) == ["s0", "s1", "s2"]


def test_a_continuing_stage_takes_the_previous_runs_model_and_tokenizer(tmp_path):
    """Stage 2 with only train.init_from: the model and tokenizer files the previous run stored."""
    import json

    stored = tmp_path / "stage1" / "checkpoints" / "3" / "config"
    stored.mkdir(parents=True)
    (stored / "metadata").write_text(json.dumps({"model": {"hf_path": "runs/sft/hf/final"},
                                                 "tokenizer": {"path": "tokenizers/qwen3"}}))
    config = _config(**{"train.init_from": str(tmp_path / "stage1"), "model.hf_path": "", "tokenizer.path": ""})
    builders.continue_previous_stage(config)
    assert (config.model.hf_path, config.tokenizer.path) == ("runs/sft/hf/final", "tokenizers/qwen3")
    mine = _config(**{"train.init_from": str(tmp_path / "stage1"), "model.hf_path": "", "tokenizer.path": "mine"})
    builders.continue_previous_stage(mine)
    assert mine.tokenizer.path == "mine"  # what the user set wins


def test_the_engine_pool_follows_mem_fraction_static_unless_max_total_tokens_is_set(capsys):
    """rollout.engine.mem_fraction_static sizes the in-process engine's KV pool as SGLang does; a CPU
    reports no memory statistics, so the pool falls back to slots x max_length (said on stdout), and a
    fallback beyond that fraction of the host's memory is refused naming the fields to change.
    max_total_tokens overrides the fraction; chunked_prefill_size reaches the engine (-1: off)."""
    from flax import nnx

    from rstar_jax.errors import UserError
    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config

    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0))
    small = {"rollout.engine.slots": 2, "rollout.engine.max_length": 64, "rollout.engine.mem_fraction_static": 0.5}
    for overrides, pool, chunk in (({"rollout.engine.chunked_prefill_size": 32}, 2 * 64, 32),
                                   ({"rollout.engine.max_total_tokens": 256,
                                     "rollout.engine.chunked_prefill_size": -1}, 256, None)):
        engine = builders.make_engine(_config(**small, **overrides), model, None)
        engine.close()
        assert (engine.max_total_tokens, engine.chunked_prefill_size) == (pool, chunk)
        fallback = "cpu reports no memory statistics: KV pool of slots x max_length = 128 tokens"
        assert (fallback in capsys.readouterr().out) == (pool == 128)
    with pytest.raises(UserError, match=r"more than config.rollout.engine.mem_fraction_static 0.5 of this host's .*; "
                                        r"pass config.rollout.engine.max_total_tokens"):
        builders.make_engine(_config(**{**small, "rollout.engine.slots": 1 << 30}), model, None)


def test_the_layer_layout_reaches_the_engine_and_the_local_servers():
    """rollout.engine.layer_layout: the in-process engine is built with it, and servers started for
    rollout.local_servers get `--layer-layout` (only where it is not the default)."""
    from flax import nnx

    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config

    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0))
    config = _config(**{"rollout.engine.slots": 2, "rollout.engine.max_length": 64,
                        "rollout.engine.layer_layout": "per_layer"})
    engine = builders.make_engine(config, model, None)
    engine.close()
    assert engine.layer_layout == "per_layer" and engine.extra_weight_bytes > 0
    assert builders.local_server_flags(config.rollout.engine)[-2:] == ["--layer-layout", "per_layer"]
    assert "--layer-layout" not in builders.local_server_flags(_config().rollout.engine)


def test_the_decode_attention_reaches_the_engine_and_unservable_shapes_name_the_field():
    """rollout.engine.decode_attention="pallas": the in-process engine decodes with the kernel over
    a heads-first pool; a page size the kernel cannot serve is a config error naming the field."""
    from flax import nnx

    from rstar_jax.model.qwen3 import Qwen3, Qwen3Config

    model = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0))
    small = {"rollout.engine.slots": 2, "rollout.engine.max_length": 64, "rollout.engine.decode_attention": "pallas"}
    engine = builders.make_engine(_config(**small), model, None)
    engine.close()
    assert engine.decode_attention == "pallas" and engine._cache.heads_first
    with pytest.raises(ConfigError, match=r"config.rollout.engine.decode_attention: decode_attention 'pallas' cannot "
                                          r"serve this model and pool: page_size 24 must be a power of two"):
        builders.make_engine(_config(**small, **{"rollout.engine.page_size": 24}), model, None)


def test_an_hf_tokenizer_with_nothing_to_load_is_a_config_error(tmp_path):
    """Stage 3 names only train.init_from; a directory that exists (what validation checks) but holds
    no run gives one error naming the field, not a traceback from the tokenizer loader."""
    (tmp_path / "checkpoints").mkdir()
    config = load_config_file(REPO_CONFIGS / "stage3.py")
    config.update_from_flattened_dict({"train.init_from": str(tmp_path / "checkpoints")})
    with pytest.raises(ConfigError, match=r"config\.tokenizer\.path: an hf tokenizer needs files"):
        builders.tokenizer(config)
