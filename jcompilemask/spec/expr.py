"""Symbolic index expressions and predicates of the MaskSpec language.

An :class:`Expr` is an integer-valued expression over the query row ``q``, the key column
``k``, the head ``h``, the static lengths ``q_len`` / ``kv_len``, integer constants and
metadata reads (see :mod:`jcompilemask.spec.metadata`). A :class:`Pred` is a boolean
formula of comparisons between expressions.

Arithmetic semantics (identical in every evaluator: the dense oracle, the jnp preprocess,
the TileLang preprocess):

* all values are int32;
* ``a // b`` is floor division and ``a % b`` the matching non-negative-divisor modulo; a
  divisor that is not positive at run time is treated as 1 (a constant divisor must be
  positive, checked at construction);
* ``min`` / ``max`` are :func:`minimum` / :func:`maximum` (Python's builtins would call
  ``bool`` on a predicate and raise).

Python's ``and`` / ``or`` / ``not`` and chained comparisons call ``bool()``, which raises:
use ``&``, ``|`` and ``~``.

>>> from jcompilemask.spec import q, k
>>> rule = (k <= q) & (k >= q - 3)
>>> print(rule)
(k <= q) & (k >= q - 3)
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Iterator

__all__ = [
    "Expr", "Pred", "Const", "Index", "Length", "BinOp", "Cmp", "BoolConst", "And", "Or",
    "Not", "minimum", "maximum", "as_expr", "as_pred", "q", "k", "h", "q_len", "kv_len",
    "walk", "substitute", "TRUE", "FALSE",
]

_BOOL_HINT = (
    "a symbolic {what} has no truth value: combine predicates with & | ~ instead of "
    "and/or/not, write a <= k & k < b instead of a <= k < b, and use "
    "jcompilemask.spec.minimum/maximum instead of min/max")


class Expr:
    """An int32-valued symbolic expression. Build with operators, never instantiate."""

    __slots__ = ()
    __hash__ = None  # ``==`` builds a predicate; use ``key()`` for structural identity.

    # -- structure --------------------------------------------------------------------
    def children(self) -> tuple["Expr", ...]:
        return ()

    def key(self) -> tuple:
        raise NotImplementedError

    def rebuild(self, children: tuple) -> "Expr":
        return self

    # -- arithmetic ---------------------------------------------------------------------
    def __add__(self, o):
        return _binop("+", self, o)

    def __radd__(self, o):
        return _binop("+", o, self)

    def __sub__(self, o):
        return _binop("-", self, o)

    def __rsub__(self, o):
        return _binop("-", o, self)

    def __mul__(self, o):
        return _binop("*", self, o)

    def __rmul__(self, o):
        return _binop("*", o, self)

    def __floordiv__(self, o):
        return _binop("//", self, o)

    def __rfloordiv__(self, o):
        return _binop("//", o, self)

    def __mod__(self, o):
        return _binop("%", self, o)

    def __rmod__(self, o):
        return _binop("%", o, self)

    def __neg__(self):
        return _binop("-", Const(0), self)

    def __pos__(self):
        return self

    def __truediv__(self, o):
        raise TypeError("MaskSpec expressions are integers: use // (floor division), not /")

    __rtruediv__ = __truediv__

    # -- comparisons ------------------------------------------------------------------
    def __lt__(self, o):
        return Cmp("<", self, as_expr(o))

    def __le__(self, o):
        return Cmp("<=", self, as_expr(o))

    def __gt__(self, o):
        return Cmp(">", self, as_expr(o))

    def __ge__(self, o):
        return Cmp(">=", self, as_expr(o))

    def __eq__(self, o):  # type: ignore[override]
        return Cmp("==", self, as_expr(o))

    def __ne__(self, o):  # type: ignore[override]
        return Cmp("!=", self, as_expr(o))

    def __bool__(self):
        raise TypeError(_BOOL_HINT.format(what="expression"))

    def __index__(self):
        raise TypeError("a symbolic expression cannot be used as a Python integer")

    def __repr__(self):
        return f"Expr({self})"

    # -- printing ---------------------------------------------------------------------
    _prec = 100

    def _fmt(self, parent_prec: int, right: bool = False) -> str:
        s = str(self)
        if self._prec < parent_prec or (right and self._prec == parent_prec):
            return f"({s})"
        return s


class Const(Expr):
    __slots__ = ("value",)

    def __init__(self, value: int):
        value = int(value)
        if not -2 ** 31 <= value < 2 ** 31:
            raise ValueError(f"constant {value} does not fit in int32 (MaskSpec values "
                             "are int32)")
        self.value = value

    def key(self):
        return ("const", self.value)

    def __str__(self):
        return str(self.value)

    @property
    def _prec(self):
        return 100 if self.value >= 0 else 5


class Index(Expr):
    """The query row ``q``, key column ``k`` or head ``h``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        assert name in ("q", "k", "h")
        self.name = name

    def key(self):
        return ("index", self.name)

    def __str__(self):
        return self.name


