"""NaN / Inf in query, key or value propagate as in jax.nn.dot_product_attention (xla
backend; the contract is in ``nonfinite_cases``); only rows whose mask is empty give 0."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask.testing import reference_attention
from nonfinite_cases import CASES, N, ROW, case_id, check_case, document_ids, inputs, ours

TILES = dict(block_q=16, block_kv=8, bwd_block_q=8, bwd_block_kv=16)


def _desc(name, padding=0):
    if name == "causal":
        return jcm.compile(jcm.masks.causal()).instantiate(None, N, N, **TILES)
    return jcm.compile(jcm.masks.document()).instantiate(
        {"segment_ids": document_ids(padding=padding)}, N, N, **TILES)


@pytest.mark.parametrize("where,value", CASES, ids=[case_id(*c) for c in CASES])
def test_causal_nonfinite_matches_jax(where, value):
    check_case(where, value, _desc("causal"), "xla")


@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_document_mask_nan_matches_jax(where):
    check_case(where, float("nan"), _desc("document"), "xla")


def test_nan_query_row_is_nan_not_zero():
    # The first symptom: a NaN in q row ROW gave out 0, lse -inf and a finite dq.
    q, k, v, do = inputs()
    q = q.at[0, ROW].set(jnp.nan)
    out, lse, dq, _, _ = ours(q, k, v, do, _desc("causal"), "xla")
    assert np.isnan(np.asarray(out[0, ROW])).all()
    assert np.isnan(np.asarray(lse[0, :, ROW])).all()
    assert np.isnan(np.asarray(dq[0, ROW])).all()
    assert np.isfinite(np.asarray(out[0, :ROW])).all()


def test_nan_key_reaches_only_rows_that_see_it():
    # The second: a NaN in k row ROW zeroed rows ROW..N-1 under causal.
    q, k, v, do = inputs()
    k = k.at[0, ROW].set(jnp.nan)
    out = np.asarray(ours(q, k, v, do, _desc("causal"), "xla")[0])
    assert np.isnan(out[0, ROW:]).all()
    assert np.isfinite(out[0, :ROW]).all() and np.isfinite(out[1]).all()


def test_empty_rows_give_zero_with_finite_inputs():
    pad = 6
    desc = _desc("document", padding=pad)
    q, k, v, do = inputs()
    out, lse, dq, dk, dv = ours(q, k, v, do, desc, "xla")
    dense = desc.as_dense()
    assert not np.asarray(dense)[:, :, N - pad:].any()
    np.testing.assert_array_equal(np.asarray(out[:, N - pad:]), 0.0)
    assert np.isneginf(np.asarray(lse[:, :, N - pad:])).all()
    np.testing.assert_array_equal(np.asarray(dq[:, N - pad:]), 0.0)
    # keys no row sees get no gradient
    np.testing.assert_array_equal(np.asarray(dk[:, N - pad:]), 0.0)
    np.testing.assert_array_equal(np.asarray(dv[:, N - pad:]), 0.0)
    ref = reference_attention(q, k, v, dense)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref[0]), atol=2e-5)
    f = lambda q, k, v: reference_attention(q, k, v, dense)[0]      # noqa: E731
    for got, want in zip((dq, dk, dv), jax.vjp(f, q, k, v)[1](do)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


@pytest.mark.parametrize("where", ["query", "key"])
def test_nan_in_padding_that_nothing_sees_stays_out(where):
    # A row with an empty mask ignores its query (out 0, lse -inf); a key no row sees
    # changes no logit. (A NaN *value* no row sees can still reach rows of a tile that
    # reads it, as 0 * NaN in P @ V: jax's dense product gives NaN everywhere then.)
    pad = 6
    desc = _desc("document", padding=pad)
    q, k, v, do = inputs()
    bad = [q, k, v]
    i = ("query", "key", "value").index(where)
    bad[i] = bad[i].at[:, N - 2].set(jnp.nan)
    out, lse, *_ = ours(*bad, do, desc, "xla")
    clean, clean_lse, *_ = ours(q, k, v, do, desc, "xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(clean), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))


def test_reference_attention_propagates_nan():
    # The dense oracle follows the same rule (a NaN max is not an empty row).
    q, k, v, _ = inputs()
    q = q.at[0, ROW].set(jnp.nan)
    mask = np.tril(np.ones((N, N), bool))
    out, lse = reference_attention(q, k, v, mask)
    assert np.isnan(np.asarray(out[0, ROW])).all() and np.isnan(np.asarray(lse[0, :, ROW])).all()
