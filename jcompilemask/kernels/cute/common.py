"""Helpers shared by the SM90 forward and backward kernels: register-fragment views of
wgmma accumulators, the unsigned interval compare, a log-depth reduction, one wgmma
issue over all k-blocks, and the 2-bit tile-state read."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, Uint32
from cutlass._mlir.dialects import arith
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def _unsigned_lt(a, b, *, loc=None, ip=None) -> Boolean:
    """uint32(a) < uint32(b) for Int32 operands.

    Spelled as an explicit `arith.cmpi ult`: `Uint32(x) < Uint32(y)` on Int32 values
    was lowered to a signed compare (setp.lt.s32) by CuTe DSL 4.8.1, which would make
    every key left of an interval's start visible.
    """
    return Boolean(
        arith.cmpi(
            arith.CmpIPredicate.ult,
            Int32(a).ir_value(loc=loc, ip=ip),
            Int32(b).ir_value(loc=loc, ip=ip),
            loc=loc,
            ip=ip,
        )
    )


def _tree(values: list, op):
    """Reduce a Python list of DSL values pairwise (log-depth dependency chain)."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _rows_view(acc: cute.Tensor) -> cute.Tensor:
    """A wgmma accumulator ((2, 2, V), M, N) seen as (rows, cols) of this thread.

    In an SM90 accumulator fragment mode 0 is (column pair, row +8, column group of 8);
    softmax wants rows first, so regroup as ((row +8, M), (column pair, group, N)).
    """
    flat = cute.make_layout(acc.layout.shape)
    shape = (
        (flat.shape[0][1], flat.shape[1]),
        (flat.shape[0][0], flat.shape[0][2], flat.shape[2]),
    )
    stride = (
        (flat.stride[0][1], flat.stride[1]),
        (flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))


def _as_a_operand(acc: cute.Tensor) -> cute.Tensor:
    """An accumulator ((2, 2, V), M, N) regrouped as a register A operand ((2, 2, 2), M, (V/2, N)).

    The k=16 slice of a bf16 wgmma A fragment is two column groups of 8, so pairs of
    accumulator column groups form one A k-block; no data moves, only the view.
    """
    split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    layout = cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
            split.shape[1],
            (split.shape[0][2][1], split.shape[2]),
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
            split.stride[1],
            (split.stride[0][2][1], split.stride[2]),
        ),
    )
    return cute.make_tensor(acc.iterator, layout)


@cute.jit
def issue_wgmma(tiled_mma, acc, tA, tB, zero_init: cutlass.Constexpr[bool]):
    """Issue one warpgroup GEMM over all k-blocks and commit it; does not wait."""
    warpgroup.fence()
    # A fresh atom: its ACCUMULATE field is mutated per k-block below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for kb in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def tile_bits(words: cute.Tensor, tile: Int32) -> Uint32:
    """The 2 state bits of tile `tile` in a row (or column) of packed tile words: bit 0
    compute, bit 1 masked (16 tiles per uint32 word)."""
    word = words[tile // 16]
    return (word >> Uint32(2 * (tile % 16))) & Uint32(3)
