"""TokenArray reads like the list it replaces, keeps every value exactly, and the trajectories built
with it (the loop's "array" buffers) equal those built with lists, pack the same and hold 13 bytes a
token."""

import copy
import pickle

import numpy as np
import pytest

from rstar_jax.rollout.tokens import TokenArray
from rstar_jax.rollout.trajectory import TOKEN_DTYPES, Trajectory, pack_trajectories, unpack_trajectories


def test_list_semantics():
    a = TokenArray([1, 2, 3])
    a += [4, 5]
    a.append(6)
    a.extend(TokenArray([7]))
    assert a == [1, 2, 3, 4, 5, 6, 7] and [1, 2, 3, 4, 5, 6, 7] == a and a == (1, 2, 3, 4, 5, 6, 7)
    assert a != [1, 2] and a != [1, 2, 3, 4, 5, 6, 8] and not (a == "abc") and a != 5
    assert len(a) == 7 and a[0] == 1 and a[-1] == 7 and type(a[2]) is int
    assert a[2:4] == [3, 4] and isinstance(a[2:4], TokenArray) and a[::-2] == [7, 5, 3, 1]
    assert list(a) == [1, 2, 3, 4, 5, 6, 7] and all(type(x) is int for x in a) and list(reversed(a))[0] == 7
    assert [0] + a == [0, 1, 2, 3, 4, 5, 6, 7] and a + [8] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (a + a).dtype == np.int32 and ([0] + a).dtype == np.int32
    assert 3 in a and 9 not in a and a.count(3) == 1 and a.index(4) == 3 and sum(a) == 28
    with pytest.raises(ValueError):
        a.index(9)
    with pytest.raises(IndexError):
        a[7]
    del a[5:]
    assert a == [1, 2, 3, 4, 5]
    a[0] = 9
    a[1:3] = [8, 7]
    del a[1]
    assert a == [9, 7, 4, 5]
    a[1:3] = [1, 1, 1]  # a resizing slice assignment, as a list's
    assert a == [9, 1, 1, 1, 5]
    a.insert(0, 2)
    assert a == [2, 9, 1, 1, 1, 5] and a.pop() == 5 and a == [2, 9, 1, 1, 1]
    assert TokenArray() == [] and not TokenArray() and len(TokenArray()) == 0
    assert {"x": TokenArray([1])} == {"x": [1]}


def test_values_are_kept_exactly():
    ids = TokenArray([1, 2])
    ids.append(2**40)  # past int32: the buffer widens
    assert ids.dtype == np.int64 and ids == [1, 2, 2**40]
    logprobs = TokenArray([-0.5], np.float32)
    logprobs.extend(np.float32([-0.1]).tolist())  # float32 values (as SGLang sends them) stay float32
    assert logprobs.dtype == np.float32
    logprobs.append(0.1)  # not a float32 value: float64 from now on, nothing rounded
    assert logprobs.dtype == np.float64 and logprobs[-1] == 0.1 and logprobs[0] == -0.5
    mixed = TokenArray([1])
    mixed.append(1.5)  # a float in an id buffer: kept as a float
    assert mixed == [1, 1.5]
    nan = TokenArray([float("nan")], np.float32)
    assert nan == [float("nan")]  # the same numbers, NaN included
    with pytest.raises(TypeError):
        TokenArray(["a"])


def test_numpy_view_copies_and_pickling():
    a = TokenArray([1, 2, 3])
    view = np.asarray(a)
    assert view.dtype == np.int32 and not view.flags.writeable and np.shares_memory(view, a.view())
    assert np.asarray(a, np.int64).dtype == np.int64 and np.asarray(a, copy=True).flags.writeable
    for other in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a), copy.copy(a), a.copy()):
        assert other == a and other.dtype == a.dtype and other is not a
        other.append(4)
        assert a == [1, 2, 3]
    for n in range(100):
        a.append(n)
    assert a.capacity > len(a) and a.trim().capacity == len(a) == 103


def _sample(buffers: str) -> Trajectory:
    t = Trajectory.begin([5, 6, 7], buffers=buffers, group_id=3, question="q")
    t.extend_sampled([11, 12, 13], [-0.5, -0.25, -0.125], 4)
    t.extend_observation([20, 21])
    t.extend_sampled([14, 15], np.float32([-1.5, -2.5]), (4, 5))
    t.extend_sampled([16], [-3.0], 5)
    t.truncate_response(7)  # the last request is lost (a failover): it restarts
    t.trim()
    return t


def test_trajectories_from_arrays_and_lists_are_equal_and_pack_the_same():
    arrays, lists = _sample("array"), _sample("list")
    assert all(isinstance(getattr(arrays, name), TokenArray) for name in TOKEN_DTYPES)
    assert all(type(getattr(lists, name)) is list for name in TOKEN_DTYPES)
    assert {name: getattr(arrays, name).dtype for name in TOKEN_DTYPES} == {k: np.dtype(v) for k, v in
                                                                          TOKEN_DTYPES.items()}
    assert arrays == lists
    assert arrays.response_ids == [11, 12, 13, 20, 21, 14, 15] and arrays.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert arrays.policy_versions == [4, 4, 4, -1, -1, 4, 5] and arrays.sampler_logprobs[3:] == [0.0, 0.0, -1.5, -2.5]
    assert arrays.num_sampled_tokens == lists.num_sampled_tokens == 5
    assert arrays.policy_version == lists.policy_version == 4
    assert all(np.array_equal(arrays.arrays()[k], lists.arrays()[k]) for k in arrays.arrays())
    packed_a, meta_a = pack_trajectories([arrays, arrays])
    packed_l, meta_l = pack_trajectories([lists, lists])
    assert packed_a.keys() == packed_l.keys() and meta_a == meta_l
    for key in packed_a:
        assert packed_a[key].dtype == packed_l[key].dtype and np.array_equal(packed_a[key], packed_l[key]), key
    decoded = unpack_trajectories(packed_a, meta_a)
    assert decoded == [lists, lists] and decoded[0].sampler_logprobs.dtype == np.float32
    decoded[0].extend_observation([1])  # a decoded trajectory grows on its own
    assert len(decoded[1].response_ids) == 7


def test_token_bytes():
    t = Trajectory.begin(list(range(500, 1500)), group_id=0)
    for turn in range(4):
        t.extend_sampled(np.arange(1000, 2000) + turn, np.full(1000, -0.5, np.float32), 1)
        t.extend_observation(list(range(300, 360)))
    t.trim()
    listed = Trajectory(prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids), loss_mask=list(t.loss_mask),
                        sampler_logprobs=list(t.sampler_logprobs), policy_versions=list(t.policy_versions))
    tokens = len(t.prompt_ids) + len(t.response_ids)
    per_token = t.token_bytes() / tokens
    assert per_token < (4 * len(t.prompt_ids) + 13 * len(t.response_ids) + 2000) / tokens
    assert listed.token_bytes() > 4 * t.token_bytes()
