"""Parallelism past one device: mask-aware context (sequence) parallelism over a mesh axis.

:func:`ring_attention` runs inside ``jax.shard_map`` with the sequence sharded over a mesh
axis (``mask_attention(..., context_axis=...)`` dispatches to it); the layout and schedule
helpers of :mod:`.plan` balance rows across devices and report what the ring sends.
"""
from .plan import (RingPlan, balance_permutation, chunk_visibility, cost_report,
                   full_ring_plan, permute_sequence, ring_plan, row_work, unpermute_sequence,
                   zigzag_permutation)
from .ring import ring_attention

__all__ = ["ring_attention", "RingPlan", "ring_plan", "full_ring_plan", "balance_permutation",
           "zigzag_permutation", "permute_sequence", "unpermute_sequence", "chunk_visibility",
           "row_work", "cost_report"]
