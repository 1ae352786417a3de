"""mask_attention with the xla backend against the dense reference (tolerance policy)."""
from __future__ import annotations

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.spec import MaskSpec, Region, Scalar, SegmentIds, k, q, q_len
from jcompilemask.testing import assert_within_policy, reference_attention

N = 40
TILES = dict(block_q=16, block_kv=8, bwd_block_q=8, bwd_block_kv=16)


def bhq_lse(res):
    """(out, lse) of ``return_residual=True`` with lse as [B, Hq, Nq] (the references')."""
    return res[0], jnp.swapaxes(res[1], 1, 2)


def metadata_for(name, b, n, rng):
    if name == "prefix_lm":
        return {"prefix_len": rng.integers(0, n + 1, b)}
    if name == "document":
        ids = np.sort(rng.integers(0, 6, (b, n)), axis=1)
        ids[:, n - rng.integers(0, 5):] = -1
        return {"segment_ids": ids}
    if name == "hstu":
        a = rng.integers(0, n // 2, b)
        g = rng.integers(1, 5, b)
        return {"context_len": a, "history_end": n - g * rng.integers(1, 4, b),
                "group_size": g}
    if name == "shared_prompt":
        p = rng.integers(1, n // 2, b)
        st_ = np.sort(rng.integers(0, n + 1, (b, 3)), axis=1)
        return {"prompt_len": p, "response_starts": np.maximum(st_, p[:, None])}
    if name == "clear":
        return {"text_len": rng.integers(0, 8, b), "image_len": rng.integers(0, n - 8, b)}
    return None


BUILTINS = {
    "causal": jcm.masks.causal(), "full": jcm.masks.full(),
    "sliding_window": jcm.masks.sliding_window(5, 2),
    "chunked_causal": jcm.masks.chunked_causal(7), "prefix_lm": jcm.masks.prefix_lm(),
    "document": jcm.masks.document(), "hstu": jcm.masks.hstu(),
    "shared_prompt": jcm.masks.shared_prompt(3), "clear": jcm.masks.clear(6, 2),
}


def _inputs(key, b, nq, nk, hq, hkv, d, dv, dtype):
    ks = jax.random.split(key, 4)
    qx = jax.random.normal(ks[0], (b, nq, hq, d), jnp.float32).astype(dtype)
    kx = jax.random.normal(ks[1], (b, nk, hkv, d), jnp.float32).astype(dtype)
    vx = jax.random.normal(ks[2], (b, nk, hkv, dv), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, nq, hq, dv), jnp.float32).astype(dtype)
    return qx, kx, vx, do


@functools.lru_cache(maxsize=None)
def _reference_fn(scale, softcap):
    """Jitted dense references, forward and gradients, at both precisions of the policy.

    Compiled once per (shapes, dtype, scale, softcap) and shared by every test: the mask
    is an argument, so tests with the same shapes but different masks reuse it."""
    def f(mask, qx, kx, vx, do):
        res = {}
        for prec in ("high", "input"):
            # "high" differentiates at float32 copies of the inputs (testing.py)
            up = (lambda x: x.astype(jnp.float32)) if prec == "high" else (lambda x: x)
            (out, lse), vjp = jax.vjp(
                lambda a, b_, c: reference_attention(a, b_, c, mask, scale=scale,
                                                     softcap=softcap, precision=prec),
                up(qx), up(kx), up(vx))
            res[prec] = out, lse, vjp((do.astype(out.dtype), jnp.zeros_like(lse)))
        return res
    return jax.jit(f)


def check_against_reference(spec_or_dense, desc, qx, kx, vx, do, *, softcap=None,
                            scale=None, grads=True, ours=None):
    """Forward (out, lse) and, with ``grads``, dq, dk, dv of ``sum(out * do)`` under the
    tolerance policy. Ours runs as one jitted forward + vjp (one compilation per test);
    the cotangent of out is ``do`` and that of lse zero, as for ``jax.grad`` of the loss.
    ``ours``: that program's (out, lse, (dq, dk, dv)) where the test already ran it (the
    same program compiled again would give the same arrays)."""
    dense = desc.as_dense() if not isinstance(spec_or_dense, jax.Array) else spec_or_dense

    def ours_fn(a, b_, c):
        return bhq_lse(jcm.mask_attention(a, b_, c, desc, scale=scale, logits_soft_cap=softcap,
                                          return_residual=True))

    @jax.jit
    def ours_and_grads(a, b_, c):
        (out, lse), vjp = jax.vjp(ours_fn, a, b_, c)
        return out, lse, (vjp((do, jnp.zeros_like(lse))) if grads else None)

    out, lse, g = ours_and_grads(qx, kx, vx) if ours is None else ours
    ref = _reference_fn(scale, softcap)(jnp.asarray(dense), qx, kx, vx, do)
    (hi_out, hi_lse, g_hi), (lo_out, lo_lse, g_lo) = ref["high"], ref["input"]
    assert out.dtype == qx.dtype and lse.dtype == jnp.float32
    assert_within_policy(out, hi_out, lo_out, "out")
    assert_within_policy(lse, hi_lse, lo_lse, "lse")
    if not grads:
        return
    for name, a, h, lo in zip(("dq", "dk", "dv"), g, g_hi, g_lo):
        assert a.dtype == qx.dtype
        assert_within_policy(a, h, lo, name)


@pytest.mark.parametrize("name", sorted(BUILTINS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_builtin_masks(name, dtype):
    rng = np.random.default_rng(zlib.crc32(name.encode()))   # stable across processes
    b = 2
    spec = BUILTINS[name]
    desc = jcm.compile(spec).instantiate(metadata_for(name, b, N, rng), N, N, **TILES)
    qx, kx, vx, do = _inputs(jax.random.key(1), b, N, N, 4, 2, 16, 16, dtype)
    check_against_reference(spec, desc, qx, kx, vx, do)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_gqa_softcap(hq, hkv, softcap):
    rng = np.random.default_rng(3)
    spec = BUILTINS["hstu"]
    desc = jcm.compile(spec).instantiate(metadata_for("hstu", 2, N, rng), N, N, **TILES)
    qx, kx, vx, do = _inputs(jax.random.key(2), 2, N, N, hq, hkv, 16, 24, jnp.float32)
    check_against_reference(spec, desc, qx * 3, kx, vx, do, softcap=softcap)


def test_float16_and_custom_scale():
    spec = BUILTINS["sliding_window"]
    desc = jcm.compile(spec).instantiate(None, N, N, **TILES)
    qx, kx, vx, do = _inputs(jax.random.key(4), 1, N, N, 2, 2, 32, 32, jnp.float16)
    check_against_reference(spec, desc, qx, kx, vx, do, scale=0.3)


def test_cross_lengths_and_head_mask():
    # q_len != kv_len, a per-head mask (uses h), batch broadcast of the mask.
    spec = MaskSpec([Region((0, q_len), (k <= q + jcm.spec.h * 3))], num_heads=4)
    desc = jcm.compile(spec).instantiate(None, 24, 37, **TILES)
    assert desc.mask_heads == 4 and desc.batch == 1
    qx, kx, vx, do = _inputs(jax.random.key(5), 3, 24, 37, 4, 2, 16, 16, jnp.float32)
    check_against_reference(spec, desc, qx, kx, vx, do)


def test_fully_masked_rows_give_zero_and_no_nan():
    p = Scalar("start", max=q_len)
    spec = MaskSpec([Region((p, q_len), k <= q)])          # rows < start see nothing
    md = {"start": np.array([5, 40])}
    desc = jcm.compile(spec).instantiate(md, N, N, **TILES)
    qx, kx, vx, do = _inputs(jax.random.key(6), 2, N, N, 2, 2, 16, 16, jnp.bfloat16)

    @jax.jit   # one compiled program (eagerly, each op of the xla backend compiles alone)
    def out_lse_grads(qx, kx, vx):
        out, lse = bhq_lse(jcm.mask_attention(qx, kx, vx, desc, return_residual=True))
        grads = jax.grad(lambda a, b_, c: jnp.sum(
            jcm.mask_attention(a, b_, c, desc).astype(jnp.float32)), argnums=(0, 1, 2))(
                qx, kx, vx)
        return out, lse, grads

    out, lse, grads = out_lse_grads(qx, kx, vx)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert (np.asarray(out[0, :5], np.float32) == 0).all()
    assert np.isneginf(np.asarray(lse[0, :, :5])).all()
    assert (np.asarray(out[1], np.float32) == 0).all()
    for g in grads:
        assert not np.isnan(np.asarray(g, np.float32)).any()
    assert (np.asarray(grads[0][0, :5], np.float32) == 0).all()
    assert all((np.asarray(g[1], np.float32) == 0).all() for g in grads)
    check_against_reference(spec, desc, qx, kx, vx, do)


def test_lse_is_differentiable():
    spec = BUILTINS["causal"]
    desc = jcm.compile(spec).instantiate(None, N, N, **TILES)
    qx, kx, vx, _ = _inputs(jax.random.key(7), 1, N, N, 2, 2, 8, 8, jnp.float32)
    f = lambda a: jnp.sum(jcm.mask_attention(a, kx, vx, desc, return_residual=True)[1])
    r = lambda a: jnp.sum(reference_attention(a, kx, vx, desc.as_dense())[1])
    # jitted: eagerly each op of the forward and backward compiles on its own
    np.testing.assert_allclose(jax.jit(jax.grad(f))(qx), jax.jit(jax.grad(r))(qx), atol=2e-5)


def test_differentiating_the_gradient_says_it_is_unsupported():
    """First-order reverse mode works; a second derivative (Hessian-vector product, gradient
    penalty, forward-over-reverse) raises one clear NotImplementedError, not a backend's
    internal error; forward mode is JAX's custom_vjp TypeError."""
    q = jax.random.normal(jax.random.key(0), (1, 64, 2, 32))
    bias = jnp.zeros((1, 2, 64, 64))

    def f(q, **kw):
        return jnp.sum(jcm.mask_attention(q, q, q, jcm.masks.causal(), **kw))

    for kw in ({}, {"bias": bias}):
        g = jax.grad(lambda x: f(x, **kw))(q)
        assert bool(jnp.all(jnp.isfinite(g)))
        penalty = lambda x: jnp.sum(jax.grad(lambda y: f(y, **kw))(x) ** 2)  # noqa: E731
        with pytest.raises(NotImplementedError, match="first-order reverse mode only.*"
                           "jax.nn.dot_product_attention"):
            jax.grad(penalty)(q)
        with pytest.raises(NotImplementedError, match="first-order reverse mode only"):
            jax.jvp(jax.grad(lambda y: f(y, **kw)), (q,), (q,))
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jvp(f, (q,), (q,))


def test_spec_with_metadata_under_jit_vmap_and_retrace():
    spec = BUILTINS["prefix_lm"]
    qx, kx, vx, _ = _inputs(jax.random.key(8), 2, N, N, 2, 2, 8, 8, jnp.float32)
    traces = []

    @jax.jit
    def f(a, b_, c, p):
        traces.append(1)
        return jcm.mask_attention(a, b_, c, spec, metadata={"prefix_len": p})

    # the reference and the per-slice calls jitted, each compiled once (eagerly every op
    # compiles on its own)
    reference = jax.jit(lambda m: reference_attention(qx, kx, vx, m)[0])
    for pv in ([3, 9], [20, 1]):
        p = jnp.array(pv)
        ref = reference(spec.as_dense({"prefix_len": p}, N, N))
        np.testing.assert_allclose(f(qx, kx, vx, p), ref, atol=1e-5)
    assert len(traces) == 1
    # vmap over an extra leading axis of the inputs
    desc = jcm.compile(spec).instantiate({"prefix_len": np.array([4, 4])}, N, N, **TILES)
    stacked = jnp.stack([qx, qx * 0.5])
    out = jax.jit(jax.vmap(lambda a: jcm.mask_attention(a, kx, vx, desc)))(stacked)
    one = jax.jit(lambda a: jcm.mask_attention(a, kx, vx, desc))
    for i in range(2):
        np.testing.assert_allclose(out[i], one(stacked[i]), atol=1e-6)


def test_x64_enabled():
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        spec = BUILTINS["hstu"]
        rng = np.random.default_rng(9)
        desc = jcm.compile(spec).instantiate(metadata_for("hstu", 2, N, rng), N, N, **TILES)
        assert desc.fwd_intervals.dtype == jnp.int32
        qx, kx, vx, do = _inputs(jax.random.key(9), 2, N, N, 2, 2, 8, 8, jnp.float32)
        check_against_reference(spec, desc, qx, kx, vx, do)
    finally:
        jax.config.update("jax_enable_x64", prev)


# -- hypothesis: random specs, fallback regions included --------------------------------
def _random_spec(draw):
    s = Scalar("s", max=q_len)
    seg = SegmentIds("seg")
    atoms = [k <= q, k >= q - 4, k < s, k >= seg.start(q), k < seg.end(q),
             k >= q // 5 * 5, k // 3 == q // 3, k % 4 != 1, k * 2 <= q + 3]
    def rule():
        terms = [atoms[i] for i in draw(st.lists(st.integers(0, len(atoms) - 1),
                                                 min_size=1, max_size=3))]
        r = terms[0]
        for t in terms[1:]:
            r = (r & t) if draw(st.booleans()) else (r | t)
        return r
    cut = draw(st.sampled_from([s, 10, q_len]))
    regions = [Region((0, cut), rule())]
    if cut is not q_len and draw(st.booleans()):      # (q_len, q_len) is provably empty
        regions.append(Region((cut, q_len), rule()))
    return MaskSpec(regions)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_random_specs(data):
    spec = data.draw(st.builds(lambda: None).flatmap(lambda _: st.composite(
        lambda draw: _random_spec(draw))()))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    b, n = 2, 29
    md = {}
    if "s" in spec.metadata:
        md["s"] = rng.integers(0, n + 1, b)
    if "seg" in spec.metadata:
        md["seg"] = np.sort(rng.integers(-1, 4, (b, n)), axis=1)
    if not md:
        md = None
    cm = jcm.compile(spec)
    desc = cm.instantiate(md, n, n, block_q=8, block_kv=8, bwd_block_q=4, bwd_block_kv=8)
    dense = desc.as_dense()         # once: it is also check_against_reference's reference mask
    np.testing.assert_array_equal(dense, jnp.broadcast_to(
        spec.as_dense(md, n, n), dense.shape))
    qx, kx, vx, do = _inputs(jax.random.key(10), b, n, n, 2, 1, 8, 8, jnp.float32)
    check_against_reference(dense, desc, qx, kx, vx, do)


# -- errors -----------------------------------------------------------------------------
def test_bad_inputs_raise_clearly():
    desc = jcm.compile(BUILTINS["causal"]).instantiate(None, N, N, **TILES)
    qx, kx, vx, _ = _inputs(jax.random.key(11), 1, N, N, 4, 2, 8, 8, jnp.float32)
    with pytest.raises(ValueError, match="rank 4"):
        jcm.mask_attention(qx[0], kx, vx, desc)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        jcm.mask_attention(qx[:, :, :3], kx, vx, desc)
    with pytest.raises(ValueError, match="head_dim differ"):
        jcm.mask_attention(qx[..., :4], kx, vx, desc)
    with pytest.raises(TypeError, match="share a dtype"):
        jcm.mask_attention(qx.astype(jnp.bfloat16), kx, vx, desc)
    with pytest.raises(TypeError, match="dtype must be"):
        jcm.mask_attention(qx.astype(jnp.int32), kx.astype(jnp.int32), vx.astype(jnp.int32), desc)
    with pytest.raises(ValueError, match="built for q_len=40"):
        jcm.mask_attention(qx[:, :20], kx[:, :20], vx[:, :20], desc)
    with pytest.raises(ValueError, match="pass metadata"):
        jcm.mask_attention(qx, kx, vx, BUILTINS["prefix_lm"])
    with pytest.raises(ValueError, match="mask has 3 heads"):
        spec = MaskSpec([Region((0, q_len), k <= q + jcm.spec.h)], num_heads=3)
        jcm.mask_attention(qx, kx, vx, jcm.compile(spec).instantiate(None, N, N))
    with pytest.raises(ValueError, match="batch 3"):
        d3 = jcm.compile(BUILTINS["prefix_lm"]).instantiate({"prefix_len": np.ones(3, int)}, N, N)
        jcm.mask_attention(jnp.concatenate([qx, qx]), jnp.concatenate([kx, kx]),
                           jnp.concatenate([vx, vx]), d3)
    with pytest.raises(TypeError, match="mask array must be boolean"):
        jcm.mask_attention(qx, kx, vx, np.ones((N, N), np.float32))
    with pytest.raises(ValueError, match="unknown implementation"):
        jcm.mask_attention(qx, kx, vx, desc, implementation="nope")


def test_backend_tile_mismatch_and_explain():
    fixed = jcm.TileConfig(64, 64, 64, 64)
    fake = backends.Backend(
        name="fixedtiles", priority=-1, tiles=lambda call: fixed, available=lambda: None,
        supports=lambda call: None, forward=backends.get("xla").forward,
        backward=backends.get("xla").backward)
    backends.register(fake)
    try:
        desc = jcm.compile(BUILTINS["causal"]).instantiate(None, N, N, **TILES)
        qx, kx, vx, _ = _inputs(jax.random.key(12), 1, N, N, 2, 2, 8, 8, jnp.float32)
        with pytest.raises(backends.BackendUnavailable, match="built for tiles"):
            jcm.mask_attention(qx, kx, vx, desc, implementation="fixedtiles")
        out = jcm.mask_attention(qx, kx, vx, BUILTINS["causal"], implementation="fixedtiles")
        assert out.shape == qx.shape
        text = backends.explain()
        assert "xla: available" in text and "cute: skipped" in text
    finally:
        backends._REGISTRY.pop("fixedtiles")


@pytest.mark.parametrize("name", ["hstu", "clear", "document"])
def test_batched_tile_loop_matches(name, monkeypatch):
    """The GPU form of the xla backend (outer tiles side by side, lax.map batch_size):
    same results as the sequential form, for forward and all three gradients, with a
    batch that does not divide the tile count and tiles of very different lengths."""
    from jcompilemask.attention import xla
    rng = np.random.default_rng(11)
    desc = jcm.compile(BUILTINS[name]).instantiate(metadata_for(name, 2, N, rng), N, N, **TILES)
    qx, kx, vx, do = _inputs(jax.random.key(12), 2, N, N, 4, 2, 16, 16, jnp.float32)

    def run():   # forward and gradients of sum(out * do) in one compilation
        f = lambda a, b_, c: bhq_lse(jcm.mask_attention(a, b_, c, desc, return_residual=True))  # noqa: E731

        @jax.jit
        def fwd_bwd(a, b_, c):
            (out, lse), vjp = jax.vjp(f, a, b_, c)
            return out, lse, vjp((do, jnp.zeros_like(lse)))
        return fwd_bwd(qx, kx, vx)

    monkeypatch.setenv("JCOMPILEMASK_XLA_TILE_BATCH", "1")
    seq = run()
    monkeypatch.setenv("JCOMPILEMASK_XLA_TILE_BATCH", "2")
    assert xla.tile_batch(3, 1) == 2
    bat = run()
    for a, b_ in zip(jax.tree.leaves(seq), jax.tree.leaves(bat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-6)
    # `bat` is check_against_reference's own program (forward + vjp of the same call,
    # same cotangents, same tile batch): checked as it is rather than compiled again
    check_against_reference(BUILTINS[name], desc, qx, kx, vx, do, ours=bat)
    monkeypatch.setenv("JCOMPILEMASK_XLA_TILE_BATCH", "x")
    with pytest.raises(ValueError, match="JCOMPILEMASK_XLA_TILE_BATCH"):
        xla.tile_batch(3, 1)


def test_shard_map_data_parallel():
    """Inside jax.shard_map (data parallel, metadata sharded with the batch) forward and
    gradients equal the unsharded call; a subprocess, since it needs 4 host devices."""
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "scripts", "shard_map_check.py")
    res = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "OK 4" in res.stdout, res.stderr[-3000:]
