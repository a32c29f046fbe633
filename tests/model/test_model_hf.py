"""Hugging Face parity, export and round trips, and checkpoint validation errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rstar_jax.model.hf import CheckpointError, load_pretrained, save_pretrained, write_safetensors  # noqa: E402
from rstar_jax.model.qwen3 import Qwen3Config  # noqa: E402

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6)


def _hf_model(tied: bool, rope_theta: float, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**TINY, tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    # Random norm weights too, so a swapped or dropped norm cannot hide behind all-ones.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def _our_logits(model, ids: np.ndarray) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        return np.asarray(model(jnp.asarray(ids)))


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, 24))


@pytest.mark.parametrize("tied,rope_theta", [(True, 10_000.0), (False, 500_000.0)])
def test_load_matches_transformers_and_export_round_trips(tmp_path, tokens, tied, rope_theta):
    hf = _hf_model(tied, rope_theta)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config.tie_word_embeddings == tied and ours.config.rope_theta == rope_theta
    ref = _hf_logits(hf, tokens)
    np.testing.assert_allclose(_our_logits(ours, tokens), ref, atol=1e-4, rtol=1e-4)

    # Export, reload with transformers: identical logits.
    save_pretrained(ours, tmp_path / "export")
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "export").eval()
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens), ref)

    # Our own load -> export -> load is bitwise.
    again = load_pretrained(tmp_path / "export")
    for name in ("embed", "q_proj", "o_proj", "down_proj", "final_norm", "q_norm"):
        np.testing.assert_array_equal(np.asarray(getattr(again, name)[...]), np.asarray(getattr(ours, name)[...]))


def test_sharded_export_with_index_and_bf16(tmp_path, tokens):
    hf = _hf_model(False, 1_000_000.0, seed=1)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "sharded", max_shard_bytes=60_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = load_pretrained(tmp_path / "sharded")
    np.testing.assert_array_equal(np.asarray(again.k_proj[...]), np.asarray(ours.k_proj[...]))

    # bf16 export is what transformers reads back as bf16.
    save_pretrained(ours, tmp_path / "bf16", dtype="bfloat16")
    hf_bf16 = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert hf_bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    ours_bf16 = load_pretrained(tmp_path / "bf16", param_dtype="bfloat16")
    np.testing.assert_array_equal(
        np.asarray(ours_bf16.embed[...]).astype(np.float32),
        hf_bf16.model.embed_tokens.weight.detach().float().numpy(),
    )


def test_dtypes_may_be_given_as_jax_dtypes(tmp_path):
    hf = _hf_model(False, 10_000.0)
    hf.save_pretrained(tmp_path / "hf")
    by_name = load_pretrained(tmp_path / "hf", dtype="bfloat16", param_dtype="bfloat16")
    by_dtype = load_pretrained(tmp_path / "hf", dtype=jnp.bfloat16, param_dtype=jnp.dtype("bfloat16"))
    assert by_dtype.config == by_name.config and by_dtype.config.dtype == by_dtype.config.param_dtype == "bfloat16"
    assert by_dtype.embed[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(by_dtype.q_proj[...]), np.asarray(by_name.q_proj[...]))

    ours = load_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "bf16", dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    weight = reloaded.model.layers[1].mlp.down_proj.weight
    assert weight.dtype == torch.bfloat16
    expected = np.asarray(ours.down_proj[...])[1].T.astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(weight.detach().float().numpy(), expected)

    with pytest.raises(ValueError, match=r"load_pretrained\.dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
        load_pretrained(tmp_path / "hf", dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"save_pretrained\.dtype must be one of"):
        save_pretrained(ours, tmp_path / "bad", dtype=np.int8)


def test_loader_accepts_transformers4_config_form(tmp_path):
    hf = _hf_model(True, 10_000.0)
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 12_345.0
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    assert load_pretrained(tmp_path / "hf").config.rope_theta == 12_345.0


# -- bad input ---------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    hf = _hf_model(False, 10_000.0)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ok")
    return tmp_path / "ok", ours


def _rewrite(path, mutate):
    from rstar_jax.model.hf import SafetensorsReader

    reader = SafetensorsReader([path / "model.safetensors"])
    tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
    mutate(tensors)
    del reader
    write_safetensors(path / "model.safetensors", tensors)


def test_missing_tensor_is_named(saved):
    path, _ = saved
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_pretrained(path)


def test_wrong_shape_is_named(saved):
    path, _ = saved

    def mutate(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)

    _rewrite(path, mutate)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(100, 64\)"):
        load_pretrained(path)


def test_unexpected_tensor_is_named(saved):
    path, _ = saved
    _rewrite(path, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", np.zeros(64, np.float32)))
    with pytest.raises(CheckpointError, match="unexpected tensors.*q_proj.bias"):
        load_pretrained(path)


def test_unknown_architecture_and_bad_field(saved):
    path, _ = saved
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="only Qwen3ForCausalLM"):
        load_pretrained(path)
    (path / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="num_heads .*multiple of num_kv_heads"):
        load_pretrained(path)
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": -4}))
    with pytest.raises(ValueError, match="Qwen3Config.hidden_size must be a positive integer"):
        load_pretrained(path)


def test_config_field_validation():
    with pytest.raises(ValueError, match="Qwen3Config.remat_policy"):
        Qwen3Config.tiny(remat_policy="sometimes")
    with pytest.raises(ValueError, match="Qwen3Config.attention_impl"):
        Qwen3Config.tiny(attention_impl="flash")
    with pytest.raises(ValueError, match="Qwen3Config.attention_impl='cudnn' needs dtype"):
        Qwen3Config.tiny(attention_impl="cudnn", dtype="float32")
    assert Qwen3Config.tiny(attention_impl="cudnn", dtype="bfloat16").attention_impl == "cudnn"
    with pytest.raises(ValueError, match="unknown model preset"):
        Qwen3Config.preset("qwen3-15b")


def _chat_tokenizer_files(directory) -> dict:
    """A ChatML tokenizer (tokenizer.json and tokenizer_config.json, as a Hub checkpoint has them) and a
    generation config with a sampling default; returns the special ids."""
    from tests.agent_helpers import write_chatml_tokenizer

    special = write_chatml_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": 151643}))
    return special


def test_a_runs_export_is_a_whole_checkpoint(tmp_path):
    """The run's HF export (`builders.export_hf`) carries the source checkpoint's tokenizer files and a
    generation config that stops on <|im_end|> and <|endoftext|>, in bf16 by default: transformers
    loads model, tokenizer and generation config from it, and so does the next stage."""
    from rstar_jax.agent.tokenizer import load_tokenizer
    from rstar_jax.config import REPO_CONFIGS, load_config_file
    from rstar_jax.app import builders

    source = tmp_path / "source"
    _hf_model(tied=False, rope_theta=10_000.0).save_pretrained(source)
    special = _chat_tokenizer_files(source)
    config = load_config_file(REPO_CONFIGS / "base.py")
    config.update_from_flattened_dict({"model.hf_path": str(source), "tokenizer.kind": "hf"})
    assert config.checkpoint.export_dtype == "bfloat16"
    tokenizer = builders.tokenizer(config)
    model = load_pretrained(source)
    out = builders.export_hf(config, model, tokenizer, tmp_path / "run" / "hf" / "final")

    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [special["<|im_end|>"], special["<|endoftext|>"]]
    assert generation.temperature == 0.6  # the source's sampling defaults are kept
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.convert_tokens_to_ids("<|im_end|>") == special["<|im_end|>"] == hf_tokenizer.eos_token_id
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    ours = load_pretrained(out)
    for name in ("embed", "q_proj", "down_proj"):
        exact = np.asarray(getattr(model, name)[...], np.float32)
        assert np.array_equal(np.asarray(getattr(ours, name)[...], np.float32),
                              exact.astype(jnp.bfloat16).astype(np.float32)), name
    # The next stage reads its tokenizer from the export (tokenizer.path defaults to model.hf_path).
    follow = config.copy_and_resolve_references()
    follow.model.hf_path = str(out)
    assert builders.tokenizer(follow).encode("<|im_start|>ab<|im_end|>") == tokenizer.encode("<|im_start|>ab<|im_end|>")
    assert load_tokenizer("hf", out).eos_id == special["<|im_end|>"]

    # As trained ("" = param_dtype), and the byte tokenizer: nothing to copy, its own stop ids.
    config.update_from_flattened_dict({"checkpoint.export_dtype": "", "tokenizer.kind": "byte"})
    plain = builders.export_hf(config, model, builders.tokenizer(config), tmp_path / "plain")
    assert sorted(p.name for p in plain.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((plain / "generation_config.json").read_text()) == {"eos_token_id": [258, 256]}
    assert json.loads((plain / "config.json").read_text())["dtype"] == "float32"


# -- tensors in memory (SGLang's distributed weight update) -------------------------------------

def test_update_from_hf_tensors_and_hf_tensor_are_the_way_back():
    """Tensors by HF name go into a copy of the model (some layers of a stacked parameter only, cast
    to the parameter's dtype); the original is untouched; hf_tensor reads one back as HF lays it out;
    wrong names and shapes are refused naming the tensor, before anything changes."""
    from flax import nnx

    from rstar_jax.model.hf import hf_tensor, hf_tensors, update_from_hf_tensors
    from rstar_jax.model.qwen3 import Qwen3

    config = Qwen3Config.tiny(num_layers=3)
    old, new = Qwen3(config, rngs=nnx.Rngs(0)), Qwen3(config, rngs=nnx.Rngs(1))
    before = dict(hf_tensors(old))
    theirs = dict(hf_tensors(new, "bfloat16"))
    sent = {k: v for k, v in theirs.items() if ".1." in k or not k.startswith("model.layers.")}
    updated = update_from_hf_tensors(old, sent)
    after = dict(hf_tensors(updated))
    for name, value in after.items():
        want = sent[name].astype(np.float32) if name in sent else before[name]
        np.testing.assert_array_equal(value, want, err_msg=name)
        np.testing.assert_array_equal(hf_tensor(updated, name), value, err_msg=name)
    assert updated.q_proj[...].dtype == jnp.float32
    np.testing.assert_array_equal(dict(hf_tensors(old))["model.layers.1.mlp.up_proj.weight"],
                                  before["model.layers.1.mlp.up_proj.weight"])  # the original is unchanged

    with pytest.raises(CheckpointError, match=r"'model\.layers\.3\.mlp\.up_proj\.weight' is not a parameter"):
        update_from_hf_tensors(old, {"model.layers.3.mlp.up_proj.weight": np.zeros((128, 64), np.float32)})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        update_from_hf_tensors(old, {"model.norm.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match="no tensor 'lm_head.bias'"):
        hf_tensor(old, "lm_head.bias")
    tied = Qwen3(Qwen3Config.tiny(tie_word_embeddings=True), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(hf_tensor(tied, "lm_head.weight"), hf_tensor(tied, "model.embed_tokens.weight"))
    assert update_from_hf_tensors(tied, {"lm_head.weight": np.zeros((320, 64), np.float32)}) is not tied


def test_checkpoints_with_equal_configs_load_as_independent_models(tmp_path, tokens):
    """Two checkpoints of one architecture: each loaded model holds its own file's weights, and
    loading the second leaves the first as it was (the loader's shape-only model is shared)."""
    from safetensors.numpy import load_file

    first_hf, second_hf = _hf_model(False, 10_000.0, seed=1), _hf_model(False, 10_000.0, seed=2)
    first_hf.save_pretrained(tmp_path / "a")
    second_hf.save_pretrained(tmp_path / "b")
    first = load_pretrained(tmp_path / "a")
    first_logits = _our_logits(first, tokens)
    second = load_pretrained(tmp_path / "b")
    np.testing.assert_allclose(_our_logits(first, tokens), _hf_logits(first_hf, tokens), atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(_our_logits(first, tokens), first_logits)
    np.testing.assert_allclose(_our_logits(second, tokens), _hf_logits(second_hf, tokens), atol=1e-4, rtol=1e-4)
    # Each export equals its own source file, tensor by tensor.
    for model, source in ((first, "a"), (second, "b")):
        save_pretrained(model, tmp_path / f"{source}_export")
        want = load_file(tmp_path / source / "model.safetensors")
        got = load_file(tmp_path / f"{source}_export" / "model.safetensors")
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name].astype(np.float32), want[name].astype(np.float32), err_msg=name)
