"""``MultiHeadAttention`` for Flax NNX, with a jcompilemask mask.

The mask descriptor is built once per step and passed to every layer:

>>> import jax, jax.numpy as jnp, jcompilemask as jcm
>>> from flax import nnx
>>> from jcompilemask.flax import MultiHeadAttention
>>> layers = [MultiHeadAttention(4, 32, rngs=nnx.Rngs(i)) for i in range(2)]
>>> seg = jnp.array([[0] * 10 + [1] * 6])                    # two packed documents
>>> desc = jcm.compile(jcm.masks.document()).instantiate({"segment_ids": seg}, 16, 16)
>>> x = jnp.ones((1, 16, 32))
>>> for layer in layers:
...     x = x + layer(x, desc)
>>> x.shape
(1, 16, 32)

Autoregressive decoding (``decode=True``) keeps a key/value cache and evaluates the mask
at the cache positions: a call with ``c`` new tokens at cache index ``i`` runs query rows
``i .. i+c-1`` of the mask against keys ``0 .. i+c-1`` (one token, or a chunk such as the
prompt). The mask is a descriptor built for ``(max_length, max_length)`` (once per
generated batch), a MaskSpec without metadata, or None (causal):

>>> layer = MultiHeadAttention(4, 32, decode=True, rngs=nnx.Rngs(0))
>>> layer.init_cache((1, 16, 32))                          # (batch, max_length, features)
>>> cm = jcm.compile(jcm.masks.sliding_window(4))
>>> desc = cm.instantiate(None, 16, 16)
>>> prompt = layer(jnp.ones((1, 5, 32)), desc)              # prefill 5 tokens
>>> step = layer(jnp.ones((1, 1, 32)), desc)                # then one at a time
>>> int(layer.cache_index[...]), step.shape
(6, (1, 1, 32))
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from ..attention.api import mask_attention
from ..lower.compiled import CompiledMask, compile as compile_mask
from ..lower.descriptor import ClassDescriptor, ExecutionDescriptor
from ..spec.maskspec import MaskSpec
from .attention import attention_fn

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nnx.Module):
    """Multi-head (grouped-query) attention under a jcompilemask mask.

    Args:
      num_heads: query heads.
      in_features: features of the inputs.
      qkv_features: total query features (default ``in_features``); the head dim is
        ``qkv_features // num_heads``.
      out_features: output features (default ``in_features``).
      num_kv_heads: key/value heads (default ``num_heads``; fewer gives GQA / MQA).
      use_bias: biases in the four projections.
      dtype, param_dtype: computation and parameter dtypes.
      scale, logits_soft_cap, implementation: as :func:`jcompilemask.mask_attention`.
      deterministic_grads: ``mask_attention(deterministic=...)``: bit-identical gradients.
      decode: keep a key/value cache for autoregressive decoding (see the module doc;
        call :meth:`init_cache` first). ``layer(..., decode=...)`` overrides it per call.
      rngs: :class:`flax.nnx.Rngs` for the projections' initialisation.

    Call ``layer(inputs_q, mask, inputs_kv=None)``: ``mask`` is the step's
    :class:`~jcompilemask.ExecutionDescriptor` (or a MaskSpec without metadata);
    ``inputs_kv`` defaults to ``inputs_q`` (self-attention).
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: Optional[int] = None,
                 out_features: Optional[int] = None, num_kv_heads: Optional[int] = None, *,
                 use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
                 scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
                 implementation: Optional[str] = None, decode: bool = False,
                 deterministic_grads: bool = False, rngs: nnx.Rngs):
        qkv_features = qkv_features or in_features
        out_features = out_features or in_features
        num_kv_heads = num_kv_heads or num_heads
        if qkv_features % num_heads:
            raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                             f"({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = qkv_features // num_heads
        self.scale, self.logits_soft_cap = scale, logits_soft_cap
        self.implementation = implementation
        self.deterministic_grads = deterministic_grads
        self.dtype = dtype
        self.decode = decode
        self.cached_key = self.cached_value = self.cache_index = nnx.data(None)

        def lin(i, o):
            return nnx.Linear(i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)

        self.query = lin(in_features, num_heads * self.head_dim)
        self.key = lin(in_features, num_kv_heads * self.head_dim)
        self.value = lin(in_features, num_kv_heads * self.head_dim)
        self.out = lin(num_heads * self.head_dim, out_features)

    def init_cache(self, input_shape, dtype=None):
        """Allocate the decoding cache for inputs of ``input_shape`` = (batch, max_length,
        features); resets the cache index to 0. Decoding past ``max_length`` raises
        eagerly; inside ``jit`` (where the index is traced) its output is NaN."""
        if len(input_shape) != 3:
            raise ValueError(f"init_cache takes (batch, max_length, features), got "
                             f"{tuple(input_shape)}")
        b, n, _ = input_shape
        dtype = dtype or self.dtype or jnp.float32
        shape = (b, n, self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(self, inputs_q, mask=None, inputs_kv=None, *, decode: Optional[bool] = None):
        if self.decode if decode is None else decode:
            return self._decode_step(inputs_q, mask, inputs_kv)
        if mask is None:
            raise ValueError("MultiHeadAttention needs its mask: layer(x, desc) with the "
                             "step's ExecutionDescriptor (or a MaskSpec without metadata)")
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        lead_q, lead_kv = inputs_q.shape[:-1], inputs_kv.shape[:-1]
        q = self.query(inputs_q).reshape(lead_q + (self.num_heads, self.head_dim))
        k = self.key(inputs_kv).reshape(lead_kv + (self.num_kv_heads, self.head_dim))
        v = self.value(inputs_kv).reshape(lead_kv + (self.num_kv_heads, self.head_dim))
        x = attention_fn(q, k, v, mask=mask, deterministic=True, dtype=self.dtype,
                         scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                         implementation=self.implementation,
                         deterministic_grads=self.deterministic_grads)
        return self.out(x.reshape(lead_q + (self.num_heads * self.head_dim,)))

    def _decode_step(self, inputs_q, mask, inputs_kv):
        if inputs_kv is not None:
            raise ValueError("decode=True is self-attention over the cache: pass no inputs_kv")
        if self.cache_index is None:
            raise ValueError("decode=True needs the cache: call layer.init_cache((batch, "
                             "max_length, features)) first")
        if inputs_q.ndim != 3:
            raise ValueError(f"decode=True takes inputs [batch, new_tokens, features], got "
                             f"{inputs_q.shape}")
        b, c, _ = inputs_q.shape
        kc, vc = self.cached_key[...], self.cached_value[...]
        n = kc.shape[1]
        if kc.shape[0] != b or c > n:
            raise ValueError(f"the cache holds batch {kc.shape[0]}, max_length {n}; got "
                             f"{c} new tokens for batch {b}")
        q = self.query(inputs_q).reshape(b, c, self.num_heads, self.head_dim)
        k = self.key(inputs_q).reshape(b, c, self.num_kv_heads, self.head_dim)
        v = self.value(inputs_q).reshape(b, c, self.num_kv_heads, self.head_dim)
        i = self.cache_index[...]
        if not isinstance(i, jax.core.Tracer) and int(i) + c > n:
            raise ValueError(f"the cache is full: index {int(i)} + {c} new tokens > "
                             f"max_length {n} (init_cache with a longer max_length)")
        zero = jnp.zeros((), i.dtype)
        kc = lax.dynamic_update_slice(kc, k.astype(kc.dtype), (zero, i, zero, zero))
        vc = lax.dynamic_update_slice(vc, v.astype(vc.dtype), (zero, i, zero, zero))
        self.cached_key[...], self.cached_value[...] = kc, vc
        self.cache_index[...] = i + c
        rows = i + jnp.arange(c, dtype=jnp.int32)
        cols = jnp.arange(n, dtype=jnp.int32)
        vis = _rows_visibility(mask, rows, cols, n) & (cols < i + c)[None, None, None, :]
        dtype = self.dtype or jnp.result_type(q, kc)
        x = mask_attention(q.astype(dtype), kc.astype(dtype), vc.astype(dtype), vis,
                           scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                           implementation=self.implementation,
                           deterministic=self.deterministic_grads)
        # Past max_length (seen only inside jit) the cache update would clamp and
        # overwrite earlier keys: the output is NaN instead of silently wrong.
        x = jnp.where(i + c <= n, x, jnp.nan)
        return self.out(x.reshape(b, c, self.num_heads * self.head_dim))


def _rows_visibility(mask, rows, cols, n):
    """bool [B|1, Hm|1, len(rows), n]: the mask's rows ``rows`` over keys ``cols``, from
    a descriptor built for (n, n), a metadata-free MaskSpec, or None (causal)."""
    if mask is None:
        return (cols[None, :] <= rows[:, None])[None, None]
    if isinstance(mask, (MaskSpec, CompiledMask)):
        cm = compile_mask(mask)
        if cm.batched:
            raise ValueError("decode=True with a mask that reads metadata: pass its "
                             "descriptor, built once for the generated batch with "
                             "instantiate(metadata, max_length, max_length)")
        mask = cm.instantiate(None, n, n)
    if not isinstance(mask, (ExecutionDescriptor, ClassDescriptor)):
        raise TypeError(f"decode=True takes an ExecutionDescriptor, a MaskSpec or None as "
                        f"mask, got {type(mask).__name__}")
    if (mask.q_len, mask.kv_len) != (n, n):
        raise ValueError(f"decode=True needs the descriptor built for the cache length: "
                         f"instantiate(metadata, {n}, {n}); this one has q_len="
                         f"{mask.q_len}, kv_len={mask.kv_len}")
    return mask.visibility(rows, cols, "fwd")
