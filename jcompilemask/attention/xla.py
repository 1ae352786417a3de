"""The ``xla`` backend: blockwise flash attention over the descriptor's tiles, in jnp.

It runs anywhere (CPU, any GPU) and is the reference the GPU kernels are checked against,
so it mirrors their structure and math:

* forward: for each query tile, only the key tiles that are non-empty for some
  (batch, head) are visited (a compacted tile list per query tile, walked by a
  ``while_loop``); a tile that is full for every (batch, head) is computed without the
  interval check (only the ragged-edge and empty-head masks apply); partial tiles use the
  unsigned interval check, AND-ed per interval with its residual predicate where the
  lowering kept one (``k % 2 == 0``: the tables hold the hulls, and a tile a residual may
  cut is never full, so full tiles stay check-free). Bitmap masks (``from_dense`` past 8
  runs per row) read their bits there.
  Online softmax with running max / sum; output 0 and lse -inf for rows that see nothing.
  NaN / Inf in q, k or v reach every output, lse and gradient that they reach through a
  visible pair, as in ``jax.nn.dot_product_attention``; masked pairs carry nothing (jax's
  dense products also spread 0 * NaN over masked pairs, a flash kernel does so at most
  within the tiles it visits).
* backward (``custom_vjp`` with residuals ``(out, lse)``): ``delta = rowsum(o * do)``;
  dQ walks the forward view (query tiles, streaming key tiles), dK/dV walk the backward
  view (key tiles, streaming query tiles, with the column intervals), as FlashAttention's
  backward kernels do.

Memory is O(N * block): no N x N tensor is formed. An additive bias (optional, [B|1, Hq|1,
Nq|1, Nk|1]: the size the caller chose) is sliced per tile and added to the logits; its
gradient, when asked for, is one more pass over the forward view.

The outer loop over tiles is a ``lax.map``. On the CPU it runs one tile at a time; on a
GPU it runs ``tile_batch`` outer tiles side by side (``lax.map(..., batch_size=...)``:
the inner ``while_loop`` then runs as many steps as the busiest tile of the batch, the
others idle), so each step is one large batched GEMM instead of many small sequential
ones. The batch is sized to keep the per-step score tensors near 256 MB;
``$JCOMPILEMASK_XLA_TILE_BATCH`` (an int, 1 = sequential) overrides it on any platform.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..lower.descriptor import COMPUTE, PARTIAL, ExecutionDescriptor

__all__ = ["forward", "backward", "softmax_delta"]

F32 = jnp.float32
NEG_INF = float("-inf")


def _pad_to(x, axis, size):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


_SCORE_BYTES = 256 << 20


def tile_batch(n_tiles: int, step_bytes: int) -> int:
    """How many outer tiles ``lax.map`` runs side by side (see the module doc)."""
    import os
    env = os.environ.get("JCOMPILEMASK_XLA_TILE_BATCH")
    if env:
        try:
            want = int(env)
        except ValueError:
            raise ValueError(f"JCOMPILEMASK_XLA_TILE_BATCH must be an int, got {env!r}") from None
        return max(1, min(n_tiles, want))
    if jax.default_backend() != "gpu":
        return 1
    return max(1, min(n_tiles, _SCORE_BYTES // max(step_bytes, 1)))


def _map_tiles(fn, n_tiles: int, step_bytes: int):
    bs = tile_batch(n_tiles, step_bytes)
    xs = jnp.arange(n_tiles, dtype=jnp.int32)
    return lax.map(fn, xs) if bs == 1 else lax.map(fn, xs, batch_size=bs)


def _kv_tile(kt, vt, tj, bk):
    """Key indices and the K, V blocks of key tile ``tj`` (operands in [B, H, N, D])."""
    cols = tj * bk + jnp.arange(bk, dtype=jnp.int32)
    return (cols, lax.dynamic_slice_in_dim(kt, tj * bk, bk, axis=2),
            lax.dynamic_slice_in_dim(vt, tj * bk, bk, axis=2))


def _tile_lists(states):
    """states uint8 [Bm, Hm, T_outer, T_inner] -> per outer tile: the inner tiles that are
    non-empty for some (batch, head), compacted first ([T_outer, T_inner] int32), their
    count, and per listed tile whether any (batch, head) needs the interval check."""
    live = jnp.any((states & COMPUTE) != 0, axis=(0, 1))               # [To, Ti]
    partial = jnp.any(states == PARTIAL, axis=(0, 1))
    order = jnp.argsort(~live, axis=-1, stable=True).astype(jnp.int32)
    count = jnp.sum(live, axis=-1).astype(jnp.int32)
    return order, count, jnp.take_along_axis(partial, order, -1)


class _Problem:
    """Static shapes and the math shared by the three passes."""

    def __init__(self, q, k, v, desc: ExecutionDescriptor, scale, softcap, *more, bias=None):
        self.b, self.nq, self.hq, self.d = q.shape
        _, self.nk, self.hkv, self.dv = v.shape
        self.g = self.hq // self.hkv
        self.desc, self.scale, self.softcap = desc, scale, softcap
        self.dtype = q.dtype
        self.bias = None if bias is None else _pad_bias(bias, desc)
        more = more + (() if bias is None else (bias,))
        # A float32 zero that depends on every operand: loop-carry initial values are
        # made "like" it, so inside shard_map they vary over the same mesh axes as the
        # loop bodies' results (while_loop requires equal carry types).
        self._ref = sum(jnp.sum(x.reshape(-1)[:0].astype(F32))
                        for x in (q, k, v, *more, *jax.tree.leaves(desc)))

    def zeros(self, shape):
        return jnp.zeros_like(self._ref, shape=shape)

    def full(self, shape, value):
        return jnp.full_like(self._ref, value, shape=shape)

    def logits(self, qb, kb, row0=0, col0=0):
        """qb [B, Hq, bq, D], kb [B, Hkv, bk, D] -> (s, t) float32 [B, Hq, bq, bk]; t is
        tanh(raw / cap) when soft-capped (for the backward), else None. The bias, if any,
        is added after the soft cap (as FlashAttention adds ALiBi); ``row0`` / ``col0``
        are the tile's first row and column."""
        b, _, bq, d = qb.shape
        qg = qb.reshape(b, self.hkv, self.g, bq, d)
        s = jnp.einsum("bkgqd,bkcd->bkgqc", qg, kb, preferred_element_type=F32)
        s = s.reshape(b, self.hq, bq, kb.shape[2]) * self.scale
        t = None
        if self.softcap is not None:
            t = jnp.tanh(s / self.softcap)
            s = self.softcap * t
        if self.bias is not None:
            s = s + self.bias_tile(row0, col0, bq, kb.shape[2])
        return s, t

    def bias_tile(self, row0, col0, bq, bk):
        """float32 [Bb, Hb, bq|1, bk|1]: the bias over the tile (broadcast axes stay 1)."""
        b = self.bias
        wide = (b.shape[2] > 1, b.shape[3] > 1)
        starts = (0, 0, row0 if wide[0] else 0, col0 if wide[1] else 0)
        sizes = (b.shape[0], b.shape[1], bq if wide[0] else 1, bk if wide[1] else 1)
        return lax.dynamic_slice(b, starts, sizes).astype(F32)

    def mask(self, rows, cols, view, states, check):
        """bool [Bm|1, Hm|1, R, C]: the tile's mask; ``check`` selects the interval path."""
        def partial_path():
            return self.desc.visibility(rows, cols, view)

        def full_path():
            live = ((states & COMPUTE) != 0)[:, :, None, None]
            inside = (rows < self.desc.q_len)[:, None] & (cols < self.desc.kv_len)[None, :]
            return jnp.broadcast_to(live & inside[None, None], partial_shape)

        partial_shape = jax.eval_shape(partial_path).shape
        return lax.cond(check, partial_path, full_path)


