"""The CuTe backward's preprocess kernel (``kernels/cute/glue.py``, ``api.backward_prep``,
on with ``$JCOMPILEMASK_CUTE_BWD_PREP=1``): lse2, delta and the zeroed dQ accumulator in one
pass, against the three XLA passes it replaces (``cute_backward``'s ``stats``, which CI runs
on the CPU through every xla-backend gradient test: ``attention.xla.softmax_delta``), and
mask_attention's gradients through it against the dense oracle.

Compile tests need only nvidia-cutlass-dsl (CUTE_DSL_ARCH=sm_90a); run tests need an SM90
GPU and jax-tvm-ffi and skip elsewhere, saying why.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jcompilemask as jcm  # noqa: E402
from jcompilemask import backends  # noqa: E402
from jcompilemask.kernels.cute import api  # noqa: E402
from jcompilemask.spec import MaskSpec, Region, k, q, q_len  # noqa: E402
from gpu_cases import SPECS, check_attention, metadata  # noqa: E402

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")
_why = backends.get("cute").available()
needs_gpu = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")

# The residual mask whose short columns make the preprocess a large part of the step.
DILATED = MaskSpec([Region((0, q_len), (k <= q) & (k > q - 128) & ((q - k) % 2 == 0))])


def _spec(name):
    return (DILATED, None) if name == "dilated_window" else (
        SPECS[name], metadata(name, 2, 1000, np.random.default_rng(3)))


# (dtype, D, Dv, block_q): every backward tile config the registry serves (D 64's 128-query
# tiles, D 256's and 192 / 128's 64-query ones) and fp16.
CONFIGS = [("bfloat16", 128, 128, 64), ("float16", 128, 128, 64), ("bfloat16", 64, 64, 128),
           ("bfloat16", 256, 256, 64), ("bfloat16", 192, 128, 64), ("float16", 64, 64, 64)]


@needs_cutlass
@pytest.mark.parametrize("dtype,d,dv,bq", CONFIGS)
@pytest.mark.parametrize("with_dlse,zero_only", [(False, False), (True, False), (False, True)])
def test_backward_prep_compiles_for_sm90(dtype, d, dv, bq, with_dlse, zero_only):
    from jcompilemask.kernels.cute.glue import compile_backward_prep
    assert compile_backward_prep(dtype, d, dv, bq, with_dlse, "--enable-tvm-ffi",
                                 zero_only=zero_only) is not None


@needs_cutlass
def test_transpose_words_compiles_for_sm90():
    from jcompilemask.kernels.cute.glue import compile_transpose_words
    assert compile_transpose_words("--enable-tvm-ffi") is not None


def test_transpose_words_key_and_switch_rules(monkeypatch):
    assert api.TransposeWordsKey().target_name == "jcompilemask_cute_transpose_words"
    monkeypatch.delenv("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS", raising=False)
    assert api.transpose_words_on() is True            # the default (session 52)
    monkeypatch.setenv("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS", "0")
    assert api.transpose_words_on() is False
    with pytest.raises(ValueError, match="are not the uint32 rows"):
        api.transpose_words(jnp.zeros((2, 64, 3), jnp.uint32), 64, 100)
    # an empty batch never launches: XLA's pack (no GPU needed)
    assert api.transpose_words(jnp.zeros((0, 64, 2), jnp.uint32), 64, 64).shape == (0, 64, 2)


def test_backward_prep_key_rules():
    key = api.BackwardPrepKey("float16", 192, 128, 64, True)
    assert key.target_name == "jcompilemask_cute_bwd_prep_float16_d192x128_q64_dlse"
    assert api.BackwardPrepKey("float16", 64, 64, 128, False, True).target_name.endswith("_q128_z")
    with pytest.raises(ValueError, match="supports"):
        api.BackwardPrepKey("float32", 128, 128, 64, False)
    with pytest.raises(ValueError, match="block_q 64 or 128"):
        api.BackwardPrepKey("bfloat16", 128, 128, 32, False)
    with pytest.raises(ValueError, match="multiples of 8"):
        api.BackwardPrepKey("bfloat16", 128, 100, 64, False)


def test_backward_prep_switch_reads_its_three_modes(monkeypatch):
    monkeypatch.delenv("JCOMPILEMASK_CUTE_BWD_PREP", raising=False)
    assert api._bwd_prep_mode() is None
    for v, mode in (("0", None), ("1", "fused"), (" zero ", "zero")):
        monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_PREP", v)
        assert api._bwd_prep_mode() == mode
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_PREP", "yes")
    with pytest.raises(ValueError, match="must be 0, 1 or zero"):
        api._bwd_prep_mode()


@needs_gpu
@pytest.mark.parametrize("dtype,d,dv,bq", CONFIGS)
@pytest.mark.parametrize("nq", [1000, 1024])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_backward_prep_matches_the_xla_passes(dtype, d, dv, bq, nq, with_dlse):
    """lse2 bit for bit (+inf for rows that see nothing and past Nq), the accumulator all
    zeros, delta within float32 rounding of the XLA reduction (0 past Nq), and non-finite
    O / dO rows non-finite in delta as in XLA's."""
    b, hq = 2, 3
    ks = jax.random.split(jax.random.key(nq + d), 4)
    out = jax.random.normal(ks[0], (b, nq, hq, dv), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[1], (b, nq, hq, dv), jnp.float32).astype(dtype)
    lse = 3 * jax.random.normal(ks[2], (b, hq, nq), jnp.float32)
    lse = lse.at[0, 1, 5:9].set(-jnp.inf)                   # rows that see no key
    out = out.at[1, 7, 2, 3].set(jnp.nan).at[1, 11, 0, 0].set(jnp.inf)
    dlse = jax.random.normal(ks[3], (b, hq, nq), jnp.float32) if with_dlse else None
    lse2, delta, acc = jax.jit(lambda *a: api.backward_prep(*a, head_dim=d, block_q=bq))(
        out, do, lse, dlse)
    want_lse2, want_delta, _ = api.backward_stats(out, do, lse, dlse, head_dim=d, block_q=bq)
    tq = -(-nq // bq)
    assert acc.shape == (b, hq, tq, bq * d) and acc.dtype == jnp.float32
    assert not np.asarray(acc).any()
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(want_lse2))
    got, want = np.asarray(delta), np.asarray(want_delta)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    assert np.isnan(got[1, 2, 7]) and not np.isfinite(got[1, 0, 11])
    fin = np.isfinite(want)
    # A float32 sum of Dv products in another order: within Dv ulps of sum |o do| (and one
    # of |dlse| for the subtraction).
    pad = lambda x: np.pad(x, ((0, 0), (0, 0), (0, tq * bq - nq)))  # noqa: E731
    mag = pad(np.einsum("bqhd->bhq", np.abs(np.asarray(out, np.float32)
                                            * np.asarray(do, np.float32))))
    if with_dlse:
        mag = mag + pad(np.abs(np.asarray(dlse)))
    tol = 2 * dv * np.finfo(np.float32).eps * mag + 1e-6
    assert (np.abs(got - want)[fin] <= tol[fin]).all(), np.abs(got - want)[fin].max()
    assert not got[..., nq:].any()


