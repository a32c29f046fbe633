"""The process group of SGLang's distributed weight update, for both of its sides.

SGLang's `/init_weights_update_group` makes every TP rank of a server join a torch.distributed group
at `rank_offset + tp_rank` through `tcp://master_address:master_port`, while the trainer joins as
rank 0; `/update_weights_from_distributed` then receives each listed tensor from a `broadcast` of
rank 0, in order. `WeightUpdateGroup` is one rank of that group: the trainer side
(`rstar_jax.train.weight_sync.DistributedSync`) and `rstar_jax.serve`'s receiver use it alike, and
it interoperates with SGLang's servers.

SGLang builds the group with torch's internal process-group helper over a TCP store wrapped in
`PrefixStore(group_name)`. The helper prefixes the store with `"{group_name}/"` and then with the
first device the backend serves (`"cpu/"` for gloo, `"cuda/"` for nccl), and creates one backend
there. This module builds the same store layout from torch's public classes (`TCPStore`,
`PrefixStore`, `ProcessGroupGloo`, `ProcessGroupNCCL`) without registering anything in torch's
global process-group state, so it collides with nothing else in the process (a trainer's own
torch groups, another weight-update group); tests check the layout against SGLang's construction.

Backends: "nccl" between GPUs (tensors on the GPU on both sides: no host copy), "gloo" on CPU.
Rank 0 hosts the TCP store; `master_port=0` binds a free port (`WeightUpdateGroup.port`), which the
trainer then sends to the servers. The join is a rendezvous: it returns once every rank has joined,
so the trainer joins while the servers' `/init_weights_update_group` calls are in flight.

torch is imported when a group is made: only this path needs it (the `distributed-sync` extra);
without it `TorchMissing` says what to install.
"""

from __future__ import annotations

import datetime
from typing import Any, Sequence

import numpy as np

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default
BACKENDS = ("gloo", "nccl")
# The device torch's process-group helper keys a backend's store by (the first one it serves).
_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}
DTYPES = ("bfloat16", "float16", "float32")  # what `dtypes` may name (torch attribute names, as SGLang's)


class TorchMissing(RuntimeError):
    """torch is not installed; the distributed weight update needs it."""


def import_torch():
    try:
        import torch
        import torch.distributed
    except ImportError as e:
        raise TorchMissing("the distributed weight update needs torch (pip install 'rstar-jax[distributed-sync]'): "
                           f"{e}") from None
    if not torch.distributed.is_available():
        raise TorchMissing("this torch build has no torch.distributed")
    return torch


class WeightUpdateGroup:
    """One rank of a weight-update group (see the module docstring).

    Rank 0: `WeightUpdateGroup.host(...)` binds the TCP store (its `port` is then known), `join()`
    blocks until every rank has joined. Other ranks: `WeightUpdateGroup.connect(...)` joins at once.
    `broadcast(tensors)` sends (rank 0) or receives (others) torch tensors in list order.
    """

    def __init__(self, *, address: str, port: int, rank: int, world_size: int, group_name: str, backend: str,
                 timeout_s: float, store: Any = None):
        if backend not in BACKENDS:
            raise ValueError(f"weight-update group: backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight-update group: rank {rank} is outside world_size {world_size}")
        if not group_name:
            raise ValueError("weight-update group: group_name must be non-empty")
        self.torch = import_torch()
        self.address, self.rank, self.world_size = address, rank, world_size
        self.group_name, self.backend = group_name, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        dist = self.torch.distributed
        self._store = store if store is not None else dist.TCPStore(
            address, port, world_size, rank == 0, timeout=self.timeout, wait_for_workers=False, multi_tenant=True)
        self.port = self._store.port
        self._backend = None

    @classmethod
    def host(cls, address: str, port: int, world_size: int, *, group_name: str = DEFAULT_GROUP_NAME,
             backend: str = "gloo", timeout_s: float = 1800.0) -> "WeightUpdateGroup":
        """Rank 0 (the trainer), its store bound on `port` (0: a free one); call `join()` next."""
        return cls(address=address, port=port, rank=0, world_size=world_size, group_name=group_name,
                   backend=backend, timeout_s=timeout_s)

    @classmethod
    def connect(cls, address: str, port: int, rank: int, world_size: int, *, group_name: str = DEFAULT_GROUP_NAME,
                backend: str = "gloo", timeout_s: float = 1800.0) -> "WeightUpdateGroup":
        """A receiving rank, joined (blocks until every rank has)."""
        group = cls(address=address, port=port, rank=rank, world_size=world_size, group_name=group_name,
                    backend=backend, timeout_s=timeout_s)
        group.join()
        return group

    def join(self) -> None:
        """The rendezvous: returns once all `world_size` ranks have joined (or raises after the timeout)."""
        dist = self.torch.distributed
        store = dist.PrefixStore(f"{self.group_name}/", dist.PrefixStore(self.group_name, self._store))
        store = dist.PrefixStore(f"{_BACKEND_DEVICE[self.backend]}/", store)
        if self.backend == "gloo":
            self._backend = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
        else:
            if not dist.is_nccl_available():
                raise RuntimeError("backend 'nccl': this torch build has no NCCL (use 'gloo' on CPU)")
            self._backend = dist.ProcessGroupNCCL(store, self.rank, self.world_size, timeout=self.timeout)

    def broadcast(self, tensors: Sequence) -> None:
        """Rank 0 sends each tensor, every other rank receives into it, in order; all are issued
        before any is waited for, as SGLang's receiver does."""
        if self._backend is None:
            raise RuntimeError(f"weight-update group {self.group_name!r}: join() first")
        options = self.torch.distributed.BroadcastOptions()
        options.rootRank = 0
        works = [self._backend.broadcast([t], options) for t in tensors]
        for work in works:
            work.wait()

    def receive(self, dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: str = "cpu") -> list:
        """Empty tensors of `dtypes`/`shapes` on `device`, filled by rank 0's broadcasts."""
        torch = self.torch
        tensors = [torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
                   for dtype, shape in zip(dtypes, shapes)]
        self.broadcast(tensors)
        return tensors

    def close(self) -> None:
        backend, self._backend, self._store = self._backend, None, None
        if backend is not None and self.backend == "nccl":
            backend.abort()  # NCCL's communicators go explicitly (nothing is in flight); gloo's go with it


def to_tensor(array) -> Any:
    """A JAX or NumPy array as a torch tensor without a copy (DLPack; NumPy's bfloat16 by its bits)."""
    torch = import_torch()
    if isinstance(array, np.ndarray):
        if array.dtype.name == "bfloat16":  # ml_dtypes: torch cannot read it from NumPy directly
            return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(array))
    return torch.from_dlpack(array)


def to_array(tensor) -> Any:
    """A received torch tensor as an array: NumPy for a CPU tensor, JAX (through DLPack, on the same
    GPU) for a CUDA one."""
    torch = import_torch()
    if tensor.device.type != "cpu":
        import jax.dlpack

        return jax.dlpack.from_dlpack(tensor)
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def dtype_name(tensor) -> str:
    """A torch tensor's dtype as SGLang's `dtypes` name it ("bfloat16", ...)."""
    return str(tensor.dtype).removeprefix("torch.")


__all__ = ["BACKENDS", "DEFAULT_GROUP_NAME", "DTYPES", "TorchMissing", "WeightUpdateGroup", "dtype_name",
           "import_torch", "to_array", "to_tensor"]
