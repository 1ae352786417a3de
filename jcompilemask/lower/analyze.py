"""Lowering of one Region's rule to a union of visible key intervals.

Steps (paper §3.2.2): push negations to the atoms; rewrite to DNF (sympy's ``to_dnf``
over atom symbols); per conjunct, solve every atom that is linear in ``k`` into a bound
(``k >= L`` or ``k < U``; the interval is [max of lowers, min of uppers)) and keep atoms
without ``k`` as a row condition; merge intervals that sympy proves overlapping or
adjacent. An atom with ``k`` inside a non-linear function (``k // w``, ``k * k``,
``seg.id(k)``) cannot be solved: the region falls back to its predicate.

The backward (per key column) view needs, per interval, bounds non-decreasing in ``q``
and row conditions that select a contiguous row range (atoms free of ``q``, or linear in
``q``); :func:`lower_region` records whether that holds and why not.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import sympy as sp

from ..spec.expr import (TRUE, And, BoolConst, Cmp, Const, Expr, Index, Not, Or, Pred,
                         kv_len, maximum, minimum, walk)
from .segments import rewrite_id_atoms
from .symbolic import CONST, INC, linear_coeff, lin_normalize, monotone, provably_le

__all__ = ["Interval", "LoweredRegion", "lower_region", "MAX_CONJUNCTS"]

MAX_CONJUNCTS = 64   # a DNF wider than this is not a "bounded number of intervals"


@dataclasses.dataclass(frozen=True, eq=False)
class Interval:
    """Visible keys ``[lo, hi)`` for rows where ``cond`` holds (``lo``/``hi`` already
    clamped to ``[0, kv_len]``). ``q_lo``/``q_hi`` are extra row bounds solved from
    row conditions linear in ``q`` (None: unbounded); ``row_flag`` is the q-free part."""

    lo: Expr
    hi: Expr
    cond: Pred = dataclasses.field(default_factory=lambda: TRUE)
    q_lo: Optional[Expr] = None
    q_hi: Optional[Expr] = None
    row_flag: Pred = dataclasses.field(default_factory=lambda: TRUE)
    bwd_ok: bool = True

    def key(self):
        return ("iv", self.lo.key(), self.hi.key(), self.cond.key())

    def __str__(self):
        s = f"[{self.lo}, {self.hi})"
        if not (isinstance(self.cond, BoolConst) and self.cond.value):
            s += f"  if {self.cond}"
        return s


@dataclasses.dataclass(frozen=True, eq=False)
class LoweredRegion:
    intervals: tuple[Interval, ...]
    fallback: Optional[str] = None          # why the region keeps its predicate
    bwd_reason: Optional[str] = None        # why no column view (None: derived)

    @property
    def bwd_ok(self) -> bool:
        return self.fallback is None and self.bwd_reason is None


def _uses(node, name) -> bool:
    return any(isinstance(n, Index) and n.name == name for n in walk(node))


def _nnf(p: Pred, neg: bool = False) -> Pred:
    """Negation normal form; ``==``/``!=`` on k-atoms split into ordered comparisons."""
    if isinstance(p, BoolConst):
        return BoolConst(p.value != neg)
    if isinstance(p, Not):
        return _nnf(p.term, not neg)
    if isinstance(p, And):
        parts = [_nnf(t, neg) for t in p.terms]
        return Or.of(*parts) if neg else And.of(*parts)
    if isinstance(p, Or):
        parts = [_nnf(t, neg) for t in p.terms]
        return And.of(*parts) if neg else Or.of(*parts)
    if isinstance(p, Cmp):
        c = p.negated() if neg else p
        if c.op == "==" and _uses(c, "k"):
            return And.of(Cmp("<=", c.a, c.b), Cmp(">=", c.a, c.b))
        if c.op == "!=" and _uses(c, "k"):
            return Or.of(Cmp("<", c.a, c.b), Cmp(">", c.a, c.b))
        return c
    raise TypeError(f"not a predicate: {p!r}")


def _dnf(p: Pred) -> list[list[Pred]] | None:
    """Conjuncts (lists of atoms) of ``p`` in NNF, via sympy; None if too wide."""
    atoms: dict = {}

    def to_sym(x):
        if isinstance(x, BoolConst):
            return sp.true if x.value else sp.false
        if isinstance(x, And):
            return sp.And(*[to_sym(t) for t in x.terms])
        if isinstance(x, Or):
            return sp.Or(*[to_sym(t) for t in x.terms])
        key = x.key()
        if key not in atoms:
            atoms[key] = (sp.Symbol(f"a{len(atoms)}"), x)
        return atoms[key][0]

    expr = to_sym(p)
    if expr is sp.false:
        return []
    if expr is sp.true:
        return [[]]
    by_sym = {s: atom for s, atom in atoms.values()}
    # Size guard before expanding: product of the Or-widths bounds the conjunct count.
    if _dnf_width(p) > MAX_CONJUNCTS:
        return None
    dnf = sp.to_dnf(expr, simplify=False)
    terms = dnf.args if isinstance(dnf, sp.Or) else (dnf,)
    out, seen = [], set()
    for t in terms:
        lits = t.args if isinstance(t, sp.And) else (t,)
        conj = [by_sym[s] for s in lits]
        key = tuple(sorted(repr(a.key()) for a in conj))
        if key not in seen:
            seen.add(key)
            out.append(conj)
    return out


def _dnf_width(p: Pred) -> int:
    if isinstance(p, Or):
        return sum(_dnf_width(t) for t in p.terms)
    if isinstance(p, And):
        w = 1
        for t in p.terms:
            w *= _dnf_width(t)
        return w
    return 1


def _solve(atom: Cmp, var: str, spec):
    """A ``var``-atom as a bound: ("lo", L) for var >= L, ("hi", U) for var < U; or None."""
    lin = linear_coeff(BinOpSub(atom.a, atom.b), var, spec)
    if lin is None:
        return None
    c, r = lin                                       # atom: c*var + r  op  0
    op = atom.op
    if op == "<":
        pass
    elif op == "<=":
        r = r - 1
    elif op == ">":
        c, r = -c, Const(0) - r
    elif op == ">=":
        c, r = -c, Const(0) - r - 1
    else:
        return None
    # now c*var + r < 0
    if c > 0:   # var < ceil(-r / c) = -(r // c)
        bound = Const(0) - r if c == 1 else Const(0) - (r // c)
        return "hi", lin_normalize(bound)
    cc = -c     # var > r / cc  <=>  var >= r // cc + 1
    bound = r + 1 if cc == 1 else (r // cc) + 1
    return "lo", lin_normalize(bound)


def _row_bounds(atom, spec):
    """A row condition linear in ``q`` as row bounds [("lo", L) / ("hi", U)], or None.

    ``q == e`` (a row equal to a metadata value: a special token's row) is the range
    ``[e, e + 1)``: both of its ordered halves, so the column view keeps it."""
    if not isinstance(atom, Cmp):
        return None
    halves = ([Cmp("<=", atom.a, atom.b), Cmp(">=", atom.a, atom.b)] if atom.op == "=="
              else [atom])
    out = [_solve(c, "q", spec) for c in halves]
    return None if any(s is None for s in out) else out


def BinOpSub(a: Expr, b: Expr) -> Expr:
    return lin_normalize(a - b)


def _conjunct_interval(conj: list[Pred], spec, region):
    """One DNF conjunct -> Interval, or a fallback reason string."""
    lows, highs, conds = [], [], []
    for atom in conj:
        if isinstance(atom, BoolConst):
            if not atom.value:
                return None
            continue
        if not _uses(atom, "k"):
            conds.append(atom)
            continue
        solved = _solve(atom, "k", spec)
        if solved is None:
            return f"atom `{atom}` is not linear in k (k sits inside a non-linear term)"
        (lows if solved[0] == "lo" else highs).append(solved[1])
    # Clamping to [0, kv_len) happens in the preprocess, which keeps bounds readable.
    lo: Expr = lows[0] if lows else Const(0)
    for x in lows[1:]:
        lo = maximum(lo, x)
    hi: Expr = highs[0] if highs else kv_len
    for x in highs[1:]:
        hi = minimum(hi, x)
    cond = And.of(*conds)
    # Row conditions for the column view: q-free atoms -> flag; q-linear -> row bounds.
    q_lo, q_hi, flags, bwd_ok = None, None, [], True
    for atom in conds:
        if not _uses(atom, "q"):
            flags.append(atom)
            continue
        bounds = _row_bounds(atom, spec)
        if bounds is None:
            bwd_ok = False
            continue
        for side, b in bounds:
            if side == "lo":
                q_lo = b if q_lo is None else maximum(q_lo, b)
            else:
                q_hi = b if q_hi is None else minimum(q_hi, b)
    if not (monotone(lo) in (CONST, INC) and monotone(hi) in (CONST, INC)):
        bwd_ok = False
    return Interval(lo, hi, cond, q_lo, q_hi, And.of(*flags), bwd_ok)


def _try_merge(a: Interval, b: Interval, spec, region) -> Interval | None:
    """Union of two intervals when sympy proves they overlap or touch (same condition)."""
    if a.cond.key() != b.cond.key():
        return None
    if a.lo.key() == b.lo.key() and a.hi.key() == b.hi.key():
        return a
    row_lo = region.rows[0]
    if not (provably_le(b.lo, a.hi, spec, row_lo) and provably_le(a.lo, b.hi, spec, row_lo)):
        return None
    lo = a.lo if provably_le(a.lo, b.lo, spec, row_lo) else (
        b.lo if provably_le(b.lo, a.lo, spec, row_lo) else minimum(a.lo, b.lo))
    hi = a.hi if provably_le(b.hi, a.hi, spec, row_lo) else (
        b.hi if provably_le(a.hi, b.hi, spec, row_lo) else maximum(a.hi, b.hi))
    ok = a.bwd_ok and b.bwd_ok and monotone(lo) in (CONST, INC) and monotone(hi) in (CONST, INC)
    return dataclasses.replace(a, lo=lo, hi=hi, bwd_ok=ok)


def lower_region(region, spec) -> LoweredRegion:
    """Lower ``region.visible`` to intervals (or record why it falls back)."""
    nnf = _nnf(rewrite_id_atoms(region.visible))   # seg.id(k) == seg.id(q): one run
    conjuncts = _dnf(nnf)
    if conjuncts is None:
        return LoweredRegion((), fallback=f"DNF has more than {MAX_CONJUNCTS} conjuncts")
    ivs: list[Interval] = []
    for conj in conjuncts:
        iv = _conjunct_interval(conj, spec, region)
        if iv is None:
            continue
        if isinstance(iv, str):
            return LoweredRegion((), fallback=iv)
        ivs.append(iv)
    # Merge pairwise until no proof applies (K is small: quadratic is fine).
    changed = True
    while changed:
        changed = False
        for i in range(len(ivs)):
            for j in range(i + 1, len(ivs)):
                m = _try_merge(ivs[i], ivs[j], spec, region)
                if m is not None:
                    ivs[i] = m
                    del ivs[j]
                    changed = True
                    break
            if changed:
                break
    reason = None
    for n, iv in enumerate(ivs):
        if not iv.bwd_ok:
            reason = (f"interval {n} {iv}: bounds not provably non-decreasing in q, or a "
                      "row condition that does not select a contiguous row range")
            break
    return LoweredRegion(tuple(ivs), None, reason)
