"""Hugging Face checkpoint import and export for Qwen3.

The key mapping is one table (`HF_PARAM_MAP`): each row names a Hugging Face tensor (with ``{i}``
for the layer index), our parameter, and how the matrix is laid out on each side. Loading streams
tensor by tensor from memory-mapped safetensors files: every device shard of a parameter is read
straight from disk through `jax.make_array_from_callback`, so no host ever assembles a full
parameter it does not own. Export (`save_pretrained`) lays every parameter out as Hugging Face does
and casts it on the parameter's own devices (`hf_blocks`), gathers it to the host and writes
safetensors shards from a thread pool, with an index and a transformers-5 config.json that
transformers and SGLang load. `update_from_hf_tensors` is the way back for tensors that arrive in
memory (SGLang's distributed weight update); `hf_tensor` reads one parameter by its HF name.

The safetensors container format (an 8-byte header length, a JSON header, raw little-endian data)
is read and written here directly because the numpy bindings of the `safetensors` package cannot
represent bfloat16.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import os
import pathlib
import shutil
import struct
from typing import Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.typing import ArrayLike, DTypeLike

from rstar_jax.model.qwen3 import Qwen3, Qwen3Config, abstract_model, dtype_name
from rstar_jax.model.sharding import DEFAULT_RULES, param_shardings, set_activation_shardings

# ---------------------------------------------------------------------------------------------
# The mapping table.
# layout: how the HF matrix [out, in] relates to ours:
#   "same"      identical shape (norm weights, the embedding)
#   "t"         ours = hf.T                              ([in, out])
#   "t_heads"   ours = hf.T.reshape(in, heads, head_dim)  (q/k/v projections)
#   "heads_t"   ours = hf.T.reshape(heads, head_dim, out) (o projection)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    hf_key: str  # "{i}" stands for the layer index
    param: str  # attribute of Qwen3
    layout: str
    stacked: bool  # one HF tensor per layer, stacked on our leading "layers" axis


HF_PARAM_MAP: tuple[ParamMapping, ...] = (
    ParamMapping("model.embed_tokens.weight", "embed", "same", False),
    ParamMapping("model.norm.weight", "final_norm", "same", False),
    ParamMapping("lm_head.weight", "lm_head", "t", False),
    ParamMapping("model.layers.{i}.input_layernorm.weight", "input_norm", "same", True),
    ParamMapping("model.layers.{i}.self_attn.q_proj.weight", "q_proj", "t_heads", True),
    ParamMapping("model.layers.{i}.self_attn.k_proj.weight", "k_proj", "t_heads", True),
    ParamMapping("model.layers.{i}.self_attn.v_proj.weight", "v_proj", "t_heads", True),
    ParamMapping("model.layers.{i}.self_attn.o_proj.weight", "o_proj", "heads_t", True),
    ParamMapping("model.layers.{i}.self_attn.q_norm.weight", "q_norm", "same", True),
    ParamMapping("model.layers.{i}.self_attn.k_norm.weight", "k_norm", "same", True),
    ParamMapping("model.layers.{i}.post_attention_layernorm.weight", "post_attn_norm", "same", True),
    ParamMapping("model.layers.{i}.mlp.gate_proj.weight", "gate_proj", "t", True),
    ParamMapping("model.layers.{i}.mlp.up_proj.weight", "up_proj", "t", True),
    ParamMapping("model.layers.{i}.mlp.down_proj.weight", "down_proj", "t", True),
)


def _param_mappings(config: Qwen3Config) -> list[ParamMapping]:
    return [m for m in HF_PARAM_MAP if not (m.param == "lm_head" and config.tie_word_embeddings)]


def _hf_shape(layout: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "same":
        return ours
    if layout == "t":
        return (ours[1], ours[0])
    if layout == "t_heads":  # ours [in, heads, hd]
        return (ours[1] * ours[2], ours[0])
    if layout == "heads_t":  # ours [heads, hd, out]
        return (ours[2], ours[0] * ours[1])
    raise ValueError(f"unknown layout {layout!r}")


def _to_ours(layout: str, hf: np.ndarray, ours_shape: tuple[int, ...]) -> np.ndarray:
    if layout == "same":
        return hf
    if layout == "t":
        return hf.T
    if layout in ("t_heads", "heads_t"):
        return hf.T.reshape(ours_shape)
    raise ValueError(f"unknown layout {layout!r}")


def _to_hf(layout: str, ours: np.ndarray) -> np.ndarray:
    if layout == "same":
        return ours
    if layout == "t":
        return ours.T
    if layout == "t_heads":
        return ours.reshape(ours.shape[0], -1).T
    if layout == "heads_t":
        return ours.reshape(-1, ours.shape[-1]).T
    raise ValueError(f"unknown layout {layout!r}")


# ---------------------------------------------------------------------------------------------
# safetensors container I/O
# ---------------------------------------------------------------------------------------------
_ST_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, tensor or field."""


