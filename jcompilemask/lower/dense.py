"""``from_dense``: a fixed boolean mask as a compiled mask (interval tables = its runs)."""
from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np

from .compiled import CompiledMask, resolve_tiles
from .descriptor import COMPUTE, MASKED, ExecutionDescriptor, pack_tiles

__all__ = ["from_dense", "DenseMask", "SegmentedDenseMask", "SegmentRunsDenseMask", "segment_runs"]


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


# Up to 8 runs per row the interval tables serve every backend. Past that the xla
# backend's per-element checks grow with K, so "auto" keeps a bitmap for it. The CuTe
# kernels loop over a masked tile's intervals past 8 (any K; validated on the GPU up to
# K 32 in tests/gpu/test_cute_any_k.py), and a bitmap would send the mask to the xla
# backend, whose GPU backward is 15-25x slower: where they can run, "auto" keeps the
# tables up to KERNEL_TABLE_INTERVALS runs per row and per column.
MAX_TABLE_INTERVALS = 8
KERNEL_TABLE_INTERVALS = 32
BITMAP_KEY = "dense_bitmap"
_WORD = 32


def _max_runs(mask: np.ndarray) -> int:
    """The most runs of True along the last axis (0 for an all-False mask)."""
    if mask.shape[-1] == 0:
        return 0
    starts = mask[..., :1].sum(-1) + (mask[..., 1:] & ~mask[..., :-1]).sum(-1)
    return int(starts.max(initial=0))


# Whether the CuTe kernels can run in this process: a () -> bool that jcompilemask.backends
# installs on import (lower/ imports no backend); None (this module alone) reads as False.
_kernel_tables_probe = None


def set_kernel_tables_probe(probe) -> None:
    """Install the () -> bool that says whether the registry's CuTe kernels can run here
    (an SM90 GPU with the GPU dependencies): ``layout="auto"`` then keeps interval tables
    up to ``KERNEL_TABLE_INTERVALS`` runs. ``jcompilemask.backends`` installs it."""
    global _kernel_tables_probe
    _kernel_tables_probe = probe


def _kernel_tables_usable() -> bool:
    try:
        return bool(_kernel_tables_probe is not None and _kernel_tables_probe())
    except Exception:       # pragma: no cover - a broken GPU install reads as absent
        return False


def auto_layout(runs_per_row: int, runs_per_col: int) -> str:
    """The layout ``layout="auto"`` picks for a mask with these most runs per row / column:
    "intervals" up to ``MAX_TABLE_INTERVALS`` row runs; up to ``KERNEL_TABLE_INTERVALS``
    row and column runs where the CuTe kernels run (they take any K, the bitmap only the
    xla backend); "bitmap" past that."""
    if runs_per_row <= MAX_TABLE_INTERVALS:
        return "intervals"
    if max(runs_per_row, runs_per_col) <= KERNEL_TABLE_INTERVALS and _kernel_tables_usable():
        return "intervals"
    return "bitmap"


