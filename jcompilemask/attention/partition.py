"""Partitioning rules: ``mask_attention`` under ``jax.jit`` with batch / head sharded inputs.

Every backend call that ``mask_attention`` dispatches (the ``xla`` backend's tile loops;
the CuTe forward and backward, custom calls with their jnp set-up around them) and the
TileLang preprocess custom call are wrapped in
:func:`jax.experimental.custom_partitioning`, so when ``jax.jit`` partitions a program
whose query, key and value are sharded (``NamedSharding`` over a mesh) along the batch
and/or the head axis, each device runs the backend on its own shard and no q, k or v
is gathered. What shards, and how:

* batch: q, k, v, out, lse and the gradients shard together along the batch. The
  descriptor shards with them when it is per sequence (``desc.batch == B``) and is
  replicated when it is shared (``desc.batch == 1``).
* heads: key/value heads shard; query heads shard in whole GQA groups (query head
  ``h`` reads key/value head ``h // (Hq // Hkv)``, and a device holds the groups of its
  key/value heads), so heads are replicated instead when ``Hq > Hkv`` and some mesh
  axis does not divide ``Hkv``. Per-head masks (``desc.mask_heads == Hq``) shard with their
  heads; a shared mask (``mask_heads == 1``) is replicated.
* an additive bias ``[Bb, Hb, Nq|1, Nk|1]`` shards like the descriptor (with the batch
  when ``Bb == B``, with the heads when ``Hb == Hq``); the gradient of a bias shared
  along a sharded axis is summed over that axis's devices (a ``psum`` of its size).
* sequence, head_dim, interval and tile axes are never split: a sharding on them is
  undone (gathered) before the call. Sequence parallelism is a different algorithm
  (the key blocks must travel between devices), not a partitioning of this call.

Why ``custom_partitioning`` and not a ``shard_map`` inside ``mask_attention``: under a
plain ``jax.jit`` the inputs' shardings are not visible while tracing (they are decided
by the partitioner, after tracing, from the arguments and the user's constraints), so
a ``shard_map`` would need the user to pass a mesh and specs. ``custom_partitioning``
is JAX's supported hook for custom calls: the partitioner (Shardy, the default) reads
the :class:`~jax.experimental.custom_partitioning.SdyShardingRule` below to propagate
shardings through the call, then asks :func:`_partition` for the per-device function.
It needs no mesh from the user and leaves single-device programs untouched (JAX inlines
the function when there is one device, and when every mesh axis is manual, as inside
a user's ``shard_map``).

On a mesh with ``Explicit`` axes (``jax.make_mesh``'s default) the shardings are part
of the types while tracing, so there the same layout runs in a ``jax.shard_map``
instead, with the inputs resharded to it first.

``custom_partitioning`` has no batching rule, so each wrapped call is also a
:class:`jax.custom_batching.custom_vmap` whose rule runs the unpartitioned function
under ``vmap``: ``jax.vmap`` over ``mask_attention`` behaves as before (and is not
partitioned by these rules).

>>> import jax, jax.numpy as jnp, numpy as np, jcompilemask as jcm
>>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
>>> x = jax.device_put(jnp.ones((2, 16, 2, 8)), NamedSharding(mesh, P("data")))
>>> f = jax.jit(lambda q: jcm.mask_attention(q, q, q, jcm.masks.causal()))
>>> f(x).shape
(2, 16, 2, 8)
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor,
                                                  SdyShardingRule, custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec

from .. import backends as _backends

__all__ = ["forward", "backward", "batch_sharded", "by_class", "from_class", "lse_by_class",
           "lse_from_class"]

# Fields of the descriptor (in pytree order) whose axis 1 is the mask-head axis.
_HEAD_FIELDS = (0, 1, 2, 3)     # fwd_intervals, bwd_intervals, fwd_tiles, bwd_tiles


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the partitioning callbacks need besides the arrays (hashable)."""

    backend: str
    scale: float
    softcap: Optional[float]
    desc_tree: Any                     # treedef of the descriptor (holds its static aux)
    desc_fields: tuple                 # per descriptor leaf: its field index
    shapes: tuple                      # shapes of all operands, in call order
    kind: str                          # "fwd" or "bwd"
    has_dlse: bool = False
    has_bias: bool = False
    bias_grad: bool = False
    deterministic: bool = False
    # a ClassDescriptor whose classes are its inner mask heads (per-class metadata): that
    # axis is not the call's heads and is never sharded with them
    per_class: bool = False

    @property
    def n_desc(self):
        return len(self.desc_fields)

    def dims(self):
        """(B, Hq, Hkv, Bm, Hm); Hm is 1 for a per-class descriptor (module doc)."""
        b, _, hq, _ = self.shapes[0]
        hkv = self.shapes[1][2]
        fwd_iv = self.shapes[3]
        return b, hq, hkv, fwd_iv[0], 1 if self.per_class else fwd_iv[1]


