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
import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)
# Dynamic shared memory one CTA may opt into on SM90 (227 KB).
_SMEM_LIMIT = 232448
DQ_ROW_PAD = 8   # floats after each row of a dq_bulk tile (dq_tile_offset)


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
    bf16 and fp16 share the shapes (same element size, same wgmma shapes).
    """
    del dtype
    if head_dim <= 128:
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
                       elem_bytes: int = 2) -> int:
    """Shared memory of FlashForwardSm90: barriers (padded to the 1 KB swizzle
    alignment), Q, and `num_stages` K and V tiles (Dv == D)."""
    return 1024 + elem_bytes * head_dim * (block_q + 2 * num_stages * block_kv)


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

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"cute forward supports {_DTYPES}, got dtype {self.dtype!r}")
        if self.head_dim not in HEAD_DIMS or self.head_dim_v != self.head_dim:
            raise ValueError(
                f"cute forward is built for head dims {HEAD_DIMS} with Dv == D, got "
                f"{self.head_dim}/{self.head_dim_v}; use the xla backend for other head dims"
            )
        want = preferred_forward_tiles(self.head_dim, self.dtype)
        if (self.block_q, self.block_kv) != want:
            raise ValueError(
                f"cute forward runs {want[0]}x{want[1]} tiles at head dim {self.head_dim}; the "
                f"descriptor was built for {self.block_q}x{self.block_kv}. Rebuild it with "
                "preferred_forward_tiles(...)"
            )
        if not 1 <= self.num_intervals <= 8:
            raise ValueError(f"interval count K must be in 1..8, got {self.num_intervals}")
        smem = forward_smem_bytes(self.head_dim, self.block_q, self.block_kv, self.num_stages)
        if self.num_stages < 1 or smem > _SMEM_LIMIT:
            raise ValueError(
                f"num_stages={self.num_stages} at head dim {self.head_dim} needs {smem} bytes of "
                f"shared memory (SM90 allows {_SMEM_LIMIT}); use preferred_forward_stages(...)"
            )
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap must be None or a positive finite float, got {self.softcap!r}")
        if self.softcap_fast_tanh and self.softcap is None:
            raise ValueError("softcap_fast_tanh needs a softcap")

    @property
    def target_name(self) -> str:
        scale_bits = np.float64(self.scale).view(np.uint64)
        return (
            f"jcompilemask_cute_fwd_{self.dtype}_d{self.head_dim}x{self.head_dim_v}_k{self.num_intervals}"
            f"_t{self.block_q}x{self.block_kv}_b{int(self.broadcast_batch)}h{int(self.broadcast_head)}"
            f"_s{self.num_stages}_{scale_bits:016x}"
            + ("" if self.softcap is None else
               f"_c{np.float64(self.softcap).view(np.uint64):016x}{'f' if self.softcap_fast_tanh else ''}")
        )


_lock = threading.Lock()
_compiled: dict[ForwardKey, Any] = {}
_registered: set[str] = set()


def _options() -> str:
    """cute.compile options; ``$JCOMPILEMASK_CUTE_DUMP_DIR`` keeps the PTX and cubin there
    (for ``cuobjdump --dump-resource-usage`` and spill counts, NOTES.md)."""
    import os
    dump = os.environ.get("JCOMPILEMASK_CUTE_DUMP_DIR")
    if not dump:
        return "--enable-tvm-ffi"
    os.makedirs(dump, exist_ok=True)
    return f"--enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir={dump}"


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
        )
        fn = cute.compile(
            kernel,
            bhsd(nq, hq, key.head_dim), bhsd(nk, hkv, key.head_dim), bhsd(nk, hkv, key.head_dim_v),
            intervals, tiles, bhsd(nq, hq, key.head_dim_v), lse,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=_options(),
        )
        _compiled[key] = fn
        return fn


def _ensure_registered(key) -> str:
    """Compile (ForwardKey or BackwardKey) and register as an XLA FFI target, once."""
    name = key.target_name
    if name in _registered:
        return name
    fn = compile_forward(key) if isinstance(key, ForwardKey) else compile_backward(key)
    try:
        import jax_tvm_ffi
    except ImportError as err:  # pragma: no cover
        raise ImportError("the cute backend needs jax-tvm-ffi to call CuTe kernels from JAX") from err
    with _lock:
        if name not in _registered:
            jax_tvm_ffi.register_ffi_target(name, fn, ["args", "rets"], platform="gpu", allow_cuda_graph=True)
            _registered.add(name)
    return name


def cute_forward(q, k, v, fwd_intervals, fwd_tiles, *, scale=None, softcap=None, block_q=128, block_kv=128,
                 num_stages=None, softcap_fast_tanh=False):
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
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    key = ForwardKey(
        dtype=jnp.dtype(q.dtype).name, head_dim=D, head_dim_v=Dv, num_intervals=K,
        block_q=block_q, block_kv=block_kv, broadcast_batch=(Bm == 1 and B > 1),
        broadcast_head=(Hm == 1 and Hq > 1), scale=float(scale),
        num_stages=num_stages or preferred_forward_stages(D, jnp.dtype(q.dtype).name),
        softcap=None if softcap is None else float(softcap), softcap_fast_tanh=softcap_fast_tanh,
    )
    if Bm == 1 and B == 1:
        key = dataclasses.replace(key, broadcast_batch=True)
    if Hm == 1 and Hq == 1:
        key = dataclasses.replace(key, broadcast_head=True)
    name = _ensure_registered(key)
    out_types = (
        jax.ShapeDtypeStruct((B, Nq, Hq, Dv), q.dtype),
        jax.ShapeDtypeStruct((B, Hq, Nq), jnp.float32),
    )
    call = jax.ffi.ffi_call(name, out_types, vmap_method="sequential")
    o, lse = call(q, k, v, fwd_intervals.astype(jnp.int32), fwd_tiles.astype(jnp.uint32))
    return o, lse


# ---------------------------------------------------------------------------- backward
BWD_HEAD_DIMS = (64, 128)
BWD_TILES = (64, 128)       # (bwd_block_q, bwd_block_kv): the descriptor's backward tiles


def backward_smem_bytes(head_dim: int, block_q: int, block_kv: int, num_stages: int,
                        elem_bytes: int = 2, dq_bulk: bool = False) -> int:
    """Shared memory of FlashBackwardSm90: barriers, K and V, `num_stages` Q and dO
    tiles, one dS tile, lse / delta stages, and (dq_bulk) one float32 dQ tile."""
    return (1024 + elem_bytes * (2 * block_kv * head_dim + 2 * num_stages * block_q * head_dim
                                 + block_q * block_kv)
            + 2 * 4 * block_q * num_stages + (4 * block_q * (head_dim + DQ_ROW_PAD) if dq_bulk else 0))


@dataclasses.dataclass(frozen=True)
class BackwardKey:
    """Everything the compiled backward kernel depends on statically."""

    dtype: str
    head_dim: int
    num_intervals: int          # K of the forward (row) table
    num_bwd_intervals: int      # Kc of the column table (0: no column view)
    block_q: int
    block_kv: int
    broadcast_batch: bool
    broadcast_head: bool
    scale: float
    num_stages: int = 2
    # lse / delta per query tile TMA'd into shared memory with Q / dO (see
    # FlashBackwardSm90.stats_tma); off until validated on the H200 (NOTES.md).
    stats_tma: bool = False
    # dQ per tile through shared memory and one bulk reduce-add into a per-tile
    # accumulator slot (FlashBackwardSm90.dq_bulk); off until validated on the H200.
    dq_bulk: bool = False

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"cute backward supports {_DTYPES}, got dtype {self.dtype!r}")
        if self.head_dim not in BWD_HEAD_DIMS:
            raise ValueError(f"cute backward is built for head dims {BWD_HEAD_DIMS} (Dv == D), "
                             f"got {self.head_dim}; the xla backward serves the others")
        if (self.block_q, self.block_kv) != BWD_TILES:
            raise ValueError(f"cute backward runs {BWD_TILES[0]}x{BWD_TILES[1]} backward tiles; the "
                             f"descriptor was built for {self.block_q}x{self.block_kv}")
        if not 1 <= self.num_intervals <= 8 or not 0 <= self.num_bwd_intervals <= 16:
            raise ValueError(f"interval counts K={self.num_intervals} (1..8), "
                             f"Kc={self.num_bwd_intervals} (0..16) out of range")
        smem = backward_smem_bytes(self.head_dim, self.block_q, self.block_kv, self.num_stages,
                                   dq_bulk=self.dq_bulk)
        if self.num_stages < 1 or smem > _SMEM_LIMIT:
            raise ValueError(f"num_stages={self.num_stages} needs {smem} bytes of shared memory")

    @property
    def target_name(self) -> str:
        scale_bits = np.float64(self.scale).view(np.uint64)
        return (f"jcompilemask_cute_bwd_{self.dtype}_d{self.head_dim}_k{self.num_intervals}"
                f"c{self.num_bwd_intervals}_t{self.block_q}x{self.block_kv}"
                f"_b{int(self.broadcast_batch)}h{int(self.broadcast_head)}_s{self.num_stages}"
                f"_{scale_bits:016x}" + ("_st" if self.stats_tma else "")
                + ("_dqb" if self.dq_bulk else ""))


def compile_backward(key: BackwardKey):
    """Compile (once per key) the TVM-FFI function of the backward kernel (no GPU needed
    with CUTE_DSL_ARCH=sm_90a)."""
    with _lock:
        if key in _compiled:
            return _compiled[key]
        cutlass, cute, dtype, sym, sym64 = _dsl(key.dtype)
        from .backward import FlashBackwardSm90

        b, nq, nk, hq, hkv = sym(), sym(), sym(), sym(), sym()
        d = key.head_dim

        def bshd(el, seqlen, heads, align=16, div=8):
            return cute.runtime.make_fake_tensor(
                el, (b, seqlen, heads, d),
                stride=(sym64(divisibility=div), sym64(divisibility=div), d, 1), assumed_align=align)

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
        if key.stats_tma:    # padded to whole query tiles: TMA boxes, 16-byte strides
            nq_pad = sym()
            rows = lambda: cute.runtime.make_fake_tensor(  # noqa: E731
                cutlass.Float32, (b, hq, nq_pad), stride=(sym64(divisibility=key.block_q),
                                                          sym64(divisibility=key.block_q), 1),
                assumed_align=16)
        else:
            rows = lambda: cute.runtime.make_fake_tensor(  # noqa: E731
                cutlass.Float32, (b, hq, nq), stride=(sym64(), sym64(), 1), assumed_align=4)
        kernel = FlashBackwardSm90(
            dtype, d, key.num_intervals, key.num_bwd_intervals, key.scale,
            block_q=key.block_q, block_kv=key.block_kv, broadcast_batch=key.broadcast_batch,
            broadcast_head=key.broadcast_head, num_stages=key.num_stages, stats_tma=key.stats_tma,
            dq_bulk=key.dq_bulk)
        if key.dq_bulk:      # [B, Hq, Tq, block_q * (D + pad)]: one contiguous slot per query tile
            tile = key.block_q * (d + DQ_ROW_PAD)
            dq_acc = lambda: cute.runtime.make_fake_tensor(  # noqa: E731
                cutlass.Float32, (b, hq, sym(), tile), stride=(sym64(divisibility=tile),
                                                                sym64(divisibility=tile), tile, 1),
                assumed_align=16)
        else:
            dq_acc = lambda: bshd(cutlass.Float32, nq, hq, align=16, div=4)  # noqa: E731
        fn = cute.compile(
            kernel,
            bshd(dtype, nq, hq), bshd(dtype, nk, hkv), bshd(dtype, nk, hkv), bshd(dtype, nq, hq),
            rows(), rows(), bwd_iv, tiles, fwd_iv, exact,
            dq_acc(), dq_acc(),
            bshd(dtype, nk, hkv), bshd(dtype, nk, hkv),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=_options(),
        )
        _compiled[key] = fn
        return fn


BWD_STATS_TMA_ENV = "JCOMPILEMASK_CUTE_BWD_STATS_TMA"
BWD_DQ_BULK_ENV = "JCOMPILEMASK_CUTE_BWD_DQ_BULK"


def _bwd_variant(env: str) -> bool:
    """Backward kernel variants not yet validated on the H200, selected by environment
    (read at trace time): ``JCOMPILEMASK_CUTE_BWD_STATS_TMA=1`` stages lse and delta in
    shared memory by TMA (BackwardKey.stats_tma); ``JCOMPILEMASK_CUTE_BWD_DQ_BULK=1`` adds
    dQ per tile with one bulk reduce-add (BackwardKey.dq_bulk). Both become the default
    once they pass tests/gpu/test_cute_backward.py there and measure faster."""
    import os
    return os.environ.get(env, "0") == "1"


def dq_tile_offset(row, col, head_dim):
    """dq_bulk: where element (row, col) of a block_q x head_dim dQ tile sits in the
    shared tile and in its global accumulator slot: row-major with rows of head_dim + 8
    floats. Linear in (row, col), so each thread's addresses are one base plus constants
    (a XOR swizzle made the compiler hoist and spill 32 addresses); the pad puts the 8
    rows of one accumulator store in distinct banks. `dq_bulk_unpad` drops it. Works on
    Python / numpy ints and on DSL integers."""
    return row * (head_dim + DQ_ROW_PAD) + col


def dq_bulk_unpad(acc, nq: int, head_dim: int):
    """[B, Hq, Tq, block_q * (D + pad)] per-tile accumulator slots (dq_tile_offset order)
    -> [B, Nq, Hq, D]."""
    b, hq, tq, slot = acc.shape
    rows = acc.reshape(b, hq, tq * (slot // (head_dim + DQ_ROW_PAD)), head_dim + DQ_ROW_PAD)
    rows = rows[..., :head_dim]
    return jnp.transpose(rows, (0, 2, 1, 3))[:, :nq]


def cute_backward(q, k, v, out, lse, do, bwd_intervals, bwd_tiles, fwd_intervals, bwd_exact, *,
                  scale=None, dlse=None, block_q=BWD_TILES[0], block_kv=BWD_TILES[1]):
    """Masked attention backward on SM90 from an Execution Descriptor's column view.

    Args:
      q, k, v, out, do: as in the forward ([B, N, H, D], bf16 or fp16, Dv == D).
      lse: float32 [B, Hq, Nq] from the forward (natural log, -inf for empty rows).
      bwd_intervals: int32 [Bm, Hm, Nk, Kc, 2]; bwd_tiles: uint32 [Bm, Hm, Tk', ceil16(Tq')]
        at ``block_q`` x ``block_kv`` backward tiles; fwd_intervals: int32 [Bm, Hm, Nq, K, 2]
        (checked instead of the column view for sequences where ``bwd_exact`` is False).
      dlse: optional cotangent of lse [B, Hq, Nq].
    Returns (dq, dk, dv) in the input dtype.
    """
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    if k.dtype != q.dtype or v.dtype != q.dtype or do.dtype != q.dtype:
        raise TypeError(f"q, k, v, do must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
                        f"{do.dtype}")
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or Hq % Hkv:
        raise ValueError(f"incompatible shapes q{q.shape} k{k.shape} v{v.shape}")
    if v.shape[-1] != D or out.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"cute backward needs Dv == D and out/do shaped like q; got q{q.shape} "
                         f"v{v.shape} out{out.shape} do{do.shape}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    Bm, Hm, _, K, _ = fwd_intervals.shape
    Kc = bwd_intervals.shape[3]
    Tq, Tk = -(-Nq // block_q), -(-Nk // block_kv)
    if bwd_tiles.shape != (Bm, Hm, Tk, -(-Tq // 16)):
        raise ValueError(f"bwd_tiles shape {bwd_tiles.shape} does not match {block_q}x{block_kv} "
                         f"backward tiles of Nq={Nq}, Nk={Nk}")
    key = BackwardKey(
        dtype=jnp.dtype(q.dtype).name, head_dim=D, num_intervals=K, num_bwd_intervals=Kc,
        block_q=block_q, block_kv=block_kv, broadcast_batch=(Bm == 1), broadcast_head=(Hm == 1),
        scale=float(scale), stats_tma=_bwd_variant(BWD_STATS_TMA_ENV),
        dq_bulk=_bwd_variant(BWD_DQ_BULK_ENV))
    name = _ensure_registered(key)
    f32 = jnp.float32
    lse = lse.astype(f32)
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * np.float32(1.0 / math.log(2.0)))
    from ...attention.xla import softmax_delta
    delta = softmax_delta(out, do, lse, dlse)
    if key.stats_tma:   # whole query tiles: +inf lse (P = 0) and 0 delta past Nq
        pad = ((0, 0), (0, 0), (0, Tq * block_q - Nq))
        lse2 = jnp.pad(lse2, pad, constant_values=np.inf)
        delta = jnp.pad(delta.astype(f32), pad)
    if Kc == 0:      # no column view: a 1-slot empty table keeps the operand shapes valid
        bwd_intervals = jnp.zeros((Bm, Hm, Nk, 1, 2), jnp.int32)
    exact = jnp.broadcast_to(jnp.asarray(bwd_exact, jnp.int32).reshape(-1), (Bm,))
    acc_shape = (B, Hq, Tq, block_q * (D + DQ_ROW_PAD)) if key.dq_bulk else (B, Nq, Hq, D)
    out_types = (
        jax.ShapeDtypeStruct(acc_shape, f32),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
    )
    # The dQ accumulator must start at zero: it is an input aliased to the output.
    call = jax.ffi.ffi_call(name, out_types, vmap_method="sequential",
                            input_output_aliases={10: 0})
    dq_acc, dk, dv = call(q, k, v, do, lse2, delta, bwd_intervals.astype(jnp.int32),
                          bwd_tiles.astype(jnp.uint32), fwd_intervals.astype(jnp.int32), exact,
                          jnp.zeros(acc_shape, f32))
    if key.dq_bulk:
        dq_acc = dq_bulk_unpad(dq_acc, Nq, D)
    return (dq_acc * np.float32(scale)).astype(q.dtype), dk, dv
