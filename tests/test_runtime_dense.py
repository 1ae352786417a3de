"""Dense masks known only at run time (``jcompilemask.lower.dense_runtime``): the runs and
tile states found on the device against numpy's, the descriptors of every layout against
the mask, the tier chosen at run time, and ``mask_attention`` with traced masks (forward,
lse and gradients) against the dense oracle on the xla backend. The registry's choice of
the CuTe kernels for the tiers is checked with cute marked available; the GPU run is
tests/gpu/test_cute_runtime_dense.py."""
from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.attention.api import runtime_dense_plan
from jcompilemask.lower.dense import _bitmap_tile_states, _runs
from jcompilemask.lower.dense_runtime import (RuntimeDense, RuntimeDenseMask, dense_runs,
                                              first_runs_from_words, pack_words,
                                              runs_from_words, tile_states_from_words)
from jcompilemask.testing import reference_attention


# A few shapes (each new shape compiles the jnp preprocess again): one row / key, word
# edges (31, 32, 33, 64) and ragged lengths.
_SHAPES = [(1, 1, 1, 1), (1, 2, 33, 64), (2, 1, 70, 31), (1, 1, 32, 90), (2, 2, 17, 33)]


@st.composite
def masks(draw):
    """bool [B, Hm, Nq, Nk]: random, striped (many runs) or causal-with-holes."""
    b, hm, nq, nk = draw(st.sampled_from(_SHAPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["random", "stripes", "causal"]))
    if kind == "random":
        m = rng.random((b, hm, nq, nk)) < draw(st.floats(0.02, 0.98))
    elif kind == "stripes":
        period = draw(st.integers(2, 9))
        m = (np.arange(nk) % period < rng.integers(1, period, (b, hm, nq, 1)))
    else:
        m = np.broadcast_to(np.tril(np.ones((nq, nk), bool)), (b, hm, nq, nk)).copy()
        m &= rng.random((b, hm, nq, nk)) < 0.97
    return np.ascontiguousarray(m)