def _pad_bias(bias, desc):
    """bias [Bb, Hb, Nq|1, Nk|1] zero-padded along its full axes to whole tiles of both
    views (the padding is never visible: the mask covers it)."""
    rows = max(-(-desc.q_len // bq) * bq for bq in (desc.tiles.block_q, desc.tiles.bwd_block_q))
    cols = max(-(-desc.kv_len // bk) * bk for bk in (desc.tiles.block_kv,
                                                     desc.tiles.bwd_block_kv))
    if bias.shape[2] > 1:
        bias = _pad_to(bias, 2, rows)
    if bias.shape[3] > 1:
        bias = _pad_to(bias, 3, cols)
    return bias


def _fwd_impl(q, k, v, desc, scale, softcap, bias=None, out_dtype=None):
    """q [B, Nq, Hq, D] ... -> out [B, Nq, Hq, Dv] (q.dtype), lse [B, Hq, Nq] f32."""
    P = _Problem(q, k, v, desc, scale, softcap, bias=bias)
    bq, bk = desc.tiles.block_q, desc.tiles.block_kv
    tq, tk = desc.num_tiles("fwd")
    qt = _pad_to(jnp.swapaxes(q, 1, 2), 2, tq * bq)                # [B, Hq, Nq', D]
    kt = _pad_to(jnp.swapaxes(k, 1, 2), 2, tk * bk)                # [B, Hkv, Nk', D]
    vt = _pad_to(jnp.swapaxes(v, 1, 2), 2, tk * bk)
    states = desc.tile_states("fwd")                               # [Bm, Hm, Tq, Tk]
    order, count, check = _tile_lists(states)

    def row_tile(ti):
        rows = ti * bq + jnp.arange(bq, dtype=jnp.int32)
        qb = lax.dynamic_slice_in_dim(qt, ti * bq, bq, axis=2)
        m0 = P.full((P.b, P.hq, bq), NEG_INF)
        l0 = P.zeros((P.b, P.hq, bq))
        a0 = P.zeros((P.b, P.hq, bq, P.dv))

        def body(carry):
            n, m, l, acc = carry
            tj = order[ti, n]
            cols, kb, vb = _kv_tile(kt, vt, tj, bk)
            s, _ = P.logits(qb, kb, ti * bq, tj * bk)
            vis = P.mask(rows, cols, "fwd", states[:, :, ti, tj], check[ti, n])
            s = jnp.where(vis, s, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqc,bkcd->bkgqd",
                            p.astype(P.dtype).reshape(P.b, P.hkv, P.g, bq, bk), vb,
                            preferred_element_type=F32).reshape(P.b, P.hq, bq, P.dv)
            return n + 1, m_new, l, alpha[..., None] * acc + pv

        _, m, l, acc = lax.while_loop(lambda c: c[0] < count[ti], body, (0, m0, l0, a0))
        # Empty iff the sum is exactly 0 (a visible finite logit adds exp(0) = 1). Not
        # ``l > 0``: a NaN or +inf logit makes the sum NaN, which must reach out and lse
        # as in jax.nn; nor ``m > -inf``: XLA's max reduction may drop a NaN.
        seen = l != 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
        return out.astype(out_dtype or P.dtype), lse

    # [Tq, B, Hq, bq, ...]; per step: s and p, float32
    out, lse = _map_tiles(row_tile, tq, 2 * 4 * P.b * P.hq * bq * bk)
    out = jnp.moveaxis(out, 0, 2).reshape(P.b, P.hq, tq * bq, P.dv)[:, :, :P.nq]
    lse = jnp.moveaxis(lse, 0, 2).reshape(P.b, P.hq, tq * bq)[:, :, :P.nq]
    return jnp.swapaxes(out, 1, 2), lse


def _probs(P, s, t, vis, lse_b):
    """Recomputed probabilities (0 where masked or the row sees nothing)."""
    lse_safe = jnp.where(lse_b == NEG_INF, 0.0, lse_b)
    p = jnp.exp(jnp.where(vis, s, NEG_INF) - lse_safe[..., None])
    return jnp.where(vis & (lse_b != NEG_INF)[..., None], p, 0.0)


def _dlogits(P, p, dp, delta_b, t, vis):
    ds = p * (dp - delta_b[..., None])
    if t is not None:
        ds = ds * (1.0 - t * t)       # d(cap * tanh(x / cap)) / dx
    # Masked pairs carry no gradient even when the row's delta is NaN (p = 0 times NaN):
    # jax.nn's masking where() zeroes them too, so dK stays finite where jax's does.
    return jnp.where(vis, ds * P.scale, 0.0)


def softmax_delta(out, do, lse, dlse=None):
    """delta [B, Hq, Nq] float32 = rowsum(dO * O), minus the lse cotangent where the row
    sees something (d lse_i / d s_ij = p_ij, so a cotangent on lse enters like -delta).
    Shared by every backward (dS = P * (dP - delta))."""
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(F32), do.astype(F32))
    if dlse is not None:
        delta = delta - jnp.where(lse == NEG_INF, 0.0, dlse.astype(F32))
    return delta


def _bwd_impl(q, k, v, desc, scale, softcap, out, lse, do, dlse=None, bias=None,
              bias_grad=False, out_dtype=None):
    P = _Problem(q, k, v, desc, scale, softcap, out, lse, do,
                 *([] if dlse is None else [dlse]), bias=bias)
    delta = softmax_delta(out, do, lse, dlse)
    dq = _dq_pass(P, q, k, v, do, lse, delta, out_dtype)
    dk, dv = _dkv_pass(P, q, k, v, do, lse, delta, out_dtype)
    if bias is None:
        return dq, dk, dv
    dbias = _dbias_pass(P, q, k, v, do, lse, delta, bias.shape) if bias_grad else None
    return dq, dk, dv, None if dbias is None else dbias.astype(bias.dtype)


def _bwd_operands(P, view, q, k, v, do, lse, delta):
    """Tile sizes and counts of ``view``, and the operands in [B, H, N, ...] layout padded
    to whole tiles (query-side along rows, key-side along columns)."""
    bq, bk = P.desc._blocks(view)
    tq, tk = P.desc.num_tiles(view)
    rows = lambda x: _pad_to(x, 2, tq * bq)             # noqa: E731
    cols = lambda x: _pad_to(jnp.swapaxes(x, 1, 2), 2, tk * bk)  # noqa: E731
    return (bq, bk, tq, tk, rows(jnp.swapaxes(q, 1, 2)), rows(jnp.swapaxes(do, 1, 2)),
            rows(lse), rows(delta), cols(k), cols(v))


def _row_tile_slices(ti, bq, qt, dot, lse_p, delta_p):
    """Row tile ti's query rows and its q, dO, lse and delta slices (forward view)."""
    rows = ti * bq + jnp.arange(bq, dtype=jnp.int32)
    sl = lambda x: lax.dynamic_slice_in_dim(x, ti * bq, bq, axis=2)  # noqa: E731
    return rows, sl(qt), sl(dot), sl(lse_p), sl(delta_p)


def _row_step_probs(P, states, order, check, kt, vt, ti, n, rows, qb, dob, lb, bq, bk):
    """The n-th listed key tile of row tile ti: (tj, kb, t, vis, p, dp) — the softmax
    probabilities and dP = dO V^T that the dQ and dbias passes both start from."""
    tj = order[ti, n]
    cols, kb, vb = _kv_tile(kt, vt, tj, bk)
    s, t = P.logits(qb, kb, ti * bq, tj * bk)
    vis = P.mask(rows, cols, "fwd", states[:, :, ti, tj], check[ti, n])
    p = _probs(P, s, t, vis, lb)
    dp = jnp.einsum("bkgqd,bkcd->bkgqc", dob.reshape(P.b, P.hkv, P.g, bq, P.dv), vb,
                    preferred_element_type=F32).reshape(s.shape)
    return tj, kb, t, vis, p, dp


def _dq_pass(P, q, k, v, do, lse, delta, out_dtype=None):
    bq, bk, tq, tk, qt, dot, lse_p, delta_p, kt, vt = _bwd_operands(
        P, "fwd", q, k, v, do, lse, delta)
    states = P.desc.tile_states("fwd")
    order, count, check = _tile_lists(states)

    def row_tile(ti):
        rows, qb, dob, lb, db = _row_tile_slices(ti, bq, qt, dot, lse_p, delta_p)

        def body(carry):
            n, dq = carry
            _, kb, t, vis, p, dp = _row_step_probs(P, states, order, check, kt, vt, ti, n,
                                                   rows, qb, dob, lb, bq, bk)
            ds = _dlogits(P, p, dp, db, t, vis)
            dq = dq + jnp.einsum("bkgqc,bkcd->bkgqd",
                                 ds.astype(P.dtype).reshape(P.b, P.hkv, P.g, bq, bk), kb,
                                 preferred_element_type=F32).reshape(dq.shape)
            return n + 1, dq

        dq0 = P.zeros((P.b, P.hq, bq, P.d))
        _, dq = lax.while_loop(lambda c: c[0] < count[ti], body, (0, dq0))
        return dq

    dq = _map_tiles(row_tile, tq, 4 * 4 * P.b * P.hq * bq * bk)        # s, p, dp, ds
    dq = jnp.moveaxis(dq, 0, 2).reshape(P.b, P.hq, tq * bq, P.d)[:, :, :P.nq]
    return jnp.swapaxes(dq, 1, 2).astype(out_dtype or q.dtype)


def _dkv_pass(P, q, k, v, do, lse, delta, out_dtype=None):
    bq, bk, tq, tk, qt, dot, lse_p, delta_p, kt, vt = _bwd_operands(
        P, "bwd", q, k, v, do, lse, delta)
    states = jnp.swapaxes(P.desc.tile_states("bwd"), -1, -2)        # [Bm, Hm, Tk, Tq]
    order, count, check = _tile_lists(states)

    def col_tile(tj):
        cols = tj * bk + jnp.arange(bk, dtype=jnp.int32)
        kb = lax.dynamic_slice_in_dim(kt, tj * bk, bk, axis=2)
        vb = lax.dynamic_slice_in_dim(vt, tj * bk, bk, axis=2)

        def body(carry):
            n, dk, dv = carry
            ti = order[tj, n]
            rows = ti * bq + jnp.arange(bq, dtype=jnp.int32)
            qb = lax.dynamic_slice_in_dim(qt, ti * bq, bq, axis=2)
            dob = lax.dynamic_slice_in_dim(dot, ti * bq, bq, axis=2)
            lb = lax.dynamic_slice_in_dim(lse_p, ti * bq, bq, axis=2)
            db = lax.dynamic_slice_in_dim(delta_p, ti * bq, bq, axis=2)
            s, t = P.logits(qb, kb, ti * bq, tj * bk)
            vis = P.mask(rows, cols, "bwd", states[:, :, tj, ti], check[tj, n])
            p = _probs(P, s, t, vis, lb)                             # [B, Hq, bq, bk]
            pg = p.astype(P.dtype).reshape(P.b, P.hkv, P.g, bq, bk)
            dog = dob.reshape(P.b, P.hkv, P.g, bq, P.dv)
            dv = dv + jnp.einsum("bkgqc,bkgqd->bkcd", pg, dog, preferred_element_type=F32)
            dp = jnp.einsum("bkgqd,bkcd->bkgqc", dog, vb,
                            preferred_element_type=F32).reshape(s.shape)
            ds = _dlogits(P, p, dp, db, t, vis).astype(P.dtype)
            dk = dk + jnp.einsum("bkgqc,bkgqd->bkcd",
                                 ds.reshape(P.b, P.hkv, P.g, bq, bk),
                                 qb.reshape(P.b, P.hkv, P.g, bq, P.d),
                                 preferred_element_type=F32)
            return n + 1, dk, dv

        dk0 = P.zeros((P.b, P.hkv, bk, P.d))
        dv0 = P.zeros((P.b, P.hkv, bk, P.dv))
        _, dk, dv = lax.while_loop(lambda c: c[0] < count[tj], body, (0, dk0, dv0))
        return dk, dv

    dk, dv = _map_tiles(col_tile, tk, 4 * 4 * P.b * P.hq * bq * bk)
    dk = jnp.moveaxis(dk, 0, 2).reshape(P.b, P.hkv, tk * bk, P.d)[:, :, :P.nk]
    dv = jnp.moveaxis(dv, 0, 2).reshape(P.b, P.hkv, tk * bk, P.dv)[:, :, :P.nk]
    return (jnp.swapaxes(dk, 1, 2).astype(out_dtype or k.dtype),
            jnp.swapaxes(dv, 1, 2).astype(out_dtype or v.dtype))


def _dbias_pass(P, q, k, v, do, lse, delta, shape):
    """d(loss)/d(bias) = P * (dP - delta), summed over the axes the bias broadcasts
    along; walks the forward view (row tiles streaming key tiles), one bias row slab per
    row tile, so memory stays at the size of the bias."""
    bq, bk, tq, tk, qt, dot, lse_p, delta_p, kt, vt = _bwd_operands(
        P, "fwd", q, k, v, do, lse, delta)
    states = P.desc.tile_states("fwd")
    order, count, check = _tile_lists(states)
    bb, hb, tb, sb = shape
    keep = (bb > 1, hb > 1, tb > 1, sb > 1)
    slab = (bb, hb, bq if keep[2] else 1, tk * bk if keep[3] else 1)

    def reduce(g):
        axes = tuple(i for i in range(4) if not keep[i])
        return jnp.sum(g, axis=axes, keepdims=True) if axes else g

    def row_tile(ti):
        rows, qb, dob, lb, db = _row_tile_slices(ti, bq, qt, dot, lse_p, delta_p)

        def body(carry):
            n, acc = carry
            tj, _, _, _, p, dp = _row_step_probs(P, states, order, check, kt, vt, ti, n,
                                                 rows, qb, dob, lb, bq, bk)
            g = reduce(p * (dp - db[..., None]))
            if keep[3]:       # each key tile is listed once per row tile: write, no sum
                return n + 1, lax.dynamic_update_slice_in_dim(acc, g, tj * bk, axis=3)
            return n + 1, acc + g

        _, acc = lax.while_loop(lambda c: c[0] < count[ti], body, (0, P.zeros(slab)))
        return acc

    out = _map_tiles(row_tile, tq, 4 * 4 * P.b * P.hq * bq * bk)    # [Tq, Bb, Hb, r, c]
    if keep[2]:
        out = jnp.moveaxis(out, 0, 2).reshape(bb, hb, tq * bq, slab[3])[:, :, :P.nq]
    else:
        out = jnp.sum(out, axis=0)
    return out[..., :P.nk] if keep[3] else out


def forward(q, k, v, desc: ExecutionDescriptor, scale: float, softcap: float | None,
            bias=None, out_dtype=None):
    """Blockwise forward: (out [B, Nq, Hq, Dv] in q.dtype, lse [B, Hq, Nq] float32).

    ``bias``: None, or an array [Bb, Hb, Nq|1, Nk|1] (Bb in {1, B}, Hb in {1, Hq}) added
    to the logits after the soft cap; -inf entries mask like the mask does.
    ``out_dtype`` (default q.dtype): the dtype ``out`` is rounded to; callers that merge
    partial results (context parallelism) ask for float32 so only the merged result is
    rounded, once.
    """
    return _fwd_impl(q, k, v, desc, scale, softcap, bias, out_dtype)


def backward(q, k, v, desc, scale, softcap, out, lse, do, dlse=None, bias=None,
             bias_grad=False, deterministic=False, out_dtype=None):
    """Blockwise backward from the residuals (out, lse): (dq, dk, dv), and with a bias
    ``(dq, dk, dv, dbias)`` (dbias None unless ``bias_grad``). Deterministic whatever
    ``deterministic`` says (every sum runs in a fixed order). dq, dk, dv come in the
    dtypes of q, k, v, or all in ``out_dtype`` (float32 for callers that sum partials)."""
    del deterministic
    return _bwd_impl(q, k, v, desc, scale, softcap, out, lse, do, dlse, bias, bias_grad,
                     out_dtype)
