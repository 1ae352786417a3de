"""The ``jax.nn.dot_product_attention`` arguments of :func:`mask_attention`, checked and
turned into what the pipeline takes: a MaskSpec (``is_causal``, ``local_window_size``
and the sequence lengths become rules and metadata of the mask), a compiled dense mask
(``from_dense``) or a dense mask whose runs are found at run time (``RuntimeDense``).

How each jax argument maps:

* ``is_causal=True``: every region's rule gains ``& (k <= q)``.
* ``local_window_size=(left, right)`` (an int means both): ``& (q - left <= k <= q + right)``.
* ``query_seq_lengths`` [B]: each region's rows end at ``min(hi, query_seq_lengths)``;
  rows past it see nothing (output 0, as in jax; lse -inf where jax returns a large
  negative number).
* ``key_value_seq_lengths`` [B]: ``& (k < key_value_seq_lengths)``.
  The lengths are metadata named like the arguments, so new values never recompile;
  they are clamped to ``[0, q_len]`` / ``[0, kv_len]`` as jax's masks clamp them.
* a boolean ``mask`` array: concrete and shared by the batch, it is compiled with
  :func:`~jcompilemask.from_dense` (host work and memory O(q_len * kv_len) per distinct
  mask; every backend, fast path included); traced (inside ``jit``), batched, or
  combined with sequence lengths, its runs are found at run time
  (:mod:`jcompilemask.lower.dense_runtime`: the mask AND the other arguments' masks,
  packed into bits; interval tables at the :class:`~jcompilemask.RuntimeDense` tiers,
  the bitmap past them), every backend included.
"""
from __future__ import annotations

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..lower.compiled import CompiledMask
from ..lower.dense import DenseMask, from_dense
from ..lower.dense_runtime import DEFAULT_TIERS, RuntimeDense
from ..lower.descriptor import ClassDescriptor, ExecutionDescriptor
from ..spec.expr import TRUE, And, k, kv_len, minimum, q, q_len
from ..masks import full
from ..spec.maskspec import MaskSpec, Region
from ..spec.metadata import Scalar

__all__ = ["QUERY_LENGTHS", "KV_LENGTHS", "as_real", "as_window", "implementation_name",
           "MaskPlan", "plan_mask", "as_array_arg", "broadcast_4d"]

QUERY_LENGTHS = "query_seq_lengths"
KV_LENGTHS = "key_value_seq_lengths"
_MASK_TYPES = (ExecutionDescriptor, ClassDescriptor, MaskSpec, CompiledMask)


