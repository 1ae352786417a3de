"""sympy bridge: conversion of MaskSpec expressions, proofs, linear normal form, monotonicity.

sympy answers three questions for the lowering — is an atom linear in a variable (and
with which coefficient), is an inequality between two expressions provable for every
admissible metadata value, and what is a readable form of a bound. Code generation never
uses sympy's output: bounds are rebuilt as :class:`~jcompilemask.spec.expr.Expr` trees
(whose evaluation semantics are fixed), so a sympy rewrite can never change a result.
"""
from __future__ import annotations

from typing import Callable

import sympy as sp

from ..spec.expr import BinOp, Const, Expr, Index, Length, substitute, walk
from ..spec.metadata import Scalar, SegRead, VectorElem, VectorRead

__all__ = ["SymCtx", "provably", "linear_coeff", "lin_normalize", "monotone"]


class SymCtx:
    """sympy symbols for the leaves of one MaskSpec, with their known signs.

    ``q``, ``k``, ``h`` are non-negative integers; ``q_len``/``kv_len`` positive;
    scalars and vector entries integers whose declared minimum gives their sign; segment
    reads are applications of undefined functions (non-negative integers).
    """

    def __init__(self, spec=None, row_lo: Expr | None = None):
        self.spec = spec
        self._syms: dict = {}
        self.row_lo = row_lo
        self.Min, self.Max = sp.Min, sp.Max

    def sym(self, name, **assume):
        s = self._syms.get(name)
        if s is None:
            s = self._syms[name] = sp.Symbol(name, integer=True, **assume)
        return s

    def _decl_sign(self, decl):
        lo = getattr(decl, "min", None)
        if isinstance(lo, Const):
            if lo.value >= 1:
                return {"positive": True}
            if lo.value >= 0:
                return {"nonnegative": True}
        if isinstance(lo, Length):
            return {"positive": True}
        return {}

    def E(self, e: Expr):
        """sympy image of ``e`` (with ``q -> row_lo + t`` when a row context is set)."""
        return _to_sympy(e, self)


def _to_sympy(e: Expr, ctx: SymCtx):
    if isinstance(e, Const):
        return sp.Integer(e.value)
    if isinstance(e, Index):
        if e.name == "q" and ctx.row_lo is not None:
            return _to_sympy(ctx.row_lo, ctx) + ctx.sym("t_row", nonnegative=True)
        return ctx.sym(e.name, nonnegative=True)
    if isinstance(e, Length):
        return ctx.sym(e.name, positive=True)
    if isinstance(e, Scalar):
        return ctx.sym(e.name, **ctx._decl_sign(e))
    if isinstance(e, VectorElem):
        return ctx.sym(f"{e.decl.name}_{e.index}", **ctx._decl_sign(e.decl))
    if isinstance(e, VectorRead):
        f = sp.Function(f"{e.decl.name}_at", integer=True, **ctx._decl_sign(e.decl))
        return f(_to_sympy(e.index, ctx))
    if isinstance(e, SegRead):
        f = sp.Function(f"{e.decl.name}_{e.field}", integer=True,
                        nonnegative=(e.field != "id"))
        return f(_to_sympy(e.pos, ctx))
    if isinstance(e, BinOp):
        a, b = _to_sympy(e.a, ctx), _to_sympy(e.b, ctx)
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*":
            return a * b
        if e.op in ("//", "%"):
            if not (isinstance(e.b, Const) and e.b.value > 0):
                b = sp.Max(b, 1)
            return sp.floor(a / b) if e.op == "//" else sp.Mod(a, b)
        if e.op == "min":
            return sp.Min(a, b)
        if e.op == "max":
            return sp.Max(a, b)
    raise TypeError(f"no sympy form for {e!r}")


def provably(fn: Callable[[SymCtx], object], spec=None, row_lo: Expr | None = None) -> bool:
    """True iff sympy proves the relation ``fn(ctx)`` for all admissible values."""
    ctx = SymCtx(spec, row_lo)
    try:
        rel = fn(ctx)
    except (TypeError, ValueError):
        return False
    return rel is sp.true or rel is True