@dataclasses.dataclass(frozen=True)
class _TensorRef:
    file: pathlib.Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file


class SafetensorsReader:
    """Lazy, memory-mapped access to the tensors of one or several safetensors files."""

    def __init__(self, files: Iterable[pathlib.Path]):
        self._refs: dict[str, _TensorRef] = {}
        self._maps: dict[pathlib.Path, np.memmap] = {}
        for file in files:
            self._index_file(pathlib.Path(file))

    def _index_file(self, file: pathlib.Path) -> None:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{file}: not a safetensors file (shorter than its header)")
            (header_len,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{file}: unreadable safetensors header ({e})") from None
        size = file.stat().st_size
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"{file}: tensor {key!r} has unsupported dtype {info['dtype']}")
            dtype = _ST_DTYPES[info["dtype"]]
            start, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or 8 + header_len + end > size:
                raise CheckpointError(f"{file}: tensor {key!r} has inconsistent offsets (truncated file?)")
            if key in self._refs:
                raise CheckpointError(f"tensor {key!r} appears in both {self._refs[key].file} and {file}")
            self._refs[key] = _TensorRef(file, dtype, shape, 8 + header_len + start)

    def keys(self) -> list[str]:
        return list(self._refs)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._refs[key].shape

    def get(self, key: str) -> np.ndarray:
        ref = self._refs[key]
        if ref.file not in self._maps:
            self._maps[ref.file] = np.memmap(ref.file, dtype=np.uint8, mode="r")
        count = int(np.prod(ref.shape, dtype=np.int64))
        data = self._maps[ref.file][ref.offset: ref.offset + count * ref.dtype.itemsize]
        return data.view(ref.dtype).reshape(ref.shape)

    def __contains__(self, key: str) -> bool:
        return key in self._refs


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for key, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {key!r}: dtype {arr.dtype} cannot be written to safetensors")
        header[key] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                       "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))  # no copy; the write releases the GIL
    os.replace(tmp, path)


def _checkpoint_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} names {f.name}, which does not exist")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{path}: no model.safetensors, index or *.safetensors files")
    return found