class Length(Expr):
    """The static lengths ``q_len`` (query rows) and ``kv_len`` (key columns)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        assert name in ("q_len", "kv_len")
        self.name = name

    def key(self):
        return ("length", self.name)

    def __str__(self):
        return self.name


_PREC = {"+": 10, "-": 10, "*": 20, "//": 20, "%": 20}


class BinOp(Expr):
    """``a op b`` for op in + - * // % min max."""

    __slots__ = ("op", "a", "b")

    def __init__(self, op: str, a: Expr, b: Expr):
        self.op, self.a, self.b = op, a, b

    def children(self):
        return (self.a, self.b)

    def rebuild(self, children):
        return _binop(self.op, *children)

    def key(self):
        return ("bin", self.op, self.a.key(), self.b.key())

    @property
    def _prec(self):
        return _PREC.get(self.op, 100)

    def __str__(self):
        if self.op in ("min", "max"):
            return f"{self.op}({self.a}, {self.b})"
        p = self._prec
        return f"{self.a._fmt(p)} {self.op} {self.b._fmt(p, right=True)}"


def minimum(a, b) -> Expr:
    """Symbolic ``min(a, b)``."""
    return _binop("min", a, b)


def maximum(a, b) -> Expr:
    """Symbolic ``max(a, b)``."""
    return _binop("max", a, b)