def _desc_leaves(desc):
    """Leaves of ``desc`` with the index of the field each comes from (metadata dict
    leaves all come from the last field)."""
    children, _ = desc.tree_flatten()
    leaves, fields = [], []
    for i, child in enumerate(children):
        sub = jax.tree.leaves(child)
        leaves += sub
        fields += [i] * len(sub)
    return leaves, tuple(fields), jax.tree.structure(desc)


# -- the sharding rule ------------------------------------------------------------------
def _rule(st: _Static, mesh, value_types, result_types):
    b, hq, hkv, bm, hm = st.dims()
    g = hq // hkv
    heads = CompoundFactor("kh", "grp") if g > 1 else "kh"
    sizes = {"grp": g} if g > 1 else {}
    fresh = []                                    # factors that must stay whole

    def own(name):
        fresh.append(name)
        return name

    q = ArrayMapping("b", "nq", heads, "d")
    k = ArrayMapping("b", "nk", "kh", "d")
    v = ArrayMapping("b", "nk", "kh", "dv")
    out = ArrayMapping("b", "nq", heads, "dv")
    lse = ArrayMapping("b", heads, "nq")
    desc = []
    for j, f in enumerate(st.desc_fields):
        ndim = len(st.shapes[3 + j])
        dims = []
        for a in range(ndim):
            if a == 0 and bm == b:
                dims.append("b")
            elif a == 1 and f in _HEAD_FIELDS and hm == hq:
                dims.append(heads)
            else:
                dims.append(own(f"x{j}_{a}"))
        desc.append(ArrayMapping(*dims))
    bias = ()
    if st.has_bias:
        bb, hb = st.shapes[-1][:2]
        bias = (ArrayMapping("b" if bb == b else own("bias_b"),
                             heads if hb == hq else own("bias_h"),
                             own("bias_q"), own("bias_k")),)
    if st.kind == "fwd":
        operands, results = (q, k, v, *desc, *bias), (out, lse)
    else:
        operands = ((q, k, v, *desc, out, lse, out) + ((lse,) if st.has_dlse else ())
                    + bias)
        results = (q, k, v) + (bias if st.bias_grad else ())
    whole = ("nq", "nk", "d", "dv", *fresh) + (("grp",) if g > 1 else ())
    if g > 1 and any(hkv % n for n in mesh.shape.values()):
        # A mesh axis that does not divide the key/value heads would be split into
        # sub-axes over the query heads (part of a GQA group per device), which the
        # callbacks cannot express: replicate the heads (batch sharding still applies).
        whole += ("kh",)
    return SdyShardingRule(operands, results, **sizes,
                           need_replication_factors=_in_order(whole, operands + results))


def _in_order(factors, mappings):
    """``factors`` in order of first use (the order Shardy requires of special factors)."""
    seen = []
    for m in mappings:
        for d in m:
            for f in (d if isinstance(d, CompoundFactor) else (d,)):
                if f not in seen:
                    seen.append(f)
    return tuple(sorted(set(factors), key=seen.index))


# -- choosing the per-device shardings --------------------------------------------------
def _axis_size(mesh, entry):
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def _entries(mesh):
    """Every way to shard one array axis over the mesh: None, an axis, a tuple of axes."""
    names = tuple(mesh.axis_names)
    out = [None]
    for r in range(1, len(names) + 1):
        for combo in itertools.permutations(names, r):
            out.append(combo[0] if r == 1 else combo)
    return out


def _decode(mesh, sharding, ndim, dims):
    """The mesh axes of ``dims`` if ``sharding`` shards exactly those array axes over
    whole mesh axes (others replicated), else all None.

    The partitioner hands the callbacks XLA shardings (``decode_shardings=False``):
    JAX's own decoding into ``NamedSharding`` raises on sub-axis shardings, which
    Shardy makes when a mesh axis meets a smaller factor (query heads over an axis that
    does not divide the key/value heads). Matching by equivalence accepts what the
    callbacks can express and replicates the rest (correct, at the cost of a gather).
    """
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))
        if all(spec[a] is None for a in range(ndim) if a not in dims):
            return tuple(spec[a] for a in dims)
        return (None,) * len(dims)
    if sharding is None or sharding.is_fully_replicated:
        return (None,) * len(dims)
    for combo in itertools.product(_entries(mesh), repeat=len(dims)):
        used = [n for e in combo if e is not None for n in (e if isinstance(e, tuple) else (e,))]
        if len(used) != len(set(used)):
            continue
        spec = [None] * ndim
        for a, e in zip(dims, combo):
            spec[a] = e
        cand = NamedSharding(mesh, PartitionSpec(*spec))
        try:
            if cand.is_equivalent_to(sharding, ndim):
                return combo
        except (ValueError, TypeError):
            continue
    return (None,) * len(dims)


