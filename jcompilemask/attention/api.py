"""``mask_attention``: the public attention function (validation, dispatch, custom_vjp);
the ``jax.nn.dot_product_attention`` arguments are resolved in :mod:`.compat`."""
from __future__ import annotations

import functools
import math
import warnings
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import backends as _backends
from ..lower.compiled import compile as _compile
from ..lower.descriptor import ClassDescriptor
from . import compat as _compat
from . import partition as _partition

__all__ = ["mask_attention"]

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attention(q, k, v, desc, bias, scale, softcap, backend_name, bias_grad, deterministic):
    return _forward(q, k, v, desc, bias, scale, softcap, backend_name)


def _forward(q, k, v, desc, bias, scale, softcap, backend_name):
    return _partition.forward(backend_name, q, k, v, desc, scale, softcap, bias)


def _attention_fwd(q, k, v, desc, bias, scale, softcap, backend_name, bias_grad, deterministic):
    out, lse = _forward(q, k, v, desc, bias, scale, softcap, backend_name)
    return (out, lse), (q, k, v, desc, bias, out, lse)


_SECOND_ORDER = (
    "jcompilemask.mask_attention supports first-order reverse mode only: its gradient (the "
    "backend's backward pass) cannot itself be differentiated, so a Hessian, a Hessian-vector "
    "product or a gradient penalty through it does not work. For those, use "
    "jax.nn.dot_product_attention with the mask as a dense boolean array (e.g. "
    "spec.as_dense(metadata, q_len, kv_len)).")


@jax.custom_jvp
def _first_order_only(x):
    """The identity, whose derivative is a clear error: applied to what the backward pass
    reads, so that differentiating the gradient of ``mask_attention`` says why it cannot,
    instead of failing inside a backend (a dynamic ``fori_loop``, an FFI call)."""
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise NotImplementedError(_SECOND_ORDER)


def _attention_bwd(scale, softcap, backend_name, bias_grad, deterministic, res, cts):
    q, k, v, desc, bias, out, lse = res
    do, dlse = cts
    q, k, v, out, lse, do = (_first_order_only(x) for x in (q, k, v, out, lse, do))
    if dlse is not None:
        dlse = _first_order_only(dlse)
    if bias is not None:
        bias = _first_order_only(bias)
    if bias is None:
        dq, dk, dv = _partition.backward(backend_name, q, k, v, desc, scale, softcap, out,
                                         lse, do, dlse, deterministic=deterministic)
        return dq, dk, dv, None, None
    dq, dk, dv, dbias = _partition.backward(backend_name, q, k, v, desc, scale, softcap, out,
                                            lse, do, dlse, bias=bias, bias_grad=bias_grad)
    return dq, dk, dv, None, dbias


_attention.defvjp(_attention_fwd, _attention_bwd)


