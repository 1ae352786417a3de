"""``from_dense``: a fixed boolean mask as a compiled mask (interval tables = its runs)."""
from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np

from .compiled import CompiledMask, resolve_tiles
from .descriptor import ExecutionDescriptor, pack_tiles

__all__ = ["from_dense", "DenseMask"]


def _runs(mask: np.ndarray):
    """Runs of True along the last axis: (starts, lens) [..., R] padded with (0, 0)."""
    m = mask.astype(np.int8)
    pad = np.zeros(m.shape[:-1] + (1,), np.int8)
    d = np.diff(np.concatenate([pad, m, pad], -1), axis=-1)
    flat_d = d.reshape(-1, d.shape[-1])
    per_row = []
    for row in flat_d:
        s = np.flatnonzero(row == 1)
        e = np.flatnonzero(row == -1)
        per_row.append((s, e - s))
    r = max([len(s) for s, _ in per_row] + [1])
    starts = np.zeros((len(per_row), r), np.int32)
    lens = np.zeros((len(per_row), r), np.int32)
    for i, (s, ln) in enumerate(per_row):
        starts[i, :len(s)] = s
        lens[i, :len(s)] = ln
    return starts.reshape(m.shape[:-1] + (r,)), lens.reshape(m.shape[:-1] + (r,))


class DenseMask(CompiledMask):
    """A static mask compiled from a boolean array [Hm, Nq, Nk]; K = the most runs in a
    row, Kc = the most runs in a column. Descriptors are constants (no metadata)."""

    def __init__(self, mask: np.ndarray, name: str | None = None):
        self.array = mask
        self.name = name
        self.spec = None
        self.regions = ()
        self.fallback_regions = ()
        self.q_len, self.kv_len = mask.shape[-2:]
        self._fs, self._fl = _runs(mask)
        self._bs, self._bl = _runs(np.swapaxes(mask, -1, -2))
        self.num_intervals = self._fs.shape[-1]
        self.num_bwd_intervals = self._bs.shape[-1]
        self.has_column_view = True
        self._digest = hashlib.sha256(np.packbits(mask).tobytes()
                                      + repr(mask.shape).encode()).hexdigest()[:16]

    def key(self):
        return ("dense", self._digest, self.array.shape)

    def fingerprint(self):
        return self._digest

    @property
    def batched(self):
        return False

    @property
    def mask_heads(self):
        return self.array.shape[0]

    def as_dense(self):
        """bool [1, Hm, Nq, Nk]: the array this mask was built from."""
        return jnp.asarray(self.array)[None]

    def explain(self):
        return (f"DenseMask {self.name or ''} {self.array.shape}: K = {self.num_intervals} "
                f"runs per row at most, Kc = {self.num_bwd_intervals} per column")

    def __repr__(self):
        return f"<DenseMask {self.array.shape} K={self.num_intervals} " \
               f"Kc={self.num_bwd_intervals}>"

    def instantiate(self, metadata=None, q_len=None, kv_len=None, *, block_q=None,
                    block_kv=None, bwd_block_q=None, bwd_block_kv=None, preprocess=None):
        if metadata:
            raise ValueError("a mask from from_dense takes no metadata")
        q_len = self.q_len if q_len is None else q_len
        kv_len = (q_len if q_len != self.q_len or self.q_len == self.kv_len
                  else self.kv_len) if kv_len is None else kv_len
        if (q_len, kv_len) != (self.q_len, self.kv_len):
            raise ValueError(f"this mask was built for q_len={self.q_len}, kv_len="
                             f"{self.kv_len}; got q_len={q_len}, kv_len={kv_len}")
        from .preprocess import tile_states_from_intervals
        tiles = resolve_tiles(block_q, block_kv, bwd_block_q, bwd_block_kv)
        fs = jnp.asarray(self._fs)[None]
        fl = jnp.asarray(self._fl)[None]
        fwd = jnp.stack([fs, fl], -1)
        bwd = jnp.stack([jnp.asarray(self._bs)[None], jnp.asarray(self._bl)[None]], -1)
        f_st = tile_states_from_intervals(fs, fl, q_len, kv_len, tiles.block_q, tiles.block_kv)
        b_st = tile_states_from_intervals(fs, fl, q_len, kv_len, tiles.bwd_block_q,
                                          tiles.bwd_block_kv)
        return ExecutionDescriptor(
            fwd, bwd, pack_tiles(f_st), pack_tiles(jnp.swapaxes(b_st, -1, -2)),
            jnp.zeros((1, q_len), jnp.int32), jnp.ones((1,), bool), {},
            mask=self, q_len=q_len, kv_len=kv_len, tiles=tiles)


def from_dense(mask, name: str | None = None) -> DenseMask:
    """Compile a fixed boolean mask, [Nq, Nk] or [H, Nq, Nk], into interval tables.

    >>> import numpy as np, jcompilemask as jcm
    >>> m = jcm.from_dense(np.tril(np.ones((4, 4), bool)))
    >>> m.num_intervals, m.num_bwd_intervals
    (1, 1)
    """
    arr = np.asarray(mask)
    if arr.dtype != bool:
        raise TypeError(f"from_dense takes a boolean array, got dtype {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or min(arr.shape) < 1:
        raise ValueError(f"from_dense takes [Nq, Nk] or [H, Nq, Nk], got shape {arr.shape}")
    return DenseMask(np.ascontiguousarray(arr), name)
