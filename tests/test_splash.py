"""The SplashAttention porting layer: mask conversion and splash numerics.

Two halves: (1) every splash mask class, ours and JAX's own objects, converts to a
jcompilemask mask whose dense view (MaskSpec oracle, and the descriptor's forward and
backward interval views) equals the splash mask's own ``mask[...]``; (2) kernel calls
(MHA, GQA, MQA, segment ids, soft cap, residuals, sinks, gradients) match a float32
dense reference written like splash's ``attention_reference``: raw q.k (no scaling),
soft cap on the raw logits, masked logits replaced by splash's mask value.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import jax
import jax.numpy as jnp

import jcompilemask as jcm
from jcompilemask import splash
from jcompilemask.lower.dense import DenseMask
from jcompilemask.splash.convert import dense_view, jax_mask_module, to_jcm

JM = jax_mask_module()
needs_jax_splash = pytest.mark.skipif(JM is None, reason="JAX's splash mask module does "
                                      "not import here")
MODULES = [pytest.param(splash, id="ours"),
           pytest.param(JM, id="jax", marks=needs_jax_splash)]

NQ, NK = 24, 32
TILES = dict(block_q=8, block_kv=8, bwd_block_q=8, bwd_block_kv=16)


def _rand_bool(shape, seed, p=0.6):
    return np.random.default_rng(seed).random(shape) < p


def mask_cases(M, s=(NQ, NK)):
    """name -> (2-D splash mask, whether it must convert to a MaskSpec)."""
    return {
        "full": (M.FullMask(s), True),
        "causal": (M.CausalMask(s), True),
        "causal_offset": (M.CausalMask(s, offset=8), True),
        "causal_negative_offset": (M.CausalMask(s, offset=-3), True),
        "local": (M.LocalMask(s, (4, 2), 0), True),
        "local_offset_left_only": (M.LocalMask(s, (3, None), 8), True),
        "local_right_only": (M.LocalMask(s, (None, 1), -2), True),
        "local_unbounded": (M.LocalMask(s, (None, None), 0), True),
        "chunked": (M.ChunkedCausalMask(s, 5), True),
        "numpy": (M.NumpyMask(_rand_bool(s, 0)), False),
        "and": (M.LogicalAnd(M.CausalMask(s), M.LocalMask(s, (4, 0), 0)), True),
        "or": (M.LogicalOr(M.ChunkedCausalMask(s, 8), M.LocalMask(s, (2, 2), 0)), True),
        "operators": (M.CausalMask(s, offset=2) & (M.LocalMask(s, (1, 1), 0)
                                                   | M.FullMask(s)), True),
        "and_numpy": (M.LogicalAnd(M.CausalMask(s), M.NumpyMask(_rand_bool(s, 1))), False),
    }


def _views(converted, shape):
    """The converted mask's dense views: oracle, fwd and bwd descriptor views [Hm, Nq, Nk]."""
    cm = jcm.compile(converted)
    desc = cm.instantiate(None, shape[0], shape[1], **TILES)
    return (dense_view(converted, shape), np.asarray(desc.as_dense("fwd")[0]),
            np.asarray(desc.as_dense("bwd")[0]))


# ---------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("M", MODULES)
@pytest.mark.parametrize("name", list(mask_cases(splash)))
def test_2d_mask_converts_exactly(M, name):
    mask, structured = mask_cases(M)[name]
    want = np.asarray(mask[:, :])
    conv = to_jcm(mask)
    assert isinstance(conv, jcm.MaskSpec) == structured, conv
    for view in _views(conv, (NQ, NK)):
        assert view.shape == (1, NQ, NK)
        np.testing.assert_array_equal(view[0], want)


@pytest.mark.parametrize("M", MODULES)
def test_multihead_mask_converts_exactly(M):
    s = (NQ, NK)
    mh = M.MultiHeadMask([M.CausalMask(s), M.CausalMask(s), M.LocalMask(s, (3, 3), 0),
                          M.ChunkedCausalMask(s, 6), M.CausalMask(s)])
    conv = to_jcm(mh)
    assert isinstance(conv, jcm.MaskSpec) and conv.mask_heads == 5
    assert not jcm.compile(conv).fallback_regions
    want = np.asarray(mh[:, :, :])
    for view in _views(conv, s):
        np.testing.assert_array_equal(view, want)


