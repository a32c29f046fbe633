"""The README's ```python blocks, and what each needs around it to run as written.

A block runs verbatim after its section's prelude, which defines the names the block leaves to the
reader (tiny shapes); the section's check then calls what the block defined. `driver(block)` is one
self-contained script, so the same run happens in-process (tests/test_readme_blocks.py), behind an
import blocker, and in a fresh virtual environment holding only the base install
(tests/test_install_tiers.py). A new section with a python block needs an entry in `RUNNERS`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

POLICY_SECTION = "The policy model"
LOSS_SECTION = "Reusing the GRPO-RoC loss in another JAX project"


@dataclasses.dataclass(frozen=True)
class Block:
    section: str  # the "## " heading above it
    line: int  # README line of its first line of code
    source: str


def python_blocks(readme: pathlib.Path = README) -> list[Block]:
    blocks, section, start, code = [], "", None, []
    for number, line in enumerate(readme.read_text().splitlines(), 1):
        if start is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif re.fullmatch(r"```python\s*", line):
                start, code = number + 1, []
        elif line.strip() == "```":
            blocks.append(Block(section, start, "\n".join(code) + "\n"))
            start = None
        else:
            code.append(line)
    if start is not None:
        raise ValueError(f"{readme}:{start - 1}: a python block is never closed")
    return blocks


@dataclasses.dataclass(frozen=True)
class Runner:
    prelude: str  # defines the block's free names; runs in a scratch working directory
    check: str  # runs after the block, in the same namespace


# A tiny Qwen3 stands in for the checkpoint, written where the block reads it (relative to the
# scratch directory), so the block's path needs no edit.
_POLICY_PRELUDE = '''
import numpy as np
from flax import nnx
from rstar_jax.model import Qwen3, Qwen3Config
from rstar_jax.model.hf import save_pretrained as _save

_save(Qwen3(Qwen3Config.tiny(), rngs=nnx.Rngs(0)), "path/to/Qwen3-1.7B")
_B, _T = 8, 12
input_ids = np.random.default_rng(0).integers(0, Qwen3Config.tiny().vocab_size, (_B, _T)).astype(np.int32)
positions = np.tile(np.r_[np.arange(7), np.arange(5)], (_B, 1)).astype(np.int32)  # two packed prompts a row
segment_ids = np.tile(np.r_[np.ones(7), np.full(5, 2)], (_B, 1)).astype(np.int32)
'''

_POLICY_CHECK = '''
import os
_cfg = Qwen3Config.tiny()
assert logits.shape == (_B, _T, _cfg.vocab_size) and logits.dtype == jnp.float32, (logits.shape, logits.dtype)
assert hidden.shape == (_B, _T, _cfg.hidden_size), hidden.shape
assert bool(jnp.isfinite(logits).all()) and bool(jnp.isfinite(hidden.astype(jnp.float32)).all())
assert {"config.json", "model.safetensors"} <= set(os.listdir("export/")), os.listdir("export/")
_again = load_pretrained("export/", mesh=mesh, dtype=jnp.bfloat16)  # the export round-trips
assert bool((_again(input_ids) == logits).all())
'''

# Numbers a GRPO-RoC step would have: 4 prompts x 32 sampled rollouts (RoC keeps 16 of each group),
# one group all correct (dropped), three mixed.
_LOSS_PRELUDE = '''
import numpy as np
import jax.numpy as jnp

_rng = np.random.default_rng(0)
group_ids = np.repeat(np.arange(4), 32)
rewards = np.where(group_ids == 0, 1.0, np.tile([1.0, 0.0], 64))
calls = _rng.integers(0, 4, 128)
errors = np.minimum(calls, _rng.integers(0, 2, 128))
answers = _rng.integers(0, 3, 128)
turns = calls + 1
step = 3

_B, _T, _D, _V = 4, 10, 16, 40
params = {"embed": jnp.asarray(_rng.normal(size=(_V, _D)), jnp.float32),
          "unembed": jnp.asarray(_rng.normal(size=(_D, _V)) / np.sqrt(_D), jnp.float32)}


def my_model_hidden_states(params, input_ids):
    return jnp.tanh(params["embed"][input_ids])


_ids = _rng.integers(0, _V, (_B, _T + 1))
batch = {"input_ids": jnp.asarray(_ids[:, :-1]), "targets": jnp.asarray(_ids[:, 1:]),
         "old_logprobs": jnp.asarray(-1.0 - 3.0 * _rng.random((_B, _T)), jnp.float32),
         "advantages": jnp.asarray(_rng.normal(size=(_B, _T)), jnp.float32),
         "loss_mask": jnp.asarray(np.arange(_T)[None] < np.array([[10], [7], [4], [1]]), jnp.int32)}
# The sampler's log-probs a little off the trainer's, and the first row packing two sequences.
batch["sampler_logprobs"] = batch["old_logprobs"] + jnp.asarray(0.005 * _rng.normal(size=(_B, _T)), jnp.float32)
batch["segment_ids"] = jnp.asarray(np.where(np.arange(_T)[None] < 5, 1, 2) * batch["loss_mask"]
                                   * (np.arange(_B)[:, None] == 0) + batch["loss_mask"] * (np.arange(_B)[:, None] > 0),
                                   jnp.int32)
'''

_LOSS_CHECK = '''
import jax
assert (roc.groups_total, roc.groups_kept, roc.dropped_all_correct) == (4, 3, 1), roc
assert advantages.shape == (48,) and np.isfinite(advantages).all(), advantages
for _adv in (batch["advantages"], advantages[:_B]):  # per token [B, T] and per rollout [B]
    _batch = dict(batch, advantages=jnp.asarray(_adv))
    _loss_sum, (_n_tokens, _metrics) = jax.jit(loss_fn)(params, _batch)
    assert _loss_sum.shape == () and bool(jnp.isfinite(_loss_sum)), _loss_sum
    assert int(_n_tokens) == 22, _n_tokens
    assert all(bool(jnp.isfinite(v).all()) for v in jax.tree.leaves(_metrics)), _metrics
    _grads = jax.jit(jax.grad(lambda p: loss_fn(p, _batch)[0]))(params)
    assert jax.tree.map(jnp.shape, _grads) == jax.tree.map(jnp.shape, params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(_grads))
    assert float(jnp.abs(_grads["unembed"]).sum()) > 0
    _loss_sum, (_sequences, _metrics) = jax.jit(variant_loss_fn)(params, _batch)
    assert bool(jnp.isfinite(_loss_sum)) and 1 <= int(_sequences) <= 5, (_loss_sum, _sequences)
    assert {"mismatch_k3_sum", "is_weight_sum", "rejected_sequence_count", "sequence_count"} <= set(_metrics)
    _grads = jax.jit(jax.grad(lambda p: variant_loss_fn(p, _batch)[0]))(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(_grads))
'''

RUNNERS: dict[str, Runner] = {
    POLICY_SECTION: Runner(_POLICY_PRELUDE, _POLICY_CHECK),
    LOSS_SECTION: Runner(_LOSS_PRELUDE, _LOSS_CHECK),
}


def driver(block: Block) -> str:
    """A script that runs the block between its section's prelude and check; the block's tracebacks
    name README.md and its lines. KeyError: no runner for the block's section."""
    runner = RUNNERS[block.section]
    readme_code = "\n" * (block.line - 1) + block.source
    return (
        "_ns = {'__name__': '__readme__'}\n"
        f"exec(compile({runner.prelude!r}, {'<prelude: ' + block.section + '>'!r}, 'exec'), _ns)\n"
        f"exec(compile({readme_code!r}, 'README.md', 'exec'), _ns)\n"
        f"exec(compile({runner.check!r}, {'<check: ' + block.section + '>'!r}, 'exec'), _ns)\n"
        f"print('README block ok:', {block.section!r})\n"
    )
