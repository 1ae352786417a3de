"""An ``attention_fn`` for Flax's attention modules, running :func:`mask_attention`.

Flax's ``nnx.MultiHeadAttention`` (and linen's ``MultiHeadDotProductAttention``) call
``attention_fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=...,
broadcast_dropout=..., deterministic=..., dtype=..., precision=..., module=...,
is_causal=...)`` (newer nnx versions add ``input_positions`` when given). This function
accepts all of them:

* ``mask``: an :class:`~jcompilemask.ExecutionDescriptor` (build it once per step and pass
  the same one to every layer: ``layer(x, mask=desc)``), or a MaskSpec / CompiledMask that
  reads no metadata. A dense boolean or float mask is rejected with a hint (build a
  MaskSpec, or :func:`jcompilemask.from_dense` for a fixed pattern).
* ``dropout_rate > 0`` with ``deterministic=False`` raises (attention dropout is not
  implemented); ``bias`` raises; ``module`` (``sow_weights=True``) raises, since the
  attention weights are never materialised; ``is_causal=True`` raises (put causality in
  the MaskSpec); ``input_positions`` raises (apply RoPE to the projections yourself).
* ``dtype`` casts query / key / value (default: their promoted dtype; float32 math inside
  the kernels either way); ``precision``, ``broadcast_dropout``, ``dropout_rng`` and
  ``promote_dtype`` are accepted and have no effect.
* Any other keyword a future Flax passes is accepted when it is None / False / 0 and
  raises otherwise, naming it.

Extra batch dimensions (``[batch..., length, heads, head_dim]``) are flattened; inputs
without a batch dimension get one.

>>> import jax, jax.numpy as jnp, jcompilemask as jcm
>>> from jcompilemask.flax import attention_fn
>>> q = k = v = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
>>> desc = jcm.compile(jcm.masks.causal()).instantiate(None, 8, 8)
>>> out = attention_fn(q, k, v, mask=desc, deterministic=True)
>>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
True
"""
from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

from ..attention.api import mask_attention
from ..lower.compiled import CompiledMask
from ..lower.descriptor import ExecutionDescriptor
from ..spec.maskspec import MaskSpec

__all__ = ["attention_fn", "make_attention_fn"]

_MASKS = (ExecutionDescriptor, MaskSpec, CompiledMask)


def _inactive(v) -> bool:
    return v is None or v is False or (isinstance(v, (int, float)) and v == 0)


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, module=None, promote_dtype=None,
                 is_causal: bool = False, input_positions=None, *,
                 scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
                 implementation: Optional[str] = None, **flax_kwargs):
    """Drop-in ``attention_fn`` (see the module docstring for every keyword).

    Args:
      query: [batch..., q_len, heads, head_dim].
      key, value: [batch..., kv_len, kv_heads, head_dim(_v)].
      mask: the ExecutionDescriptor (or a metadata-free MaskSpec / CompiledMask).
      scale, logits_soft_cap, implementation: as :func:`jcompilemask.mask_attention`.

    Returns:
      [batch..., q_len, heads, head_dim_v].
    """
    del broadcast_dropout, dropout_rng, precision, promote_dtype
    for name, v in flax_kwargs.items():
        if not _inactive(v):
            raise TypeError(f"jcompilemask attention_fn does not support the keyword "
                            f"{name}={v!r} (only its inactive value None/False/0)")
    if bias is not None:
        raise NotImplementedError("attention bias is not supported by jcompilemask: express "
                                  "masking as a MaskSpec (additive biases are not "
                                  "implemented)")
    if dropout_rate and not deterministic:
        raise NotImplementedError(
            f"attention dropout (dropout_rate={dropout_rate}, deterministic=False) is not "
            "supported by jcompilemask: set dropout_rate=0 on the attention module, or call "
            "it with deterministic=True")
    if module is not None:
        raise NotImplementedError("sow_weights=True needs the attention weights, which "
                                  "jcompilemask never materialises")
    if is_causal:
        raise NotImplementedError("is_causal=True: put causality in the MaskSpec (e.g. "
                                  "jcm.masks.causal(), or `& (k <= q)` in a rule)")
    if input_positions is not None:
        raise NotImplementedError("input_positions (RoPE inside attention_fn) is not "
                                  "supported: apply RoPE to the query/key projections "
                                  "before attention")
    if mask is None:
        raise ValueError("jcompilemask attention_fn needs its mask: call the layer with "
                         "mask=<ExecutionDescriptor> (built once per step with "
                         "jcm.compile(spec).instantiate(metadata, q_len, kv_len)), or bind "
                         "one with jcompilemask.flax.make_attention_fn(desc)")
    if not isinstance(mask, _MASKS):
        raise TypeError(f"mask must be a jcompilemask ExecutionDescriptor, MaskSpec or "
                        f"CompiledMask, got {type(mask).__name__}: a dense mask array is not "
                        "accepted (write the pattern as a MaskSpec, or use "
                        "jcompilemask.from_dense for a fixed [Nq, Nk] pattern)")

    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"query/key/value must be [batch..., length, heads, head_dim] with "
                         f"equal ranks, got {query.shape}, {key.shape}, {value.shape}")
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"batch dimensions differ: query {query.shape}, key {key.shape}, "
                         f"value {value.shape}")
    b = math.prod(batch)
    q4, k4, v4 = (x.reshape((b,) + x.shape[-3:]) for x in (query, key, value))
    out = mask_attention(q4, k4, v4, mask, scale=scale, logits_soft_cap=logits_soft_cap,
                         implementation=implementation)
    return out.reshape(batch + out.shape[1:])


def make_attention_fn(mask=None, *, scale: Optional[float] = None,
                      logits_soft_cap: Optional[float] = None,
                      implementation: Optional[str] = None):
    """An ``attention_fn`` with its mask (and options) bound.

    Bind a descriptor when a module is built inside the step (linen ``apply``, or an nnx
    model constructed per step); for a persistent nnx module pass ``mask=desc`` at call
    time instead (``mask=None`` here). A bound mask wins over a call-time ``mask`` only
    when the call passes none.

    >>> import jcompilemask as jcm
    >>> fn = make_attention_fn(jcm.masks.causal(), logits_soft_cap=30.0)
    """
    bound = mask

    def fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
           dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
           dtype=None, precision=None, module=None, promote_dtype=None,
           is_causal: bool = False, input_positions=None, **flax_kwargs):
        # Explicit keywords: linen passes only the keywords named in the signature.
        return attention_fn(query, key, value, bias, bound if mask is None else mask,
                            broadcast_dropout, dropout_rng, dropout_rate, deterministic,
                            dtype, precision, module, promote_dtype, is_causal,
                            input_positions, scale=scale, logits_soft_cap=logits_soft_cap,
                            implementation=implementation, **flax_kwargs)

    fn.__doc__ = attention_fn.__doc__
    return fn