def _pack_bits(mask: np.ndarray) -> np.ndarray:
    """bool [..., N] -> uint32 [..., ceil(N / 32)]; bit ``j % 32`` of word ``j // 32``."""
    n = mask.shape[-1]
    w = -(-n // _WORD)
    pad = np.zeros(mask.shape[:-1] + (w * _WORD,), np.bool_)
    pad[..., :n] = mask
    by = np.packbits(pad, axis=-1, bitorder="little")                   # [..., 4w] uint8
    return np.ascontiguousarray(by).view("<u4").astype(np.uint32)


def _bitmap_tile_states(mask: np.ndarray, bq: int, bk: int) -> np.ndarray:
    """uint8 [B, Hm, Tq, Tk] tile states of a bool [B, Hm, Nq, Nk] mask (exact)."""
    b, hm, nq, nk = mask.shape
    tq, tk = -(-nq // bq), -(-nk // bk)
    out = np.zeros((b, hm, tq, tk), np.uint8)
    inside = np.zeros((tq * bq, tk * bk), np.bool_)
    inside[:nq, :nk] = True
    inside = inside.reshape(tq, bq, tk, bk)
    for i in range(b):
        for h in range(hm):                   # one head at a time bounds the memory
            pad = np.zeros((tq * bq, tk * bk), np.bool_)
            pad[:nq, :nk] = mask[i, h]
            pad = pad.reshape(tq, bq, tk, bk)
            vis = pad.any(axis=(1, 3))
            masked = (inside & ~pad).any(axis=(1, 3))
            out[i, h] = vis * COMPUTE + masked * MASKED
    return out



def _no_classes(row_classes):
    """A dense mask has no residue-class form (``CompiledMask.classes_for``)."""
    if row_classes:
        raise ValueError("row_classes=True: a mask from from_dense has no residue-class "
                         "form (that needs a MaskSpec rule with (q - k) % c == 0)")

class DenseMask(CompiledMask):
    """A static mask compiled from a boolean array [Hm, Nq, Nk], or [B, Hm, Nq, Nk] for
    one mask per sequence of the batch (see :func:`from_dense`).

    Two layouts, chosen by the most runs of visible keys in a row (K) and, past 8, in a
    column (Kc):

    * ``"intervals"``: the interval tables hold the runs -- K per row, Kc per key
      column -- and every backend serves the mask. ``"auto"`` picks it for K <= 8, and
      where the CuTe kernels can run (an SM90 GPU with the GPU dependencies: they take
      any K) for K and Kc up to 32 (``KERNEL_TABLE_INTERVALS``).
    * ``"bitmap"`` (the rest, e.g. a random pattern): the mask is kept as a packed bitmap
      (Nk / 8 bytes per row and head) that the ``xla`` backend reads per tile; its cost
      does not grow with the number of runs. The interval tables are empty and the mask
      counts as one fallback region (every row), so the CuTe kernels leave it to ``xla``.

    So on a GPU a mask of 9-32 runs per row runs on the CuTe kernels; on a CPU the same
    call gives a bitmap (the xla backend's cheaper form). ``layout=`` fixes either.

    Descriptors are constants (no metadata; B = 1, or the mask's batch for a per-sequence
    mask); tile states are exact in both layouts. ``array`` is the mask as given
    ([Hm, Nq, Nk], or [B, Hm, Nq, Nk] when per sequence).
    """

    def __init__(self, mask: np.ndarray, name: str | None = None, layout: str = "auto"):
        if layout not in ("auto", "intervals", "bitmap"):
            raise ValueError(f"layout must be 'auto', 'intervals' or 'bitmap', got {layout!r}")
        self.array = mask
        mask = mask if mask.ndim == 4 else mask[None]          # [B, Hm, Nq, Nk]
        self.batch_array = mask
        self.name = name
        self.spec = None
        self.regions = ()
        self.q_len, self.kv_len = mask.shape[-2:]
        self.runs_per_row = max(_max_runs(mask), 1)
        if layout == "auto":
            layout = auto_layout(self.runs_per_row,
                                 0 if self.runs_per_row <= MAX_TABLE_INTERVALS
                                 else _max_runs(np.swapaxes(mask, -1, -2)))
        self.layout = layout
        if layout == "intervals":
            self.fallback_regions = ()
            self._fs, self._fl = _runs(mask)
            self._bs, self._bl = _runs(np.swapaxes(mask, -1, -2))
            self.num_intervals = self._fs.shape[-1]
            self.num_bwd_intervals = self._bs.shape[-1]
            self.has_column_view = True
        else:
            self.fallback_regions = (0,)
            self._words = _pack_bits(mask)
            self._states = {}
            self.num_intervals = 1
            self.num_bwd_intervals = 0
            self.has_column_view = False
        self._digest = hashlib.sha256(np.packbits(mask).tobytes()
                                      + repr(mask.shape).encode()).hexdigest()[:16]

    def key(self):
        return ("dense", self.layout, self._digest, self.array.shape)

    def fingerprint(self):
        return self._digest

    @property
    def batched(self):
        """True for one mask per sequence (B > 1); the descriptor's batch is then B."""
        return self.batch_array.shape[0] > 1

    @property
    def batch(self) -> int:
        return self.batch_array.shape[0]

    @property
    def mask_heads(self):
        return self.batch_array.shape[1]

    def as_dense(self):
        """bool [B, Hm, Nq, Nk] (B = 1 unless per sequence): the array it was built from."""
        return jnp.asarray(self.batch_array)

    def explain(self):
        if self.layout == "bitmap":
            return (f"DenseMask {self.name or ''} {self.array.shape}: bitmap layout (up to "
                    f"{self.runs_per_row} runs per row, over {MAX_TABLE_INTERVALS}); served "
                    "by the xla backend"
                    + (f" (on an SM90 GPU, layout='intervals' runs it on the CuTe kernels)"
                       if self.runs_per_row <= KERNEL_TABLE_INTERVALS else ""))
        return (f"DenseMask {self.name or ''} {self.array.shape}: K = {self.num_intervals} "
                f"runs per row at most, Kc = {self.num_bwd_intervals} per column")

    def __repr__(self):
        if self.layout == "bitmap":
            return f"<DenseMask {self.array.shape} bitmap, {self.runs_per_row} runs/row>"
        return f"<DenseMask {self.array.shape} K={self.num_intervals} " \
               f"Kc={self.num_bwd_intervals}>"

    def _lengths(self, q_len, kv_len):
        q_len = self.q_len if q_len is None else q_len
        kv_len = (q_len if q_len != self.q_len or self.q_len == self.kv_len
                  else self.kv_len) if kv_len is None else kv_len
        if (q_len, kv_len) != (self.q_len, self.kv_len):
            raise ValueError(f"this mask was built for q_len={self.q_len}, kv_len="
                             f"{self.kv_len}; got q_len={q_len}, kv_len={kv_len}")
        return q_len, kv_len

    def _bitmap_states(self, bq, bk):
        if (bq, bk) not in self._states:
            self._states[bq, bk] = _bitmap_tile_states(self.batch_array, bq, bk)
        return self._states[bq, bk]

    def _empty_tables(self, b, q_len, kv_len):
        hm = self.mask_heads
        return (jnp.zeros((b, hm, q_len, 1, 2), jnp.int32),
                jnp.zeros((b, hm, kv_len, 0, 2), jnp.int32))

    def instantiate(self, metadata=None, q_len=None, kv_len=None, *, block_q=None,
                    block_kv=None, bwd_block_q=None, bwd_block_kv=None, preprocess=None,
                    row_classes=None):
        _no_classes(row_classes)
        if metadata:
            raise ValueError("a mask from from_dense takes no metadata")
        q_len, kv_len = self._lengths(q_len, kv_len)
        tiles = resolve_tiles(block_q, block_kv, bwd_block_q, bwd_block_kv)
        b = self.batch
        if self.layout == "bitmap":
            fwd, bwd = self._empty_tables(b, q_len, kv_len)
            f_st = self._bitmap_states(tiles.block_q, tiles.block_kv)
            b_st = self._bitmap_states(tiles.bwd_block_q, tiles.bwd_block_kv)
            return ExecutionDescriptor(
                fwd, bwd, pack_tiles(jnp.asarray(f_st)),
                pack_tiles(jnp.asarray(np.swapaxes(b_st, -1, -2))),
                jnp.zeros((b, q_len), jnp.int32), jnp.zeros((b,), bool),
                {BITMAP_KEY: jnp.asarray(self._words)},
                mask=self, q_len=q_len, kv_len=kv_len, tiles=tiles)
        return self._table_descriptor(jnp.asarray(self._fs), jnp.asarray(self._fl),
                                      jnp.asarray(self._bs), jnp.asarray(self._bl),
                                      jnp.ones((b,), bool), q_len, kv_len, tiles)

    def _table_descriptor(self, fs, fl, bs, bl, bwd_exact, q_len, kv_len, tiles, states=None):
        """The descriptor of row tables (fs, fl) and column tables (bs, bl); ``states``:
        the uint8 [B, Hm, Tq, Tk] tile states at both passes' tiles (fwd, bwd), or None to
        derive them from the row tables."""
        if states is None:
            from .preprocess import tile_states_from_intervals
            states = [tile_states_from_intervals(fs, fl, q_len, kv_len, bq, bk) for bq, bk in
                      ((tiles.block_q, tiles.block_kv), (tiles.bwd_block_q, tiles.bwd_block_kv))]
        f_st, b_st = states
        return ExecutionDescriptor(
            jnp.stack([fs, fl], -1), jnp.stack([bs, bl], -1), pack_tiles(f_st),
            pack_tiles(jnp.swapaxes(b_st, -1, -2)),
            jnp.zeros((bwd_exact.shape[0], q_len), jnp.int32), bwd_exact, {},
            mask=self, q_len=q_len, kv_len=kv_len, tiles=tiles)

    def fallback_visibility(self, desc: ExecutionDescriptor, rows, cols):
        """bool [B, Hm, R, C]: the bitmap's bits (bitmap layout; False otherwise)."""
        if self.layout != "bitmap":
            return jnp.zeros((), bool)
        words = desc.metadata[BITMAP_KEY]                                # [B, Hm, Nq, W]
        r = jnp.clip(rows, 0, desc.q_len - 1)
        c = jnp.clip(cols, 0, desc.kv_len - 1)
        w = jnp.take(words[:, :, r], c // _WORD, axis=-1)                # [1, Hm, R, C]
        shift = (c % _WORD).astype(jnp.uint32)[None, None, None, :]
        return ((w >> shift) & jnp.uint32(1)).astype(bool)


class SegmentedDenseMask(DenseMask):
    """A fixed mask AND segment-id equality, for packed sequences: in sequence ``b``,
    row i sees key j iff ``mask[h, i, j]`` and ``q_segment_ids[b, i] ==
    kv_segment_ids[b, j]`` (any id layout; ids need not be contiguous).

    The mask is kept as a bitmap (see :class:`DenseMask`) computed once; the segment ids
    are metadata (int [B, Nq] / [B, Nk], or 1-D for one sequence), intersected per tile at
    run time. The tile states cost O(B * Hm * Nq * Nk) bit tests per call, whatever the
    number of runs. Served by the ``xla`` backend.

    >>> import numpy as np, jax.numpy as jnp
    >>> m = SegmentedDenseMask(np.tril(np.ones((1, 4, 4), bool)))
    >>> ids = jnp.array([0, 0, 1, 1])
    >>> d = m.instantiate({"q_segment_ids": ids, "kv_segment_ids": ids}, 4, 4, block_q=2,
    ...                   block_kv=2, bwd_block_q=2, bwd_block_kv=2)
    >>> np.asarray(d.as_dense()[0, 0]).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """

    METADATA = ("q_segment_ids", "kv_segment_ids")

    def __init__(self, mask: np.ndarray, name: str | None = None):
        if mask.ndim != 3:
            raise ValueError(f"SegmentedDenseMask takes one mask [Hm, Nq, Nk] for every "
                             f"sequence (the segment ids vary per sequence), got shape "
                             f"{mask.shape}")
        super().__init__(mask, name, layout="bitmap")

    def key(self):
        return ("dense+segments",) + super().key()[1:]

    @property
    def batched(self):
        return True

    @property
    def batch(self) -> int:
        return 1

    def explain(self):
        return super().explain() + "; AND q_segment_ids == kv_segment_ids (metadata)"

    def _segments(self, metadata, q_len, kv_len):
        if not isinstance(metadata, dict) or set(metadata) != set(self.METADATA):
            got = sorted(metadata) if isinstance(metadata, dict) else type(metadata).__name__
            raise ValueError(f"this mask takes metadata {{'q_segment_ids': int [B, Nq], "
                             f"'kv_segment_ids': int [B, Nk]}}, got {got}")
        out = []
        for name, n in zip(self.METADATA, (q_len, kv_len)):
            x = jnp.asarray(metadata[name])
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"metadata {name!r} must be integer, got {x.dtype}")
            x = x[None] if x.ndim == 1 else x
            if x.ndim != 2 or x.shape[1] != n:
                raise ValueError(f"metadata {name!r} must be [B, {n}] (or [{n}]), got shape "
                                 f"{tuple(jnp.shape(metadata[name]))}")
            out.append(x)
        sq, skv = out
        if sq.shape[0] != skv.shape[0]:
            b = max(sq.shape[0], skv.shape[0])
            if min(sq.shape[0], skv.shape[0]) != 1:
                raise ValueError(f"q_segment_ids has batch {sq.shape[0]}, kv_segment_ids "
                                 f"{skv.shape[0]}: they must match (or one be 1)")
            sq = jnp.broadcast_to(sq, (b, q_len))
            skv = jnp.broadcast_to(skv, (b, kv_len))
        return sq, skv

    def instantiate(self, metadata=None, q_len=None, kv_len=None, *, block_q=None,
                    block_kv=None, bwd_block_q=None, bwd_block_kv=None, preprocess=None,
                    row_classes=None):
        from .preprocess import tile_states_dense
        _no_classes(row_classes)
        q_len, kv_len = self._lengths(q_len, kv_len)
        tiles = resolve_tiles(block_q, block_kv, bwd_block_q, bwd_block_kv)
        sq, skv = self._segments(metadata, q_len, kv_len)
        b = sq.shape[0]
        fwd, bwd = self._empty_tables(b, q_len, kv_len)
        meta = {BITMAP_KEY: jnp.asarray(self._words), self.METADATA[0]: sq,
                self.METADATA[1]: skv}
        desc = ExecutionDescriptor(fwd, bwd, None, None, jnp.zeros((b, q_len), jnp.int32),
                                   jnp.zeros((b,), bool), meta, mask=self, q_len=q_len,
                                   kv_len=kv_len, tiles=tiles)
        f_st = tile_states_dense(desc, tiles.block_q, tiles.block_kv)
        b_st = tile_states_dense(desc, tiles.bwd_block_q, tiles.bwd_block_kv)
        desc.fwd_tiles = pack_tiles(f_st)
        desc.bwd_tiles = pack_tiles(jnp.swapaxes(b_st, -1, -2))
        return desc

    def fallback_visibility(self, desc: ExecutionDescriptor, rows, cols):
        """bool [B, Hm, R, C]: bitmap bits AND equal segment ids."""
        bits = super().fallback_visibility(desc, rows, cols)
        sq = desc.metadata[self.METADATA[0]]
        skv = desc.metadata[self.METADATA[1]]
        r = jnp.clip(rows, 0, desc.q_len - 1)
        c = jnp.clip(cols, 0, desc.kv_len - 1)
        same = sq[:, r][:, None, :, None] == skv[:, c][:, None, None, :]
        return bits & same


def segment_runs(ids_a, ids_b):
    """For each position of ``ids_a`` [B, Na], the first and one-past-last position of
    ``ids_b`` [B, Nb] holding the same id, and whether those positions are contiguous
    (``lo, hi, ok``: int32 / int32 / bool [B, Na]; ``lo == hi == 0`` where the id is absent
    from ``ids_b``). Jit-able: a stable sort and two searches per sequence."""
    def one(a, b):
        nb = b.shape[0]
        order = jnp.argsort(b, stable=True).astype(jnp.int32)
        sorted_b = b[order]
        left = jnp.searchsorted(sorted_b, a, side="left").astype(jnp.int32)
        right = jnp.searchsorted(sorted_b, a, side="right").astype(jnp.int32)
        count = right - left
        first = order[jnp.clip(left, 0, nb - 1)]
        last = order[jnp.clip(right - 1, 0, nb - 1)]
        lo = jnp.where(count > 0, first, 0)
        hi = jnp.where(count > 0, last + 1, 0)
        return lo, hi, (count == 0) | (hi - lo == count)

    import jax
    return jax.vmap(one)(ids_a, ids_b)


def _clip_runs(starts, lens, lo, hi):
    """Interval tables [Bm, Hm, N, K] clipped per (batch, row) to [lo, hi) ([B, N]):
    [B, Hm, N, K], emptied slots (0, 0)."""
    end = jnp.minimum(starts + lens, hi[:, None, :, None])
    start = jnp.maximum(starts, lo[:, None, :, None])
    length = jnp.maximum(end - start, 0)
    return jnp.where(length > 0, start, 0), length


class SegmentRunsDenseMask(SegmentedDenseMask):
    """A fixed mask AND segment-id equality, as interval tables: the fixed mask's runs,
    clipped per row to the keys of that row's id. The same mask as
    :class:`SegmentedDenseMask` (same metadata), exact where every id's keys form one
    contiguous stretch -- what packing produces -- and then served by every backend, the
    GPU kernels included (the bitmap form only by ``xla``). A query row whose id's keys
    are split is given only the first to last of them (so wrong there): callers that
    cannot rule that out check ``segment_runs(...)[2]`` (the splash port does, and
    returns NaN for such rows inside ``jit``). The column view is exact for each
    sequence whose ids are contiguous in the rows too; elsewhere the backward checks the
    row intervals (``bwd_exact``).

    The fixed mask must keep interval tables (``from_dense``'s layout rule: at most 8
    runs per row, or 32 where the CuTe kernels run).

    >>> import numpy as np, jax.numpy as jnp
    >>> m = SegmentRunsDenseMask(np.tril(np.ones((1, 4, 4), bool)))
    >>> ids = jnp.array([0, 0, 1, 1])
    >>> d = m.instantiate({"q_segment_ids": ids, "kv_segment_ids": ids}, 4, 4, block_q=2,
    ...                   block_kv=2, bwd_block_q=2, bwd_block_kv=2)
    >>> np.asarray(d.as_dense()[0, 0]).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """

    def __init__(self, mask: np.ndarray, name: str | None = None, layout: str = "auto"):
        if mask.ndim != 3:
            raise ValueError(f"SegmentRunsDenseMask takes one mask [Hm, Nq, Nk] for every "
                             f"sequence (the segment ids vary per sequence), got shape "
                             f"{mask.shape}")
        DenseMask.__init__(self, mask, name, layout=layout)
        if self.layout != "intervals":
            raise ValueError(f"SegmentRunsDenseMask needs interval tables, but this mask has "
                             f"{self.runs_per_row} runs per row (a bitmap): use "
                             f"SegmentedDenseMask")

    def key(self):
        return ("dense+segment-runs",) + DenseMask.key(self)[1:]

    def explain(self):
        return (DenseMask.explain(self) + "; clipped per row to the keys of the row's "
                "segment id (metadata; exact for contiguous ids)")

    def __repr__(self):
        return (f"<SegmentRunsDenseMask {self.array.shape} K={self.num_intervals} "
                f"Kc={self.num_bwd_intervals}>")

    def instantiate(self, metadata=None, q_len=None, kv_len=None, *, block_q=None,
                    block_kv=None, bwd_block_q=None, bwd_block_kv=None, preprocess=None,
                    row_classes=None):
        _no_classes(row_classes)
        q_len, kv_len = self._lengths(q_len, kv_len)
        tiles = resolve_tiles(block_q, block_kv, bwd_block_q, bwd_block_kv)
        sq, skv = (x.astype(jnp.int32) for x in self._segments(metadata, q_len, kv_len))
        lo, hi, _ = segment_runs(sq, skv)
        clo, chi, col_ok = segment_runs(skv, sq)
        fs, fl = _clip_runs(jnp.asarray(self._fs), jnp.asarray(self._fl), lo, hi)
        bs, bl = _clip_runs(jnp.asarray(self._bs), jnp.asarray(self._bl), clo, chi)
        return self._table_descriptor(fs, fl, bs, bl, jnp.all(col_ok, axis=-1), q_len, kv_len,
                                      tiles)

    def fallback_visibility(self, desc: ExecutionDescriptor, rows, cols):
        return jnp.zeros((), bool)


def from_dense(mask, name: str | None = None, *, layout: str = "auto",
               batched: bool = False) -> DenseMask:
    """Compile a fixed boolean mask into interval tables (or, past 8 runs in a row -- 32
    where the CuTe kernels run -- a bitmap: ``layout`` "auto", "intervals" or "bitmap";
    see :class:`DenseMask`).

    Shape contract of ``mask`` (True = attend):

    ===========================  ===================  =================================
    ``mask``                     ``batched``          meaning
    ===========================  ===================  =================================
    [Nq, Nk]                     False (default)      one mask for every sequence, head
    [H, Nq, Nk]                  False (default)      one mask per head (``Hm = H``)
    [B, Nq, Nk]                  True                 one mask per sequence of the batch
    [B, H, Nq, Nk]               True                 per sequence and head
    ===========================  ===================  =================================

    A per-sequence mask's descriptor has batch ``B``, which must equal the attention
    batch (or be 1); K is the most runs in any row of any sequence. The descriptor is a
    constant: a mask that changes every step is better written as a MaskSpec with
    metadata (a dense [B, Nq, Nk] costs O(B * Nq * Nk) host work per distinct mask).

    >>> import numpy as np, jcompilemask as jcm
    >>> m = jcm.from_dense(np.tril(np.ones((4, 4), bool)))
    >>> m.num_intervals, m.num_bwd_intervals
    (1, 1)
    >>> per_seq = np.stack([np.tril(np.ones((4, 4), bool)), np.ones((4, 4), bool)])
    >>> m = jcm.from_dense(per_seq, batched=True)            # [B=2, Nq, Nk]
    >>> d = m.instantiate(None, 4, 4, block_q=2, block_kv=2, bwd_block_q=2, bwd_block_kv=2)
    >>> d.batch, d.mask_heads, bool(d.as_dense()[1, 0].all())
    (2, 1, True)
    """
    if not isinstance(batched, (bool, np.bool_)):
        raise TypeError(f"from_dense(batched=...) must be True or False, got {batched!r}")
    if hasattr(mask, "dtype") and hasattr(mask, "shape"):
        import jax
        if isinstance(mask, jax.core.Tracer):
            raise TypeError("from_dense(mask): mask must be a concrete boolean array (numpy "
                            "or an evaluated jax array), not a traced value: the mask is "
                            "compiled on the host. Build it outside jit, or write it as a "
                            "MaskSpec with metadata")
    arr = np.asarray(mask)
    if arr.dtype != bool:
        raise TypeError(f"from_dense(mask): mask must be a boolean array (True = attend), "
                        f"got dtype {arr.dtype}; pass e.g. mask.astype(bool)")
    want = ("[B, Nq, Nk] or [B, H, Nq, Nk]" if batched else
            "[Nq, Nk] or [H, Nq, Nk]; for one mask per sequence pass [B, Nq, Nk] or "
            "[B, H, Nq, Nk] with batched=True")
    ndim = arr.ndim
    if batched and ndim == 3:
        arr = arr[:, None]
    elif not batched and ndim == 2:
        arr = arr[None]
    if ndim not in ((3, 4) if batched else (2, 3)):
        raise ValueError(f"from_dense(mask{', batched=True' if batched else ''}): mask must "
                         f"be {want}, got shape {arr.shape}")
    if min(arr.shape) < 1:
        raise ValueError(f"from_dense(mask): mask has an empty axis, shape {arr.shape}")
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]                                   # one mask for every sequence
    return DenseMask(np.ascontiguousarray(arr), name, layout)
