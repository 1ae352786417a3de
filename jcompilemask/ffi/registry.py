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

__all__ = ["register_ffi_kernel", "is_registered", "ffi_call", "match_varying"]

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
    out = jax.ffi.ffi_call(name, result_shape_dtypes, vmap_method=vmap_method)(
        *operands, **attrs)
    return match_varying(out, *operands)


def _varying_axes(x) -> frozenset:
    """The manual mesh axes over which ``x`` varies inside ``jax.shard_map`` (empty
    outside it, and for jax versions without the type)."""
    import jax
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)        # jax >= 0.11
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))            # jax 0.10


def match_varying(outs, *operands):
    """``outs`` (a pytree of arrays) marked as varying over every manual mesh axis any of
    ``operands`` varies over.

    An XLA custom call (``jax.ffi.ffi_call``) returns arrays typed as invariant across
    the mesh axes of an enclosing ``jax.shard_map``, whatever its operands are: a
    kernel's output computed from per-device q, k, v would then be claimed to be the same
    on every device, and ``jax.vjp`` / ``jax.grad`` inside the ``shard_map`` refuse the
    per-device cotangent ("unexpected JAX type ... for argument to VJP function": seen on
    the H200 with the CuTe kernels over a one-device mesh). Every custom call of the
    library goes through this. Outside ``shard_map`` it returns ``outs`` unchanged.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))
    >>> def f(x):
    ...     y = match_varying(jnp.zeros(x.shape, x.dtype), x)   # as a custom call would
    ...     return x + y
    >>> jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(jnp.ones(2)).shape
    (2,)
    """
    import jax
    from jax import lax
    want = frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(operands)))
    if not want:
        return outs
    cast = getattr(lax, "pcast", None)

    def mark(o):
        missing = tuple(sorted(want - _varying_axes(o)))
        if not missing:
            return o
        if cast is not None:
            return cast(o, missing, to="varying")
        return lax.pvary(o, missing)                       # jax 0.10
    return jax.tree.map(mark, outs)
