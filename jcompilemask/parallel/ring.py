"""Mask-aware ring attention: context (sequence) parallelism over one mesh axis.

Inside ``jax.shard_map``, q, k and v are sharded along their sequence axis over a mesh
axis; each device keeps its query rows and passes key/value chunks around the ring
(``lax.ppermute`` to the next device), combining the partial results of each step by
their log-sum-exp, as in ring attention (Liu et al., 2023). Per step, the rows of the
device are attended to the chunks it holds by the ``xla`` backend's blockwise attention
(:mod:`jcompilemask.attention.xla`), on a descriptor cut from the global one for exactly
those rows and columns, so its tile skipping, interval checks and backward are reused
unchanged.

The descriptor. It is built for the **whole sequence** (``q_len == kv_len == N``, the
original order) and replicated over the context axis: its size is O(N * K) for the
interval tables plus the tile bitmaps, small next to q, k, v, and every device needs the
rows x columns of every step anyway. Each step cuts from it the intervals of the local
rows clipped to the held key chunks (re-based to local columns), the column intervals of
the held keys clipped to the local rows, and the matching blocks of both tile-state
maps. Masks with residual predicates (an element predicate over absolute indices) are not
supported here.

Layout. The sequence is cut into C chunks (whole tiles of both passes); a layout (a
tuple of chunk ids, see :mod:`jcompilemask.parallel.plan`) says which chunks each device
holds: ``balance_permutation`` balances visible pairs per device (zigzag for causal), and
the caller applies it with ``permute_sequence`` before sharding and undoes it with
``unpermute_sequence``. Default: one chunk per device, in order.

What is skipped.

* Compute, always: a step whose held chunks have no non-empty tile for this device's rows
  is skipped with ``lax.cond`` (no logits, no softmax, no gradient products); within a
  step the blockwise loops visit only non-empty tiles.
* Transfers, when the schedule is static: with a :class:`RingPlan` (``layout=plan``, or
  a concrete descriptor -- built outside ``jit`` or closed over -- from which one is
  made), a chunk travels only as far as the last device whose rows see it and the ring
  stops after the last useful step. A collective's pattern must be static, so with a
  descriptor that is only known inside ``jit`` (traced metadata) every chunk goes round
  the whole ring and only compute is skipped.

Overlap. Each step issues the ``ppermute`` of the chunks for the next step before the
step's compute, which does not depend on it, so the scheduler can run the transfer
under the compute (XLA's latency-hiding scheduler on GPU).

Backward (``custom_vjp``, residuals ``(out, lse)`` of the merged result): the key/value
chunks travel the same route again, each with a float32 dK/dV accumulator that every
device on the way adds its rows' contribution to; where a chunk's route ends the
accumulator is sent home directly (one ``ppermute`` per distance; on the full ring this
is the last hop). dQ stays local. Partial results stay float32 until the end.

>>> import jax, jax.numpy as jnp, numpy as np, jcompilemask as jcm
>>> from jax.sharding import Mesh, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
>>> desc = jcm.compile(jcm.masks.causal()).instantiate(None, 32, block_q=16, block_kv=16,
...                                                   bwd_block_q=16, bwd_block_kv=16)
>>> q = k = v = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
>>> f = jax.shard_map(lambda q, k, v: jcm.parallel.ring_attention(q, k, v, desc,
...                   axis_name="cp"), mesh=mesh, in_specs=P(None, "cp"),
...                   out_specs=P(None, "cp"))
>>> bool(jnp.allclose(f(q, k, v), jcm.mask_attention(q, k, v, desc), atol=1e-5))
True
"""
from __future__ import annotations

import functools
import math
from typing import Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax

from ..attention import xla as _xla
from ..lower.compiled import CompiledMask, compile as _compile
from ..lower.descriptor import COMPUTE, ExecutionDescriptor, pack_tiles, unpack_tiles
from ..spec.maskspec import MaskSpec
from .plan import RingPlan, check_layout, chunk_size, full_ring_plan, ring_plan

__all__ = ["ring_attention"]

F32 = jnp.float32
I32 = jnp.int32
NEG_INF = float("-inf")


def _is_concrete(desc) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(desc))


