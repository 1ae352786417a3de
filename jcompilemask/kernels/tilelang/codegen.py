"""Generate the preprocess program of a lowered CompiledMask as TileLang source.

Nothing here is written per mask: the program walks ``cm.regions[g].intervals[m]``
(``lo``, ``hi``, ``cond``, ``q_lo``, ``q_hi``, ``row_flag``) and the region bounds
``spec.regions[g].rows`` and emits them (see :mod:`.emit`) into three kernel templates.
One TileLang ``prim_func`` launches them in order (one FFI call):

1. ``rows_fwd`` -- one block per forward tile-row (``block_q`` rows): each row's region
   (first match) and K intervals, written to ``row_region`` / ``fwd_intervals``; the
   row's intervals merged into disjoint runs, which add +1 over the tile columns they
   touch and over those they cover (difference arrays in shared memory, then a block
   scan); a tile is visible if a row touches it and full if all its rows cover it. The
   16-tile words of the row-major bitmap are written whole. The block also zeroes its
   share of the backward words (kernel 2 ORs into them).
2. ``rows_bwd`` -- the same per backward tile-row (``bwd_block_q`` rows, intervals
   recomputed, nothing written but tile states), OR-ing 2 bits per tile into the
   column-major words.
3. ``cols`` (masks with a column view) -- one thread per key column ``j``: for each
   (region, interval) the rows that see ``j`` are ``[#{q: hi'(q) <= j}, #{q: lo'(q) <=
   j})`` (``lo'``, ``hi'`` the endpoints extended by -1 before the region's effective
   row range and by a big value after it), counted by binary search over the effective
   range, where the lowering proved both endpoints non-decreasing in ``q``; plus
   ``bwd_exact`` (no run-time nested regions).

Results equal the jnp preprocess (``lower/preprocess.py``) bit for bit: the same clamping,
first-match regions, effective row ranges with nested detection, run merging and
in-range-only tile states. The binary search equals jnp's counting whenever the clamped
endpoints are non-decreasing in ``q`` over the effective range, which the lowering
proves for metadata inside its declared ranges (a scalar declared ``min=0`` that is
negative at run time can break it, as can int32 overflow of a bound).

Lengths, batch and metadata values are run-time values of the kernel (``q_len`` and
``kv_len`` are scalar arguments; batch, token count and word counts are symbolic buffer
dimensions): changing them never recompiles. Tile sizes, the number of intervals and of
mask heads are compile-time constants.

The same body text runs on the CPU under :mod:`.mock` (``T.sync_threads()`` becomes a
``yield``), which is how the program's logic is tested without a GPU.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

from ...lower.descriptor import TileConfig
from ...spec.expr import BoolConst
from ...spec.metadata import Scalar, SegmentIds, Vector
from .emit import ExprEmitter, leaves_of, uses_q

__all__ = ["KernelConfig", "Program", "generate", "unsupported_reason"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the generated kernels (compile-time).

    threads: threads per block (a power of two, >= 32).
    chunk: tile columns handled per pass of the tile-state kernels (a multiple of 16);
      wider masks loop over chunks. 1024 keeps shared memory at ~13 KB per block.
    """

    threads: int = 128
    chunk: int = 1024

    def __post_init__(self):
        t = self.threads
        if t < 32 or t & (t - 1):
            raise ValueError(f"threads must be a power of two >= 32, got {t}")
        if self.chunk < 16 or self.chunk % 16:
            raise ValueError(f"chunk must be a positive multiple of 16, got {self.chunk}")


