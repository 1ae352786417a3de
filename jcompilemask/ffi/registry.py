"""Registering compiled kernels as XLA FFI targets and calling them from JAX.

Registration goes through jax-tvm-ffi's ``register_ffi_target``: any function exported
with the TVM FFI ABI (TileLang's ``tvm_ffi`` backend, CuTe DSL's ``--enable-tvm-ffi``)
becomes an XLA custom call that receives XLA's buffers and CUDA stream without copies.
We use it rather than ``cutlass.jax`` because it serves both kernel families through one
path (verified on the H200 with the versions of docs/gpu-stack.md).
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

__all__ = ["register_ffi_kernel", "is_registered", "ffi_call"]

_REGISTERED: dict[str, Any] = {}       # name -> (function, capsule): keeps both alive
_LOCK = threading.Lock()


def is_registered(name: str) -> bool:
    return name in _REGISTERED


def register_ffi_kernel(name: str, function, *, platform: str = "gpu",
                        arg_spec: Optional[Sequence[str]] = None,
                        allow_cuda_graph: bool = False) -> str:
    """Register ``function`` (a ``tvm_ffi.Function``) as the FFI target ``name``.

    ``arg_spec`` maps the call to the function's parameters (jax-tvm-ffi's spec:
    ``"args"``, ``"rets"``, ``"attrs.<key>"``; default ``["args", "rets"]``). Registering
    the same name again with the same function is a no-op; with another, an error.
    """
    from .errors import require_gpu_extras
    require_gpu_extras(("tvm_ffi", "jax_tvm_ffi"))
    import jax_tvm_ffi
    with _LOCK:
        prev = _REGISTERED.get(name)
        if prev is not None:
            if prev[0] is not function:
                raise ValueError(f"FFI target {name!r} is already registered with another "
                                 "function; use a name derived from the kernel's key")
            return name
        capsule = jax_tvm_ffi.register_ffi_target(
            name, function, list(arg_spec or ["args", "rets"]), platform=platform,
            allow_cuda_graph=allow_cuda_graph)
        _REGISTERED[name] = (function, capsule)
    return name


def ffi_call(name: str, result_shape_dtypes, *operands, vmap_method: str = "sequential",
             **attrs):
    """``jax.ffi.ffi_call`` of a registered target (``vmap_method`` always explicit).

    The default ``"sequential"`` is right for kernels whose leading axis is already a
    batch the kernel loops over; pass another method only for kernels that accept it.
    """
    import jax
    if name not in _REGISTERED:
        raise KeyError(f"FFI target {name!r} is not registered (register_ffi_kernel first)")
    return jax.ffi.ffi_call(name, result_shape_dtypes, vmap_method=vmap_method)(
        *operands, **attrs)