def _clip(iv, lo, size, shift):
    """Intervals [..., K, 2] (start, len) clipped to [lo, lo + size), re-based to
    ``shift``; empty ones become (0, 0) as the descriptor contract wants."""
    s = iv[..., 0]
    e = s + iv[..., 1]
    a = jnp.clip(s - lo, 0, size)
    b = jnp.clip(e - lo, 0, size)
    n = jnp.where(iv[..., 1] > 0, jnp.maximum(b - a, 0), 0)
    return jnp.stack([jnp.where(n > 0, a + shift, 0), n], -1)


class _Cutter:
    """Cuts, from the global descriptor, the descriptor of (local rows) x (held keys)."""

    def __init__(self, desc: ExecutionDescriptor, plan: RingPlan, d):
        self.desc, self.plan = desc, plan
        self.cpd = plan.chunks_per_device
        self.cs = chunk_size(desc, len(plan.chunks))
        self.table = jnp.asarray(plan.chunks, I32)
        self.q_chunks = [self.table[d * self.cpd + i] for i in range(self.cpd)]
        self.fwd_states = desc.tile_states("fwd")
        self.bwd_states = desc.tile_states("bwd")
        rows = lambda x, axis: jnp.concatenate(      # noqa: E731
            [lax.dynamic_slice_in_dim(x, c * self.cs, self.cs, axis) for c in self.q_chunks],
            axis)
        self.local_fwd = rows(desc.fwd_intervals, 2)
        self.local_region = rows(desc.row_region, 1)

    def _blocks(self, states, view, k_chunks):
        bq, bk = self.desc._blocks(view)
        tq, tk = self.cs // bq, self.cs // bk
        b, hm = states.shape[:2]
        return jnp.concatenate([jnp.concatenate(
            [lax.dynamic_slice(states, (0, 0, qc * tq, kc * tk), (b, hm, tq, tk))
             for kc in k_chunks], axis=3) for qc in self.q_chunks], axis=2)

    def held_chunks(self, src):
        return [self.table[src * self.cpd + j] for j in range(self.cpd)]

    def step(self, src):
        """(descriptor, any-visible) of this device's rows x the chunks of device src."""
        desc, cs, cpd = self.desc, self.cs, self.cpd
        kcs = self.held_chunks(src)
        fwd = jnp.concatenate([_clip(self.local_fwd, kc * cs, cs, j * cs)
                               for j, kc in enumerate(kcs)], axis=3)
        cols = jnp.concatenate([lax.dynamic_slice_in_dim(desc.bwd_intervals, kc * cs, cs, 2)
                                for kc in kcs], axis=2)
        bwd = jnp.concatenate([_clip(cols, qc * cs, cs, i * cs)
                               for i, qc in enumerate(self.q_chunks)], axis=3)
        fst = self._blocks(self.fwd_states, "fwd", kcs)
        bst = self._blocks(self.bwd_states, "bwd", kcs)
        n = cs * cpd
        sub = ExecutionDescriptor(fwd, bwd, pack_tiles(fst),
                                  pack_tiles(jnp.swapaxes(bst, -1, -2)), self.local_region,
                                  desc.bwd_exact, {}, mask=desc.mask, q_len=n, kv_len=n,
                                  tiles=desc.tiles)
        live = jnp.any((fst & COMPUTE) != 0) | jnp.any((bst & COMPUTE) != 0)
        return sub, live


def _slots(x, cpd):
    return jnp.split(x, cpd, axis=1)


def _shift(xs, pairs, axis_name):
    """ppermute a pytree along ``pairs``; devices that receive nothing get zeros (never
    read: the plan sends every chunk a later device can see)."""
    if not pairs:
        return jax.tree.map(jnp.zeros_like, xs)
    return lax.ppermute(xs, axis_name, perm=pairs)


def _ref_zero(*xs):
    # A float32 zero varying over the same mesh axes as xs (lax.cond branches and
    # loop values inside shard_map must agree on that).
    return sum(jnp.sum(x.reshape(-1)[:0].astype(F32)) for x in jax.tree.leaves(xs))


