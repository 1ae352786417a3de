"""Issue 16, item 3 (spec side): spellings the lowering now serves.

* row conditions ``q == G[i]`` (a row equal to a metadata value) keep the column view;
* ``SegmentIds.id(k)`` (a per-token property of the key) and vectors indexed by
  per-token ids (``V[D.id(q)]``);
* the K of a per-head spec is the maximum over heads, not the sum;
* ``from_dense`` with a batch axis.

Each case: the natural spelling and a hand-written equivalent give the same dense view;
descriptors match the dense oracle on random metadata (hypothesis); forward and gradients
on the ``xla`` backend match :func:`jcompilemask.testing.reference_gradients` under the
tolerance policy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jcompilemask as jcm
from jcompilemask.spec import (MaskSpec, Region, Scalar, SegmentIds, Vector, h, k, kv_len,
                               q, q_len)
from jcompilemask.testing import assert_within_policy, reference_gradients
from test_lower import TILE_CONFIGS, _tile_kwargs, check_descriptor

TILES = dict(block_q=16, block_kv=8, bwd_block_q=8, bwd_block_kv=16)


def _inputs(key, b, nq, nk, hq, hkv, d, dtype=jnp.float32):
    ks = jax.random.split(key, 4)
    qx = jax.random.normal(ks[0], (b, nq, hq, d), jnp.float32).astype(dtype)
    kx = jax.random.normal(ks[1], (b, nk, hkv, d), jnp.float32).astype(dtype)
    vx = jax.random.normal(ks[2], (b, nk, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, nq, hq, d), jnp.float32).astype(dtype)
    return qx, kx, vx, do


def check_xla_against_reference(desc, dense, qx, kx, vx, do):
    """Forward and (dq, dk, dv) of ``sum(out * do)`` on the xla backend, against the
    dense reference of ``dense`` [B or 1, Hm, Nq, Nk] under the tolerance policy."""
    from jcompilemask.testing import reference_attention

    def ours(a, b_, c):
        return jcm.mask_attention(a, b_, c, desc, implementation="xla")

    out, vjp = jax.vjp(ours, qx, kx, vx)
    grads = vjp(do)
    mask = jnp.asarray(dense)
    hi_out = reference_attention(qx, kx, vx, mask, precision="high")[0]
    lo_out = reference_attention(qx, kx, vx, mask, precision="input")[0]
    assert_within_policy(out, hi_out, lo_out, "out")
    g_hi, g_lo = reference_gradients(qx, kx, vx, do, mask)
    for name, a, gh, gl in zip(("dq", "dk", "dv"), grads, g_hi, g_lo):
        assert_within_policy(a, gh, gl, name)


def _same_dense(a, b, md, nq, nk):
    np.testing.assert_array_equal(np.asarray(a.as_dense(md, nq, nk)),
                                  np.asarray(b.as_dense(md, nq, nk)))


# =======================================================================================
# Row conditions q == G[i] keep the column view
# =======================================================================================
G = Vector("special", 2, max=q_len)


def special_rows_spec():
    """Causal, plus two special rows (e.g. summary tokens) that see every key."""
    return MaskSpec([Region((0, q_len), (q == G[0]) | (q == G[1]) | (k <= q))],
                    name="special_rows")


def special_rows_by_hand():
    return MaskSpec([Region((0, q_len), ((q >= G[0]) & (q < G[0] + 1))
                            | ((q >= G[1]) & (q <= G[1])) | (k <= q))])


def special_window_spec():
    """Causal, and row G[0] also sees the 3 keys from G[1] on (maybe in its future)."""
    return MaskSpec([Region((0, q_len), ((q == G[0]) & (k >= G[1]) & (k < G[1] + 3))
                            | (k <= q))])


def test_row_equal_to_metadata_keeps_the_column_view():
    for spec in (special_rows_spec(), special_window_spec()):
        cm = jcm.compile(spec)
        assert cm.has_column_view and cm.num_bwd_intervals > 0, cm.explain()
        assert not cm.fallback_regions
        assert "no column view" not in cm.explain()
    md = {"special": np.array([[3, 9], [0, 12], [12, 12]], np.int32)}
    _same_dense(special_rows_spec(), special_rows_by_hand(), md, 13, 13)


@settings(max_examples=15)
@given(data=st.data())
def test_row_equal_to_metadata_descriptor(data):
    spec = data.draw(st.sampled_from([special_rows_spec(), special_window_spec()]))
    tiles = data.draw(st.sampled_from(TILE_CONFIGS))
    nq, nk = data.draw(st.sampled_from([(13, 13), (7, 11), (12, 5)]))
    b = data.draw(st.integers(1, 3))
    md = {"special": np.array(data.draw(st.lists(st.lists(st.integers(0, nq), min_size=2,
                                                          max_size=2),
                                                 min_size=b, max_size=b)), np.int32)}
    desc = jcm.compile(spec).instantiate(md, nq, nk, **_tile_kwargs(tiles))
    # the special rows' column intervals come from the row bounds [G, G + 1)
    check_descriptor(desc, spec.as_dense(md, nq, nk), nq, nk, expect_column_view=True)


def test_row_equal_to_metadata_gradients_on_xla():
    spec = special_rows_spec()
    md = {"special": np.array([[5, 17], [0, 30]], np.int32)}
    n = 32
    desc = jcm.compile(spec).instantiate(md, n, n, **TILES)
    assert desc.num_bwd_intervals > 0 and bool(np.asarray(desc.bwd_exact).all())
    qx, kx, vx, do = _inputs(jax.random.key(0), 2, n, n, 2, 2, 16)
    check_xla_against_reference(desc, spec.as_dense(md, n, n), qx, kx, vx, do)
