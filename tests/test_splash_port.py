"""The splash port's surface: what code written against JAX's splash attention imports and
calls, exercised the way such code (and its tests) does.

* names: the submodules under JAX's names, ``QKVLayout`` (an IntEnum), ``BlockSizes``
  (derived fields, ``has_backward_blocks``), the dense mask helpers, a user subclass of
  the computable-mask base;
* the float32 references: plain, custom backward ("flash" and "vanilla" deltas), the
  stand-alone backward, the all-heads MHA/GQA/MQA wrappers;
* kernels on dense many-run masks, alone and with segment ids, against the references;
* cost: such a mask is one table-shaped descriptor whose size does not grow with the
  number of runs, and repeated eager calls reuse one compilation;
* options: each either acts or provably changes nothing, and bad values are refused.
"""
import enum

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jcompilemask as jcm
from jcompilemask import splash
from jcompilemask.lower.dense import (DenseMask, SegmentedDenseMask, SegmentRunsDenseMask,
                                      segment_runs)
from jcompilemask.splash import splash_attention_kernel as sk
from jcompilemask.splash import splash_attention_mask as sm


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.uniform(jax.random.key(seed), shape, dtype)


def _close(a, b, atol=2e-5, rtol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=atol, rtol=rtol)


def _many_runs(n, seed, sparsity=0.4):
    """A random mask with about n * sparsity runs per row, the diagonal always visible."""
    m = sm.make_random_mask((n, n), sparsity, seed)
    m[np.arange(n), np.arange(n)] = True
    return m


# ---------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------
def test_module_names_match_jax():
    for name in ("make_splash_mha", "make_splash_mqa", "make_splash_mha_single_device",
                 "make_splash_mqa_single_device", "SegmentIds", "BlockSizes", "QKVLayout",
                 "DEFAULT_MASK_VALUE", "attention_reference", "attention_reference_custom",
                 "make_masked_mha_reference", "make_masked_mqa_reference",
                 "_attention_reference_custom_bwd", "SplashAttentionKernel"):
        assert hasattr(sk, name), name
    for name in ("Mask", "FullMask", "CausalMask", "LocalMask", "ChunkedCausalMask",
                 "NumpyMask", "MultiHeadMask", "LogicalAnd", "LogicalOr", "_ComputableMask",
                 "make_causal_mask", "make_local_attention_mask", "make_chunk_attention_mask",
                 "make_random_mask"):
        assert hasattr(sm, name), name
    assert splash.splash_attention_kernel is sk and splash.splash_attention_mask is sm


def test_qkv_layout_is_an_int_enum():
    assert issubclass(sk.QKVLayout, enum.IntEnum)
    assert [m.name for m in sk.QKVLayout] == ["HEAD_DIM_MINOR", "SEQ_MINOR"]
    assert sk.QKVLayout.HEAD_DIM_MINOR == 1 and sk.QKVLayout.SEQ_MINOR == 2


def test_block_sizes_fields():
    bs = sk.BlockSizes(256, 512)
    assert bs.block_kv_compute == 512 and bs.block_kv_dkv_compute is None
    assert not bs.has_backward_blocks
    full = sk.BlockSizes(128, 128, block_q_dkv=128, block_kv_dkv=256, block_q_dq=128,
                         block_kv_dq=128)
    assert full.block_kv_dkv_compute == 256 and full.has_backward_blocks
    fused = sk.BlockSizes(128, 128, block_q_dkv=128, block_kv_dkv=128,
                          use_fused_bwd_kernel=True)
    assert fused.has_backward_blocks               # the fused backward needs no dq blocks
    assert sk.BlockSizes.get_default().has_backward_blocks
    assert sk.BlockSizes(128, 128, q_layout=2).q_layout is sk.QKVLayout.SEQ_MINOR
    with pytest.raises(ValueError, match="fused"):
        sk.BlockSizes(128, 128, block_q_dq=128, use_fused_bwd_kernel=True)
    with pytest.raises(ValueError, match="block_kv"):
        sk.BlockSizes(128, 0)
    with pytest.raises(ValueError, match="k_layout"):
        sk.BlockSizes(128, 128, k_layout=7)