def as_real(x, name: str, *, positive: bool = False, example: str = "") -> float:
    """A concrete real scalar (Python, NumPy or a concrete 0-d array) as a float."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} must be a concrete number (it selects the compiled "
                        f"kernel), got a traced value; {example or 'pass a Python float'}")
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}={x!r} is a bool, not a number: pass the value itself"
                        + (f", e.g. {example}" if example else ""))
    try:
        arr = np.asarray(x)
    except Exception:   # noqa: BLE001 - anything that is not array-like
        arr = None
    if arr is None or arr.ndim != 0 or arr.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be a real number, got {x!r} "
                        f"({type(x).__name__})" + (f"; e.g. {example}" if example else ""))
    v = float(arr)
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{name} must be a {'positive ' if positive else ''}finite number, "
                         f"got {v!r}" + (f"; e.g. {example}" if example else ""))
    return v


def as_window(w):
    """``local_window_size`` -> (left, right) non-negative ints, or None."""
    if w is None:
        return None
    pair = (w, w) if not isinstance(w, (tuple, list)) else tuple(w)
    if len(pair) != 2 or any(isinstance(v, (bool, np.bool_)) or not isinstance(
            v, (int, np.integer)) or v < 0 for v in pair):
        raise ValueError(f"local_window_size must be a non-negative int or a (left, right) "
                         f"pair of them, got {w!r}")
    return int(pair[0]), int(pair[1])


def implementation_name(impl):
    """jax's names mapped: 'cudnn' (jax's fused GPU kernel) -> 'cute' (ours)."""
    if impl is None:
        return None
    if not isinstance(impl, str):
        raise TypeError(f"implementation must be a string or None, got {impl!r}")
    return {"cudnn": "cute"}.get(impl, impl)


def as_array_arg(x, name: str, shape_doc: str):
    """An array argument (jax or NumPy); lists and other objects raise naming the fix."""
    if isinstance(x, (list, tuple)):
        raise TypeError(f"{name} is a Python {type(x).__name__}, not an array: pass "
                        f"jnp.asarray({name}) ({shape_doc})")
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return jnp.asarray(x)
    raise TypeError(f"{name} must be an array ({shape_doc}), got {type(x).__name__}")


def broadcast_4d(x, name: str, full: tuple, what: str):
    """jax's rule: fewer than 4 dims gain leading 1s; each dim must be 1 or ``full``'s."""
    if x.ndim > 4:
        raise ValueError(f"{name} has shape {x.shape}: at most 4 dims, broadcastable to "
                         f"{what} = {full}")
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if any(s not in (1, f) for s, f in zip(x.shape, full)):
        raise ValueError(f"{name} has shape {x.shape}, not broadcastable to {what} = {full} "
                         "(each dim must be 1 or the full size)")
    return x


def _lengths(x, name, batch, limit):
    if x is None:
        return None
    x = as_array_arg(x, name, f"int [{batch}]")
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.shape != (batch,):
        raise ValueError(f"{name} must be an integer array of shape ({batch},) (one length "
                         f"per sequence), got {x.dtype}{list(x.shape)}")
    return jnp.clip(x, 0, limit).astype(jnp.int32)


@functools.lru_cache(maxsize=256)
def _with_extras(spec: MaskSpec, causal: bool, window, q_lens: bool, kv_lens: bool):
    """``spec`` with jax's extra masks AND-ed into every region (cached: building a spec
    runs sympy's overlap proofs)."""
    clash = sorted({QUERY_LENGTHS, KV_LENGTHS} & set(spec.metadata))
    if clash:
        raise ValueError(f"the mask already reads metadata {clash}; rename it to pass "
                         "query_seq_lengths / key_value_seq_lengths")
    extra = TRUE
    tags = []
    if causal:
        extra = extra & (k <= q)
        tags.append("causal")
    if window is not None:
        extra = extra & (k >= q - window[0]) & (k <= q + window[1])
        tags.append(f"window{window}")
    decls = list(spec.metadata.values())
    qsl = None
    if q_lens:
        qsl = Scalar(QUERY_LENGTHS, max=q_len)
        decls.append(qsl)
        tags.append("q lengths")
    if kv_lens:
        kvsl = Scalar(KV_LENGTHS, max=kv_len)
        decls.append(kvsl)
        extra = extra & (k < kvsl)
        tags.append("kv lengths")
    regions = [Region((r.rows[0], r.rows[1] if qsl is None else minimum(r.rows[1], qsl)),
                      And.of(r.visible, extra), r.name) for r in spec.regions]
    name = f"{spec.name or 'mask'} & {' & '.join(tags)}"
    return MaskSpec(regions, num_heads=spec.num_heads if spec.uses_heads else None,
                    metadata=decls, name=name)


class MaskPlan:
    """What :func:`plan_mask` decided: ``mask`` (a CompiledMask/MaskSpec to instantiate,
    or None when ``desc`` or ``runtime`` is given), ``desc``, ``metadata``, and
    ``runtime`` (a :class:`RuntimeDense` whose ``mask`` is the whole call's bool [Bm, Hm,
    Nq, Nk] mask, for a dense mask known at run time)."""

    def __init__(self, mask=None, desc=None, metadata=None, runtime=None):
        self.mask, self.desc, self.metadata, self.runtime = mask, desc, metadata, runtime


def _check_mask_object(mask):
    if isinstance(mask, _MASK_TYPES + (RuntimeDense,)) or mask is None:
        return
    if isinstance(mask, (list, tuple)):
        raise TypeError(f"mask is a Python {type(mask).__name__}: pass a boolean array "
                        "(jnp.asarray(mask)), a MaskSpec (jcm.masks.*) or an "
                        "ExecutionDescriptor")
    if callable(mask) and not hasattr(mask, "dtype"):
        fn = getattr(mask, "__qualname__", repr(mask))
        mod = getattr(mask, "__module__", "") or ""
        short = f"jcm.masks.{fn}" if mod == "jcompilemask.masks" else f"{fn}"
        try:
            import inspect
            required = any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                               p.POSITIONAL_OR_KEYWORD)
                           for p in inspect.signature(mask).parameters.values())
        except (TypeError, ValueError):
            required = True
        raise TypeError(f"mask is the function {mod + '.' if mod else ''}{fn}, not a mask: "
                        f"call it, e.g. mask={short}({'...' if required else ''})")
    if not hasattr(mask, "dtype") or not hasattr(mask, "shape"):
        mod = type(mask).__module__ or ""
        hint = (": convert a splash mask with jcompilemask.splash.to_jcm(mask)"
                if "splash" in mod else "")
        raise TypeError("mask must be an ExecutionDescriptor, a MaskSpec / CompiledMask, a "
                        f"boolean array or None, got {type(mask).__name__}{hint}")
    if mask.dtype != bool:
        raise TypeError(f"mask is a {mask.dtype} array; a mask array must be boolean (True "
                        "= attend), as in jax.nn.dot_product_attention: an additive mask "
                        "goes to bias=, and a 0/1 mask to mask=m.astype(bool)")


