"""JAX's ``splash_attention_mask`` module under jcompilemask: the lazy mask classes and the
dense helpers, under the names splash's users import.

>>> # from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask
>>> from jcompilemask.splash import splash_attention_mask as mask_lib
>>> bool((mask_lib.CausalMask((8, 8))[:, :] == mask_lib.make_causal_mask((8, 8))).all())
True
"""
from .masks import (CausalMask, ChunkedCausalMask, FullMask, LocalMask,  # noqa: F401
                    LogicalAnd, LogicalOr, Mask, MultiHeadMask, NumpyMask, _ComputableMask,
                    make_causal_mask, make_chunk_attention_mask, make_local_attention_mask,
                    make_random_mask)

__all__ = ["Mask", "FullMask", "CausalMask", "LocalMask", "ChunkedCausalMask", "NumpyMask",
           "MultiHeadMask", "LogicalAnd", "LogicalOr", "make_causal_mask",
           "make_local_attention_mask", "make_chunk_attention_mask", "make_random_mask"]
