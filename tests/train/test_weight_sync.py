"""Weight sync that scales: the parallel bf16 disk export, and SGLang's distributed weight update
over torch.distributed (gloo here) between a trainer and a real `python -m rstar_jax.serve`."""

import asyncio
import datetime
import filecmp
import sys
import textwrap
import threading

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from rstar_jax.model.hf import hf_tensors, load_pretrained, save_pretrained
from rstar_jax.model.qwen3 import Qwen3, Qwen3Config
from rstar_jax.parallel import create_sharded_model, make_mesh
from rstar_jax.engine.local_server import LocalServer
from rstar_jax.rollout.protocol import SamplingParams
from rstar_jax.rollout.sglang import SGLangError, SGLangGenerator
from rstar_jax.engine.weight_transfer import TorchMissing, WeightUpdateGroup
from rstar_jax.train.weight_sync import DistributedSync, reachable_address
from tests.engine.test_engine import _reference

torch = pytest.importorskip("torch")

CONFIG = Qwen3Config.tiny()  # what `LocalServer("tiny")` serves
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _files(path):
    return sorted(p.name for p in path.iterdir())


def test_parallel_bf16_export_equals_the_sequential_one_and_transformers_loads_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = Qwen3(Qwen3Config.tiny(num_layers=3), rngs=nnx.Rngs(3))
    kw = dict(dtype="bfloat16", max_shard_bytes=40_000)
    sequential = save_pretrained(model, tmp_path / "sequential", writer_threads=1, **kw)
    parallel = save_pretrained(model, tmp_path / "parallel", writer_threads=4, **kw)
    names = _files(parallel)
    assert names == _files(sequential) and "model.safetensors.index.json" in names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(filecmp.cmp(sequential / n, parallel / n, shallow=False) for n in names)

    hf = transformers.Qwen3ForCausalLM.from_pretrained(parallel, dtype=torch.bfloat16)
    assert hf.model.layers[2].mlp.down_proj.weight.dtype == torch.bfloat16
    expected = np.asarray(model.down_proj[...])[2].T.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(hf.model.layers[2].mlp.down_proj.weight.detach().float().numpy(), expected)
    ours = load_pretrained(parallel, param_dtype="bfloat16")
    for name in ("embed", "q_proj", "o_proj", "lm_head"):
        np.testing.assert_array_equal(np.asarray(getattr(ours, name)[...]),
                                      np.asarray(getattr(model, name)[...]).astype(ml_dtypes.bfloat16))


