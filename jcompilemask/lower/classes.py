"""Residue classes: masks that only pair a query with keys of its own class mod ``c``.

A rule such as ``(k <= q) & (k > q - 128) & ((q - k) % 2 == 0)`` (a dilated window) lowers
in the sequence's own coordinates to a hull ``(q - 128, q]`` and a residual predicate that
masks every other key: every visited tile is partial and half of each is computed for
nothing. Yet ``(q - k) % c == 0`` says ``q`` and ``k`` have the same residue ``r`` mod
``c``, so with ``q = c * i + r`` and ``k = c * j + r`` the mask splits into ``c``
independent problems, one per class, and where every other atom depends on ``q`` and ``k``
only through ``q - k`` (it is then the same in every class), each class runs the *same*
mask, with no residual: here ``0 <= i - j < 64``, a plain causal window.

In the ``[batch, len, heads, dim]`` layout that is a free reshape: ``[B, N, H, D]`` viewed
as ``[B, N / c, c * H, D]`` puts row ``c * i + r`` of head ``h`` at row ``i`` of head
``r * H + h`` (and keys likewise, so GQA's head mapping is kept). The kernels then see
``c * H`` heads of length ``N / c`` under the class mask: the same visible pairs, fewer
and denser tiles, no per-element predicate.

:func:`find_row_classes` finds the factorization, exactly (or not at all):

* every region's rule is a conjunction with a *class atom*: ``(q - k) % c == 0``
  (``(k - q) % c``, a constant multiple of ``c`` added, ``0 ==`` on the left) or
  ``q % c == k % c``, with one ``c >= 2`` for all regions (a region that sees nothing
  is compatible with any);
* every other comparison in the rules is ``alpha * (q - k) + rest`` with ``rest`` free of
  ``q`` and ``k`` (constants, ``q_len``, ``kv_len``) after collecting terms: it then holds
  at ``(c i + r, c j + r)`` iff it holds at ``(c i, c j)``, so the class rule is the rule
  with ``q := c * q``, ``k := c * k`` (the lowering solves those exactly);
* region bounds are constants divisible by ``c`` or ``q_len``;
* no ``h`` and no metadata, except segment ids read as run bounds at ``q`` or ``k``
  themselves: ``X >= seg.B(Y)`` or ``X < seg.B(Y)`` with ``X, Y`` each ``q`` or ``k`` and
  ``B`` one of ``start``, ``end``, ``run_start``, ``run_end`` (packed documents: the
  ``document`` mask's atoms), or ``seg.id(k) == seg.id(q)`` of ids declared
  ``contiguous`` (the same run). Scalars, vectors and other uses of ``seg.id`` stay out
  (their values are written in the sequence's coordinates).

*Per-class metadata.* A run ``[s, e)`` of the sequence holds, in class ``r``, the class
rows ``ceil((s - r) / c) <= j < ceil((e - r) / c)``, and ``c j + r >= s`` iff ``j >=
ceil((s - r) / c)`` (``<`` likewise): so a run-bound atom reads, in each class, the same
bound of the class sequence's runs, provided the class sequence's runs are exactly the
sequence's runs restricted to the class. Segment ids give each run a label of its own
(its index among the runs; negative for padding runs) before they are sliced per class,
``labels[:, r::c]``, which makes that so whatever the ids (two runs of one id with a short
run between them would otherwise merge within a class). Each class then has its own
descriptor (the classes are its mask heads, see :class:`ClassDescriptor`).

The class spec's ``q_len`` / ``kv_len`` are the class lengths ``N / c``; a descriptor
uses the classes only when both lengths are multiples of ``c``
(:meth:`CompiledMask.instantiate`), else the residual lowering as before.

>>> from jcompilemask.spec import MaskSpec, Region, q, k, q_len
>>> spec = MaskSpec([Region((0, q_len), (k <= q) & (k > q - 128) & ((q - k) % 2 == 0))])
>>> rc = find_row_classes(spec)
>>> rc.factor, str(rc.spec.regions[0].visible)
(2, '(k - q <= 0) & (k - q > -64)')
>>> find_row_classes(MaskSpec([Region((0, q_len), (k < 16) & ((q - k) % 2 == 0))])) is None
True
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from ..spec.expr import (And, BinOp, BoolConst, Cmp, Const, Index, Length, Not, Or, Pred,
                         substitute, walk)
from ..spec.maskspec import MaskSpec, Region
from ..spec.metadata import SegmentIds, SegRead
from .symbolic import _from_lin, _lin

__all__ = ["RowClasses", "find_row_classes", "why_no_row_classes", "classes_enabled",
           "class_segment_ids", "ENV"]

ENV = "JCOMPILEMASK_ROW_CLASSES"


def classes_enabled() -> bool:
    """``$JCOMPILEMASK_ROW_CLASSES`` (default 1): 0 makes every descriptor use the
    sequence's own coordinates (the residual lowering), e.g. to time both."""
    v = os.environ.get(ENV, "").strip()
    if v in ("", "1"):
        return True
    if v == "0":
        return False
    raise ValueError(f"${ENV} must be 0 or 1 (or unset: 1), got {v!r}")


