"""The routes of `rstar_jax.serve` that a trainer drives around a weight update, as SGLang serves
them: `/update_weights_from_disk`, the distributed update (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`, and SGLang 0.5.23's
`/begin_weight_update` / `/end_weight_update`), `/get_weights_by_name`, `/pause_generation` (modes
abort, retract, in_place), `/continue_generation`, `/get_weight_version` and no-op
`/release_memory_occupation` / `/resume_memory_occupation`.

The weight_version string starts as "0" and becomes the `weight_version` a weight update names, or
the engine's version counter when it names none. `version_name` maps the engine's version counter
(the one its tokens carry) to that string, for the per-token `weight_versions` of a response whose
request an in-place update crossed. Loading weights from disk is the caller's
(`load_weights(path) -> model`), and so are applying tensors received by name
(`load_tensors(model, {name: array}) -> model`) and reading one back (`read_tensor(model, name)`), so
this module knows no checkpoint format. The distributed update joins the trainer's torch.distributed
group as one rank whatever the tensor-parallel size (one process holds every device), receives each
broadcast tensor (on the host with gloo; on the GPU with nccl, handed to JAX through DLPack) and
applies the call's tensors in one swap (`/get_server_info` reports the rank count as
`weight_update_ranks`; SGLang's servers join with one rank per GPU).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from aiohttp import web

from rstar_jax.engine import weight_transfer
from rstar_jax.engine.http_common import BadRequest, error_response, json_or_empty, json_response
from rstar_jax.engine.jax_engine import PAUSE_MODES, JaxEngine

log = logging.getLogger("rstar_jax.serve")


class WeightRoutes:
    """The weight-update, pause and memory routes over one JaxEngine, and the weight_version they
    set. load_weights / load_tensors / read_tensor: see the module docstring (None: the route
    answers that this server cannot do it)."""

    def __init__(self, engine: JaxEngine, *, load_weights: Callable[[str], object] | None = None,
                 load_tensors: Callable[[object, dict], object] | None = None,
                 read_tensor: Callable[[object, str], np.ndarray] | None = None):
        self.engine = engine
        self.load_weights = load_weights
        self.load_tensors = load_tensors
        self.read_tensor = read_tensor
        self.weight_version = str(engine.version)
        self._names = {engine.version: self.weight_version}  # the engine's version -> weight_version
        self._groups: dict[str, weight_transfer.WeightUpdateGroup] = {}  # weight-update groups by name
        self._weight_session = False  # SGLang 0.5.23's begin/end_weight_update bracket is open
        self._update_lock = asyncio.Lock()

    def _swapped(self, version: int, given) -> None:
        """After the engine swapped to `version`: the weight_version string it serves under."""
        self.weight_version = str(given) if given is not None else str(version)
        self._names[version] = self.weight_version

    def version_name(self, version: int) -> str:
        """The weight_version string of the engine's `version` (its counter, where no update named one)."""
        return self._names.get(version, str(version))

    def routes(self) -> list[tuple[str, str, Any]]:
        return [
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/init_weights_update_group", self.init_weights_update_group),
            ("POST", "/update_weights_from_distributed", self.update_weights_from_distributed),
            ("POST", "/destroy_weights_update_group", self.destroy_weights_update_group),
            ("POST", "/begin_weight_update", self.begin_weight_update),
            ("POST", "/end_weight_update", self.end_weight_update),
            ("GET", "/get_weights_by_name", self.get_weights_by_name),
            ("POST", "/get_weights_by_name", self.get_weights_by_name),
            ("POST", "/pause_generation", self.pause), ("POST", "/continue_generation", self.resume),
            ("GET", "/get_weight_version", self.get_weight_version),
            ("GET", "/release_memory_occupation", self.memory_noop), ("POST", "/release_memory_occupation", self.memory_noop),
            ("GET", "/resume_memory_occupation", self.memory_noop), ("POST", "/resume_memory_occupation", self.memory_noop),
        ]

    # -- from disk ----------------------------------------------------------------------------
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_or_empty(request)
        path = body.get("model_path")
        if not path or self.load_weights is None:
            message = "model_path is required" if self.load_weights else "this server cannot load weights from disk"
            return json_response({"success": False, "message": message, "num_paused_requests": 0}, status=400)
        async with self._update_lock:
            try:
                model = await asyncio.to_thread(self.load_weights, path)
                version = await asyncio.to_thread(
                    self.engine.update_weights, model,
                    abort_in_flight=bool(body.get("abort_all_requests", False)))
            except (OSError, ValueError) as e:
                return json_response({"success": False, "message": f"Failed to update weights: {e}",
                                          "num_paused_requests": 0}, status=400)
            self._swapped(version, body.get("weight_version"))
        return json_response({"success": True, "message": f"Succeeded to update model weights from {path}.",
                                  "num_paused_requests": 0})

    # -- distributed (SGLang's /init_weights_update_group family) -------------------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Joins the trainer's group as rank `rank_offset`; answers once every rank has joined."""
        body = await json_or_empty(request)
        try:
            address, port = str(body["master_address"]), _int(body, "master_port")
            rank, world_size = _int(body, "rank_offset"), _int(body, "world_size")
        except (KeyError, BadRequest) as e:
            return _weights_error(f"init_weights_update_group: {e if isinstance(e, BadRequest) else f'missing {e}'}")
        group_name = str(body.get("group_name", weight_transfer.DEFAULT_GROUP_NAME))
        backend = str(body.get("backend", "nccl"))
        if self.load_tensors is None:
            return _weights_error("this server cannot load weights from tensors")
        if group_name in self._groups:
            return _weights_error(f"Failed to initialize custom process group: group {group_name!r} already exists "
                                  f"(destroy it first).")
        try:
            group = await asyncio.to_thread(weight_transfer.WeightUpdateGroup.connect, address, port, rank, world_size,
                                            group_name=group_name, backend=backend)
        except Exception as e:  # noqa: BLE001  (torch missing, bad backend, rendezvous timeout: all answered)
            return _weights_error(f"Failed to initialize custom process group: {e}.")
        self._groups[group_name] = group
        log.info("joined weight-update group %r as rank %d of %d (%s, %s:%d)", group_name, rank, world_size, backend,
                 address, port)
        return json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receives the listed tensors (HF names) from rank 0's broadcasts, in order, then applies
        them in one swap: running requests finish on the old weights first unless
        `abort_all_requests`; the prefix cache is dropped (its KV came from the old weights)."""
        body = await json_or_empty(request)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        group_name = str(body.get("group_name", weight_transfer.DEFAULT_GROUP_NAME))
        group = self._groups.get(group_name)
        problem = None
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            problem = "names, dtypes and shapes must be lists of equal length"
        elif bad := [d for d in dtypes if d not in weight_transfer.DTYPES]:
            problem = f"dtypes: {bad[0]!r} is not one of {weight_transfer.DTYPES}"
        elif not all(isinstance(s, list) and all(isinstance(n, int) and n >= 0 for n in s) for s in shapes):
            problem = "shapes must be lists of non-negative ints"
        elif group is None:
            problem = f"group {group_name!r} does not exist: call /init_weights_update_group first"
        elif body.get("load_format") is not None:
            problem = f"load_format {body['load_format']!r} is not supported (only the default)"
        if problem is not None:
            return _weights_error(f"Failed to update parameter online: {problem}.")
        async with self._update_lock:
            try:
                # Receive even tensors that will be refused: rank 0 is sending them regardless.
                device = "cuda" if group.backend == "nccl" else "cpu"
                tensors = await asyncio.to_thread(group.receive, dtypes, shapes, device)
                if len(set(names)) != len(names):
                    raise ValueError("names lists a tensor twice")
                arrays = dict(zip(names, map(weight_transfer.to_array, tensors)))
                model = await asyncio.to_thread(self.load_tensors, self.engine.model, arrays)
                version = await asyncio.to_thread(self.engine.update_weights, model,
                                                  abort_in_flight=bool(body.get("abort_all_requests", False)))
            except (RuntimeError, ValueError) as e:  # a broken group or a tensor this model has not
                return _weights_error(f"Failed to update parameter online: {e}.")
            # A call without a version keeps the string (SGLang's behaviour); its tokens map to it.
            self._swapped(version, body.get("weight_version", self.weight_version))
        return json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's session around distributed updates, for clients that open one: this server
        swaps whole updates atomically, so it only keeps SGLang's rule that sessions do not nest."""
        if self._weight_session:
            return _weights_error("a weight-update session is already open; call end_weight_update() first")
        self._weight_session = True
        return json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        if not self._weight_session:
            return _weights_error("no weight-update session is open; call begin_weight_update() first")
        self._weight_session = False
        return json_response({"success": True, "message": "Success"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await json_or_empty(request)
        group = self._groups.pop(str(body.get("group_name", weight_transfer.DEFAULT_GROUP_NAME)), None)
        if group is None:
            return _weights_error("The group to be destroyed does not exist.")
        group.close()
        return json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    # -- reading back, pause, version -----------------------------------------------------------
    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's debug read: a parameter by its HF name, as float32 values (the first
        `truncate_size` rows, default 100)."""
        body = await json_or_empty(request)
        try:
            name, truncate = str(body["name"]), _int({"truncate_size": 100, **body}, "truncate_size")
        except (KeyError, BadRequest) as e:
            return error_response(f"get_weights_by_name: {e if isinstance(e, BadRequest) else f'missing {e}'}")
        if self.read_tensor is None:
            return error_response("this server cannot read weights by name")
        try:
            value = await asyncio.to_thread(self.read_tensor, self.engine.model, name)
        except ValueError as e:
            return error_response(f"Get parameter by name failed: {e}")
        return json_response(np.asarray(value[:truncate], np.float32).tolist())

    async def pause(self, request: web.Request) -> web.Response:
        body = await json_or_empty(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return error_response(f"pause_generation: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.engine.pause(mode)
        return json_response({"message": "Generation paused.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return json_response({"message": "Generation continued.", "status": "ok"})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.weight_version})

    async def memory_noop(self, request: web.Request) -> web.Response:
        return json_response(None)


def _weights_error(message: str) -> web.Response:
    return json_response({"success": False, "message": message}, status=400)


def _int(body: dict, field: str) -> int:
    value = body[field]
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{field} must be an integer, got {value!r}")
    return value