def provably_le(a: Expr, b: Expr, spec=None, row_lo: Expr | None = None) -> bool:
    """``a <= b`` for every admissible value (and every row of the context)."""
    def rel(S):
        d = S.E(b) - S.E(a)
        if _refuted(d):
            return sp.false
        d = sp.simplify(d)
        return sp.true if d.is_nonnegative else sp.false
    return provably(rel, spec, row_lo)


def _refuted(d, trials: int = 16) -> bool:
    """True if ``d < 0`` at some integer point that respects every symbol's sign
    assumption -- exactly the facts sympy may use, so a relation refuted here is one
    sympy cannot prove. A cheap first step: ``simplify`` on the floor / min / max
    bounds of a 2-D window takes seconds, and most candidate merges are false."""
    import random
    from sympy.core.function import AppliedUndef
    rng = random.Random(0)
    funcs = sorted(d.atoms(AppliedUndef), key=sp.default_sort_key)
    syms = sorted(d.free_symbols, key=sp.default_sort_key)

    def draw(x, top):
        if x.is_positive:
            return rng.randint(1, top)
        if x.is_nonnegative:
            return rng.randint(0, top)
        return rng.randint(-top, top)

    for n in range(trials):
        top = (3, 40, 1000)[n % 3]
        try:
            v = d.xreplace({f: sp.Integer(draw(f, top)) for f in funcs})
            v = v.xreplace({x: sp.Integer(draw(x, top)) for x in syms})
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if v.is_Number and v < 0:
            return True
    return False


# ---------------------------------------------------------------------------------------
# Linear normal form over + - and scaling by integer constants.
# ---------------------------------------------------------------------------------------
def _lin(e: Expr) -> tuple[dict, int]:
    """``e`` as ({atom key: (coeff, atom)}, const): exact, purely syntactic."""
    if isinstance(e, Const):
        return {}, e.value
    if isinstance(e, BinOp) and e.op in ("+", "-"):
        ta, ca = _lin(e.a)
        tb, cb = _lin(e.b)
        s = 1 if e.op == "+" else -1
        out = dict(ta)
        for key, (c, atom) in tb.items():
            c0 = out.get(key, (0, atom))[0]
            out[key] = (c0 + s * c, atom)
        return {k_: v for k_, v in out.items() if v[0] != 0}, ca + s * cb
    if isinstance(e, BinOp) and e.op == "*":
        for x, y in ((e.a, e.b), (e.b, e.a)):
            if isinstance(x, Const):
                t, c = _lin(y)
                return {k_: (v[0] * x.value, v[1]) for k_, v in t.items()
                        if v[0] * x.value != 0}, c * x.value
    atom = _normalize_children(e)
    return {atom.key(): (1, atom)}, 0


def _normalize_children(e: Expr) -> Expr:
    kids = e.children()
    if not kids:
        return e
    return e.rebuild(tuple(lin_normalize(c) for c in kids))


def _from_lin(terms: dict, const: int) -> Expr:
    pos = [(c, a) for c, a in terms.values() if c > 0]
    neg = [(-c, a) for c, a in terms.values() if c < 0]
    out: Expr | None = None
    for c, a in pos:
        t = a if c == 1 else BinOp("*", Const(c), a)
        out = t if out is None else BinOp("+", out, t)
    if out is None:
        out = Const(0) if not neg else None
    for c, a in neg:
        t = a if c == 1 else BinOp("*", Const(c), a)
        out = BinOp("-", Const(0), t) if out is None else BinOp("-", out, t)
    if const > 0:
        out = BinOp("+", out, Const(const)) if not _is_zero(out) else Const(const)
    elif const < 0:
        out = BinOp("-", out, Const(-const)) if not _is_zero(out) else Const(const)
    return out


def _is_zero(e):
    return isinstance(e, Const) and e.value == 0


def lin_normalize(e: Expr) -> Expr:
    """Collect like terms and constants: ``0 - (0 - q) - 1 + 2`` -> ``q + 1``."""
    if isinstance(e, BinOp) and e.op in ("min", "max", "//", "%"):
        return _normalize_children(e)
    t, c = _lin(e)
    return _from_lin(t, c)