def _grads(spec, md, n, dtype, d, hq, hkv, monkeypatch, prep):
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_PREP", "1" if prep else "0")
    ks = jax.random.split(jax.random.key(7), 5)
    mk = lambda kk, h: jax.random.normal(kk, (2, n, h, d), jnp.float32).astype(dtype)  # noqa: E731
    qx, kx, vx, do = mk(ks[0], hq), mk(ks[1], hkv), mk(ks[2], hkv), mk(ks[3], hq)
    dl = jax.random.normal(ks[4], (2, n, hq), jnp.float32)

    def loss(a, b_, c):
        o, lse = jcm.mask_attention(a, b_, c, spec, metadata=md, implementation="cute",
                                    return_residual=True)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(
            jnp.where(jnp.isfinite(lse), lse, 0.0) * dl)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qx, kx, vx)


@needs_gpu
@pytest.mark.parametrize("name,dtype,d,hq,hkv", [
    ("dilated_window", "bfloat16", 128, 4, 2), ("causal", "float16", 64, 4, 4),
    ("shared_prompt", "bfloat16", 256, 2, 1)])
def test_prep_gradients_meet_the_policy(name, dtype, d, hq, hkv, monkeypatch):
    """mask_attention's gradients with the preprocess kernel against the dense oracle."""
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_PREP", "1")
    n = 1000
    spec, md = _spec(name)
    check_attention(spec, md, 2, n, hq, hkv, d, dtype, "cute", forward=False)