@dataclasses.dataclass(frozen=True)
class Program:
    """A generated preprocess program.

    Attributes:
      source: Python source defining the TileLang ``prim_func`` ``main`` (run it with
        ``T`` = ``tilelang.language`` in its globals).
      mock_source: the same kernels as CPU generators (see :mod:`.mock`).
      inputs: metadata operands in call order: ``("scalar", name)``,
        ``("vector", name)``, ``("seg", name, field)``.
      outputs: output names in call order.
      has_columns: whether the column kernel (and its outputs) exist.
      kernels: ``(name, grid_x, grid_y, threads)`` in launch order (grid as text).
    """

    source: str
    mock_source: str
    inputs: tuple
    outputs: tuple
    has_columns: bool
    kernels: tuple
    num_intervals: int
    num_bwd_intervals: int
    mask_heads: int

    def fingerprint(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]


def unsupported_reason(cm) -> Optional[str]:
    """Why the TileLang preprocess cannot serve ``cm`` (None: it can)."""
    from ...lower.dense import DenseMask
    if isinstance(cm, DenseMask):
        return "from_dense masks have constant descriptors (nothing to preprocess)"
    if cm.fallback_regions:
        return (f"regions {list(cm.fallback_regions)} keep a residual predicate (their "
                "intervals are hulls); the generated kernels write exact tables only (jnp "
                "preprocess)")
    return None


# ---------------------------------------------------------------------------------------
class _Lines:
    """Indented source lines, plus the scalar variables to declare at the kernel top.

    Intermediate values are stored in ``T.alloc_var`` scalars rather than bound with
    ``x = ...``: TileLang inlines let-bindings, and the nested selects of the interval
    slots and the sorting network then grow exponentially (minutes of compile time).
    """

    def __init__(self):
        self.out: list[str] = []
        self.ind = 0
        self.decls: dict[str, str] = {}

    def __call__(self, s: str):
        self.out.append("    " * self.ind + s)

    def set(self, name: str, value: str, dtype: str = "int32"):
        """``name = value`` into a declared scalar variable."""
        self.decls.setdefault(name, dtype)
        self(f"{name} = {value}")

    def lines(self) -> list[str]:
        return [f'{n} = T.alloc_var("{d}")' for n, d in self.decls.items()] + self.out

    def block(self):
        return _Indent(self)


class _Indent:
    def __init__(self, w):
        self.w = w

    def __enter__(self):
        self.w.ind += 1

    def __exit__(self, *a):
        self.w.ind -= 1


class _OnHeads:
    """``if h in heads:`` around a block (no condition when ``heads`` is None)."""

    def __init__(self, w: _Lines, heads):
        self.w, self.heads = w, heads

    def __enter__(self):
        if self.heads is not None:
            cond = f"h == T.int32({self.heads[0]})"
            for x in self.heads[1:]:
                cond = f"T.Or({cond}, h == T.int32({x}))"
            self.w(f"if {cond}:")
            self.w.ind += 1

    def __exit__(self, *a):
        if self.heads is not None:
            self.w.ind -= 1


_on_heads = _OnHeads


