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
    dQ_m = dS K                  (dS^T stored to shared memory; wgmma; added to global)
    dK  += dS^T Q                (wgmma, dS^T from registers)

A partial tile (mask bit) — and a ragged last query or key tile — checks each element:
with the column view exact for this sequence (`bwd_exact[b]`), `uint32(i - start) <
uint32(length)` over the key's Kc query intervals, which each thread loads once for its
two keys; otherwise the forward row intervals of each query (the same check, over the
row's K key intervals). dK is scaled by the softmax scale at the end; dQ leaves as an
fp32 accumulator that the caller un-permutes, scales and casts.

Warp roles. Warpgroup 0: warp 0 loads (TMA: K and V once, then per visited tile Q with
its lse and dO with its delta into a `num_stages` ring); warp 1 writes dQ (per tile and
dQ warpgroup, one `cp.reduce.async.bulk ... add.f32` of the warpgroup's float32 dQ tile
from shared memory into the tile's global slot). Warpgroups 1 and 2 compute, each owning
64 of the 128 keys for S / dP / dK / dV and half of the head dims for dQ (which needs
both halves of dS: a named barrier; at D = 64 the first computes dQ alone; with 128-query
tiles, ``BackwardConfig.block_q=128`` at D 64, each computes dQ for 64 of the queries).

Per tile a consumer warpgroup issues S^T and dP^T, reads lse / delta from shared memory
while they run, waits S^T (P^T, mask), waits dP^T (dS^T), issues dV, stores dS^T into
one of two buffers, meets the other warpgroup once (DS_READY), issues dQ then dK, waits
dV and dQ, hands its dQ tile to the dQ warp (DQ_FULL; DQ_EMPTY guards the buffer), waits
dK and frees the Q / dO stage. Two dS buffers make one barrier per tile enough: a
warpgroup writing tile t + 1's dS has passed tile t's DS_READY, which the other reached
only after its dQ product of tile t - 1 (the same buffer) completed. With
``BackwardConfig.wg_dq`` (opt-in) there is no DS_READY: each warpgroup computes dQ over its
own 64 keys for all of D (two halves), warpgroup 0 stores each half into the shared dQ tile
and warpgroup 1 adds its own to it before the dQ warp's reduce-add (``wg_dq_and_dk``).

The static shape (tiles, stages, dS buffers, early statistics) and the options still to
be measured on the H200 (deterministic dQ order, a shared work list instead of three
walks of the tile words, dK / dV by TMA store, ...) are `api.BackwardConfig`.
Validated on the H200 (tests/gpu/test_cute_backward.py, tests/gpu/test_cute_head_dims.py,
tests/gpu/test_cute_any_k.py, tests/gpu/test_cute_residual.py); the cute backend uses it
by default for every configuration the CuTe forward runs but D 192 / Dv 128 with a soft
cap (`backends.cute_backward_reason` says why not; JCOMPILEMASK_CUTE_BACKWARD=0 turns it
off): D 64 / 128, a soft cap (P recomputed from t = tanh(scale s / cap), dS^T multiplied
by 1 - t^2 in registers; `softcap_tanh`, `softcap_probs`), and D 256 / 192 through
`BackwardConfig.split_dkv`: 64 x 64 tiles whose 64 keys both consumer warpgroups own, each
computing its half of D for dK, dV and dQ (dK + dV of 64 keys x 256 would not fit one
warpgroup's registers; ``split_sdp`` splits S^T / dP^T by queries at D 256).
"""

from __future__ import annotations

import enum
import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.memory as cutlass_memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Boolean, Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .api import (BackwardConfig, backward_grad_scale, dq_splits_queries, dq_warpgroups,
                  stats_shfl_query, stats_shfl_source)
from .residual_ops import CuteOps
from .common import (COLUMNS_UNROLLED, INTERVALS_UNROLLED, WarpSpecializedSm90, _as_a_operand,
                     build_tile_list, first_listed_tile, list_first_word, _pair_runs, _rows_view, _unsigned_lt,
                     bulk_reduce_add_f32, exp2_fma, issue_wgmma, rcp_fma, ld_acquire_s32, ld_pair_s32, red_add_v4_f32,
                     nanosleep, red_release_add_s32, select_by_words, fold_periodic_slots, smem_tensor, tile_bits, tma_tiles)
from .exp2_fma import emulated_column

_LOG2_E = math.log2(math.e)


class Bar(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads). DQ_FULL + w / DQ_EMPTY + w exist per dQ
    warpgroup w: its 128 threads and the dQ warp's 32 meet there."""

    DS_READY = 1    # both consumer warpgroups stored their half of this tile's dS^T
    DS_FREE = 2     # ds_stages == 1: both finished the previous tile's dQ product
    DQ_FULL = 3     # 3, 4: warpgroup w's dQ tile is in shared memory (consumers arrive)
    DQ_EMPTY = 5    # 5, 6: the dQ warp's bulk reduce-add has read it (the dQ warp arrives)
    EPILOGUE = 7    # dkv_tma_store: both consumer warpgroups are done with K / V, then
                    # have written dK / dV into their buffers; wg_dq_offset, once before the
                    # first tile: warpgroup 0 made its first dS^T (warpgroup 1 then starts)
    LIST_READY = 8  # 8, 9 (per list buffer): the producer warp built the work list (for the
                    # consumer warpgroups)
    LIST_FREE = 10  # 10, 11: every reader (consumers, dQ warp) is done with it
    LIST_READY_DQ = 12  # 12, 13: the same list, for the dQ warp. A barrier generation is
                        # waited on from one instruction only (bar.sync is .aligned): the
                        # consumers' and the dQ warp's waits sit at different instructions,
                        # which compute-sanitizer's synccheck reports as divergent.
    P_READY = 14    # 14, 15 (per consumer warpgroup; dkv_swap with dv_early): the warpgroup
                    # stored its keys' P, which its dV^T reads; with dk_late: it zeroed its
                    # keys' rows of a dS^T stage, which its first dK of a chunk reads; with
                    # wg_dq: it stored its keys' rows of dS^T, which its own dQ part reads
    # wg_dq (no DS_READY, and ds_stages == 2: no DS_FREE) reuses ids 1 and 2: DQ_HALF + h,
    # warpgroup 0 stored its partial dQ of D half h (it arrives), which warpgroup 1 then
    # adds to (it waits).
    DQ_HALF = 1


class FlashBackwardSm90(WarpSpecializedSm90):
    """Backward attention over a tile-state descriptor (SM90).

    Inputs of ``__call__`` (layouts of ``jax.nn.dot_product_attention``):
      mQ [B, Nq, Hq, D], mK [B, Nk, Hkv, D], mV [B, Nk, Hkv, D], mdO [B, Nq, Hq, D] (dtype);
      mLSE2 float32 [B, Hq, Nq']: lse * log2(e), +inf for rows that see nothing;
      mDelta float32 [B, Hq, Nq']: rowsum(dO * O) (minus the lse cotangent); both padded to
        Nq' = ceil(Nq / block_q) * block_q (+inf / 0), TMA'd with each Q / dO tile;
      mBwdIntervals int32 [Bm, Hm, Nk, Kc, 2]; mBwdTiles uint32 [Bm, Hm, Tk, W];
      mFwdIntervals int32 [Bm, Hm, Nq, K, 2]; mBwdExact int32 [Bm];
      mDqRank int32 [Bm, Hm, Tk, Tq] (``config.deterministic``; else any shape): per key
        tile and query tile, how many lower key tiles visit that query tile;
    mdQinit, mSemInit: the zeroed dQ accumulator and semaphores as inputs (XLA aliases them
      to mdQaccum / mSem; unused);
    outputs mdQaccum float32 [B, Hq, Tq, block_q * D] (zero on entry; receives dS K,
      unscaled, in `api.dq_fragment_unpermute` order), mSem int32 [B, Hq, Tq]
      (deterministic: per query tile the number of key tiles that added to it),
      mdK, mdV [B, Nk, Hkv, D] (dtype).
    """

    dq_writer_warp = 1          # the warp of warpgroup 0 that issues the dQ reduce-adds

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        num_intervals: int,
        num_bwd_intervals: int,
        scale: float,
        config: BackwardConfig,
        *,
        broadcast_batch: bool = False,
        broadcast_head: bool = False,
        softcap: float | None = None,
        head_dim_v: int | None = None,
        residual=None,
        exact_columns: bool = False,
    ):
        assert dtype in (cutlass.BFloat16, cutlass.Float16), dtype
        assert softcap is None or softcap > 0
        # exact_columns: the mask's column view is exact for every input (one region: no
        # run-time nesting), so masked tiles never take the row path (bwd_exact ignored).
        self.exact_columns = exact_columns and num_bwd_intervals > 0
        # Residual predicates (lower/residual_program.py; (forward, column) programs over
        # one parameter table): partial tiles AND each slot's interval with its residual,
        # the slots unrolled; the kernel then also reads the rows' regions and the table.
        self.residual = None
        if residual is not None and not (residual[0].exact and residual[1].exact):
            self.residual = residual
        # split_dkv: both consumer warpgroups own the same 64 keys (each computes all of S^T
        # and dP^T, and half of dK / dV's head dims); else each owns 64 of the tile's keys.
        self.split_dkv = config.split_dkv
        # dkv_swap (D 192 / Dv 128): the queries are the rows of S / dP (S = Q K^T), each
        # warpgroup owns 48 of 96 keys, dK^T / dV^T accumulate from P / dS in shared memory.
        self.dkv_swap = config.dkv_swap
        # entry_ahead: each tile's step reads the next work-list entry (needs the list).
        self.entry_ahead = config.work_list and config.entry_ahead
        wg_keys = 48 if self.dkv_swap else 64
        assert config.block_kv == (64 if self.split_dkv else wg_keys * self.num_consumer_wgs), \
            "each consumer warpgroup owns 64 keys (split_dkv: the same 64; dkv_swap: 48)"
        # 128-query tiles (D 64): each dQ warpgroup takes 64 of the queries (one m64 wgmma
        # row block, all of D), so dQ still leaves in one m64 wgmma's fragment order.
        self.dq_split_q = dq_splits_queries(config.block_q, self.num_consumer_wgs)
        assert config.block_q == 64 or (self.dq_split_q and not self.split_dkv), \
            "dQ leaves in the fragment order of one m64 wgmma per warpgroup"
        assert head_dim % 32 == 0, "head dims 64, 96 (dQ halves in 32B atoms), 128, 192, 256"
        assert num_intervals >= 1 and num_bwd_intervals >= 0
        self.dtype = dtype
        self.head_dim = head_dim
        # Dv != D (192 / 128): V, dO and dV are (rows, Dv) buffers and dV its own tiled MMA.
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        assert self.head_dim_v == head_dim or (
            (config.split_dkv or config.dkv_swap) and config.dkv_tma_store), \
            "Dv != D runs split_dkv or dkv_swap with the TMA epilogue"
        self.num_intervals = num_intervals
        self.num_bwd_intervals = num_bwd_intervals
        self.scale = float(scale)
        self.scale_log2 = float(scale) * _LOG2_E
        # Soft cap: logit = cap * t, t = tanh(scale * s / cap); P = exp2(t * cap log2 e - lse2)
        # and dlogit / ds = scale * (1 - t^2) (the scale is applied to dQ / dK at the end).
        self.softcap = None if softcap is None else float(softcap)
        self.config = config
        # dK's epilogue factor, the one cute_backward applies to dQ after the kernel.
        self.grad_scale = backward_grad_scale(scale, self.softcap, config)
        self.block_q = config.block_q
        self.block_kv = config.block_kv
        self.num_stages = config.num_stages
        self.broadcast_batch = broadcast_batch
        self.broadcast_head = broadcast_head
        self.dq_wgs = dq_warpgroups(head_dim, self.num_consumer_wgs, config.block_q)
        # Warpgroups that tile S^T / dP^T (split_dkv: one tile, computed by both), and the
        # dK / dV tiling: along keys (64 per warpgroup) or, with split_dkv, along D.
        # split_sdp (with split_dkv): each warpgroup computes S^T / dP^T for half of the
        # tile's queries; P^T and dS^T go through shared memory for dV / dK (both halves).
        self.split_sdp = config.split_sdp
        # The whole S^T / dP^T tile in each warpgroup (split_dkv without split_sdp).
        self.sdp_shared = self.split_dkv and not self.split_sdp
        # P (P^T) through its own shared buffer, beside dS (dS^T), for dV.
        self.p_in_smem = self.split_sdp or self.dkv_swap
        # S^T / dP^T tiling: (64 keys, all queries) per warpgroup along the keys (one atom
        # with split_dkv), or with split_sdp the warpgroups split the queries of 64 keys.
        if self.split_sdp:
            self.sdp_atoms = (1, self.num_consumer_wgs, 1)
            self.sdp_tile = (64, config.block_q // self.num_consumer_wgs)
        elif self.dkv_swap:
            # (64 queries, 48 keys) per warpgroup, the keys split along N.
            self.sdp_atoms = (1, self.num_consumer_wgs, 1)
            self.sdp_tile = (config.block_q, wg_keys)
        else:
            self.sdp_atoms = (1 if self.split_dkv else self.num_consumer_wgs, 1, 1)
            self.sdp_tile = (64, config.block_q)
        # Where dV += P^T dO is issued in a tile (one operand either way, ``issue_dv``):
        # with dv_early in softmax_grad before the dP^T wait; by default before dS^T is
        # converted; with ds_first between the dS^T stores and their fence; with split_sdp
        # after DS_READY (P^T of both halves in shared memory).
        # dv_split (soft cap only): in pieces along the queries, each issued in
        # ``probabilities`` once its columns' P^T is made.
        self.dv_split = config.dv_split if softcap is not None else 0
        # dk_split (with dv_split): each piece's dS^T made once dP^T is done, and its k-blocks
        # of dK issued at once, before the DS_READY barrier (dQ is then the tile's last GEMM).
        self.dk_split = config.dk_split and self.dv_split > 0
        # dk_late: tile j's dK issued in tile j + 1 after its S^T / dP^T (one more wgmma
        # group in flight at the S^T and dP^T waits).
        self.dk_late = config.dk_late
        self.late_groups = 1 if config.dk_late else 0
        # wg_dq: each consumer warpgroup computes dQ over its own 64 keys for all of D (two
        # halves, one at a time), summed in the shared dQ tile (warpgroup 0 stores, 1 adds):
        # no DS_READY, the warpgroups meet only at that sum.
        self.wg_dq = config.wg_dq
        if config.wg_dq and (self.dq_wgs != 2 or self.dq_split_q or self.split_dkv or self.dkv_swap):
            raise ValueError(
                f"wg_dq (dQ per warpgroup over its own keys, summed in shared memory) needs two "
                f"dQ warpgroups splitting D with 64-query tiles and keys split across the "
                f"warpgroups (D 128: head_dim={head_dim}, block_q={config.block_q}); set wg_dq=0")
        self.dv_at = ("split" if self.dv_split else "early" if config.dv_early
                      else "after_ready" if self.split_sdp or self.dkv_swap
                      else "after_stores" if config.ds_first else "before_ds")
        # The halves of D (dK, dQ) and of Dv (dV) start at a column of K's / Q's / dO's
        # buffers seen MN-major, which must begin a swizzle atom: 128B atoms (64 elements)
        # when the half is a multiple of 64, else (D 192: halves of 96) 64B atoms for Q and K.
        self.qk_sw64 = False
        self.qk_sw32 = False
        if self.dkv_swap:
            # dK^T / dV^T: (D or Dv, this warpgroup's 48 keys), M repeated over D / Dv;
            # dQ's halves of D (96 columns) start 64B atoms of K's buffer (and Q's).
            self.qk_sw64 = (head_dim // self.num_consumer_wgs) % 64 != 0
            self.dkv_atoms, self.dkv_tile = (1, self.num_consumer_wgs, 1), (64, wg_keys)
            self.dv_tile = self.dkv_tile
        elif self.split_dkv:
            half, half_v = head_dim // self.num_consumer_wgs, self.head_dim_v // self.num_consumer_wgs
            assert half_v % 64 == 0 and half % 32 == 0, "D / Dv halves must start swizzle atoms"
            self.qk_sw64 = half % 64 != 0
            self.dkv_atoms, self.dkv_tile = (1, self.num_consumer_wgs, 1), (64, half)
            self.dv_tile = (64, half_v)
        else:
            self.dkv_atoms, self.dkv_tile = (self.num_consumer_wgs, 1, 1), (64, head_dim)
            self.dv_tile = self.dkv_tile
            # D 96: dQ's halves of 48 columns start 32B atoms (16 elements) of K's buffer.
            half = head_dim // self.num_consumer_wgs
            self.qk_sw32 = self.dq_wgs == 2 and not self.dq_split_q and half % 32 != 0
        self.dq_single_wg = self.dq_wgs == 1
        # Floats of one dQ warpgroup's tile (block_q x D / dq_wgs) and its float4 chunks
        # (its D columns / 8: with dq_split_q a warpgroup's 64 queries take all of D).
        self.dq_wg_floats = self.block_q * head_dim // self.dq_wgs
        self.dq_cols = head_dim if self.dq_split_q else head_dim // self.dq_wgs
        self.dq_chunks = self.dq_cols // 8
        # A key's Kc column intervals stay in registers for the whole pass only up to
        # config.column_registers; above it they are re-read (L1-resident: the same 2 x Kc
        # pairs every tile) in each masked tile. At Kc = 7 (clear) holding them makes the
        # masked tile body spill (280 B of stack at D = 128; re-read: 48 B).
        self.hold_columns = num_bwd_intervals <= config.column_registers
        # Above config.column_bits, re-read intervals are tested one at a time against all
        # of a row's columns, visibility gathered in a bit mask (2 live values, not 2 x Kc).
        # Any K: past COLUMNS_UNROLLED re-read column intervals (INTERVALS_UNROLLED row
        # intervals in the no-column-view path) the masked tile loops over them without
        # unrolling and skips those that miss the tile. (Held intervals: unrolled at any Kc.)
        self.column_bits = not self.hold_columns and (
            num_bwd_intervals > config.column_bits or num_bwd_intervals > COLUMNS_UNROLLED)
        self.columns_looped = self.column_bits and num_bwd_intervals > COLUMNS_UNROLLED
        # row_mask: partial tiles are tested against the forward row intervals (K per query
        # column, as where the column view is not exact) instead of the column view (Kc per
        # key): fewer tests per element where K < Kc (shared prompt: K 2, Kc 13).
        self.row_mask = config.row_mask and residual is None
        # dkv_swap: a thread holds 2 query rows of 12 keys, so partial tiles always test the
        # rows' forward intervals (``mask_query_rows``); the column view is not read.
        self.query_rows = self.dkv_swap
        # column_words (issue 16; the D 128 default since session 23): masked tiles of the column
        # view build each key row's visibility as column-group words (mask_by_column_words).
        self.column_words = config.column_words and not self.row_mask
        # Its column slots with a residual predicate (each keeps a word pair per key row).
        self.column_pred_slots = [] if residual is None else \
            [m for m in range(num_bwd_intervals) if residual[1].slots[m]]
        # residual_periodic (issue 16, the D 128 default since session 25): a column slot whose predicate
        # lower/residual_program.column_periodic proves 8-periodic in q (the dilated window's
        # (q - k) % 2 == 0) is evaluated once per key row and column class, not per element.
        self.periodic_slots = () if residual is None else residual[1].periodic_slots()
        self.residual_periodic = (config.residual_periodic and self.column_words
                                  and any(self.periodic_slots))
        # ds_words (opt-in; BackwardConfig.ds_words): where the masked tile's visibility is
        # word tests only (no predicate slot left per element, no soft cap), the words go on
        # to dS^T, whose masked pairs the same selects zero, instead of the P == 0 guard.
        per_element = [m for m in self.column_pred_slots
                       if not (self.residual_periodic and self.periodic_slots[m])]
        self.ds_words = (config.ds_words and self.column_words and not per_element
                         and self.softcap is None)
        if self.row_mask or self.query_rows:
            self.hold_columns = self.column_bits = self.columns_looped = False
        if self.query_rows:
            self.column_words = self.residual_periodic = self.ds_words = False
        # held_words (issue 16, session 36; BackwardConfig.held_words): column_words builds a
        # masked tile's words from the column intervals the thread holds for the pass
        # (hold_columns: loaded once per key tile and head) instead of re-reading them from
        # the table in every masked tile, as the forward's residual_regs does for its rows.
        self.held_words = config.held_words and self.column_words and self.hold_columns
        self.rows_looped = num_intervals > INTERVALS_UNROLLED
        # work_list: the query tiles a key column visits, built once per (head, chunk of
        # list_chunk query tiles) by the producer warp into one of two shared buffers.
        self.list_chunk = config.list_chunk
        self.list_meet = self.num_consumer_wgs * self.threads_per_wg + 64   # LIST_FREE
        self.list_ready_meet = self.num_consumer_wgs * self.threads_per_wg + 32

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
        mDqRank: cute.Tensor,
        mdQinit: cute.Tensor,
        mSemInit: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSem: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        stream,
    ):
        self._launch(mQ, mK, mV, mdO, mLSE2, mDelta, mBwdIntervals, mBwdTiles, mFwdIntervals,
                     mBwdExact, mDqRank, mdQinit, mSemInit, mdQaccum, mSem, mdK, mdV, None, None,
                     stream)

    @cute.jit
    def with_residual(
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
        mDqRank: cute.Tensor,
        mdQinit: cute.Tensor,
        mSemInit: cute.Tensor,
        mRegion: cute.Tensor,
        mParams: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSem: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        stream,
    ):
        """The entry of a residual mask: also the rows' regions int32 [Bm, Nq] and the
        residual parameter table int32 [Bm, W] (the forward's; inputs, so before the
        outputs: the FFI passes operands then results)."""
        self._launch(mQ, mK, mV, mdO, mLSE2, mDelta, mBwdIntervals, mBwdTiles, mFwdIntervals,
                     mBwdExact, mDqRank, mdQinit, mSemInit, mdQaccum, mSem, mdK, mdV, mRegion,
                     mParams, stream)

    @cute.jit
    def with_schedule(
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
        mDqRank: cute.Tensor,
        mdQinit: cute.Tensor,
        mSemInit: cute.Tensor,
        mSchedule: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSem: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        stream,
    ):
        """The entry with a work-unit order (``config.schedule``): int32 [B * Hkv * Tk], a
        permutation of the units ``(batch * Hkv + head_kv) * Tk + k_tile``
        (api.backward_schedule); block i runs unit mSchedule[i]."""
        self._launch(mQ, mK, mV, mdO, mLSE2, mDelta, mBwdIntervals, mBwdTiles, mFwdIntervals,
                     mBwdExact, mDqRank, mdQinit, mSemInit, mdQaccum, mSem, mdK, mdV, None, None,
                     stream, mSchedule)

    @cute.jit
    def with_residual_schedule(
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
        mDqRank: cute.Tensor,
        mdQinit: cute.Tensor,
        mSemInit: cute.Tensor,
        mRegion: cute.Tensor,
        mParams: cute.Tensor,
        mSchedule: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSem: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        stream,
    ):
        """``with_residual`` and ``with_schedule`` together."""
        self._launch(mQ, mK, mV, mdO, mLSE2, mDelta, mBwdIntervals, mBwdTiles, mFwdIntervals,
                     mBwdExact, mDqRank, mdQinit, mSemInit, mdQaccum, mSem, mdK, mdV, mRegion,
                     mParams, stream, mSchedule)

    @cute.jit
    def _launch(self, mQ, mK, mV, mdO, mLSE2, mDelta, mBwdIntervals, mBwdTiles, mFwdIntervals,
                mBwdExact, mDqRank, mdQinit, mSemInit, mdQaccum, mSem, mdK, mdV, mRegion, mParams,
                stream, mSchedule=None):
        # mdQinit / mSemInit are the zero-filled inputs XLA aliases to mdQaccum / mSem.
        # (B, N, H, D) -> (N, D, H, B) for the TMA tiles.
        rows_first = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))  # noqa: E731
        mQt, mKt, mVt, mdOt = rows_first(mQ), rows_first(mK), rows_first(mV), rows_first(mdO)
        d, bq, bk = self.head_dim, self.block_q, self.block_kv
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S^T = K Q^T and dP^T = V dO^T: (keys, queries), contraction over D.
        # split_sdp: the warpgroups tile the queries (N = bq / 2 each) of the 64 keys.
        tiled_mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, self.sdp_atoms, self.sdp_tile)
        # dV += P^T dO and dK += dS^T Q: (keys, D), contraction over the queries; the
        # left operand comes from registers, dO and Q are their buffers seen transposed.
        # (split_sdp: the left operand, P^T / dS^T of all the tile's queries, from shared
        # memory.)
        # dkv_swap: dK^T += Q^T dS and dV^T += dO^T P, (D or Dv, keys): Q^T / dO^T are their
        # buffers seen transposed (MN-major), dS / P (keys, queries) K-major, both from
        # shared memory.
        tiled_mma_dkv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN_MAJOR if self.dkv_swap else K_MAJOR,
            K_MAJOR if self.dkv_swap else MN_MAJOR, Float32, self.dkv_atoms, self.dkv_tile,
            warpgroup.OperandSource.SMEM if self.split_sdp or self.dkv_swap else warpgroup.OperandSource.RMEM,
        )

        # dQ = dS K: (queries, D), contraction over the keys; dS (queries-major in shared
        # memory) and K seen transposed; the dQ warpgroups split D (see dq_warpgroups), or
        # with 128-query tiles the queries (64 each, all of D).
        dq_atoms, dq_inst = (1, self.dq_wgs, 1), (bq, d // self.dq_wgs)
        if const_expr(self.dq_split_q):
            dq_atoms, dq_inst = (self.dq_wgs, 1, 1), (64, d)
        tiled_mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, dq_atoms, dq_inst,
        )
        sK_layout = sm90_helpers.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bk, bq, d), self.dtype, 1)
        sQ_layout = sm90_helpers.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (bk, bq, d), self.dtype, self.num_stages)
        if const_expr(self.qk_sw64):
            sK_layout = self.k_major_sw64((bk, d, 1))
            sQ_layout = self.k_major_sw64((bq, d, self.num_stages))
        if const_expr(self.qk_sw32):
            sK_layout = self.k_major_sw64((bk, d, 1), kind=warpgroup.SmemLayoutAtomKind.K_SW32)
            sQ_layout = self.k_major_sw64((bq, d, self.num_stages), kind=warpgroup.SmemLayoutAtomKind.K_SW32)
        sV_layout, sdO_layout = sK_layout, sQ_layout
        if const_expr(self.head_dim_v != d):
            sV_layout, sdO_layout = self.v_do_layouts()
        sdS_layout = sm90_helpers.make_smem_layout_a(LayoutEnum.COL_MAJOR, (bq, d, bk), self.dtype,
                                                     self.config.ds_stages)
        tma_atom_q, mQ_tma = self.tma_load_atom(mQt, sQ_layout, (bq, d))
        tma_atom_do, mdO_tma = self.tma_load_atom(mdOt, sdO_layout, (bq, self.head_dim_v))
        tma_atom_k, mK_tma = self.tma_load_atom(mKt, sK_layout, (bk, d))
        tma_atom_v, mV_tma = self.tma_load_atom(mVt, sV_layout, (bk, self.head_dim_v))
        # dK / dV leave through K's and V's buffers and one TMA store each (rows past Nk
        # clipped), like the forward's O; else element stores from registers.
        tma_atom_dk, tma_atom_dv = tma_atom_k, tma_atom_v      # placeholders when unused
        if const_expr(self.config.dkv_tma_store):
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dk, mdK = cpasync.make_tiled_tma_atom(s2g, rows_first(mdK), cute.slice_(sK_layout, (None, None, 0)), (bk, d))
            tma_atom_dv, mdV = cpasync.make_tiled_tma_atom(s2g, rows_first(mdV), cute.slice_(sV_layout, (None, None, 0)), (bk, self.head_dim_v))
        self.bytes_q = self.stage_bytes(sQ_layout)
        self.bytes_k = self.stage_bytes(sK_layout)
        self.bytes_do = self.stage_bytes(sdO_layout)
        self.bytes_v = self.stage_bytes(sV_layout)
        # lse / delta: (B, H, Nq') -> (Nq', H, B); one TMA box of block_q floats per tile.
        stats_first = lambda t: cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))  # noqa: E731
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_lse, mLSE2 = cpasync.make_tiled_tma_atom(g2s, stats_first(mLSE2), cute.make_layout(bq), (bq,))
        tma_atom_delta, mDelta = cpasync.make_tiled_tma_atom(g2s, stats_first(mDelta), cute.make_layout(bq), (bq,))
        self.bytes_stat = bq * 4

        self.check_staging(sK_layout, sdS_layout)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout) if self.p_in_smem else 8], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, bq * self.num_stages], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, bq * self.num_stages], 128]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, 4 if self.config.dq_red else bq * d],
                                   1024 if self.config.dkv_staged else 128]
            sList: cute.struct.Align[cute.struct.MemRange[Int32, 2 * self.list_chunk if self.config.work_list else 4], 16]
            sCount: cute.struct.MemRange[Int32, 2]

        self.shared_storage = SharedStorage
        num_k_tiles = cute.ceil_div(mK.shape[1], bk)
        grid = [num_k_tiles, mK.shape[2], mK.shape[0]]
        if const_expr(self.config.heads_inner):
            grid = [mK.shape[2], num_k_tiles, mK.shape[0]]   # KV heads fastest
        if const_expr(self.config.persistent):
            grid = [mSchedule.shape[0], 1, 1]      # one CTA per row of the persistent table
        elif const_expr(self.config.schedule):
            grid = [num_k_tiles * mK.shape[2] * mK.shape[0], 1, 1]
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mdO_tma, mLSE2, mDelta, mBwdIntervals, mBwdTiles,
            mFwdIntervals, mBwdExact, mdQaccum, mdK, mdV, mDqRank, mSem,
            tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_lse, tma_atom_delta,
            tma_atom_dk, tma_atom_dv, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, sQ_layout, sK_layout, sdS_layout,
            mQ.shape[1], mQ.shape[2], *(() if const_expr(self.residual is None) else (mRegion, mParams)),
            **({"mSchedule": mSchedule} if const_expr(self.config.schedule) else {}),
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def check_staging(self, sK_layout, sdS_layout):
        """``dkv_staged``: dK goes to the dS^T buffers and dV to the dQ tile, so both must
        hold a K / V tile (D 128's 64 x 128 tiles: 32 KB each); raise ValueError otherwise."""
        if not self.config.dkv_staged:
            return
        bq, bk, d = self.block_q, self.block_kv, self.head_dim
        if (cute.cosize(sdS_layout) < cute.cosize(sK_layout) or self.p_in_smem
                or self.head_dim_v != d or self.dkv_swap
                or bq * d * 4 < cute.cosize(sK_layout) * self.dtype.width // 8):
            raise ValueError(f"dkv_staged: the dS^T buffers / dQ tile of {bq} x {bk} tiles at D "
                             f"{d} / Dv {self.head_dim_v} cannot hold dK / dV (built for D 128's "
                             "64 x 128 tiles); unset dkv_staged")

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
        mDqRank: cute.Tensor,
        mSem: cute.Tensor,
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        tma_atom_do: cute.CopyAtom,
        tma_atom_lse: cute.CopyAtom,
        tma_atom_delta: cute.CopyAtom,
        tma_atom_dk: cute.CopyAtom,
        tma_atom_dv: cute.CopyAtom,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        seqlen_q: Int32,
        num_heads: Int32,
        mRegion: Optional[cute.Tensor] = None,
        mParams: Optional[cute.Tensor] = None,
        mSchedule: Optional[cute.Tensor] = None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        k_tile, head_kv, batch = cute.arch.block_idx()
        if const_expr(self.config.heads_inner):
            head_kv, k_tile, batch = cute.arch.block_idx()
        unit = Int32(0)
        if const_expr(self.config.schedule and not self.config.persistent):
            # The block's work unit, read first: its latency overlaps the barrier setup.
            unit = mSchedule[k_tile]
        first_raw = None
        if const_expr(self.config.list_early and self.config.work_list and not self.config.schedule):
            # The producer's tile words of its first list (first head, first chunk), loaded
            # first thing: the first Q / dO load waits for that list.
            first_raw = Uint32(0)
            if warp_idx == 0:
                mh0 = self.mask_head(head_kv * (num_heads // mK.shape[2]))
                mb0 = 0 if const_expr(self.broadcast_batch) else batch
                first_raw = list_first_word(mBwdTiles[mb0, mh0, k_tile, None],
                                            cute.ceil_div(seqlen_q, self.block_q), self.list_chunk)
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_lse, tma_atom_delta):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass_memory.SmemAllocator().allocate(self.shared_storage)
        pipeline_kv = self.tma_pipeline(storage.mbar_kv, 1, self.bytes_k + self.bytes_v)   # K and V together
        # The Q (dO) barrier also counts the tile's lse (delta) bytes.
        pipeline_q = self.tma_pipeline(storage.mbar_q, self.num_stages, self.bytes_q + self.bytes_stat)
        pipeline_do = self.tma_pipeline(storage.mbar_do, self.num_stages, self.bytes_do + self.bytes_stat)
        pipeline.pipeline_init_arrive()

        sK = smem_tensor(storage.sK, sK_layout)
        sV_layout, sdO_layout = sK_layout, sQ_layout
        tiled_mma_dv = tiled_mma_dkv
        if const_expr(self.head_dim_v != self.head_dim):
            # Rebuilt here, not passed in: IR values stay in their region (and the kernel's
            # parameters, so the Dv == D kernels' PTX, stay as they were). dkv_swap: one
            # tiled MMA for dK^T and dV^T (M repeated over D or Dv).
            sV_layout, sdO_layout = self.v_do_layouts()
            if const_expr(not self.dkv_swap):
                tiled_mma_dv = self.dv_tiled_mma()
        sV = smem_tensor(storage.sV, sV_layout)
        sQ = smem_tensor(storage.sQ, sQ_layout)
        sdO = smem_tensor(storage.sdO, sdO_layout)
        sdS = smem_tensor(storage.sdS, sdS_layout)
        sP = smem_tensor(storage.sP, sdS_layout) if const_expr(self.p_in_smem) else None
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.block_q, self.num_stages)))
        sDelta = storage.sDelta.get_tensor(cute.make_layout((self.block_q, self.num_stages)))
        sdQ = storage.sdQ.get_tensor(cute.make_layout(4 if self.config.dq_red else self.block_q * self.head_dim))
        sList = storage.sList.get_tensor(cute.make_layout(2 * self.list_chunk if self.config.work_list else 4))
        sCount = storage.sCount.get_tensor(cute.make_layout(2))
        work = (sList, sCount)

        units = None
        if const_expr(self.config.persistent):
            # Persistent CTAs (api.persistent_schedule): block i runs mSchedule[i, 0] units,
            # mSchedule[i, 1:], each decoded where it starts.
            units = (mSchedule, k_tile, cute.ceil_div(mK.shape[0], self.block_kv), mK.shape[2])
        elif const_expr(self.config.schedule):
            # The host's order (api.backward_schedule: long key columns first): block i
            # runs unit (batch * Hkv + head_kv) * Tk + k_tile = mSchedule[i].
            k_tile, head_kv, batch, _ = self.unit_coords(unit, cute.ceil_div(mK.shape[0], self.block_kv),
                                                         mK.shape[2])
        group = num_heads // mK.shape[2]
        mask_batch = 0 if const_expr(self.broadcast_batch) else batch
        n_q_tiles = cute.ceil_div(seqlen_q, self.block_q)

        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                          (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_lse, tma_atom_delta),
                          pipeline_kv, pipeline_q, pipeline_do, mBwdTiles,
                          n_q_tiles, k_tile, head_kv, batch, mask_batch, group, work, first_raw,
                          units)
            if warp_idx == self.dq_writer_warp:
                self.write_dq(mdQaccum, sdQ, mBwdTiles, mDqRank, mSem, n_q_tiles, k_tile, head_kv,
                              batch, mask_batch, group, work, units)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            smem = _Namespace(storage=storage, layouts=(sQ_layout, sdO_layout, sK_layout), sQ=sQ,
                              sK=sK, sV=sV, sdO=sdO, sdS=sdS, sLSE=sLSE, sDelta=sDelta, sdQ=sdQ,
                              work=work, sP=sP)
            gmem = _Namespace(mBwdIntervals=mBwdIntervals, mBwdTiles=mBwdTiles, mdQaccum=mdQaccum,
                              mFwdIntervals=mFwdIntervals, mBwdExact=mBwdExact, mdK=mdK, mdV=mdV,
                              mRegion=mRegion, mParams=mParams,
                              tma_store_atoms=(tma_atom_dk, tma_atom_dv))
            cta = _Namespace(n_q_tiles=n_q_tiles, seqlen_q=seqlen_q, seqlen_k=mK.shape[0],
                             k_tile=k_tile, head_kv=head_kv, batch=batch, mask_batch=mask_batch,
                             group=group)
            self.consume(smem, gmem, cta, (tiled_mma_sdp, (tiled_mma_dkv, tiled_mma_dv), tiled_mma_dq),
                         (pipeline_kv, pipeline_q, pipeline_do), tidx - self.threads_per_wg, units)

    @cute.jit
    def mask_head(self, head):
        return 0 if const_expr(self.broadcast_head) else head

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta, atoms,
             pipeline_kv, pipeline_q, pipeline_do, mBwdTiles, n_q_tiles, k_tile, head_kv, batch,
             mask_batch, group, work, first_raw=None, units=None):
        """Warp 0: K and V once; per visited tile Q + lse and dO + delta into the ring
        (with ``work_list``, it also builds each (head, chunk)'s list first). ``units``
        (``config.persistent``): (mSchedule, CTA, Tk, Hkv): the CTA's units one after the
        other, the ring state and the list count carried over."""
        if const_expr(units is None):
            self.load_unit(mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta, atoms,
                           pipeline_kv, pipeline_q, pipeline_do, mBwdTiles, n_q_tiles, k_tile,
                           head_kv, batch, mask_batch, group, work, first_raw)
            total = group * self.num_chunks(n_q_tiles)
        else:
            _, _, total = self.for_units(units, lambda k_tile, head_kv, batch, mask_batch, carried: self.load_unit(
                mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta, atoms, pipeline_kv,
                pipeline_q, pipeline_do, mBwdTiles, n_q_tiles, k_tile, head_kv, batch, mask_batch,
                group, work, None, carried), self.unit_states(pipeline.PipelineUserType.Producer))
        if const_expr(self.config.work_list):
            # Balance LIST_FREE: the readers freed every list; the builder waited for all
            # but the last two.
            if total >= 2:
                cute.arch.barrier(barrier_id=int(Bar.LIST_FREE) + (total - 2) % 2, number_of_threads=self.list_meet)
            if total >= 1:
                cute.arch.barrier(barrier_id=int(Bar.LIST_FREE) + (total - 1) % 2, number_of_threads=self.list_meet)

    @cute.jit
    def load_unit(self, mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta, atoms,
                  pipeline_kv, pipeline_q, pipeline_do, mBwdTiles, n_q_tiles, k_tile, head_kv,
                  batch, mask_batch, group, work, first_raw=None, carried=None):
        """``load`` for one work unit. ``carried`` (persistent CTAs): the K / V and ring
        producer states and the lists built so far, returned advanced; K and V are then
        loaded after the unit's first visited Q / dO tile (the previous unit's dK / dV store
        still reads their buffers while that tile loads)."""
        _, tma_atom_k, tma_atom_v, _, _, _ = atoms
        d, bk = self.head_dim, self.block_kv
        gK = cute.local_tile(mK[None, None, head_kv, batch], (bk, d), (k_tile, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (bk, self.head_dim_v), (k_tile, 0))
        tKsK, tKgK = tma_tiles(tma_atom_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_atom_v, sV, gV)
        seq0 = Int32(0)
        kv_pending = Boolean(False)
        if const_expr(carried is None):
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipeline_kv.producer_acquire(kv_state)
            bar = pipeline_kv.producer_get_barrier(kv_state)
            cute.copy(tma_atom_k, tKgK, tKsK[None, 0], tma_bar_ptr=bar)
            cute.copy(tma_atom_v, tVgV, tVsV[None, 0], tma_bar_ptr=bar)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        else:
            kv_state, state, seq0 = carried
            kv_pending = Boolean(True)
        kv = (pipeline_kv, kv_state, tma_atom_k, tma_atom_v, tKgK, tKsK, tVgV, tVsV)
        if const_expr(carried is not None and self.config.dkv_staged):
            # dkv_staged: the last unit's store does not read K / V's buffers, which its
            # consumers free before their epilogue: this unit's K / V go first.
            self.load_kv(kv)
            kv_pending = Boolean(False)
        first_q = Int32(-1)
        if const_expr(self.config.q_early and first_raw is not None and carried is None):
            # q_early: the first list's first tile from the early words (no list yet); its
            # Q / dO go out right behind K / V, and the walk below skips that entry's load.
            first_q = first_listed_tile(first_raw, n_q_tiles, self.list_chunk)
            if first_q >= 0:
                views0 = self.head_tiles(atoms, mQ, mdO, mLSE2, mDelta, sQ, sdO, sLSE, sDelta,
                                         head_kv * group, batch)
                self.load_q_do(atoms, pipeline_q, pipeline_do, views0, first_q, state)
                state.advance()

        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            gTiles = mBwdTiles[mask_batch, self.mask_head(head), k_tile, None]
            views = self.head_tiles(atoms, mQ, mdO, mLSE2, mDelta, sQ, sdO, sLSE, sDelta, head, batch)
            for ch in cutlass.range(self.num_chunks(n_q_tiles), unroll=1):
              seq = g * self.num_chunks(n_q_tiles) + ch
              if const_expr(carried is not None):
                  seq = seq0 + seq
              n_iter = n_q_tiles
              if const_expr(self.config.work_list):
                if seq >= 2:   # the readers are done with this buffer's list of seq - 2
                    cute.arch.barrier(barrier_id=int(Bar.LIST_FREE) + seq % 2, number_of_threads=self.list_meet)
                self.build_list(gTiles, n_q_tiles, ch * self.list_chunk, work, seq % 2,
                                None if const_expr(first_raw is None) else (seq == 0, first_raw))
                cute.arch.barrier_arrive(barrier_id=int(Bar.LIST_READY) + seq % 2,
                                         number_of_threads=self.list_ready_meet)
                cute.arch.barrier_arrive(barrier_id=int(Bar.LIST_READY_DQ) + seq % 2, number_of_threads=64)
                n_iter = work[1][seq % 2]
              it0 = Int32(0)
              if const_expr(self.config.q_early and first_raw is not None and carried is None):
                  if (seq == 0) & (first_q >= 0):
                      it0 = Int32(1)        # entry 0 is first_q, loaded already
              for it in cutlass.range(it0, n_iter, unroll=1):
                q_tile, bits = self.visit(it, gTiles, work, seq)
                if bits & Uint32(1) != Uint32(0):
                    self.load_q_do(atoms, pipeline_q, pipeline_do, views, q_tile, state)
                    state.advance()
                    if const_expr(carried is not None):
                        if kv_pending:
                            self.load_kv(kv)
                            kv_pending = Boolean(False)
        if const_expr(carried is not None):
            if kv_pending:          # a unit without a visited tile still has its K / V stage
                self.load_kv(kv)
            kv_state.advance()
            return kv_state, state, seq0 + group * self.num_chunks(n_q_tiles)

    def head_tiles(self, atoms, mQ, mdO, mLSE2, mDelta, sQ, sdO, sLSE, sDelta, head, batch):
        """The TMA views of one query head's Q, dO, lse and delta, per query tile: (shared,
        global) pairs of Q, dO, lse, delta."""
        tma_atom_q, _, _, tma_atom_do, tma_atom_lse, tma_atom_delta = atoms
        bq = self.block_q
        gQ = cute.local_tile(mQ[None, None, head, batch], (bq, self.head_dim), (None, 0))
        gdO = cute.local_tile(mdO[None, None, head, batch], (bq, self.head_dim_v), (None, 0))
        gL = cute.local_tile(mLSE2[None, head, batch], (bq,), (None,))
        gD = cute.local_tile(mDelta[None, head, batch], (bq,), (None,))
        return (*tma_tiles(tma_atom_q, sQ, gQ), *tma_tiles(tma_atom_do, sdO, gdO),
                *tma_tiles(tma_atom_lse, sLSE, gL, tile_rank=1),
                *tma_tiles(tma_atom_delta, sDelta, gD, tile_rank=1))

    def load_q_do(self, atoms, pipeline_q, pipeline_do, views, q_tile, state):
        """Query tile ``q_tile``'s Q + lse (one barrier) and dO + delta (the other) into ring
        stage ``state`` (``views``: ``head_tiles``); the caller advances the state."""
        tma_atom_q, _, _, tma_atom_do, tma_atom_lse, tma_atom_delta = atoms
        tQsQ, tQgQ, tdOsdO, tdOgdO, tLsL, tLgL, tDsD, tDgD = views
        pipeline_q.producer_acquire(state)
        bar_q = pipeline_q.producer_get_barrier(state)
        cute.copy(tma_atom_q, tQgQ[None, q_tile], tQsQ[None, state.index], tma_bar_ptr=bar_q)
        cute.copy(tma_atom_lse, tLgL[None, q_tile], tLsL[None, state.index], tma_bar_ptr=bar_q)
        pipeline_do.producer_acquire(state)
        bar_do = pipeline_do.producer_get_barrier(state)
        cute.copy(tma_atom_do, tdOgdO[None, q_tile], tdOsdO[None, state.index], tma_bar_ptr=bar_do)
        cute.copy(tma_atom_delta, tDgD[None, q_tile], tDsD[None, state.index], tma_bar_ptr=bar_do)

    @cute.jit
    def load_kv(self, kv):
        """A persistent CTA's K and V of this unit, once the consumers freed their buffers
        (after the last unit's dK / dV store read them)."""
        pipeline_kv, kv_state, tma_atom_k, tma_atom_v, tKgK, tKsK, tVgV, tVsV = kv
        pipeline_kv.producer_acquire(kv_state)
        bar = pipeline_kv.producer_get_barrier(kv_state)
        cute.copy(tma_atom_k, tKgK, tKsK[None, 0], tma_bar_ptr=bar)
        cute.copy(tma_atom_v, tVgV, tVsV[None, 0], tma_bar_ptr=bar)

    @cute.jit
    def for_units(self, units, run_unit, carried):
        """A persistent CTA's units (``units``: mSchedule, CTA, Tk, Hkv) one after the other:
        ``run_unit(k_tile, head_kv, batch, mask_batch, carried)`` returns ``carried`` (what a
        role keeps from unit to unit: ``unit_states``, or the dQ warp's list count) advanced."""
        mSchedule, cta, n_k_tiles, n_kv_heads = units
        for u in cutlass.range(mSchedule[cta, 0], unroll=1):
            k_tile, head_kv, batch, mask_batch = self.unit_coords(mSchedule[cta, u + 1], n_k_tiles, n_kv_heads)
            carried = run_unit(k_tile, head_kv, batch, mask_batch, carried)
        return carried

    def unit_states(self, user_type):
        """A persistent producer's or consumers' carried state before the first unit: the K / V
        and ring pipeline states of ``user_type`` and the lists seen (0)."""
        return (pipeline.make_pipeline_state(user_type, 1),
                pipeline.make_pipeline_state(user_type, self.num_stages), Int32(0))

    @cute.jit
    def unit_coords(self, unit, n_k_tiles, n_kv_heads):
        """(k_tile, head_kv, batch, mask batch) of work unit (batch * Hkv + head_kv) * Tk +
        k_tile (warp-uniform)."""
        unit = cute.arch.make_warp_uniform(unit)
        k_tile = unit % n_k_tiles
        head_kv = (unit // n_k_tiles) % n_kv_heads
        batch = unit // (n_k_tiles * n_kv_heads)
        return k_tile, head_kv, batch, 0 if const_expr(self.broadcast_batch) else batch

    # ------------------------------------------------------------------ work list
    @cute.jit
    def num_chunks(self, n_q_tiles):
        """List chunks per head: 1 when walking the tile states."""
        n = 1
        if const_expr(self.config.work_list):
            n = cute.ceil_div(n_q_tiles, self.list_chunk)
        return n

    @cute.jit
    def visit(self, it, gTiles, work, seq):
        """(query tile, 2 state bits) of iteration `it`: the list's entry it (compute bit
        set by construction), or query tile it's bits from the tile states."""
        q_tile = it
        bits = Uint32(0)
        if const_expr(self.config.work_list):
            q_tile, bits = self.decode_entry(self.list_entry(work, seq, it))
        else:
            bits = tile_bits(gTiles, it)
        return q_tile, bits

    def list_entry(self, work, seq, i):
        """Entry i of list `seq` (shared memory, double buffered)."""
        return work[0][(seq % 2) * self.list_chunk + i]

    def decode_entry(self, entry):
        """A list entry -> (query tile, state bits: compute set, masked as bit 1)."""
        return entry & Int32(0xFFFF), Uint32(1) | (Uint32(entry >> Int32(16)) << Uint32(1))

    @cute.jit
    def list_wait(self, n_q_tiles, work, seq, dq_warp=False):
        """A reader's iteration count for list `seq`: wait until it is built (work_list),
        else every query tile of the walk. The dQ warp waits on its own barrier."""
        n = n_q_tiles
        if const_expr(self.config.work_list):
            if const_expr(dq_warp):
                cute.arch.barrier(barrier_id=int(Bar.LIST_READY_DQ) + seq % 2, number_of_threads=64)
            else:
                cute.arch.barrier(barrier_id=int(Bar.LIST_READY) + seq % 2,
                                  number_of_threads=self.list_ready_meet)
            n = work[1][seq % 2]
        return n

    @cute.jit
    def list_done(self, seq):
        """A reader is done with list `seq`: its buffer may be rebuilt."""
        if const_expr(self.config.work_list):
            cute.arch.barrier_arrive(barrier_id=int(Bar.LIST_FREE) + seq % 2, number_of_threads=self.list_meet)

    @cute.jit
    def build_list(self, gTiles, n_q_tiles, first_tile, work, buf, early=None):
        """The producer warp: the visited query tiles of [first_tile, first_tile +
        list_chunk) in order (common.build_tile_list; ``early``: its (use, word) for the
        first list, loaded by the kernel first thing with ``list_early``)."""
        build_tile_list(gTiles, n_q_tiles, first_tile, self.list_chunk, work[0], work[1], buf, early)

    # ------------------------------------------------------------------ dQ writer
    @cute.jit
    def write_dq(self, mdQaccum, sdQ, mBwdTiles, mDqRank, mSem, n_q_tiles, k_tile, head_kv, batch,
                 mask_batch, group, work, units=None):
        """The dQ warp (``write_dq_unit``); with ``units`` (persistent CTAs) unit after unit,
        the list count carried over."""
        if const_expr(units is None):
            self.write_dq_unit(mdQaccum, sdQ, mBwdTiles, mDqRank, mSem, n_q_tiles, k_tile, head_kv,
                               batch, mask_batch, group, work)
        else:
            self.for_units(units, lambda k_tile, head_kv, batch, mask_batch, seq: self.write_dq_unit(
                mdQaccum, sdQ, mBwdTiles, mDqRank, mSem, n_q_tiles, k_tile, head_kv, batch, mask_batch,
                group, work, seq), Int32(0))
        if cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def write_dq_unit(self, mdQaccum, sdQ, mBwdTiles, mDqRank, mSem, n_q_tiles, k_tile, head_kv,
                      batch, mask_batch, group, work, seq0=None):
        """Warp 1: per visited tile (the same walk as the producer's and the consumers'),
        per dQ warpgroup: wait for its tile in shared memory, add it to the tile's global
        slot with one bulk reduce-add, wait until the add has read it, free the buffer.

        ``config.deterministic``: the adds into one query tile's slot happen in key-tile
        order. Before adding, lane 0 waits until the tile's semaphore (mSem[b, h, q_tile],
        zero on entry) equals this key tile's rank among the key tiles that visit the query
        tile (mDqRank, an exclusive count over the column-major tile states); after its
        adds have completed, it bumps the semaphore with release semantics. Lower key
        tiles of a (batch, head) have lower block indices, so they are resident or done
        (which is why ``config.schedule``, a host order of the blocks, excludes it)."""
        lane = cute.arch.lane_idx()
        meet = self.threads_per_wg + 32
        nbytes = self.dq_wg_floats * 4
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            mh = self.mask_head(head)
            gTiles = mBwdTiles[mask_batch, mh, k_tile, None]
            for ch in cutlass.range(self.num_chunks(n_q_tiles), unroll=1):
              seq = g * self.num_chunks(n_q_tiles) + ch
              if const_expr(seq0 is not None):
                  seq = seq0 + seq
              n_iter = self.list_wait(n_q_tiles, work, seq, dq_warp=True)
              if const_expr(self.config.dq_red):
                  n_iter = Int32(0)      # the consumers add dQ themselves: only the lists' barriers
              for it in cutlass.range(n_iter, unroll=1):
                q_tile, bits = self.visit(it, gTiles, work, seq)
                if bits & Uint32(1) != Uint32(0):
                    slot = mdQaccum[batch, head, q_tile, None]
                    if const_expr(self.config.deterministic):
                        if lane == 0:
                            turn = mDqRank[mask_batch, mh, k_tile, q_tile]
                            sem = (mSem[batch, head, None].iterator + q_tile).llvm_ptr
                            seen = ld_acquire_s32(sem)
                            while seen != turn:
                                nanosleep(32)
                                seen = ld_acquire_s32(sem)
                        cute.arch.sync_warp()
                    for w in cutlass.range_constexpr(self.dq_wgs):
                        cute.arch.barrier(barrier_id=int(Bar.DQ_FULL) + w, number_of_threads=meet)
                        if lane == 0:
                            bulk_reduce_add_f32((slot.iterator + w * self.dq_wg_floats).llvm_ptr,
                                                (sdQ.iterator + w * self.dq_wg_floats).llvm_ptr, nbytes)
                            cute.arch.cp_async_bulk_commit_group()
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.sync_warp()
                        cute.arch.barrier_arrive(barrier_id=int(Bar.DQ_EMPTY) + w, number_of_threads=meet)
                    if const_expr(self.config.deterministic):
                        if lane == 0:
                            cute.arch.cp_async_bulk_wait_group(0)    # the adds are complete
                            sem = (mSem[batch, head, None].iterator + q_tile).llvm_ptr
                            red_release_add_s32(sem, 1)
                        cute.arch.sync_warp()
              self.list_done(seq)
        if const_expr(seq0 is not None):
            return seq0 + group * self.num_chunks(n_q_tiles)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, smem, gmem, cta, tiled_mmas, pipelines, tidx, units=None):
        """The two consumer warpgroups: per head of the CTA's key tile, per visited query
        tile (the work list), ``step``; then dK / dV out.

        ``smem`` / ``gmem`` / ``cta``: the CTA's shared buffers, global tensors and
        coordinates (namespaces built in ``kernel``); ``tiled_mmas`` (S^T / dP^T, (dK, dV),
        dQ); ``pipelines`` (K / V, Q, dO); ``tidx`` among the consumers; ``units``
        (``config.persistent``): (mSchedule, CTA, Tk, Hkv), the CTA's units one after the
        other (``consume_unit``), the pipeline states and the list count carried over."""
        d, bq, bk = self.head_dim, self.block_q, self.block_kv
        storage, work = smem.storage, smem.work
        sQ_layout, sdO_layout, sK_layout = smem.layouts
        sQ, sK, sV, sdO, sdS = smem.sQ, smem.sK, smem.sV, smem.sdO, smem.sdS
        sLSE, sDelta, sdQ = smem.sLSE, smem.sDelta, smem.sdQ
        mBwdIntervals, mBwdTiles, mFwdIntervals = gmem.mBwdIntervals, gmem.mBwdTiles, gmem.mFwdIntervals
        mBwdExact, mdK, mdV = gmem.mBwdExact, gmem.mdK, gmem.mdV
        mRegion, mParams, tma_store_atoms = gmem.mRegion, gmem.mParams, gmem.tma_store_atoms
        n_q_tiles, seqlen_q, seqlen_k = cta.n_q_tiles, cta.seqlen_q, cta.seqlen_k
        k_tile, head_kv, batch, mask_batch, group = cta.k_tile, cta.head_kv, cta.batch, cta.mask_batch, cta.group
        tiled_mma_sdp, tiled_mmas_dkv, tiled_mma_dq = tiled_mmas
        pipeline_kv, pipeline_q, pipeline_do = pipelines
        tiled_mma_dkv, tiled_mma_dv = tiled_mmas_dkv
        wg = self.consumer_wg(tidx)
        wg_slice = cute.make_layout(self.num_consumer_wgs, stride=self.threads_per_wg)
        # split_dkv: both warpgroups take the one S^T / dP^T tile (thread t and t + 128 hold
        # the same elements), so dK / dV's register A operand is whole in each.
        sdp_tidx = tidx % self.threads_per_wg if const_expr(self.sdp_shared) else tidx
        mma_sdp = tiled_mma_sdp.get_slice(wg_slice(0) if const_expr(self.sdp_shared) else wg_slice(wg))
        mma_dkv = tiled_mma_dkv.get_slice(wg_slice(wg))
        mma_dv = tiled_mma_dv.get_slice(wg_slice(wg))
        # With a single dQ warpgroup, the second one builds (and never uses) its fragments.
        mma_dq = tiled_mma_dq.get_slice(wg_slice(0) if const_expr(self.dq_single_wg) else wg_slice(wg))
        thr_sdp = tiled_mma_sdp.get_slice(sdp_tidx)

        # Operand fragments (shared-memory descriptors) of the five products.
        frags = _Fragments()
        frags.wg = wg
        sQt = smem_tensor(storage.sQ, sQ_layout, [1, 0, 2])     # (D, queries, stage)
        sdOt = smem_tensor(storage.sdO, sdO_layout, [1, 0, 2])  # (Dv, queries, stage)
        sKt = smem_tensor(storage.sK, sK_layout, [1, 0, 2])     # (D, keys, 1)
        if const_expr(self.dkv_swap):
            # S = Q K^T, dP = dO V^T (queries x this warpgroup's keys); dK^T / dV^T's left
            # operands Q^T / dO^T.
            frags.tSrQ = mma_sdp.make_fragment_A(mma_sdp.partition_A(sQ))
            frags.tSrdO = mma_sdp.make_fragment_A(mma_sdp.partition_A(sdO))
            frags.tSrK = mma_sdp.make_fragment_B(mma_sdp.partition_B(sK))
            frags.tSrV = mma_sdp.make_fragment_B(mma_sdp.partition_B(sV))
            frags.tKVrQt = mma_dkv.make_fragment_A(mma_dkv.partition_A(sQt))
            frags.tKVrdOt = mma_dv.make_fragment_A(mma_dv.partition_A(sdOt))
        else:
            frags.tSrK = mma_sdp.make_fragment_A(mma_sdp.partition_A(sK))
            frags.tSrV = mma_sdp.make_fragment_A(mma_sdp.partition_A(sV))
            frags.tSrQ = mma_sdp.make_fragment_B(mma_sdp.partition_B(sQ))
            frags.tSrdO = mma_sdp.make_fragment_B(mma_sdp.partition_B(sdO))
            frags.tKVrQt = mma_dkv.make_fragment_B(mma_dkv.partition_B(sQt))
            frags.tKVrdOt = mma_dv.make_fragment_B(mma_dv.partition_B(sdOt))
        frags.tQrdS = mma_dq.make_fragment_A(mma_dq.partition_A(sdS))
        frags.tQrKt = mma_dq.make_fragment_B(mma_dq.partition_B(sKt))
        if const_expr(self.wg_dq):
            # D half h of dQ as the default's warpgroup h computes it (the same per-thread
            # fragment, so the same shared / global layout), issued by either warpgroup
            # over its own keys' k-blocks.
            frags.mma_dq_halves = [tiled_mma_dq.get_slice(wg_slice(h)) for h in range(self.dq_wgs)]
            frags.tQrdS_halves = [m.make_fragment_A(m.partition_A(sdS)) for m in frags.mma_dq_halves]
            frags.tQrKt_halves = [m.make_fragment_B(m.partition_B(sKt)) for m in frags.mma_dq_halves]
        frags.mma_sdp, frags.mma_dkv, frags.mma_dq, frags.mma_dv = mma_sdp, mma_dkv, mma_dq, mma_dv
        frags.mBwdIntervals = mBwdIntervals
        frags.residual_args = (mRegion, mParams)
        frags.sLSE, frags.sDelta, frags.mFwdIntervals = sLSE, sDelta, mFwdIntervals
        frags.pipeline_q, frags.pipeline_do = pipeline_q, pipeline_do
        frags.seqlen_q, frags.seqlen_k, frags.k_tile, frags.mask_batch = seqlen_q, seqlen_k, k_tile, mask_batch

        dk_shape, dv_shape = (bk, d), (bk, self.head_dim_v)
        if const_expr(self.dkv_swap):
            dk_shape, dv_shape = (d, bk), (self.head_dim_v, bk)     # dK^T, dV^T
        acc_dK = cute.make_rmem_tensor(mma_dkv.partition_shape_C(dk_shape), Float32)
        acc_dV = cute.make_rmem_tensor(mma_dv.partition_shape_C(dv_shape), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        frags.acc_dK, frags.acc_dV = acc_dK, acc_dV

        # (key, query) coordinates of this thread's elements of an S^T tile: 2 keys (rows);
        # dkv_swap: (query, key) of an S tile, 2 queries (rows) of 12 keys.
        tScS = _rows_view(thr_sdp.partition_C(cute.make_identity_tensor(
            (bq, bk) if const_expr(self.dkv_swap) else (bk, bq))))
        frags.tScS = tScS
        num_rows = cute.size(tScS, mode=[0])

        # dS^T as written from registers: the (keys, queries) view of the dQ A operand.
        # Written with stmatrix (8x8 blocks, queries contiguous in both), like an epilogue.
        # dkv_swap: dS (queries x keys, a thread's pairs along the keys) into the same
        # queries-contiguous buffer: stmatrix.trans.
        sdS_t = cute.make_tensor(sdS.iterator, cute.select(sdS.layout, mode=[1, 0, 2]))
        ds_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.dkv_swap, num_matrices=4),
                                self.dtype),
            tiled_mma_sdp,
        ).get_slice(sdp_tidx)
        frags.ds_copy = ds_copy
        frags.tdSsdS = ds_copy.partition_D(sdS if const_expr(self.dkv_swap) else sdS_t)
        if const_expr(self.dk_late):
            # dK += dS^T Q a tile late, dS^T (this warpgroup's 64 keys x the queries, queries
            # contiguous: K-major) from its shared stage rather than registers (kept there,
            # the tile's 16 registers made ptxas serialize every wgmma, C7512).
            tiled_mma_dks = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
                Float32, self.dkv_atoms, self.dkv_tile, warpgroup.OperandSource.SMEM)
            mma_dks = tiled_mma_dks.get_slice(wg_slice(wg))
            frags.mma_dks = mma_dks
            frags.tKVsdS_late = mma_dks.make_fragment_A(mma_dks.partition_A(sdS_t))
            frags.tKVrQt_late = mma_dks.make_fragment_B(mma_dks.partition_B(sQt))
        if const_expr(self.dkv_swap):
            # P the same way into its own buffer; dV^T / dK^T read this warpgroup's keys of
            # P / dS (keys x queries, queries contiguous: K-major) as their right operand.
            sP_t = cute.make_tensor(smem.sP.iterator, cute.select(smem.sP.layout, mode=[1, 0, 2]))
            frags.tPsP = ds_copy.partition_D(smem.sP)
            frags.tKVsP = mma_dv.make_fragment_B(mma_dv.partition_B(sP_t))
            frags.tKVsdS = mma_dkv.make_fragment_B(mma_dkv.partition_B(sdS_t))
        elif const_expr(self.split_sdp):
            # P^T the same way into its own buffer; dV / dK read P^T / dS^T of the whole
            # tile (keys x queries, queries contiguous: K-major) from shared memory.
            sP_t = cute.make_tensor(smem.sP.iterator, cute.select(smem.sP.layout, mode=[1, 0, 2]))
            frags.tPsP = ds_copy.partition_D(sP_t)
            frags.tKVsP = mma_dv.make_fragment_A(mma_dv.partition_A(sP_t))
            frags.tKVsdS = mma_dkv.make_fragment_A(mma_dkv.partition_A(sdS_t))
        # This thread's float4 chunks of its warpgroup's dQ tile in shared memory: chunk g
        # of thread t at 4 t + 512 g (fragment order: 128-bit stores, no bank conflicts).
        # dq_blocked: column block g of 8 floats holds rows 0..63 at 8 floats each; thread
        # t = 32 warp + lane keeps rows 16 warp + lane // 4 (+ 8), columns 2 (lane % 4) (+ 1)
        # of the block, at 128 warp + 2 lane (+ 64 for the row + 8): 64-bit stores, a warp's
        # 32 of them contiguous.
        dq_region = 0 if const_expr(self.dq_single_wg) else wg * self.dq_wg_floats
        t_wg = tidx % self.threads_per_wg
        if const_expr(self.config.dq_red):
            # dq_red: the same chunks at the same offsets of the tile's global slot.
            frags.dq_offset = dq_region + t_wg * 4
        elif const_expr(self.config.dq_blocked):
            frags.sdQ_thr = cute.make_tensor(
                sdQ.iterator + dq_region + (t_wg // 32) * 128 + (t_wg % 32) * 2,
                cute.make_layout(((2, 2), self.dq_chunks), stride=((1, 64), 512)))
        else:
            frags.sdQ_thr = cute.make_tensor(
                sdQ.iterator + dq_region + t_wg * 4,
                cute.make_layout((4, self.dq_chunks), stride=(1, 4 * self.threads_per_wg)))
        if const_expr(self.wg_dq):
            # This thread's chunks of each D half's region (both warpgroups write both).
            frags.sdQ_halves = [cute.make_tensor(
                sdQ.iterator + h * self.dq_wg_floats + t_wg * 4,
                cute.make_layout((4, self.dq_chunks), stride=(1, 4 * self.threads_per_wg)))
                for h in range(self.dq_wgs)]

        # The CTA's keys' column intervals (Kc per key), loaded once per head.
        kc = self.num_bwd_intervals
        col_starts = cute.make_rmem_tensor((num_rows, max(kc, 1)), Int32)
        col_lengths = cute.make_rmem_tensor((num_rows, max(kc, 1)), Int32)
        frags.work, frags.sK, frags.sV = work, sK, sV
        # The ring count before which no dQ hand-off waits for the dQ warp: the CTA's first
        # tile's (dkv_staged: each unit's first, consume_unit).
        frags.unit_count0 = Int32(0)
        if const_expr(self.config.dkv_staged):
            # dkv_staged: dK's staging over the dS^T buffers, dV's over the dQ tile.
            frags.stage_dk = smem_tensor(storage.sdS, sK_layout)
            frags.stage_dv = cute.make_tensor(
                cute.recast_ptr(storage.sdQ.data_ptr(), sK_layout.inner, self.dtype), sK_layout.outer)
        f = frags
        args = (f, gmem, cta, tiled_mmas, pipelines, tidx, col_starts, col_lengths)
        if const_expr(units is None):
            self.consume_unit(*args, cta.k_tile, cta.head_kv, cta.batch, cta.mask_batch)
        else:
            _, state, _ = self.for_units(units, lambda k_tile, head_kv, batch, mask_batch, carried: self.consume_unit(
                *args, k_tile, head_kv, batch, mask_batch, carried), self.unit_states(pipeline.PipelineUserType.Consumer))
            # The dQ warp's last DQ_EMPTY of the CTA (per unit the next unit's first dQ
            # tile waited for the last one's; dkv_staged: each unit's end waited its own).
            if const_expr(not self.config.dkv_staged):
                self.balance_dq(state.count, f.wg)

    @cute.jit
    def consume_unit(self, f, gmem, cta, tiled_mmas, pipelines, tidx, col_starts, col_lengths,
                     k_tile, head_kv, batch, mask_batch, carried=None):
        """One work unit of the consumers: per head of the unit's key tile, per visited query
        tile (the work list), ``step``; then dK / dV out. ``carried`` (persistent CTAs): the
        K / V and ring consumer states and the lists read so far, returned advanced; K and V
        are then freed once the dK / dV store has read their buffers, and dK / dV zeroed."""
        d, bq, bk = self.head_dim, self.block_q, self.block_kv
        # The CTA's fragments with this unit's key tile and mask batch (a copy: the caller's
        # stays as it was across a persistent CTA's unit loop).
        frags = _Fragments()
        frags.__dict__.update(f.__dict__)
        frags.k_tile, frags.mask_batch = k_tile, mask_batch
        work = f.work
        kc = self.num_bwd_intervals
        num_rows = cute.size(f.tScS, mode=[0])
        tScS, acc_dK, acc_dV = f.tScS, f.acc_dK, f.acc_dV
        mBwdIntervals, mBwdTiles, mBwdExact = gmem.mBwdIntervals, gmem.mBwdTiles, gmem.mBwdExact
        mdK, mdV, tma_store_atoms = gmem.mdK, gmem.mdV, gmem.tma_store_atoms
        n_q_tiles, seqlen_q, seqlen_k, group = cta.n_q_tiles, cta.seqlen_q, cta.seqlen_k, cta.group
        pipeline_kv = pipelines[0]
        tiled_mmas_dkv = tiled_mmas[1]
        tiled_mma_dkv = tiled_mmas_dkv[0]
        sK, sV = f.sK, f.sV
        wg = f.wg
        exact = Boolean(False)
        if const_expr(kc > 0 and not self.row_mask):
            exact = mBwdExact[mask_batch] != 0
            if const_expr(self.exact_columns):
                # The column view is exact for every input (BackwardKey.exact_columns): a
                # constant, so the row path of the masked tiles folds away.
                exact = Boolean(True)
        seq0 = Int32(0)
        # held_words: the first head's held column intervals are loaded before the K / V
        # wait (they do not depend on it), so their latency runs under the K / V load
        # instead of after it (session 39's ncu: 3.3% of the samples at the first use).
        columns_early = self.held_words and kc > 0 and carried is None
        if const_expr(columns_early):
            self.hold_head_columns(col_starts, col_lengths, tScS, k_tile, seqlen_k, mBwdIntervals,
                                   mask_batch, self.mask_head(head_kv * group))
        if const_expr(carried is None):
            pipeline_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        else:
            kv_state, state, seq0 = carried
            pipeline_kv.consumer_wait(kv_state)
        if const_expr(self.config.dkv_staged):
            frags.unit_count0 = state.count
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            mh = self.mask_head(head)
            gTiles = mBwdTiles[mask_batch, mh, k_tile, None]
            if const_expr(kc > 0 and self.hold_columns and not columns_early):
                self.hold_head_columns(col_starts, col_lengths, tScS, k_tile, seqlen_k, mBwdIntervals,
                                       mask_batch, mh)
            elif const_expr(columns_early):
                if g > 0:
                    self.hold_head_columns(col_starts, col_lengths, tScS, k_tile, seqlen_k,
                                           mBwdIntervals, mask_batch, mh)
            ragged_q = n_q_tiles if seqlen_q % bq == 0 else n_q_tiles - 1
            ragged_k = (seqlen_k % bk != 0) & (k_tile == cute.ceil_div(seqlen_k, bk) - 1)
            for ch in cutlass.range(self.num_chunks(n_q_tiles), unroll=1):
              seq = g * self.num_chunks(n_q_tiles) + ch
              if const_expr(carried is not None):
                  seq = seq0 + seq
              n_iter = self.list_wait(n_q_tiles, work, seq)
              # dk_late: the chunk's first stepped tile (its dK of zeros uses its own Q stage)
              # and the stage of the tile before (its Q is freed once that tile's dK is done).
              count0 = state.count
              prev_si = state.index
              if const_expr(self.dk_late):
                  self.zero_ds_stage(frags, prev_si)
              # entry_ahead: every list entry is a visited tile, and each tile's step reads
              # the next entry before its last wgmma wait (the load completes under the
              # GEMMs); else each iteration reads its own (``visit``).
              entry = self.list_entry(work, seq, 0) if const_expr(self.entry_ahead) else Int32(0)
              for it in cutlass.range(n_iter, unroll=1):
                  q_tile, bits = self.decode_entry(entry) if const_expr(self.entry_ahead) \
                      else self.visit(it, gTiles, work, seq)
                  if bits & Uint32(1) != Uint32(0):
                      needs_mask = (bits & Uint32(2) != Uint32(0)) | (q_tile == ragged_q) | ragged_k
                      cols = _Namespace(starts=col_starts, lengths=col_lengths, exact=exact, mh=mh)
                      if const_expr(self.config.dq_red):
                          cols.dq_slot = gmem.mdQaccum[batch, head, q_tile, None]
                      if const_expr(self.entry_ahead):
                          cols.next_entry = (work, seq, cutlass.min(it + 1, n_iter - 1))
                      if const_expr(self.dk_late):
                          cols.prev_si, cols.later = prev_si, state.count != count0
                      if needs_mask:
                          entry = self.step_at(True, state, q_tile, frags, cols)
                      else:
                          entry = self.step_at(False, state, q_tile, frags, cols)
                      prev_si = state.index
                      state.advance()
              if const_expr(self.dk_late):
                  self.flush_dk(frags, state.count != count0, prev_si)
              self.list_done(seq)
        # Balance DQ_EMPTY: the dQ warp freed the buffer once per tile, this warpgroup
        # waited before every tile but the first. config.late_balance waits after the
        # dK / dV epilogue (which never touches the dQ tile) instead of before it.
        if const_expr(not self.config.late_balance and carried is None):
            self.balance_dq(state.count, wg)
        staged = self.config.dkv_staged and carried is not None
        if const_expr(staged):
            # dkv_staged: this unit's last dQ tile read (the staging of dV overwrites it), and
            # K / V freed now: the producer loads the next unit's during this epilogue.
            self.balance_dq(state.count - frags.unit_count0, wg)
            pipeline_kv.consumer_release(kv_state)
        if const_expr(self.config.dkv_tma_store):
            self.epilogue_tma(acc_dK, acc_dV, mdK, mdV, frags.stage_dk if const_expr(staged) else sK,
                              frags.stage_dv if const_expr(staged) else sV, tma_store_atoms,
                              tiled_mmas_dkv, tidx, k_tile, head_kv, batch)
        elif const_expr(self.config.dkv_vec_store):
            self.epilogue_vec(acc_dK, acc_dV, mdK, mdV, tiled_mmas_dkv, tidx, seqlen_k, k_tile,
                              head_kv, batch)
        else:
            self.epilogue(acc_dK, acc_dV, mdK, mdV, tiled_mma_dkv, tidx, seqlen_k, k_tile, head_kv, batch)
        if const_expr(self.config.late_balance and carried is None):
            self.balance_dq(state.count, wg)
        if const_expr(carried is not None):
            # The store has read K's and V's buffers (warp 0 waited for it): the producer may
            # load the next unit's K / V there (dkv_staged: the store read the dS^T buffers
            # and the dQ tile, which the next unit's first tile writes). dK / dV start over.
            cute.arch.barrier(barrier_id=int(Bar.EPILOGUE), number_of_threads=self.num_consumer_wgs * self.threads_per_wg)
            if const_expr(not staged):
                pipeline_kv.consumer_release(kv_state)
            kv_state.advance()
            acc_dK.fill(0.0)
            acc_dV.fill(0.0)
            return kv_state, state, seq0 + group * self.num_chunks(n_q_tiles)

    @cute.jit
    def flush_dk(self, f, any_tile, prev_si):
        """``dk_late``: the chunk's last tile's dK (its dS^T still in its shared stage), then
        its Q stage freed; nothing when the chunk stepped no tile (``any_tile`` false)."""
        pipeline_q, mma_dks, acc_dK, tKVsdS, tKVrQt = f.pipeline_q, f.mma_dks, f.acc_dK, f.tKVsdS_late, f.tKVrQt_late
        if any_tile:
            issue_wgmma(mma_dks, acc_dK, tKVsdS[None, None, None, prev_si], tKVrQt[None, None, None, prev_si], False)
            warpgroup.wait_group(0)
            pipeline_q.consumer_release(self.stage_state(prev_si))

    @cute.jit
    def zero_ds_stage(self, f, stage):
        """``dk_late``: zeros into this warpgroup's keys' rows of dS^T stage ``stage`` (the
        chunk's first tile's, whose dK of the tile before reads it), fenced, then the
        warpgroup's 128 threads meet. The stage's last readers (the dQ and dK of the tile
        two steps back) finished before the last DS_READY both warpgroups passed."""
        zeros = cute.make_rmem_tensor(f.mma_sdp.partition_shape_C((self.block_kv, self.block_q)), self.dtype)
        zeros.fill(0.0)
        cute.copy(f.ds_copy, f.ds_copy.retile(zeros), f.tdSsdS[None, None, None, stage])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Bar.P_READY) + f.wg, number_of_threads=self.threads_per_wg)

    def stage_state(self, index):
        """A consumer state naming ring stage ``index`` (``consumer_release`` reads only it)."""
        return pipeline.PipelineState(self.num_stages, Int32(0), index, Int32(0))

    @cute.jit
    def balance_dq(self, count, wg):
        """The consumers' last DQ_EMPTY wait (one per warpgroup that handed the dQ warp a
        tile, when the CTA visited any; none with ``dq_red``)."""
        if const_expr(self.config.dq_red):
            return
        if count > 0:
            if const_expr(self.wg_dq):
                if wg == 0:         # warpgroup 0 waits both regions before storing
                    for h in cutlass.range_constexpr(self.dq_wgs):
                        self.dq_buffer_wait(h)
            elif const_expr(self.dq_single_wg):
                if wg == 0:
                    self.dq_buffer_wait(wg)
            else:
                self.dq_buffer_wait(wg)

    @cute.jit
    def step_at(self, masked: cutlass.Constexpr[bool], state, q_tile, f, cols):
        """``step`` for this tile; with ``config.static_stage`` one copy per ring stage, the
        stage a compile-time constant in each (the branch is warp-uniform). A runtime stage
        makes each k-step's shared-memory descriptor a 64-bit add of base and offset, which
        ptxas turns into UIADD3 + UIADD3.X + a UMOV of the constant high word, dependent,
        before each HGMMA; a constant one folds into the base. (Branching per GEMM instead
        spills: the accumulators of wgmmas in flight meet at the join.)"""
        nxt = Int32(0)
        if const_expr(self.config.static_stage):
            if state.index == 0:
                nxt = self.step(masked, state, q_tile, f, cols, stage=0)
            else:
                nxt = self.step(masked, state, q_tile, f, cols, stage=1)
        else:
            nxt = self.step(masked, state, q_tile, f, cols)
        return nxt

    @cute.jit
    def step(self, masked: cutlass.Constexpr[bool], state, q_tile, f, cols,
             stage: cutlass.Constexpr = None):
        """One visited query tile, in FA3's order, as five phases: ``issue_scores`` (S^T and
        dP^T products), ``load_statistics`` (lse / delta reads that precede any wait),
        ``probabilities`` (P^T, the mask), ``softmax_grad`` (dS^T), ``dv_and_ds`` (dV +=
        P^T dO; dS^T to shared memory for dQ), ``dq_dk_and_release`` (dQ out, dK +=, the
        ring stage freed). They share the tile's registers through ``t``.

        ``f``: the CTA's fragments, accumulators and constants (``consume``); ``cols``: the
        head's column intervals and mask head; ``stage``: the ring stage of this tile as a
        compile-time constant (``static_stage``), or None to index by ``state.index``."""
        t = _Namespace(si=state.index if const_expr(stage is None) else stage, ring=(state, stage))
        if const_expr(self.dk_late):
            t.prev_si, t.later = cols.prev_si, cols.later
        both = self.num_consumer_wgs * self.threads_per_wg
        if const_expr(self.config.wg_dq_offset):
            # Warpgroup 1 starts its first tile once warpgroup 0 has made its first dS^T
            # (EPILOGUE's id: its generations at the end are whole again).
            if f.wg == 1:
                if state.count == 0:
                    cute.arch.barrier(barrier_id=int(Bar.EPILOGUE), number_of_threads=both)
        self.issue_scores(t, state, f)
        self.load_statistics(t, f)
        self.probabilities(masked, t, q_tile, f, cols)
        if const_expr(not self.dk_split):       # dk_split: dS^T made piece by piece there
            self.softmax_grad(masked, t, f)
        if const_expr(self.config.wg_dq_offset):
            if f.wg == 0:
                if state.count == 0:
                    cute.arch.barrier_arrive(barrier_id=int(Bar.EPILOGUE), number_of_threads=both)
        self.dv_and_ds(t, state, f, stage)
        return self.dq_dk_and_release(t, state, f, cols)

    @cute.jit
    def issue_scores(self, t, state, f):
        """S^T = K Q^T and dP^T = V dO^T issued as Q and dO arrive (no wait on them); the
        tile's lse / delta registers; with ``lse_prefetch`` the lse read before S^T."""
        bq, bk = self.block_q, self.block_kv
        si = t.si
        shape = (bq, bk) if const_expr(self.dkv_swap) else (bk, bq)
        t.acc_S = cute.make_rmem_tensor(f.mma_sdp.partition_shape_C(shape), Float32)
        t.acc_dP = cute.make_rmem_tensor(f.mma_sdp.partition_shape_C(shape), Float32)
        t.S = _rows_view(t.acc_S)
        t.n_cols = cute.size(t.S, mode=[1])
        # A statistic per query: per column of S^T, per row of S (dkv_swap).
        t.n_stats = cute.size(t.S, mode=[0]) if const_expr(self.dkv_swap) else t.n_cols
        t.lse = cute.make_rmem_tensor(t.n_stats, Float32)
        t.delta = cute.make_rmem_tensor(t.n_stats, Float32)
        f.pipeline_q.consumer_wait(state)
        if const_expr(self.config.lse_prefetch):
            # The lse of the tile's queries (they came with Q) read before the S^T issue:
            # the loads complete under the GEMM (FA4's SM90 placement).
            self.read_stats(t.lse, f.sLSE, t, f)
        if const_expr(self.dkv_swap):
            issue_wgmma(f.mma_sdp, t.acc_S, f.tSrQ[None, None, None, si], f.tSrK[None, None, None, 0], True)
            f.pipeline_do.consumer_wait(state)
            issue_wgmma(f.mma_sdp, t.acc_dP, f.tSrdO[None, None, None, si], f.tSrV[None, None, None, 0], True)
        else:
            issue_wgmma(f.mma_sdp, t.acc_S, f.tSrK[None, None, None, 0], f.tSrQ[None, None, None, si], True)
            f.pipeline_do.consumer_wait(state)
            issue_wgmma(f.mma_sdp, t.acc_dP, f.tSrV[None, None, None, 0], f.tSrdO[None, None, None, si], True)
            if const_expr(self.dk_late):
                # The last tile's dK += dS^T Q, under this tile's tanh / exp2 phase (a chunk's
                # first tile: its own stage's dS^T zeroed, against its own Q: adds nothing).
                issue_wgmma(f.mma_dks, f.acc_dK, f.tKVsdS_late[None, None, None, t.prev_si],
                            f.tKVrQt_late[None, None, None, t.prev_si], False)

    @cute.jit
    def read_stats(self, dst, src, t, f):
        """``dst[i]`` = this stage's statistic (``src``: sLSE or sDelta) of the thread's i-th
        query: column i of S^T, or with ``dkv_swap`` row i of S."""
        for i in cutlass.range_constexpr(t.n_stats):
            query = f.tScS[i, 0][0] if const_expr(self.dkv_swap) else f.tScS[0, i][1]
            dst[i] = src[query, t.si]

    def stat_at(self, r: int, c: int) -> int:
        """The statistic index (``read_stats``) of element (r, c) of the rows view."""
        return r if self.dkv_swap else c

    def stat_span(self, stats, c0: int, c1: int) -> tuple:
        """The statistics (``read_stats``) of columns c0 .. c1 - 1 of the rows view: those
        columns', or with ``dkv_swap`` (a statistic per row) all of them."""
        return (0, cute.size(stats)) if self.dkv_swap else (c0, c1)

    @cute.jit
    def load_statistics(self, t, f):
        """This stage's lse / delta (arrived with Q / dO) for the thread's columns, the reads
        each config places before the first wait (the rest happen where they are used)."""
        si, n_cols = t.si, t.n_cols
        t.lse_early = (self.config.stats_early or self.config.lse_early) and not self.config.stats_shfl
        if const_expr(self.config.stats_shfl):
            # Each lane holds 2 of every 64 queries of the tile (64 h + 2 lane, + 1) of lse
            # and delta, read before any wait; at use, column c of the accumulator (query
            # 8 (c // 2) + 2 (lane % 4) + c % 2, the m64nN layout) comes by shfl from lane
            # 4 (c // 2 % 8) + lane % 4, its value 2 (c // 16) + c % 2 (``stat_source``) —
            # no shared-memory load queued behind the GEMMs' operand traffic where exp2
            # waits for it (FA4's SM90 backward does the same). 128-query tiles: 4 values.
            assert n_cols == self.block_q // 4, "stats_shfl: the m64nN accumulator's columns"
            t.lane = cute.arch.lane_idx()
            owned = [stats_shfl_query(i, t.lane) for i in range(self.block_q // 32)]
            t.own_lse = tuple(f.sLSE[query, si] for query in owned)
            t.own_delta = tuple(f.sDelta[query, si] for query in owned)
        if const_expr(t.lse_early):
            self.read_stats(t.lse, f.sLSE, t, f)
        if const_expr(self.config.stats_early):
            self.read_stats(t.delta, f.sDelta, t, f)

    @cute.jit
    def probabilities(self, masked: cutlass.Constexpr[bool], t, q_tile, f, cols):
        """P^T = exp2(S^T * scale log2 e - lse log2 e) once S^T is done, masked elements 0
        (with a soft cap, P^T for dV in ``t.rP`` and P^T (1 - t^2) in S); the delta reads
        that follow it. ``exp2_emu`` of every 8 columns take exp2 on the FMA pipe
        (``exp2_fma``) instead of the MUFU."""
        si, n_cols, S, lse, delta = t.si, t.n_cols, t.S, t.lse, t.delta
        warpgroup.wait_group(1 + self.late_groups)      # S^T done (dP^T, dk_late's dK in flight)
        if const_expr(self.config.stats_shfl):
            for c in cutlass.range_constexpr(n_cols):
                lse[c] = self.stat_source(t.own_lse, c, t.lane)
        elif const_expr(not t.lse_early and not self.config.lse_prefetch):
            self.read_stats(lse, f.sLSE, t, f)
        if const_expr(self.softcap is None):
            scale_log2 = Float32(self.scale_log2)
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                for c in cutlass.range_constexpr(n_cols):
                    S[r, c] = self.p_exp2(S[r, c] * scale_log2 - lse[self.stat_at(r, c)], c)
        elif const_expr(self.dv_split and not masked):
            # dv_split, unmasked tile: each piece of the queries' columns through tanh and
            # P^T, then its k-blocks of dV issued, so that they run under the next piece.
            t.rP = cute.make_rmem_tensor_like(t.acc_S, self.dtype)
            per = n_cols // self.dv_split
            for j in cutlass.range_constexpr(self.dv_split):
                self.softcap_tanh(S, j * per, (j + 1) * per)
                self.capped_piece(False, t, f, j, per)
        else:
            self.softcap_tanh(S, 0, n_cols)     # S^T -> t = tanh(scale S^T / cap) (softcap_r: r)
        if const_expr(masked):
            # With a cap the mask writes t = -inf (softcap_r: r = +inf): exp2 then gives P = 0.
            fill = 0.0
            if const_expr(self.softcap is not None):
                fill = math.inf if const_expr(self.config.softcap_r) else -math.inf
            keep_words = None
            if const_expr(self.ds_words):
                # Each key row's visibility words (word 1 in the high half), for dS^T.
                t.keep_words = cute.make_rmem_tensor(cute.size(S, mode=[0]), Uint32)
                t.exact = cols.exact
                keep_words = t.keep_words
            if const_expr(self.query_rows):
                self.mask_query_rows(S, f.tScS, f.mFwdIntervals, f.seqlen_q, f.seqlen_k,
                                     q_tile * self.block_q, f.k_tile * self.block_kv, cols.mh,
                                     f.mask_batch, f.residual_args, fill)
            else:
                self.apply_mask(S, f.tScS, q_tile, cols.starts, cols.lengths, cols.exact, f.mFwdIntervals,
                                f.mBwdIntervals, f.seqlen_q, f.seqlen_k, f.k_tile, cols.mh, f.mask_batch,
                                f.residual_args, fill, keep_words)
        if const_expr(self.softcap is not None and not (self.dv_split and not masked)):
            # P^T for dV (bf16 / fp16 registers) and, in S, P^T (1 - t^2) (softcap_r: a
            # quarter of it): the gradient of the capped logits is that times (dP^T - delta).
            # dv_split: piece by piece, each piece's dV issued once its P^T is made.
            t.rP = cute.make_rmem_tensor_like(t.acc_S, self.dtype)
            if const_expr(self.dv_split):
                per = n_cols // self.dv_split
                for j in cutlass.range_constexpr(self.dv_split):
                    self.capped_piece(masked, t, f, j, per)
            else:
                self.capped_probs(masked, S, t.rP, lse, 0, n_cols)
        if const_expr(not self.dk_split):
            self.load_delta(t, f)

    @cute.jit
    def load_delta(self, t, f):
        """The tile's delta for the thread's columns (by shfl with ``stats_shfl``; with
        ``stats_early`` it was read after the issues)."""
        delta = t.delta
        if const_expr(self.config.stats_shfl):
            for c in cutlass.range_constexpr(t.n_cols):
                delta[c] = self.stat_source(t.own_delta, c, t.lane)
        elif const_expr(not self.config.stats_early):
            self.read_stats(delta, f.sDelta, t, f)

    @cute.jit
    def capped_piece(self, masked: cutlass.Constexpr[bool], t, f, j: cutlass.Constexpr[int],
                     per: cutlass.Constexpr[int]):
        """``dv_split``: piece j (columns j per .. (j + 1) per, after their tanh and mask) to
        P^T and P^T (1 - t^2), and its k-blocks of dV issued. With ``dk_split`` also its
        dS^T (the first piece waits for dP^T, leaving its dV in flight) and its k-blocks of
        dK issued."""
        c0, c1 = j * per, (j + 1) * per
        self.capped_probs(masked, t.S, t.rP, t.lse, c0, c1)
        self.issue_dv(t, f, j)
        if const_expr(self.dk_split):
            if const_expr(j == 0):
                self.load_delta(t, f)
                warpgroup.wait_group(1)             # dP^T done; dV's first piece runs on
                t.rdS = cute.make_rmem_tensor_like(t.acc_dP, self.dtype)
            dP, rdS_rows = _rows_view(t.acc_dP), _rows_view(t.rdS)
            if const_expr(masked):
                self.guarded_ds(dP, t.S, t.delta, c0, c1)
            else:
                for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
                    for c in cutlass.range_constexpr(c0, c1):
                        dP[r, c] = t.S[r, c] * (dP[r, c] - t.delta[c])
            for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
                for c in cutlass.range_constexpr(c0, c1):
                    rdS_rows[r, c] = dP[r, c].to(self.dtype)
            self.issue_dk(t, f, j)

    def stat_source(self, own, c: int, lane):
        """``stats_shfl``: accumulator column c's lse / delta from the lane that holds it
        (``api.stats_shfl_source``)."""
        base, index = stats_shfl_source(c)
        return cute.arch.shuffle_sync(own[index], base + lane % 4)

    @cute.jit
    def softmax_grad(self, masked: cutlass.Constexpr[bool], t, f):
        """dS^T = P^T (dP^T - delta) in dP^T's registers, once dP^T is done. With
        ``p_early`` P^T is converted for dV before that wait (``dv_early``: dV issued too,
        the wait then leaves it in flight)."""
        S, delta = t.S, t.delta
        if const_expr(self.config.p_early):
            self.convert_p(t)
        if const_expr(self.dv_at == "early"):
            if const_expr(self.dkv_swap):
                self.store_own_p(t, f, *t.ring)
            self.issue_dv(t, f)
            warpgroup.wait_group(1)
        else:
            # dv_split: dV's pieces were committed after dP^T and may stay in flight;
            # dk_late: the last tile's dK too.
            warpgroup.wait_group(self.dv_split + self.late_groups)
        dP = _rows_view(t.acc_dP)
        if const_expr(masked and self.ds_words):
            if t.exact:
                # The mask's words zero the masked pairs (NaN-safe: the select does not read
                # dP - delta there); visible pairs keep P (dP - delta), as in a full tile.
                for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
                    for c in cutlass.range_constexpr(t.n_cols):
                        dP[r, c] = S[r, c] * (dP[r, c] - delta[c])
                    w = t.keep_words[r]
                    select_by_words(dP, r, w, w >> Uint32(16), t.n_cols // 2, 0.0)
            else:
                self.guarded_ds(dP, S, delta, 0, t.n_cols)
        elif const_expr(masked):
            self.guarded_ds(dP, S, delta, 0, t.n_cols)
        else:
            for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
                for c in cutlass.range_constexpr(t.n_cols):
                    dP[r, c] = S[r, c] * (dP[r, c] - delta[self.stat_at(r, c)])

    @cute.jit
    def guarded_ds(self, dP, S, delta, c0: cutlass.Constexpr[int], c1: cutlass.Constexpr[int]):
        """dS^T of a masked tile (columns c0 .. c1 - 1) with the P == 0 guard: a masked pair
        carries no gradient even when its query's delta is NaN (a NaN input in q or k), where
        0 * (dP - NaN) would leak into dK."""
        for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
            for c in cutlass.range_constexpr(c0, c1):
                dP[r, c] = Float32(0.0) if S[r, c] == Float32(0.0) \
                    else S[r, c] * (dP[r, c] - delta[self.stat_at(r, c)])

    @cute.jit
    def store_own_p(self, t, f, state, stage: cutlass.Constexpr = None):
        """``dkv_swap`` with ``dv_early``: this warpgroup's P to its keys' slice of the P
        buffer, fenced, then its 128 threads meet (P_READY + wg) so its dV^T may read it.
        Only this warpgroup's dV^T reads the slice, and its last one completed before the
        previous tile's stage release: no cross-warpgroup wait."""
        t.ds_stage = 0
        if const_expr(self.config.ds_stages == 2):
            t.ds_stage = state.count % 2 if const_expr(stage is None) else stage
        cute.copy(f.ds_copy, f.ds_copy.retile(t.rP), f.tPsP[None, None, None, t.ds_stage])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Bar.P_READY) + f.wg, number_of_threads=self.threads_per_wg)

    @cute.jit
    def dv_and_ds(self, t, state, f, stage: cutlass.Constexpr = None):
        """dV += P^T dO (P^T from registers) issued (with ``dv_early``: done already, in
        ``softmax_grad``); dS^T converted once, to its shared buffer for dQ (``t.rdS`` keeps
        it for dK), then both warpgroups meet (DS_READY). With ``ds_first`` dS^T is stored
        first and dV issued between the stores and their fence."""
        both = self.num_consumer_wgs * self.threads_per_wg
        if const_expr(not self.config.p_early):
            self.convert_p(t)
        if const_expr(self.dv_at == "before_ds"):
            self.issue_dv(t, f)

        if const_expr(self.dk_late):
            # The last tile's dK (issued after this tile's S^T / dP^T) done, dV in flight:
            # that tile's Q stage is free, and its dS^T stage (the next tile's) may be
            # written once both warpgroups pass this tile's DS_READY.
            warpgroup.wait_group(1)
            pipeline_q, later, prev_si = f.pipeline_q, t.later, t.prev_si
            if later:
                pipeline_q.consumer_release(self.stage_state(prev_si))
        if const_expr(self.dk_split):
            rdS = t.rdS                         # made piece by piece (capped_piece)
        else:
            rdS = cute.make_rmem_tensor_like(t.acc_dP, self.dtype)
            rdS.store(t.acc_dP.load().to(self.dtype))
        ds_stage = 0
        if const_expr(self.config.ds_stages == 1):
            cute.arch.barrier(barrier_id=int(Bar.DS_FREE), number_of_threads=both)
        else:
            # With a 2-stage ring the dS^T buffer alternates with the ring stage.
            ds_stage = state.count % 2 if const_expr(stage is None) else stage
        wg = f.wg
        if const_expr(self.p_in_smem):
            # Each warpgroup's half of the queries: P^T and dS^T, then dV from shared memory
            # once both warpgroups' halves are there (dkv_swap: its keys of P and dS; with
            # dv_early P went before the dP wait, ``store_own_p``).
            if const_expr(self.dv_at != "early"):
                cute.copy(f.ds_copy, f.ds_copy.retile(t.rP), f.tPsP[None, None, None, ds_stage])
            cute.copy(f.ds_copy, f.ds_copy.retile(rdS), f.tdSsdS[None, None, None, ds_stage])
            cute.arch.fence_view_async_shared()
        elif const_expr(self.split_dkv):
            if wg == 0:      # both hold the same dS^T: one writes it
                self.store_ds(f, rdS, ds_stage)
        else:
            cute.copy(f.ds_copy, f.ds_copy.retile(rdS), f.tdSsdS[None, None, None, ds_stage])
            if const_expr(self.dv_at == "after_stores"):
                # The stores drain while dV is issued; the fence then rarely waits.
                self.issue_dv(t, f)
            cute.arch.fence_view_async_shared()
        t.rdS, t.ds_stage = rdS, ds_stage
        if const_expr(self.wg_dq):
            # Its own keys' rows of dS^T, which only its own dQ part reads.
            cute.arch.barrier(barrier_id=int(Bar.P_READY) + wg, number_of_threads=self.threads_per_wg)
        else:
            cute.arch.barrier(barrier_id=int(Bar.DS_READY), number_of_threads=both)
        if const_expr(self.dv_at == "after_ready"):
            self.issue_dv(t, f)

    @cute.jit
    def dq_dk_and_release(self, t, state, f, cols):
        """dQ_tile[:, this warpgroup's D part] = dS K handed to the dQ warp; dK += dS^T Q;
        then the tile's Q (and dO) ring stage is freed."""
        # Locals only inside the runtime `if`s (the DSL carries names, not attributes).
        rdS, si, ds_stage = t.rdS, t.si, t.ds_stage
        pipeline_q, pipeline_do = f.pipeline_q, f.pipeline_do
        wg, mma_dkv, acc_dK, tKVrQt = f.wg, f.mma_dkv, f.acc_dK, f.tKVrQt
        dq_slot = cols.dq_slot if const_expr(self.config.dq_red) else None
        if const_expr(self.dq_single_wg):
            if wg == 0:
                self.dq_and_dk(f, rdS, ds_stage, state, pipeline_do, si, dq_slot)
            else:
                if const_expr(not self.dk_split and not self.dk_late):
                    issue_wgmma(mma_dkv, acc_dK, self.dk_operand(f, rdS, ds_stage), tKVrQt[None, None, None, si], False)
                if const_expr(self.config.release_do_early):
                    warpgroup.wait_group(1)                 # dV done: dO's stage is free
                    pipeline_do.consumer_release(state)
        elif const_expr(self.wg_dq):
            self.wg_dq_and_dk(f, rdS, ds_stage, state, si)
        else:
            self.dq_and_dk(f, rdS, ds_stage, state, pipeline_do, si, dq_slot)
        nxt = Int32(0)
        if const_expr(self.entry_ahead):
            # The next tile's work-list entry (``entry_ahead``), read while dK runs.
            nxt = self.list_entry(*cols.next_entry)
        warpgroup.wait_group(0)
        if const_expr(not self.dk_late):        # dk_late: freed once the next tile's dK is done
            pipeline_q.consumer_release(state)
        if const_expr(not self.config.release_do_early):
            pipeline_do.consumer_release(state)
        return nxt

    def issue_dv(self, t, f, piece: int = -1):
        """dV += P^T dO for this tile (where: ``self.dv_at``). P^T from registers
        (``t.rP``) or, with ``split_sdp``, the whole tile's from its shared buffer. With
        ``piece`` >= 0 (``dv_split``) only that piece's k-blocks (16 queries each: P^T's
        accumulator columns 4 kb .. 4 kb + 3, ``_as_a_operand``), as its own group."""
        if const_expr(self.dkv_swap):       # dV^T += dO^T P
            issue_wgmma(f.mma_dv, f.acc_dV, f.tKVrdOt[None, None, None, t.si],
                        f.tKVsP[None, None, None, t.ds_stage], False)
            return
        p = f.tKVsP[None, None, None, t.ds_stage] if const_expr(self.split_sdp) else _as_a_operand(t.rP)
        if const_expr(piece >= 0):
            per = cute.size(p.shape[2]) // self.dv_split
            issue_wgmma(f.mma_dv, f.acc_dV, p, f.tKVrdOt[None, None, None, t.si], False,
                        piece * per, per)
        else:
            issue_wgmma(f.mma_dv, f.acc_dV, p, f.tKVrdOt[None, None, None, t.si], False)

    def issue_dk(self, t, f, piece: int):
        """``dk_split``: dK += dS^T Q over this piece's k-blocks (its 16-query blocks of dS^T,
        from registers), as its own group."""
        a = _as_a_operand(t.rdS)
        per = cute.size(a.shape[2]) // self.dv_split
        issue_wgmma(f.mma_dkv, f.acc_dK, a, f.tKVrQt[None, None, None, t.si], False, piece * per, per)

    def dk_operand(self, f, rdS, ds_stage):
        """dK += dS^T Q's left operand: dS^T from registers, or with ``split_sdp`` (each
        warpgroup holds half the queries' dS^T) the whole tile's from its shared buffer."""
        return f.tKVsdS[None, None, None, ds_stage] if const_expr(self.split_sdp) else _as_a_operand(rdS)

    def convert_p(self, t):
        """P^T (float32, ``t.acc_S``) -> ``t.rP`` in the input dtype, the dV operand (with a
        soft cap ``probabilities`` made it already)."""
        if const_expr(self.softcap is None):
            t.rP = cute.make_rmem_tensor_like(t.acc_S, self.dtype)
            t.rP.store(t.acc_S.load().to(self.dtype))

    def k_major_sw64(self, shape, kind=None):
        """A K-major buffer of `shape` (rows, cols, stages) in 64B-swizzle atoms (8 x 32
        elements): D 192's halves of 96 columns then start an atom (128B atoms: 64); with
        ``kind`` K_SW32, 32B atoms (8 x 16: D 96's halves of 48)."""
        kind = warpgroup.SmemLayoutAtomKind.K_SW64 if kind is None else kind
        atom = warpgroup.make_smem_layout_atom(kind, self.dtype)
        return cute.tile_to_shape(atom, shape, order=(0, 1, 2))

    def dv_tiled_mma(self):
        """dV += P^T dO when Dv != D: the dK tiling with Dv / 2 columns per warpgroup (P^T
        from registers, or with ``split_sdp`` from shared memory)."""
        return sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, self.dkv_atoms, self.dv_tile,
            warpgroup.OperandSource.SMEM if self.split_sdp else warpgroup.OperandSource.RMEM)

    def v_do_layouts(self):
        """(V, dO) buffers when Dv != D: (block_kv, Dv) and (block_q, Dv, stages)."""
        bq, bk, dv = self.block_q, self.block_kv, self.head_dim_v
        return (sm90_helpers.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bk, bq, dv), self.dtype, 1),
                sm90_helpers.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (bk, bq, dv), self.dtype, self.num_stages))

    @cute.jit
    def store_ds(self, f, rdS, ds_stage):
        """dS^T registers -> this tile's dS^T buffer (stmatrix), fenced for the wgmma reads."""
        cute.copy(f.ds_copy, f.ds_copy.retile(rdS), f.tdSsdS[None, None, None, ds_stage])
        cute.arch.fence_view_async_shared()

    def p_exp2(self, x, c: int):
        """P^T's exp2 of fragment column ``c`` (static): on the FMA pipe (``exp2_fma``) for the
        ``exp2_emu`` of every 8 columns, else on the MUFU. Both give exactly 0 at -inf."""
        if emulated_column(c, self.config.exp2_emu):
            return exp2_fma(x)
        return cute.math.exp2(x, fastmath=True)

    @cute.jit
    def softcap_tanh(self, S, c0: cutlass.Constexpr[int], c1: cutlass.Constexpr[int]):
        """S^T -> t = tanh(scale S^T / cap) in place, as the forward's default tanh
        (``FlashForwardSm90.apply_softcap``): 1 - 2 rcp(ex2(2 log2 e scale / cap * s) + 1),
        |t error| < ~4e-7, saturating to +-1 without NaN; P is then recomputed from the
        same capped logits the forward's lse saw. 2 MUFU ops per score; ``rcp_emu`` of every
        8 columns take the reciprocal on the FMA pipe (``rcp_fma``, within 1 ulp as the
        MUFU's). Columns ``c0 .. c1 - 1`` of the rows view (``dv_split``: one piece)."""
        pre = Float32(2.0 * _LOG2_E * self.scale / self.softcap)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            for c in cutlass.range_constexpr(c0, c1):
                e = cute.math.exp2(S[r, c] * pre, fastmath=True)
                if const_expr(emulated_column(c, self.config.rcp_emu)):
                    rcp = rcp_fma(e + Float32(1.0))
                else:
                    rcp = cute.arch.rcp_approx(e + Float32(1.0))
                if const_expr(self.config.softcap_r):
                    S[r, c] = rcp                   # t = 1 - 2 r, left to softcap_probs_r
                else:
                    S[r, c] = Float32(1.0) - Float32(2.0) * rcp

    @cute.jit
    def capped_probs(self, masked: cutlass.Constexpr[bool], S, rP, lse,
                     c0: cutlass.Constexpr[int], c1: cutlass.Constexpr[int]):
        """``softcap_probs`` (or ``softcap_probs_r``) over columns ``c0 .. c1 - 1`` of the
        rows view, P^T into ``rP`` (the dV operand's registers)."""
        if const_expr(self.config.softcap_r):
            self.softcap_probs_r(masked, S, _rows_view(rP), lse, c0, c1)
        else:
            self.softcap_probs(S, _rows_view(rP), lse, c0, c1)

    @cute.jit
    def softcap_probs(self, S, rP_rows, lse, c0: cutlass.Constexpr[int], c1: cutlass.Constexpr[int]):
        """t (S^T after softcap_tanh and the mask; -inf where masked) -> P^T = exp2(t cap
        log2 e - lse2) into rP_rows (the dV operand, input dtype) and P^T (1 - t^2) into S
        (0 where P^T is 0: a masked t of -inf would give 0 * -inf). One live fp32 tile, as
        without a cap; the (1 - t^2) factor costs no registers beyond the early rP.
        ``exp2_emu`` of every 8 columns take this exp2 on the FMA pipe (``exp2_fma``: -inf
        gives exactly 0 there too); the tanh's ex2 and rcp stay on the MUFU."""
        cap_log2 = Float32(self.softcap * _LOG2_E)
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            for c in cutlass.range_constexpr(c0, c1):
                t = S[r, c]
                p = self.p_exp2(t * cap_log2 - lse[self.stat_at(r, c)], c)   # -inf (masked) -> exactly 0
                rP_rows[r, c] = p.to(self.dtype)
                S[r, c] = Float32(0.0) if p == Float32(0.0) else p * (Float32(1.0) - t * t)

    @cute.jit
    def softcap_probs_r(self, masked: cutlass.Constexpr[bool], S, rP_rows, lse,
                        c0: cutlass.Constexpr[int], c1: cutlass.Constexpr[int]):
        """``softcap_r``: softcap_probs from r = 1 / (e + 1) (t = 1 - 2 r; S^T after
        softcap_tanh and the mask, +inf where masked). P^T = exp2(r (-2 cap log2 e) + (cap
        log2 e - lse2)): one FFMA per score (the column's constant once per column), and
        (1 - t^2) / 4 = r (1 - r) = FFMA(-r, r, r): exact near t = +-1, where 1 - t * t of a
        rounded t loses its digits. The factor 4 moves to dQ's and dK's final scale
        (``grad_scale``). The 0 guard only in masked tiles: there r = +inf gives P^T = 0 and
        r (1 - r) NaN; elsewhere r is finite, or NaN from a NaN score, which propagates."""
        cap_log2 = Float32(self.softcap * _LOG2_E)
        minus_2cap_log2 = Float32(-2.0 * self.softcap * _LOG2_E)
        # the query's constant, in place (lse's last use); dkv_swap: per row (whole tiles)
        lo, hi = self.stat_span(lse, c0, c1)
        for i in cutlass.range_constexpr(lo, hi):
            lse[i] = cap_log2 - lse[i]
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            for c in cutlass.range_constexpr(c0, c1):
                rc = S[r, c]
                p = self.p_exp2(rc * minus_2cap_log2 + lse[self.stat_at(r, c)], c)
                rP_rows[r, c] = p.to(self.dtype)
                quarter = rc - rc * rc
                if const_expr(masked):
                    S[r, c] = Float32(0.0) if p == Float32(0.0) else p * quarter
                else:
                    S[r, c] = p * quarter

    @cute.jit
    def dq_and_dk(self, f, rdS, ds_stage, state, pipeline_do, si, dq_slot=None):
        """Issue dQ then dK; once dV and dQ are done, hand the dQ tile to the dQ warp
        through shared memory (dK still in flight). With ``release_do_early``: wait for dV
        between the two issues and free dO's stage at once (the producer's next dO load
        starts a GEMM earlier)."""
        dq_tile = (self.block_q, self.head_dim if const_expr(self.dq_split_q) else self.head_dim // self.dq_wgs)
        acc_dQ = cute.make_rmem_tensor(f.mma_dq.partition_shape_C(dq_tile), Float32)
        issue_wgmma(f.mma_dq, acc_dQ, f.tQrdS[None, None, None, ds_stage], f.tQrKt[None, None, None, 0], True)
        if const_expr(self.config.release_do_early):
            warpgroup.wait_group(1)
            pipeline_do.consumer_release(state)
        if const_expr(self.dk_split):
            warpgroup.wait_group(0)             # dK's pieces went before DS_READY: dQ is last
        elif const_expr(self.dk_late):
            warpgroup.wait_group(0)             # dV and dQ; this tile's dK goes in the next
        elif const_expr(self.dkv_swap):     # dK^T += Q^T dS
            issue_wgmma(f.mma_dkv, f.acc_dK, f.tKVrQt[None, None, None, si], f.tKVsdS[None, None, None, ds_stage], False)
            warpgroup.wait_group(1)
        else:
            issue_wgmma(f.mma_dkv, f.acc_dK, self.dk_operand(f, rdS, ds_stage), f.tKVrQt[None, None, None, si], False)
            warpgroup.wait_group(1)
        if const_expr(self.config.dq_red):
            # dq_red: straight from the registers into the tile's global slot.
            regs = cute.make_tensor(acc_dQ.iterator, cute.make_layout((4, self.dq_chunks)))
            base = dq_slot.iterator + f.dq_offset
            for g in cutlass.range_constexpr(self.dq_chunks):
                red_add_v4_f32((base + g * 4 * self.threads_per_wg).llvm_ptr,
                               regs[0, g], regs[1, g], regs[2, g], regs[3, g])
        else:
            if state.count > f.unit_count0:     # (dkv_staged: each unit's end waited its last)
                self.dq_buffer_wait(f.wg)
            dq_regs = ((2, 2), self.dq_chunks) if const_expr(self.config.dq_blocked) else (4, self.dq_chunks)
            cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout(dq_regs)), f.sdQ_thr)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=int(Bar.DQ_FULL) + self.dq_wg_index(f.wg),
                                     number_of_threads=self.threads_per_wg + 32)

    @cute.jit
    def wg_dq_and_dk(self, f, rdS, ds_stage, state, si):
        """``wg_dq``: per D half h, dQ[:, h] over this warpgroup's own 64 keys (its k-blocks
        of dS K), the first half issued before dK; once a half is done, warpgroup 0 stores
        it into region h of the shared dQ tile and warpgroup 1 adds its own to it, then
        hands the region to the dQ warp (DQ_FULL + h, as the default's warpgroup h)."""
        kb = self.block_kv // self.num_consumer_wgs // 16    # k-blocks of 16 keys per warpgroup
        dq_tile = (self.block_q, self.head_dim // self.dq_wgs)
        wg = f.wg
        for h in cutlass.range_constexpr(self.dq_wgs):
            mma, tA, tB = f.mma_dq_halves[h], f.tQrdS_halves[h], f.tQrKt_halves[h]
            acc = cute.make_rmem_tensor(mma.partition_shape_C(dq_tile), Float32)
            # The same group either way (one commit): the wait counts below stay static.
            if wg == 0:
                issue_wgmma(mma, acc, tA[None, None, None, ds_stage], tB[None, None, None, 0], True,
                            first_kb=0, num_kb=kb)
            else:
                issue_wgmma(mma, acc, tA[None, None, None, ds_stage], tB[None, None, None, 0], True,
                            first_kb=kb, num_kb=kb)
            if const_expr(h == 0):
                issue_wgmma(f.mma_dkv, f.acc_dK, self.dk_operand(f, rdS, ds_stage),
                            f.tKVrQt[None, None, None, si], False)
                warpgroup.wait_group(1)         # dV and this half; dK in flight
            else:
                warpgroup.wait_group(0)
            self.sum_dq_half(f, acc, h, state)

    @cute.jit
    def sum_dq_half(self, f, acc, h: cutlass.Constexpr[int], state):
        """``wg_dq``: D half h of the tile's dQ into region h of the shared dQ tile.
        Warpgroup 0 (once the dQ warp has read the region's last tile) stores its part and
        arrives at DQ_HALF + h; warpgroup 1 waits there, adds its part to the region's
        values (the same chunks: the fragments are the same) and hands the region to the
        dQ warp. Warpgroup 0 cannot arrive twice before warpgroup 1 waited once: its next
        store waits for the dQ warp, which waits for warpgroup 1."""
        regs = cute.make_tensor(acc.iterator, cute.make_layout((4, self.dq_chunks)))
        dst = f.sdQ_halves[h]
        both = self.num_consumer_wgs * self.threads_per_wg
        if f.wg == 0:
            if state.count > 0:
                self.dq_buffer_wait(h)
            cute.autovec_copy(regs, dst)
            cute.arch.barrier_arrive(barrier_id=int(Bar.DQ_HALF) + h, number_of_threads=both)
        else:
            cute.arch.barrier(barrier_id=int(Bar.DQ_HALF) + h, number_of_threads=both)
            for g in cutlass.range_constexpr(self.dq_chunks):
                part = cute.make_rmem_tensor(4, Float32)
                cute.autovec_copy(dst[None, g], part)
                for i in cutlass.range_constexpr(4):
                    regs[i, g] = regs[i, g] + part[i]
            cute.autovec_copy(regs, dst)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=int(Bar.DQ_FULL) + h,
                                     number_of_threads=self.threads_per_wg + 32)

    @cute.jit
    def consumer_wg(self, tidx):
        """The consumer warpgroup of thread `tidx` (0-based among the consumers), marked
        warp-uniform for ptxas (a shfl from lane 0): the warpgroup's operand offsets and
        the GMMA descriptors built from them then stay in uniform registers. Without it
        (ncu, causal 32K, run of session 8) ~130 vector instructions per tile rebuilt them
        and moved them over with R2UR (9.78 G executed instructions vs FA4's 7.57 G)."""
        return cute.arch.make_warp_uniform(tidx // self.threads_per_wg)

    @cute.jit
    def dq_wg_index(self, wg):
        """The dQ buffer of consumer warpgroup `wg` (``consumer_wg``)."""
        return 0 if const_expr(self.dq_single_wg) else wg

    @cute.jit
    def dq_buffer_wait(self, wg):
        """Wait until the dQ warp's reduce-add has read warpgroup `wg`'s dQ buffer."""
        cute.arch.barrier(barrier_id=int(Bar.DQ_EMPTY) + self.dq_wg_index(wg),
                          number_of_threads=self.threads_per_wg + 32)

    @cute.jit
    def hold_head_columns(self, col_starts, col_lengths, tScS, k_tile, seqlen_k, mBwdIntervals,
                          mask_batch, mh):
        """The thread's key rows' Kc column intervals of mask head ``mh`` into the held
        registers (``hold_columns``), once per head of the pass."""
        for r in cutlass.range_constexpr(cute.size(tScS, mode=[0])):
            key = k_tile * self.block_kv + tScS[r, 0][0]
            self.load_columns(col_starts, col_lengths, r, key, key < seqlen_k, mBwdIntervals,
                              mask_batch, mh)

    @cute.jit
    def load_columns(self, col_starts, col_lengths, r, key, ok, mBwdIntervals, mask_batch, mh):
        """Key `key`'s Kc column intervals into row r of the registers (empty past Nk)."""
        safe = key if ok else 0
        for m in cutlass.range_constexpr(self.num_bwd_intervals):
            col_starts[r, m] = mBwdIntervals[mask_batch, mh, safe, m, 0]
            length = mBwdIntervals[mask_batch, mh, safe, m, 1]
            col_lengths[r, m] = length if ok else 0

    @cute.jit
    def apply_mask(self, P, tScS, q_tile, col_starts, col_lengths, exact, mFwdIntervals,
                   mBwdIntervals, seqlen_q, seqlen_k, k_tile, mh, mask_batch, residual_args,
                   fill: cutlass.Constexpr[float] = 0.0, keep_words=None):
        """Set P^T to `fill` (0; -inf for the soft cap's t) where the (key, query) pair is
        not visible (or out of range); ``keep_words``: see mask_by_column_words."""
        bq, bk = self.block_q, self.block_kv
        row0, col0 = k_tile * bk, q_tile * bq
        if const_expr(self.column_words):
            if exact:
                self.mask_by_column_words(P, tScS, mBwdIntervals, seqlen_q, seqlen_k, row0, col0,
                                          mh, mask_batch, residual_args, fill, keep_words,
                                          (col_starts, col_lengths) if const_expr(self.held_words)
                                          else None)
            elif const_expr(self.residual is not None):
                self.residual_by_rows(P, tScS, mFwdIntervals, seqlen_q, seqlen_k, row0, col0,
                                      mh, mask_batch, residual_args, fill)
            else:
                self.mask_by_rows(P, tScS, mFwdIntervals, seqlen_q, seqlen_k, row0, col0, mh,
                                  mask_batch, fill)
        elif const_expr(self.residual is not None):
            self.apply_mask_residual(P, tScS, exact, mFwdIntervals, mBwdIntervals, seqlen_q,
                                     seqlen_k, row0, col0, mh, mask_batch, residual_args, fill)
        elif const_expr(self.row_mask):
            self.mask_by_rows(P, tScS, mFwdIntervals, seqlen_q, seqlen_k, row0, col0, mh,
                              mask_batch, fill)
        elif exact and const_expr(self.column_bits):
            # Interval-outer: each of the row's Kc (start, length) pairs is loaded once
            # and tested against the row's columns; bit c of `seen` says column c is
            # visible (the row holds at most 32 columns: asserted at trace time).
            ncols = cute.size(P, mode=[1])
            assert ncols <= 32, f"column_bits needs <= 32 columns per thread row, got {ncols}"
            seen_t = cute.make_rmem_tensor(1, Uint32)
            for r in cutlass.range_constexpr(cute.size(P, mode=[0])):
                key = row0 + tScS[r, 0][0]
                key_ok = key < seqlen_k
                safe = key if key_ok else 0
                seen = Uint32(0)
                if const_expr(self.columns_looped):
                    # Any Kc: a loop that is not unrolled; intervals that miss this tile's
                    # queries [col0, col0 + bq) are skipped.
                    seen_t[0] = Uint32(0)
                    for m in cutlass.range(self.num_bwd_intervals, unroll=1):
                        start = mBwdIntervals[mask_batch, mh, safe, m, 0]
                        length = mBwdIntervals[mask_batch, mh, safe, m, 1]
                        if (length > 0) & (start < col0 + bq) & (start + length > col0):
                            for c in cutlass.range_constexpr(ncols):
                                if _unsigned_lt(col0 + tScS[r, c][1] - start, length):
                                    seen_t[0] = seen_t[0] | Uint32(1 << c)
                    seen = seen_t[0]
                elif const_expr(self.config.column_skip):
                    # Unrolled, but an interval that misses the tile's queries is skipped.
                    seen_t[0] = Uint32(0)
                    for m in cutlass.range_constexpr(self.num_bwd_intervals):
                        start = mBwdIntervals[mask_batch, mh, safe, m, 0]
                        length = mBwdIntervals[mask_batch, mh, safe, m, 1]
                        if (length > 0) & (start < col0 + bq) & (start + length > col0):
                            for c in cutlass.range_constexpr(ncols):
                                if _unsigned_lt(col0 + tScS[r, c][1] - start, length):
                                    seen_t[0] = seen_t[0] | Uint32(1 << c)
                    seen = seen_t[0]
                else:
                    for m in cutlass.range_constexpr(self.num_bwd_intervals):
                        start = mBwdIntervals[mask_batch, mh, safe, m, 0]
                        length = mBwdIntervals[mask_batch, mh, safe, m, 1]
                        for c in cutlass.range_constexpr(ncols):
                            if _unsigned_lt(col0 + tScS[r, c][1] - start, length):
                                seen = seen | Uint32(1 << c)
                for c in cutlass.range_constexpr(ncols):
                    i = col0 + tScS[r, c][1]
                    keep = (seen & Uint32(1 << c) != Uint32(0)) & key_ok & (i < seqlen_q)
                    P[r, c] = P[r, c] if keep else Float32(fill)
        elif exact:
            for r in cutlass.range_constexpr(cute.size(P, mode=[0])):
                key_ok = row0 + tScS[r, 0][0] < seqlen_k
                if const_expr(not self.hold_columns):     # this row's Kc intervals, re-read
                    self.load_columns(col_starts, col_lengths, r, row0 + tScS[r, 0][0], key_ok,
                                      mBwdIntervals, mask_batch, mh)
                for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                    i = col0 + tScS[r, c][1]
                    vis = Boolean(False)
                    for m in cutlass.range_constexpr(self.num_bwd_intervals):
                        vis = vis | _unsigned_lt(i - col_starts[r, m], col_lengths[r, m])
                    keep = vis & key_ok & (i < seqlen_q)
                    P[r, c] = P[r, c] if keep else Float32(fill)
        else:
            self.mask_by_rows(P, tScS, mFwdIntervals, seqlen_q, seqlen_k, row0, col0, mh,
                              mask_batch, fill)

    @cute.jit
    def mask_query_rows(self, P, tScS, mFwdIntervals, seqlen_q, seqlen_k, q0, k0, mh, mask_batch,
                        residual_args, fill: cutlass.Constexpr[float] = 0.0):
        """``dkv_swap``: P (query rows, key columns) set to ``fill`` where the pair is not
        visible, by the forward row intervals of each of the thread's query rows (and their
        residual predicates: the forward program of the row's region), or out of range. Up
        to INTERVALS_UNROLLED intervals are held and tested per element; above, or with
        residuals, each interval that meets the tile's keys sets its columns' bits in a
        visibility mask (the intervals looped, not unrolled, without residuals)."""
        nrows, ncols = cute.size(P, mode=[0]), cute.size(P, mode=[1])
        assert ncols <= 32, f"the query-row mask needs <= 32 key columns per thread, got {ncols}"
        ops = None
        if const_expr(self.residual is not None):
            ops = CuteOps(residual_args[1], mask_batch, seqlen_q, seqlen_k)
        for r in cutlass.range_constexpr(nrows):
            i = q0 + tScS[r, 0][0]
            q_ok = i < seqlen_q
            safe = i if q_ok else 0
            if const_expr(self.rows_looped or self.residual is not None):
                region = residual_args[0][mask_batch, safe] if const_expr(self.residual is not None) else None
                seen_t = cute.make_rmem_tensor(1, Uint32)
                seen_t[0] = Uint32(0)
                if const_expr(self.residual is not None):
                    for m in cutlass.range_constexpr(self.num_intervals):
                        self.mark_query_row(seen_t, P, tScS, r, i, k0, m, mFwdIntervals[mask_batch, mh, safe, m, None],
                                            ops, mh, region)
                else:
                    for m in cutlass.range(self.num_intervals, unroll=1):
                        self.mark_query_row(seen_t, P, tScS, r, i, k0, m, mFwdIntervals[mask_batch, mh, safe, m, None],
                                            ops, mh, region)
                seen = seen_t[0]
                for c in cutlass.range_constexpr(ncols):
                    j = k0 + tScS[r, c][1]
                    keep = (seen & Uint32(1 << c) != Uint32(0)) & q_ok & (j < seqlen_k)
                    P[r, c] = P[r, c] if keep else Float32(fill)
            else:
                starts = cute.make_rmem_tensor(self.num_intervals, Int32)
                lengths = cute.make_rmem_tensor(self.num_intervals, Int32)
                for m in cutlass.range_constexpr(self.num_intervals):
                    # One 8-byte load per (start, length) (see mask_by_rows).
                    lo, n = ld_pair_s32(mFwdIntervals[mask_batch, mh, safe, m, None].iterator.llvm_ptr)
                    starts[m] = lo
                    lengths[m] = n
                for c in cutlass.range_constexpr(ncols):
                    j = k0 + tScS[r, c][1]
                    vis = Boolean(False)
                    for m in cutlass.range_constexpr(self.num_intervals):
                        vis = vis | _unsigned_lt(j - starts[m], lengths[m])
                    keep = vis & q_ok & (j < seqlen_k)
                    P[r, c] = P[r, c] if keep else Float32(fill)

    @cute.jit
    def mark_query_row(self, seen_t, P, tScS, r: cutlass.Constexpr[int], i, k0, m, interval, ops, mh,
                       region):
        """``mask_query_rows``: the bits of row r's key columns inside ``interval`` (start,
        length; slot m's residual AND-ed when it has one, m then static) set in seen_t[0];
        an interval that misses the tile's keys is skipped."""
        start, length = interval[0], interval[1]
        if (length > 0) & (start < k0 + self.block_kv) & (start + length > k0):
            for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                j = k0 + tScS[r, c][1]
                hit = _unsigned_lt(j - start, length)
                if const_expr(self.residual is not None):
                    if const_expr(len(self.residual[0].slots[m]) > 0):
                        hit = hit & self.residual[0].emit_slot(ops, m, q=i, k=j, h=mh, region=region)
                if hit:
                    seen_t[0] = seen_t[0] | Uint32(1 << c)

    @cute.jit
    def mask_by_rows(self, P, tScS, mFwdIntervals, seqlen_q, seqlen_k, row0, col0, mh,
                     mask_batch, fill: cutlass.Constexpr[float] = 0.0):
        """P^T masked by the forward row intervals of each query column (where the column
        view is not exact, or with ``row_mask``)."""
        bq, bk = self.block_q, self.block_kv
        if const_expr(self.rows_looped):
            # Forward row intervals of each query column, K > INTERVALS_UNROLLED: a loop
            # over them (not unrolled), skipping those that miss this tile's keys; bit r of
            # the mask says key row r is visible.
            nrows = cute.size(P, mode=[0])
            assert nrows <= 32, f"the row-interval loop needs <= 32 key rows per thread, got {nrows}"
            seen_t = cute.make_rmem_tensor(1, Uint32)
            for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                i = col0 + tScS[0, c][1]
                q_ok = i < seqlen_q
                safe = i if q_ok else 0
                seen_t[0] = Uint32(0)
                for m in cutlass.range(self.num_intervals, unroll=1):
                    start = mFwdIntervals[mask_batch, mh, safe, m, 0]
                    length = mFwdIntervals[mask_batch, mh, safe, m, 1]
                    if (length > 0) & (start < row0 + bk) & (start + length > row0):
                        for r in cutlass.range_constexpr(nrows):
                            if _unsigned_lt(row0 + tScS[r, c][0] - start, length):
                                seen_t[0] = seen_t[0] | Uint32(1 << r)
                seen = seen_t[0]
                for r in cutlass.range_constexpr(nrows):
                    j = row0 + tScS[r, c][0]
                    keep = (seen & Uint32(1 << r) != Uint32(0)) & q_ok & (j < seqlen_k)
                    P[r, c] = P[r, c] if keep else Float32(fill)
        else:
            # Forward row intervals of each query column (K per query).
            for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                i = col0 + tScS[0, c][1]
                q_ok = i < seqlen_q
                safe = i if q_ok else 0
                starts = cute.make_rmem_tensor(self.num_intervals, Int32)
                lengths = cute.make_rmem_tensor(self.num_intervals, Int32)
                for m in cutlass.range_constexpr(self.num_intervals):
                    if const_expr(self.row_mask):
                        # One 8-byte load per (start, length): every pair starts at an
                        # even int32 offset of a buffer XLA aligns to >= 16 bytes.
                        lo, n = ld_pair_s32(
                            mFwdIntervals[mask_batch, mh, safe, m, None].iterator.llvm_ptr)
                        starts[m] = lo
                        lengths[m] = n
                    else:
                        starts[m] = mFwdIntervals[mask_batch, mh, safe, m, 0]
                        lengths[m] = mFwdIntervals[mask_batch, mh, safe, m, 1]
                for r in cutlass.range_constexpr(cute.size(P, mode=[0])):
                    j = row0 + tScS[r, c][0]
                    vis = Boolean(False)
                    for m in cutlass.range_constexpr(self.num_intervals):
                        vis = vis | _unsigned_lt(j - starts[m], lengths[m])
                    keep = vis & q_ok & (j < seqlen_k)
                    P[r, c] = P[r, c] if keep else Float32(fill)

    @cute.jit
    def apply_mask_residual(self, P, tScS, exact, mFwdIntervals, mBwdIntervals, seqlen_q,
                            seqlen_k, row0, col0, mh, mask_batch, residual_args,
                            fill: cutlass.Constexpr[float]):
        """apply_mask of a residual mask: each slot's interval AND its emitted residual
        (column view: the column program per key row; no column view: the forward program
        per query column, with the query row's region); slots unrolled, those that miss the
        tile skipped; visibility gathered in bit masks."""
        if exact:
            self.residual_by_columns(P, tScS, mBwdIntervals, seqlen_q, seqlen_k, row0, col0,
                                     mh, mask_batch, residual_args, fill)
        else:
            self.residual_by_rows(P, tScS, mFwdIntervals, seqlen_q, seqlen_k, row0, col0,
                                  mh, mask_batch, residual_args, fill)

    @cute.jit
    def mask_by_column_words(self, P, tScS, mBwdIntervals, seqlen_q, seqlen_k, row0, col0, mh,
                             mask_batch, residual_args, fill: cutlass.Constexpr[float], keep_words=None,
                             held=None):
        """``column_words``, column view: per key row, each of its Kc intervals that reaches
        into the tile's queries ORs its column-group runs into a pair of words (the slots
        without a residual predicate into one pair, each slot with one into its own), the
        row's range (key < Nk, query < Nq) folded in; then per element: the word bit, OR
        for the predicate slots the bit AND the column program's predicate. The visibility
        of the per-element paths, with 2 word ORs per interval instead of a subtract-compare
        per interval and element. ``keep_words`` (``ds_words``): each row's final words (word 1 in
        the high half) go there, for dS^T. ``held`` (``held_words``): the (starts, lengths)
        registers of the rows' column intervals (``load_columns``), read instead of the table."""
        ncols = cute.size(P, mode=[1])
        groups = ncols // 2
        pred_slots = self.column_pred_slots
        ops = None
        if const_expr(len(pred_slots) > 0):
            ops = CuteOps(residual_args[1], mask_batch, seqlen_q, seqlen_k)
        nw = 2 * (1 + len(pred_slots))
        words = cute.make_rmem_tensor(nw, Uint32)
        for r in cutlass.range_constexpr(cute.size(P, mode=[0])):
            key = row0 + tScS[r, 0][0]
            key_ok = key < seqlen_k
            safe = key if key_ok else 0
            base = col0 + tScS[r, 0][1]
            for w in cutlass.range_constexpr(nw):
                words[w] = Uint32(0)
            if const_expr(len(pred_slots) == 0 and self.num_bwd_intervals > COLUMNS_UNROLLED):
                for m in cutlass.range(self.num_bwd_intervals, unroll=1):
                    self.add_column_runs(words, 0, mBwdIntervals, mask_batch, mh, safe, m, col0, base,
                                         groups)
            else:
                for m in cutlass.range_constexpr(self.num_bwd_intervals):
                    pair = 0 if const_expr(m not in pred_slots) else 2 * (1 + pred_slots.index(m))
                    if const_expr(held is not None):
                        self.add_run_values(words, pair, held[0][r, m], held[1][r, m], col0, base,
                                            groups)
                    else:
                        self.add_column_runs(words, pair, mBwdIntervals, mask_batch, mh, safe, m,
                                             col0, base, groups)
            below0, below1 = _pair_runs(Int32(0), seqlen_q - base, groups)
            below0 = below0 if key_ok else Uint32(0)
            below1 = below1 if key_ok else Uint32(0)
            for w in cutlass.range_constexpr(nw // 2):
                words[2 * w] = words[2 * w] & below0
                words[2 * w + 1] = words[2 * w + 1] & below1
            general = pred_slots
            if const_expr(self.residual_periodic):
                # Slots whose predicate has period 8 in q: once per key row and column class.
                general = fold_periodic_slots(
                    words, pred_slots, self.periodic_slots,
                    lambda m, u: self.residual[1].emit_slot(ops, m, q=base + u, k=key, h=mh,
                                                            region=None))
            if const_expr(keep_words is not None):
                assert len(general) == 0 and groups <= 16
                keep_words[r] = words[0] | (words[1] << Uint32(16))
            if const_expr(len(general) == 0 and (self.config.mask_r2p or self.residual_periodic)):
                select_by_words(P, r, words[0], words[1], groups, fill)
            else:
                for c in cutlass.range_constexpr(ncols):
                    bit = Uint32(1 << (c // 2))
                    keep = words[c % 2] & bit != Uint32(0)
                    if const_expr(len(general) > 0):
                        i = col0 + tScS[r, c][1]
                        for j, m in enumerate(pred_slots):
                            if const_expr(m in general):
                                hit = words[2 * (1 + j) + c % 2] & bit != Uint32(0)
                                keep = keep | (hit & self.residual[1].emit_slot(ops, m, q=i, k=key,
                                                                               h=mh, region=None))
                    P[r, c] = P[r, c] if keep else Float32(fill)

    @cute.jit
    def add_column_runs(self, words, pair, mBwdIntervals, mask_batch, mh, key, m, col0, base, groups):
        """ORs key `key`'s column interval m into words[pair], words[pair + 1] when it
        reaches into the tile's queries [col0, col0 + block_q)."""
        self.add_run_values(words, pair, mBwdIntervals[mask_batch, mh, key, m, 0],
                            mBwdIntervals[mask_batch, mh, key, m, 1], col0, base, groups)

    @cute.jit
    def add_run_values(self, words, pair, start, length, col0, base, groups):
        """ORs the column interval [start, start + length) into words[pair], words[pair + 1]
        when it reaches into the tile's queries [col0, col0 + block_q)."""
        if (length > 0) & (start < col0 + self.block_q) & (start + length > col0):
            run0, run1 = _pair_runs(start - base, start - base + length, groups)
            words[pair] = words[pair] | run0
            words[pair + 1] = words[pair + 1] | run1

    @cute.jit
    def residual_by_columns(self, P, tScS, mBwdIntervals, seqlen_q, seqlen_k, row0, col0, mh,
                            mask_batch, residual_args, fill: cutlass.Constexpr[float]):
        """Column view: per key row r, its Kc intervals AND the column program's residuals."""
        ops = CuteOps(residual_args[1], mask_batch, seqlen_q, seqlen_k)
        nrows, ncols = cute.size(P, mode=[0]), cute.size(P, mode=[1])
        assert ncols <= 32
        seen_t = cute.make_rmem_tensor(1, Uint32)
        for r in cutlass.range_constexpr(nrows):
            key = row0 + tScS[r, 0][0]
            key_ok = key < seqlen_k
            safe = key if key_ok else 0
            seen_t[0] = Uint32(0)
            for m in cutlass.range_constexpr(self.num_bwd_intervals):
                start = mBwdIntervals[mask_batch, mh, safe, m, 0]
                length = mBwdIntervals[mask_batch, mh, safe, m, 1]
                if (length > 0) & (start < col0 + self.block_q) & (start + length > col0):
                    for c in cutlass.range_constexpr(ncols):
                        i = col0 + tScS[r, c][1]
                        hit = _unsigned_lt(i - start, length)
                        if const_expr(len(self.residual[1].slots[m]) > 0):
                            hit = hit & self.residual[1].emit_slot(ops, m, q=i, k=key, h=mh,
                                                                   region=None)
                        if hit:
                            seen_t[0] = seen_t[0] | Uint32(1 << c)
            seen = seen_t[0]
            for c in cutlass.range_constexpr(ncols):
                i = col0 + tScS[r, c][1]
                keep = (seen & Uint32(1 << c) != Uint32(0)) & key_ok & (i < seqlen_q)
                P[r, c] = P[r, c] if keep else Float32(fill)

    @cute.jit
    def residual_by_rows(self, P, tScS, mFwdIntervals, seqlen_q, seqlen_k, row0, col0, mh,
                         mask_batch, residual_args, fill: cutlass.Constexpr[float]):
        """No column view: per query column c, its K forward intervals AND the forward
        program's residuals of the query row's region."""
        mRegion, mParams = residual_args
        ops = CuteOps(mParams, mask_batch, seqlen_q, seqlen_k)
        nrows, ncols = cute.size(P, mode=[0]), cute.size(P, mode=[1])
        assert nrows <= 32
        seen_t = cute.make_rmem_tensor(1, Uint32)
        for c in cutlass.range_constexpr(ncols):
            i = col0 + tScS[0, c][1]
            q_ok = i < seqlen_q
            safe = i if q_ok else 0
            region = mRegion[mask_batch, safe]
            seen_t[0] = Uint32(0)
            for m in cutlass.range_constexpr(self.num_intervals):
                start = mFwdIntervals[mask_batch, mh, safe, m, 0]
                length = mFwdIntervals[mask_batch, mh, safe, m, 1]
                if (length > 0) & (start < row0 + self.block_kv) & (start + length > row0):
                    for r in cutlass.range_constexpr(nrows):
                        j = row0 + tScS[r, c][0]
                        hit = _unsigned_lt(j - start, length)
                        if const_expr(len(self.residual[0].slots[m]) > 0):
                            hit = hit & self.residual[0].emit_slot(ops, m, q=i, k=j, h=mh,
                                                                   region=region)
                        if hit:
                            seen_t[0] = seen_t[0] | Uint32(1 << r)
            seen = seen_t[0]
            for r in cutlass.range_constexpr(nrows):
                j = row0 + tScS[r, c][0]
                keep = (seen & Uint32(1 << r) != Uint32(0)) & q_ok & (j < seqlen_k)
                P[r, c] = P[r, c] if keep else Float32(fill)

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, mdK, mdV, tiled_mma_dkv, tidx, seqlen_k, k_tile, head_kv, batch):
        """dK (times the softmax scale) and dV to global, rows past Nk dropped."""
        thr = tiled_mma_dkv.get_slice(tidx)
        coords = _rows_view(thr.partition_C(cute.make_identity_tensor((self.block_kv, self.head_dim))))
        dK = _rows_view(acc_dK)
        dV = _rows_view(acc_dV)
        scale = Float32(self.grad_scale)
        for r in cutlass.range_constexpr(cute.size(dK, mode=[0])):
            row = k_tile * self.block_kv + coords[r, 0][0]
            if row < seqlen_k:
                for c in cutlass.range_constexpr(cute.size(dK, mode=[1])):
                    col = coords[r, c][1]
                    mdK[batch, row, head_kv, col] = (dK[r, c] * scale).to(self.dtype)
                    mdV[batch, row, head_kv, col] = dV[r, c].to(self.dtype)

    def output_regs(self, acc, scale=None):
        """An fp32 accumulator (times ``scale``) in the input dtype, in its own register
        layout: what the stored dK / dV epilogues (``epilogue_tma``, ``epilogue_vec``) copy out."""
        out = cute.make_rmem_tensor_like(acc, self.dtype)
        vals = acc.load()
        if const_expr(scale is not None):
            vals = vals * Float32(scale)
        out.store(vals.to(self.dtype))
        return out

    @cute.jit
    def epilogue_vec(self, acc_dK, acc_dV, mdK, mdV, tiled_mmas_dkv, tidx, seqlen_k, k_tile,
                     head_kv, batch):
        """``config.dkv_vec_store``: dK (times the softmax scale) and dV straight from the
        registers to global, each thread's adjacent column pair in one 32-bit store (no
        shared memory, no barrier: the warps exit as soon as their stores are issued, where
        the TMA store's CTA waits for it to read shared memory); a key tile that runs past
        Nk goes element by element (``epilogue``)."""
        tiled_mma_dkv, tiled_mma_dv = tiled_mmas_dkv
        bk = self.block_kv
        if (k_tile + 1) * bk <= seqlen_k:
            pair = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=2 * self.dtype.width)
            store_k = cute.make_tiled_copy_C(pair, tiled_mma_dkv).get_slice(tidx)
            store_v = store_k
            if const_expr(self.head_dim_v != self.head_dim):
                store_v = cute.make_tiled_copy_C(pair, tiled_mma_dv).get_slice(tidx)
            gdK = cute.local_tile(mdK[batch, None, head_kv, None], (bk, self.head_dim), (k_tile, 0))
            gdV = cute.local_tile(mdV[batch, None, head_kv, None], (bk, self.head_dim_v), (k_tile, 0))
            cute.copy(store_k, store_k.retile(self.output_regs(acc_dK, self.grad_scale)),
                      store_k.partition_D(gdK))
            cute.copy(store_v, store_v.retile(self.output_regs(acc_dV)), store_v.partition_D(gdV))
        else:
            self.epilogue(acc_dK, acc_dV, mdK, mdV, tiled_mma_dkv, tidx, seqlen_k, k_tile, head_kv,
                          batch)

    @cute.jit
    def epilogue_tma(self, acc_dK, acc_dV, mdK, mdV, sK, sV, atoms, tiled_mmas_dkv, tidx, k_tile,
                     head_kv, batch):
        """dK (times the softmax scale) and dV: registers -> K's and V's buffers (stmatrix)
        -> one TMA store each; the TMA clips rows past Nk."""
        tma_atom_dk, tma_atom_dv = atoms
        both = self.num_consumer_wgs * self.threads_per_wg
        # The other warpgroup's last dQ product reads all of K: wait for it.
        cute.arch.barrier(barrier_id=int(Bar.EPILOGUE), number_of_threads=both)
        tiled_mma_dkv, tiled_mma_dv = tiled_mmas_dkv
        # dkv_swap: dK^T / dV^T (D or Dv, keys; a thread's pairs along the keys) into the
        # buffers seen (D or Dv, keys): stmatrix.trans writes them as key rows.
        stmatrix = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.dkv_swap, num_matrices=4), self.dtype)
        smem_store = cute.make_tiled_copy_C(stmatrix, tiled_mma_dkv).get_slice(tidx)
        smem_store_v = smem_store
        if const_expr(self.head_dim_v != self.head_dim and not self.dkv_swap):
            smem_store_v = cute.make_tiled_copy_C(stmatrix, tiled_mma_dv).get_slice(tidx)
        sK_out, sV_out = sK[None, None, 0], sV[None, None, 0]
        if const_expr(self.dkv_swap):
            sK_out = cute.make_tensor(sK.iterator, cute.select(sK.layout, mode=[1, 0, 2]))[None, None, 0]
            sV_out = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))[None, None, 0]
        cute.copy(smem_store, smem_store.retile(self.output_regs(acc_dK, self.grad_scale)),
                  smem_store.partition_D(sK_out))
        cute.copy(smem_store_v, smem_store_v.retile(self.output_regs(acc_dV)),
                  smem_store_v.partition_D(sV_out))
        # Generic-proxy smem writes are fenced before the TMA (async proxy) reads them.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Bar.EPILOGUE), number_of_threads=both)
        if tidx // 32 == 0:
            d, bk = self.head_dim, self.block_kv
            gdK = cute.local_tile(mdK[None, None, head_kv, batch], (bk, d), (k_tile, 0))
            gdV = cute.local_tile(mdV[None, None, head_kv, batch], (bk, self.head_dim_v), (k_tile, 0))
            tKsK, tKgK = tma_tiles(tma_atom_dk, sK, gdK)
            tVsV, tVgV = tma_tiles(tma_atom_dv, sV, gdV)
            cute.copy(tma_atom_dk, tKsK[None, 0], tKgK)
            cute.copy(tma_atom_dv, tVsV[None, 0], tVgV)
            cute.arch.cp_async_bulk_commit_group()
            # The CTA's shared memory must outlive the stores' reads of it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)


class _Namespace:
    """A bag of traced values handed between the kernel's methods (tracing only reads and
    sets its attributes): the CTA's buffers / tensors / coordinates, a head's column
    intervals, one tile's registers shared by ``step``'s phases."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Fragments:
    """The consumer's per-CTA operand fragments and accumulators, handed to each step as
    one object (a plain namespace: tracing only reads its attributes)."""