@settings(max_examples=15)
@given(masks(), st.sampled_from([1, 3, 10]))
def test_runs_match_numpy(m, k):
    rs, rl, rc, cs, cl, cc, words = jax.jit(dense_runs, static_argnums=(1, 2))(m, k, k)
    for (s, ln, c), arr in (((rs, rl, rc), m), ((cs, cl, cc), np.swapaxes(m, -1, -2))):
        fs, fl = _runs(arr)
        np.testing.assert_array_equal(np.asarray(c), (fl > 0).sum(-1))
        kk = min(k, fs.shape[-1])
        np.testing.assert_array_equal(np.asarray(s)[..., :kk], fs[..., :kk])
        np.testing.assert_array_equal(np.asarray(ln)[..., :kk], fl[..., :kk])
        assert not np.asarray(ln)[..., kk:].any() and not np.asarray(s)[..., kk:].any()
    bits = (np.asarray(words)[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    np.testing.assert_array_equal(bits.reshape(m.shape[:3] + (-1,))[..., :m.shape[-1]], m)
    assert not bits.reshape(m.shape[:3] + (-1,))[..., m.shape[-1]:].any()


@settings(max_examples=15)
@given(masks())
def test_first_runs_match_the_search(m):
    """first_runs_from_words (one reduction) gives runs_from_words(words, 1) exactly, rows
    and columns, all-False rows included."""
    m = m.copy()
    m[..., 0, :] = False
    for words in (pack_words(m), pack_words(m, -2)):
        got = jax.jit(first_runs_from_words)(words)
        want = jax.jit(runs_from_words, static_argnums=1)(words, 1)
        for a, b_ in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


@settings(max_examples=4)
@given(masks(), st.sampled_from([(1, 8), (1, 3, 8), (2, 8), (1,)]))
@example(np.tril(np.ones((2, 1, 40, 40), bool)), (1, 8))          # index 0: zeros past it
@example(np.tril(np.ones((2, 1, 40, 40), bool)) & (np.arange(40) != 7), (1, 8))   # index 1
def test_plan_metadata_is_the_runs_of_its_tier(m, tiers):
    """Each tier's metadata equals dense_runs' tables at its width when the index reaches
    it (the wider tables are built under lax.cond); with a K = 1 first tier chosen, the
    wider tiers' tables are zeros (they do not run) and the K = 1 tables are still exact."""
    meta, index = jax.jit(lambda a: RuntimeDense(a, tiers).plan(a)[1:])(jnp.asarray(m))
    index = int(index)
    assert index == int(jax.jit(lambda a: RuntimeDense(a, tiers).tier_index())(m))
    assert set(meta[-1]) == {"dense_bitmap"}                # the bitmap, last
    runs = jax.jit(dense_runs, static_argnums=(1, 2))
    for k, md in zip(tiers, meta):
        rs, rl, rc, cs, cl, cc, _ = runs(m, k, k)
        if k == 1 or index > 0 or tiers[0] > 1:
            np.testing.assert_array_equal(md["row_starts"], rs)
            np.testing.assert_array_equal(md["row_lens"], rl)
            np.testing.assert_array_equal(md["col_starts"], cs)
            np.testing.assert_array_equal(md["col_lens"], cl)
        else:
            assert not np.asarray(md["row_lens"]).any() and not np.asarray(md["col_lens"]).any()
        np.testing.assert_array_equal(md["col_exact"], np.all(np.asarray(cc) <= k, axis=(1, 2)))


@settings(max_examples=15)
@given(masks(), st.sampled_from([(8, 32), (16, 64), (4, 5), (128, 128)]))
def test_tile_states_from_words_are_exact(m, tiles):
    bq, bk = tiles
    nq, nk = m.shape[-2:]
    got = tile_states_from_words(pack_words(m), nq, nk, bq, bk)
    np.testing.assert_array_equal(np.asarray(got), _bitmap_tile_states(m, bq, bk))


def test_words_and_runs_at_word_edges():
    """Runs that start or end on a word boundary (bit 31 / bit 0), a row all True, one
    all False, and a row of 64 keys whose only run is the last key."""
    n = 96
    m = np.zeros((1, 1, 5, n), bool)
    m[0, 0, 0, 31:33] = True
    m[0, 0, 1, :] = True
    m[0, 0, 3, 63] = True
    m[0, 0, 3, 95] = True
    m[0, 0, 4, 32:64] = True
    s, ln, c = runs_from_words(pack_words(m), 3)
    assert np.asarray(c)[0, 0].tolist() == [1, 1, 0, 2, 1]
    assert np.asarray(s)[0, 0].tolist() == [[31, 0, 0], [0, 0, 0], [0, 0, 0], [63, 95, 0],
                                            [32, 0, 0]]
    assert np.asarray(ln)[0, 0].tolist() == [[2, 0, 0], [96, 0, 0], [0, 0, 0], [1, 1, 0],
                                             [32, 0, 0]]
    with pytest.raises(ValueError, match="axis"):
        pack_words(m, axis=0)


def _tiles():
    return dict(block_q=16, block_kv=32, bwd_block_q=8, bwd_block_kv=16)


@settings(max_examples=4)
@given(masks())
def test_descriptors_of_each_layout_match_the_mask(m):
    """Every tier whose K holds the rows gives the mask in both views (a column past Kc:
    ``col_exact`` False and the backward view reads the rows); the bitmap always does."""
    shape = m.shape
    nq, nk = shape[-2:]
    most = max(int((_runs(m)[1] > 0).sum(-1).max()), 1)
    most_c = max(int((_runs(np.swapaxes(m, -1, -2))[1] > 0).sum(-1).max()), 1)
    runs = dense_runs(m, 8, 8)
    for cm in (RuntimeDenseMask(shape, "intervals", 8, 8),
               RuntimeDenseMask(shape, "intervals", most, max(1, most_c - 1)),
               RuntimeDenseMask(shape, "bitmap")):
        if cm.layout == "intervals" and most > cm.num_intervals:
            continue
        meta = cm.metadata_of(m) if cm.num_intervals != 8 else cm.metadata_from_runs(runs)
        d = cm.instantiate(meta, nq, nk, **_tiles())
        if cm.layout == "intervals":
            want = np.all((_runs(np.swapaxes(m, -1, -2))[1] > 0).sum(-1)
                          <= cm.num_bwd_intervals, axis=(1, 2))
            np.testing.assert_array_equal(np.asarray(d.bwd_exact), want)
        for view in ("fwd", "bwd"):
            np.testing.assert_array_equal(np.asarray(d.as_dense(view)), m, err_msg=repr(cm))
        np.testing.assert_array_equal(np.asarray(d.tile_states("fwd")),
                                      _bitmap_tile_states(m, 16, 32))
        np.testing.assert_array_equal(np.asarray(d.tile_states("bwd")),
                                      _bitmap_tile_states(m, 8, 16))


def _row_runs_mask(runs_per_row, n=64, b=2, seed=0):
    """bool [B, 1, n, n] whose rows have exactly ``runs_per_row`` runs (0: all False)."""
    rng = np.random.default_rng(seed)
    m = np.zeros((b, 1, n, n), bool)
    if runs_per_row:
        width = n // runs_per_row
        for bi in range(b):
            for i in range(n):
                for r in range(runs_per_row):
                    a = r * width + rng.integers(0, max(1, width // 2))
                    m[bi, 0, i, a:a + rng.integers(1, max(2, width // 2))] = True
    return m


@pytest.mark.parametrize("runs,tiers,want", [(0, (1, 8), 0), (1, (1, 8), 0), (2, (1, 8), 1),
                                             (8, (1, 8), 1), (9, (1, 8), 2), (3, (2, 4, 16), 1),
                                             (20, (2, 4, 16), 3)])
def test_the_narrowest_tier_that_holds_every_row_runs(runs, tiers, want):
    m = _row_runs_mask(runs)
    if runs:
        assert int((_runs(m)[1] > 0).sum(-1).max()) == runs
    q = jnp.zeros((2, 64, 2, 16))
    seen = {}

    def plan(m):
        descs, seen["names"], index = runtime_dense_plan(q, q, jcm.runtime_dense(m, tiers))
        return descs, index
    descs, index = jax.jit(plan)(m)
    names = seen["names"]
    assert int(index) == want == int(jcm.runtime_dense(m, tiers).tier_index())
    assert [d.num_intervals for d in descs] == list(tiers) + [1]
    assert names == ("xla",) * (len(tiers) + 1)
    assert descs[-1].mask.layout == "bitmap"


def _oracle(q, k, v, m, **kw):
    out, lse = reference_attention(q, k, v, m, **kw)
    return out.astype(jnp.float32), lse


@pytest.mark.parametrize("runs", [1, 5, 12])
def test_traced_masks_match_the_oracle_in_every_tier(runs):
    """Forward, lse and gradients under ``jit`` for masks that land in tier 1, tier 8 and
    the bitmap; rows that see nothing give zeros, lse -inf and zero gradients."""
    m = _row_runs_mask(runs, seed=runs)
    m[1, 0, 3:7] = False                                    # fully masked rows
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 64, 4, 16)) for i in range(3))
    k, v = k[:, :, :2], v[:, :, :2]                        # GQA
    do = jax.random.normal(jax.random.key(9), q.shape)

    @jax.jit
    def f(q, k, v, m):
        return jcm.mask_attention(q, k, v, m, return_residual=True)
    out, lse = f(q, k, v, m)
    ro, rl = _oracle(q, k, v, m)
    np.testing.assert_allclose(out, ro, atol=2e-5)
    np.testing.assert_allclose(jnp.swapaxes(lse, 1, 2), rl, atol=2e-5)
    assert not np.isnan(np.asarray(out)).any()

    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * do)  # noqa: E731
    g = jax.jit(jax.grad(loss(lambda q, k, v: jcm.mask_attention(q, k, v, jnp.asarray(m))),
                         (0, 1, 2)))(q, k, v)
    gr = jax.grad(loss(lambda q, k, v: _oracle(q, k, v, m)[0]), (0, 1, 2))(q, k, v)
    for a, b_ in zip(g, gr):
        np.testing.assert_allclose(a, b_, atol=5e-5)
    assert not np.asarray(g[0])[1, 3:7].any()


def test_traced_mask_with_jax_arguments_bias_and_unbatched_inputs():
    """The traced mask AND is_causal, a window and both sequence lengths; a bias on top
    (differentiable); an unbatched call."""
    n = 48
    q, k, v = (jax.random.normal(jax.random.key(20 + i), (2, n, 2, 8)) for i in range(3))
    bias = jax.random.normal(jax.random.key(30), (1, 2, n, n))
    m = jnp.asarray(np.random.default_rng(3).random((2, 1, n, n)) < 0.9)
    qsl, kvsl = jnp.array([n, 30]), jnp.array([40, n])
    kw = dict(is_causal=True, local_window_size=(20, 0), query_seq_lengths=qsl,
              key_value_seq_lengths=kvsl)

    def ours(q, bias, m):
        return jcm.mask_attention(q, k, v, m, bias=bias, **kw)

    def ref(q, bias, m):
        band = jnp.tril(jnp.ones((n, n), bool)) & ~jnp.tril(jnp.ones((n, n), bool), -21)
        full = (m & band[None, None]
                & (jnp.arange(n)[None, None, :, None] < qsl[:, None, None, None])
                & (jnp.arange(n)[None, None, None, :] < kvsl[:, None, None, None]))
        out = jax.nn.dot_product_attention(q, k, v, bias, full)
        return jnp.where(jnp.any(full, -1)[:, 0, :, None, None], out, 0)

    np.testing.assert_allclose(jax.jit(ours)(q, bias, m), ref(q, bias, m), atol=2e-5)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(ours(*a))), (0, 1)))(q, bias, m)
    gr = jax.grad(lambda *a: jnp.sum(jnp.sin(ref(*a))), (0, 1))(q, bias, m)
    for a, b_ in zip(g, gr):
        np.testing.assert_allclose(a, b_, atol=5e-5)
    one = jax.jit(lambda q, k, v, m: jcm.mask_attention(q, k, v, m))(q[0], k[0], v[0], m[0])
    np.testing.assert_allclose(one, reference_attention(q[:1], k[:1], v[:1], m[:1])[0][0],
                               atol=2e-5)


