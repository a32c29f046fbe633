"""The model's settings without jax: `Qwen3Config`, the dtype, remat and attention names, the mesh axes.

This module exists so that a config is checked (`python -m rstar_jax.config`, `configs/*.py`) by
building the model's settings without importing jax or flax: it needs numpy and ml_dtypes only (the
bfloat16 that `jnp.bfloat16` is). `rstar_jax.model.qwen3` and `rstar_jax.model.sharding` re-export
every name here and hold what needs jax (the remat policies' functions, the model, the shardings).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy, as importing jax does)
import numpy as np
from numpy.typing import DTypeLike


DTYPE_NAMES = ("bfloat16", "float16", "float32")  # what a dtype may be named in configs and exports

# Remat policies for the scanned decoder layer (`qwen3.REMAT_POLICIES` maps each to its
# jax.checkpoint policy). "none" keeps every activation; "full" saves only the layer input
# (recomputes the whole layer in the backward pass); "dots" / "dots_saveable" save every matmul
# output; "dots_no_batch" / "dots_with_no_batch_dims_saveable" save only the weight matmuls (no batch
# dimensions: projections and MLP, not attention scores), recomputing attention.
# The "save_*" / "offload_*" policies keep only activations the decoder layer names
# (`jax.ad_checkpoint.checkpoint_name`, `qwen3.REMAT_NAMES`); the backward recomputes the rest:
#   save_attention      attention's output (before o_proj)
#   save_qkv_attention  the q/k/v projections' outputs (before q/k-norm and RoPE) and attention's output
#   save_named          every named activation: q/k/v, attention's output, o_proj's output, the MLP's gate and up
#   offload_mlp         q/k/v and attention's output on the device; o_proj's output and the MLP's gate and up
#                       copied to pinned host memory (backends without one are refused)
#   offload_named       every named activation copied to pinned host memory, none kept on the device
REMAT_POLICY_NAMES = ("none", "full", "dots", "dots_saveable", "dots_no_batch", "dots_with_no_batch_dims_saveable",
                      "save_attention", "save_qkv_attention", "save_named", "offload_mlp", "offload_named")
# "blockwise": xla's masking over query blocks with a flash-style backward (`qwen3.blockwise_attention`):
# no [T, S] score matrix held, on any backend.
ATTENTION_IMPLS = ("xla", "cudnn", "blockwise")

MESH_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axis (or axes, or None = replicated). Weights are FSDP-sharded on the
# embedding dimension and tensor-parallel on heads / MLP / vocabulary; activations are sharded on
# the batch over both data-parallel axes.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("norm", None),
)


def dtype_name(dtype: DTypeLike, field: str = "dtype") -> str:
    """The canonical name ("bfloat16", "float16", "float32") of a dtype given by name or as a JAX/NumPy
    dtype (`jnp.bfloat16`, `np.float32`, `jnp.dtype("bfloat16")`); anything else is a ValueError
    naming `field`."""
    try:
        name = np.dtype(dtype).name if dtype is not None else None  # jnp.dtype is np.dtype
    except TypeError:
        name = None
    if name not in DTYPE_NAMES:
        got = repr(name) if name is not None and not isinstance(dtype, str) else repr(dtype)
        raise ValueError(f"{field} must be one of {sorted(DTYPE_NAMES)}, got {got}")
    return name


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    # Given by name or as a JAX/NumPy dtype; stored as the canonical name so configs compare and hash
    # alike whichever way they were written.
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype
    remat_policy: str = "none"
    attention_impl: str = "xla"

    def __post_init__(self):
        for name in ("param_dtype", "dtype"):
            object.__setattr__(self, name, dtype_name(getattr(self, name), f"Qwen3Config.{name}"))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Qwen3Config.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Qwen3Config.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"Qwen3Config.rope_theta must be > 0, got {self.rope_theta}")
        if not 0 < self.rms_norm_eps < 1:
            raise ValueError(f"Qwen3Config.rms_norm_eps must be in (0, 1), got {self.rms_norm_eps}")
        if self.remat_policy not in REMAT_POLICY_NAMES:
            raise ValueError(f"Qwen3Config.remat_policy must be one of {sorted(REMAT_POLICY_NAMES)}, got {self.remat_policy!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"Qwen3Config.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.attention_impl == "cudnn" and self.dtype == "float32":
            # cuDNN fused attention runs in half precision only.
            raise ValueError("Qwen3Config.attention_impl='cudnn' needs dtype 'bfloat16' or 'float16', got 'float32'")

    # -- presets: values of the Hugging Face config.json files of the Qwen3 releases ------------
    @classmethod
    def qwen3_0p6b(cls, **kw) -> "Qwen3Config":
        return cls(**{**dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                             num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True), **kw})

    @classmethod
    def qwen3_1p7b(cls, **kw) -> "Qwen3Config":
        return cls(**{**dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                             num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True), **kw})

    @classmethod
    def qwen3_4b(cls, **kw) -> "Qwen3Config":
        return cls(**{**dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                             num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=True), **kw})

    @classmethod
    def qwen3_8b(cls, **kw) -> "Qwen3Config":
        return cls(**{**dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                             num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False), **kw})

    @classmethod
    def qwen3_14b(cls, **kw) -> "Qwen3Config":
        return cls(**{**dict(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=40,
                             num_heads=40, num_kv_heads=8, head_dim=128, tie_word_embeddings=False), **kw})

    @classmethod
    def tiny(cls, **kw) -> "Qwen3Config":
        """Test-sized shapes (GQA ratio 2, untied head); keep them shared so compilations are reused."""
        return cls(**{**dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                             max_position_embeddings=2048), **kw})

    @classmethod
    def preset(cls, name: str, **kw) -> "Qwen3Config":
        presets = {
            "qwen3-0.6b": cls.qwen3_0p6b, "qwen3-1.7b": cls.qwen3_1p7b, "qwen3-4b": cls.qwen3_4b,
            "qwen3-8b": cls.qwen3_8b, "qwen3-14b": cls.qwen3_14b, "tiny": cls.tiny,
        }
        key = name.lower()
        if key not in presets:
            raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(presets)}")
        return presets[key](**kw)

    # -- Hugging Face config.json ----------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "Qwen3Config":
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if model_type != "qwen3" or (archs and "Qwen3ForCausalLM" not in archs):
            raise ValueError(
                f"config.json describes model_type={model_type!r}, architectures={archs!r}; "
                "only Qwen3ForCausalLM (model_type 'qwen3') is supported"
            )
        # transformers 5 keeps RoPE settings under rope_parameters; 4.x has a top-level rope_theta.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"config.json rope_type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10_000.0))
        if d.get("attention_bias", False):
            raise ValueError("config.json attention_bias=true is not supported by Qwen3 (no biases)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in d:
                raise ValueError(f"config.json is missing the field {key!r}")
        num_heads = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads", num_heads),
            head_dim=d.get("head_dim", d["hidden_size"] // num_heads),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_dict(self, torch_dtype: DTypeLike | None = None) -> dict:
        dtype = self.param_dtype if torch_dtype is None else dtype_name(torch_dtype, "to_hf_dict.torch_dtype")
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_cache": True,
            "dtype": dtype,
            "torch_dtype": dtype,
        }

    @property
    def num_params(self) -> int:
        d, f, h, k, hd, v, n = (self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
                                self.head_dim, self.vocab_size, self.num_layers)
        per_layer = 2 * d + d * h * hd + 2 * d * k * hd + h * hd * d + 2 * hd + 3 * d * f
        return v * d + n * per_layer + d + (0 if self.tie_word_embeddings else d * v)


__all__ = [
    "Qwen3Config", "dtype_name", "DTYPE_NAMES", "REMAT_POLICY_NAMES", "ATTENTION_IMPLS", "MESH_AXES",
    "DEFAULT_RULES",
]