def load_config(path: str | os.PathLike, **overrides) -> Qwen3Config:
    cfg_path = pathlib.Path(path) / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{cfg_path} does not exist")
    return Qwen3Config.from_hf_dict(json.loads(cfg_path.read_text()), **overrides)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def load_pretrained(
    path: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence | None = None,
    dtype: DTypeLike | None = None,
    param_dtype: DTypeLike | None = None,
    config_overrides: dict | None = None,
) -> Qwen3:
    """Loads a Hugging Face Qwen3 directory into a (sharded) `Qwen3`.

    `dtype` (compute) and `param_dtype` are names or JAX/NumPy dtypes (`"bfloat16"`, `jnp.bfloat16`);
    by default computation and parameters are float32. Every expected tensor must be present with
    the expected shape, and no unexpected tensor may be left over; otherwise a `CheckpointError`
    names the tensor and nothing is returned.
    """
    path = pathlib.Path(path)
    overrides = dict(config_overrides or {})
    if dtype is not None:
        overrides["dtype"] = dtype_name(dtype, "load_pretrained.dtype")
    if param_dtype is not None:
        overrides["param_dtype"] = dtype_name(param_dtype, "load_pretrained.param_dtype")
    config = load_config(path, **overrides)
    reader = SafetensorsReader(_checkpoint_files(path))
    abstract = abstract_model(config)
    graphdef, abstract_state = nnx.split(abstract)
    target_dtype = np.dtype(jnp.dtype(config.param_dtype))

    # Validate every tensor before reading any data: nothing is half-loaded.
    expected: set[str] = set()
    mappings = _param_mappings(config)
    for m in mappings:
        ours_shape = tuple(getattr(abstract, m.param).shape)
        per_layer = ours_shape[1:] if m.stacked else ours_shape
        want = _hf_shape(m.layout, per_layer)
        keys = [m.hf_key.format(i=i) for i in range(config.num_layers)] if m.stacked else [m.hf_key]
        for key in keys:
            expected.add(key)
            if key not in reader:
                raise CheckpointError(f"{path}: missing tensor {key!r} (for parameter {m.param})")
            if reader.shape(key) != want:
                raise CheckpointError(
                    f"{path}: tensor {key!r} has shape {reader.shape(key)}, expected {want} "
                    f"for config {config.num_layers}L/{config.hidden_size}d"
                )
    unexpected = sorted(k for k in reader.keys() if k not in expected)
    # Tied checkpoints sometimes still carry lm_head.weight; it must equal the embedding then.
    if config.tie_word_embeddings and unexpected == ["lm_head.weight"]:
        unexpected = []
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensors not used by Qwen3: {unexpected[:8]}")

    shardings = param_shardings(abstract_state, mesh, rules or DEFAULT_RULES) if mesh is not None else None
    loaded = {}
    for m in mappings:
        var = getattr(abstract, m.param)
        shape = tuple(var.shape)

        def read(index, m=m, shape=shape):
            # index: a tuple of slices into our parameter; read only the layers this shard needs.
            if m.stacked:
                layers = range(*index[0].indices(shape[0]))
                block = np.stack([_to_ours(m.layout, reader.get(m.hf_key.format(i=i)), shape[1:])
                                  for i in layers])
                block = block[(slice(None),) + tuple(index[1:])]
            else:
                block = _to_ours(m.layout, reader.get(m.hf_key), shape)[tuple(index)]
            return np.ascontiguousarray(block.astype(target_dtype))

        if shardings is not None:
            sharding = shardings[m.param]
        else:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        loaded[m.param] = jax.make_array_from_callback(shape, sharding, read)

    model = nnx.merge(graphdef, abstract_state)
    for name, value in loaded.items():
        getattr(model, name).set_value(value)
    if mesh is not None:
        set_activation_shardings(model, mesh, rules or DEFAULT_RULES)
    return model


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------

def host_value(x: jax.Array) -> np.ndarray:
    """The whole array on this host. An array that spans several processes is all-gathered: every
    process must call this for the same arrays in the same order."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


@functools.partial(jax.jit, static_argnames=("layout", "stacked", "dtype"))
def _hf_block(value: jax.Array, layout: str, stacked: bool, dtype: str) -> jax.Array:
    # On the parameter's own devices: XLA transposes and casts a whole stacked parameter several
    # times faster than NumPy does per layer on the host, and a GPU's arrays never leave the GPU.
    to_hf = functools.partial(_to_hf, layout)
    return (jax.vmap(to_hf)(value) if stacked else to_hf(value)).astype(dtype)


def hf_blocks(model: Qwen3, dtype: DTypeLike | None = None) -> Iterator[tuple[ParamMapping, jax.Array]]:
    """(mapping, array) per parameter in `HF_PARAM_MAP` order: the parameter in Hugging Face layout
    and `dtype` (default `config.param_dtype`), computed on the parameter's devices with its
    sharding; a stacked parameter is [layers, *hf_shape] (layer i is HF tensor `hf_key` with i)."""
    config = model.config
    out = dtype_name(config.param_dtype if dtype is None else dtype, "hf_tensors.dtype")
    for m in _param_mappings(config):
        yield m, _hf_block(getattr(model, m.param)[...], m.layout, m.stacked, out)


def hf_keys(m: ParamMapping, config: Qwen3Config) -> list[str]:
    """The HF tensor names of one mapping row, in layer order."""
    return [m.hf_key.format(i=i) for i in range(config.num_layers)] if m.stacked else [m.hf_key]


def hf_shapes(model: Qwen3) -> list[tuple[str, tuple[int, ...]]]:
    """(hf_key, shape) of every tensor, in `hf_tensors` order, from the parameters' shapes alone."""
    out = []
    for m in _param_mappings(model.config):
        ours = tuple(getattr(model, m.param).shape)
        shape = _hf_shape(m.layout, ours[1:] if m.stacked else ours)
        out.extend((key, shape) for key in hf_keys(m, model.config))
    return out


def _host_tensors(model: Qwen3, dtype: DTypeLike | None) -> Iterator[tuple[str, np.ndarray]]:
    # Every process runs the same transforms and gathers, in the same order (they are collectives
    # when parameters span processes); per-layer tensors are views of the gathered block.
    for m, block in hf_blocks(model, dtype):
        host = host_value(block)
        if m.stacked:
            yield from zip(hf_keys(m, model.config), host)
        else:
            yield m.hf_key, host