def test_vmap_over_traced_masks():
    """Under vmap one tier runs for the whole mapped batch, the widest any mapped mask
    needs (the switch stays a switch: no select over every tier); here one mapped mask
    fits tier 0, the other needs the bitmap, so both run on the bitmap; gradients too."""
    n = 40
    q, k, v = (jax.random.normal(jax.random.key(40 + i), (2, 1, n, 2, 8)) for i in range(3))
    ms = jnp.asarray(np.stack([_row_runs_mask(1, n, 1, 1), _row_runs_mask(11, n, 1, 2)]))
    f = jax.vmap(lambda q, k, v, m: jcm.mask_attention(q, k, v, m))
    out = jax.jit(f)(q, k, v, ms)
    for i in range(2):
        np.testing.assert_allclose(out[i], _oracle(q[i], k[i], v[i], ms[i])[0], atol=2e-5)
    assert [int(jcm.runtime_dense(m).tier_index()) for m in ms] == [0, 2]
    idx = jax.vmap(lambda m: RuntimeDense(m).plan(m)[2])(ms)
    assert idx.tolist() == [2, 2]             # unbatched inside, broadcast by vmap on the way out
    # the traced program keeps the switch (a batched index would have become a select of
    # every tier's output, with no cond left)
    assert "cond[" in str(jax.make_jaxpr(f)(q, k, v, ms))
    g = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(jnp.sin(f(q, k, v, m))), (0, 1, 2)))(q, k, v, ms)
    for i in range(2):
        gr = jax.grad(lambda *a: jnp.sum(jnp.sin(_oracle(*a, ms[i])[0])), (0, 1, 2))(q[i], k[i], v[i])
        for a, b_ in zip(g, gr):
            np.testing.assert_allclose(a[i], b_, atol=5e-5)


