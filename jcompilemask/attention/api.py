"""``mask_attention``: the public attention function (validation, dispatch, custom_vjp)."""
from __future__ import annotations

import functools
import math
from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from .. import backends as _backends
from ..lower.compiled import CompiledMask, compile as _compile
from ..lower.descriptor import ExecutionDescriptor
from ..spec.maskspec import MaskSpec

__all__ = ["mask_attention"]

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, desc, scale, softcap, backend_name):
    return _backends.get(backend_name).forward(q, k, v, desc, scale, softcap)


def _attention_fwd(q, k, v, desc, scale, softcap, backend_name):
    out, lse = _backends.get(backend_name).forward(q, k, v, desc, scale, softcap)
    return (out, lse), (q, k, v, desc, out, lse)


def _attention_bwd(scale, softcap, backend_name, res, cts):
    q, k, v, desc, out, lse = res
    do, dlse = cts
    dq, dk, dv = _backends.get(backend_name).backward(q, k, v, desc, scale, softcap, out,
                                                      lse, do, dlse)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _shape_error(msg):
    return ValueError(msg + " (layout: query [batch, q_len, heads, head_dim], key/value "
                      "[batch, kv_len, kv_heads, head_dim(_v)])")


def _validate(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise _shape_error(f"{name} must be rank 4, got shape {getattr(x, 'shape', None)}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name} dtype must be bfloat16, float16 or float32, got "
                            f"{x.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    b, nq, hq, d = query.shape
    bk, nk, hkv, dk = key.shape
    bv, nv, hv, dv = value.shape
    if not (b == bk == bv):
        raise _shape_error(f"batch sizes differ: query {b}, key {bk}, value {bv}")
    if nk != nv:
        raise _shape_error(f"key and value lengths differ: {nk} vs {nv}")
    if hkv != hv:
        raise _shape_error(f"key and value head counts differ: {hkv} vs {hv}")
    if d != dk:
        raise _shape_error(f"query and key head_dim differ: {d} vs {dk}")
    if hkv == 0 or hq % hkv:
        raise _shape_error(f"query heads ({hq}) must be a multiple of key/value heads "
                           f"({hkv}) for GQA/MQA")
    return b, nq, hq, d, nk, hkv, dv


def mask_attention(query, key, value, mask, *, metadata: Optional[Mapping] = None,
                   scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
                   return_residuals: bool = False, implementation: Optional[str] = None):
    """Attention under a compiled mask, usable inside ``jax.jit``, ``grad`` and ``vmap``.

    Args:
      query: [batch, q_len, num_heads, head_dim] (bfloat16, float16 or float32).
      key: [batch, kv_len, num_kv_heads, head_dim]; query head h reads key/value head
        ``h // (num_heads // num_kv_heads)`` (GQA/MQA).
      value: [batch, kv_len, num_kv_heads, head_dim_v].
      mask: an :class:`ExecutionDescriptor` (built once per step, shared by layers), or a
        :class:`MaskSpec` / :class:`CompiledMask` together with ``metadata`` (the
        descriptor is then built here, at the tiles of the backend that runs).
        Its batch and mask heads broadcast when 1.
      metadata: the mask's metadata arrays, when ``mask`` is not a descriptor.
      scale: logits multiplier, default ``1 / sqrt(head_dim)``.
      logits_soft_cap: if set, logits become ``cap * tanh(logits / cap)``.
      return_residuals: also return ``lse`` (natural log, float32 [batch, heads, q_len]).
      implementation: ``"cute"``, ``"xla"`` or None (the best available; see
        :func:`jcompilemask.backends.explain`).

    Returns:
      ``out`` [batch, q_len, num_heads, head_dim_v] in the input dtype, or
      ``(out, lse)``. A row that sees no key gets out 0, lse -inf and zero gradients.

    >>> import jax, jax.numpy as jnp, jcompilemask as jcm
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))
    >>> out = jcm.mask_attention(q, k, v, jcm.masks.causal())
    >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> bool(jnp.allclose(out, ref, atol=1e-5))
    True
    """
    b, nq, hq, d, nk, hkv, dv = _validate(query, key, value)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if logits_soft_cap is not None:
        if not isinstance(logits_soft_cap, (int, float)) or logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be a positive float, got "
                             f"{logits_soft_cap!r}")
        logits_soft_cap = float(logits_soft_cap)

    if isinstance(mask, ExecutionDescriptor):
        if metadata is not None:
            raise ValueError("metadata is only used when mask is a MaskSpec or "
                             "CompiledMask; the descriptor already holds it")
        desc = mask
        cm = desc.mask
    elif isinstance(mask, (MaskSpec, CompiledMask)):
        cm = _compile(mask)
        if cm.batched and metadata is None:
            raise ValueError(f"this mask reads metadata {sorted(cm.spec.metadata)}: pass "
                             "metadata={...} or an ExecutionDescriptor")
        desc = None
    else:
        raise TypeError("mask must be an ExecutionDescriptor, MaskSpec or CompiledMask, "
                        f"got {type(mask).__name__}")

    call = _backends.Call(
        dtype=jnp.dtype(query.dtype).name, head_dim=d, head_dim_v=dv, num_heads=hq,
        num_kv_heads=hkv, softcap=logits_soft_cap is not None,
        has_fallback=bool(cm.fallback_regions), num_intervals=cm.num_intervals,
        tiles=None if desc is None else desc.tiles)
    backend = _backends.select(implementation, call)
    if desc is None:
        t = backend.tiles(call)
        desc = cm.instantiate(metadata, nq, nk, block_q=t.block_q, block_kv=t.block_kv,
                              bwd_block_q=t.bwd_block_q, bwd_block_kv=t.bwd_block_kv)

    if (desc.q_len, desc.kv_len) != (nq, nk):
        raise ValueError(f"the descriptor was built for q_len={desc.q_len}, kv_len="
                         f"{desc.kv_len}, but query/key have {nq}/{nk}: instantiate it "
                         "with the lengths of this call")
    if desc.batch not in (1, b):
        raise ValueError(f"the descriptor has batch {desc.batch}; the call has batch {b} "
                         "(a mask batch must be 1 or equal the query batch)")
    if desc.mask_heads not in (1, hq):
        raise ValueError(f"the mask has {desc.mask_heads} heads; the call has {hq} query "
                         "heads (mask heads must be 1 or the query head count)")

    out, lse = _attention(query, key, value, desc, float(scale), logits_soft_cap,
                          backend.name)
    return (out, lse) if return_residuals else out
