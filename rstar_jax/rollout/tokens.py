"""`TokenArray`: a growable one-dimensional numpy buffer that reads like the list it replaces.

A trajectory's per-token fields (token ids, loss mask, sampler log-probs, policy versions) are held
from its first turn until the update: thousands of trajectories of thousands of tokens per trainer
process at the paper's scale. As Python lists they cost 8 bytes of pointer per token plus an object
for every id above 256 and every log-prob (about 36 + 8 + 32 + 8 bytes a token); as typed arrays 4
(int32 ids) + 1 (int8 mask) + 4 (float32 log-probs) + 4 (int32 versions).

The buffer keeps the list's reading semantics, so code written for lists keeps working:
- `len`, iteration and indexing give Python ints and floats; a slice is a TokenArray (a copy);
- `==` compares element for element with any sequence (a list, a tuple, an array, another
  TokenArray) and gives one bool; `+` concatenates (also `list + TokenArray`), `+=` extends;
- `append`, `extend`, `del buf[k:]`, item and slice assignment, `count`, `index`, `in`.
`np.asarray(buf)` is a read-only view of the valid part (no copy): write through a copy.

Values are never changed by the storage: an extension whose values the current dtype cannot hold
exactly (an id past int32, a log-prob that is not a float32 value, a float in an integer buffer)
widens the buffer (int64, float64) first. Generators' ids and log-probs (SGLang's float32 log-probs
as JSON, the JAX engine's) fit the narrow types, so the loop's buffers stay narrow.

Growth is geometric (x1.5); `trim()` drops the spare capacity once a buffer stops growing (the
rollout loop trims a finished trajectory's buffers).
"""

from __future__ import annotations

import collections.abc
from typing import Any, Iterable

import numpy as np

_GROWTH = 1.5
_MIN_CAPACITY = 16


def _as_array(values: Any) -> np.ndarray:
    """`values` as a one-dimensional numeric array (a view where it already is one)."""
    if isinstance(values, TokenArray):
        return values._data[:values._n]
    array = values if isinstance(values, np.ndarray) else np.asarray(
        values if isinstance(values, (list, tuple)) else list(values))
    if array.ndim != 1:
        if array.ndim == 0:
            raise TypeError(f"TokenArray: expected a sequence of numbers, got {type(values).__name__}")
        raise ValueError(f"TokenArray: expected a one-dimensional sequence, got shape {array.shape}")
    if array.dtype.kind not in "biuf":
        if array.size == 0:
            return np.zeros(0, np.int64)
        raise TypeError(f"TokenArray: values must be numbers, got dtype {array.dtype}")
    return array


_BOUNDS: dict[np.dtype, tuple[int, int]] = {}


def _bounds(dtype: np.dtype) -> tuple[int, int]:
    bounds = _BOUNDS.get(dtype)
    if bounds is None:
        info = np.iinfo(dtype)
        bounds = _BOUNDS[dtype] = (int(info.min), int(info.max))
    return bounds


def _holds(dtype: np.dtype, values: np.ndarray) -> bool:
    """Whether `dtype` holds every one of `values` exactly."""
    if values.size == 0 or values.dtype == dtype:
        return True
    if dtype.kind in "iu":
        if values.dtype.kind not in "biu":
            return False
        if values.dtype.kind == "b" or (values.dtype.itemsize < dtype.itemsize and
                                        (values.dtype.kind == dtype.kind or values.dtype.kind == "u")):
            return True
        lo, hi = _bounds(dtype)
        return lo <= int(values.min()) and int(values.max()) <= hi
    if values.dtype.kind == "b" or (values.dtype.kind in "iu" and values.dtype.itemsize <= 2) or (
            values.dtype.kind == "f" and values.dtype.itemsize <= dtype.itemsize):
        return True
    # a float buffer narrower than the values: exact when the round trip gives the same numbers
    narrowed = values.astype(dtype)
    if values.dtype.kind == "f" and (narrowed == values).all():
        # float values compared with their narrowed copy in the wider type (which holds the narrow
        # values exactly); a NaN, never equal to itself, takes the comparison below
        return True
    return bool(np.array_equal(narrowed.astype(values.dtype), values, equal_nan=True))


