"""The CuTe forward's work-unit order (kernels/cute/api.forward_schedule, issue 14 item 2),
on the CPU: a permutation, grouped by KV heads for L2, longest first inside a group, the
same under numpy and jax.numpy; the schedule knob and the key's name."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jcompilemask as jcm
from jcompilemask import masks
from jcompilemask.kernels.cute import api
from jcompilemask.kernels.cute.api import forward_schedule, kv_heads_per_l2_group


def _counts(tiles):
    bits = np.unpackbits(np.asarray(tiles, np.uint32).view(np.uint8), bitorder="little")
    bits = bits.reshape(*tiles.shape, 32)[..., 0::2]             # each tile's visited bit
    return bits.sum(axis=(-1, -2)).astype(np.int64)               # [Bm, Hm, Tq]


@st.composite
def problems(draw):
    hkv = draw(st.sampled_from([1, 2, 3]))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    b = draw(st.integers(1, 3))
    bm = draw(st.sampled_from([1, b]))
    hm = draw(st.sampled_from([1, hq]))
    tq = draw(st.integers(1, 9))
    w = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    tiles = np.random.default_rng(seed).integers(0, 2**32, size=(bm, hm, tq, w), dtype=np.uint64)
    group = draw(st.sampled_from([1, 2, 4]))
    return tiles.astype(np.uint32), b, hq, hkv, group


@given(problems())
def test_order_is_grouped_longest_first_permutation(p):
    tiles, b, hq, hkv, group = p
    order = forward_schedule(tiles, b, hq, hkv, group, xp=np)
    tq = tiles.shape[2]
    assert order.dtype == np.int32 and sorted(order.tolist()) == list(range(b * hq * tq))
    counts = np.broadcast_to(_counts(tiles), (b, hq, tq)).reshape(-1)[order]
    bb, rest = np.divmod(order, hq * tq)
    hh = rest // tq
    groups = (bb * hkv + hh // (hq // hkv)) // group
    assert np.all(np.diff(groups) >= 0), "groups run one after another"
    same = np.diff(groups) == 0
    assert np.all(np.diff(counts)[same] <= 0), "longest first inside a group"
    np.testing.assert_array_equal(np.asarray(forward_schedule(jnp.asarray(tiles), b, hq, hkv, group)),
                                  order)


def test_causal_descriptor_starts_with_the_last_query_tiles():
    """Causal at 8 query tiles, 2 batches x 4 heads over 2 KV heads, one KV head per group:
    each group (a KV head's 2 query heads) runs tile 7 of both heads, then tile 6, ..."""
    n, bq = 1024, 128
    desc = jcm.compile(masks.causal()).instantiate(None, n, n, block_q=bq, block_kv=bq,
                                                    preprocess="jnp")
    tiles = np.asarray(desc.fwd_tiles)
    order = forward_schedule(tiles, 2, 4, 2, 1, xp=np)
    tq = n // bq
    q_tile = order % tq
    head = (order // tq) % 4
    batch = order // (4 * tq)
    assert q_tile[:4].tolist() == [7, 7, 6, 6] and head[:4].tolist() == [0, 1, 0, 1]
    assert batch[:2 * tq].tolist() == [0] * (2 * tq) and head[2 * tq:2 * tq + 2].tolist() == [2, 3]


def test_schedule_runs_under_jit():
    tiles = jnp.asarray(np.array([[[[0x1], [0x5], [0x15]]]], np.uint32))
    f = jax.jit(lambda t: forward_schedule(t, 2, 2, 1, 2))
    assert f(tiles).tolist() == forward_schedule(np.asarray(tiles), 2, 2, 1, 2, xp=np).tolist()
    assert f(tiles).tolist()[:4] == [2, 5, 8, 11]      # both batches' last tiles share a group


def test_l2_group_size():
    assert kv_heads_per_l2_group(32768, 128, 128, 2) == 2      # 16 MB of K / V a head
    assert kv_heads_per_l2_group(8192, 128, 128, 2) == 8
    assert kv_heads_per_l2_group(1 << 20, 256, 256, 2) == 1    # larger than L2: 1
    assert kv_heads_per_l2_group(1, 64, 64, 2) & (kv_heads_per_l2_group(1, 64, 64, 2) - 1) == 0


def test_schedule_env_and_key_name(monkeypatch):
    monkeypatch.delenv(api.FWD_SCHEDULE_ENV, raising=False)
    assert api._fwd_schedule() == (False, False)
    monkeypatch.setenv(api.FWD_SCHEDULE_ENV, "1")
    assert api._fwd_schedule() == (True, False)
    monkeypatch.setenv(api.FWD_SCHEDULE_ENV, "persistent")
    assert api._fwd_schedule() == (True, True)
    monkeypatch.setenv(api.FWD_SCHEDULE_ENV, "yes")
    with pytest.raises(ValueError, match="JCOMPILEMASK_CUTE_FWD_SCHEDULE"):
        api._fwd_schedule()
    base = dict(dtype="bfloat16", head_dim=128, head_dim_v=128, num_intervals=1, block_q=128,
                block_kv=128, broadcast_batch=True, broadcast_head=True, scale=128**-0.5)
    assert api.ForwardKey(**base, schedule=True).target_name.endswith("_ls")
    assert api.ForwardKey(**base, schedule=True, persistent=True).target_name.endswith("_lp")
    assert not api.ForwardKey(**base).target_name.endswith(("_ls", "_lp"))


def test_num_sms_without_a_gpu():
    assert api.num_sms() == 132 or api.num_sms() > 0


@given(st.integers(1, 300), st.integers(1, 40))
def test_persistent_table_deals_every_unit_once(units, ctas):
    order = np.random.default_rng(units * 41 + ctas).permutation(units).astype(np.int32)
    table = api.persistent_schedule(order, ctas, xp=np)
    p = min(ctas, units)
    assert table.shape == (p, 1 + -(-units // p)) and table.dtype == np.int32
    got = []
    for row in table:
        n = row[0]
        assert np.all(row[1:1 + n] >= 0) and np.all(row[1 + n:] == -1)
        got += row[1:1 + n].tolist()
    assert sorted(got) == list(range(units))
    np.testing.assert_array_equal(np.asarray(api.persistent_schedule(jnp.asarray(order), ctas)), table)


def test_persistent_snake_balances_a_longest_first_order():
    """Causal at 32K (8 heads x 4 batches x 256 query tiles, tile t visits t + 1 key
    tiles) on 132 CTAs: the snake keeps the CTAs' visited tiles within 1% of each other
    (dealing round-robin without reversing gives ~3%)."""
    tq, units = 256, 8 * 4 * 256
    counts = np.tile(np.arange(1, tq + 1), units // tq)
    order = np.argsort(-counts, kind="stable").astype(np.int32)
    table = api.persistent_schedule(order, 132, xp=np)
    loads = [counts[row[1:1 + row[0]]].sum() for row in table]
    assert max(loads) / min(loads) < 1.01, (max(loads), min(loads))
