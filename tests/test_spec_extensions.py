"""Issue 16, item 3 (spec side): spellings the lowering now serves.

* row conditions ``q == G[i]`` (a row equal to a metadata value) keep the column view;
* ``SegmentIds.id(k)`` (a per-token property of the key) and vectors indexed by
  per-token ids (``V[D.id(q)]``);
* the K of a per-head spec is the maximum over heads, not the sum;
* ``from_dense`` with a batch axis.

Each case: the natural spelling and a hand-written equivalent give the same dense view;
descriptors match the dense oracle on random metadata (hypothesis); forward and gradients
on the ``xla`` backend match :func:`jcompilemask.testing.reference_gradients` under the
tolerance policy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jcompilemask as jcm
from jcompilemask.spec import (MaskSpec, Region, Scalar, SegmentIds, Vector, h, k, kv_len,
                               q, q_len)
from jcompilemask.testing import assert_within_policy, reference_gradients
from test_lower import TILE_CONFIGS, _tile_kwargs, check_descriptor

TILES = dict(block_q=16, block_kv=8, bwd_block_q=8, bwd_block_kv=16)


def _inputs(key, b, nq, nk, hq, hkv, d, dtype=jnp.float32):
    ks = jax.random.split(key, 4)
    qx = jax.random.normal(ks[0], (b, nq, hq, d), jnp.float32).astype(dtype)
    kx = jax.random.normal(ks[1], (b, nk, hkv, d), jnp.float32).astype(dtype)
    vx = jax.random.normal(ks[2], (b, nk, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, nq, hq, d), jnp.float32).astype(dtype)
    return qx, kx, vx, do


def check_xla_against_reference(desc, dense, qx, kx, vx, do):
    """Forward and (dq, dk, dv) of ``sum(out * do)`` on the xla backend, against the
    dense reference of ``dense`` [B or 1, Hm, Nq, Nk] under the tolerance policy."""
    from jcompilemask.testing import reference_attention

    def ours(a, b_, c):
        return jcm.mask_attention(a, b_, c, desc, implementation="xla")

    out, vjp = jax.vjp(ours, qx, kx, vx)
    grads = vjp(do)
    mask = jnp.asarray(dense)
    hi_out = reference_attention(qx, kx, vx, mask, precision="high")[0]
    lo_out = reference_attention(qx, kx, vx, mask, precision="input")[0]
    assert_within_policy(out, hi_out, lo_out, "out")
    g_hi, g_lo = reference_gradients(qx, kx, vx, do, mask)
    for name, a, gh, gl in zip(("dq", "dk", "dv"), grads, g_hi, g_lo):
        assert_within_policy(a, gh, gl, name)


def _same_dense(a, b, md, nq, nk):
    np.testing.assert_array_equal(np.asarray(a.as_dense(md, nq, nk)),
                                  np.asarray(b.as_dense(md, nq, nk)))


# =======================================================================================
# Row conditions q == G[i] keep the column view
# =======================================================================================
G = Vector("special", 2, max=q_len)


def special_rows_spec():
    """Causal, plus two special rows (e.g. summary tokens) that see every key."""
    return MaskSpec([Region((0, q_len), (q == G[0]) | (q == G[1]) | (k <= q))],
                    name="special_rows")


def special_rows_by_hand():
    return MaskSpec([Region((0, q_len), ((q >= G[0]) & (q < G[0] + 1))
                            | ((q >= G[1]) & (q <= G[1])) | (k <= q))])


def special_window_spec():
    """Causal, and row G[0] also sees the 3 keys from G[1] on (maybe in its future)."""
    return MaskSpec([Region((0, q_len), ((q == G[0]) & (k >= G[1]) & (k < G[1] + 3))
                            | (k <= q))])


def test_row_equal_to_metadata_keeps_the_column_view():
    for spec in (special_rows_spec(), special_window_spec()):
        cm = jcm.compile(spec)
        assert cm.has_column_view and cm.num_bwd_intervals > 0, cm.explain()
        assert not cm.fallback_regions
        assert "no column view" not in cm.explain()
    md = {"special": np.array([[3, 9], [0, 12], [12, 12]], np.int32)}
    _same_dense(special_rows_spec(), special_rows_by_hand(), md, 13, 13)


@settings(max_examples=15)
@given(data=st.data())
def test_row_equal_to_metadata_descriptor(data):
    spec = data.draw(st.sampled_from([special_rows_spec(), special_window_spec()]))
    tiles = data.draw(st.sampled_from(TILE_CONFIGS))
    nq, nk = data.draw(st.sampled_from([(13, 13), (7, 11), (12, 5)]))
    b = data.draw(st.integers(1, 3))
    md = {"special": np.array(data.draw(st.lists(st.lists(st.integers(0, nq), min_size=2,
                                                          max_size=2),
                                                 min_size=b, max_size=b)), np.int32)}
    desc = jcm.compile(spec).instantiate(md, nq, nk, **_tile_kwargs(tiles))
    # the special rows' column intervals come from the row bounds [G, G + 1)
    check_descriptor(desc, spec.as_dense(md, nq, nk), nq, nk, expect_column_view=True)


def test_row_equal_to_metadata_gradients_on_xla():
    spec = special_rows_spec()
    md = {"special": np.array([[5, 17], [0, 30]], np.int32)}
    n = 32
    desc = jcm.compile(spec).instantiate(md, n, n, **TILES)
    assert desc.num_bwd_intervals > 0 and bool(np.asarray(desc.bwd_exact).all())
    qx, kx, vx, do = _inputs(jax.random.key(0), 2, n, n, 2, 2, 16)
    check_xla_against_reference(desc, spec.as_dense(md, n, n), qx, kx, vx, do)


# =======================================================================================
# SegmentIds.id(k) and vectors indexed by per-token ids
# =======================================================================================
D = SegmentIds("doc", contiguous=True)
DN = SegmentIds("doc")                      # no declared layout
P = Vector("doc_prefix", 4, max=q_len)      # per-document prefix length


def doc_by_id(causal=True):
    rule = D.id(k) == D.id(q)
    return MaskSpec([Region((0, q_len), rule & (k <= q) if causal else rule)])


def doc_by_runs(causal=True):
    """The hand-written interval spelling of doc_by_id (padding runs included)."""
    rule = (k >= D.run_start(q)) & (k < D.run_end(q))
    return MaskSpec([Region((0, q_len), rule & (k <= q) if causal else rule)])


def doc_other():
    """Keys of the other documents, and the diagonal."""
    return MaskSpec([Region((0, q_len), (D.id(q) != D.id(k)) | (k == q))])


def doc_prefix_lm():
    """Packed prefix-LM: inside its document, row q sees the document's first
    P[id(q)] keys bidirectionally and the rest causally."""
    inside = (k >= D.start(q)) & (k < D.end(q))
    return MaskSpec([Region((0, q_len), inside & ((k <= q) | (k < D.start(q) + P[D.id(q)])))])


def doc_prefix_lm_by_hand():
    inside = (k >= D.start(q)) & (k < D.end(q))
    per_doc = [(D.id(q) == i) & (k < D.start(q) + P[i]) for i in range(4)]
    # a padding id (-1) reads entry 0; padding rows see nothing either way (empty run)
    per_doc[0] = (D.id(q) <= 0) & (k < D.start(q) + P[0])
    from jcompilemask.spec.expr import Or
    return MaskSpec([Region((0, q_len), inside & ((k <= q) | Or.of(*per_doc)))])


@st.composite
def contiguous_ids(draw, b, n, max_id=3):
    """Each id one run: up to 6 runs with distinct ids (any order), padding runs too."""
    rows = []
    for _ in range(b):
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(5, n - 1))))
        values = draw(st.permutations(list(range(max_id + 1)) + [-1, -2]))
        bounds = [0] + cuts + [n]
        row = []
        for r in range(len(bounds) - 1):
            row += [values[r]] * (bounds[r + 1] - bounds[r])
        rows.append(row)
    return np.array(rows, np.int32)


def test_key_id_equality_lowers_for_contiguous_ids():
    for spec in (doc_by_id(), doc_by_id(False), doc_other()):
        cm = jcm.compile(spec)
        assert not cm.fallback_regions, cm.explain()
        assert cm.has_column_view, cm.explain()
    assert jcm.compile(doc_by_id()).num_intervals == 1
    assert jcm.compile(doc_other()).num_intervals <= 3
    md = {"doc": np.array([[2, 2, 0, 0, 0, -1, -1, 1], [0, 0, 0, 0, 1, 1, 3, 3]], np.int32)}
    _same_dense(doc_by_id(), doc_by_runs(), md, 8, 8)
    _same_dense(doc_by_id(False), doc_by_runs(False), md, 8, 8)
    # with the padding rows excluded it is the built-in document mask
    no_pad = MaskSpec([Region((0, q_len), (D.id(k) == D.id(q)) & (D.id(q) >= 0) & (k <= q))])
    want = jcm.masks.document().as_dense({"segment_ids": md["doc"]}, 8, 8)
    np.testing.assert_array_equal(np.asarray(no_pad.as_dense(md, 8, 8)), np.asarray(want))
    # the oracle reads raw ids: padding rows see the keys of their padding run
    dense = np.asarray(doc_by_id(False).as_dense(md, 8, 8))[0, 0]
    assert dense[5].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]


@settings(max_examples=20)
@given(data=st.data())
def test_segment_id_specs_descriptor_vs_oracle(data):
    spec = data.draw(st.sampled_from([doc_by_id(), doc_by_id(False), doc_other(),
                                      doc_prefix_lm()]))
    tiles = data.draw(st.sampled_from(TILE_CONFIGS))
    nq, nk = data.draw(st.sampled_from([(13, 13), (7, 11), (12, 5)]))
    b = data.draw(st.integers(1, 3))
    md = {"doc": data.draw(contiguous_ids(b, max(nq, nk)))}
    if "doc_prefix" in spec.metadata:
        md["doc_prefix"] = np.array(data.draw(st.lists(
            st.lists(st.integers(0, nq), min_size=4, max_size=4), min_size=b, max_size=b)),
            np.int32)
    cm = jcm.compile(spec)
    desc = cm.instantiate(md, nq, nk, **_tile_kwargs(tiles))
    check_descriptor(desc, spec.as_dense(md, nq, nk), nq, nk,
                     expect_column_view=cm.has_column_view or None)


def test_vector_indexed_by_segment_id():
    assert str(P[D.id(q)]) == "doc_prefix[doc.id(q)]"
    assert type(P[jcm.spec.expr.Const(2)]).__name__ == "VectorElem"
    with pytest.raises(TypeError, match="integer expression"):
        P[1.5]
    cm = jcm.compile(doc_prefix_lm())
    assert not cm.fallback_regions and cm.num_intervals <= 2
    md = {"doc": np.array([[0, 0, 0, 1, 1, 1, 1, 3, 3, 2, -1, -1]], np.int32),
          "doc_prefix": np.array([[2, 3, 1, 0]], np.int32)}
    _same_dense(doc_prefix_lm(), doc_prefix_lm_by_hand(), md, 12, 12)
    row = np.asarray(doc_prefix_lm().as_dense(md, 12, 12))[0, 0, 3]   # doc 1, first row
    assert row.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    # an index past the vector's end reads its last entry (clamped)
    big = MaskSpec([Region((0, q_len), k < P[q])])
    dense = np.asarray(big.as_dense({"doc_prefix": np.array([[1, 2, 3, 4]])}, 6, 6))[0, 0]
    assert dense.sum(1).tolist() == [1, 2, 3, 4, 4, 4]


def test_non_contiguous_ids_fall_back_with_a_hint():
    spec = MaskSpec([Region((0, q_len), (DN.id(k) == DN.id(q)) & (k <= q))])
    with pytest.warns(jcm.MaskFallbackWarning, match=r"SegmentIds\('doc', contiguous=True\)"):
        cm = jcm.compile(spec)
    assert cm.fallback_regions == (0,)
    # the fallback path still serves the raw semantics: an id in two runs joins them
    md = {"doc": np.array([[0, 0, 1, 0, -1, 1, 2, -1]], np.int32)}
    desc = cm.instantiate(md, 8, 8, block_q=4, block_kv=4, bwd_block_q=2, bwd_block_kv=4)
    want = spec.as_dense(md, 8, 8)
    check_descriptor(desc, want, 8, 8)
    assert np.asarray(want)[0, 0, 3].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]


def test_contiguity_is_checked():
    ids = np.array([[0, 0, 1, 0]], np.int32)
    with pytest.raises(jcm.spec.MetadataError, match="contiguous"):
        doc_by_id().as_dense({"doc": ids}, 4, 4)
    with pytest.raises(jcm.spec.MetadataError, match="contiguous"):
        doc_by_id().as_dense({"doc": np.array([[-1, 0, 0, -1]], np.int32)}, 4, 4)
    from jax.experimental import checkify
    f = checkify.checkify(lambda m: doc_by_id().check_metadata(m, 4, 4))
    err, _ = jax.jit(f)({"doc": jnp.asarray(ids)})
    assert err.get() is not None and "contiguous" in err.get()
    err, _ = jax.jit(f)({"doc": jnp.asarray([[3, 3, 1, -1]], jnp.int32)})
    assert err.get() is None
    # two declarations of one name must agree on the property
    with pytest.raises(ValueError, match="declared twice"):
        MaskSpec([Region((0, q_len), (k >= DN.start(q)) & (D.id(k) == D.id(q)))])


def test_segment_id_specs_on_the_tilelang_program():
    from jcompilemask.kernels.tilelang import mock_preprocess
    from jcompilemask.kernels.tilelang.testing import descriptors_equal, sample_metadata
    from jcompilemask.lower.descriptor import TileConfig
    from jcompilemask.lower.preprocess import build_descriptor
    tiles = TileConfig(8, 16, 4, 8)
    rng = np.random.default_rng(0)
    for spec in (doc_by_id(), doc_other(), doc_prefix_lm()):
        cm = jcm.compile(spec)
        meta = sample_metadata(spec, 2, 30, 30, rng)
        ref = build_descriptor(cm, meta, 30, 30, tiles)
        got = mock_preprocess(cm, meta, 30, 30, tiles)
        assert not descriptors_equal(ref, got)
        np.testing.assert_array_equal(np.asarray(got.as_dense()),
                                      np.asarray(spec.as_dense(meta, 30, 30)))


@pytest.mark.parametrize("which", ["doc_by_id", "doc_prefix_lm"])
def test_segment_id_specs_gradients_on_xla(which):
    spec = {"doc_by_id": doc_by_id, "doc_prefix_lm": doc_prefix_lm}[which]()
    n = 32
    md = {"doc": np.array([[0] * 9 + [2] * 12 + [1] * 8 + [-1] * 3,
                           [3] * 20 + [0] * 12], np.int32)}
    if which == "doc_prefix_lm":
        md["doc_prefix"] = np.array([[4, 0, 3, 1], [5, 2, 0, 7]], np.int32)
    desc = jcm.compile(spec).instantiate(md, n, n, **TILES)
    qx, kx, vx, do = _inputs(jax.random.key(1), 2, n, n, 4, 2, 16)
    check_xla_against_reference(desc, spec.as_dense(md, n, n), qx, kx, vx, do)


# =======================================================================================
# Per-head specs: K is the maximum over heads, not the sum
# =======================================================================================
HEAD_RULES = [
    k <= q,                                               # causal: 1 interval
    (k >= q - 2) & (k <= q),                              # window: 1
    (k < 3) | ((k >= q - 1) & (k <= q)),                  # sinks + window: 2
    (k < q // 4 * 4) | (k == q + 1),                      # chunks before + next key: 2
    (k < Scalar("pre", max=q_len)) | (k <= q),            # prefix-LM: 1 or 2
]


def _per_head_spec(rules):
    from jcompilemask.splash.convert import head_condition
    from jcompilemask.spec.expr import Or
    groups: dict = {}
    for x, r in enumerate(rules):
        groups.setdefault(r.key(), (r, []))[1].append(x)
    rule = Or.of(*[head_condition(tuple(hs)) & r for r, hs in groups.values()])
    return MaskSpec([Region((0, q_len), rule)], num_heads=len(rules))


def test_per_head_k_is_the_max_over_heads():
    from jcompilemask.splash import CausalMask, LocalMask, MultiHeadMask
    from jcompilemask.splash.convert import to_jcm
    n = 16
    heads = [CausalMask((n, n)), LocalMask((n, n), (2, 0), 0), CausalMask((n, n)),
             LocalMask((n, n), (3, 1), 0)]
    spec = to_jcm(MultiHeadMask(heads))
    cm = jcm.compile(spec)
    assert cm.mask_heads == 4 and not cm.fallback_regions
    assert cm.num_intervals == 1, cm.explain()          # one per head (was: 3 groups)
    assert cm.num_bwd_intervals == 1
    want = np.stack([np.asarray(m[:, :]) for m in heads])[None]
    np.testing.assert_array_equal(np.asarray(spec.as_dense(None, n, n)), want)
    desc = cm.instantiate(None, n, n, block_q=4, block_kv=4, bwd_block_q=8, bwd_block_kv=4)
    check_descriptor(desc, want, n, n, expect_column_view=True)
    # the hand-written per-head rules, one spec per head, agree head by head
    for x, m in enumerate(heads):
        one = to_jcm(m)
        np.testing.assert_array_equal(np.asarray(one.as_dense(None, n, n))[0, 0], want[0, x])


@settings(max_examples=20)
@given(data=st.data())
def test_random_per_head_specs(data):
    hm = data.draw(st.integers(2, 4))
    rules = [data.draw(st.sampled_from(HEAD_RULES)) for _ in range(hm)]
    spec = _per_head_spec(rules)
    cm = jcm.compile(spec)
    per_head = [jcm.compile(MaskSpec([Region((0, q_len), r)])) for r in rules]
    assert cm.num_intervals == max(c.num_intervals for c in per_head), cm.explain()
    if cm.has_column_view:
        assert cm.num_bwd_intervals == max(c.num_bwd_intervals for c in per_head)
    nq, nk = data.draw(st.sampled_from([(13, 13), (7, 11), (12, 5)]))
    tiles = data.draw(st.sampled_from(TILE_CONFIGS))
    b = data.draw(st.integers(1, 2))
    md = ({"pre": np.array(data.draw(st.lists(st.integers(0, nq), min_size=b, max_size=b)),
                           np.int32)} if "pre" in spec.metadata else None)
    want = np.asarray(spec.as_dense(md, nq, nk))
    for x, r in enumerate(rules):     # the natural spelling is the per-head rules
        one = MaskSpec([Region((0, q_len), r)])
        m1 = ({"pre": md["pre"]} if "pre" in one.metadata else None)
        got = np.asarray(one.as_dense(m1, nq, nk))[:, 0]
        np.testing.assert_array_equal(want[:, x], np.broadcast_to(got, want[:, x].shape))
    desc = cm.instantiate(md, nq, nk, **_tile_kwargs(tiles))
    check_descriptor(desc, np.broadcast_to(want, desc.as_dense().shape), nq, nk,
                     expect_column_view=cm.has_column_view or None)


def test_per_head_spec_on_the_tilelang_program():
    from jcompilemask.kernels.tilelang import mock_preprocess
    from jcompilemask.kernels.tilelang.testing import descriptors_equal
    from jcompilemask.lower.descriptor import TileConfig
    from jcompilemask.lower.preprocess import build_descriptor
    tiles = TileConfig(8, 16, 4, 8)
    for rules in (HEAD_RULES[:4], [HEAD_RULES[2], HEAD_RULES[0], HEAD_RULES[2]]):
        spec = _per_head_spec(rules)
        cm = jcm.compile(spec)
        assert cm.num_intervals == 2
        ref = build_descriptor(cm, None, 30, 30, tiles)
        got = mock_preprocess(cm, None, 30, 30, tiles)
        assert not descriptors_equal(ref, got)


def test_per_head_slots_over_residual_slot_groups():
    # The two slot systems composed: per head, a residual rule, a shared-slot group (the
    # row conditions q < 4 / q >= 4 exclude each other: one run) and two intervals. The
    # groups are assigned per head, so K is 2 (head 2), not 1 + 1 + 2; Kc likewise.
    rules = [(k <= q) & ((q - k) % 2 == 0),
             ((q < 4) & (k < 4)) | ((q >= 4) & (k <= q)),
             (k < 3) | ((k >= q - 1) & (k <= q))]
    spec = _per_head_spec(rules)
    cm = jcm.compile(spec, warn=False)
    assert cm.residual_regions == (0,) and cm.shares_slots
    assert cm.num_intervals == 2 and cm.num_bwd_intervals == 2, cm.explain()
    assert cm.regions[0].num_slots == 4            # four slot groups, two per head at most
    res0 = [cm.residual(0, s) for s in range(cm.num_intervals)]
    assert any("% 2" in str(r) and "h ==" in str(r) for r in res0), res0
    from jcompilemask.kernels.tilelang.codegen import unsupported_reason
    assert unsupported_reason(cm)                  # residual + shared slots: jnp preprocess
    n = 13
    want = np.asarray(spec.as_dense(None, n, n))
    for tiles in TILE_CONFIGS[:2]:
        desc = cm.instantiate(None, n, n, **_tile_kwargs(tiles))
        # (both dense views, residuals applied; the raw column intervals are hulls)
        check_descriptor(desc, np.broadcast_to(want, desc.as_dense().shape), n, n)
        assert np.asarray(desc.bwd_exact).all()
    desc = cm.instantiate(None, 16, 16, **TILES)
    qx, kx, vx, do = _inputs(jax.random.key(3), 1, 16, 16, 3, 3, 16)
    check_xla_against_reference(desc, spec.as_dense(None, 16, 16), qx, kx, vx, do)


def test_per_head_spec_gradients_on_xla():
    spec = _per_head_spec(HEAD_RULES[:4])
    n = 32
    desc = jcm.compile(spec).instantiate(None, n, n, **TILES)
    assert desc.num_intervals == 2 and desc.mask_heads == 4
    qx, kx, vx, do = _inputs(jax.random.key(2), 2, n, n, 4, 2, 16)
    check_xla_against_reference(desc, spec.as_dense(None, n, n), qx, kx, vx, do)


# =======================================================================================
# from_dense with a batch axis
# =======================================================================================
@st.composite
def batched_bool_arrays(draw):
    b = draw(st.integers(1, 3))
    heads = draw(st.sampled_from([None, 1, 2]))
    nq, nk = draw(st.sampled_from([(5, 7), (9, 4), (8, 8)]))
    shape = (b, nq, nk) if heads is None else (b, heads, nq, nk)
    p = draw(st.sampled_from([0.1, 0.5, 0.9]))
    seed = draw(st.integers(0, 2 ** 16))
    return np.random.default_rng(seed).random(shape) < p


@settings(max_examples=15)
@given(arr=batched_bool_arrays(), tiles=st.sampled_from(TILE_CONFIGS),
       layout=st.sampled_from(["auto", "bitmap"]))
def test_from_dense_batched(arr, tiles, layout):
    dm = jcm.from_dense(arr, batched=True, layout=layout)
    want = arr if arr.ndim == 4 else arr[:, None]
    nq, nk = want.shape[2:]
    assert dm.mask_heads == want.shape[1] and dm.batched == (want.shape[0] > 1)
    np.testing.assert_array_equal(np.asarray(dm.as_dense()), want)
    desc = dm.instantiate(None, **_tile_kwargs(tiles))
    assert desc.batch == want.shape[0]
    check_descriptor(desc, want, nq, nk,
                     expect_column_view=(dm.layout == "intervals") or None)


def test_from_dense_batched_is_the_per_sequence_spec():
    spec = jcm.masks.prefix_lm()
    md = {"prefix_len": np.array([0, 3, 9], np.int32)}
    dense = np.asarray(spec.as_dense(md, 9, 9))             # [3, 1, 9, 9]
    dm = jcm.from_dense(dense[:, 0], batched=True)
    np.testing.assert_array_equal(np.asarray(dm.as_dense()), dense)
    assert dm.num_intervals == jcm.compile(spec).num_intervals


def test_from_dense_batch_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"from_dense\(mask, batched=True\).*\[B, Nq, Nk\]"):
        jcm.from_dense(np.ones((4, 4), bool), batched=True)
    with pytest.raises(ValueError, match="batched=True"):
        jcm.from_dense(np.ones((2, 1, 4, 4), bool))
    with pytest.raises(ValueError, match=r"from_dense\(mask"):
        jcm.from_dense(np.ones((2, 2, 2, 4, 4), bool), batched=True)
    with pytest.raises(TypeError, match=r"from_dense\(mask\): mask must be a boolean"):
        jcm.from_dense(np.ones((2, 4, 4), np.int32), batched=True)
    with pytest.raises(TypeError, match="batched"):
        jcm.from_dense(np.ones((2, 4, 4), bool), batched="yes")
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda m: jcm.from_dense(m, batched=True))(jnp.ones((2, 4, 4), bool))
    # without batched=True a 3-D array is still [H, Nq, Nk]
    assert jcm.from_dense(np.ones((2, 4, 4), bool)).mask_heads == 2


def test_from_dense_batched_gradients_on_xla():
    n = 24
    rng = np.random.default_rng(7)
    arr = np.stack([np.tril(np.ones((n, n), bool)), rng.random((n, n)) < 0.3])
    arr[1, 5] = False                                          # a row that sees nothing
    dm = jcm.from_dense(arr, batched=True)
    desc = dm.instantiate(None, n, n, **TILES)
    qx, kx, vx, do = _inputs(jax.random.key(3), 2, n, n, 2, 1, 16)
    check_xla_against_reference(desc, arr[:, None], qx, kx, vx, do)
    # passed straight to mask_attention, with is_causal added on top
    out = jcm.mask_attention(qx, kx, vx, dm, is_causal=True, implementation="xla")
    from jcompilemask.testing import reference_attention
    causal = np.tril(np.ones((n, n), bool))
    ref = reference_attention(qx, kx, vx, jnp.asarray(arr[:, None] & causal))[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)
