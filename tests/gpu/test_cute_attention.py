"""mask_attention(implementation="cute") end to end on the H200: descriptors from the real
preprocess of every built-in mask and of random lowered specs, against the tolerance
policy (forward out and lse; gradients through the CuTe backward where it applies, else
the xla backward on the CuTe residuals).

Runs on an SM90 GPU with the CUDA extras; skips elsewhere with the reason.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.spec import MaskSpec, Region, Scalar, k, q, q_len
from jcompilemask.testing import assert_within_policy, reference_attention
from gpu_cases import SPECS, metadata, random_spec_case, registry_names_cute  # tests/gpu is on sys.path under pytest

_why = backends.get("cute").available()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")

D = 128


def _run(spec, md, b, n, hq, hkv, dtype=jnp.bfloat16, seed=0, grads=False, d=D, softcap=None):
    # The registry itself picks cute (and the CuTe backward) for this call, not only the
    # forced implementation="cute" below.
    registry_names_cute(spec, dtype, d, hq, hkv, softcap=softcap is not None)
    ks = jax.random.split(jax.random.key(seed), 4)
    # With a soft cap, logits spread ~3x wider so that tanh saturates on some of them.
    q_gain = 1.0 if softcap is None else 3.0
    qx = (q_gain * jax.random.normal(ks[0], (b, n, hq, d), jnp.float32)).astype(dtype)
    kx = jax.random.normal(ks[1], (b, n, hkv, d), jnp.float32).astype(dtype)
    vx = jax.random.normal(ks[2], (b, n, hkv, d), jnp.float32).astype(dtype)
    out, lse = jax.jit(lambda a, b_, c, m: jcm.mask_attention(
        a, b_, c, spec, metadata=m, implementation="cute", logits_soft_cap=softcap,
        return_residual=True))(qx, kx, vx, md)
    lse = jnp.swapaxes(lse, 1, 2)                      # [B, Nq, Hq] -> the references' [B, Hq, Nq]
    dense = spec.as_dense(md, n, n)
    hi = reference_attention(qx, kx, vx, dense, softcap=softcap, precision="high")
    lo = reference_attention(qx, kx, vx, dense, softcap=softcap, precision="input")
    assert_within_policy(out, hi[0], lo[0], "out")
    assert_within_policy(lse, hi[1], lo[1], "lse")
    if grads:
        do = jax.random.normal(ks[3], out.shape, jnp.float32).astype(dtype)
        loss = lambda impl: lambda a: jnp.sum(jcm.mask_attention(
            a, kx, vx, spec, metadata=md, implementation=impl,
            logits_soft_cap=softcap).astype(jnp.float32) * do)
        g = jax.jit(jax.grad(loss("cute")))(qx)
        f32 = lambda x: x.astype(jnp.float32)
        g_hi = jax.grad(lambda a: jnp.sum(reference_attention(
            a, f32(kx), f32(vx), dense, softcap=softcap)[0] * f32(do)))(f32(qx))
        g_lo = jax.grad(lambda a: jnp.sum(reference_attention(
            a, kx, vx, dense, softcap=softcap, precision="input")[0].astype(jnp.float32) * do))(qx)
        assert_within_policy(g, g_hi, g_lo, "dq")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_builtin(name):
    rng = np.random.default_rng(1)
    n = 1000 if name != "clear" else 1100            # ragged: not a multiple of 128
    _run(SPECS[name], metadata(name, 2, n, rng), 2, n, 4, 2, grads=name in ("hstu", "document"))


def test_fp16_and_mqa():
    _run(SPECS["hstu"], metadata("hstu", 2, 777, np.random.default_rng(2)), 2, 777, 4, 1,
         dtype=jnp.float16)


def test_fully_masked_rows():
    s = Scalar("start", max=q_len)
    spec = MaskSpec([Region((s, q_len), k <= q)])
    _run(spec, {"start": np.array([300, 900])}, 2, 900, 2, 2)


@pytest.mark.parametrize("seed", range(8))
def test_random_lowered_specs(seed):
    rng = np.random.default_rng(100 + seed)
    n, b = 700, 2
    spec, md = random_spec_case(rng, n, b)
    assert not jcm.compile(spec).fallback_regions
    _run(spec, md, b, n, 2, 2, seed=seed)


# Step 2 of issue 6 end to end: head dims 64 and 256 (the descriptor is built at the
# backend's preferred tiles, 128 x 80 for D = 256) and the soft cap, through the real
# preprocess. clear has K = 6 intervals (the D = 256 kernel reloads them per masked tile);
# hstu K = 2; document per-batch intervals. Ragged n; fp16 and MQA on some.
STEP2 = [
    ("causal", 64, None, jnp.bfloat16), ("hstu", 64, None, jnp.float16),
    ("clear", 64, 5.0, jnp.bfloat16), ("document", 64, 5.0, jnp.float16),
    ("causal", 256, None, jnp.bfloat16), ("hstu", 256, 5.0, jnp.bfloat16),
    ("clear", 256, None, jnp.float16), ("document", 256, 5.0, jnp.bfloat16),
    ("causal", 128, 5.0, jnp.bfloat16), ("hstu", 128, 5.0, jnp.float16),
    ("clear", 128, 5.0, jnp.bfloat16), ("shared_prompt", 128, 20.0, jnp.bfloat16),
]


@pytest.mark.parametrize("name,d,softcap,dtype", STEP2,
                         ids=[f"{n}-d{d}-cap{c}-{jnp.dtype(t).name}" for n, d, c, t in STEP2])
def test_head_dims_and_softcap(name, d, softcap, dtype):
    rng = np.random.default_rng(3)
    n = 1000 if name != "clear" else 1100
    hkv = 1 if dtype == jnp.float16 else 2
    grads = (name, d) in (("hstu", 64), ("document", 256))
    _run(SPECS[name], metadata(name, 2, n, rng), 2, n, 4, hkv, dtype=dtype, d=d, softcap=softcap,
         grads=grads)


@pytest.mark.parametrize("d", [64, 256])
def test_fully_masked_rows_head_dims(d):
    s = Scalar("start", max=q_len)
    spec = MaskSpec([Region((s, q_len), k <= q)])
    _run(spec, {"start": np.array([300, 900])}, 2, 900, 2, 2, d=d, softcap=5.0)