@needs_gpu
@pytest.mark.parametrize("name,dtype,d", [("dilated_window", "bfloat16", 128),
                                          ("hstu", "float16", 128), ("clear", "bfloat16", 64)])
def test_prep_gives_the_xla_passes_gradients(name, dtype, d, monkeypatch):
    """With an lse cotangent too (delta less dlse): the kernel's gradients and the XLA
    passes' differ only by delta's rounding (a few bf16 / fp16 ulps at most)."""
    n = 1000
    spec, md = _spec(name)
    on = _grads(spec, md, n, dtype, d, 4, 2, monkeypatch, True)
    off = _grads(spec, md, n, dtype, d, 4, 2, monkeypatch, False)
    for a, b_, what in zip(on, off, "qkv"):
        a, b_ = np.asarray(a, np.float32), np.asarray(b_, np.float32)
        assert np.isfinite(a).all() and np.isfinite(b_).all(), what
        scale = np.abs(b_).max()
        assert np.abs(a - b_).max() <= 2e-2 * scale, (what, np.abs(a - b_).max(), scale)


@needs_gpu
@pytest.mark.parametrize("dtype,d,dv,bq", CONFIGS[:3])
def test_zero_only_prep_zeroes_the_accumulator(dtype, d, dv, bq):
    b, nq, hq = 2, 1000, 3
    out = jnp.ones((b, nq, hq, dv), dtype)
    lse = jnp.zeros((b, hq, nq), jnp.float32)
    acc = jax.jit(lambda o, l_: api.backward_prep(o, o, l_, head_dim=d, block_q=bq,
                                                  zero_only=True)[2])(out, lse)
    assert acc.shape == (b, hq, -(-nq // bq), bq * d) and not np.asarray(acc).any()


@needs_gpu
@pytest.mark.parametrize("name,dtype,d,hq,hkv", [
    ("dilated_window", "bfloat16", 128, 4, 2), ("causal", "float16", 64, 4, 4)])
def test_zero_only_prep_gradients_meet_the_policy(name, dtype, d, hq, hkv, monkeypatch):
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_PREP", "zero")
    spec, md = _spec(name)
    check_attention(spec, md, 2, 1000, hq, hkv, d, dtype, "cute", forward=False)


# -- the postprocess kernel: dQ from its accumulator ----------------------------------------
# (dtype, D, block_q): the dQ slot orders the backward configs produce (D 64 at 64 queries:
# one warpgroup; at 128: the warpgroups split the queries; D 128 / 192 / 256: they split D).
POST_CONFIGS = [("bfloat16", 128, 64), ("float16", 64, 128), ("bfloat16", 64, 64),
                ("bfloat16", 256, 64), ("float16", 192, 64)]


@needs_cutlass
@pytest.mark.parametrize("dtype,d,bq", POST_CONFIGS)
def test_backward_post_compiles_for_sm90(dtype, d, bq):
    from jcompilemask.kernels.cute.glue import compile_backward_post
    fn = compile_backward_post(dtype, d, bq, api.dq_warpgroups(d, block_q=bq),
                               api.dq_splits_queries(bq), 0.0883883461356163, "--enable-tvm-ffi")
    assert fn is not None


def test_backward_post_key_and_switch_rules(monkeypatch):
    key = api.BackwardPostKey("float16", 192, 64, 0.125)
    assert key.target_name == "jcompilemask_cute_bwd_post_float16_d192_q64_3fc0000000000000"
    with pytest.raises(ValueError, match="serves the backward's dQ tiles"):
        api.BackwardPostKey("bfloat16", 128, 128, 0.125)
    with pytest.raises(ValueError, match="supports"):
        api.BackwardPostKey("float32", 128, 64, 0.125)
    monkeypatch.delenv("JCOMPILEMASK_CUTE_BWD_POST", raising=False)
    assert api._bwd_post_on() is False
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_POST", "1")
    assert api._bwd_post_on() is True
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_POST", "on")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        api._bwd_post_on()
    with pytest.raises(ValueError, match="is not the float32 accumulator"):
        api.backward_post(jnp.zeros((1, 2, 3, 64 * 128)), 1000, 128, 64, 0.1, jnp.bfloat16)


@needs_gpu
@pytest.mark.parametrize("dtype,d,bq", POST_CONFIGS)
@pytest.mark.parametrize("nq", [1000, 1024])
def test_backward_post_matches_the_xla_pass(dtype, d, bq, nq):
    """The kernel's dQ is XLA's un-permute, scale and cast bit for bit, non-finite values
    included; rows past Nq are not written (the result has none)."""
    b, hq = 2, 3
    tq = -(-nq // bq)
    acc = 40 * jax.random.normal(jax.random.key(d + nq), (b, hq, tq, bq * d), jnp.float32)
    acc = acc.at[1, 2, 3, 17].set(jnp.nan).at[0, 0, 0, 5].set(jnp.inf).at[0, 1, 2, 9].set(-0.0)
    scale = 0.0883883461356163 * 4
    got = jax.jit(lambda a: api.backward_post(a, nq, d, bq, scale, dtype))(acc)
    want = api.backward_dq(acc, nq, d, bq, scale, dtype)           # XLA's pass
    assert got.shape == (b, nq, hq, d) and got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@needs_gpu
@pytest.mark.parametrize("name,dtype,d,hq,hkv", [
    ("dilated_window", "bfloat16", 128, 4, 2), ("causal", "float16", 64, 4, 4),
    ("hstu", "bfloat16", 256, 2, 1), ("clear", "bfloat16", 64, 2, 2)])
def test_post_gradients_meet_the_policy(name, dtype, d, hq, hkv, monkeypatch):
    """mask_attention's gradients with the postprocess kernel (and the preprocess kernel)
    against the dense oracle."""
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_POST", "1")
    monkeypatch.setenv("JCOMPILEMASK_CUTE_BWD_PREP", "1")
    spec, md = _spec(name)
    check_attention(spec, md, 2, 1000, hq, hkv, d, dtype, "cute", forward=False)


@needs_cutlass
@pytest.mark.parametrize("dtype,d,bq", POST_CONFIGS)
def test_post_slot_order_is_the_unpermute_order(dtype, d, bq):
    """The kernel's slot order (``glue.slot_position``, the same function it traces) places
    every float of a slot where ``api.dq_fragment_unpermute`` does (CPU)."""
    from jcompilemask.kernels.cute.glue import slot_position
    wgs, splits = api.dq_warpgroups(d, block_q=bq), api.dq_splits_queries(bq)
    groups = d // 8 if splits else d // wgs // 8
    slot = np.arange(bq * d, dtype=np.float32)
    f = np.arange(bq * d // 4)
    row, col = slot_position(f, groups, wgs, splits, d)
    tile = np.full((bq, d), -1.0, np.float32)
    for h in range(2):
        for p in range(2):
            tile[row + 8 * h, col + p] = slot[4 * f + 2 * h + p]
    want = np.asarray(api.dq_fragment_unpermute(slot.reshape(1, 1, 1, -1), bq, d, bq))[0, :, 0]
    np.testing.assert_array_equal(tile, want)