def _layout(st: _Static, mesh, q_sharding):
    """(batch axes, head axes) the call runs over, from the query's sharding: what
    divides evenly (heads: in whole GQA groups), everything else replicated."""
    b, hq, hkv, _, _ = st.dims()
    bax, hax = _decode(mesh, q_sharding, 4, (0, 2))
    if b % _axis_size(mesh, bax):
        bax = None
    if hkv % _axis_size(mesh, hax):
        hax = None
    return bax, hax


def _shardings(st: _Static, mesh, bax, hax):
    b, hq, _, bm, hm = st.dims()
    ns = lambda *s: NamedSharding(mesh, PartitionSpec(*s))   # noqa: E731
    qs = ns(bax, None, hax, None)
    lse = ns(bax, hax, None)
    desc = []
    for j, f in enumerate(st.desc_fields):
        ndim = len(st.shapes[3 + j])
        s = [None] * ndim
        if ndim and bm == b:
            s[0] = bax
        if ndim > 1 and f in _HEAD_FIELDS and hm == hq:
            s[1] = hax
        desc.append(ns(*s))
    bias = ()
    if st.has_bias:
        bb, hb = st.shapes[-1][:2]
        bias = (ns(bax if bb == b else None, hax if hb == hq else None, None, None),)
    if st.kind == "fwd":
        return (qs, qs, qs, *desc, *bias), (qs, lse)
    args = (qs, qs, qs, *desc, qs, lse, qs) + ((lse,) if st.has_dlse else ()) + bias
    return args, (qs, qs, qs) + (bias if st.bias_grad else ())


