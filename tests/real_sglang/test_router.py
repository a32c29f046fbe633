"""sglang-router 0.3.2 (SGLang's Rust load balancer) in front of two `rstar_jax.serve` servers: what
it forwards is answered (it fills `model`, `background`, `no_logs` and `return_bytes` into every
/generate), the control plane it lacks is refused by our client with what to do, and the workers
themselves take pause and weight updates directly."""

import asyncio
import contextlib
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from flax import nnx

from rstar_jax.model.hf import save_pretrained
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.engine.local_server import LocalServer
from rstar_jax.rollout.protocol import SamplingParams
from rstar_jax.rollout.sglang import SGLangError, SGLangGenerator
from rstar_jax.train.weight_sync import DiskSync
from tests.real_sglang.server import free_port, stop_process_group

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny export with a byte-level tokenizer.json beside it: the router loads each worker's
    tokenizer from its model path, and a local one keeps it off the network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = save_pretrained(Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0)), tmp_path_factory.mktemp("router") / "hf",
                           dtype="float32")
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@contextlib.contextmanager
def router(env, workers, log_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(env / "bin" / "python"), "-m", "sglang_router.launch_router", "--host",
                                    "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy",
                                    "cache_aware", "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router did not start: {log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        stop_process_group(process, grace=10)


def test_the_router_forwards_generation_and_leaves_control_to_the_workers(sglang_env, checkpoint, tmp_path):
    other = Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(3))
    prompts = [[1 + i, 2, 3, 4 + i] for i in range(8)]

    async def run(router_url, workers):
        async with SGLangGenerator(router_url) as through_router:
            routed = await asyncio.gather(*(through_router.generate(p, GREEDY) for p in prompts))
            refusals = {}
            for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
                status, _ = await through_router._request("POST", path, {}, ok_statuses=(200, 404))
                refusals[path] = status
            status, _ = await through_router._request("GET", "/v1/loads", ok_statuses=(200, 404))
            refusals["/v1/loads"] = status
            with pytest.raises(SGLangError, match="is an sglang-router, not a server: list its workers"):
                await through_router.capacity()
        gens = [SGLangGenerator(url) for url in workers]
        try:
            direct = [await gens[0].generate(p, GREEDY) for p in prompts]
            # The control plane goes to every worker directly: pause, weights, loads.
            await DiskSync(gens, tmp_path / "weights", mode="pause", dtype="float32").push(other, 1)
            capacities = [await g.capacity() for g in gens]
            async with SGLangGenerator(router_url) as through_router:
                after = await through_router.generate(prompts[0], GREEDY)
            return routed, refusals, direct, capacities, after
        finally:
            for g in gens:
                await g.close()

    with LocalServer(str(checkpoint), slots=4, max_length=256) as a, \
            LocalServer(str(checkpoint), slots=4, max_length=256) as b, \
            router(sglang_env, [a.url, b.url], tmp_path / "router.log") as url:
        routed, refusals, direct, capacities, after = asyncio.run(run(url, [a.url, b.url]))

    assert [r.token_ids for r in routed] == [d.token_ids for d in direct]
    assert refusals == dict.fromkeys(("/pause_generation", "/continue_generation", "/update_weights_from_disk",
                                      "/v1/loads"), 404)
    assert all(c.total_tokens > 0 for c in capacities)
    assert after.weight_version == 1  # whichever worker the router picked, it runs the pushed weights
