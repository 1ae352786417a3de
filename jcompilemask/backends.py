"""Registry of attention implementations; picks the best one and says why.

Each :class:`Backend` states whether it is available on this machine and whether it
supports a given call (dtype, head dims, heads, soft cap, mask). ``implementation=None``
takes the highest-priority backend that is available and supports the call; a named one
raises with its reason when it cannot run the call.

>>> import jcompilemask as jcm
>>> print(jcm.backends.explain())          # doctest: +ELLIPSIS
backends, best first:
  cute: ...
  xla: available
preprocess, best first (instantiate runs the first available; residual masks take jnp):
  tilelang: ...
  jnp: available (the reference; every platform; preprocess='jnp' selects it)

The registry also chooses the preprocess that builds descriptors
(:func:`select_preprocess`, asked by ``CompiledMask.instantiate``): TileLang's generated
GPU kernels where they run (an SM90 GPU and the ``tilelang`` extra), else jnp; both build
the same descriptor bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Callable, Optional

import jax

from ._install import missing, missing_hint, no_gpu_hint, pip_hint
from ._progress import log_once, slow_step
from .lower import compiled as _compiled
from .lower import dense as _dense
from .lower.compiled import DEFAULT_TILES
from .lower.descriptor import TileConfig

__all__ = ["Backend", "Call", "register", "select", "explain", "preferred_tiles",
           "BackendUnavailable", "Preprocess", "register_preprocess", "select_preprocess",
           "get_preprocess", "PREPROCESS_ENV", "cute_head_dims", "cute_forward_head_dims",
           "cute_backward_head_dims"]


class BackendUnavailable(RuntimeError):
    """A named implementation cannot run this call (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Call:
    """What a backend needs to know to accept a call."""

    dtype: str
    head_dim: int
    head_dim_v: int
    num_heads: int
    num_kv_heads: int
    softcap: bool
    has_fallback: bool                     # residual predicates (the interval tables are hulls)
    num_intervals: int = 1
    tiles: Optional[TileConfig] = None     # of a prebuilt descriptor, if one was passed
    bias: bool = False                     # an additive bias (or a dense mask) on the logits
    dense_bitmap: bool = False             # a from_dense mask kept as a bitmap
    # With has_fallback: None when every residual predicate can be emitted as kernel code
    # (lower/residual_program.py), else why not.
    residual_reason: Optional[str] = None


def call_for(cm, *, dtype: str, head_dim: int, head_dim_v: int, num_heads: int,
             num_kv_heads: int, softcap: bool = False, tiles: Optional[TileConfig] = None,
             bias: bool = False, num_intervals: Optional[int] = None) -> Call:
    """The registry's view of an attention call on the compiled mask ``cm``: the call's own
    dtype, head dims, heads and options, and what the mask decides (residual regions and
    whether they can become kernel code, the interval count, a dense bitmap layout).
    ``mask_attention``, the ring steps and ``explain(mask=...)`` build their calls here;
    ``num_intervals`` overrides the mask's (a ring step's slots).

    >>> import jcompilemask as jcm
    >>> c = call_for(jcm.compile(jcm.masks.causal()), dtype="bfloat16", head_dim=128,
    ...              head_dim_v=128, num_heads=8, num_kv_heads=2)
    >>> c.has_fallback, c.num_intervals, c.residual_reason
    (False, 1, None)
    """
    return Call(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, num_heads=num_heads,
                num_kv_heads=num_kv_heads, softcap=bool(softcap),
                has_fallback=bool(cm.fallback_regions),
                num_intervals=cm.num_intervals if num_intervals is None else num_intervals,
                tiles=tiles, bias=bias, dense_bitmap=getattr(cm, "layout", None) == "bitmap",
                residual_reason=residual_reason_of(cm))


def cute_head_dims(head_dim: int, head_dim_v: int) -> Optional[tuple[int, int]]:
    """The head dims ``(D', Dv')`` the CuTe kernels run a call of head dims
    ``(head_dim, head_dim_v)`` at, or None when no built pair is wide enough (past 256).

    A built pair (D in 64 / 128 / 256 with Dv == D, or (192, 128)) runs as is. Other head
    dims run at the cheapest built pair at least as wide in both (least D' + Dv'): query
    and key zero-padded to D', value to Dv'. That is exact: zero columns add nothing to
    ``q . k`` (the scale stays the caller's, ``1 / sqrt(head_dim)`` by default), give
    zero output columns, which are cut off, and zero gradient columns. It costs the
    padded kernels' work (``(D' + Dv') / (D + Dv)`` of a kernel built for the call's own
    dims) and one copy of each padded operand, far less than the ``xla`` backend on a
    GPU.

    >>> cute_head_dims(128, 128), cute_head_dims(96, 96), cute_head_dims(160, 128)
    ((128, 128), (128, 128), (192, 128))
    >>> cute_head_dims(32, 64), cute_head_dims(192, 192), cute_head_dims(320, 320)
    ((64, 64), (256, 256), None)
    """
    from .kernels.cute.api import HEAD_DIM_PAIRS, HEAD_DIMS
    if head_dim < 1 or head_dim_v < 1:
        return None
    built = [(d, d) for d in HEAD_DIMS] + list(HEAD_DIM_PAIRS)
    fits = [(d, dv) for d, dv in built if d >= head_dim and dv >= head_dim_v]
    return min(fits, key=lambda p: (p[0] + p[1], p)) if fits else None


CUTE_HEAD_DIM_PAD_ENV = "JCOMPILEMASK_CUTE_HEAD_DIM_PAD"


def cute_head_dim_padding(head_dim: int, head_dim_v: int) -> Optional[str]:
    """How the CuTe kernels take head dims without kernels of their own
    (:func:`cute_head_dims`): ``"copy"``, q / k / v (and out / dO) zero-padded copies, the
    results cut back; ``"tma"``, the arrays as they are, the wider kernel's TMA loads
    zero-filling the columns past them and its stores dropping those (``kernel_head_dims``
    of ``cute_forward`` / ``cute_backward``: no copies); None for a built pair (or none
    wide enough). ``"tma"`` needs head dims that are multiples of 8 (16-byte TMA
    strides); others take ``"copy"``. ``$JCOMPILEMASK_CUTE_HEAD_DIM_PAD`` = ``copy`` /
    ``tma`` chooses; the default is ``tma``. Measured on an H100 (session 45, run
    2026-12-07T01:48:00Z, causal 8K, 8 heads, bf16; fwd / step ms, copies -> in place):
    D 96 3.95 / 13.65 -> 3.44 / 12.94, D 80 3.87 / 13.57 -> 3.36 / 12.62; its GPU cases
    (tests/gpu/test_cute_head_dims.py -k in_place) passed against the reference there.

    >>> cute_head_dim_padding(128, 128), cute_head_dim_padding(96, 96), cute_head_dim_padding(100, 100)
    (None, 'tma', 'copy')
    """
    import os
    dims = cute_head_dims(head_dim, head_dim_v)
    if dims is None or dims == (head_dim, head_dim_v):
        return None
    want = os.environ.get(CUTE_HEAD_DIM_PAD_ENV, "tma").strip().lower() or "tma"
    if want not in ("copy", "tma"):
        raise ValueError(f"${CUTE_HEAD_DIM_PAD_ENV}={want!r}: use 'copy' or 'tma'")
    if want == "tma" and (head_dim % 8 or head_dim_v % 8):
        return "copy"
    return want


CUTE_FWD_NATIVE_ENV = "JCOMPILEMASK_CUTE_FWD_NATIVE"
CUTE_BWD_NATIVE_ENV = "JCOMPILEMASK_CUTE_BWD_NATIVE"


def _native_dims(env: str, native: tuple, head_dim: int, head_dim_v: int):
    """With ``$env`` = 1 (the default) and Dv == D: the narrowest of the ``native`` dims at
    least D where it is cheaper than :func:`cute_head_dims`'s pair (D 72 on an 80 kernel,
    not 128); else (``$env`` = 0: D 128's kernels in place, as before session 47)
    cute_head_dims's."""
    from .kernels.cute.api import _env_flag
    padded = cute_head_dims(head_dim, head_dim_v)
    if _env_flag(env, "1") and head_dim == head_dim_v:
        fits = [n for n in native if n >= head_dim]
        if fits and (padded is None or 2 * min(fits) < sum(padded)):
            return (min(fits), min(fits))
    return padded


def cute_forward_head_dims(head_dim: int, head_dim_v: int) -> Optional[tuple[int, int]]:
    """The head dims of the CuTe forward kernel that runs a call of these. With Dv == D: the
    forward's native kernels (D 80 and 96, ``kernels.cute.api.FWD_NATIVE_HEAD_DIMS``: D
    128's loop on narrower rows) at the call's own D, or the narrowest of them wider than
    it (D 72 zero-padded to 80, 88 to 96, in place like :func:`cute_head_dim_padding`'s)
    where that beats :func:`cute_head_dims`'s pair; else cute_head_dims's.
    ``$JCOMPILEMASK_CUTE_FWD_NATIVE=0`` (read at trace time) runs D 128's kernels instead,
    in place. The default since session 47: all of tests/gpu/test_cute_head_dims.py -k
    native passed (H100), and causal 8K forward ms went 3.429 -> 3.070 at D 96 and 3.369
    -> 2.883 at D 80 (H100, run 2026-12-07T08:17:06Z; FA4 native 2.882 / 2.695).

    >>> cute_forward_head_dims(96, 96), cute_forward_head_dims(72, 72), cute_forward_head_dims(64, 64)
    ((96, 96), (80, 80), (64, 64))
    """
    from .kernels.cute.api import FWD_NATIVE_HEAD_DIMS
    return _native_dims(CUTE_FWD_NATIVE_ENV, FWD_NATIVE_HEAD_DIMS, head_dim, head_dim_v)


def cute_backward_head_dims(head_dim: int, head_dim_v: int) -> Optional[tuple[int, int]]:
    """The backward's :func:`cute_forward_head_dims`: with Dv == D, D 96's own kernels
    (``kernels.cute.api.BWD_NATIVE_HEAD_DIMS``: D 128's config on 32B-swizzled rows) run
    D 96 as is and D 72-88 zero-padded to 96 in place (D 80: 1.2x its matmul work, not
    128's 1.6x); else :func:`cute_head_dims`'s. ``$JCOMPILEMASK_CUTE_BWD_NATIVE=0`` runs
    D 128's kernels instead, in place. Causal 8K backward ms (H100, run
    2026-12-07T08:17:06Z): D 96 9.538 -> 8.500, D 80 9.203 -> 8.297 (FA4 native 7.854 /
    7.013).

    >>> cute_backward_head_dims(96, 96), cute_backward_head_dims(80, 80)
    ((96, 96), (96, 96))
    """
    from .kernels.cute.api import BWD_NATIVE_HEAD_DIMS
    return _native_dims(CUTE_BWD_NATIVE_ENV, BWD_NATIVE_HEAD_DIMS, head_dim, head_dim_v)


def _cute_call_dims(call: Call) -> tuple[int, int]:
    """``call``'s head dims as the CuTe kernels run them (its own where none fits: the
    kernels' checks then say why)."""
    return cute_head_dims(call.head_dim, call.head_dim_v) or (call.head_dim, call.head_dim_v)


@dataclasses.dataclass(frozen=True)
class Backend:
    """An attention implementation.

    ``available()`` and ``supports(call)`` return None when fine, else the reason.
    ``forward(q, k, v, desc, scale, softcap) -> (out, lse)``; ``backward(...)`` likewise
    with ``(out, lse, do, dlse) -> (dq, dk, dv)``; ``backward_note`` (a string, or a
    callable returning one, asked at each ``explain``) says where
    gradients come from when not from this backend's own kernels.
    """

    name: str
    priority: int
    tiles: Callable[[Call | None], TileConfig]
    available: Callable[[], Optional[str]]
    supports: Callable[[Call], Optional[str]]
    forward: Callable
    backward: Callable
    backward_note: str | Callable[[], str] = ""   # a callable is asked each time
    takes_bias: bool = False      # forward/backward accept bias= (added to the logits)
    # The backward checks the descriptor's backward tiles itself and hands over to xla when
    # they are not its own, so only the forward tiles must match (cute).
    own_bwd_tile_check: bool = False
    # Every TileConfig the backend runs for a call, ``tiles(call)`` first (None: only that
    # one). Where a layout needs tiles that divide something (ring_attention's chunks),
    # the first that fits is taken: cute at D 192 runs 64 x 96 backward tiles by default
    # and 64 x 64 ones too.
    tile_options: Optional[Callable[[Call], tuple]] = None


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend):
    _REGISTRY[backend.name] = backend


