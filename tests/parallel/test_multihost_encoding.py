"""Trajectories as token arrays across processes (`pack_trajectories` + `allgather_arrays`): decoded
trajectories equal the originals field for field, types included."""

import dataclasses
import json
import random

import numpy as np
import pytest

from rstar_jax.parallel import multihost
from rstar_jax.parallel.multihost import allgather_arrays, decode_arrays, encode_arrays
from rstar_jax.rollout.tokens import TokenArray
from rstar_jax.rollout.trajectory import Trajectory, pack_trajectories, unpack_trajectories

TEXTS = ["", "plain", "ünïcödé ∑ 𝔽 — 数学 🤖", "line\nbreak\t\"quoted\" \\ back", "lone \ud800 surrogate", "\x00nul"]


def _typed(value):
    """`value` with every leaf paired with its type: equality then also checks types (1 vs 1.0 vs True).
    A TokenArray (the decoded per-token fields) reads as the list of Python numbers it holds."""
    if isinstance(value, TokenArray):
        value = value.tolist()
    if isinstance(value, dict):
        return {"dict": [(_typed(k), _typed(v)) for k, v in value.items()]}  # key order too
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_typed(v) for v in value])
    return (type(value).__name__, repr(value))


def random_trajectory(rng: random.Random, group: int, prompts: list[list[int]]) -> Trajectory:
    n = rng.choice([0, 0, 1, 2, rng.randint(3, 300)])  # empty responses included
    mask = []
    while len(mask) < n:  # turns of sampled tokens (1) and observations (0)
        mask += [rng.choice([0, 1])] * rng.randint(1, 40)
    mask = mask[:n]
    version = rng.randint(0, 2000)
    extra = rng.choice([
        {}, {"model_text": rng.choice(TEXTS)}, {"error": "context", "model_text": rng.choice(TEXTS)},
        {"model_text": rng.choice(TEXTS), "after": [1, 2.5, None]}, {"model_text": None}, {"note": None},
        {"model_text": 7, "x": {"nested": "ü"}},
    ])
    return Trajectory(
        prompt_ids=list(rng.choice(prompts)),
        response_ids=[rng.choice([0, 1, 151_643, 2**31 - 1, rng.randrange(200_000)]) for _ in range(n)],
        loss_mask=mask,
        sampler_logprobs=[float(np.float32(-rng.expovariate(1.0))) if m else 0.0 for m in mask],
        policy_versions=[version if m else -1 for m in mask],
        reward=rng.choice([0.0, 1.0, -0.5, 0.1 + 0.2]),
        finish_reason=rng.choice(["no_tool_call", "budget", "aborted", "", "ü"]),
        truncated=rng.choice([True, False]),
        group_id=group,
        sample_index=rng.randint(0, 31),
        question=rng.choice(TEXTS + [f"question {group}"]),
        gold_answer=rng.choice(["7", "\\frac{1}{2}", "", "√2"]),
        n_turns=rng.randint(0, 9),
        n_tool_calls=rng.randint(0, 9),
        n_tool_errors=rng.randint(0, 3),
        n_answer_tags=rng.randint(0, 2),
        tool_statuses=[rng.choice(["ok", "timeout", "error: ü"]) for _ in range(rng.randint(0, 4))],
        tool_seconds=rng.random() * 10,
        n_retractions=rng.randint(0, 2),
        n_failovers=rng.randint(0, 2),
        n_abort_resumes=rng.randint(0, 2),
        extra=extra,
    )


