"""Hugging Face checkpoint import and export for Qwen3.

The key mapping is one table (`HF_PARAM_MAP`): each row names a Hugging Face tensor (with ``{i}``
for the layer index), our parameter, and how the matrix is laid out on each side. Loading streams
tensor by tensor from memory-mapped safetensors files: every device shard of a parameter is read
straight from disk through `jax.make_array_from_callback`, so no host ever assembles a full
parameter it does not own. Export writes safetensors shards with an index and a transformers-5
config.json that transformers and SGLang load.

The safetensors container format (an 8-byte header length, a JSON header, raw little-endian data)
is read and written here directly because the numpy bindings of the `safetensors` package cannot
represent bfloat16.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import struct
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.typing import DTypeLike

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
            f.write(arr.tobytes())
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


def hf_tensors(model: Qwen3, dtype: DTypeLike | None = None) -> Iterable[tuple[str, np.ndarray]]:
    """Yields (hf_key, array) one tensor at a time, gathered to the host, in `dtype` (a name or a
    JAX/NumPy dtype; default `config.param_dtype`)."""
    config = model.config
    out_dtype = np.dtype(jnp.dtype(config.param_dtype if dtype is None else dtype_name(dtype, "hf_tensors.dtype")))
    for m in _param_mappings(config):
        value = host_value(getattr(model, m.param)[...])
        if m.stacked:
            for i in range(config.num_layers):
                yield m.hf_key.format(i=i), np.ascontiguousarray(_to_hf(m.layout, value[i]).astype(out_dtype))
        else:
            yield m.hf_key, np.ascontiguousarray(_to_hf(m.layout, value).astype(out_dtype))


# What transformers, SGLang and our HF tokenizer read from a checkpoint directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def save_pretrained(
    model: Qwen3,
    path: str | os.PathLike,
    *,
    dtype: DTypeLike | None = None,
    max_shard_bytes: int = 4 << 30,
    tokenizer_dir: str | os.PathLike | None = None,
    stop_token_ids: Sequence[int] = (),
) -> pathlib.Path:
    """Writes config.json, generation_config.json and safetensors (sharded with an index when large).

    `dtype`: the tensors' dtype, a name or a JAX/NumPy dtype (default `config.param_dtype`).
    `tokenizer_dir`: its tokenizer files (`TOKENIZER_FILES`) are copied beside the weights, so the
    directory is a whole checkpoint for the next stage, transformers and SGLang; its
    generation_config.json, if any, is kept (sampling defaults) with `stop_token_ids` as eos.
    `stop_token_ids`: the chat model's stop tokens (`<|im_end|>`, `<|endoftext|>`), generation's eos.
    """
    config = model.config
    out_dtype = config.param_dtype if dtype is None else dtype_name(dtype, "save_pretrained.dtype")
    path = pathlib.Path(path)
    if jax.process_index() != 0:
        # One writer. Parameters that span hosts are gathered with a collective, so every process
        # takes part in each gather, in hf_tensors' order, and drops the result unconverted.
        for m in _param_mappings(config):
            host_value(getattr(model, m.param)[...])
        return path
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    written: list[str] = []
    weight_map: dict[str, str] = {}
    tensor_bytes: dict[str, int] = {}

    def flush():
        name_template = "model-{:05d}-of-{{total}}.safetensors"
        if shards[-1]:
            fname = name_template.format(len(written) + 1)
            write_safetensors(path / fname, shards[-1])
            written.append(fname)
            for key in shards[-1]:
                weight_map[key] = fname
        shards[-1] = {}
        sizes[-1] = 0

    for key, arr in hf_tensors(model, out_dtype):
        if sizes[-1] and sizes[-1] + arr.nbytes > max_shard_bytes:
            flush()
        shards[-1][key] = arr
        sizes[-1] += arr.nbytes
        tensor_bytes[key] = arr.nbytes
    flush()

    # Rename shards now that their count is known; a single shard becomes model.safetensors.
    for stale in list(path.glob("model*.safetensors")) + [path / "model.safetensors.index.json"]:
        if stale.exists() and stale.name not in written:
            stale.unlink()
    total = len(written)
    if total == 1:
        os.replace(path / written[0], path / "model.safetensors")
    else:
        final_names = {}
        for fname in written:
            new = fname.replace("{total}", f"{total:05d}")
            os.replace(path / fname, path / new)
            final_names[fname] = new
        index = {
            "metadata": {"total_size": sum(tensor_bytes.values())},
            "weight_map": {k: final_names[v] for k, v in weight_map.items()},
        }
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


__all__ = ["TOKENIZER_FILES", "HF_PARAM_MAP", "ParamMapping", "CheckpointError", "SafetensorsReader", "write_safetensors",
           "load_config", "load_pretrained", "save_pretrained", "hf_tensors"]
