"""Several JAX processes on one machine: two `jax.distributed` processes on 127.0.0.1 with 4 fake CPU
devices each and gloo collectives form one 8-device mesh, as two hosts of a cluster would."""

import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file

from rstar_jax.model.hf import save_pretrained
from rstar_jax.model.qwen3 import Qwen3Config
from rstar_jax.parallel import create_sharded_model, make_mesh

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
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
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