def _merge(out, lse, o, l):
    """Combine two normalised partial results by their log-sum-exp (-inf = empty)."""
    m = jnp.maximum(lse, l)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    w1, w2 = jnp.exp(lse - m_safe), jnp.exp(l - m_safe)
    tot = w1 + w2
    seen = tot != 0
    norm = jnp.where(seen, tot, 1.0)
    a = (w1 / norm)[..., None]                    # [B, Hq, n, 1] -> out is [B, n, Hq, D]
    b = (w2 / norm)[..., None]
    out = jnp.swapaxes(a, 1, 2) * out + jnp.swapaxes(b, 1, 2) * o
    return out, jnp.where(seen, m_safe + jnp.log(norm), NEG_INF)


def _uniform(plan: RingPlan) -> bool:
    """Every chunk goes round the whole ring: the steps are alike, so they run as one
    ``fori_loop`` body (compile time independent of the device count)."""
    p = plan.num_devices
    return p > 1 and all(x == p - 1 for row in plan.last_step for x in row)


def _steps(plan, body, carry):
    """Run ``body(s, carry, send)`` for the plan's steps; ``send(s)`` says whether chunks
    move after step s. Unrolled for a static plan (each step its own transfer pattern),
    a loop over the P - 1 alike steps of the full ring plus the last one."""
    if _uniform(plan):
        p = plan.num_devices
        carry = lax.fori_loop(0, p - 1, lambda s, c: body(s, c, True), carry)
        return body(p - 1, carry, False)
    for s in range(plan.num_steps):
        carry = body(s, carry, s + 1 < plan.num_steps)
    return carry


def _sends(plan, s, j):
    # In the loop of a uniform plan s is traced; its pattern is the full ring.
    return plan.sends(0 if _uniform(plan) else s, j)


def _forward(q, k, v, desc, scale, softcap, axis_name, plan):
    p, cpd = plan.num_devices, plan.chunks_per_device
    d = lax.axis_index(axis_name)
    cut = _Cutter(desc, plan, d)
    zero = _ref_zero(q, k, v, desc)
    b, n, hq, _ = q.shape
    dv = v.shape[-1]
    out = jnp.zeros_like(zero, shape=(b, n, hq, dv))
    lse = jnp.full_like(zero, NEG_INF, shape=(b, hq, n))
    held = list(zip(_slots(k, cpd), _slots(v, cpd)))

    def compute(q, kc, vc, sub):
        return _xla.forward(q, kc, vc, sub, scale, softcap, out_dtype=F32)

    def skip(q, kc, vc, sub):
        return jnp.zeros_like(out), jnp.full_like(lse, NEG_INF)

    def step(s, carry, send):
        held, out, lse = carry
        if send:                      # issued first: it does not wait for this step
            nxt = [_shift(held[j], _sends(plan, s, j), axis_name) for j in range(cpd)]
        sub, live = cut.step((d - s) % p)
        kc = jnp.concatenate([h[0] for h in held], axis=1)
        vc = jnp.concatenate([h[1] for h in held], axis=1)
        o, l = lax.cond(live, compute, skip, q, kc, vc, sub)
        out, lse = _merge(out, lse, o, l)
        return (nxt if send else held), out, lse

    _, out, lse = _steps(plan, step, (held, out, lse))
    return out.astype(q.dtype), lse


