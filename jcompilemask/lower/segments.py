"""Segment-id atoms that are intervals in ``k``, rewritten before the lowering solves atoms.

``seg.id(k) == seg.id(e)`` (``e`` free of ``k``) holds for the keys whose id equals the
id at ``e``. When ``seg`` is declared ``SegmentIds(name, contiguous=True)`` (every id
one run of tokens), those keys are exactly the run of ``e``:
``[seg.run_start(e), seg.run_end(e))``, padding included (a negative id's run is a run
like any other), and ``!=`` is the complement of that interval. Without the declaration
the atom stays as written, as a residual predicate of its interval's hull (the
warning says which declaration would lower it).

>>> from jcompilemask.spec import SegmentIds, k, q
>>> docs = SegmentIds("doc", contiguous=True)
>>> print(rewrite_id_atoms(docs.id(k) == docs.id(q)))
(k >= doc.run_start(q)) & (k < doc.run_end(q))
"""
from __future__ import annotations

from ..spec.expr import Cmp, Index, Pred, substitute, walk
from ..spec.metadata import SegRead

__all__ = ["rewrite_id_atoms", "key_id_read"]


def _uses_k(node) -> bool:
    return any(isinstance(n, Index) and n.name == "k" for n in walk(node))


def key_id_read(e) -> bool:
    """``e`` is ``seg.id(k)`` (the id of the key itself)."""
    return (isinstance(e, SegRead) and e.field == "id" and isinstance(e.pos, Index)
            and e.pos.name == "k")


def _id_equality(atom: Cmp):
    """(seg, e) when ``atom`` is ``seg.id(k) ==/!= seg.id(e)`` with ``e`` free of ``k``."""
    if atom.op not in ("==", "!="):
        return None
    for a, b in ((atom.a, atom.b), (atom.b, atom.a)):
        if (key_id_read(a) and isinstance(b, SegRead) and b.field == "id"
                and b.decl.name == a.decl.name and not _uses_k(b.pos)):
            return a.decl, b.pos
    return None


def rewrite_id_atoms(p: Pred) -> Pred:
    """``p`` with every ``seg.id(k) ==/!= seg.id(e)`` of a contiguous ``seg`` replaced by
    its interval form (see the module doc); everything else unchanged."""
    def fn(node):
        if not isinstance(node, Cmp):
            return None
        hit = _id_equality(node)
        if hit is None or not hit[0].contiguous:
            return None
        seg, e = hit
        k = Index("k")
        lo, hi = seg.run_start(e), seg.run_end(e)
        return (k >= lo) & (k < hi) if node.op == "==" else (k < lo) | (k >= hi)
    return substitute(p, fn)
