"""Helpers shared by the SM90 forward and backward kernels: register-fragment views of
wgmma accumulators, the unsigned interval compare, a log-depth reduction, one wgmma
issue over all k-blocks, the 2-bit tile-state read, and the warp-specialized kernel
skeleton (TMA tiles, TMA pipelines, swizzled shared buffers)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Float32, Int32, Uint32, const_expr
from cutlass._mlir.dialects import arith, llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from .exp2_fma import EXP2_FMA_PTX, RCP_FMA_PTX
from .limits import COLUMNS_UNROLLED, INTERVALS_UNROLLED  # noqa: F401  (the kernels' unroll bounds)


@dsl_user_op
def _unsigned_lt(a, b, *, loc=None, ip=None) -> Boolean:
    """uint32(a) < uint32(b) for Int32 operands.

    Spelled as an explicit `arith.cmpi ult`: `Uint32(x) < Uint32(y)` on Int32 values
    was lowered to a signed compare (setp.lt.s32) by CuTe DSL 4.8.1, which would make
    every key left of an interval's start visible.
    """
    return Boolean(
        arith.cmpi(
            arith.CmpIPredicate.ult,
            Int32(a).ir_value(loc=loc, ip=ip),
            Int32(b).ir_value(loc=loc, ip=ip),
            loc=loc,
            ip=ip,
        )
    )


def _group_run(lo, hi, groups: int):
    """Bit g of a Uint32 for each g in [0, groups) with lo <= 8 g < hi (Int32 ends, lo <= hi
    or both <= 0; groups < 32): the groups of 8 columns whose first column an interval
    [lo, hi) covers, for ``forward.apply_mask_groups``. ceil(x / 8) of a clamped
    non-negative x is (x + 7) >> 3; both shifts stay below 32."""
    a = cutlass.min((cutlass.max(lo, Int32(0)) + Int32(7)) >> Int32(3), Int32(groups))
    b = cutlass.min((cutlass.max(hi, Int32(0)) + Int32(7)) >> Int32(3), Int32(groups))
    return (Uint32(1) << Uint32(b)) - (Uint32(1) << Uint32(a))


def _pair_runs(lo, hi, groups: int):
    """(_group_run for the first column of a thread's column pairs, for the second): bit g
    of word u for lo <= 8 g + u < hi, the columns 8 apart in an SM90 accumulator row."""
    return _group_run(lo, hi, groups), _group_run(lo - 1, hi - 1, groups)


@dsl_user_op
def bulk_reduce_add_f32(dst_gmem, src_smem, num_bytes: int, *, loc=None, ip=None) -> None:
    """``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``: adds `num_bytes`
    (a multiple of 16) of float32 from shared memory at `src_smem` onto global memory at
    `dst_gmem` (both 16-byte aligned; LLVM pointers). Asynchronous: commit it with
    ``cute.arch.cp_async_bulk_commit_group()`` and wait with
    ``cp_async_bulk_wait_group(n, read=True)`` before the shared source is rewritten.
    The writes to the source must be fenced (``fence_view_async_shared``) first."""
    g = llvm.ptrtoint(cutlass.Int64.mlir_type, dst_gmem, loc=loc, ip=ip)
    s = llvm.ptrtoint(cutlass.Int32.mlir_type, src_smem, loc=loc, ip=ip)
    llvm.inline_asm(
        res=None,
        operands_=[g, s, Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        asm_string="cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        constraints="l,r,r,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def ld_acquire_s32(gmem_ptr, *, loc=None, ip=None) -> Int32:
    """``ld.acquire.gpu.global.b32``: a semaphore read that orders later reads after the
    writes the releasing thread made before its release (`red_release_add_s32`)."""
    p = llvm.ptrtoint(cutlass.Int64.mlir_type, gmem_ptr, loc=loc, ip=ip)
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [p], "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
        has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def ld_pair_s32(gmem_ptr, *, loc=None, ip=None):
    """``ld.global.nc.b64``: two adjacent int32 of read-only global memory (8-byte aligned),
    e.g. an interval's (start, length), in one load. Returns (first, second)."""
    p = llvm.ptrtoint(cutlass.Int64.mlir_type, gmem_ptr, loc=loc, ip=ip)
    v = cutlass.Int64(llvm.inline_asm(
        cutlass.Int64.mlir_type, [p], "ld.global.nc.b64 $0, [$1];", "=l,l",
        has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
    return Int32(v), Int32(v >> 32)


@dsl_user_op
def red_release_add_s32(gmem_ptr, value: int, *, loc=None, ip=None) -> None:
    """``red.release.gpu.global.add.s32``: bump a semaphore after this thread's earlier
    writes (and the bulk operations it waited for) are visible GPU-wide."""
    p = llvm.ptrtoint(cutlass.Int64.mlir_type, gmem_ptr, loc=loc, ip=ip)
    llvm.inline_asm(None, [p, Int32(value).ir_value(loc=loc, ip=ip)],
                    "red.release.gpu.global.add.s32 [$0], $1;", "l,r",
                    has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def red_add_v4_f32(gmem_ptr, a, b, c, d, *, loc=None, ip=None) -> None:
    """``red.global.add.v4.f32``: add 4 float32 onto 16-byte-aligned global memory (SM90's
    vector reduction; relaxed, no result)."""
    p = llvm.ptrtoint(cutlass.Int64.mlir_type, gmem_ptr, loc=loc, ip=ip)
    llvm.inline_asm(None, [p] + [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
                    "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f",
                    has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    """``nanosleep.u32``: back off inside a spin wait (frees issue slots for the other warps)."""
    llvm.inline_asm(None, [Int32(ns).ir_value(loc=loc, ip=ip)], "nanosleep.u32 $0;", "r",
                    has_side_effects=True, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def exp2_fma(x, *, loc=None, ip=None) -> cutlass.Float32:
    """2^x in float32 without MUFU.EX2: Cody-Waite range reduction x = j + f (j = floor x,
    f in [0, 1)), a cubic for 2^f (3 FFMA) and 2^j built from j's bits: 10 instructions on
    the FMA / ALU pipes instead of one on the MUFU pipe (16 lanes per SM and clock).

    Relative error <= 8.6e-5 for x in [-126, 128) (the MUFU's ``ex2.approx`` ~2^-22;
    bf16 / fp16 keep 2^-8 / 2^-11). x < -126 gives exactly 0.0 (-inf included: a masked
    score's P stays 0, as ``ex2.approx.ftz`` flushes there too), x >= 128 and +inf give
    +inf, NaN gives NaN; never a denormal. The PTX and its constants: ``exp2_fma.py``;
    its numpy model, bit for bit: ``exp2_fma_reference`` in tests/test_exp2_emulation.py."""
    return _f32_asm(EXP2_FMA_PTX, x, loc, ip)


@dsl_user_op
def rcp_fma(y, *, loc=None, ip=None) -> cutlass.Float32:
    """1 / y in float32 without MUFU.RCP, for y >= 1 (the soft cap's e + 1): a bit-trick
    seed and three Newton steps on the FMA pipe, within 1 ulp (``rcp.approx``'s accuracy);
    y past 2^125 (+inf included) is taken as 2^125, NaN gives NaN. The PTX and its
    constants: ``exp2_fma.py``; its numpy model: ``rcp_fma_reference`` in
    tests/test_exp2_emulation.py."""
    return _f32_asm(RCP_FMA_PTX, y, loc, ip)


def _f32_asm(ptx: str, x, loc, ip) -> cutlass.Float32:
    """One float32 in, one out, through a pure inline-PTX block ($1 -> $0)."""
    return cutlass.Float32(llvm.inline_asm(
        cutlass.Float32.mlir_type, [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], ptx,
        "=f,f", has_side_effects=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def _tree(values: list, op):
    """Reduce a Python list of DSL values pairwise (log-depth dependency chain)."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _rows_view(acc: cute.Tensor) -> cute.Tensor:
    """A wgmma accumulator ((2, 2, V), M, N) seen as (rows, cols) of this thread.

    In an SM90 accumulator fragment mode 0 is (column pair, row +8, column group of 8);
    softmax wants rows first, so regroup as ((row +8, M), (column pair, group, N)).
    """
    flat = cute.make_layout(acc.layout.shape)
    shape = (
        (flat.shape[0][1], flat.shape[1]),
        (flat.shape[0][0], flat.shape[0][2], flat.shape[2]),
    )
    stride = (
        (flat.stride[0][1], flat.stride[1]),
        (flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))


def _as_a_operand(acc: cute.Tensor) -> cute.Tensor:
    """An accumulator ((2, 2, V), M, N) regrouped as a register A operand ((2, 2, 2), M, (V/2, N)).

    The k=16 slice of a bf16 wgmma A fragment is two column groups of 8, so pairs of
    accumulator column groups form one A k-block; no data moves, only the view.
    """
    split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    layout = cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
            split.shape[1],
            (split.shape[0][2][1], split.shape[2]),
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
            split.stride[1],
            (split.stride[0][2][1], split.stride[2]),
        ),
    )
    return cute.make_tensor(acc.iterator, layout)


@cute.jit
def issue_wgmma(tiled_mma, acc, tA, tB, zero_init: cutlass.Constexpr[bool],
                first_kb: cutlass.Constexpr[int] = 0, num_kb: cutlass.Constexpr[int] = 0):
    """Issue one warpgroup GEMM and commit it; does not wait. Over all k-blocks, or with
    ``num_kb`` > 0 over k-blocks ``first_kb .. first_kb + num_kb - 1`` only (a GEMM issued
    in pieces as its A operand's registers are written: ``BackwardConfig.dv_split``)."""
    warpgroup.fence()
    # A fresh atom: its ACCUMULATE field is mutated per k-block below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    count = num_kb if const_expr(num_kb > 0) else cute.size(tA.shape[2])
    for i in cutlass.range_constexpr(count):
        kb = first_kb + i
        cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def tile_bits(words: cute.Tensor, tile: Int32) -> Uint32:
    """The 2 state bits of tile `tile` in a row (or column) of packed tile words: bit 0
    compute, bit 1 masked (16 tiles per uint32 word)."""
    word = words[tile // 16]
    return (word >> Uint32(2 * (tile % 16))) & Uint32(3)


@cute.jit
def build_tile_list(gTiles: cute.Tensor, n_tiles: Int32, first_tile: Int32, chunk: cutlass.Constexpr[int],
                    sList: cute.Tensor, sCount: cute.Tensor, buf: Int32, early=None):
    """One warp: the visited tiles of [first_tile, first_tile + chunk) of a row (or column)
    of packed tile words, in order, as tile | masked << 16 into sList[buf * chunk ...], and
    their count into sCount[buf]. Each lane takes one 16-tile word; a warp prefix sum of
    the words' compute-bit counts places them. (The compact work list of both kernels.)
    ``early`` = (use, raw): when ``use``, the first pass takes the lane's word from ``raw``
    (``list_first_word``, loaded earlier by the kernel) instead of loading it."""
    lane = cute.arch.lane_idx()
    end = cutlass.min(first_tile + chunk, n_tiles)
    w_end = cute.ceil_div(end, 16)
    base = Int32(0)
    for w0 in cutlass.range(first_tile // 16, w_end, 32, unroll=1):
        w = w0 + lane
        word = Uint32(0)
        if const_expr(early is None):
            if w < w_end:
                word = gTiles[w]
                if (w + 1) * 16 > end:      # the last word: no tile at or past `end`
                    word = word & ((Uint32(1) << Uint32(2 * (end - w * 16))) - Uint32(1))
        else:
            use, raw = early
            if w < w_end:
                if use & (w0 == first_tile // 16):
                    word = raw
                else:
                    word = gTiles[w]
                if (w + 1) * 16 > end:
                    word = word & ((Uint32(1) << Uint32(2 * (end - w * 16))) - Uint32(1))
        compute = word & Uint32(0x55555555)
        cnt = Int32(cute.arch.popc(compute))
        incl = cnt
        for off in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(incl, 1 << off)
            if lane >= (1 << off):
                incl = incl + other
        pos = (buf * chunk) + base + incl - cnt
        for t in cutlass.range_constexpr(16):
            if (word >> Uint32(2 * t)) & Uint32(1) != Uint32(0):
                masked = Int32((word >> Uint32(2 * t + 1)) & Uint32(1))
                sList[pos] = (w * 16 + t) | (masked << Int32(16))
                pos = pos + 1
        base = base + cute.arch.shuffle_sync(incl, 31)
    if lane == 0:
        sCount[buf] = base
    cute.arch.sync_warp()


@cute.jit
def list_first_word(gTiles: cute.Tensor, n_tiles: Int32, chunk: cutlass.Constexpr[int]):
    """This lane's tile word of the first pass of a row's first list chunk, as
    ``build_tile_list(..., early=(use, raw))`` takes it (0 past the chunk's words)."""
    w = cute.arch.lane_idx()
    raw = Uint32(0)
    if w < cute.ceil_div(cutlass.min(Int32(chunk), n_tiles), 16):
        raw = gTiles[w]
    return raw


@cute.jit
def word_before(raw: Uint32, w: Int32, end: Int32) -> Uint32:
    """Tile word ``w`` (tiles 16 w .. 16 w + 15, 2 state bits each) with no tile at or past
    ``end``: the word itself, its low part in the word holding ``end``, 0 past it."""
    word = raw
    if (w + 1) * 16 > end:
        word = Uint32(0)
        if w * 16 < end:
            word = raw & ((Uint32(1) << Uint32(2 * (end - w * 16))) - Uint32(1))
    return word


@cute.jit
def first_listed_tile(raw: Uint32, n_tiles: Int32, chunk: cutlass.Constexpr[int]):
    """The first entry's tile of the list ``build_tile_list`` builds from a row's first chunk
    [0, min(chunk, n_tiles)), from the lanes' words of it (``list_first_word``, lane w
    holding word w), without building the list: the lowest lane whose word has a compute
    bit in the chunk (one ballot), then that word's lowest compute bit. -1 when the chunk
    has no visited tile (warp-uniform)."""
    lane = cute.arch.lane_idx()
    compute = word_before(raw, lane, cutlass.min(Int32(chunk), n_tiles)) & Uint32(0x55555555)
    lanes = Uint32(cute.arch.vote_ballot_sync(compute != Uint32(0)))
    tile = Int32(-1)
    if lanes != Uint32(0):
        src = Int32(cute.arch.clz(cute.arch.brev(lanes)))
        word = cute.arch.shuffle_sync(compute, src)
        tile = src * 16 + (Int32(cute.arch.clz(cute.arch.brev(word))) >> Int32(1))
    return tile


@cute.jit
def select_by_words(rows: cute.Tensor, r: int, word0: Uint32, word1: Uint32, groups: int, fill: float):
    """Row ``r`` of an SM90 accumulator (``_rows_view``) kept where its column-group bit is
    set, ``fill`` elsewhere: column 2 g + u tests bit g of word u. Each word's bits are
    tested in order, one word after the other (the elements are independent), in the form
    ptxas turns into R2P (8 predicates an instruction), not a LOP3 per element."""
    for u in cutlass.range_constexpr(2):
        word = word0 if const_expr(u == 0) else word1
        for g in cutlass.range_constexpr(groups):
            keep = Boolean(word & (Uint32(1) << g))
            rows[r, 2 * g + u] = rows[r, 2 * g + u] if keep else cutlass.Float32(fill)


@cute.jit
def fold_periodic_slots(words: cute.Tensor, pred_slots: list, periodic: tuple, slot_at):
    """``residual_periodic``: each predicate slot m (word pair 2 (1 + i) for its index i in
    ``pred_slots``) that ``periodic`` marks takes one value per column class u (a thread's
    columns of a row are base + 8 g + u), ``slot_at(m, u)``; it gates the slot's words, which
    join the plain pair (words[0], words[1]). Returns the slots left for per-element tests."""
    for i, m in enumerate(pred_slots):
        if const_expr(periodic[m]):
            for u in cutlass.range_constexpr(2):
                gate = Uint32(0xFFFFFFFF) if slot_at(m, u) else Uint32(0)
                words[u] = words[u] | (words[2 * (1 + i) + u] & gate)
    return [m for m in pred_slots if not periodic[m]]


RUN_CHUNK = 512     # build_tile_runs: key tiles per chunk, one 16-tile word per lane


@cute.jit
def run_chunk_word(gTiles: cute.Tensor, n_tiles: Int32, first_tile: Int32):
    """This lane's tile word of the chunk [first_tile, first_tile + RUN_CHUNK) of a row, as
    stored (0 past the chunk's last word): what ``build_tile_runs`` takes. A load of its
    own, so a kernel can issue it first thing (its latency under the kernel's prologue)."""
    w = first_tile // 16 + cute.arch.lane_idx()
    raw = Uint32(0)
    if w * 16 < cutlass.min(first_tile + RUN_CHUNK, n_tiles):
        raw = gTiles[w]
    return raw


@cute.jit
def build_tile_runs(raw: Uint32, n_tiles: Int32, first_tile: Int32, sRuns: cute.Tensor,
                    sCount: cute.Tensor, ragged_tile: Int32):
    """One warp: the visited tiles of the chunk [first_tile, first_tile + RUN_CHUNK) of a row
    of packed tile words as runs, maximal stretches of consecutive visited tiles of one kind
    (all masked or all full), in order: run r is tiles [sRuns[2 r] & 0xFFFF, sRuns[2 r + 1]),
    masked when sRuns[2 r] >> 16 is 1; the run count goes to sCount[0]. ``raw`` is the
    lane's word (``run_chunk_word``, which a kernel can load first thing: ForwardKey.runs_early).
    ``ragged_tile`` (the row's last tile when Nk is not a
    multiple of the tile; past the row otherwise) counts as masked, so a run's kind is all
    its consumer needs. A chunk holds at most RUN_CHUNK runs: sRuns needs 2 * RUN_CHUNK
    entries. A tile starts (ends) a run where its kind differs from the tile's before
    (after) it, the neighbour words' kinds coming by shuffles; two warp prefix sums place
    the starts and the ends (the k-th end closes the k-th run), and each lane visits only
    its set bits (causal: two runs a row, so most lanes none)."""
    lane = cute.arch.lane_idx()
    w = first_tile // 16 + lane
    word = _run_kinds(word_before(raw, w, cutlass.min(first_tile + RUN_CHUNK, n_tiles)), w, ragged_tile)
    before = cute.arch.shuffle_sync_up(word, 1)
    after = cute.arch.shuffle_sync_down(word, 1)
    if lane == 0:
        before = Uint32(0)          # the chunk starts a run
    if lane == 31:
        after = Uint32(0)           # and ends one
    starts, ends, n_s, n_e, incl_s, incl_e = _run_edges(word, before, after)
    pos = incl_s - n_s
    while starts != Uint32(0):
        b = Int32(cute.arch.clz(cute.arch.brev(starts)))       # 2 t: the lowest start
        masked = Int32((word >> Uint32(b + 1)) & Uint32(1))
        sRuns[2 * pos] = (w * 16 + (b >> Int32(1))) | (masked << Int32(16))
        pos = pos + 1
        starts = starts & (starts - Uint32(1))
    pos = incl_e - n_e
    while ends != Uint32(0):
        b = Int32(cute.arch.clz(cute.arch.brev(ends)))
        sRuns[2 * pos + 1] = w * 16 + (b >> Int32(1)) + 1
        pos = pos + 1
        ends = ends & (ends - Uint32(1))
    if lane == 31:
        sCount[0] = incl_s
    cute.arch.sync_warp()


@cute.jit
def _run_kinds(word: Uint32, w: Int32, ragged_tile: Int32):
    """Tile word ``w`` (tile t: visited bit 2 t, masked bit 2 t + 1) with a masked bit kept
    only on a visited tile and the ragged tile, if in the word, masked: its 2-bit kinds."""
    vis = word & Uint32(0x55555555)
    word = (word & (vis << Uint32(1))) | vis
    if (ragged_tile >= w * 16) & (ragged_tile < w * 16 + 16):
        sh = Uint32(2 * (ragged_tile - w * 16))
        word = word | (((word >> sh) & Uint32(1)) << (sh + Uint32(1)))
    return word


@cute.jit
def _run_edges(word: Uint32, before: Uint32, after: Uint32):
    """(starts, ends, their counts, the counts' inclusive warp prefix sums) of a lane's
    kinds word: a visited tile starts (ends) a run where its kind differs from the tile's
    before (after) it, the neighbour words' kinds given (one bit per tile, at 2 t)."""
    lane = cute.arch.lane_idx()
    vis = word & Uint32(0x55555555)
    d_prev = word ^ ((word << Uint32(2)) | (before >> Uint32(30)))
    d_next = word ^ ((word >> Uint32(2)) | (after << Uint32(30)))
    starts = vis & (d_prev | (d_prev >> Uint32(1)))
    ends = vis & (d_next | (d_next >> Uint32(1)))
    n_s = Int32(cute.arch.popc(starts))
    n_e = Int32(cute.arch.popc(ends))
    incl_s = n_s
    incl_e = n_e
    for off in cutlass.range_constexpr(5):
        other_s = cute.arch.shuffle_sync_up(incl_s, 1 << off)
        other_e = cute.arch.shuffle_sync_up(incl_e, 1 << off)
        if lane >= (1 << off):
            incl_s = incl_s + other_s
            incl_e = incl_e + other_e
    return starts, ends, n_s, n_e, incl_s, incl_e


class WarpSpecializedSm90:
    """What the forward and backward kernels share: one producer warpgroup (a single
    warp issues TMA loads) and `num_consumer_wgs` consumer warpgroups, FA3's register
    split between them, and the host/device helpers for TMA tiles and pipelines."""

    num_consumer_wgs = 2
    threads_per_wg = 128
    num_threads = threads_per_wg * (1 + num_consumer_wgs)
    # The producer keeps few registers so the consumers can hold their tiles.
    producer_regs = 24
    consumer_regs = 240

    @staticmethod
    def tma_load_atom(tensor, smem_layout, tile):
        """(atom, TMA tensor) loading `tile` of `tensor` into one stage of `smem_layout`."""
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), tensor, cute.slice_(smem_layout, (None, None, 0)), tile)

    def stage_bytes(self, smem_layout) -> int:
        """Bytes of one stage of `smem_layout` (the transaction count of its TMA load)."""
        return cute.size_in_bytes(self.dtype, cute.slice_(smem_layout, (None, None, 0)))

    def tma_pipeline(self, mbarriers, num_stages: int, tx_count: int):
        """A TMA pipeline: one producer thread, consumers releasing once per warp (lane 0
        of each consumer warp)."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=mbarriers.data_ptr(), num_stages=num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_consumer_wgs * self.threads_per_wg // 32),
            tx_count=tx_count, defer_sync=True,
        )


def tma_tiles(atom, smem, gmem, tile_rank: int = 2):
    """(shared, global) partitions of a TMA copy between tiles whose first `tile_rank`
    modes are the tile (the rest index stages / tiles): no multicast."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, tile_rank),
                                 cute.group_modes(gmem, 0, tile_rank))


def smem_tensor(storage_range, layout, modes=None):
    """A shared buffer as a tensor of a swizzled (composed) layout; `modes` permutes the
    outer modes (e.g. [1, 0, 2]: a K-major tile seen as the MN-major operand of the
    transposed product; the swizzle acts on offsets, so only the outer layout moves)."""
    outer = layout.outer if modes is None else cute.select(layout.outer, mode=modes)
    return storage_range.get_tensor(outer, swizzle=layout.inner)
