"""jax.numpy evaluation of expressions and predicates.

One evaluator serves the dense oracle, the jnp preprocess and the reference attention's
element-wise fallback: they differ only in the :class:`Env` that supplies the leaves
(index arrays of some broadcast rank, metadata arrays reshaped to that rank).
"""
from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
from jax import lax

from .expr import (And, BinOp, BoolConst, Cmp, Const, Expr, Index, Length, Not, Or, Pred)
from .metadata import Scalar, SegRead, VectorElem, VectorRead

__all__ = ["Env", "evaluate", "segment_tables"]

I32 = jnp.int32


def segment_tables(ids) -> dict:
    """Per-token run tables from segment ids [B, N]: ``start``, ``end``, ``id``,
    ``run_start``, ``run_end`` (int32).

    A run is a maximal stretch of equal consecutive ids; padding (id < 0) gets
    ``start == end == pos``; ``run_start`` / ``run_end`` are the run's bounds for every
    token, padding included.
    """
    ids = jnp.asarray(ids, I32)
    n = ids.shape[-1]
    pos = jnp.broadcast_to(jnp.arange(n, dtype=I32), ids.shape)
    new_run = jnp.concatenate(
        [jnp.ones(ids.shape[:-1] + (1,), bool), ids[..., 1:] != ids[..., :-1]], axis=-1)
    last = jnp.concatenate(
        [ids[..., 1:] != ids[..., :-1], jnp.ones(ids.shape[:-1] + (1,), bool)], axis=-1)
    start = lax.cummax(jnp.where(new_run, pos, 0), axis=ids.ndim - 1)
    end = lax.cummin(jnp.where(last, pos + 1, n), axis=ids.ndim - 1, reverse=True)
    pad = ids < 0
    return {"start": jnp.where(pad, pos, start), "end": jnp.where(pad, pos, end), "id": ids,
            "run_start": start, "run_end": end}


class Env:
    """Leaves for :func:`evaluate`.

    Args:
      rank: rank of every array the evaluation produces; axis 0 is the batch axis.
      indices: ``{"q": arr, "k": arr, "h": arr}`` int32 arrays of that rank (batch axis 1).
      q_len, kv_len: static Python ints.
      metadata: normalised metadata (int32): scalars [B], vectors [B, R], segment tables
        ``{name: {"start", "end", "id"}}`` of [B, N].
    """

    def __init__(self, rank: int, indices: Mapping, q_len: int, kv_len: int,
                 metadata: Mapping):
        self.rank, self.indices = rank, dict(indices)
        self.q_len, self.kv_len = q_len, kv_len
        self.metadata = metadata

    def _lift(self, arr):
        # [B] -> [B, 1, ..., 1] of the env's rank.
        return arr.reshape(arr.shape[:1] + (1,) * (self.rank - 1))

    def index(self, name):
        try:
            return self.indices[name]
        except KeyError:
            raise ValueError(f"index {name!r} is not available here") from None

    def scalar(self, name):
        return self._lift(self.metadata[name])

    def elem(self, name, i):
        return self._lift(self.metadata[name][:, i])

    def vector_read(self, name, index):
        """``vec[clamp(index, 0, R - 1)]`` for an int32 index array of the env's rank."""
        table = self.metadata[name]                 # [B, R]
        return self._gather(table, index)

    def seg(self, name, field, pos):
        return self._gather(self.metadata[name][field], pos)

    def _gather(self, table, pos):
        b, n = table.shape
        pos = jnp.asarray(pos, I32)
        pos = pos.reshape((1,) * (self.rank - pos.ndim) + pos.shape)
        shape = (b,) + pos.shape[1:]
        idx = jnp.clip(jnp.broadcast_to(pos, shape), 0, n - 1).reshape(b, -1)
        return jnp.take_along_axis(table, idx, axis=1).reshape(shape)


def evaluate(node, env: Env):
    """Evaluate an Expr (int32 array) or Pred (bool array) in ``env``."""
    cache: dict = {}
    return _eval(node, env, cache)


def _eval(node, env, cache):
    key = node.key()
    hit = cache.get(key)
    if hit is not None:
        return hit
    out = _eval_uncached(node, env, cache)
    cache[key] = out
    return out


def _eval_uncached(node, env, cache):
    if isinstance(node, Const):
        return jnp.asarray(node.value, I32)
    if isinstance(node, Index):
        return env.index(node.name)
    if isinstance(node, Length):
        return jnp.asarray(env.q_len if node.name == "q_len" else env.kv_len, I32)
    if isinstance(node, Scalar):
        return env.scalar(node.name)
    if isinstance(node, VectorElem):
        return env.elem(node.decl.name, node.index)
    if isinstance(node, VectorRead):
        return env.vector_read(node.decl.name, _eval(node.index, env, cache))
    if isinstance(node, SegRead):
        return env.seg(node.decl.name, node.field, _eval(node.pos, env, cache))
    if isinstance(node, BinOp):
        a, b = _eval(node.a, env, cache), _eval(node.b, env, cache)
        op = node.op
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op in ("//", "%"):
            if not (isinstance(node.b, Const) and node.b.value > 0):
                b = jnp.maximum(b, 1)   # documented: a non-positive divisor acts as 1
            return jnp.floor_divide(a, b) if op == "//" else jnp.remainder(a, b)
        if op == "min":
            return jnp.minimum(a, b)
        if op == "max":
            return jnp.maximum(a, b)
        raise AssertionError(op)
    if isinstance(node, BoolConst):
        return jnp.asarray(node.value)
    if isinstance(node, Cmp):
        a, b = _eval(node.a, env, cache), _eval(node.b, env, cache)
        return {"<": jnp.less, "<=": jnp.less_equal, ">": jnp.greater,
                ">=": jnp.greater_equal, "==": jnp.equal, "!=": jnp.not_equal}[node.op](a, b)
    if isinstance(node, And):
        out = _eval(node.terms[0], env, cache)
        for t in node.terms[1:]:
            out = jnp.logical_and(out, _eval(t, env, cache))
        return out
    if isinstance(node, Or):
        out = _eval(node.terms[0], env, cache)
        for t in node.terms[1:]:
            out = jnp.logical_or(out, _eval(t, env, cache))
        return out
    if isinstance(node, Not):
        return jnp.logical_not(_eval(node.term, env, cache))
    if isinstance(node, (Expr, Pred)):
        raise TypeError(f"cannot evaluate node {node!r}")
    raise TypeError(f"not a MaskSpec node: {node!r}")
