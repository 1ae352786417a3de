"""Flax layers for jcompilemask: an NNX module, a linen module, and an ``attention_fn``
for Flax's own attention modules.

The mask descriptor is built once per step and shared by every layer::

    spec = jcm.masks.document()                     # once
    cm = jcm.compile(spec)                          # once (cached)

    @nnx.jit
    def train_step(model, optimizer, tokens, segment_ids):
        n = tokens.shape[1]
        desc = cm.instantiate({"segment_ids": segment_ids}, n, n)   # once per step
        def loss_fn(model):
            logits = model(tokens, desc)            # every layer gets the same desc
            ...

With Flax's ``nnx.MultiHeadAttention(..., attention_fn=jcm.flax.attention_fn)`` pass
``mask=desc`` at call time; :func:`make_attention_fn` binds a mask (and scale / soft cap)
instead. See ``examples/flax_decoder.py``.
"""
from .attention import attention_fn, make_attention_fn
from .nnx import MultiHeadAttention
from . import linen

__all__ = ["attention_fn", "make_attention_fn", "MultiHeadAttention", "linen"]