def backends() -> list[Backend]:
    return sorted(_REGISTRY.values(), key=lambda b: -b.priority)


def get(name: str) -> Backend:
    _ensure_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown implementation {name!r}; choose from "
                         f"{sorted(_REGISTRY)} or None (automatic)") from None


def _check(b: Backend, call: Call | None) -> Optional[str]:
    why = b.available()
    if why is None and call is not None and call.bias and not b.takes_bias:
        why = ("an additive bias or dense mask array (these kernels take none; the xla "
               "backend adds it to the logits)")
    if why is None and call is not None:
        why = b.supports(call)
        if why is None and call.tiles is not None:
            want = b.tiles(call)
            got = call.tiles
            if b.own_bwd_tile_check:
                want, got = (want.block_q, want.block_kv), (got.block_q, got.block_kv)
            elif b.tile_options is not None and got in b.tile_options(call):
                want = got          # one of the backend's other configs
            if want != got and b.name != "xla":
                why = (f"the descriptor was built for tiles {call.tiles}, this backend needs "
                       f"{want}: instantiate with those tiles or pass the MaskSpec")
    return why


def select(implementation: Optional[str], call: Call, *, quiet: bool = False) -> Backend:
    """The backend that runs ``call`` (raises :class:`BackendUnavailable` if none).
    ``quiet``: do not log the faster backends passed over (for a call that runs only in
    a fallback branch, e.g. a run-time dense mask's bitmap)."""
    _ensure_builtin()
    if implementation is not None:
        b = get(implementation)
        why = _check(b, call)
        if why:
            raise BackendUnavailable(f"implementation={implementation!r} cannot run this "
                                     f"call: {why}")
        return b
    reasons, passed_over = [], []
    for b in backends():
        why = _check(b, call)
        if why is None:
            for name, reason in ([] if quiet else passed_over):
                # A faster backend runs on this machine but not this call: say so once
                # per reason (a silent drop to the reference path costs 10x or more).
                log_once(("passed-over", name, reason, b.name),
                         "jcompilemask: mask_attention runs the %s backend, not %s: %s",
                         b.name, name, reason)
            return b
        reasons.append(f"{b.name}: {why}")
        if b.available() is None or _on_gpu():
            passed_over.append((b.name, why))
    raise BackendUnavailable("no implementation can run this call: " + "; ".join(reasons))


