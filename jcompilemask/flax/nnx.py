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
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from flax import nnx

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
      rngs: :class:`flax.nnx.Rngs` for the projections' initialisation.

    Call ``layer(inputs_q, mask, inputs_kv=None)``: ``mask`` is the step's
    :class:`~jcompilemask.ExecutionDescriptor` (or a MaskSpec without metadata);
    ``inputs_kv`` defaults to ``inputs_q`` (self-attention).
    """

    def __init__(self, num_heads: int, in_features: int, qkv_features: Optional[int] = None,
                 out_features: Optional[int] = None, num_kv_heads: Optional[int] = None, *,
                 use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
                 scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
                 implementation: Optional[str] = None, rngs: nnx.Rngs):
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
        self.dtype = dtype

        def lin(i, o):
            return nnx.Linear(i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)

        self.query = lin(in_features, num_heads * self.head_dim)
        self.key = lin(in_features, num_kv_heads * self.head_dim)
        self.value = lin(in_features, num_kv_heads * self.head_dim)
        self.out = lin(num_heads * self.head_dim, out_features)

    def __call__(self, inputs_q, mask, inputs_kv=None):
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        lead_q, lead_kv = inputs_q.shape[:-1], inputs_kv.shape[:-1]
        q = self.query(inputs_q).reshape(lead_q + (self.num_heads, self.head_dim))
        k = self.key(inputs_kv).reshape(lead_kv + (self.num_kv_heads, self.head_dim))
        v = self.value(inputs_kv).reshape(lead_kv + (self.num_kv_heads, self.head_dim))
        x = attention_fn(q, k, v, mask=mask, deterministic=True, dtype=self.dtype,
                         scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                         implementation=self.implementation)
        return self.out(x.reshape(lead_q + (self.num_heads * self.head_dim,)))
