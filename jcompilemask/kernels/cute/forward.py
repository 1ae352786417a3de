"""SM90 (Hopper) forward attention driven by the Execution Descriptor.

One CTA owns one `block_q`-row query tile of one (batch, query head). It reads the
tile-state word(s) of its tile row and visits only the key tiles whose compute bit is
set: an empty tile costs no TMA load and no MMA. A full tile runs with no masking; a
partial tile (mask bit set) — and the ragged last key tile, which the descriptor does
not flag because its bits count in-range elements only — runs the interval check
``OR_m uint32(j - start_m) < uint32(length_m)`` over the row's K intervals, which each
thread loads once for its rows before the key loop.

Warp specialization (FlashAttention-3's layout of the work, written here for the
descriptor): warpgroup 0 is the producer (one warp issues TMA loads of Q once and of K
and V per visited tile into a `num_stages`-deep ring); warpgroups 1 and 2 are
consumers, each owning 64 query rows. Each consumer overlaps its own softmax with
its own P@V wgmma (S of tile t+1 is issued before P_t @ V_t), and the two consumers
alternate tensor-core issue through a pair of named barriers so that one's softmax
hides behind the other's GEMMs.

Scores stay in registers (P is the register A operand of the P@V wgmma). Softmax uses
exp2 with the scale folded into one FFMA; a row that sees no key keeps max = -inf and
sum = 0 and ends with o = 0, lse = -inf (never NaN). O leaves through shared memory
(Q's buffer, stmatrix) and one TMA store; LSE is stored directly.

Soft cap (logit = cap * tanh(scale * s / cap)) is applied to S before the mask, since
masking writes -inf and tanh(-inf) = -1 would make a masked key visible. The scores
are then kept as t = tanh(...) in [-1, 1] and the whole factor cap * log2(e) moves into
the exp2 scale: the running max, the softmax and the LSE see t exactly as they see raw
scores without a cap, so there is still one FFMA per element ahead of the exp2.

Head dims 64, 128 and 256 with Dv == D, and 192 with Dv 128 (O is staged through Q's
shared buffer, which is at least as large). Tile shapes come from
`api.preferred_forward_tiles`: 128 x 128 for D <= 128 and 192 / 128; 128 x 80 for D = 256,
where O alone takes 128 fp32 registers per consumer thread.

Measured (H200, causal, bf16, D = 128, 8 heads, 128K tokens): 440 / 544 / 582 TF/s at
N = 2K / 8K / 32K against FlashAttention-4's native kernel at 491 / 600 / 625
(benchmarks/results/h200-forward.json, NOTES.md).
"""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.memory as cutlass_memory
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Boolean, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .residual_ops import CuteOps
from .common import (INTERVALS_UNROLLED, RUN_CHUNK, WarpSpecializedSm90, _as_a_operand, _pair_runs, _rows_view, _tree,
                     _unsigned_lt, build_tile_list, build_tile_runs,
                     issue_wgmma, run_chunk_word, select_by_words,
                     fold_periodic_slots, smem_tensor, tile_bits, tma_tiles)

# residual_words: at most this many interval slots with a residual predicate (each keeps a
# word pair per row in registers); masks with more keep residual_bits.
RESIDUAL_WORD_SLOTS = 4
# residual_regs: at most this many interval slots kept in registers per row (2 rows a
# thread: 4 registers a slot, 2 for the regions).
RESIDUAL_REG_SLOTS = 2

# Named barrier ids. 0 is __syncthreads; the two consumer warpgroups each own one
# scheduling barrier that the other one arrives on (tensor-core ping-pong).
_BARRIER_SCHED_WG1 = 1
_BARRIER_EPILOGUE = 3  # both consumer warpgroups: O is in shared memory
_BARRIER_LIST_READY = 4  # work_list: the producer warp built this chunk of the list
_BARRIER_LIST_FREE = 5   # work_list: both consumer warpgroups are done with it
FWD_LIST_CHUNK = 512     # work_list: key tiles per list chunk (2 KB of shared memory)
assert FWD_LIST_CHUNK == RUN_CHUNK     # work_runs: one 16-tile word per lane of the producer warp
_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)


