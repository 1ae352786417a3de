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


# ------------------------------------------- the column pack in one kernel (glue.TransposeWords)
@needs_gpu
@pytest.mark.skipif(IMPL != "cute", reason="the CuTe column-pack kernel runs only on cute")
@pytest.mark.parametrize("lead,nr,nc", [((2, 1), 700, 700), ((3,), 256, 8192), ((1, 2), 33, 1000),
                                        ((2,), 1025, 40), ((1,), 1, 1), ((5, 3), 300, 257)])
def test_transpose_words_kernel_is_the_jnp_pack(lead, nr, nc):
    """The kernel's column words equal ``dense_runtime.transpose_words``'s bit for bit: ragged
    rows (a partial last 32-row block, a partial 256-row tile) and columns (a partial last
    word, a partial 8-word tile), several matrices, one row or column."""
    from jcompilemask.kernels.cute import api
    from jcompilemask.lower import dense_runtime as R
    m = np.random.default_rng(nr * 7 + nc).random(lead + (nr, nc)) < 0.4
    words = jax.jit(lambda x: R.pack_words(x, -1))(m)
    got = jax.jit(lambda w: api.transpose_words(w, nr, nc))(words)
    want = R.transpose_words(words, nr, nc)
    assert got.shape == want.shape == lead + (nc, -(-nr // 32)) and got.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(R.pack_words(np.swapaxes(m, -1, -2))))


@needs_gpu
@pytest.mark.skipif(IMPL != "cute", reason="the CuTe column-pack kernel runs only on cute")
def test_transpose_words_kernel_under_vmap():
    """Under ``vmap`` the mapped axis folds into the kernel's matrices (one launch), batched
    or not, nested or not."""
    from jcompilemask.kernels.cute import api
    from jcompilemask.lower import dense_runtime as R
    m = np.random.default_rng(1).random((3, 2, 300, 500)) < 0.5
    words = R.pack_words(m, -1)
    f = lambda w: api.transpose_words(w, 300, 500)                     # noqa: E731
    want = R.transpose_words(words, 300, 500)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(f))(words)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(jax.vmap(f)))(words)),
                                  np.asarray(want))
    one = jax.jit(jax.vmap(lambda _, w: f(w), in_axes=(0, None)))(jnp.arange(4), words[0])
    np.testing.assert_array_equal(np.asarray(one), np.broadcast_to(np.asarray(want[0]),
                                                                   (4,) + want.shape[1:]))


@needs_gpu
@pytest.mark.skipif(IMPL != "cute", reason="the CuTe column-pack kernel runs only on cute")
@pytest.mark.parametrize("case", ["packed_causal", "window_globals"])
def test_transpose_words_switch_gives_identical_results(case, monkeypatch):
    """``$JCOMPILEMASK_CUTE_TRANSPOSE_WORDS=1`` (the column pack in one kernel, the default) gives the
    same output, lse and gradients bit for bit as XLA's pack, at each tier on cute."""
    b, hq, hkv, d = 2, 4, 2, 128            # test_traced_dense_mask_on_cute's kernels
    m, _ = CASES[case](np.random.default_rng(11), b)
    m = np.ascontiguousarray(m[:, None])
    ks = jax.random.split(jax.random.key(9), 4)
    qx, kx, vx, do = (jax.random.normal(kk, (b, N, h, d), jnp.bfloat16)
                      for kk, h in zip(ks, (hq, hkv, hkv, hq)))

    def run():
        def loss(a, b_, c, mm):
            o, lse = jcm.mask_attention(a, b_, c, mm, return_residual=True)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), (o, lse)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(qx, kx, vx, m)
    monkeypatch.setenv("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS", "0")
    base = run()
    monkeypatch.setenv("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS", "1")
    got = run()
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)),
                                      np.asarray(y.astype(jnp.float32)))