def _on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:   # pragma: no cover - no backend initialised
        return False


def explain(call: Call | None = None, mask=None) -> str:
    """Each backend, best first, and whether it would run ``call`` (or is available).

    ``mask`` (a MaskSpec or CompiledMask, optional) adds, per region, its interval count,
    its residual predicate if any, and which backend runs it and why; with ``mask`` and
    no ``call``, the call is a bfloat16 one (head dim 128, 8 heads) of that mask. A dense
    boolean array is explained as ``mask_attention`` would take it: a concrete mask shared
    by the batch compiled by :func:`~jcompilemask.from_dense`, any other (or a
    :class:`~jcompilemask.RuntimeDense`) as a mask found at run time, tier by tier.

    >>> import jcompilemask as jcm
    >>> from jcompilemask.spec import MaskSpec, Region, q, k, q_len
    >>> dilated = MaskSpec([Region((0, q_len), (k <= q) & (k >= q - 8) & ((q - k) % 2 == 0))])
    >>> print(explain(mask=jcm.compile(dilated, warn=False)))   # doctest: +ELLIPSIS
    backends, best first:
      cute: skipped: ...
      xla: available
    chosen: xla
    backward: xla (the backend that runs the forward)
    mask regions:
      region 0: 1 interval(s), residual predicate: (q - k) % 2 == 0
        runs on: xla (the hull intervals and the residual predicate serve it; xla is the ...
    preprocess, ...
    """
    _ensure_builtin()
    cm = None
    if mask is not None and hasattr(mask, "dtype") and hasattr(mask, "shape"):
        mask = _dense_for_explain(mask)
        if not isinstance(mask, _compiled.CompiledMask):
            return _explain_runtime_dense(mask, call)
    if mask is not None:
        cm = _compiled.compile(mask, warn=False)
        if call is None:
            call = call_for(cm, dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=8,
                            num_kv_heads=8)
    lines, chosen = _backend_lines(call)
    if call is not None:
        lines.append(f"chosen: {chosen}" + (_padding_note(call) if chosen == "cute" else ""))
        if chosen is not None:
            lines.append(explain_backward(call))
    if cm is not None:
        lines += _explain_regions(cm, chosen, call)
    lines += _explain_preprocess()
    return "\n".join(lines)


