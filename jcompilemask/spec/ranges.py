"""int32 range analysis of MaskSpec expressions (interval arithmetic over the tree).

Every evaluator computes mask expressions in int32 (JAX's default integer, and the type of
the kernels' indices), where an overflow wraps silently: ``q * 1000000 // 1000000`` is
not ``q`` past row 2147. So before anything is evaluated for given lengths, each node of
each expression is bounded from

* ``q`` in [0, q_len), ``k`` in [0, kv_len), ``h`` in [0, mask heads), the lengths
  themselves;
* metadata in their declared ``[min, max]`` (an undeclared bound is the int32 limit:
  values outside int32 are rejected eagerly and saturate inside ``jit``), segment
  ``start`` / ``end`` / ``run_start`` / ``run_end`` in [0, N] and ``id`` anywhere in
  int32, ``vec[e]`` in the vector's declared range;

and a node whose range can leave int32 raises :class:`Int32RangeError`, naming the
expression, its range and the fix. Interval arithmetic forgets that two operands are the
same value, which matters for one common idiom, rounding down to a multiple:
``a // g * g`` lies in ``[a - g + 1, a]`` whatever ``g`` is, and is bounded that way.

>>> from jcompilemask.spec import Region, MaskSpec, q, k, q_len
>>> spec = MaskSpec([Region((0, q_len), k <= q * 1000000 // 1000000)])
>>> spec.as_dense(None, 8, 8).shape
(1, 1, 8, 8)
>>> spec.as_dense(None, 4096, 4096)
Traceback (most recent call last):
...
jcompilemask.spec.ranges.Int32RangeError: q * 1000000 can reach 4095000000 ...
"""
from __future__ import annotations

from .expr import (And, BinOp, BoolConst, Cmp, Const, Index, Length, Not, Or)
from .metadata import Scalar, SegRead, VectorElem, VectorRead

__all__ = ["Int32RangeError", "INT32_MIN", "INT32_MAX", "expr_range", "check_int32"]

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


class Int32RangeError(ValueError):
    """An expression whose value can leave int32 for the declared ranges and lengths."""


def _static(bound, lens, default):
    if bound is None:
        return default
    from .maskspec import _eval_static
    return _eval_static(bound, lens)


def _decl_range(decl, lens):
    return (_static(decl.min, lens, INT32_MIN), _static(decl.max, lens, INT32_MAX))


