"""Metadata declarations: the per-batch values a MaskSpec reads at run time.

Three kinds, each bound to a key of the ``metadata`` dict passed at run time:

==================  ===============  ===============================================
declaration         array            reads
==================  ===============  ===============================================
``Scalar(name)``    int [B]          the declaration itself is an :class:`Expr`
``Vector(name, R)`` int [B, R]       ``vec[i]`` for a static Python int ``i``, or
                                     ``vec[e]`` for an expression ``e`` (a per-token id)
``SegmentIds(name)`` int [B, N]      ``seg.start(pos)``, ``seg.end(pos)``, ``seg.id(pos)``,
                                     ``seg.run_start(pos)``, ``seg.run_end(pos)``
==================  ===============  ===============================================

Segment semantics: a *segment* is a maximal run of equal consecutive ids. For a token at
``pos``, ``start(pos)`` / ``end(pos)`` are the first index of its run and one past the
last. A negative id marks padding, which belongs to no segment: for a padding token
``start(pos) == end(pos) == pos`` (an empty run at its position, which keeps both reads
non-decreasing in ``pos``). ``id(pos)`` is the raw id. ``run_start(pos)`` /
``run_end(pos)`` are the bounds of the token's run with padding counted like any id (a
run of equal negative ids is a run too). ``N`` must equal ``max(q_len, kv_len)``; a
position outside ``[0, N)`` reads the nearest end (clamped). ``pos`` may be any
expression, of the key ``k`` too: ``seg.id(k) == seg.id(q)`` reads "key and query carry
the same id".

Declared property ``SegmentIds(name, contiguous=True)``: every id value (negative ones
included) occupies one contiguous run of tokens in each sequence, as sorted ids do
(``[0, 0, 1, 1, 1, -1, -1]``; ``[0, 1, 0]`` is not contiguous). Then ``seg.id(k) ==
seg.id(e)`` (``e`` free of ``k``) is the interval ``[run_start(e), run_end(e))`` of keys
and lowers (the document mask, spelled by ids); without the declaration it falls back to
the per-element predicate. The property is checked eagerly on concrete metadata and
reported by :meth:`MaskSpec.check_metadata` inside ``jit``; under ``jit`` a sequence that
breaks it gets, from the lowered tables, only the query's own run of that id.

``vec[e]`` with an expression ``e`` (``P[seg.id(q)]``: a per-segment value looked up by
the query's segment id) reads entry ``clamp(e, 0, R - 1)`` (a padding id -1 reads entry
0). A bound with such a read lowers to intervals; its column view needs monotone bounds,
which a looked-up value is not known to be.

Scalars and vector entries carry a declared value range ``[min, max]`` (``max`` may be an
expression of ``q_len`` / ``kv_len``), checked eagerly on concrete metadata; inside
``jit`` a value outside its range is clamped into it (the lowering's proofs assume the
declared ranges; the dense oracle and every preprocess clamp alike) and
:meth:`MaskSpec.check_metadata` reports violations through ``checkify``.

Every value is int32 at run time. A value that does not fit int32 (an int64 array holding
``2**32 + 4``, say) is an error on concrete metadata; inside ``jit`` it saturates to the
int32 limit (never wraps) and ``check_metadata`` reports it. With ``jax_enable_x64`` off,
JAX itself converts an int64 argument of a jitted function to int32, wrapping it, before
any of this code sees it: validate such metadata outside ``jit`` (any eager call, or
``check_metadata`` on the host arrays). Expressions are bounded for the lengths in use
(:mod:`jcompilemask.spec.ranges`): declare ``max`` for metadata used in products.
"""
from __future__ import annotations

from .expr import Expr, as_expr

__all__ = ["Scalar", "Vector", "SegmentIds", "MetaDecl", "VectorElem", "VectorRead",
           "SegRead"]


def _range_key(v):
    return None if v is None else as_expr(v).key()


class MetaDecl:
    """Base of metadata declarations (name + kind + value range)."""

    kind: str = ""
    name: str

    def decl_key(self) -> tuple:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def _check_name(name):
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"metadata name must be an identifier string, got {name!r}")


def _check_bound(v, what):
    if v is None:
        return None
    e = as_expr(v, what)
    from .expr import walk, Index
    if any(isinstance(n, Index) for n in walk(e)):
        raise ValueError(f"{what} may use constants, q_len and kv_len only, got {e}")
    return e


class Scalar(Expr, MetaDecl):
    """A per-sequence integer, int32 [B]. Usable directly in expressions.

    >>> from jcompilemask.spec import Scalar, q_len
    >>> a = Scalar("context_len", max=q_len)
    >>> print(a + 1)
    context_len + 1
    """

    __slots__ = ("name", "min", "max")
    kind = "scalar"

    def __init__(self, name: str, *, min=0, max=None):
        _check_name(name)
        self.name = name
        self.min = _check_bound(min, f"Scalar {name!r} min")
        self.max = _check_bound(max, f"Scalar {name!r} max")

    def key(self):
        return ("meta", self.name)

    def decl_key(self):
        return ("scalar", self.name, _range_key(self.min), _range_key(self.max))

    def describe(self):
        return f"{self.name}: int[B] in [{self.min}, {self.max if self.max is not None else 'inf'}]"

    def __str__(self):
        return self.name


