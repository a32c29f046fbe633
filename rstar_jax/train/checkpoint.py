"""Checkpoints of a training run with Orbax: saves are asynchronous, restores land sharded.

One checkpoint step holds
- `model`: the policy's NNX state (every variable, as a pure dict of arrays),
- `optimizer`: the optimizer's NNX state (step count and moments; the fp32 master weights under
  `optim.master_weights`), when given,
- `meta` (JSON): step, stage, the RNG key data, and wall time,
- `data` (JSON): the data-iterator state (`PromptIterator.get_state()`),
- `config` (JSON): the run's config.

Restores go straight into the shardings of the live targets (or of any pytree of
`jax.ShapeDtypeStruct` with `sharding` set), so no host holds a full copy of the parameters.

    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=3)
    ckpt.save(step, model=model, optimizer=optimizer, rng=key, data_state=it.get_state(), config=config)
    restored = ckpt.restore(model=model, optimizer=optimizer)      # latest step, in place
    ckpt.close()
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from rstar_jax.errors import ConfigError
from rstar_jax.train.run_files import (  # noqa: F401  (stored_config: re-exported)
    CheckpointError,
    checkpoint_steps,
    checkpoints_directory,
    stored_config,
)

# export_hf(step, directory, optimizer): the optimizer saved with the step (None without one), whose
# master weights, when it keeps them, are what an export should write (`train.step.with_master_weights`).
ExportHook = Callable[[int, pathlib.Path, Any], Any]


@dataclasses.dataclass
class RestoredState:
    step: int
    stage: str
    rng: jax.Array | None
    data_state: dict | None
    config: dict | None
    optimizer_restored: bool  # False when reset_optimizer was requested or none was saved
    model_state: Any = None  # pure dict (also written into `model` when one was passed)
    optimizer_state: Any = None


def abstract_state(tree: Any) -> Any:
    """ShapeDtypeStructs (with the arrays' shardings) for every array leaf of a pytree."""
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.tree.map(leaf, tree)


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _pure_state(obj: Any) -> Any:
    """An nnx object or State -> pure nested dict of arrays; any other pytree passes through."""
    if isinstance(obj, nnx.Pytree):
        obj = nnx.state(obj)
    if isinstance(obj, nnx.State):
        return nnx.to_pure_dict(obj)
    return obj


def _storable(tree: Any) -> Any:
    """Typed PRNG keys (e.g. the keys inside nnx.Rngs) become their uint32 key data for storage."""
    def leaf(x):
        if not _is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            data = jax.eval_shape(jax.random.key_data, x)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))
        return jax.random.key_data(x)
    return jax.tree.map(leaf, tree)


# Key dtype names (str(dtype)) -> PRNG implementation names, for abstract (ShapeDtypeStruct) targets.
_KEY_IMPLS = {"key<fry>": "threefry2x32", "key<rbg>": "rbg", "key<urbg>": "unsafe_rbg"}


def _rekey(target: Any, restored: Any) -> Any:
    """Wraps restored key data back into typed keys wherever the target holds typed keys."""
    def leaf(t, r):
        if not _is_key(t):
            return r
        impl = _KEY_IMPLS.get(str(t.dtype)) if isinstance(t, jax.ShapeDtypeStruct) else jax.random.key_impl(t)
        return jax.random.wrap_key_data(r, impl=impl)
    return jax.tree.map(leaf, target, restored)


def _rng_to_json(rng: jax.Array | None) -> dict | None:
    if rng is None:
        return None
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    data = np.asarray(jax.random.key_data(rng) if typed else rng)
    out = {"typed": bool(typed), "data": data.astype(np.uint32).tolist(), "shape": list(data.shape)}
    if typed:
        out["impl"] = str(jax.random.key_impl(rng))
    return out


def _rng_from_json(entry: dict | None) -> jax.Array | None:
    if entry is None:
        return None
    data = np.asarray(entry["data"], np.uint32).reshape(entry["shape"])
    if entry["typed"]:
        return jax.random.wrap_key_data(data, impl=entry.get("impl"))
    return jax.numpy.asarray(data)


def _config_to_json(config: Any) -> dict | None:
    if config is None:
        return None
    if hasattr(config, "to_json_best_effort"):
        return json.loads(config.to_json_best_effort())
    return json.loads(json.dumps(config, default=str))