def _backend_lines(call):
    """explain()'s backend list for ``call`` (None: availability alone) and the name of
    the first backend that takes it."""
    lines = ["backends, best first:"]
    chosen = None
    for b in backends():
        why = _check(b, call)
        if why is None and chosen is None:
            chosen = b.name
        status = "available" if why is None else f"skipped: {why}"
        note = b.backward_note() if callable(b.backward_note) else b.backward_note
        if why is None and note:
            status += f" ({note})"
        lines.append(f"  {b.name}: {status}")
    return lines, chosen


def _dense_for_explain(mask):
    """A bool array or RuntimeDense as ``mask_attention`` takes it (no other masking
    arguments): a concrete array shared by the batch (2-D, 3-D [heads, Nq, Nk] or a
    leading 1) becomes a ``from_dense`` mask, the rest a RuntimeDense."""
    from .lower.dense_runtime import RuntimeDense
    if isinstance(mask, RuntimeDense):
        return mask
    if mask.dtype != bool:
        raise TypeError(f"explain(mask=...): a dense mask must be boolean (True = attend), "
                        f"got {mask.dtype}")
    if not 2 <= mask.ndim <= 4:
        raise ValueError(f"explain(mask=...): a dense mask is [q_len, kv_len], [heads, "
                         f"q_len, kv_len] or [batch, heads, q_len, kv_len], got shape "
                         f"{tuple(mask.shape)}")
    if not isinstance(mask, jax.core.Tracer) and (mask.ndim < 4 or mask.shape[0] == 1):
        import numpy as np
        arr = np.asarray(mask)
        return _dense.from_dense(arr[0] if arr.ndim == 4 else arr)
    return RuntimeDense(mask)


def _explain_runtime_dense(rd, call) -> str:
    """explain() of a RuntimeDense: the backends, then per tier (and the bitmap) the
    backend that would run it and its backward, and the tier this mask takes."""
    shape = tuple(rd.shape)
    shape = (1,) * (4 - len(shape)) + shape
    kw = (dict(dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=8, num_kv_heads=8)
          if call is None else
          dict(dtype=call.dtype, head_dim=call.head_dim, head_dim_v=call.head_dim_v,
               num_heads=call.num_heads, num_kv_heads=call.num_kv_heads,
               softcap=call.softcap, bias=call.bias))
    labels = [f"tier {i}: K = {t} run(s) per row / column" for i, t in enumerate(rd.tiers)]
    labels.append(f"bitmap (past {rd.tiers[-1]} runs in a row)")
    parts = list(zip(labels, rd.masks(shape)))
    lines = _backend_lines(None)[0]
    lines.append(f"mask: {rd!r}: its runs are found on the device at each call; the "
                 f"narrowest tier that holds every row runs (forward and backward)")
    cute_up = "cute" in _REGISTRY and _check(get("cute"), None) is None
    for label, rm in parts:
        c = call_for(rm, **kw)
        chosen = next((b.name for b in backends() if _check(b, c) is None), None)
        lines.append(f"  {label}: runs on {chosen}; {explain_backward(c)}")
        if chosen != "cute" and cute_up:
            lines.append(f"    (cute: {_check(get('cute'), c)})")
    if isinstance(rd.mask, jax.core.Tracer):
        lines.append("  this mask: traced; its tier is chosen at run time "
                     "(RuntimeDense.tier_index() gives it inside the step)")
    else:
        i = int(rd.tier_index())
        lines.append(f"  this mask: {parts[i][0].split(':')[0]} (its rows alone; sequence "
                     f"lengths or is_causal can only lower it)")
    lines.append("preprocess: jnp on the call's device (lower/dense_runtime.py: the mask packed "
                 "into words, its runs found from them; no metadata)")
    return "\n".join(lines)


def _explain_regions(cm, chosen, call=None) -> list[str]:
    """Per region of ``cm``: intervals, residual, the backend that runs it and why."""
    from .lower.compiled import region_backend
    regions = getattr(cm, "regions", ())
    if not regions:
        return ["mask: " + cm.explain().splitlines()[0]]
    lines = ["mask regions:"]
    for g, lr in enumerate(regions):
        name = cm.spec.regions[g].name
        head = f"  region {g}{f' {name!r}' if name else ''}: {cm.region_num_slots[g]} interval(s)"
        res = [str(lr.slot_residual(m)) for m in range(lr.num_slots)
               if lr.slot_residual(m).key() != ("bool", True)]
        if res:
            head += ", residual predicate: " + "; ".join(res)
        lines.append(head)
        why = region_backend(cm, g)
        if why.startswith("cute") and chosen is not None:
            tables = ("the hull intervals and the residual predicate" if lr.has_residual
                      else "the interval tables")
            why = (f"{chosen} ({tables} serve it; {chosen} is the backend this call takes)"
                   if chosen != "cute" else
                   "cute (hull intervals, the residual predicate emitted into partial tiles)"
                   if lr.has_residual else "cute (interval tables only)")
        lines.append(f"    runs on: {why}")
    rc = getattr(cm, "row_classes", None)
    if rc is not None and call is not None:
        inner = cm.class_mask
        cc = call_for(inner, dtype=call.dtype, head_dim=call.head_dim,
                      head_dim_v=call.head_dim_v, num_heads=call.num_heads * rc.factor,
                      num_kv_heads=call.num_kv_heads * rc.factor, softcap=call.softcap,
                      bias=call.bias)
        runs = next((b.name for b in backends() if _check(b, cc) is None), None)
        res = (f"residual regions {list(inner.residual_regions)}" if inner.residual_regions
               else "no residual")
        lines.append(f"  residue classes mod {rc.factor}: where q_len and kv_len are multiples "
                     f"of {rc.factor} (and $JCOMPILEMASK_ROW_CLASSES is not 0), one class's "
                     f"mask (K = {inner.num_intervals}, {res}) runs with the classes as "
                     f"heads{', each with its own segment ids' if rc.segments else ''}, on: "
                     f"{runs}; the regions above serve other lengths")
    return lines