class _Gen:
    """Builds the kernel bodies for one (mask, tiles, config)."""

    def __init__(self, cm, tiles: TileConfig, cfg: KernelConfig):
        self.cm, self.spec, self.tiles, self.cfg = cm, cm.spec, tiles, cfg
        self.hm = cm.spec.mask_heads
        self.K = cm.num_intervals
        self.KC = cm.num_bwd_intervals
        self.lowered = [(g, lr) for g, lr in enumerate(cm.regions) if lr.fallback is None]
        nodes = [b for r in self.spec.regions for b in r.rows]
        for _, lr in self.lowered:
            for iv in lr.intervals:
                nodes += [iv.lo, iv.hi, iv.cond, iv.q_lo, iv.q_hi, iv.row_flag]
        self.scalars, self.elems, self.segs = leaves_of(nodes)
        self.E = ExprEmitter("q")

    # -- operands -----------------------------------------------------------------------
    def inputs(self):
        out = []
        for name, decl in self.spec.metadata.items():
            if isinstance(decl, Scalar):
                out.append(("scalar", name))
            elif isinstance(decl, Vector):
                out.append(("vector", name))
            elif isinstance(decl, SegmentIds):
                for field in sorted(f for n, f in self.segs if n == name):
                    out.append(("seg", name, field))
        return tuple(out)

    def params(self):
        """(name, declaration text) of every prim_func parameter, in call order."""
        ps = []
        for inp in self.inputs():
            if inp[0] == "scalar":
                ps.append((f"M_{inp[1]}", 'T.Tensor((B,), "int32")'))
            elif inp[0] == "vector":
                size = self.spec.metadata[inp[1]].size
                ps.append((f"M_{inp[1]}", f'T.Tensor((B, {size}), "int32")'))
            else:
                ps.append((f"G_{inp[1]}_{inp[2]}", f'T.Tensor((B, NT_{inp[1]}), "int32")'))
        hm, K, KC = self.hm, self.K, self.KC
        ps += [("row_region", 'T.Tensor((B, NQ), "int32")'),
               ("fwd_iv", f'T.Tensor((B, {hm}, NQ, {K}, 2), "int32")'),
               ("fwd_tiles", f'T.Tensor((B, {hm}, TQF, WKF), "uint32")'),
               ("bwd_tiles", f'T.Tensor((B, {hm}, TKB, WQB), "uint32")')]
        if KC:
            ps += [("bwd_iv", f'T.Tensor((B, {hm}, NK, {KC}, 2), "int32")'),
                   ("bwd_exact", 'T.Tensor((B,), "uint8")')]
        ps += [("q_len", "T.int32"), ("kv_len", "T.int32")]
        return ps

    def dyn_names(self):
        names = ["B", "NQ", "TQF", "WKF", "TKB", "WQB"]
        if self.KC:
            names.append("NK")
        names += sorted({f"NT_{n}" for n, _ in self.segs})
        return names

    # -- shared pieces ------------------------------------------------------------------
    def prologue(self, w: _Lines):
        if self.hm == 1:
            w("b = by")
            w("h = by - by")
        else:
            w(f"b = by // {self.hm}")
            w(f"h = by % {self.hm}")
        for name in sorted(self.scalars):
            w.set(f"S_{name}", f"M_{name}[b]")
        for name, i in sorted(self.elems):
            w.set(f"V_{name}_{i}", f"M_{name}[b, {i}]")
        for g, r in enumerate(self.spec.regions):
            w.set(f"RLO_{g}", self.E.clamp(r.rows[0], "q_len"))
            w.set(f"RHI_{g}", self.E.clamp(r.rows[1], "q_len"))

    def row_intervals(self, w: _Lines):
        """Region of row ``q`` (-> ``reg``) and its K slots (-> ``ST_m``, ``LN_m``).

        Each region's endpoints are computed inside an ``if reg == g`` branch, so a row
        evaluates only its own region's expressions.
        """
        chain = "T.int32(-1)"
        for g in reversed(range(len(self.spec.regions))):
            chain = (f"T.if_then_else(T.And(q >= RLO_{g}, q < RHI_{g}), T.int32({g}), "
                     f"{chain})")
        w.set("reg", chain)
        for m in range(self.K):
            w.set(f"ST_{m}", "T.int32(0)")
            w.set(f"LN_{m}", "T.int32(0)")
        E = self.E
        for g, lr in self.lowered:
            if not lr.intervals:
                continue
            w(f"if reg == {g}:")
            with w.block():
                for members in lr.slots:
                    slots = self.cm.fwd_slots[g, members[0]]     # the group's assignment
                    if not slots:
                        continue
                    if len(members) == 1:
                        iv = lr.intervals[members[0]]
                        w.set("lo", E.clamp(iv.lo, "kv_len"))
                        w.set("hi", E.clamp(iv.hi, "kv_len"))
                        span = "T.max(hi - lo, T.int32(0))"
                        if isinstance(iv.cond, BoolConst) and iv.cond.value:
                            w.set("ln", span)
                        else:
                            w.set("ln", f"T.if_then_else({E.pred(iv.cond)}, {span}, T.int32(0))")
                    else:
                        # A slot group (row conditions that exclude each other, or intervals
                        # that touch wherever both hold): the union of the active non-empty
                        # members is one run, [min lo, max hi).
                        w.set("lo", "kv_len + 1")
                        w.set("hi", "T.int32(0)")
                        for i in members:
                            iv = lr.intervals[i]
                            w.set("mlo", E.clamp(iv.lo, "kv_len"))
                            w.set("mhi", E.clamp(iv.hi, "kv_len"))
                            act = "mhi > mlo"
                            if not (isinstance(iv.cond, BoolConst) and iv.cond.value):
                                act = f"T.And({E.pred(iv.cond)}, mhi > mlo)"
                            w.set("act", f"T.if_then_else({act}, T.int32(1), T.int32(0))")
                            w.set("lo", "T.if_then_else(act > 0, T.min(lo, mlo), lo)")
                            w.set("hi", "T.if_then_else(act > 0, T.max(hi, mhi), hi)")
                        w.set("ln", "T.max(hi - lo, T.int32(0))")
                    for s, heads in slots:        # per-head slots (lower/slots.py)
                        with _on_heads(w, heads):
                            w(f"LN_{s} = ln")
                            w(f"ST_{s} = T.if_then_else(ln > 0, lo, T.int32(0))")

    def runs(self, w: _Lines, bk: int, atomic):
        """Merge the row's K intervals into runs; add them to the chunk's diff arrays."""
        K = self.K
        for m in range(K):
            w(f"slo[{m}] = T.if_then_else(LN_{m} > 0, ST_{m}, big)")
            w(f"shi[{m}] = T.if_then_else(LN_{m} > 0, ST_{m} + LN_{m}, big)")
        for i in range(K - 1):                      # bubble network, static indices
            for j in range(K - 1 - i):
                w.set("xa", f"slo[{j}]")
                w.set("xb", f"slo[{j + 1}]")
                w.set("ya", f"shi[{j}]")
                w.set("yb", f"shi[{j + 1}]")
                w(f"slo[{j}] = T.if_then_else(xa > xb, xb, xa)")
                w(f"slo[{j + 1}] = T.if_then_else(xa > xb, xa, xb)")
                w(f"shi[{j}] = T.if_then_else(xa > xb, yb, ya)")
                w(f"shi[{j + 1}] = T.if_then_else(xa > xb, ya, yb)")
        w("pmax = T.int32(-1)")
        w("gst = T.int32(-1)")
        for i in range(K):
            w(f"gst = T.max(gst, T.if_then_else(slo[{i}] > pmax, slo[{i}], T.int32(-1)))")
            w(f"pmax = T.max(pmax, shi[{i}])")
            nxt = f"slo[{i + 1}]" if i + 1 < K else "big + 1"
            w(f"if T.And({nxt} > pmax, gst < big):")
            with w.block():
                w.set("tl", f"T.max(T.floordiv(gst, {bk}) - base, T.int32(0))")
                w.set("th", f"T.min(T.floordiv(pmax + {bk - 1}, {bk}) - base, n)")
                w("if tl < th:")
                with w.block():
                    atomic(w, "dT", "tl", "T.int32(1)")
                    atomic(w, "dT", "th", "T.int32(-1)")
                w.set("fl", f"T.max(T.floordiv(gst + {bk - 1}, {bk}) - base, T.int32(0))")
                w.set("fh", f"T.min(T.if_then_else(pmax == kv_len, tk, "
                      f"T.floordiv(pmax, {bk})) - base, n)")
                w("if fl < fh:")
                with w.block():
                    atomic(w, "dF", "fl", "T.int32(1)")
                    atomic(w, "dF", "fh", "T.int32(-1)")

    def scan(self, w: _Lines):
        """In-place inclusive block scan of dT[0:n] and dF[0:n]."""
        th = self.cfg.threads
        w(f"E = T.ceildiv(n, {th})")
        w("acc1 = T.int32(0)")
        w("acc2 = T.int32(0)")
        w("for si in T.serial(E):")
        with w.block():
            w("ix = tx * E + si")
            w("if ix < n:")
            with w.block():
                w("acc1 = acc1 + dT[ix]")
                w("dT[ix] = acc1")
                w("acc2 = acc2 + dF[ix]")
                w("dF[ix] = acc2")
        w("tot1[tx] = acc1")
        w("tot2[tx] = acc2")
        w("T.sync_threads()")
        off = 1
        while off < th:
            w(f"u1_{off} = tot1[tx] + T.if_then_else(tx >= {off}, "
              f"tot1[T.max(tx - {off}, 0)], T.int32(0))")
            w(f"u2_{off} = tot2[tx] + T.if_then_else(tx >= {off}, "
              f"tot2[T.max(tx - {off}, 0)], T.int32(0))")
            w("T.sync_threads()")
            w(f"tot1[tx] = u1_{off}")
            w(f"tot2[tx] = u2_{off}")
            w("T.sync_threads()")
            off *= 2
        w("o1 = T.if_then_else(tx > 0, tot1[T.max(tx - 1, 0)], T.int32(0))")
        w("o2 = T.if_then_else(tx > 0, tot2[T.max(tx - 1, 0)], T.int32(0))")
        w("for si2 in T.serial(E):")
        with w.block():
            w("ix2 = tx * E + si2")
            w("if ix2 < n:")
            with w.block():
                w("dT[ix2] = dT[ix2] + o1")
                w("dF[ix2] = dF[ix2] + o2")
        w("T.sync_threads()")

    # -- kernels ------------------------------------------------------------------------
    def rows_kernel(self, w: _Lines, view: str, atomic, atomic_or):
        """Kernel body for the forward (row-major words, writes rows) or backward view."""
        th, ch, K = self.cfg.threads, self.cfg.chunk, self.K
        if view == "fwd":
            bq, bk = self.tiles.block_q, self.tiles.block_kv
        else:
            bq, bk = self.tiles.bwd_block_q, self.tiles.bwd_block_kv
        w(f'dT = T.alloc_shared(({ch + 1},), "int32")')
        w(f'dF = T.alloc_shared(({ch + 1},), "int32")')
        w(f'tot1 = T.alloc_shared(({th},), "int32")')
        w(f'tot2 = T.alloc_shared(({th},), "int32")')
        if view == "fwd":
            w(f'stS = T.alloc_shared(({ch},), "int32")')
            w('word = T.alloc_var("uint32")')
        w(f'slo = T.alloc_local(({K},), "int32")')
        w(f'shi = T.alloc_local(({K},), "int32")')
        for v in ("acc1", "acc2", "pmax", "gst"):
            w(f'{v} = T.alloc_var("int32")')
        self.prologue(w)
        w("ti = bx")
        w(f"tk = T.ceildiv(kv_len, {bk})")
        w(f"nrows = T.min({bq}, q_len - ti * {bq})")
        w("big = kv_len + 1")
        if view == "fwd":
            w("# zero this block's share of the backward words (kernel rows_bwd ORs)")
            w(f"ntq = T.ceildiv(q_len, {bq})")
            w(f"for zi in T.serial(T.ceildiv(TKB * WQB, ntq * {th})):")
            with w.block():
                w(f"zf = (zi * ntq + bx) * {th} + tx")
                w("if zf < TKB * WQB:")
                with w.block():
                    w("bwd_tiles[b, h, zf // WQB, zf % WQB] = T.uint32(0)")
        w(f"for c in T.serial(T.ceildiv(tk, {ch})):")
        with w.block():
            w(f"base = c * {ch}")
            w(f"n = T.min({ch}, tk - base)")
            w(f"for zi2 in T.serial(T.ceildiv(n + 1, {th})):")
            with w.block():
                w(f"iz = zi2 * {th} + tx")
                w("if iz <= n:")
                with w.block():
                    w("dT[iz] = T.int32(0)")
                    w("dF[iz] = T.int32(0)")
            w("T.sync_threads()")
            w(f"for rr in T.serial({-(-bq // th)}):")
            with w.block():
                w(f"r = rr * {th} + tx")
                w(f"q = ti * {bq} + r")
                w(f"if T.And(r < {bq}, q < q_len):")
                with w.block():
                    self.row_intervals(w)
                    if view == "fwd":
                        w("if c == 0:")
                        with w.block():
                            for m in range(K):
                                w(f"fwd_iv[b, h, q, {m}, 0] = ST_{m}")
                                w(f"fwd_iv[b, h, q, {m}, 1] = LN_{m}")
                            if self.hm == 1:
                                w("row_region[b, q] = reg")
                            else:
                                w("if h == 0:")
                                with w.block():
                                    w("row_region[b, q] = reg")
                    self.runs(w, bk, atomic)
            w("T.sync_threads()")
            self.scan(w)
            w(f"for sj in T.serial(T.ceildiv(n, {th})):")
            with w.block():
                w(f"jx = sj * {th} + tx")
                w("if jx < n:")
                with w.block():
                    w.set("stv", "T.if_then_else(dT[jx] > 0, T.int32(1), T.int32(0)) + "
                          "T.if_then_else(dF[jx] == nrows, T.int32(0), T.int32(2))")
                    if view == "fwd":
                        w("stS[jx] = stv")
                    else:
                        atomic_or(w, "bwd_tiles", "b, h, base + jx, ti // 16",
                                  'T.shift_left(T.Cast("uint32", stv), '
                                  'T.Cast("uint32", (ti % 16) * 2))')
            w("T.sync_threads()")
            if view == "fwd":
                w("nw = T.ceildiv(n, 16)")
                w(f"for sw in T.serial(T.ceildiv(nw, {th})):")
                with w.block():
                    w(f"wx = sw * {th} + tx")
                    w("if wx < nw:")
                    with w.block():
                        w("word = T.uint32(0)")
                        w("for t in T.unroll(16):")
                        with w.block():
                            w("if wx * 16 + t < n:")
                            with w.block():
                                w('word = word | T.shift_left(T.Cast("uint32", '
                                  'stS[wx * 16 + t]), T.Cast("uint32", t * 2))')
                        w(f"fwd_tiles[b, h, ti, base // 16 + wx] = word")
                w("T.sync_threads()")

    def cols_kernel(self, w: _Lines):
        th = self.cfg.threads
        G = len(self.spec.regions)
        w('blo = T.alloc_var("int32")')
        w('bhi = T.alloc_var("int32")')
        w('cnl = T.alloc_var("int32")')
        w('cnh = T.alloc_var("int32")')
        w('nest = T.alloc_var("int32")')
        for g in range(G):
            w(f'EA_{g} = T.alloc_var("int32")')
            w(f'EB_{g} = T.alloc_var("int32")')
        self.prologue(w)
        # effective contiguous row ranges (region_row_ranges in lower/preprocess.py)
        w("nest = T.int32(0)")
        for g in range(G):
            w(f"EA_{g} = RLO_{g}")
            w(f"EB_{g} = RHI_{g}")
            for _ in range(g):
                for p in range(g):
                    ne = f"RLO_{p} < RHI_{p}"
                    w(f"EA_{g} = T.if_then_else(T.And(T.And({ne}, RLO_{p} <= EA_{g}), "
                      f"EA_{g} < RHI_{p}), RHI_{p}, EA_{g})")
                    w(f"EB_{g} = T.if_then_else(T.And(T.And({ne}, RLO_{p} < EB_{g}), "
                      f"EB_{g} <= RHI_{p}), RLO_{p}, EB_{g})")
            w(f"EB_{g} = T.max(EA_{g}, EB_{g})")
            for p in range(g):
                w(f"nest = T.if_then_else(T.And(T.And(RLO_{p} < RHI_{p}, EA_{g} < RLO_{p}), "
                  f"RHI_{p} < EB_{g}), T.int32(1), nest)")
        w(f"j = bx * {th} + tx")
        w("if j < kv_len:")
        with w.block():
            c = 0
            E = self.E
            if any(h is not None for sl in self.cm.bwd_slots.values() for _, h in sl) or \
                    any(not sl for sl in self.cm.bwd_slots.values()):
                for x in range(self.KC):      # slots some heads leave unused
                    w(f"bwd_iv[b, h, j, {x}, 0] = T.int32(0)")
                    w(f"bwd_iv[b, h, j, {x}, 1] = T.int32(0)")
            for g, lr in self.lowered:
                for m, iv in enumerate(lr.intervals):
                    a = f"EA_{g}"
                    if iv.q_lo is not None:
                        a = f"T.max({a}, {E.expr(iv.q_lo)})"
                    z = f"EB_{g}"
                    if iv.q_hi is not None:
                        z = f"T.min({z}, {E.expr(iv.q_hi)})"
                    w.set("A", f"T.min(T.max({a}, T.int32(0)), q_len)")
                    w.set("Z", f"T.max(A, T.min(T.max({z}, T.int32(0)), q_len))")
                    for var, bound in (("cnl", iv.lo), ("cnh", iv.hi)):
                        self.count(w, var, bound, c)
                    w.set("q0", f"A + cnh")
                    w.set("q1", f"A + cnl")
                    span = f"T.max(q1 - q0, T.int32(0))"
                    if isinstance(iv.row_flag, BoolConst) and iv.row_flag.value:
                        w.set("cl", span)
                    else:
                        w.set("cl", f"T.if_then_else({E.pred(iv.row_flag)}, "
                              f"{span}, T.int32(0))")
                    for c, heads in self.cm.bwd_slots[g, m]:
                        with _on_heads(w, heads):
                            w(f"bwd_iv[b, h, j, {c}, 0] = T.if_then_else(cl > 0, q0, "
                              "T.int32(0))")
                            w(f"bwd_iv[b, h, j, {c}, 1] = cl")
            w("if T.And(j == 0, h == 0):")
            with w.block():
                w('bwd_exact[b] = T.Cast("uint8", T.if_then_else(nest > 0, T.int32(0), '
                  'T.int32(1)))')

    def count(self, w: _Lines, var: str, bound, c: int):
        """``var = #{q in [A_c, Z_c): clamp(bound(q)) <= j}`` (bound non-decreasing)."""
        if not uses_q(bound):
            w(f"{var} = T.if_then_else({self.E.clamp(bound, 'kv_len')} <= j, "
              f"Z - A, T.int32(0))")
            return
        w(f"blo = A")
        w(f"bhi = Z")
        w("for it in T.serial(32):")
        with w.block():
            w("if blo < bhi:")
            with w.block():
                w.set("md", "T.floordiv(blo + bhi, 2)")
                w.set("vv", ExprEmitter("md").clamp(bound, "kv_len"))
                w("bhi = T.if_then_else(vv <= j, bhi, md)")
                w("blo = T.if_then_else(vv <= j, md + 1, blo)")
        w(f"{var} = blo - A")


