"""The xla backward (what serves every configuration the CuTe backward does not, and the
reference the GPU tests of issue 15 lean on) with a soft cap and Dv != D, against a float64
numpy forward + backward written out by hand (no JAX autodiff on either side of the check).

Shapes: D 24 / Dv 16 (a 192 / 128 in miniature) and D = Dv, GQA 4 / 2 and MQA, a causal
mask whose first rows see nothing (fully masked rows), and a wide spread of logits so that
tanh saturates.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask.spec import MaskSpec, Region, Scalar, k, q, q_len

N = 70
TILES = dict(block_q=16, block_kv=32, bwd_block_q=32, bwd_block_kv=16)


def _numpy_attention_grads(q, k, v, do, vis, scale, cap):
    """float64 out [B, Nq, Hq, Dv] and (dq, dk, dv) of sum(out * do): logits
    l = cap tanh(scale q.k / cap) (or scale q.k), P = softmax over visible keys (0 in rows
    that see nothing), dl = P (dP - rowsum(dP P)), ds = dl (1 - t^2) scale."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    g = q.shape[2] // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    t = np.tanh(s / cap) if cap is not None else None
    logit = cap * t if cap is not None else s
    logit = np.where(vis, logit, -np.inf)
    m = np.max(logit, axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.where(vis, np.exp(logit - m), 0.0)
    z = e.sum(-1, keepdims=True)
    p = e / np.where(z == 0, 1.0, z)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
    dl = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    ds = dl * ((1.0 - t * t) if cap is not None else 1.0) * scale
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q)
    dvv = np.einsum("bhqk,bqhd->bkhd", p, do)
    b, nk, hkv = k.shape[:3]
    fold = lambda x: x.reshape(b, nk, hkv, g, x.shape[-1]).sum(3)  # noqa: E731
    return out, (dq, fold(dk), fold(dvv))


@pytest.mark.parametrize("d,dv", [(24, 16), (16, 16)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_xla_backward_softcap_and_dv_against_float64(d, dv, hq, hkv, cap):
    start = Scalar("start", max=q_len)
    spec = MaskSpec([Region((start, q_len), k <= q)])       # rows < start see nothing
    md = {"start": np.array([0, 9])}
    b = 2
    desc = jcm.compile(spec).instantiate(md, N, N, preprocess="jnp", **TILES)
    ks = jax.random.split(jax.random.key(11), 4)
    qx = 3.0 * jax.random.normal(ks[0], (b, N, hq, d), jnp.float32)
    kx = jax.random.normal(ks[1], (b, N, hkv, d), jnp.float32)
    vx = jax.random.normal(ks[2], (b, N, hkv, dv), jnp.float32)
    do = jax.random.normal(ks[3], (b, N, hq, dv), jnp.float32)
    scale = 0.37

    def run(a, b_, c):
        return jcm.mask_attention(a, b_, c, desc, scale=scale, logits_soft_cap=cap,
                                  implementation="xla")

    out, vjp = jax.vjp(run, qx, kx, vx)
    grads = vjp(do)
    vis = np.asarray(spec.as_dense(md, N, N), bool)
    want_out, want = _numpy_attention_grads(qx, kx, vx, do, vis, scale, cap)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=2e-5, rtol=1e-4)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.shape == ref.shape, name
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=5e-5, rtol=2e-4,
                                   err_msg=name)
    # the fully masked rows: zero output and zero dq
    assert np.all(np.asarray(out)[1, :9] == 0) and np.all(np.asarray(grads[0])[1, :9] == 0)