def preferred_tiles(call: Call | None = None) -> TileConfig:
    """Tiles of the backend that would run ``call`` (or of the best available one)."""
    _ensure_builtin()
    for b in backends():
        if _check(b, call) is None:
            return b.tiles(call)
    return DEFAULT_TILES


# ---------------------------------------------------------------------------------------
# Built-in backends
# ---------------------------------------------------------------------------------------
def _xla_backend() -> Backend:
    from .attention import xla
    return Backend(
        name="xla", priority=0, tiles=lambda call: DEFAULT_TILES,
        available=lambda: None, supports=lambda call: None,
        forward=xla.forward, backward=xla.backward, takes_bias=True)


@functools.lru_cache(maxsize=1)
def _sm90_reason() -> Optional[str]:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return no_gpu_hint()
    cc = getattr(gpus[0], "compute_capability", None)
    if cc is None or str(cc) not in ("9.0", "9.0a"):
        return f"needs an SM90 GPU (H100/H200), found compute capability {cc}"
    return None


def _cute_backend() -> Backend:
    def available():
        why = _sm90_reason()
        if why:
            return why
        absent = missing("cutlass", "jax_tvm_ffi")
        return missing_hint(*absent) if absent else None

    def supports(call: Call):
        if call.dense_bitmap:
            return ("a dense mask kept as a bitmap (from_dense keeps one past 32 runs per "
                    "row or column, or with layout='bitmap'; a mask known at run time, past "
                    "runtime_dense's widest tier); the CuTe kernels read interval tables "
                    "(any K: from_dense(..., layout='intervals') runs it on them); the xla "
                    "backend checks the bitmap")
        if call.has_fallback and call.residual_reason:
            return (f"residual predicate: {call.residual_reason}; the xla backend evaluates "
                    "it per element in partial tiles")
        if call.dtype not in ("bfloat16", "float16"):
            return f"dtype {call.dtype} (the CuTe kernels take bfloat16 and float16)"
        if cute_head_dims(call.head_dim, call.head_dim_v) is None:
            from .kernels.cute.api import HEAD_DIM_PAIRS, HEAD_DIMS
            return (f"head dims {call.head_dim}/{call.head_dim_v} (built: D in {HEAD_DIMS} "
                    f"with Dv == D, and (D, Dv) in {HEAD_DIM_PAIRS}; narrower head dims "
                    "run zero-padded to one of them, wider ones have no kernel)")
        return None     # any K: unrolled up to 8 intervals, a per-tile loop past it

    def tiles(call):
        from .kernels.cute import preferred_forward_tiles
        d, dv = _cute_call_dims(call) if call is not None else (128, 128)
        bq, bk = preferred_forward_tiles(d, call.dtype if call else "bfloat16")
        bwd = (DEFAULT_TILES.bwd_block_q, DEFAULT_TILES.bwd_block_kv)
        if call is not None:
            # The backward configs of D 256 and 192 / 128 run 64 x 64 / 64 x 96 backward tiles.
            from .kernels.cute.api import preferred_backward_tiles
            if cute_backward_plan(d, dv, call.softcap) is None:
                bwd = preferred_backward_tiles(d, call.dtype, dv, softcap=bool(call.softcap))
        return TileConfig(bq, bk, *bwd)

    def residual_program(desc):
        # Defence in depth: the tables of a residual mask hold hulls, which the kernels
        # would take for the mask itself. supports() refuses such calls unless the
        # residuals can be emitted into the kernel; a Call built by hand with
        # has_fallback=False must not run them silently either.
        res = getattr(desc.mask, "residual_regions", ())
        if not res:
            return None
        why = residual_reason_of(desc.mask)
        if why:
            why = f"a residual predicate that cannot run in a kernel: {why}"
            raise BackendUnavailable(f"the cute backend cannot run this mask: regions "
                                     f"{list(res)} have {why}; use implementation='xla'")
        from .lower.residual_program import ResidualProgram
        return ResidualProgram.forward(desc.mask)

    def forward(q, k, v, desc, scale, softcap):
        import jax.numpy as jnp
        dims = cute_forward_head_dims(q.shape[-1], v.shape[-1])
        padding = (None if dims == (q.shape[-1], v.shape[-1])
                   else cute_head_dim_padding(q.shape[-1], v.shape[-1]))
        if padding == "copy":
            # Head dims without a kernel of their own run zero-padded (cute_head_dims).
            pad = xla._pad_to
            out, lse = forward(pad(q, -1, dims[0]), pad(k, -1, dims[0]), pad(v, -1, dims[1]),
                               desc, scale, softcap)
            return out[..., :v.shape[-1]], lse
        prog = residual_program(desc)
        from .kernels.cute import cute_forward
        extra = {} if padding is None else dict(kernel_head_dims=dims)
        if prog is not None:
            bm = desc.fwd_intervals.shape[0]
            extra.update(residual=prog, row_region=jnp.broadcast_to(
                desc.row_region, (bm,) + desc.row_region.shape[1:]),
                residual_params=prog.table(desc.metadata or {}, bm, xp=jnp))
        with slow_step(f"jcompilemask: building the CuTe forward kernel ({q.dtype}, D "
                       f"{q.shape[-1]}, K {desc.num_intervals}, tiles {desc.tiles.block_q}x"
                       f"{desc.tiles.block_kv}{', residual predicates' if prog else ''})"):
            return cute_forward(q, k, v, desc.fwd_intervals, desc.fwd_tiles, scale=scale,
                                softcap=softcap, block_q=desc.tiles.block_q,
                                block_kv=desc.tiles.block_kv, **extra)

    from .attention import xla

    def backward(q, k, v, desc, scale, softcap, out, lse, do, dlse=None, deterministic=False):
        import jax.numpy as jnp
        d, dv = q.shape[-1], v.shape[-1]
        dims = cute_backward_head_dims(d, dv)
        padding = None if dims == (d, dv) else cute_head_dim_padding(d, dv)
        if padding == "copy":
            # As the forward: zero columns of q / k / v / out / dO give zero gradient
            # columns and leave delta = rowsum(dO * out) as it was.
            pad = xla._pad_to
            dq, dk, dvv = backward(pad(q, -1, dims[0]), pad(k, -1, dims[0]),
                                   pad(v, -1, dims[1]), desc, scale, softcap,
                                   pad(out, -1, dims[1]), lse, pad(do, -1, dims[1]),
                                   dlse, deterministic)
            return dq[..., :d], dk[..., :d], dvv[..., :dv]
        prog = residual_program(desc)
        why = cute_backward_plan(*(dims if padding else (d, dv)), softcap,
                                 (desc.tiles.bwd_block_q, desc.tiles.bwd_block_kv),
                                 desc.num_bwd_intervals)
        if why is not None:
            log_once(("cute-backward", why), "jcompilemask: gradients come from the xla "
                     "backward, not the CuTe backward kernel: %s", why)
            return xla.backward(q, k, v, desc, scale, softcap, out, lse, do, dlse)
        from .kernels.cute.api import _bwd_static_order_on, cute_backward
        extra = {} if padding is None else dict(kernel_head_dims=dims)
        if prog is not None:
            from .lower.residual_program import ResidualProgram
            bm = desc.fwd_intervals.shape[0]
            extra.update(residual=ResidualProgram.pair(desc.mask), row_region=jnp.broadcast_to(
                desc.row_region, (bm,) + desc.row_region.shape[1:]),
                residual_params=prog.table(desc.metadata or {}, bm, xp=jnp))
        with slow_step(f"jcompilemask: building the CuTe backward kernel ({q.dtype}, D "
                       f"{q.shape[-1]}, Kc {desc.num_bwd_intervals}"
                       f"{', residual predicates' if prog else ''})"):
            return cute_backward(q, k, v, out, lse, do, desc.bwd_intervals, desc.bwd_tiles,
                                 desc.fwd_intervals, desc.bwd_exact, scale=scale, dlse=dlse,
                                 block_q=desc.tiles.bwd_block_q,
                                 block_kv=desc.tiles.bwd_block_kv, deterministic=deterministic,
                                 softcap=softcap,
                                 exact_columns=bool(getattr(desc.mask, "column_view_exact", False)),
                                 static_bwd_tiles=(static_bwd_tiles(desc) if not deterministic
                                                   and _bwd_static_order_on(
                                                       *(dims if padding else (d, dv)), softcap)
                                                   else None),
                                 **extra)

    def tile_options(call):
        t = tiles(call)
        d, dv = _cute_call_dims(call)
        if cute_backward_plan(d, dv, call.softcap) is not None:
            return (t,)
        from .kernels.cute.api import served_backward_tiles
        served = served_backward_tiles(d, call.dtype, dv, softcap=bool(call.softcap))
        return (t,) + tuple(dataclasses.replace(t, bwd_block_q=q, bwd_block_kv=k)
                            for q, k in served if (q, k) != (t.bwd_block_q, t.bwd_block_kv))

    return Backend(name="cute", priority=10, tiles=tiles, available=available,
                   supports=supports, forward=forward, backward=backward,
                   backward_note=_cute_backward_note, own_bwd_tile_check=True,
                   tile_options=tile_options)