# ---------------------------------------------------------------------------------------
def _atomic_tl(w, buf, idx, val):
    w(f"T.atomic_add({buf}[{idx}], {val})")


def _atomic_or_tl(w, buf, idx, val):
    w(f"T.atomic_or({buf}[{idx}], {val})")


def _atomic_mock(w, buf, idx, val):
    w(f"T.atomic_add_at({buf}, ({idx},), {val})")


def _atomic_or_mock(w, buf, idx, val):
    w(f"T.atomic_or_at({buf}, ({idx},), {val})")


def _kernels(gen: _Gen, mock: bool):
    """[(name, grid_x, grid_y, body lines)] in launch order."""
    at, ator = (_atomic_mock, _atomic_or_mock) if mock else (_atomic_tl, _atomic_or_tl)
    t = gen.tiles
    hm = gen.hm
    out = []
    w = _Lines()
    gen.rows_kernel(w, "fwd", at, ator)
    out.append(("rows_fwd", f"T.ceildiv(q_len, {t.block_q})", f"B * {hm}", w.lines()))
    w = _Lines()
    gen.rows_kernel(w, "bwd", at, ator)
    out.append(("rows_bwd", f"T.ceildiv(q_len, {t.bwd_block_q})", f"B * {hm}", w.lines()))
    if gen.KC:
        w = _Lines()
        gen.cols_kernel(w)
        out.append(("cols", f"T.ceildiv(kv_len, {gen.cfg.threads})", f"B * {hm}", w.lines()))
    return out


