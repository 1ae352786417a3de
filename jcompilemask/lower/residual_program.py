"""Residual predicates as kernel code (issue 16, item 2): one emitter, several backends.

A residual mask keeps interval *hulls* in its tables and, per table slot, a residual
predicate over ``q``, ``k``, ``h`` and metadata (:meth:`CompiledMask.residual`,
:meth:`CompiledMask.column_residual`) that partial tiles evaluate per element. This module
turns those predicates into a :class:`ResidualProgram`:

- the per-batch **parameter table** it reads: int32 [B, W], one column per scalar, R
  columns per vector (``V[i]`` and ``V[expr]`` read it, the index clamped as in the dense
  semantics); built from the normalised metadata by :meth:`ResidualProgram.table`;
- :meth:`ResidualProgram.emit_slot`, which evaluates slot ``m``'s predicate through an
  **ops backend**: elementwise int32 / bool primitives (truncating division and remainder,
  compares, select). The CuTe kernels pass DSL values (``kernels/cute/residual_ops.py``);
  :class:`NumpyOps` runs the very same emission on numpy arrays, which is how CI checks the
  generated logic (floor division and remainder built from truncating primitives, int32
  wrap-around, the divisor clamp, region selection) against the jnp evaluator.

What a kernel cannot read yet — per-token metadata (``SegmentIds`` reads) — leaves the
program unbuildable: :func:`kernel_reason` says why, and the mask stays on ``xla``.

>>> import numpy as np
>>> import jcompilemask as jcm
>>> from jcompilemask.spec import MaskSpec, Region, Scalar, k, q, q_len
>>> d = Scalar("d", min=1, max=8)
>>> cm = jcm.compile(MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % d == 0))]), warn=False)
>>> prog = ResidualProgram.forward(cm)
>>> prog.width, [p.name for p in prog.params]
(1, ['d'])
>>> table = prog.table({"d": np.array([3], np.int32)}, 1)
>>> qs, ks = np.arange(6)[:, None], np.arange(6)[None, :]
>>> ops = NumpyOps(table, batch=0)
>>> vis = prog.emit_slot(ops, 0, q=qs, k=ks, h=0, region=np.zeros_like(qs))
>>> vis.astype(int)[5]
array([0, 0, 1, 0, 0, 1])
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ..spec.expr import And, BinOp, BoolConst, Cmp, Const, Index, Length, Not, Or, walk
from ..spec.metadata import Scalar, SegRead, VectorElem, VectorRead

__all__ = ["ResidualProgram", "NumpyOps", "kernel_reason", "mask_kernel_reason", "Param",
           "column_periodic"]


@dataclasses.dataclass(frozen=True)
class Param:
    """One metadata entry in the parameter table: ``size`` columns from ``offset``."""
    name: str
    kind: str          # "scalar" | "vector"
    offset: int
    size: int


def kernel_reason(pred) -> Optional[str]:
    """None when a kernel can evaluate ``pred`` from (q, k, h, the row's region, the
    sequence lengths, a per-batch parameter table); else why not."""
    for node in walk(pred):
        if isinstance(node, SegRead):
            return (f"the residual reads segment ids {node.decl.name!r} per token (the "
                    "kernels read per-batch metadata only)")
        if not isinstance(node, (Const, Index, Length, Scalar, VectorElem, VectorRead, BinOp,
                                 BoolConst, Cmp, And, Or, Not)):
            return f"the residual has a {type(node).__name__} node"
    return None


def mask_kernel_reason(cm) -> Optional[str]:
    """None when every residual predicate of ``cm``'s forward slots can run in a kernel
    (or there are none); else the first reason one cannot."""
    for g in getattr(cm, "residual_regions", ()):
        for m in range(cm.num_intervals):
            why = kernel_reason(cm.residual(g, m))
            if why:
                return why
    return None


def column_periodic(pred, var: str = "k", period: int = 8) -> bool:
    """True when ``pred`` (an Expr or Pred) takes the same value at ``var`` and ``var +
    period`` for every value of everything else, by a structural proof: ``var`` enters only
    through ``(c * var + t) % m`` with ``c`` and ``m`` integer constants, ``m`` a power of
    two (so int32 wrap-around keeps the remainder) and ``m / gcd(c, m)`` dividing
    ``period``; ``t`` free of ``var``. A kernel then evaluates such a predicate once per
    column class instead of per element: an SM90 accumulator row puts a thread's columns
    8 apart (``base + 8 g + u``), so with ``period`` 8 one value per ``u`` serves every
    ``g``. False when the proof does not go through (the predicate may still be periodic).

    >>> from jcompilemask.spec import k, q
    >>> column_periodic((q - k) % 2 == 0), column_periodic(k % 16 == 0), column_periodic(k <= q)
    (True, False, False)
    """
    return _period(pred, var, period) is not None


def _period(node, var, period):
    """The structural period of ``node`` in ``var``: 0 when free of it, ("affine", c) for
    c * var + (free), a positive int dividing ``period`` when periodic; None otherwise."""
    import math
    if isinstance(node, Index):
        return ("affine", 1) if node.name == var else 0
    if isinstance(node, (Const, Length, Scalar, BoolConst)):
        return 0
    if isinstance(node, (VectorElem,)):
        return 0
    if isinstance(node, VectorRead):
        return 0 if _period(node.index, var, period) == 0 else None
    if isinstance(node, BinOp):
        a, b = _period(node.a, var, period), _period(node.b, var, period)
        if a is None or b is None:
            return None
        if a == 0 and b == 0:
            return 0
        if node.op in ("+", "-"):
            if isinstance(a, tuple) or isinstance(b, tuple):
                if isinstance(a, int) and a > 0 or isinstance(b, int) and b > 0:
                    return None                      # periodic + affine: not kept
                ca = a[1] if isinstance(a, tuple) else 0
                cb = b[1] if isinstance(b, tuple) else 0
                c = ca + cb if node.op == "+" else ca - cb
                return ("affine", c) if c else 0
            return math.lcm(a or 1, b or 1)          # periodic +- periodic / free
        if node.op == "*":
            if isinstance(a, tuple) and isinstance(node.b, Const):
                c = a[1] * node.b.value
                return ("affine", c) if c else 0
            if isinstance(b, tuple) and isinstance(node.a, Const):
                c = b[1] * node.a.value
                return ("affine", c) if c else 0
            if isinstance(a, int) and isinstance(b, int):
                return math.lcm(a or 1, b or 1)
            return None
        if node.op == "%":
            m = node.b.value if isinstance(node.b, Const) else 0
            if b != 0 or m <= 0 or m & (m - 1):
                return None
            if isinstance(a, tuple):
                p = m // math.gcd(abs(a[1]), m)
                return p if period % p == 0 else None
            return a                                  # periodic % m: same period
        if node.op in ("min", "max", "//"):
            if isinstance(a, tuple) or isinstance(b, tuple):
                return None
            return math.lcm(a or 1, b or 1)
        return None
    if isinstance(node, Cmp):
        a, b = _period(node.a, var, period), _period(node.b, var, period)
        if a is None or b is None or isinstance(a, tuple) or isinstance(b, tuple):
            return None
        return 0 if a == 0 and b == 0 else math.lcm(a or 1, b or 1)
    if isinstance(node, (And, Or)):
        out = 0
        for t in node.terms:
            p = _period(t, var, period)
            if p is None or isinstance(p, tuple):
                return None
            out = p if out == 0 else (out if p == 0 else math.lcm(out, p))
        return out
    if isinstance(node, Not):
        p = _period(node.term, var, period)
        return None if isinstance(p, tuple) else p
    return None


class ResidualProgram:
    """Per table slot, the residual predicate of each region (see the module doc).

    ``slots[m]`` is a tuple of (region, predicate) pairs: a row of region g is visible
    through slot m only where predicate holds; regions absent from it need nothing there.
    For the column view (``view == "bwd"``) each slot has one predicate for every row
    (region -1)."""

    def __init__(self, slots, params, view):
        self.slots = tuple(tuple(s) for s in slots)
        self.params = tuple(params)
        self.view = view
        self._offsets = {p.name: p for p in self.params}

    def key(self):
        """Structural identity (what a compiled kernel depends on)."""
        return (self.view, tuple(tuple((g, p.key()) for g, p in s) for s in self.slots),
                tuple(dataclasses.astuple(p) for p in self.params))

    def __eq__(self, other):
        return isinstance(other, ResidualProgram) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    @property
    def tag(self) -> str:
        """A short stable hash of :meth:`key` for kernel names."""
        import hashlib
        return hashlib.sha1(repr(self.key()).encode()).hexdigest()[:12]

    def __repr__(self):
        body = "; ".join(f"slot {m}: " + ", ".join(f"region {g}: {p}" for g, p in s)
                         for m, s in enumerate(self.slots) if s)
        return f"ResidualProgram({self.view}, {body or 'exact'}, params={[p.name for p in self.params]})"

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def forward(cls, cm) -> "ResidualProgram":
        """The forward (row) view: slot m, region g -> ``cm.residual(g, m)``."""
        return cls.pair(cm)[0]

    @classmethod
    def backward(cls, cm) -> "ResidualProgram":
        """The column view: slot c -> ``cm.column_residual(c)`` for every key."""
        return cls.pair(cm)[1]

    @classmethod
    def pair(cls, cm) -> tuple:
        """(forward, backward) programs over one parameter table layout (the union of the
        metadata both views read), so one table serves both kernels."""
        fwd = []
        for m in range(cm.num_intervals):
            entry = []
            for g in range(len(cm.regions)):
                res = cm.residual(g, m)
                if not (isinstance(res, BoolConst) and res.value):
                    entry.append((g, res))
            fwd.append(entry)
        bwd = []
        for c in range(cm.num_bwd_intervals):
            res = cm.column_residual(c)
            bwd.append([] if isinstance(res, BoolConst) and res.value else [(-1, res)])
        params = cls._layout(fwd + bwd)
        return cls(fwd, params, "fwd"), cls(bwd, params, "bwd")

    @staticmethod
    def _layout(slots):
        for entry in slots:
            for _, pred in entry:
                why = kernel_reason(pred)
                if why:
                    raise ValueError(f"residual predicate {pred} cannot run in a kernel: {why}")
        params, seen, off = [], set(), 0
        for entry in slots:
            for _, pred in entry:
                for node in walk(pred):
                    if isinstance(node, Scalar) and node.name not in seen:
                        params.append(Param(node.name, "scalar", off, 1))
                        seen.add(node.name)
                        off += 1
                    elif isinstance(node, (VectorElem, VectorRead)) and node.decl.name not in seen:
                        size = int(node.decl.size)
                        params.append(Param(node.decl.name, "vector", off, size))
                        seen.add(node.decl.name)
                        off += size
        return params

    @property
    def width(self) -> int:
        """Columns of the parameter table (0: the residuals read no metadata)."""
        return sum(p.size for p in self.params)

    def periodic_slots(self, period: int = 8) -> tuple:
        """Per slot, whether every one of its predicates is ``column_periodic`` in the
        view's column index (``k`` for the row view, ``q`` for the column view)."""
        var = "k" if self.view == "fwd" else "q"
        return tuple(bool(s) and all(column_periodic(p, var, period) for _, p in s)
                     for s in self.slots)

    @property
    def exact(self) -> bool:
        """True when no slot has a residual."""
        return not any(self.slots)

    def table(self, metadata, batch: int, xp=np):
        """int32 [B, max(W, 1)] from normalised metadata (scalars [B] or [1], vectors
        [B, R]); ``xp`` is numpy or jax.numpy (inside jit)."""
        cols = []
        for p in self.params:
            v = xp.asarray(metadata[p.name]).astype(xp.int32)
            if p.kind == "scalar":
                cols.append(xp.broadcast_to(v.reshape(-1, 1), (batch, 1)))
            else:
                cols.append(xp.broadcast_to(v.reshape(v.shape[0], -1), (batch, p.size)))
        if not cols:
            return xp.zeros((batch, 1), xp.int32)
        return xp.concatenate(cols, axis=1)

    # -- emission -------------------------------------------------------------------------
    def emit_slot(self, ops, m: int, *, q, k, h, region):
        """Slot ``m``'s visibility factor through ``ops`` (True where the slot's interval
        check alone decides): AND over its regions g of (region != g) | residual_g."""
        out = None
        for g, pred in self.slots[m]:
            val = self.emit(ops, pred, q=q, k=k, h=h)
            if g >= 0:
                val = ops.or_(ops.ne(region, ops.const(g)), val)
            out = val if out is None else ops.and_(out, val)
        return ops.true() if out is None else out

    def emit(self, ops, node, *, q, k, h):
        """One Expr (int32) or Pred (bool) through ``ops``; shared subtrees once."""
        cache: dict = {}
        return self._emit(ops, node, {"q": q, "k": k, "h": h}, cache)

    def _emit(self, ops, node, idx, cache):
        key = node.key()
        if key in cache:
            return cache[key]
        out = self._emit_uncached(ops, node, idx, cache)
        cache[key] = out
        return out

    def _emit_uncached(self, ops, node, idx, cache):
        e = lambda n: self._emit(ops, n, idx, cache)  # noqa: E731
        if isinstance(node, Const):
            return ops.const(node.value)
        if isinstance(node, Index):
            return idx[node.name] if not isinstance(idx[node.name], int) else ops.const(idx[node.name])
        if isinstance(node, Length):
            return ops.length(node.name)
        if isinstance(node, Scalar):
            return ops.param(self._offsets[node.name].offset)
        if isinstance(node, VectorElem):
            p = self._offsets[node.decl.name]
            return ops.param(p.offset + min(max(int(node.index), 0), p.size - 1))
        if isinstance(node, VectorRead):
            p = self._offsets[node.decl.name]
            i = ops.min(ops.max(e(node.index), ops.const(0)), ops.const(p.size - 1))
            return ops.param_at(ops.add(i, ops.const(p.offset)))
        if isinstance(node, BinOp):
            a, b = e(node.a), e(node.b)
            op = node.op
            if op == "+":
                return ops.add(a, b)
            if op == "-":
                return ops.sub(a, b)
            if op == "*":
                return ops.mul(a, b)
            if op == "min":
                return ops.min(a, b)
            if op == "max":
                return ops.max(a, b)
            if op in ("//", "%"):
                if not (isinstance(node.b, Const) and node.b.value > 0):
                    b = ops.max(b, ops.const(1))    # a non-positive divisor acts as 1
                # b > 0: floor division / remainder from the truncating primitives.
                r = ops.rem_trunc(a, b)
                neg = ops.lt(r, ops.const(0))
                if op == "%":
                    return ops.select(neg, ops.add(r, b), r)
                qt = ops.div_trunc(a, b)
                return ops.select(neg, ops.sub(qt, ops.const(1)), qt)
            raise AssertionError(op)
        if isinstance(node, BoolConst):
            return ops.true() if node.value else ops.false()
        if isinstance(node, Cmp):
            a, b = e(node.a), e(node.b)
            return {"<": ops.lt, "<=": ops.le, ">": ops.gt, ">=": ops.ge, "==": ops.eq,
                    "!=": ops.ne}[node.op](a, b)
        if isinstance(node, And):
            out = e(node.terms[0])
            for t in node.terms[1:]:
                out = ops.and_(out, e(t))
            return out
        if isinstance(node, Or):
            out = e(node.terms[0])
            for t in node.terms[1:]:
                out = ops.or_(out, e(t))
            return out
        if isinstance(node, Not):
            return ops.not_(e(node.term))
        raise TypeError(f"cannot emit {node!r}")


