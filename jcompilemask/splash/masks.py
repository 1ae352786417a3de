"""SplashAttention's mask classes, with the same constructors, fields and dense views.

Each class mirrors the one of the same name in
``jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask``: ``shape``,
numpy slicing ``mask[q_slice, kv_slice]`` (``mask[h, q_slice, kv_slice]`` for a
:class:`MultiHeadMask`), ``&`` / ``|`` building :class:`LogicalAnd` / :class:`LogicalOr`, and
``bool(mask)`` raising (so ``and`` / ``or`` on masks fail loudly). They are descriptions
only: :func:`jcompilemask.splash.to_jcm` turns them (or JAX's own objects) into a MaskSpec
or a :func:`jcompilemask.from_dense` mask.

>>> from jcompilemask.splash import CausalMask, LocalMask
>>> m = CausalMask((4, 4)) & LocalMask((4, 4), (1, 0), 0)
>>> m[:, :].astype(int).tolist()
[[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["Mask", "FullMask", "CausalMask", "LocalMask", "ChunkedCausalMask", "NumpyMask",
           "MultiHeadMask", "LogicalAnd", "LogicalOr", "make_causal_mask",
           "make_local_attention_mask", "make_chunk_attention_mask", "make_random_mask"]


def _shape2(shape, what):
    if (not isinstance(shape, tuple) or len(shape) != 2
            or not all(isinstance(n, (int, np.integer)) and n >= 1 for n in shape)):
        raise ValueError(f"{what}: shape must be a (q_seq_len, kv_seq_len) tuple of positive "
                         f"ints, got {shape!r}")
    return (int(shape[0]), int(shape[1]))


def _fill(s, size):
    if not isinstance(s, slice) or s.step not in (None, 1):
        raise NotImplementedError(f"masks are sliced with unit-step slices, got {s!r}")
    start, stop, _ = s.indices(size)
    return start, max(start, stop)


class Mask:
    """Base class: a lazy boolean [q_seq_len, kv_seq_len] (or [heads, ...]) mask."""

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def __getitem__(self, idx) -> np.ndarray:
        raise NotImplementedError

    def __bool__(self):
        raise NotImplementedError("a splash mask has no truth value: combine masks with & "
                                  "and |, not `and` / `or`")

    def __and__(self, other: "Mask") -> "Mask":
        return LogicalAnd(self, other)

    def __or__(self, other: "Mask") -> "Mask":
        return LogicalOr(self, other)


class _ComputableMask(Mask):
    """A 2-D mask given by ``mask_function(q_ids, kv_ids) -> bool array``, evaluated on
    numpy index grids (``q_ids`` [R, 1] taken from ``q_sequence``, ``kv_ids`` [1, C]).

    Subclass it for a custom lazy mask (define ``__eq__`` and ``__hash__``, as splash
    asks); the built-in subclasses also define ``_key``. A subclass that jcompilemask does
    not know converts through its dense view (:func:`jcompilemask.from_dense`).

    >>> m = _ComputableMask((3, 3), lambda q, k: q == k)
    >>> m[:, :].astype(int).tolist()
    [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    """

    def __init__(self, shape: tuple[int, int], mask_function: Callable[..., Any],
                 shard_count: int = 1):
        self._shape = _shape2(shape, type(self).__name__)
        if not isinstance(shard_count, (int, np.integer)) or shard_count < 1 or \
                self._shape[0] % (shard_count * shard_count):
            raise ValueError(f"shard count squared ({shard_count}**2) must divide q_seq_len "
                             f"({self._shape[0]})")
        self.shard_count = int(shard_count)
        self.mask_function = mask_function
        self.q_sequence = np.arange(self._shape[0], dtype=np.int32)

    @property
    def shape(self):
        return self._shape

    def __getitem__(self, idx):
        if not isinstance(idx, tuple) or len(idx) != 2:
            raise NotImplementedError(f"unsupported slice {idx!r}: use mask[q_slice, kv_slice]")
        (r0, r1), (c0, c1) = _fill(idx[0], self._shape[0]), _fill(idx[1], self._shape[1])
        rows = self.q_sequence[r0:r1].astype(np.int64)[:, None]
        cols = np.arange(c0, c1, dtype=np.int64)[None, :]
        out = np.asarray(self.mask_function(rows, cols))
        return np.broadcast_to(out, (r1 - r0, c1 - c0)).astype(np.bool_)

    def _key(self):
        raise NotImplementedError

    def __eq__(self, other):
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self):
        return hash((type(self).__name__,) + self._key())

    def __repr__(self):
        return f"{type(self).__name__}{self._key()}"


class FullMask(_ComputableMask):
    """Every query sees every key."""

    def __init__(self, _shape: tuple[int, int]):
        super().__init__(_shape, lambda rows, cols: np.ones((1, 1), np.bool_))

    def _key(self):
        return (self._shape,)


class CausalMask(_ComputableMask):
    """Query i sees key j iff ``i + offset >= j``."""

    def __init__(self, shape: tuple[int, int], offset: int = 0, shard_count: int = 1):
        self.offset = int(offset)
        super().__init__(shape, lambda rows, cols: rows + self.offset >= cols, shard_count)

    def _key(self):
        return (self._shape, self.offset)


class LocalMask(_ComputableMask):
    """Query i sees key j iff ``i + offset - left <= j <= i + offset + right``; a side of
    ``window_size = (left, right)`` that is None is unbounded."""

    def __init__(self, shape: tuple[int, int], window_size: tuple[int | None, int | None],
                 offset: int, shard_count: int = 1):
        if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
            raise ValueError(f"window_size must be a (left, right) pair, got {window_size!r}")
        self.window_size = tuple(None if w is None else int(w) for w in window_size)
        self.offset = int(offset)
        super().__init__(shape, self._visible, shard_count)

    def _visible(self, rows, cols):
        left, right = self.window_size
        out = np.ones((1, 1), np.bool_)
        if left is not None:
            out = out & (rows + self.offset - left <= cols)
        if right is not None:
            out = out & (rows + self.offset + right >= cols)
        return out

    def _key(self):
        return (self._shape, self.window_size, self.offset)


class ChunkedCausalMask(_ComputableMask):
    """Causal within consecutive chunks of ``chunk_size`` tokens (Llama 4)."""

    def __init__(self, shape: tuple[int, int], chunk_size: int, shard_count: int = 1):
        self.chunk_size = _chunk(chunk_size)
        super().__init__(shape, lambda rows, cols: (rows // self.chunk_size
                                                    == cols // self.chunk_size)
                         & (rows >= cols), shard_count)

    def _key(self):
        return (self._shape, self.chunk_size)


def _chunk(chunk_size):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) \
            or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return int(chunk_size)


def _grid(shape):
    q_len, kv_len = _shape2(tuple(shape), "mask")
    return np.arange(q_len)[:, None], np.arange(kv_len)[None, :]


def make_causal_mask(shape: tuple[int, int], offset: int = 0) -> np.ndarray:
    """Dense bool [q_seq_len, kv_seq_len]: query i sees key j iff ``i + offset >= j``.

    >>> make_causal_mask((2, 3), offset=1).astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    rows, cols = _grid(shape)
    return rows + int(offset) >= cols


def make_local_attention_mask(shape: tuple[int, int],
                              window_size: tuple[int | None, int | None], *,
                              offset: int = 0) -> np.ndarray:
    """Dense view of :class:`LocalMask` (a None side of the window is unbounded).

    >>> make_local_attention_mask((3, 3), (1, 0)).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    rows, cols = _grid(shape)
    left, right = window_size
    out = np.ones((rows.shape[0], cols.shape[1]), np.bool_)
    if left is not None:
        out &= rows + int(offset) - int(left) <= cols
    if right is not None:
        out &= rows + int(offset) + int(right) >= cols
    return out


def make_chunk_attention_mask(shape: tuple[int, int], chunk_size: int) -> np.ndarray:
    """Dense view of :class:`ChunkedCausalMask`.

    >>> make_chunk_attention_mask((3, 3), 2).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    c = _chunk(chunk_size)
    rows, cols = _grid(shape)
    return (rows // c == cols // c) & (rows >= cols)


def make_random_mask(shape: tuple[int, int], sparsity: float, seed: int) -> np.ndarray:
    """Dense bool mask whose entries are visible with probability ``1 - sparsity``.

    Draws from numpy's global generator seeded with ``seed`` (as splash's helper does), so
    a seed gives the same mask as there.

    >>> make_random_mask((2, 2), 0.0, seed=0).tolist()
    [[True, True], [True, True]]
    """
    np.random.seed(seed)
    return np.random.binomial(n=1, p=1.0 - sparsity, size=tuple(shape)).astype(np.bool_)


class NumpyMask(Mask):
    """A mask given by a dense boolean [q_seq_len, kv_seq_len] numpy array."""

    def __init__(self, array):
        array = np.asarray(array)
        if array.ndim != 2:
            raise ValueError("Expected a 2-dim array")
        if array.dtype != np.bool_:
            raise ValueError("Mask must be a boolean array")
        self.array = array

    @property
    def shape(self):
        return self.array.shape

    def __getitem__(self, idx):
        return self.array[idx]

    def __eq__(self, other):
        return type(other) is type(self) and np.array_equal(self.array, other.array)

    def __hash__(self):
        return hash((type(self).__name__, self.array.shape, self.array.tobytes()))

    def __repr__(self):
        return f"NumpyMask(shape={self.array.shape})"


class _Binary(Mask):
    _op = None

    def __init__(self, left: Mask, right: Mask):
        if tuple(left.shape) != tuple(right.shape):
            raise ValueError(f"Masks must have the same shape, got {left.shape} and "
                             f"{right.shape}")
        self.left, self.right = left, right

    @property
    def shape(self):
        return self.left.shape

    def __getitem__(self, idx):
        return type(self)._op(self.left[idx], self.right[idx])

    def __eq__(self, other):
        return type(other) is type(self) and (self.left, self.right) == (other.left,
                                                                         other.right)

    def __hash__(self):
        return hash((type(self).__name__, self.left, self.right))

    def __repr__(self):
        return f"{type(self).__name__}({self.left!r}, {self.right!r})"


class LogicalAnd(_Binary):
    """Visible where both masks are visible."""

    _op = staticmethod(np.logical_and)


class LogicalOr(_Binary):
    """Visible where either mask is visible."""

    _op = staticmethod(np.logical_or)


class MultiHeadMask(Mask):
    """One 2-D mask per head; ``shape`` is (heads, q_seq_len, kv_seq_len)."""

    def __init__(self, masks: Sequence[Mask]):
        masks = tuple(masks)
        if not masks:
            raise ValueError("Unsupported empty tuple of masks")
        if not all(hasattr(m, "shape") and hasattr(m, "__getitem__") for m in masks):
            raise ValueError("masks should be of type Mask")
        shape = tuple(masks[0].shape)
        for m in masks[1:]:
            if tuple(m.shape) != shape:
                raise ValueError(f"Unexpected mask shape, got: {m.shape}, expected: {shape}")
        if len(shape) != 2:
            raise ValueError("Nesting MultiHeadMasks is not supported")
        self.masks = masks

    @property
    def shape(self):
        return (len(self.masks),) + tuple(self.masks[0].shape)

    def __getitem__(self, idx):
        if not isinstance(idx, tuple) or len(idx) != 3:
            raise NotImplementedError(f"Unsupported slice: {idx!r}")
        head = idx[0]
        if isinstance(head, (int, np.integer)):
            return self.masks[head][idx[1:]]
        return np.stack([m[idx[1:]] for m in self.masks[head]])

    def __eq__(self, other):
        return type(other) is type(self) and self.masks == other.masks

    def __hash__(self):
        return hash((type(self).__name__,) + tuple(hash(m) for m in self.masks))

    def __repr__(self):
        return f"MultiHeadMask({len(self.masks)} heads)"
