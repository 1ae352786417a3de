"""SplashAttention's API on jcompilemask: port a model by changing one import.

>>> # from jax.experimental.pallas.ops.tpu import splash_attention as splash
>>> from jcompilemask import splash
>>> import jax, jax.numpy as jnp
>>> mask = splash.MultiHeadMask([splash.CausalMask((32, 32))] * 4)
>>> kernel = splash.make_splash_mha_single_device(mask)
>>> q = k = v = jax.random.normal(jax.random.key(0), (4, 32, 16))   # [heads, seq, dim]
>>> kernel(q, k, v).shape
(4, 32, 16)

The submodules ``splash_attention_kernel`` and ``splash_attention_mask`` carry JAX's module
names, so ``from jax.experimental.pallas.ops.tpu.splash_attention import X`` becomes
``from jcompilemask.splash import X``. Mask classes mirror JAX's, and JAX's own mask
objects are accepted unchanged; :func:`to_jcm` shows what a mask becomes (a MaskSpec
that lowers to intervals where the structure allows, else a
:func:`jcompilemask.from_dense` mask).
Numerics, segment ids, every option (what it does here) and the deliberate differences
from splash are documented in :mod:`jcompilemask.splash.kernel`; the float32 references
splash's tests use are in :mod:`jcompilemask.splash.reference`.
"""
from . import reference, splash_attention_kernel, splash_attention_mask  # noqa: F401
from .convert import rule_of, to_jcm
from .kernel import (DEFAULT_MASK_VALUE, BlockSizes, QKVLayout, SegmentIds,
                     SplashAttentionKernel, make_splash_mha, make_splash_mha_single_device,
                     make_splash_mqa, make_splash_mqa_single_device)
from .masks import (CausalMask, ChunkedCausalMask, FullMask, LocalMask, LogicalAnd,
                    LogicalOr, Mask, MultiHeadMask, NumpyMask, make_causal_mask,
                    make_chunk_attention_mask, make_local_attention_mask, make_random_mask)
from .reference import (attention_reference, attention_reference_custom,
                        make_attention_reference, make_masked_mha_reference,
                        make_masked_mqa_reference)

__all__ = ["make_splash_mha", "make_splash_mqa", "make_splash_mha_single_device",
           "make_splash_mqa_single_device", "SplashAttentionKernel", "SegmentIds",
           "BlockSizes", "QKVLayout", "DEFAULT_MASK_VALUE", "Mask", "FullMask", "CausalMask",
           "LocalMask", "ChunkedCausalMask", "NumpyMask", "MultiHeadMask", "LogicalAnd",
           "LogicalOr", "make_causal_mask", "make_local_attention_mask",
           "make_chunk_attention_mask", "make_random_mask", "attention_reference",
           "attention_reference_custom", "make_attention_reference",
           "make_masked_mha_reference", "make_masked_mqa_reference", "to_jcm", "rule_of",
           "splash_attention_kernel", "splash_attention_mask"]