def test_runtime_dense_checks_its_arguments():
    m = jnp.ones((4, 4), bool)
    for bad in ((), (8, 1), (0, 2), (1, 1), (True,), 8, (1.5,)):
        with pytest.raises(ValueError, match="tiers"):
            jcm.runtime_dense(m, bad)
    with pytest.raises(TypeError, match="boolean"):
        jcm.runtime_dense(m.astype(jnp.float32))
    with pytest.raises(TypeError, match="boolean array"):
        jcm.runtime_dense([[True]])
    cm = RuntimeDenseMask((1, 1, 4, 4), "intervals", 2, 2)
    with pytest.raises(ValueError, match="metadata"):
        cm.instantiate({"dense_bitmap": pack_words(m)}, 4, 4)
    with pytest.raises(ValueError, match="row_starts.*shape"):
        cm.instantiate(RuntimeDenseMask((1, 1, 4, 4), "intervals", 3, 2).metadata_of(
            m[None, None]), 4, 4)
    with pytest.raises(ValueError, match="no array"):
        cm.as_dense()
    assert "K = 2" in cm.explain() and "bitmap" in RuntimeDenseMask((1, 1, 4, 4),
                                                                    "bitmap").explain()
    r = jcm.runtime_dense(m, (2,))
    leaves, tree = jax.tree_util.tree_flatten(r)
    assert jax.tree_util.tree_unflatten(tree, leaves).tiers == (2,) and "tiers=(2,)" in repr(r)


