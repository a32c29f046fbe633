"""Weight-update and pause routes of one SGLang server, mixed into `SGLangGenerator`.

Split from `rstar_jax.rollout.sglang` to keep the client class small: these routes belong to the
trainer's weight sync (`rstar_jax.train.weight_sync`), not to the rollout's data plane. They rest on
the client's transport (`_request`, which retries and maps HTTP errors to `SGLangError`s) and on its
state (`base_url`, `_version`, `_load_route`, `_pause_body`, `_weight_sessions`, set in
`SGLangGenerator.__init__`). The errors, statuses and route list are the client's
(`rstar_jax.rollout.sglang_errors`), and log records keep the client module's logger.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Sequence

from rstar_jax.rollout.sglang_errors import ABSENT_STATUSES, LOAD_ROUTES, SGLangError, SGLangRejected, error_message

log = logging.getLogger("rstar_jax.rollout.sglang")  # one logger for the whole client, as before the split

BODY_REJECTED_STATUSES = (400, 415, 422)  # a handler that takes no (or another) body
# Where the weight version is: `/model_info` (every 0.5.x build; the only one that follows updates in
# 0.5.23, where /get_weight_version is gone), the route older builds had, then the startup value.
WEIGHT_VERSION_ROUTES = ("/model_info", "/get_weight_version", "/get_server_info")


def parse_weight_version(value: Any) -> int | None:
    """SGLang's weight_version is a free string; numeric ones map to the policy version."""
    try:
        return int(str(value))
    except ValueError:
        return None


