"""Why a region keeps a residual predicate, and a rewrite that lowers where one is known.

A region whose atoms are not all intervals in ``k`` keeps the rest as a *residual*
predicate of its intervals' hulls: correct, slower (every element of its partial tiles
evaluates the residual) and not run by the GPU kernels yet, so
:func:`jcompilemask.compile` warns once per mask with :func:`fallback_message`.
``k // c`` atoms are solved by the lowering itself (``k // c <= e`` holds exactly when
``k < (e + 1) * c``); :func:`rewrite_atom` shows that rewrite by hand.

>>> from jcompilemask.spec import q, k
>>> print(rewrite_atom(k // 64 <= q // 64))
k < (q // 64 + 1) * 64
"""
from __future__ import annotations

import warnings

from ..spec.expr import BinOp, Cmp, Const, Pred, substitute, walk

__all__ = ["MaskFallbackWarning", "rewrite_atom", "fallback_message", "warn_fallbacks"]


class MaskFallbackWarning(UserWarning):
    """A region of a MaskSpec keeps a residual predicate (evaluated per element in partial
    tiles by the xla backend; not on the GPU kernels yet)."""


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _uses_k(e) -> bool:
    return any(getattr(n, "name", None) == "k" and type(n).__name__ == "Index"
               for n in walk(e))


def _is_k_over_c(e) -> bool:
    return (isinstance(e, BinOp) and e.op == "//" and isinstance(e.b, Const)
            and e.b.value > 0 and not isinstance(e.a, BinOp) and _is_k(e.a))


def _is_k(e) -> bool:
    return type(e).__name__ == "Index" and e.name == "k"


def rewrite_atom(atom: Cmp) -> Pred | None:
    """An equivalent predicate linear in ``k`` for ``k // c OP e`` (``e`` free of ``k``,
    ``c`` a positive constant, either side), else None."""
    if not isinstance(atom, Cmp):
        return None
    op, a, b = atom.op, atom.a, atom.b
    if not _is_k_over_c(a):
        op, a, b = _FLIP[op], b, a
    if not _is_k_over_c(a) or _uses_k(b):
        return None
    k_, c = a.a, a.b
    lo, hi = b * c, (b + 1) * c           # k // c == b  <=>  b*c <= k < (b+1)*c
    return {"<=": k_ < hi, "<": k_ < lo, ">=": k_ >= lo, ">": k_ >= hi,
            "==": (k_ >= lo) & (k_ < hi), "!=": (k_ < lo) | (k_ >= hi)}[op]


def _rewrite_pred(p: Pred) -> Pred:
    def fn(node):
        if isinstance(node, Cmp):
            return rewrite_atom(node)
        return None
    return substitute(p, fn)


def _offending_atom(reason: str, visible: Pred):
    """The atom the lowering named in ``reason`` (its text sits between backquotes)."""
    if "`" not in reason:
        return None
    text = reason.split("`")[1]
    for n in walk(visible):
        if isinstance(n, Cmp):
            # The lowering works on the negation normal form, with == and != split.
            forms = [n, n.negated()]
            for f in list(forms):
                if f.op in ("==", "!="):
                    forms += [Cmp(o, f.a, f.b) for o in
                              (("<=", ">=") if f.op == "==" else ("<", ">"))]
            for form in forms:
                if str(form) == text:
                    return form
    return None


def fallback_message(spec, index: int, reason: str) -> str:
    """The warning text for region ``index`` of ``spec``, lowering ``reason``."""
    from .analyze import lower_region
    r = spec.regions[index]
    label = f" {r.name!r}" if r.name else ""
    where = f"mask {spec.name!r}: " if spec.name else ""
    msg = (f"{where}region {index}{label} (rows [{r.rows[0]}, {r.rows[1]})) keeps a residual "
           f"predicate, evaluated per element in partial tiles: {reason}. This is slower than "
           "an interval rule (the GPU kernels test it in every partial tile; a residual "
           "reading per-token segment ids runs on the xla backend).")
    atom = _offending_atom(reason, r.visible)
    fixed = rewrite_atom(atom) if atom is not None else None
    if fixed is not None:
        rule = _rewrite_pred(r.visible)
        trial = type(r)(r.rows, rule, r.name)
        if not lower_region(trial, spec).has_residual:
            whole = "" if rule.key() == fixed.key() else f" (the whole rule: `{rule}`)"
            return msg + f" Rewrite `{atom}` as `{fixed}`{whole}: it lowers to intervals."
        return msg + f" `{atom}` can be written `{fixed}`, but the rule still falls back."
    seg_hint = _key_id_hint(spec, atom)
    if seg_hint:
        return msg + seg_hint
    return msg + (" To stay on the interval path, write the rule with k alone (or k // c) "
                  "on one side of each comparison, against bounds of q and metadata "
                  "(floor division and % of q are fine).")


def _key_id_hint(spec, atom) -> str:
    """The hint for an atom that reads ``seg.id(k)`` (the key's segment id)."""
    from ..spec.metadata import SegRead
    from .segments import key_id_read
    if atom is None:
        return ""
    reads = [n for n in walk(atom) if key_id_read(n)]
    if not reads:
        return ""
    seg = reads[0].decl
    name = seg.name
    if not seg.contiguous:
        return (f" `{name}.id(k) == {name}.id(q)` lowers to one interval per row when every "
                f"id occupies one contiguous run of tokens (sorted ids do): declare "
                f"SegmentIds({name!r}, contiguous=True) if your ids are laid out so (it is "
                f"checked on concrete metadata), or write the token's own run as "
                f"`(k >= {name}.start(q)) & (k < {name}.end(q))` (padding sees nothing).")
    same = any(isinstance(n, SegRead) and n.field == "id" and n.decl.name == name
               and not _uses_k(n.pos) for n in walk(atom))
    if same:
        return ""
    return (f" Of the comparisons that read the key's id, only `{name}.id(k) == "
            f"{name}.id(e)` and `!=` (e free of k) lower (to the run of e); others are "
            "evaluated per element.")


def warn_fallbacks(cm, stacklevel: int = 3):
    """Issue one :class:`MaskFallbackWarning` per region of ``cm`` with a residual (saying,
    for a spec with a residue-class atom, why it does not run as residue classes)."""
    from .classes import why_no_row_classes
    why = why_no_row_classes(cm.spec)
    extra = ("" if why is None else
             f" The rule holds a residue-class atom, but the mask cannot run as residue "
             f"classes (no residual at all, docs/lowering.md): {why}.")
    for i in cm.fallback_regions:
        warnings.warn(fallback_message(cm.spec, i, cm.regions[i].fallback) + extra,
                      MaskFallbackWarning, stacklevel=stacklevel)

