"""`python -m rstar_jax.serve` as a drop-in for `sglang.launch_server`: started with SGLang's flags on
a tiny Qwen3 checkpoint with Qwen3's real tokenizer and chat template, driven by the official
`openai` client (models, completions and chat, streaming and not), checked against transformers'
`apply_chat_template` and against the model's own forward; `/metrics` read by `prometheus_client`;
a client that disconnects has its request aborted; `/health` answers 503 until warm."""

import asyncio
import json
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.hf import save_pretrained
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.engine.jax_engine import JaxEngine
from rstar_jax.engine.server import EngineServer
from tests import qwen3_vocab

CONTEXT, SLOTS, NAME = 512, 4, "tiny-qwen3"
IM_END, ENDOFTEXT = 151645, 151643
TOP = 3  # one top-k size everywhere: its scoring kernel compiles once
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 6 x 7? Answer with a number."}]
TOOLS = [{"type": "function", "function": {"name": "python", "description": "Runs Python code.",
                                           "parameters": {"type": "object",
                                                          "properties": {"code": {"type": "string"}},
                                                          "required": ["code"]}}}]


def _http(url, method="GET", body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, qwen3_tokenizer_dir):
    """A tiny Qwen3 with Qwen3's 151,936-row embedding, saved with the real tokenizer files and chat
    template beside the weights (what a Hugging Face Qwen3 directory holds)."""
    model = Qwen3(Qwen3Config.tiny(vocab_size=qwen3_vocab.EMBEDDING_SIZE), rngs=nnx.Rngs(0))
    directory = tmp_path_factory.mktemp("qwen3_tiny")
    save_pretrained(model, directory, tokenizer_dir=qwen3_tokenizer_dir, stop_token_ids=(IM_END, ENDOFTEXT))
    return types.SimpleNamespace(dir=directory, model=model)


@pytest.fixture(scope="module")
def hf_tok(checkpoint):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(checkpoint.dir))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """The server as a user starts SGLang's (plus `--port-file`, ours, to learn the free port)."""
    port_file = tmp_path_factory.mktemp("serve") / "port"
    cmd = [sys.executable, "-m", "rstar_jax.serve", "--model-path", str(checkpoint.dir),
           "--tokenizer-path", str(checkpoint.dir), "--context-length", str(CONTEXT),
           "--max-running-requests", str(SLOTS), "--mem-fraction-static", "0.8", "--host", "127.0.0.1",
           "--port", "0", "--port-file", str(port_file), "--served-model-name", NAME, "--enable-metrics",
           "--enable-deterministic-inference", "--random-seed", "0", "--log-level", "warning"]
    log = open(port_file.parent / "server.log", "w+")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def tail():
        log.flush()
        log.seek(0)
        return log.read()[-4000:]

    try:
        deadline = time.monotonic() + 300
        while not port_file.exists():
            assert process.poll() is None and time.monotonic() < deadline, tail()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        while _http(url + "/health_generate")[0] != 200:
            assert process.poll() is None and time.monotonic() < deadline, tail()
            time.sleep(0.1)
        yield types.SimpleNamespace(url=url)
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _generate(server, body):
    status, text, _ = _http(server.url + "/generate", "POST", body)
    assert status == 200, text
    return json.loads(text)


GREEDY = {"temperature": 0.0, "skip_special_tokens": True}


