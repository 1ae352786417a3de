"""``MultiHeadAttention`` for Flax linen, with a jcompilemask mask.

>>> import jax, jax.numpy as jnp, jcompilemask as jcm
>>> from jcompilemask.flax.linen import MultiHeadAttention
>>> layer = MultiHeadAttention(num_heads=2)
>>> desc = jcm.compile(jcm.masks.causal()).instantiate(None, 8, 8)
>>> x = jnp.ones((1, 8, 16))
>>> params = layer.init(jax.random.key(0), x, desc)
>>> layer.apply(params, x, desc).shape
(1, 8, 16)

Linen's own ``nn.MultiHeadDotProductAttention(attention_fn=jcompilemask.flax.attention_fn)``
works as well, called with ``mask=desc``.
"""
from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from .attention import attention_fn

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query) attention under a jcompilemask mask (linen).

    Attributes mirror :class:`jcompilemask.flax.MultiHeadAttention` (NNX):
    ``num_heads``, ``qkv_features`` / ``out_features`` (default: the input features),
    ``num_kv_heads``, ``use_bias``, ``dtype``, ``param_dtype``, ``scale``,
    ``logits_soft_cap``, ``implementation``. Call with ``(inputs_q, mask, inputs_kv=None)``.
    """

    num_heads: int
    qkv_features: Optional[int] = None
    out_features: Optional[int] = None
    num_kv_heads: Optional[int] = None
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    scale: Optional[float] = None
    logits_soft_cap: Optional[float] = None
    implementation: Optional[str] = None
    deterministic_grads: bool = False    # mask_attention(deterministic=...); not dropout

    @nn.compact
    def __call__(self, inputs_q, mask, inputs_kv=None):
        inputs_kv = inputs_q if inputs_kv is None else inputs_kv
        feats = self.qkv_features or inputs_q.shape[-1]
        hkv = self.num_kv_heads or self.num_heads
        if feats % self.num_heads or self.num_heads % hkv:
            raise ValueError(f"qkv_features ({feats}) must be divisible by num_heads "
                             f"({self.num_heads}), and num_heads by num_kv_heads ({hkv})")
        d = feats // self.num_heads

        def proj(name, heads, x):
            return nn.DenseGeneral((heads, d), use_bias=self.use_bias, dtype=self.dtype,
                                   param_dtype=self.param_dtype, name=name)(x)

        q = proj("query", self.num_heads, inputs_q)
        k = proj("key", hkv, inputs_kv)
        v = proj("value", hkv, inputs_kv)
        x = attention_fn(q, k, v, mask=mask, deterministic=True, dtype=self.dtype,
                         scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                         implementation=self.implementation,
                         deterministic_grads=self.deterministic_grads)
        return nn.DenseGeneral(self.out_features or inputs_q.shape[-1], axis=(-2, -1),
                               use_bias=self.use_bias, dtype=self.dtype,
                               param_dtype=self.param_dtype, name="out")(x)
