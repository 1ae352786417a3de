"""SM90 (Hopper) attention backward driven by the Execution Descriptor's column view.

One CTA owns one `block_kv`-key tile of one (batch, KV head) and keeps its K and V in
shared memory for the whole pass. It walks the backward tile states of its key column
(column-major words, `bwd_tiles[b, h, key_tile, :]`) once per query head of its KV
group and visits only the query tiles whose compute bit is set; per visited tile, with
`m` the tile's `block_q` queries and `n` the CTA's keys (everything transposed so that
the keys are the rows of every register tile):

    S^T  = K Q^T                 (wgmma, both operands from shared memory)
    dP^T = V dO^T                (wgmma)
    P^T  = exp2(S^T * scale * log2 e - lse_m * log2 e), zero where masked
    dS^T = P^T * (dP^T - delta_m)                    (delta = rowsum(dO * O) - dlse)
    dV  += P^T dO                (wgmma, P^T from registers, dO's buffer seen transposed)
    dK  += dS^T Q                (wgmma, dS^T from registers)
    dQ_m += dS K                 (dS^T stored to shared memory, wgmma, fp32 atomics
                                  into a dQ accumulator in global memory)

A partial tile (mask bit) — and a ragged last query or key tile — checks each element:
with the column view exact for this sequence (`bwd_exact[b]`), `uint32(i - start) <
uint32(length)` over the key's Kc query intervals, which each thread loads once for its
two keys; otherwise the forward row intervals of each query (the same check, over the
row's K key intervals). dK is scaled by the softmax scale at the end; dQ leaves as the
fp32 accumulator and is scaled and cast by the caller.

Warp specialization: warpgroup 0 is the producer (one warp: TMA loads of K and V once,
Q and dO per visited tile into a `num_stages` ring); warpgroups 1 and 2 are consumers,
each owning 64 of the 128 keys for the S / dP / dK / dV products and half of the head
dims for the dQ product (which needs both halves of dS: a named barrier); at D = 64
the first warpgroup computes dQ alone (see `dq_single_wg`).

Validated on the H200 (tests/gpu/test_cute_backward.py: every built-in mask, random
lowered specs, fully masked rows, ragged lengths, GQA/MQA, D 64 fp16); the cute backend
uses it by default for D 64/128 without soft cap (`backends.cute_backward_reason` says
why not otherwise; JCOMPILEMASK_CUTE_BACKWARD=0 turns it off).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.memory as cutlass_memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Boolean, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .api import DQ_ROW_PAD, dq_tile_offset
from .common import (WarpSpecializedSm90, _as_a_operand, _rows_view, _unsigned_lt,
                     bulk_reduce_add_f32, issue_wgmma, smem_tensor, tile_bits, tma_tiles)

_BARRIER_DS_READY = 1   # both consumer warpgroups wrote their half of dS^T
_BARRIER_DS_FREE = 2    # both finished reading dS for the dQ product
_BARRIER_DQ_READY = 3   # dq_bulk: the dQ tile is in shared memory for the bulk reduce-add
_LOG2_E = math.log2(math.e)


class FlashBackwardSm90(WarpSpecializedSm90):
    """Backward attention over a tile-state descriptor (SM90).

    Inputs of ``__call__`` (layouts of ``jax.nn.dot_product_attention``):
      mQ [B, Nq, Hq, D], mK [B, Nk, Hkv, D], mV [B, Nk, Hkv, D], mdO [B, Nq, Hq, D] (dtype);
      mLSE2 float32 [B, Hq, Nq]: lse * log2(e), +inf for rows that see nothing;
      mDelta float32 [B, Hq, Nq]: rowsum(dO * O) (minus the lse cotangent);
        with ``stats_tma`` both are padded to Nq' = ceil(Nq / block_q) * block_q (lse2 +inf,
        delta 0) and arrive in shared memory by TMA with each Q / dO tile;
      mBwdIntervals int32 [Bm, Hm, Nk, Kc, 2]; mBwdTiles uint32 [Bm, Hm, Tk, W];
      mFwdIntervals int32 [Bm, Hm, Nq, K, 2]; mBwdExact int32 [Bm];
    mdQinit: the zeroed dQ accumulator as an input (XLA aliases it to mdQaccum; unused);
    outputs mdQaccum float32 [B, Nq, Hq, D] (zero on entry; receives dS K, unscaled) —
      with ``dq_bulk`` float32 [B, Hq, Tq, block_q * (D + 8)], one slot per query tile
      in dq_tile_offset order —,
      mdK, mdV [B, Nk, Hkv, D] (dtype).
    """

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        num_intervals: int,
        num_bwd_intervals: int,
        scale: float,
        *,
        block_q: int = 64,
        block_kv: int = 128,
        broadcast_batch: bool = False,
        broadcast_head: bool = False,
        num_stages: int = 2,
        stats_tma: bool = False,
        dq_bulk: bool = False,
    ):
        assert dtype in (cutlass.BFloat16, cutlass.Float16), dtype
        assert block_kv == 64 * self.num_consumer_wgs, "each consumer warpgroup owns 64 keys"
        assert block_q % 16 == 0 and head_dim % 32 == 0
        assert 1 <= num_intervals <= 8 and 0 <= num_bwd_intervals <= 16
        self.dtype = dtype
        self.head_dim = head_dim
        self.num_intervals = num_intervals
        self.num_bwd_intervals = num_bwd_intervals
        self.scale = float(scale)
        self.scale_log2 = float(scale) * _LOG2_E
        self.block_q = block_q
        self.block_kv = block_kv
        self.broadcast_batch = broadcast_batch
        self.broadcast_head = broadcast_head
        self.num_stages = num_stages
        # lse and delta of a query tile: TMA'd into shared memory beside Q / dO (FA3's way)
        # instead of read from global memory by every consumer thread after its S / dP
        # products completed (latency in the critical path, 64-bit addresses in registers).
        self.stats_tma = stats_tma
        # dQ of a tile: written to shared memory (padded rows, dq_tile_offset) and added to a
        # per-tile global accumulator slot with one bulk reduce-add, instead of one
        # red.global.add per element pair from every consumer thread.
        self.dq_bulk = dq_bulk
        # Split the dQ product over the warpgroups by head dim only when each half is a
        # whole 128B-swizzle row (64 elements of 16 bits) of K's buffer.
        self.dq_single_wg = head_dim // self.num_consumer_wgs < 64

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE2: cute.Tensor,
        mDelta: cute.Tensor,
        mBwdIntervals: cute.Tensor,
        mBwdTiles: cute.Tensor,
        mFwdIntervals: cute.Tensor,
        mBwdExact: cute.Tensor,
        mdQinit: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        stream,
    ):
        # mdQinit is the zero-filled input XLA aliases to mdQaccum (the same buffer).
        # (B, N, H, D) -> (N, D, H, B) for the TMA tiles.
        rows_first = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))  # noqa: E731
        mQt, mKt, mVt, mdOt = rows_first(mQ), rows_first(mK), rows_first(mV), rows_first(mdO)
        d, bq, bk = self.head_dim, self.block_q, self.block_kv
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S^T = K Q^T and dP^T = V dO^T: (keys, queries), contraction over D.
        tiled_mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (self.num_consumer_wgs, 1, 1), (64, bq),
        )
        # dV += P^T dO and dK += dS^T Q: (keys, D), contraction over the queries; the
        # left operand comes from registers, dO and Q are their buffers seen transposed.
        tiled_mma_dkv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (self.num_consumer_wgs, 1, 1), (64, d),
            warpgroup.OperandSource.RMEM,
        )
        # dQ = dS K: (queries, D), contraction over the keys; dS (queries-major in shared
        # memory) and K seen transposed; the two warpgroups split D — except at D = 64,
        # where a half would be 32 columns of a 64-column 128B-swizzle row, a start that
        # is not a canonical wgmma layout: there the first warpgroup computes it alone.
        dq_wgs = 1 if self.dq_single_wg else self.num_consumer_wgs
        tiled_mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, dq_wgs, 1), (bq, d // dq_wgs),
        )
        sK_layout = sm90_helpers.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bk, bq, d), self.dtype, 1)
        sQ_layout = sm90_helpers.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (bk, bq, d), self.dtype, self.num_stages)
        sdS_layout = sm90_helpers.make_smem_layout_a(LayoutEnum.COL_MAJOR, (bq, d, bk), self.dtype, 1)
        tma_atom_q, mQ_tma = self.tma_load_atom(mQt, sQ_layout, (bq, d))
        tma_atom_do, mdO_tma = self.tma_load_atom(mdOt, sQ_layout, (bq, d))
        tma_atom_k, mK_tma = self.tma_load_atom(mKt, sK_layout, (bk, d))
        tma_atom_v, mV_tma = self.tma_load_atom(mVt, sK_layout, (bk, d))
        self.bytes_q = self.stage_bytes(sQ_layout)
        self.bytes_k = self.stage_bytes(sK_layout)
        self.bytes_stat = 0
        tma_atom_lse, tma_atom_delta = tma_atom_q, tma_atom_q    # placeholders when unused
        if const_expr(self.stats_tma):
            # (B, H, Nq') -> (Nq', H, B); one TMA box of block_q floats per query tile.
            stats_first = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))  # noqa: E731
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            tma_atom_lse, mLSE2 = cpasync.make_tiled_tma_atom(g2s, stats_first(mLSE2), cute.make_layout(bq), (bq,))
            tma_atom_delta, mDelta = cpasync.make_tiled_tma_atom(g2s, stats_first(mDelta), cute.make_layout(bq), (bq,))
            self.bytes_stat = bq * 4

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, bq * self.num_stages], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, bq * self.num_stages], 128]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, bq * (d + DQ_ROW_PAD) if self.dq_bulk else 4], 128]

        self.shared_storage = SharedStorage
        num_k_tiles = cute.ceil_div(mK.shape[1], bk)
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mdO_tma, mLSE2, mDelta, mBwdIntervals, mBwdTiles,
            mFwdIntervals, mBwdExact, mdQaccum, mdK, mdV,
            tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_lse, tma_atom_delta,
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, sQ_layout, sK_layout, sdS_layout,
            mQ.shape[1], mQ.shape[2],
        ).launch(
            grid=[num_k_tiles, mK.shape[2], mK.shape[0]],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---------------------------------------------------------------- device entry
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE2: cute.Tensor,
        mDelta: cute.Tensor,
        mBwdIntervals: cute.Tensor,
        mBwdTiles: cute.Tensor,
        mFwdIntervals: cute.Tensor,
        mBwdExact: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        tma_atom_do: cute.CopyAtom,
        tma_atom_lse: cute.CopyAtom,
        tma_atom_delta: cute.CopyAtom,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        seqlen_q: Int32,
        num_heads: Int32,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.stats_tma):
                cpasync.prefetch_descriptor(tma_atom_lse)
                cpasync.prefetch_descriptor(tma_atom_delta)

        storage = cutlass_memory.SmemAllocator().allocate(self.shared_storage)
        pipeline_kv = self.tma_pipeline(storage.mbar_kv, 1, 2 * self.bytes_k)   # K and V together
        # With stats_tma the Q (dO) barrier also counts the tile's lse (delta) bytes.
        pipeline_q = self.tma_pipeline(storage.mbar_q, self.num_stages, self.bytes_q + self.bytes_stat)
        pipeline_do = self.tma_pipeline(storage.mbar_do, self.num_stages, self.bytes_q + self.bytes_stat)
        pipeline.pipeline_init_arrive()

        sK = smem_tensor(storage.sK, sK_layout)
        sV = smem_tensor(storage.sV, sK_layout)
        sQ = smem_tensor(storage.sQ, sQ_layout)
        sdO = smem_tensor(storage.sdO, sQ_layout)
        sdS = smem_tensor(storage.sdS, sdS_layout)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.block_q, self.num_stages)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((self.block_q, self.num_stages)))
        sdQ = storage.sdQ.get_tensor(cute.make_layout(
            self.block_q * (self.head_dim + DQ_ROW_PAD) if self.dq_bulk else 4))

        k_tile, head_kv, batch = cute.arch.block_idx()
        group = num_heads // mK.shape[2]
        mask_batch = 0 if const_expr(self.broadcast_batch) else batch
        n_q_tiles = cute.ceil_div(seqlen_q, self.block_q)

        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_atom_q, tma_atom_k, tma_atom_v,
                          tma_atom_do, pipeline_kv, pipeline_q, pipeline_do, mBwdTiles,
                          n_q_tiles, k_tile, head_kv, batch, mask_batch, group,
                          (mLSE2, mDelta, sLSE, sDelta, tma_atom_lse, tma_atom_delta))
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                storage, sQ_layout, sK_layout, sQ, sK, sV, sdO, sdS,
                sLSE if const_expr(self.stats_tma) else mLSE2,
                sDelta if const_expr(self.stats_tma) else mDelta, mBwdIntervals,
                mBwdTiles, mFwdIntervals, mBwdExact, (mdQaccum, sdQ), mdK, mdV, tiled_mma_sdp,
                tiled_mma_dkv, tiled_mma_dq, pipeline_kv, pipeline_q, pipeline_do, n_q_tiles,
                seqlen_q, mK.shape[0], k_tile, head_kv, batch, mask_batch, group,
                tidx - self.threads_per_wg)

    @cute.jit
    def mask_head(self, head):
        return 0 if const_expr(self.broadcast_head) else head

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, mQ, mK, mV, mdO, sQ, sK, sV, sdO, tma_atom_q, tma_atom_k, tma_atom_v,
             tma_atom_do, pipeline_kv, pipeline_q, pipeline_do, mBwdTiles, n_q_tiles, k_tile,
             head_kv, batch, mask_batch, group, stats):
        d, bq, bk = self.head_dim, self.block_q, self.block_kv
        gK = cute.local_tile(mK[None, None, head_kv, batch], (bk, d), (k_tile, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (bk, d), (k_tile, 0))
        tKsK, tKgK = tma_tiles(tma_atom_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_atom_v, sV, gV)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipeline_kv.producer_acquire(kv_state)
        bar = pipeline_kv.producer_get_barrier(kv_state)
        cute.copy(tma_atom_k, tKgK, tKsK[None, 0], tma_bar_ptr=bar)
        cute.copy(tma_atom_v, tVgV, tVsV[None, 0], tma_bar_ptr=bar)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            gTiles = mBwdTiles[mask_batch, self.mask_head(head), k_tile, None]
            gQ = cute.local_tile(mQ[None, None, head, batch], (bq, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch], (bq, d), (None, 0))
            tQsQ, tQgQ = tma_tiles(tma_atom_q, sQ, gQ)
            tdOsdO, tdOgdO = tma_tiles(tma_atom_do, sdO, gdO)
            mLSE2, mDelta, sLSE, sDelta, tma_atom_lse, tma_atom_delta = stats
            tLsL, tLgL, tDsD, tDgD = tQsQ, tQgQ, tdOsdO, tdOgdO     # placeholders when unused
            if const_expr(self.stats_tma):
                gL = cute.local_tile(mLSE2[None, head, batch], (bq,), (None,))
                gD = cute.local_tile(mDelta[None, head, batch], (bq,), (None,))
                tLsL, tLgL = tma_tiles(tma_atom_lse, sLSE, gL, tile_rank=1)
                tDsD, tDgD = tma_tiles(tma_atom_delta, sDelta, gD, tile_rank=1)
            for q_tile in cutlass.range(n_q_tiles, unroll=1):
                if tile_bits(gTiles, q_tile) & Uint32(1) != Uint32(0):
                    pipeline_q.producer_acquire(state)
                    cute.copy(tma_atom_q, tQgQ[None, q_tile], tQsQ[None, state.index],
                              tma_bar_ptr=pipeline_q.producer_get_barrier(state))
                    if const_expr(self.stats_tma):
                        cute.copy(tma_atom_lse, tLgL[None, q_tile], tLsL[None, state.index],
                                  tma_bar_ptr=pipeline_q.producer_get_barrier(state))
                    pipeline_do.producer_acquire(state)
                    cute.copy(tma_atom_do, tdOgdO[None, q_tile], tdOsdO[None, state.index],
                              tma_bar_ptr=pipeline_do.producer_get_barrier(state))
                    if const_expr(self.stats_tma):
                        cute.copy(tma_atom_delta, tDgD[None, q_tile], tDsD[None, state.index],
                                  tma_bar_ptr=pipeline_do.producer_get_barrier(state))
                    state.advance()

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, storage, sQ_layout, sK_layout, sQ, sK, sV, sdO, sdS, mLSE2, mDelta,
                mBwdIntervals, mBwdTiles, mFwdIntervals, mBwdExact, mdQaccum, mdK, mdV,
                tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, pipeline_kv, pipeline_q, pipeline_do,
                n_q_tiles, seqlen_q, seqlen_k, k_tile, head_kv, batch, mask_batch, group, tidx):
        d, bq, bk = self.head_dim, self.block_q, self.block_kv
        wg = tidx // self.threads_per_wg
        wg_slice = cute.make_layout(self.num_consumer_wgs, stride=self.threads_per_wg)
        mma_sdp = tiled_mma_sdp.get_slice(wg_slice(wg))
        mma_dkv = tiled_mma_dkv.get_slice(wg_slice(wg))
        # With a single dQ warpgroup, the second one builds (and never uses) its fragments.
        mma_dq = tiled_mma_dq.get_slice(wg_slice(0) if const_expr(self.dq_single_wg) else wg_slice(wg))
        thr_sdp = tiled_mma_sdp.get_slice(tidx)

        # Operand fragments (shared-memory descriptors) of the five products.
        tSrK = mma_sdp.make_fragment_A(mma_sdp.partition_A(sK))
        tSrV = mma_sdp.make_fragment_A(mma_sdp.partition_A(sV))
        tSrQ = mma_sdp.make_fragment_B(mma_sdp.partition_B(sQ))
        tSrdO = mma_sdp.make_fragment_B(mma_sdp.partition_B(sdO))
        sQt = smem_tensor(storage.sQ, sQ_layout, [1, 0, 2])     # (D, queries, stage)
        sdOt = smem_tensor(storage.sdO, sQ_layout, [1, 0, 2])
        sKt = smem_tensor(storage.sK, sK_layout, [1, 0, 2])     # (D, keys, 1)
        tKVrQt = mma_dkv.make_fragment_B(mma_dkv.partition_B(sQt))
        tKVrdOt = mma_dkv.make_fragment_B(mma_dkv.partition_B(sdOt))
        tQrdS = mma_dq.make_fragment_A(mma_dq.partition_A(sdS))
        tQrKt = mma_dq.make_fragment_B(mma_dq.partition_B(sKt))
        tKVrP = mma_dkv.make_fragment_A(mma_dkv.partition_shape_A((bk, bq)))
        tKVrdS = mma_dkv.make_fragment_A(mma_dkv.partition_shape_A((bk, bq)))

        acc_dK = cute.make_rmem_tensor(mma_dkv.partition_shape_C((bk, d)), Float32)
        acc_dV = cute.make_rmem_tensor(mma_dkv.partition_shape_C((bk, d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # (key, query) coordinates of this thread's elements of an S^T tile: 2 keys (rows).
        tScS = _rows_view(thr_sdp.partition_C(cute.make_identity_tensor((bk, bq))))
        num_rows = cute.size(tScS, mode=[0])

        # dS^T as written from registers: the (keys, queries) view of the dQ A operand.
        # Written with stmatrix (8x8 blocks, queries contiguous in both), like an epilogue.
        sdS_t = cute.make_tensor(sdS.iterator, cute.select(sdS.layout, mode=[1, 0, 2]))
        ds_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_sdp,
        ).get_slice(tidx)
        tdSsdS = (ds_copy, ds_copy.partition_D(sdS_t[None, None, 0]))
        # (query, head dim) coordinates of this thread's dQ elements.
        dq_thread = tidx % self.threads_per_wg if const_expr(self.dq_single_wg) else tidx
        tdQcdQ = _rows_view(tiled_mma_dq.get_slice(dq_thread).partition_C(cute.make_identity_tensor((bq, d))))

        # The CTA's keys' column intervals (Kc per key), loaded once.
        kc = self.num_bwd_intervals
        col_starts = cute.make_rmem_tensor((num_rows, max(kc, 1)), Int32)
        col_lengths = cute.make_rmem_tensor((num_rows, max(kc, 1)), Int32)
        exact = Boolean(False)
        if const_expr(kc > 0):
            exact = mBwdExact[mask_batch] != 0
        pipeline_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            mh = self.mask_head(head)
            gTiles = mBwdTiles[mask_batch, mh, k_tile, None]
            if const_expr(kc > 0):
                for r in cutlass.range_constexpr(num_rows):
                    key = k_tile * bk + tScS[r, 0][0]
                    ok = key < seqlen_k
                    safe = key if ok else 0
                    for m in cutlass.range_constexpr(kc):
                        col_starts[r, m] = mBwdIntervals[mask_batch, mh, safe, m, 0]
                        length = mBwdIntervals[mask_batch, mh, safe, m, 1]
                        col_lengths[r, m] = length if ok else 0
            ragged_q = n_q_tiles if seqlen_q % bq == 0 else n_q_tiles - 1
            ragged_k = (seqlen_k % bk != 0) & (k_tile == cute.ceil_div(seqlen_k, bk) - 1)
            for q_tile in cutlass.range(n_q_tiles, unroll=1):
                bits = tile_bits(gTiles, q_tile)
                if bits & Uint32(1) != Uint32(0):
                    needs_mask = (bits & Uint32(2) != Uint32(0)) | (q_tile == ragged_q) | ragged_k
                    if needs_mask:
                        self.step(True, state, q_tile, mma_sdp, mma_dkv, mma_dq, tSrK, tSrV, tSrQ,
                                  tSrdO, tKVrQt, tKVrdOt, tQrdS, tQrKt, tKVrP, tKVrdS, acc_dK, acc_dV,
                                  tScS, tdSsdS, tdQcdQ, mLSE2, mDelta, col_starts, col_lengths, exact,
                                  mFwdIntervals, mdQaccum, pipeline_q, pipeline_do, seqlen_q,
                                  seqlen_k, k_tile, head, mh, batch, mask_batch, tidx)
                    else:
                        self.step(False, state, q_tile, mma_sdp, mma_dkv, mma_dq, tSrK, tSrV, tSrQ,
                                  tSrdO, tKVrQt, tKVrdOt, tQrdS, tQrKt, tKVrP, tKVrdS, acc_dK, acc_dV,
                                  tScS, tdSsdS, tdQcdQ, mLSE2, mDelta, col_starts, col_lengths, exact,
                                  mFwdIntervals, mdQaccum, pipeline_q, pipeline_do, seqlen_q,
                                  seqlen_k, k_tile, head, mh, batch, mask_batch, tidx)
                    state.advance()
        if const_expr(self.dq_bulk):
            if tidx == 0:        # the last bulk reduce-add completes before the CTA exits
                cute.arch.cp_async_bulk_wait_group(0)
        self.epilogue(acc_dK, acc_dV, mdK, mdV, tiled_mma_dkv, tidx, seqlen_k, k_tile, head_kv, batch)

    @cute.jit
    def step(self, masked: cutlass.Constexpr[bool], state, q_tile, mma_sdp, mma_dkv, mma_dq, tSrK,
             tSrV, tSrQ, tSrdO, tKVrQt, tKVrdOt, tQrdS, tQrKt, tKVrP, tKVrdS, acc_dK, acc_dV, tScS,
             tdSsdS, tdQcdQ, mLSE2, mDelta, col_starts, col_lengths, exact, mFwdIntervals, mdQaccum,
             pipeline_q, pipeline_do, seqlen_q, seqlen_k, k_tile, head, mh, batch, mask_batch, tidx):
        d, bq, bk = self.head_dim, self.block_q, self.block_kv
        acc_S = cute.make_rmem_tensor(mma_sdp.partition_shape_C((bk, bq)), Float32)
        acc_dP = cute.make_rmem_tensor(mma_sdp.partition_shape_C((bk, bq)), Float32)
        pipeline_q.consumer_wait(state)
        issue_wgmma(mma_sdp, acc_S, tSrK[None, None, None, 0], tSrQ[None, None, None, state.index], True)
        pipeline_do.consumer_wait(state)
        issue_wgmma(mma_sdp, acc_dP, tSrV[None, None, None, 0], tSrdO[None, None, None, state.index], True)
        warpgroup.wait_group(1)

        # P^T = exp2(S^T * scale log2 e - lse log2 e); masked elements 0. The per-query
        # statistics are read where they are used (L1/L2), not held across the step.
        S = _rows_view(acc_S)
        n_cols = cute.size(S, mode=[1])
        cols = cute.make_rmem_tensor(n_cols, Int32)     # global query rows (clamped)
        if const_expr(not self.stats_tma):
            for c in cutlass.range_constexpr(n_cols):
                i = q_tile * bq + tScS[0, c][1]
                cols[c] = i if i < seqlen_q else 0
        stat = cute.make_rmem_tensor(n_cols, Float32)
        for c in cutlass.range_constexpr(n_cols):
            if const_expr(self.stats_tma):      # mLSE2 is this stage's shared lse (Q's barrier)
                stat[c] = mLSE2[tScS[0, c][1], state.index]
            else:
                stat[c] = mLSE2[batch, head, cols[c]]
        scale_log2 = Float32(self.scale_log2)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            for c in cutlass.range_constexpr(n_cols):
                S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - stat[c], fastmath=True)
        if const_expr(masked):
            self.apply_mask(S, tScS, q_tile, col_starts, col_lengths, exact, mFwdIntervals,
                            seqlen_q, seqlen_k, k_tile, mh, mask_batch)
        for c in cutlass.range_constexpr(n_cols):
            if const_expr(self.stats_tma):      # dO's barrier was waited on above
                stat[c] = mDelta[tScS[0, c][1], state.index]
            else:
                stat[c] = mDelta[batch, head, cols[c]]
        warpgroup.wait_group(0)
        dP = _rows_view(acc_dP)
        for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
            for c in cutlass.range_constexpr(n_cols):
                dP[r, c] = S[r, c] * (dP[r, c] - stat[c])
        # dV += P^T dO, dK += dS^T Q (register A operands).
        tKVrP.store(_as_a_operand(acc_S).load().to(self.dtype))
        tKVrdS.store(_as_a_operand(acc_dP).load().to(self.dtype))
        issue_wgmma(mma_dkv, acc_dV, tKVrP, tKVrdOt[None, None, None, state.index], False)
        issue_wgmma(mma_dkv, acc_dK, tKVrdS, tKVrQt[None, None, None, state.index], False)

        # dS^T -> shared memory (after both warpgroups finished the previous dQ product).
        if const_expr(self.dq_bulk):
            # The previous tile's bulk reduce-add must have read the shared dQ tile before
            # anyone passes DS_FREE and (further down) rewrites it.
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=_BARRIER_DS_FREE, number_of_threads=self.num_consumer_wgs * self.threads_per_wg)
        ds_copy, tdSsdS_dst = tdSsdS
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        cute.copy(ds_copy, ds_copy.retile(rdS), tdSsdS_dst)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BARRIER_DS_READY, number_of_threads=self.num_consumer_wgs * self.threads_per_wg)

        # dQ_tile[:, this warpgroup's D half] = dS K (the whole of D on warpgroup 0 alone
        # when dq_single_wg).
        if const_expr(self.dq_single_wg):
            if tidx // self.threads_per_wg == 0:
                acc_dQ = cute.make_rmem_tensor(mma_dq.partition_shape_C((bq, d)), Float32)
                issue_wgmma(mma_dq, acc_dQ, tQrdS[None, None, None, 0], tQrKt[None, None, None, 0], True)
                warpgroup.wait_group(0)
                self.store_dq(acc_dQ, mdQaccum, tdQcdQ, seqlen_q, q_tile, head, batch)
            warpgroup.wait_group(0)
            pipeline_q.consumer_release(state)
            pipeline_do.consumer_release(state)
        else:
            acc_dQ = cute.make_rmem_tensor(mma_dq.partition_shape_C((bq, d)), Float32)
            issue_wgmma(mma_dq, acc_dQ, tQrdS[None, None, None, 0], tQrKt[None, None, None, 0], True)
            warpgroup.wait_group(0)
            pipeline_q.consumer_release(state)
            pipeline_do.consumer_release(state)
            self.store_dq(acc_dQ, mdQaccum, tdQcdQ, seqlen_q, q_tile, head, batch)
        if const_expr(self.dq_bulk):
            # Every consumer thread's part of the tile is in shared memory (fenced for the
            # async proxy): one thread adds the whole tile to its global slot.
            cute.arch.barrier(barrier_id=_BARRIER_DQ_READY,
                              number_of_threads=self.num_consumer_wgs * self.threads_per_wg)
            if tidx == 0:
                mdQ, sdQ = mdQaccum
                bulk_reduce_add_f32(mdQ[batch, head, q_tile, None].iterator.llvm_ptr,
                                    sdQ.iterator.llvm_ptr, bq * (d + DQ_ROW_PAD) * 4)
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def apply_mask(self, P, tScS, q_tile, col_starts, col_lengths, exact, mFwdIntervals,
                   seqlen_q, seqlen_k, k_tile, mh, mask_batch):
        """Zero P^T where the (key, query) pair is not visible (or out of range)."""
        bq, bk = self.block_q, self.block_kv
        row0, col0 = k_tile * bk, q_tile * bq
        if exact:
            for r in cutlass.range_constexpr(cute.size(P, mode=[0])):
                key_ok = row0 + tScS[r, 0][0] < seqlen_k
                for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                    i = col0 + tScS[r, c][1]
                    vis = Boolean(False)
                    for m in cutlass.range_constexpr(self.num_bwd_intervals):
                        vis = vis | _unsigned_lt(i - col_starts[r, m], col_lengths[r, m])
                    keep = vis & key_ok & (i < seqlen_q)
                    P[r, c] = P[r, c] if keep else Float32(0.0)
        else:
            # Forward row intervals of each query column (K per query).
            for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                i = col0 + tScS[0, c][1]
                q_ok = i < seqlen_q
                safe = i if q_ok else 0
                starts = cute.make_rmem_tensor(self.num_intervals, Int32)
                lengths = cute.make_rmem_tensor(self.num_intervals, Int32)
                for m in cutlass.range_constexpr(self.num_intervals):
                    starts[m] = mFwdIntervals[mask_batch, mh, safe, m, 0]
                    lengths[m] = mFwdIntervals[mask_batch, mh, safe, m, 1]
                for r in cutlass.range_constexpr(cute.size(P, mode=[0])):
                    j = row0 + tScS[r, c][0]
                    vis = Boolean(False)
                    for m in cutlass.range_constexpr(self.num_intervals):
                        vis = vis | _unsigned_lt(j - starts[m], lengths[m])
                    keep = vis & q_ok & (j < seqlen_k)
                    P[r, c] = P[r, c] if keep else Float32(0.0)

    @cute.jit
    def store_dq(self, acc_dQ, mdQaccum, coords, seqlen_q, q_tile, head, batch):
        """fp32 atomic adds of this thread's dQ elements (rows past Nq dropped); with
        dq_bulk, its elements into the shared dQ tile (rows past Nq included: their slot
        of the padded accumulator is dropped by the caller)."""
        acc = _rows_view(acc_dQ)
        if const_expr(self.dq_bulk):
            _, sdQ = mdQaccum
            for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
                row = coords[r, 0][0]
                for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                    sdQ[dq_tile_offset(row, coords[r, c][1], self.head_dim)] = acc[r, c]
            cute.arch.fence_view_async_shared()
        else:
            pair = cute.make_rmem_tensor(2, Float32)
            for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
                row = q_tile * self.block_q + coords[r, 0][0]
                if row < seqlen_q:
                    dst = mdQaccum[0][batch, row, head, None]
                    # Columns c, c + 1 of a thread are adjacent in memory: one red.v2.f32.
                    for c in cutlass.range_constexpr(0, cute.size(acc, mode=[1]), 2):
                        pair[0] = acc[r, c]
                        pair[1] = acc[r, c + 1]
                        cute.arch.atomic_add((dst.iterator + coords[r, c][1]).llvm_ptr,
                                             pair.load().ir_value())

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, mdK, mdV, tiled_mma_dkv, tidx, seqlen_k, k_tile, head_kv, batch):
        """dK (times the softmax scale) and dV to global, rows past Nk dropped."""
        thr = tiled_mma_dkv.get_slice(tidx)
        coords = _rows_view(thr.partition_C(cute.make_identity_tensor((self.block_kv, self.head_dim))))
        dK = _rows_view(acc_dK)
        dV = _rows_view(acc_dV)
        scale = Float32(self.scale)
        for r in cutlass.range_constexpr(cute.size(dK, mode=[0])):
            row = k_tile * self.block_kv + coords[r, 0][0]
            if row < seqlen_k:
                for c in cutlass.range_constexpr(cute.size(dK, mode=[1])):
                    col = coords[r, c][1]
                    mdK[batch, row, head_kv, col] = (dK[r, c] * scale).to(self.dtype)
                    mdV[batch, row, head_kv, col] = dV[r, c].to(self.dtype)