def static_bwd_tiles(desc):
    """``desc.bwd_tiles``' values where they are known while tracing, as numpy, else None:
    a concrete descriptor's own, or, for a traced one whose mask reads no metadata (its
    descriptor depends on the lengths and tiles alone), the same mask instantiated again at
    trace time (the jnp preprocess, compiled once per mask and lengths). The CuTe backward
    orders its key columns from them (``kernels.cute.api.backward_static_order``).

    >>> import jax, jcompilemask as jcm
    >>> cm = jcm.compile(jcm.masks.causal())
    >>> seen = []
    >>> _ = jax.jit(lambda: seen.append(static_bwd_tiles(cm.instantiate(None, 512, 512))) or 0)()
    >>> import numpy as np
    >>> type(seen[0]).__name__, np.array_equal(seen[0], cm.instantiate(None, 512, 512).bwd_tiles)
    ('ndarray', True)
    >>> static_bwd_tiles(cm.instantiate(None, 512, 512)).shape      # concrete: its own
    (1, 1, 4, 1)
    """
    import jax
    import numpy as np
    if not isinstance(desc.bwd_tiles, jax.core.Tracer):
        return np.asarray(desc.bwd_tiles)
    spec = getattr(desc.mask, "spec", None)
    if spec is None or spec.batched:
        return None
    t = desc.tiles
    return _static_bwd_tiles(desc.mask, desc.q_len, desc.kv_len, t.block_q, t.block_kv,
                             t.bwd_block_q, t.bwd_block_kv)