def hf_tensors(model: Qwen3, dtype: DTypeLike | None = None) -> Iterable[tuple[str, np.ndarray]]:
    """Yields (hf_key, array) one tensor at a time, gathered to the host, in `dtype` (a name or a
    JAX/NumPy dtype; default `config.param_dtype`). Every process of a multi-process job must
    iterate it to the end (the gathers are collectives)."""
    return _host_tensors(model, dtype)


def _hf_index(config: Qwen3Config) -> dict[str, tuple[ParamMapping, int | None]]:
    """HF tensor name -> (mapping row, layer index or None)."""
    index = {}
    for m in _param_mappings(config):
        for i, key in enumerate(hf_keys(m, config)):
            index[key] = (m, i if m.stacked else None)
    return index


def hf_tensor(model: Qwen3, name: str) -> np.ndarray:
    """One parameter as Hugging Face names and lays it out (in the parameter's dtype), on the host:
    what SGLang's `/get_weights_by_name` reads. A tied model answers `lm_head.weight` with the
    embedding, as SGLang does."""
    config = model.config
    if name == "lm_head.weight" and config.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    if name not in (index := _hf_index(config)):
        raise CheckpointError(f"no tensor {name!r} in this Qwen3 ({config.num_layers} layers)")
    m, layer = index[name]
    value = getattr(model, m.param)[...]
    value = value[layer] if layer is not None else value
    return host_value(_hf_block(value, m.layout, False, dtype_name(value.dtype)))


def update_from_hf_tensors(model: Qwen3, tensors: Mapping[str, ArrayLike]) -> Qwen3:
    """A copy of `model` whose parameters named by `tensors` (Hugging Face names and layouts, e.g.
    received from a trainer) take those values, cast to the parameter's dtype; every other
    parameter is shared with `model`, which is left unchanged. A stacked parameter may receive only
    some of its layers. Values may be NumPy or JAX arrays; they are laid out on device and placed
    with the parameter's sharding.

    Every name and shape is checked before anything is built: a `CheckpointError` names the first
    unknown tensor or wrong shape. A tied model ignores `lm_head.weight`, as SGLang's loader does.
    """
    config = model.config
    index = _hf_index(config)
    by_param: dict[str, dict[int | None, ArrayLike]] = {}
    for name, value in tensors.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in index:
            raise CheckpointError(f"tensor {name!r} is not a parameter of this Qwen3 ({config.num_layers} layers)")
        m, layer = index[name]
        ours = tuple(getattr(model, m.param).shape)
        want = _hf_shape(m.layout, ours[1:] if m.stacked else ours)
        if tuple(value.shape) != want:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {want}")
        by_param.setdefault(m.param, {})[layer] = value
    mappings = {m.param: m for m in _param_mappings(config)}
    updated = nnx.merge(*nnx.split(model), copy=True)  # new variables over the same arrays
    for param, parts in by_param.items():
        m, current = mappings[param], getattr(model, param)[...]
        if not m.stacked:
            value = _to_ours(m.layout, jnp.asarray(parts[None]), current.shape).astype(current.dtype)
        else:
            layers = sorted(parts)
            block = jnp.stack([_to_ours(m.layout, jnp.asarray(parts[i]), current.shape[1:]) for i in layers])
            block = block.astype(current.dtype)
            value = block if len(layers) == config.num_layers else current.at[np.asarray(layers)].set(block)
        getattr(updated, param).set_value(jax.device_put(value, current.sharding))
    return updated


# What transformers, SGLang and our HF tokenizer read from a checkpoint directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")
DEFAULT_MAX_SHARD_BYTES = 4 << 30
DEFAULT_WRITER_THREADS = 8