@dataclasses.dataclass(frozen=True)
class RowClasses:
    """A spec's residue-class factorization: ``factor`` classes, each running ``spec``
    (the rule in class coordinates ``i = q // factor``, ``j = k // factor``)."""

    factor: int
    spec: MaskSpec
    # names of the SegmentIds the spec reads (as run bounds): each class gets its own
    # metadata (:func:`class_segment_ids`) and its own descriptor
    segments: tuple = ()


def _is_qk(e, name):
    return isinstance(e, Index) and e.name == name


def _class_factor(atom) -> Optional[int]:
    """``c`` if ``atom`` says ``q = k (mod c)`` with a constant ``c >= 2``, else None."""
    if not isinstance(atom, Cmp) or atom.op != "==":
        return None
    for a, b in ((atom.a, atom.b), (atom.b, atom.a)):
        # q % c == k % c (the loop tries both sides in both orders)
        if (isinstance(a, BinOp) and isinstance(b, BinOp) and a.op == b.op == "%"
                and isinstance(a.b, Const) and isinstance(b.b, Const)
                and a.b.value == b.b.value >= 2 and _is_qk(a.a, "q") and _is_qk(b.a, "k")):
            return a.b.value
        # (+-(q - k) + m c) % c == 0
        if (isinstance(a, BinOp) and a.op == "%" and isinstance(a.b, Const)
                and a.b.value >= 2 and isinstance(b, Const) and b.value == 0):
            c = a.b.value
            terms, const = _lin(a.a)
            coeff = {key: v for key, (v, node) in terms.items()}
            if (set(coeff) == {("index", "q"), ("index", "k")}
                    and abs(coeff[("index", "q")]) == 1
                    and coeff[("index", "q")] == -coeff[("index", "k")] and const % c == 0):
                return c
    return None


_RUN_BOUNDS = ("start", "end", "run_start", "run_end")


def _run_atom(atom) -> bool:
    """``atom`` is ``X >= seg.B(Y)`` or ``X < seg.B(Y)`` (either side order), ``X`` and ``Y``
    each ``q`` or ``k``, ``B`` a run bound, or ``seg.id(k) == seg.id(q)`` of segment ids
    declared ``contiguous`` (one run per id, so equal ids are one run, and equal run
    labels): the same atom in every class (module doc)."""
    if not isinstance(atom, Cmp):
        return False
    a, b = atom.a, atom.b
    if (atom.op == "==" and isinstance(a, SegRead) and isinstance(b, SegRead)
            and a.field == b.field == "id" and a.decl is b.decl and a.decl.contiguous
            and ((_is_qk(a.pos, "q") and _is_qk(b.pos, "k"))
                 or (_is_qk(a.pos, "k") and _is_qk(b.pos, "q")))):
        return True
    flip = {">=": "<=", "<": ">", "<=": ">=", ">": "<"}
    for x, b, op in ((atom.a, atom.b, atom.op), (atom.b, atom.a, flip.get(atom.op))):
        if (op in (">=", "<") and (_is_qk(x, "q") or _is_qk(x, "k"))
                and isinstance(b, SegRead) and b.field in _RUN_BOUNDS
                and (_is_qk(b.pos, "q") or _is_qk(b.pos, "k"))):
            return True
    return False


