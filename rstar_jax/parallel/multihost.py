"""What the processes of one `jax.distributed` job share, split and exchange on the host side.

Every process runs the same program over one global mesh (launch/README.md, "Several trainer
processes"). The host-side pieces here are the only places the run asks which process it is:

- `share(n)`: this process's contiguous part of n items (prompts, questions, servers);
- `allgather_json(obj)`: every process's JSON-able value, in process order, on every process (an
  evaluation's samples); it travels as bytes through a JAX collective, so it needs nothing beyond
  `jax.distributed`;
- `allgather_arrays(arrays, meta)`: the same for numpy arrays plus a small JSON-able value, packed
  raw into one flat byte buffer per process (`encode_arrays`/`decode_arrays`): the step's
  trajectories as token arrays, several times smaller than their JSON;
- `is_writer()`: the one process that writes files others also need (metrics, rollout records,
  reports, HF exports);
- `barrier(name)`: every process waits for the others (files written, servers loaded);
- `host_state(model)`: every parameter gathered whole onto every host (a host-local engine's copy).

With one process they cost nothing: no collective runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from rstar_jax.errors import UserError
from rstar_jax.model.hf import host_value


def is_writer() -> bool:
    """True on the process that writes the run's shared files (process 0)."""
    return jax.process_index() == 0


def share(n: int, index: int | None = None, count: int | None = None) -> slice:
    """Process `index`'s contiguous part of `n` items (this process's by default): the first
    `n % count` processes take one more, so the parts cover range(n) in process order."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


def barrier(name: str) -> None:
    """Every process reaches `name` before any goes on (nothing with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _allgather_bytes(payload: np.ndarray) -> list[np.ndarray]:
    """Every process's flat uint8 `payload`, in process order (each a view of one gathered array):
    the lengths first, then every payload padded to the longest, through one JAX collective."""
    lengths = np.asarray(multihost_utils.process_allgather(np.int64(payload.size))).reshape(-1)
    padded = np.zeros(-(-int(lengths.max()) // 8) * 8, np.uint8)  # rows 8-byte aligned (encode_arrays)
    padded[:payload.size] = payload
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [row[:n] for row, n in zip(gathered, lengths)]


def allgather_json(value: Any) -> list[Any]:
    """`value` (JSON-able) of every process, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    payload = np.frombuffer(json.dumps(value, separators=(",", ":")).encode(), np.uint8)
    return [json.loads(row.tobytes()) for row in _allgather_bytes(payload)]


_MAGIC = b"RJA1"  # format of `encode_arrays`: magic, header length (uint64 LE), JSON header, aligned arrays
_ALIGN = 8


def encode_arrays(arrays: Mapping[str, np.ndarray], meta: Any = None) -> np.ndarray:
    """`arrays` (numeric numpy arrays, any shapes) and `meta` (JSON-able, small) as one flat uint8
    buffer: a JSON header (meta, each array's name, dtype with byte order, shape, offset) and then
    each array's raw bytes, 8-byte aligned. `decode_arrays` gives back equal arrays and meta."""
    specs, offset = [], 0
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.dtype.hasobject or array.dtype.fields is not None:
            raise TypeError(f"encode_arrays: {name!r} has dtype {array.dtype}; only plain numeric arrays travel raw")
        specs.append([name, array.dtype.str, list(array.shape), offset])
        offset += -(-array.nbytes // _ALIGN) * _ALIGN
    header = json.dumps({"meta": meta, "arrays": specs}, separators=(",", ":")).encode()
    start = -(-(len(_MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
    buffer = np.zeros(start + offset, np.uint8)
    buffer[:len(_MAGIC) + 8] = np.frombuffer(_MAGIC + struct.pack("<Q", len(header)), np.uint8)
    buffer[len(_MAGIC) + 8:len(_MAGIC) + 8 + len(header)] = np.frombuffer(header, np.uint8)
    for (_, _, _, at), array in zip(specs, arrays.values()):
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buffer[start + at:start + at + raw.size] = raw
    return buffer


def decode_arrays(buffer: np.ndarray | bytes) -> tuple[dict[str, np.ndarray], Any]:
    """The (arrays, meta) that `encode_arrays` packed into `buffer`; the arrays are read-only views
    of `buffer` (copy one to keep it beyond the buffer's life or to write it)."""
    buffer = np.frombuffer(buffer, np.uint8) if isinstance(buffer, (bytes, bytearray, memoryview)) else buffer
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer[:len(_MAGIC)].tobytes() != _MAGIC:
        raise ValueError("decode_arrays: not a buffer from encode_arrays")
    (size,) = struct.unpack("<Q", buffer[len(_MAGIC):len(_MAGIC) + 8].tobytes())
    header = json.loads(buffer[len(_MAGIC) + 8:len(_MAGIC) + 8 + size].tobytes())
    start = -(-(len(_MAGIC) + 8 + size) // _ALIGN) * _ALIGN
    arrays = {}
    for name, dtype, shape, at in header["arrays"]:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(buffer, dtype, count=count, offset=start + at).reshape(shape)
        array.flags.writeable = False
        arrays[name] = array
    return arrays, header["meta"]


def allgather_arrays(arrays: Mapping[str, np.ndarray], meta: Any = None) -> list[tuple[dict[str, np.ndarray], Any]]:
    """Every process's (arrays, meta), in process order, on every process: `encode_arrays`'s one
    flat buffer per process, gathered as `allgather_json` gathers its bytes (padded to the longest,
    one JAX collective). Array names, shapes and dtypes may differ between processes. With one
    process, nothing is encoded: the value comes back as given."""
    if jax.process_count() == 1:
        return [(dict(arrays), meta)]
    return [decode_arrays(row) for row in _allgather_bytes(encode_arrays(arrays, meta))]


def host_state(model) -> Any:
    """The model's `nnx.State` with every array whole on this host (collective: all processes call it)."""
    return jax.tree.map(lambda x: host_value(x) if isinstance(x, jax.Array) else x, nnx.state(model))


def engine_devices(mesh_shape: dict[str, int]) -> list:
    """This host's devices for a host-local engine replica: the policy's tensor-parallel size when
    the host has that many, else one. Decoding gains nothing from splitting a replica's parameters
    further (FSDP would all-gather them every token)."""
    local = jax.local_devices()
    tensor = mesh_shape.get("tensor", 1)
    return local[:tensor] if tensor <= len(local) else local[:1]


@contextlib.contextmanager
def exit_job_on_failure() -> Iterator[None]:
    """Under several processes, a failure ends this process at once (status 2 for a user error, 1
    otherwise) instead of unwinding into `jax.distributed`'s shutdown barrier, where it would wait
    for processes that are themselves waiting in a collective for it. The others then fail in
    their next collective, or when the coordination service misses this process's heartbeat
    (`JAX_HEARTBEAT_TIMEOUT_S`, see `maybe_initialize_distributed`): every process exits within a
    bounded time."""
    if jax.process_count() == 1:
        yield
        return
    try:
        yield
    except BaseException as e:  # noqa: BLE001  (any failure ends the whole job)
        if isinstance(e, UserError):
            for line in str(e).splitlines() or [type(e).__name__]:
                print(f"error: {line}", file=sys.stderr)
            code = 2
        else:
            traceback.print_exc()
            code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) and e.code else 1
        print(f"[process {jax.process_index()}] failed: ending the job", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)
