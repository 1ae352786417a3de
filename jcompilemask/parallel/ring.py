"""Mask-aware ring attention: context (sequence) parallelism over one mesh axis.

Inside ``jax.shard_map``, q, k and v are sharded along their sequence axis over a mesh
axis; each device keeps its query rows and passes key/value chunks around the ring
(``lax.ppermute`` to the next device), combining the partial results of each step by
their log-sum-exp, as in ring attention (Liu et al., 2023). Per step, the rows of the
device are attended to the chunks it holds by an attention backend of the registry
(:mod:`jcompilemask.backends`), on a descriptor cut from the global one for exactly
those rows and columns, so its tile skipping, interval checks and backward are reused
unchanged.

Backends. ``implementation`` means what it means for ``mask_attention``: None takes
the registry's choice for a step's call (on an H200 the CuTe forward and backward
kernels; elsewhere ``xla``, the blockwise jnp attention of
:mod:`jcompilemask.attention.xla`), a name raises when that backend cannot run the
call. A step's descriptor holds the key chunks of one device, ``chunks_per_device``
of them, each clipping every row's intervals, so it has ``K * chunks_per_device``
interval slots per row (and ``Kc * chunks_per_device`` per column): a backend that
refuses that step call (the CuTe kernels unroll K <= 8) is replaced by ``xla`` for the
steps, with a logged notice. The descriptor's tiles are the backend's own: a MaskSpec
is instantiated at them, a prebuilt descriptor must have them (as for
``mask_attention``), and a chunk must be a whole number of them -- the CuTe kernels run
only 128 x 128 forward and 64 x 128 backward tiles (head dim 128), so chunks are
multiples of 128 rows; otherwise a named implementation raises saying so, and the
automatic choice falls back to ``xla`` (tiles that divide the chunk) with a logged
notice.

Precision. Partial results are merged (forward: ``out`` by the log-sum-exp weights) and
summed (backward: dQ over steps, dK/dV along the route) in float32. The ``xla`` steps
hand over float32 partials; a backend that returns the input dtype (the CuTe kernels:
``out``, dQ, dK, dV in bfloat16 / float16, lse float32) has each step's partial
rounded to that dtype before the float32 merge, as other ring implementations do: up to
one rounding per step on top of the final one, so with P > 1 steps the error is a few
units in the last place of the input dtype rather than the one-device call's one or
two. The backward of every step reads the **merged** ``out``, ``lse`` (and their
cotangents): the softmax delta ``rowsum(dO * O) - dlse`` is the global one, which is
what each step's share of the gradient needs.

The descriptor. It is built for the **whole sequence** (``q_len == kv_len == N``, the
original order) and replicated over the context axis: its size is O(N * K) for the
interval tables plus the tile bitmaps, small next to q, k, v, and every device needs the
rows x columns of every step anyway. Each step cuts from it the intervals of the local
rows clipped to the held key chunks (re-based to local columns), the column intervals of
the held keys clipped to the local rows, and the matching blocks of both tile-state
maps. Masks with residual predicates (an element predicate over absolute indices) are not
supported here, except where they are residue classes (a dilated window,
:mod:`jcompilemask.lower.classes`): with a :class:`ClassDescriptor` (or a spec that has one
at N), each device's shard viewed as ``[B, N / (P c), c H, D]`` is its chunks of the class
sequence when a chunk is a multiple of ``c`` rows, and the ring runs one class's mask at
``N / c`` with ``c H`` heads.

Layout. The sequence is cut into C chunks (whole tiles of both passes); a layout (a
tuple of chunk ids, see :mod:`jcompilemask.parallel.plan`) says which chunks each device
holds: ``balance_permutation`` balances visible pairs per device (zigzag for causal), and
the caller applies it with ``permute_sequence`` before sharding and undoes it with
``unpermute_sequence``. Default: one chunk per device, in order.

What is skipped.

* Compute, always: a step whose held chunks have no non-empty tile for this device's rows
  is skipped with ``lax.cond`` (no logits, no softmax, no gradient products); within a
  step the backend visits only non-empty tiles.
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

import dataclasses
import functools
import math
from typing import Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import backends as _backends
from .._progress import log_once
from ..attention import compat as _compat
from ..attention import partition as _partition
from ..attention import xla as _xla
from ..lower.classes import ENV as CLASSES_ENV, classes_enabled
from ..lower.compiled import CompiledMask, compile as _compile
from ..lower.descriptor import COMPUTE, ClassDescriptor, ExecutionDescriptor, TileConfig, pack_tiles
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


def _step_forward(backend: str, zero):
    """``f(q, kc, vc, sub, scale, softcap) -> (out, lse)`` of one ring step, float32.

    ``xla`` computes the partial ``out`` in float32 directly; another backend returns it
    in its own dtype (the CuTe kernels: the input dtype), cast up here for the merge.
    Adding ``zero`` (a float32 0 varying over the mesh axes of the ring's values) gives
    the results exactly the type of the skipped step's zeros, which ``lax.cond`` needs: a
    custom call's results are typed as not varying inside ``shard_map`` unless the
    backend marks them (the library's own do, ``ffi.match_varying``; a registered
    backend need not)."""
    if backend == "xla":
        return functools.partial(_xla.forward, out_dtype=F32)
    fwd = _backends.get(backend).forward

    def f(q, k, v, sub, scale, softcap):
        o, lse = fwd(q, k, v, sub, scale, softcap)
        return o.astype(F32) + zero, lse.astype(F32) + zero
    return f


def _step_backward(backend: str, zero, deterministic: bool):
    """``f(q, kc, vc, sub, scale, softcap, out, lse, do, dlse) -> (dq, dk, dv)`` of one
    ring step, float32 (cast up from the backend's dtype and typed as varying, as for the
    forward). ``deterministic`` is passed on when set (the xla backward is deterministic
    either way; the ring adds the steps' parts in a fixed order)."""
    if backend == "xla":
        return functools.partial(_xla.backward, out_dtype=F32)
    bwd = _backends.get(backend).backward
    kw = {"deterministic": True} if deterministic else {}

    def f(q, k, v, sub, scale, softcap, out, lse, do, dlse):
        return tuple(g.astype(F32) + zero for g in bwd(q, k, v, sub, scale, softcap, out,
                                                        lse, do, dlse, **kw))
    return f


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


def _forward(q, k, v, desc, scale, softcap, axis_name, plan, backend):
    p, cpd = plan.num_devices, plan.chunks_per_device
    d = lax.axis_index(axis_name)
    cut = _Cutter(desc, plan, d)
    zero = _ref_zero(q, k, v, desc)
    b, n, hq, _ = q.shape
    dv = v.shape[-1]
    out = jnp.zeros_like(zero, shape=(b, n, hq, dv))
    lse = jnp.full_like(zero, NEG_INF, shape=(b, hq, n))
    held = list(zip(_slots(k, cpd), _slots(v, cpd)))

    attend = _step_forward(backend, zero)

    def compute(q, kc, vc, sub):
        return attend(q, kc, vc, sub, scale, softcap)

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


def _backward(q, k, v, desc, scale, softcap, axis_name, plan, backend, deterministic, out,
              lse, do, dlse):
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

    grads = _step_backward(backend, zero, deterministic)

    def compute(q, kc, vc, sub):
        # The merged out / lse / do / dlse of the whole row: each step's delta is global.
        return grads(q, kc, vc, sub, scale, softcap, out, lse, do, dlse)

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


# The ring's forward and backward as one program each: under jax.jit these inline (the
# compiled step is the same); in an unjitted shard_map they run as one program instead
# of op by op (each ring step's concatenates, conds, merges and ppermutes dispatched and
# compiled one at a time: seconds per call on a CPU, tests/test_context_parallel.py).
_forward_one = jax.jit(_forward, static_argnums=(4, 5, 6, 7, 8))
_backward_one = jax.jit(_backward, static_argnums=(4, 5, 6, 7, 8, 9))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _ring(q, k, v, desc, scale, softcap, axis_name, plan, backend, deterministic):
    return _forward_one(q, k, v, desc, scale, softcap, axis_name, plan, backend)


def _ring_fwd(q, k, v, desc, scale, softcap, axis_name, plan, backend, deterministic):
    out, lse = _forward_one(q, k, v, desc, scale, softcap, axis_name, plan, backend)
    return (out, lse), (q, k, v, desc, out, lse)


def _ring_bwd(scale, softcap, axis_name, plan, backend, deterministic, res, cts):
    q, k, v, desc, out, lse = res
    do, dlse = cts
    dq, dk, dv = _backward_one(q, k, v, desc, scale, softcap, axis_name, plan, backend,
                               deterministic, out, lse, do, dlse)
    return dq, dk, dv, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _default_block(cs):
    b = 128
    while cs % b:
        b //= 2
    return max(b, 1)


_TILE_FIELDS = ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv")


def _xla_tiles(n: int, c: int) -> TileConfig:
    """Tiles for an ``xla`` ring built here: the largest power of two <= 128 dividing a chunk."""
    blk = _default_block(n // c) if n % c == 0 else 128
    return TileConfig(blk, blk, blk, blk)


def _misfit(cs: int, tiles: TileConfig) -> list[str]:
    """The tile sizes of ``tiles`` that a chunk of ``cs`` rows is not a whole number of."""
    return [f"{f}={getattr(tiles, f)}" for f in _TILE_FIELDS if cs % getattr(tiles, f)]


def _rows(cs, n, c, classes=1) -> str:
    if classes == 1:
        return f"a chunk has {cs} rows (N = {n} over the layout's {c} chunks)"
    return (f"a chunk has {cs} rows per residue class ({cs * classes} rows, {classes} "
            f"classes; N = {n * classes} over the layout's {c} chunks)")


def _chunk_error(cs, n, c, tiles, backend, whose, classes=1) -> ValueError:
    if backend == "xla":
        fix = ("build the descriptor with tiles that divide N / num_chunks, or use fewer "
               "chunks (layout= / context_layout=)")
    else:
        fix = (f"the {backend} backend runs only these tiles, so N / num_chunks must be a "
               f"multiple of them: pass a layout with fewer chunks (layout= / "
               f"context_layout=) or a longer sequence, or implementation='xla' (which "
               f"takes any tiles that divide a chunk)")
    return ValueError(f"{_rows(cs, n, c, classes)}, not a multiple of {whose} "
                      f"{', '.join(_misfit(cs, tiles))}: {fix}")


def _call(query, key, value, cm, softcap, num_intervals, tiles) -> _backends.Call:
    """The registry's view of one ring step's call (see ``mask_attention``'s)."""
    return _backends.call_for(
        cm, dtype=jnp.dtype(query.dtype).name, head_dim=query.shape[-1],
        head_dim_v=value.shape[-1], num_heads=query.shape[2], num_kv_heads=key.shape[2],
        softcap=softcap is not None, num_intervals=num_intervals, tiles=tiles)


def _step_backend(backend, call: _backends.Call, desc, cpd: int) -> str:
    """The backend that runs the steps: ``backend``, unless it refuses a step's call
    (its descriptor has ``K * cpd`` interval slots per row), then ``xla``, said once."""
    if backend.name == "xla":
        return "xla"
    step = dataclasses.replace(call, num_intervals=desc.num_intervals * cpd,
                               tiles=desc.tiles)
    why = _backends._check(backend, step)
    if why is None:
        return backend.name
    log_once(("ring-step", backend.name, why),
             "jcompilemask: ring_attention runs the xla backend per ring step, not %s: a "
             "step's descriptor (the device's rows x its %d held key chunk(s), K = %d x %d "
             "interval slots per row) is refused: %s", backend.name, cpd,
             desc.num_intervals, cpd, why)
    return "xla"


def _length_error(desc, p, rows, n) -> ValueError:
    return ValueError(f"the descriptor was built for q_len={desc.q_len}, kv_len="
                      f"{desc.kv_len}; with {p} devices of {rows} rows the whole sequence "
                      f"is {n}: build it for the whole sequence")


def _ring_classes(cm: CompiledMask, n: int, cs: Optional[int]) -> int:
    """The residue classes a ring over chunks of ``cs`` rows runs ``cm`` with (1: none).
    A chunk must hold whole class rows (``cs`` a multiple of the factor); where it does
    not, the mask takes its residual lowering, which :func:`ring_attention` refuses."""
    rc = cm.row_classes
    if rc is None or cs is None or cs % rc.factor:
        return 1
    return cm.classes_for(n, n)


def _class_chunk_error(f, cs, n, c) -> ValueError:
    return ValueError(f"this mask runs as {f} residue classes, so a chunk must start at a "
                      f"multiple of {f}: a chunk has {cs} rows (N = {n} over the layout's "
                      f"{c} chunks); pass a layout whose chunks are multiples of {f} rows "
                      "(context_layout= / layout=) or pad the sequence")


def _classes_hint(cm, n, cs, c) -> str:
    """Why a mask with residue classes took its residual lowering in the ring."""
    rc = cm.row_classes
    if rc is None:
        return ""
    if not classes_enabled():
        return (f" (it would run as {rc.factor} residue classes, but "
                f"${CLASSES_ENV}=0 turns them off)")
    if cs is not None and cs % rc.factor:
        return f" (or run it as residue classes: {_class_chunk_error(rc.factor, cs, n, c)})"
    return ""


def ring_attention(query, key, value, mask, *, axis_name: str,
                   layout: Union[None, Sequence[int], RingPlan] = None,
                   metadata: Optional[Mapping] = None, scale: Optional[float] = None,
                   logits_soft_cap: Optional[float] = None, return_residuals: bool = False,
                   implementation: Optional[str] = None, deterministic: bool = False):
    """Attention under a compiled mask with the sequence sharded over ``axis_name``.

    Call it inside ``jax.shard_map`` with query/key/value sharded along axis 1 (the
    sequence) over ``axis_name``; the result is sharded the same way. See the module doc
    for the ring, the backend of each step, what it skips, precision and the backward.

    Args:
      query, key, value: the local shards, [batch, N / P, heads, head_dim] (layout of
        :func:`jcompilemask.mask_attention`; GQA/MQA as there).
      mask: an :class:`ExecutionDescriptor` built for the **whole** sequence (q_len ==
        kv_len == N, original order), replicated over ``axis_name`` (it may be sharded
        along the batch over another axis), at the tiles of the backend that runs (the
        default ``instantiate`` builds those), or a MaskSpec / CompiledMask with
        ``metadata`` (the descriptor is then built here, at the whole length, with the
        backend's tiles, or for ``xla`` tiles that divide a chunk). A
        :class:`ClassDescriptor` (residue classes) runs over its class sequence; its
        chunks must be multiples of its ``classes`` rows.
      axis_name: the mesh axis the sequence is sharded over (P = its size).
      layout: which chunks each device holds: None (one chunk per device, in order), a
        chunk order (e.g. :func:`balance_permutation`; the caller applies it with
        :func:`permute_sequence`), or a :class:`RingPlan` (a static transfer schedule
        from :func:`ring_plan`). Without a plan, one is made from the descriptor when it
        is concrete; otherwise every chunk goes round the whole ring. A chunk must be a
        whole number of the descriptor's tiles (the CuTe kernels': multiples of 128).
      implementation: the backend of each ring step, as in ``mask_attention``:
        ``"cute"`` (``"cudnn"`` maps to it), ``"xla"``, or None (the registry's choice
        for a step's call). A named backend that cannot run the call raises; one that
        refuses only a step's sub-call (more interval slots per row, see the module doc)
        is replaced by ``xla`` for the steps with a logged notice.
      metadata, scale, logits_soft_cap, return_residuals, deterministic: as in
        ``mask_attention`` (``deterministic`` goes to each step's backward; the ring adds
        the steps' parts in a fixed order).

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
    impl = _compat.implementation_name(implementation)
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
    c = len(chunks)
    cpd = c // p

    cs = n // c if n % c == 0 else None
    classes = 1
    if isinstance(mask, (MaskSpec, CompiledMask)):
        cm, desc = _compile(mask), None
        if cm.batched and metadata is None:
            raise ValueError(f"this mask reads metadata {sorted(cm.spec.metadata)}: pass "
                             "metadata={...} or an ExecutionDescriptor")
        classes = _ring_classes(cm, n, cs)
    elif metadata is not None and isinstance(mask, (ExecutionDescriptor, ClassDescriptor)):
        raise ValueError("metadata is only used when mask is a MaskSpec or CompiledMask")
    elif isinstance(mask, ClassDescriptor):
        if (mask.q_len, mask.kv_len) != (n, n):
            raise _length_error(mask, p, query.shape[1], n)
        if cs is not None and cs % mask.classes:
            raise _class_chunk_error(mask.classes, cs, n, c)
        cm, desc, classes = mask.mask, mask.for_heads(query.shape[2]), mask.classes
    elif not isinstance(mask, ExecutionDescriptor):
        raise TypeError("mask must be an ExecutionDescriptor, ClassDescriptor, MaskSpec or "
                        f"CompiledMask, got {type(mask).__name__}")
    else:
        cm, desc = mask.mask, mask
    if getattr(cm, "layout", None) == "bitmap":
        raise ValueError("context parallelism needs interval tables; this dense mask is kept "
                         "as a bitmap (too many runs per row): run it without context_axis")
    outer_cm, heads = cm, query.shape[2]
    if classes > 1:
        # Residue classes (lower/classes.py): each device's shard, viewed as [B, rows / f,
        # f H, D], is its chunks of the class sequence (a chunk starts at a multiple of f),
        # so the ring runs one class's mask, at N / f, with f times the heads.
        cm = cm.class_mask
        query, key, value = (_partition.by_class(x, classes) for x in (query, key, value))
        n, cs = n // classes, None if cs is None else cs // classes
    elif cm.fallback_regions:
        raise ValueError(f"context parallelism needs a fully lowered mask; regions "
                         f"{list(cm.fallback_regions)} fall back to an element "
                         "predicate (see CompiledMask.explain()): run them without "
                         f"context_axis{_classes_hint(cm, n, cs, c)}")
    if logits_soft_cap is not None:
        if not isinstance(logits_soft_cap, (int, float)) or logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be a positive float, got "
                             f"{logits_soft_cap!r}")
        logits_soft_cap = float(logits_soft_cap)
    call = _call(query, key, value, cm, logits_soft_cap, cm.num_intervals,
                 None if desc is None else desc.tiles)
    backend = _backends.select(impl, call)

    if desc is None:
        tiles = _xla_tiles(n, c) if backend.name == "xla" else backend.tiles(call)
        if backend.name != "xla" and cs is not None and _misfit(cs, tiles) \
                and backend.tile_options is not None:
            # another config of the backend whose tiles a chunk is a whole number of
            tiles = next((t for t in backend.tile_options(call) if not _misfit(cs, t)), tiles)
        if backend.name != "xla" and cs is not None and _misfit(cs, tiles):
            if impl is not None:
                raise _chunk_error(cs, n, c, tiles, backend.name,
                                   f"the {backend.name} backend's tiles", classes)
            log_once(("ring-tiles", backend.name, cs, tiles),
                     "jcompilemask: ring_attention runs the xla backend, not %s: %s, not a "
                     "multiple of its tiles %s (fewer chunks or a longer sequence would let "
                     "it run)", backend.name, _rows(cs, n, c, classes), tiles)
            backend, tiles = _backends.get("xla"), _xla_tiles(n, c)
        tile_kw = dict(block_q=tiles.block_q, block_kv=tiles.block_kv,
                       bwd_block_q=tiles.bwd_block_q, bwd_block_kv=tiles.bwd_block_kv)
        if classes > 1:       # the class descriptor (per-class metadata included)
            desc = outer_cm.instantiate(metadata, n * classes, n * classes, preprocess="jnp",
                                        row_classes=True, **tile_kw).for_heads(heads)
        else:
            desc = cm.instantiate(metadata, n, n, preprocess="jnp", row_classes=False,
                                  **tile_kw)
    else:
        if (desc.q_len, desc.kv_len) != (n, n):
            raise _length_error(desc, p, query.shape[1], n)
        if cs is not None and _misfit(cs, desc.tiles):
            raise _chunk_error(cs, n, c, desc.tiles, backend.name, "the descriptor's", classes)
    chunk_size(desc, c)
    b, hq = query.shape[0], query.shape[2]
    if desc.batch not in (1, b):
        raise ValueError(f"the descriptor has batch {desc.batch}; the call has batch {b}")
    if desc.mask_heads not in (1, hq):
        raise ValueError(f"the mask has {desc.mask_heads} heads; the call has {hq}")
    if plan is None:
        plan = (ring_plan(desc, p, chunks) if _is_concrete(desc)
                else full_ring_plan(p, chunks))
    step_backend = _step_backend(backend, call, desc, cpd)
    d = query.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    out, lse = _ring(query, key, value, desc, float(scale), logits_soft_cap, axis_name, plan,
                     step_backend, bool(deterministic))
    if classes > 1:
        out, lse = _partition.from_class(out, classes), _partition.lse_from_class(lse, classes)
    return (out, lse) if return_residuals else out
