"""NaN / Inf in query, key or value through the CuTe forward and backward
(``mask_attention(implementation="cute")``), against jax.nn.dot_product_attention under
the contract of ``tests/nonfinite_cases.py``; rows whose mask is empty give 0.

Runs on an SM90 GPU with the CUDA extras; skips elsewhere with the reason.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.testing import reference_attention
from nonfinite_cases import (CASES, ROW, case_id, check_case, document_ids, inputs,  # tests/
                             ours)

_why = backends.get("cute").available()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")

N = 300                       # ragged: not a multiple of the 128-row tiles
HQ, HKV = 4, 2
# bf16 inputs against jax's float32 math on the same (rounded) inputs.
ATOL = 5e-2


def _mask(name, padding=0):
    if name == "causal":
        return jcm.masks.causal(), None
    return jcm.masks.document(), {"segment_ids": document_ids(N, padding)}


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("where,value", CASES, ids=[case_id(*c) for c in CASES])
def test_causal_nonfinite_matches_jax(where, value, d):
    spec, md = _mask("causal")
    check_case(where, value, spec, "cute", md, dtype=jnp.bfloat16, atol=ATOL, n=N, hq=HQ,
               hkv=HKV, d=d)


@pytest.mark.parametrize("where,value", CASES, ids=[case_id(*c) for c in CASES])
def test_document_mask_nonfinite_matches_jax(where, value):
    spec, md = _mask("document")
    check_case(where, value, spec, "cute", md, dtype=jnp.bfloat16, atol=ATOL, n=N, hq=HQ,
               hkv=HKV, d=128)


def test_nan_query_row_is_nan_not_zero():
    spec, md = _mask("causal")
    q, k, v, do = inputs(jnp.bfloat16, N, HQ, HKV, 128)
    q = q.at[0, ROW].set(jnp.nan)
    out, lse, dq, _, _ = ours(q, k, v, do, spec, "cute", md)
    assert np.isnan(np.asarray(out[0, ROW], np.float32)).all()
    assert np.isnan(np.asarray(lse[0, :, ROW])).all()
    assert np.isnan(np.asarray(dq[0, ROW], np.float32)).all()


def test_empty_rows_give_zero_with_finite_inputs():
    pad = 40
    spec, md = _mask("document", padding=pad)
    q, k, v, do = inputs(jnp.bfloat16, N, HQ, HKV, 128)
    out, lse, dq, dk, dv = ours(q, k, v, do, spec, "cute", md)
    f32 = lambda x: np.asarray(x, np.float32)                       # noqa: E731
    np.testing.assert_array_equal(f32(out[:, N - pad:]), 0.0)
    assert np.isneginf(f32(lse[:, :, N - pad:])).all()
    for g in (dq, dk, dv):
        assert np.isfinite(f32(g)).all()
        np.testing.assert_array_equal(f32(g[:, N - pad:]), 0.0)
    dense = spec.as_dense(md, N, N)
    ref = reference_attention(q, k, v, dense)[0]
    np.testing.assert_allclose(f32(out), f32(ref), atol=ATOL)