def _floordiv_range(a, b):
    (alo, ahi), (blo, bhi) = a, (max(b[0], 1), max(b[1], 1))
    c = [alo // blo, alo // bhi, ahi // blo, ahi // bhi]
    return min(c), max(c)


def _round_down_range(a, b):
    """Range of ``a // g * g`` for a in a, g in b (g < 1 acts as 1): in [a - g + 1, a]."""
    (alo, ahi), bhi = a, max(b[1], 1)
    hi = ahi
    if alo >= 0:
        lo = 0
    else:
        x = -alo            # -(ceil(x / g) * g): x + g - 1 when g < x, g when g >= x
        lo = -(x + bhi - 1) if bhi < x else -max(2 * x - 2, bhi)
    return lo, hi


def _round_down_operands(e):
    """(a, g) when ``e`` is ``a // g * g`` or ``g * (a // g)``, else None."""
    if not (isinstance(e, BinOp) and e.op == "*"):
        return None
    for div, mul in ((e.a, e.b), (e.b, e.a)):
        if isinstance(div, BinOp) and div.op == "//" and div.b.key() == mul.key():
            return div.a, div.b
    return None


class _Ranges:
    def __init__(self, q_len, kv_len, mask_heads, where, check):
        self.lens = {"q_len": q_len, "kv_len": kv_len}
        self.n_tok = max(q_len, kv_len)
        self.mask_heads = mask_heads
        self.where, self.check = where, check
        self.cache = {}

    def __call__(self, e):
        key = e.key()
        r = self.cache.get(key)
        if r is None:
            r = self.cache[key] = self._range(e)
            if self.check and not (INT32_MIN <= r[0] and r[1] <= INT32_MAX):
                self._raise(e, r)
        return r

    def _range(self, e):
        if isinstance(e, Const):
            return e.value, e.value
        if isinstance(e, Length):
            n = self.lens[e.name]
            return n, n
        if isinstance(e, Index):
            top = {"q": self.lens["q_len"], "k": self.lens["kv_len"], "h": self.mask_heads}
            return 0, max(top[e.name] - 1, 0)
        if isinstance(e, Scalar):
            return _decl_range(e, self.lens)
        if isinstance(e, VectorElem):
            return _decl_range(e.decl, self.lens)
        if isinstance(e, VectorRead):
            self(e.index)
            return _decl_range(e.decl, self.lens)
        if isinstance(e, SegRead):
            self(e.pos)
            return (INT32_MIN, INT32_MAX) if e.field == "id" else (0, self.n_tok)
        if isinstance(e, BinOp):
            pair = _round_down_operands(e)
            if pair is not None:
                self(e.a), self(e.b)            # the operands must fit too
                return _round_down_range(self(pair[0]), self(pair[1]))
            (alo, ahi), (blo, bhi) = self(e.a), self(e.b)
            if e.op == "+":
                return alo + blo, ahi + bhi
            if e.op == "-":
                return alo - bhi, ahi - blo
            if e.op == "*":
                c = [alo * blo, alo * bhi, ahi * blo, ahi * bhi]
                return min(c), max(c)
            if e.op == "//":
                return _floordiv_range((alo, ahi), (blo, bhi))
            if e.op == "%":
                return 0, max(bhi, 1) - 1
            if e.op == "min":
                return min(alo, blo), min(ahi, bhi)
            if e.op == "max":
                return max(alo, blo), max(ahi, bhi)
        raise TypeError(f"no range for {e!r}")

    def pred(self, p):
        if isinstance(p, Cmp):
            self(p.a), self(p.b)
        elif isinstance(p, (And, Or)):
            for t in p.terms:
                self.pred(t)
        elif isinstance(p, Not):
            self.pred(p.term)
        elif not isinstance(p, BoolConst):
            raise TypeError(f"not a predicate: {p!r}")

    def _raise(self, e, r):
        lo, hi = r
        reach = hi if hi > INT32_MAX else lo
        unbounded = sorted({n.name for n in _leaves(e) if isinstance(n, Scalar)
                            and (n.max is None or n.min is None)}
                           | {n.decl.name for n in _leaves(e)
                              if isinstance(n, (VectorElem, VectorRead))
                              and (n.decl.max is None or n.decl.min is None)})
        hint = ("rewrite it so that every intermediate value stays within int32 (e.g. "
                "divide before multiplying)")
        if unbounded:
            hint = (f"declare the range of metadata {unbounded} (e.g. Scalar(name, "
                    "max=q_len)): without one it may be anything in int32; or " + hint)
        raise Int32RangeError(
            f"{e} can reach {reach} (range [{lo}, {hi}]) in {self.where} at q_len="
            f"{self.lens['q_len']}, kv_len={self.lens['kv_len']}, which overflows int32 "
            f"(mask expressions are evaluated in int32 and would wrap silently): {hint}")


def _leaves(e):
    from .expr import walk
    return walk(e)


def expr_range(e, q_len: int, kv_len: int, mask_heads: int = 1) -> tuple[int, int]:
    """(min, max) bound of an expression's value for these lengths (no int32 check)."""
    return _Ranges(q_len, kv_len, mask_heads, "", check=False)(e)


def check_int32(items, q_len: int, kv_len: int, mask_heads: int = 1):
    """Raise :class:`Int32RangeError` if a node of an expression or predicate can leave
    int32. ``items``: (description, Expr or Pred) pairs, e.g. ``("region 0 rule", p)``."""
    from .expr import Expr
    for where, node in items:
        r = _Ranges(q_len, kv_len, mask_heads, where, check=True)
        if isinstance(node, Expr):
            r(node)
        else:
            r.pred(node)