class Checkpointer:
    """An Orbax `CheckpointManager` for model, optimizer, RNG, data-iterator state and config."""

    def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 3, async_save: bool = True,
                 save_every: int = 1, export_hf: ExportHook | None = None, export_every: int = 0,
                 export_dir: str | pathlib.Path | None = None):
        if max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep must be >= 1, got {max_to_keep}")
        if save_every < 1:
            raise ValueError(f"Checkpointer: save_every must be >= 1, got {save_every}")
        if export_every < 0:
            raise ValueError(f"Checkpointer: export_every must be >= 0, got {export_every}")
        self.directory = pathlib.Path(directory).absolute()
        self.save_every = save_every
        self.export_hf = export_hf
        self.export_every = export_every
        self.export_dir = pathlib.Path(export_dir) if export_dir else self.directory.parent / "hf"
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

    # -- saving ---------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return step % self.save_every == 0

    def save(self, step: int, *, model: Any, optimizer: Any = None, rng: jax.Array | None = None,
             data_state: dict | None = None, stage: str = "", config: Any = None, force: bool = False) -> bool:
        """Starts an (async) save of everything at `step`; returns whether a save happened.

        Without `force`, saves only on multiples of `save_every`. The HF export hook runs on the
        saved steps that are multiples of `export_every` (synchronously, with the live model), so
        choose `export_every` as a multiple of `save_every`.
        """
        if not force and not self.should_save(step):
            return False
        items = {
            "model": ocp.args.StandardSave(_storable(_pure_state(model))),
            "meta": ocp.args.JsonSave({"step": int(step), "stage": stage, "rng": _rng_to_json(rng),
                                       "has_optimizer": optimizer is not None, "time": time.time()}),
            "data": ocp.args.JsonSave(data_state if data_state is not None else {}),
            "config": ocp.args.JsonSave(_config_to_json(config) or {}),
        }
        if optimizer is not None:
            items["optimizer"] = ocp.args.StandardSave(_storable(_pure_state(optimizer)))
        saved = self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        if self.export_hf is not None and self.export_every and step % self.export_every == 0:
            self.export_hf(step, self.export_dir / f"step_{step}", optimizer)
        return bool(saved)

    # -- restoring ------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore(self, step: int | None = None, *, model: Any, optimizer: Any = None,
                reset_optimizer: bool = False) -> RestoredState:
        """Restores `step` (default: latest) into the shardings of `model` / `optimizer`.

        `model` and `optimizer` are live nnx objects (updated in place) or pytrees of arrays /
        ShapeDtypeStructs describing the targets. With `reset_optimizer`, the optimizer state is
        left as it is (freshly initialised by the caller), as for the stage-3 reset.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint in {self.directory}")
        if step not in self._manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} "
                                  f"(available: {self.all_steps()})")
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        metadata = self._manager.item_metadata(step)
        model_pure = _pure_state(model)
        model_target = _storable(abstract_state(model_pure))
        where = f"{self.directory} step {step}"
        _check_target(metadata["model"], model_target, f"{where} model")
        want_optimizer = optimizer is not None and not reset_optimizer
        if want_optimizer and not meta.get("has_optimizer"):
            raise CheckpointError(f"checkpoint step {step} in {self.directory} has no optimizer state; "
                                  f"restore with reset_optimizer=True to start a fresh optimizer")
        # Master weights (optim.master_weights): the run's optimizer may keep them where the
        # checkpoint's did not, or the other way round (`_MasterPlan`).
        optimizer_pure = _pure_state(optimizer) if optimizer is not None else None
        saved_optimizer = _tree(metadata["optimizer"]) if meta.get("has_optimizer") else None
        plan = _MasterPlan(model_target, optimizer_pure, saved_optimizer, want_optimizer)
        items = {"model": ocp.args.StandardRestore(plan.model_target),
                 "meta": ocp.args.JsonRestore(), "data": ocp.args.JsonRestore(),
                 "config": ocp.args.JsonRestore()}
        if plan.optimizer_target is not None:
            _check_target(metadata["optimizer"], plan.optimizer_target, f"{where} optimizer")
            items["optimizer"] = ocp.args.StandardRestore(plan.optimizer_target)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} does not match the restore "
                                  f"target: {e}") from None
        model_state, optimizer_state = plan.finish(_rekey(model_pure, restored["model"]), restored.get("optimizer"))
        _write_back(model, model_state)
        if optimizer_state is not None:
            _write_back(optimizer, optimizer_state)
            if not want_optimizer:
                optimizer_state = None  # only its master weights were set
        return RestoredState(step=int(meta["step"]), stage=meta.get("stage", ""), rng=_rng_from_json(meta.get("rng")),
                             data_state=restored["data"] or None, config=restored["config"] or None,
                             optimizer_restored=want_optimizer, model_state=model_state,
                             optimizer_state=optimizer_state)

    def wait(self) -> None:
        """Blocks until pending async saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _handlers() -> dict:
    return {"model": ocp.StandardCheckpointHandler(), "optimizer": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler()}