def plan_mask(mask, metadata, *, is_causal, window, query_seq_lengths, key_value_seq_lengths,
              batch, heads, nq, nk) -> MaskPlan:
    """Resolve ``mask`` and jax's extra masking arguments into one :class:`MaskPlan`."""
    _check_mask_object(mask)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    qsl = _lengths(query_seq_lengths, "query_seq_lengths", batch, nq)
    kvsl = _lengths(key_value_seq_lengths, "key_value_seq_lengths", batch, nk)
    lengths = {n: x for n, x in ((QUERY_LENGTHS, qsl), (KV_LENGTHS, kvsl)) if x is not None}
    extras = bool(is_causal) or window is not None or bool(lengths)

    if isinstance(mask, (ExecutionDescriptor, ClassDescriptor)):
        if metadata is not None:
            raise ValueError("metadata is only used when mask is a MaskSpec or "
                             "CompiledMask; the descriptor already holds it")
        if extras:
            raise ValueError("is_causal, local_window_size and the sequence lengths cannot "
                             "be added to a prebuilt ExecutionDescriptor: write them into "
                             "the MaskSpec before instantiate (e.g. `& (k <= q)`), or pass "
                             "the MaskSpec with metadata= and let mask_attention build it")
        return MaskPlan(desc=mask)

    if isinstance(mask, DenseMask):
        if not extras:
            return MaskPlan(mask=mask, metadata=metadata)
        if getattr(mask, "METADATA", None):
            raise ValueError(f"{type(mask).__name__} reads metadata; combine is_causal, "
                             "local_window_size and sequence lengths into its array instead")
        mask = jnp.asarray(mask.array)                 # combine as a dense array below

    if mask is None or isinstance(mask, (MaskSpec, CompiledMask)):
        spec = full() if mask is None else mask
        if metadata is None and spec.batched:
            names = sorted((spec.spec if isinstance(spec, CompiledMask) else spec).metadata)
            raise ValueError(f"this mask reads metadata {names}: pass metadata={{...}} or "
                             "an ExecutionDescriptor")
        if extras:
            if metadata is not None and not isinstance(metadata, Mapping):
                raise TypeError("metadata must be a dict mapping the mask's metadata names "
                                f"to arrays, got {type(metadata).__name__}")
            spec = _with_extras(spec.spec if isinstance(spec, CompiledMask) else spec,
                                bool(is_causal), window, qsl is not None, kvsl is not None)
            if lengths:
                metadata = {**(metadata or {}), **lengths}
        return MaskPlan(mask=spec, metadata=metadata)

    # A dense boolean array.
    if metadata is not None:
        raise ValueError("metadata is only used with a MaskSpec; a dense mask array has "
                         "none")
    tiers = None
    if isinstance(mask, RuntimeDense):
        mask, tiers = mask.mask, mask.tiers
    arr = broadcast_4d(mask, "mask", (batch, heads, nq, nk), "[batch, heads, q_len, kv_len]")
    concrete = not isinstance(arr, jax.core.Tracer)
    if concrete and tiers is None and arr.shape[0] == 1 and not lengths:
        dense = np.broadcast_to(np.asarray(arr)[0], (arr.shape[1], nq, nk))
        rows, cols = np.arange(nq)[:, None], np.arange(nk)[None, :]
        if is_causal:
            dense = dense & (cols <= rows)
        if window is not None:
            dense = dense & (cols >= rows - window[0]) & (cols <= rows + window[1])
        return MaskPlan(mask=from_dense(dense))
    return MaskPlan(runtime=RuntimeDense(_combined(arr, is_causal, window, qsl, kvsl, nq, nk),
                                         tiers or DEFAULT_TIERS))


def _combined(arr, causal, window, qsl, kvsl, nq, nk):
    """The bool [Bm, Hm, Nq, Nk] mask ``arr`` AND jax's other masking arguments (Bm is
    the call's batch when sequence lengths are given)."""
    rows = jnp.arange(nq, dtype=jnp.int32)[:, None]
    cols = jnp.arange(nk, dtype=jnp.int32)[None, :]
    m = jnp.asarray(arr, bool)
    if causal or window is not None:       # (no all-True AND: each pass reads the mask)
        extra = jnp.ones((nq, nk), bool)
        if causal:
            extra = extra & (cols <= rows)
        if window is not None:
            extra = extra & (cols >= rows - window[0]) & (cols <= rows + window[1])
        m = m & extra[None, None]
    if qsl is not None or kvsl is not None:
        b = (qsl if qsl is not None else kvsl).shape[0]
        m = jnp.broadcast_to(m, (b,) + m.shape[1:])
        if qsl is not None:
            m = m & (rows[None, None] < qsl[:, None, None, None])
        if kvsl is not None:
            m = m & (cols[None, None] < kvsl[:, None, None, None])
    return m