@pytest.mark.parametrize("M", MODULES)
def test_multihead_equal_heads_broadcast(M):
    s = (NQ, NK)
    conv = to_jcm(M.MultiHeadMask([M.LocalMask(s, (2, 0), 0)] * 4))
    assert isinstance(conv, jcm.MaskSpec) and conv.mask_heads == 1
    np.testing.assert_array_equal(dense_view(conv, s)[0],
                                  M.LocalMask(s, (2, 0), 0)[:, :])


@pytest.mark.parametrize("M", MODULES)
def test_multihead_with_dense_head_goes_dense(M):
    s = (NQ, NK)
    mh = M.MultiHeadMask([M.CausalMask(s), M.NumpyMask(_rand_bool(s, 3)),
                          M.CausalMask(s)])
    conv = to_jcm(mh)
    assert isinstance(conv, DenseMask) and conv.mask_heads == 3
    want = np.asarray(mh[:, :, :])
    for view in _views(conv, s):
        np.testing.assert_array_equal(view, want)


def test_numpy_array_mask_and_errors():
    arr = _rand_bool((2, NQ, NK), 4)
    conv = to_jcm(arr)
    assert isinstance(conv, DenseMask)
    np.testing.assert_array_equal(dense_view(conv, (NQ, NK)), arr)
    with pytest.raises(ValueError, match="boolean"):
        to_jcm(arr.astype(np.int32))
    with pytest.raises(TypeError, match="not a splash mask"):
        to_jcm(object())
    with pytest.raises(NotImplementedError, match="truth value"):
        bool(splash.CausalMask((4, 4)))
    with pytest.raises(ValueError, match="same shape"):
        splash.CausalMask((4, 4)) & splash.CausalMask((4, 8))


@st.composite
def structured_masks(draw, shape, depth=2):
    kind = draw(st.sampled_from(["full", "causal", "local", "chunked"]
                                + (["and", "or"] if depth > 0 else [])))
    if kind == "full":
        return splash.FullMask(shape)
    if kind == "causal":
        return splash.CausalMask(shape, offset=draw(st.integers(-4, 12)))
    if kind == "local":
        side = st.one_of(st.none(), st.integers(0, 6))
        return splash.LocalMask(shape, (draw(side), draw(side)), draw(st.integers(-4, 8)))
    if kind == "chunked":
        return splash.ChunkedCausalMask(shape, draw(st.integers(1, 9)))
    a = draw(structured_masks(shape, depth - 1))
    b = draw(structured_masks(shape, depth - 1))
    return (a & b) if kind == "and" else (a | b)


@given(st.data())
def test_random_structured_masks_convert_exactly(data):
    # The rule of every And/Or tree of structured masks equals the splash mask; that the
    # rules lower exactly is checked above per class and by the lowering's own tests.
    shape = data.draw(st.sampled_from([(12, 16), (16, 12), (1, 5), (7, 7)]))
    mask = data.draw(structured_masks(shape))
    conv = to_jcm(mask)
    assert isinstance(conv, jcm.MaskSpec)
    np.testing.assert_array_equal(dense_view(conv, shape)[0], np.asarray(mask[:, :]))