def generate(cm, tiles: TileConfig, config: KernelConfig | None = None) -> Program:
    """The preprocess program of ``cm`` at ``tiles`` (raises if unsupported)."""
    cfg = config or KernelConfig()
    why = unsupported_reason(cm)
    if why:
        raise ValueError(f"the TileLang preprocess cannot serve this mask: {why}")
    gen = _Gen(cm, tiles, cfg)
    th = cfg.threads
    head = [f"# jcompilemask TileLang preprocess for mask {cm.spec.name or ''!r} "
            f"(fingerprint {cm.fingerprint()})",
            f"# tiles fwd {tiles.block_q}x{tiles.block_kv}, bwd {tiles.bwd_block_q}x"
            f"{tiles.bwd_block_kv}; K={gen.K}, Kc={gen.KC}, Hm={gen.hm}; {cfg}",
            "# generated by jcompilemask.kernels.tilelang.codegen -- do not edit"]
    params = gen.params()

    # TileLang source
    src = list(head) + ["# namespace: T = tilelang.language", ""]
    for name in gen.dyn_names():
        src.append(f'{name} = T.dynamic("{name}")')
    src.append("")
    src.append("")
    src.append("@T.prim_func")
    sig = ",\n         ".join(f"{n}: {d}" for n, d in params)
    src.append(f"def main({sig}):")
    for name, gx, gy, body in _kernels(gen, mock=False):
        src.append(f"    # ---- kernel {name}")
        src.append(f"    with T.Kernel({gx}, {gy}, threads={th}) as (bx, by):")
        src.append("        tx = T.get_thread_binding()")
        src += ["        " + ln for ln in body]
    source = "\n".join(src) + "\n"

    # CPU mock source: each kernel a generator over (bx, by, tx); sync -> yield
    ms = list(head) + [""]
    kernels = []
    names = [n for n, _ in params] + gen.dyn_names()
    for name, gx, gy, body in _kernels(gen, mock=True):
        kernels.append((name, gx, gy, th))
        ms.append(f"def kernel_{name}(T, bx, by, tx, env):")
        for n in names:
            ms.append(f"    {n} = env[{n!r}]")
        for ln in body:
            stripped = ln.strip()
            if stripped == "T.sync_threads()":
                ms.append("    " + ln.replace("T.sync_threads()", "yield"))
            else:
                ms.append("    " + ln)
        ms.append("    return")
        ms.append("    yield")
        ms.append("")
    mock_source = "\n".join(ms) + "\n"
    outputs = ("row_region", "fwd_iv", "fwd_tiles", "bwd_tiles")
    if gen.KC:
        outputs += ("bwd_iv", "bwd_exact")
    return Program(source, mock_source, gen.inputs(), outputs, bool(gen.KC), tuple(kernels),
                   gen.K, gen.KC, gen.hm)