def _sglang_rank(port, rank, world_size, group_name, timeout):
    """A rank joined exactly as SGLang's servers join (`init_custom_process_group` in sglang's
    utils: torch's process-group helper over a tcp:// rendezvous store prefixed by the group name).
    The reference for the store layout `WeightUpdateGroup` builds from public classes."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def test_the_group_joins_with_sglangs_own_construction():
    """Rank 0 as the trainer, rank 1 as an SGLang server joins, rank 2 as rstar_jax.serve joins:
    one rendezvous, and every broadcast (bf16 and f32) arrives bit for bit on both receivers."""
    import torch.distributed as dist

    sent = [torch.randn(3, 5).to(torch.bfloat16), torch.randn(7)]
    trainer = WeightUpdateGroup.host("127.0.0.1", 0, 3, group_name="g", backend="gloo", timeout_s=60)
    received, errors = {}, []

    def sglang_server():
        try:
            group = _sglang_rank(trainer.port, 1, 3, "g", datetime.timedelta(seconds=60))
            tensors = [torch.empty_like(t) for t in sent]
            for t in tensors:
                dist.broadcast(t, src=0, group=group)
            received["sglang"] = tensors
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    def our_server():
        try:
            group = WeightUpdateGroup.connect("127.0.0.1", trainer.port, 2, 3, group_name="g", backend="gloo",
                                              timeout_s=60)
            received["ours"] = group.receive(["bfloat16", "float32"], [[3, 5], [7]])
            group.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=sglang_server), threading.Thread(target=our_server)]
    for thread in threads:
        thread.start()
    trainer.join()
    trainer.broadcast(sent)
    for thread in threads:
        thread.join(60)
    trainer.close()
    assert not errors, errors
    for side in ("sglang", "ours"):
        for got, want in zip(received[side], sent):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_without_torch_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as where it is not installed
    with pytest.raises(TorchMissing, match=r"needs torch \(pip install 'rstar-jax\[distributed-sync\]'\)"):
        WeightUpdateGroup.host("127.0.0.1", 0, 2)


def test_reachable_address():
    assert reachable_address(["http://127.0.0.1:30000", "http://localhost:1"]) == "127.0.0.1"
    assert reachable_address(["http://127.0.0.1:30000", "http://10.1.2.3:30000"]) not in ("", "127.0.0.1")


def test_the_config_chooses_and_configures_the_sync(tmp_path):
    """`weight_sync.*` reaches the objects: the method picks the class, every knob its field."""
    from rstar_jax.config import REPO_CONFIGS, load_config_file, validate
    from rstar_jax.app import builders
    from rstar_jax.train.weight_sync import DiskSync

    def build(**fields):
        config = load_config_file(REPO_CONFIGS / "tiny.py")
        config.update_from_flattened_dict({"run_dir": str(tmp_path), "rollout.backend": "sglang",
                                           "rollout.servers": ("http://10.0.0.9:30000",),
                                           **{f"weight_sync.{k}": v for k, v in fields.items()}})
        resources = builders.RolloutResources(client=None, scorer=None, generators=[SGLangGenerator("http://x:1")])
        return builders.weight_sync(validate(config, check_files=False), resources), resources

    sync, resources = build(method="distributed", mode="pause", dtype="bfloat16", master_address="10.0.0.1",
                            master_port=29555, backend="gloo", group_name="g", bucket_bytes=1234)
    assert isinstance(sync, DistributedSync) and resources.closers == [sync.close]
    assert (sync.mode, sync.dtype, sync.master_address, sync.master_port, sync.backend, sync.group_name,
            sync.bucket_bytes) == ("pause", "bfloat16", "10.0.0.1", 29555, "gloo", "g", 1234)
    sync, _ = build(directory=str(tmp_path / "shm"), mode="abort", max_shard_bytes=99, writer_threads=3)
    assert isinstance(sync, DiskSync) and sync.directory == tmp_path / "shm"
    assert (sync.mode, sync.dtype, sync.max_shard_bytes, sync.writer_threads) == ("abort", "float32", 99, 3)
    sync, _ = build()
    assert sync.directory == tmp_path / "weights_sync"  # the default: in the run directory


# -- against a real `python -m rstar_jax.serve` ----------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with LocalServer("tiny", slots=2, max_length=256, seed=0) as s:
        yield s


async def _read_all(gen, names):
    values = await asyncio.gather(*(gen.get_weights_by_name(n, truncate_size=1 << 20) for n in names))
    return {n: np.asarray(v, np.float32) for n, v in zip(names, values)}


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.slow
def test_distributed_sync_makes_the_servers_weights_the_trainers_bit_for_bit(server):
    """The trainer (this process) joins the server through /init_weights_update_group and
    broadcasts over gloo: afterwards every parameter the server reads back (/get_weights_by_name)
    is the trainer's, bit for bit, and greedy generations are the trainer's; an unknown tensor is
    refused by name without breaking the group. Then bf16 in small buckets (layers of one parameter
    split across calls) in pause mode through a second group, and the group destroyed."""
    sharded = create_sharded_model(CONFIG, make_mesh(fsdp=8), seed=7)  # per-layer gathers onto one device
    single = Qwen3(CONFIG, rngs=nnx.Rngs(11))  # DLPack views of one device's arrays
    prompt = np.random.default_rng(0).integers(1, CONFIG.vocab_size, 9).tolist()

    async def run():
        async with SGLangGenerator(server.url) as gen:
            sync = DistributedSync([gen], dtype="float32", mode="wait", timeout_s=60)
            await sync.push(single, version=4)  # forms the group
            # An unknown tensor: the server still receives it (the trainer is sending), then refuses it.
            bad = asyncio.ensure_future(gen.update_weights_from_distributed(
                ["model.layers.9.mlp.up_proj.weight"], ["float32"], [[3]]))
            await asyncio.to_thread(sync._group.broadcast, [torch.zeros(3)])
            with pytest.raises(SGLangError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
                await bad
            await sync.push(sharded, version=5)  # the same group
            expected = dict(hf_tensors(sharded, "float32"))
            got = await _read_all(gen, list(expected))
            first = (expected, got, await gen.generate(prompt, GREEDY), await gen.weight_version())

            bf16 = DistributedSync([gen], dtype="bfloat16", mode="pause", bucket_bytes=20_000, timeout_s=60)
            # A trainer that died inside SGLang 0.5.23's weight-update session left it open: the
            # next push closes it before opening its own.
            assert await gen.begin_weight_update()
            await bf16.push(single, version=6)  # destroys the first group, joins anew
            plan = bf16._plan(single)
            expected16 = dict(hf_tensors(single, "bfloat16"))
            got16 = await _read_all(gen, list(expected16))
            second = (expected16, got16, await gen.generate(prompt, GREEDY), await gen.weight_version(), plan)
            await bf16.close()
            with pytest.raises(SGLangError, match="does not exist"):
                await gen.destroy_weights_update_group()
            with pytest.raises(SGLangError, match="no weight-update session is open"):
                await gen.end_weight_update()  # every push closed the session it opened
            return first, second

    (expected, got, generated, version), (expected16, got16, generated16, version16, plan) = asyncio.run(run())
    assert version == "5" and generated.weight_version == 5
    assert len(got) == 3 + 11 * CONFIG.num_layers
    for name, value in expected.items():
        assert got[name].shape == value.shape and np.array_equal(_bits(got[name]), _bits(value)), name
    assert generated.token_ids == _reference(sharded, prompt, GREEDY.max_new_tokens)[0]

    # bf16 travels; the server's float32 parameters hold exactly the bf16 values.
    def kind(name):  # "model.layers.3.mlp.up_proj.weight" -> "mlp.up_proj.weight"
        return name.split(".", 3)[-1]

    assert len(plan) > 2 and any(kind(a[-1]) == kind(b[0]) for a, b in zip(plan, plan[1:]))  # a split parameter
    assert version16 == "6" and generated16.weight_version == 6
    for name, value in expected16.items():
        assert value.dtype == ml_dtypes.bfloat16
        assert np.array_equal(_bits(got16[name]), _bits(value.astype(np.float32))), name


TWO_TRAINERS = textwrap.dedent("""
    import asyncio
    import sys

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process_id, port, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from rstar_jax.model.qwen3 import Qwen3Config
    from rstar_jax.parallel import create_sharded_model, make_mesh
    from rstar_jax.rollout.sglang import SGLangGenerator
    from rstar_jax.train.weight_sync import DistributedSync

    model = create_sharded_model(Qwen3Config.tiny(), make_mesh(fsdp=8), seed=0)
    assert not model.embed[...].is_fully_addressable  # every parameter spans both processes


    async def push():
        async with SGLangGenerator(url) as gen:
            sync = DistributedSync([gen], dtype="float32", bucket_bytes=50_000, timeout_s=60)
            await sync.push(model, 9)  # both processes gather; the writer alone broadcasts
            await sync.close()

    asyncio.run(push())
