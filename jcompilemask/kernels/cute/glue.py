"""The CuTe backward's glue kernels: what ``cute_backward`` hands ``FlashBackwardSm90``
besides Q, K, V and dO (``BackwardPrep``, one pass over O and dO), and dQ made from the
kernel's float32 accumulator (``BackwardPost``). Both are opt-in
(``$JCOMPILEMASK_CUTE_BWD_PREP``, ``$JCOMPILEMASK_CUTE_BWD_POST``); the default is XLA's
passes, which give the same values (``api.backward_stats``, ``api.backward_dq``).

Per (query tile, head, batch) one ``BackwardPrep`` CTA writes

- ``delta`` [B, Hq, Tq * block_q] float32: rowsum(dO * O) less the lse cotangent where the
  row sees a key (``attention.xla.softmax_delta``), 0 past Nq;
- ``lse2`` [B, Hq, Tq * block_q] float32: lse / ln 2 (the kernels' exp2 domain), +inf where
  lse is -inf (a row that sees nothing: P = 0) and past Nq;
- the tile's slot of the dQ accumulator [B, Hq, Tq, block_q * D] float32, zeroed (the
  backward reduce-adds into it).

XLA's passes for these took, on the H200 (dilated window 8K, ``benchmarks/kernel_times.py``,
run 2026-12-06T09:38:26Z), 128.2 us (delta's reduction), 158.3 us (the accumulator's zero
fill, 3.4 TB/s) and 3.5 us (lse2's pad); dQ's conversion 199.1 us (4.0 TB/s) against
FA4's postprocess kernel's 187.0. On an H100 the fused preprocess made that step's backward
1.1% slower (session 41): there XLA's passes already run at the card's bandwidth.

Each thread moves 16-byte vectors (``threads_per_row`` lanes of a warp per row; rows summed
by butterflies). These sources are kept out of ``api._package_fingerprint`` (the attention
kernels' disk-cache key) and have their own (``api._glue_fingerprint``), so an edit here
recompiles only these small kernels.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.memory as cutlass_memory
from cutlass import Float32, const_expr

LOG2_E = 1.0 / math.log(2.0)


def threads_per_row(head_dim_v: int, elem_bits: int = 16, num_threads: int = 256) -> int:
    """Lanes that share one row of O / dO (or dQ), each moving 16-byte vectors: the largest
    power of two up to 16 that divides the row's vectors (a Dv 256 row: 16 lanes of two
    vectors each; D 192: 8 lanes of three).

    >>> [threads_per_row(d) for d in (64, 128, 192, 256)]
    [8, 16, 8, 16]
    """
    vec = 128 // elem_bits
    if head_dim_v % vec:
        raise ValueError(f"the backward's glue kernels move rows in {vec}-element vectors: "
                         f"head dim {head_dim_v} must be a multiple of {vec}")
    return min(math.gcd(head_dim_v // vec, 16), num_threads)


class BackwardPrep:
    """delta, lse2 and the zeroed dQ accumulator of the CuTe backward (module docstring).

    ``with_dlse``: the lse has a cotangent (its operand ``mdLSE``); without it the kernel never
    reads ``mdLSE`` (the caller passes lse there). ``zero_only``: the accumulator's zeros alone
    (lse2 and delta then come from XLA; their operands are still passed and left unwritten).
    Grid (Tq, Hq, B) of ``num_threads`` threads.
    """

    def __init__(self, dtype, head_dim: int, head_dim_v: int, block_q: int, with_dlse: bool,
                 num_threads: int = 256, zero_only: bool = False):
        self.zero_only = zero_only
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.block_q = block_q
        self.with_dlse = with_dlse
        self.num_threads = num_threads
        self.vec = 128 // dtype.width
        self.tpr = threads_per_row(head_dim_v, dtype.width, num_threads)
        self.rows_per_pass = num_threads // self.tpr
        if block_q % self.rows_per_pass or block_q > num_threads:
            raise ValueError(f"block_q={block_q} must be a multiple of {self.rows_per_pass} "
                             f"and at most {num_threads}")
        if (block_q * head_dim) % (4 * num_threads):
            raise ValueError(f"the dQ slot ({block_q} x {head_dim} floats) must split into "
                             f"16-byte stores over {num_threads} threads")

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mAcc: cute.Tensor, stream):
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                   num_bits_per_copy=128)
        copy_o = cute.make_tiled_copy_tv(
            atom, cute.make_layout((self.rows_per_pass, self.tpr), stride=(self.tpr, 1)),
            cute.make_layout((1, self.vec)))
        atom_acc = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                       num_bits_per_copy=128)
        copy_acc = cute.make_tiled_copy_tv(atom_acc, cute.make_layout(self.num_threads),
                                           cute.make_layout(4))
        self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mDelta, mAcc, copy_o, copy_acc).launch(
            grid=(mAcc.shape[2], mO.shape[2], mO.shape[0]), block=(self.num_threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor,
               mLSE2: cute.Tensor, mDelta: cute.Tensor, mAcc: cute.Tensor,
               copy_o: cute.TiledCopy, copy_acc: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        q_tile, head, batch = cute.arch.block_idx()
        bq = self.block_q
        first = q_tile * bq
        limit = mO.shape[1] - first            # rows of this tile inside Nq
        # O and dO: every row's vectors issued before any use.
        thr = copy_o.get_slice(tidx)
        gO = cute.local_tile(mO[batch, None, head, None], (bq, self.head_dim_v), (q_tile, 0))
        gdO = cute.local_tile(mdO[batch, None, head, None], (bq, self.head_dim_v), (q_tile, 0))
        tOg = thr.partition_S(gO)
        tdOg = thr.partition_S(gdO)
        tc = thr.partition_S(cute.make_identity_tensor((bq, self.head_dim_v)))
        rO = cute.make_fragment_like(tOg)
        rdO = cute.make_fragment_like(tdOg)
        num_m = cute.size(tOg, mode=[1])
        num_k = cute.size(tOg, mode=[2])
        if const_expr(not self.zero_only):
            for m in cutlass.range_constexpr(num_m):
                if tc[0, m, 0][0] < limit:
                    cute.copy(copy_o, tOg[None, m, None], rO[None, m, None])
                    cute.copy(copy_o, tdOg[None, m, None], rdO[None, m, None])
        # The slot's zeros, while the loads are in flight.
        thr_acc = copy_acc.get_slice(tidx)
        tAg = thr_acc.partition_D(mAcc[batch, head, q_tile, None])
        zeros = cute.make_fragment_like(tAg)
        zeros.fill(0.0)
        cute.copy(copy_acc, zeros, tAg)
        if const_expr(not self.zero_only):
            # lse2: one row per thread.
            if tidx < bq:
                lse2 = Float32.inf
                if tidx < limit:
                    lse = mLSE[batch, head, first + tidx]
                    if lse != -Float32.inf:
                        lse2 = lse * Float32(LOG2_E)
                mLSE2[batch, head, first + tidx] = lse2
            # delta: a thread's part of each of its rows, then the row's lanes summed.
            fo = rO.load().to(Float32)
            fdo = rdO.load().to(Float32)
            prod = cute.make_fragment_like(rO, Float32)
            prod.store(fo * fdo)
            lane_col = tidx % self.tpr
            for m in cutlass.range_constexpr(num_m):
                s = Float32(0.0)
                for k in cutlass.range_constexpr(num_k):
                    for v in cutlass.range_constexpr(self.vec):
                        s = s + prod[v, m, k]
                off = self.tpr // 2
                while const_expr(off >= 1):
                    s = s + cute.arch.shuffle_sync_bfly(s, offset=off)
                    off //= 2
                row = tc[0, m, 0][0]
                if lane_col == 0:
                    delta = Float32(0.0)
                    if row < limit:
                        delta = s
                        if const_expr(self.with_dlse):
                            if mLSE[batch, head, first + row] != -Float32.inf:
                                delta = s - mdLSE[batch, head, first + row]
                    mDelta[batch, head, first + row] = delta


def compile_backward_prep(dtype_name: str, head_dim: int, head_dim_v: int, block_q: int,
                          with_dlse: bool, options: str, zero_only: bool = False):
    """The TVM-FFI function of one :class:`BackwardPrep` (no GPU needed with
    CUTE_DSL_ARCH=sm_90a). Operands: out, do [B, Nq, Hq, Dv], lse, dlse [B, Hq, Nq]
    (lse again where ``with_dlse`` is off); results: lse2, delta [B, Hq, Tq * block_q] and
    the dQ accumulator [B, Hq, Tq, block_q * head_dim]."""
    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype_name]
    sym, sym64 = cute.sym_int, cute.sym_int64
    b, nq, hq, nq_pad, tq = sym(), sym(), sym(), sym(), sym()
    vec = 128 // dtype.width

    def bshd():
        return cute.runtime.make_fake_tensor(
            dtype, (b, nq, hq, head_dim_v),
            stride=(sym64(divisibility=vec), sym64(divisibility=vec), head_dim_v, 1),
            assumed_align=16)

    def rows(n):
        return cute.runtime.make_fake_tensor(Float32, (b, hq, n), stride=(sym64(), sym64(), 1),
                                             assumed_align=4)

    tile = block_q * head_dim
    acc = cute.runtime.make_fake_tensor(
        Float32, (b, hq, tq, tile), stride=(sym64(divisibility=tile), sym64(divisibility=tile),
                                            tile, 1), assumed_align=16)
    kernel = BackwardPrep(dtype, head_dim, head_dim_v, block_q, with_dlse, zero_only=zero_only)
    return cute.compile(kernel, bshd(), bshd(), rows(nq), rows(nq), rows(nq_pad), rows(nq_pad),
                        acc, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=options)


def slot_position(f, groups: int, dq_wgs: int, splits_queries: bool, head_dim: int):
    """(row, column) in the query tile of the first element of float4 number ``f`` of a dQ
    slot; its four elements (h, p) sit at (row + 8 h, column + p). ``f`` may be a Python or
    numpy integer (the CPU check of this order against ``api.dq_fragment_unpermute``) or the
    kernel's Int32. ``groups``: 8-column float4 chunks per warpgroup.

    >>> slot_position(0, 16, 2, False, 128), slot_position(5, 16, 2, False, 128)
    ((0, 0), (1, 2))
    >>> slot_position(128 * 16, 16, 2, False, 128), slot_position(128 * 8, 8, 2, True, 64)
    ((0, 64), (64, 0))
    """
    lr = f % 4
    lq = (f // 4) % 8
    warp = (f // 32) % 4
    g = (f // 128) % groups
    w = f // (128 * groups)
    row = 16 * warp + lq
    col = 8 * g + 2 * lr
    if splits_queries:
        return row + 64 * w, col
    return row, col + w * (head_dim // dq_wgs)


class BackwardPost:
    """dQ [B, Nq, Hq, D] in the input dtype from the backward's float32 accumulator
    [B, Hq, Tq, block_q * D]: each query tile's slot un-permuted (``api.dq_fragment_unpermute``'s
    order: per dQ warpgroup w, float4 chunk g, thread 32 warp + 4 lq + lr, then (h, p)),
    times ``scale`` (``api.backward_grad_scale``) and rounded, as XLA's fused pass does it:
    a float32 product, then one round to nearest even.

    One CTA per (query tile, head, batch): the slot read in 16-byte vectors (contiguous), the
    scaled values written into a (block_q, D) shared tile padded by 16 bytes a row (a warp's
    eight rows then fall in distinct banks), and the tile's rows stored to dQ in 16-byte
    vectors, rows past Nq left out. ``dq_wgs`` / ``splits_queries``: ``api.dq_warpgroups`` and
    ``api.dq_splits_queries`` of the backward config (the slot's order); not the
    ``dq_blocked`` order.
    """

    def __init__(self, dtype, head_dim: int, block_q: int, dq_wgs: int, splits_queries: bool,
                 scale: float, num_threads: int = 256):
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_q = block_q
        self.dq_wgs = dq_wgs
        self.splits_queries = splits_queries
        self.scale = scale
        self.num_threads = num_threads
        self.vec = 128 // dtype.width
        self.tpr = threads_per_row(head_dim, dtype.width, num_threads)
        self.rows_per_pass = num_threads // self.tpr
        # float4 chunks of 8 columns per warpgroup (all of D when the warpgroups split queries)
        self.groups = head_dim // 8 if splits_queries else head_dim // dq_wgs // 8
        if block_q % self.rows_per_pass or (block_q * head_dim) % (4 * num_threads):
            raise ValueError(f"BackwardPost: block_q={block_q}, D={head_dim} do not split over "
                             f"{num_threads} threads")
        if block_q != (64 * dq_wgs if splits_queries else 64) or \
                (not splits_queries and head_dim % (8 * dq_wgs)):
            raise ValueError(f"BackwardPost: no dQ slot order for block_q={block_q}, D={head_dim}, "
                             f"{dq_wgs} warpgroups, splits_queries={splits_queries}")

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, stream):
        atom_acc = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                       num_bits_per_copy=128)
        copy_acc = cute.make_tiled_copy_tv(atom_acc, cute.make_layout(self.num_threads),
                                           cute.make_layout(4))
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                   num_bits_per_copy=128)
        copy_row = cute.make_tiled_copy_tv(
            atom, cute.make_layout((self.rows_per_pass, self.tpr), stride=(self.tpr, 1)),
            cute.make_layout((1, self.vec)))
        self.kernel(mAcc, mdQ, copy_acc, copy_row).launch(
            grid=(mAcc.shape[2], mAcc.shape[1], mAcc.shape[0]), block=(self.num_threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, copy_acc: cute.TiledCopy,
               copy_row: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        q_tile, head, batch = cute.arch.block_idx()
        bq, d = self.block_q, self.head_dim
        limit = mdQ.shape[1] - q_tile * bq
        allocator = cutlass_memory.SmemAllocator()
        sQ = allocator.allocate_tensor(self.dtype, cute.make_layout((bq, d), stride=(d + 8, 1)), 16)
        # The slot, contiguous: thread t holds float4 number i * threads + t at fragment (:, i).
        thr_acc = copy_acc.get_slice(tidx)
        tAg = thr_acc.partition_S(mAcc[batch, head, q_tile, None])
        vals = cute.make_fragment_like(tAg)
        cute.copy(copy_acc, tAg, vals)
        scale = Float32(self.scale)
        for i in cutlass.range_constexpr(cute.size(vals, mode=[1])):
            # the float4's index in the slot, and where its first element lands
            row, col = slot_position(i * self.num_threads + tidx, self.groups, self.dq_wgs,
                                     self.splits_queries, d)
            for hh in cutlass.range_constexpr(2):
                for pp in cutlass.range_constexpr(2):
                    sQ[row + 8 * hh, col + pp] = (vals[2 * hh + pp, i] * scale).to(self.dtype)
        cute.arch.sync_threads()
        thr = copy_row.get_slice(tidx)
        gdQ = cute.local_tile(mdQ[batch, None, head, None], (bq, d), (q_tile, 0))
        tS = thr.partition_S(sQ)
        tG = thr.partition_D(gdQ)
        tc = thr.partition_S(cute.make_identity_tensor((bq, d)))
        for m in cutlass.range_constexpr(cute.size(tG, mode=[1])):
            if tc[0, m, 0][0] < limit:
                cute.copy(copy_row, tS[None, m, None], tG[None, m, None])


def compile_backward_post(dtype_name: str, head_dim: int, block_q: int, dq_wgs: int,
                          splits_queries: bool, scale: float, options: str):
    """The TVM-FFI function of one :class:`BackwardPost`. Operand: the accumulator
    [B, Hq, Tq, block_q * D] float32; result: dQ [B, Nq, Hq, D]."""
    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype_name]
    sym, sym64 = cute.sym_int, cute.sym_int64
    b, nq, hq, tq = sym(), sym(), sym(), sym()
    vec = 128 // dtype.width
    tile = block_q * head_dim
    acc = cute.runtime.make_fake_tensor(
        Float32, (b, hq, tq, tile), stride=(sym64(divisibility=tile), sym64(divisibility=tile),
                                            tile, 1), assumed_align=16)
    dq = cute.runtime.make_fake_tensor(
        dtype, (b, nq, hq, head_dim),
        stride=(sym64(divisibility=vec), sym64(divisibility=vec), head_dim, 1), assumed_align=16)
    kernel = BackwardPost(dtype, head_dim, block_q, dq_wgs, splits_queries, scale)
    return cute.compile(kernel, acc, dq, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=options)


def _i32(bits: int):
    """The Int32 constant of a 32-bit pattern (a Python int, masked to 32 bits)."""
    bits &= 0xFFFFFFFF
    return cutlass.Int32(bits - (1 << 32) if bits >= 1 << 31 else bits)


class TransposeWords:
    """A bit matrix's packed rows as its packed columns (``lower.dense_runtime``'s
    ``transpose_words``, the column side of a run-time dense mask): words [BH, Nr, W] int32
    (bit ``c % 32`` of word ``c // 32`` of row r: element (r, c)) -> [BH, Nc, Wq] (bit
    ``r % 32`` of word ``r // 32`` of column c), Wq = ceil(Nr / 32), rows past Nr read as 0.

    One CTA of 256 threads per tile of 256 rows x 8 words (256 columns) of one matrix: each
    thread loads its row's 8 words (a warp's rows are one 32-row block), each warp
    transposes its 8 blocks of 32 x 32 bits by five rounds of butterfly shuffles and masked
    bit swaps (lane c then holds column c's word), the columns' words meet in a shared tile (a row of
    8 words padded to 9: the warps' writes fall in distinct banks), and each column's 8
    consecutive words are stored by 8 consecutive threads. XLA's five rounds of masked
    swaps on whole arrays (the jnp form) took 1.14 ms on an 8K x 8K x 16 mask on an H100
    (session 51), 0.1 TB/s of words.
    """

    rows = 256      # rows (8 blocks of 32) and 8 words (256 columns) per CTA
    words = 8
    num_threads = 256

    @cute.jit
    def __call__(self, mW: cute.Tensor, mC: cute.Tensor, stream):
        self.kernel(mW, mC).launch(
            grid=(cute.ceil_div(mW.shape[2], self.words), cute.ceil_div(mC.shape[2], self.words),
                  mW.shape[0]),
            block=(self.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        word_tile, row_tile, bh = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        n_rows, n_words = mW.shape[1], mW.shape[2]
        n_cols, n_row_words = mC.shape[1], mC.shape[2]
        allocator = cutlass_memory.SmemAllocator()
        sC = allocator.allocate_tensor(
            cutlass.Int32, cute.make_layout((self.rows, self.words), stride=(self.words + 1, 1)),
            16)
        row = row_tile * self.rows + tidx
        w0 = word_tile * self.words
        x = cute.make_rmem_tensor((self.words,), cutlass.Int32)
        x.fill(0)
        if row < n_rows:
            for j in cutlass.range_constexpr(self.words):
                if w0 + j < n_words:
                    x[j] = mW[bh, row, w0 + j]
        # Five rounds of masked swaps across the warp (rows r and r ^ s exchange their
        # bits c and c ^ s for every c with bit s clear): lane c then holds column c's word.
        for j in cutlass.range_constexpr(self.words):
            for s, m in ((16, 0x0000FFFF), (8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333),
                         (1, 0x55555555)):
                y = cute.arch.shuffle_sync_bfly(x[j], offset=s)
                if (lane & s) != 0:     # the upper row: its bits m take the lower's m << s
                    x[j] = (x[j] & _i32(~m)) | ((y >> s) & _i32(m))
                else:                   # the lower row: its bits m << s take the upper's m
                    x[j] = (x[j] & _i32(~(m << s))) | ((y << s) & _i32(m << s))
            # column 32 (w0 + j) + lane's word of row block 8 row_tile + warp
            sC[j * 32 + lane, warp] = x[j]
        cute.arch.sync_threads()
        c0 = word_tile * self.words * 32
        k0 = row_tile * self.words
        for i in cutlass.range_constexpr(self.rows * self.words // self.num_threads):
            f = i * self.num_threads + tidx
            c = f // self.words
            kk = f % self.words
            if c0 + c < n_cols:
                if k0 + kk < n_row_words:
                    mC[bh, c0 + c, k0 + kk] = sC[c, kk]


def compile_transpose_words(options: str):
    """The TVM-FFI function of :class:`TransposeWords` (no GPU needed with
    CUTE_DSL_ARCH=sm_90a). Operand: words [BH, Nr, W] int32 (row-major); result: the
    columns' words [BH, Nc, Wq] int32."""
    sym, sym64 = cute.sym_int, cute.sym_int64
    bh, nr, w, nc, wq = sym(), sym(), sym(), sym(), sym()
    words = cute.runtime.make_fake_tensor(cutlass.Int32, (bh, nr, w), stride=(sym64(), sym64(), 1),
                                          assumed_align=4)
    cols = cute.runtime.make_fake_tensor(cutlass.Int32, (bh, nc, wq), stride=(sym64(), sym64(), 1),
                                         assumed_align=4)
    return cute.compile(TransposeWords(), words, cols,
                        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options=options)