def _flat(tree: Any) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in flat}


def _check_target(metadata: Any, target: Any, where: str) -> None:
    """Same tensor names and shapes in the checkpoint and the restore target, named when not."""
    saved = _flat(getattr(metadata, "tree", metadata))
    wanted = _flat(target)
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    if missing or unexpected:
        raise CheckpointError(f"{where} does not match the restore target: missing in the checkpoint "
                              f"{missing[:8]}, not in the target {unexpected[:8]}")
    for name, leaf in wanted.items():
        if tuple(saved[name].shape) != tuple(leaf.shape):
            raise CheckpointError(f"{where} does not match the restore target: tensor {name} has shape "
                                  f"{tuple(saved[name].shape)} in the checkpoint, {tuple(leaf.shape)} in the target")


MASTER = "master"  # the key of master weights in an optimizer's state (`train.step.MasterWeightsOptimizer`)


def _tree(metadata: Any) -> Any:
    return getattr(metadata, "tree", metadata)


class _MasterPlan:
    """How master weights travel between a checkpoint and the run restoring it.

    - Both keep them, or neither: restored as they are.
    - The run keeps them, the checkpoint's optimizer did not (a run that trained fp32 parameters, or
      a restore with reset_optimizer): the master is the checkpoint's parameters read at the master's
      precision (fp32 ones lose nothing); with reset_optimizer and a saved master, the saved master.
    - The checkpoint keeps them, the run does not (optim.master_weights=''): restoring the optimizer,
      the parameters are the checkpoint's master cast to the run's parameter dtype (fp32 parameters get
      its full precision); a restore of the model alone reads the checkpoint's parameters.
    """

    def __init__(self, model_target: Any, optimizer_pure: Any, saved_optimizer: Any, want_optimizer: bool):
        self.model_target = model_target
        self.optimizer_target = None
        self.run_master = isinstance(optimizer_pure, dict) and MASTER in optimizer_pure
        self.saved_master = isinstance(saved_optimizer, dict) and MASTER in saved_optimizer
        self.optimizer_pure = optimizer_pure
        self.master_from_model = False
        self.want_optimizer = want_optimizer
        flat_model = _flat(model_target)
        self.model_dtypes = {name: leaf.dtype for name, leaf in flat_model.items()}
        if self.run_master:
            master_target = _storable(abstract_state(optimizer_pure[MASTER]))
            self.master_names = list(_flat(master_target))
            full_target = _storable(abstract_state(optimizer_pure))
            if want_optimizer and self.saved_master:
                self.optimizer_target = full_target
            elif not want_optimizer and self.saved_master and _matches(saved_optimizer, full_target):
                self.optimizer_target = full_target  # read for its master only
            else:
                # The parameters read at the master's dtype: the model's dtype is cast from them.
                self.master_from_model = True
                flat_master = _flat(master_target)
                self.model_target = _unflat(model_target, {**flat_model, **flat_master})
                if want_optimizer:
                    self.optimizer_target = {k: v for k, v in full_target.items() if k != MASTER}
        elif want_optimizer:
            target = _storable(abstract_state(optimizer_pure))
            if self.saved_master:
                # The saved master, placed as the parameters are, in its saved dtype.
                saved = _flat(saved_optimizer[MASTER])
                placed = {name: jax.ShapeDtypeStruct(flat_model[name].shape, saved[name].dtype,
                                                     sharding=getattr(flat_model[name], "sharding", None))
                          for name in saved if name in flat_model}
                if len(placed) != len(saved):
                    raise CheckpointError(f"the checkpoint's master weights {sorted(set(saved) - set(placed))[:8]} "
                                          f"are not parameters of the model restoring it")
                self.master_names = list(saved)
                target = {**target, MASTER: _unflat(saved_optimizer[MASTER], placed)}
            self.optimizer_target = target

    def finish(self, model_state: Any, optimizer_state: Any) -> tuple[Any, Any]:
        """(model state, optimizer state to write back or None) from what was restored."""
        if self.run_master and self.master_from_model:
            flat = _flat(model_state)
            master = _unflat(self.optimizer_pure[MASTER], {name: flat[name] for name in self.master_names})
            model_state = _unflat(model_state, {name: flat[name].astype(self.model_dtypes[name])
                                                for name in self.master_names})
            base = optimizer_state if optimizer_state is not None else self.optimizer_pure
            return model_state, {**base, MASTER: master}
        if self.run_master and not self.want_optimizer and optimizer_state is not None:
            return model_state, {**self.optimizer_pure, MASTER: optimizer_state[MASTER]}  # its master only
        if not self.run_master and self.saved_master and optimizer_state is not None:
            optimizer_state = dict(optimizer_state)
            master = _flat(optimizer_state.pop(MASTER))
            model_state = _unflat(model_state, {name: master[name].astype(self.model_dtypes[name]) for name in master})
        return model_state, optimizer_state


