"""Several JAX processes on one machine: two `jax.distributed` processes on 127.0.0.1 with 4 fake CPU
devices each and gloo collectives form one 8-device mesh, as two hosts of a cluster would."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from rstar_jax.model.hf import save_pretrained
from rstar_jax.model.qwen3 import Qwen3Config
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.train.checkpoint import checkpoint_steps
from tests.conftest import TINY_TEST_TASK, xla_flags

pytestmark = pytest.mark.slow  # subprocesses

EXPORT = textwrap.dedent("""
    import sys

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from rstar_jax.model.hf import save_pretrained
    from rstar_jax.model.qwen3 import Qwen3Config
    from rstar_jax.parallel import create_sharded_model, make_mesh

    assert (jax.device_count(), jax.local_device_count()) == (8, 4)
    model = create_sharded_model(Qwen3Config.tiny(), make_mesh(fsdp=8), seed=0)
    assert not model.embed[...].is_fully_addressable  # every parameter spans both processes
    save_pretrained(model, out)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(script: str, *args: str, n: int = 2, timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """`script` in `n` processes (process id first, then the coordinator port, then `args`), 4 fake
    CPU devices each; all are killed if one has not finished in `timeout` seconds."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "JAX_PLATFORMS": "cpu"}
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i), port, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(n)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    return results


def test_hf_export_of_parameters_that_span_two_processes(tmp_path):
    """Each tensor is gathered across the processes and one process writes: the export equals the
    one-process export of the same 8-device model, tensor for tensor, and both processes exit."""
    results = run_processes(EXPORT, str(tmp_path / "two"))
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    one = save_pretrained(create_sharded_model(Qwen3Config.tiny(), make_mesh(fsdp=8), seed=0), tmp_path / "one")
    a, b = load_file(str(tmp_path / "two" / "model.safetensors")), load_file(str(one / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert (tmp_path / "two" / "config.json").read_text() == (one / "config.json").read_text()


def _launch(run_dir, args, *, processes: int, port: int | None = None, env_extra: dict | None = None,
            log_dir=None) -> list[subprocess.Popen]:
    """`python -m rstar_jax.launch` as a cluster starts it: `processes` processes joined through
    JAX_COORDINATOR_ADDRESS on 127.0.0.1, 8 // processes fake CPU devices each (one process: 8)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8 // processes),
           "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    if processes > 1:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port or _free_port()}", JAX_NUM_PROCESSES=str(processes))
    log_dir = log_dir or run_dir.parent
    procs = []
    for i in range(processes):
        out = open(log_dir / f"{run_dir.name}.{i}.log", "a")  # per-process logs, as per-node logs on a cluster
        procs.append(subprocess.Popen([sys.executable, "-m", "rstar_jax.launch", f"--config.run_dir={run_dir}", *args],
                                      env={**env, "JAX_PROCESS_ID": str(i)}, stdout=out, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def _wait(procs, timeout: float) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


def _records(run_dir, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def test_two_process_run_equals_the_one_process_run_and_resumes_after_a_kill(tiny_run_dir, tmp_path):
    """The launcher over two jax.distributed processes x 4 CPU devices (one 8-device mesh, gloo)
    against the same run in one process on 8 devices, RL from the tiny run's warm-up export:

    - process 1 is killed after step 1's checkpoint; process 0 then ends (non-zero) within the
      heartbeat bound instead of waiting in a collective; both restart and resume from step 1;
    - every trajectory of every step equals the one-process run's token for token (the processes
      generate their shares of the prompts with the same group ids and per-trajectory seeds, on
      host-local engine replicas of the same weights), and metrics and rollout records are written
      once per step;
    - losses and the final HF export agree within float32 rounding: the gradient all-reduce crosses
      processes through gloo, which sums the 8 shards in another order than XLA's in-process
      all-reduce (last-bit differences, seen as 1e-7 relative in the gradient norm), and AdamW
      carries them into the parameters at the scale of lr (3e-4) times that.
    """
    args = [f"--config.model.hf_path={tiny_run_dir / 'hf' / 'sft_warmup'}", "--config.sft.before_rl=False",
            *TINY_TEST_TASK, "--config.train.steps=2", "--config.train.eval_every=2",
            "--config.checkpoint.every_steps=1", "--config.metrics.progress_bar=False"]
    two, one = tmp_path / "two", tmp_path / "one"
    procs = _launch(two, args, processes=2, env_extra={"JAX_HEARTBEAT_TIMEOUT_S": "10"})
    deadline = time.monotonic() + 600
    while not checkpoint_steps(two / "checkpoints") and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), (two.parent / "two.0.log").read_text()[-3000:]
        time.sleep(0.5)
    assert checkpoint_steps(two / "checkpoints") == [1]
    procs[1].kill()
    t0 = time.monotonic()
    first = procs[0].wait(timeout=120)
    bound_s = time.monotonic() - t0
    assert first != 0 and bound_s < 60, (first, bound_s)

    assert _wait(_launch(two, args, processes=2), 900) == [0, 0], (two.parent / "two.0.log").read_text()[-3000:]
    assert "[rl] resumed from step 1" in (two.parent / "two.0.log").read_text()
    assert _wait(_launch(one, args, processes=1), 900) == [0], (one.parent / "one.0.log").read_text()[-3000:]

    for step in (1, 2):
        a, b = _records(two, step), _records(one, step)
        assert [(r["group_id"], r["sample_index"]) for r in a] == [(r["group_id"], r["sample_index"]) for r in b]
        assert [r["response_ids"] for r in a] == [r["response_ids"] for r in b], f"step {step}"
    lines = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    steps = lambda records, key: [r["step"] for r in records if key in r]  # noqa: E731
    assert steps(lines, "rollout/reward_mean") == [1, 2] and steps(lines, "eval/pass@1") == [0, 2]
    for key in ("rollout/reward_mean", "update/loss", "eval/pass@1"):
        assert steps(lines, key) == steps(reference, key), key
        np.testing.assert_allclose([r[key] for r in lines if key in r], [r[key] for r in reference if key in r],
                                   rtol=1e-5, err_msg=key)
    assert any(r.get("update/skipped") == 0 for r in lines), "no step made an update"

    import torch
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(two / "hf" / "final", torch_dtype=torch.float32)
    assert exported.config.num_hidden_layers == 1  # configs/tiny.py's depth
    a, b = load_file(str(two / "hf" / "final" / "model.safetensors")), load_file(str(one / "hf" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], atol=1e-5, err_msg=key)


def test_two_process_asynchronous_run_bounds_staleness(tiny_run_dir, tmp_path):
    """rl.max_staleness=1 over two jax.distributed processes: each generates its share of a step's
    groups ahead of the trainer with no collective, while the trainer's sequence (gather, update, push,
    save) keeps the collectives in one order on both; the run completes, and every trained token is at
    most one version behind (read from the rollout records, written once per step)."""
    args = [f"--config.model.hf_path={tiny_run_dir / 'hf' / 'sft_warmup'}", "--config.sft.before_rl=False",
            *TINY_TEST_TASK, "--config.train.steps=2", "--config.data.shuffle_seed=3", "--config.optim.warmup_steps=0",
            "--config.rl.max_staleness=1", "--config.metrics.progress_bar=False"]
    run = tmp_path / "async"
    assert _wait(_launch(run, args, processes=2), 900) == [0, 0], (tmp_path / "async.0.log").read_text()[-3000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "rollout/reward_mean" in r] == [1, 2]
    lags, trained = [], []
    for step in (1, 2):
        records = _records(run, step)
        trained.append({r["group_id"] for r in records})
        dropped = next(r for r in lines if r["step"] == step)["async/stale_groups_dropped"]
        assert len(records) == 8 * (4 - dropped)
        # Versions held: 0, then 1 if step 1 updated; the lag counts the updates in between.
        lags += [int(r["trained_version"] > v) for r in records for v, _ in r["policy_version_runs"] if v >= 0]
    assert 0 <= min(lags) and max(lags) <= 1
    assert not trained[0] & trained[1]  # each update takes groups no other update took
    if lines[0]["update/skipped"] == 0:  # step 2 was generated beside step 1, which then updated
        assert max(lags) == 1