def save_pretrained(
    model: Qwen3,
    path: str | os.PathLike,
    *,
    dtype: DTypeLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    writer_threads: int = DEFAULT_WRITER_THREADS,
    tokenizer_dir: str | os.PathLike | None = None,
    stop_token_ids: Sequence[int] = (),
) -> pathlib.Path:
    """Writes config.json, generation_config.json and safetensors (sharded with an index when large).

    `dtype`: the tensors' dtype, a name or a JAX/NumPy dtype (default `config.param_dtype`); the
    conversion and the HF layout are computed on the parameters' devices.
    `max_shard_bytes`: tensors go into `model-0000k-of-0000N.safetensors` shards of at most this
    size (one larger tensor gets a shard of its own) with `model.safetensors.index.json`; a single
    shard is `model.safetensors`.
    `writer_threads`: shards are written by this many threads while the next ones are filled (at
    most that many wait in memory); the files are the same bytes whatever the count.
    `tokenizer_dir`: its tokenizer files (`TOKENIZER_FILES`) are copied beside the weights, so the
    directory is a whole checkpoint for the next stage, transformers and SGLang; its
    generation_config.json, if any, is kept (sampling defaults) with `stop_token_ids` as eos.
    `stop_token_ids`: the chat model's stop tokens (`<|im_end|>`, `<|endoftext|>`), generation's eos.
    """
    if max_shard_bytes < 1 or writer_threads < 1:
        raise ValueError(f"save_pretrained: max_shard_bytes ({max_shard_bytes}) and writer_threads "
                         f"({writer_threads}) must be >= 1")
    config = model.config
    out_dtype = config.param_dtype if dtype is None else dtype_name(dtype, "save_pretrained.dtype")
    path = pathlib.Path(path)
    if jax.process_index() != 0:
        # One writer. Parameters that span hosts are gathered with a collective, so every process
        # takes part in each transform and gather, in the same order, and drops the result.
        for _ in _host_tensors(model, out_dtype):
            pass
        return path
    path.mkdir(parents=True, exist_ok=True)
    temporary = "model-{:05d}-of-{{total}}.safetensors"  # renamed once the count is known
    written: list[str] = []
    weight_map: dict[str, str] = {}
    total_size = 0
    pending: collections.deque[concurrent.futures.Future] = collections.deque()
    shard: dict[str, np.ndarray] = {}
    shard_bytes = 0

    with concurrent.futures.ThreadPoolExecutor(writer_threads, thread_name_prefix="hf-writer") as pool:
        def flush():
            nonlocal shard, shard_bytes
            if not shard:
                return
            fname = temporary.format(len(written) + 1)
            written.append(fname)
            weight_map.update(dict.fromkeys(shard, fname))
            # Bounded memory: a filled shard waits only while fewer than writer_threads are queued.
            while len(pending) >= writer_threads:
                pending.popleft().result()
            pending.append(pool.submit(write_safetensors, path / fname, shard))
            shard, shard_bytes = {}, 0

        for key, arr in _host_tensors(model, out_dtype):
            if shard_bytes and shard_bytes + arr.nbytes > max_shard_bytes:
                flush()
            shard[key] = arr
            shard_bytes += arr.nbytes
            total_size += arr.nbytes
        flush()
        for future in pending:
            future.result()  # a failed write raises here

    # Rename shards now that their count is known; a single shard becomes model.safetensors.
    total = len(written)
    final_names = ({written[0]: "model.safetensors"} if total == 1 else
                   {f: f.replace("{total}", f"{total:05d}") for f in written})
    for stale in list(path.glob("model*.safetensors")) + [path / "model.safetensors.index.json"]:
        if stale.exists() and stale.name not in written:
            stale.unlink()
    for fname, final in final_names.items():
        os.replace(path / fname, path / final)
    if total > 1:
        index = {"metadata": {"total_size": total_size},
                 "weight_map": {k: final_names[v] for k, v in weight_map.items()}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(out_dtype), indent=2))
    generation: dict = {"_from_model_config": True}
    if tokenizer_dir is not None:
        source = pathlib.Path(tokenizer_dir)
        for name in TOKENIZER_FILES:
            if (source / name).is_file() and (source / name).resolve() != (path / name).resolve():
                shutil.copyfile(source / name, path / name)
        if (source / "generation_config.json").is_file():
            generation = json.loads((source / "generation_config.json").read_text())
    if stop_token_ids:
        generation = {k: v for k, v in generation.items() if k != "_from_model_config"}
        generation["eos_token_id"] = [int(i) for i in stop_token_ids]
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


__all__ = ["TOKENIZER_FILES", "HF_PARAM_MAP", "ParamMapping", "CheckpointError", "SafetensorsReader",
           "write_safetensors", "load_config", "load_pretrained", "save_pretrained", "hf_tensors", "hf_blocks", "hf_keys",
           "hf_shapes", "hf_tensor", "update_from_hf_tensors"]