def class_segment_ids(ids, c: int, xp=None):
    """Segment ids [B, N] -> the class sequences' ids [B * c, N / c] (row ``b c + r`` is
    class ``r`` of sequence ``b``): each run of the sequence gets a label of its own (its
    run index; ``-1 - index`` for a run of negative ids, which stays padding), then every
    ``c``-th token from ``r``. The class sequence's runs are then exactly the sequence's
    runs restricted to the class (module doc).

    >>> import numpy as np
    >>> class_segment_ids(np.array([[0, 0, 1, 0, 0, 0, -1, -1]]), 2).tolist()
    [[0, 1, 2, -4], [0, 2, 2, -4]]
    """
    if xp is None:
        import jax.numpy as xp
    ids = xp.asarray(ids)
    b, n = ids.shape
    new = xp.concatenate([xp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    run = xp.cumsum(new.astype(xp.int32), axis=1, dtype=xp.int32) - 1
    label = xp.where(ids >= 0, run, -1 - run).astype(xp.int32)
    return xp.transpose(label.reshape(b, n // c, c), (0, 2, 1)).reshape(b * c, n // c)


def _invariant(atom: Cmp) -> bool:
    """``atom`` is ``alpha * (q - k) + rest`` against 0, ``rest`` free of q, k, h and
    metadata (collected syntactically: exact)."""
    terms, _ = _lin(BinOp("-", atom.a, atom.b))
    cq = ck = 0
    for key, (v, node) in terms.items():
        if _is_qk(node, "q"):
            cq += v
        elif _is_qk(node, "k"):
            ck += v
        elif not isinstance(node, (Length, Const)):
            return False
    return cq == -ck


def _class_atom(atom: Cmp, c: int) -> Pred:
    """An invariant ``atom`` in class coordinates. With ``q := c q``, ``k := c k`` and the
    lengths scaled by ``c``, ``a - b`` becomes ``c X + d`` (``X`` its q / k / length terms,
    ``d`` its constant); for integer ``X`` that compares with 0 as ``X`` does with
    ``-d / c`` rounded the way ``op`` needs (exact)."""
    terms, d = _lin(BinOp("-", atom.a, atom.b))
    x = _from_lin(terms, 0)
    lo, hi = -((d + c - 1) // c), -(d // c)          # floor(-d / c), ceil(-d / c)
    if atom.op == "<":
        return Cmp("<", x, Const(hi))
    if atom.op == "<=":
        return Cmp("<=", x, Const(lo))
    if atom.op == ">":
        return Cmp(">", x, Const(lo))
    if atom.op == ">=":
        return Cmp(">=", x, Const(hi))
    if d % c:
        return BoolConst(atom.op == "!=")
    return Cmp(atom.op, x, Const(-d // c))


def _scaled(p: Pred, c: int) -> Optional[Pred]:
    """``p`` in class coordinates, if every comparison in it is invariant or a run-bound
    atom (kept as it is: it reads the class sequence's runs)."""
    if _blocker(p) is not None:
        return None

    def one(n):
        if not isinstance(n, Cmp):
            return None
        return n if _run_atom(n) else _class_atom(n, c)
    return substitute(p, one)


def _class_bound(b, c: int):
    if isinstance(b, Const) and b.value % c == 0:
        return Const(b.value // c)
    if isinstance(b, Length) and b.name == "q_len":
        return b
    return None


def find_row_classes(spec) -> Optional[RowClasses]:
    """The residue-class factorization of ``spec`` (module doc), or None."""
    return _factorize(spec)[0]


def why_no_row_classes(spec) -> Optional[str]:
    """Why a spec that holds a class atom (``(q - k) % c == 0``, ``q % c == k % c``) does
    not factor into residue classes; None when it factors or holds none.

    >>> from jcompilemask.spec import MaskSpec, Region, Scalar, q, k, q_len
    >>> s = Scalar("s", max=q_len)
    >>> print(why_no_row_classes(MaskSpec([Region((0, q_len), (k < s) & ((q - k) % 2 == 0))])))
    it reads metadata 's' (a Scalar); only segment ids read as run bounds at q or k can be split per class
    """
    rc, why = _factorize(spec)
    if rc is not None or not isinstance(spec, MaskSpec):
        return None
    if not any(isinstance(n, Cmp) and _class_factor(n) is not None
               for r in spec.regions for n in walk(r.visible)):
        return None
    return why


def _blocker(p: Pred):
    """The first node of ``p`` that keeps it from class coordinates (None: there is none)."""
    for node in walk(p):
        if isinstance(node, Cmp) and not (_invariant(node) or _run_atom(node)):
            return node
        if not isinstance(node, (Cmp, And, Or, Not, BoolConst)) and isinstance(node, Pred):
            return node
    return None


def _factorize(spec):
    """(RowClasses or None, the reason it is None)."""
    if not isinstance(spec, MaskSpec):
        return None, "not a MaskSpec"
    if spec.mask_heads != 1:
        return None, "it is a per-head mask"
    for name, d in spec.metadata.items():
        if not isinstance(d, SegmentIds):
            return None, (f"it reads metadata {name!r} (a {type(d).__name__}); only segment "
                          "ids read as run bounds at q or k can be split per class")
    if any(isinstance(n, Index) and n.name == "h" for r in spec.regions for n in walk(r.visible)):
        return None, "its rules read the head h"
    factors, splits = set(), []
    for i, r in enumerate(spec.regions):
        vis = r.visible
        if isinstance(vis, BoolConst) and not vis.value:
            splits.append((r, None))
            continue
        terms = vis.terms if isinstance(vis, And) else (vis,)
        cs = [_class_factor(t) for t in terms]
        found = {x for x in cs if x is not None}
        if not found:
            return None, (f"region {i} has no class atom ((q - k) % c == 0) among the "
                          "conjuncts of its rule")
        factors.add(math.lcm(*found))
        splits.append((r, [t for t, x in zip(terms, cs) if x is None]))
    if len(factors) != 1:
        return None, f"its regions' class atoms have different factors {sorted(factors)}"
    c = factors.pop()
    regions = []
    for i, (r, rest) in enumerate(splits):
        lo, hi = (_class_bound(b, c) for b in r.rows)
        if lo is None or hi is None:
            return None, (f"region {i}'s rows [{r.rows[0]}, {r.rows[1]}) are not bounded by "
                          f"multiples of {c} or q_len")
        if rest is None:
            vis = BoolConst(False)
        else:
            # a region with several class atoms of other factors keeps the lcm: each
            # divides c, so in class coordinates (q - k = c (i - j)) they always hold
            vis = _scaled(And.of(*rest), c)
            if vis is None:
                return None, (f"atom `{_blocker(And.of(*rest))}` of region {i} is neither a "
                              "function of q - k and the lengths nor a segment run bound at "
                              "q or k")
        regions.append(Region((lo, hi), vis, name=r.name))
    name = f"{spec.name or 'mask'} (classes mod {c})"
    cspec = MaskSpec(regions, name=name)
    # every metadata read is a run-bound atom (_scaled refused the rest); a segment read
    # that the class rules dropped (e.g. under a class atom alone) leaves no declaration
    return RowClasses(c, cspec, tuple(sorted(cspec.metadata))), None