@functools.lru_cache(maxsize=64)
def _static_bwd_tiles(mask, q_len, kv_len, block_q, block_kv, bwd_block_q, bwd_block_kv):
    """``mask``'s backward tile states for these lengths and tiles (read-only numpy), built
    once per process: every layer and every trace of a model reuses them.

    They are built in a worker thread. A new thread starts outside the caller's trace, so
    the jnp preprocess runs as one jitted program (~0.4 s to compile and run at 8K-128K on
    2 CPU cores), where ``jax.ensure_compile_time_eval`` inside the trace evaluated it op
    by op (~4 s the first time, 0.1-0.3 s on every later call)."""
    import concurrent.futures

    import jax
    import numpy as np

    def build():
        tiles = jax.jit(lambda: mask.instantiate(
            None, q_len, kv_len, block_q=block_q, block_kv=block_kv, bwd_block_q=bwd_block_q,
            bwd_block_kv=bwd_block_kv, preprocess="jnp").bwd_tiles)()
        return np.asarray(tiles)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        tiles = pool.submit(build).result()
    tiles.flags.writeable = False
    return tiles


def residual_reason_of(cm) -> Optional[str]:
    """Why ``cm``'s residual predicates cannot be emitted into the CuTe forward (None when
    they can, or when there are none)."""
    if not getattr(cm, "residual_regions", ()):
        return None
    from .lower.residual_program import mask_kernel_reason
    return mask_kernel_reason(cm)


CUTE_BACKWARD_ENV = "JCOMPILEMASK_CUTE_BACKWARD"


def _cute_backward_enabled() -> bool:
    return os.environ.get(CUTE_BACKWARD_ENV, "1") != "0"


def _cute_backward_note() -> str:
    if not _cute_backward_enabled():
        return (f"gradients from the xla backward on the CuTe forward's residuals "
                f"({CUTE_BACKWARD_ENV}=0 turned the CuTe backward off)")
    return ("CuTe backward for every config the CuTe forward runs (D 64 / 128 / 256, 192 / "
            "128, each with or without a soft cap, other head dims up to 256 zero-padded to "
            "one of them; any K, residual predicates); "
            f"{CUTE_BACKWARD_ENV}=0 uses the xla backward on the CuTe forward's residuals "
            "instead")


def cute_backward_plan(d: int, dv: int, softcap, bwd_tiles=None, num_bwd_intervals: int = 0
                       ) -> Optional[str]:
    """None when the CuTe backward kernel would serve gradients of this shape, else why the
    xla backward does (static facts only: head dims, soft cap, the descriptor's backward
    tiles)."""
    from .kernels.cute.api import (BWD_HEAD_DIM_PAIRS, BWD_HEAD_DIMS, BWD_NATIVE_HEAD_DIMS,
                                   served_backward_tiles)
    del num_bwd_intervals   # any Kc: unrolled up to COLUMNS_UNROLLED, a loop past it
    if not _cute_backward_enabled():
        return f"the CuTe backward is turned off ({CUTE_BACKWARD_ENV}=0)"
    capped = softcap is not None and softcap is not False
    if (d, dv) not in BWD_HEAD_DIM_PAIRS and (d not in BWD_HEAD_DIMS + BWD_NATIVE_HEAD_DIMS
                                             or dv != d):
        return (f"head dims {d}/{dv} (the CuTe backward is built for D in {BWD_HEAD_DIMS} with "
                f"Dv == D, and (D, Dv) in {BWD_HEAD_DIM_PAIRS})")
    served = served_backward_tiles(d, "bfloat16", dv, softcap=capped)
    if bwd_tiles is not None and tuple(bwd_tiles) not in served:
        runs = " or ".join(f"{q}x{k}" for q, k in served)
        return (f"backward tiles {bwd_tiles[0]}x{bwd_tiles[1]} (the kernel for head dims "
                f"{d}/{dv} runs {runs})")
    return None


def cute_backward_reason(q, v, desc, softcap) -> Optional[str]:
    """None when the CuTe backward kernel serves these gradients, else why the xla
    backward does (checked at trace time, from static shapes only)."""
    return cute_backward_plan(q.shape[-1], v.shape[-1], softcap,
                              (desc.tiles.bwd_block_q, desc.tiles.bwd_block_kv),
                              desc.num_bwd_intervals)


def explain_backward(call: Call) -> str:
    """Which backward computes the gradients of ``call`` and why (one line)."""
    _ensure_builtin()
    chosen = None
    for b in backends():
        if _check(b, call) is None:
            chosen = b.name
            break
    if chosen != "cute":
        return f"backward: {chosen} (the backend that runs the forward)"
    bwd_tiles = None if call.tiles is None else (call.tiles.bwd_block_q, call.tiles.bwd_block_kv)
    d, dv = cute_backward_head_dims(call.head_dim, call.head_dim_v) or _cute_call_dims(call)
    why = cute_backward_plan(d, dv, call.softcap or None, bwd_tiles)
    if why is None:
        return "backward: the CuTe backward kernel"
    return f"backward: xla on the CuTe forward's residuals, because {why}"


_BUILTIN_DONE = False


def _padding_note(call: Call) -> str:
    """`` (how the CuTe kernels run call's head dims)`` when they have no kernel of their
    own, else ""."""
    own = (call.head_dim, call.head_dim_v)
    if _cute_call_dims(call) == own:
        return ""
    fwd = cute_forward_head_dims(*own) or own
    bwd = cute_backward_head_dims(*own) or own
    if fwd == bwd == own:
        return f" (kernels of head dims {own[0]}/{own[1]} of their own in both passes)"
    how = ("read in place by TMA boxes that zero-fill the columns past them, no copies"
           if cute_head_dim_padding(call.head_dim, call.head_dim_v) == "tma"
           else "padded copies of the operands")

    def work(dims):
        return (dims[0] + dims[1]) / (own[0] + own[1])

    if fwd == bwd:
        return (f" (head dims {own[0]}/{own[1]} run zero-padded to {fwd[0]}/{fwd[1]}: "
                f"exact, {work(fwd):.2f}x the matmul work of kernels of their own; {how})")
    if own in (fwd, bwd):
        mine, other = ("forward", "backward") if fwd == own else ("backward", "forward")
        to = bwd if fwd == own else fwd
        return (f" (the {mine} has kernels of head dims {own[0]}/{own[1]}; the {other} "
                f"runs them zero-padded to {to[0]}/{to[1]}: exact, {work(to):.2f}x the matmul "
                f"work, {how})")
    return (f" (head dims {own[0]}/{own[1]} run zero-padded: the forward to {fwd[0]}/{fwd[1]} "
            f"({work(fwd):.2f}x the matmul work), the backward to {bwd[0]}/{bwd[1]} "
            f"({work(bwd):.2f}x); exact, {how})")


