"""JAX entry point of the CuTe DSL forward kernel: compile cache, FFI registration, call.

`cute_forward` is traceable (usable inside `jax.jit`). On the first call for a given
`ForwardKey` it compiles `FlashForwardSm90` with TVM-FFI and an environment stream
(the stream XLA runs the custom call on), registers it as an XLA FFI target for the
GPU platform through `jax_tvm_ffi`, and emits a `jax.ffi.ffi_call`. Shapes (batch,
lengths, head counts) are runtime values of the compiled function: a new sequence
length does not recompile. Importing this module needs neither a GPU nor cutlass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...ffi.registry import match_varying

_DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)          # Dv == D; validated on the H200 (NOTES.md)
# (D, Dv) pairs with Dv != D (DeepSeek-style 192 / 128); validated on the H200 with the
# backward's (tests/gpu/test_cute_head_dims.py, 2026-12-03).
HEAD_DIM_PAIRS = ((192, 128),)
# Head dims (Dv == D) whose forward has kernels of its own (backends.cute_forward_head_dims,
# the default since session 47; narrower dims run them in place): 128 x 128 tiles and D 128's
# loop and switches, Q / K / V in 64B- (D 96) or 32B-swizzled (D 80) rows. The forward at D 128
# does the same work plus 33% (D 96) / 60% (D 80) of zero columns.
FWD_NATIVE_HEAD_DIMS = (80, 96)
# Head dims (Dv == D) whose backward has kernels of its own (backends.cute_backward_head_dims):
# D 128's config, Q / K / V / dO in 32B-swizzled rows so that dQ's halves of 48 columns start
# a swizzle atom (dq_warpgroups). D 80's halves of 40 would need unswizzled rows: it runs
# D 96's kernels in place (1.2x its matmul work; D 128's: 1.6x).
BWD_NATIVE_HEAD_DIMS = (96,)
# Dynamic shared memory one CTA may opt into on SM90 (227 KB).
_SMEM_LIMIT = 232448
# Shared memory the forward's work list adds: one chunk of tile indices (FWD_LIST_CHUNK
# int32) and its count / barrier words.
_WORK_LIST_SMEM = 4 * 512 + 32
_WORK_RUNS_SMEM = 8 * 512 + 32


def preferred_forward_tiles(head_dim: int, dtype: str = "bfloat16") -> tuple[int, int]:
    """(block_q, block_kv) the SM90 forward kernel wants its descriptor built at.

    Always 128 query rows: two consumer warpgroups of 64 rows each. Per consumer thread
    S takes block_kv / 2 fp32 registers, P block_kv / 4, O head_dim / 2, out of 240.
    - D = 128: 128 keys (S 64 + P 32 + O 64). FlashAttention-3 uses the same shape for
      hdim 128 on H100 (tile_size_fwd_sm90); 582 TF/s causal 32K on the H200 (NOTES.md).
    - D = 64: 128 keys as well (S 64 + P 32 + O 32). FA3 runs 192 rows (three consumer
      warpgroups) at this dim; this kernel has two, and a wider key tile would only
      coarsen the descriptor. Not yet measured on the device.
    - D = 256: 80 keys (S 40 + P 20 + O 128 = 188 registers), FA3's choice for hdim
      256. Shared memory binds: Q (64 KB) + 2 stages of K and V at 80 keys (160 KB) is
      224 KB of the 227 available; 96 keys would need 256 KB, i.e. a single stage and
      no load/compute overlap.
    - D = 192 / Dv = 128 (DeepSeek-style): 128 keys (S 64 + P 32 + O 64 registers, as at
      D = 128); shared memory Q 48 KB + 2 stages of K (2 x 48 KB) and V (2 x 32 KB) =
      208 KB + 1 KB, O staged in Q's buffer. Chosen by arithmetic (FlashAttention's SM90
      forward also runs 128 x 128 at 192 / 128); to be measured on the H200.
    bf16 and fp16 share the shapes (same element size, same wgmma shapes).
    """
    del dtype
    if head_dim <= 128 or head_dim == 192:
        return (128, 128)
    return (128, 80)


def preferred_forward_stages(head_dim: int, dtype: str = "bfloat16") -> int:
    """Depth of the K/V ring: 2 for D = 128 (measured, NOTES.md) and D = 256 (224 KB of
    shared memory is all there is); 3 for D = 64, whose tiles are half as long to
    compute, so the load latency is hidden over more of them (80 KB -> 112 KB). The
    D = 64 choice is not yet measured against 2."""
    del dtype
    return 3 if head_dim == 64 else 2


def forward_smem_bytes(head_dim: int, block_q: int, block_kv: int, num_stages: int,
                       elem_bytes: int = 2, head_dim_v: int | None = None) -> int:
    """Shared memory of FlashForwardSm90: barriers (padded to the 1 KB swizzle
    alignment), Q (O is staged in it), and `num_stages` K and V tiles."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 1024 + elem_bytes * (head_dim * (block_q + num_stages * block_kv)
                                + dv * num_stages * block_kv)



def _check_io_head_dims(what: str, io, head_dim: int, head_dim_v: int) -> None:
    """``io_head_dims`` of a kernel key: None, or (D, Dv) no wider than the kernel's head
    dims, not both equal to them, and multiples of 8 (TMA's 16-byte global strides)."""
    if io is None:
        return
    d, dv = io
    if not (0 < d <= head_dim and 0 < dv <= head_dim_v) or (d, dv) == (head_dim, head_dim_v) \
            or d % 8 or dv % 8:
        raise ValueError(f"{what}(io_head_dims={io!r}) must be narrower than the kernel's head "
                         f"dims {head_dim}/{head_dim_v} (None when equal) and multiples of 8")


def _io_suffix(io) -> str:
    """The kernel name's mark of ``io_head_dims``."""
    return "" if io is None else f"_io{io[0]}x{io[1]}"


def _io_head_dims(what: str, d: int, dv: int, kernel_head_dims):
    """The ``io_head_dims`` of a call of (d, dv) arrays on the kernel of ``kernel_head_dims``
    (None: the arrays' own; also None when equal to them)."""
    if kernel_head_dims is None or tuple(kernel_head_dims) == (d, dv):
        return None
    kd, kdv = kernel_head_dims
    if kd < d or kdv < dv or d % 8 or dv % 8:
        raise ValueError(f"{what}: kernel_head_dims={tuple(kernel_head_dims)} must be at least "
                         f"the arrays' head dims {d}/{dv}, which must be multiples of 8 (TMA's "
                         "16-byte strides); pad the arrays otherwise")
    return (d, dv)


@dataclasses.dataclass(frozen=True)
class ForwardKey:
    """Everything the compiled forward kernel depends on statically."""

    dtype: str  # "bfloat16" | "float16"
    head_dim: int
    head_dim_v: int
    num_intervals: int  # K of the interval table
    block_q: int
    block_kv: int
    broadcast_batch: bool  # mask batch dim Bm == 1 while B may be > 1
    broadcast_head: bool  # mask head dim Hm == 1
    scale: float  # folded into the exp2 argument; static per model
    num_stages: int = 2
    softcap: float | None = None  # logits = cap * tanh(scale * q.k / cap); static per model
    # tanh.approx instead of the exact (error < ~4e-7) form (see FlashForwardSm90.apply_softcap);
    # misses the LSE tolerance policy, so only benchmarks set it.
    softcap_fast_tanh: bool = False
    # Residual predicates per forward slot (jcompilemask.lower.residual_program), evaluated
    # in partial tiles; the kernel then also reads the row regions and a parameter table.
    residual: Any = None
    # Masks with K > bits_above test a masked tile's intervals one at a time (those that miss
    # the tile skipped) into bit masks; 8 is the validated default, lower values are a
    # benchmark knob ($JCOMPILEMASK_CUTE_FWD_BITS_ABOVE; issue 14 item 3).
    bits_above: int = 8
    # Past INTERVALS_UNROLLED intervals a masked tile walks the row's K intervals from the
    # table in a loop (apply_mask_bits / apply_mask_bits_groups); interval_unroll > 1
    # unrolls that loop by this factor, so several intervals' table loads are in flight
    # (issue 16; $JCOMPILEMASK_CUTE_FWD_INTERVAL_UNROLL, a benchmark knob until timed). The
    # motivating record: a 25-run dense mask at 8K spends ~3.5x a causal tile's time per
    # visited tile in that loop (H100, run 2026-12-07T11:05:48Z, NOTES.md session 48).
    # Bit-identical by construction (the same OR of the same runs). Ignored at K <= 8.
    interval_unroll: int = 1
    # The compact work list in the forward (issue 14 item 1; what cute_forward compiles where
    # it fits, see _fwd_work_list): producer and consumers iterate the row's visited key
    # tiles instead of walking every tile's bits.
    work_list: bool = False
    # A 1-D grid over work units in the host's order (issue 14 item 2;
    # $JCOMPILEMASK_CUTE_FWD_SCHEDULE=1, a benchmark knob): longest first by the
    # descriptor's visited-tile counts, heads grouped so their K / V fit in L2
    # (forward_schedule); the kernel then also reads that order, int32 [B * Hq * Tq].
    # Measured slower than the default grid with the work list (run 2026-12-03T17:23:20Z,
    # h200-fwd-variants.json, fwd ms): causal 32K 14.62 -> 14.79, 2K 1.205 -> 1.282; hstu
    # 32K 17.08 -> 17.08, 2K 1.349 -> 1.422.
    schedule: bool = False
    # Persistent CTAs (issue 14 item 2; $JCOMPILEMASK_CUTE_FWD_SCHEDULE=persistent): one per
    # SM, each running its row of persistent_schedule's table; implies the order above.
    # Slower still in the same run: causal 32K 14.95, 2K 1.287; hstu 17.27, 1.427.
    persistent: bool = False
    # K(t + 1) loaded before V(t) (FA4's SM90 producer order; issue 14;
    # $JCOMPILEMASK_CUTE_FWD_K_AHEAD=1 for benchmarks until measured).
    k_ahead: bool = False
    # A masked tile's visibility built per row as bit words of column groups from each
    # interval's ends (FlashForwardSm90.apply_mask_groups; issue 14 item 3; what
    # cute_forward compiles, see _fwd_group_mask; $JCOMPILEMASK_CUTE_FWD_GROUP_MASK=0 opts
    # out). Any K (on the bit-mask path, intervals that reach into the tile); not with a
    # residual program.
    group_mask: bool = False
    # O's rescale by each step's row factors in the tile loop's common tail, beside the P
    # conversion the compiler sinks there (FlashForwardSm90.rescale_tail; issue 14;
    # $JCOMPILEMASK_CUTE_FWD_RESCALE_TAIL=1). Bit-identical (6 cases on the H200) and
    # slower at every point timed (run 2026-12-03T21:56:51Z, fwd ms, causal 32K 14.45 ->
    # 14.92, 8K 3.92 -> 4.02, 2K 1.198 -> 1.227; hstu / shared prompt +0.2-1.6%):
    # a benchmark knob, off.
    rescale_tail: bool = False
    # A residual mask's masked tile: each slot's interval as column-group words, then per
    # element the word bit AND the slot's predicate (FlashForwardSm90.residual_words; issue
    # 16). Static SASS, dilated window (K 1, D 128): 1246 -> 815 instructions per masked
    # tile (NOTES.md, session 21). On the H200: o bit-identical to the per-interval path on
    # 6 residual masks and 11 forward + gradient cases against the oracle under it (session
    # 23); fwd ms, dilated window (128, dilation 2), 0.633 -> 0.536 at 8K (run
    # 2026-12-04T09:46:51Z) and 0.671 -> 0.574 at 32K (run 2026-12-04T09:54:01Z). The
    # default at D 128 since ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_WORDS=0 / 1 forces it).
    residual_words: bool = False
    # With work_list: the list holds runs of consecutive visited tiles of one kind
    # (common.build_tile_runs), which producer and consumers walk with a counter, the
    # masked / full choice made once per run (FlashForwardSm90.work_runs; issue 14 item 1).
    # 4 KB of shared memory instead of 2. Static SASS, D 128 K 1: the full-tile loop 491
    # instructions per tile and warp against 513 (FA4's 465). On the H200 (run
    # 2026-12-04T13:02:54Z, h200-fwd-variants.json, fwd ms, per-tile list -> runs; FA4
    # native beside): causal 32K 14.61 -> 14.14 (FA4 13.97), 8K 3.965 -> 3.827 (3.750), 2K
    # 1.203 -> 1.181 (1.142); hstu 32K 17.05 -> 16.21, 8K 4.504 -> 4.352, 2K 1.351 -> 1.319;
    # shared prompt 32K 12.22 -> 11.63, 8K 3.375 -> 3.277, 2K 1.114 -> 1.090. Bit-identical
    # to the per-tile list on 10 cases, and 123 cases of test_cute_forward.py +
    # test_cute_attention.py passed under it (D 64 / 128, session 24): what cute_forward
    # compiles at D 64 and 128 (_fwd_work_runs; $JCOMPILEMASK_CUTE_FWD_WORK_RUNS=0 / 1
    # forces it).
    work_runs: bool = False
    # With work_runs: the producer's tile words of the row's first chunk loaded first thing in
    # the kernel, before the barriers' setup (FlashForwardSm90.runs_early, which gives the
    # measurement that motivates it; the runs come from build_tile_runs, one pass over the
    # set bits, with or without it). The default with work_runs since
    # session 25, together with slot_skip and mask_r2p (below: the three were timed alone and
    # together, and together is what the tests ran under; _fwd_masked_switches);
    # $JCOMPILEMASK_CUTE_FWD_RUNS_EARLY=0 turns it off.
    runs_early: bool = False
    # group_mask's masked tile builds an interval slot's runs only when the slot reaches into
    # the tile for some row of the warp (FlashForwardSm90.slot_skip; issue 14 item 3; the
    # default since session 25, see _fwd_masked_switches; $JCOMPILEMASK_CUTE_FWD_SLOT_SKIP=0
    # turns it off). K >= 2 with the intervals in registers; elsewhere the field is ignored.
    slot_skip: bool = False
    # A masked tile tests each column-group word's bits in order, one word after the other,
    # in FA4's form, so that ptxas emits R2P (FlashForwardSm90.mask_by_words; issue 14; the
    # default since session 25, see _fwd_masked_switches; $JCOMPILEMASK_CUTE_FWD_MASK_R2P=0
    # turns it off). Static SASS, D 128:
    # masked tile K 1 698 -> 650 instructions (LOP3 70 -> 14, 8 R2P), K 6 946 -> 898.
    # Bit-identical by construction (independent selects in another order).
    mask_r2p: bool = False
    # With residual_words: a slot whose residual predicate is provably 8-periodic in k
    # (lower/residual_program.column_periodic: the dilated window's (q - k) % 2 == 0) is
    # evaluated once per row and column class (FlashForwardSm90.residual_periodic; issue
    # 16). Bit-identical to residual_words alone on the H200 for 6 residual masks (dilated
    # window, a metadata dilation, per head, quadratic, two regions, a vector stride) and the
    # dilated window's fwd 0.558 -> 0.525 ms at 8K (run 2026-12-04T15:59:36Z,
    # h200-masks.json; session 25): the default wherever residual_words is on;
    # $JCOMPILEMASK_CUTE_FWD_RESIDUAL_PERIODIC=0 turns it off.
    residual_periodic: bool = False
    # O's rescale by a step's row factors in the next step, between its S GEMM issue and its
    # P V issue (FA3's order), instead of after the step's P V wait, where ptxas puts the 64
    # FMULs after all exp2s (FlashForwardSm90.rescale_early; issue 14, ncu causal 8K session
    # 26). Bit-identical by construction; $JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY=1, a benchmark
    # knob until timed. Not with rescale_tail.
    rescale_early: bool = False
    # A step's GEMM operand slices taken before its K wait and the scheduler barrier, so
    # fewer dependent uniform instructions sit between the other warpgroup's signal and the
    # S GEMM issue (FlashForwardSm90.operands_early; issue 14, ncu causal 8K session 26).
    # Bit-identical; the registry's default at D 128 (_fwd_issue_switches: timed there);
    # $JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY=0 / 1 overrides.
    operands_early: bool = False
    # P in two register tensors by step parity, so P's conversion does not wait for the
    # previous P V (FlashForwardSm90.p_double; issue 14, session 30). Bit-identical; the
    # registry's default at D 128 beside operands_early ($JCOMPILEMASK_CUTE_FWD_P_DOUBLE=0 / 1
    # overrides). Work runs only.
    p_double: bool = False
    # A residual mask's row intervals and regions loaded into registers once per tile row
    # instead of per masked tile (FlashForwardSm90.residual_regs; issue 16, session 35;
    # with residual_words, K <= 2). Bit-identical (7 residual cases, H100, session 36); what
    # forward_switches gives wherever residual_words is on ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_REGS=0
    # opts out): the dilated window's forward 0.533 -> 0.480 ms at 8K, 0.616 -> 0.488 at
    # 32K (H100, run 2026-12-05T23:42:56Z; Flex+FA4 0.493 / 0.512).
    residual_regs: bool = False
    # The caller's head dims (D, Dv) where they are narrower than the kernel's (head_dim,
    # head_dim_v): q / k / v / o are read and written at their own width, the TMA boxes stay
    # the kernel's, so TMA fills the columns past D (Dv) with zeros on load and drops O's past
    # Dv on store (backends.cute_head_dims without the pad / slice copies). None: the same.
    # Both multiples of 8 (16-byte TMA strides). The scale is the caller's, as always.
    io_head_dims: tuple | None = None

    @property
    def list_smem(self) -> int:
        """Shared bytes of the work list (0 without it; twice the entries with runs)."""
        return 0 if not self.work_list else (_WORK_RUNS_SMEM if self.work_runs else _WORK_LIST_SMEM)

    @property
    def o_buffer(self) -> bool:
        """Persistent kernels stage O in a buffer of its own where shared memory allows
        (D <= 128), so the next unit's Q loads under this unit's epilogue."""
        base = forward_smem_bytes(self.head_dim, self.block_q, self.block_kv, self.num_stages,
                                  head_dim_v=self.head_dim_v) + self.list_smem
        return self.persistent and base + 2 * self.block_q * self.head_dim_v + 1024 <= _SMEM_LIMIT

    def __post_init__(self):
        if self.persistent and not self.schedule:
            raise ValueError("ForwardKey(persistent=True) runs the schedule's order: set schedule=True")
        if self.residual is not None and (self.residual.view != "fwd"
                                          or len(self.residual.slots) != self.num_intervals):
            raise ValueError(f"residual program {self.residual!r} does not fit K={self.num_intervals}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"cute forward supports {_DTYPES}, got dtype {self.dtype!r}")
        _check_io_head_dims("ForwardKey", self.io_head_dims, self.head_dim, self.head_dim_v)
        pair = (self.head_dim, self.head_dim_v)
        if not ((self.head_dim in HEAD_DIMS + FWD_NATIVE_HEAD_DIMS
                 and self.head_dim_v == self.head_dim) or pair in HEAD_DIM_PAIRS):
            raise ValueError(
                f"cute forward is built for head dims {HEAD_DIMS + FWD_NATIVE_HEAD_DIMS} with "
                f"Dv == D and (D, Dv) in "
                f"{HEAD_DIM_PAIRS}, got {self.head_dim}/{self.head_dim_v}; use the "
                "xla backend for other head dims"
            )
        want = preferred_forward_tiles(self.head_dim, self.dtype)
        if (self.block_q, self.block_kv) != want:
            raise ValueError(
                f"cute forward runs {want[0]}x{want[1]} tiles at head dim {self.head_dim}; the "
                f"descriptor was built for {self.block_q}x{self.block_kv}. Rebuild it with "
                "preferred_forward_tiles(...)"
            )
        if self.num_intervals < 1:
            raise ValueError(f"interval count K must be >= 1, got {self.num_intervals}")
        if not isinstance(self.interval_unroll, int) or self.interval_unroll < 1:
            raise ValueError(f"interval_unroll must be an int >= 1, got {self.interval_unroll!r}")
        smem = forward_smem_bytes(self.head_dim, self.block_q, self.block_kv, self.num_stages,
                                  head_dim_v=self.head_dim_v) + self.list_smem
        if self.num_stages < 1 or smem > _SMEM_LIMIT:
            raise ValueError(
                f"num_stages={self.num_stages} at head dim {self.head_dim} needs {smem} bytes of "
                f"shared memory (SM90 allows {_SMEM_LIMIT}); use preferred_forward_stages(...)"
            )
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap must be None or a positive finite float, got {self.softcap!r}")
        if self.softcap_fast_tanh and self.softcap is None:
            raise ValueError("softcap_fast_tanh needs a softcap")
        if self.work_runs and not self.work_list:
            raise ValueError("ForwardKey(work_runs=True) is a form of the work list: set work_list=True")
        if self.work_runs and self.rescale_tail:
            raise ValueError("ForwardKey(work_runs=True) does not combine with rescale_tail")
        if self.rescale_early and self.rescale_tail:
            raise ValueError("ForwardKey(rescale_early=True) moves O's rescale to the next step; "
                             "rescale_tail moves it to the loop's tail: choose one")
        if self.runs_early and not self.work_runs:
            raise ValueError("ForwardKey(runs_early=True) is a form of work_runs: set work_runs=True")
        if self.residual_periodic and not self.residual_words:
            raise ValueError("ForwardKey(residual_periodic=True) works on residual_words' words: "
                             "set residual_words=True")
        if self.residual_words and self.residual is None:
            raise ValueError("ForwardKey(residual_words=True) serves masks with a residual program")
        if self.residual_regs and not self.residual_words:
            raise ValueError("ForwardKey(residual_regs=True) keeps residual_words' row tables in "
                             "registers: set residual_words=True")
        if self.group_mask and self.residual is not None:
            raise ValueError("ForwardKey(group_mask=True) serves masks without a residual program "
                             "(partial tiles of a residual mask evaluate it per element)")

    @property
    def target_name(self) -> str:
        scale_bits = np.float64(self.scale).view(np.uint64)
        return (
            f"jcompilemask_cute_fwd_{self.dtype}_d{self.head_dim}x{self.head_dim_v}_k{self.num_intervals}"
            f"_t{self.block_q}x{self.block_kv}_b{int(self.broadcast_batch)}h{int(self.broadcast_head)}"
            f"_s{self.num_stages}_{scale_bits:016x}"
            + ("" if self.softcap is None else
               f"_c{np.float64(self.softcap).view(np.uint64):016x}{'f' if self.softcap_fast_tanh else ''}")
            + ("" if self.residual is None else f"_r{self.residual.tag}")
            + ("" if self.bits_above == 8 else f"_ba{self.bits_above}")
            + ("" if self.interval_unroll == 1 else f"_iu{self.interval_unroll}")
            + ("_wl" if self.work_list else "")
            + ("_ls" if self.schedule and not self.persistent else "")
            + ("_lp" if self.persistent else "")
            + ("_ka" if self.k_ahead else "")
            + ("_gm" if self.group_mask else "")
            + ("_rt" if self.rescale_tail else "")
            + ("_rw" if self.residual_words else "")
            + ("_wr" if self.work_runs else "")
            + ("_re" if self.runs_early else "")
            + ("_ss" if self.slot_skip else "")
            + ("_r2p" if self.mask_r2p else "")
            + ("_rp" if self.residual_periodic else "")
            + ("_rse" if self.rescale_early else "")
            + ("_oe" if self.operands_early else "")
            + ("_pd" if self.p_double else "")
            + ("_rr" if self.residual_regs else "")
            + _io_suffix(self.io_head_dims)
        )


_lock = threading.Lock()
_compiled: dict[ForwardKey, Any] = {}
_registered: set[str] = set()


def _options() -> str:
    """cute.compile options; ``$JCOMPILEMASK_CUTE_DUMP_DIR`` keeps the PTX and cubin there
    (for ``cuobjdump --dump-resource-usage`` and spill counts, NOTES.md);
    ``$JCOMPILEMASK_CUTE_PTXAS_REMARKS=1`` prints ptxas's output per kernel (registers,
    spills, and remarks such as C7512, wgmmas serialized for want of registers)."""
    import os
    opts = "--enable-tvm-ffi"
    if _ptxas_remarks():
        opts += " remarks{ptx}"
    dump = os.environ.get("JCOMPILEMASK_CUTE_DUMP_DIR")
    if not dump:
        return opts
    os.makedirs(dump, exist_ok=True)
    return f"{opts} --keep-ptx --keep-cubin --dump-dir={dump}"


def _ptxas_remarks() -> bool:
    import os
    return os.environ.get("JCOMPILEMASK_CUTE_PTXAS_REMARKS", "") not in ("", "0")


def _import_cutlass():
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the cute backend needs nvidia-cutlass-dsl (>= 4.8) and jax-tvm-ffi; "
            "install them or use backend='xla'"
        ) from err