def by_class(x, c):
    """[B, N, H, D] -> [B, N / c, c H, D] (row ``c i + r`` of head ``h`` is row ``i`` of head
    ``r H + h``: a view)."""
    b, n, h, d = x.shape
    return x.reshape(b, n // c, c * h, d)


def from_class(x, c):
    b, m, ch, d = x.shape
    return x.reshape(b, m * c, ch // c, d)


def lse_by_class(x, c):
    """[B, H, N] -> [B, c H, N / c] (a transpose of the small lse)."""
    b, h, n = x.shape
    return jnp.moveaxis(x.reshape(b, h, n // c, c), -1, 1).reshape(b, c * h, n // c)


def lse_from_class(x, c):
    b, ch, m = x.shape
    return jnp.moveaxis(x.reshape(b, c, ch // c, m), 1, -1).reshape(b, ch // c, m * c)


def _call(st: _Static, *arrays):
    """The backend on whatever shapes it is given (global or one device's shard). A
    :class:`ClassDescriptor` (residue classes) runs its inner descriptor on this device's
    arrays viewed with the classes as heads, so batch and head sharding stay local."""
    q, k, v = arrays[:3]
    desc = jax.tree.unflatten(st.desc_tree, arrays[3:3 + st.n_desc])
    rest = arrays[3 + st.n_desc:]
    c = getattr(desc, "classes", 1)
    if c == 1:
        return _backend_call(st, q, k, v, desc, rest)
    assert not st.has_bias, "a bias under residue classes is gathered by mask_attention"
    inner = desc.for_heads(q.shape[2])         # this device's heads
    q, k, v = (by_class(x, c) for x in (q, k, v))
    if st.kind == "fwd":
        out, lse = _backend_call(st, q, k, v, inner, rest)
        return from_class(out, c), lse_from_class(lse, c)
    out, lse, do = rest[:3]
    rest = ((by_class(out, c), lse_by_class(lse, c), by_class(do, c))
            + tuple(lse_by_class(x, c) for x in rest[3:]))             # dlse
    return tuple(from_class(x, c) for x in _backend_call(st, q, k, v, inner, rest))


def _backend_call(st: _Static, q, k, v, desc, rest):
    """``rest``: the operands after the descriptor's leaves (out, lse, do[, dlse]) and the
    bias last."""
    bias = rest[-1] if st.has_bias else None
    be = _backends.get(st.backend)
    if st.kind == "fwd":
        if bias is None:
            return tuple(be.forward(q, k, v, desc, st.scale, st.softcap))
        return tuple(be.forward(q, k, v, desc, st.scale, st.softcap, bias=bias))
    out, lse, do = rest[:3]
    dlse = rest[3] if st.has_dlse else None
    args = (q, k, v, desc, st.scale, st.softcap, out, lse, do, dlse)
    if bias is not None:
        dq, dk, dv, dbias = be.backward(*args, bias=bias, bias_grad=st.bias_grad)
        return (dq, dk, dv) + ((dbias,) if st.bias_grad else ())
    if st.deterministic:
        return tuple(be.backward(*args, deterministic=True))
    return tuple(be.backward(*args))


def _local(st: _Static, bax, hax):
    """The per-device function: the backend on the shard, and for a bias gradient whose
    bias is shared along a sharded axis, the sum of the devices' parts over that axis."""
    def fn(*arrays):
        res = _call(st, *arrays)
        if st.kind == "bwd" and st.bias_grad:
            b, hq, _, _, _ = st.dims()
            bb, hb = st.shapes[-1][:2]
            axes = tuple(n for e, shared in ((bax, bb != b), (hax, hb != hq))
                         if shared and e is not None
                         for n in (e if isinstance(e, tuple) else (e,)))
            if axes:
                dbias = jax.lax.psum(res[-1].astype(jnp.float32), axes)
                res = res[:-1] + (dbias.astype(res[-1].dtype),)
        return res
    return fn


def _partition(st: _Static, mesh, arg_shapes, result_shape):
    bax, hax = _layout(st, mesh, arg_shapes[0].sharding)
    args, results = _shardings(st, mesh, bax, hax)
    return mesh, _local(st, bax, hax), results, args


def _infer(st: _Static, mesh, arg_shapes, result_shape):
    # Only asked when the (deprecated) GSPMD partitioner is turned on instead of Shardy.
    bax, hax = _layout(st, mesh, arg_shapes[0].sharding)
    return _shardings(st, mesh, bax, hax)[1]


_attention_cp = custom_partitioning(_call, static_argnums=(0,))
_attention_cp.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                            sharding_rule=_rule, decode_shardings=False)


def _explicit_mesh(x):
    """The mesh of ``x``'s sharding type when it has Explicit axes (None otherwise)."""
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not any(
            t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return None
    return mesh


def _run_explicit(st: _Static, mesh, arrays):
    # Explicit axes: the shardings are part of the types while tracing, so the layout is
    # known here and a shard_map runs the backend on each device's shard.
    bax, hax = _layout(st, mesh, NamedSharding(mesh, jax.typeof(arrays[0]).sharding.spec))
    args, results = _shardings(st, mesh, bax, hax)
    arrays = tuple(jax.sharding.reshard(a, s) for a, s in zip(arrays, args))
    return jax.shard_map(_local(st, bax, hax), mesh=mesh,
                         in_specs=tuple(s.spec for s in args),
                         out_specs=tuple(s.spec for s in results))(*arrays)


def _single_device() -> bool:
    """A process with one device has nothing to partition: the calls then run as they
    are, exactly the code validated on one GPU (no custom_partitioning around the kernels)."""
    return jax.device_count() == 1


def _run(st: _Static, arrays):
    if _single_device():
        return _call(st, *arrays)
    mesh = _explicit_mesh(arrays[0])
    if mesh is not None:
        return _run_explicit(st, mesh, arrays)
    return _with_vmap(lambda *a: _attention_cp(st, *a), lambda *x: _call(st, *x), arrays)


def _with_vmap(partitioned: Callable, plain: Callable, arrays):
    """``partitioned(*arrays)`` with a batching rule: custom_partitioning has none, so
    under ``vmap`` the plain (unpartitioned) function is vmapped instead."""
    cv = jax.custom_batching.custom_vmap(partitioned)

    @cv.def_vmap
    def _vmapped(axis_size, in_batched, *a):
        out = jax.vmap(plain, in_axes=tuple(0 if bt else None for bt in in_batched),
                       axis_size=axis_size)(*a)
        return out, tuple(True for _ in out)

    return cv(*arrays)


def forward(backend: str, q, k, v, desc, scale: float, softcap: Optional[float], bias=None):
    """``backends.get(backend).forward(q, k, v, desc, scale, softcap[, bias=bias])``,
    partitioned over batch and heads (see the module doc): ``(out, lse)``."""
    leaves, fields, tree = _desc_leaves(desc)
    arrays = (q, k, v, *leaves) + (() if bias is None else (bias,))
    st = _Static(backend, float(scale), softcap, tree, fields,
                 tuple(tuple(a.shape) for a in arrays), "fwd", has_bias=bias is not None,
                 per_class=getattr(desc, "per_class", False))
    return _run(st, arrays)


def backward(backend: str, q, k, v, desc, scale: float, softcap: Optional[float], out, lse,
             do, dlse=None, *, bias=None, bias_grad=False, deterministic=False):
    """``backends.get(backend).backward(...)``, partitioned over batch and heads:
    ``(dq, dk, dv)``, and ``(dq, dk, dv, dbias)`` with a bias (dbias None unless
    ``bias_grad``). A bias shared along a sharded batch or head axis gets its gradient
    summed over the devices of that axis."""
    leaves, fields, tree = _desc_leaves(desc)
    arrays = ((q, k, v, *leaves, out, lse, do) + (() if dlse is None else (dlse,))
              + (() if bias is None else (bias,)))
    st = _Static(backend, float(scale), softcap, tree, fields,
                 tuple(tuple(a.shape) for a in arrays), "bwd", dlse is not None,
                 has_bias=bias is not None, bias_grad=bool(bias_grad) and bias is not None,
                 deterministic=bool(deterministic), per_class=getattr(desc, "per_class", False))
    res = _run(st, arrays)
    if bias is None:
        return res
    return res if st.bias_grad else res + (None,)


# -- batch-only custom calls (the TileLang preprocess) ------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class _BatchCall:
    build: Callable            # build(local_batch) -> fn(*operands) -> tuple of outputs
    batch: int
    in_ndims: tuple
    out_ndims: tuple


def _batch_fn(bc: _BatchCall, *operands):
    b = operands[0].shape[0] if operands else bc.batch
    return tuple(bc.build(b)(*operands))


def _batch_rule(bc: _BatchCall, mesh, value_types, result_types):
    whole = []

    def mapping(tag, ndim):
        dims = ["b"] + [f"{tag}_{a}" for a in range(1, ndim)]
        whole.extend(dims[1:])
        return ArrayMapping(*dims)
    ops = tuple(mapping(f"i{i}", n) for i, n in enumerate(bc.in_ndims))
    res = tuple(mapping(f"o{i}", n) for i, n in enumerate(bc.out_ndims))
    return SdyShardingRule(ops, res, need_replication_factors=_in_order(whole, ops + res))


def _batch_layout(bc: _BatchCall, mesh, arg_shapes):
    bax = _decode(mesh, arg_shapes[0].sharding, bc.in_ndims[0], (0,))[0]
    if bc.batch % _axis_size(mesh, bax):
        bax = None
    ns = lambda n: NamedSharding(mesh, PartitionSpec(bax, *([None] * (n - 1))))  # noqa: E731
    return (tuple(ns(n) for n in bc.in_ndims), tuple(ns(n) for n in bc.out_ndims))


def _batch_partition(bc: _BatchCall, mesh, arg_shapes, result_shape):
    args, results = _batch_layout(bc, mesh, arg_shapes)
    return mesh, lambda *a: _batch_fn(bc, *a), results, args


def _batch_infer(bc: _BatchCall, mesh, arg_shapes, result_shape):
    return _batch_layout(bc, mesh, arg_shapes)[1]


_batch_cp = custom_partitioning(_batch_fn, static_argnums=(0,))
_batch_cp.def_partition(partition=_batch_partition, infer_sharding_from_operands=_batch_infer,
                        sharding_rule=_batch_rule, decode_shardings=False)


def batch_sharded(build: Callable, batch: int, *operands):
    """Run ``build(batch)(*operands)`` so that it shards along axis 0 under ``jax.jit``.

    For a custom call whose operands and results all lead with the batch axis (each
    sequence computed on its own, as the TileLang preprocess does): each device runs
    ``build(local_batch)`` on its rows of every operand. Other axes are replicated.
    ``build`` makes the function for a batch size (its result shapes depend on it).

    >>> import jax.numpy as jnp
    >>> batch_sharded(lambda b: lambda x: (x * 2,), 3, jnp.ones((3, 4)))[0].shape
    (3, 4)
    """
    if not operands or _single_device():   # nothing to shard
        return tuple(build(batch)(*operands))
    if any(getattr(x, "ndim", 0) < 1 or x.shape[0] != batch for x in operands):
        raise ValueError("batch_sharded: every operand must lead with the batch axis "
                         f"({batch}); got shapes {[getattr(x, 'shape', None) for x in operands]}")
    out_ndims = tuple(o.ndim for o in jax.eval_shape(build(batch), *operands))
    bc = _BatchCall(build, batch, tuple(x.ndim for x in operands), out_ndims)
    return _with_vmap(lambda *a: _batch_cp(bc, *a), lambda *x: _batch_fn(bc, *x), operands)