class FlashForwardSm90(WarpSpecializedSm90):
    """Forward attention over a tile-state descriptor, one class for SM90's forward pass.

    Static choices (the compile key) are fixed here; shapes B, Nq, Nk, heads are runtime.
    Inputs of ``__call__`` (layouts of ``jax.nn.dot_product_attention``):
      mQ [B, Nq, Hq, D], mK [B, Nk, Hkv, D], mV [B, Nk, Hkv, Dv] (dtype),
      mIntervals int32 [Bm, Hm, Nq, K, 2], mTiles uint32 [Bm, Hm, Tq, W],
      mO [B, Nq, Hq, Dv] (dtype), mLSE float32 [B, Hq, Nq].
    """

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        head_dim_v: int,
        num_intervals: int,
        scale: float,
        *,
        block_q: int = 128,
        block_kv: int = 128,
        broadcast_batch: bool = False,
        broadcast_head: bool = False,
        num_stages: int = 2,
        softcap: float | None = None,
        softcap_fast_tanh: bool = False,
        residual=None,
        bits_above: int = INTERVALS_UNROLLED,
        interval_unroll: int = 1,
        group_mask: bool = False,
        residual_words: bool = False,
        rescale_tail: bool = False,
        work_list: bool = False,
        schedule: bool = False,
        persistent: bool = False,
        o_buffer: bool = False,
        k_ahead: bool = False,
        work_runs: bool = False,
        runs_early: bool = False,
        slot_skip: bool = False,
        mask_r2p: bool = False,
        residual_periodic: bool = False,
        rescale_early: bool = False,
        operands_early: bool = False,
        p_double: bool = False,
        residual_regs: bool = False,
    ):
        assert dtype in (cutlass.BFloat16, cutlass.Float16), dtype
        assert block_q == 64 * self.num_consumer_wgs, "each consumer warpgroup owns 64 rows"
        assert block_kv % 16 == 0 and head_dim % 16 == 0 and head_dim_v % 16 == 0
        assert num_intervals >= 1
        # O goes out through Q's shared buffer: the same layout when Dv == D, else (192 / 128)
        # a (block_q, Dv) layout over the first bytes of the (larger) Q buffer.
        assert head_dim_v <= head_dim, "the epilogue stages O in Q's buffer: needs Dv <= D"
        assert softcap is None or softcap > 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.num_intervals = num_intervals
        self.scale = float(scale)
        self.softcap = None if softcap is None else float(softcap)
        self.softcap_fast_tanh = softcap_fast_tanh
        if self.softcap is None:
            self.scale_log2 = float(scale) * _LOG2_E
        else:
            # S holds t = tanh(scale * s / cap) after apply_softcap; the logit is cap * t.
            self.scale_log2 = self.softcap * _LOG2_E
        self.block_q = block_q
        self.block_kv = block_kv
        self.broadcast_batch = broadcast_batch
        self.broadcast_head = broadcast_head
        self.num_stages = num_stages
        # The intervals take 4 K registers per consumer thread (2 rows x start, length).
        # Beside D = 256's 128-register O they fit up to K = 4; K = 6 spilled 48 bytes
        # (cuobjdump, NOTES.md), so above that they are reloaded per masked tile.
        # Above INTERVALS_UNROLLED (K > 8: e.g. global tokens + a window) a masked tile tests
        # the row's intervals one at a time from the table in a loop that is not unrolled,
        # skipping those that miss the tile, and gathers visibility in bit masks.
        # bits_above < 8 (a benchmark knob, issue 14 item 3) takes that path for fewer
        # intervals too, with the slots unrolled: only the intervals that reach into the
        # tile are tested (clear: K 6, of which ~1-2 meet a 128-key tile).
        self.intervals_as_bits = num_intervals > bits_above
        # The unroll factor of that path's loop over K > INTERVALS_UNROLLED intervals
        # (ForwardKey.interval_unroll: several table loads in flight).
        self.interval_unroll = interval_unroll
        # work_list (issue 14 item 1): the producer warp turns the row's tile words into a
        # list of visited key tiles (common.build_tile_list), chunks of FWD_LIST_CHUNK; it
        # and the consumers iterate the list instead of walking every tile's bits.
        self.work_list = work_list
        # work_runs (issue 14 item 1, with work_list): the list holds runs of consecutive
        # visited tiles of one kind (common.build_tile_runs) instead of one entry per tile;
        # both sides loop over a run's tiles with a counter, the consumers' masked / full
        # choice made once per run. The per-tile list handling (load, decode, branch: ~29
        # instructions per tile and warp over FA4's counter loop, ncu session 19) goes.
        assert not work_runs or (work_list and not rescale_tail)
        self.work_runs = work_runs
        # runs_early (with work_runs; the default since session 25, see ForwardKey): the
        # producer's tile words of the row's first chunk are loaded first thing in the
        # kernel, before the barriers' setup (build_tile_runs then visits only the set
        # bits; since session 25 the one runs builder, with or without). A fixed per-CTA cost
        # fits the runs' remaining gap to FA4 (run 2026-12-04T13:02:54Z: +0.164 / +0.077 /
        # +0.039 ms at causal 32K / 8K / 2K, 8192 CTAs each: ~0.7 us a CTA, ~25 cycles a
        # tile); the list, and so the first K / V load, waited for that word's latency.
        assert not runs_early or work_runs
        self.runs_early = runs_early
        self.list_words = FWD_LIST_CHUNK * (2 if work_runs else 1)
        # k_ahead (issue 14): the producer issues K(t + 1) before V(t) (FA4's SM90 order),
        # so the next QK^T's operand is not queued behind the wait for V's stage, which
        # frees only when P V of two tiles back has been read.
        self.k_ahead = k_ahead
        # schedule (issue 14 item 2): a 1-D grid whose block i runs the work unit
        # mSchedule[i] = (batch * Hq + head) * Tq + q_tile; the host orders the units
        # longest-first within groups of heads whose K / V fit in L2 (api.forward_schedule).
        # persistent: one CTA per SM, each running its row of mSchedule [P, 1 + J] (a count,
        # then its units); the K / V ring and the Q stage carry over from one unit to the
        # next, so the next unit's K / V load while this one's epilogue runs.
        self.persistent = persistent
        self.schedule = schedule or persistent
        # o_buffer (persistent, where shared memory allows: D <= 128): O is staged in its own
        # buffer instead of Q's, so the consumers release Q after the unit's last S = Q K^T
        # and the next unit's Q loads during this unit's last P V and epilogue.
        assert not o_buffer or persistent
        self.o_buffer = o_buffer
        self.list_meet = self.num_consumer_wgs * self.threads_per_wg + 32
        # Residual predicates (lower/residual_program.py: per slot, per region) are checked
        # with the interval in partial tiles, on the bit-mask path with the slots unrolled;
        # the kernel then also reads the rows' regions and the parameter table.
        self.residual = residual if residual is not None and not residual.exact else None
        if self.residual is not None:
            assert len(self.residual.slots) == num_intervals
            self.intervals_as_bits = True
        self.intervals_in_registers = not self.intervals_as_bits and (
            head_dim_v < 256 or num_intervals <= 4)
        # group_mask (issue 14 item 3, a benchmark knob): a masked tile's visibility per row is
        # built as two bit words, one per column of the thread's column pairs, from each
        # interval's two clamped ends (apply_mask_groups), instead of one subtract-compare
        # per interval and element.
        # On the bit-mask path (K > bits_above) an interval that reaches into the tile ORs
        # its runs into the words (apply_mask_bits_groups); residual masks keep their path.
        self.group_mask = group_mask and self.residual is None
        assert not self.group_mask or block_kv // 8 < 32
        # slot_skip (issue 14 item 3, the default since session 25; group_mask with the
        # intervals in registers, K >= 2): a masked tile builds an interval slot's runs only when the slot
        # reaches into the tile for some row of the warp (a vote, so the branch is uniform).
        # Building the words is the masked tile's cost at K 6 (clear: 946 SASS instructions
        # per masked tile and warp against 491 for a full one, ~35 per row and slot), and
        # ~1-2 of clear's 6 slots meet a 128-key tile. Exact: a slot that misses the tile
        # for every row gives empty runs.
        self.slot_skip = slot_skip and self.group_mask and num_intervals >= 2
        # mask_r2p (the default since session 25): mask_by_words tests word0's bits in order, then word1's
        # (the elements are independent), in FA4's form, so that ptxas emits R2P instead of a
        # LOP3 per element (SASS, D 128 K 1 masked tile: 698 -> 650 instructions).
        self.mask_r2p = mask_r2p
        # residual_words (issue 16; the D 128 default since session 23): a residual mask's masked
        # tile ORs its slots' intervals into column-group words as group_mask does (the slots
        # without a residual into one pair, each slot with one into a pair of its own), then
        # per element tests the word bit AND that slot's predicate: no per-element interval
        # subtract-compare, no bit-set round trip (residual_bits). Up to
        # RESIDUAL_WORD_SLOTS slots with a predicate, K unrolled up to INTERVALS_UNROLLED.
        self.residual_words = (residual_words and self.residual is not None
                               and num_intervals <= INTERVALS_UNROLLED
                               and sum(1 for sl in self.residual.slots if sl) <= RESIDUAL_WORD_SLOTS)
        # residual_periodic (issue 16, the default since session 25; with residual_words): a slot whose
        # predicate lower/residual_program.column_periodic proves 8-periodic in k (the dilated
        # window's (q - k) % 2 == 0) is evaluated once per row and column class instead of
        # per element; with every predicate slot periodic the masked tile is word tests only.
        self.residual_periodic = (residual_periodic and self.residual_words
                                  and any(self.residual.periodic_slots()))
        self.periodic_slots = self.residual.periodic_slots() if self.residual_periodic else ()
        # residual_regs (issue 16, session 35; with residual_words, K <= RESIDUAL_REG_SLOTS): a
        # residual mask's row intervals and row regions are loaded into registers once per
        # tile row, as the interval path does (load_intervals), instead of from the tables
        # in every masked tile. The dilated window's every visited tile is masked, and its
        # first one waited on those loads (L2) before its softmax.
        self.residual_regs = residual_regs and self.residual_words and num_intervals <= RESIDUAL_REG_SLOTS
        # rescale_tail (issue 14, a benchmark knob): O's rescale by the step's row factor runs
        # in the tile loop's common tail, after the branch on the tile's kind, instead of at
        # the end of each step. The compiler sinks the steps' identical conversion of P to
        # the input dtype into that tail anyway (SASS: 32 F2FP back to back at the join, the
        # 64 FMULs of the rescale before the branch), so the two bursts could not interleave;
        # ncu (causal 32K, session 19) had the F2FPs at 8.6% of our stall samples, mostly
        # `math` throttle, against FA4's 2.2%, whose F2FPs and FMULs share one block.
        # With the work list the row's first tile is also taken out of the loop, which then
        # joins two step kinds, not three (fewer register moves at the join). Bit-identical
        # results: the same products in the same order.
        self.rescale_tail = rescale_tail
        # rescale_early (issue 14, a benchmark knob): O's rescale by a step's row factors runs
        # in the next step, between its S = Q K^T issue and its P V issue (FA3's order), not
        # after the step's P V wait. ncu (causal 8K, session 26): the unmasked step's 64 FMULs
        # of the rescale all sit after its 64 exp2s, behind the P V wait, which ptxas places
        # right after the row max (0 of 64 MUFU before it; FA4's FMULs interleave with its
        # exp2s); per tile our consumer warps sampled 2.7% more than FA4's. Moved before the
        # next P V issue they run while that step's S GEMM holds the tensor pipe, and after the
        # wait only P's conversion is left. Bit-identical: O sees the same multiplies and
        # accumulations in the same order (factor 1 before the first P V, whose O is 0).
        assert not (rescale_early and rescale_tail)
        self.rescale_early = rescale_early
        # Both keep the row factors in a register tensor across steps (the caller's).
        self.carries_row_scale = rescale_tail or rescale_early
        # operands_early (issue 14, a benchmark knob): a step's GEMM operand slices (Q, K and V
        # at their stages) are taken before the K wait and the scheduler barrier. ncu (causal
        # 8K, session 26): FA4 issues its first S HGMMA 6 instructions after that barrier,
        # ours 16 (the K and Q descriptors built after it, a chain of dependent uniform ops on
        # the path from the other warpgroup's signal to the tensor pipe). SASS D 128 K 1:
        # 14-15 -> 9-11 instructions, 2952 -> 2920 in the kernel. Bit-identical: the same GEMMs.
        self.operands_early = operands_early
        # p_double (issue 14, a benchmark knob): P alternates between two register tensors,
        # so a step writes its P while the previous P V (reading the other) is still running;
        # the P V wait then guards only O's rescale and V's release. With one P, ptxas puts
        # that wait right after the row max (0 of the 64 exp2s before it at causal D 128;
        # FA4: 10), because the P conversions it interleaves with the exp2s write the
        # in-flight operand (static SASS, session 30); with two, 15. The parity is a
        # warp-uniform run-time value: each step kind is compiled once per parity. Work runs
        # only, not beside the rescale knobs. Bit-identical: the same products in the same order.
        assert not p_double or (work_runs and not rescale_tail and not rescale_early)
        self.p_double = p_double

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mIntervals: cute.Tensor,
        mTiles: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream,
    ):
        self._launch(mQ, mK, mV, mIntervals, mTiles, mO, mLSE, None, None, stream)

    @cute.jit
    def with_residual(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mIntervals: cute.Tensor,
        mTiles: cute.Tensor,
        mRegion: cute.Tensor,
        mParams: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream,
    ):
        """The entry of a residual mask: also the rows' regions int32 [Bm, Nq] and the
        residual parameter table int32 [Bm, W] (inputs, so before the outputs: the FFI
        passes operands then results)."""
        self._launch(mQ, mK, mV, mIntervals, mTiles, mO, mLSE, mRegion, mParams, stream)

    @cute.jit
    def with_schedule(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mIntervals: cute.Tensor,
        mTiles: cute.Tensor,
        mSchedule: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream,
    ):
        """The entry with a work-unit order: int32 [B * Hq * Tq], a permutation of the units
        (api.forward_schedule)."""
        self._launch(mQ, mK, mV, mIntervals, mTiles, mO, mLSE, None, None, stream, mSchedule)

    @cute.jit
    def with_residual_schedule(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mIntervals: cute.Tensor,
        mTiles: cute.Tensor,
        mRegion: cute.Tensor,
        mParams: cute.Tensor,
        mSchedule: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream,
    ):
        """``with_residual`` and ``with_schedule`` together."""
        self._launch(mQ, mK, mV, mIntervals, mTiles, mO, mLSE, mRegion, mParams, stream, mSchedule)

    @cute.jit
    def _launch(self, mQ, mK, mV, mIntervals, mTiles, mO, mLSE, mRegion, mParams, stream,
                mSchedule=None):
        # (B, N, H, D) -> (N, D, H, B): row, contraction dim, then the batch modes.
        mQt = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        mKt = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        mOt = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
        # V as the B operand of O = P @ V: (Dv, Nk, H, B), Dv contiguous (MN-major).
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))

        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype,
            cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, (self.num_consumer_wgs, 1, 1), (64, self.block_kv),
        )
        tiled_mma_pv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype,
            cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, (self.num_consumer_wgs, 1, 1), (64, self.head_dim_v),
            warpgroup.OperandSource.RMEM,
        )
        sQ_layout = sm90_helpers.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (self.block_q, self.block_kv, self.head_dim), self.dtype, 1
        )
        sK_layout = sm90_helpers.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (self.block_q, self.block_kv, self.head_dim), self.dtype, self.num_stages
        )
        sV_layout = sm90_helpers.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (self.block_q, self.head_dim_v, self.block_kv), self.dtype, self.num_stages
        )
        tma_atom_q, mQ_tma = self.tma_load_atom(mQt, sQ_layout, (self.block_q, self.head_dim))
        tma_atom_k, mK_tma = self.tma_load_atom(mKt, sK_layout, (self.block_kv, self.head_dim))
        tma_atom_v, mV_tma = self.tma_load_atom(mVt, sV_layout, (self.head_dim_v, self.block_kv))
        # O leaves through shared memory and one TMA store: it reuses Q's buffer (same
        # shape and swizzle when Dv == D) and TMA clips the rows past Nq for us.
        sO_layout = sQ_layout
        if const_expr(self.head_dim_v != self.head_dim):
            sO_layout = self.o_smem_layout()
        tma_atom_o, mO_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mOt, cute.slice_(sO_layout, (None, None, 0)),
            (self.block_q, self.head_dim_v),
        )
        self.bytes_q = self.stage_bytes(sQ_layout)
        self.bytes_k = self.stage_bytes(sK_layout)
        self.bytes_v = self.stage_bytes(sV_layout)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            # 1024-byte alignment: the 128B swizzle pattern repeats every 1024 bytes.
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage
        if const_expr(self.work_list):
            @cute.struct
            class SharedStorageList:
                mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
                mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
                mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
                sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
                sList: cute.struct.Align[cute.struct.MemRange[Int32, self.list_words], 16]
                sCount: cute.struct.MemRange[Int32, 2]

            self.shared_storage = SharedStorageList

        num_q_tiles = cute.ceil_div(mQ.shape[1], self.block_q)
        extra = {}
        if const_expr(self.residual is not None):
            extra.update(mRegion=mRegion, mParams=mParams)
        grid = [num_q_tiles, mQ.shape[2], mQ.shape[0]]
        if const_expr(self.schedule):
            extra.update(mSchedule=mSchedule)
            grid = [num_q_tiles * mQ.shape[2] * mQ.shape[0], 1, 1]
            if const_expr(self.persistent):
                grid = [mSchedule.shape[0], 1, 1]
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mO_tma, mLSE, mIntervals, mTiles,
            tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o,
            tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, **extra,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def o_smem_layout(self):
        """O's (block_q, Dv) staging layout when Dv < D (over the start of Q's buffer)."""
        return sm90_helpers.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (self.block_q, self.block_kv, self.head_dim_v), self.dtype, 1)

    # ---------------------------------------------------------------- device entry
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mIntervals: cute.Tensor,
        mTiles: cute.Tensor,
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        tma_atom_o: cute.CopyAtom,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        mRegion: Optional[cute.Tensor] = None,
        mParams: Optional[cute.Tensor] = None,
        mSchedule: Optional[cute.Tensor] = None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        first_raw = None
        if const_expr(self.runs_early and not self.schedule):
            # The producer's tile words of the row's first chunk, loaded first thing: the
            # list (and so the first K / V load) waits for them, and their latency would
            # otherwise add to every CTA's start (FA4 issues its first K load at once).
            bidx0, head0, batch0 = cute.arch.block_idx()
            mb0, mh0 = self.mask_index(head0, batch0)
            first_raw = Uint32(0)
            if warp_idx == 0:
                first_raw = run_chunk_word(mTiles[mb0, mh0, cute.arch.grid_dim()[0] - 1 - bidx0, None],
                                           cute.ceil_div(mK.shape[0], self.block_kv), 0)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)
            cpasync.prefetch_descriptor(tma_atom_o)

        allocator = cutlass_memory.SmemAllocator()
        storage = allocator.allocate(self.shared_storage)
        pipeline_q = self.tma_pipeline(storage.mbar_q, 1, self.bytes_q)
        pipeline_k = self.tma_pipeline(storage.mbar_k, self.num_stages, self.bytes_k)
        pipeline_v = self.tma_pipeline(storage.mbar_v, self.num_stages, self.bytes_v)
        pipeline.pipeline_init_arrive()

        sQ = smem_tensor(storage.sQ, sQ_layout)
        sO = sQ
        if const_expr(self.head_dim_v != self.head_dim):
            # The host's sO_layout is rebuilt here (IR values do not cross into the kernel).
            sO = smem_tensor(storage.sQ, self.o_smem_layout())
        if const_expr(self.o_buffer):
            o_layout = sQ_layout if const_expr(self.head_dim_v == self.head_dim) else self.o_smem_layout()
            sO = allocator.allocate_tensor(self.dtype, o_layout.outer, 1024, o_layout.inner)
        sK = smem_tensor(storage.sK, sK_layout)
        sV = smem_tensor(storage.sV, sV_layout)
        work = None
        if const_expr(self.work_list):
            work = (storage.sList.get_tensor(cute.make_layout(self.list_words)),
                    storage.sCount.get_tensor(cute.make_layout(2)))

        # Heaviest query tiles first: under a causal-like mask the last tile rows see
        # the most keys, and launching them first shortens the tail of the grid.
        bidx, head, batch = cute.arch.block_idx()
        if const_expr(self.persistent):
            self.run_units(mQ, mK, mV, mO, mLSE, mIntervals, mTiles, mSchedule, sQ, sK, sV, sO,
                           tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o, tiled_mma_qk,
                           tiled_mma_pv, pipeline_q, pipeline_k, pipeline_v, warp_idx, tidx, bidx,
                           mRegion, mParams, work)
            return
        q_tile = cute.arch.grid_dim()[0] - 1 - bidx
        if const_expr(self.schedule):
            # The host's order (longest first, heads grouped for L2) of the work units.
            q_tile, head, batch = self.unit_coords(mQ, mSchedule[bidx], cute.ceil_div(mQ.shape[0], self.block_q))
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        mask_batch, mask_head = self.mask_index(head, batch)
        n_k_tiles = cute.ceil_div(mK.shape[0], self.block_kv)
        gTiles = mTiles[mask_batch, mask_head, q_tile, None]

        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(
                    mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v,
                    pipeline_q, pipeline_k, pipeline_v, gTiles, n_k_tiles,
                    q_tile, head, head_kv, batch, work, first_raw=first_raw,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                mO, mLSE, mIntervals, sQ, sK, sV, tma_atom_o, tiled_mma_qk, tiled_mma_pv,
                pipeline_q, pipeline_k, pipeline_v, gTiles, n_k_tiles,
                mQ.shape[0], mK.shape[0], q_tile, head, batch, mask_batch, mask_head,
                tidx - self.threads_per_wg, sO, mRegion, mParams, work,
            )

    # ------------------------------------------------------------------ persistent
    @cute.jit
    def unit_coords(self, mQ, unit, n_q_tiles):
        """(q_tile, head, batch) of work unit `unit` = (batch * Hq + head) * Tq + q_tile."""
        q_tile = unit % n_q_tiles
        head = (unit // n_q_tiles) % mQ.shape[2]
        batch = unit // (n_q_tiles * mQ.shape[2])
        return q_tile, head, batch

    @cute.jit
    def mask_index(self, head, batch):
        """(batch, head) of the descriptor's tables: 0 where the mask broadcasts."""
        mask_batch = 0 if const_expr(self.broadcast_batch) else batch
        mask_head = 0 if const_expr(self.broadcast_head) else head
        return mask_batch, mask_head

    @cute.jit
    def run_units(self, mQ, mK, mV, mO, mLSE, mIntervals, mTiles, mSchedule, sQ, sK, sV, sO,
                  tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o, tiled_mma_qk, tiled_mma_pv,
                  pipeline_q, pipeline_k, pipeline_v, warp_idx, tidx, bidx, mRegion, mParams, work):
        """The persistent CTA: mSchedule[bidx, 0] units, mSchedule[bidx, 1:], one after the
        other; the producer warp and the consumers walk the same row, and their pipeline
        states carry over between units."""
        n_units = mSchedule[bidx, 0]
        n_q_tiles = cute.ceil_div(mQ.shape[0], self.block_q)
        n_k_tiles = cute.ceil_div(mK.shape[0], self.block_kv)
        group = mQ.shape[2] // mK.shape[2]
        pipeline.pipeline_init_wait()
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                for j in cutlass.range(n_units, unroll=1):
                    q_tile, head, batch = self.unit_coords(mQ, mSchedule[bidx, j + 1], n_q_tiles)
                    mask_batch, mask_head = self.mask_index(head, batch)
                    gTiles = mTiles[mask_batch, mask_head, q_tile, None]
                    q_state, kv_state = self.load(
                        mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v,
                        pipeline_q, pipeline_k, pipeline_v, gTiles, n_k_tiles,
                        q_tile, head, head // group, batch, work, q_state=q_state, kv_state=kv_state,
                    )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            for j in cutlass.range(n_units, unroll=1):
                q_tile, head, batch = self.unit_coords(mQ, mSchedule[bidx, j + 1], n_q_tiles)
                mask_batch, mask_head = self.mask_index(head, batch)
                gTiles = mTiles[mask_batch, mask_head, q_tile, None]
                q_state, kv_state = self.consume(
                    mO, mLSE, mIntervals, sQ, sK, sV, tma_atom_o, tiled_mma_qk, tiled_mma_pv,
                    pipeline_q, pipeline_k, pipeline_v, gTiles, n_k_tiles,
                    mQ.shape[0], mK.shape[0], q_tile, head, batch, mask_batch, mask_head,
                    tidx - self.threads_per_wg, sO, mRegion, mParams, work,
                    q_state=q_state, kv_state=kv_state, first_unit=j == 0,
                )
            if const_expr(self.o_buffer):
                if (tidx - self.threads_per_wg) // 32 == 0:
                    # The last O store must have read shared memory before the CTA exits.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(
        self, mQ, mK, mV, sQ, sK, sV, tma_atom_q, tma_atom_k, tma_atom_v,
        pipeline_q, pipeline_k, pipeline_v, gTiles, n_k_tiles, q_tile, head, head_kv, batch, work,
        q_state=None, kv_state=None, first_raw=None,
    ):
        """Warp 0: Q once, then K and V of each visited key tile into the ring. The
        persistent kernel hands in (and gets back) the Q stage's and the ring's states, so
        one unit's loads continue where the previous unit's stopped. ``first_raw`` (work_runs):
        this lane's tile word of the row's first chunk, loaded early by the caller."""
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.block_q, self.head_dim), (q_tile, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.block_kv, self.head_dim), (None, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.head_dim_v, self.block_kv), (0, None))
        tQsQ, tQgQ = tma_tiles(tma_atom_q, sQ, gQ)
        tKsK, tKgK = tma_tiles(tma_atom_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_atom_v, sV, gV)
        if const_expr(q_state is None):
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        # (persistent: waits until the consumers released the previous unit's Q stage, i.e.
        # its O, staged in Q's buffer, has been read by the TMA store)
        pipeline_q.producer_acquire(q_state)
        cute.copy(tma_atom_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
        q_state.advance()

        if const_expr(kv_state is None):
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        if const_expr(self.k_ahead):
            return q_state, self.load_k_ahead(tKgK, tKsK, tVgV, tVsV, tma_atom_k, tma_atom_v,
                                              pipeline_k, pipeline_v, gTiles, n_k_tiles, work, kv_state,
                                              self.ragged_tile(n_k_tiles, mK.shape[0]), first_raw)
        kv_rings = (pipeline_k, tma_atom_k, tKgK, tKsK, pipeline_v, tma_atom_v, tVgV, tVsV)
        if const_expr(self.work_runs):
            sRuns, sCount = work
            ragged_tile = self.ragged_tile(n_k_tiles, mK.shape[0])
            for ch in cutlass.range(cute.ceil_div(n_k_tiles, FWD_LIST_CHUNK), unroll=1):
                self.build_runs(gTiles, n_k_tiles, ch, sRuns, sCount, ragged_tile, first_raw)
                cute.arch.barrier_arrive(barrier_id=_BARRIER_LIST_READY, number_of_threads=self.list_meet)
                for r in cutlass.range(sCount[0], unroll=1):
                    for k_tile in cutlass.range(sRuns[2 * r] & Int32(0xFFFF), sRuns[2 * r + 1], unroll=1):
                        kv_state = self.load_kv(kv_rings, kv_state, k_tile)
                cute.arch.barrier(barrier_id=_BARRIER_LIST_FREE, number_of_threads=self.list_meet)
        elif const_expr(self.work_list):
            sList, sCount = work
            for ch in cutlass.range(cute.ceil_div(n_k_tiles, FWD_LIST_CHUNK), unroll=1):
                build_tile_list(gTiles, n_k_tiles, ch * FWD_LIST_CHUNK, FWD_LIST_CHUNK, sList, sCount, 0)
                cute.arch.barrier_arrive(barrier_id=_BARRIER_LIST_READY, number_of_threads=self.list_meet)
                for it in cutlass.range(sCount[0], unroll=1):
                    kv_state = self.load_kv(kv_rings, kv_state, sList[it] & Int32(0xFFFF))
                # Every load of the chunk is issued; rebuild only once both consumers are done.
                cute.arch.barrier(barrier_id=_BARRIER_LIST_FREE, number_of_threads=self.list_meet)
        else:
            for k_tile in cutlass.range(n_k_tiles, unroll=1):
                if tile_bits(gTiles, k_tile) & Uint32(1) != Uint32(0):
                    kv_state = self.load_kv(kv_rings, kv_state, k_tile)
        return q_state, kv_state

    @cute.jit
    def load_k_ahead(self, tKgK, tKsK, tVgV, tVsV, tma_atom_k, tma_atom_v, pipeline_k, pipeline_v,
                     gTiles, n_k_tiles, work, kv_state, ragged_tile, first_raw=None):
        """``load``'s K / V ring with K(t + 1) issued before V(t): K and V of a tile still
        share a stage index (two states, one per pipeline, advancing once per tile), so the
        consumers see the same ring; a row's (with the work list, a list chunk's) last V
        follows its last K: the consumers need it before they can free the list. Returns the
        ring's state after the last tile (K's and V's are then equal)."""
        k_state = kv_state.clone()
        prev = Int32(-1)
        k_ring = (pipeline_k, tma_atom_k, tKgK, tKsK)
        v_ring = (pipeline_v, tma_atom_v, tVgV, tVsV)
        if const_expr(self.work_runs):
            sRuns, sCount = work
            for ch in cutlass.range(cute.ceil_div(n_k_tiles, FWD_LIST_CHUNK), unroll=1):
                self.build_runs(gTiles, n_k_tiles, ch, sRuns, sCount, ragged_tile, first_raw)
                cute.arch.barrier_arrive(barrier_id=_BARRIER_LIST_READY, number_of_threads=self.list_meet)
                for r in cutlass.range(sCount[0], unroll=1):
                    for k_tile in cutlass.range(sRuns[2 * r] & Int32(0xFFFF), sRuns[2 * r + 1], unroll=1):
                        prev, k_state, kv_state = self.load_k_then_v(k_ring, v_ring, k_state, kv_state,
                                                                     k_tile, prev)
                prev, k_state, kv_state = self.load_k_then_v(None, v_ring, k_state, kv_state,
                                                             Int32(-1), prev)
                cute.arch.barrier(barrier_id=_BARRIER_LIST_FREE, number_of_threads=self.list_meet)
        elif const_expr(self.work_list):
            sList, sCount = work
            for ch in cutlass.range(cute.ceil_div(n_k_tiles, FWD_LIST_CHUNK), unroll=1):
                build_tile_list(gTiles, n_k_tiles, ch * FWD_LIST_CHUNK, FWD_LIST_CHUNK, sList, sCount, 0)
                cute.arch.barrier_arrive(barrier_id=_BARRIER_LIST_READY, number_of_threads=self.list_meet)
                for it in cutlass.range(sCount[0], unroll=1):
                    prev, k_state, kv_state = self.load_k_then_v(
                        k_ring, v_ring, k_state, kv_state, sList[it] & Int32(0xFFFF), prev)
                # The chunk's last V before waiting for the consumers to be done with the
                # list (they need it to get there), then rebuild.
                prev, k_state, kv_state = self.load_k_then_v(None, v_ring, k_state, kv_state,
                                                             Int32(-1), prev)
                cute.arch.barrier(barrier_id=_BARRIER_LIST_FREE, number_of_threads=self.list_meet)
        else:
            for k_tile in cutlass.range(n_k_tiles, unroll=1):
                if tile_bits(gTiles, k_tile) & Uint32(1) != Uint32(0):
                    prev, k_state, kv_state = self.load_k_then_v(k_ring, v_ring, k_state, kv_state,
                                                                 k_tile, prev)
            prev, k_state, kv_state = self.load_k_then_v(None, v_ring, k_state, kv_state,
                                                         Int32(-1), prev)
        return kv_state

    @cute.jit
    def load_kv(self, kv_rings, kv_state, k_tile):
        """K and V of ``k_tile`` into the ring's next stage; returns the advanced state (the
        caller assigns it: see load_k_then_v on carrying a state through a region)."""
        pipeline_k, tma_atom_k, tKgK, tKsK, pipeline_v, tma_atom_v, tVgV, tVsV = kv_rings
        pipeline_k.producer_acquire(kv_state)
        cute.copy(tma_atom_k, tKgK[None, k_tile], tKsK[None, kv_state.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
        pipeline_v.producer_acquire(kv_state)
        cute.copy(tma_atom_v, tVgV[None, k_tile], tVsV[None, kv_state.index],
                  tma_bar_ptr=pipeline_v.producer_get_barrier(kv_state))
        kv_state.advance()
        return kv_state

    @cute.jit
    def build_runs(self, gTiles, n_k_tiles, ch, sRuns, sCount, ragged_tile, first_raw):
        """The producer warp: chunk ``ch`` of the row's runs into sRuns / sCount (work_runs,
        build_tile_runs). ``first_raw``: chunk 0's tile word when the kernel loaded it first
        thing (``runs_early``), else None (loaded here)."""
        if const_expr(first_raw is None):
            build_tile_runs(run_chunk_word(gTiles, n_k_tiles, ch * FWD_LIST_CHUNK), n_k_tiles,
                            ch * FWD_LIST_CHUNK, sRuns, sCount, ragged_tile)
        else:
            raw = first_raw
            if ch > 0:
                raw = run_chunk_word(gTiles, n_k_tiles, ch * FWD_LIST_CHUNK)
            build_tile_runs(raw, n_k_tiles, ch * FWD_LIST_CHUNK, sRuns, sCount, ragged_tile)

    @cute.jit
    def load_k_then_v(self, k_ring, v_ring, k_state, v_state, k_tile, prev):
        """K of ``k_tile`` (unless ``k_ring`` is None), then V of ``prev`` (the tile before,
        if any) into their rings; returns ``k_tile`` (the tile now owed its V) and the two
        advanced states. The caller must assign the states it gets back: the DSL carries a
        value through a dynamic loop or branch only when the region assigns it, or calls a
        method on it directly — a state advanced inside a ``self.method(...)`` call would
        leave the region at its old value (every K of the row then went to one stage: an H200
        launch failure; tests/test_kernel_state_carry.py checks the sources)."""
        if const_expr(k_ring is not None):
            pipe, atom, src, dst = k_ring
            pipe.producer_acquire(k_state)
            cute.copy(atom, src[None, k_tile], dst[None, k_state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(k_state))
            k_state.advance()
        pipe, atom, src, dst = v_ring
        if prev >= 0:
            pipe.producer_acquire(v_state)
            cute.copy(atom, src[None, prev], dst[None, v_state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(v_state))
            v_state.advance()
        return k_tile, k_state, v_state

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(
        self, mO, mLSE, mIntervals, sQ, sK, sV, tma_atom_o, tiled_mma_qk, tiled_mma_pv,
        pipeline_q, pipeline_k, pipeline_v, gTiles, n_k_tiles,
        seqlen_q, seqlen_k, q_tile, head, batch, mask_batch, mask_head, tidx, sO,
        mRegion=None, mParams=None, work=None, q_state=None, kv_state=None, first_unit=None,
    ):
        """Both consumer warpgroups: the tile row's S = Q K^T, online softmax, O += P V, then
        the epilogue. The persistent kernel hands in (and gets back) the pipeline states and
        says whether this is the CTA's first unit (the ping-pong's opening arrive)."""
        # 0 or 1 among the consumers; warp-uniform for ptxas (a shfl from lane 0), so the
        # warpgroup's operand offsets and GMMA descriptors stay in uniform registers.
        wg = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        wg_slice = cute.make_layout(self.num_consumer_wgs, stride=self.threads_per_wg)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_slice(wg))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_slice(wg))
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)

        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrV = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sV))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.block_q, self.head_dim_v)), Float32)
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.block_q, self.block_kv)))
        tOrP1 = None
        if const_expr(self.p_double):
            tOrP1 = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.block_q, self.block_kv)))
        acc_O.fill(0.0)

        # Coordinates of this thread's score elements inside a (block_q, block_kv) tile.
        tScS = _rows_view(thr_mma_qk.partition_C(cute.make_identity_tensor((self.block_q, self.block_kv))))
        num_rows = cute.size(tScS, mode=[0])
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # rescale_tail: the last step's row factors, applied to O in the loop's tail (1 after
        # the first tile, whose O is still zero).
        # rescale_early: the last step's factors, applied before the next P V issue.
        row_scale = None
        if const_expr(self.carries_row_scale):
            row_scale = cute.make_rmem_tensor(num_rows, Float32)
            row_scale.fill(1.0)

        # The row's K intervals, loaded once, when registers allow (see __init__);
        # otherwise apply_mask reloads them from the (L1-resident) table per masked tile.
        row_intervals = (mIntervals, q_tile, seqlen_q, mask_batch, mask_head)
        if const_expr(self.residual is not None):
            row_intervals = row_intervals + (mRegion, mParams)
        if const_expr(self.intervals_in_registers):
            row_intervals = self.load_intervals(tScS, *row_intervals)
        if const_expr(self.residual_regs):
            row_intervals = row_intervals + (self.load_residual_rows(tScS, *row_intervals),)

        if const_expr(q_state is None):
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipeline_q.consumer_wait(q_state)
        if const_expr(first_unit is None):
            if wg == 0:
                # Let the first consumer issue first; from then on they alternate.
                cute.arch.barrier_arrive(barrier_id=_BARRIER_SCHED_WG1, number_of_threads=2 * self.threads_per_wg)
        else:
            # Once per CTA: every unit leaves one arrive of warpgroup 1 pending on warpgroup
            # 0's barrier (its last signal), which opens the next unit the same way.
            if first_unit & (wg == 0):
                cute.arch.barrier_arrive(barrier_id=_BARRIER_SCHED_WG1, number_of_threads=2 * self.threads_per_wg)

        if const_expr(kv_state is None):
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        ragged_tile = self.ragged_tile(n_k_tiles, seqlen_k)
        # One pass over the tile row; an empty tile costs a bit test on an L1-resident
        # word. Jumping straight to the next compute tile (brev + clz over whole words)
        # measured 4-5% slower on the H200 (NOTES.md), so the plain walk stays.
        started = Boolean(False)
        # The operands every step / first tile takes after (kv_state, k_tile[, masked]).
        step_args = (wg_mma_qk, wg_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_O, tScS, row_max, row_sum,
                     row_intervals, seqlen_k, pipeline_k, pipeline_v, wg, row_scale)
        first_args = (wg_mma_qk, tSrQ, tSrK, tOrP, tScS, row_max, row_sum, row_intervals, seqlen_k,
                      pipeline_k)
        # p_double: the same with P read from the second buffer (the step then writes the first).
        step_args_1 = None
        p_par = Int32(0)
        if const_expr(self.p_double):
            step_args_1 = (wg_mma_qk, wg_mma_pv, tSrQ, tSrK, tOrV, tOrP1, acc_O, tScS, row_max,
                           row_sum, row_intervals, seqlen_k, pipeline_k, pipeline_v, wg, row_scale)
        if const_expr(self.work_runs):
            sRuns, sCount = work
            for ch in cutlass.range(cute.ceil_div(n_k_tiles, FWD_LIST_CHUNK), unroll=1):
                cute.arch.barrier(barrier_id=_BARRIER_LIST_READY, number_of_threads=self.list_meet)
                for r in cutlass.range(sCount[0], unroll=1):
                    # The run's first tile and end, its kind (the ragged tile is masked).
                    entry = cute.arch.make_warp_uniform(sRuns[2 * r])
                    run_end = cute.arch.make_warp_uniform(sRuns[2 * r + 1])
                    k_first = entry & Int32(0xFFFF)
                    masked = entry >= Int32(0x10000)
                    if not started:
                        # A full first tile skips the mask (a third copy of the softmax body).
                        self.first_either(masked, kv_state, k_first, first_args)
                        started = Boolean(True)
                        k_first = k_first + 1
                    if const_expr(self.p_double):
                        # The buffer holding the pending P is p_par (mma_first wrote buffer 0).
                        if masked:
                            for k_tile in cutlass.range(k_first, run_end, unroll=1):
                                if p_par == 0:
                                    kv_state = self.mma_step(kv_state, k_tile, True, *step_args, tOrP_next=tOrP1)
                                else:
                                    kv_state = self.mma_step(kv_state, k_tile, True, *step_args_1, tOrP_next=tOrP)
                                p_par = p_par ^ Int32(1)
                        else:
                            for k_tile in cutlass.range(k_first, run_end, unroll=1):
                                if p_par == 0:
                                    kv_state = self.mma_step(kv_state, k_tile, False, *step_args, tOrP_next=tOrP1)
                                else:
                                    kv_state = self.mma_step(kv_state, k_tile, False, *step_args_1, tOrP_next=tOrP)
                                p_par = p_par ^ Int32(1)
                    else:
                        if masked:
                            for k_tile in cutlass.range(k_first, run_end, unroll=1):
                                kv_state = self.mma_step(kv_state, k_tile, True, *step_args)
                        else:
                            for k_tile in cutlass.range(k_first, run_end, unroll=1):
                                kv_state = self.mma_step(kv_state, k_tile, False, *step_args)
                cute.arch.barrier_arrive(barrier_id=_BARRIER_LIST_FREE, number_of_threads=self.list_meet)
        elif const_expr(self.work_list):
            sList, sCount = work
            for ch in cutlass.range(cute.ceil_div(n_k_tiles, FWD_LIST_CHUNK), unroll=1):
                cute.arch.barrier(barrier_id=_BARRIER_LIST_READY, number_of_threads=self.list_meet)
                first_it = Int32(0)
                if const_expr(self.rescale_tail):
                    # The row's first tile out of the loop: the loop body then joins two
                    # step kinds, not three (fewer register moves at the join).
                    if (not started) & (sCount[0] > 0):
                        k_tile, needs_mask = self.list_tile(sList[0], ragged_tile)
                        self.first_either(needs_mask, kv_state, k_tile, first_args)
                        started = Boolean(True)
                        first_it = Int32(1)
                for it in cutlass.range(first_it, sCount[0], unroll=1):
                    k_tile, needs_mask = self.list_tile(sList[it], ragged_tile)
                    if const_expr(self.rescale_tail):
                        kv_state = self.step_either(needs_mask, kv_state, k_tile, step_args)
                        self.rescale_o(acc_O, row_scale)
                    else:
                        if started:
                            kv_state = self.step_either(needs_mask, kv_state, k_tile, step_args)
                        else:
                            # With the list the first tile's mask bit is at hand: a full first
                            # tile skips the mask (issue 14 item 1), at the cost of a third
                            # copy of the softmax body.
                            self.first_either(needs_mask, kv_state, k_tile, first_args)
                        started = Boolean(True)
                cute.arch.barrier_arrive(barrier_id=_BARRIER_LIST_FREE, number_of_threads=self.list_meet)
        for k_tile in cutlass.range(0 if const_expr(self.work_list) else n_k_tiles, unroll=1):
            bits = tile_bits(gTiles, k_tile)
            if bits & Uint32(1) != Uint32(0):
                needs_mask = (bits & Uint32(2) != Uint32(0)) | (k_tile == ragged_tile)
                if started:
                    kv_state = self.step_either(needs_mask, kv_state, k_tile, step_args)
                else:
                    # The first visited tile is always masked: cheap once, and it saves a
                    # third copy of the softmax body.
                    self.mma_first(kv_state, k_tile, *first_args)
                if const_expr(self.rescale_tail):
                    self.rescale_o(acc_O, row_scale)
                started = Boolean(True)
        if const_expr(self.o_buffer):
            # Every S = Q K^T of the unit has completed (each step waited for its S): the
            # next unit's Q may overwrite the buffer while P V and the epilogue run.
            pipeline_q.consumer_release(q_state)
            q_state.advance()
        if started:
            pipeline_v.consumer_wait(kv_state)
            v_stage = kv_state.index
            if const_expr(self.rescale_tail):
                v_stage = cute.arch.make_warp_uniform(v_stage)     # as in mma_step
            if const_expr(self.rescale_early):
                self.rescale_o(acc_O, row_scale)
            if const_expr(self.p_double):
                if p_par == 0:
                    issue_wgmma(wg_mma_pv, acc_O, tOrP, tOrV[None, None, None, v_stage], False)
                else:
                    issue_wgmma(wg_mma_pv, acc_O, tOrP1, tOrV[None, None, None, v_stage], False)
            else:
                issue_wgmma(wg_mma_pv, acc_O, tOrP, tOrV[None, None, None, v_stage], False)
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(kv_state)
            if const_expr(self.persistent):
                kv_state.advance()      # the ring's next slot belongs to the next unit

        self.epilogue(acc_O, row_max, row_sum, mO, mLSE, sO, tma_atom_o, tiled_mma_pv, tidx, seqlen_q,
                      q_tile, head, batch)
        if const_expr(self.persistent and not self.o_buffer):
            # The TMA store of O (warp 0 waited for its read of Q's buffer) is done with the
            # buffer: the producer may load the next unit's Q into it.
            pipeline_q.consumer_release(q_state)
            q_state.advance()
        return q_state, kv_state

    @cute.jit
    def ragged_tile(self, n_k_tiles, seqlen_k):
        """The row's last key tile when Nk is not a multiple of the tile (always masked: its
        keys past Nk), else n_k_tiles (no tile)."""
        return n_k_tiles if seqlen_k % self.block_kv == 0 else n_k_tiles - 1

    @cute.jit
    def list_tile(self, entry, ragged_tile):
        """(key tile, whether it needs the mask) of a work-list entry: tile index in the low
        16 bits, the masked flag above; the ragged last tile is always masked."""
        k_tile = entry & Int32(0xFFFF)
        return k_tile, (entry >> Int32(16) != Int32(0)) | (k_tile == ragged_tile)

    @cute.jit
    def step_either(self, needs_mask, kv_state, k_tile, step_args):
        """``mma_step`` for a masked or a full tile (a run-time choice between the two
        compiled bodies); returns the advanced ring state."""
        if needs_mask:
            kv_state = self.mma_step(kv_state, k_tile, True, *step_args)
        else:
            kv_state = self.mma_step(kv_state, k_tile, False, *step_args)
        return kv_state

    @cute.jit
    def first_either(self, needs_mask, kv_state, k_tile, first_args):
        """``mma_first`` for a masked or a full first tile."""
        if needs_mask:
            self.mma_first(kv_state, k_tile, *first_args, True)
        else:
            self.mma_first(kv_state, k_tile, *first_args, False)

    @cute.jit
    def mma_first(self, kv_state, k_tile, wg_mma_qk, tSrQ, tSrK, tOrP, tScS, row_max, row_sum,
                  row_intervals, seqlen_k, pipeline_k, masked: cutlass.Constexpr[bool] = True):
        """S of the first visited tile, softmax, P into registers; its P@V waits for the next step."""
        acc_S = cute.make_rmem_tensor(wg_mma_qk.partition_shape_C((self.block_q, self.block_kv)), Float32)
        pipeline_k.consumer_wait(kv_state)
        k_stage = kv_state.index
        if const_expr(self.rescale_tail):
            k_stage = cute.arch.make_warp_uniform(k_stage)     # as in mma_step
        issue_wgmma(wg_mma_qk, acc_S, tSrQ[None, None, None, 0], tSrK[None, None, None, k_stage], True)
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(kv_state)
        acc_S_rows = _rows_view(acc_S)
        if const_expr(self.softcap is not None):
            self.apply_softcap(acc_S)
        if const_expr(masked):
            self.apply_mask(acc_S_rows, tScS, k_tile, row_intervals, seqlen_k)
        self.online_softmax(acc_S_rows, row_max, row_sum, None)
        tOrP.store(_as_a_operand(acc_S).load().to(self.dtype))

    @cute.jit
    def mma_step(self, kv_state, k_tile, masked: cutlass.Constexpr[bool], wg_mma_qk, wg_mma_pv,
                 tSrQ, tSrK, tOrV, tOrP, acc_O, tScS, row_max, row_sum, row_intervals, seqlen_k,
                 pipeline_k, pipeline_v, wg, row_scale=None, tOrP_next=None):
        """S_t = Q K_t^T is issued before O += P_{t-1} V_{t-1}; softmax of S_t overlaps that GEMM.
        With ``rescale_tail`` the row factors go to ``row_scale`` and the caller rescales O; with
        ``rescale_early`` O is rescaled by ``row_scale`` (the last step's factors) before this
        step's P V issue, and the softmax leaves this step's factors there."""
        v_state = kv_state.clone()
        kv_state.advance()
        acc_S = cute.make_rmem_tensor(wg_mma_qk.partition_shape_C((self.block_q, self.block_kv)), Float32)
        if const_expr(not self.operands_early):
            pipeline_k.consumer_wait(kv_state)
            self.sched_wait(wg)
        k_stage, v_stage = kv_state.index, v_state.index
        if const_expr(self.rescale_tail):
            # Stage indices marked warp-uniform: with O's rescale in the loop's tail ptxas
            # otherwise kept them in vector registers and moved every GMMA descriptor over
            # (32 R2UR per tile).
            k_stage = cute.arch.make_warp_uniform(k_stage)
            v_stage = cute.arch.make_warp_uniform(v_stage)
        tQ, tK = tSrQ[None, None, None, 0], tSrK[None, None, None, k_stage]
        if const_expr(self.operands_early):
            tV = tOrV[None, None, None, v_stage]
            pipeline_k.consumer_wait(kv_state)
            self.sched_wait(wg)
        issue_wgmma(wg_mma_qk, acc_S, tQ, tK, True)
        pipeline_v.consumer_wait(v_state)
        if const_expr(self.rescale_early):
            # The previous step's factors (its P V is done: it waited for it); this S holds
            # the tensor pipe meanwhile. After V's wait, whose branch keeps ptxas from
            # hoisting the FMULs above the S GEMM's issue (before it, 20 of them sat between
            # the scheduler barrier and the first HGMMA).
            self.rescale_o(acc_O, row_scale)
        if const_expr(not self.operands_early):
            tV = tOrV[None, None, None, v_stage]
        issue_wgmma(wg_mma_pv, acc_O, tOrP, tV, False)
        self.sched_signal(wg)
        warpgroup.wait_group(1)
        pipeline_k.consumer_release(kv_state)
        acc_S_rows = _rows_view(acc_S)
        if const_expr(self.softcap is not None):
            self.apply_softcap(acc_S)
        if const_expr(masked):
            self.apply_mask(acc_S_rows, tScS, k_tile, row_intervals, seqlen_k)
        if const_expr(not self.carries_row_scale):
            row_scale = cute.make_rmem_tensor(row_max.shape, Float32)
        self.online_softmax(acc_S_rows, row_max, row_sum, row_scale)
        if const_expr(tOrP_next is not None):
            # p_double: this P into the other buffer while P V reads this one; the wait
            # guards only V's release and O's rescale.
            tOrP_next.store(_as_a_operand(acc_S).load().to(self.dtype))
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(v_state)
        else:
            warpgroup.wait_group(0)
            pipeline_v.consumer_release(v_state)
            tOrP.store(_as_a_operand(acc_S).load().to(self.dtype))
        if const_expr(not self.carries_row_scale):
            self.rescale_o(acc_O, row_scale)
        return kv_state

    @cute.jit
    def rescale_o(self, acc_O, row_scale):
        """O *= the row factors of the last softmax step (O's P V of that step done)."""
        acc_O_rows = _rows_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(acc_O_rows, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_O_rows, mode=[1])):
                acc_O_rows[r, c] = acc_O_rows[r, c] * row_scale[r]

    @cute.jit
    def sched_wait(self, wg):
        cute.arch.barrier(barrier_id=_BARRIER_SCHED_WG1 + wg, number_of_threads=2 * self.threads_per_wg)

    @cute.jit
    def sched_signal(self, wg):
        cute.arch.barrier_arrive(barrier_id=_BARRIER_SCHED_WG1 + 1 - wg, number_of_threads=2 * self.threads_per_wg)

    # ------------------------------------------------------------- masking, softmax
    @cute.jit
    def apply_softcap(self, acc_S):
        """S -> t = tanh(scale * S / cap) in place; the exp2 scale is cap * log2(e).

        Default: tanh(y) = 1 - 2 / (2^(2 y log2 e) + 1) with ex2.approx (about 2 ulp) and
        rcp.approx (1 ulp), so |t error| stays below ~4e-7 and the logit error below
        cap * 4e-7: the LSE meets the tolerance policy (2x the error of a dense
        computation whose logits are exact fp32, + 1e-5). Saturates cleanly: 2^y = inf
        gives rcp 0 and t = 1; 2^y = 0 gives t = -1. Costs 2 MUFU ops per score on top
        of the softmax's exp2.
        `softcap_fast_tanh`: one tanh.approx.f32 (1 MUFU op), whose error the PTX ISA
        gives as 2^-10.987 relative, i.e. a logit error up to about cap * 5e-4. That is
        far beyond the LSE bound of the policy, so the tests and the registry use the
        default; the flag exists to measure what the accuracy costs.
        """
        if const_expr(self.softcap_fast_tanh):
            pre = Float32(self.scale / self.softcap)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * pre, approx=True)
        else:
            pre = Float32(2.0 * _LOG2_E * self.scale / self.softcap)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                e = cute.math.exp2(acc_S[i] * pre, fastmath=True)
                acc_S[i] = Float32(1.0) - Float32(2.0) * cute.arch.rcp_approx(e + Float32(1.0))

    @cute.jit
    def load_intervals(self, tScS, mIntervals, q_tile, seqlen_q, mask_batch, mask_head):
        """(starts, lengths) [rows, K] of this thread's rows; rows past Nq see nothing."""
        num_rows = cute.size(tScS, mode=[0])
        starts = cute.make_rmem_tensor((num_rows, self.num_intervals), Int32)
        lengths = cute.make_rmem_tensor((num_rows, self.num_intervals), Int32)
        for r in cutlass.range_constexpr(num_rows):
            row = q_tile * self.block_q + tScS[r, 0][0]
            in_range = row < seqlen_q
            safe_row = row if in_range else 0
            for m in cutlass.range_constexpr(self.num_intervals):
                starts[r, m] = mIntervals[mask_batch, mask_head, safe_row, m, 0]
                length = mIntervals[mask_batch, mask_head, safe_row, m, 1]
                lengths[r, m] = length if in_range else 0
        return starts, lengths

    @cute.jit
    def load_residual_rows(self, tScS, mIntervals, q_tile, seqlen_q, mask_batch, mask_head, mRegion,
                           mParams):
        """(starts, lengths, regions) of this thread's rows, for ``residual_regs``: the table
        entries apply_mask_residual_words reads, as load_intervals gives them (rows past Nq
        with zero lengths: their words are cleared either way)."""
        starts, lengths = self.load_intervals(tScS, mIntervals, q_tile, seqlen_q, mask_batch, mask_head)
        num_rows = cute.size(tScS, mode=[0])
        regions = cute.make_rmem_tensor(num_rows, Int32)
        for r in cutlass.range_constexpr(num_rows):
            row = q_tile * self.block_q + tScS[r, 0][0]
            regions[r] = mRegion[mask_batch, row if row < seqlen_q else 0]
        return starts, lengths, regions

    @cute.jit
    def apply_mask(self, acc_S_rows, tScS, k_tile, row_intervals, seqlen_k):
        """Set S to -inf where the key is past Nk or in none of the row's intervals.

        One subtraction and one unsigned compare per interval: uint32(j - start) < length
        covers start <= j < start + length, and a zero length never matches.
        `row_intervals` is (starts, lengths) in registers, or the table to load them from.
        """
        if const_expr(self.intervals_as_bits):
            self.apply_mask_bits(acc_S_rows, tScS, k_tile, row_intervals, seqlen_k)
            return
        if const_expr(self.intervals_in_registers):
            starts, lengths = row_intervals
        else:
            starts, lengths = self.load_intervals(tScS, *row_intervals)
        if const_expr(self.group_mask):
            self.apply_mask_groups(acc_S_rows, tScS, k_tile, starts, lengths, seqlen_k)
            return
        col0 = k_tile * self.block_kv
        for r in cutlass.range_constexpr(cute.size(acc_S_rows, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_S_rows, mode=[1])):
                col = col0 + tScS[r, c][1]
                visible = Boolean(False)
                for m in cutlass.range_constexpr(self.num_intervals):
                    visible = visible | _unsigned_lt(col - starts[r, m], lengths[r, m])
                keep = visible & (col < seqlen_k)
                acc_S_rows[r, c] = acc_S_rows[r, c] if keep else -Float32.inf

    @cute.jit
    def apply_mask_groups(self, acc_S_rows, tScS, k_tile, starts, lengths, seqlen_k):
        """apply_mask by column groups. In an SM90 accumulator a thread's columns of a row are
        pairs: column c of ``_rows_view`` sits at offset 8 * (c // 2) + c % 2 from the
        thread's first column (mode (column pair, group of 8, N) of the fragment, the N
        atoms adjacent). So for each of the pair's two columns u the groups an interval
        [s, e) covers are a run, g in [ceil((s - u) / 8), ceil((e - u) / 8)): per row and
        interval two clamped ends and a shifted difference per u build bit word u; each
        element then tests one bit. Columns past Nk are cleared the same way."""
        groups = cute.size(acc_S_rows, mode=[1]) // 2
        col0 = k_tile * self.block_kv
        if const_expr(self.slot_skip):
            self.apply_mask_groups_skip(acc_S_rows, tScS, col0, starts, lengths, seqlen_k, groups)
            return
        for r in cutlass.range_constexpr(cute.size(acc_S_rows, mode=[0])):
            base = col0 + tScS[r, 0][1]
            word0 = Uint32(0)
            word1 = Uint32(0)
            for m in cutlass.range_constexpr(self.num_intervals):
                s = starts[r, m] - base
                run0, run1 = _pair_runs(s, s + lengths[r, m], groups)
                word0 = word0 | run0
                word1 = word1 | run1
            self.mask_by_words(acc_S_rows, r, word0, word1, base, seqlen_k)

    @cute.jit
    def apply_mask_groups_skip(self, acc_S_rows, tScS, col0, starts, lengths, seqlen_k, groups):
        """apply_mask_groups with ``slot_skip``: slot by slot, the rows' runs only where the
        slot's interval reaches into [col0, col0 + block_kv) for some row of the warp."""
        n_rows = cute.size(acc_S_rows, mode=[0])
        col_end = col0 + self.block_kv
        words = cute.make_rmem_tensor((n_rows, 2), Uint32)
        for r in cutlass.range_constexpr(n_rows):
            words[r, 0] = Uint32(0)
            words[r, 1] = Uint32(0)
        for m in cutlass.range_constexpr(self.num_intervals):
            hit = Boolean(False)
            for r in cutlass.range_constexpr(n_rows):
                hit = hit | ((starts[r, m] < col_end) & (starts[r, m] + lengths[r, m] > col0))
            if cute.arch.vote_any_sync(hit):
                for r in cutlass.range_constexpr(n_rows):
                    s = starts[r, m] - (col0 + tScS[r, 0][1])
                    run0, run1 = _pair_runs(s, s + lengths[r, m], groups)
                    words[r, 0] = words[r, 0] | run0
                    words[r, 1] = words[r, 1] | run1
        for r in cutlass.range_constexpr(n_rows):
            self.mask_by_words(acc_S_rows, r, words[r, 0], words[r, 1], col0 + tScS[r, 0][1], seqlen_k)

    @cute.jit
    def mask_by_words(self, acc_S_rows, r, word0, word1, base, seqlen_k):
        """Row r of S kept where bit c // 2 of word c % 2 is set and the column is below Nk
        (apply_mask_groups' words; `base`: the thread's first column of the row); -inf
        elsewhere."""
        ncols = cute.size(acc_S_rows, mode=[1])
        below0, below1 = _pair_runs(Int32(0), seqlen_k - base, ncols // 2)
        word0 = word0 & below0
        word1 = word1 & below1
        if const_expr(self.mask_r2p):
            select_by_words(acc_S_rows, r, word0, word1, ncols // 2, -math.inf)
            return
        for c in cutlass.range_constexpr(ncols):
            word = word0 if const_expr(c % 2 == 0) else word1
            keep = word & Uint32(1 << (c // 2)) != Uint32(0)
            acc_S_rows[r, c] = acc_S_rows[r, c] if keep else -Float32.inf

    @cute.jit
    def apply_mask_bits(self, acc_S_rows, tScS, k_tile, row_intervals, seqlen_k):
        """apply_mask for any K: per row, a loop (not unrolled) over its K intervals read
        from the table; an interval that misses this key tile is skipped, one that reaches
        into it sets the bits of the columns it covers. Rows past Nq see nothing."""
        mIntervals, q_tile, seqlen_q, mask_batch, mask_head = row_intervals[:5]
        col0 = k_tile * self.block_kv
        col_end = col0 + self.block_kv
        ncols = cute.size(acc_S_rows, mode=[1])
        if const_expr(self.group_mask and self.residual is None):
            self.apply_mask_bits_groups(acc_S_rows, tScS, col0, col_end, row_intervals, seqlen_k)
            return
        if const_expr(self.residual_words):
            self.apply_mask_residual_words(acc_S_rows, tScS, col0, col_end, row_intervals, seqlen_k)
            return
        nwords = (ncols + 31) // 32
        seen = cute.make_rmem_tensor(nwords, Uint32)
        for r in cutlass.range_constexpr(cute.size(acc_S_rows, mode=[0])):
            row = q_tile * self.block_q + tScS[r, 0][0]
            in_range = row < seqlen_q
            safe_row = row if in_range else 0
            for w in cutlass.range_constexpr(nwords):
                seen[w] = Uint32(0)
            if const_expr(self.residual is not None):
                self.residual_bits(seen, acc_S_rows, tScS, r, row, safe_row, col0, col_end,
                                   row_intervals, seqlen_k)
            elif const_expr(self.num_intervals <= INTERVALS_UNROLLED):
                for m in cutlass.range_constexpr(self.num_intervals):
                    start = mIntervals[mask_batch, mask_head, safe_row, m, 0]
                    length = mIntervals[mask_batch, mask_head, safe_row, m, 1]
                    if (length > 0) & (start < col_end) & (start + length > col0):
                        for c in cutlass.range_constexpr(ncols):
                            if _unsigned_lt(col0 + tScS[r, c][1] - start, length):
                                seen[c // 32] = seen[c // 32] | Uint32(1 << (c % 32))
            else:
                for m in cutlass.range(self.num_intervals, unroll=self.interval_unroll):
                    start = mIntervals[mask_batch, mask_head, safe_row, m, 0]
                    length = mIntervals[mask_batch, mask_head, safe_row, m, 1]
                    if (length > 0) & (start < col_end) & (start + length > col0):
                        for c in cutlass.range_constexpr(ncols):
                            if _unsigned_lt(col0 + tScS[r, c][1] - start, length):
                                seen[c // 32] = seen[c // 32] | Uint32(1 << (c % 32))
            for c in cutlass.range_constexpr(ncols):
                col = col0 + tScS[r, c][1]
                keep = (seen[c // 32] & Uint32(1 << (c % 32)) != Uint32(0)) & in_range & (col < seqlen_k)
                acc_S_rows[r, c] = acc_S_rows[r, c] if keep else -Float32.inf

    @cute.jit
    def apply_mask_bits_groups(self, acc_S_rows, tScS, col0, col_end, row_intervals, seqlen_k):
        """apply_mask_bits with group_mask: an interval that reaches into the tile ORs its
        column-group runs into the row's two words (as apply_mask_groups) instead of testing
        each column; the K slots unrolled up to INTERVALS_UNROLLED, else a loop."""
        mIntervals, q_tile, seqlen_q, mask_batch, mask_head = row_intervals[:5]
        groups = cute.size(acc_S_rows, mode=[1]) // 2
        words = cute.make_rmem_tensor(2, Uint32)
        for r in cutlass.range_constexpr(cute.size(acc_S_rows, mode=[0])):
            row = q_tile * self.block_q + tScS[r, 0][0]
            in_range = row < seqlen_q
            safe_row = row if in_range else 0
            base = col0 + tScS[r, 0][1]
            words[0] = Uint32(0)
            words[1] = Uint32(0)
            if const_expr(self.num_intervals <= INTERVALS_UNROLLED):
                for m in cutlass.range_constexpr(self.num_intervals):
                    self.add_interval_runs(words, mIntervals, mask_batch, mask_head, safe_row, m,
                                           col0, col_end, base, groups)
            else:
                for m in cutlass.range(self.num_intervals, unroll=self.interval_unroll):
                    self.add_interval_runs(words, mIntervals, mask_batch, mask_head, safe_row, m,
                                           col0, col_end, base, groups)
            # Rows past Nq (their table row is row 0's) see nothing.
            self.mask_by_words(acc_S_rows, r, words[0] if in_range else Uint32(0),
                               words[1] if in_range else Uint32(0), base, seqlen_k)

    @cute.jit
    def apply_mask_residual_words(self, acc_S_rows, tScS, col0, col_end, row_intervals, seqlen_k):
        """A residual mask's masked tile (``residual_words``): per row, the slots without a
        predicate OR their column-group runs into one word pair, each slot with one into a
        pair of its own (add_interval_runs); below Nk and rows past Nq folded into the
        words; then per element: keep = plain bit | OR over predicate slots (bit & the
        slot's predicate at (row, column)). The same visibility as residual_bits."""
        mIntervals, q_tile, seqlen_q, mask_batch, mask_head, mRegion, mParams = row_intervals[:7]
        ops = CuteOps(mParams, mask_batch, seqlen_q, seqlen_k)
        ncols = cute.size(acc_S_rows, mode=[1])
        groups = ncols // 2
        pred_slots = [m for m in range(self.num_intervals) if self.residual.slots[m]]
        words = cute.make_rmem_tensor(2 * (1 + len(pred_slots)), Uint32)
        for r in cutlass.range_constexpr(cute.size(acc_S_rows, mode=[0])):
            row = q_tile * self.block_q + tScS[r, 0][0]
            in_range = row < seqlen_q
            safe_row = row if in_range else 0
            base = col0 + tScS[r, 0][1]
            if const_expr(self.residual_regs):
                region = row_intervals[7][2][r]
            else:
                region = mRegion[mask_batch, safe_row]
            for w in cutlass.range_constexpr(2 * (1 + len(pred_slots))):
                words[w] = Uint32(0)
            for m in cutlass.range_constexpr(self.num_intervals):
                pair = 0 if const_expr(m not in pred_slots) else 2 * (1 + pred_slots.index(m))
                if const_expr(self.residual_regs):
                    start = row_intervals[7][0][r, m]
                    length = row_intervals[7][1][r, m]
                else:
                    start = mIntervals[mask_batch, mask_head, safe_row, m, 0]
                    length = mIntervals[mask_batch, mask_head, safe_row, m, 1]
                if (length > 0) & (start < col_end) & (start + length > col0):
                    run0, run1 = _pair_runs(start - base, start - base + length, groups)
                    words[pair] = words[pair] | run0
                    words[pair + 1] = words[pair + 1] | run1
            below0, below1 = _pair_runs(Int32(0), seqlen_k - base, groups)
            below0 = below0 if in_range else Uint32(0)
            below1 = below1 if in_range else Uint32(0)
            for w in cutlass.range_constexpr(1 + len(pred_slots)):
                words[2 * w] = words[2 * w] & below0
                words[2 * w + 1] = words[2 * w + 1] & below1
            general = pred_slots
            if const_expr(self.residual_periodic):
                # Slots whose predicate has period 8 in k: once per row and column class.
                general = fold_periodic_slots(
                    words, pred_slots, self.periodic_slots,
                    lambda m, u: self.residual.emit_slot(ops, m, q=row, k=base + u, h=mask_head,
                                                         region=region))
            if const_expr(len(general) == 0):
                # Only the plain pair is left: word tests alone (R2P, as mask_r2p).
                select_by_words(acc_S_rows, r, words[0], words[1], groups, -math.inf)
            else:
                for c in cutlass.range_constexpr(ncols):
                    bit = Uint32(1 << (c // 2))
                    keep = words[c % 2] & bit != Uint32(0)
                    col = col0 + tScS[r, c][1]
                    for i, m in enumerate(pred_slots):
                        if const_expr(m in general):
                            hit = words[2 * (1 + i) + c % 2] & bit != Uint32(0)
                            keep = keep | (hit & self.residual.emit_slot(ops, m, q=row, k=col,
                                                                        h=mask_head, region=region))
                    acc_S_rows[r, c] = acc_S_rows[r, c] if keep else -Float32.inf

    @cute.jit
    def add_interval_runs(self, words, mIntervals, mask_batch, mask_head, row, m, col0, col_end,
                          base, groups):
        """ORs slot m's interval of `row` into `words` (rmem, 2) when it reaches into the
        key tile [col0, col_end)."""
        start = mIntervals[mask_batch, mask_head, row, m, 0]
        length = mIntervals[mask_batch, mask_head, row, m, 1]
        if (length > 0) & (start < col_end) & (start + length > col0):
            run0, run1 = _pair_runs(start - base, start - base + length, groups)
            words[0] = words[0] | run0
            words[1] = words[1] | run1

    @cute.jit
    def residual_bits(self, seen, acc_S_rows, tScS, r, row, safe_row, col0, col_end,
                      row_intervals, seqlen_k):
        """Row r's visibility bits of a residual mask: slot m's interval and, where the
        row's region has one there, its residual predicate (unrolled over the K slots; the
        predicate is emitted from its expression tree, lower/residual_program.py)."""
        mIntervals, _, seqlen_q, mask_batch, mask_head, mRegion, mParams = row_intervals[:7]
        ops = CuteOps(mParams, mask_batch, seqlen_q, seqlen_k)
        region = mRegion[mask_batch, safe_row]
        for m in cutlass.range_constexpr(self.num_intervals):
            start = mIntervals[mask_batch, mask_head, safe_row, m, 0]
            length = mIntervals[mask_batch, mask_head, safe_row, m, 1]
            if (length > 0) & (start < col_end) & (start + length > col0):
                for c in cutlass.range_constexpr(cute.size(acc_S_rows, mode=[1])):
                    col = col0 + tScS[r, c][1]
                    hit = _unsigned_lt(col - start, length)
                    if const_expr(len(self.residual.slots[m]) > 0):
                        hit = hit & self.residual.emit_slot(ops, m, q=row, k=col, h=mask_head,
                                                            region=region)
                    if hit:
                        seen[c // 32] = seen[c // 32] | Uint32(1 << (c % 32))

    @cute.jit
    def online_softmax(self, acc_S_rows, row_max, row_sum, row_scale):
        """Scores -> unnormalised probabilities in place; row_scale (None on the first
        tile) receives the factor that rescales the running O and sum."""
        scale_log2 = Float32(self.scale_log2)
        n_cols = cute.size(acc_S_rows, mode=[1])
        # 8 lanes for 32 columns (block_kv 128); 4 for the 20 of block_kv 80.
        lanes = next(n for n in (8, 4, 2, 1) if n_cols % n == 0)
        for r in cutlass.range_constexpr(cute.size(acc_S_rows, mode=[0])):
            # 8 independent max chains, then a tree: a single chain of 63 dependent
            # FMNMX sat on the softmax critical path.
            parts = []
            for c in cutlass.range_constexpr(lanes):
                parts.append(acc_S_rows[r, c])
            for c in cutlass.range_constexpr(lanes, n_cols):
                parts[c % lanes] = cute.arch.fmax(parts[c % lanes], acc_S_rows[r, c])
            m = _tree(parts, cute.arch.fmax)
            # The 4 threads of a quad hold one row between them.
            m = cute.arch.warp_reduction_max(m, threads_in_group=4)
            m_prev = row_max[r]
            if const_expr(row_scale is not None):
                m = cute.arch.fmax(m, m_prev)
            row_max[r] = m
            # A row with nothing visible yet keeps max -inf; offset 0 makes its P exactly 0.
            m_scaled = Float32(0.0) if m == -Float32.inf else m * scale_log2
            sums = []
            for c in cutlass.range_constexpr(n_cols):
                p = cute.math.exp2(acc_S_rows[r, c] * scale_log2 - m_scaled, fastmath=True)
                acc_S_rows[r, c] = p
                if const_expr(c < lanes):
                    sums.append(p)
                else:
                    sums[c % lanes] = sums[c % lanes] + p
            s = _tree(sums, lambda a, b: a + b)
            if const_expr(row_scale is not None):
                factor = cute.math.exp2(m_prev * scale_log2 - m_scaled, fastmath=True)
                row_scale[r] = factor
                row_sum[r] = row_sum[r] * factor + s
            else:
                row_sum[r] = s

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def epilogue(self, acc_O, row_max, row_sum, mO, mLSE, sQ, tma_atom_o, tiled_mma_pv, tidx, seqlen_q,
                 q_tile, head, batch):
        """Normalise O by the row sum; O goes registers -> smem (Q's buffer) -> one TMA store,
        the natural-log LSE straight to global. Rows past Nq are dropped (TMA clips them)."""
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        acc_O_rows = _rows_view(acc_O)
        tOcO = _rows_view(thr_mma_pv.partition_C(cute.make_identity_tensor((self.block_q, self.head_dim_v))))
        lse = cute.make_rmem_tensor(row_sum.shape, Float32)
        for r in cutlass.range_constexpr(cute.size(acc_O_rows, mode=[0])):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            empty = total == Float32(0.0)
            inv = Float32(0.0) if empty else cute.arch.rcp_approx(total)
            lse[r] = (-Float32.inf if empty
                      else (row_max[r] * Float32(self.scale_log2) + cute.math.log2(total, fastmath=True)) * Float32(_LN_2))
            for c in cutlass.range_constexpr(cute.size(acc_O_rows, mode=[1])):
                acc_O_rows[r, c] = acc_O_rows[r, c] * inv
        for r in cutlass.range_constexpr(cute.size(acc_O_rows, mode=[0])):
            row = q_tile * self.block_q + tOcO[r, 0][0]
            if tOcO[r, 0][1] == 0 and row < seqlen_q:
                mLSE[batch, head, row] = lse[r]

        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        if const_expr(self.o_buffer):
            # The previous unit's O store must have read the buffer before it is rewritten
            # (its issuing warp waits; the barrier tells the others).
            if tidx // 32 == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=_BARRIER_EPILOGUE, number_of_threads=self.num_consumer_wgs * self.threads_per_wg)
        # Each warpgroup overwrites only its own 64 Q rows, which its own (finished)
        # wgmmas were the last to read; stmatrix writes 8x8 blocks, conflict-free on
        # the 128B swizzle.
        sO = sQ[None, None, 0]
        smem_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
            tiled_mma_pv,
        ).get_slice(tidx)
        cute.copy(smem_store, smem_store.retile(rO), smem_store.partition_D(sO))
        # Generic-proxy smem writes must be fenced before the TMA (async proxy) reads them.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BARRIER_EPILOGUE, number_of_threads=self.num_consumer_wgs * self.threads_per_wg)
        if tidx // 32 == 0:
            gO = cute.local_tile(mO[None, None, head, batch], (self.block_q, self.head_dim_v), (q_tile, 0))
            tOsO, tOgO = tma_tiles(tma_atom_o, sQ, gO)
            cute.copy(tma_atom_o, tOsO[None, 0], tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.o_buffer):
                # The CTA's shared memory must outlive the store's reads of it (o_buffer: the
                # next epilogue waits, and run_units after the last).
                cute.arch.cp_async_bulk_wait_group(0, read=True)
