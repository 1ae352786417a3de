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
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax

from .lower.compiled import DEFAULT_TILES
from .lower.descriptor import TileConfig

__all__ = ["Backend", "Call", "register", "select", "explain", "preferred_tiles",
           "BackendUnavailable"]


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
    has_fallback: bool
    num_intervals: int = 1
    tiles: Optional[TileConfig] = None     # of a prebuilt descriptor, if one was passed


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
    if why is None and call is not None:
        why = b.supports(call)
        if why is None and call.tiles is not None:
            want = b.tiles(call)
            if want != call.tiles and b.name != "xla":
                why = (f"the descriptor was built for tiles {call.tiles}, this backend needs "
                       f"{want}: instantiate with those tiles or pass the MaskSpec")
    return why


def select(implementation: Optional[str], call: Call) -> Backend:
    """The backend that runs ``call`` (raises :class:`BackendUnavailable` if none)."""
    _ensure_builtin()
    if implementation is not None:
        b = get(implementation)
        why = _check(b, call)
        if why:
            raise BackendUnavailable(f"implementation={implementation!r} cannot run this "
                                     f"call: {why}")
        return b
    reasons = []
    for b in backends():
        why = _check(b, call)
        if why is None:
            return b
        reasons.append(f"{b.name}: {why}")
    raise BackendUnavailable("no implementation can run this call: " + "; ".join(reasons))


def explain(call: Call | None = None) -> str:
    """Each backend, best first, and whether it would run ``call`` (or is available)."""
    _ensure_builtin()
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
    if call is not None:
        lines.append(f"chosen: {chosen}")
    return "\n".join(lines)


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
        forward=xla.forward, backward=xla.backward)


@functools.lru_cache(maxsize=1)
def _sm90_reason() -> Optional[str]:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return "no GPU visible to JAX"
    cc = getattr(gpus[0], "compute_capability", None)
    if cc is None or str(cc) not in ("9.0", "9.0a"):
        return f"needs an SM90 GPU (H100/H200), found compute capability {cc}"
    return None


def _cute_backend() -> Backend:
    import importlib.util

    def available():
        why = _sm90_reason()
        if why:
            return why
        for mod in ("cutlass", "jax_tvm_ffi"):
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not installed (pip install 'jcompilemask[cuda]')"
        return None

    def supports(call: Call):
        if call.has_fallback:
            return ("the mask has fallback regions (predicates the interval tables cannot "
                    "hold); the xla backend evaluates them")
        if call.dtype not in ("bfloat16", "float16"):
            return f"dtype {call.dtype} (the CuTe kernels take bfloat16 and float16)"
        from .kernels.cute.api import HEAD_DIMS
        if call.head_dim not in HEAD_DIMS or call.head_dim_v != call.head_dim:
            return (f"head dims {call.head_dim}/{call.head_dim_v} (built: D in {HEAD_DIMS} "
                    "with Dv == D)")
        if call.num_intervals > 8:
            return f"K = {call.num_intervals} intervals per row (the kernel unrolls up to 8)"
        return None

    def tiles(call):
        from .kernels.cute import preferred_forward_tiles
        bq, bk = preferred_forward_tiles(call.head_dim if call else 128,
                                         call.dtype if call else "bfloat16")
        return TileConfig(bq, bk, DEFAULT_TILES.bwd_block_q, DEFAULT_TILES.bwd_block_kv)

    def forward(q, k, v, desc, scale, softcap):
        from .kernels.cute import cute_forward
        return cute_forward(q, k, v, desc.fwd_intervals, desc.fwd_tiles, scale=scale,
                            softcap=softcap, block_q=desc.tiles.block_q,
                            block_kv=desc.tiles.block_kv)

    from .attention import xla

    def backward(q, k, v, desc, scale, softcap, out, lse, do, dlse=None):
        why = cute_backward_reason(q, v, desc, softcap)
        if why is not None:
            return xla.backward(q, k, v, desc, scale, softcap, out, lse, do, dlse)
        from .kernels.cute.api import cute_backward
        return cute_backward(q, k, v, out, lse, do, desc.bwd_intervals, desc.bwd_tiles,
                             desc.fwd_intervals, desc.bwd_exact, scale=scale, dlse=dlse,
                             block_q=desc.tiles.bwd_block_q, block_kv=desc.tiles.bwd_block_kv)

    return Backend(name="cute", priority=10, tiles=tiles, available=available,
                   supports=supports, forward=forward, backward=backward,
                   backward_note=_cute_backward_note)


CUTE_BACKWARD_ENV = "JCOMPILEMASK_CUTE_BACKWARD"


def _cute_backward_enabled() -> bool:
    import os
    return os.environ.get(CUTE_BACKWARD_ENV, "1") != "0"


def _cute_backward_note() -> str:
    if _cute_backward_enabled():
        return ("CuTe backward for D 64/128 without soft cap; xla backward on the CuTe "
                f"forward's residuals otherwise ({CUTE_BACKWARD_ENV}=0 uses it always)")
    return (f"gradients from the xla backward on the CuTe forward's residuals "
            f"({CUTE_BACKWARD_ENV}=0 turned the CuTe backward off)")


def cute_backward_reason(q, v, desc, softcap) -> Optional[str]:
    """None when the CuTe backward kernel serves these gradients, else why the xla
    backward does (checked at trace time, from static shapes only)."""
    from .kernels.cute.api import BWD_HEAD_DIMS, BWD_TILES
    if not _cute_backward_enabled():
        return f"the CuTe backward is turned off ({CUTE_BACKWARD_ENV}=0)"
    d, dv = q.shape[-1], v.shape[-1]
    if d not in BWD_HEAD_DIMS or dv != d:
        return f"head dims {d}/{dv} (the CuTe backward is built for D in {BWD_HEAD_DIMS}, Dv == D)"
    if softcap is not None:
        return "soft cap (the CuTe backward does not differentiate through tanh yet)"
    if (desc.tiles.bwd_block_q, desc.tiles.bwd_block_kv) != BWD_TILES:
        return (f"backward tiles {desc.tiles.bwd_block_q}x{desc.tiles.bwd_block_kv} (the kernel "
                f"runs {BWD_TILES[0]}x{BWD_TILES[1]})")
    if desc.num_bwd_intervals > 16:
        return f"Kc = {desc.num_bwd_intervals} column intervals (the kernel unrolls up to 16)"
    return None


_BUILTIN_DONE = False


def _ensure_builtin():
    global _BUILTIN_DONE
    if not _BUILTIN_DONE:
        _BUILTIN_DONE = True
        register(_xla_backend())
        register(_cute_backend())
