"""Lowering of one Region's rule to a union of visible key intervals (hull + residual).

Steps (paper §3.2.2, extended by issue 16):

1. Push negations to the atoms (NNF). ``==`` / ``!=`` atoms on ``k`` are split into
   ordered comparisons when those solve (``k // 8 == q // 8`` -> two bounds); otherwise
   they stay whole (``k % 4 == 1`` is kept as it is, for the residual). A comparison of
   ``min`` / ``max`` with ``k`` inside splits into its two sides (``min(k, q) >= 3`` is
   ``(k >= 3) & (q >= 3)``).
2. DNF (sympy's ``to_dnf`` over atom symbols), one interval per conjunct.
3. Per conjunct: every atom that *solves* for ``k`` becomes a bound (``k >= L`` or
   ``k < U``): atoms linear in ``k``, and atoms whose key side is a floor division
   ``(a*k + s) // c`` (``c`` a positive constant or a metadata value; a non-positive
   run-time divisor acts as 1, as everywhere), solved exactly -- ``k // c < U`` holds iff
   ``k < U*c`` and ``k // c >= L`` iff ``k >= L*c``. The interval ``[max of lowers, min
   of uppers)`` is the conjunct's **hull**. Atoms without ``k`` are row conditions.
   Every other ``k``-atom (``k % c == r``, ``(q - k) % 2 == 0``, ``k * k <= q``,
   ``seg.id(k) == seg.id(q)``) goes into the conjunct's **residual**: a per-element
   predicate AND-ed with the hull. A conjunct with no solved bound has the hull
   ``[0, kv_len)``; a rule whose DNF is too wide is one conjunct, hull ``[0, kv_len)``,
   residual the whole rule.
4. Intervals with the same row condition and residual are merged when sympy proves they
   overlap or touch.
5. Intervals are packed into forward-table *slots*: two intervals may share a slot when
   their row conditions provably exclude each other, or when (equal residuals) they
   provably overlap or touch wherever both hold. A slot holds the union of its active
   intervals, so K (the slots of a region) is the most runs a row can need, not the
   number of conjuncts: an HSTU spelled as one region with row conditions lowers to K = 2.
   Intervals of disjoint mask heads are not grouped: the per-head assignment of the
   groups to table slots (:mod:`.slots`) gives each head its own K.

The backward (per key column) view needs, per interval, bounds non-decreasing in ``q``
and row conditions that select a contiguous row range (atoms free of ``q``, or linear in
``q``); :func:`lower_region` records whether that holds and why not. Residuals do not
stand in its way: the column view is the hull's, the residual applies to it as to rows.

>>> from jcompilemask.spec import MaskSpec, Region, q, k, q_len
>>> spec = MaskSpec([Region((0, q_len), (k // 64 <= q // 64) & ((q - k) % 2 == 0))])
>>> lr = lower_region(spec.regions[0], spec)
>>> print(lr.intervals[0])
[0, 64 * (q // 64) + 64)  and residual (q - k) % 2 == 0
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import sympy as sp

from ..spec.expr import (TRUE, And, BinOp, BoolConst, Cmp, Const, Expr, Index, Not, Or,
                         Pred, kv_len, maximum, minimum, walk)
from .segments import rewrite_id_atoms
from .symbolic import (CONST, INC, _lin, _from_lin, linear_coeff, lin_normalize, monotone,
                       provably_le)

__all__ = ["Interval", "LoweredRegion", "lower_region", "MAX_CONJUNCTS", "solve_k"]

MAX_CONJUNCTS = 64   # a DNF wider than this is not a "bounded number of intervals"


def _is_true(p: Pred) -> bool:
    return isinstance(p, BoolConst) and p.value


@dataclasses.dataclass(frozen=True, eq=False)
class Interval:
    """Visible keys ``[lo, hi)`` (the hull) AND ``residual`` for rows where ``cond``
    holds (``lo``/``hi`` are clamped to ``[0, kv_len]`` by the preprocess). ``q_lo`` /
    ``q_hi`` are extra row bounds solved from row conditions linear in ``q`` (None:
    unbounded); ``row_flag`` is the q-free part. ``residual`` is a predicate over ``q``,
    ``k``, ``h`` and metadata, TRUE when the hull is exact."""

    lo: Expr
    hi: Expr
    cond: Pred = dataclasses.field(default_factory=lambda: TRUE)
    q_lo: Optional[Expr] = None
    q_hi: Optional[Expr] = None
    row_flag: Pred = dataclasses.field(default_factory=lambda: TRUE)
    bwd_ok: bool = True
    residual: Pred = dataclasses.field(default_factory=lambda: TRUE)

    @property
    def has_residual(self) -> bool:
        return not _is_true(self.residual)

    def key(self):
        return ("iv", self.lo.key(), self.hi.key(), self.cond.key(), self.residual.key())

    def __str__(self):
        s = f"[{self.lo}, {self.hi})"
        if self.has_residual:
            s += f"  and residual {self.residual}"
        if not _is_true(self.cond):
            s += f"  if {self.cond}"
        return s


@dataclasses.dataclass(frozen=True, eq=False)
class LoweredRegion:
    """A region's intervals, their forward-table slots and what the lowering noted.

    ``slots[m]`` lists the intervals that share slot ``m`` of the forward table (one
    interval per slot unless their row conditions exclude each other or they overlap);
    ``residual_reason`` says why some interval keeps a residual predicate (None: the
    intervals are exact); ``bwd_reason`` why there is no column view (None: derived).
    """

    intervals: tuple[Interval, ...]
    slots: tuple[tuple[int, ...], ...] = None            # None: one interval per slot
    residual_reason: Optional[str] = None
    bwd_reason: Optional[str] = None

    def __post_init__(self):
        if self.slots is None:
            object.__setattr__(self, "slots", tuple((i,) for i in range(len(self.intervals))))

    @property
    def fallback(self) -> Optional[str]:
        """The former name of :attr:`residual_reason` (a region that keeps a
        per-element predicate: the GPU kernels leave it to the xla backend)."""
        return self.residual_reason

    @property
    def has_residual(self) -> bool:
        return any(iv.has_residual for iv in self.intervals)

    @property
    def shares_slots(self) -> bool:
        return any(len(s) > 1 for s in self.slots)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def bwd_ok(self) -> bool:
        return self.bwd_reason is None

    def slot_residual(self, m: int) -> Pred:
        """The residual of slot ``m``: per row, that of the interval that is active
        there (the members' residuals are equal where two can be active at once)."""
        members = [self.intervals[i] for i in self.slots[m]]
        if not any(iv.has_residual for iv in members):
            return TRUE
        if len(members) == 1:
            return members[0].residual
        return Or.of(*[And.of(iv.cond, iv.residual) for iv in members])


def _uses(node, name) -> bool:
    return any(isinstance(n, Index) and n.name == name for n in walk(node))


def _nnf(p: Pred, spec, neg: bool = False) -> Pred:
    """Negation normal form; ``==``/``!=`` on k-atoms split into ordered comparisons
    when both halves solve for ``k`` (else kept whole, as one residual atom)."""
    if isinstance(p, BoolConst):
        return BoolConst(p.value != neg)
    if isinstance(p, Not):
        return _nnf(p.term, spec, not neg)
    if isinstance(p, And):
        parts = [_nnf(t, spec, neg) for t in p.terms]
        return Or.of(*parts) if neg else And.of(*parts)
    if isinstance(p, Or):
        parts = [_nnf(t, spec, neg) for t in p.terms]
        return And.of(*parts) if neg else Or.of(*parts)
    if isinstance(p, Cmp):
        c = p.negated() if neg else p
        split = _split_minmax(c, spec)
        if split is not None:
            return _nnf(split, spec)
        if c.op in ("==", "!=") and _uses(c, "k"):
            le, ge = Cmp("<=", c.a, c.b), Cmp(">=", c.a, c.b)
            if solve_k(le, spec) is None or solve_k(ge, spec) is None:
                return c
            if c.op == "==":
                return And.of(le, ge)
            return Or.of(Cmp("<", c.a, c.b), Cmp(">", c.a, c.b))
        return c
    raise TypeError(f"not a predicate: {p!r}")


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _split_minmax(c: Cmp, spec) -> Pred | None:
    """``min(x, y) >= e`` as ``(x >= e) & (y >= e)`` (and the other seven forms), for an
    atom whose key side is a min / max with ``k`` inside and whose other side is free of
    ``k``, when the atom does not solve as it stands: ``min(k, q) >= 3`` is the interval
    ``k >= 3`` under the row condition ``q >= 3``."""
    if c.op not in _FLIP or solve_k(c, spec) is not None:
        return None
    op, x, e = c.op, c.a, c.b
    if _uses(e, "k"):
        op, x, e = _FLIP[op], e, x
    if _uses(e, "k") or not (isinstance(x, BinOp) and x.op in ("min", "max")):
        return None
    parts = (Cmp(op, x.a, e), Cmp(op, x.b, e))
    lower = op in (">", ">=")               # x op e bounds x from below
    both = (x.op == "min") == lower         # min(..) >= e and max(..) < e need both
    return And.of(*parts) if both else Or.of(*parts)


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


def _bound_from_linear(c: int, r: Expr, op: str):
    """``c*x + r  op  0`` (``c`` a non-zero int, ``x`` an integer unknown) as
    ("hi", U) for x < U or ("lo", L) for x >= L; None for == / !=."""
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
    # now c*x + r < 0
    if c > 0:   # x < ceil(-r / c) = -(r // c)
        bound = Const(0) - r if c == 1 else Const(0) - (r // c)
        return "hi", lin_normalize(bound)
    cc = -c     # x > r / cc  <=>  x >= r // cc + 1
    bound = r + 1 if cc == 1 else (r // cc) + 1
    return "lo", lin_normalize(bound)


def _solve(atom: Cmp, var: str, spec):
    """A ``var``-atom as a bound: ("lo", L) for var >= L, ("hi", U) for var < U; or None."""
    lin = linear_coeff(BinOpSub(atom.a, atom.b), var, spec)
    if lin is None:
        return None
    c, r = lin                                       # atom: c*var + r  op  0
    return _bound_from_linear(c, r, atom.op)


def _divisor(d: Expr, spec) -> Expr:
    """The run-time divisor of ``x // d``: ``d`` where it is provably >= 1 (a positive
    constant, a metadata value declared ``min >= 1``), else ``max(d, 1)`` (the language
    treats a non-positive divisor as 1)."""
    if isinstance(d, Const) or provably_le(Const(1), d, spec):
        return d
    return maximum(d, Const(1))


def solve_k(atom: Cmp, spec, _depth: int = 0):
    """A ``k``-atom as an exact bound ("lo", L) for k >= L or ("hi", U) for k < U; None
    when the atom is not an interval in ``k`` (it then belongs to the residual).

    Solved: atoms linear in ``k``; atoms ``alpha * ((a*k + s) // d) + r  op  0`` with
    ``s``, ``r``, ``d`` free of ``k`` (floor divisions nest), by ``x // d < U <=> x <
    U*d`` and ``x // d >= L <=> x >= L*d`` for ``d >= 1``.

    >>> from jcompilemask.spec import q, k
    >>> side, bound = solve_k(k // 64 <= q // 64, None)
    >>> print(side, bound)
    hi 64 * (q // 64) + 64
    >>> solve_k(k % 4 == 1, None) is None
    True
    """
    if not isinstance(atom, Cmp) or atom.op in ("==", "!=") or _depth > 8:
        return None
    s = _solve(atom, "k", spec)
    if s is not None:
        return s
    terms, const = _lin(lin_normalize(atom.a - atom.b))
    k_terms = [(key, c, x) for key, (c, x) in terms.items() if _uses(x, "k")]
    if len(k_terms) != 1:
        return None
    key, alpha, x = k_terms[0]
    if not (isinstance(x, BinOp) and x.op == "//") or _uses(x.b, "k"):
        return None
    rest = _from_lin({kk: v for kk, v in terms.items() if kk != key}, const)
    bound = _bound_from_linear(alpha, rest, atom.op)   # alpha * X + rest  op  0
    if bound is None:
        return None
    side, v = bound
    d = _divisor(x.b, spec)
    inner = Cmp("<", x.a, v * d) if side == "hi" else Cmp(">=", x.a, v * d)
    return solve_k(inner, spec, _depth + 1)


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
    """One DNF conjunct -> Interval (hull + residual), or None if it is empty."""
    lows, highs, conds, residual = [], [], [], []
    for atom in conj:
        if isinstance(atom, BoolConst):
            if not atom.value:
                return None
            continue
        if not _uses(atom, "k"):
            conds.append(atom)
            continue
        solved = solve_k(atom, spec) if isinstance(atom, Cmp) else None
        if solved is None:
            residual.append(atom)
            continue
        (lows if solved[0] == "lo" else highs).append(solved[1])
    # Clamping to [0, kv_len) happens in the preprocess, which keeps bounds readable.
    lo: Expr = lows[0] if lows else Const(0)
    for x in lows[1:]:
        lo = maximum(lo, x)
    hi: Expr = highs[0] if highs else kv_len
    for x in highs[1:]:
        hi = minimum(hi, x)
    return _make_interval(lo, hi, conds, And.of(*residual), spec)


def _make_interval(lo, hi, conds, residual, spec) -> Interval:
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
    return Interval(lo, hi, cond, q_lo, q_hi, And.of(*flags), bwd_ok, residual)


def _touch(a: Interval, b: Interval, spec, row_lo) -> bool:
    """Sympy proves ``a`` and ``b`` overlap or touch (so their union is one interval)."""
    return provably_le(b.lo, a.hi, spec, row_lo) and provably_le(a.lo, b.hi, spec, row_lo)


def _try_merge(a: Interval, b: Interval, spec, region) -> Interval | None:
    """Union of two intervals when sympy proves they overlap or touch (same condition
    and same residual)."""
    if a.cond.key() != b.cond.key() or a.residual.key() != b.residual.key():
        return None
    if a.lo.key() == b.lo.key() and a.hi.key() == b.hi.key():
        return a
    row_lo = region.rows[0]
    if not _touch(a, b, spec, row_lo):
        return None
    lo = a.lo if provably_le(a.lo, b.lo, spec, row_lo) else (
        b.lo if provably_le(b.lo, a.lo, spec, row_lo) else minimum(a.lo, b.lo))
    hi = a.hi if provably_le(b.hi, a.hi, spec, row_lo) else (
        b.hi if provably_le(a.hi, b.hi, spec, row_lo) else maximum(a.hi, b.hi))
    ok = a.bwd_ok and b.bwd_ok and monotone(lo) in (CONST, INC) and monotone(hi) in (CONST, INC)
    return dataclasses.replace(a, lo=lo, hi=hi, bwd_ok=ok)


def _atoms(p: Pred):
    return p.terms if isinstance(p, And) else (() if _is_true(p) else (p,))


def _exclusive(a: Interval, b: Interval, spec) -> bool:
    """Sympy proves no row satisfies both row conditions."""
    for lo_iv, hi_iv in ((a, b), (b, a)):
        if hi_iv.q_hi is not None and lo_iv.q_lo is not None and provably_le(
                hi_iv.q_hi, lo_iv.q_lo, spec):
            return True           # rows of hi_iv are < q_hi <= q_lo <= rows of lo_iv
    keys_b = {t.key() for t in _atoms(b.cond)}
    for t in _atoms(a.cond):
        if isinstance(t, Cmp) and t.negated().key() in keys_b:
            return True
        if isinstance(t, Cmp) and not _uses(t, "q"):
            for u in _atoms(b.cond):   # q-free bounds on the same metadata: x < c vs x >= d
                if isinstance(u, Cmp) and not _uses(u, "q") and _flags_exclusive(t, u, spec):
                    return True
    return False


def _flags_exclusive(t: Cmp, u: Cmp, spec) -> bool:
    """``t`` and ``u`` (q-free comparisons) are ``x < U`` and ``x >= L`` forms of one
    expression with ``U <= L`` provable."""
    def as_lt(c: Cmp):   # c as (x, "<"|">=", y) with integer x
        op, x, y = c.op, c.a, c.b
        if op == "<=":
            return x, "<", y + 1
        if op == ">":
            return x, ">=", y + 1
        if op in ("<", ">="):
            return x, op, y
        return None
    p, r = as_lt(t), as_lt(u)
    if p is None or r is None or p[0].key() != r[0].key() or p[1] == r[1]:
        return False
    upper, lower = (p[2], r[2]) if p[1] == "<" else (r[2], p[2])
    return provably_le(upper, lower, spec)


def _slot_compatible(a: Interval, b: Interval, spec, region) -> bool:
    if _exclusive(a, b, spec):
        return True
    return a.residual.key() == b.residual.key() and _touch(a, b, spec, region.rows[0])


def _assign_slots(ivs: list[Interval], spec, region) -> tuple[tuple[int, ...], ...]:
    """Greedy packing of the intervals into forward-table slot groups (see the module
    doc): every pair in a group is compatible, so the active members of a group form one
    interval on every row (pairwise-touching intervals have a connected union).

    An interval joins a group only if some member can hold on one of its mask heads:
    intervals of disjoint heads need no union, the per-head slot assignment
    (:mod:`.slots`, run over these groups by :class:`~.compiled.CompiledMask`) puts them
    in one table slot anyway."""
    from .slots import head_support
    hm = getattr(spec, "mask_heads", 1) or 1
    heads = [set(head_support(iv.cond, hm)) for iv in ivs]
    slots: list[list[int]] = []
    for i, iv in enumerate(ivs):
        for s in slots:
            if (any(heads[i] & heads[j] for j in s)
                    and all(_slot_compatible(ivs[j], iv, spec, region) for j in s)):
                s.append(i)
                break
        else:
            slots.append([i])
    return tuple(tuple(s) for s in slots)


def lower_region(region, spec) -> LoweredRegion:
    """Lower ``region.visible`` to intervals: hulls, residuals and slots."""
    # seg.id(k) == seg.id(q) first: one run of contiguous ids (lower/segments.py)
    nnf = _nnf(rewrite_id_atoms(region.visible), spec)
    conjuncts = _dnf(nnf)
    if conjuncts is None:
        iv = _make_interval(Const(0), kv_len, [], nnf, spec)
        return LoweredRegion((iv,), residual_reason=(
            f"its DNF has more than {MAX_CONJUNCTS} conjuncts: the whole rule is the "
            "residual of the hull [0, kv_len)"))
    ivs: list[Interval] = []
    for conj in conjuncts:
        iv = _conjunct_interval(conj, spec, region)
        if iv is not None:
            ivs.append(iv)
    # An interval without residual contains one with the same condition: drop the latter.
    ivs = _absorb(ivs, spec, region)
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
    residual = None
    for iv in ivs:
        if iv.has_residual:
            atoms = [t for t in _atoms(iv.residual)]
            residual = (f"atom `{atoms[0]}` is not an interval in k: kept as the residual "
                        "predicate of its interval" if len(atoms) == 1 else
                        f"`{iv.residual}` is not an interval in k: kept as the residual "
                        "predicate of its interval")
            break
    return LoweredRegion(tuple(ivs), _assign_slots(ivs, spec, region), residual, reason)


def _absorb(ivs: list[Interval], spec, region) -> list[Interval]:
    """Drop an interval with a residual whose hull lies inside an exact interval of the
    same row condition (``(k <= q) | ((k <= q) & (k % 2 == 0))`` is ``k <= q``)."""
    row_lo = region.rows[0]
    out = []
    for i, iv in enumerate(ivs):
        if iv.has_residual and any(
                j != i and not o.has_residual and o.cond.key() == iv.cond.key()
                and provably_le(o.lo, iv.lo, spec, row_lo)
                and provably_le(iv.hi, o.hi, spec, row_lo) for j, o in enumerate(ivs)):
            continue
        out.append(iv)
    return out
