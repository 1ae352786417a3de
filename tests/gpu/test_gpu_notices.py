"""On the H200: mask_attention says once (through logging) when a call leaves the CuTe
kernels and why, and jax.nn-style calls (bias, dense masks, lengths) run correctly.

Runs on an SM90 GPU with the CUDA extras; skips elsewhere with the reason.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.spec import MaskSpec, Region, k, q, q_len

_why = backends.get("cute").available()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")

B, N, H, D = 2, 256, 4, 128


def _qkv(dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(kk, (B, N, H, D), jnp.float32).astype(dtype) for kk in ks)


def _notices(caplog):
    return [r.getMessage() for r in caplog.records if "not cute" in r.getMessage()]


def test_leaving_the_cute_kernels_is_logged_once_with_the_reason(caplog):
    q_, k_, v_ = _qkv()
    # a dilated causal mask: its residual (q - k) % 2 == 0 keeps it off the CuTe kernels
    # (k // 64 <= q // 64, the block-causal spelling, lowers exactly since issue 16)
    dilated = MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % 2 == 0))],
                       name="gpu_notice_dilated")
    with pytest.warns(jcm.MaskFallbackWarning, match="residual predicate"):
        with caplog.at_level(logging.WARNING, logger="jcompilemask"):
            for _ in range(2):
                out = jcm.mask_attention(q_, k_, v_, dilated)
    lines = _notices(caplog)
    assert len(lines) == 1 and "evaluate residuals only with" in lines[0], lines
    ref = jax.nn.dot_product_attention(q_, k_, v_, mask=dilated.as_dense(None, N))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2)
    caplog.clear()
    bias = jax.random.normal(jax.random.key(1), (1, H, N, N))
    with caplog.at_level(logging.WARNING, logger="jcompilemask"):
        out = jcm.mask_attention(q_, k_, v_, bias=bias.astype(jnp.bfloat16), is_causal=True)
    lines = _notices(caplog)
    assert len(lines) == 1 and "bias" in lines[0], lines
    ref = jax.nn.dot_product_attention(q_, k_, v_, bias.astype(jnp.bfloat16), is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2)


def test_jax_keywords_run_on_the_cute_kernels():
    q_, k_, v_ = _qkv()
    lens = jnp.array([200, 97], jnp.int32)
    kw = dict(is_causal=True, key_value_seq_lengths=lens, local_window_size=(64, 0))
    out = jcm.mask_attention(q_, k_, v_, implementation="cudnn", **kw)      # -> cute
    ref = jax.nn.dot_product_attention(q_, k_, v_, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2)