def test_registry_runs_the_tiers_on_cute_and_the_bitmap_on_xla(caplog, monkeypatch):
    """CPU twin of the GPU file: with the CuTe kernels marked available, a bf16 D 128 call
    runs every tier on cute and only the bitmap on xla, without logging the bitmap's
    fallback (it runs only past the widest tier); a named implementation="cute" keeps
    the bitmap on xla; a bias puts every tier on xla (the CuTe kernels take none). The
    column pack goes to the CuTe kernel (``kernels.cute.api.transpose_words``; here a
    stand-in that records its call and packs with XLA's words) unless
    ``$JCOMPILEMASK_CUTE_TRANSPOSE_WORDS=0``, and never when no tier runs on cute."""
    from jcompilemask.kernels.cute import api as cute_api
    from jcompilemask.lower import dense_runtime
    packs = []

    def kernel_stand_in(words, n_rows, n_cols):
        packs.append((words.shape, n_rows, n_cols))
        return dense_runtime.transpose_words(words, n_rows, n_cols)
    monkeypatch.setattr(cute_api, "transpose_words", kernel_stand_in)
    monkeypatch.delenv("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS", raising=False)
    real = backends.get("cute")
    backends.register(dataclasses.replace(real, available=lambda: None))
    try:
        q = jnp.zeros((2, 256, 8, 128), jnp.bfloat16)
        k = jnp.zeros((2, 256, 2, 128), jnp.bfloat16)
        m = jnp.tril(jnp.ones((1, 1, 256, 256), bool))
        with caplog.at_level("INFO"):
            _, names, _ = runtime_dense_plan(q, k, jcm.runtime_dense(m))
        assert names == ("cute", "cute", "xla")
        assert "bitmap" not in caplog.text
        _, names, _ = runtime_dense_plan(q, k, jcm.runtime_dense(m), implementation="cute")
        assert names == ("cute", "cute", "xla")
        assert packs == [((1, 1, 256, 8), 256, 256)] * 2    # the default: the kernel's pack
        _, names, _ = runtime_dense_plan(q, k, jcm.runtime_dense(m),
                                         bias=jnp.zeros((1, 1, 256, 256), jnp.bfloat16))
        assert names == ("xla",) * 3
        assert len(packs) == 2                                  # no tier on cute: XLA's pack
        monkeypatch.setenv("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS", "0")
        _, names, _ = runtime_dense_plan(q, k, jcm.runtime_dense(m))
        assert names == ("cute", "cute", "xla") and len(packs) == 2
    finally:
        backends.register(real)


def test_explain_takes_dense_masks():
    """explain(mask=...) takes a dense mask as mask_attention does: a RuntimeDense (or a
    traced / per-sequence array) tier by tier with the backend of each and the tier this
    mask takes; a concrete shared array as its from_dense mask; with the CuTe kernels
    marked available the tiers name cute and the bitmap says why it stays on xla."""
    m = jnp.tril(jnp.ones((1, 1, 64, 64), bool))
    real = backends.get("cute")
    backends.register(dataclasses.replace(real, available=lambda: None))
    try:
        text = backends.explain(mask=jcm.runtime_dense(m))
        assert "tier 0: K = 1 run(s) per row / column: runs on cute" in text
        assert "tier 1: K = 8 run(s) per row / column: runs on cute" in text
        assert "bitmap (past 8 runs in a row): runs on xla" in text
        assert "(cute: a dense mask kept as a bitmap" in text
        assert "this mask: tier 0" in text
        assert "this mask: bitmap" in backends.explain(
            mask=jcm.runtime_dense(jnp.asarray(_row_runs_mask(11, 64, 1, 1)), (1, 4)))
    finally:
        backends.register(real)
    per_seq = jnp.concatenate([m, m & (jnp.arange(64) != 10)[None, None, None, :]], axis=0)
    assert "tier 1" in backends.explain(mask=per_seq)          # 2 runs in some row
    seen = []
    jax.jit(lambda a: seen.append(backends.explain(mask=a)) or 0)(m)
    assert "this mask: traced" in seen[0]
    assert "DenseMask" in backends.explain(mask=np.tril(np.ones((64, 64), bool)))
    with pytest.raises(TypeError, match="boolean"):
        backends.explain(mask=jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match="shape"):
        backends.explain(mask=jnp.zeros((4,), bool))


