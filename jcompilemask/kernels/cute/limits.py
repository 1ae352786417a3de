"""Interval counts the CuTe kernels unroll (no cutlass import: the registry reads these).

Up to ``INTERVALS_UNROLLED`` row intervals (K) the forward's mask code and the backward's
row-interval fallback are unrolled, as validated on the H200; above it a masked tile loops
over the row's intervals from the (L1-resident) table, skipping those that miss the tile,
and gathers visibility in bit masks (any K). The backward's re-read column intervals (Kc)
unroll up to ``COLUMNS_UNROLLED`` (validated at Kc 13) and loop past it.
"""

INTERVALS_UNROLLED = 8
COLUMNS_UNROLLED = 16