def _backward(q, k, v, desc, scale, softcap, axis_name, plan, out, lse, do, dlse):
    p, cpd = plan.num_devices, plan.chunks_per_device
    d = lax.axis_index(axis_name)
    cut = _Cutter(desc, plan, d)
    zero = _ref_zero(q, k, v, desc, out, lse, do, dlse)
    last = jnp.asarray(plan.last_step, I32)                     # [P, cpd]
    held = [(ks, vs, jnp.zeros_like(zero, shape=ks.shape), jnp.zeros_like(zero, shape=vs.shape))
            for ks, vs in zip(_slots(k, cpd), _slots(v, cpd))]
    home = [(jnp.zeros_like(zero, shape=h[0].shape), jnp.zeros_like(zero, shape=h[1].shape))
            for h in held]
    dq = jnp.zeros_like(zero, shape=q.shape)

    def compute(q, kc, vc, sub):
        return _xla.backward(q, kc, vc, sub, scale, softcap, out, lse, do, dlse,
                             out_dtype=F32)

    def skip(q, kc, vc, sub):
        return (jnp.zeros_like(dq), jnp.zeros_like(zero, shape=kc.shape),
                jnp.zeros_like(zero, shape=vc.shape))

    def step(s, carry, send):
        held, home, dq = carry
        home = list(home)
        if send:                      # the K/V of the next step, issued before compute
            nxt_kv = [_shift(held[j][:2], _sends(plan, s, j), axis_name) for j in range(cpd)]
        sub, live = cut.step((d - s) % p)
        kc = jnp.concatenate([h[0] for h in held], axis=1)
        vc = jnp.concatenate([h[1] for h in held], axis=1)
        dq_s, dk_s, dv_s = lax.cond(live, compute, skip, q, kc, vc, sub)
        dq = dq + dq_s
        acc = [(h[2] + a, h[3] + b_) for h, a, b_ in
               zip(held, _slots(dk_s, cpd), _slots(dv_s, cpd))]
        for j in range(cpd):
            # The accumulator whose route ends here (last_step == s) goes home. In the
            # loop of a uniform plan routes end only after it (send False).
            if isinstance(s, int) and s == 0:
                mine = last[d, j] == 0
                home[j] = tuple(hm + jnp.where(mine, a, 0.0) for hm, a in zip(home[j], acc[j]))
            elif isinstance(s, int):
                pairs = plan.returns(s, j)
                if pairs:
                    got = lax.ppermute(acc[j], axis_name, perm=pairs)
                    home[j] = tuple(hm + g for hm, g in zip(home[j], got))
        if send:
            nxt_acc = [_shift(acc[j], _sends(plan, s, j), axis_name) for j in range(cpd)]
            held = [kv + a for kv, a in zip(nxt_kv, nxt_acc)]
        return held, home, dq

    _, home, dq = _steps(plan, step, (held, home, dq))
    dk = jnp.concatenate([h[0] for h in home], axis=1).astype(k.dtype)
    dvv = jnp.concatenate([h[1] for h in home], axis=1).astype(v.dtype)
    return dq.astype(q.dtype), dk, dvv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q, k, v, desc, scale, softcap, axis_name, plan):
    return _forward(q, k, v, desc, scale, softcap, axis_name, plan)


def _ring_fwd(q, k, v, desc, scale, softcap, axis_name, plan):
    out, lse = _forward(q, k, v, desc, scale, softcap, axis_name, plan)
    return (out, lse), (q, k, v, desc, out, lse)


def _ring_bwd(scale, softcap, axis_name, plan, res, cts):
    q, k, v, desc, out, lse = res
    do, dlse = cts
    dq, dk, dv = _backward(q, k, v, desc, scale, softcap, axis_name, plan, out, lse, do,
                           dlse)
    return dq, dk, dv, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _default_block(cs):
    b = 128
    while cs % b:
        b //= 2
    return max(b, 1)