@pytest.mark.slow  # the server subprocess
def test_models_and_completions_through_the_openai_client(server, client, hf_tok):
    [model] = client.models.list().data
    assert (model.id, model.object, model.model_extra["max_model_len"]) == (NAME, "model", CONTEXT)
    info = json.loads(_http(server.url + "/get_server_info")[1])
    assert info["skip_tokenizer_init"] is False and info["tokenizer_path"] == info["model_path"]
    assert (info["context_length"], info["max_running_requests"], info["served_model_name"]) == (CONTEXT, SLOTS, NAME)
    assert info["enable_deterministic_inference"] is True and info["port"] == int(server.url.rsplit(":", 1)[1])

    prompt = "The quick brown fox"
    completion = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    # The same prompt through SGLang's native route: its tokens, decoded by transformers, are the text.
    native = _generate(server, {"text": prompt, "sampling_params": {"max_new_tokens": 8, **GREEDY}})
    [choice] = completion.choices
    assert choice.text == native["text"] == hf_tok.decode(native["output_ids"], skip_special_tokens=True)
    assert choice.finish_reason == "length" and len(native["output_ids"]) == 8
    assert completion.usage.prompt_tokens == len(hf_tok.encode(prompt)) == native["meta_info"]["prompt_tokens"]
    assert completion.usage.completion_tokens == 8 and completion.model == NAME

    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8

    # A stop string: the text ends before it, and generation stops there.
    text = choice.text
    stop = next(ch for ch in text[1:] if ch.strip() and ch != "\ufffd")
    stopped = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["matched_stop"] == stop
    assert stopped.usage.completion_tokens < 8

    # Token-id prompts, a batch of them, and the prompt's log-probs with echo (the first is null).
    batch = client.completions.create(model=NAME, prompt=[hf_tok.encode(prompt), hf_tok.encode("Hi")], max_tokens=2,
                                      temperature=0, echo=True, logprobs=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text.startswith(prompt) and batch.choices[0].logprobs.token_logprobs[0] is None
    assert len(batch.choices[0].logprobs.tokens) == len(hf_tok.encode(prompt)) + 2


@pytest.mark.slow  # the server subprocess
def test_chat_prompt_is_the_checkpoints_template(server, client, hf_tok):
    prompt_ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=TOP)
    [choice] = chat.choices
    assert chat.usage.prompt_tokens == len(prompt_ids)
    native = _generate(server, {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 6, **GREEDY}})
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == hf_tok.decode(native["output_ids"], skip_special_tokens=True)
    assert chat.usage.completion_tokens == 6 == len(choice.logprobs.content)
    for entry, token in zip(choice.logprobs.content, native["output_ids"]):
        # Greedy: the sampled token is the most likely one.
        assert len(entry.top_logprobs) == TOP and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.token == hf_tok.decode([token])

    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)

    # Tools go through the template as transformers passes them.
    with_tools = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=1)
    expected = hf_tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
    assert with_tools.usage.prompt_tokens == len(expected) > len(prompt_ids)


@pytest.mark.slow  # the server subprocess
def test_bad_openai_requests_name_the_field(server, client):
    openai = pytest.importorskip("openai")
    for kwargs, field in [({"n": 2}, "n"), ({"presence_penalty": 1.0}, "presence_penalty"),
                          ({"extra_body": {"bogus": 1}}, "bogus"), ({"tool_choice": "required", "tools": TOOLS},
                                                                   "tool_choice")]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1, **kwargs)
    status, text, _ = _http(server.url + "/v1/completions", "POST", {"prompt": "x"},
                            headers={"Content-Type": "text/plain"})
    assert status == 400 and "Content-Type" in text
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}], max_tokens=1)


