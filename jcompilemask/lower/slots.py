"""Interval slots of a per-head mask: K is the most intervals one head's row has.

The descriptor holds K interval slots per (sequence, mask head, row). A per-head spec
(one that reads ``h``, e.g. a splash ``MultiHeadMask`` converted to ``(h == 0) & rule0 |
(h == 1) & rule1 | ...``) lowers to one interval per DNF conjunct, and a conjunct that
holds only for some heads need not take a slot in the others. So every interval carries
its *head support* -- the heads where its condition can hold, decided statically from the
condition's atoms over ``h`` and constants -- and slots are assigned per head: interval
``m`` of region ``g`` writes slot ``s`` for the heads listed with ``s``. Then

    K  = max over regions g, heads h of #{intervals of g live on h}
    Kc = max over heads h of #{(g, m) live on h}   (the column view: all regions)

instead of the sums over all heads. An interval keeps one slot for all its heads when a
common free slot below that bound exists (always so without head conditions, where slot
``m`` is interval ``m`` as before); otherwise it takes, in each head, that head's first
free slot.

>>> import jcompilemask as jcm
>>> from jcompilemask.spec import MaskSpec, Region, h, k, q, q_len
>>> rule = ((h == 0) & (k <= q)) | ((h == 1) & (k >= q - 2) & (k <= q)) | ((h >= 2) & (k < 4))
>>> cm = jcm.compile(MaskSpec([Region((0, q_len), rule)], num_heads=3))
>>> cm.num_intervals, cm.num_bwd_intervals          # one interval per head, not three
(1, 1)
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..spec.expr import And, BoolConst, Cmp, Const, Index, Not, Or, Pred, walk

__all__ = ["head_support", "assign_slots", "Slots"]

# per interval: ((slot, heads or None for every head), ...)
Slots = tuple[tuple[int, Optional[tuple[int, ...]]], ...]

_CMP = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def _static_value(e, h: int):
    """The value of ``e`` at head ``h`` when it reads only ``h`` and constants, else None."""
    from ..spec.expr import BinOp, _FOLD
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Index) and e.name == "h":
        return h
    if isinstance(e, BinOp):
        a, b = _static_value(e.a, h), _static_value(e.b, h)
        if a is None or b is None:
            return None
        if e.op in ("//", "%"):
            b = max(b, 1)              # the documented divisor semantics
        return _FOLD[e.op](a, b)
    return None


def _truth(p: Pred, h: int):
    """True / False / None (unknown) of ``p`` at head ``h``."""
    if isinstance(p, BoolConst):
        return p.value
    if isinstance(p, Cmp):
        a, b = _static_value(p.a, h), _static_value(p.b, h)
        return None if a is None or b is None else _CMP[p.op](a, b)
    if isinstance(p, Not):
        t = _truth(p.term, h)
        return None if t is None else not t
    if isinstance(p, (And, Or)):
        vals = [_truth(t, h) for t in p.terms]
        stop = isinstance(p, Or)               # True decides an Or, False an And
        if stop in vals:
            return stop
        return None if None in vals else not stop
    return None


def head_support(cond: Pred, num_heads: int) -> tuple[int, ...]:
    """The heads ``h`` in ``[0, num_heads)`` where ``cond`` may hold."""
    if not any(isinstance(n, Index) and n.name == "h" for n in walk(cond)):
        return tuple(range(num_heads))
    return tuple(x for x in range(num_heads) if _truth(cond, x) is not False)


def assign_slots(supports: Sequence[tuple[int, ...]], num_heads: int) -> tuple[int, list[Slots]]:
    """(slot count, per item its slots) for items live on the given heads (see module)."""
    bound = max([sum(x in s for s in supports) for x in range(num_heads)] + [0])
    used = [set() for _ in range(num_heads)]
    out: list[Slots] = []
    for s in supports:
        if not s:
            out.append(())
            continue
        common = next((c for c in range(bound) if all(c not in used[x] for x in s)), None)
        if common is not None:
            per = {x: common for x in s}
        else:
            per = {x: min(set(range(bound)) - used[x]) for x in s}
        for x, c in per.items():
            used[x].add(c)
        by_slot: dict[int, list[int]] = {}
        for x, c in per.items():
            by_slot.setdefault(c, []).append(x)
        every = len(s) == num_heads
        out.append(tuple((c, None if every and len(by_slot) == 1 else tuple(xs))
                         for c, xs in sorted(by_slot.items())))
    return bound, out
