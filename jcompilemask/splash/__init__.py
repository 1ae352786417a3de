"""SplashAttention's API on jcompilemask: port a model by changing one import.

>>> # from jax.experimental.pallas.ops.tpu import splash_attention as splash
>>> from jcompilemask import splash
>>> import jax, jax.numpy as jnp
>>> mask = splash.MultiHeadMask([splash.CausalMask((32, 32))] * 4)
>>> kernel = splash.make_splash_mha_single_device(mask)
>>> q = k = v = jax.random.normal(jax.random.key(0), (4, 32, 16))   # [heads, seq, dim]
>>> kernel(q, k, v).shape
(4, 32, 16)

Mask classes mirror JAX's ``splash_attention_mask`` module, and JAX's own mask objects
are accepted unchanged; :func:`to_jcm` shows what a mask becomes (a MaskSpec that lowers
to intervals where the structure allows, else a :func:`jcompilemask.from_dense` mask).
Numerics, segment ids, ``BlockSizes`` and the deliberate differences from splash are
documented in :mod:`jcompilemask.splash.kernel`.
"""
from .convert import rule_of, to_jcm
from .kernel import (DEFAULT_MASK_VALUE, BlockSizes, QKVLayout, SegmentIds,
                     SplashAttentionKernel, make_splash_mha, make_splash_mha_single_device,
                     make_splash_mqa, make_splash_mqa_single_device)
from .masks import (CausalMask, ChunkedCausalMask, FullMask, LocalMask, LogicalAnd,
                    LogicalOr, Mask, MultiHeadMask, NumpyMask)

__all__ = ["make_splash_mha", "make_splash_mqa", "make_splash_mha_single_device",
           "make_splash_mqa_single_device", "SplashAttentionKernel", "SegmentIds",
           "BlockSizes", "QKVLayout", "DEFAULT_MASK_VALUE", "Mask", "FullMask", "CausalMask",
           "LocalMask", "ChunkedCausalMask", "NumpyMask", "MultiHeadMask", "LogicalAnd",
           "LogicalOr", "to_jcm", "rule_of"]