def ring_attention(query, key, value, mask, *, axis_name: str,
                   layout: Union[None, Sequence[int], RingPlan] = None,
                   metadata: Optional[Mapping] = None, scale: Optional[float] = None,
                   logits_soft_cap: Optional[float] = None, return_residuals: bool = False):
    """Attention under a compiled mask with the sequence sharded over ``axis_name``.

    Call it inside ``jax.shard_map`` with query/key/value sharded along axis 1 (the
    sequence) over ``axis_name``; the result is sharded the same way. See the module doc
    for the ring, what it skips, and the backward.

    Args:
      query, key, value: the local shards, [batch, N / P, heads, head_dim] (layout of
        :func:`jcompilemask.mask_attention`; GQA/MQA as there).
      mask: an :class:`ExecutionDescriptor` built for the **whole** sequence (q_len ==
        kv_len == N, original order), replicated over ``axis_name`` (it may be sharded
        along the batch over another axis), or a MaskSpec / CompiledMask with
        ``metadata`` (the descriptor is then built here, at the whole length, with tiles
        that divide a chunk).
      axis_name: the mesh axis the sequence is sharded over (P = its size).
      layout: which chunks each device holds: None (one chunk per device, in order), a
        chunk order (e.g. :func:`balance_permutation`; the caller applies it with
        :func:`permute_sequence`), or a :class:`RingPlan` (a static transfer schedule
        from :func:`ring_plan`). Without a plan, one is made from the descriptor when it
        is concrete; otherwise every chunk goes round the whole ring.
      metadata, scale, logits_soft_cap, return_residuals: as in ``mask_attention``.

    Returns:
      ``out`` [batch, N / P, heads, head_dim_v] (and ``lse`` [batch, heads, N / P]).
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be rank 4 [batch, seq / P, heads, dim], got "
                             f"shape {getattr(x, 'shape', None)}")
    if query.shape[1] != key.shape[1] or key.shape[1] != value.shape[1]:
        raise ValueError("context parallelism is for self-attention: query, key and value "
                         f"shards must have the same length, got {query.shape[1]}, "
                         f"{key.shape[1]}, {value.shape[1]}")
    try:
        p = lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"axis_name {axis_name!r} is not a mesh axis here: call "
                         "ring_attention inside jax.shard_map over a mesh with that "
                         "axis") from e
    n = query.shape[1] * p
    if isinstance(layout, RingPlan):
        plan, chunks = layout, layout.chunks
        if plan.num_devices != p:
            raise ValueError(f"the plan is for {plan.num_devices} devices; axis "
                             f"{axis_name!r} has {p}")
    else:
        plan, chunks = None, check_layout(range(p) if layout is None else layout, p)

    if isinstance(mask, (MaskSpec, CompiledMask)):
        cm = _compile(mask)
        if cm.batched and metadata is None:
            raise ValueError(f"this mask reads metadata {sorted(cm.spec.metadata)}: pass "
                             "metadata={...} or an ExecutionDescriptor")
        blk = _default_block(n // len(chunks)) if n % len(chunks) == 0 else 128
        mask = cm.instantiate(metadata, n, n, block_q=blk, block_kv=blk, bwd_block_q=blk,
                              bwd_block_kv=blk, preprocess="jnp")
    elif not isinstance(mask, ExecutionDescriptor):
        raise TypeError("mask must be an ExecutionDescriptor, MaskSpec or CompiledMask, "
                        f"got {type(mask).__name__}")
    elif metadata is not None:
        raise ValueError("metadata is only used when mask is a MaskSpec or CompiledMask")
    desc = mask
    if getattr(desc.mask, "layout", None) == "bitmap":
        raise ValueError("context parallelism needs interval tables; this dense mask is kept "
                         "as a bitmap (too many runs per row): run it without context_axis")
    if desc.mask.fallback_regions:
        raise ValueError(f"context parallelism needs a fully lowered mask; regions "
                         f"{list(desc.mask.fallback_regions)} fall back to an element "
                         "predicate (see CompiledMask.explain()): run them without "
                         "context_axis")
    if (desc.q_len, desc.kv_len) != (n, n):
        raise ValueError(f"the descriptor was built for q_len={desc.q_len}, kv_len="
                         f"{desc.kv_len}; with {p} devices of {query.shape[1]} rows the "
                         f"whole sequence is {n}: build it for the whole sequence")
    chunk_size(desc, len(chunks))
    b, hq = query.shape[0], query.shape[2]
    if desc.batch not in (1, b):
        raise ValueError(f"the descriptor has batch {desc.batch}; the call has batch {b}")
    if desc.mask_heads not in (1, hq):
        raise ValueError(f"the mask has {desc.mask_heads} heads; the call has {hq}")
    if plan is None:
        plan = (ring_plan(desc, p, chunks) if _is_concrete(desc)
                else full_ring_plan(p, chunks))
    d = query.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if logits_soft_cap is not None:
        if not isinstance(logits_soft_cap, (int, float)) or logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be a positive float, got "
                             f"{logits_soft_cap!r}")
        logits_soft_cap = float(logits_soft_cap)
    out, lse = _ring(query, key, value, desc, float(scale), logits_soft_cap, axis_name, plan)
    return (out, lse) if return_residuals else out
