"""The CuTe backward's key-column order (kernels/cute/api.backward_schedule,
``BackwardConfig.schedule``), on the CPU: a permutation of the (batch, kv head, key tile)
units under every policy, heaviest first where the policy says so, the same under numpy
and jax.numpy (and under jit); the config's checks, its tag, the policy's environment
variable; and the greedy replay that motivated it (long columns no longer start last)."""
from __future__ import annotations

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jcompilemask as jcm
from jcompilemask import masks
from jcompilemask.kernels.cute import api
from jcompilemask.kernels.cute.api import BackwardConfig, backward_schedule


def _unit_counts(tiles, b, hq, hkv):
    """Visited query tiles per (batch, kv head, key tile), numpy, bit by bit."""
    bits = np.unpackbits(np.asarray(tiles, np.uint32).view(np.uint8), bitorder="little")
    bits = bits.reshape(*tiles.shape, 32)[..., 0::2]            # each tile's visited bit
    per_head = np.broadcast_to(bits.sum(axis=(-1, -2)), (b, hq, tiles.shape[2]))
    return per_head.reshape(b, hkv, hq // hkv, -1).sum(axis=2).reshape(-1).astype(np.int64)


@st.composite
def problems(draw):
    hkv = draw(st.sampled_from([1, 2, 3]))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    b = draw(st.integers(1, 3))
    bm = draw(st.sampled_from([1, b]))
    hm = draw(st.sampled_from([1, hq]))
    tk = draw(st.integers(1, 9))
    w = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    tiles = rng.integers(0, 2**32, size=(bm, hm, tk, w), dtype=np.uint64).astype(np.uint32)
    # Some sparse columns too (most tiles empty), so that hoisting has something to hoist.
    tiles &= rng.integers(0, 2**32, size=tiles.shape, dtype=np.uint64).astype(np.uint32) \
        if draw(st.booleans()) else np.uint32(0xFFFFFFFF)
    group = draw(st.sampled_from([1, 2, 4]))
    ctas = draw(st.sampled_from([1, 3, 132]))
    return tiles, b, hq, hkv, group, ctas


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(api.BWD_ORDER_POLICIES))
def test_every_policy_gives_a_permutation_in_its_order(p, policy):
    tiles, b, hq, hkv, group, ctas = p
    tk = tiles.shape[2]
    order = backward_schedule(tiles, b, hq, hkv, group, num_ctas=ctas, policy=policy, xp=np)
    assert order.dtype == np.int32 and sorted(order.tolist()) == list(range(b * hkv * tk))
    counts = _unit_counts(tiles, b, hq, hkv)[order]
    groups = (order // tk) // group
    if policy == "global":
        assert np.all(np.diff(counts) <= 0)
    elif policy == "group":
        assert np.all(np.diff(groups) >= 0), "groups run one after another"
        assert np.all(np.diff(counts)[np.diff(groups) == 0] <= 0), "heaviest first in a group"
    elif policy in ("tail", "auto"):
        w = _unit_counts(tiles, b, hq, hkv) + api.BWD_BLOCK_COST_TILES
        after = w.sum() - np.cumsum(w)
        late = w * (ctas - 1) - after > (ctas * w.sum()) // w.size
        n = int(late.sum())
        assert sorted(order[:n].tolist()) == np.flatnonzero(late).tolist(), "late units first"
        assert np.all(np.diff(counts[:n]) <= 0)
        assert np.all(np.diff(order[n:]) > 0), "the rest in the grid's order"
    else:
        totals = np.bincount(order // tk // group, weights=_unit_counts(tiles, b, hq, hkv)[order])
        hoisted = counts > totals[groups] // ctas
        n = int(hoisted.sum())
        assert hoisted[:n].all() and not hoisted[n:].any(), "hoisted units first"
        assert np.all(np.diff(counts[:n]) <= 0)
        rest_groups, rest_counts = groups[n:], counts[n:]
        assert np.all(np.diff(rest_groups) >= 0)
        assert np.all(np.diff(rest_counts)[np.diff(rest_groups) == 0] <= 0)
    traced = backward_schedule(jnp.asarray(tiles), b, hq, hkv, group, num_ctas=ctas, policy=policy)
    np.testing.assert_array_equal(np.asarray(traced), order)


def test_ties_keep_the_grid_order():
    tiles = np.full((1, 1, 5, 1), 0x5, np.uint32)            # every column: 2 tiles
    for policy in api.BWD_ORDER_POLICIES:
        assert backward_schedule(tiles, 2, 2, 2, 2, num_ctas=4, policy=policy, xp=np).tolist() \
            == list(range(20))


def test_tail_moves_only_the_columns_that_would_end_last():
    """Causal, 2 batches x 2 heads, 8 key tiles (16 query tiles) on 4 CTAs: no column
    ends much after the rest, the grid's order stays. 16 global keys + a window (the
    key tile 0 of each head is visited by every query tile): on 8 CTAs the last head's
    moves to the front (the earlier heads' start early enough), nothing else moves."""
    desc = jcm.compile(masks.causal()).instantiate(None, 1024, 1024, preprocess="jnp")
    order = backward_schedule(np.asarray(desc.bwd_tiles), 2, 2, 2, 1, num_ctas=4, policy="tail", xp=np)
    assert order.tolist() == list(range(32))
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    spec = MaskSpec([Region((0, q_len), (k <= q) & ((k < 16) | (k > q - 256)))])
    desc = jcm.compile(spec).instantiate(None, 2048, 2048, preprocess="jnp")
    order = backward_schedule(np.asarray(desc.bwd_tiles), 2, 2, 2, 1, num_ctas=8, policy="tail", xp=np)
    tk = 2048 // 128
    assert order.tolist() == [3 * tk] + [u for u in range(4 * tk) if u != 3 * tk]


@settings(max_examples=40, deadline=None)
@given(problems())
def test_auto_runs_the_schedule_exactly_when_tail_moves_a_unit(p):
    """backward_schedule_moves (what cute_backward's lax.cond reads for the ``auto``
    policy) is True exactly when tail's order differs from the grid's, in numpy and traced."""
    tiles, b, hq, hkv, group, ctas = p
    order = backward_schedule(tiles, b, hq, hkv, group, num_ctas=ctas, policy="auto", xp=np)
    moved = order.tolist() != list(range(order.size))
    assert bool(api.backward_schedule_moves(tiles, b, hq, hkv, num_ctas=ctas, xp=np)) == moved
    assert bool(jax.jit(lambda t: api.backward_schedule_moves(t, b, hq, hkv, num_ctas=ctas))(
        jnp.asarray(tiles))) == moved


def test_auto_keeps_the_grid_on_causal_and_moves_the_global_keys():
    """The descriptors of test_tail_moves_only_the_columns_that_would_end_last: causal
    moves nothing (the grid's kernel runs), 16 global keys + a window move."""
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    desc = jcm.compile(masks.causal()).instantiate(None, 1024, 1024, preprocess="jnp")
    assert not api.backward_schedule_moves(np.asarray(desc.bwd_tiles), 2, 2, 2, num_ctas=4, xp=np)
    spec = MaskSpec([Region((0, q_len), (k <= q) & ((k < 16) | (k > q - 256)))])
    desc = jcm.compile(spec).instantiate(None, 2048, 2048, preprocess="jnp")
    assert api.backward_schedule_moves(np.asarray(desc.bwd_tiles), 2, 2, 2, num_ctas=8, xp=np)


def test_runs_under_jit():
    tiles = jnp.asarray(np.array([[[[0x55], [0x1], [0x1], [0x1]]]], np.uint32))
    f = jax.jit(lambda t: backward_schedule(t, 2, 2, 1, 1, num_ctas=2))
    assert f(tiles).tolist() == [0, 4, 1, 2, 3, 5, 6, 7]


def _replay(durations, sms=132):
    """Greedy list scheduling of blocks in launch order on ``sms`` slots: the makespan."""
    free = [0.0] * sms
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def test_global_tokens_column_no_longer_starts_last():
    """16 global keys + a 256-wide causal window, 4 x 8 heads at 2K keys (the 32K shape's
    column profile, scaled down): key tile 0 is visited by every query tile; in the grid's
    order the last head's starts near the end and sets the makespan. The hoisted order's
    replay (5 us a block + 2.4 us a visited tile on 132 SMs) is within 2% of the bound."""
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    n, b, h = 2048, 16, 8
    spec = MaskSpec([Region((0, q_len), (k <= q) & ((k < 16) | (k > q - 256)))])
    desc = jcm.compile(spec).instantiate(None, n, n, preprocess="jnp")
    tiles = np.asarray(desc.bwd_tiles)
    counts = _unit_counts(tiles, b, h, h)
    dur = 5.0 + 2.4 * counts
    grid = _replay(dur)
    group = api.kv_heads_per_l2_group(n, 128, 128, 2)
    hoisted = _replay(dur[backward_schedule(tiles, b, h, h, group, policy="hoist", xp=np)])
    bound = max(dur.sum() / 132, dur.max())
    assert hoisted <= 1.02 * bound < grid, (grid, hoisted, bound)


def test_config_checks_tag_and_policy_env(monkeypatch):
    with pytest.raises(ValueError, match="excludes deterministic"):
        BackwardConfig(schedule=True, deterministic=True)
    cfg = dataclasses.replace(api.preferred_backward_config(128), schedule=True)
    assert "_sch" in cfg.tag and "_sch" not in api.preferred_backward_config(128).tag
    monkeypatch.delenv(api.BWD_ORDER_ENV, raising=False)
    assert api._bwd_order_policy() == "hoist"
    monkeypatch.setenv(api.BWD_ORDER_ENV, "global")
    assert api._bwd_order_policy() == "global"
    monkeypatch.setenv(api.BWD_ORDER_ENV, "auto")
    assert api._bwd_order_policy() == "auto"
    monkeypatch.setenv(api.BWD_ORDER_ENV, "lpt")
    with pytest.raises(ValueError, match="JCOMPILEMASK_CUTE_BWD_ORDER"):
        api._bwd_order_policy()
    with pytest.raises(ValueError, match="policy"):
        backward_schedule(np.zeros((1, 1, 2, 1), np.uint32), 1, 1, 1, 1, policy="lpt", xp=np)


def test_causal_columns_run_heaviest_first_per_l2_group():
    """Causal at 8 key tiles, 2 batches x 2 heads (MHA), two heads per group: the first
    group runs key tile 0 of both heads, then key tile 1, ... On one CTA no column
    outweighs its group's share; on 132 every column with more than one tile does (a
    group has 144 tiles), so all of those go first, heaviest first."""
    n = 1024
    desc = jcm.compile(masks.causal()).instantiate(None, n, n, preprocess="jnp")
    tiles = np.asarray(desc.bwd_tiles)
    tk = tiles.shape[2]
    order = backward_schedule(tiles, 2, 2, 2, 2, num_ctas=1, policy="hoist", xp=np)
    k_tile, pair = order % tk, order // tk
    assert k_tile[:4].tolist() == [0, 0, 1, 1] and pair[:4].tolist() == [0, 1, 0, 1]
    assert set(pair[:2 * tk].tolist()) == {0, 1}
    order = backward_schedule(tiles, 2, 2, 2, 2, num_ctas=132, policy="hoist", xp=np)
    assert (order % tk)[:8].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (order % tk)[-4:].tolist() == [7, 7, 7, 7]


@pytest.mark.parametrize("policy,calls", [("auto", 2), ("tail", 1)])
def test_auto_traces_a_cond_between_the_two_kernels(policy, calls, monkeypatch):
    """cute_backward under ``schedule=1`` and the ``auto`` order: one lax.cond whose
    branches call the scheduled kernel and the grid's (its key without the schedule);
    ``tail`` calls the scheduled kernel alone. Traced only (kernel names stand in for
    registered targets: no GPU, no compiler)."""
    monkeypatch.setenv(api.BWD_CONFIG_ENV, "schedule=1")
    monkeypatch.setenv(api.BWD_ORDER_ENV, policy)
    names = []
    monkeypatch.setattr(api, "_ensure_registered", lambda key: names.append(key) or key.target_name)
    n = 512
    desc = jcm.compile(masks.causal()).instantiate(None, n, n, preprocess="jnp")
    x = jnp.zeros((1, n, 2, 128), jnp.bfloat16)
    lse = jnp.zeros((1, 2, n), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v, o, l_, do: api.cute_backward(
        q, k, v, o, l_, do, desc.bwd_intervals, desc.bwd_tiles, desc.fwd_intervals,
        desc.bwd_exact))(x, x, x, x, lse, x))
    assert jaxpr.count("ffi_call") == calls and ("cond[" in jaxpr) == (policy == "auto")
    assert [k.config.schedule for k in names] == ([True, False] if policy == "auto" else [True])



# -- the trace-time host order (masks without metadata) ------------------------------------

def _global_window_spec():
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    return MaskSpec([Region((0, q_len), (k <= q) & ((k < 16) | (k > q - 256)))])


def _dilated_window_spec():
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    return MaskSpec([Region((0, q_len), (k <= q) & (k > q - 128) & ((q - k) % 2 == 0))])


def test_replay_makespan_is_the_greedy_in_order_launch():
    w = np.array([5, 1, 1, 1, 1, 1])
    assert api.replay_makespan(w, range(6), 2) == 5              # the long unit starts first
    assert api.replay_makespan(w, [1, 2, 3, 4, 5, 0], 2) == 7    # ... or after the others
    assert api.replay_makespan(w, range(6), 1) == w.sum()
    assert api.replay_makespan(w, range(6), 132) == 5
    rng = np.random.default_rng(3)
    w = rng.integers(1, 50, size=300)
    assert api.replay_makespan(w, range(300), 7) == _replay(w, 7)


@pytest.mark.parametrize("name,spec,n,b", [
    ("causal", masks.causal(), 8192, 16), ("causal", masks.causal(), 2048, 64),
    ("sliding window", masks.sliding_window(256), 8192, 16),
    ("dilated window", _dilated_window_spec(), 8192, 16),
    ("dilated window", _dilated_window_spec(), 32768, 4),
])
def test_static_order_keeps_the_grid_where_no_column_is_long(name, spec, n, b):
    """The benchmark shapes (8 heads, 131072 tokens a batch) of the masks where a host
    order measured slower than the grid (NOTES.md, session 21): the replay's gain stays
    under 5%, so the grid's kernel runs (no unit read)."""
    cm = jcm.compile(spec, warn=False)
    desc = cm.instantiate(None, n, n, preprocess="jnp", row_classes=False)
    tiles = np.asarray(desc.bwd_tiles)
    group = api.kv_heads_per_l2_group(n, 128, 128, 2)
    assert api.backward_static_order(tiles, b, 8, 8, group, num_ctas=132) is None
    # the dilated window runs as residue classes: one class's descriptor, c times the heads
    classes = cm.instantiate(None, n, n, preprocess="jnp")
    if isinstance(classes, jcm.ClassDescriptor):
        c = classes.classes
        tiles = np.asarray(classes.inner.bwd_tiles)
        group = api.kv_heads_per_l2_group(n // c, 128, 128, 2)
        assert api.backward_static_order(tiles, b, 8 * c, 8 * c, group, num_ctas=132) is None


@pytest.mark.parametrize("n,b", [(8192, 16), (32768, 4)])
def test_static_order_starts_the_global_keys_first(n, b):
    """16 global keys + a 256 window: every head's key tile 0 (seen by every query) runs
    first, then the rest; the order is a permutation, and its replay ends >= 5% sooner."""
    desc = jcm.compile(_global_window_spec()).instantiate(None, n, n, preprocess="jnp")
    tiles = np.asarray(desc.bwd_tiles)
    tk = tiles.shape[2]
    group = api.kv_heads_per_l2_group(n, 128, 128, 2)
    order = api.backward_static_order(tiles, b, 8, 8, group, num_ctas=132)
    assert order is not None and order.dtype == np.int32
    assert sorted(order.tolist()) == list(range(b * 8 * tk))
    assert set((order[:b * 8] % tk).tolist()) == {0}
    w = _unit_counts(tiles, b, 8, 8) + api.BWD_BLOCK_COST_TILES
    assert api.replay_makespan(w, order, 132) <= 0.95 * api.replay_makespan(w, range(w.size), 132)


def test_static_bwd_tiles_inside_jit():
    """Known while tracing: a concrete descriptor, and a traced one of a mask without
    metadata (instantiated again at trace time); unknown: a traced one that reads metadata."""
    from jcompilemask.backends import static_bwd_tiles
    seen = {}
    cm = jcm.compile(_global_window_spec())
    doc = jcm.compile(masks.document())
    md = {"segment_ids": np.repeat(np.arange(4, dtype=np.int32), 128)[None]}

    @jax.jit
    def f(x):
        seen["static"] = static_bwd_tiles(cm.instantiate(None, 1024, 1024))
        seen["batched"] = static_bwd_tiles(doc.instantiate(md, 512, 512))
        return x
    f(0)
    np.testing.assert_array_equal(seen["static"], cm.instantiate(None, 1024, 1024).bwd_tiles)
    assert isinstance(seen["static"], np.ndarray) and seen["batched"] is None


def _traced_backward_keys(monkeypatch, spec, n, d=128, static=True, softcap=None):
    """The kernel keys cute_backward registers for this mask (traced only, as
    test_auto_traces_a_cond_between_the_two_kernels) and its jaxpr."""
    names = []
    monkeypatch.setattr(api, "_ensure_registered", lambda key: names.append(key) or key.target_name)
    monkeypatch.setattr(api, "num_sms", lambda default=132: 132)
    desc = jcm.compile(spec).instantiate(None, n, n, preprocess="jnp")
    b, h = 131072 // n, 8
    x = jnp.zeros((b, n, h, d), jnp.bfloat16)
    lse = jnp.zeros((b, h, n), jnp.float32)
    st_tiles = np.asarray(desc.bwd_tiles) if static else None
    jaxpr = str(jax.make_jaxpr(lambda q, k, v, o, l_, do: api.cute_backward(
        q, k, v, o, l_, do, desc.bwd_intervals, desc.bwd_tiles, desc.fwd_intervals,
        desc.bwd_exact, softcap=softcap, static_bwd_tiles=st_tiles))(x, x, x, x, lse, x))
    return names, jaxpr


def test_static_order_runs_the_scheduled_kernel_with_a_constant_order(monkeypatch):
    """By default at D 128 without a cap (session 36), and everywhere with
    ``$JCOMPILEMASK_CUTE_BWD_STATIC_ORDER=1``, global keys + window at 8K: one kernel, the
    scheduled one (the grid's is not built), its order a constant of the program (no cond,
    no sort); causal, or no static tiles: the grid's kernel. D 64 unset, or 0: the grid's
    kernel."""
    monkeypatch.delenv(api.BWD_ORDER_ENV, raising=False)
    monkeypatch.delenv(api.BWD_CONFIG_ENV, raising=False)
    monkeypatch.delenv("JCOMPILEMASK_CUTE_BWD_STATIC_ORDER", raising=False)
    names, _ = _traced_backward_keys(monkeypatch, _global_window_spec(), 8192)
    assert [k.config.schedule for k in names] == [True]
    names, _ = _traced_backward_keys(monkeypatch, _global_window_spec(), 8192, d=64)
    assert [k.config.schedule for k in names] == [False]
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_STATIC_ORDER", "1")
    names, jaxpr = _traced_backward_keys(monkeypatch, _global_window_spec(), 8192)
    assert [k.config.schedule for k in names] == [True]      # the grid's kernel is not built
    assert jaxpr.count("ffi_call") == 1 and "cond[" not in jaxpr and "sort" not in jaxpr
    names, _ = _traced_backward_keys(monkeypatch, masks.causal(), 8192)
    assert [k.config.schedule for k in names] == [False]
    names, _ = _traced_backward_keys(monkeypatch, _global_window_spec(), 8192, static=False)
    assert [k.config.schedule for k in names] == [False]
    names, _ = _traced_backward_keys(monkeypatch, _global_window_spec(), 8192, d=64)
    assert [k.config.schedule for k in names] == [True]
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_STATIC_ORDER", "0")
    names, _ = _traced_backward_keys(monkeypatch, _global_window_spec(), 8192)
    assert [k.config.schedule for k in names] == [False]


def test_static_tiles_are_built_once_per_mask_and_lengths():
    """Every trace of a model (each layer, each jit) reads the same cached tile states for
    a mask and its lengths: one build, read-only, equal to the descriptor's own."""
    import jax
    from jcompilemask import backends
    cm = jcm.compile(_global_window_spec())
    seen = []

    def step():
        desc = cm.instantiate(None, 1024, 1024, block_q=128, block_kv=128, bwd_block_q=64,
                              bwd_block_kv=128, preprocess="jnp")
        seen.append(backends.static_bwd_tiles(desc))
        return 0
    jax.jit(step).lower()
    jax.jit(lambda: step() + 1).lower()
    assert seen[0] is seen[1] and not seen[0].flags.writeable
    concrete = cm.instantiate(None, 1024, 1024, block_q=128, block_kv=128, bwd_block_q=64,
                              bwd_block_kv=128, preprocess="jnp")
    np.testing.assert_array_equal(seen[0], np.asarray(concrete.bwd_tiles))