class NumpyOps:
    """The ops backend on numpy int32 / bool arrays (CPU twin of the kernel emission).

    Args:
      table: the parameter table [B, W] (:meth:`ResidualProgram.table`).
      batch: which row of it this evaluation reads.
      q_len, kv_len: the sequence lengths ``q_len`` / ``kv_len`` read as.
    """

    def __init__(self, table, batch: int = 0, q_len: int = 0, kv_len: int = 0):
        self.row = np.asarray(table, np.int32)[batch]
        self.lengths = {"q_len": np.int32(q_len), "kv_len": np.int32(kv_len)}

    @staticmethod
    def _i(x):
        return np.asarray(x, np.int32)

    def const(self, v):
        return np.int32(v)

    def true(self):
        return np.bool_(True)

    def false(self):
        return np.bool_(False)

    def length(self, name):
        return self.lengths[name]

    def param(self, offset: int):
        return self.row[offset]

    def param_at(self, offset):
        return self.row[np.asarray(offset)]

    def add(self, a, b):
        with np.errstate(over="ignore"):
            return self._i(np.add(self._i(a), self._i(b), dtype=np.int32))

    def sub(self, a, b):
        with np.errstate(over="ignore"):
            return self._i(np.subtract(self._i(a), self._i(b), dtype=np.int32))

    def mul(self, a, b):
        with np.errstate(over="ignore"):
            return self._i(np.multiply(self._i(a), self._i(b), dtype=np.int32))

    def div_trunc(self, a, b):
        a, b = self._i(a), self._i(b)
        r = np.fmod(a, b)
        with np.errstate(over="ignore"):
            return self._i(np.floor_divide(a - r, b))      # exact: floor == trunc

    def rem_trunc(self, a, b):
        return self._i(np.fmod(self._i(a), self._i(b)))

    def min(self, a, b):
        return np.minimum(self._i(a), self._i(b))

    def max(self, a, b):
        return np.maximum(self._i(a), self._i(b))

    def select(self, c, a, b):
        return np.where(c, a, b).astype(np.int32)

    def lt(self, a, b):
        return np.less(a, b)

    def le(self, a, b):
        return np.less_equal(a, b)

    def gt(self, a, b):
        return np.greater(a, b)

    def ge(self, a, b):
        return np.greater_equal(a, b)

    def eq(self, a, b):
        return np.equal(a, b)

    def ne(self, a, b):
        return np.not_equal(a, b)

    def and_(self, a, b):
        return np.logical_and(a, b)

    def or_(self, a, b):
        return np.logical_or(a, b)

    def not_(self, a):
        return np.logical_not(a)

