"""The Execution Descriptor: the contract between the preprocess and the attention kernels.

Fields (B = metadata batch or 1, Hm = mask heads or 1, Nq = q_len, Nk = kv_len; the
forward pass tiles rows by ``block_q`` and keys by ``block_kv``, the backward pass by
``bwd_block_q`` / ``bwd_block_kv``; Tq = ceil(Nq / block_q), Tk = ceil(Nk / block_kv),
Tq' and Tk' the same at the backward tiles; ``ceil16(x) = ceil(x / 16)``):

==================  ======  ==========================  ===================================
field               dtype   shape                       meaning
==================  ======  ==========================  ===================================
``fwd_intervals``   int32   [B, Hm, Nq, K, 2]           per query row, K visible key
                                                        intervals as (start, length); row i
                                                        sees j iff for some m
                                                        ``uint32(j - start) < uint32(len)``.
                                                        ``0 <= start``, ``start + len <=
                                                        Nk``; unused slots are (0, 0).
``bwd_intervals``   int32   [B, Hm, Nk, Kc, 2]          per key column, Kc visible query
                                                        intervals (start, length) in rows;
                                                        Kc = 0 when the mask has no
                                                        column view (see ``bwd_exact``).
``fwd_tiles``       uint32  [B, Hm, Tq, ceil16(Tk)]     forward tile states, row-major:
                                                        tile (ti, tj) at word tj // 16,
                                                        bits 2*(tj % 16) (+1).
``bwd_tiles``       uint32  [B, Hm, Tk', ceil16(Tq')]   backward tile states, column-major:
                                                        tile (ti, tj) at [tj, ti // 16],
                                                        bits 2*(ti % 16) (+1).
``row_region``      int32   [B, Nq]                     the region of each row (first
                                                        match), -1 for none.
``bwd_exact``       bool    [B]                         True where ``bwd_intervals`` is
                                                        exact for that sequence; where
                                                        False the backward pass checks the
                                                        forward row intervals instead
                                                        (regions without a column view,
                                                        or run-time nested regions).
``metadata``        int32   dict                        normalised metadata, kept only for
                                                        masks with residual predicates.
==================  ======  ==========================  ===================================

Tile state, 2 bits: bit 0 (``COMPUTE``) = some in-range element of the tile is visible;
bit 1 (``MASKED``) = some in-range element is masked. So ``0b10`` = empty (skip: no K/V
load, no MMA), ``0b01`` = full (no masking), ``0b11`` = partial (element checks). Only
elements with i < Nq and j < Nk count: kernels bound-check ragged last tiles themselves.
Masks with residual predicates (atoms that are not intervals in ``k``): the tables hold
each interval's *hull*, and row i sees j iff for some m j is in slot m and that slot's
residual holds at (i, j) (``CompiledMask.slot_residuals``; per column interval likewise in
the backward view). Their tile states are safe rather than exact: EMPTY and FULL are
exact claims, but a tile the hulls touch is never EMPTY and a tile a residual may cut is
never FULL, so PARTIAL may hold a tile whose residual leaves it all visible or all masked.

Static (aux) data: the compiled mask, ``q_len``, ``kv_len`` and the :class:`TileConfig`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ExecutionDescriptor", "ClassDescriptor", "TileConfig", "COMPUTE", "MASKED",
           "EMPTY", "FULL", "PARTIAL", "pack_tiles", "unpack_tiles", "interval_check"]

COMPUTE, MASKED = 1, 2
EMPTY, FULL, PARTIAL = MASKED, COMPUTE, COMPUTE | MASKED
TILES_PER_WORD = 16


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shapes of the forward (``block_q`` x ``block_kv``) and backward passes."""

    block_q: int
    block_kv: int
    bwd_block_q: int
    bwd_block_kv: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{f.name} must be a positive int, got {v!r}")


def interval_check(j, starts, lens, residual=None):
    """``OR_m uint32(j - start_m) < uint32(len_m)`` -- the kernels' visibility test.

    ``j`` broadcasts against ``starts[..., m]``; the interval axis is the last one.
    ``residual`` (bool, broadcasting the same way, or None) is AND-ed per interval: the
    test of a mask whose intervals are hulls with residual predicates.
    """
    d = (j[..., None] - starts).astype(jnp.uint32)
    inside = d < lens.astype(jnp.uint32)
    if residual is not None:
        inside = inside & residual
    return jnp.any(inside, axis=-1)