def _transpose_kernel_twin(words3, n_cols):
    """numpy twin of ``kernels/cute/glue.TransposeWords`` (the GPU column pack), step for
    step: per CTA (256-row x 8-word tile) each of its 256 threads loads its row's 8 words,
    each warp's lanes run the five butterfly rounds (the shuffle partner is lane ^ s), the
    words meet in the shared tile [256 columns, 8 row words], and thread t stores element
    i 256 + t of it. The kernel itself runs in tests/gpu/test_cute_runtime_dense.py."""
    bh, nr, w = words3.shape
    wq = -(-nr // 32)
    out = np.zeros((bh, n_cols, wq), np.uint32)
    tid = np.arange(256)
    warp, lane = tid // 32, tid % 32
    rounds = ((16, 0x0000FFFF), (8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333),
              (1, 0x55555555))
    for b in range(bh):
        for rt in range(-(-wq // 8)):
            for wt in range(-(-w // 8)):
                row, w0 = rt * 256 + tid, wt * 8
                x = np.zeros((256, 8), np.uint32)
                for j in range(min(8, w - w0)):
                    ok = row < nr
                    x[ok, j] = words3[b, row[ok], w0 + j]
                for s, m in rounds:
                    y = x[(warp * 32 + (lane ^ s))]                 # shuffle_sync_bfly
                    up = ((lane & s) != 0)[:, None]
                    m, ms = np.uint32(m), np.uint32((m << s) & 0xFFFFFFFF)
                    x = np.where(up, (x & ~m) | ((y >> np.uint32(s)) & m),
                                 (x & ~ms) | ((y << np.uint32(s)) & ms))
                sc = np.zeros((256, 8), np.uint32)
                for j in range(8):
                    sc[j * 32 + lane, warp] = x[:, j]
                for i in range(8):
                    f = i * 256 + tid
                    c, kk = f // 8, f % 8
                    ok = (wt * 256 + c < n_cols) & (rt * 8 + kk < wq)
                    out[b, wt * 256 + c[ok], rt * 8 + kk[ok]] = sc[c[ok], kk[ok]]
    return out


@pytest.mark.parametrize("lead,nr,nc", [((2,), 700, 700), ((1,), 256, 300), ((2,), 33, 1000),
                                        ((1,), 1025, 40), ((1,), 1, 1)])
def test_transpose_kernel_twin_is_the_jnp_pack(lead, nr, nc):
    """The GPU column pack's algorithm and indexing (its numpy twin) against
    ``transpose_words`` and the pack of the transposed mask: ragged rows, columns and
    tiles."""
    from jcompilemask.lower.dense_runtime import transpose_words
    m = np.random.default_rng(nr + nc).random(lead + (nr, nc)) < 0.4
    words = np.asarray(pack_words(m, -1))
    got = _transpose_kernel_twin(words, nc)
    np.testing.assert_array_equal(got, np.asarray(transpose_words(words, nr, nc)))
    np.testing.assert_array_equal(got, np.asarray(pack_words(np.swapaxes(m, -1, -2), -1)))


def test_plan_takes_a_column_pack():
    """``RuntimeDense.plan(transpose=...)`` packs the columns with the function given (as
    mask_attention passes the CuTe kernel's) and gives the same plan."""
    from jcompilemask.lower.dense_runtime import transpose_words
    m = jnp.asarray(np.random.default_rng(2).random((2, 1, 100, 70)) < 0.3)
    calls = []

    def twin(words, nr, nc):
        calls.append((words.shape, nr, nc))
        lead = words.shape[:-2]
        return jnp.asarray(_transpose_kernel_twin(
            np.asarray(words).reshape((-1,) + words.shape[-2:]), nc).reshape(
                lead + (nc, -(-nr // 32))))
    rd = jcm.runtime_dense(m)
    base, got = rd.plan(m), rd.plan(m, transpose=twin)
    assert calls == [((2, 1, 100, 3), 100, 70)]
    assert [x.num_intervals for x in got[0]] == [x.num_intervals for x in base[0]]
    for a, b in zip(jax.tree.leaves((got[1], got[2])), jax.tree.leaves((base[1], base[2]))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert transpose_words is not None
