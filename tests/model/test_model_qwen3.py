"""Qwen3 forward: paged KV-cache decode, packing, sharded equivalence, memory plan, dtypes, cuDNN attention.

Greedy generation over the paged cache (argmax and log-probs equal to repeated full forwards) is
tested through the engine in test_engine.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.qwen3 import (Qwen3, Qwen3Config, dtype_name, sequence_positions, single_query_attention,
                                   xla_attention)
from rstar_jax.parallel import DEFAULT_RULES, create_sharded_model, make_mesh, memory_plan, param_shardings

CONFIG = Qwen3Config.tiny()


@pytest.fixture(scope="module")
def model():
    return Qwen3(CONFIG, rngs=nnx.Rngs(0))


def _ids(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(1, CONFIG.vocab_size, size=shape), jnp.int32)


@nnx.jit
def _forward(model, ids, positions, segment_ids):
    return model(ids, positions, segment_ids)


@nnx.jit
def _paged(model, ids, positions, cache, page_table):
    return model.forward_with_paged_cache(ids, positions, cache, page_table)


def test_paged_cache_with_scattered_pages_matches_full_forward(model):
    """Prefill then decode equals the full forward, for two rows at different positions (continuous
    batching: the shorter row's padding is written past its end, then overwritten by its decode).
    The rows' pages lie out of order in one pool that starts full of garbage; entries equal to the
    pool size (9) are unallocated: nothing is written there and nothing read there reaches the
    output, and pages no row holds are left untouched."""
    num_pages, page_size, free = 9, 4, 9
    with jax.default_matmul_precision("highest"):
        a, b = _ids((1, 12), 3), _ids((1, 10), 4)
        cache = model.init_paged_cache(num_pages, page_size)
        garbage = 1e3 * jax.random.normal(jax.random.key(0), cache.k.shape)
        cache = type(cache)(k=garbage, v=-garbage)
        table = jnp.array([[7, 2, free, free], [3, 6, free, free]])
        prompt = jnp.concatenate([a[:, :8], jnp.pad(b[:, :6], ((0, 0), (0, 2)))], axis=0)  # b padded 6 -> 8
        logits, cache = _paged(model, prompt, jnp.broadcast_to(jnp.arange(8), (2, 8)), cache, table)
        np.testing.assert_allclose(logits[0], model(a[:, :8])[0], atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(logits[1, :6], model(b[:, :6])[0], atol=1e-4, rtol=1e-5)
        table = jnp.array([[7, 2, 0, free], [3, 6, 8, free]])  # third pages allocated as the rows grow
        pos, steps = jnp.array([8, 6]), []
        for _ in range(4):
            tokens = jnp.stack([a[0, pos[0]], b[0, pos[1]]])[:, None]
            step, cache = _paged(model, tokens, pos[:, None], cache, table)
            steps.append(step[:, 0])
            pos = pos + 1
        steps = jnp.stack(steps, axis=1)
        np.testing.assert_allclose(steps[0], model(a)[0, 8:12], atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(steps[1], model(b)[0, 6:10], atol=1e-4, rtol=1e-5)
        untouched = jnp.array([1, 4, 5])
        np.testing.assert_array_equal(cache.k[:, untouched], garbage[:, untouched])


def test_packed_sequences_equal_each_alone(model):
    with jax.default_matmul_precision("highest"):
        a, b = _ids((1, 7), 4), _ids((1, 11), 5)
        packed = jnp.concatenate([a, b, jnp.zeros((1, 2), jnp.int32)], axis=1)
        segments = jnp.asarray([[1] * 7 + [2] * 11 + [0] * 2])
        positions = sequence_positions(segments)
        assert positions[0, :9].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1]
        out = _forward(model, packed, positions, segments)
        np.testing.assert_allclose(out[:, :7], model(a), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out[:, 7:18], model(b), atol=1e-5, rtol=1e-5)


def _loss_and_grads(model, ids):
    def loss(m):
        logits = m(ids)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(ids.shape[1]))

    return nnx.jit(nnx.value_and_grad(loss))(model)


EXPECTED_SPECS = {
    # (data=2, fsdp=2, tensor=2)
    (2, 2, 2): {
        "embed": ("tensor", "fsdp"), "lm_head": ("fsdp", "tensor"),
        "q_proj": (None, "fsdp", "tensor", None), "k_proj": (None, "fsdp", "tensor", None),
        "v_proj": (None, "fsdp", "tensor", None), "o_proj": (None, "tensor", None, "fsdp"),
        "gate_proj": (None, "fsdp", "tensor"), "up_proj": (None, "fsdp", "tensor"),
        "down_proj": (None, "tensor", "fsdp"), "input_norm": (None, None), "post_attn_norm": (None, None),
        "q_norm": (None, None), "k_norm": (None, None), "final_norm": (None,),
    },
    # (fsdp=8): every matrix sharded 8 ways on its embed dimension.
    (1, 8, 1): {
        "embed": (None, "fsdp"), "lm_head": ("fsdp", None),
        "q_proj": (None, "fsdp", None, None), "k_proj": (None, "fsdp", None, None),
        "v_proj": (None, "fsdp", None, None), "o_proj": (None, None, None, "fsdp"),
        "gate_proj": (None, "fsdp", None), "up_proj": (None, "fsdp", None),
        "down_proj": (None, None, "fsdp"), "input_norm": (None, None), "post_attn_norm": (None, None),
        "q_norm": (None, None), "k_norm": (None, None), "final_norm": (None,),
    },
}


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1)])
def test_sharded_forward_and_grads_equal_single_device(model, mesh_shape):
    mesh = make_mesh(*mesh_shape)
    sharded = create_sharded_model(CONFIG, mesh, DEFAULT_RULES, seed=0)
    # Parameters are created already in place: every spec matches the golden table.
    for name, spec in EXPECTED_SPECS[mesh_shape].items():
        array = getattr(sharded, name)[...]
        assert array.sharding.mesh.shape == mesh.shape, name
        assert tuple(array.sharding.spec) == spec, (name, array.sharding.spec)
        assert tuple(param_shardings(sharded, mesh)[name].spec) == spec
        assert param_shardings(sharded, mesh)[name] == array.sharding
    ids = _ids((4, 16), 6)
    with jax.default_matmul_precision("highest"):
        loss_1, grads_1 = _loss_and_grads(model, ids)
        loss_n, grads_n = _loss_and_grads(sharded, ids)
        np.testing.assert_allclose(sharded(ids), model(ids), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(loss_n, loss_1, atol=1e-6)
    for (path, g1), (_, gn) in zip(nnx.to_flat_state(grads_1), nnx.to_flat_state(grads_n)):
        np.testing.assert_allclose(gn[...], g1[...], atol=1e-5, rtol=1e-4, err_msg=str(path))


def test_mesh_errors_name_the_axes():
    with pytest.raises(ValueError, match="data\\*fsdp\\*tensor"):
        make_mesh(2, 2, 3)
    with pytest.raises(ValueError, match="mesh.tensor must be"):
        make_mesh(1, -1, 0)


def test_memory_plan_14b_matches_hand_computation():
    c = Qwen3Config.qwen3_14b()
    d, f, h, k, hd, v, n = 5120, 17408, 40, 8, 128, 151936, 40
    per_layer = 2 * d + d * h * hd + 2 * d * k * hd + h * hd * d + 2 * hd + 3 * d * f
    total = 2 * v * d + n * per_layer + d  # untied embedding and head
    assert total == 14_768_307_200
    assert c.num_params == total
    # fsdp=64: every matrix splits 64 ways on its embed dim (5120 = 64 * 80); norms are replicated.
    norms = n * (2 * d + 2 * hd) + d
    per_device = (total - norms) // 64 + norms
    plan = memory_plan(c, {"data": 1, "fsdp": 64, "tensor": 1}, param_dtype="float32")
    assert plan.num_params == total
    assert plan.param_bytes == 4 * per_device
    assert plan.grad_bytes == 4 * per_device
    assert plan.opt_state_bytes == 8 * per_device  # AdamW mu and nu in fp32
    # bf16 parameters and gradients halve those two, not the fp32 moments.
    bf16 = memory_plan(c, {"fsdp": 64}, param_dtype="bfloat16")
    assert bf16.param_bytes == 2 * per_device and bf16.opt_state_bytes == 8 * per_device
    table = str(memory_plan(c, {"fsdp": 64}, preset="qwen3-14b"))
    assert "qwen3-14b" in table and f"{(4 + 4 + 8) * per_device / 2**30:.3f}" in table
    # A Mesh is accepted as well as a shape: 8 fake devices, 14B over fsdp=8 (5120 = 8 * 640).
    per_device_8 = (total - norms) // 8 + norms
    assert memory_plan(c, make_mesh(1, 8, 1)).param_bytes == 4 * per_device_8
    with pytest.raises(ValueError, match="unknown mesh axes"):
        memory_plan(c, {"model": 8})


def test_dtypes_are_names_or_jax_and_numpy_dtypes(model):
    """A dtype may be given by name or as a JAX/NumPy dtype; configs store the name, so both spellings
    give equal configs (and share compilations); an unsupported dtype names the field."""
    for given in ("float16", jnp.float16, np.float16, jnp.dtype("float16")):
        assert Qwen3Config.tiny(dtype=given).dtype == "float16"
    config = Qwen3Config.tiny(dtype=jnp.bfloat16, param_dtype=np.float32)
    assert config == Qwen3Config.tiny(dtype="bfloat16", param_dtype="float32")
    assert hash(config) == hash(Qwen3Config.tiny(dtype="bfloat16", param_dtype="float32"))
    assert dataclasses.replace(config, param_dtype=jnp.bfloat16).param_dtype == "bfloat16"
    assert Qwen3Config.preset("qwen3-0.6b", dtype=jnp.bfloat16).dtype == "bfloat16"
    assert dtype_name(jnp.dtype("bfloat16")) == "bfloat16"
    with pytest.raises(ValueError, match=r"Qwen3Config\.dtype must be one of \['bfloat16', 'float16', 'float32'\], "
                                         r"got 'int32'"):
        Qwen3Config.tiny(dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"Qwen3Config\.param_dtype must be one of .*got 'int8'"):
        Qwen3Config.tiny(param_dtype="int8")

    assert model.init_paged_cache(2, 4, dtype=jnp.bfloat16).k.dtype == jnp.bfloat16
    assert model.init_paged_cache(2, 4).v.dtype == jnp.float32  # the compute dtype
    with pytest.raises(ValueError, match=r"init_paged_cache\.dtype must be one of"):
        model.init_paged_cache(2, 4, dtype=np.int32)

    c = Qwen3Config.qwen3_14b()
    assert memory_plan(c, {"fsdp": 64}, param_dtype=jnp.bfloat16, opt_state_dtype=np.float32) == \
        memory_plan(c, {"fsdp": 64}, param_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"memory_plan\.grad_dtype must be one of"):
        memory_plan(c, {"fsdp": 64}, grad_dtype=jnp.int32)


def test_every_preset_matches_published_shapes():
    expected = {  # (layers, hidden, intermediate, heads, kv heads, tied, billions of parameters)
        "qwen3-0.6b": (28, 1024, 3072, 16, 8, True, 0.596),
        "qwen3-1.7b": (28, 2048, 6144, 16, 8, True, 1.721),
        "qwen3-4b": (36, 2560, 9728, 32, 8, True, 4.022),
        "qwen3-8b": (36, 4096, 12288, 32, 8, False, 8.191),
        "qwen3-14b": (40, 5120, 17408, 40, 8, False, 14.768),
    }
    for name, (layers, hidden, inter, heads, kv, tied, billions) in expected.items():
        c = Qwen3Config.preset(name)
        assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                c.tie_word_embeddings) == (layers, hidden, inter, heads, kv, tied), name
        assert c.vocab_size == 151936 and c.head_dim == 128 and c.rope_theta == 1e6
        assert round(c.num_params / 1e9, 3) == billions, name


@pytest.mark.parametrize("policy", ["full", "dots_with_no_batch_dims_saveable"])
def test_remat_policies_give_identical_gradients(model, policy):
    ids = _ids((2, 8), 7)
    _, ref = _loss_and_grads(model, ids)
    remat = Qwen3(Qwen3Config.tiny(remat_policy=policy), rngs=nnx.Rngs(0))
    _, grads = _loss_and_grads(remat, ids)
    for (path, a), (_, b) in zip(nnx.to_flat_state(ref), nnx.to_flat_state(grads)):
        np.testing.assert_allclose(a[...], b[...], atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_decode_attention_equals_the_batched_dot(dtype, tol):
    """The decode step's multiply-reduce attention against xla_attention at one query per row:
    grouped heads, rows of different lengths, masked positions holding garbage."""
    rng = np.random.default_rng(0)
    b, s, h, kv_heads, hd = 3, 40, 8, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=shape), dtype) for shape in ((b, 1, h, hd), (b, s, kv_heads, hd),
                                                                      (b, s, kv_heads, hd)))
    lengths = jnp.asarray([1, 17, 40])
    mask = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :]
    k = jnp.where(mask[:, 0, :, None, None], k, 1e4)  # what an unallocated page may hold
    got = single_query_attention(q, k, v, mask)
    want = xla_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask)
    assert got.dtype == dtype and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(got[0, 0], np.float32), np.asarray(v[0, 0], np.float32)
                               .repeat(h // kv_heads, axis=0), atol=tol)  # one visible position: its V


@pytest.mark.gpu
def test_cudnn_attention_matches_xla_in_bf16():
    cfg = dict(param_dtype="bfloat16", dtype="bfloat16", head_dim=64, num_heads=4, num_kv_heads=2)
    gpu = jax.devices("gpu")[0]
    with jax.default_device(gpu):
        xla_model = Qwen3(Qwen3Config.tiny(**cfg), rngs=nnx.Rngs(0))
        cudnn_model = Qwen3(Qwen3Config.tiny(attention_impl="cudnn", **cfg), rngs=nnx.Rngs(0))
        ids = _ids((2, 256), 8)
        np.testing.assert_allclose(
            np.asarray(cudnn_model(ids), np.float32), np.asarray(xla_model(ids), np.float32), atol=5e-2, rtol=5e-2)
        segments = jnp.asarray([[1] * 100 + [2] * 156, [1] * 200 + [0] * 56])
        positions = sequence_positions(segments)
        out_c = np.asarray(cudnn_model(ids, positions, segments), np.float32)
        out_x = np.asarray(xla_model(ids, positions, segments), np.float32)
        valid = np.asarray(segments > 0)
        np.testing.assert_allclose(out_c[valid], out_x[valid], atol=5e-2, rtol=5e-2)


def test_profiles_name_the_model_parts():
    """Named scopes reach the ops' names, which profilers show, through remat, scan and the log-prob
    head's hand-written gradient. (The lowered module's locations: a compiled executable may come
    from the persistent cache, whose key ignores names.)"""
    import re

    from rstar_jax.rl.logprobs import token_logprobs

    model = Qwen3(Qwen3Config.tiny(remat_policy="full"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    ids = _ids((2, 16), 3)

    def loss(state, ids):
        m = nnx.merge(graphdef, state)
        return token_logprobs(m.hidden_states(ids), m.unembedding(), ids, chunk_size=8).sum()

    def op_names(lowered) -> str:
        return "\n".join(re.findall(r'loc\("([^"]+)"', lowered.as_text(debug_info=True)))

    names = op_names(jax.jit(jax.grad(loss)).lower(state, ids))
    for scope in ("embed", "decoder_layer/qkv", "decoder_layer/attention", "decoder_layer/o_proj",
                  "decoder_layer/mlp", "final_norm", "logprob_head"):
        assert re.search(rf"(^|/|\(){re.escape(scope)}(/|\)|$)", names, re.M), scope

    cache = model.init_paged_cache(num_pages=4, page_size=8)
    table = jnp.arange(4, dtype=jnp.int32)[None]
    positions = jnp.arange(16, dtype=jnp.int32)[None]
    decode = jax.jit(lambda ids: model.forward_with_paged_cache(ids, positions, cache, table)[0])
    names = op_names(decode.lower(ids[:1]))
    for scope in ("decoder_layer/kv_write", "decoder_layer/kv_gather", "decoder_layer/attention", "unembed"):
        assert re.search(rf"(^|/|\(){re.escape(scope)}(/|\)|$)", names, re.M), scope
