"""JAX's ``splash_attention_kernel`` module under jcompilemask: the kernel factories, their
options and the float32 references, under the names splash's users import.

>>> # from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
>>> from jcompilemask.splash import splash_attention_kernel as splash
>>> splash.QKVLayout.SEQ_MINOR, splash.BlockSizes.get_default().block_kv_compute
(<QKVLayout.SEQ_MINOR: 2>, 128)
"""
from .kernel import (DEFAULT_MASK_VALUE, BlockSizes, QKVLayout, SegmentIds,  # noqa: F401
                     SplashAttentionKernel, make_splash_mha, make_splash_mha_single_device,
                     make_splash_mqa, make_splash_mqa_single_device)
from .reference import (_attention_reference_custom_bwd, attention_reference,  # noqa: F401
                        attention_reference_custom, make_attention_reference,
                        make_masked_mha_reference, make_masked_mqa_reference)

__all__ = ["DEFAULT_MASK_VALUE", "BlockSizes", "QKVLayout", "SegmentIds",
           "SplashAttentionKernel", "make_splash_mha", "make_splash_mha_single_device",
           "make_splash_mqa", "make_splash_mqa_single_device", "attention_reference",
           "attention_reference_custom", "make_attention_reference",
           "make_masked_mha_reference", "make_masked_mqa_reference"]
