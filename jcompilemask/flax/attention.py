"""An ``attention_fn`` for Flax's attention modules, running :func:`mask_attention`.

Flax's ``nnx.MultiHeadAttention`` (and linen's ``MultiHeadDotProductAttention``) call
``attention_fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=...,
broadcast_dropout=..., deterministic=..., dtype=..., precision=..., module=...,
is_causal=...)`` (newer nnx versions add ``input_positions`` when given). This function
accepts all of them:

* ``mask``: an :class:`~jcompilemask.ExecutionDescriptor` (build it once per step and pass
  the same one to every layer: ``layer(x, mask=desc)``), or a MaskSpec / CompiledMask that
  reads no metadata, or a dense mask array as Flax makes them (``[batch..., heads|1,
  q_len, kv_len]``, nonzero = attend; inside ``jit`` its runs are found at every call
  and a structured one runs on the GPU kernels, see :func:`jcompilemask.mask_attention`;
  ``jcm.runtime_dense(mask, tiers=...)`` sets the interval widths). With none,
  ``is_causal=True`` is the mask.
* ``bias`` is added to the logits and ``is_causal=True`` AND-s ``k <= q`` into the mask,
  as in :func:`jcompilemask.mask_attention`.
* ``dropout_rate > 0`` with ``deterministic=False`` raises (attention dropout is not
  implemented); ``module`` (``sow_weights=True``) raises, since the attention weights are
  never materialised; ``input_positions`` raises (apply RoPE to the projections
  yourself).
* Flax's own ``MultiHeadAttention(decode=True)`` combines the mask with its cache mask as
  arrays: it works with ``mask=None`` (its cache mask then runs as a dense mask); for a
  structured mask while decoding use :class:`jcompilemask.flax.MultiHeadAttention` with
  ``decode=True``, which evaluates the mask at the cache positions.
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
from ..lower.dense_runtime import RuntimeDense
from ..lower.descriptor import ClassDescriptor, ExecutionDescriptor
from ..spec.maskspec import MaskSpec

__all__ = ["attention_fn", "make_attention_fn"]

_MASKS = (ExecutionDescriptor, ClassDescriptor, MaskSpec, CompiledMask)


def _inactive(v) -> bool:
    return v is None or v is False or (isinstance(v, (int, float)) and v == 0)


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                 dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, module=None, promote_dtype=None,
                 is_causal: bool = False, input_positions=None, *,
                 scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
                 implementation: Optional[str] = None, deterministic_grads: bool = False,
                 **flax_kwargs):
    """Drop-in ``attention_fn`` (see the module docstring for every keyword).

    Args:
      query: [batch..., q_len, heads, head_dim].
      key, value: [batch..., kv_len, kv_heads, head_dim(_v)].
      mask: the ExecutionDescriptor (or a metadata-free MaskSpec / CompiledMask).
      scale, logits_soft_cap, implementation: as :func:`jcompilemask.mask_attention`.
      deterministic_grads: :func:`jcompilemask.mask_attention`'s ``deterministic``
        (bit-identical gradients); Flax's own ``deterministic`` is the dropout switch.

    Returns:
      [batch..., q_len, heads, head_dim_v].
    """
    del broadcast_dropout, dropout_rng, precision, promote_dtype
    for name, v in flax_kwargs.items():
        if not _inactive(v):
            raise TypeError(f"jcompilemask attention_fn does not support the keyword "
                            f"{name}={v!r} (only its inactive value None/False/0)")
    if dropout_rate and not deterministic:
        raise NotImplementedError(
            f"attention dropout (dropout_rate={dropout_rate}, deterministic=False) is not "
            "supported by jcompilemask: set dropout_rate=0 on the attention module, or call "
            "it with deterministic=True")
    if module is not None:
        raise NotImplementedError("sow_weights=True needs the attention weights, which "
                                  "jcompilemask never materialises")
    if input_positions is not None:
        raise NotImplementedError("input_positions (RoPE inside attention_fn) is not "
                                  "supported: apply RoPE to the query/key projections "
                                  "before attention")
    if mask is None and not is_causal:
        raise ValueError("jcompilemask attention_fn needs its mask: call the layer with "
                         "mask=<ExecutionDescriptor> (built once per step with "
                         "jcm.compile(spec).instantiate(metadata, q_len, kv_len)), or bind "
                         "one with jcompilemask.flax.make_attention_fn(desc); for no "
                         "masking at all pass jcm.masks.full()")
    dense = mask is not None and not isinstance(mask, _MASKS)
    if dense and not (hasattr(mask, "dtype") and hasattr(mask, "shape")):
        raise TypeError(f"mask must be a jcompilemask ExecutionDescriptor, MaskSpec or "
                        f"CompiledMask, or a mask array, got {type(mask).__name__}")

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
    if isinstance(mask, RuntimeDense):
        mask = RuntimeDense(_flat_batch(mask.mask, batch, "mask"), mask.tiers)
    elif dense:
        mask = _flat_batch(jnp.asarray(mask) != 0, batch, "mask")
    if bias is not None:
        bias = _flat_batch(jnp.asarray(bias), batch, "bias")
    out = mask_attention(q4, k4, v4, mask, bias=bias, is_causal=bool(is_causal),
                         scale=scale, logits_soft_cap=logits_soft_cap,
                         implementation=implementation, deterministic=deterministic_grads)
    return out.reshape(batch + out.shape[1:])


def _flat_batch(x, batch, name):
    """[batch..., H, T, S] (leading dims may be 1 or missing) -> [prod(batch)|1, H, T, S]."""
    if x.ndim <= 3:
        return x
    lead = x.shape[:-3]
    if len(lead) > len(batch):
        raise ValueError(f"{name} has shape {x.shape}: more batch dims than the inputs' "
                         f"{batch}")
    lead = (1,) * (len(batch) - len(lead)) + lead
    x = x.reshape(lead + x.shape[-3:])
    if all(n == 1 for n in lead):
        return x.reshape((1,) + x.shape[-3:])
    x = jnp.broadcast_to(x, tuple(batch) + x.shape[-3:])
    return x.reshape((math.prod(batch),) + x.shape[-3:])


def make_attention_fn(mask=None, *, scale: Optional[float] = None,
                      logits_soft_cap: Optional[float] = None,
                      implementation: Optional[str] = None, deterministic_grads: bool = False):
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
                            implementation=implementation,
                            deterministic_grads=deterministic_grads, **flax_kwargs)

    fn.__doc__ = attention_fn.__doc__
    return fn