def test_dense_mask_helpers():
    assert sm.make_causal_mask((3, 4), offset=-1).astype(int).tolist() == [
        [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert sm.make_local_attention_mask((4, 3), (None, 0), offset=1).astype(int).tolist() == [
        [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert sm.make_chunk_attention_mask((5, 5), 2).astype(int).tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="chunk_size"):
        sm.make_chunk_attention_mask((4, 4), 0)
    a, b = sm.make_random_mask((64, 64), 0.25, 3), sm.make_random_mask((64, 64), 0.25, 3)
    assert a.dtype == np.bool_ and (a == b).all() and 0.6 < a.mean() < 0.9
    assert sm.make_random_mask((8, 8), 1.0, 0).sum() == 0
    # The lazy classes agree with the helpers on every tile.
    for lazy, dense in ((sm.CausalMask((40, 24), offset=3), sm.make_causal_mask((40, 24), 3)),
                        (sm.LocalMask((24, 40), (2, 5), 4),
                         sm.make_local_attention_mask((24, 40), (2, 5), offset=4)),
                        (sm.ChunkedCausalMask((40, 40), 7),
                         sm.make_chunk_attention_mask((40, 40), 7))):
        assert (lazy[:, :] == dense).all()
        assert (lazy[8:16, 16:24] == dense[8:16, 16:24]).all()


class _Identity(sm._ComputableMask):
    def __init__(self, shape):
        super().__init__(shape=shape, mask_function=lambda q, k: q == k)

    def __eq__(self, other):
        return type(other) is type(self) and self.shape == other.shape

    def __hash__(self):
        return hash((type(self), self.shape))


def test_user_computable_mask_through_a_kernel():
    mask = _Identity((48, 48))
    assert (mask[:, :] == np.eye(48, dtype=bool)).all() and mask.q_sequence.shape == (48,)
    q, k, v = _rand((1, 48, 16), 0), _rand((48, 16), 1), _rand((48, 16), 2)
    out = sk.make_splash_mqa_single_device(sm.MultiHeadMask([mask]))(q, k, v)
    _close(out[0], v)                              # each row sees its own value row only


# ---------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------
def _ref_inputs(n=32, d=8, seed=0):
    mask = jnp.asarray(_many_runs(n, seed))
    q, k, v = _rand((n, d), seed + 1), _rand((n, d), seed + 2), _rand((n, d), seed + 3)
    ids = np.repeat(np.arange(4), n // 4).astype(np.int32)
    return mask, q, k, v, sk.SegmentIds(ids, ids)


def test_attention_reference_is_splash_math():
    mask, q, k, v, seg = _ref_inputs()
    vis = mask & (seg.q[:, None] == seg.kv[None, :])
    out, (lse,) = sk.attention_reference(mask, q, k, v, seg, save_residuals=True,
                                         attn_logits_soft_cap=3.0)
    s = 3.0 * jnp.tanh((q @ k.T) / 3.0)
    want = jax.nn.dot_product_attention(q[None, :, None], k[None, :, None], v[None, :, None],
                                        bias=3.0 * jnp.tanh((q @ k.T) / 3.0)[None, None]
                                        - (q @ k.T)[None, None],
                                        mask=vis[None, None], scale=1.0)[0, :, 0]
    _close(out, want, atol=1e-5)
    _close(lse, jax.nn.logsumexp(jnp.where(vis, s, -jnp.inf), axis=-1), atol=1e-5)
    # A sink adds exp(sink) to every row's denominator.
    out_s, (lse_s,) = sk.attention_reference(mask, q, k, v, seg, jnp.float32(0.5),
                                             save_residuals=True)
    _, (lse0,) = sk.attention_reference(mask, q, k, v, seg, save_residuals=True)
    _close(lse_s, jnp.logaddexp(lse0, 0.5), atol=1e-5)


@pytest.mark.parametrize("cap", [None, 4.0])
@pytest.mark.parametrize("custom_type", ["flash", "vanilla"])
def test_custom_backward_equals_autodiff(cap, custom_type):
    mask, q, k, v, seg = _ref_inputs(seed=5)
    do = _rand(q.shape, 9)
    f_ref = lambda q, k, v: sk.attention_reference(mask, q, k, v, seg,  # noqa: E731
                                                   attn_logits_soft_cap=cap)
    f_cus = lambda q, k, v: sk.attention_reference_custom(  # noqa: E731
        mask, q, k, v, seg, custom_type=custom_type, attn_logits_soft_cap=cap)
    o_ref, vjp_ref = jax.vjp(f_ref, q, k, v)
    o_cus, vjp_cus = jax.vjp(f_cus, q, k, v)
    _close(o_cus, o_ref)
    for a, b in zip(vjp_cus(do), vjp_ref(do)):
        _close(a, b, atol=1e-4, rtol=1e-4)


def test_standalone_backward_with_sinks():
    mask, q, k, v, seg = _ref_inputs(seed=11)
    sink, do = jnp.float32(0.3), _rand(q.shape, 12)
    f = lambda q, k, v, s: sk.attention_reference(mask, q, k, v, seg, s)  # noqa: E731
    o, vjp = jax.vjp(f, q, k, v, sink)
    _, (lse,) = sk.attention_reference(mask, q, k, v, seg, sink, save_residuals=True)
    got = sk._attention_reference_custom_bwd(sk.DEFAULT_MASK_VALUE, False, "flash", None,
                                             (mask, q, k, v, seg, sink, o, lse), do)
    assert got[0] is None and got[4] is None
    for a, b in zip(got[1:4] + (got[5],), vjp(do)):
        _close(a, b, atol=1e-4, rtol=1e-4)
    assert sk._attention_reference_custom_bwd(
        sk.DEFAULT_MASK_VALUE, False, "flash", None,
        (mask, q, k, v, seg, None, o, lse), do)[5] is None


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 0)])
def test_all_heads_reference(heads, kv_heads):
    n, d = 24, 8
    masks = np.stack([_many_runs(n, s) for s in range(heads)])
    q = _rand((heads, n, d), 1)
    kv_shape = (n, d) if kv_heads == 0 else (kv_heads, n, d)
    k, v, sinks = _rand(kv_shape, 2), _rand(kv_shape, 3), _rand((heads,), 4)
    make = sk.make_masked_mqa_reference if kv_heads == 0 else sk.make_masked_mha_reference
    out, (lse,) = make(masks, backward_impl="custom")(q, k, v, None, sinks,
                                                      save_residuals=True)
    for h in range(heads):
        kh = k if kv_heads == 0 else k[h // (heads // kv_heads)]
        vh = v if kv_heads == 0 else v[h // (heads // kv_heads)]
        o1, (l1,) = sk.attention_reference(masks[h], q[h], kh, vh, None, sinks[h],
                                           save_residuals=True)
        _close(out[h], o1, atol=1e-5)
        _close(lse[h], l1, atol=1e-5)
    with pytest.raises(ValueError, match="backward_impl"):
        sk.make_masked_mha_reference(masks, backward_impl="fast")


# ---------------------------------------------------------------------------------------
# Kernels on dense many-run masks
# ---------------------------------------------------------------------------------------
def _kernel_case(is_mqa, heads=4, kv_heads=2, n=64, d=16, seed=0, dtype=jnp.float32):
    masks = sm.MultiHeadMask([sm.NumpyMask(_many_runs(n, seed + h)) for h in range(heads)])
    q = _rand((heads, n, d), seed + 10, dtype)
    kv_shape = (n, d) if is_mqa else (kv_heads, n, d)
    return masks, q, _rand(kv_shape, seed + 11, dtype), _rand(kv_shape, seed + 12, dtype)


def _segments(n, bounds):
    ids = np.zeros(n, np.int32)
    for i, b in enumerate(bounds):
        ids[b:] = i + 1
    return sk.SegmentIds(ids, ids)


@pytest.mark.parametrize("is_mqa", [False, True])
@pytest.mark.parametrize("segmented", [False, True])
def test_kernel_dense_mask_matches_reference(is_mqa, segmented):
    masks, q, k, v = _kernel_case(is_mqa)
    seg = _segments(64, [10, 29, 50]) if segmented else None
    make = sk.make_splash_mqa_single_device if is_mqa else sk.make_splash_mha_single_device
    ref = (sk.make_masked_mqa_reference if is_mqa else sk.make_masked_mha_reference)(masks)
    kernel = make(masks, save_residuals=True, attn_logits_soft_cap=20.0)
    sinks = _rand((4,), 7)
    (o, (lse,)), vjp = jax.vjp(lambda q, k, v, s: kernel(q, k, v, seg, s), q, k, v, sinks)
    (o_r, (lse_r,)), vjp_r = jax.vjp(
        lambda q, k, v, s: ref(q, k, v, seg, s, save_residuals=True,
                               attn_logits_soft_cap=20.0), q, k, v, sinks)
    _close(o, o_r, atol=1e-5)
    _close(lse, lse_r, atol=1e-5)
    cts = (_rand(o.shape, 8), (_rand(lse.shape, 9),))      # through out and logsumexp
    for a, b in zip(vjp(cts), vjp_r(cts)):
        _close(a, b, atol=1e-4, rtol=1e-4)


def test_kernel_dense_mask_bf16_and_concrete_jax_array_mask():
    masks, q, k, v = _kernel_case(False, dtype=jnp.bfloat16, seed=3)
    dense = jnp.asarray(masks[:, :, :])           # a concrete jax array, as splash allows
    seg = _segments(64, [17, 40])
    out = sk.make_splash_mha_single_device(dense)(q, k, v, seg)
    ref = sk.make_masked_mha_reference(dense)(q.astype(jnp.float32), k.astype(jnp.float32),
                                              v.astype(jnp.float32), seg)
    assert out.dtype == jnp.bfloat16
    _close(out, ref, atol=2e-2, rtol=2e-2)


def _few_runs(n, seed):
    """A dense mask of at most 8 runs per row (interval tables on every machine): a causal
    window, a few key stripes, the diagonal."""
    rng = np.random.default_rng(seed)
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    stripes = np.zeros(n, bool)
    for s in rng.choice(n - 3, 4, replace=False):
        stripes[s:s + 2] = True
    return (ki <= qi) & ((qi - ki < 6) | stripes[None, :])


def _few_runs_case(seed=20, n=64):
    masks = sm.MultiHeadMask([sm.NumpyMask(_few_runs(n, seed + h)) for h in range(4)])
    q = _rand((4, n, 16), seed + 10)
    return masks, q, _rand((2, n, 16), seed + 11), _rand((2, n, 16), seed + 12)


def test_dense_few_runs_with_segments_take_interval_tables():
    """A dense mask kept as interval tables with segment ids runs as tables too (its runs
    clipped per row: SegmentRunsDenseMask, the GPU kernels' form), eagerly and under jit,
    matching the reference in value and gradients; contiguity is checked as for
    structured masks (concrete ids: split ones take the exact bitmap form)."""
    masks, q, k, v = _few_runs_case()
    kernel = sk.make_splash_mha_single_device(masks, save_residuals=True)
    assert kernel.masks.dense_tables
    seg = _segments(64, [10, 29, 50])
    assert kernel._segment_mode(seg, 64, 64)[2] == "dense_runs"
    assert isinstance(kernel.masks.dense_runs, SegmentRunsDenseMask)
    ref = sk.make_masked_mha_reference(masks)
    for fn in (kernel, jax.jit(kernel)):        # jit: traced ids, the checked form
        (o, (lse,)), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        (o_r, (lse_r,)), vjp_r = jax.vjp(
            lambda q, k, v: ref(q, k, v, seg, save_residuals=True), q, k, v)
        _close(o, o_r, atol=1e-5)
        _close(lse, lse_r, atol=1e-5)
        cts = (_rand(o.shape, 8), (_rand(lse.shape, 9),))
        for a, b in zip(vjp(cts), vjp_r(cts)):
            _close(a, b, atol=1e-4, rtol=1e-4)
    split = sk.SegmentIds(np.array([0] * 16 + [1] * 16 + [0] * 16 + [2] * 16, np.int32),
                          np.array([0] * 16 + [1] * 16 + [0] * 16 + [2] * 16, np.int32))
    assert kernel._segment_mode(split, 64, 64)[2] == "dense"        # concrete: exact form
    out = sk.make_splash_mha_single_device(masks)
    ref_split = ref(q, k, v, split)
    _close(out(q, k, v, split), ref_split, atol=1e-5)
    fast = np.asarray(jax.jit(out)(q, k, v, split))                  # traced: NaN, never wrong
    bad = np.asarray(split.q == 0)
    assert np.isnan(fast[:, bad]).all()
    _close(fast[:, ~bad], np.asarray(ref_split)[:, ~bad], atol=1e-5)
    exact = sk.make_splash_mha_single_device(masks, exact_segment_ids=True)
    assert exact._segment_mode(split, 64, 64)[2] == "dense"
    _close(jax.jit(exact)(q, k, v, split), ref_split, atol=1e-5)


def test_segment_runs_dense_mask_matches_the_bitmap_form():
    """SegmentRunsDenseMask against SegmentedDenseMask (exact for any ids): the same dense
    views and tile states for contiguous ids (batch 2, cross lengths); a sequence whose
    ids are split in the rows keeps exact forward rows and loses its column view
    (bwd_exact False: the backward checks the row intervals)."""
    arr = np.stack([_few_runs(48, 1)[:40], _few_runs(48, 2)[:40]])        # [2, 40, 48]
    runs, bitmap = SegmentRunsDenseMask(arr), SegmentedDenseMask(arr)
    assert runs.layout == "intervals" and "segment id" in runs.explain()
    q_ids = np.stack([np.repeat([0, 1, 2], [10, 20, 10]), np.repeat([0, 1, 2], [30, 5, 5])])
    kv_ids = np.stack([np.repeat([0, 1, 2], [12, 20, 16]), np.repeat([0, 1, 2], [8, 8, 32])])
    tiles = dict(block_q=16, block_kv=16, bwd_block_q=8, bwd_block_kv=16)
    md = {"q_segment_ids": jnp.asarray(q_ids, jnp.int32),
          "kv_segment_ids": jnp.asarray(kv_ids, jnp.int32)}
    a = runs.instantiate(md, 40, 48, **tiles)
    b = bitmap.instantiate(md, 40, 48, **tiles)
    assert np.asarray(a.bwd_exact).all()
    for view in ("fwd", "bwd"):
        np.testing.assert_array_equal(np.asarray(a.as_dense(view)), np.asarray(b.as_dense(view)))
        np.testing.assert_array_equal(np.asarray(a.tile_states(view)),
                                      np.asarray(b.tile_states(view)))
    # rows split by id (0, 1, 0): every row's keys are contiguous, a column's rows are not
    md2 = {"q_segment_ids": jnp.asarray(np.repeat([0, 1, 0], [10, 10, 20])[None], jnp.int32),
           "kv_segment_ids": jnp.asarray(np.repeat([0, 1], [30, 18])[None], jnp.int32)}
    a2 = runs.instantiate(md2, 40, 48, **tiles)
    assert not bool(np.asarray(a2.bwd_exact)[0])
    np.testing.assert_array_equal(np.asarray(a2.as_dense("fwd")),
                                  np.asarray(bitmap.instantiate(md2, 40, 48, **tiles).as_dense("fwd")))
    lo, hi, ok = segment_runs(md2["q_segment_ids"], md2["kv_segment_ids"])
    assert np.asarray(ok).all() and int(hi[0, 0]) == 30
    assert not np.asarray(segment_runs(md2["kv_segment_ids"], md2["q_segment_ids"])[2]).all()
    with pytest.raises(ValueError, match="needs interval tables"):
        SegmentRunsDenseMask(_many_runs(64, 0)[None], layout="bitmap")
    with pytest.raises(ValueError, match="one mask"):
        SegmentRunsDenseMask(arr[None])


def test_dense_segments_need_not_be_contiguous():
    masks, q, k, v = _kernel_case(False, seed=4)
    ids = np.random.default_rng(0).integers(0, 3, 64).astype(np.int32)   # scattered ids
    seg = sk.SegmentIds(ids, ids)
    kernel = sk.make_splash_mha_single_device(masks)
    ref = sk.make_masked_mha_reference(masks)(q, k, v, seg)
    _close(kernel(q, k, v, seg), ref, atol=1e-5)
    _close(jax.jit(kernel)(q, k, v, seg), ref, atol=1e-5)     # traced ids: exact as well


# ---------------------------------------------------------------------------------------
# Cost: table-shaped, and compiled once
# ---------------------------------------------------------------------------------------
def test_many_run_mask_is_one_table_shaped_descriptor():
    n = 512
    mask = _many_runs(n, 0)
    runs = int((np.diff(mask.astype(int), axis=-1) == 1).sum(-1).max())
    assert runs > 50
    conv = splash.to_jcm(mask[None])
    assert isinstance(conv, DenseMask) and conv.layout == "bitmap"
    assert conv.runs_per_row >= runs
    desc = conv.instantiate(None, n, n, block_q=128, block_kv=128, bwd_block_q=64,
                            bwd_block_kv=128)
    # Nothing in the descriptor scales with the number of runs: one empty interval slot
    # per row, no column intervals, a bitmap of n/32 words per row.
    assert desc.fwd_intervals.shape == (1, 1, n, 1, 2)
    assert desc.bwd_intervals.shape == (1, 1, n, 0, 2)
    assert desc.metadata["dense_bitmap"].shape == (1, 1, n, n // 32)
    np.testing.assert_array_equal(np.asarray(desc.as_dense("fwd")[0, 0]), mask)
    np.testing.assert_array_equal(np.asarray(desc.as_dense("bwd")[0, 0]), mask)
    # Few runs keep the interval tables (and the GPU kernels).
    few = splash.to_jcm(sm.make_local_attention_mask((n, n), (3, 0))[None] | np.eye(n, k=9,
                                                                                   dtype=bool))
    assert isinstance(few, jcm.MaskSpec) or few.layout == "intervals"


def test_eager_calls_compile_once():
    n = 256
    masks = sm.MultiHeadMask([sm.NumpyMask(_many_runs(n, 1))] * 2)
    kernel = sk.make_splash_mha_single_device(masks)
    q = _rand((2, n, 16), 0)
    for bounds in ([40, 100], [7, 200], [128]):          # new id values, same shapes
        kernel(q, q, q, _segments(n, bounds))
    assert kernel._call._cache_size() == 1
    assert isinstance(kernel.masks.dense_segmented, SegmentedDenseMask)


# ---------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------
def test_options_without_effect_do_not_change_results():
    masks, q, k, v = _kernel_case(False, seed=6)
    base = sk.make_splash_mha_single_device(masks)(q, k, v)
    for kw in (dict(block_sizes=sk.BlockSizes(128, 128, q_layout=sk.QKVLayout.SEQ_MINOR,
                                              k_layout=sk.QKVLayout.SEQ_MINOR,
                                              v_layout=sk.QKVLayout.SEQ_MINOR)),
               dict(block_sizes=sk.BlockSizes.get_default()),
               dict(downcast_smem_data=False), dict(interpret=True)):
        np.testing.assert_array_equal(np.asarray(sk.make_splash_mha_single_device(
            masks, **kw)(q, k, v)), np.asarray(base))
    sharded = sk.make_splash_mha(masks, head_shards=2, q_seq_shards=4)
    np.testing.assert_array_equal(np.asarray(sharded(q, k, v)), np.asarray(base))


def test_bad_options_are_refused():
    masks = sm.MultiHeadMask([sm.CausalMask((64, 64))] * 4)
    with pytest.raises(ValueError, match="head_shards"):
        sk.make_splash_mha(masks, head_shards=3, q_seq_shards=1)
    with pytest.raises(ValueError, match="q_seq_shards"):
        sk.make_splash_mha(masks, head_shards=1, q_seq_shards=5)
    with pytest.raises(TypeError, match="BlockSizes"):
        sk.make_splash_mha_single_device(masks, block_sizes=(128, 128))
    with pytest.raises(ValueError, match="soft_cap"):
        sk.make_splash_mha_single_device(masks, attn_logits_soft_cap=True)
    with pytest.raises(ValueError, match="mask_value"):
        sk.make_splash_mha_single_device(masks, mask_value=-1.0)
    kernel = sk.make_splash_mha_single_device(masks)
    q = _rand((4, 64, 8), 0)
    with pytest.raises(ValueError, match="sinks"):
        kernel(q, q, q, None, jnp.zeros(3))
    with pytest.raises(TypeError, match="integer"):
        kernel(q, q, q, sk.SegmentIds(jnp.zeros(64), jnp.zeros(64)))


# ---------------------------------------------------------------------------------------
# JAX's test configuration
# ---------------------------------------------------------------------------------------
def test_suite_runs_with_rank_promotion_raise():
    import os
    want = os.environ.get("JAX_NUMPY_RANK_PROMOTION", "raise")
    assert jax.config.jax_numpy_rank_promotion == want


def test_strict_promotion_paths():
    # JAX's own tests run with rank promotion 'raise' and dtype promotion 'strict'.
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        masks, q, k, v = _kernel_case(False, seed=2, n=32)
        seg = _segments(32, [9, 20])
        dense = sk.make_splash_mha_single_device(masks, save_residuals=True)
        jax.grad(lambda q: dense(q, k, v, seg, jnp.ones(4))[0].sum())(q)
        causal = sk.make_splash_mha_single_device(sm.MultiHeadMask([sm.CausalMask((32, 32))]
                                                                   * 4))
        jax.jit(causal)(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                        v.astype(jnp.bfloat16), seg)
        ref = sk.make_masked_mha_reference(masks, backward_impl="custom")
        jax.grad(lambda q: ref(q, k, v, seg).sum())(q)


def test_cute_refuses_a_bitmap_dense_mask_saying_why():
    """A dense mask of many runs per row is kept as a bitmap; the registry names that, not
    'fallback regions', when it passes over the CuTe kernels."""
    from jcompilemask import backends
    call = backends.Call(dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=2,
                         num_kv_heads=2, softcap=False, has_fallback=True, dense_bitmap=True)
    why = backends.get("cute").supports(call)
    assert "bitmap" in why and "fallback regions" not in why