def _ensure_builtin():
    global _BUILTIN_DONE
    if not _BUILTIN_DONE:
        _BUILTIN_DONE = True
        register(_xla_backend())
        register(_cute_backend())
        register_preprocess(_jnp_preprocess())
        register_preprocess(_tilelang_preprocess())


# ---------------------------------------------------------------------------------------
# Preprocess: which builder turns a CompiledMask and its metadata into the descriptor
# ---------------------------------------------------------------------------------------
PREPROCESS_ENV = "JCOMPILEMASK_PREPROCESS"


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """A builder of :class:`ExecutionDescriptor` s; all of them agree bit for bit.

    ``available()`` and ``supports(cm)`` return None when fine, else the reason;
    ``build(cm, metadata, q_len, kv_len, tiles) -> ExecutionDescriptor``; ``note`` is
    shown by :func:`explain` when it is available.
    """

    name: str
    priority: int
    available: Callable[[], Optional[str]]
    supports: Callable[[object], Optional[str]]
    build: Callable
    note: str = ""


_PREPROCESS: dict[str, Preprocess] = {}


def register_preprocess(p: Preprocess):
    _PREPROCESS[p.name] = p


def get_preprocess(name: str) -> Preprocess:
    _ensure_builtin()
    try:
        return _PREPROCESS[name]
    except KeyError:
        raise ValueError(f"preprocess must be one of {sorted(_PREPROCESS)} or None "
                         f"(automatic), got {name!r}") from None


def preprocesses() -> list[Preprocess]:
    _ensure_builtin()
    return sorted(_PREPROCESS.values(), key=lambda p: -p.priority)


def select_preprocess(cm, name: Optional[str] = None) -> Preprocess:
    """The preprocess that builds ``cm``'s descriptors.

    ``name`` None reads ``$JCOMPILEMASK_PREPROCESS``, else takes the best preprocess that
    is available here and serves ``cm``. A named one raises ``ValueError`` when it cannot
    serve ``cm``; whether this machine can run it is checked when it builds, and its
    errors say what to install.

    >>> import jcompilemask as jcm
    >>> jcm.backends.select_preprocess(jcm.compile(jcm.masks.causal()), "jnp").name
    'jnp'
    """
    _ensure_builtin()
    name = name or os.environ.get(PREPROCESS_ENV) or None
    if name is not None:
        p = get_preprocess(name)
        why = p.supports(cm)
        if why:
            raise ValueError(f"preprocess={name!r} cannot serve this mask: {why}; use "
                             "preprocess='jnp'")
        return p
    for p in preprocesses():
        if p.available() is None and p.supports(cm) is None:
            return p
    raise RuntimeError("no preprocess can serve this mask")  # jnp serves every mask


def _explain_preprocess() -> list[str]:
    lines = ["preprocess, best first (instantiate runs the first available; residual masks "
             "take jnp):"]
    for p in preprocesses():
        why = p.available()
        status = f"skipped: {why}" if why else "available" + (f" ({p.note})" if p.note else "")
        lines.append(f"  {p.name}: {status}")
    forced = os.environ.get(PREPROCESS_ENV)
    if forced:
        lines.append(f"  ${PREPROCESS_ENV}={forced} overrides the choice")
    return lines


def _jnp_preprocess() -> Preprocess:
    def build(cm, metadata, q_len, kv_len, tiles):
        from .lower.preprocess import build_descriptor_program
        return build_descriptor_program(cm, metadata, q_len, kv_len, tiles)

    return Preprocess(name="jnp", priority=0, available=lambda: None,
                      supports=lambda cm: None, build=build,
                      note="the reference; every platform; preprocess='jnp' selects it")


@functools.lru_cache(maxsize=1)
def _tilelang_reason() -> Optional[str]:
    if jax.default_backend() != "gpu":
        why = _sm90_reason() or f"JAX's default backend is {jax.default_backend()}, not the GPU"
        if missing("tilelang"):
            why += f"; on an SM90 GPU it also needs {pip_hint('tilelang')}"
        return why
    absent = missing("tilelang", "jax_tvm_ffi")
    if absent:
        return missing_hint(*absent) + "; the jnp preprocess builds the same descriptor"
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not cc.startswith("9.0"):
        return f"needs an SM90 GPU (H100/H200), found compute capability {cc}"
    return None


def _tilelang_preprocess() -> Preprocess:
    def supports(cm):
        from .kernels.tilelang.codegen import unsupported_reason
        return unsupported_reason(cm)

    def build(cm, metadata, q_len, kv_len, tiles):
        from .kernels.tilelang import tilelang_preprocess
        return tilelang_preprocess(cm, metadata, q_len, kv_len, tiles, strict=True)

    return Preprocess(name="tilelang", priority=10, available=_tilelang_reason,
                      supports=supports, build=build,
                      note="generated GPU kernels, compiled once per mask structure")


# CompiledMask.instantiate asks this module (the planner of jcompilemask.lower) which
# preprocess runs and which tiles to build at.
_compiled.install_planner(sys.modules[__name__])


# from_dense's "auto" layout keeps interval tables past 8 runs where the CuTe kernels run
# (lower/dense.py asks through this probe: lower/ imports no backend).
_dense.set_kernel_tables_probe(lambda: get("cute").available() is None)