""")


@pytest.mark.slow
def test_two_trainer_processes_sync_parameters_that_span_them(server):
    """Under `jax.distributed` every process takes part in the gathers and the writer process is
    rank 0: the server ends with the one-process model's parameters, bit for bit."""
    from tests.parallel.test_multiprocess import run_processes

    results = run_processes(TWO_TRAINERS, server.url)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    expected = dict(hf_tensors(create_sharded_model(CONFIG, make_mesh(fsdp=8), seed=0), "float32"))

    async def read():
        async with SGLangGenerator(server.url) as gen:
            return await _read_all(gen, list(expected)), await gen.weight_version()

    got, version = asyncio.run(read())
    assert version == "9"
    for name, value in expected.items():
        assert np.array_equal(_bits(got[name]), _bits(value)), name


@pytest.mark.slow
def test_an_in_place_push_lets_a_running_generation_go_on_under_the_new_weights(server, tmp_path):
    """weight_sync.mode "in_place" against a real serve: a push lands while a long generation runs;
    the generation is neither aborted nor drained but finishes under the new weights, and
    `meta_info.weight_versions` (SGLang 0.5.23's spans) gives each token the version that sampled it."""
    from rstar_jax.train.weight_sync import DiskSync

    prompt = np.random.default_rng(1).integers(1, CONFIG.vocab_size, 8).tolist()
    long = SamplingParams(max_new_tokens=240, temperature=0.0)

    async def run():
        async with SGLangGenerator(server.url) as gen:
            sync = DiskSync([gen], tmp_path / "weights", mode="in_place", dtype="float32")
            for attempt in range(5):  # a push that lands before the first token or after the last: again
                version = 20 + 2 * attempt
                await sync.push(Qwen3(CONFIG, rngs=nnx.Rngs(version)), version)
                running = asyncio.ensure_future(gen.generate(prompt, long))
                while (await gen.capacity()).running_requests == 0 and not running.done():
                    await asyncio.sleep(0.002)
                await asyncio.sleep(0.02 * (attempt + 1))
                await sync.push(Qwen3(CONFIG, rngs=nnx.Rngs(version + 1)), version + 1)
                result = await running
                if result.token_versions is not None:
                    return version, result
            raise AssertionError("no push landed inside a generation in 5 attempts")

    version, result = asyncio.run(run())
    assert result.finish_reason != "abort" and result.weight_version == version + 1
    split = result.token_versions.index(version + 1)
    assert 0 < split < len(result.token_ids)
    assert result.token_versions == (version,) * split + (version + 1,) * (len(result.token_ids) - split)