class Vector(MetaDecl):
    """A per-sequence vector of static length ``size``, int32 [B, size].

    >>> from jcompilemask.spec import SegmentIds, Vector, q
    >>> starts = Vector("response_starts", 4)
    >>> print(starts[2] + 1)
    response_starts[2] + 1
    >>> doc = SegmentIds("segment_ids")
    >>> print(Vector("doc_prefix", 8)[doc.id(q)])          # looked up per query token
    doc_prefix[segment_ids.id(q)]
    """

    kind = "vector"

    def __init__(self, name: str, size: int, *, min=0, max=None):
        _check_name(name)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"Vector {name!r}: size must be a positive int, got {size!r}")
        self.name, self.size = name, size
        self.min = _check_bound(min, f"Vector {name!r} min")
        self.max = _check_bound(max, f"Vector {name!r} max")

    def __getitem__(self, i) -> "Expr":
        from .expr import Const
        if isinstance(i, Const):
            i = i.value
        if isinstance(i, Expr):
            return VectorRead(self, i)
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"Vector {self.name!r} is indexed by a Python int or an "
                            f"integer expression (e.g. a segment id), got {i!r}")
        if not -self.size <= i < self.size:
            raise IndexError(f"Vector {self.name!r} has size {self.size}, index {i}")
        return VectorElem(self, i % self.size)

    def decl_key(self):
        return ("vector", self.name, self.size, _range_key(self.min), _range_key(self.max))

    def describe(self):
        hi = self.max if self.max is not None else "inf"
        return f"{self.name}: int[B, {self.size}] in [{self.min}, {hi}]"

    def __bool__(self):
        raise TypeError("a metadata Vector has no truth value")

    def __repr__(self):
        return f"Vector({self.name!r}, {self.size})"


class VectorElem(Expr):
    __slots__ = ("decl", "index")

    def __init__(self, decl: Vector, index: int):
        self.decl, self.index = decl, index

    def key(self):
        return ("elem", self.decl.name, self.index)

    def __str__(self):
        return f"{self.decl.name}[{self.index}]"


class VectorRead(Expr):
    """``vec[e]`` for an expression ``e``: entry ``clamp(e, 0, size - 1)``."""

    __slots__ = ("decl", "index")

    def __init__(self, decl: Vector, index: Expr):
        self.decl, self.index = decl, index

    def children(self):
        return (self.index,)

    def rebuild(self, children):
        from .expr import Const
        i = children[0]
        if isinstance(i, Const):          # keep the clamp of a run-time index
            return VectorElem(self.decl, min(max(i.value, 0), self.decl.size - 1))
        return VectorRead(self.decl, i)

    def key(self):
        return ("vread", self.decl.name, self.index.key())

    def __str__(self):
        return f"{self.decl.name}[{self.index}]"


class SegmentIds(MetaDecl):
    """Per-token segment ids, int32 [B, N] with N = max(q_len, kv_len).

    >>> from jcompilemask.spec import SegmentIds, q, k
    >>> seg = SegmentIds("segment_ids")
    >>> print((k >= seg.start(q)) & (k < seg.end(q)))
    (k >= segment_ids.start(q)) & (k < segment_ids.end(q))

    ``contiguous=True`` declares that every id occupies one run of tokens (see the
    module doc); ``seg.id(k) == seg.id(q)`` then lowers to one interval per row:

    >>> import jcompilemask as jcm
    >>> from jcompilemask.spec import MaskSpec, Region, q_len
    >>> docs = SegmentIds("segment_ids", contiguous=True)
    >>> spec = MaskSpec([Region((0, q_len), (docs.id(k) == docs.id(q)) & (k <= q))])
    >>> jcm.compile(spec).num_intervals
    1
    >>> spec.as_dense({"segment_ids": [[0, 0, 1, 1]]}, 4)[0, 0].astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    """

    kind = "tokens"

    def __init__(self, name: str, *, contiguous: bool = False):
        _check_name(name)
        if not isinstance(contiguous, bool):
            raise TypeError(f"SegmentIds {name!r}: contiguous must be True or False, got "
                            f"{contiguous!r}")
        self.name = name
        self.contiguous = contiguous

    def start(self, pos) -> "SegRead":
        return SegRead(self, "start", as_expr(pos, f"{self.name}.start(pos)"))

    def end(self, pos) -> "SegRead":
        return SegRead(self, "end", as_expr(pos, f"{self.name}.end(pos)"))

    def id(self, pos) -> "SegRead":
        return SegRead(self, "id", as_expr(pos, f"{self.name}.id(pos)"))

    def run_start(self, pos) -> "SegRead":
        return SegRead(self, "run_start", as_expr(pos, f"{self.name}.run_start(pos)"))

    def run_end(self, pos) -> "SegRead":
        return SegRead(self, "run_end", as_expr(pos, f"{self.name}.run_end(pos)"))

    def decl_key(self):
        return ("tokens", self.name) + (("contiguous",) if self.contiguous else ())

    def describe(self):
        extra = ", each id one contiguous run" if self.contiguous else ""
        return f"{self.name}: int[B, N] segment ids (negative = padding{extra})"

    def __bool__(self):
        raise TypeError("a metadata SegmentIds has no truth value")

    def __repr__(self):
        return f"SegmentIds({self.name!r})"


class SegRead(Expr):
    """``seg.start(pos)`` / ``seg.end(pos)`` / ``seg.id(pos)`` / ``seg.run_start(pos)`` /
    ``seg.run_end(pos)``."""

    __slots__ = ("decl", "field", "pos")

    def __init__(self, decl: SegmentIds, field: str, pos: Expr):
        self.decl, self.field, self.pos = decl, field, pos

    def children(self):
        return (self.pos,)

    def rebuild(self, children):
        return SegRead(self.decl, self.field, children[0])

    def key(self):
        return ("seg", self.decl.name, self.field, self.pos.key())

    def __str__(self):
        return f"{self.decl.name}.{self.field}({self.pos})"