def _matches(saved: Any, target: Any) -> bool:
    saved, wanted = _flat(saved), _flat(target)
    return set(saved) == set(wanted) and all(tuple(saved[k].shape) == tuple(wanted[k].shape) for k in wanted)


def _unflat(tree: Any, values: dict[str, Any]) -> Any:
    """`tree` with the leaves named in `values` (`_flat`'s names) replaced."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: values.get(jax.tree_util.keystr(path, simple=True, separator="."), leaf), tree)


def _write_back(target: Any, pure: Any) -> None:
    """Writes a restored pure dict into a live nnx object (no-op for plain pytrees)."""
    if isinstance(target, nnx.Pytree):
        state = nnx.state(target)
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(target, state)


# -- run directories and policy resolution --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PolicySource:
    """Where a policy comes from: an HF directory, an orbax checkpoint, or servers already serving it."""

    kind: str  # "hf" | "checkpoint" | "servers"
    path: str = ""  # HF directory or the orbax checkpoints directory
    step: int | None = None  # resolved checkpoint step
    urls: tuple[str, ...] = ()
    field: str = "model.hf_path"  # the config field that named it (for errors)

    def identity(self) -> dict:
        """What a resumable evaluation records: the same policy on resume (URLs may change)."""
        if self.kind == "servers":
            return {"kind": "servers"}
        out = {"kind": self.kind, "path": str(pathlib.Path(self.path).resolve())}
        if self.kind == "checkpoint":
            out["step"] = self.step
        return out


def policy_source(*, hf_path: str = "", checkpoint_dir: str = "", checkpoint_step: int | None = None,
                  generator_urls: Sequence[str] = (), prefix: str = "eval", fallback_dir: str = "",
                  fallback_field: str = "") -> PolicySource:
    """Resolves a policy: servers, else an orbax checkpoint (`<prefix>.checkpoint_dir`), else the HF
    directory `model.hf_path`, else `fallback_dir` (a checkpoint directory named by `fallback_field`).
    Errors are ConfigErrors naming the field."""
    if generator_urls:
        return PolicySource("servers", urls=tuple(generator_urls), field=f"{prefix}.generator_urls")
    if checkpoint_dir and hf_path:
        raise ConfigError(f"config.{prefix}.checkpoint_dir: set either model.hf_path (an HF directory) or "
                          f"{prefix}.checkpoint_dir (an orbax run), not both")
    field = f"{prefix}.checkpoint_dir"
    if not checkpoint_dir and not hf_path and fallback_dir:
        checkpoint_dir, field = fallback_dir, fallback_field
    if checkpoint_dir:
        if not pathlib.Path(checkpoint_dir).is_dir():
            raise ConfigError(f"config.{field}: {checkpoint_dir} is not a directory")
        directory = checkpoints_directory(checkpoint_dir)
        steps = checkpoint_steps(directory)
        if not steps:
            raise ConfigError(f"config.{field}: no committed orbax checkpoint in {directory} (expected a run "
                              f"directory or its checkpoints/ directory)")
        if checkpoint_step is None:
            step = steps[-1]
        elif checkpoint_step in steps:
            step = checkpoint_step
        else:
            raise ConfigError(f"config.{prefix}.checkpoint_step: no step {checkpoint_step} in {directory} "
                              f"(available: {steps})")
        return PolicySource("checkpoint", path=str(directory), step=step, field=field)
    if hf_path:
        if not pathlib.Path(hf_path, "config.json").is_file():
            raise ConfigError(f"config.model.hf_path: {hf_path} is not a Hugging Face model directory (no config.json)")
        return PolicySource("hf", path=hf_path, field="model.hf_path")
    raise ConfigError(f"config.{prefix}.checkpoint_dir: no policy: set model.hf_path, {prefix}.checkpoint_dir or "
                      f"{prefix}.generator_urls")