# ---------------------------------------------------------------------------------------
# Kernel numerics
# ---------------------------------------------------------------------------------------
def reference(mask3, q, k, v, segment_ids=None, cap=None, sinks=None, is_mqa=False):
    """splash's attention_reference, float32, all heads: (out [H,Nq,Dv], lse [H,Nq])."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    h = q.shape[0]
    if is_mqa:
        k, v = k[None], v[None]
    k = jnp.repeat(k, h // k.shape[0], axis=0)
    v = jnp.repeat(v, h // v.shape[0], axis=0)
    logits = jnp.einsum("hsd,htd->hst", q, k, precision="highest")
    mask = jnp.broadcast_to(jnp.asarray(mask3), logits.shape)
    if segment_ids is not None:
        mask = mask & (segment_ids.q[:, None] == segment_ids.kv[None, :])[None]
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    logits = jnp.where(mask, logits, splash.DEFAULT_MASK_VALUE)
    m = logits.max(-1)
    if sinks is not None:
        m = jnp.maximum(m, sinks[:, None])
    p = jnp.exp(logits - m[..., None])
    l = p.sum(-1) + (0 if sinks is None else jnp.exp(sinks[:, None] - m))
    out = jnp.einsum("hst,htd->hsd", p / l[..., None], v, precision="highest")
    return out, m + jnp.log(l)


def qkv(h=4, hkv=None, nq=32, nk=32, d=8, seed=0, is_mqa=False):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (h, nq, d))
    kv_shape = (nk, d) if is_mqa else ((hkv or h), nk, d)
    return q, jax.random.normal(ks[1], kv_shape), jax.random.normal(ks[2], kv_shape)


def _close(a, b, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=2e-5)


def _heads_mask(M, n=32, h=4):
    s = (n, n)
    return M.MultiHeadMask([M.CausalMask(s), M.LocalMask(s, (5, 0), 0),
                            M.ChunkedCausalMask(s, 8), M.CausalMask(s, offset=3)][:h])


@pytest.mark.parametrize("M", MODULES)
def test_mha_softcap_residuals(M):
    mask = _heads_mask(M)
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, save_residuals=True,
                                    attn_logits_soft_cap=3.0)
    q, k, v = qkv(seed=1)
    q = q * 2.0                                   # logits beyond the cap
    out, (lse,) = jax.jit(kernel)(q, k, v)
    ref_out, ref_lse = reference(mask[:, :, :], q, k, v, cap=3.0)
    _close(out, ref_out)
    _close(lse, ref_lse)
    assert lse.shape == (4, 32) and lse.dtype == jnp.float32


def test_matches_jax_own_reference():
    sk = pytest.importorskip(
        "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel")
    mask = _heads_mask(JM)
    ref = sk.make_masked_mha_reference(mask)
    q, k, v = qkv(seed=2, hkv=2)
    seg_ids = jnp.repeat(jnp.arange(2), 16)
    kernel = splash.make_splash_mha_single_device(mask, save_residuals=True,
                                                  attn_logits_soft_cap=4.0)
    out, (lse,) = jax.jit(kernel)(q, k, v, splash.SegmentIds(seg_ids, seg_ids))
    ref_out, (ref_lse,) = ref(q, k, v, sk.SegmentIds(seg_ids, seg_ids), save_residuals=True,
                              attn_logits_soft_cap=4.0)
    _close(out, ref_out)
    _close(lse, ref_lse)


def test_gqa_and_mqa():
    mask = _heads_mask(splash)
    q, k, v = qkv(seed=3, hkv=2)
    out = jax.jit(splash.make_splash_mha_single_device(mask))(q, k, v)
    _close(out, reference(mask[:, :, :], q, k, v)[0])
    q, k, v = qkv(seed=4, is_mqa=True)
    out = jax.jit(splash.make_splash_mqa_single_device(mask))(q, k, v)
    _close(out, reference(mask[:, :, :], q, k, v, is_mqa=True)[0])


def test_numpy_mask_array_and_bf16():
    rng = np.random.default_rng(5)                       # blocky: a few runs per row
    arr = np.kron(rng.random((4, 4, 4)) < 0.5, np.ones((1, 8, 8), bool))
    arr[:, np.arange(32), np.arange(32)] = True          # no empty rows
    kernel = splash.make_splash_mha_single_device(arr)
    q, k, v = qkv(seed=5)
    out = jax.jit(kernel)(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert out.dtype == jnp.bfloat16
    ref = reference(arr, *(x.astype(jnp.bfloat16) for x in (q, k, v)))[0]
    _close(out.astype(jnp.float32), ref, atol=3e-2)


def _packed(nq):
    return jnp.asarray(np.repeat(np.arange(3), [nq // 2, nq // 4, nq - nq // 2 - nq // 4]))


def test_segment_ids_contiguous_eager_and_jit():
    mask = _heads_mask(splash)
    kernel = splash.make_splash_mha_single_device(mask, attn_logits_soft_cap=5.0)
    q, k, v = qkv(seed=6)
    seg = splash.SegmentIds(_packed(32), _packed(32))
    ref = reference(mask[:, :, :], q, k, v, seg, cap=5.0)[0]
    _close(kernel(q, k, v, seg), ref)
    _close(jax.jit(kernel)(q, k, v, seg), ref)


def test_segment_ids_noncontiguous():
    """Ids that repeat in separate stretches: exact eagerly and with exact_segment_ids;
    NaN (never a wrong value) on the fast path inside jit, only for the affected rows."""
    mask = splash.MultiHeadMask([splash.FullMask((32, 32))] * 2)
    ids = jnp.asarray(np.array([0] * 8 + [1] * 8 + [0] * 8 + [2] * 8))
    seg = splash.SegmentIds(ids, ids)
    q, k, v = qkv(h=2, seed=7)
    ref = reference(mask[:, :, :], q, k, v, seg)[0]
    _close(splash.make_splash_mha_single_device(mask)(q, k, v, seg), ref)
    exact = splash.make_splash_mha_single_device(mask, exact_segment_ids=True)
    _close(jax.jit(exact)(q, k, v, seg), ref)
    fast = jax.jit(splash.make_splash_mha_single_device(mask))(q, k, v, seg)
    bad = np.asarray(ids == 0)
    assert np.isnan(np.asarray(fast)[:, bad]).all()
    _close(np.asarray(fast)[:, ~bad], np.asarray(ref)[:, ~bad])


def test_segment_ids_cross_lengths_and_dense_mask():
    """q and kv ids differ (q_seq_len 24, kv_seq_len 32), and a NumpyMask with segments."""
    rng = np.random.default_rng(8)
    arr = rng.random((24, 32)) < 0.5
    arr[:, :2] = True
    mask = splash.MultiHeadMask([splash.NumpyMask(arr), splash.CausalMask((24, 32), 8)])
    q_ids = jnp.asarray(np.repeat([0, 1, 2], 8))
    kv_ids = jnp.asarray(np.repeat([0, 1, 2, 3], 8))
    seg = splash.SegmentIds(q_ids, kv_ids)
    q, k, v = qkv(h=2, nq=24, nk=32, seed=8)
    ref_out, ref_lse = reference(mask[:, :, :], q, k, v, seg)
    visible = np.asarray((mask[:, :, :] & (q_ids[:, None] == kv_ids[None])[None]).any(-1))
    kernel = splash.make_splash_mha_single_device(mask, save_residuals=True)
    for fn in (jax.jit(kernel),):
        out, (lse,) = fn(q, k, v, seg)
        _close(np.asarray(out)[visible], np.asarray(ref_out)[visible])
        _close(np.asarray(lse)[visible], np.asarray(ref_lse)[visible])
        # A row that sees nothing returns 0 and lse -inf (splash leaves it undefined).
        assert np.all(np.asarray(out)[~visible] == 0)
        assert np.all(np.isneginf(np.asarray(lse)[~visible]))


def test_sinks():
    mask = _heads_mask(splash)
    kernel = splash.make_splash_mha_single_device(mask, save_residuals=True)
    q, k, v = qkv(seed=9)
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    out, (lse,) = jax.jit(kernel)(q, k, v, None, sinks)
    ref_out, ref_lse = reference(mask[:, :, :], q, k, v, sinks=sinks)
    _close(out, ref_out)
    _close(lse, ref_lse)


def test_vmap_batch_and_gradients():
    mask = _heads_mask(splash)
    kernel = splash.make_splash_mha_single_device(mask, attn_logits_soft_cap=4.0)
    b = 2
    ks = jax.random.split(jax.random.key(10), 4)
    q, k, v = (jax.random.normal(x, (b, 4, 32, 8)) for x in ks[:3])
    w = jax.random.normal(ks[3], (b, 4, 32, 8))
    ids = jnp.stack([_packed(32), jnp.repeat(jnp.arange(4), 8)])
    dense = mask[:, :, :]

    def ours(q, k, v):
        seg = splash.SegmentIds(ids, ids)
        return jnp.sum(jax.vmap(kernel)(q, k, v, seg) * w)

    def ref(q, k, v):
        fn = lambda q, k, v, i: reference(dense, q, k, v, splash.SegmentIds(i, i), cap=4.0)[0]
        return jnp.sum(jax.vmap(fn)(q, k, v, ids) * w)

    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(ref, argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want):
        _close(g, r, atol=1e-4)


def test_api_checks():
    mask = _heads_mask(splash)
    splash.make_splash_mha_single_device(mask, block_sizes=splash.BlockSizes(256, 512))
    if JM is not None:
        sk = pytest.importorskip(
            "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel")
        splash.make_splash_mha_single_device(mask, block_sizes=sk.BlockSizes.get_default())
    with pytest.raises(ValueError, match="mask_value"):
        splash.make_splash_mha_single_device(mask, mask_value=-1.0)
    with pytest.raises(ValueError, match="Unexpected mask shape"):
        splash.make_splash_mha_single_device(splash.CausalMask((32, 32)))
    with pytest.raises(TypeError):
        splash.make_splash_mha(mask)                       # shards are required, as in JAX
    kernel = splash.make_splash_mha_single_device(mask)
    q, k, v = qkv(seed=11)
    with pytest.raises(ValueError, match="one example"):
        kernel(q[None], k, v)
    with pytest.raises(ValueError, match="mask is"):
        kernel(q[:, :16], k, v)
    with pytest.raises(ValueError, match="segment_ids"):
        kernel(q, k, v, splash.SegmentIds(jnp.zeros(16, int), jnp.zeros(32, int)))
