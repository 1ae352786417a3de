"""Dense boolean masks known only at run time (a traced ``mask=`` array inside ``jit``):
their runs found on the device by a jnp preprocess, as interval tables of a fixed width.

:func:`~jcompilemask.from_dense` compiles a *concrete* array on the host. A mask computed
inside the step (``nn.make_attention_mask(...)``, a padding mask, a per-batch packing
mask) is a tracer there; this module turns it into descriptors at run time:

1. :func:`pack_words` packs each row (and each key column) into uint32 words: one read of
   the mask, 1/8 of its bytes written.
2. :func:`runs_from_words` finds the first ``K`` runs of every row from the words: the
   run starts are the bits ``w & ~(w << 1)``, the ends ``~w & (w << 1)`` (carrying bit 31
   of the previous word); the m-th start is found by a binary search over the per-row
   cumulative popcounts, then a 5-step search for the bit within its word. O(Nq * Nk / 32
   + Nq * K * log(Nk)) work per head; no O(Nq * Nk) int32 temporaries. The first run and
   the run count need no search (:func:`first_runs_from_words`: one reduction), so a
   mask that fits one run per row never builds the wider tables (``lax.cond``).
3. :class:`RuntimeDenseMask` holds a static shape and width: in its ``"intervals"`` layout
   the tables are the runs (exact for rows with at most K runs, columns with at most Kc:
   ``bwd_exact`` is False for a sequence with a longer column, whose backward then checks
   the row tables), in its ``"bitmap"`` layout the packed words (the ``xla`` backend reads
   them per tile; exact for any mask).

``mask_attention`` builds one descriptor per width of :class:`RuntimeDense`'s ``tiers``
(each on the backend the registry picks for it: the CuTe kernels on an SM90 GPU) plus the
bitmap, and picks at run time (``lax.switch``) the narrowest whose K holds every row's
runs; past the widest, the bitmap. So a traced mask is never wrong, and a structured one
(causal, padding, packed documents: one run per row) runs on the kernels.
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .compiled import resolve_tiles
from .dense import BITMAP_KEY, DenseMask, _no_classes, _pack_bits
from .descriptor import COMPUTE, MASKED, ExecutionDescriptor, pack_tiles

__all__ = ["pack_words", "transpose_words", "runs_from_words", "first_runs_from_words",
           "dense_runs", "RuntimeDenseMask", "RuntimeDense", "runtime_dense", "DEFAULT_TIERS",
           "tile_states_from_words"]

I32, U32 = jnp.int32, jnp.uint32
_WORD = 32
# The interval widths a traced dense mask's tables are built at, narrowest first. One run
# per row covers causal, padding and packed-document masks (their kernels check one
# interval per masked element); 8 is the widest the CuTe kernels keep in registers.
DEFAULT_TIERS = (1, 8)
# The intervals layout's metadata (the packed rows give its tile states).
_TABLES = ("row_starts", "row_lens", "col_starts", "col_lens", "col_exact", BITMAP_KEY)


def pack_words(mask, axis: int = -1):
    """bool [..., N] -> uint32 [..., ceil(N / 32)]: bit ``j % 32`` of word ``j // 32`` is
    ``mask[..., j]``; bits past N are 0. The mask is read once (no padded copy when N is a
    multiple of 32): 8 elements to a byte, 4 bytes viewed as a word (H100, 8K x 8K x 16:
    0.45 ms, 2.4 TB/s; summing 32 shifted elements to a word took 0.76).

    ``axis=-2`` packs along the second-to-last axis instead: bool [..., N, M] -> uint32
    [..., M, ceil(N / 32)] (each column's bits): the rows packed, then each 32 x 32 block
    of bits transposed in registers (:func:`transpose_words`), so the mask is read once
    in its own order (a reduction across rows read it at 0.3 TB/s).

    >>> import numpy as np
    >>> pack_words(np.array([True, False, True] + [False] * 29 + [True])).tolist()
    [5, 1]
    >>> m = np.random.default_rng(0).random((3, 40, 70)) < 0.5
    >>> bool((pack_words(m, -2) == pack_words(np.swapaxes(m, -1, -2))).all())
    True
    """
    mask = jnp.asarray(mask, bool)
    if axis not in (-1, -2):
        raise ValueError(f"axis must be -1 or -2, got {axis}")
    if axis == -2:
        nq, nk = mask.shape[-2:]
        return transpose_words(pack_words(mask, -1), nq, nk)
    n = mask.shape[-1]
    w = -(-n // _WORD)
    if w * _WORD != n:                       # a ragged length: pad the last word with 0s
        mask = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, w * _WORD - n)])
    m = mask.reshape(mask.shape[:-1] + (w * 4, 8)).astype(jnp.uint8)
    by = jnp.sum(m << lax.broadcasted_iota(jnp.uint8, m.shape, m.ndim - 1), axis=-1,
                 dtype=jnp.uint8)
    return lax.bitcast_convert_type(by.reshape(by.shape[:-1] + (w, 4)), U32)


_SWAP_MASKS = {16: 0x0000FFFF, 8: 0x00FF00FF, 4: 0x0F0F0F0F, 2: 0x33333333, 1: 0x55555555}


def transpose_words(words, n_rows: int, n_cols: int):
    """The packed rows ``words`` [..., n_rows, ceil(n_cols / 32)] of a bit matrix as its
    packed columns [..., n_cols, ceil(n_rows / 32)]: each 32 x 32 block transposed by
    five rounds of masked swaps (bit j of row i <-> bit i of row j), all on words."""
    w = words.shape[-1]
    wq = -(-n_rows // _WORD)
    lead = words.shape[:-2]
    if wq * _WORD != n_rows:
        words = jnp.pad(words, [(0, 0)] * len(lead) + [(0, wq * _WORD - n_rows), (0, 0)])
    x = jnp.swapaxes(words.reshape(lead + (wq, _WORD, w)), -1, -2)      # [..., Wq, W, 32]
    for s in (16, 8, 4, 2, 1):
        y = x.reshape(x.shape[:-1] + (_WORD // (2 * s), 2, s))
        a, b = y[..., 0, :], y[..., 1, :]
        t = ((a >> s) ^ b) & U32(_SWAP_MASKS[s])
        x = jnp.stack([a ^ (t << s), b ^ t], axis=-2).reshape(x.shape)
    # x[..., i, j, c]: column 32 j + c's bits of rows 32 i .. 32 i + 31
    cols = jnp.moveaxis(x, -3, -1).reshape(lead + (w * _WORD, wq))
    return cols[..., :n_cols, :]


def _nth_bit(x, r):
    """The position of the ``r``-th (0-based) set bit of ``x`` (uint32), for r below its
    popcount: a binary search over halves of the word."""
    pos = jnp.zeros(x.shape, U32)
    r = r.astype(U32)
    for width in (16, 8, 4, 2, 1):
        low = (x >> pos) & U32((1 << width) - 1)
        c = lax.population_count(low)
        go = r >= c
        pos = pos + jnp.where(go, U32(width), U32(0))
        r = r - jnp.where(go, c, U32(0))
    return pos.astype(I32)


def _select_bits(bits, k: int):
    """Positions of the first ``k`` set bits of each row of words ``bits`` [..., W]:
    int32 [..., k] (garbage past the row's popcount), and the popcount [...]."""
    cnt = lax.population_count(bits).astype(I32)
    cum = jnp.cumsum(cnt, axis=-1)                                        # inclusive
    w = bits.shape[-1]
    slot = jnp.arange(k, dtype=I32)
    target = jnp.broadcast_to(slot, bits.shape[:-1] + (k,))
    # wi = the number of words whose cumulative count is <= slot (binary lifting).
    lo = jnp.zeros(target.shape, I32)
    step = 1 << (w.bit_length() - 1)
    while step:
        cand = lo + step
        val = jnp.take_along_axis(cum, jnp.clip(cand - 1, 0, w - 1), axis=-1)
        lo = jnp.where((cand <= w) & (val <= target), cand, lo)
        step >>= 1
    wi = jnp.clip(lo, 0, w - 1)
    before = jnp.take_along_axis(cum - cnt, wi, axis=-1)
    word = jnp.take_along_axis(bits, wi, axis=-1)
    return wi * _WORD + _nth_bit(word, target - before), cum[..., -1]


def _run_edges(words):
    """(start bits, end bits) of the runs in packed rows ``words`` [..., W], one zero word
    longer (so that a run reaching the last bit ends inside): a start is a set bit whose
    predecessor is clear, an end a clear bit whose predecessor is set."""
    words = jnp.asarray(words, U32)
    words = jnp.concatenate([words, jnp.zeros(words.shape[:-1] + (1,), U32)], axis=-1)
    prev = jnp.concatenate([jnp.zeros(words.shape[:-1] + (1,), U32), words[..., :-1] >> 31],
                           axis=-1)
    left = (words << 1) | prev                       # bit j: the element before j
    return words & ~left, ~words & left


@jax.custom_batching.custom_vmap
def _most_over_batch(most):
    """``most`` (an int32 scalar) itself; under ``vmap`` the maximum over the mapped axis,
    unbatched. A wider tier is exact wherever a narrower one is, so one index for the
    whole mapped batch is always right, and ``lax.switch`` on an unbatched index stays a
    switch: only the chosen tier runs (a batched index turns the switch into a select
    that runs every tier and the bitmap)."""
    return most


@_most_over_batch.def_vmap
def _most_over_batch_vmap(axis_size, in_batched, most):
    del axis_size
    return (jnp.max(most, axis=0) if in_batched[0] else most), False


def _tier(tiers, count, *, one_for_vmap=False):
    """int32: the index of the narrowest of ``tiers`` that holds ``count`` runs in every
    row (``len(tiers)``: none, the bitmap); ``one_for_vmap``: under ``vmap``, the one index
    that holds every mapped mask (see :func:`_most_over_batch`)."""
    most = jnp.max(count)
    if one_for_vmap:
        most = _most_over_batch(most)
    return jnp.sum(jnp.asarray(tiers, I32) < jnp.full((len(tiers),), most)).astype(I32)


def runs_from_words(words, k: int):
    """The first ``k`` runs of True of each row of packed words (see :func:`pack_words`):
    ``(starts, lens, count)``, int32 [..., k], [..., k] and [...]: slots past a row's run
    count are (0, 0); ``count`` is the row's run count (it may exceed ``k``).

    >>> import numpy as np
    >>> row = np.array([0, 1, 1, 0, 1, 0, 0, 1], bool)
    >>> s, l, c = runs_from_words(pack_words(row), 2)
    >>> s.tolist(), l.tolist(), int(c)
    ([1, 4], [2, 1], 3)
    """
    start_bits, end_bits = _run_edges(words)
    start_pos, count = _select_bits(start_bits, k)
    end_pos, _ = _select_bits(end_bits, k)
    live = lax.broadcasted_iota(I32, start_pos.shape, start_pos.ndim - 1) < count[..., None]
    starts = jnp.where(live, start_pos, 0)
    return starts, jnp.where(live, end_pos - start_pos, 0), count


def first_runs_from_words(words):
    """:func:`runs_from_words` at ``k = 1``, without its scan and searches: the first run
    start is the lowest set start bit of the row and its end the lowest end bit (no run
    ends before the first starts), each a min over the words of ``32 j + ctz(word)``; the
    count is the popcount sum. One reduction over the words: ``(starts, lens, count)``,
    int32 [..., 1], [..., 1], [...].

    >>> import numpy as np
    >>> row = np.array([0, 1, 1, 0, 1, 0, 0, 1], bool)
    >>> s, l, c = first_runs_from_words(pack_words(row))
    >>> s.tolist(), l.tolist(), int(c)
    ([1], [2], 3)
    """
    start_bits, end_bits = _run_edges(words)
    base = lax.broadcasted_iota(I32, start_bits.shape, start_bits.ndim - 1) * _WORD
    big = jnp.iinfo(I32).max

    def lowest(bits):
        ctz = lax.population_count((bits & (~bits + U32(1))) - U32(1)).astype(I32)
        return jnp.min(jnp.where(bits != U32(0), base + ctz, big), axis=-1)

    count = jnp.sum(lax.population_count(start_bits).astype(I32), axis=-1)
    start, end = lowest(start_bits), lowest(end_bits)
    live = count > 0
    start = jnp.where(live, start, 0)
    return start[..., None], jnp.where(live, end - start, 0)[..., None], count


def dense_runs(mask, k: int, kc: int):
    """Row and column run tables of a bool [B, Hm, Nq, Nk] mask (traced or not):
    ``(row_starts, row_lens, row_count, col_starts, col_lens, col_count, words)``, the
    tables [B, Hm, N, k|kc], the counts [B, Hm, N] and the packed rows ``words`` [B, Hm, Nq,
    ceil(Nk / 32)] (the bitmap form)."""
    words = pack_words(mask, -1)
    rs, rl, rc = runs_from_words(words, k)
    cs, cl, cc = runs_from_words(pack_words(mask, -2), kc)
    return rs, rl, rc, cs, cl, cc, words


def tile_states_from_words(words, q_len: int, kv_len: int, bq: int, bk: int):
    """Exact 2-bit tile states uint8 [B, Hm, Tq, Tk] from packed rows [B, Hm, Nq, W]; a key
    tile that is a multiple of 32 reads whole words, any other unpacks the bits."""
    b, hm, nq, w = words.shape
    tq, tk = -(-q_len // bq), -(-kv_len // bk)
    if bk % _WORD:
        bits = (words[..., None] >> lax.broadcasted_iota(U32, words.shape + (_WORD,),
                                                          words.ndim)) & U32(1)
        m = bits.reshape(b, hm, nq, w * _WORD)[..., :kv_len].astype(bool)
        pad = jnp.pad(m, [(0, 0), (0, 0), (0, tq * bq - nq), (0, tk * bk - kv_len)])
        inside = np.zeros((tq * bq, tk * bk), bool)
        inside[:q_len, :kv_len] = True
        pad = pad.reshape(b, hm, tq, bq, tk, bk)
        inside = jnp.asarray(inside.reshape(tq, bq, tk, bk))[None, None]
        vis = jnp.any(pad, axis=(3, 5))
        masked = jnp.any(inside & ~pad, axis=(3, 5))
    else:
        per = bk // _WORD
        ww = tk * per
        x = jnp.pad(words[..., :min(w, ww)], [(0, 0), (0, 0), (0, tq * bq - nq),
                                              (0, max(0, ww - w))])
        # Bits outside [0, kv_len) and rows past q_len count as visible for "all" and
        # invisible for "any".
        valid = np.zeros((ww * _WORD,), bool)
        valid[:kv_len] = True
        valid_w = _pack_bits(valid)
        row_in = (np.arange(tq * bq) < q_len)[:, None]
        valid_w = jnp.asarray(np.where(row_in, valid_w[None, :], 0).astype(np.uint32))[None, None]
        x = x & valid_w
        full = (x | ~valid_w) == U32(0xFFFFFFFF)
        x = x.reshape(b, hm, tq, bq, tk, per)
        full = full.reshape(b, hm, tq, bq, tk, per)
        vis = jnp.any(x != 0, axis=(3, 5))
        masked = ~jnp.all(full, axis=(3, 5))
    return vis.astype(jnp.uint8) * COMPUTE + masked.astype(jnp.uint8) * MASKED


class RuntimeDenseMask(DenseMask):
    """A dense mask of static shape [B, Hm, Nq, Nk] whose values arrive at run time, as
    metadata (see the module doc). Two layouts:

    * ``"intervals"`` (``K`` row runs, ``Kc`` column runs): metadata ``row_starts`` /
      ``row_lens`` int32 [B, Hm, Nq, K], ``col_starts`` / ``col_lens`` [B, Hm, Nk, Kc],
      ``col_exact`` bool [B] (whether every column of the sequence fits Kc), as
      :func:`dense_runs` gives them, and the packed rows (below: the tile states). Exact for a mask whose rows have at most K runs (the
      caller checks: :class:`RuntimeDense` picks the layout at run time); every backend
      serves it.
    * ``"bitmap"``: metadata ``dense_bitmap`` uint32 [B, Hm, Nq, ceil(Nk / 32)]
      (:func:`pack_words`); exact for any mask, served by ``xla``.

    >>> import numpy as np, jax.numpy as jnp
    >>> m = jnp.asarray(np.tril(np.ones((1, 1, 4, 4), bool)))
    >>> rm = RuntimeDenseMask((1, 1, 4, 4), "intervals", 1, 1)
    >>> d = rm.instantiate(rm.metadata_of(m), 4, 4, block_q=2, block_kv=2, bwd_block_q=2,
    ...                    bwd_block_kv=2)
    >>> np.asarray(d.as_dense()[0, 0]).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """

    def __init__(self, shape, layout: str, num_intervals: int = 0,
                 num_bwd_intervals: int = 0, name: str | None = None):
        if len(shape) != 4 or min(shape) < 1:
            raise ValueError(f"RuntimeDenseMask takes a shape [B, Hm, Nq, Nk], got {shape}")
        if layout not in ("intervals", "bitmap"):
            raise ValueError(f"layout must be 'intervals' or 'bitmap', got {layout!r}")
        self.shape = tuple(int(s) for s in shape)
        self.array = self.batch_array = None
        self.name = name
        self.spec = None
        self.regions = ()
        self.q_len, self.kv_len = self.shape[2:]
        self.layout = layout
        if layout == "intervals":
            if num_intervals < 1 or num_bwd_intervals < 1:
                raise ValueError("the intervals layout needs num_intervals and "
                                 "num_bwd_intervals >= 1")
            self.fallback_regions = ()
            self.num_intervals, self.num_bwd_intervals = int(num_intervals), int(num_bwd_intervals)
            self.runs_per_row = self.num_intervals
            self.has_column_view = True
            self.METADATA = _TABLES
        else:
            self.fallback_regions = (0,)
            self.num_intervals, self.num_bwd_intervals = 1, 0
            self.runs_per_row = 0
            self.has_column_view = False
            self.METADATA = (BITMAP_KEY,)
        self._digest = hashlib.sha256(repr(self.key()).encode()).hexdigest()[:16]

    def key(self):
        return ("runtime-dense", self.layout, self.num_intervals, self.num_bwd_intervals,
                self.shape)

    def fingerprint(self):
        return self._digest

    @property
    def batched(self):
        return True

    @property
    def batch(self) -> int:
        return self.shape[0]

    @property
    def mask_heads(self):
        return self.shape[1]

    def as_dense(self):
        raise ValueError("a RuntimeDenseMask has no array of its own (its values are "
                         "metadata): instantiate it and call the descriptor's as_dense()")

    def metadata_of(self, mask, *, runs=None):
        """This layout's metadata for the bool [B, Hm, Nq, Nk] ``mask`` (``runs``: a
        :func:`dense_runs` result to reuse, at least this width)."""
        if runs is None and self.layout == "bitmap":
            return {BITMAP_KEY: pack_words(mask)}
        if runs is None:
            runs = dense_runs(mask, self.num_intervals, self.num_bwd_intervals)
        return self.metadata_from_runs(runs)

    def metadata_from_runs(self, runs):
        rs, rl, _, cs, cl, cc, words = runs
        k, kc = self.num_intervals, self.num_bwd_intervals
        if self.layout == "bitmap":
            return {BITMAP_KEY: words}
        if rs.shape[-1] < k or cs.shape[-1] < kc:
            raise ValueError(f"the runs hold {rs.shape[-1]} / {cs.shape[-1]} slots; this "
                             f"layout needs {k} / {kc}")
        return {"row_starts": rs[..., :k], "row_lens": rl[..., :k], "col_starts": cs[..., :kc],
                "col_lens": cl[..., :kc],
                "col_exact": jnp.all(cc <= kc, axis=(1, 2)), BITMAP_KEY: words}

    def explain(self):
        if self.layout == "bitmap":
            return (f"RuntimeDenseMask {self.shape}: a dense mask known at run time, as a "
                    "bitmap (any number of runs); served by the xla backend")
        return (f"RuntimeDenseMask {self.shape}: a dense mask known at run time, as its "
                f"runs: K = {self.num_intervals} per row, Kc = {self.num_bwd_intervals} per "
                "column (exact for rows with at most K runs)")

    def __repr__(self):
        if self.layout == "bitmap":
            return f"<RuntimeDenseMask {self.shape} bitmap>"
        return (f"<RuntimeDenseMask {self.shape} K={self.num_intervals} "
                f"Kc={self.num_bwd_intervals}>")

    def _check_metadata(self, metadata):
        if not isinstance(metadata, dict) or set(metadata) != set(self.METADATA):
            got = sorted(metadata) if isinstance(metadata, dict) else type(metadata).__name__
            raise ValueError(f"this mask takes metadata {sorted(self.METADATA)} (build it "
                             f"with metadata_of(mask)), got {got}")
        b, hm, nq, nk = self.shape
        want = ({BITMAP_KEY: (b, hm, nq, -(-nk // _WORD))} if self.layout == "bitmap" else
                {"row_starts": (b, hm, nq, self.num_intervals),
                 "row_lens": (b, hm, nq, self.num_intervals),
                 "col_starts": (b, hm, nk, self.num_bwd_intervals),
                 "col_lens": (b, hm, nk, self.num_bwd_intervals), "col_exact": (b,),
                 BITMAP_KEY: (b, hm, nq, -(-nk // _WORD))})
        for name, shape in want.items():
            if tuple(jnp.shape(metadata[name])) != shape:
                raise ValueError(f"metadata {name!r} must have shape {shape}, got "
                                 f"{tuple(jnp.shape(metadata[name]))}")

    def instantiate(self, metadata=None, q_len=None, kv_len=None, *, block_q=None,
                    block_kv=None, bwd_block_q=None, bwd_block_kv=None, preprocess=None,
                    row_classes=None):
        _no_classes(row_classes)
        q_len, kv_len = self._lengths(q_len, kv_len)
        self._check_metadata(metadata)
        tiles = resolve_tiles(block_q, block_kv, bwd_block_q, bwd_block_kv)
        b = self.batch
        # Tile states from the packed rows in both layouts: exact, one read of the words
        # (1/8 of the mask's bytes) per tile shape, and the same program for every tier
        # (XLA computes it once).
        words = jnp.asarray(metadata[BITMAP_KEY], U32)
        states = [tile_states_from_words(words, q_len, kv_len, bq, bk) for bq, bk in
                  ((tiles.block_q, tiles.block_kv), (tiles.bwd_block_q, tiles.bwd_block_kv))]
        if self.layout == "bitmap":
            fwd, bwd = self._empty_tables(b, q_len, kv_len)
            return ExecutionDescriptor(
                fwd, bwd, pack_tiles(states[0]), pack_tiles(jnp.swapaxes(states[1], -1, -2)),
                jnp.zeros((b, q_len), I32), jnp.zeros((b,), bool), {BITMAP_KEY: words},
                mask=self, q_len=q_len, kv_len=kv_len, tiles=tiles)
        get = lambda n: jnp.asarray(metadata[n], I32)  # noqa: E731
        return self._table_descriptor(get("row_starts"), get("row_lens"), get("col_starts"),
                                      get("col_lens"), jnp.asarray(metadata["col_exact"], bool),
                                      q_len, kv_len, tiles, states)


@jax.tree_util.register_pytree_node_class
class RuntimeDense:
    """A dense boolean mask whose values may be known only at run time, for
    :func:`jcompilemask.mask_attention` (``mask=``): the interval widths ``tiers`` its
    tables are built at (see the module doc). ``mask_attention`` wraps a plain traced or
    per-sequence boolean array in one with the default tiers; wrap it yourself to choose.

    Args:
      mask: bool, broadcastable to [batch, heads, q_len, kv_len] (as ``mask=``).
      tiers: increasing positive ints, the K (row runs; the column tables use the same
        width) of each set of tables. At run time the narrowest that holds every row of
        the batch is used; a mask with more runs in some row than the widest runs as a
        bitmap on the ``xla`` backend. Each tier costs one more compiled attention (both
        passes) per shape; the kernels check up to K intervals per element of a partial
        tile.

    >>> import jax, jax.numpy as jnp, numpy as np, jcompilemask as jcm
    >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 16, 2, 8))
    >>> @jax.jit
    ... def f(q, k, v, lengths):          # a padding mask built inside the step
    ...     m = jnp.arange(16)[None, :] < lengths[:, None]
    ...     m = m[:, None, None, :] & jnp.tril(jnp.ones((16, 16), bool))[None, None]
    ...     return jcm.mask_attention(q, k, v, jcm.runtime_dense(m, tiers=(1, 4)))
    >>> lens = jnp.array([16, 9])
    >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True,
    ...                                    key_value_seq_lengths=lens)
    >>> bool(jnp.allclose(f(q, k, v, lens), ref, atol=1e-5))
    True
    """

    def __init__(self, mask, tiers=DEFAULT_TIERS):
        tiers = tuple(tiers) if isinstance(tiers, (tuple, list)) else tiers
        if (not isinstance(tiers, tuple) or not tiers or any(
                isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
                or t < 1 for t in tiers) or list(tiers) != sorted(set(tiers))):
            raise ValueError(f"tiers must be a non-empty increasing tuple of positive ints "
                             f"(row intervals per table), e.g. (1, 8); got {tiers!r}")
        if not (hasattr(mask, "dtype") and hasattr(mask, "shape")):
            raise TypeError(f"runtime_dense(mask): mask must be a boolean array, got "
                            f"{type(mask).__name__}")
        if mask.dtype != bool:
            raise TypeError(f"runtime_dense(mask): mask must be boolean (True = attend), got "
                            f"{mask.dtype}; pass mask.astype(bool)")
        self.mask = mask
        self.tiers = tuple(int(t) for t in tiers)

    def tree_flatten(self):
        return (self.mask,), self.tiers

    @classmethod
    def tree_unflatten(cls, tiers, children):
        obj = object.__new__(cls)
        obj.mask, obj.tiers = children[0], tiers
        return obj

    @property
    def dtype(self):
        return self.mask.dtype

    @property
    def shape(self):
        return self.mask.shape

    def __repr__(self):
        return f"RuntimeDense(shape={tuple(self.mask.shape)}, tiers={self.tiers})"

    def tier_index(self):
        """int32 (traced inside ``jit``): which tier this mask alone runs at, ``len(tiers)``
        for the bitmap (the call's ``is_causal`` and sequence lengths can only lower it),
        e.g. for ``jax.debug.print`` in a training step. Under ``vmap`` this is per mapped
        mask, while ``mask_attention`` runs the whole mapped batch at the widest of them.

        >>> import jax.numpy as jnp, jcompilemask as jcm
        >>> int(jcm.runtime_dense(jnp.tril(jnp.ones((8, 8), bool))).tier_index())
        0
        >>> int(jcm.runtime_dense(jnp.eye(8, dtype=bool) | (jnp.arange(8) % 3 == 0)[None]).tier_index())
        1
        """
        m = jnp.asarray(self.mask, bool)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape) if m.ndim < 4 else m
        return _tier(self.tiers, first_runs_from_words(pack_words(m))[2])

    def masks(self, shape=None):
        """The :class:`RuntimeDenseMask` of each tier and the bitmap's last (the first
        thing :meth:`plan` returns) for masks of ``shape`` [B, Hm, Nq, Nk] (default: this
        mask's shape)."""
        shape = tuple(self.mask.shape if shape is None else shape)
        return ([RuntimeDenseMask(shape, "intervals", t, t) for t in self.tiers]
                + [RuntimeDenseMask(shape, "bitmap")])

    def plan(self, mask4, transpose=None):
        """For the bool [B, Hm, Nq, Nk] ``mask4`` (this mask combined with the call's other
        masking): ``(masks, metadata, index)``: one :class:`RuntimeDenseMask` per tier and
        the bitmap last, each one's metadata, and the int32 index of the one to run (the
        narrowest tier that holds every row's runs; the bitmap past the widest; under
        ``vmap``, one index for every mapped mask, the widest any of them needs).
        ``transpose(words, n_rows, n_cols)`` packs the columns from the row words (default
        :func:`transpose_words`; ``mask_attention`` passes the CuTe kernel's where it is on,
        ``kernels.cute.api.transpose_words``, which gives the same words).

        The run counts and a K = 1 tier's tables come from one reduction over the packed
        words (:func:`first_runs_from_words`); the wider tiers' tables (a scan and a
        search per slot, :func:`runs_from_words`) are built under ``lax.cond`` only when
        the index is past a K = 1 first tier, and are zeros otherwise (their tier does
        not run)."""
        shape = tuple(mask4.shape)
        words = pack_words(mask4, -1)
        cwords = (transpose or transpose_words)(words, shape[-2], shape[-1])
        rs1, rl1, rc = first_runs_from_words(words)
        cs1, cl1, cc = first_runs_from_words(cwords)
        index = _tier(self.tiers, rc, one_for_vmap=True)
        runs1 = (rs1, rl1, rc, cs1, cl1, cc, words)
        runs_wide = runs1                  # the bitmap reads only the words
        kw = self.tiers[-1]
        if kw > 1:
            def tables():
                rs, rl, _ = runs_from_words(words, kw)
                cs, cl, _ = runs_from_words(cwords, kw)
                return rs, rl, cs, cl

            def zeros():
                r = jnp.zeros(words.shape[:-1] + (kw,), I32)
                c = jnp.zeros(cwords.shape[:-1] + (kw,), I32)
                return r, r, c, c

            rs, rl, cs, cl = lax.cond(index > 0, tables, zeros) if self.tiers[0] == 1 else tables()
            runs_wide = (rs, rl, rc, cs, cl, cc, words)
        masks = self.masks(shape)
        metadata = [m.metadata_from_runs(runs1 if m.layout == "intervals" and m.num_intervals == 1
                                         else runs_wide) for m in masks]
        return masks, metadata, index


def runtime_dense(mask, tiers=DEFAULT_TIERS) -> RuntimeDense:
    """A dense boolean mask for :func:`jcompilemask.mask_attention` whose runs are found at
    run time, with the interval widths ``tiers`` (see :class:`RuntimeDense`)."""
    return RuntimeDense(mask, tiers)