def _dsl(dtype_name: str):
    """(cutlass, cute, the element type, sym_int, sym_int64) for building a kernel."""
    _import_cutlass()
    import cutlass
    import cutlass.cute as cute
    dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype_name]
    return cutlass, cute, dtype, cute.sym_int, cute.sym_int64


def compile_forward(key: ForwardKey):
    """Compile (once per key) and return the TVM-FFI function of the forward kernel.

    Works without a GPU when CUTE_DSL_ARCH=sm_90a is set before cutlass is imported.
    """
    with _lock:
        if key in _compiled:
            return _compiled[key]
        cutlass, cute, dtype, sym, sym64 = _dsl(key.dtype)
        from .forward import FlashForwardSm90

        # 16-byte alignment of every non-unit stride, in elements: TMA needs it.
        div = 8
        b, nq, nk, hq, hkv = sym(), sym(), sym(), sym(), sym()

        def bhsd(seqlen, heads, dim):
            return cute.runtime.make_fake_tensor(
                dtype, (b, seqlen, heads, dim),
                stride=(sym64(divisibility=div), sym64(divisibility=div), dim, 1),
                assumed_align=16,
            )

        bm = 1 if key.broadcast_batch else b
        hm = 1 if key.broadcast_head else hq
        intervals = cute.runtime.make_fake_tensor(
            cutlass.Int32, (bm, hm, nq, key.num_intervals, 2),
            stride=(sym64(), sym64(), 2 * key.num_intervals, 2, 1), assumed_align=4,
        )
        tiles = cute.runtime.make_fake_tensor(
            cutlass.Uint32, (bm, hm, sym(), sym()), stride=(sym64(), sym64(), sym64(), 1), assumed_align=4,
        )
        lse = cute.runtime.make_fake_tensor(
            cutlass.Float32, (b, hq, nq), stride=(sym64(), sym64(), 1), assumed_align=4,
        )
        kernel = FlashForwardSm90(
            dtype, key.head_dim, key.head_dim_v, key.num_intervals, key.scale,
            block_q=key.block_q, block_kv=key.block_kv,
            broadcast_batch=key.broadcast_batch, broadcast_head=key.broadcast_head,
            num_stages=key.num_stages, softcap=key.softcap, softcap_fast_tanh=key.softcap_fast_tanh,
            residual=key.residual, bits_above=key.bits_above,
            interval_unroll=key.interval_unroll, work_list=key.work_list,
            schedule=key.schedule, persistent=key.persistent, o_buffer=key.o_buffer,
            k_ahead=key.k_ahead, group_mask=key.group_mask, rescale_tail=key.rescale_tail,
            work_runs=key.work_runs, runs_early=key.runs_early, slot_skip=key.slot_skip,
            mask_r2p=key.mask_r2p, residual_periodic=key.residual_periodic,
            residual_words=key.residual_words, rescale_early=key.rescale_early,
            operands_early=key.operands_early, p_double=key.p_double,
            residual_regs=key.residual_regs,
        )
        # The tensors at the caller's head dims (io_head_dims: TMA zero-fills past them).
        d_io, dv_io = key.io_head_dims or (key.head_dim, key.head_dim_v)
        inputs = [bhsd(nq, hq, d_io), bhsd(nk, hkv, d_io), bhsd(nk, hkv, dv_io), intervals, tiles]
        entry = kernel
        if key.residual is not None:
            # The rows' regions [Bm, Nq] and the residual parameter table [Bm, max(W, 1)]
            # (operands: before the results, as the FFI passes them).
            entry = kernel.with_residual
            inputs += [cute.runtime.make_fake_tensor(cutlass.Int32, (bm, nq), stride=(sym64(), 1),
                                                     assumed_align=4),
                       cute.runtime.make_fake_tensor(cutlass.Int32, (bm, max(key.residual.width, 1)),
                                                     stride=(sym64(), 1), assumed_align=4)]
        if key.schedule:
            # The work-unit order int32 [B * Hq * Tq] (an operand, after the residual's).
            entry = kernel.with_residual_schedule if key.residual is not None else kernel.with_schedule
            if key.persistent:    # [P, 1 + J]: per CTA a count, then its units
                inputs.append(cute.runtime.make_fake_tensor(cutlass.Int32, (sym(), sym()), stride=(sym64(), 1),
                                                            assumed_align=4))
            else:
                inputs.append(cute.runtime.make_fake_tensor(cutlass.Int32, (sym(),), stride=(1,),
                                                            assumed_align=4))
        args = inputs + [bhsd(nq, hq, dv_io), lse]
        fn = cute.compile(
            entry, *args,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=_options(),
        )
        _compiled[key] = fn
        return fn


DISK_CACHE_ENV = "JCOMPILEMASK_CUTE_DISK_CACHE"
_EXPORTED = "jcm_kernel"          # the function's name inside an exported object file


# The top-level functions of this module that never run while a kernel is traced: the
# registry's policy (which key / config to build), the JAX wrappers around the call, the
# schedules and the cache plumbing. The kernel fingerprint leaves their lines out, so an
# edit to them keeps the disk cache's kernels (tests/test_cute_fingerprint.py checks that
# nothing the kernels run names one of them).
_HOST_ONLY = frozenset({
    "preferred_forward_stages", "_package_fingerprint", "_sources_fingerprint",
    "_strip_host_only", "_code_only",
    "_module_files", "_kernel_sources", "disk_cache_key", "kernel_function", "_ensure_registered",
    "_fit_list_to_length", "_fwd_bits_above", "_fwd_interval_unroll", "_env_int", "_env_flag", "_fwd_d128_loop", "_bwd_d128_config",
    "_fwd_work_list", "_fwd_schedule",
    "_fwd_k_ahead", "_fwd_group_mask", "_fwd_residual_words", "_fwd_rescale_tail",
    "_fwd_work_runs", "_fwd_masked_switches", "forward_switches", "_fwd_issue_switches", "num_sms",
    "persistent_schedule", "kv_heads_per_l2_group", "forward_schedule", "cute_forward",
    "preferred_backward_config", "preferred_backward_tiles", "_config_from_env",
    "_d64_query64_config", "_d192_split_config", "_backward_configs", "served_backward_tiles",
    "dq_fragment_unpermute", "dq_turns", "_bwd_exact_columns", "_bwd_order_policy",
    "_popcount_visited", "_unit_counts", "_late_units", "backward_schedule_moves",
    "backward_schedule", "cute_backward", "backward_config", "replay_makespan",
    "backward_static_order", "_bwd_static_order_on",
    # the backward's pre- and postprocess kernels (kernels/cute/glue.py, their own fingerprint)
    "BackwardPrepKey", "_glue_fingerprint", "_bwd_prep_mode", "backward_prep",
    "BackwardPostKey", "_bwd_post_on", "backward_post", "backward_stats", "backward_dq",
    # the run-time dense mask's column pack (glue.TransposeWords)
    "TransposeWordsKey", "transpose_words_on", "transpose_words", "_transpose_words_fn",
})
# Where the kernels' code lives: the kernel modules, and the residual programs they emit
# into partial tiles; their imports inside the package are followed (_kernel_sources).
_KERNEL_ROOTS = ("kernels/cute/forward.py", "kernels/cute/backward.py", "kernels/cute/api.py",
                 "lower/residual_program.py")


def _strip_host_only(text: str) -> str:
    """api.py's text without the lines of its _HOST_ONLY functions (decorators included)."""
    import ast
    lines = text.splitlines(keepends=True)
    drop = set()
    for node in ast.parse(text).body:
        host = isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in _HOST_ONLY
        # ... and the two tables of this machinery (what they leave out is seen in the rest)
        host = host or isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) in ("_HOST_ONLY", "_KERNEL_ROOTS") for t in node.targets)
        if host:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
            drop.update(range(first - 1, node.end_lineno))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def _code_only(text: str) -> str:
    """``text`` without its comments, docstrings, trailing blanks and empty lines: what a
    kernel's trace runs, so that prose edits in the kernel sources keep the fingerprint.
    (Cut from the text rather than re-printed from the AST or the token stream, both of
    which differ between Python versions.)"""
    import ast
    import io
    import tokenize
    cuts = []
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            d = body[0]
            cuts.append(((d.lineno, d.col_offset), (d.end_lineno, d.end_col_offset)))
    cuts += [(t.start, t.end) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT]
    lines = text.splitlines()
    for (r0, c0), (r1, c1) in sorted(cuts, reverse=True):   # later spans first: offsets hold
        head, tail = lines[r0 - 1][:c0], lines[r1 - 1][c1:]
        lines[r0 - 1:r1] = [head + tail] + [""] * (r1 - r0)
    return "\n".join(line.rstrip() for line in lines if line.strip())


def _module_files(parts) -> list:
    """The files a package module (its dotted path's parts below jcompilemask) may be."""
    stem = "/".join(parts)
    return [f"{stem}/__init__.py", f"{stem}.py"] if stem else ["__init__.py"]


def _kernel_sources(read, roots=_KERNEL_ROOTS) -> dict:
    """{path inside the package: code} of every module a kernel's trace can run: the
    _KERNEL_ROOTS and, transitively, the package modules they import (anywhere in the file,
    relative or absolute), api.py without its _HOST_ONLY functions; each as _code_only.
    ``read(path)`` gives a file's text or None where it does not exist (a checkout, or a git
    revision's tree)."""
    import ast
    import posixpath
    out, todo = {}, list(roots)
    while todo:
        path = todo.pop()
        if path in out:
            continue
        text = read(path)
        if text is None:
            continue
        if path == "kernels/cute/api.py":
            text = _strip_host_only(text)
        out[path] = _code_only(text)
        pkg = posixpath.dirname(path).split("/") if posixpath.dirname(path) else []
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                up = pkg[:len(pkg) - node.level + 1]
                mod = up + (node.module.split(".") if node.module else [])
            elif isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "jcompilemask":
                mod = node.module.split(".")[1:]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "jcompilemask":
                        todo += _module_files(alias.name.split(".")[1:])
                continue
            else:
                continue
            todo += _module_files(mod)
            for alias in node.names:        # `from . import name`: name may be a module
                todo += _module_files(mod + [alias.name])
    return out


@functools.lru_cache(maxsize=1)
def _package_fingerprint() -> str:
    """sha256 of the sources a kernel's trace runs (_kernel_sources: paths and text): a
    kernel compiled by other kernel code is never reused; edits elsewhere in the package
    (the registry's policy, docs, the XLA path) keep the cached kernels."""
    return _sources_fingerprint(_KERNEL_ROOTS)


def _sources_fingerprint(roots) -> str:
    """sha256 (24 hex digits) of ``_kernel_sources`` from ``roots`` in this checkout."""
    import hashlib
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]

    def read(path):
        f = root / path
        return f.read_text() if f.is_file() else None

    h = hashlib.sha256()
    for path, text in sorted(_kernel_sources(read, roots).items()):
        h.update(path.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:24]


