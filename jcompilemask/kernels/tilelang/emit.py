"""Expr / Pred trees -> TileLang expression text (the leaves of the generated kernels).

The text is plain Python over a namespace ``T`` (``tilelang.language`` on the GPU, the
:mod:`.mock` interpreter on the CPU), so one emitted kernel serves both. The semantics
are the evaluator's (``jcompilemask.spec.evaluate``): int32 values, floor division and
modulo, a divisor that is not a positive constant is ``max(b, 1)``, segment reads clamp
the position to ``[0, N)``.

Leaf names used by the generated code:

* ``q`` (or another name, for binary searches), ``h``, ``q_len``, ``kv_len``;
* ``S_<name>`` a scalar, ``V_<name>_<i>`` a vector entry (loaded once per block),
  ``M_<name>[b, i]`` a vector entry at a run-time index (``vec[seg.id(q)]``);
* ``G_<name>_<field>[b, pos]`` a segment run table, ``NT_<name>`` its length.
"""
from __future__ import annotations

from ...spec.expr import (And, BinOp, BoolConst, Cmp, Const, Expr, Index, Length, Not, Or,
                          Pred, walk)
from ...spec.metadata import Scalar, SegRead, VectorElem, VectorRead

__all__ = ["ExprEmitter", "leaves_of", "uses_q"]

_CMP = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}


def uses_q(node) -> bool:
    return any(isinstance(n, Index) and n.name == "q" for n in walk(node))


def leaves_of(nodes) -> tuple[set, set, set]:
    """(scalar names, (vector name, index) pairs, (segment name, field) pairs) read."""
    scalars, elems, segs = set(), set(), set()
    for node in nodes:
        if node is None:
            continue
        for n in walk(node):
            if isinstance(n, Scalar):
                scalars.add(n.name)
            elif isinstance(n, VectorElem):
                elems.add((n.decl.name, n.index))
            elif isinstance(n, SegRead):
                segs.add((n.decl.name, n.field))
    return scalars, elems, segs


class ExprEmitter:
    """Emit one tree as a TileLang expression string.

    Args:
      q: the name the row index ``q`` is bound to in the surrounding code.
    """

    def __init__(self, q: str = "q"):
        self.q = q

    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            return f"T.int32({e.value})"
        if isinstance(e, Index):
            if e.name == "q":
                return self.q
            if e.name == "h":
                return "h"
            raise ValueError(f"index {e.name!r} cannot appear in a lowered bound")
        if isinstance(e, Length):
            return e.name
        if isinstance(e, Scalar):
            return f"S_{e.name}"
        if isinstance(e, VectorElem):
            return f"V_{e.decl.name}_{e.index}"
        if isinstance(e, VectorRead):      # vec[e]: the entry clamp(e, 0, R - 1)
            idx = self.expr(e.index)
            top = e.decl.size - 1
            return (f"M_{e.decl.name}[b, T.min(T.max({idx}, T.int32(0)), "
                    f"T.int32({top}))]")
        if isinstance(e, SegRead):
            pos = self.expr(e.pos)
            n = f"NT_{e.decl.name}"
            return (f"G_{e.decl.name}_{e.field}[b, T.min(T.max({pos}, T.int32(0)), "
                    f"{n} - 1)]")
        if isinstance(e, BinOp):
            a, b = self.expr(e.a), self.expr(e.b)
            op = e.op
            if op in ("+", "-", "*"):
                return f"({a} {op} {b})"
            if op in ("//", "%"):
                if not (isinstance(e.b, Const) and e.b.value > 0):
                    b = f"T.max({b}, T.int32(1))"   # a non-positive divisor acts as 1
                fn = "floordiv" if op == "//" else "floormod"
                return f"T.{fn}({a}, {b})"
            if op in ("min", "max"):
                return f"T.{op}({a}, {b})"
        raise TypeError(f"cannot emit expression node {e!r}")

    def pred(self, p: Pred) -> str:
        if isinstance(p, BoolConst):
            return "T.bool(True)" if p.value else "T.bool(False)"
        if isinstance(p, Cmp):
            return f"({self.expr(p.a)} {_CMP[p.op]} {self.expr(p.b)})"
        if isinstance(p, (And, Or)):
            fn = "T.And" if isinstance(p, And) else "T.Or"
            out = self.pred(p.terms[0])
            for t in p.terms[1:]:
                out = f"{fn}({out}, {self.pred(t)})"
            return out
        if isinstance(p, Not):
            return f"T.Not({self.pred(p.term)})"
        raise TypeError(f"cannot emit predicate node {p!r}")

    def clamp(self, e: Expr, hi: str) -> str:
        """``min(max(e, 0), hi)`` -- interval endpoints and region bounds."""
        return f"T.min(T.max({self.expr(e)}, T.int32(0)), {hi})"
