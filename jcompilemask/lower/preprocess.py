"""The jnp preprocess: metadata -> ExecutionDescriptor, generated from lowered intervals.

"Generated" in the JAX sense: the lowered interval expressions are evaluated while
tracing, so the jaxpr holds exactly the arithmetic of this mask's endpoints and nothing
per-mask is hand-written. Everything here is jit-able and shape-static: metadata values
never retrace. Work is O(B * Hm * (Nq * K + Nk * Kc + tiles)), no O(Nq * Nk) term, for
every MaskSpec: residual predicates are not evaluated here (their hulls give safe tile
states: see :func:`tile_states_from_intervals`).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from ..spec.evaluate import Env, evaluate
from ..spec.expr import BoolConst
from .descriptor import (COMPUTE, MASKED, ExecutionDescriptor, TileConfig, pack_tiles)

__all__ = ["build_descriptor", "tile_states_from_intervals"]

I32 = jnp.int32


def _bcast(x, shape):
    return jnp.broadcast_to(jnp.asarray(x, I32), shape)


def region_row_ranges(spec, meta, q_len, kv_len):
    """Per region, the clamped bounds and the *effective* contiguous row range.

    Returns (lo, hi, eff_lo, eff_hi, nested): lists of int32 [B] and bool [B] ``nested``
    (an earlier region lies strictly inside a later one: its rows are not contiguous).
    """
    lo_raw, hi_raw = spec._raw_bounds(meta, q_len, kv_len)
    lo = [jnp.clip(x, 0, q_len) for x in lo_raw]
    hi = [jnp.clip(x, 0, q_len) for x in hi_raw]
    n = len(lo)
    eff_lo, eff_hi = [], []
    nested = jnp.zeros(lo[0].shape, bool)
    for g in range(n):
        a, b = lo[g], hi[g]
        for _ in range(g):               # a fixed point is reached within g sweeps
            for p in range(g):
                nonempty = lo[p] < hi[p]
                a = jnp.where(nonempty & (lo[p] <= a) & (a < hi[p]), hi[p], a)
                b = jnp.where(nonempty & (lo[p] < b) & (b <= hi[p]), lo[p], b)
        b = jnp.maximum(a, b)
        for p in range(g):
            nested = nested | ((lo[p] < hi[p]) & (a < lo[p]) & (hi[p] < b))
        eff_lo.append(a)
        eff_hi.append(b)
    return lo, hi, eff_lo, eff_hi, nested


def tile_states_from_intervals(starts, lens, q_len, kv_len, bq, bk, exact=None):
    """2-bit tile states uint8 [B, Hm, Tq, Tk] from row intervals [B, Hm, Nq, K].

    Per row, the K intervals are merged into disjoint runs; a run adds +1 over the tile
    columns it touches and over those it covers entirely (difference arrays, one
    scatter-add each). A tile is visible if any row touches it and full if every one of
    its in-range rows covers it: O(Nq * K + Tq * Tk) work.

    ``exact`` (bool [B, Hm, Nq, K], or None: all): which intervals are exact. Hulls of
    residual predicates (``exact`` False) make the tiles they touch visible but never
    cover one: such a tile is partial (the residual may cut it).
    """
    if exact is not None:
        touched = tile_states_from_intervals(starts, lens, q_len, kv_len, bq, bk)
        covered = tile_states_from_intervals(starts, jnp.where(exact, lens, 0), q_len,
                                             kv_len, bq, bk)
        return (touched & COMPUTE) | (covered & MASKED)
    b, hm, nq, kk = starts.shape
    tq, tk = -(-q_len // bq), -(-kv_len // bk)
    big = jnp.asarray(kv_len + 1, I32)
    live = lens > 0
    lo = jnp.where(live, starts, big)
    hi = jnp.where(live, starts + lens, big)
    order = jnp.argsort(lo, axis=-1)
    lo = jnp.take_along_axis(lo, order, -1)
    hi = jnp.take_along_axis(hi, order, -1)
    pmax = lax.cummax(hi, axis=3)
    prev = jnp.concatenate([jnp.full(pmax.shape[:-1] + (1,), -1, I32), pmax[..., :-1]], -1)
    new_group = lo > prev
    gstart = lax.cummax(jnp.where(new_group, lo, -1), axis=3)
    nxt = jnp.concatenate([lo[..., 1:], jnp.full(lo.shape[:-1] + (1,), big + 1, I32)], -1)
    last = nxt > pmax
    ok = last & (gstart < big)
    gs = jnp.where(ok, gstart, 0)
    ge = jnp.where(ok, pmax, 0)
    t_lo, t_hi = gs // bk, (ge + bk - 1) // bk
    f_lo = (gs + bk - 1) // bk
    f_hi = jnp.where(ge == kv_len, tk, ge // bk)
    f_ok = ok & (f_hi > f_lo)

    ti = (jnp.arange(nq, dtype=I32) // bq)[:, None]
    one = ok.astype(I32)
    fone = f_ok.astype(I32)

    def diff(lo_i, hi_i, w):
        # vmapped over (batch, mask head): the scatters carry those as batching dims, so
        # under a batch-sharded jit each device scatters into its own sequences (an
        # explicit batch index would make XLA all-reduce the whole table).
        def one_row_block(lo_r, hi_r, w_r):                  # [Nq, K] -> [Tq, Tk]
            d = jnp.zeros((tq, tk + 1), I32)
            d = d.at[ti, jnp.where(w_r > 0, lo_r, 0)].add(w_r)
            d = d.at[ti, jnp.where(w_r > 0, hi_r, 0)].add(-w_r)
            return jnp.cumsum(d, axis=-1)[..., :tk]
        return jax.vmap(jax.vmap(one_row_block))(lo_i, hi_i, w)

    touched = diff(t_lo, t_hi, one)
    covered = diff(f_lo, f_hi, fone)
    rows = jnp.minimum(bq, q_len - jnp.arange(tq, dtype=I32) * bq)[:, None]
    full = covered == rows[None, None]
    return ((touched > 0).astype(jnp.uint8) * COMPUTE
            + (~full).astype(jnp.uint8) * MASKED)


def tile_states_dense(desc: ExecutionDescriptor, bq, bk):
    """Tile states by evaluating visibility tile-row by tile-row (fallback masks)."""
    q_len, kv_len = desc.q_len, desc.kv_len
    tq, tk = -(-q_len // bq), -(-kv_len // bk)
    cols = jnp.arange(tk * bk, dtype=I32)
    col_in = cols < kv_len

    def one(ti):
        rows = ti * bq + jnp.arange(bq, dtype=I32)
        vis = desc.visibility(rows, cols, "fwd")                 # [B, Hm, bq, tk*bk]
        inside = (rows < q_len)[:, None] & col_in[None, :]
        vis = vis.reshape(vis.shape[:2] + (bq, tk, bk))
        inside = inside.reshape(bq, tk, bk)
        any_vis = jnp.any(vis, axis=(2, 4))
        any_mask = jnp.any(inside[None, None] & ~vis, axis=(2, 4))
        return any_vis.astype(jnp.uint8) * COMPUTE + any_mask.astype(jnp.uint8) * MASKED

    st = lax.map(one, jnp.arange(tq, dtype=I32))               # [Tq, B, Hm, Tk]
    return jnp.moveaxis(st, 0, 2)


def build_descriptor_program(cm, metadata, q_len: int, kv_len: int, tiles: TileConfig):
    """``build_descriptor`` as one jitted XLA program when the metadata is concrete.

    Run op by op, the preprocess is a few hundred small programs, each compiled the first
    time its shapes are seen (seconds for a new mask or length, even on small inputs) and
    dispatched one by one after that; as one program it compiles once per (mask, lengths,
    tiles, metadata shapes and dtypes) and runs as one call. The metadata is checked first,
    eagerly, so bad values still raise :class:`MetadataError` naming the argument. Under
    a transformation (inside the caller's ``jit``, even with concrete metadata closed over)
    it is ``build_descriptor`` itself, traced into the caller's program.

    JAX keeps each compiled program; a process that instantiates thousands of distinct masks
    or lengths (a fuzzer) holds as many executables, on CPU each with its own code mappings
    (Linux caps a process at ``vm.max_map_count``, 65530 by default): ``jax.clear_caches()``
    releases them (tests/compiled_programs.py does so for the test suite).
    """
    if not _top_level():        # traced metadata, or concrete metadata inside a trace
        if _eager_shard_map():
            # Op by op inside an eager (unjitted) jax.shard_map, each op is compiled as its
            # own manual computation, and jaxlib 0.11's Shardy canonicalizer crashes the
            # process on some of them (ManualComputationUnusedInputsPattern, a segfault):
            # one jitted program compiles once and does not.
            return jax.jit(functools.partial(build_descriptor, cm, q_len=q_len,
                                             kv_len=kv_len, tiles=tiles))(metadata)
        return build_descriptor(cm, metadata, q_len, kv_len, tiles)
    arrays, _ = cm.spec.checked_metadata(metadata, q_len, kv_len)
    programs = cm.__dict__.setdefault("_descriptor_programs", {})
    key = (q_len, kv_len, tiles)
    if key not in programs:
        programs[key] = jax.jit(functools.partial(_build_checked, cm, q_len=q_len,
                                                  kv_len=kv_len, tiles=tiles))
    return programs[key](arrays)


def _top_level() -> bool:
    """No transformation is tracing (not inside the caller's jit / vmap / grad, where even
    concrete metadata, closed over, is traced into the caller's program, as one program
    rather than a nested call). False when JAX offers no way to tell, so the op-by-op path
    is the fallback."""
    from jax._src import core as _core
    clean = getattr(_core, "trace_state_clean", None)
    try:
        return bool(clean()) if clean is not None else False
    except Exception:            # pragma: no cover - a JAX without it
        return False


def _eager_shard_map() -> bool:
    """Ops run op by op inside an eager (unjitted) ``jax.shard_map``'s body: its trace is
    the innermost one or sits below transformations that evaluate eagerly (``jax.vjp`` /
    ``jax.grad`` / ``jax.vmap`` of the unjitted shard_map: JVP, linearize and batch traces
    pass each op down to it). A staging trace (``jit``, ``make_jaxpr``) on the way ends the
    walk: the ops then join that program. False when JAX offers no way to tell."""
    try:
        from jax._src import core as _core
        from jax._src.interpreters import partial_eval as _pe
        from jax._src.shard_map import ShardMapTrace
        trace = _core.trace_ctx.trace
        for _ in range(64):      # the stack of nested transformations, innermost first
            if isinstance(trace, ShardMapTrace):
                return True
            if trace is None or isinstance(trace, (_pe.DynamicJaxprTrace, _core.EvalTrace)):
                return False
            trace = getattr(trace, "parent_trace", None)
        return False
    except Exception:            # pragma: no cover - a JAX without them
        return False


def _build_checked(cm, arrays, *, q_len, kv_len, tiles):
    return build_descriptor(cm, arrays or None, q_len, kv_len, tiles)


def build_descriptor(cm, metadata, q_len: int, kv_len: int, tiles: TileConfig):
    """The jnp preprocess of a lowered :class:`CompiledMask` (see module doc)."""
    spec = cm.spec
    meta, b = spec.normalize_metadata(metadata, q_len, kv_len)
    hm = spec.mask_heads
    kk, kc = cm.num_intervals, cm.num_bwd_intervals
    shape = (b, hm, q_len)
    idx = {"q": jnp.arange(q_len, dtype=I32).reshape(1, 1, q_len),
           "h": jnp.arange(hm, dtype=I32).reshape(1, hm, 1)}
    env = Env(3, idx, q_len, kv_len, meta)
    row_region = spec.row_regions(meta, q_len, kv_len)              # [B, Nq]
    region3 = row_region[:, None, :]
    zero = jnp.zeros(shape, I32)
    starts, lens = [zero] * kk, [zero] * kk
    exact = [jnp.ones(shape, bool)] * kk            # per row: slot m has no residual
    endpoints = {}                                   # (g, i) -> (lo, hi) clamped
    big = jnp.asarray(kv_len + 1, I32)
    for g, lr in enumerate(cm.regions):
        mine = region3 == g
        for i, iv in enumerate(lr.intervals):
            lo = jnp.clip(_bcast(evaluate(iv.lo, env), shape), 0, kv_len)
            hi = jnp.clip(_bcast(evaluate(iv.hi, env), shape), 0, kv_len)
            endpoints[g, i] = (lo, hi)
        for m, members in enumerate(lr.slots):
            # One slot group (lr.slots[m]): a single interval, or intervals whose row
            # conditions exclude each other or that touch wherever both hold.
            if len(members) == 1:
                lo, hi = endpoints[g, members[0]]
                ok = mine & _bcast(evaluate(lr.intervals[members[0]].cond, env),
                                   shape).astype(bool)
                ln = jnp.where(ok, jnp.maximum(hi - lo, 0), 0)
                st_m = jnp.where(ln > 0, lo, 0)
            else:
                # The union of the active non-empty members is one run.
                s_lo, s_hi = big, jnp.zeros(shape, I32)
                for i in members:
                    lo, hi = endpoints[g, i]
                    act = (_bcast(evaluate(lr.intervals[i].cond, env), shape).astype(bool)
                           & (hi > lo))
                    s_lo = jnp.minimum(s_lo, jnp.where(act, lo, big))
                    s_hi = jnp.maximum(s_hi, jnp.where(act, hi, 0))
                ln = jnp.where(mine, jnp.maximum(s_hi - s_lo, 0), 0)
                st_m = jnp.where(ln > 0, s_lo, 0)
            res = lr.slot_residual(m)
            inexact = not (isinstance(res, BoolConst) and res.value)
            # The group's table slot per head (lower/slots.py; every member has the
            # group's assignment).
            for s, heads in cm.fwd_slots[g, members[0]]:
                sel = mine & _heads_mask(heads, hm)
                starts[s] = jnp.where(sel, st_m, starts[s])
                lens[s] = jnp.where(sel, ln, lens[s])
                if inexact:
                    exact[s] = exact[s] & ~sel
    st = jnp.stack(starts, -1)
    ln = jnp.stack(lens, -1)
    fwd_intervals = jnp.stack([st, ln], -1)                           # [B, Hm, Nq, K, 2]

    # -- column view -------------------------------------------------------------------
    if kc > 0:
        bwd_intervals, nested = _column_intervals(cm, env, meta, endpoints, q_len, kv_len,
                                                  b, hm)
        bwd_exact = ~nested
    else:
        bwd_intervals = jnp.zeros((b, hm, kv_len, 0, 2), I32)
        bwd_exact = jnp.zeros((b,), bool)

    keep_meta = meta if cm.residual_regions else {}
    desc = ExecutionDescriptor(fwd_intervals, bwd_intervals, None, None, row_region,
                               bwd_exact, keep_meta, mask=cm, q_len=q_len, kv_len=kv_len,
                               tiles=tiles)
    ex = jnp.stack(exact, -1) if cm.residual_regions else None
    fwd_states = tile_states_from_intervals(st, ln, q_len, kv_len, tiles.block_q,
                                            tiles.block_kv, ex)
    bwd_states = tile_states_from_intervals(st, ln, q_len, kv_len, tiles.bwd_block_q,
                                            tiles.bwd_block_kv, ex)
    desc.fwd_tiles = pack_tiles(fwd_states)
    desc.bwd_tiles = pack_tiles(jnp.swapaxes(bwd_states, -1, -2))
    return desc


def count_le_sorted(v, n):
    """int32 [n]: ``out[j] = #{q : v[q] <= j}`` for a non-decreasing int32 [Nq] ``v``.

    One scatter with at most two writes per index: v is clipped to [-1, n] (still
    non-decreasing); a run of equal values c over rows [q0, q1] adds q1 + 1 - q0 at index c
    (+ (q1 + 1) from its last row, - q0 from its first); runs at -1 (before every j) are
    counted apart and runs at n fall out of bounds; a cumsum gives the counts. A histogram
    (``zeros.at[v].add(1)``) is the same count, but every row outside a region adds into
    one slot, and on a GPU those atomic adds serialize (H200, shared prompt at 8K, 26
    histograms per sequence: 5.6 ms of preprocess, run 2026-12-01T23:55:22Z). On a CPU
    the two take the same time.

    The column view exists only where the lowering proved the bounds non-decreasing in q
    (``analyze``), and ``_column_intervals`` keeps them so around the region (-1 before it,
    n + 1 after). An unsorted v gives a count that is not the histogram's.

    >>> import jax.numpy as jnp
    >>> count_le_sorted(jnp.array([-1, 0, 0, 2, 5, 9]), 6).tolist()
    [3, 3, 4, 4, 4, 5]
    """
    nq = v.shape[-1]
    # Materialized once (XLA would otherwise re-evaluate v's producer, e.g. the endpoint
    # expression, inside each of the fused uses below).
    vc = lax.optimization_barrier(jnp.clip(v, -1, n).astype(I32))
    q = jnp.arange(nq, dtype=I32)
    step = vc[1:] > vc[:-1]
    first = jnp.concatenate([jnp.ones((1,), bool), step])
    last = jnp.concatenate([step, jnp.ones((1,), bool)])
    # A run [q0, q1] of value c adds q1 + 1 - q0 rows at c: + (q1 + 1) from its last row,
    # - q0 from its first (one write of 1 when they are the same row).
    val = jnp.where(last, q + 1, 0) - jnp.where(first, q, 0)
    idx = jnp.where((first | last) & (vc >= 0), vc, n + q)           # >= n: dropped
    at = jnp.zeros((n,), I32).at[idx].add(val, mode="drop")
    below = jnp.sum(vc < 0, dtype=I32)                                # rows before every j
    return jnp.cumsum(at) + below


def _heads_mask(heads, hm):
    """bool [1, Hm, 1]: the mask heads of a slot assignment (None: every head)."""
    if heads is None:
        return jnp.ones((1, hm, 1), bool)
    return jnp.isin(jnp.arange(hm, dtype=I32), jnp.asarray(heads, I32)).reshape(1, hm, 1)


def _column_intervals(cm, env, meta, endpoints, q_len, kv_len, b, hm):
    """Per key column, the rows that see it, one (start, len) per (region, interval).

    For interval m of region g with bounds non-decreasing in q, the rows q of the
    region's effective range with lo(q) <= j < hi(q) are [#{q: hi'(q) <= j},
    #{q: lo'(q) <= j}), where lo', hi' extend lo, hi by -1 before the range and by
    a big value after it (so they stay monotone). Counting them (``count_le_sorted``)
    keeps it O(Nq + Nk) and exact.
    """
    spec = cm.spec
    _, _, eff_lo, eff_hi, nested = region_row_ranges(spec, meta, q_len, kv_len)
    qs = jnp.arange(q_len, dtype=I32)[None, None, :]
    big = kv_len + 1
    shape3 = (b, hm, 1)
    out = [jnp.zeros((b, hm, kv_len, 2), I32)] * cm.num_bwd_intervals

    def count_le(v):   # [..., B, Hm, Nq] -> [..., B, Hm, Nk]: #{q : v(q) <= j}
        f = lambda v_r: count_le_sorted(v_r, kv_len)    # noqa: E731
        for _ in range(v.ndim - 1):
            f = jax.vmap(f)
        return f(v)

    # Pass 1: each interval's extended bounds; pass 2: their counts, all 2 Kc bounds
    # stacked through one program (a GPU's default) or one per bound (a CPU's; see
    # column_counts_mode); pass 3: the (start, len) slots.
    bounds, rows = [], []
    for g, lr in enumerate(cm.regions):
        for m, iv in enumerate(lr.intervals):
            lo, hi = endpoints[g, m]
            a = _bcast(eff_lo[g][:, None, None], shape3)
            z = _bcast(eff_hi[g][:, None, None], shape3)
            if iv.q_lo is not None:
                a = jnp.maximum(a, _bcast(evaluate(iv.q_lo, env), shape3))
            if iv.q_hi is not None:
                z = jnp.minimum(z, _bcast(evaluate(iv.q_hi, env), shape3))
            flag = _bcast(evaluate(iv.row_flag, env), shape3).astype(bool)
            before, after = qs < a, qs >= z
            lo_x = jnp.where(before, -1, jnp.where(after, big, lo))
            hi_x = jnp.where(before, -1, jnp.where(after, big, hi))
            bounds += [jnp.broadcast_to(v, (b, hm, q_len)) for v in (hi_x, lo_x)]
            rows.append((g, m, flag))
    if not rows:
        return jnp.stack(out, 3), nested
    stacked = lambda *v: list(count_le(jnp.stack(v)))      # noqa: E731
    each = lambda *v: [count_le(x) for x in v]               # noqa: E731
    mode = column_counts_mode()
    if mode == "auto":
        counts = lax.platform_dependent(*bounds, cpu=each, default=stacked)
    else:
        counts = (stacked if mode == "stacked" else each)(*bounds)
    for i, (g, m, flag) in enumerate(rows):
        q0, q1 = counts[2 * i], counts[2 * i + 1]
        ln = jnp.where(flag, jnp.maximum(q1 - q0, 0), 0)
        val = jnp.stack([jnp.where(ln > 0, q0, 0), ln], -1)
        for c, heads in cm.bwd_slots[g, m]:
            out[c] = jnp.where(_heads_mask(heads, hm)[..., None], val, out[c])
    return jnp.stack(out, 3), nested


COLUMN_COUNTS_ENV = "JCOMPILEMASK_PREPROCESS_COLUMN_COUNTS"


def column_counts_mode():
    """How the jnp preprocess counts the column view's 2 Kc bounds (read at trace time):
    ``"stacked"`` runs :func:`count_le_sorted` once over all of them ([2 Kc, B, Hm, Nq]: one
    scatter and one cumsum), ``"each"`` once per bound (2 Kc scatters and their fusions),
    ``"auto"`` (the default) picks by the platform the program is lowered for: each on a
    CPU, stacked elsewhere. The descriptor is identical; what differs is the number of
    programs the device launches. H200, 8K, 16 sequences per batch (run
    2026-12-02T16:19:42Z), preprocess ms each -> stacked: shared prompt (Kc 13) 3.54 ->
    2.09, CLEAR (Kc 7) 0.92 -> 0.51, HSTU 0.21 -> 0.16, causal 0.13 -> 0.10. On a CPU the
    stacked program is the slower (shared prompt, 8K, 16 sequences, 2 cores: 94 vs 66 ms,
    ``benchmarks``-sized metadata). Override with
    ``$JCOMPILEMASK_PREPROCESS_COLUMN_COUNTS`` (``auto`` / ``each`` / ``stacked``).

    >>> column_counts_mode() in ("auto", "each", "stacked")
    True
    """
    mode = os.environ.get(COLUMN_COUNTS_ENV, "auto")
    if mode not in ("auto", "each", "stacked"):
        raise ValueError(f"${COLUMN_COUNTS_ENV}={mode!r}: expected 'auto', 'each' or 'stacked'")
    return mode