def linear_coeff(e: Expr, var: str, spec=None):
    """If ``e`` is ``c * var + r`` with a non-zero int ``c`` and ``r`` free of ``var``,
    return ``(c, r)`` (``r`` as a normalised Expr); else ``None``.

    Syntactic first (exact); where ``var`` hides inside a non-linear node, sympy decides
    (``(2*k + 2*q) // 2`` is linear), and ``r`` is then ``e`` with ``var := 0``.
    """
    uses = lambda x: any(isinstance(n, Index) and n.name == var for n in walk(x))  # noqa
    if not uses(e):
        return None
    terms, const = _lin(e)
    coeff, rest = 0, {}
    hidden = False
    for key, (c, atom) in terms.items():
        if isinstance(atom, Index) and atom.name == var:
            coeff += c
        elif uses(atom):
            hidden = True
        else:
            rest[key] = (c, atom)
    if not hidden:
        return (coeff, _from_lin(rest, const)) if coeff != 0 else None
    ctx = SymCtx(spec)
    try:
        se = sp.expand(ctx.E(e))
        v = ctx.sym(var, nonnegative=True)
        c = sp.diff(se, v)
        if not (c.is_Integer and c != 0):
            return None
        if (se - c * v).has(v):
            return None
        r = sp.simplify(se - c * v)
        if r.has(v):
            return None
    except Exception:  # sympy may refuse derivatives of floor/Mod: not linear for us
        return None
    zero = substitute(e, lambda n: Const(0) if isinstance(n, Index) and n.name == var
                      else None)
    return int(c), lin_normalize(zero)


# ---------------------------------------------------------------------------------------
# Monotonicity in q, by structural rules over the expression tree
# ---------------------------------------------------------------------------------------
# The column view (visible query rows per key) exists when every interval bound L_m(q),
# U_m(q) is non-decreasing in q over its region: then {q : L_m(q) <= j < U_m(q)} is one
# contiguous row range per key j, found by binary search. sympy alone rarely proves this
# for floor division or min/max, so these rules do: a sum of non-decreasing terms, scaling
# by a non-negative constant or metadata value, floor division by a positive value, and
# min/max of non-decreasing terms are non-decreasing. ``%`` is not monotone: bounds written
# with max/min instead (a 2-D window's row start as max(q + dy*w - hw, row_start) rather
# than row_start + max(x - hw, 0)) keep the column view.
CONST, INC, DEC = "const", "inc", "dec"


def _flip(m):
    return {INC: DEC, DEC: INC}.get(m, m)


def _add(a, b):
    if a is None or b is None:
        return None
    if a == CONST:
        return b
    if b == CONST or a == b:
        return a
    return None


def _nonneg(e: Expr) -> bool:
    if isinstance(e, Const):
        return e.value >= 0
    if isinstance(e, Length):
        return True
    if isinstance(e, Scalar):
        return isinstance(e.min, Const) and e.min.value >= 0
    if isinstance(e, (VectorElem, VectorRead)):
        return isinstance(e.decl.min, Const) and e.decl.min.value >= 0
    return False


def monotone(e: Expr, var: str = "q"):
    """``"const"``, ``"inc"`` (non-decreasing), ``"dec"`` in ``var``, or None (unknown)."""
    if isinstance(e, Index):
        return INC if e.name == var else CONST
    if isinstance(e, (Const, Length, Scalar, VectorElem)):
        return CONST
    if isinstance(e, SegRead):
        m = monotone(e.pos, var)
        if m == CONST:
            return CONST
        if e.field in ("start", "end", "run_start", "run_end") and m == INC:
            return INC     # run bounds never decrease with the position (padding too)
        return None
    if isinstance(e, VectorRead):
        return CONST if monotone(e.index, var) == CONST else None   # a looked-up value
    if isinstance(e, BinOp):
        ma, mb = monotone(e.a, var), monotone(e.b, var)
        if e.op == "+":
            return _add(ma, mb)
        if e.op == "-":
            return _add(ma, _flip(mb))
        if e.op == "*":
            for x, mx, my in ((e.a, ma, mb), (e.b, mb, ma)):
                if mx == CONST and my is not None:
                    if my == CONST:
                        return CONST
                    if _nonneg(x):
                        return my
                    if isinstance(x, Const) and x.value < 0:
                        return _flip(my)
            return None
        if e.op == "//":
            # the run-time divisor is max(b, 1) > 0: floor(a / d) keeps a's direction
            return ma if mb == CONST else None
        if e.op == "%":
            return CONST if (ma == CONST and mb == CONST) else None
        if e.op in ("min", "max"):
            return _add(ma, mb)
    return None