class SGLangWeightsMixin:
    """Prefix-cache flush, pause/continue, the weight version, and disk and distributed weight
    updates of one server; only `SGLangGenerator` uses it, which supplies the transport and state."""

    async def flush_cache(self, *, attempts: int = 20, interval_s: float = 0.5) -> None:
        """Flushes the prefix cache; SGLang refuses (400) while requests run, so this retries."""
        for _ in range(attempts):
            status, body = await self._request("POST", "/flush_cache", ok_statuses=(200, 400))
            if status == 200:
                return
            await asyncio.sleep(interval_s)
        raise SGLangError(f"{self.base_url}/flush_cache: still busy after {attempts} attempts: "
                                  f"{body}")

    async def pause(self, mode: str = "abort") -> None:
        """Pauses generation; new requests wait. "abort": running requests return partial output;
        "retract": they go back to the queue and are recomputed after `resume`; "in_place": they freeze.

        Late-2025 builds take no body and only abort: a server that refuses the body is asked again
        without one (mode "abort" only). Their handler may also ignore a body, so a mode other than
        "abort" is refused on servers without /v1/loads (the 2026 route set that has pause modes)."""
        if mode == "in_place":
            self._in_place_pauses += 1  # before the server freezes: a response racing it is labelled safely
        if mode != "abort":
            await self.loads()  # detects the route set once
            if self._pause_body is False or self._load_route != LOAD_ROUTES[0]:
                raise SGLangError(f"{self.base_url}/pause_generation: this server (no /v1/loads, a "
                                          f"pre-2026 build) does not support pause mode {mode!r}; only 'abort'")
        if self._pause_body is False:
            await self._request("POST", "/pause_generation")
            return
        status, body = await self._request("POST", "/pause_generation", {"mode": mode},
                                           ok_statuses=(200, *BODY_REJECTED_STATUSES))
        if status == 200:
            self._pause_body = True
            return
        if mode != "abort":
            raise SGLangError(f"{self.base_url}/pause_generation: HTTP {status} to mode {mode!r}; this "
                                      f"server does not support pause modes: {error_message(body)}")
        await self._request("POST", "/pause_generation")
        self._pause_body = False
        log.info("%s: /pause_generation takes no body (older SGLang); pausing in abort mode", self.base_url)

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def weight_version(self) -> str:
        """The server's weight_version: from `/model_info`, the route that follows weight updates on
        every 0.5.x build (`/get_weight_version` is 404 in 0.5.23), else the older route, else
        `/get_server_info`'s startup value."""
        for route in WEIGHT_VERSION_ROUTES:
            status, body = await self._request("GET", route, ok_statuses=(200, *ABSENT_STATUSES))
            if status == 200 and isinstance(body, dict) and body.get("weight_version") is not None:
                return str(body["weight_version"])
        raise SGLangError(f"{self.base_url}: no weight_version in any of {', '.join(WEIGHT_VERSION_ROUTES)}")

    async def update_weights_from_disk(self, model_path: str | os.PathLike, *, abort_all_requests: bool = False,
                                       weight_version: str | int | None = None, flush_cache: bool = True) -> dict:
        """Makes the server load an HF checkpoint directory.

        Without `abort_all_requests` (and unless paused) the server first lets running requests finish.
        """
        payload: dict[str, Any] = {"model_path": os.fspath(model_path), "abort_all_requests": abort_all_requests,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        _, body = await self._request("POST", "/update_weights_from_disk", payload, retry=False)
        if not isinstance(body, dict) or not body.get("success"):
            raise SGLangError(f"{self.base_url}/update_weights_from_disk failed: {body}")
        version = parse_weight_version(weight_version) if weight_version is not None else None
        if version is None:
            try:  # the weights are loaded: failing to read the version must not undo that
                version = parse_weight_version(await self.weight_version())
            except SGLangError as e:
                log.warning("%s: weights loaded from %s, but the weight version could not be read (%s); "
                            "keeping version %d", self.base_url, model_path, e, self._version)
        if version is not None:
            self._version = version
        return body

    # -- distributed weight update (trainer side: rstar_jax.train.weight_sync.DistributedSync) ------
    async def weight_update_ranks(self) -> int:
        """How many ranks this server joins a weight-update group with: one per GPU (tp_size) on
        SGLang, one for `rstar_jax.serve` (`weight_update_ranks`). Pipeline-parallel servers and DP
        without DP attention are refused, as SGLang cannot take part then."""
        info = await self.server_info()
        if "weight_update_ranks" in info:
            return int(info["weight_update_ranks"])
        if int(info.get("pp_size") or 1) > 1:
            raise SGLangError(f"{self.base_url}: pp_size {info['pp_size']} > 1: SGLang's weight-update "
                                      f"group ranks collide across pipeline stages (sglang#24643); use the disk "
                                      f"weight sync")
        if int(info.get("dp_size") or 1) > 1 and not info.get("enable_dp_attention"):
            raise SGLangError(f"{self.base_url}: dp_size {info['dp_size']} > 1 without DP attention: SGLang "
                                      f"refuses distributed weight updates; use the disk weight sync")
        return int(info.get("tp_size") or 1)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                        *, group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        """Makes the server join a torch.distributed group (its ranks from `rank_offset`) whose rank
        0 is the caller; answers once every rank has joined, so rank 0 joins while this is in flight."""
        payload = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                   "world_size": int(world_size), "group_name": group_name, "backend": backend}
        return await self._weights_call("/init_weights_update_group", payload)

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]], *,
                                              group_name: str = "weight_update_group",
                                              weight_version: str | int | None = None, flush_cache: bool = True,
                                              abort_all_requests: bool = False) -> dict:
        """Makes the server receive the listed tensors (HF names, dtype names such as "bfloat16",
        shapes) from rank 0's broadcasts in this order and load them; the caller broadcasts while
        this is in flight. The server reports `weight_version` afterwards when given."""
        payload: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                                   "group_name": group_name, "flush_cache": flush_cache,
                                   "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        body = await self._weights_call("/update_weights_from_distributed", payload)
        version = parse_weight_version(weight_version) if weight_version is not None else None
        if version is not None:
            self._version = version
        return body

    async def begin_weight_update(self) -> bool:
        """Opens the server's weight-update session: SGLang 0.5.23 loads distributed (and tensor)
        updates only between `/begin_weight_update` and `/end_weight_update`. A session an earlier
        trainer left open is closed first. False where the route is absent (older builds): updates
        load without one there."""
        if self._weight_sessions is False:
            return False
        for attempt in range(2):
            status, body = await self._request("POST", "/begin_weight_update", {}, retry=False, idempotent=False,
                                               ok_statuses=(200, 400, *ABSENT_STATUSES))
            if status in ABSENT_STATUSES:
                self._weight_sessions = False
                return False
            if status == 200:
                self._weight_sessions = True
                return True
            if attempt == 0 and "already open" in error_message(body):
                await self.end_weight_update()
                continue
            raise SGLangRejected(f"{self.base_url}/begin_weight_update: {error_message(body)}")
        raise AssertionError("unreachable")

    async def end_weight_update(self) -> None:
        """Closes the session `begin_weight_update` opened (no-op where the server has none)."""
        if self._weight_sessions is False:
            return
        await self._weights_call("/end_weight_update", {})

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._weights_call("/destroy_weights_update_group", {"group_name": group_name})

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """One parameter by its HF name as float32 values (SGLang's debug read): its first
        `truncate_size` rows."""
        _, body = await self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        if not isinstance(body, list):
            raise SGLangError(f"{self.base_url}/get_weights_by_name {name!r}: unexpected response "
                                      f"{str(body)[:200]}")
        return body

    async def _weights_call(self, path: str, payload: dict) -> dict:
        # Sent once: each is a collective with the caller's broadcasts, never to be repeated.
        _, body = await self._request("POST", path, payload, retry=False, idempotent=False)
        if not isinstance(body, dict) or not body.get("success"):
            raise SGLangError(f"{self.base_url}{path} failed: {body}")
        return body