def _log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.slow  # the server subprocess
def test_prompt_and_top_logprobs_match_the_models_forward(server, checkpoint, hf_tok):
    prompt = hf_tok.encode("Prompt log-probs, as SGLang reports them.")
    start = 3
    body = _generate(server, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": start,
                              "top_logprobs_num": TOP, "return_text_in_logprobs": True,
                              "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    meta, output = body["meta_info"], body["output_ids"]
    sequence = prompt + output
    reference = _log_softmax(checkpoint.model(jnp.asarray([sequence]))[0])  # row t: the distribution of t + 1
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompt[start:] and inputs[0][0] is None  # SGLang: the first is null
    np.testing.assert_allclose([t[0] for t in inputs[1:]],
                               [reference[t - 1, prompt[t]] for t in range(start + 1, len(prompt))], atol=1e-4)
    assert all(t[2] == hf_tok.decode([t[1]]) for t in inputs)  # return_text_in_logprobs
    assert meta["input_top_logprobs"][0] is None
    for t, top in zip(range(start + 1, len(prompt)), meta["input_top_logprobs"][1:]):
        order = np.argsort(-reference[t - 1])[:TOP]
        assert [e[1] for e in top] == order.tolist()
        np.testing.assert_allclose([e[0] for e in top], reference[t - 1, order], atol=1e-4)
    np.testing.assert_allclose([t[0] for t in meta["output_token_logprobs"]],
                               [reference[len(prompt) + j - 1, tok] for j, tok in enumerate(output)], atol=1e-4)
    for j, top in enumerate(meta["output_top_logprobs"]):
        order = np.argsort(-reference[len(prompt) + j - 1])[:TOP]
        assert [e[1] for e in top] == order.tolist() and top[0][1] == output[j]
    # Without logprob_start_len, no prompt log-probs (SGLang's default of -1).
    plain = _generate(server, {"input_ids": prompt, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    assert "input_token_logprobs" not in plain["meta_info"] and "output_top_logprobs" not in plain["meta_info"]


@pytest.mark.slow  # the server subprocess
def test_metrics_parse_as_prometheus_text(server, client):
    parser = pytest.importorskip("prometheus_client.parser")
    client.completions.create(model=NAME, prompt="count me", max_tokens=2, temperature=0)
    status, text, headers = _http(server.url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage", "cache_hit_rate",
                 "gen_throughput", "max_total_num_tokens"):
        family = families[f"sglang:{name}"]
        assert family.type == "gauge" and family.samples[0].labels == {"model_name": NAME}
    for name in ("prompt_tokens", "generation_tokens", "num_requests"):
        assert families[f"sglang:{name}"].type == "counter" and families[f"sglang:{name}"].samples[0].value >= 1
    ttft = families["sglang:time_to_first_token_seconds"]
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert ttft.type == "histogram" and count >= 1
    assert next(s for s in families["sglang:max_total_num_tokens"].samples).value >= CONTEXT


def _loads(server) -> dict:
    return json.loads(_http(server.url + "/v1/loads")[1])["loads"][0]


def _assert_starts_running(server, n=1, timeout=30.0):
    deadline = time.monotonic() + timeout
    while _loads(server)["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def _assert_stops_within_a_second(server) -> None:
    """Running requests drop to 0 within 1 s, and the used KV stops growing (it is freed)."""
    deadline = time.monotonic() + 1.0
    while (load := _loads(server))["num_running_reqs"]:
        assert time.monotonic() < deadline, f"still running 1 s after the client left: {load}"
        time.sleep(0.02)
    used = load["num_used_tokens"]
    time.sleep(0.3)
    assert used == 0 == _loads(server)["num_used_tokens"]


@pytest.mark.slow  # the server subprocess
def test_a_disconnected_clients_request_stops(server, client, hf_tok):
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"input_ids": hf_tok.encode("Go on forever"),
                       "sampling_params": {"max_new_tokens": CONTEXT - 16, "ignore_eos": True}}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    _assert_starts_running(server)
    sock.close()
    _assert_stops_within_a_second(server)

    # A streaming chat whose reader stops reading and closes the stream.
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=CONTEXT, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))
    _assert_starts_running(server)
    stream.close()
    _assert_stops_within_a_second(server)


def test_health_answers_503_until_warm():
    """The site is up before warm-up; /health and /health_generate answer 503 until `ready`."""
    from aiohttp.test_utils import TestClient, TestServer

    engine = JaxEngine(Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0)), slots=1, max_length=64)
    server = EngineServer(engine, model_path="tiny")

    async def run():
        async with TestClient(TestServer(server.app())) as http:
            before = [(await http.get(path)).status for path in ("/health", "/health_generate")]
            server.ready = True
            after = (await http.get("/health")).status
            return before, after

    try:
        assert asyncio.run(run()) == ([503, 503], 200)
    finally:
        engine.close()


def test_bad_flags_and_tokenizers_exit_2_without_a_traceback(tmp_path, capsys):
    from rstar_jax import serve

    no_tokenizer = tmp_path / "model"
    save_pretrained(Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0)), no_tokenizer)
    for argv, message in [(["--model-path", str(no_tokenizer)], "no tokenizer.json"),
                          (["--model-path", "tiny", "--dp-size", "2"], "--dp-size 2"),
                          (["--model", "tiny", "--mem-fraction-static", "1.5"], "--mem-fraction-static"),
                          (["--model", "tiny", "--chunked-prefill-size", "-2"], "--chunked-prefill-size"),
                          (["--model", "tiny", "--layer-layout", "unrolled"], "--layer-layout must be one of")]:
        with pytest.raises(SystemExit) as exit_info:
            serve.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("error: ") and message in err, err
        assert "Traceback" not in err