def disk_cache_key(key):
    """The :class:`jcompilemask.ffi.KernelKey` a CuTe kernel is kept under on disk, or None
    when the disk cache is off for it.

    The disk cache (``$JCOMPILEMASK_CACHE_DIR``, default ``~/.cache/jcompilemask``,
    ``cute-forward/`` and ``cute-backward/``) lets a new process load a kernel instead of
    compiling it again (tens of seconds per kernel). The key holds the kernel's FFI target
    name (every field of the ForwardKey / BackwardKey), a hash of the sources its trace
    runs (:func:`_package_fingerprint`), the versions of cutlass-dsl (and of its compiler
    libraries) and tvm-ffi, and ``$CUTE_DSL_ARCH``, so a change to any of them compiles
    afresh. Off with ``$JCOMPILEMASK_CUTE_DISK_CACHE=0``, and whenever
    ``$JCOMPILEMASK_CUTE_DUMP_DIR`` or ``$JCOMPILEMASK_CUTE_PTXAS_REMARKS`` asks for a
    real compile's by-products.
    """
    import os
    from ... import ffi
    if os.environ.get(DISK_CACHE_ENV, "1").strip() == "0":
        return None
    if os.environ.get("JCOMPILEMASK_CUTE_DUMP_DIR") or _ptxas_remarks():
        return None
    glue = isinstance(key, (BackwardPrepKey, BackwardPostKey, TransposeWordsKey))
    kind = "cute-glue" if glue else "cute-forward" if isinstance(key, ForwardKey) \
        else "cute-backward"
    sources = _glue_fingerprint() if glue else _package_fingerprint()
    return ffi.KernelKey(
        kind=kind, mask_fingerprint="", shape_class=(key.target_name,), dtypes=(key.dtype,),
        tile_config=(), source_fingerprint=sources,
        versions=ffi.versions("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                              "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13",
                              "apache-tvm-ffi")
        + (("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "")),))


def _export(fn, path: str) -> None:
    """Write a compiled kernel (host launcher + cubin) as an object file."""
    fn.export_to_c(object_file_path=path, function_name=_EXPORTED)


@functools.lru_cache(maxsize=1)
def _preload_runtime() -> None:
    """The DSL's runtime libraries loaded with RTLD_GLOBAL, once: an exported object file's
    references to them (module loading, launch) resolve against these symbols."""
    import ctypes
    import os
    import cutlass.cute as cute
    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _load_exported(path: str):
    """The TVM-FFI function of an object file written by :func:`_export`."""
    _import_cutlass()
    import cutlass.cute as cute
    _preload_runtime()
    module = cute.runtime.load_module(path, enable_tvm_ffi=True)
    return getattr(module, _EXPORTED)


def kernel_function(key):
    """The TVM-FFI function of a ForwardKey / BackwardKey or a glue kernel's key (BackwardPrepKey,
    BackwardPostKey, TransposeWordsKey):
    from this process's memory, else from the disk cache (:func:`disk_cache_key`), else
    compiled (and then saved for the next process; this one keeps the function it compiled)."""
    if isinstance(key, (BackwardPrepKey, BackwardPostKey, TransposeWordsKey)):
        def build():
            with _lock:
                if key not in _compiled:
                    _import_cutlass()
                    from . import glue
                    if isinstance(key, TransposeWordsKey):
                        fn = glue.compile_transpose_words(_options())
                    elif isinstance(key, BackwardPrepKey):
                        fn = glue.compile_backward_prep(
                            key.dtype, key.head_dim, key.head_dim_v, key.block_q,
                            key.with_dlse, _options(), zero_only=key.zero_only)
                    else:
                        fn = glue.compile_backward_post(
                            key.dtype, key.head_dim, key.block_q,
                            dq_warpgroups(key.head_dim, block_q=key.block_q),
                            dq_splits_queries(key.block_q), key.scale, _options())
                    _compiled[key] = fn
                return _compiled[key]
    else:
        build = (lambda: compile_forward(key)) if isinstance(key, ForwardKey) \
            else (lambda: compile_backward(key))
    dkey = disk_cache_key(key)
    if dkey is None:
        return build()
    from ... import ffi
    return ffi.default_cache().get_or_build(dkey, build, load=_load_exported, save=_export,
                                            reload=False, announce=False,
                                            filename="kernel.o")


def _ensure_registered(key) -> str:
    """Compile or load (ForwardKey or BackwardKey) and register as an XLA FFI target, once."""
    name = key.target_name
    if name in _registered:
        return name
    fn = kernel_function(key)
    try:
        import jax_tvm_ffi
    except ImportError as err:  # pragma: no cover
        raise ImportError("the cute backend needs jax-tvm-ffi to call CuTe kernels from JAX") from err
    with _lock:
        if name not in _registered:
            jax_tvm_ffi.register_ffi_target(name, fn, ["args", "rets"], platform="gpu", allow_cuda_graph=True)
            _registered.add(name)
    return name


# A work-list entry holds its tile index in 16 bits (the masked flag above it), so a row
# (column) of more tiles than this walks the tile bitmap instead (_fit_list_to_length).
LIST_MAX_TILES = 1 << 16


def _fit_list_to_length(key_or_config, n_tiles: int):
    """``key_or_config`` (a ForwardKey or a BackwardConfig) without its work list when a
    row (column) has more than LIST_MAX_TILES tiles: 8.4 M keys (queries) at 128-wide
    tiles. The list stores tile indices in 16 bits; the bitmap walk has no such limit.

    >>> k = ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1, work_list=True, work_runs=True)
    >>> _fit_list_to_length(k, 1 << 16) is k, _fit_list_to_length(k, (1 << 16) + 1).work_list
    (True, False)
    """
    if n_tiles <= LIST_MAX_TILES or not key_or_config.work_list:
        return key_or_config
    if isinstance(key_or_config, ForwardKey):
        return dataclasses.replace(key_or_config, work_list=False, work_runs=False, runs_early=False)
    return dataclasses.replace(key_or_config, work_list=False, list_early=False)


FWD_BITS_ABOVE_ENV = "JCOMPILEMASK_CUTE_FWD_BITS_ABOVE"
FWD_WORK_LIST_ENV = "JCOMPILEMASK_CUTE_FWD_WORK_LIST"
FWD_SCHEDULE_ENV = "JCOMPILEMASK_CUTE_FWD_SCHEDULE"
FWD_K_AHEAD_ENV = "JCOMPILEMASK_CUTE_FWD_K_AHEAD"
FWD_GROUP_MASK_ENV = "JCOMPILEMASK_CUTE_FWD_GROUP_MASK"
FWD_RESCALE_TAIL_ENV = "JCOMPILEMASK_CUTE_FWD_RESCALE_TAIL"
FWD_RESIDUAL_WORDS_ENV = "JCOMPILEMASK_CUTE_FWD_RESIDUAL_WORDS"
FWD_WORK_RUNS_ENV = "JCOMPILEMASK_CUTE_FWD_WORK_RUNS"
FWD_RUNS_EARLY_ENV = "JCOMPILEMASK_CUTE_FWD_RUNS_EARLY"
FWD_SLOT_SKIP_ENV = "JCOMPILEMASK_CUTE_FWD_SLOT_SKIP"
FWD_MASK_R2P_ENV = "JCOMPILEMASK_CUTE_FWD_MASK_R2P"
FWD_RESIDUAL_PERIODIC_ENV = "JCOMPILEMASK_CUTE_FWD_RESIDUAL_PERIODIC"
FWD_RESCALE_EARLY_ENV = "JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY"
FWD_OPERANDS_EARLY_ENV = "JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY"
FWD_P_DOUBLE_ENV = "JCOMPILEMASK_CUTE_FWD_P_DOUBLE"
FWD_RESIDUAL_REGS_ENV = "JCOMPILEMASK_CUTE_FWD_RESIDUAL_REGS"
# L2 bytes the K / V of one group of heads may take (forward_schedule): the H100 / H200's
# 50 MB L2, as FlashAttention's longest-first scheduler assumes.
L2_BYTES = 50 * 1024 * 1024


FWD_INTERVAL_UNROLL_ENV = "JCOMPILEMASK_CUTE_FWD_INTERVAL_UNROLL"


def _env_int(name: str, default: int, minimum: int, meaning: str) -> int:
    """An int >= ``minimum`` from ``$name`` (read at trace time; unset or empty: default)."""
    import os
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={text!r}: an int >= {minimum} ({meaning})")
    return value


def _fwd_interval_unroll(num_intervals=None, bits_above: int = 8) -> int:
    """ForwardKey.interval_unroll: ``$JCOMPILEMASK_CUTE_FWD_INTERVAL_UNROLL`` (read at trace
    time) where set, else 4 for a kernel of more than ``bits_above`` intervals; 1 (the
    knob does nothing there, and the key stays the same) at ``num_intervals <=
    bits_above`` or when ``num_intervals`` is None (unknown)."""
    # 4: on a 25-run dense mask at 8K the forward took 4.845 ms against 5.562 unrolled once
    # (-12.9%; H100, run 2026-12-07T14:56:22Z, benchmarks/results/h100/
    # h100-interval-unroll-s49.json), bit for bit the same output (tests/gpu/
    # test_cute_any_k.py::test_interval_unroll_gives_identical_forward, same call).
    if num_intervals is not None and num_intervals <= bits_above:
        return 1
    default = 1 if num_intervals is None else 4
    return _env_int(FWD_INTERVAL_UNROLL_ENV, default, 1,
                    "the unroll factor of a masked tile's loop over K > 8 intervals")


def _fwd_bits_above() -> int:
    """``$JCOMPILEMASK_CUTE_FWD_BITS_ABOVE`` (read at trace time; benchmarks), default 8."""
    return _env_int(FWD_BITS_ABOVE_ENV, 8, 0,
                    "K above it tests intervals one at a time into bit masks")


def _env_flag(name: str, default: str) -> bool:
    """A 0 / 1 switch from ``$name`` (read at trace time; unset or empty: `default`)."""
    import os
    text = os.environ.get(name, "").strip() or default
    if text not in ("0", "1"):
        raise ValueError(f"${name} must be 0 or 1, got {text!r}")
    return text == "1"


def _fwd_d128_loop(head_dim: int, head_dim_v: int) -> bool:
    """Whether the forward runs D 128's loop at these head dims: D 128 itself, or a
    FWD_NATIVE_HEAD_DIMS dim with Dv == D (the same loop on narrower rows), so that D 128's
    measured defaults (residual words, work runs, the issue switches) apply.

    >>> _fwd_d128_loop(128, 128), _fwd_d128_loop(96, 96), _fwd_d128_loop(96, 128)
    (True, True, False)
    """
    return head_dim == head_dim_v and head_dim in (128,) + FWD_NATIVE_HEAD_DIMS


def _fwd_work_list(d, dv, block_q, block_kv, num_stages) -> bool:
    """Whether the forward iterates a compact work list (the producer warp turns the row's
    tile words into a list of visited key tiles; both sides walk the list) rather than every
    tile word of the row. The default where the list's 2 KB fit beside the tiles (not D 256
    at 2 stages): the H200 measured it faster at every size timed (run
    2026-12-03T07:33:41Z, fwd ms: causal 32K -3.4%, hstu 32K -2.1%, shared prompt 32K -5.6%,
    causal 8K -2.7%, hstu 8K -2.1%) and all 109 cases of test_cute_forward.py +
    test_cute_attention.py passed under it (sessions 16-17). ``$JCOMPILEMASK_CUTE_FWD_WORK_LIST=0``
    (read at trace time) walks the bitmap instead, for comparison."""
    return _env_flag(FWD_WORK_LIST_ENV, "1") and forward_smem_bytes(
        d, block_q, block_kv, num_stages, head_dim_v=dv) + _WORK_LIST_SMEM <= _SMEM_LIMIT


def _fwd_schedule() -> tuple[bool, bool]:
    """(schedule, persistent) from ``$JCOMPILEMASK_CUTE_FWD_SCHEDULE`` (read at trace time; a
    benchmark knob, measured slower than the default grid: see ForwardKey.schedule): ``1`` runs the forward's work units in
    ``forward_schedule``'s order, ``persistent`` on one CTA per SM in that order
    (``persistent_schedule``); ``0`` or unset: the default grid."""
    import os
    text = os.environ.get(FWD_SCHEDULE_ENV, "0").strip()
    if text not in ("0", "1", "", "persistent"):
        raise ValueError(f"{FWD_SCHEDULE_ENV}={text!r}: 0, 1 or persistent")
    return text in ("1", "persistent"), text == "persistent"


def _fwd_k_ahead() -> bool:
    """``$JCOMPILEMASK_CUTE_FWD_K_AHEAD=1`` (read at trace time; a benchmark knob until
    measured): the forward's producer issues K(t + 1) before V(t)."""
    return _env_flag(FWD_K_AHEAD_ENV, "0")


def _fwd_group_mask() -> bool:
    """Whether masked tiles build each row's visibility as column-group bit words
    (FlashForwardSm90.apply_mask_groups; masks without a residual predicate). The default:
    the H200 measured clear (K 6, nearly every visited tile masked) 2.204 -> 1.705 ms at 8K
    and 3.528 -> 2.433 ms at 32K, and causal / hstu / shared prompt at 32K unchanged within
    1% (runs 2026-12-03T14:12:32Z and the 8K run after it; bench_forward.py); its 8
    bit-identity cases and all 118 cases of test_cute_forward.py + test_cute_attention.py
    passed under it (session 18). ``$JCOMPILEMASK_CUTE_FWD_GROUP_MASK=0`` (read at trace
    time) tests each interval per element instead, for comparison."""
    return _env_flag(FWD_GROUP_MASK_ENV, "1")


def _fwd_residual_words(head_dim: int = 128) -> bool:
    """Residual masks build a masked tile's visibility from column-group words
    (ForwardKey.residual_words, which cites the runs): on at D 128, the head dim it was
    tested and timed at, and at FWD_NATIVE_HEAD_DIMS (D 128's loop on narrower rows); ``$JCOMPILEMASK_CUTE_FWD_RESIDUAL_WORDS`` (read at trace time)
    =1 / =0 forces it on / off at every head dim."""
    return _env_flag(FWD_RESIDUAL_WORDS_ENV,
                     "1" if _fwd_d128_loop(head_dim, head_dim) else "0")


def _fwd_rescale_tail() -> bool:
    """``$JCOMPILEMASK_CUTE_FWD_RESCALE_TAIL=1`` (read at trace time; a benchmark knob,
    measured slower): O's rescale in the tile loop's tail, beside P's conversion
    (ForwardKey.rescale_tail, which cites the run)."""
    return _env_flag(FWD_RESCALE_TAIL_ENV, "0")


def _fwd_work_runs(work_list: bool, rescale_tail: bool, d, dv, block_q, block_kv, num_stages) -> bool:
    """Whether the forward's work list holds runs of one kind (ForwardKey.work_runs, which
    cites the run): the default at D 64 and 128 (the head dims its GPU cases ran at) and at
    FWD_NATIVE_HEAD_DIMS (D 128's loop on narrower rows) where
    the work list is on, rescale_tail off and the runs' 4 KB fit;
    ``$JCOMPILEMASK_CUTE_FWD_WORK_RUNS`` (read at trace time) =1 / =0 forces it on / off
    wherever the work list is on."""
    default = "1" if (d, dv) == (64, 64) or _fwd_d128_loop(d, dv) else "0"
    return (_env_flag(FWD_WORK_RUNS_ENV, default) and work_list and not rescale_tail
            and forward_smem_bytes(d, block_q, block_kv, num_stages, head_dim_v=dv)
            + _WORK_RUNS_SMEM <= _SMEM_LIMIT)


def _fwd_masked_switches() -> dict:
    """``slot_skip`` and ``mask_r2p`` (ForwardKey), on by default since session 25 with
    ``runs_early``. Same call on the H200 (run 2026-12-04T15:42:40Z, h200-fwd-variants.json,
    fwd ms, default / runs_early / mask_r2p / all three): CLEAR 8K 1.703 / 1.694 / 1.666 /
    1.582, 32K 2.493 / 2.481 / 2.431 / 2.278; causal 32K 14.302 / 14.385 / 14.308 / 14.186
    (FA4 native 14.268), 8K 3.937 / 3.916 / 3.919 / 3.911 (3.806); hstu and shared prompt
    within 1% (all three -0.1% to -0.8%). Their 20 bit-identity cases passed, and 144
    cases of test_cute_forward.py + test_cute_attention.py under the three (none failed;
    21 not reached in that call). ``$JCOMPILEMASK_CUTE_FWD_SLOT_SKIP`` /
    ``$JCOMPILEMASK_CUTE_FWD_MASK_R2P`` (read at trace time) =0 turn them off."""
    return dict(slot_skip=_env_flag(FWD_SLOT_SKIP_ENV, "1"),
                mask_r2p=_env_flag(FWD_MASK_R2P_ENV, "1"))


def forward_switches(head_dim: int, head_dim_v: int, block_q: int, block_kv: int, num_stages: int,
                     residual=None, num_intervals=None) -> dict:
    """The ForwardKey fields that ``cute_forward`` takes from the environment (read at
    trace time) for a kernel of these sizes: ``bits_above``, ``interval_unroll``,
    ``work_list``, ``schedule``,
    ``persistent``, ``k_ahead``, ``group_mask`` (never with a residual program),
    ``residual_words`` (only with one), ``rescale_tail``, ``work_runs``, ``runs_early``,
    ``slot_skip``, ``mask_r2p``, ``residual_periodic`` (only with a residual program),
    ``rescale_early`` (never with ``rescale_tail``), ``residual_regs`` (with residual_words;
    ``$JCOMPILEMASK_CUTE_FWD_RESIDUAL_REGS=0`` opts out), ``operands_early`` and ``p_double`` (with
    work runs, without the rescale knobs). With no ``JCOMPILEMASK_CUTE_FWD_*`` variable set these are the
    defaults the registry runs, so a compile test that builds its key with them compiles
    what users get. ``num_intervals`` (the kernel's K) decides ``interval_unroll`` (see
    ``_fwd_interval_unroll``; None: 1 unless the variable is set).

    >>> sorted(forward_switches(128, 128, 128, 128, 2))
    ['bits_above', 'group_mask', 'interval_unroll', 'k_ahead', 'mask_r2p', 'operands_early', 'p_double', 'persistent', 'rescale_early', 'rescale_tail', 'residual_periodic', 'residual_regs', 'residual_words', 'runs_early', 'schedule', 'slot_skip', 'work_list', 'work_runs']
    """
    schedule, persistent = _fwd_schedule()
    work_list = _fwd_work_list(head_dim, head_dim_v, block_q, block_kv, num_stages)
    rescale_tail = _fwd_rescale_tail()
    work_runs = _fwd_work_runs(work_list, rescale_tail, head_dim, head_dim_v, block_q, block_kv,
                               num_stages)
    rescale_early = _env_flag(FWD_RESCALE_EARLY_ENV, "0") and not rescale_tail
    bits_above = _fwd_bits_above()
    return dict(bits_above=bits_above,
                interval_unroll=_fwd_interval_unroll(num_intervals, bits_above),
                work_list=work_list,
                schedule=schedule, persistent=persistent, k_ahead=_fwd_k_ahead(),
                group_mask=_fwd_group_mask() and residual is None,
                residual_words=_fwd_residual_words(head_dim) and residual is not None,
                rescale_tail=rescale_tail,
                work_runs=work_runs, runs_early=work_runs and _env_flag(FWD_RUNS_EARLY_ENV, "1"),
                **_fwd_masked_switches(),
                residual_periodic=(_env_flag(FWD_RESIDUAL_PERIODIC_ENV, "1") and residual is not None
                                   and _fwd_residual_words(head_dim)),
                rescale_early=rescale_early,
                residual_regs=(_env_flag(FWD_RESIDUAL_REGS_ENV, "1") and residual is not None
                               and _fwd_residual_words(head_dim)),
                **_fwd_issue_switches(head_dim, head_dim_v, work_runs, rescale_tail, rescale_early))


def _fwd_issue_switches(head_dim: int, head_dim_v: int, work_runs: bool, rescale_tail: bool,
                        rescale_early: bool) -> dict:
    """``operands_early`` and ``p_double``: on by default at D 128 (both bit-identical with
    the forward without them; $JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY / _P_DOUBLE = 0 / 1
    override). Measured together at D 128 only (bf16, 8 heads, 131072 tokens per batch,
    `h200.sh fpd`, run 2026-12-05T16:46:15Z on an H100, FA4 native in the same call): causal
    8K 575.2 -> 586.1 TF/s (0.978 -> 0.997 of FA4), causal 32K 626.0 -> 637.4 (0.961 ->
    0.978), hstu 593.1 / 634.1 -> 592.5 / 636.1, shared prompt 549.0 / 621.1 -> 552.7 / 624.2
    (8K / 32K); session 32's H100 run at causal 8K ordered them the same (default 0.975,
    operands_early 0.980, both 0.993). The native D 80 / 96 forwards (FWD_NATIVE_HEAD_DIMS)
    run D 128's loop on narrower rows and take them too; D 64 / 192 / 256 keep them off
    until timed. p_double needs work runs and neither rescale knob.

    >>> _fwd_issue_switches(128, 128, True, False, False)
    {'operands_early': True, 'p_double': True}
    >>> _fwd_issue_switches(64, 64, True, False, False)
    {'operands_early': False, 'p_double': False}
    """
    measured = "1" if _fwd_d128_loop(head_dim, head_dim_v) else "0"
    return dict(operands_early=_env_flag(FWD_OPERANDS_EARLY_ENV, measured),
                p_double=(_env_flag(FWD_P_DOUBLE_ENV, measured) and work_runs and not rescale_tail
                          and not rescale_early))


def num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the first GPU (``core_count``), else ``default`` (132:
    H100 SXM / H200), e.g. while compiling on a machine without one."""
    try:
        for d in jax.local_devices():
            if d.platform == "gpu" and getattr(d, "core_count", None):
                return int(d.core_count)
    except RuntimeError:
        pass
    return default


def persistent_schedule(order, num_ctas: int, xp=jnp):
    """Deal ``forward_schedule``'s order to ``num_ctas`` persistent CTAs: int32
    [P, 1 + J] with P = min(num_ctas, U), J = ceil(U / P); row p holds CTA p's unit count,
    then its units. Units go round by round, one per CTA, every other round in reverse
    (a snake), so the CTA that takes a round's longest unit takes the next round's
    shortest and the CTAs' totals stay close under the longest-first order.

    >>> import numpy as np
    >>> persistent_schedule(np.arange(5, dtype=np.int32), 2, xp=np).tolist()
    [[3, 0, 3, 4], [2, 1, 2, -1]]
    """
    u = int(order.shape[0])
    p = max(1, min(int(num_ctas), u))
    j = -(-u // p)
    padded = xp.concatenate([order.astype(xp.int32), xp.full((p * j - u,), -1, xp.int32)])
    rounds = padded.reshape(j, p)
    snake = xp.where((xp.arange(j) % 2 == 1)[:, None], rounds[:, ::-1], rounds)
    # Padding sits in the last round only, i.e. at the end of a CTA's row.
    table = snake.T
    count = (table >= 0).sum(axis=1, dtype=xp.int32)[:, None]
    return xp.concatenate([count, table], axis=1).astype(xp.int32)


def kv_heads_per_l2_group(seqlen_k: int, head_dim: int, head_dim_v: int, itemsize: int,
                          l2_bytes: int = L2_BYTES) -> int:
    """How many KV heads' K and V (seqlen_k x (D + Dv) x itemsize bytes each) one group of
    the forward schedule holds: the largest power of two that fits ``l2_bytes``, at least 1
    (32K keys, D 128, bf16: 16 MB a head, groups of 2)."""
    per_head = max(1, seqlen_k * (head_dim + head_dim_v) * itemsize)
    fit = max(1, l2_bytes // per_head)
    return 1 << (int(fit).bit_length() - 1)


def forward_schedule(fwd_tiles, batch: int, num_heads: int, num_kv_heads: int, heads_per_group: int,
                     xp=jnp):
    """The order in which the forward's 1-D grid runs its work units, ``unit = (b * Hq + h) * Tq
    + q_tile``: int32 [B * Hq * Tq], a permutation.

    Units are grouped by KV head (``heads_per_group`` consecutive (batch, kv head) pairs per
    group, so the group's K / V stay in L2 while its units run) and, inside a group, ordered
    by their visited key-tile count, largest first (ties: query tile descending, then
    (batch, head)):
    the longest units start first and the grid's tail is made of short ones. The counts
    come from ``fwd_tiles`` (uint32 [Bm, Hm, Tq, W], 2 state bits per tile, bit 0 = visited),
    so the order serves any mask, not only causal. ``xp``: ``jax.numpy`` (traced, inside
    ``cute_forward``) or ``numpy`` (tests).

    >>> import numpy as np
    >>> tiles = np.array([[[[0x1], [0x5], [0x15]]]], np.uint32)   # causal, 3 query tiles
    >>> forward_schedule(tiles, 1, 2, 1, 1, xp=np).tolist()        # 2 heads share one kv head
    [2, 5, 1, 4, 0, 3]
    """
    Bm, Hm, Tq, W = fwd_tiles.shape
    x = fwd_tiles.astype(xp.uint32) & xp.uint32(0x55555555)          # each tile's visited bit
    x = (x & xp.uint32(0x33333333)) + ((x >> xp.uint32(2)) & xp.uint32(0x33333333))
    x = (x + (x >> xp.uint32(4))) & xp.uint32(0x0F0F0F0F)
    x = (x * xp.uint32(0x01010101)) >> xp.uint32(24)                   # popcount per word
    counts = xp.broadcast_to(x.astype(xp.int32).sum(axis=-1, dtype=xp.int32), (batch, num_heads, Tq))
    b = xp.arange(batch, dtype=xp.int32)[:, None, None]
    h = xp.arange(num_heads, dtype=xp.int32)[None, :, None]
    t = xp.arange(Tq, dtype=xp.int32)[None, None, :]
    group = (b * num_kv_heads + h // (num_heads // num_kv_heads)) // heads_per_group
    shape = (batch, num_heads, Tq)
    keys = [xp.broadcast_to(x, shape).reshape(-1) for x in (b * num_heads + h, -t, -counts, group)]
    order = xp.lexsort(keys)    # the last key sorts first: group, -count, -q_tile, (batch, head)
    return order.astype(xp.int32)


def cute_forward(q, k, v, fwd_intervals, fwd_tiles, *, scale=None, softcap=None, block_q=128, block_kv=128,
                 num_stages=None, softcap_fast_tanh=False, residual=None, row_region=None,
                 residual_params=None, kernel_head_dims=None):
    """Masked attention forward on SM90 from an Execution Descriptor's forward view.

    Args:
      q: [B, Nq, Hq, D]; k: [B, Nk, Hkv, D]; v: [B, Nk, Hkv, Dv] (bf16 or fp16; Hq % Hkv == 0).
      fwd_intervals: int32 [Bm, Hm, Nq, K, 2] (start, length) per row, Bm in {1, B}, Hm in {1, Hq}.
      fwd_tiles: uint32 [Bm, Hm, ceil(Nq/block_q), ceil(ceil(Nk/block_kv)/16)] tile states.
      scale: logit scale, default 1/sqrt(D).
      softcap: None, or cap > 0: logits = cap * tanh(scale * q.k / cap), before the mask.
      block_q, block_kv: the tiles fwd_tiles was built at; must be preferred_forward_tiles(D).
      num_stages, softcap_fast_tanh: benchmark overrides (default: preferred_forward_stages,
        exact tanh; the fast tanh misses the LSE tolerance policy).
      residual: a forward ``ResidualProgram`` (lower/residual_program.py) when the tables
        hold hulls: its predicates are checked per element in partial tiles, reading
        ``row_region`` int32 [Bm, Nq] (the descriptor's) and ``residual_params`` int32
        [Bm, max(W, 1)] (``residual.table(desc.metadata, Bm, jnp)``).
      kernel_head_dims: None, or a built pair (D', Dv') at least as wide as (D, Dv), both
        multiples of 8: the kernel of (D', Dv') runs on the arrays as they are, its TMA
        loads zero-filling the columns past D / Dv and O's store dropping those past Dv
        (``ForwardKey.io_head_dims``): exact, with no padded copies. The tiles and stages
        are (D', Dv')'s; the default scale stays 1/sqrt(D).
    Returns:
      o [B, Nq, Hq, Dv] (q.dtype) and lse float32 [B, Hq, Nq] (natural log; -inf for empty rows).
    """
    B, Nq, Hq, D = q.shape
    Bk, Nk, Hkv, Dk = k.shape
    Dv = v.shape[-1]
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if Bk != B or Dk != D or v.shape[:3] != k.shape[:3] or Hq % Hkv:
        raise ValueError(f"incompatible shapes q{q.shape} k{k.shape} v{v.shape}")
    io = _io_head_dims("cute_forward", D, Dv, kernel_head_dims)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if io is not None:
        D, Dv = kernel_head_dims
    Bm, Hm, Nq_i, K, two = fwd_intervals.shape
    if two != 2 or Nq_i != Nq or Bm not in (1, B) or Hm not in (1, Hq):
        raise ValueError(f"fwd_intervals shape {fwd_intervals.shape} does not fit q{q.shape}")
    Tq, Tk = -(-Nq // block_q), -(-Nk // block_kv)
    if fwd_tiles.shape != (Bm, Hm, Tq, -(-Tk // 16)):
        raise ValueError(
            f"fwd_tiles shape {fwd_tiles.shape} does not match {block_q}x{block_kv} tiles of "
            f"Nq={Nq}, Nk={Nk} (expected {(Bm, Hm, Tq, -(-Tk // 16))}); was the descriptor built "
            "for other tile sizes?"
        )
    stages = num_stages or preferred_forward_stages(D, jnp.dtype(q.dtype).name)
    residual = None if residual is None or residual.exact else residual
    key = ForwardKey(
        dtype=jnp.dtype(q.dtype).name, head_dim=D, head_dim_v=Dv, num_intervals=K,
        block_q=block_q, block_kv=block_kv, broadcast_batch=(Bm == 1 and B > 1),
        broadcast_head=(Hm == 1 and Hq > 1), scale=float(scale), num_stages=stages,
        softcap=None if softcap is None else float(softcap), softcap_fast_tanh=softcap_fast_tanh,
        residual=residual, io_head_dims=io,
        **forward_switches(D, Dv, block_q, block_kv, stages, residual=residual, num_intervals=K),
    )
    extra = ()
    if key.residual is not None:
        if row_region is None or residual_params is None:
            raise ValueError("cute_forward with a residual program needs row_region and residual_params")
        if row_region.shape != (Bm, Nq) or residual_params.shape != (Bm, max(residual.width, 1)):
            raise ValueError(f"row_region {row_region.shape} / residual_params {residual_params.shape} "
                             f"must be {(Bm, Nq)} / {(Bm, max(residual.width, 1))}")
        extra = (row_region.astype(jnp.int32), residual_params.astype(jnp.int32))
    key = _fit_list_to_length(key, Tk)
    if Bm == 1 and B == 1:
        key = dataclasses.replace(key, broadcast_batch=True)
    if Hm == 1 and Hq == 1:
        key = dataclasses.replace(key, broadcast_head=True)
    if key.schedule:
        group = kv_heads_per_l2_group(Nk, D, Dv, jnp.dtype(q.dtype).itemsize)
        order = forward_schedule(fwd_tiles, B, Hq, Hkv, group)
        extra = extra + ((persistent_schedule(order, num_sms()) if key.persistent else order),)
    name = _ensure_registered(key)
    out_types = (
        jax.ShapeDtypeStruct((B, Nq, Hq, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((B, Hq, Nq), jnp.float32),
    )
    call = jax.ffi.ffi_call(name, out_types, vmap_method="sequential")
    operands = (q, k, v, fwd_intervals.astype(jnp.int32), fwd_tiles.astype(jnp.uint32), *extra)
    o, lse = match_varying(call(*operands), *operands)
    return o, lse


# ---------------------------------------------------------------------------- backward
# Validated on the H200: D 64 / 128 since "Backward v1", with a soft cap and D 256 since
# 2026-12-03 (every case of tests/gpu/test_cute_head_dims.py; NOTES.md "Session 16").
BWD_HEAD_DIMS = (64, 128, 256)
BWD_HEAD_DIM_PAIRS = ((192, 128),)     # (D, Dv), Dv != D: split_dkv; validated without a cap
BWD_TILES = (64, 128)       # (bwd_block_q, bwd_block_kv): the descriptor's backward tiles
BWD_TILES_SPLIT = (64, 64)  # ... with BackwardConfig.split_dkv (D 256: preferred_backward_config)
BWD_TILES_WIDE = (128, 128)  # ... with 128-query tiles (D 64: BackwardConfig.block_q)
BWD_TILES_SWAP = (64, 96)    # ... with BackwardConfig.dkv_swap (D 192 / Dv 128)
BWD_CONFIG_ENV = "JCOMPILEMASK_CUTE_BWD_CONFIG"


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """The static shape of FlashBackwardSm90, separate from what the mask decides.

    - ``block_q`` x ``block_kv``: the backward tile (queries streamed, keys resident). Two
      consumer warpgroups of 64 keys each; FA3 and FA4 use 64 x 128 at hdim 128 too.
      ``block_q=128`` (D 64 only, its default: 128 x 128, FlashAttention's hdim-64 tile)
      doubles the queries per tile: S^T / dP^T are 64 x 128 per warpgroup, and the dQ product splits
      along the queries (each warpgroup 64 of them, all of D) instead of along D. It needs
      ``ds_first`` (FA4's order at this tile: with dV in flight while dS^T is converted
      ptxas serializes every wgmma, C7512). D 64 causal, SASS: 657 instructions per
      unmasked tile loop copy, 168 registers, 0 B stack (64 x 128: 458 for half the work).
    - ``num_stages``: depth of the Q / dO (and lse / delta) ring.
    - ``ds_stages``: dS^T buffers in shared memory. With 2, a warpgroup may write tile
      t + 1's dS while the other still reads tile t's for its dQ product, so one barrier
      per tile suffices (1: a second barrier guards the buffer).
    - ``stats_early``: lse and delta read from shared memory into registers right after
      the S^T and dP^T products are issued (their latency hides under the GEMMs), instead
      of where they are used (lse after S^T is waited on, delta before dP^T is). Off by
      default: measured slower on the H200 (run 2026-12-01T10:48:36Z, causal 32K bwd 42.2 vs
      41.3 ms, hstu 51.0 vs 48.2; the 32 extra live registers cost more than the latency).
    - ``lse_early``: lse alone read right after the S^T issue, delta where used (FA4's
      SM90 choice); implied by ``stats_early``. Not yet measured.
    - ``release_do_early``: dO's ring stage freed as soon as dV (its last reader) is done,
      between the dQ and dK issues, instead of with Q's at the end of the tile. Not yet
      measured.
    - ``stats_shfl``: lse and delta as 2 values per lane (queries 2 lane, 2 lane + 1 of the
      64-query tile), read right after the S^T / dP^T issue, and handed to the lanes that
      need them by ``shfl`` where used (FA4's SM90 order), instead of 16 shared-memory loads
      each queued behind the GEMMs' operand reads (ncu, causal 32K: the exp2 FFMA waiting on
      the lse load was ~13% of consumer stalls). Overrides ``stats_early`` / ``lse_early``.
      H200, 32K bwd ms (run 2026-12-01T20:30:10Z): causal 38.81 -> 38.02, hstu 44.75 ->
      45.05; run 2026-12-01T23:46:01Z with ``column_bits=0, column_skip``: causal 39.88 ->
      39.21, hstu 45.17 -> 45.26. The D 64 / 128 default since session 8 (see
      ``preferred_backward_config``).
    - ``column_registers``: the largest Kc whose column intervals each thread holds in
      registers for the whole pass; above it they are re-read in each masked tile
      (ptxas, D 128, K 6 / Kc 7: 280 B of stack held, 48 B re-read). 16 (always hold) is
      the behaviour validated on the H200; 2 is the candidate, to validate
      (``test_builtin_grads[clear]``) and time (``h200.sh bwdv1c``).
    - ``column_bits``: re-read intervals (Kc > ``column_registers``) of masks with Kc >
      ``column_bits`` are loaded one (start, length) pair at a time and tested against all
      of the key row's query columns, visibility gathered in a 32-bit mask, instead of all
      2 x Kc values of the row first. ptxas, D 128, work list + dK/dV TMA store, stack
      bytes held / re-read / re-read into bits: K 2 / Kc 13 (shared_prompt, 6 responses)
      656 / 128 / 0; K 6 / Kc 7 (clear) 288 / 32 / 0. H200, 32K bwd ms (run
      2026-12-01T17:02:17Z, NOTES.md "Session 6"): shared_prompt 38.44 / 34.13 / 32.90; clear
      15.13 / 7.29 / 7.66 (most of its tiles are masked: the bit loop costs more there);
      hstu (Kc 4) 45.16 / 44.45 / 44.66. Hence the default: re-read above Kc 2, into bits
      above Kc 8.
    - ``column_skip``: in the unrolled bit-mask path, skip a column interval that misses
      the tile's queries (one compare per interval and key row instead of ncols); the loop
      past ``COLUMNS_UNROLLED`` always skips. H200, 32K bwd ms with ``column_bits=0`` (run
      2026-12-01T20:30:10Z): clear (Kc 7) 7.19 -> 6.61, shared_prompt (Kc 13) 33.16 ->
      33.31; with ``stats_shfl`` (run 2026-12-01T23:46:01Z, 32K): clear 7.28 -> 6.76,
      shared_prompt 33.60 -> 33.56, hstu 45.17 -> 45.26. The D 64 / 128 default since
      session 8.
    - ``deterministic``: dQ contributions added to each query tile in key-tile order
      (per-query-tile semaphores; see ``FlashBackwardSm90.write_dq``), so gradients are
      bit-identical across runs. dK and dV are deterministic either way (one CTA owns a
      key tile). ``mask_attention(deterministic=True)`` selects it.
    - ``dkv_tma_store``: dK / dV written through K's and V's shared buffers (stmatrix)
      and one TMA store each, as the forward writes O, instead of 2-byte element stores
      from registers (128 per thread per CTA; the epilogue weighs most at short
      sequences, where a CTA visits few tiles). Not yet run on the H200.
    - ``work_list``: the producer warp turns a key column's tile words into a list of the
      query tiles it visits (tile index + masked bit; one warp prefix sum per 32 words) in
      shared memory, once per head and chunk of ``list_chunk`` query tiles, double
      buffered; producer, dQ warp and consumers iterate that one list instead of each
      walking every tile's bits (so their tile counts cannot diverge). Not yet run on the
      H200.

    - ``lse_prefetch``: the tile's lse read from shared memory (8 LDS.64 per thread) right
      after the Q stage's barrier wait, before the S^T issue, so the loads complete under
      the GEMM; delta where used. FA4's SM90 placement (its SASS, ``tests/scripts/
      sass_offline.py fa4``). ``lse_early`` (after both issues) measured +3.4% at causal
      32K; this one, alone, 37.64 -> 37.81 causal / 44.28 -> 44.59 hstu (32K bwd ms, run
      2026-12-02T08:02:41Z), but with ``static_stage`` the fastest (below). Excludes
      ``stats_shfl`` / ``stats_early`` / ``lse_early``.
    - ``static_stage``: the tile body compiled once per ring stage (2), the stage a
      compile-time constant in each copy (a warp-uniform branch on ``state.index`` picks
      one), so the shared-memory descriptors of Q, dO, their transposes and dS^T fold the
      stage into their base: each k-step then ORs its offset in (one uniform instruction)
      instead of a 64-bit add (UIADD3 + UIADD3.X + a UMOV of the constant high word,
      dependent, before each HGMMA). Twice the tile code. H200, 32K bwd ms (run
      2026-12-02T08:02:41Z): causal 37.64 -> 37.69, hstu 44.28 -> 43.49; with
      ``lse_prefetch`` 37.44 / 42.80, the D 128 default since session 10 (see
      ``preferred_backward_config``). At D 64 ptxas serializes the wgmmas (C7512,
      insufficient registers): not used there.
    - ``p_early``: P^T converted to the input dtype (the dV operand) before the wait on
      dP^T, so the conversion overlaps that GEMM's tail (FA4's SM90 order), instead of after
      dS^T. 16 more live registers while dS^T is computed. Not yet run on the H200.
    - ``dv_early``: with ``p_early``, dV += P^T dO also issued there, before the wait on dP^T
      (which then waits for one group fewer), so the tensor pipe holds queued work while
      dS^T is computed (FA4 issues dV after dS^T is in shared memory; ours, by default,
      before dS^T is converted). Implies ``p_early``. H200, 32K bwd ms (run
      2026-12-02T12:11:05Z): causal 37.41 -> 37.54, hstu 43.22 -> 44.19, shared prompt
      31.73 -> 32.48: slower, kept opt-in only.
    - ``ds_first``: dS^T converted and written to its shared buffer (stmatrix) *before* dV +=
      P^T dO is issued, and the fence that makes it visible to the dQ wgmma after that
      issue, then the DS_READY barrier: FA4's SM90 order. By default the stores follow the
      dV issue and the fence follows them at once, so each warp waits there for its own
      stores (ncu, causal 32K, run 2026-12-02: fence + DS_READY 7% of our warps' stall
      samples, FA4's 0.7%). Excludes ``dv_early`` and ``split_dkv``. H200, 32K bwd ms (run
      2026-12-02T12:40:37Z): causal 37.03 -> 37.25, hstu 42.61 -> 43.13: slower (dV then
      waits for every dS^T conversion; by default the tensor pipe runs dV while the fence
      waits, so those stall samples were not lost tensor time). Opt-in only.
    - ``entry_ahead`` (with ``work_list``): each tile's step reads the next tile's
      work-list entry from shared memory before its last wgmma wait, instead of the loop
      reading it at the next tile's head (that LDS and the R2UR waiting on it were ~2% of
      our warps' stall samples at causal 32K, ncu, session 11; FA4 counts its query tiles).
      A read at the loop head one tile ahead changes nothing: ptxas puts the R2UR right
      behind the LDS.
    - ``split_sdp`` (with ``split_dkv``; ``ds_stages=2`` double-buffers P^T too, D 192
      only: 215 KB; D 256 needs ``ds_stages=1``): the warpgroups split the S^T / dP^T
      tile by queries (64 keys x 32 queries each: 16 + 16 accumulator registers instead of
      32 + 32, each computed once instead of twice) and write P^T and dS^T to shared memory,
      where dV / dK (each warpgroup's half of D, all 64 queries) read them (SS wgmmas).
      FlashAttention's SM90 hdim-256 layout; without it ptxas serializes the D 256
      backward's wgmmas (C7512: the whole S^T / dP^T in each warpgroup beside dK + dV).
    - ``split_dkv``: both consumer warpgroups own the same ``block_kv`` = 64 keys; each
      computes the whole 64 x 64 S^T and dP^T of them (twice the S / dP tensor work: 7
      GEMM units per tile instead of 5) and the half of dK / dV / dQ's head dims that is
      its own, so dK + dV take D registers per thread instead of 2 D (D 256: 128 instead of
      an impossible 256). dS^T is written to shared memory by the first warpgroup alone.
      Needs 64 x 64 backward tiles (``BWD_TILES_SPLIT``). Validated on the H200 (D 256,
      192 / 128: tests/gpu/test_cute_head_dims.py).

    - ``row_mask``: a masked tile tests each query column against its K forward row
      intervals (one vector of 2 K values per column, K tests per element) instead of each
      key row against its Kc column intervals (Kc per element, or the bit loop), even where
      the column view is exact; the row path the kernel already takes for sequences whose
      column view is not exact. Per consumer thread and masked tile at D 128 (2 key rows x
      16 query columns): shared prompt (K 2, Kc 13) 64 tests instead of up to 416 (the
      default's bit loop skips, at run time, the column intervals that miss the tile),
      HSTU (K 2, Kc 4) 64 instead of up to 128, CLEAR (K 6, Kc 7) 192 instead of up to
      224. Each (start, length) is one 8-byte load; static SASS of the shared prompt's
      masked tile: 859 instructions instead of 2649, 0 B stack (NOTES.md, session 13).
      Residual masks keep their own path. Not yet run on the H200.
    - ``exp2_emu`` (0..8): of every 8 consecutive query columns of a thread's S^T fragment,
      ``exp2_emu`` compute P^T's exp2 on the FMA pipe (``common.exp2_fma``: Cody-Waite range
      reduction, a cubic for 2^f, 2^j from the exponent bits; 10 FMA / ALU instructions,
      relative error <= 8.6e-5, exactly 0 for x < -126 and -inf, NaN kept) instead of
      MUFU.EX2, spread evenly: column c (0-based, of the thread's 16, or 8 with
      ``split_sdp``) is emulated when ``(c + 1) * exp2_emu // 8 != c * exp2_emu // 8``
      (2: columns 3, 7, 11, 15, a quarter of the elements; 4: the odd columns, half; 8:
      all). With a soft cap the same columns of ``softcap_probs``' exp2 (the third MUFU op
      per score); the tanh's ex2 stays on the MUFU (its error would reach P multiplied by
      cap log2 e). 0 (the default) emits the MUFU path alone, SASS unchanged. For MUFU
      pressure: our warps stalled on MUFU.EX2 in 5.9% of stall samples (ncu, causal 32K),
      FA4's SM90 backward 2.9%. Static SASS per tile and warp, D 128 default config
      (unmasked / masked tile): 394 / 919 instructions, 32 MUFU; exp2_emu=2 467 / 992, 24
      MUFU; 4: 539 / 1064, 16 MUFU; 168 registers, 0 B stack, no C7512. Soft cap 30: MUFU
      96 -> 88 / 80 at 2 / 4, stack 8 -> 16 / 8 B (8: 56 B, spills in the tile loop); D 64:
      8 B of stack (one value kept across the tile loop). Not yet run on the H200.
    - ``rcp_emu`` (0..8, soft cap only): the same columns rule for the reciprocal of the
      soft cap's tanh (1 - 2 / (e + 1), the second of its three MUFU ops per score), taken
      on the FMA pipe (``common.rcp_fma``: bit-trick seed, three Newton steps, within 1 ulp
      as ``rcp.approx``; ~8 instructions instead of one MUFU.RCP). With ``exp2_emu`` the
      capped score's MUFU ops fall from 3 toward 1. Ignored without a soft cap. Not yet run
      on the H200.

    - ``softcap_r`` (soft cap only): the capped score kept as r = 1 / (e + 1) (t = 1 - 2 r)
      rather than t: P^T's exponent is one FFMA of r against a per-column constant (cap
      log2 e - lse2), the gradient factor (1 - t^2) / 4 = r (1 - r) one FFMA (exact near
      saturation, where 1 - t * t of a rounded t is not), the factor 4 folded into dQ's and
      dK's final scale (``backward_grad_scale``), and the P^T = 0 guard only in masked tiles
      (the mask writes r = +inf): 3 instructions fewer per score (the cap costs +16.5-20.7%
      over no cap, issue 15's line is 15%: run 2026-12-03T14:20:06Z). Timed on the H200, no
      gain (run 2026-12-03T17:34:16Z, causal D 128 cap 30, bwd ms): 32K 44.64 -> 44.69, 8K
      11.78 -> 11.84: 104 fewer instructions per tile do not shorten it, so instruction
      issue is not what the capped tile waits on (not yet profiled). Opt-in; its GPU
      gradient cases have not run.
    - ``dq_blocked``: the order of each query tile's float32 dQ slot (what the dQ warp
      adds to global memory, byte for byte as the consumers left it in shared memory).
      Off: fragment order, each thread's 4 floats of one 8-column group (2 rows x 2
      columns) as one 128-bit store, thread-major; the un-permute after the kernel
      (``dq_fragment_unpermute``) then gathers 8-byte pieces at strides (a 10-d transpose).
      On: column blocks of 8 floats, (block, row, 8 floats) — each thread's 2 columns of
      a row as one 64-bit store (a warp's 32 stores are 256 contiguous bytes: no bank
      conflict), twice the stores; the un-permute is then a transpose of 32-byte runs.
      The same values added in the same order: dQ is bit-identical (causal D 128 on the
      H200). Measured slower, so off: the un-permute was never the cost — XLA runs the
      fragment-order one at 0.200 ms against 0.189 for the bare scale + cast of the same
      537 MB at 8K (``tests/scripts/gpu_dq_post_time.py``, run 2026-12-03T21:17:13Z), and
      the 8 extra stores per tile cost more: bwd ms causal 8K 10.26 -> 10.44, 32K 38.23 ->
      38.54, shared prompt 8K 9.146 -> 9.153, 32K 32.45 -> 32.74 (same run,
      ``h200-bwd-variants.json``).

    - ``schedule``: a 1-D grid whose block i runs the key column (work unit) the host put
      at position i of ``backward_schedule``'s order, so that long columns do not start
      last. With the default 3-D grid the blocks of the last (batch, head) start at the end
      of the launch, its longest columns among them. A greedy replay of the launch on 132
      SMs (a column costing 5 us + 2.4 us per visited tile, 3.0 per masked one) lands
      within ~3% of the measured grid-order kernels at 32K. Costs one dependent global
      load (the unit) per block. Excludes ``deterministic`` (its dQ turns rely on the
      launch order). ``$JCOMPILEMASK_CUTE_BWD_ORDER`` picks the host order
      (``backward_schedule``'s ``policy``). Bit-identical dK / dV and dQ within the
      tolerance policy (6 cases on the H200, session 21). Measured (bwd ms, default grid
      -> ``hoist`` / ``group`` / ``global``; runs 2026-12-04T03:09:19Z, 03:18:22Z,
      03:32:08Z, ``h200-bwd-variants.json``):

      | mask | N | grid | hoist | group | global |
      |---|---|---|---|---|---|
      | 16 global keys + window 256 | 32K | 2.989 | **2.121** | 3.008 | 2.123 |
      | 16 global keys + window 256 | 8K | 2.246 | **2.163** | 2.239 | |
      | CLEAR | 32K | 6.738 | **5.556** | 6.582 | 5.526 |
      | CLEAR | 8K | 4.602 | **4.461** | 4.535 | |
      | causal | 32K | **37.36** | 37.57 | 37.70 | 40.56 |
      | causal | 8K | **10.09** | 10.11 | 10.20 | |
      | shared prompt | 32K | 31.83 | 32.05 | **31.60** | 34.28 |
      | shared prompt | 8K | **8.864** | 9.104 | 9.018 | |
      | dilated window | 8K | **1.536** | 1.596 | | |

      Long columns that start late (global keys, CLEAR's text keys) gain 3-29%; the
      masks without them lose 0.2-3.9% (the unit's load before anything else can start;
      ``global`` also loses L2 reuse at 32K: +8.6% on causal), so it stays off by default.
      The ``tail`` policy (the grid's order, only the late columns moved) and the unit
      read first thing in the kernel were built after these runs. Timed at 8K in session
      22 (run 2026-12-04T05:36:54Z): global + window 2.274 -> 2.173, the dilated window
      1.535 -> 1.602. ``auto`` (session 23, not yet timed) keeps tail's order but runs the
      scheduled kernel only where that order moves a unit (``backward_schedule_moves``;
      ``lax.cond`` between it and the grid's kernel), so masks without late columns keep
      the grid's kernel and pay neither the unit read nor the sort.

    - ``column_words``: a masked tile of the column view builds each key row's visibility as
      two column-group bit words (the forward's ``group_mask``): each of the row's Kc
      intervals that reaches into the tile's queries ORs two runs in, the row's range is
      folded in, and each element costs a bit test and its select; residual masks keep a
      word pair per slot with a predicate and AND the bit with it per element. Static SASS
      per masked tile, D 128 (NOTES.md, session 21): see the table there. On the H200
      (session 22) bit-identical gradients on 8 masks and faster with exact_columns on the
      three timed (see ``preferred_backward_config``): the D 128 default since. Excludes
      nothing; ``row_mask`` takes precedence.

    - ``late_balance``: the consumers' last wait on the dQ warp (DQ_EMPTY, which only
      balances the barrier: the dQ warp frees the buffer once per tile, the consumers wait
      before every tile but the first) moved from before the dK / dV epilogue to after it.
      The epilogue writes K's and V's buffers, never the dQ tile, so it then overlaps the
      dQ warp's last bulk reduce-add. ncu of the dilated window's 8K backward (session 23,
      ``profiles/ncu-bwd-s23-*``) put 4.2% of the kernel's stall samples on that wait
      (barrier stalls at the epilogue's first instruction; Flex+FA4 has none). Not yet run
      on the H200.
    - ``list_early`` (with ``work_list``): the producer warp's tile words of the first
      list (first head, first chunk) are loaded first thing in the kernel, before the
      barriers' setup, instead of when the list is built after K / V's load is issued: the
      first Q / dO load waits for the list, so that word's latency adds to every CTA's
      start. On the dilated window's 2-4-tile columns a CTA lasts ~23 us at 8K, so ~0.5 us
      is ~2%. The forward's ``runs_early`` is the same idea. Not yet run on the H200.
    - ``dkv_staged`` (with ``persistent``, ``ds_stages=2``, the dQ tile; session 39): a
      persistent CTA stages a unit's dK in the two dS^T buffers and its dV in the dQ tile
      (32 KB each at D 128's 64 x 128 tiles) instead of in K's and V's buffers, so it frees
      K / V before its epilogue and the producer loads the next unit's K / V at once. ncu of
      the dilated window's 8K backward (session 39, an H100) put 14.2% of all stall samples
      on each CTA's first K / V wait (one CTA per SM: nothing overlaps it); session 28's
      persistent grid was slower because its next K / V waited for the dK / dV store. The
      consumers wait for the dQ warp's read of the unit's last dQ tile at the unit's end
      (not before its next unit's first), then store; the next unit's first dS^T / dQ
      waits for the store's read. The same values: dK / dV bit for bit (8 GPU cases on an
      H100, session 40). Slower there: the dilated window's 8K bwd 1.7124 ms (the default
      grid), 1.9817 persistent, 1.9267 persistent + dkv_staged, all at 1980 MHz (run
      2026-12-06T09:04:14Z, benchmarks/results/h100/h100-shortcols-s40.json): staging
      takes 2.8% off the persistent grid, which stays 12.5% behind the default. Opt-in.
    - ``dkv_vec_store`` (with ``dkv_tma_store=0``; session 40): dK / dV go from the
      registers to global memory, each thread's adjacent column pair in one 32-bit store (64
      per thread at D 128, where ``dkv_tma_store=0`` alone issues 128 2-byte stores), with no
      shared-memory staging and no barrier; a key tile that runs past Nk goes element by
      element. Aimed at each short-column CTA's tail: with the TMA store, the storing warp's
      ``EXIT`` waits for the store to read shared memory (session 39's ncu of the dilated
      window: 8.7% of the samples; FA4's kernel 9.9%), and the next CTA cannot start before.
      Not yet timed (``h200.sh shortcols``: ``nt`` / ``ntv``).
    - ``q_early`` (with ``list_early``; session 39): the producer finds the first visited
      tile of its first list from those early words (a ballot over the lanes' words and
      the lowest set bit: a few instructions, no list) and issues that tile's Q / dO / lse /
      delta loads right after K / V's, before it builds the list; the list's first entry
      is that tile, whose load the walk then skips. FlashAttention's SM90 backward issues
      its first K, V, Q, dO and lse together; ours issued the first Q / dO ~430 SASS lines
      of list building (and the words' load) after K / V (NOTES.md, session 38's static
      SASS), on every CTA of the dilated window's 2-4-tile columns. The same loads in the
      same stages: the gradients are bit for bit the default's. Grid order only (a host
      order's 1-D grid, ``schedule`` / ``persistent``, loads no early words and runs
      without it).
    - ``mask_r2p`` (with ``column_words``, masks without residual predicates): a masked
      tile tests each column-group word's bits in order, one word after the other, so that
      ptxas turns the tests into R2P (8 predicates from one instruction), as FA4's masks
      do, instead of one LOP3 per element. The elements are independent: bit-identical.
      Not yet run on the H200.
    - ``residual_periodic`` (with ``column_words``): a column slot whose residual
      predicate ``lower.residual_program.column_periodic`` proves 8-periodic in q (the
      dilated window's ``(q - k) % 2 == 0``) is evaluated once per key row and column
      class (the thread's query columns are base + 8 g + u) and gates its words, instead
      of per element; with every predicate slot periodic the masked tile is word tests
      (as R2P). Same values: bit-identical on the H200 (4 gradient cases) and the dilated
      window's bwd 1.457 -> 1.429 ms at 8K (run 2026-12-04T15:59:36Z): the D 128 default
      since session 25.
    - ``ds_words`` (with ``column_words``, a masked tile whose visibility is word tests
      only: no residual predicate, or every one periodic under ``residual_periodic``; no
      soft cap): the masked tile keeps each key row's two visibility words (packed in one
      register per row) from the mask to dS^T, and dS^T's masked pairs are set to 0 by the
      same R2P-form selects instead of a compare of P with 0 and a select per element (the
      guard that keeps 0 (dP - delta) from leaking a NaN into dK / dQ: ncu of the dilated
      window's 8K backward, session 23, counted its FSETP once per element, 8.3 M of the
      kernel's 224 M warp instructions). Same values where no visible P underflows to 0
      (there the guard gave +0 and this P (dP - delta), as a full tile and the reference
      do). Where the column view is not exact the guard stays. Not yet run on the H200.
    - ``persistent`` (with ``schedule``, ``dkv_tma_store``, ``work_list``): one CTA per SM,
      each running a row of ``persistent_schedule``'s table (``backward_schedule``'s order
      dealt round by round, every other round reversed) instead of one key column per CTA.
      The producer's and consumers' pipeline states and the list count carry from unit to
      unit; the consumers free K / V once the dK / dV store has read their buffers, and the
      producer loads the next unit's K / V after its first Q / dO tile, so that tile's load,
      the next list and the next unit's prologue overlap the store. For short key columns
      (the dilated window: 2-4 tiles a column, a CTA's fixed cost ~2 tiles' time). Its 14
      gradient cases passed on the H200 (session 28), but it timed 4.3% slower than the grid
      on the dilated window at 8K (run 2026-12-05T02:53:41Z): opt-in.
    - ``dq_red``: each consumer thread adds its float4 chunks of the dQ tile to the tile's
      global slot with ``red.global.add.v4.f32`` (the slot's fragment order as before)
      instead of staging the tile in shared memory for the dQ warp's bulk reduce-add: no
      DQ_FULL / DQ_EMPTY handoff per tile, and block_q x D x 4 bytes of shared memory free
      (64 KB at D 256: room for a second Q / dO stage, ``num_stages=2``). Excludes
      ``deterministic``. Its gradient cases passed on the H200 (dK / dV bit for bit with
      the default; session 29); D 256's default with ``num_stages=2`` since session 31
      (preferred_backward_config).

    - ``dv_split`` (0, 2 or 4; soft cap only, ignored without one): dV += P^T dO issued in
      that many pieces along the tile's queries (its k-blocks), each as soon as its query
      columns' P^T is in registers, instead of once after dS^T. With a cap each score costs
      3 MUFU ops (the tanh's ex2 and rcp, P's ex2) where the uncapped tile has 1, and during
      that phase the tensor pipe holds only dP^T (session 19's arithmetic: ~1000 clocks of a
      ~4000-clock tile with no GEMM under them; the cap costs +16.5-20.7% over no cap, the
      line is 15%). With pieces, dV's first k-blocks run under the next columns' tanh and
      exp2. In unmasked tiles each piece's tanh, P^T and dV issue follow one another; in
      masked tiles the tanh and the mask cover the tile first (the mask reads whole rows),
      then P^T and dV go piece by piece. The same products accumulate in the same k-block
      order: bit-identical gradients. With a cap it excludes ``split_sdp`` (P^T from shared
      memory) and ``dv_early`` / ``p_early`` / ``ds_first`` (other dV placements):
      ``BackwardKey`` says so. Not yet run on the H200.
    - ``dk_split`` (with ``dv_split``): each piece's dS^T is also made as soon as its P^T is
      (the first piece waits for dP^T, leaving its dV in flight) and its k-blocks of dK +=
      dS^T Q are issued at once, before the DS_READY barrier, so dK too runs under the next
      piece's MUFU work; dQ becomes the tile's last GEMM (its handoff then waits for every
      group). The same products in the same order: bit-identical. Excludes
      ``release_do_early``. Not yet run on the H200.
    - ``dkv_swap`` (D 192 / Dv 128; 64 x 96 tiles): the queries are the
      rows of S and dP (S = Q K^T, dP = dO V^T; each consumer warpgroup owns 48 of the 96
      keys, a thread 2 query rows x 12 key columns), and dK / dV are accumulated transposed
      (dV^T += dO^T P, dK^T += Q^T dS, M = Dv / D, both operands from shared memory: P and
      dS go through their buffers, like ``split_sdp``). 72 + 48 fp32 of dK^T / dV^T per
      thread, 24 + 24 of S / dP: the 96-key tile fits the 240 registers, where the S^T
      orientation needs ``split_dkv``'s 64 keys. Partial tiles test each query row's forward
      intervals (the column view is not read). Needs ``dkv_tma_store`` (stmatrix.trans into
      K's / V's buffers) and ``ds_stages=1`` (P + dS: 2 x 12 KB a stage, 227 KB in all),
      or ``ds_stages=2`` with ``dq_red``; excludes ``split_dkv`` / ``split_sdp``, the other
      dV placements (``ds_first`` / ``dv_split`` / ``dk_split``), ``stats_shfl`` and the
      column-view masks (``column_words`` / ``ds_words`` / ``residual_periodic``). dV^T is
      issued after DS_READY; with ``dv_early`` each warpgroup stores its keys' P before the
      dP wait, meets its own 128 threads (a named barrier per warpgroup) and issues dV^T
      there, so it runs under dS. FlashAttention-4's SM90 backward runs D 192 this way.
      Not yet run on the H200.
    - ``dk_late`` (issue 15, the soft cap's cost): tile j's dK += dS^T Q is issued in tile
      j + 1, right after its S^T and dP^T, so it runs on the tensor pipe under that tile's
      tanh / exp2 phase (ncu, session 33: the capped tile's extra 1024 MUFU cycles were
      hidden under nothing; dP^T was the only GEMM there). The dK reads dS^T from the
      tile's shared stage (from registers, the 16 live registers made ptxas serialize every
      wgmma, C7512), and the tile's Q stage is freed one tile later, once that dK is done
      (before the next dS^T store). The first tile of each list chunk issues a dK over its
      own dS^T stage zeroed beforehand and its own Q (no branch around the wgmma: its group
      keeps every wait count static); the last one's dK is issued after the chunk. The
      same products in the same order: dK bit for bit (but for the sign of an exact zero).
      Needs num_stages=2, ds_stages=2 and the default dV placement. SASS (D 128, cap 30):
      168 registers, 0 B stack (the default capped config: 8 B), 766 / 1248 instructions
      per unmasked / masked tile copy (783 / 1234). Measured slower (H100, causal 8K bwd,
      run 2026-12-05T19:51:04Z): 11.85 -> 12.00 ms capped, 10.00 -> 10.53 uncapped, with
      every identity case passing; not a default (NOTES.md, session 34).
    - ``wg_dq`` (issue 15, the soft cap's cost; D 128): each consumer warpgroup computes dQ
      over its own 64 keys for all of D (two halves of 64 columns, one at a time, so the
      accumulator stays 32 registers), reading only its own rows of dS^T: DS_READY, which
      made both warpgroups run their tanh / exp2 phase together, goes away. The two parts
      are summed in the shared dQ tile (warpgroup 0 stores, warpgroup 1 adds, then the dQ
      warp's one bulk reduce-add per half as before), so the global traffic is unchanged and
      warpgroup 1 trails warpgroup 0, whose MUFU phase can then run under its GEMMs. dK / dV
      are bit for bit the default's; dQ's per-tile sum is split in two fp32 partial sums
      (deterministic, not bit-identical). ``wg_dq_offset``: warpgroup 1 starts its first tile
      once warpgroup 0 has made its first dS^T (one wait per CTA), so the two begin out of
      phase instead of converging there by chance; the sum keeps warpgroup 1 behind
      warpgroup 0 and the dQ warp keeps warpgroup 0 less than a tile ahead.
    - ``held_words`` (issue 16, session 36; with ``column_words`` where the thread holds its
      key rows' column intervals for the pass, Kc <= ``column_registers``): a masked tile
      builds its words from those registers instead of re-reading the column table in
      every masked tile (the backward twin of the forward's ``residual_regs``, which took
      the dilated window's forward from 0.616 to 0.488 ms at 32K). Same values (4 gradient
      cases bit for bit on an H100, ``test_held_words_gives_the_default_gradients``) and
      the same time within noise (run 2026-12-06T00:05:49Z: dilated window bwd 1.711 ->
      1.708 ms at 8K, global + window 2.434 -> 2.448): opt-in.
    - ``heads_inner`` (issue 16, session 37): the grid's fastest dimension is the KV head
      (grid [Hkv, Tk, B]) instead of the key tile: the CTAs in flight read the same key and
      query rows of every head, i.e. whole [N, H, D] rows of Q / K / V / dO (H x D x 2
      bytes, 2 KB at 8 heads of 128) instead of one head's 256-byte piece of each. For
      sparse masks whose backward moves more bytes than it computes (a dilated window:
      1.43 ms vs Flex+FA4's 1.20 on the H200, where the H100 had them even, i.e. ours
      gained less from the H200's bandwidth). Each column computes what it did: dK / dV
      bit for bit, dQ's float sums added in another order. The grid's order only: it
      excludes ``schedule`` / ``persistent`` (1-D grids in the host's order; a trace-time
      host order, where chosen, replaces it) and ``deterministic`` (untested with it).

    ``preferred_backward_config`` picks the default per head dim; ``JCOMPILEMASK_CUTE_BWD_CONFIG``
    (e.g. ``ds_stages=1,stats_early=0``) overrides fields at trace time for benchmarks.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    ds_stages: int = 2
    stats_early: bool = False
    lse_early: bool = False
    release_do_early: bool = False
    stats_shfl: bool = False
    column_registers: int = 16
    column_bits: int = 16
    column_skip: bool = False
    deterministic: bool = False
    dkv_tma_store: bool = False
    work_list: bool = False
    list_chunk: int = 1024
    split_dkv: bool = False
    static_stage: bool = False
    lse_prefetch: bool = False
    p_early: bool = False
    dv_early: bool = False
    ds_first: bool = False
    entry_ahead: bool = False
    split_sdp: bool = False
    row_mask: bool = False
    exp2_emu: int = 0
    rcp_emu: int = 0
    softcap_r: bool = False
    dq_blocked: bool = False
    schedule: bool = False
    column_words: bool = False
    late_balance: bool = False
    list_early: bool = False
    mask_r2p: bool = False
    residual_periodic: bool = False
    ds_words: bool = False
    persistent: bool = False
    dq_red: bool = False
    dv_split: int = 0
    dk_split: bool = False
    dkv_swap: bool = False
    dk_late: bool = False
    wg_dq: bool = False
    wg_dq_offset: bool = False
    held_words: bool = False
    heads_inner: bool = False
    q_early: bool = False
    dkv_staged: bool = False
    dkv_vec_store: bool = False

    def __post_init__(self):
        wants = ((BWD_TILES_SWAP,) if self.dkv_swap else (BWD_TILES_SPLIT,) if self.split_dkv
                 else (BWD_TILES, BWD_TILES_WIDE))
        if (self.block_q, self.block_kv) not in wants:
            runs = " or ".join(f"{w[0]}x{w[1]}" for w in wants)
            knob = " with dkv_swap" if self.dkv_swap else " with split_dkv" if self.split_dkv else ""
            raise ValueError(f"cute backward runs {runs} backward tiles{knob}; the descriptor "
                             f"was built for {self.block_q}x{self.block_kv}")
        if self.dkv_swap:
            clash = [n for n in ("split_dkv", "split_sdp", "ds_first",
                                 "dv_split", "dk_split", "stats_shfl", "column_words",
                                 "ds_words", "residual_periodic") if getattr(self, n)]
            if clash or not self.dkv_tma_store:
                raise ValueError(
                    "dkv_swap (S = Q K^T per query row, dK^T / dV^T from shared memory) needs "
                    "dkv_tma_store=1 and excludes split_dkv / split_sdp, the dV placements "
                    "other than dv_early (ds_first, dv_split, dk_split), stats_shfl and the "
                    "column-view masks (column_words, ds_words, residual_periodic)"
                    + (f"; set {', '.join(n + '=0' for n in clash)}" if clash else
                       "; set dkv_tma_store=1"))
            if self.ds_stages == 2 and not self.dq_red:
                raise ValueError("dkv_swap with ds_stages=2 needs dq_red=1: two P + dS stages "
                                 "and the float32 dQ tile do not fit 227 KB of shared memory")
        if self.block_q == BWD_TILES_WIDE[0] and (self.dq_blocked or not self.ds_first):
            raise ValueError("block_q=128 needs ds_first=1 (dV issued after the dS^T stores: "
                             "with dV in flight while dS^T is converted, ptxas serializes the "
                             "wgmmas, C7512) and excludes dq_blocked (64-row dQ blocks)")
        if self.list_chunk < 16 or self.list_chunk % 16:
            raise ValueError(f"list_chunk={self.list_chunk} must be a positive multiple of 16 "
                             "(whole tile-state words)")
        if self.lse_prefetch and (self.stats_shfl or self.stats_early or self.lse_early):
            raise ValueError("lse_prefetch places the lse loads itself: it excludes stats_shfl, "
                             "stats_early and lse_early (set those to 0)")
        if self.split_sdp and not (self.split_dkv and not self.dv_early
                                   and not self.ds_first and not self.p_early and not self.stats_shfl):
            raise ValueError("split_sdp needs split_dkv, and excludes dv_early / p_early / ds_first "
                             "(dV is issued from shared memory after both halves are stored) and "
                             "stats_shfl (16 query columns per thread; split_sdp has 8)")
        if self.ds_first and (self.dv_early or self.split_dkv):
            raise ValueError("ds_first orders the dS^T store before the dV issue: it excludes "
                             "dv_early (dV issued earlier still) and split_dkv (one warpgroup "
                             "stores dS^T)")
        if self.dv_early and not self.p_early:
            object.__setattr__(self, "p_early", True)
        if self.static_stage and (self.num_stages, self.ds_stages) != (2, 2):
            raise ValueError("static_stage needs num_stages=2 and ds_stages=2 (the dS^T buffer "
                             "then alternates with the ring stage)")
        if not 0 <= self.exp2_emu <= 8:
            raise ValueError(f"exp2_emu={self.exp2_emu} must be 0..8 (columns of every 8 whose "
                             "exp2 runs on the FMA pipe)")
        if not 0 <= self.rcp_emu <= 8:
            raise ValueError(f"rcp_emu={self.rcp_emu} must be 0..8 (columns of every 8 whose "
                             "soft-cap reciprocal runs on the FMA pipe)")
        if self.persistent and not (self.schedule and self.dkv_tma_store and self.work_list):
            raise ValueError("persistent (each CTA runs a row of units) needs schedule=1 (the host's "
                             "unit order, dealt to the CTAs), dkv_tma_store=1 (K / V are freed for "
                             "the next unit once the dK / dV store has read them) and work_list=1")
        if self.dq_red and (self.deterministic or self.dq_blocked):
            raise ValueError("dq_red (dQ added from registers, no dQ warp) excludes deterministic "
                             "(the dQ warp orders the adds) and dq_blocked (a layout of the shared "
                             "staging buffer dq_red does without)")
        if self.schedule and self.deterministic:
            raise ValueError("schedule (a host order of the key columns) excludes deterministic: "
                             "the deterministic dQ turns wait on lower key tiles, which must "
                             "have lower block indices")
        if self.dv_split not in (0, 2, 4):
            raise ValueError(f"dv_split={self.dv_split} must be 0 (dV issued once), 2 or 4 (pieces "
                             "of the 64-query tile's 4 k-blocks)")
        if self.dk_split and (not self.dv_split or self.release_do_early):
            raise ValueError("dk_split issues dK with dv_split's pieces: it needs dv_split=2 or 4 "
                             "and excludes release_do_early (dO's stage is freed with Q's)")
        if self.dk_late:
            self._exclusive(
                "dk_late (each tile's dK += dS^T Q issued in the next tile, after its S^T / "
                "dP^T) keeps the tile's dS^T and Q stages until then: it needs "
                "num_stages=2, ds_stages=2 and dV issued before dS^T (the default placement), and "
                "excludes dkv_swap / split_dkv / split_sdp, dv_split / dk_split / dv_early / "
                "ds_first, release_do_early and persistent",
                ("dkv_swap", "split_dkv", "split_sdp", "dv_split", "dk_split", "dv_early",
                 "ds_first", "release_do_early", "persistent"),
                self.ds_stages == 2 and self.num_stages == 2, "num_stages=2,ds_stages=2")
        if self.wg_dq:
            self._exclusive(
                "wg_dq (each warpgroup's dQ over its own keys, summed in shared memory) "
                "needs 64-query tiles, ds_stages=2 and dK / dV along the keys, and excludes "
                "dkv_swap / split_dkv / split_sdp, dv_split / dk_split / dv_early / dk_late, "
                "release_do_early, dq_red / dq_blocked and persistent",
                ("dkv_swap", "split_dkv", "split_sdp", "dv_split", "dk_split", "dv_early",
                 "dk_late", "release_do_early", "dq_red", "dq_blocked", "persistent"),
                self.ds_stages == 2 and self.block_q == 64, "ds_stages=2,block_q=64")
        if self.wg_dq_offset and not self.wg_dq:
            raise ValueError("wg_dq_offset (warpgroup 1 starts once warpgroup 0 made its first "
                             "dS^T) needs wg_dq (with DS_READY both meet every tile anyway); "
                             "set wg_dq=1")
        if self.heads_inner:
            self._exclusive(
                "heads_inner (the grid's fastest dimension is the KV head) orders the grid "
                "itself: it excludes schedule / persistent (1-D grids in the host's order) "
                "and deterministic", ("schedule", "persistent", "deterministic"), True, "")
        if self.dkv_staged and not (self.persistent and self.ds_stages == 2 and not self.dq_red
                                    and not self.wg_dq):
            raise ValueError("dkv_staged (a persistent CTA stages dK / dV in the dS^T buffers and "
                             "the dQ tile, so K / V's buffers take the next unit's at once) needs "
                             "persistent=1, ds_stages=2 and the dQ tile (dq_red=0, wg_dq=0)")
        if self.q_early and not (self.list_early and self.work_list):
            raise ValueError("q_early (the first visited tile's Q / dO issued from the early "
                             "tile words, before the list is built) needs those words: set "
                             "work_list=1, list_early=1")
        if self.dkv_vec_store and (self.dkv_tma_store or self.dkv_swap or self.persistent):
            raise ValueError("dkv_vec_store (dK / dV stored from registers, a column pair per "
                             "32-bit store) replaces the TMA store: set dkv_tma_store=0 (and "
                             "dkv_swap=0, persistent=0, which need the TMA store)")
        if self.num_stages < 1 or self.ds_stages not in (1, 2):
            raise ValueError(f"num_stages={self.num_stages} must be >= 1 and ds_stages="
                             f"{self.ds_stages} 1 or 2")

    def _exclusive(self, what: str, excludes: tuple, shape_ok: bool, shape_fix: str):
        """Raise ValueError(``what`` + the fix) when a switch in ``excludes`` is on or the
        tile / stage shape it needs is not there (``shape_ok``; ``shape_fix`` says how)."""
        clash = [n for n in excludes if getattr(self, n)]
        if clash or not shape_ok:
            raise ValueError(what + (f"; set {', '.join(n + '=0' for n in clash)}" if clash
                                     else f"; set {shape_fix}"))

    @property
    def tag(self) -> str:
        return (f"t{self.block_q}x{self.block_kv}_s{self.num_stages}_ds{self.ds_stages}"
                f"{'_se' if self.stats_early else ''}{'_le' if self.lse_early else ''}"
                f"{'_rd' if self.release_do_early else ''}{'_sh' if self.stats_shfl else ''}"
                f"_cr{self.column_registers}"
                f"{f'_cb{self.column_bits}' if self.column_bits != 16 else ''}"
                f"{'_cs' if self.column_skip else ''}"
                f"{'_det' if self.deterministic else ''}{'_dkvt' if self.dkv_tma_store else ''}"
                f"{f'_wl{self.list_chunk}' if self.work_list else ''}{'_sdkv' if self.split_dkv else ''}"
                f"{'_ss' if self.static_stage else ''}{'_lp' if self.lse_prefetch else ''}"
                f"{'_dve' if self.dv_early else '_pe' if self.p_early else ''}"
                f"{'_dsf' if self.ds_first else ''}{'_ea' if self.entry_ahead and self.work_list else ''}"
                f"{'_ssdp' if self.split_sdp else ''}{'_rm' if self.row_mask else ''}"
                f"{f'_e2e{self.exp2_emu}' if self.exp2_emu else ''}"
                f"{f'_rcp{self.rcp_emu}' if self.rcp_emu else ''}"
                f"{'_scr' if self.softcap_r else ''}{'_qb' if self.dq_blocked else ''}"
                f"{'_sch' if self.schedule else ''}{'_cw' if self.column_words else ''}"
                f"{'_lb' if self.late_balance else ''}"
                f"{'_lse' if self.list_early and self.work_list else ''}"
                f"{'_r2p' if self.mask_r2p else ''}{'_rp' if self.residual_periodic else ''}"
                f"{'_dsw' if self.ds_words else ''}{'_pers' if self.persistent else ''}"
                f"{'_dqr' if self.dq_red else ''}{f'_dvs{self.dv_split}' if self.dv_split else ''}"
                f"{'_dks' if self.dk_split else ''}{'_swp' if self.dkv_swap else ''}"
                f"{'_dkl' if self.dk_late else ''}{'_wgq' if self.wg_dq else ''}"
                f"{'o' if self.wg_dq_offset else ''}{'_hw' if self.held_words else ''}"
                f"{'_hi' if self.heads_inner else ''}{'_qe' if self.q_early else ''}"
                f"{'_dst' if self.dkv_staged else ''}{'_vst' if self.dkv_vec_store else ''}")


def preferred_backward_config(head_dim: int, dtype: str = "bfloat16",
                              softcap: bool = False, deterministic: bool = False) -> BackwardConfig:
    """The backward config the registry uses. D 128 (and D 64 until session 29, which moved
    it to 128 x 128 tiles: below): 64 x 128 tiles, a 2-stage Q / dO ring, two dS buffers
    (NOTES.md, "Backward v1": the run that compared ds_stages 1 / 2 and stats_early on / off); at D 128 the lse read before the S^T GEMM
    and the tile body compiled once per ring stage (session 10).

    D 256 was chosen by arithmetic (below: the one layout that fits) and is the registry's
    default since every gradient case passed on the H200 (2026-12-03); timed once at causal
    32K: 138 ms against cuDNN's 119 (run 2026-12-03T05:54:08Z, h200-head-dims.json), so the
    shape is still to be re-chosen by measurement (h200.sh hdims with --jcm-variants):
    - registers (240 per consumer thread): the 64 x 128 layout gives each warpgroup 64 keys
      x D of dK and of dV, 2 x 64 x 256 / 128 = 256 fp32 registers: it cannot exist. With
      ``split_dkv`` (both warpgroups on the same 64 keys, D split) dK + dV take 128, the dQ
      half 64 (64 x 128 / 128). With each warpgroup also holding the whole S^T and dP^T
      (32 + 32) ptxas serializes the wgmmas (C7512, session 10); ``split_sdp`` (session 11)
      splits S^T / dP^T by queries (16 + 16 each) and takes P^T / dS^T through shared
      memory to dV / dK: no C7512, 0 B stack (bf16 / fp16, per head, soft cap,
      deterministic), 44 HGMMAs per tile and warpgroup, 5 groups.
    - shared memory (232448 bytes): K and V at 64 keys 2 x 32 KB, one Q and one dO stage
      2 x 32 KB, one 8 KB dS^T and one 8 KB P^T buffer, the float32 dQ tile 64 KB, the work
      list 8 KB: ~218 KB; a second Q / dO stage (+64 KB) does not fit, nor 128 keys (K + V
      128 KB + dQ 64 KB + one stage 64 KB = 256 KB). So 64 x 64 tiles, one stage — the
      shape FlashAttention's SM90 backward uses at hdim 256 (64 x 64, one Q / dO / dS stage,
      S split across warpgroups, P through shared memory).

    The new configs (D 256, and a soft cap at D 64 / 128) re-read Kc > 2 column intervals
    per masked tile (``column_registers=2``): ptxas stack bytes, D 128 fp16 cap K 6 / Kc 7
    272 held -> 96; D 256 K 6 / Kc 7 136 -> 40; D 256 cap K 2 / Kc 4 128 -> 72 (NOTES.md,
    "Issue 15"); since session 6 the D 64 / 128 no-cap config does too (measured), and
    all of them test Kc > 8 intervals one at a time into a bit mask (``column_bits=8``).
    """
    del dtype
    if head_dim == 192:
        # D 192 / Dv 128 (the only Dv != D pair), since session 32: dkv_swap, FA4's D 192
        # shape (kernels/cute/D192_64x96_PLAN.md): 64 x 96 tiles, S = Q K^T per query row,
        # dK^T / dV^T from P / dS in shared memory; 168 registers, 0 B stack, 46 HGMMA and
        # 454 / 605 instructions per unmasked / masked tile copy. Causal bwd ms on an H100
        # (runs 2026-12-05T14:29:31Z / 14:40:59Z, benchmarks/results/h100/): 8K 18.90 ->
        # 15.34 (FA4 native 15.19: 0.99x its speed), 32K 71.35 -> 58.61 (FA4 56.51: 0.96x);
        # FA4 forced to 64 x 64 ran 18.53 / 70.95, so the tile width was the gap. All 24 D 192
        # gradient cases of tests/gpu/test_cute_head_dims.py (with and without a cap) passed
        # under it there. ``_d192_split_config`` serves descriptors built at 64 x 64.
        # (column_registers / column_bits do nothing here, the column view is not read; they
        # keep the name of the kernels validated and timed: the split config's values.)
        return BackwardConfig(block_q=64, block_kv=96, num_stages=2, ds_stages=1, dkv_swap=True,
                              work_list=True, dkv_tma_store=True, column_registers=2,
                              column_bits=8)
    if head_dim == 256:
        # dq_red (dQ added from the consumers' registers: no 64 KB float32 dQ tile in shared
        # memory) frees room for a second Q / dO stage, as FlashAttention's hdim-256 backward
        # has. Causal bwd ms, one stage -> this: 32K 137.46 -> 111.34 (cuDNN 117.50, FA4
        # native 122.59; run 2026-12-05T02:47:39Z), 8K 34.73 -> 27.40 (cuDNN 29.86, FA4
        # 31.44; run 2026-12-05T05:44:19Z; h200-head-dims.json). dq_red excludes the
        # deterministic dQ order, whose form is the one-stage config (the same sums in the
        # same order).
        fast = not deterministic
        return BackwardConfig(block_q=64, block_kv=64, num_stages=2 if fast else 1, ds_stages=1,
                              split_dkv=True, split_sdp=True, work_list=True, dkv_tma_store=True,
                              column_registers=2, column_bits=8, dq_red=fast)
    if softcap:
        return BackwardConfig(work_list=True, dkv_tma_store=True, column_registers=2,
                              column_bits=8)
    # work_list and dkv_tma_store: causal 32K bwd 38.85 / 40.44 ms vs 40.66 without
    # (run 2026-12-01T13:50:48Z, h200.sh v1prof; NOTES.md "Backward v1, session 5").
    # column_registers / column_bits: see their entries in BackwardConfig.
    # stats_shfl, column_bits=0, column_skip: 23 GPU backward / gradient cases (the 20-rerun
    # stress among them) passed (h200.sh s8t, session 8); bwd ms vs the config before
    # (run 2026-12-01T23:46:01Z, 32K / 8K): causal 39.88 -> 39.21 / 10.60 -> 10.51, hstu
    # 45.17 -> 45.26 / 12.06 -> 12.10, shared_prompt 33.60 -> 33.56 (8K, run
    # 2026-12-01T23:55:22Z: 9.52 -> 9.31), clear 7.28 -> 6.76 (8K 4.95 -> 4.69).
    if head_dim == 64:
        # static_stage at D 64 makes ptxas serialize every wgmma ("C7512 ... insufficient
        # register resources"; CUTE_DSL_COMPILER_OPT='remarks{ptx}'; SASS: an arrive and a
        # wait around each of the 28 HGMMAs of a tile): D 64 keeps session 8's config
        # (the compile tests of the defaults fail on C7512: gpu_cases.compile_checking_remarks).
        # 128 x 128 tiles (FlashAttention's hdim-64 backward tile; ds_first, which they need)
        # with D 128's masked-tile words (column_words, residual_periodic): causal bwd ms
        # 24.14 -> 22.21 at 32K (FA4 native 21.37; run 2026-12-05T02:47:39Z), 6.408 -> 5.945
        # at 8K (FA4 native 5.561; run 2026-12-05T05:44:19Z; h200-head-dims.json); all 31
        # 128-query gradient cases of tests/gpu/test_cute_backward.py passed on the H200
        # (session 29).
        return dataclasses.replace(_d64_query64_config(), block_q=128, ds_first=True,
                                   column_words=True, residual_periodic=True)
    # static_stage + lse_prefetch (stats_shfl off: lse_prefetch places the lse loads): the 23
    # GPU backward / gradient cases passed (h200.sh s8t, session 10); bwd ms vs the config
    # before, same run (2026-12-02T08:22:59Z, h200-bwd-s10b.json; 32K / 8K): causal 37.49 ->
    # 37.26 / 10.19 -> 10.25, hstu 44.52 -> 43.05 / 11.83 -> 11.52, shared_prompt 32.55 ->
    # 31.59 / 9.11 -> 9.00, clear 6.69 -> 6.85 / 4.58 -> 4.59 (run 2026-12-02T08:02:41Z,
    # h200-bwd-s10.json: causal 37.64 -> 37.44, hstu 44.28 -> 42.80).
    # column_words (masked tiles of the column view from column-group words): its 8 gradient
    # cases bit-identical to the config before on the H200 (causal, dilated window, global +
    # window, shared prompt, CLEAR, HSTU, two residual regions; h200.sh s21, session 22),
    # bwd ms at 8K, same run (2026-12-04T05:36:54Z, h200-bwd-variants.json), with
    # exact_columns: dilated window 1.535 -> 1.453, global + window 2.274 -> 2.254, causal
    # 10.389 -> 10.255.
    # residual_periodic (a residual mask's 8-periodic predicate slots evaluated once per
    # column class; acts on such masks only): its 4 gradient cases bit-identical on the H200
    # (dilated window, global + dilated, two regions, per head), the dilated window's bwd
    # 1.457 -> 1.429 ms at 8K (run 2026-12-04T15:59:36Z, h200-masks.json; session 25).
    return BackwardConfig(work_list=True, dkv_tma_store=True, column_registers=2, column_bits=0,
                          column_skip=True, static_stage=True, lse_prefetch=True,
                          column_words=True, residual_periodic=True)


def _d64_query64_config() -> BackwardConfig:
    """D 64's 64 x 128 config (its default from session 8 to 28, validated on the H200
    throughout): what a D 64 descriptor built at the generic 64 x 128 backward tiles runs."""
    return BackwardConfig(work_list=True, dkv_tma_store=True, column_registers=2,
                          column_bits=0, column_skip=True, stats_shfl=True)


def _d192_split_config() -> BackwardConfig:
    """D 192 / 128's 64 x 64 config (its default from session 19 to 31, validated on the
    H200): what a D 192 descriptor built at 64 x 64 backward tiles runs."""
    # D 192 / Dv 128 (the only Dv != D pair): split_dkv with 64B-swizzled Q / K (halves
    # of 96 columns); registers dK 48 + dV 32 + S^T 32 + dP^T 32 + dQ half 48; shared
    # memory K 24 KB + V 16 KB + 2 x (Q 24 KB + dO 16 KB) + dS 16 KB + dQ 48 KB + list
    # 8 KB = ~193 KB, so two stages fit. By arithmetic, like D 256 (see above).
    # split_sdp (S^T / dP^T split by queries, each computed once; P^T through the second
    # dS buffer, hence ds_stages=1): causal bwd ms 78.31 -> 68.52 at 32K, 20.46 -> 17.94
    # at 8K (run 2026-12-03T14:20:06Z, h200-head-dims.json; FA4 native 58.54 / 15.52);
    # all 12 D 192 gradient cases of tests/gpu/test_cute_head_dims.py passed under it
    # (session 19). 168 registers, 0 B stack; 347 / 596 instructions per unmasked /
    # masked tile copy instead of 465 / 924.
    return BackwardConfig(block_q=64, block_kv=64, num_stages=2, ds_stages=1, split_dkv=True,
                          split_sdp=True, work_list=True, dkv_tma_store=True,
                          column_registers=2, column_bits=8)


def _backward_configs(head_dim: int, dtype: str = "bfloat16", softcap: bool = False,
                      deterministic: bool = False) -> tuple:
    """The configs the CuTe backward runs for these head dims, preferred first; a descriptor
    built at another one's tiles runs that one. At D 64 without a soft cap also the 64 x 128
    config (``_d64_query64_config``), so a descriptor instantiated at the generic default
    tiles keeps the CuTe backward; at D 192 the 64 x 64 one (``_d192_split_config``)."""
    preferred = preferred_backward_config(head_dim, dtype, softcap, deterministic)
    if head_dim == 64 and not softcap and preferred.block_q != BWD_TILES[0]:
        return preferred, _d64_query64_config()
    if head_dim == 192:
        return preferred, _d192_split_config()
    return (preferred,)


def served_backward_tiles(head_dim: int, dtype: str = "bfloat16", head_dim_v: int | None = None,
                          softcap: bool = False) -> tuple:
    """The (bwd_block_q, bwd_block_kv) a descriptor may be built at for the CuTe backward of
    these head dims: ``preferred_backward_tiles`` first, then the other configs' tiles
    (``_backward_configs``).

    >>> served_backward_tiles(64)
    ((128, 128), (64, 128))
    >>> served_backward_tiles(128)
    ((64, 128),)
    """
    want = preferred_backward_tiles(head_dim, dtype, head_dim_v, softcap)
    others = [(c.block_q, c.block_kv) for c in _backward_configs(head_dim, dtype, bool(softcap))[1:]]
    return (want,) + tuple(t for t in others if t != want)


def preferred_backward_tiles(head_dim: int, dtype: str = "bfloat16",
                             head_dim_v: int | None = None, softcap: bool = False
                             ) -> tuple[int, int]:
    """(bwd_block_q, bwd_block_kv) the descriptor's backward view must be built at for
    ``preferred_backward_config`` of the kernel that serves (head_dim, head_dim_v, softcap)."""
    del head_dim_v      # Dv != D (192 / 128) shares D's config
    # The env's tiles too ($JCOMPILEMASK_CUTE_BWD_CONFIG, e.g. block_q=128 at D 64): the
    # descriptor is then built at the tiles cute_backward will run. The env's fields apply
    # to the config of this softcap, as in cute_backward (stats_shfl=1 is valid beside the
    # capped config, not beside the uncapped one's lse_prefetch).
    base = preferred_backward_config(head_dim, dtype, bool(softcap))
    try:
        cfg = _config_from_env(base)
    except ValueError:
        # The variable's other fields may not fit this (non-deterministic) config, e.g.
        # dq_blocked beside D 256's dq_red, which the deterministic config cute_backward then
        # runs does not have: only its tiles count here (cute_backward validates the config
        # it runs, whole).
        keep = {f.name: getattr(base, f.name) for f in dataclasses.fields(BackwardConfig)
                if f.name not in ("block_q", "block_kv")}
        cfg = _config_from_env(base, **keep)
    return cfg.block_q, cfg.block_kv


def _config_from_env(config: BackwardConfig, **fixed) -> BackwardConfig:
    """Apply ``$JCOMPILEMASK_CUTE_BWD_CONFIG`` (``field=value,...``; read at trace time).
    ``fixed`` fields (the descriptor's tiles in ``cute_backward``) are set in the same step
    and win over the variable's, so a config is validated only whole: ``block_q=128``
    from a descriptor needs the variable's ``ds_first=1`` beside it.

    >>> import os
    >>> os.environ[BWD_CONFIG_ENV] = "block_q=128,ds_first=1"
    >>> cfg = _config_from_env(preferred_backward_config(64), block_q=128, block_kv=128)
    >>> (cfg.block_q, cfg.ds_first)
    (128, True)
    >>> del os.environ[BWD_CONFIG_ENV]
    """
    import os
    text = os.environ.get(BWD_CONFIG_ENV, "").strip()
    if not text:
        return dataclasses.replace(config, **fixed) if fixed else config
    fields = {f.name: f.type for f in dataclasses.fields(BackwardConfig)}
    changes = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in fields:
            raise ValueError(f"{BWD_CONFIG_ENV}: unknown field {name!r}; fields: {sorted(fields)}")
        default = getattr(config, name)
        changes[name] = (value.strip() in ("1", "true", "True")) if isinstance(default, bool) \
            else int(value)
    return dataclasses.replace(config, **{**changes, **fixed})


def backward_smem_bytes(head_dim: int, config: BackwardConfig, elem_bytes: int = 2,
                        head_dim_v: int | None = None) -> int:
    """Shared memory of FlashBackwardSm90: barriers, K and V, the Q / dO ring with its
    lse / delta, the dS^T buffers and one float32 dQ tile."""
    bq, bk = config.block_q, config.block_kv
    dd = head_dim + (head_dim if head_dim_v is None else head_dim_v)     # D + Dv
    return (1024 + elem_bytes * (bk * dd + config.num_stages * bq * dd
                                 + (2 if config.split_sdp or config.dkv_swap else 1)
                                 * config.ds_stages * bq * bk)
            + 2 * 4 * bq * config.num_stages + (16 if config.dq_red else 4 * bq * head_dim)
            + (2 * 4 * config.list_chunk if config.work_list else 16) + 8)


@dataclasses.dataclass(frozen=True)
class BackwardKey:
    """Everything the compiled backward kernel depends on statically: the mask's shape
    (interval counts, broadcasting), the model's (dtype, head dim, scale) and the config."""

    dtype: str
    head_dim: int
    num_intervals: int          # K of the forward (row) table
    num_bwd_intervals: int      # Kc of the column table (0: no column view)
    broadcast_batch: bool
    broadcast_head: bool
    scale: float
    config: BackwardConfig = BackwardConfig()
    # logits = cap * tanh(scale * q.k / cap); P recomputed from them and dS times (1 - t^2).
    # Static per model, like the forward's. Validated on the H200 at D 64 / 128 / 256.
    softcap: float | None = None
    head_dim_v: int | None = None   # None: Dv == D; (192, 128) runs split_dkv (64B-swizzled Q / K)
    # (forward, column) ResidualProgram pair over one parameter table (residual masks).
    residual: Any = None
    # The column view is exact for every input (masks of one region: regions cannot nest at
    # run time, lower/preprocess.region_row_ranges), so the masked tiles are compiled
    # without the row path that ``bwd_exact`` False selects: less code and, for residual
    # masks, no stack (the dilated window, D 128: 16 B of stack and 9 local loads / stores
    # in the masked tile loop -> 0; 1413 -> 794 static instructions per masked tile copy).
    exact_columns: bool = False
    # The caller's head dims (D, Dv) where narrower than (head_dim, dv): q / k / dk at D, v /
    # do / dv at Dv, read by TMA boxes of the kernel's width (zero-filled past D / Dv) and
    # dK / dV stored by TMA boxes that drop the columns past them (ForwardKey.io_head_dims;
    # needs config.dkv_tma_store). dQ's float32 accumulator stays at the kernel's width.
    io_head_dims: tuple | None = None

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"cute backward supports {_DTYPES}, got dtype {self.dtype!r}")
        _check_io_head_dims("BackwardKey", self.io_head_dims, self.head_dim, self.dv)
        if self.io_head_dims is not None and not self.config.dkv_tma_store:
            raise ValueError("BackwardKey(io_head_dims=...) stores dK / dV by TMA (columns past "
                             "the caller's head dims dropped): needs config.dkv_tma_store")
        if self.exact_columns and self.num_bwd_intervals == 0:
            raise ValueError("exact_columns needs a column view (num_bwd_intervals > 0)")
        if self.residual is not None:
            f, b = self.residual
            if (f.view, b.view) != ("fwd", "bwd") or len(f.slots) != self.num_intervals \
                    or len(b.slots) != self.num_bwd_intervals or f.params != b.params:
                raise ValueError(f"residual programs {self.residual!r} do not fit K="
                                 f"{self.num_intervals}, Kc={self.num_bwd_intervals}")
        if self.head_dim_v is not None and self.head_dim_v != self.head_dim:
            if (self.head_dim, self.head_dim_v) not in BWD_HEAD_DIM_PAIRS:
                raise ValueError(f"cute backward head dims {self.head_dim}/{self.head_dim_v}: Dv != D "
                                 f"only as {BWD_HEAD_DIM_PAIRS}")
            if not ((self.config.split_dkv or self.config.dkv_swap) and self.config.dkv_tma_store):
                raise ValueError("Dv != D needs BackwardConfig(split_dkv=True, dkv_tma_store=True) "
                                 "or dkv_swap=True; use preferred_backward_config(D)")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap must be None or a positive finite float, got {self.softcap!r}")
        dims = BWD_HEAD_DIMS + BWD_NATIVE_HEAD_DIMS
        if self.head_dim not in dims and self.dv == self.head_dim:
            raise ValueError(f"cute backward is built for head dims {dims} (Dv == D), "
                             f"got {self.head_dim}; the xla backward serves the others")
        if self.head_dim == 256 and not self.config.split_dkv:
            raise ValueError("cute backward at head dim 256 needs BackwardConfig(split_dkv=True, "
                             "block_kv=64): dK + dV of 64 keys x 256 do not fit in registers; "
                             "use preferred_backward_config(256)")
        if self.config.block_q == BWD_TILES_WIDE[0] and (
                (self.head_dim, self.dv) != (64, 64) or self.softcap is not None):
            raise ValueError(f"cute backward 128-query tiles (block_q=128) run at head dim 64 "
                             f"without a soft cap only (S^T + dP^T + dK + dV: 192 of the 240 "
                             f"registers there; a cap's P^T copy makes ptxas serialize the "
                             f"wgmmas and spill), got D {self.head_dim}/{self.dv}, softcap="
                             f"{self.softcap}; use block_q=64")
        c = self.config
        if c.dkv_swap and (self.head_dim, self.dv) != (192, 128):
            raise ValueError(f"dkv_swap runs head dims 192 / 128, got {self.head_dim}/{self.dv}; "
                             f"use preferred_backward_config(D) (dkv_swap=0) here")
        if self.softcap is not None and c.dv_split and (
                c.split_sdp or c.dv_early or c.p_early or c.ds_first or c.block_q != BWD_TILES[0]):
            raise ValueError("dv_split issues dV from P^T's registers piece by piece as the soft "
                             "cap's probabilities are made: it excludes split_sdp (P^T from shared "
                             "memory; head dims 256 and 192) and dv_early / p_early / ds_first "
                             "(other dV placements); set dv_split=0 for this config")
        if self.num_intervals < 1 or self.num_bwd_intervals < 0:
            raise ValueError(f"interval counts K={self.num_intervals} (>= 1), "
                             f"Kc={self.num_bwd_intervals} (>= 0) out of range")
        smem = backward_smem_bytes(self.head_dim, self.config, head_dim_v=self.dv)
        if smem > _SMEM_LIMIT:
            raise ValueError(f"{self.config} needs {smem} bytes of shared memory at head dim "
                             f"{self.head_dim} (SM90 allows {_SMEM_LIMIT})")

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def target_name(self) -> str:
        scale_bits = np.float64(self.scale).view(np.uint64)
        dims = f"{self.head_dim}" + ("" if self.dv == self.head_dim else f"x{self.dv}")
        return (f"jcompilemask_cute_bwd_{self.dtype}_d{dims}_k{self.num_intervals}"
                f"c{self.num_bwd_intervals}_b{int(self.broadcast_batch)}h{int(self.broadcast_head)}"
                f"_{self.config.tag}_{scale_bits:016x}"
                + ("" if self.softcap is None else f"_c{np.float64(self.softcap).view(np.uint64):016x}")
                + ("" if self.residual is None else f"_r{self.residual[0].tag}{self.residual[1].tag}")
                + ("_xc" if self.exact_columns else "") + _io_suffix(self.io_head_dims))


def dq_warpgroups(head_dim: int, num_consumer_wgs: int = 2, block_q: int = BWD_TILES[0]) -> int:
    """Consumer warpgroups that compute dQ. With 64-query tiles they split D when each half
    is a whole 128B-swizzle row (64 elements of 16 bits) of K's buffer, or (D 96) three
    32B-swizzle rows of 16 (FlashBackwardSm90.qk_sw32; alone, the first warpgroup's 64 x 96
    dQ beside its dK / dV made ptxas serialize the wgmmas: 64 WARPGROUP syncs a tile), else the first does
    it alone (D = 64: a 32-column half would not be a canonical wgmma layout); with
    128-query tiles (``dq_splits_queries``) each takes 64 of the queries, all of D."""
    if dq_splits_queries(block_q, num_consumer_wgs):
        return num_consumer_wgs
    return num_consumer_wgs if head_dim // num_consumer_wgs >= 48 else 1


def stats_shfl_query(i: int, lane):
    """``BackwardConfig.stats_shfl``: the query of the tile whose lse / delta is value i
    (0 .. block_q / 32 - 1) of lane ``lane``: 2 of every 64 queries, 64 (i // 2) + 2 lane + i % 2."""
    return 64 * (i // 2) + 2 * lane + i % 2


def stats_shfl_source(c: int) -> tuple[int, int]:
    """``stats_shfl``: (lane base, value index) holding accumulator column c's lse / delta:
    the query of column c in the m64nN accumulator, 8 (c // 2) + 2 (lane % 4) + c % 2, is
    value ``index`` of lane ``base + lane % 4``.

    >>> [stats_shfl_source(c) for c in (0, 1, 2, 15, 16, 31)]
    [(0, 0), (0, 1), (4, 0), (28, 1), (0, 2), (28, 3)]
    """
    return 4 * (c // 2 % 8), 2 * (c // 16) + c % 2


def dq_splits_queries(block_q: int, num_consumer_wgs: int = 2) -> bool:
    """Whether the dQ warpgroups split the tile's queries (one m64 wgmma row block each:
    ``block_q`` = 64 x warpgroups) rather than D."""
    return block_q == 64 * num_consumer_wgs


def compile_backward(key: BackwardKey):
    """Compile (once per key) the TVM-FFI function of the backward kernel (no GPU needed
    with CUTE_DSL_ARCH=sm_90a)."""
    with _lock:
        if key in _compiled:
            return _compiled[key]
        cutlass, cute, dtype, sym, sym64 = _dsl(key.dtype)
        from .backward import FlashBackwardSm90

        cfg = key.config
        b, nq, nk, hq, hkv = sym(), sym(), sym(), sym(), sym()
        d = key.head_dim

        def bshd(el, seqlen, heads, align=16, div=8, dim=d):
            return cute.runtime.make_fake_tensor(
                el, (b, seqlen, heads, dim),
                stride=(sym64(divisibility=div), sym64(divisibility=div), dim, 1), assumed_align=align)

        bm = 1 if key.broadcast_batch else b
        hm = 1 if key.broadcast_head else hq
        kc = max(key.num_bwd_intervals, 1)
        fwd_iv = cute.runtime.make_fake_tensor(
            cutlass.Int32, (bm, hm, nq, key.num_intervals, 2),
            stride=(sym64(), sym64(), 2 * key.num_intervals, 2, 1), assumed_align=4)
        bwd_iv = cute.runtime.make_fake_tensor(
            cutlass.Int32, (bm, hm, nk, kc, 2), stride=(sym64(), sym64(), 2 * kc, 2, 1),
            assumed_align=4)
        tiles = cute.runtime.make_fake_tensor(
            cutlass.Uint32, (bm, hm, sym(), sym()), stride=(sym64(), sym64(), sym64(), 1),
            assumed_align=4)
        exact = cute.runtime.make_fake_tensor(cutlass.Int32, (bm,), stride=(1,), assumed_align=4)
        # lse2 / delta padded to whole query tiles: TMA boxes, 16-byte strides.
        nq_pad = sym()
        rows = lambda: cute.runtime.make_fake_tensor(  # noqa: E731
            cutlass.Float32, (b, hq, nq_pad), stride=(sym64(divisibility=cfg.block_q),
                                                      sym64(divisibility=cfg.block_q), 1),
            assumed_align=16)
        kernel = FlashBackwardSm90(
            dtype, d, key.num_intervals, key.num_bwd_intervals, key.scale, cfg,
            broadcast_batch=key.broadcast_batch, broadcast_head=key.broadcast_head,
            softcap=key.softcap, head_dim_v=key.dv, residual=key.residual,
            exact_columns=key.exact_columns)
        # [B, Hq, Tq, block_q * D]: one contiguous slot per query tile (fragment order).
        tile = cfg.block_q * d
        dq_acc = lambda: cute.runtime.make_fake_tensor(  # noqa: E731
            cutlass.Float32, (b, hq, sym(), tile), stride=(sym64(divisibility=tile),
                                                            sym64(divisibility=tile), tile, 1),
            assumed_align=16)
        rank = cute.runtime.make_fake_tensor(
            cutlass.Int32, (bm, hm, sym(), sym()), stride=(sym64(), sym64(), sym64(), 1), assumed_align=4)
        sem = lambda: cute.runtime.make_fake_tensor(  # noqa: E731
            cutlass.Int32, (sym(), sym(), sym()), stride=(sym64(), sym64(), 1), assumed_align=4)
        # q / k / dk at the caller's D, v / do / dv at its Dv (io_head_dims: TMA zero-fills
        # the kernel's columns past them and drops dK / dV's on store).
        d_io, dv_io = key.io_head_dims or (d, key.dv)
        args = [bshd(dtype, nq, hq, dim=d_io), bshd(dtype, nk, hkv, dim=d_io),
                bshd(dtype, nk, hkv, dim=dv_io), bshd(dtype, nq, hq, dim=dv_io),
                rows(), rows(), bwd_iv, tiles, fwd_iv, exact, rank, dq_acc(), sem()]
        entry = kernel
        if key.residual is not None:
            # The rows' regions [Bm, Nq] and the residual parameter table [Bm, max(W, 1)]
            # (operands: before the results, as the FFI passes them).
            entry = kernel.with_residual
            args += [cute.runtime.make_fake_tensor(cutlass.Int32, (bm, nq), stride=(sym64(), 1),
                                                   assumed_align=4),
                     cute.runtime.make_fake_tensor(cutlass.Int32, (bm, max(key.residual[0].width, 1)),
                                                   stride=(sym64(), 1), assumed_align=4)]
        if cfg.schedule:
            # The work-unit order int32 [B * Hkv * Tk], or with persistent CTAs their table
            # [P, 1 + J] (persistent_schedule); an operand, after the residual's.
            entry = kernel.with_residual_schedule if key.residual is not None else kernel.with_schedule
            shape, stride = ((sym(), sym()), (sym64(), 1)) if cfg.persistent else ((sym(),), (1,))
            args.append(cute.runtime.make_fake_tensor(cutlass.Int32, shape, stride=stride, assumed_align=4))
        args += [dq_acc(), sem(), bshd(dtype, nk, hkv, dim=d_io), bshd(dtype, nk, hkv, dim=dv_io)]
        fn = cute.compile(
            entry, *args,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=_options(),
        )
        _compiled[key] = fn
        return fn


def dq_fragment_unpermute(acc, nq: int, head_dim: int, block_q: int = BWD_TILES[0],
                          blocked: bool = False):
    """[B, Hq, Tq, block_q * D] dQ accumulator slots -> [B, Nq, Hq, D].

    Each query tile's slot holds, per dQ warpgroup w (``dq_warpgroups``), its
    block_q x (D / W) accumulator in the order the registers leave the threads: float4
    chunk g (columns 8g..8g+7 of the warpgroup's part), thread t = 32 * warp + 4 * lq + lr,
    then (row half h, column pair p). The element is row 16 * warp + 8 * h + lq,
    column w * D / W + 8 g + 2 lr + p — the SM90 wgmma accumulator layout (m64nNk16).
    With 128-query tiles (``dq_splits_queries``) warpgroup w holds rows 64 w .. 64 w + 63
    and all of D: the element is row 64 w + 16 * warp + 8 * h + lq, column 8 g + 2 lr + p.
    With ``blocked`` (``BackwardConfig.dq_blocked``) the slot is (column block of 8, row,
    column within the block): D / 8 blocks of block_q x 8 floats.

    >>> import numpy as np
    >>> dq = np.arange(2 * 64 * 1 * 64, dtype=np.float32).reshape(2, 64, 1, 64)
    >>> slots = dq.reshape(2, 1, 64, 1, 8, 8).transpose(0, 3, 1, 4, 2, 5).reshape(2, 1, 1, -1)
    >>> bool((np.asarray(dq_fragment_unpermute(slots, 64, 64, blocked=True)) == dq).all())
    True
    """
    b, hq, tq, slot = acc.shape
    if blocked:
        assert block_q == 64, "dq_blocked: 64-row blocks"
        x = acc.reshape(b, hq, tq, head_dim // 8, block_q, 8)
        x = jnp.transpose(x, (0, 2, 4, 1, 3, 5))            # b tq row | hq block 8
        return x.reshape(b, tq * block_q, hq, head_dim)[:, :nq]
    w = dq_warpgroups(head_dim, block_q=block_q)
    if dq_splits_queries(block_q):
        x = acc.reshape(b, hq, tq, w, head_dim // 8, 4, 8, 4, 2, 2)     # w g warp lq lr h p
        x = jnp.transpose(x, (0, 2, 3, 5, 8, 6, 1, 4, 7, 9))             # b tq w warp h lq | hq g lr p
        return x.reshape(b, tq * block_q, hq, head_dim)[:, :nq]
    assert block_q == 64, "the fragment order is that of one m64 wgmma per warpgroup"
    g = head_dim // w // 8
    x = acc.reshape(b, hq, tq, w, g, 4, 8, 4, 2, 2)      # w g warp lq lr h p
    x = jnp.transpose(x, (0, 2, 5, 8, 6, 1, 3, 4, 7, 9))  # b tq warp h lq | hq w g lr p
    return x.reshape(b, tq * block_q, hq, head_dim)[:, :nq]


def dq_turns(bwd_tiles, num_q_tiles: int):
    """int32 [Bm, Hm, Tk, Tq]: for each (key tile, query tile), how many lower key tiles
    visit that query tile (compute bit set in the column-major tile states) — the turn of
    the key tile's dQ add in deterministic mode."""
    bm, hm, tk, words = bwd_tiles.shape
    shifts = (2 * jnp.arange(16, dtype=jnp.uint32)).reshape(1, 1, 1, 1, 16)
    bits = (bwd_tiles.astype(jnp.uint32)[..., None] >> shifts) & jnp.uint32(1)
    visits = bits.reshape(bm, hm, tk, words * 16)[..., :num_q_tiles].astype(jnp.int32)
    return jnp.cumsum(visits, axis=2) - visits


BWD_ORDER_ENV = "JCOMPILEMASK_CUTE_BWD_ORDER"
# ``$JCOMPILEMASK_CUTE_BWD_EXACT_COLUMNS`` (read at trace time): 1 / 0 force cute_backward to
# honour / ignore ``exact_columns`` (BackwardKey.exact_columns). Unset: honoured at D 128
# without a soft cap, the configuration it was timed on (one-region masks' masked tiles
# without the row path; bwd ms at 8K, run 2026-12-04T05:36:54Z: dilated window 1.535 ->
# 1.481, global + window 2.274 -> 2.238, causal 10.389 -> 10.413, i.e. level); the other
# head dims and the soft cap keep the row path until they are timed with it.
BWD_EXACT_COLUMNS_ENV = "JCOMPILEMASK_CUTE_BWD_EXACT_COLUMNS"
BWD_ORDER_POLICIES = ("hoist", "group", "global", "tail", "auto")


def _bwd_d128_config(head_dim: int, head_dim_v: int) -> bool:
    """Whether the backward runs D 128's config at these head dims: D 128 itself, or a
    BWD_NATIVE_HEAD_DIMS dim with Dv == D (the same config on narrower rows), so that D 128's
    validated defaults (exact columns, the static order) apply.

    >>> _bwd_d128_config(128, 128), _bwd_d128_config(96, 96), _bwd_d128_config(80, 80)
    (True, True, False)
    """
    return head_dim == head_dim_v and head_dim in (128,) + BWD_NATIVE_HEAD_DIMS


def _bwd_exact_columns(head_dim: int, head_dim_v: int, softcap) -> bool:
    """Whether cute_backward honours a mask's ``exact_columns`` promise for this kernel:
    ``$JCOMPILEMASK_CUTE_BWD_EXACT_COLUMNS`` =1 / =0, else on at D 128 without a soft cap
    (and at BWD_NATIVE_HEAD_DIMS, D 128's config on narrower rows).

    >>> _bwd_exact_columns(128, 128, None), _bwd_exact_columns(64, 64, None)
    (True, False)
    """
    default = "1" if _bwd_d128_config(head_dim, head_dim_v) and softcap is None else "0"
    return _env_flag(BWD_EXACT_COLUMNS_ENV, default)
# A block's fixed cost in visited-tile units (the "tail" policy's weights): ~5 us of setup,
# K / V load and dK / dV store against ~2.4 us a tile (causal 8K, H200).
BWD_BLOCK_COST_TILES = 2


def _bwd_order_policy() -> str:
    """``$JCOMPILEMASK_CUTE_BWD_ORDER`` (read at trace time): ``backward_schedule``'s policy
    under ``BackwardConfig.schedule``; ``hoist`` when unset."""
    import os
    policy = os.environ.get(BWD_ORDER_ENV, "").strip() or "hoist"
    if policy not in BWD_ORDER_POLICIES:
        raise ValueError(f"{BWD_ORDER_ENV}={policy!r}: choose one of {BWD_ORDER_POLICIES}")
    return policy


def _popcount_visited(tiles, xp):
    """Visited tiles per row of 2-bit tile states (bit 0 of each pair): int32 [..., rows]."""
    x = tiles.astype(xp.uint32) & xp.uint32(0x55555555)
    x = (x & xp.uint32(0x33333333)) + ((x >> xp.uint32(2)) & xp.uint32(0x33333333))
    x = (x + (x >> xp.uint32(4))) & xp.uint32(0x0F0F0F0F)
    x = (x * xp.uint32(0x01010101)) >> xp.uint32(24)
    return x.astype(xp.int32).sum(axis=-1, dtype=xp.int32)


def _unit_counts(bwd_tiles, batch: int, num_heads: int, num_kv_heads: int, xp):
    """Visited query tiles per work unit (one key column of a KV head, its query heads
    summed): int32 [batch * num_kv_heads * Tk], in the default grid's order."""
    Tk = bwd_tiles.shape[2]
    group_size = num_heads // num_kv_heads
    counts = xp.broadcast_to(_popcount_visited(bwd_tiles, xp), (batch, num_heads, Tk))
    return counts.reshape(batch, num_kv_heads, group_size, Tk).sum(axis=2, dtype=xp.int32).reshape(-1)


def _late_units(counts, ctas: int, xp):
    """``tail``'s rule: a unit started in the grid's order once the work before it is
    spread over the CTAs ends weight * (ctas - 1) / ctas - after / ctas past that work's
    even finish; it is late (moves first) when that overshoot exceeds the mean unit's
    weight (a unit weighs its tiles + ``BWD_BLOCK_COST_TILES``)."""
    weight = counts + BWD_BLOCK_COST_TILES
    total = weight.sum(dtype=xp.int32)
    after = total - xp.cumsum(weight, dtype=xp.int32)
    return weight * (ctas - 1) - after > (ctas * total) // weight.shape[0]


def backward_schedule_moves(bwd_tiles, batch: int, num_heads: int, num_kv_heads: int, *,
                            num_ctas: int | None = None, xp=jnp):
    """Whether ``tail``'s order (``auto``'s) moves any unit of this descriptor: a bool
    scalar (traced inside ``cute_backward``). No sort: a popcount, a cumulative sum and
    a comparison per unit.

    >>> import numpy as np
    >>> causal = np.array([[[[0x15], [0x14], [0x10]]]], np.uint32)
    >>> bool(backward_schedule_moves(causal, 2, 1, 1, num_ctas=2, xp=np))
    False
    >>> late_column = np.array([[[[0x1], [0x1], [0x1], [0x5555]]]], np.uint32)
    >>> bool(backward_schedule_moves(late_column, 1, 1, 1, num_ctas=4, xp=np))
    True
    """
    ctas = max(1, int(num_ctas if num_ctas is not None else num_sms()))
    return xp.any(_late_units(_unit_counts(bwd_tiles, batch, num_heads, num_kv_heads, xp), ctas, xp))


def backward_schedule(bwd_tiles, batch: int, num_heads: int, num_kv_heads: int,
                      heads_per_group: int, *, num_ctas: int | None = None,
                      policy: str = "hoist", xp=jnp):
    """The order in which the backward's 1-D grid (``BackwardConfig.schedule``) runs its
    work units, ``unit = (b * Hkv + kv_head) * Tk + k_tile`` (one key column of a KV head,
    all its query heads): int32 [B * Hkv * Tk], a permutation.

    A unit's weight is its visited query tiles, summed over the KV head's query heads
    (from ``bwd_tiles``, uint32 [Bm, Hm, Tk, W], 2 state bits per tile, bit 0 = visited),
    so the order serves any mask. ``policy``:

    - ``group``: units grouped by ``heads_per_group`` consecutive (batch, kv head) pairs
      (their Q / dO stay in L2 while the group runs), heaviest first inside a group;
    - ``global``: heaviest first over all units;
    - ``hoist`` (default): ``group``, except that units heavier than their group's work
      per CTA (group total / ``num_ctas``, the SM count by default) go first of all,
      heaviest first: a column no group could hide (16 global keys seen by every query)
      starts at once instead of with its group.
    - ``tail``: the default grid's order, except for the units that would end well after
      the rest of the grid (started once the work before them is spread evenly, a unit
      weighing its tiles + ``BWD_BLOCK_COST_TILES``, it overshoots that work's even
      finish by more than a mean unit): those go first, heaviest first. The others keep
      the grid's order and its L2 locality.
    - ``auto``: ``tail``'s order; ``cute_backward`` then runs the scheduled kernel only
      for descriptors where that order moves a unit (``backward_schedule_moves``), and
      the default grid's kernel otherwise (both compiled, ``lax.cond`` picks at run time;
      under ``jax.vmap`` over the descriptor the cond becomes a select and both run).

    Ties keep the launch order of the default grid. ``xp``: ``jax.numpy`` (traced, inside
    ``cute_backward``) or ``numpy`` (tests).

    >>> import numpy as np
    >>> tiles = np.array([[[[0x15], [0x14], [0x10]]]], np.uint32)   # causal: 3, 2, 1 visited
    >>> backward_schedule(tiles, 2, 1, 1, 1, num_ctas=2, policy="group", xp=np).tolist()
    [0, 1, 2, 3, 4, 5]
    >>> tiles = np.array([[[[0x55], [0x1], [0x1], [0x1]]]], np.uint32)  # column 0 seen by all
    >>> backward_schedule(tiles, 2, 1, 1, 1, num_ctas=2, policy="hoist", xp=np).tolist()
    [0, 4, 1, 2, 3, 5, 6, 7]
    """
    if policy not in BWD_ORDER_POLICIES:
        raise ValueError(f"policy={policy!r}: choose one of {BWD_ORDER_POLICIES}")
    Tk = bwd_tiles.shape[2]
    counts = _unit_counts(bwd_tiles, batch, num_heads, num_kv_heads, xp)
    unit = xp.arange(batch * num_kv_heads * Tk, dtype=xp.int32)
    pair = unit // Tk                                       # b * Hkv + kv head
    if policy == "global":
        return xp.lexsort((unit, -counts)).astype(xp.int32)
    ctas = max(1, int(num_ctas if num_ctas is not None else num_sms()))
    if policy in ("tail", "auto"):
        late = _late_units(counts, ctas, xp)
        return xp.lexsort((unit, xp.where(late, -counts, 0), xp.where(late, 0, 1))).astype(xp.int32)
    grp = pair // max(1, int(heads_per_group))
    if policy == "group":
        return xp.lexsort((unit, -counts, grp)).astype(xp.int32)
    n_groups = -(-(batch * num_kv_heads) // max(1, int(heads_per_group)))
    totals = xp.zeros((n_groups,), xp.int32).at[grp].add(counts) if xp is jnp \
        else np.bincount(grp, weights=counts, minlength=n_groups).astype(np.int32)
    per_cta = totals[grp] // ctas
    first = xp.where(counts > per_cta, -1, grp)
    return xp.lexsort((unit, -counts, first)).astype(xp.int32)


def replay_makespan(weights, order, num_ctas: int) -> int:
    """When the last unit of a greedy in-order launch ends: units ``order[0], order[1], ...``
    each start on the CTA slot that frees first and hold it ``weights[u]`` (any unit: a
    visited tile or a block's fixed cost). The hardware's dispatch, replayed: at 32K it
    reproduced the grid-order kernels within ~3% (NOTES.md, session 21).

    >>> replay_makespan([4, 1, 1, 1, 1], [1, 2, 3, 4, 0], 2), replay_makespan([4, 1, 1, 1, 1], range(5), 2)
    (6, 4)
    """
    import heapq
    free = [0] * max(1, int(num_ctas))
    end = 0
    for u in order:
        t = heapq.heappop(free) + int(weights[u])
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def backward_static_order(bwd_tiles, batch: int, num_heads: int, num_kv_heads: int,
                          heads_per_group: int, *, num_ctas: int | None = None,
                          min_gain: float = 0.05):
    """The host order (``backward_schedule``'s ``hoist``) for a backward whose tile states
    are known while tracing (a mask without metadata: one descriptor for every batch), or
    None where the grid's order serves: numpy int32 [batch * num_kv_heads * Tk].

    Both orders are replayed (``replay_makespan``; a unit weighs its visited query tiles +
    ``BWD_BLOCK_COST_TILES``) on ``num_ctas`` CTAs (the SM count by default); the order is
    returned when it ends at least ``min_gain`` before the grid. Why 5%: every mask where
    a host order was measured slower replays within 2% of the grid (causal / shared prompt
    8K: hoist replays -0.9 / -1.5%, measured +0.2 / +2.7%; the dilated window: replay 0%,
    measured +3.9%, the unit read each block waits on), and every mask it helped replays
    past 5% (16 global keys + window 256: hoist replays -15% / -41% at 8K / 32K, measured
    -3.7% / -29%; CLEAR 32K: replay -18%, measured -17.5%; runs 2026-12-04T03:09:19Z,
    03:18:22Z, 03:32:08Z, NOTES.md session 21).

    >>> import numpy as np
    >>> causal = np.array([[[[0x5555], [0x5554], [0x5550], [0x5540]]]], np.uint32)
    >>> backward_static_order(causal, 8, 1, 1, 1, num_ctas=4) is None
    True
    >>> late = np.zeros((1, 1, 4, 1), np.uint32); late[..., 0, 0] = 0x5555; late[..., 1:, 0] = 0x1
    >>> order = backward_static_order(late, 8, 1, 1, 8, num_ctas=8)
    >>> sorted(order.tolist()) == list(range(32)), order[:8].tolist()
    (True, [0, 4, 8, 12, 16, 20, 24, 28])
    """
    tiles = np.asarray(bwd_tiles)
    counts = _unit_counts(tiles, batch, num_heads, num_kv_heads, np)
    ctas = max(1, int(num_ctas if num_ctas is not None else num_sms()))
    weights = counts + BWD_BLOCK_COST_TILES
    grid = replay_makespan(weights, range(weights.shape[0]), ctas)
    order = backward_schedule(tiles, batch, num_heads, num_kv_heads, heads_per_group,
                              num_ctas=ctas, policy="hoist", xp=np)
    if replay_makespan(weights, order, ctas) > grid * (1.0 - min_gain):
        return None
    return order.astype(np.int32)


def _bwd_static_order_on(head_dim: int, head_dim_v: int, softcap) -> bool:
    """Whether ``cute_backward`` may run a trace-time host order (``backward_static_order``)
    for tile states known while tracing: on by default at D 128 without a soft cap, the
    configuration it was validated and timed on (and at BWD_NATIVE_HEAD_DIMS, D 128's config
    on narrower rows); ``$JCOMPILEMASK_CUTE_BWD_STATIC_ORDER=1`` /
    ``0`` turns it on / off everywhere.

    Session 36 (H100, run 2026-12-05T23:42:56Z, ``h200.sh masks16``; the GPU test
    ``test_static_order_gives_the_default_gradients`` passed in the same call): 16 global
    keys + a 256 window, bwd ms 2.604 -> 2.431 at 8K and 3.320 -> 2.453 at 32K; the
    dilated window keeps the grid (its replay gains nothing): 1.702 / 1.727 both ways.

    >>> _bwd_static_order_on(128, 128, None), _bwd_static_order_on(128, 128, 30.0)
    (True, False)
    >>> _bwd_static_order_on(64, 64, None)
    False
    """
    measured = "1" if _bwd_d128_config(head_dim, head_dim_v) and softcap is None else "0"
    return _env_flag("JCOMPILEMASK_CUTE_BWD_STATIC_ORDER", measured)


def cute_backward(q, k, v, out, lse, do, bwd_intervals, bwd_tiles, fwd_intervals, bwd_exact, *,
                  scale=None, dlse=None, block_q=BWD_TILES[0], block_kv=BWD_TILES[1],
                  deterministic=False, softcap=None, residual=None, row_region=None,
                  residual_params=None, exact_columns=False, static_bwd_tiles=None,
                  kernel_head_dims=None):
    """Masked attention backward on SM90 from an Execution Descriptor's column view.

    Args:
      q, k, v, out, do: as in the forward ([B, N, H, D], bf16 or fp16, Dv == D).
      lse: float32 [B, Hq, Nq] from the forward (natural log, -inf for empty rows).
      bwd_intervals: int32 [Bm, Hm, Nk, Kc, 2]; bwd_tiles: uint32 [Bm, Hm, Tk', ceil16(Tq')]
        at ``block_q`` x ``block_kv`` backward tiles; fwd_intervals: int32 [Bm, Hm, Nq, K, 2]
        (checked instead of the column view for sequences where ``bwd_exact`` is False).
      dlse: optional cotangent of lse [B, Hq, Nq].
      deterministic: add dQ contributions in a fixed order (``BackwardConfig.deterministic``).
      softcap: the forward's soft cap (None: none); P is recomputed from the capped logits.
      residual: the (forward, column) ``ResidualProgram`` pair of a residual mask
        (``ResidualProgram.pair``), with ``row_region`` int32 [Bm, Nq] and
        ``residual_params`` int32 [Bm, max(W, 1)], as for ``cute_forward``.
      exact_columns: the caller guarantees ``bwd_exact`` is True for every sequence
        (``CompiledMask.column_view_exact``): the kernel is compiled without the row path
        and ignores ``bwd_exact`` (``BackwardKey.exact_columns``) at D 128 without a soft
        cap, or wherever ``$JCOMPILEMASK_CUTE_BWD_EXACT_COLUMNS=1`` (``=0``: never).
      static_bwd_tiles: ``bwd_tiles``' values where they are known while tracing (numpy;
        a mask without metadata, whose descriptor is the same for every batch): the key
        columns then run in ``backward_static_order``'s host order where its replay ends
        5% before the grid's (long columns, such as 16 global keys', start first), a
        constant of the program: no ``lax.cond`` and no sort at run time. Elsewhere, and
        where ``_bwd_static_order_on`` is off (other than D 128 without a cap, unless
        set), the grid. The order changes when each
        column runs, not what it computes: dK / dV are bit-identical, dQ's float sums
        may be added in another order (as under ``BackwardConfig.schedule``).
      kernel_head_dims: None, or a built pair (D', Dv') at least as wide as (D, Dv), both
        multiples of 8: the kernel of (D', Dv') runs on the arrays as they are (TMA loads
        zero-fill the columns past D / Dv, dK / dV's stores drop them; dQ is cut from the
        accumulator), as ``cute_forward``'s; the default scale stays 1/sqrt(D).
    Returns (dq, dk, dv) in the input dtype.

    (D, Dv) = (192, 128): v, out, do and dv are [.., 128] (``BWD_HEAD_DIM_PAIRS``).
    """
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    if k.dtype != q.dtype or v.dtype != q.dtype or do.dtype != q.dtype:
        raise TypeError(f"q, k, v, do must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
                        f"{do.dtype}")
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or Hq % Hkv or k.shape[3] != D:
        raise ValueError(f"incompatible shapes q{q.shape} k{k.shape} v{v.shape}")
    Dv = v.shape[-1]
    if out.shape != q.shape[:3] + (Dv,) or do.shape != out.shape:
        raise ValueError(f"cute backward needs out / do shaped [B, Nq, Hq, Dv]; got q{q.shape} "
                         f"v{v.shape} out{out.shape} do{do.shape}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    io = _io_head_dims("cute_backward", D, Dv, kernel_head_dims)
    D_io = D
    if io is not None:
        D, Dv = kernel_head_dims
    if Dv != D and (D, Dv) not in BWD_HEAD_DIM_PAIRS:
        raise ValueError(f"cute backward needs Dv == D or (D, Dv) in {BWD_HEAD_DIM_PAIRS}; got "
                         f"{D}/{Dv}")
    Bm, Hm, _, K, _ = fwd_intervals.shape
    Kc = bwd_intervals.shape[3]
    Tq, Tk = -(-Nq // block_q), -(-Nk // block_kv)
    if bwd_tiles.shape != (Bm, Hm, Tk, -(-Tq // 16)):
        raise ValueError(f"bwd_tiles shape {bwd_tiles.shape} does not match {block_q}x{block_kv} "
                         f"backward tiles of Nq={Nq}, Nk={Nk}")
    dtype_name = jnp.dtype(q.dtype).name
    config = backward_config(D, dtype_name, softcap is not None, block_q, block_kv,
                             deterministic, Tq)
    if io is not None and not config.dkv_tma_store:
        # dK / dV leave by element stores in this config (an override of the default): run
        # it on zero-padded copies instead, which is exact too.
        from ...attention.xla import _pad_to
        dq, dk, dv = cute_backward(
            _pad_to(q, -1, D), _pad_to(k, -1, D), _pad_to(v, -1, Dv), _pad_to(out, -1, Dv),
            lse, _pad_to(do, -1, Dv), bwd_intervals,
            bwd_tiles, fwd_intervals, bwd_exact, scale=scale, dlse=dlse, block_q=block_q,
            block_kv=block_kv, deterministic=deterministic, softcap=softcap, residual=residual,
            row_region=row_region, residual_params=residual_params, exact_columns=exact_columns,
            static_bwd_tiles=static_bwd_tiles)
        return dq[..., :D_io], dk[..., :D_io], dv[..., :io[1]]
    if config.heads_inner and Tk > 65535:
        raise ValueError(f"heads_inner puts the {Tk} key tiles of Nk={Nk} in the grid's y "
                         "dimension (at most 65535): unset heads_inner in "
                         "$JCOMPILEMASK_CUTE_BWD_CONFIG for keys this long")
    key = BackwardKey(
        dtype=dtype_name, head_dim=D, num_intervals=K, num_bwd_intervals=Kc,
        broadcast_batch=(Bm == 1), broadcast_head=(Hm == 1), scale=float(scale), config=config,
        softcap=None if softcap is None else float(softcap), head_dim_v=None if Dv == D else Dv,
        residual=None if residual is None or (residual[0].exact and residual[1].exact) else
        tuple(residual),
        exact_columns=bool(exact_columns) and Kc > 0 and _bwd_exact_columns(D, Dv, softcap),
        io_head_dims=io)
    extra = ()
    if key.residual is not None:
        want = ((Bm, Nq), (Bm, max(residual[0].width, 1)))
        if row_region is None or residual_params is None or \
                (row_region.shape, residual_params.shape) != want:
            raise ValueError(f"cute_backward with residual programs needs row_region / "
                             f"residual_params shaped {want}")
        extra = (row_region.astype(jnp.int32), residual_params.astype(jnp.int32))
    # Key columns per L2 group of the host orders (the trace-time one and the schedule's).
    l2_group = kv_heads_per_l2_group(Nq, D * (Hq // Hkv), Dv * (Hq // Hkv),
                                     jnp.dtype(q.dtype).itemsize)
    # A trace-time host order (static_bwd_tiles): only its scheduled kernel is built.
    static_order = None
    if (not config.schedule and static_bwd_tiles is not None and not config.deterministic
            and _bwd_static_order_on(D, Dv, softcap)
            and tuple(np.shape(static_bwd_tiles)) == tuple(bwd_tiles.shape)):
        static_order = backward_static_order(static_bwd_tiles, B, Hq, Hkv, l2_group)
    name = _ensure_registered(key if static_order is None else dataclasses.replace(
        key, config=dataclasses.replace(config, schedule=True, heads_inner=False)))
    f32 = jnp.float32
    acc_shape = (B, Hq, Tq, block_q * D)

    def stats():
        # (The preprocess kernel, an opt-in, is built for the kernel's own widths.)
        return backward_stats(out, do, lse, dlse, head_dim=D, block_q=block_q,
                              mode=_bwd_prep_mode() if io is None else None)

    if Kc == 0:      # no column view: a 1-slot empty table keeps the operand shapes valid
        bwd_intervals = jnp.zeros((Bm, Hm, Nk, 1, 2), jnp.int32)
    exact = jnp.broadcast_to(jnp.asarray(bwd_exact, jnp.int32).reshape(-1), (Bm,))
    if config.deterministic:
        turns, sem_shape = dq_turns(bwd_tiles, Tq), (B, Hq, Tq)
    else:   # unused by the kernel: minimal placeholders keep one signature
        turns, sem_shape = jnp.zeros((Bm, Hm, 1, 1), jnp.int32), (1, 1, 1)
    out_types = (
        jax.ShapeDtypeStruct(acc_shape, f32),
        jax.ShapeDtypeStruct(sem_shape, jnp.int32),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
    )
    # The dQ accumulator and the semaphores must start at zero: inputs aliased to outputs.
    # (Made in each branch that runs a kernel, so that a lax.cond's branch owns its buffer.)
    def run(kernel_name, inputs, order=()):
        call = jax.ffi.ffi_call(kernel_name, out_types, vmap_method="sequential",
                                input_output_aliases={11: 0, 12: 1})
        lse2, delta, acc = stats()
        operands = (*inputs[:4], lse2, delta, *inputs[4:9], acc,
                    jnp.zeros(sem_shape, jnp.int32), *inputs[9:], *order)
        return tuple(match_varying(call(*operands), *operands))

    inputs = (q, k, v, do, bwd_intervals.astype(jnp.int32), bwd_tiles.astype(jnp.uint32),
              fwd_intervals.astype(jnp.int32), exact, turns, *extra)
    def scheduled(inputs):
        order = backward_schedule(
            bwd_tiles, B, Hq, Hkv, l2_group,
            policy="tail" if config.persistent and policy == "auto" else policy)
        if config.persistent:
            # Persistent CTAs: the order dealt round by round to one CTA per SM.
            order = persistent_schedule(order, num_sms())
        return run(name, inputs, (order,))

    policy = _bwd_order_policy() if config.schedule else None
    if static_order is not None:
        dq_acc, _, dk, dv = run(name, inputs, (jnp.asarray(static_order),))
    elif policy is None:
        dq_acc, _, dk, dv = run(name, inputs)
    elif policy == "auto" and not config.persistent:
        # The scheduled kernel where tail's order moves a unit, the grid's kernel (the same
        # key without the schedule) where it would move none: no unit read, no sort.
        grid_name = _ensure_registered(dataclasses.replace(
            key, config=dataclasses.replace(config, schedule=False)))
        moves = backward_schedule_moves(bwd_tiles, B, Hq, Hkv)
        dq_acc, _, dk, dv = jax.lax.cond(moves, scheduled, lambda i: run(grid_name, i), inputs)
    else:
        dq_acc, _, dk, dv = scheduled(inputs)
    dq = backward_dq(dq_acc, Nq, D, block_q, backward_grad_scale(scale, softcap, config),
                     q.dtype, post=_bwd_post_on(), blocked=config.dq_blocked)
    return dq[..., :D_io], dk, dv


def backward_config(head_dim: int, dtype: str, softcap: bool, block_q: int, block_kv: int,
                    deterministic: bool = False, num_q_tiles: int = 1) -> BackwardConfig:
    """The config ``cute_backward`` compiles for a descriptor of these backward tiles:
    ``preferred_backward_config``, ``deterministic`` as asked (no host order then), the
    fields of ``$JCOMPILEMASK_CUTE_BWD_CONFIG`` over those, and the descriptor's tiles over
    everything (the data is laid out in them), validated once, whole; no work list for
    columns of more than LIST_MAX_TILES query tiles.

    >>> cfg = backward_config(128, "bfloat16", False, 64, 128, deterministic=True)
    >>> (cfg.block_q, cfg.deterministic, cfg.schedule)
    (64, True, False)
    """
    configs = _backward_configs(head_dim, dtype, softcap, deterministic)
    preferred = next((c for c in configs if (c.block_q, c.block_kv) == (block_q, block_kv)),
                     configs[0])
    config = _config_from_env(dataclasses.replace(
        preferred, deterministic=bool(deterministic),
        schedule=preferred.schedule and not deterministic), block_q=block_q, block_kv=block_kv)
    return _fit_list_to_length(config, num_q_tiles)


def backward_grad_scale(scale: float, softcap, config: BackwardConfig) -> float:
    """The factor on dQ (after the kernel) and dK (its epilogue, ``FlashBackwardSm90.grad_scale``):
    the softmax scale, times 4 where ``config.softcap_r`` leaves a quarter of the soft cap's
    gradient factor in dS^T.

    >>> backward_grad_scale(0.125, None, BackwardConfig(softcap_r=True))
    0.125
    >>> backward_grad_scale(0.125, 30.0, BackwardConfig(softcap_r=True))
    0.5
    """
    return float(scale) * (4.0 if softcap is not None and config.softcap_r else 1.0)


# ------------------------------------------------------------- the backward's preprocess
@dataclasses.dataclass(frozen=True)
class BackwardPrepKey:
    """What one compiled ``glue.BackwardPrep`` depends on: the element type of O / dO, the
    head dims (D sizes the dQ accumulator's slots, Dv the rows it reads), the backward's
    query tile, whether the lse has a cotangent, and whether it makes only the accumulator's
    zeros (``zero_only``).

    >>> BackwardPrepKey("bfloat16", 128, 128, 64, False).target_name
    'jcompilemask_cute_bwd_prep_bfloat16_d128x128_q64'
    """

    dtype: str
    head_dim: int
    head_dim_v: int
    block_q: int
    with_dlse: bool
    zero_only: bool = False

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"the backward preprocess supports {_DTYPES}, got {self.dtype!r}")
        if self.head_dim_v % 8 or self.head_dim % 8 or self.block_q not in (64, 128):
            raise ValueError(f"the backward preprocess needs head dims that are multiples of 8 "
                             f"and block_q 64 or 128, got D {self.head_dim}, Dv {self.head_dim_v}, "
                             f"block_q {self.block_q}")

    @property
    def target_name(self) -> str:
        return (f"jcompilemask_cute_bwd_prep_{self.dtype}_d{self.head_dim}x{self.head_dim_v}"
                f"_q{self.block_q}" + ("_dlse" if self.with_dlse else "")
                + ("_z" if self.zero_only else ""))


@functools.lru_cache(maxsize=1)
def _glue_fingerprint() -> str:
    """The glue kernels' (pre- and postprocess) own disk-cache fingerprint: the hash of
    :func:`_package_fingerprint` over ``kernels/cute/glue.py`` and what it imports from the
    package (nothing today), so neither they nor the attention kernels recompile for the
    other's edits."""
    return _sources_fingerprint(("kernels/cute/glue.py",))


def _bwd_prep_mode() -> str | None:
    """``$JCOMPILEMASK_CUTE_BWD_PREP``: how the CuTe backward makes lse2, delta and its zeroed
    dQ accumulator. ``0`` (the default: on an H100 the kernel was 1.1% slower, session 41):
    three XLA passes (None); ``1``: the preprocess kernel, one pass (``"fused"``); ``zero``:
    the kernel for the zeros alone, lse2 and delta from XLA (``"zero"``)."""
    import os
    v = os.environ.get("JCOMPILEMASK_CUTE_BWD_PREP", "").strip() or "0"
    modes = {"0": None, "1": "fused", "zero": "zero"}
    if v not in modes:
        raise ValueError(f"$JCOMPILEMASK_CUTE_BWD_PREP must be 0, 1 or zero, got {v!r}")
    return modes[v]


def backward_prep(out, do, lse, dlse=None, *, head_dim: int, block_q: int,
                  zero_only: bool = False):
    """The CuTe backward's statistics and dQ accumulator in one kernel (``glue.BackwardPrep``):
    ``(lse2, delta, dq_acc)``, the first two [B, Hq, Tq * block_q] float32 and the third
    [B, Hq, Tq, block_q * head_dim] float32 zeros, Tq = ceil(Nq / block_q).

    The same values as the XLA passes ``cute_backward`` otherwise runs: lse2 = lse / ln 2
    bit for bit (+inf where lse is -inf, and past Nq), delta = rowsum(dO * O) less ``dlse``
    where lse is finite (``attention.xla.softmax_delta``; the sum's order differs, so delta
    agrees to float32 rounding), 0 past Nq; non-finite O / dO propagate into delta. Needs
    the GPU (the ``cute`` backend); out / do [B, Nq, Hq, Dv] in bfloat16 or float16, lse /
    dlse [B, Hq, Nq]. ``zero_only``: the kernel writes the accumulator alone (the first two
    results are then unset: use the XLA passes' lse2 and delta).
    """
    B, Nq, Hq, Dv = out.shape
    if do.shape != out.shape or do.dtype != out.dtype:
        raise ValueError(f"backward_prep: do {do.shape} {do.dtype} must match out {out.shape} "
                         f"{out.dtype}")
    if lse.shape != (B, Hq, Nq) or (dlse is not None and dlse.shape != lse.shape):
        raise ValueError(f"backward_prep: lse / dlse must be shaped {(B, Hq, Nq)}, got "
                         f"{lse.shape} / {None if dlse is None else dlse.shape}")
    key = BackwardPrepKey(jnp.dtype(out.dtype).name, head_dim, Dv, block_q,
                          dlse is not None and not zero_only, zero_only)
    name = _ensure_registered(key)
    tq = -(-Nq // block_q)
    f32 = jnp.float32
    out_types = (jax.ShapeDtypeStruct((B, Hq, tq * block_q), f32),
                 jax.ShapeDtypeStruct((B, Hq, tq * block_q), f32),
                 jax.ShapeDtypeStruct((B, Hq, tq, block_q * head_dim), f32))
    lse = lse.astype(f32)
    operands = (out, do, lse, lse if dlse is None else dlse.astype(f32))
    call = jax.ffi.ffi_call(name, out_types, vmap_method="sequential")
    return tuple(match_varying(call(*operands), *operands))


@dataclasses.dataclass(frozen=True)
class BackwardPostKey:
    """What one compiled ``glue.BackwardPost`` depends on: dQ's dtype, D, the backward's
    query tile (with D, the slot's order: ``dq_warpgroups`` / ``dq_splits_queries``) and the
    factor on dQ (``backward_grad_scale``), baked in like the backward's own scale.

    >>> BackwardPostKey("bfloat16", 128, 64, 0.125).target_name
    'jcompilemask_cute_bwd_post_bfloat16_d128_q64_3fc0000000000000'
    """

    dtype: str
    head_dim: int
    block_q: int
    scale: float

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"the backward postprocess supports {_DTYPES}, got {self.dtype!r}")
        if (self.head_dim, self.block_q) not in ((64, 64), (64, 128), (128, 64), (192, 64),
                                                 (256, 64)):
            raise ValueError(f"the backward postprocess serves the backward's dQ tiles (D 64 at "
                             f"64 or 128 queries, D 128 / 192 / 256 at 64), got D "
                             f"{self.head_dim}, block_q {self.block_q}")

    @property
    def target_name(self) -> str:
        bits = np.float64(self.scale).view(np.uint64)
        return (f"jcompilemask_cute_bwd_post_{self.dtype}_d{self.head_dim}_q{self.block_q}"
                f"_{bits:016x}")


def _bwd_post_on() -> bool:
    """``$JCOMPILEMASK_CUTE_BWD_POST``: ``1`` converts the backward's dQ accumulator with the
    postprocess kernel (``glue.BackwardPost``) instead of XLA's fused un-permute / scale /
    cast pass; ``0`` (the default until it is timed on a GPU) keeps XLA's."""
    return _env_flag("JCOMPILEMASK_CUTE_BWD_POST", "0")


def backward_post(dq_acc, nq: int, head_dim: int, block_q: int, scale: float, dtype):
    """dQ [B, Nq, Hq, D] in ``dtype`` from the backward's float32 accumulator
    [B, Hq, Tq, block_q * D] (its non-blocked slot order), times ``scale``: the same values,
    bit for bit, as ``(dq_fragment_unpermute(dq_acc, nq, head_dim, block_q) *
    float32(scale)).astype(dtype)``, in one kernel (``glue.BackwardPost``). Needs the GPU.
    """
    B, Hq, Tq, slot = dq_acc.shape
    if slot != block_q * head_dim or Tq != -(-nq // block_q) or dq_acc.dtype != jnp.float32:
        raise ValueError(f"backward_post: dq_acc {dq_acc.shape} {dq_acc.dtype} is not the float32 "
                         f"accumulator of Nq={nq}, D={head_dim}, block_q={block_q}")
    key = BackwardPostKey(jnp.dtype(dtype).name, head_dim, block_q, float(np.float32(scale)))
    name = _ensure_registered(key)
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((B, nq, Hq, head_dim), dtype),
                            vmap_method="sequential")
    return match_varying(call(dq_acc), dq_acc)


def backward_stats(out, do, lse, dlse=None, *, head_dim: int, block_q: int, mode=None):
    """What the CuTe backward kernel reads besides Q, K, V and dO: ``(lse2, delta, dq_acc)``
    (``backward_prep``'s shapes: whole query tiles for the statistics' TMA boxes, +inf lse2
    so P = 0 and 0 delta past Nq; the zeroed float32 dQ accumulator). ``mode``
    (``_bwd_prep_mode``): None, three XLA passes; ``"fused"``, the preprocess kernel;
    ``"zero"``, the kernel for the zeros and XLA for the rest.

    >>> import jax.numpy as jnp
    >>> o = jnp.ones((1, 3, 1, 8), jnp.bfloat16)
    >>> lse2, delta, acc = backward_stats(o, o, jnp.zeros((1, 1, 3)), head_dim=8, block_q=64)
    >>> lse2.shape, float(delta[0, 0, 0]), float(delta[0, 0, 5]), float(lse2[0, 0, 5]), acc.shape
    ((1, 1, 64), 8.0, 0.0, inf, (1, 1, 1, 512))
    """
    if mode == "fused":
        return backward_prep(out, do, lse, dlse, head_dim=head_dim, block_q=block_q)
    f32 = jnp.float32
    B, Nq, Hq, _ = out.shape
    Tq = -(-Nq // block_q)
    lse32 = lse.astype(f32)
    lse2 = jnp.where(jnp.isneginf(lse32), jnp.inf, lse32 * np.float32(1.0 / math.log(2.0)))
    from ...attention.xla import softmax_delta
    delta = softmax_delta(out, do, lse32, dlse)
    pad = ((0, 0), (0, 0), (0, Tq * block_q - Nq))
    acc = (backward_prep(out, do, lse, head_dim=head_dim, block_q=block_q, zero_only=True)[2]
           if mode == "zero" else jnp.zeros((B, Hq, Tq, block_q * head_dim), f32))
    return jnp.pad(lse2, pad, constant_values=np.inf), jnp.pad(delta.astype(f32), pad), acc


def backward_dq(dq_acc, nq: int, head_dim: int, block_q: int, scale: float, dtype, *,
                post: bool = False, blocked: bool = False):
    """dQ [B, Nq, Hq, D] in ``dtype`` from the CuTe backward's float32 accumulator, times
    ``scale``: XLA's fused un-permute / scale / cast pass, or with ``post`` (not for the
    ``blocked`` slot order) the postprocess kernel, which gives the same bits.

    >>> import jax.numpy as jnp, numpy as np
    >>> acc = jnp.arange(64 * 64, dtype=jnp.float32).reshape(1, 1, 1, -1)
    >>> dq = backward_dq(acc, 64, 64, 64, 0.5, jnp.float32)
    >>> dq.shape, float(dq.sum()) == 0.5 * float(acc.sum())
    ((1, 64, 1, 64), True)
    """
    if post and not blocked:
        return backward_post(dq_acc, nq, head_dim, block_q, scale, dtype)
    dq = dq_fragment_unpermute(dq_acc, nq, head_dim, block_q, blocked=blocked)
    return (dq * np.float32(scale)).astype(dtype)


# ------------------------------------------------- a run-time dense mask's column pack
@dataclasses.dataclass(frozen=True)
class TransposeWordsKey:
    """The one compiled ``glue.TransposeWords`` (int32 words of any shape).

    >>> TransposeWordsKey().target_name
    'jcompilemask_cute_transpose_words'
    """

    dtype: str = "int32"

    @property
    def target_name(self) -> str:
        return "jcompilemask_cute_transpose_words"


def transpose_words_on() -> bool:
    """``$JCOMPILEMASK_CUTE_TRANSPOSE_WORDS``: ``1`` (the default) packs a run-time dense
    mask's columns with the CuTe kernel (``glue.TransposeWords``) wherever its tiers run on
    the ``cute`` backend; ``0`` keeps XLA's five rounds of word swaps
    (``lower.dense_runtime.transpose_words``), which give the same words, bit for bit.
    Default since session 52: on an H100 (run ``2026-12-08T00:32:42Z``) the 8K x 8K x 16
    pack took 0.64 ms against XLA's 1.14 and the plan 1.43 against 1.94; the traced
    documents step (run ``2026-12-08T00:36:53Z``) 8.34 ms against 8.84."""
    return _env_flag("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS", "1")


@functools.lru_cache(maxsize=None)
def _transpose_words_fn(n_cols: int):
    """The kernel on int32 [BH, Nr, W] -> [BH, n_cols, ceil(Nr / 32)], as a function whose
    ``vmap`` folds the mapped axis into the kernel's matrices (one launch for the batch)."""
    @jax.custom_batching.custom_vmap
    def run(words3):
        bh, nr, _ = words3.shape
        name = _ensure_registered(TransposeWordsKey())
        out = jax.ShapeDtypeStruct((bh, n_cols, -(-nr // 32)), jnp.int32)
        call = jax.ffi.ffi_call(name, out, vmap_method="sequential")
        return match_varying(call(words3), words3)

    @run.def_vmap
    def _(axis_size, in_batched, words3):
        if not in_batched[0]:
            out = run(words3)
            return jnp.broadcast_to(out[None], (axis_size,) + out.shape), True
        out = run(words3.reshape((-1,) + words3.shape[2:]))
        return out.reshape((axis_size, -1) + out.shape[1:]), True
    return run


def transpose_words(words, n_rows: int, n_cols: int):
    """The packed rows ``words`` uint32 [..., n_rows, ceil(n_cols / 32)] of bit matrices as
    their packed columns [..., n_cols, ceil(n_rows / 32)] (bit ``r % 32`` of word ``r // 32``
    of column c is element (r, c)), in one CuTe kernel (``glue.TransposeWords``): the same
    words as ``lower.dense_runtime.transpose_words``, which this falls back to for an empty
    array or more matrices than one launch's grid takes. Needs the GPU (the ``cute``
    backend); bits past ``n_cols`` in the last word of a row must be 0 (``pack_words``
    leaves them so)."""
    from ...lower import dense_runtime
    lead, (nr, w) = words.shape[:-2], words.shape[-2:]
    if nr != n_rows or w != -(-n_cols // 32) or words.dtype != jnp.uint32:
        raise ValueError(f"transpose_words: words {words.shape} {words.dtype} are not the uint32 "
                         f"rows of a {n_rows} x {n_cols} bit matrix")
    bh = math.prod(lead)
    grid_max = 65535      # the grid's y (256-row tiles) and z (matrices) are 16-bit
    if bh == 0 or n_rows == 0 or n_cols == 0 or bh > grid_max or -(-n_rows // 256) > grid_max:
        return dense_runtime.transpose_words(words, n_rows, n_cols)
    x = jax.lax.bitcast_convert_type(words, jnp.int32).reshape((bh, nr, w))
    out = _transpose_words_fn(int(n_cols))(x)
    return jax.lax.bitcast_convert_type(out, jnp.uint32).reshape(lead + out.shape[1:])