def _class_attention_with_bias(q, k, v, desc, bias, scale, softcap, backend_name,
                               bias_grad, deterministic):
    """Attention under a :class:`ClassDescriptor` with a bias: [B, N, H, D] viewed as
    [B, N / c, c H, D] (row ``c i + r`` of head ``h`` is row ``i`` of head ``r H + h``; GQA's
    head map is kept: query head ``r H + h`` reads key head ``r Hk + h // (H / Hk)``), the
    bias gathered to its same-class blocks (autodiff scatters its gradient back), one
    class's mask on every class, and the results viewed back. Without a bias the same views
    happen per device inside the partitioned call (attention/partition.py)."""
    c = desc.classes
    bb, nq, nk, hq = bias.shape[0], q.shape[1], k.shape[1], q.shape[2]
    # [B, H, Nq, Nk] -> the same-class blocks [B, H, Nq/c, Nk/c, c] -> [B, c H, ...]
    g = jnp.broadcast_to(bias, (bb, hq, nq, nk)).reshape(bb, hq, nq // c, c, nk // c, c)
    g = jnp.diagonal(g, axis1=3, axis2=5)
    bias = jnp.moveaxis(g, -1, 1).reshape(bb, c * hq, nq // c, nk // c)
    by_class = functools.partial(_partition.by_class, c=c)
    out, lse = _attention(by_class(q), by_class(k), by_class(v), desc.for_heads(hq), bias,
                          scale, softcap, backend_name, bias_grad, deterministic)
    return _partition.from_class(out, c), _partition.lse_from_class(lse, c)


def _shape_error(msg):
    return ValueError(msg + " (layout: query [batch, q_len, heads, head_dim], key/value "
                      "[batch, kv_len, kv_heads, head_dim(_v)])")


def _validate(query, key, value):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise _shape_error(f"{name} must be rank 4 (or 3 without the batch axis, for "
                               f"all three), got shape {x.shape}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name} dtype must be bfloat16, float16 or float32, got "
                            f"{x.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    b, nq, hq, d = query.shape
    bk, nk, hkv, dk = key.shape
    bv, nv, hv, dv = value.shape
    if not (b == bk == bv):
        raise _shape_error(f"batch sizes differ: query {b}, key {bk}, value {bv}")
    if nk != nv:
        raise _shape_error(f"key and value lengths differ: {nk} vs {nv}")
    if hkv != hv:
        raise _shape_error(f"key and value head counts differ: {hkv} vs {hv}")
    if d != dk:
        raise _shape_error(f"query and key head_dim differ: {d} vs {dk}")
    if hkv == 0 or hq % hkv:
        raise _shape_error(f"query heads ({hq}) must be a multiple of key/value heads "
                           f"({hkv}) for GQA/MQA")
    return b, nq, hq, d, nk, hkv, dv


def mask_attention(query, key, value, mask=None, *, bias=None,
                   metadata: Optional[Mapping] = None, scale: Optional[float] = None,
                   is_causal: bool = False, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None,
                   logits_soft_cap: Optional[float] = None,
                   implementation: Optional[str] = None, return_residual: bool = False,
                   return_residuals: Optional[bool] = None, deterministic: bool = False,
                   context_axis: Optional[str] = None, context_layout=None):
    """Attention under a compiled mask, usable inside ``jax.jit``, ``grad`` and ``vmap``.

    Takes what :func:`jax.nn.dot_product_attention` takes (the same names and layouts),
    plus a structured ``mask``, its ``metadata`` and ``logits_soft_cap``.

    Args:
      query: [batch, q_len, num_heads, head_dim] (bfloat16, float16 or float32), or
        [q_len, num_heads, head_dim] (then key and value drop the batch axis too).
      key: [batch, kv_len, num_kv_heads, head_dim]; query head h reads key/value head
        ``h // (num_heads // num_kv_heads)`` (GQA/MQA).
      value: [batch, kv_len, num_kv_heads, head_dim_v]. On an SM90 GPU the CuTe kernels
        take head dims up to 256 in bfloat16 / float16 (those without a kernel of their own
        run a wider one, zero-padded, in place where they are multiples of 8:
        :func:`jcompilemask.backends.cute_head_dims`, ``cute_head_dim_padding``; D 80 / 96
        have kernels of their own, which also take D 72 / 88 in place,
        ``cute_forward_head_dims`` / ``cute_backward_head_dims``); wider ones and float32
        run the ``xla`` backend.
      mask: one of

        * an :class:`ExecutionDescriptor` (built once per step, shared by layers);
        * a :class:`MaskSpec` / :class:`CompiledMask` (with ``metadata`` if it reads any):
          the descriptor is then built here, at the tiles of the backend that runs;
        * a boolean array broadcastable to [batch, num_heads, q_len, kv_len] (True =
          attend), as jax takes it. Concrete and shared by the batch, it is compiled by
          :func:`jcompilemask.from_dense` (O(q_len * kv_len) host work per distinct mask,
          then the fast path). Otherwise (traced inside ``jit``, per sequence, or with
          sequence lengths) its runs are found on the device at every call
          (:func:`jcompilemask.runtime_dense`; about four reads of the mask): interval
          tables of 1 and of 8 runs per row, each on the backend the registry picks (the
          CuTe kernels on an SM90 GPU), the narrowest that holds every row running; a
          mask with more runs in a row runs as a bitmap on the xla backend (exact, slower
          on a GPU). ``jcm.runtime_dense(mask, tiers=...)`` chooses the widths. A
          MaskSpec with metadata skips the O(q_len * kv_len) reads.
        * None: every key is visible (before ``is_causal`` and the options below).

        A descriptor's batch and mask heads broadcast when 1.
      bias: optional float array broadcastable to [batch, num_heads, q_len, kv_len], added
        to the logits (after the soft cap); differentiable. O(q_len * kv_len) memory; the
        xla backend adds it (the CuTe kernels take none and say so).
      metadata: the mask's metadata arrays (a dict by name), when ``mask`` is a MaskSpec.
      scale: logits multiplier, any real number (Python, NumPy or a concrete 0-d array);
        default ``1 / sqrt(head_dim)``.
      is_causal: also require ``k <= q`` (AND-ed with ``mask``).
      query_seq_lengths: int [batch]: rows from this length on are padding (output 0).
      key_value_seq_lengths: int [batch]: keys from this length on are never visible.
      local_window_size: ``(left, right)`` or an int for both: also require
        ``q - left <= k <= q + right``. These four combine with a MaskSpec ``mask`` (they
        become part of its rules and metadata: no recompiles as lengths vary), not with
        a prebuilt descriptor (write them into its MaskSpec).
      logits_soft_cap: if set (a positive number), logits become ``cap * tanh(logits / cap)``.
      implementation: ``"cute"`` (the CuTe kernels; jax's ``"cudnn"`` maps to it),
        ``"xla"`` or None (the best available; see :func:`jcompilemask.backends.explain`).
        A named implementation that cannot run the call raises, saying why.
      return_residual: also return the logsumexp, in jax's layout [batch, q_len,
        num_heads] ([q_len, num_heads] unbatched), float32, natural log.
      return_residuals: deprecated; returns the lse as [batch, num_heads, q_len].
      deterministic: gradients bit-identical across runs. The CuTe backward then adds each
        query tile's dQ contributions in key-tile order (per-tile semaphores; some speed
        is lost waiting for turns); the xla backward is deterministic either way.
      context_axis: a mesh axis name: context (sequence) parallelism inside
        ``jax.shard_map``, with query/key/value sharded along the sequence over that
        axis and ``mask`` a descriptor (or spec + metadata) of the whole sequence; runs
        :func:`jcompilemask.parallel.ring_attention`, whose ring steps run the backend
        ``implementation`` names (None: the registry's choice for a step's call).
      context_layout: with ``context_axis``, the chunk layout or ring plan (see
        :func:`jcompilemask.parallel.ring_attention`).

    Returns:
      ``out`` shaped like ``query`` with head_dim_v, in the input dtype, or ``(out, lse)``.
      A row that sees no key gets out 0, lse -inf and zero gradients (jax instead averages
      the values of such a row).

    Differentiation: first-order reverse mode (``jax.grad``, ``jax.vjp``, under
    ``jax.checkpoint``, ``lax.scan`` and ``vmap``), with respect to query, key, value and
    ``bias``. It is a ``jax.custom_vjp`` (the backward is its own kernel), so forward mode
    (``jax.jvp``, ``jax.jacfwd``) raises JAX's "can't apply forward-mode autodiff"
    TypeError, and differentiating the gradient (a Hessian-vector product, a gradient
    penalty) raises a NotImplementedError that says so; use
    ``jax.nn.dot_product_attention`` where those are needed.

    >>> import jax, jax.numpy as jnp, jcompilemask as jcm
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))
    >>> out = jcm.mask_attention(q, k, v, jcm.masks.causal())
    >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> bool(jnp.allclose(out, ref, atol=1e-5))
    True
    >>> lens = jnp.array([12])                      # jax.nn's own keywords work too
    >>> out = jcm.mask_attention(q, k, v, is_causal=True, key_value_seq_lengths=lens)
    >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lens)
    >>> bool(jnp.allclose(out, ref, atol=1e-5))
    True
    """
    shape_doc = "[batch, len, heads, head_dim]"
    query, key, value = (_compat.as_array_arg(x, n, shape_doc) for x, n in
                         ((query, "query"), (key, "key"), (value, "value")))
    unbatched = query.ndim == 3
    if unbatched:
        if key.ndim != 3 or value.ndim != 3:
            raise _shape_error(f"query has rank 3 (unbatched), so key and value must have "
                               f"rank 3 too (or all three rank 4); got key {key.shape}, "
                               f"value {value.shape}")
        query, key, value = query[None], key[None], value[None]
    b, nq, hq, d, nk, hkv, dv = _validate(query, key, value)

    scale = 1.0 / math.sqrt(d) if scale is None else _compat.as_real(
        scale, "scale", example="scale=0.125")
    if logits_soft_cap is not None:
        logits_soft_cap = _compat.as_real(logits_soft_cap, "logits_soft_cap", positive=True,
                                          example="logits_soft_cap=50.0")
    if return_residuals is not None:
        warnings.warn("mask_attention(return_residuals=...) is deprecated: use "
                      "return_residual=True (jax's name), which returns the lse as [batch, "
                      "q_len, heads] like jax.nn.dot_product_attention", DeprecationWarning,
                      stacklevel=2)
        if return_residual:
            raise ValueError("pass return_residual or the deprecated return_residuals, "
                             "not both")
    if context_axis is not None:
        if (bias, query_seq_lengths, key_value_seq_lengths, local_window_size) != (None,) * 4 \
                or is_causal or unbatched:
            raise ValueError("context_axis takes a compiled mask (descriptor, or spec and "
                             "metadata) and batched inputs; bias, is_causal, sequence "
                             "lengths and windows are not supported with it")
        from ..parallel import ring_attention
        res = ring_attention(query, key, value, mask, axis_name=context_axis,
                             layout=context_layout, metadata=metadata, scale=scale,
                             logits_soft_cap=logits_soft_cap, implementation=implementation,
                             deterministic=deterministic,
                             return_residuals=bool(return_residual or return_residuals))
        if return_residual:
            return res[0], jnp.swapaxes(res[1], 1, 2)
        return res
    if context_layout is not None:
        raise ValueError("context_layout is only used together with context_axis")
    window = _compat.as_window(local_window_size)
    full = (b, hq, nq, nk)
    if bias is not None:
        bias = _compat.as_array_arg(bias, "bias", "[batch, heads, q_len, kv_len]")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be a float array (added to the logits), got "
                            f"{bias.dtype}; a boolean mask goes to mask=")
        bias = _compat.broadcast_4d(bias[None] if unbatched and bias.ndim == 3 else bias,
                                    "bias", full, "[batch, heads, q_len, kv_len]")
    if unbatched and hasattr(mask, "dtype") and getattr(mask, "ndim", 0) == 3:
        mask = mask[None]

    plan = _compat.plan_mask(mask, metadata, is_causal=is_causal, window=window,
                             query_seq_lengths=query_seq_lengths,
                             key_value_seq_lengths=key_value_seq_lengths,
                             batch=b, heads=hq, nq=nq, nk=nk)
    bias_grad = bias is not None
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    if plan.runtime is not None:
        out, lse = _runtime_dense_attention(
            query, key, value, plan.runtime, bias, float(scale), logits_soft_cap,
            implementation, bool(deterministic), hkv=hkv, dv=dv)
        return _results(out, lse, unbatched, return_residual, return_residuals)

    desc = plan.desc
    cm = desc.mask if desc is not None else _compile(plan.mask)
    # Residue classes (lower/classes.py): the kernels run one class's mask with the
    # classes as heads, so the backend is chosen for that mask and c times the heads.
    if isinstance(desc, ClassDescriptor):
        classes = desc.classes
    elif desc is None and isinstance(nq, int):
        classes = cm.classes_for(nq, nk)
    else:
        classes = 1
    run_cm = cm.class_mask if classes > 1 else cm
    call = _call(run_cm, query, dv, hq * classes, hkv * classes, logits_soft_cap,
                 None if desc is None else desc.tiles, bias)
    backend = _select(implementation, call)
    if desc is None:
        t = backend.tiles(call)
        desc = cm.instantiate(plan.metadata, nq, nk, block_q=t.block_q, block_kv=t.block_kv,
                              bwd_block_q=t.bwd_block_q, bwd_block_kv=t.bwd_block_kv,
                              row_classes=classes > 1)

    if (desc.q_len, desc.kv_len) != (nq, nk):
        raise ValueError(f"the descriptor was built for q_len={desc.q_len}, kv_len="
                         f"{desc.kv_len}, but query/key have {nq}/{nk}: instantiate it "
                         "with the lengths of this call")
    if desc.batch not in (1, b):
        raise ValueError(f"the descriptor has batch {desc.batch}; the call has batch {b} "
                         "(a mask batch must be 1 or equal the query batch)")
    if desc.mask_heads not in (1, hq):
        raise ValueError(f"the mask has {desc.mask_heads} heads; the call has {hq} query "
                         "heads (mask heads must be 1 or the query head count)")

    if classes > 1 and bias is not None:
        out, lse = _class_attention_with_bias(query, key, value, desc, bias, float(scale),
                                              logits_soft_cap, backend.name, bias_grad,
                                              bool(deterministic))
    else:
        # (a ClassDescriptor without a bias: the partitioned call views each device's
        # arrays with the classes as heads, attention/partition.py)
        out, lse = _attention(query, key, value, desc, bias, float(scale), logits_soft_cap,
                              backend.name, bias_grad, bool(deterministic))
    return _results(out, lse, unbatched, return_residual, return_residuals)


def _results(out, lse, unbatched, return_residual, return_residuals):
    if unbatched:
        out, lse = out[0], lse[0]
    if return_residuals:
        return out, lse
    if return_residual:
        return out, jnp.swapaxes(lse, -1, -2)
    return out


def _call(cm, query, dv, heads, kv_heads, softcap, tiles, bias):
    return _backends.call_for(
        cm, dtype=jnp.dtype(query.dtype).name, head_dim=query.shape[-1], head_dim_v=dv,
        num_heads=heads, num_kv_heads=kv_heads, softcap=softcap is not None, tiles=tiles,
        bias=bias is not None)


def _select(implementation, call):
    impl = _compat.implementation_name(implementation)
    try:
        return _backends.select(impl, call)
    except _backends.BackendUnavailable as err:
        if implementation == "cudnn":
            raise _backends.BackendUnavailable(
                f"implementation='cudnn' (jax's cuDNN kernel) maps to jcompilemask's GPU "
                f"kernels, 'cute': {err}; pass implementation=None to fall back") from None
        raise


# -- dense masks known at run time ---------------------------------------------------------
# One descriptor per RuntimeDense tier (and the bitmap), each on its own backend; the
# forward and the backward each run the one ``index`` names (lax.switch). It is one
# custom_vjp around the switch, not a switch of ``_attention`` calls: differentiating a
# switch keeps every branch's residuals (out, lse: one set per tier), this keeps one.

@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _tiered(q, k, v, descs, index, bias, scale, softcap, names, bias_grad, deterministic):
    return _tiered_forward(q, k, v, descs, index, bias, scale, softcap, names)


def _tiered_forward(q, k, v, descs, index, bias, scale, softcap, names):
    def branch(i):
        return lambda q, k, v, descs, bias: _forward(q, k, v, descs[i], bias, scale,
                                                     softcap, names[i])
    return jax.lax.switch(index, [branch(i) for i in range(len(names))], q, k, v, descs,
                          bias)


def _tiered_fwd(q, k, v, descs, index, bias, scale, softcap, names, bias_grad,
                deterministic):
    out, lse = _tiered_forward(q, k, v, descs, index, bias, scale, softcap, names)
    return (out, lse), (q, k, v, descs, index, bias, out, lse)


def _tiered_bwd(scale, softcap, names, bias_grad, deterministic, res, cts):
    q, k, v, descs, index, bias, out, lse = res

    def branch(i):
        def run(q, k, v, descs, bias, out, lse, cts):
            g = _attention_bwd(scale, softcap, names[i], bias_grad, deterministic,
                               (q, k, v, descs[i], bias, out, lse), cts)
            return g[0], g[1], g[2], g[4]
        return run
    dq, dk, dv, dbias = jax.lax.switch(index, [branch(i) for i in range(len(names))],
                                       q, k, v, descs, bias, out, lse, cts)
    return dq, dk, dv, None, None, dbias


_tiered.defvjp(_tiered_fwd, _tiered_bwd)


def runtime_dense_plan(query, key, runtime, *, head_dim_v=None, num_kv_heads=None,
                       softcap=None, bias=None, implementation=None):
    """How ``mask_attention`` runs a :class:`~jcompilemask.RuntimeDense` mask whose
    ``mask`` is the call's whole bool [Bm, Hm, Nq, Nk] mask: ``(descs, names, index)``, a
    descriptor per tier and the bitmap's last, the backend each runs on (the registry's
    choice for that descriptor, or the named ``implementation``; the bitmap, used only
    past the widest tier, runs where it can when the named one cannot take it), and the
    int32 index of the one that runs (traced inside ``jit``).

    >>> import jax, jax.numpy as jnp, jcompilemask as jcm
    >>> q = jnp.zeros((1, 64, 2, 16))
    >>> m = jnp.tril(jnp.ones((1, 1, 64, 64), bool))
    >>> descs, names, index = runtime_dense_plan(q, q, jcm.runtime_dense(m))
    >>> [d.num_intervals for d in descs], int(index)           # on a CPU: xla for all
    ([1, 8, 1], 0)
    """
    b, nq, hq, _ = query.shape
    nk, hkv = key.shape[1], key.shape[2] if num_kv_heads is None else num_kv_heads
    dv = query.shape[-1] if head_dim_v is None else head_dim_v
    masks = runtime.masks(runtime.mask.shape)
    backends = []
    for i, cm in enumerate(masks):
        call = _call(cm, query, dv, hq, hkv, softcap, None, bias)
        last = i == len(masks) - 1         # the bitmap: runs only past the widest tier
        try:
            backend = (_backends.select(None, call, quiet=True)
                       if last and implementation is None else _select(implementation, call))
        except _backends.BackendUnavailable:
            if not last or implementation is None:
                raise
            backend = _backends.select(None, call, quiet=True)
        backends.append((backend, call))
    transpose = None
    if any(b.name == "cute" for b, _ in backends[:-1]):
        from ..kernels.cute import api as _cute_api
        if _cute_api.transpose_words_on():
            transpose = _cute_api.transpose_words      # the column pack in one kernel
    masks, metas, index = runtime.plan(runtime.mask, transpose=transpose)
    descs, names = [], []
    for cm, meta, (backend, call) in zip(masks, metas, backends):
        t = backend.tiles(call)
        descs.append(cm.instantiate(meta, nq, nk, block_q=t.block_q, block_kv=t.block_kv,
                                    bwd_block_q=t.bwd_block_q, bwd_block_kv=t.bwd_block_kv))
        names.append(backend.name)
    return tuple(descs), tuple(names), index


def _runtime_dense_attention(query, key, value, runtime, bias, scale, softcap,
                             implementation, deterministic, *, hkv, dv):
    """Attention under a :class:`~jcompilemask.RuntimeDense` mask: the descriptors of
    :func:`runtime_dense_plan`, the narrowest that fits run (forward and backward)."""
    descs, names, index = runtime_dense_plan(
        query, key, runtime, head_dim_v=dv, num_kv_heads=hkv, softcap=softcap, bias=bias,
        implementation=implementation)
    return _tiered(query, key, value, descs, index, bias, scale, softcap, names,
                   bias is not None, deterministic)
