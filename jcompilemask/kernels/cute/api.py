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


def preferred_forward_tiles(head_dim: int, dtype: str = "bfloat16") -> tuple[int, int]:
    """(block_q, block_kv) the SM90 forward kernel wants its descriptor built at.

    128 x 128 for head dim <= 128: two consumer warpgroups of 64 rows each, a 128-key
    tile that keeps S (64 fp32 registers per thread) and O (64 more) in registers;
    FlashAttention-3 uses the same shape for hdim 128 on H100 (its tile_size_fwd_sm90).
    Head dim 256 would need a narrower key tile (80) to fit O; not built yet.
    """
    del dtype  # bf16 and fp16 share the shape
    if head_dim <= 128:
        return (128, 128)
    return (128, 80)


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

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"cute forward supports {_DTYPES}, got dtype {self.dtype!r}")
        if self.head_dim != 128 or self.head_dim_v != 128:
            raise ValueError(
                f"cute forward is built for head dim 128 so far, got {self.head_dim}/{self.head_dim_v}; "
                "use the xla backend for other head dims"
            )
        if (self.block_q, self.block_kv) != (128, 128):
            raise ValueError(
                f"cute forward runs 128x128 tiles; the descriptor was built for "
                f"{self.block_q}x{self.block_kv}. Rebuild it with preferred_forward_tiles(...)"
            )
        if not 1 <= self.num_intervals <= 8:
            raise ValueError(f"interval count K must be in 1..8, got {self.num_intervals}")

    @property
    def target_name(self) -> str:
        scale_bits = np.float64(self.scale).view(np.uint64)
        return (
            f"jcompilemask_cute_fwd_{self.dtype}_d{self.head_dim}x{self.head_dim_v}_k{self.num_intervals}"
            f"_t{self.block_q}x{self.block_kv}_b{int(self.broadcast_batch)}h{int(self.broadcast_head)}"
            f"_s{self.num_stages}_{scale_bits:016x}"
        )


_lock = threading.Lock()
_compiled: dict[ForwardKey, Any] = {}
_registered: set[str] = set()


def _import_cutlass():
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the cute backend needs nvidia-cutlass-dsl (>= 4.8) and jax-tvm-ffi; "
            "install them or use backend='xla'"
        ) from err


def compile_forward(key: ForwardKey):
    """Compile (once per key) and return the TVM-FFI function of the forward kernel.

    Works without a GPU when CUTE_DSL_ARCH=sm_90a is set before cutlass is imported.
    """
    with _lock:
        if key in _compiled:
            return _compiled[key]
        _import_cutlass()
        import cutlass
        import cutlass.cute as cute

        from .forward import FlashForwardSm90

        dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[key.dtype]
        sym, sym64 = cute.sym_int, cute.sym_int64
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
            num_stages=key.num_stages,
        )
        fn = cute.compile(
            kernel,
            bhsd(nq, hq, key.head_dim), bhsd(nk, hkv, key.head_dim), bhsd(nk, hkv, key.head_dim_v),
            intervals, tiles, bhsd(nq, hq, key.head_dim_v), lse,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options="--enable-tvm-ffi",
        )
        _compiled[key] = fn
        return fn


def _ensure_registered(key: ForwardKey) -> str:
    name = key.target_name
    if name in _registered:
        return name
    fn = compile_forward(key)
    try:
        import jax_tvm_ffi
    except ImportError as err:  # pragma: no cover
        raise ImportError("the cute backend needs jax-tvm-ffi to call CuTe kernels from JAX") from err
    with _lock:
        if name not in _registered:
            jax_tvm_ffi.register_ffi_target(name, fn, ["args", "rets"], platform="gpu", allow_cuda_graph=True)
            _registered.add(name)
    return name


def cute_forward(q, k, v, fwd_intervals, fwd_tiles, *, scale=None, block_q=128, block_kv=128):
    """Masked attention forward on SM90 from an Execution Descriptor's forward view.

    Args:
      q: [B, Nq, Hq, D]; k: [B, Nk, Hkv, D]; v: [B, Nk, Hkv, Dv] (bf16 or fp16; Hq % Hkv == 0).
      fwd_intervals: int32 [Bm, Hm, Nq, K, 2] (start, length) per row, Bm in {1, B}, Hm in {1, Hq}.
      fwd_tiles: uint32 [Bm, Hm, ceil(Nq/block_q), ceil(ceil(Nk/block_kv)/16)] tile states.
      scale: logit scale, default 1/sqrt(D).
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