def as_expr(x: Any, what: str = "expression") -> Expr:
    """Convert a Python ``int`` (or numpy integer) to :class:`Const`; pass Exprs through."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, (bool, Pred)):
        raise TypeError(f"{what}: expected an integer expression, got a boolean {x!r}")
    if isinstance(x, numbers.Integral):
        return Const(int(x))
    if isinstance(x, numbers.Real):
        if float(x).is_integer():
            raise TypeError(f"{what}: constants must be Python ints, got float {x!r}; "
                            f"write {int(x)}")
        raise TypeError(f"{what}: constants must be integers, got {x!r}")
    raise TypeError(f"{what}: expected an integer expression or int, got {type(x).__name__}")


def _binop(op: str, a, b) -> Expr:
    a, b = as_expr(a), as_expr(b)
    ca = a.value if isinstance(a, Const) else None
    cb = b.value if isinstance(b, Const) else None
    if op in ("//", "%") and cb is not None and cb <= 0:
        raise ValueError(f"constant divisor must be positive, got {op} {cb}")
    if ca is not None and cb is not None:
        return Const(_FOLD[op](ca, cb))
    # Light algebraic clean-up keeps lowered expressions readable; every rule is exact.
    if op == "+":
        if ca == 0:
            return b
        if cb == 0:
            return a
        if cb is not None and cb < 0:
            return BinOp("-", a, Const(-cb))
    if op == "-":
        if cb == 0:
            return a
        if cb is not None and cb < 0:
            return BinOp("+", a, Const(-cb))
        if a.key() == b.key():
            return Const(0)
    if op == "*":
        if ca == 1:
            return b
        if cb == 1:
            return a
        if ca == 0 or cb == 0:
            return Const(0)
    if op == "//" and cb == 1:
        return a
    if op == "%" and cb == 1:
        return Const(0)
    if op in ("min", "max") and a.key() == b.key():
        return a
    return BinOp(op, a, b)


_FOLD: dict[str, Callable[[int, int], int]] = {
    "+": lambda x, y: x + y,
    "-": lambda x, y: x - y,
    "*": lambda x, y: x * y,
    "//": lambda x, y: x // y,
    "%": lambda x, y: x % y,
    "min": min,
    "max": max,
}


# ---------------------------------------------------------------------------------------
# Predicates
# ---------------------------------------------------------------------------------------
class Pred:
    """A boolean formula over comparisons of :class:`Expr`. Combine with & | ~."""

    __slots__ = ()
    __hash__ = None

    def children(self) -> tuple:
        return ()

    def key(self) -> tuple:
        raise NotImplementedError

    def rebuild(self, children: tuple) -> "Pred":
        return self

    def __and__(self, o):
        return And.of(self, as_pred(o))

    def __rand__(self, o):
        return And.of(as_pred(o), self)

    def __or__(self, o):
        return Or.of(self, as_pred(o))

    def __ror__(self, o):
        return Or.of(as_pred(o), self)

    def __invert__(self):
        return Not.of(self)

    def __bool__(self):
        raise TypeError(_BOOL_HINT.format(what="predicate"))

    def __repr__(self):
        return f"Pred({self})"

    _prec = 100

    def _fmt(self, parent_prec):
        s = str(self)
        return f"({s})" if self._prec <= parent_prec else s


class BoolConst(Pred):
    __slots__ = ("value",)

    def __init__(self, value: bool):
        self.value = bool(value)

    def key(self):
        return ("bool", self.value)

    def __str__(self):
        return "True" if self.value else "False"


TRUE = BoolConst(True)
FALSE = BoolConst(False)

_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


class Cmp(Pred):
    __slots__ = ("op", "a", "b")

    def __init__(self, op: str, a: Expr, b: Expr):
        assert op in _NEGATE
        self.op, self.a, self.b = op, a, b

    def children(self):
        return (self.a, self.b)

    def rebuild(self, children):
        return Cmp(self.op, *children)

    def key(self):
        return ("cmp", self.op, self.a.key(), self.b.key())

    def negated(self) -> "Cmp":
        return Cmp(_NEGATE[self.op], self.a, self.b)

    _prec = 50

    def __str__(self):
        return f"{self.a} {self.op} {self.b}"


class And(Pred):
    __slots__ = ("terms",)

    def __init__(self, terms: tuple):
        self.terms = terms

    @staticmethod
    def of(*terms) -> Pred:
        flat = []
        for t in terms:
            if isinstance(t, BoolConst):
                if not t.value:
                    return FALSE
                continue
            flat.extend(t.terms if isinstance(t, And) else (t,))
        if not flat:
            return TRUE
        return flat[0] if len(flat) == 1 else And(tuple(flat))

    def children(self):
        return self.terms

    def rebuild(self, children):
        return And.of(*children)

    def key(self):
        return ("and",) + tuple(t.key() for t in self.terms)

    _prec = 30

    def __str__(self):
        return " & ".join(t._fmt(self._prec) if not isinstance(t, Cmp) else f"({t})"
                          for t in self.terms)


class Or(Pred):
    __slots__ = ("terms",)

    def __init__(self, terms: tuple):
        self.terms = terms

    @staticmethod
    def of(*terms) -> Pred:
        flat = []
        for t in terms:
            if isinstance(t, BoolConst):
                if t.value:
                    return TRUE
                continue
            flat.extend(t.terms if isinstance(t, Or) else (t,))
        if not flat:
            return FALSE
        return flat[0] if len(flat) == 1 else Or(tuple(flat))

    def children(self):
        return self.terms

    def rebuild(self, children):
        return Or.of(*children)

    def key(self):
        return ("or",) + tuple(t.key() for t in self.terms)

    _prec = 20

    def __str__(self):
        return " | ".join(f"({t})" if isinstance(t, (Cmp, And)) else t._fmt(self._prec)
                          for t in self.terms)


class Not(Pred):
    __slots__ = ("term",)

    def __init__(self, term: Pred):
        self.term = term

    @staticmethod
    def of(term: Pred) -> Pred:
        if isinstance(term, BoolConst):
            return BoolConst(not term.value)
        if isinstance(term, Not):
            return term.term
        return Not(term)

    def children(self):
        return (self.term,)

    def rebuild(self, children):
        return Not.of(children[0])

    def key(self):
        return ("not", self.term.key())

    _prec = 60

    def __str__(self):
        return f"~({self.term})"


def as_pred(x: Any, what: str = "predicate") -> Pred:
    """Convert Python ``True``/``False`` to :class:`BoolConst`; pass predicates through."""
    if isinstance(x, Pred):
        return x
    if isinstance(x, bool):
        return BoolConst(x)
    if isinstance(x, Expr):
        raise TypeError(f"{what} must be boolean (a comparison such as k <= q, combined "
                        f"with & | ~), got the integer expression {x}")
    try:
        import numpy as np
        if isinstance(x, np.bool_):
            return BoolConst(bool(x))
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"{what} must be a predicate or True/False, got {type(x).__name__}")


# ---------------------------------------------------------------------------------------
# Tree utilities
# ---------------------------------------------------------------------------------------
def walk(node) -> Iterator:
    """Yield every node of an Expr/Pred tree (pre-order)."""
    yield node
    for c in node.children():
        yield from walk(c)


def substitute(node, fn: Callable[[Any], Any]):
    """Rebuild a tree bottom-up, replacing each node by ``fn(node)`` (or itself if None)."""
    kids = node.children()
    if kids:
        node = node.rebuild(tuple(substitute(c, fn) for c in kids))
    out = fn(node)
    return node if out is None else out


q = Index("q")
k = Index("k")
h = Index("h")
q_len = Length("q_len")
kv_len = Length("kv_len")
