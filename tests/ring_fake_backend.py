"""A recording attention backend for the ring tests (tests/test_ring_backends.py and
tests/scripts/ring_backends_check.py).

Registered in the backend registry for the duration of a ``with registered(...)`` block,
it runs like the CuTe kernels as far as the ring can tell: its own tiles (not xla's
defaults, block_q != block_kv); outputs rounded to bfloat16 (``out``, dQ, dK, dV; lse
float32), which the ring must cast up and merge in float32; and outputs that come out of
an opaque call (a host callback here, ``jax.ffi.ffi_call`` there), which inside
``shard_map`` are typed as not varying over the mesh axes. The arithmetic is the xla
backend's. Each call records what it was given (shapes, tiles), at trace time.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jcompilemask import backends
from jcompilemask.attention import xla
from jcompilemask.lower.descriptor import TileConfig

TILES = TileConfig(block_q=16, block_kv=8, bwd_block_q=8, bwd_block_kv=16)


@dataclasses.dataclass(frozen=True)
class Seen:
    kind: str                      # "fwd" or "bwd"
    q: tuple
    k: tuple
    fwd_intervals: tuple
    bwd_intervals: tuple
    fwd_tiles: tuple
    bwd_tiles: tuple
    row_region: tuple
    tiles: TileConfig
    q_len: int
    kv_len: int
    out: tuple = ()                # backward: the out / lse / do it was handed
    lse: tuple = ()
    do: tuple = ()
    deterministic: bool = False


def _opaque(*xs):
    """``xs`` through an identity host callback: like an FFI kernel's results, they lose
    their varying-manual-axes type inside ``shard_map``."""
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs)
    return jax.pure_callback(lambda *a: tuple(np.asarray(x) for x in a), shapes, *xs,
                             vmap_method="sequential")


def _seen(kind, q, k, desc, out=None, lse=None, do=None, deterministic=False):
    sh = lambda x: () if x is None else tuple(x.shape)   # noqa: E731
    return Seen(kind, sh(q), sh(k), sh(desc.fwd_intervals), sh(desc.bwd_intervals),
                sh(desc.fwd_tiles), sh(desc.bwd_tiles), sh(desc.row_region), desc.tiles,
                desc.q_len, desc.kv_len, sh(out), sh(lse), sh(do), deterministic)


@contextlib.contextmanager
def registered(name: str, *, priority: int = 5, max_intervals=None, round_to=jnp.bfloat16,
               other_tiles=()):
    """Register the fake backend ``name``; yields the list of calls it records.

    ``max_intervals``: ``supports`` refuses calls with more interval slots per row.
    ``priority`` 5 is above xla (0) and below cute (10). ``other_tiles``: TileConfigs it
    also runs (``Backend.tile_options``, after TILES)."""
    seen: list[Seen] = []

    def supports(call):
        if max_intervals is not None and call.num_intervals > max_intervals:
            return f"K = {call.num_intervals} intervals per row (this one takes {max_intervals})"
        return None

    def forward(q, k, v, desc, scale, softcap):
        seen.append(_seen("fwd", q, k, desc))
        out, lse = xla.forward(q, k, v, desc, scale, softcap)
        return _opaque(out.astype(round_to), lse)

    def backward(q, k, v, desc, scale, softcap, out, lse, do, dlse=None, deterministic=False):
        seen.append(_seen("bwd", q, k, desc, out, lse, do, deterministic))
        grads = xla.backward(q, k, v, desc, scale, softcap, out, lse, do, dlse)
        return _opaque(*(g.astype(round_to) for g in grads))

    backends._ensure_builtin()
    backends.register(backends.Backend(
        name=name, priority=priority, tiles=lambda call: TILES, available=lambda: None,
        supports=supports, forward=forward, backward=backward,
        tile_options=(lambda call: (TILES,) + tuple(other_tiles)) if other_tiles else None))
    try:
        yield seen
    finally:
        backends._REGISTRY.pop(name, None)


def check_seen(seen, *, batch, rows, k_slots, kc_slots, q_heads, tiles=TILES):
    """Every recorded call is one ring step's: ``rows`` local rows x ``rows`` held keys, a
    sub-descriptor at ``tiles`` with ``k_slots`` / ``kc_slots`` intervals per row / column
    (Bm = ``batch``, one mask head), and both passes were seen."""
    assert {s.kind for s in seen} == {"fwd", "bwd"}, [s.kind for s in seen]
    cdiv = lambda a, b: -(-a // b)   # noqa: E731
    for s in seen:
        assert s.tiles == tiles, s
        assert s.q_len == s.kv_len == rows and s.q[1] == s.k[1] == rows, s
        assert s.fwd_intervals == (batch, 1, rows, k_slots, 2), s
        assert s.bwd_intervals == (batch, 1, rows, kc_slots, 2), s
        assert s.fwd_tiles == (batch, 1, rows // tiles.block_q,
                               cdiv(rows // tiles.block_kv, 16)), s
        assert s.bwd_tiles == (batch, 1, rows // tiles.bwd_block_kv,
                               cdiv(rows // tiles.bwd_block_q, 16)), s
        assert s.row_region == (batch, rows), s
        if s.kind == "bwd":     # the merged (global) out / lse / do of the local rows
            assert s.out[:3] == s.q[:3] and s.do == s.out, s
            assert s.lse == (s.q[0], q_heads, rows), s