def random_trajectories(seed: int, count: int) -> list[Trajectory]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(150_000) for _ in range(rng.randint(0, 50))] for _ in range(4)]
    return [random_trajectory(rng, group=i // 4, prompts=prompts) for i in range(count)]


def round_trip(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Through the bytes that cross processes (the JSON side record included)."""
    return unpack_trajectories(*decode_arrays(encode_arrays(*pack_trajectories(trajectories))))


def assert_same(decoded: list[Trajectory], original: list[Trajectory]) -> None:
    assert len(decoded) == len(original)
    for d, o in zip(decoded, original):
        assert type(d) is Trajectory
        assert dataclasses.asdict(d) == dataclasses.asdict(o)
        assert _typed(dataclasses.asdict(d)) == _typed(dataclasses.asdict(o))
        assert d == o


@pytest.mark.parametrize("seed", range(5))
def test_random_trajectories_round_trip_exactly(seed):
    original = random_trajectories(seed, 60)
    snapshot = json.loads(json.dumps([dataclasses.asdict(t) for t in original]))
    decoded = round_trip(original)
    assert_same(decoded, original)
    assert [dataclasses.asdict(t) for t in original] == snapshot  # packing leaves the originals alone
    # No list is shared between decoded trajectories (a group's prompt travels once).
    assert len({id(t.prompt_ids) for t in decoded}) == len(decoded)


def test_every_field_is_exercised_and_survives():
    """Each field differs from its default in some trajectory, so dropping any field (or one added
    later that the packing forgot) fails the equality above."""
    original = random_trajectories(11, 200)
    default = dataclasses.asdict(Trajectory(prompt_ids=[]))
    for field in dataclasses.fields(Trajectory):
        assert any(dataclasses.asdict(t)[field.name] != default[field.name] for t in original), field.name
    assert_same(round_trip(original), original)


def test_a_dropped_field_is_detected():
    original = random_trajectories(3, 40)
    arrays, meta = pack_trajectories(original)
    arrays, meta = decode_arrays(encode_arrays(arrays, meta))
    meta["records"] = [[0] * (len(r) - 1) + [r[-1]] for r in meta["records"]]  # the side record lost
    with pytest.raises(AssertionError):
        assert_same(unpack_trajectories(arrays, meta), original)
    with pytest.raises(ValueError, match="fields"):
        unpack_trajectories(arrays, {**meta, "fields": meta["fields"][:-1]})


def test_edge_cases():
    assert round_trip([]) == []
    empty = [Trajectory(prompt_ids=[]), Trajectory(prompt_ids=[1], extra={"model_text": ""})]
    assert_same(round_trip(empty), empty)
    # Log-probs that are not float32 values travel as float64; large ids as int64.
    odd = [Trajectory(prompt_ids=[2**40], response_ids=[-(2**40), 3], loss_mask=[1, 1],
                      sampler_logprobs=[0.1, -1e-300], policy_versions=[2**33, 0])]
    arrays, _ = pack_trajectories(odd)
    assert arrays["sampler_logprobs"].dtype == np.float64 and arrays["response_ids"].dtype == np.int64
    assert_same(round_trip(odd), odd)


def test_compact_dtypes_for_real_trajectories():
    original = random_trajectories(5, 64)
    for t in original:
        t.response_ids = [i % 150_000 for i in t.response_ids]
    arrays, _ = pack_trajectories(original)
    assert arrays["response_ids"].dtype == np.int32
    assert arrays["sampler_logprobs"].dtype == np.float32
    assert arrays["loss_mask.values"].dtype == np.uint8
    total = sum(len(t.response_ids) for t in original)
    assert arrays["loss_mask.values"].size < total and arrays["policy_versions.values"].size < total


def test_encode_arrays_round_trips_any_numeric_arrays():
    arrays = {"a": np.arange(7, dtype=np.int16), "empty": np.zeros((0, 3), np.float32),
              "b": np.array([[1.5, -np.inf], [np.nan, 0.0]]), "u": np.frombuffer(b"xyz", np.uint8),
              "big": np.array([2**62], ">i8"), "flag": np.array([True, False])}
    meta = {"k": ["ü", None, 1.0]}
    decoded, back = decode_arrays(encode_arrays(arrays, meta).tobytes())
    assert back == meta and list(decoded) == list(arrays)
    for name, array in arrays.items():
        assert decoded[name].dtype == array.dtype and decoded[name].shape == array.shape
        np.testing.assert_array_equal(decoded[name], array)
    with pytest.raises(TypeError):
        encode_arrays({"o": np.array(["x"], object)})
    with pytest.raises(ValueError):
        decode_arrays(np.zeros(16, np.uint8))


def test_allgather_arrays_through_a_two_process_gather(monkeypatch):
    """The collective's padding and per-row decoding, with a fake two-process gather in which the
    other process sent `theirs`."""
    mine, theirs = random_trajectories(1, 30), random_trajectories(2, 50)
    sent = {"other": encode_arrays(*pack_trajectories(theirs))}

    def fake_allgather(x):
        other = sent["other"]
        x = np.asarray(x)
        if x.ndim == 0:
            return np.array([x, other.size])
        padded = np.zeros_like(x)
        padded[:other.size] = other
        return np.stack([x, padded])

    monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost.multihost_utils, "process_allgather", fake_allgather)
    gathered = allgather_arrays(*pack_trajectories(mine))
    assert_same([t for arrays, meta in gathered for t in unpack_trajectories(arrays, meta)], mine + theirs)
    sent["other"] = np.frombuffer(json.dumps([1, "ü"]).encode(), np.uint8)
    assert multihost.allgather_json({"a": "ü"}) == [{"a": "ü"}, [1, "ü"]]


def test_allgather_arrays_with_one_process():
    arrays, meta = pack_trajectories(random_trajectories(4, 5))
    [(back, back_meta)] = allgather_arrays(arrays, meta)
    assert back_meta is meta and all(back[k] is arrays[k] for k in arrays)