def pack_tiles(states):
    """uint8/int [..., T] 2-bit states -> uint32 [..., ceil(T / 16)] words."""
    t = states.shape[-1]
    w = -(-t // TILES_PER_WORD)
    pad = w * TILES_PER_WORD - t
    s = jnp.pad(states.astype(jnp.uint32), [(0, 0)] * (states.ndim - 1) + [(0, pad)])
    s = s.reshape(s.shape[:-1] + (w, TILES_PER_WORD))
    shifts = (2 * jnp.arange(TILES_PER_WORD, dtype=jnp.uint32))
    shifts = jnp.expand_dims(shifts, tuple(range(s.ndim - 1)))
    return jnp.sum(s << shifts, axis=-1, dtype=jnp.uint32)   # fields never overlap


def unpack_tiles(words, num_tiles: int):
    """uint32 [..., W] words -> uint8 [..., num_tiles] 2-bit states (the decoder)."""
    shifts = 2 * jnp.arange(TILES_PER_WORD, dtype=jnp.uint32)
    shifts = jnp.expand_dims(shifts, tuple(range(words.ndim)))
    s = (words[..., None] >> shifts) & jnp.uint32(3)
    s = s.reshape(words.shape[:-1] + (words.shape[-1] * TILES_PER_WORD,))
    return s[..., :num_tiles].astype(jnp.uint8)


def not_an_array(kind: str) -> AttributeError:
    """The error for ``mask.ndim`` on a jcompilemask mask: code that takes masks as arrays
    (Flax's ``decode=True`` cache masking, ``flax.nnx.combine_masks``) reads it first."""
    return AttributeError(
        f"a jcompilemask {kind} is not an array (it has no ndim): code that combines masks "
        "as arrays cannot take it. With Flax's MultiHeadAttention(decode=True), use "
        "jcompilemask.flax.MultiHeadAttention(..., decode=True), which evaluates the mask at "
        "the cache positions, or call Flax's layer with mask=None; elsewhere pass "
        "mask.as_dense() where a dense boolean array is wanted")


@jax.tree_util.register_pytree_node_class
class ExecutionDescriptor:
    """Interval tables + tile-state bitmaps for one batch of one mask (see module doc).

    Build it with :meth:`CompiledMask.instantiate` (inside or outside ``jit``), pass it
    to :func:`jcompilemask.mask_attention` in every layer that uses the mask.
    """

    def __init__(self, fwd_intervals, bwd_intervals, fwd_tiles, bwd_tiles, row_region,
                 bwd_exact, metadata, *, mask, q_len: int, kv_len: int, tiles: TileConfig):
        self.fwd_intervals = fwd_intervals
        self.bwd_intervals = bwd_intervals
        self.fwd_tiles = fwd_tiles
        self.bwd_tiles = bwd_tiles
        self.row_region = row_region
        self.bwd_exact = bwd_exact
        self.metadata = metadata
        self.mask = mask
        self.q_len, self.kv_len, self.tiles = q_len, kv_len, tiles

    # -- pytree ---------------------------------------------------------------------------
    def tree_flatten(self):
        children = (self.fwd_intervals, self.bwd_intervals, self.fwd_tiles, self.bwd_tiles,
                    self.row_region, self.bwd_exact, self.metadata)
        return children, (self.mask, self.q_len, self.kv_len, self.tiles)

    @classmethod
    def tree_unflatten(cls, aux, children):
        mask, q_len, kv_len, tiles = aux
        return cls(*children, mask=mask, q_len=q_len, kv_len=kv_len, tiles=tiles)

    # -- shape facts ----------------------------------------------------------------------
    @property
    def ndim(self):
        raise not_an_array("ExecutionDescriptor")

    @property
    def batch(self) -> int:
        return self.fwd_intervals.shape[0]

    @property
    def mask_heads(self) -> int:
        return self.fwd_intervals.shape[1]

    @property
    def num_intervals(self) -> int:
        return self.fwd_intervals.shape[3]

    @property
    def num_bwd_intervals(self) -> int:
        return self.bwd_intervals.shape[3]

    def num_tiles(self, view: str = "fwd") -> tuple[int, int]:
        """(Tq, Tk) at the tile shape of ``view``."""
        bq, bk = self._blocks(view)
        return -(-self.q_len // bq), -(-self.kv_len // bk)

    def _blocks(self, view):
        if view == "fwd":
            return self.tiles.block_q, self.tiles.block_kv
        if view == "bwd":
            return self.tiles.bwd_block_q, self.tiles.bwd_block_kv
        raise ValueError(f"view must be 'fwd' or 'bwd', got {view!r}")

    def tile_states(self, view: str = "fwd"):
        """Decoded states uint8 [B, Hm, Tq, Tk] (row-major for both views)."""
        tq, tk = self.num_tiles(view)
        if view == "fwd":
            return unpack_tiles(self.fwd_tiles, tk)
        return jnp.swapaxes(unpack_tiles(self.bwd_tiles, tq), -1, -2)

    # -- element visibility ---------------------------------------------------------------
    def visibility(self, rows, cols, view: str = "fwd"):
        """bool [B, Hm, R, C]: visibility of rows x cols (int32 index vectors) as
        ``view``'s kernel sees it; indices out of range read as masked."""
        rows = jnp.asarray(rows, jnp.int32)
        cols = jnp.asarray(cols, jnp.int32)
        r = jnp.clip(rows, 0, self.q_len - 1)
        c = jnp.clip(cols, 0, self.kv_len - 1)
        fwd = self.fwd_intervals[:, :, r]                        # [B, Hm, R, K, 2]
        res_f = self.mask.slot_residuals(self, rows, cols, "fwd")
        row_vis = interval_check(cols[None, None, None, :],
                                 fwd[:, :, :, None, :, 0], fwd[:, :, :, None, :, 1], res_f)
        vis = row_vis
        if view == "bwd" and self.num_bwd_intervals > 0:
            bwd = self.bwd_intervals[:, :, c]                    # [B, Hm, C, Kc, 2]
            res_b = self.mask.slot_residuals(self, rows, cols, "bwd")
            col_vis = interval_check(rows[None, None, :, None],
                                     bwd[:, :, None, :, :, 0], bwd[:, :, None, :, :, 1],
                                     res_b)
            vis = jnp.where(self.bwd_exact[:, None, None, None], col_vis, row_vis)
        vis = vis | self.mask.fallback_visibility(self, rows, cols)
        inside = (rows >= 0) & (rows < self.q_len)
        inside = inside[:, None] & ((cols >= 0) & (cols < self.kv_len))[None, :]
        return vis & inside[None, None]

    def as_dense(self, view: str = "fwd"):
        """bool [B, Hm, q_len, kv_len] as seen by ``view``'s interval tables."""
        return self.visibility(jnp.arange(self.q_len), jnp.arange(self.kv_len), view)

    # -- debugging ------------------------------------------------------------------------
    def to_string(self, view: str = "fwd", batch: int = 0, head: int = 0,
                  max_tiles: int = 64) -> str:
        """Draw the tile map: ``#`` full, ``+`` partial, ``.`` empty."""
        st = np.asarray(self.tile_states(view)[batch, head])
        bq, bk = self._blocks(view)
        tq, tk = st.shape
        sym = {EMPTY: ".", FULL: "#", PARTIAL: "+"}
        lines = [f"{view} tiles {bq}x{bk} ({tq}x{tk}), batch {batch}, head {head}: "
                 f"# full, + partial, . empty"]
        for i in range(min(tq, max_tiles)):
            row = "".join(sym.get(int(x), "?") for x in st[i, :max_tiles])
            lines.append(row + (" ..." if tk > max_tiles else ""))
        if tq > max_tiles:
            lines.append("...")
        n = {s: int((st == v).sum()) for s, v in (("full", FULL), ("partial", PARTIAL),
                                                   ("empty", EMPTY))}
        lines.append(f"full {n['full']}, partial {n['partial']}, empty {n['empty']}")
        return "\n".join(lines)

    def __repr__(self):
        return (f"ExecutionDescriptor(B={self.batch}, Hm={self.mask_heads}, q_len="
                f"{self.q_len}, kv_len={self.kv_len}, K={self.num_intervals}, Kc="
                f"{self.num_bwd_intervals}, tiles={self.tiles})")


@jax.tree_util.register_pytree_node_class
class ClassDescriptor:
    """The descriptor of a mask that pairs queries only with keys of their own residue
    class mod ``classes`` (:mod:`jcompilemask.lower.classes`): ``inner`` is the
    :class:`ExecutionDescriptor` of one class's mask (rows ``i = q // classes``, keys
    ``j = k // classes``, lengths ``q_len / classes``), the same for every class.

    :func:`jcompilemask.mask_attention` runs it on the inputs viewed as ``[batch,
    len / classes, classes * heads, dim]`` (a free reshape: row ``classes * i + r`` of head
    ``h`` is row ``i`` of head ``r * heads + h``), so the kernels see fewer, denser tiles
    and no per-element predicate. ``q_len`` / ``kv_len`` and the dense views below are in
    the sequence's coordinates; ``tiles`` and :meth:`to_string` describe the class tiles.
    Built by :meth:`CompiledMask.instantiate` (``row_classes=False`` there gives an
    :class:`ExecutionDescriptor` of the same mask instead).

    ``per_class``: a mask that reads segment ids (packed documents) has a mask of its own
    in each class; ``inner`` then holds them as its ``classes`` mask heads, and
    :meth:`for_heads` repeats them to the heads of a call's class view. ``mask_heads`` is
    1 either way: the mask is the same for every head of the call.

    >>> import jcompilemask as jcm
    >>> from jcompilemask.spec import MaskSpec, Region, q, k, q_len
    >>> spec = MaskSpec([Region((0, q_len), (k <= q) & (k > q - 4) & ((q - k) % 2 == 0))])
    >>> d = jcm.compile(spec).instantiate(None, 8, 8)
    >>> d.classes, d.q_len, d.inner.q_len
    (2, 8, 4)
    >>> bool((d.as_dense() == spec.as_dense(None, 8, 8)).all())
    True
    """

    def __init__(self, inner: ExecutionDescriptor, *, classes: int, mask,
                 per_class: bool = False):
        self.inner, self.classes, self.mask = inner, classes, mask
        self.per_class = per_class

    # The inner descriptor's children, in its order: code that walks a descriptor's fields
    # by position (the partitioning rules: which leaves have a mask-head axis) reads a
    # class descriptor as its inner one.
    def tree_flatten(self):
        children, aux = self.inner.tree_flatten()
        return children, (aux, self.classes, self.mask, self.per_class)

    @classmethod
    def tree_unflatten(cls, aux, children):
        inner = ExecutionDescriptor.tree_unflatten(aux[0], children)
        return cls(inner, classes=aux[1], mask=aux[2], per_class=aux[3])

    def for_heads(self, heads: int) -> ExecutionDescriptor:
        """The inner descriptor for the inputs viewed with the classes as heads, of
        ``heads`` heads each (``classes * heads`` in all): the inner one itself, or where
        each class has its own mask (``per_class``: a mask reading segment ids, whose
        classes are the inner descriptor's mask heads) its tables repeated so that head
        ``r * heads + h`` reads class ``r``'s."""
        if not self.per_class:
            return self.inner
        d = self.inner
        rep = lambda x: jnp.repeat(x, heads, axis=1)          # noqa: E731
        return ExecutionDescriptor(rep(d.fwd_intervals), rep(d.bwd_intervals),
                                   rep(d.fwd_tiles), rep(d.bwd_tiles), d.row_region,
                                   d.bwd_exact, d.metadata, mask=d.mask, q_len=d.q_len,
                                   kv_len=d.kv_len, tiles=d.tiles)

    @property
    def ndim(self):
        raise not_an_array("ClassDescriptor")

    @property
    def q_len(self) -> int:
        return self.inner.q_len * self.classes

    @property
    def kv_len(self) -> int:
        return self.inner.kv_len * self.classes

    @property
    def tiles(self) -> TileConfig:
        return self.inner.tiles

    @property
    def batch(self) -> int:
        return self.inner.batch

    @property
    def mask_heads(self) -> int:
        # per_class: the inner descriptor's heads are the classes; the mask itself is the
        # same for every head of the call
        return 1 if self.per_class else self.inner.mask_heads

    @property
    def num_intervals(self) -> int:
        return self.inner.num_intervals

    @property
    def num_bwd_intervals(self) -> int:
        return self.inner.num_bwd_intervals

    def visibility(self, rows, cols, view: str = "fwd"):
        """bool [B, Hm, R, C] in the sequence's coordinates (see
        :meth:`ExecutionDescriptor.visibility`)."""
        rows = jnp.asarray(rows, jnp.int32)
        cols = jnp.asarray(cols, jnp.int32)
        c = self.classes
        same = (rows[:, None] % c) == (cols[None, :] % c)
        inside = ((rows >= 0) & (rows < self.q_len))[:, None] & \
            ((cols >= 0) & (cols < self.kv_len))[None, :]
        vis = self.inner.visibility(rows // c, cols // c, view)
        if self.per_class:                # row r's class is inner head r % c
            idx = jnp.broadcast_to((rows % c)[None, None, :, None],
                                   (vis.shape[0], 1) + vis.shape[2:])
            vis = jnp.take_along_axis(vis, idx, axis=1)
        return vis & (same & inside)[None, None]

    def as_dense(self, view: str = "fwd"):
        """bool [B, Hm, q_len, kv_len] in the sequence's coordinates."""
        return self.visibility(jnp.arange(self.q_len), jnp.arange(self.kv_len), view)

    def to_string(self, view: str = "fwd", batch: int = 0, head: int = 0,
                  max_tiles: int = 64) -> str:
        """The tile map of one class (every class has the same one; with ``per_class``
        ``head`` picks the class)."""
        which = (f"class {head} of" if self.per_class else "each of")
        return (f"{self.classes} residue classes (q % {self.classes} == k % "
                f"{self.classes}), {which} {self.inner.q_len} x {self.inner.kv_len}:\n"
                + self.inner.to_string(view, batch, head if self.per_class else 0,
                                       max_tiles))

    def __repr__(self):
        return (f"ClassDescriptor(classes={self.classes}, q_len={self.q_len}, kv_len="
                f"{self.kv_len}, inner={self.inner!r})")