def _holds_scalar(dtype: np.dtype, value) -> bool:
    """`_holds` for one Python number (no array made)."""
    if type(value) is int or type(value) is bool:
        if dtype.kind in "iu":
            lo, hi = _bounds(dtype)
            return lo <= value <= hi
        return abs(value) <= (1 << 53 if dtype.itemsize >= 8 else 1 << 24)
    if type(value) is float:
        if dtype.kind != "f":
            return False
        return dtype.itemsize >= 8 or value != value or float(dtype.type(value)) == value
    return _holds(dtype, _as_array((value,)))


def _wider(dtype: np.dtype, values: np.ndarray) -> np.dtype:
    """The dtype a buffer of `dtype` widens to so that it also holds `values` exactly."""
    if dtype.kind in "iu" and values.dtype.kind in "biu":
        return np.dtype(np.int64)
    return np.dtype(np.float64)


class TokenArray(collections.abc.MutableSequence):
    """A growable typed buffer of numbers with list semantics (see the module docstring)."""

    __slots__ = ("_data", "_n")

    def __init__(self, values: Iterable = (), dtype: Any = np.int32):
        dtype = np.dtype(dtype)
        array = _as_array(values)
        if not _holds(dtype, array):
            dtype = _wider(dtype, array)
        self._data = np.array(array, dtype=dtype, copy=True)
        self._n = int(array.size)

    @classmethod
    def _wrap(cls, data: np.ndarray) -> "TokenArray":
        """A TokenArray over `data` itself (no copy): `data` is owned by it from now on."""
        out = cls.__new__(cls)
        out._data, out._n = data, int(data.size)
        return out

    # -- reading ---------------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer, its spare capacity included."""
        return int(self._data.nbytes)

    @property
    def capacity(self) -> int:
        return int(self._data.size)

    def view(self) -> np.ndarray:
        """The valid part as a read-only array view (changes as the buffer is written)."""
        out = self._data[:self._n]
        out.flags.writeable = False
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self._data[:self._n]
        if dtype is not None and np.dtype(dtype) != out.dtype:
            return out.astype(dtype)
        if copy:
            return out.copy()
        out.flags.writeable = False
        return out

    def tolist(self) -> list:
        return self._data[:self._n].tolist()

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return iter(self._data[:self._n].tolist())

    def __reversed__(self):
        return iter(self._data[:self._n][::-1].tolist())

    def __getitem__(self, index):
        if isinstance(index, slice):
            return TokenArray._wrap(self._data[:self._n][index].copy())
        return self._data[self._position(index)].item()

    def _position(self, index) -> int:
        i = int(index) if not isinstance(index, int) else index
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("TokenArray index out of range")
        return i

    def __contains__(self, value) -> bool:
        try:
            return bool(np.any(self._data[:self._n] == value))
        except (TypeError, ValueError):
            return False

    def count(self, value) -> int:
        return int(np.count_nonzero(self._data[:self._n] == value))

    def index(self, value, start: int = 0, stop: int | None = None) -> int:
        start, stop, _ = slice(start, stop).indices(self._n)
        hits = np.flatnonzero(self._data[start:stop] == value)
        if not hits.size:
            raise ValueError(f"{value!r} is not in TokenArray")
        return start + int(hits[0])

    def __eq__(self, other) -> bool:
        if isinstance(other, (str, bytes)) or not isinstance(other, (collections.abc.Sequence, np.ndarray)):
            return NotImplemented
        if len(other) != self._n:
            return False
        try:
            theirs = _as_array(other)
        except (TypeError, ValueError, OverflowError):
            return list(self) == list(other)
        mine = self._data[:self._n]
        nan = mine.dtype.kind == "f" or theirs.dtype.kind == "f"
        return bool(np.array_equal(mine, theirs, equal_nan=nan))

    def __ne__(self, other) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # mutable, as a list

    def __repr__(self) -> str:
        return f"TokenArray({self.tolist()!r}, dtype={self.dtype.name})"

    def _concatenated(self, other, *, mine_first: bool):
        try:
            theirs = _as_array(other)
        except (TypeError, ValueError, OverflowError):
            return NotImplemented
        mine = self._data[:self._n]
        dtype = mine.dtype if _holds(mine.dtype, theirs) else np.result_type(mine.dtype, _wider(mine.dtype, theirs))
        parts = (mine, theirs) if mine_first else (theirs, mine)
        return TokenArray._wrap(np.concatenate(parts, dtype=dtype))

    def __add__(self, other) -> "TokenArray":
        return self._concatenated(other, mine_first=True)

    def __radd__(self, other) -> "TokenArray":
        return self._concatenated(other, mine_first=False)

    # -- pickling and copies ---------------------------------------------------------------------
    def __reduce__(self):
        return (TokenArray._wrap, (self._data[:self._n].copy(),))

    def __copy__(self) -> "TokenArray":
        return TokenArray._wrap(self._data[:self._n].copy())

    def __deepcopy__(self, memo) -> "TokenArray":
        return self.__copy__()

    def copy(self) -> "TokenArray":
        return self.__copy__()

    # -- writing ---------------------------------------------------------------------------------
    def _reserve(self, size: int, dtype: np.dtype | None = None) -> None:
        """Room for `size` values (and the dtype `dtype`, when given)."""
        dtype = self._data.dtype if dtype is None else dtype
        if size <= self._data.size and dtype == self._data.dtype:
            return
        capacity = self._data.size
        if size > capacity:
            capacity = max(size, int(capacity * _GROWTH), _MIN_CAPACITY)
        data = np.empty(capacity, dtype)
        data[:self._n] = self._data[:self._n]
        self._data = data

    def _fitted(self, values: Any) -> np.ndarray:
        """`values` as an array the buffer holds exactly, the buffer widened first where needed."""
        array = _as_array(values)
        if not _holds(self._data.dtype, array):
            self._reserve(self._n, _wider(self._data.dtype, array))
        return array

    def extend(self, values: Iterable) -> None:
        array = self._fitted(values)
        end = self._n + array.size
        self._reserve(end)
        self._data[self._n:end] = array
        self._n = end

    def __iadd__(self, values: Iterable) -> "TokenArray":
        self.extend(values)
        return self

    def append(self, value) -> None:
        self.extend((value,))

    def fill(self, value, count: int) -> None:
        """Appends `count` copies of `value`."""
        if count <= 0:
            return
        if not _holds_scalar(self._data.dtype, value):
            self._fitted((value,))
        end = self._n + count
        self._reserve(end)
        self._data[self._n:end] = value
        self._n = end

    def insert(self, index: int, value) -> None:
        self._fitted((value,))
        index = max(0, min(self._n, index + self._n if index < 0 else index))
        self._reserve(self._n + 1)
        self._data[index + 1:self._n + 1] = self._data[index:self._n].copy()
        self._data[index] = value
        self._n += 1

    def __setitem__(self, index, value) -> None:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            array = self._fitted(value)
            if step == 1 and array.size != max(0, stop - start):  # a list's resizing slice assignment
                items = self.tolist()
                items[index] = array.tolist()
                rebuilt = TokenArray(items, self._data.dtype)
                self._data, self._n = rebuilt._data, rebuilt._n
                return
            self._data[:self._n][index] = array
            return
        array = self._fitted((value,))
        self._data[self._position(index)] = array[0]

    def __delitem__(self, index) -> None:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step == 1 and stop >= self._n:  # the common case: truncation
                self._n = min(self._n, start) if start < stop else self._n
                return
            keep = np.ones(self._n, bool)
            keep[index] = False
        else:
            keep = np.ones(self._n, bool)
            keep[self._position(index)] = False
        kept = self._data[:self._n][keep]
        self._data[:kept.size] = kept
        self._n = int(kept.size)

    def clear(self) -> None:
        self._n = 0

    def trim(self) -> "TokenArray":
        """Drops the spare capacity (a copy of the valid part when there is any); returns self."""
        if self._data.size != self._n:
            self._data = self._data[:self._n].copy()
        return self


def token_array(values: Iterable = (), dtype: Any = np.int32) -> TokenArray:
    """`values` as a TokenArray of `dtype` (widened where needed); a TokenArray of that dtype as is."""
    if isinstance(values, TokenArray) and values.dtype == np.dtype(dtype):
        return values
    return TokenArray(values, dtype)


__all__ = ["TokenArray", "token_array"]