def test_kv_pool_is_sized_from_mem_fraction_static_as_sglang():
    """fraction x the device's memory limit holds weights and pool: the pool gets that less what is in
    use after loading; KV heads split over "tensor" need 1/tp of the bytes per device; a device with
    no memory statistics (CPU) gets the fallback; too little room for one context is an error."""
    import jax

    from rstar_jax.errors import UserError
    from rstar_jax.app.serving import kv_pool_tokens

    class Device:
        platform = "gpu"

        def __init__(self, in_use):
            self.in_use = in_use

        def memory_stats(self):
            return {"bytes_limit": 1 << 30, "bytes_in_use": self.in_use}

    model = types.SimpleNamespace(config=Qwen3Config.tiny())  # K and V: 2 x 2 layers x 2 heads x 16 x 4 B
    per_token = 2 * 2 * 2 * 16 * 4

    def mesh(devices, tensor=1):
        return types.SimpleNamespace(devices=np.array(devices, dtype=object), shape={"tensor": tensor})

    expected = int((0.5 * (1 << 30) - (200 << 20)) // per_token)  # the fuller device decides
    assert kv_pool_tokens(model, mesh([Device(100 << 20), Device(200 << 20)]), mem_fraction=0.5, context_length=64,
                          fallback=7) == expected
    assert kv_pool_tokens(model, mesh([Device(200 << 20)] * 2, tensor=2), mem_fraction=0.5, context_length=64,
                          fallback=7) == int((0.5 * (1 << 30) - (200 << 20)) // (per_token / 2))
    cpu = mesh(jax.devices("cpu")[:1])
    assert kv_pool_tokens(model, cpu, mem_fraction=0.5, context_length=64, fallback=7) == 7
    with pytest.raises(UserError, match="pass --max-total-tokens"):  # more than the host's memory
        kv_pool_tokens(model, cpu, mem_fraction=0.5, context_length=64, fallback=1 << 40)
    with pytest.raises(UserError, match="--mem-fraction-static 0.1"):
        kv_pool_tokens(model, mesh([Device(200 << 20)]), mem_fraction=0.1, context_length=64, fallback=7)


def test_engine_streams_tokens_and_ends_exactly_the_request_asked():
    """on_token sees every token before the result; True from it ends that request; a cancelled
    generate ends only its own request, not the others its rid prefixes (the SGLang abort semantics
    stay with /abort_request)."""
    from rstar_jax.rollout.protocol import SamplingParams

    engine = JaxEngine(Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0)), slots=2, max_length=128)
    params = SamplingParams(max_new_tokens=100, temperature=0.0)

    async def run():
        seen = []
        stopped = await engine.generate([1, 2, 3], params, on_token=lambda t, lp: seen.append(t) or len(seen) >= 5)
        tasks = {}

        def cancel_prefix_owner(token, logprob):
            if not tasks["ab"].done():
                tasks["ab"].cancel()

        tasks["ab"] = asyncio.ensure_future(engine.generate([4, 5, 6], params, rid="ab"))
        await asyncio.sleep(0)
        longer = await engine.generate([4, 5, 6], params, rid="abc", on_token=cancel_prefix_owner)
        return seen, stopped, tasks["ab"], longer

    try:
        seen, stopped, cancelled, longer = asyncio.run(run())
    finally:
        engine.close()
    assert stopped.finish_reason == "abort" and stopped.token_ids[:len(seen)] == seen and len(seen) >= 5
    assert len(stopped.token_ids) < params.max_new_tokens
    assert cancelled.cancelled() and longer.finish_reason == "length" and len(longer.token_ids) == 100


def test_sampling_seed_is_honoured_only_with_deterministic_inference():
    from rstar_jax.engine.server import parse_sampling

    assert parse_sampling({"sampling_seed": 5}, honour_seed=True)[0].seed == 5
    assert parse_sampling({"sampling_seed": 5}, honour_seed=False)[0].seed is None  # as SGLang without the flag
