"""Dense masks known only at run time on the CuTe kernels: a boolean ``mask=`` computed
inside ``jit`` (as Flax's ``make_attention_mask`` and padding masks are) has its runs found
on the device (``jcompilemask.lower.dense_runtime``); the registry runs its interval-table
tiers on the CuTe forward and backward and the bitmap, past the widest tier, on xla. Each
case checks the backends the registry names, the tier that runs, and out / lse / gradients
against the dense oracle under the tolerance policy. CPU twin: tests/test_runtime_dense.py.

    python3 -m pytest -q tests/gpu/test_cute_runtime_dense.py        # on an SM90 GPU
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.attention.api import runtime_dense_plan
from jcompilemask.testing import assert_within_policy, reference_attention, reference_gradients
from gpu_cases import gradient_problems  # noqa: E402  (tests/gpu is on sys.path under pytest)

import os

IMPL = os.environ.get("JCM_RUNTIME_DENSE_IMPL", "cute")   # "xla": the test logic on CPU
_why = None if IMPL == "xla" else backends.get("cute").available()
needs_gpu = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")

N = 700


def _packed_causal(rng, b):
    """Packed documents, causal inside each, the last stretch padding: 1 run per row."""
    ids = np.sort(rng.integers(0, 5, (b, N)), axis=1)
    ids[:, -37:] = -1
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    return same & np.tril(np.ones((N, N), bool))[None], 0


def _window_globals(rng, b):
    """A causal 96-wide window and 5 scattered global keys: up to 6 runs per row."""
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    g = np.zeros(N, bool)
    g[[3, 150, 333, 410, 600]] = True
    m = (j <= i) & ((j > i - 96) | g[None, :])
    return np.broadcast_to(m, (b, N, N)), 1


def _many_runs(rng, b):
    """12 stripes of keys, causal: past the widest tier, the bitmap on xla."""
    j = np.arange(N)[None, :]
    m = ((j % 58) < 4) & (j <= np.arange(N)[:, None])
    m = m | np.eye(N, dtype=bool)
    return np.broadcast_to(m, (b, N, N)), 2


CASES = {"packed_causal": _packed_causal, "window_globals": _window_globals,
         "many_runs": _many_runs}


@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_traced_dense_mask_on_cute(case, dtype):
    b, hq, hkv, d = 2, 4, 2, 128
    m, want_index = CASES[case](np.random.default_rng(7), b)
    m = np.ascontiguousarray(m[:, None])
    m[1, 0, 20:30] = False                                  # rows that see nothing
    ks = jax.random.split(jax.random.key(3), 4)
    mk = lambda kk, h: jax.random.normal(kk, (b, N, h, d), jnp.float32).astype(dtype)  # noqa: E731
    qx, kx, vx, do = mk(ks[0], hq), mk(ks[1], hkv), mk(ks[2], hkv), mk(ks[3], hq)

    seen = {}

    def plan(m):
        descs, seen["names"], index = runtime_dense_plan(qx, kx, jcm.runtime_dense(m))
        return index
    assert int(jax.jit(plan)(m)) == want_index
    assert seen["names"] == (IMPL, IMPL, "xla"), seen["names"]

    # (every kernel runs before the first check: a compile-only pass reaches all of them)
    out, lse = jax.jit(lambda a, b_, c, mm: jcm.mask_attention(
        a, b_, c, mm, return_residual=True))(qx, kx, vx, m)

    def loss(a, b_, c, mm):
        o = jcm.mask_attention(a, b_, c, mm)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qx, kx, vx, m)
    hi = reference_attention(qx, kx, vx, m, precision="high")
    lo = reference_attention(qx, kx, vx, m, precision="input")
    assert_within_policy(out, hi[0], lo[0], "out")
    assert_within_policy(jnp.swapaxes(lse, 1, 2), hi[1], lo[1], "lse")
    g_hi, g_lo = reference_gradients(qx, kx, vx, do, m)
    problems = gradient_problems(g, g_hi, g_lo, dtype)
    assert not problems, "; ".join(problems)


@needs_gpu
def test_jax_style_call_with_lengths_on_cute():
    """jax.nn.dot_product_attention's arguments with a traced mask: a key padding mask AND
    is_causal AND both sequence lengths, as a Flax model passes them (one run per row:
    the first tier, on cute); the forward against the oracle."""
    b, h, d = 2, 8, 64
    ks = jax.random.split(jax.random.key(5), 3)
    qx, kx, vx = (jax.random.normal(kk, (b, N, h, d), jnp.bfloat16) for kk in ks)
    m = jnp.arange(N)[None, None, None, :] < jnp.array([N, 600])[:, None, None, None]
    qsl, kvsl = jnp.array([N, 500]), jnp.array([650, N])
    kw = dict(is_causal=True, query_seq_lengths=qsl, key_value_seq_lengths=kvsl)
    ours = jax.jit(lambda a, b_, c, mm: jcm.mask_attention(a, b_, c, mm, **kw))(qx, kx, vx, m)
    full = (m & jnp.tril(jnp.ones((N, N), bool))[None, None]
            & (jnp.arange(N)[None, None, :, None] < qsl[:, None, None, None])
            & (jnp.arange(N)[None, None, None, :] < kvsl[:, None, None, None]))
    hi = reference_attention(qx, kx, vx, full, precision="high")
    lo = reference_attention(qx, kx, vx, full, precision="input")
    assert_within_policy(ours, hi[0], lo[0], "out")
