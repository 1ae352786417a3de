"""Issue 16, CPU side: hull + residual lowering, ``k // c`` atoms, shared slots, explain.

* Natural spellings (``k // 64 <= q // 64``, ``k // c == q // c``) lower to the same
  intervals, K and dense view as their hand-written interval spellings.
* K equals the most runs a row can have where the spec allows it: an HSTU written as one
  region with row conditions packs its four intervals into two slots (proved by sympy,
  checked against the oracle's run counts).
* Random specs with residual atoms (``(q - k) % 2 == 0``, ``k % c != 0``, ...): both
  dense views equal the oracle, tile states are safe, and ``mask_attention`` on the
  ``xla`` backend matches the dense reference forward and backward (tolerance policy).
* ``explain()`` and ``backends.explain(mask=...)`` report intervals, residuals and the
  backend; the CuTe backend and the TileLang preprocess refuse residual masks.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.lower.analyze import lower_region, solve_k
from jcompilemask.spec.expr import Pred
from jcompilemask.spec import (TRUE, MaskSpec, Region, Scalar, SegmentIds, k, kv_len,
                               maximum, minimum, q, q_len)
from jcompilemask.testing import assert_within_policy, reference_gradients, reference_attention
from strategies import hstu_one_region
from test_lower import (BOUNDS, K_ATOMS, ROW_ATOMS, _tile_kwargs, check_descriptor,
                        random_metadata)

A = Scalar("a", max=q_len)
B = Scalar("b", max=q_len)
C = Scalar("c", min=1, max=q_len)
SEG = SegmentIds("seg")
LAYOUTS = [((13, 13), ((4, 4), (2, 4))), ((7, 11), ((1, 1), (5, 3))),
           ((12, 5), ((3, 5), (32, 8)))]


def _cm(rule, rows=(0, q_len), **kw):
    return jcm.compile(MaskSpec([Region(rows, rule)], **kw), warn=False)


def _md(spec, rng, b, n):
    out = {}
    for name in spec.metadata:
        if name in ("a", "b"):
            out[name] = rng.integers(0, n + 1, b).astype(np.int32)
        elif name in ("c", "g"):
            out[name] = rng.integers(1, 5, b).astype(np.int32)
        elif name == "seg":
            out[name] = np.sort(rng.integers(-1, 4, (b, n)), axis=1).astype(np.int32)
    return out or None


def _dense(cm, md, n, tiles=((4, 4), (2, 4))):
    desc = cm.instantiate(md, n, n, **_tile_kwargs(tiles))
    want = np.asarray(cm.spec.as_dense(md, n, n))
    check_descriptor(desc, want, n, n)
    return np.asarray(desc.as_dense())


# =======================================================================================
# k // c and k % c atoms
# =======================================================================================
SPELLINGS = [
    # natural spelling, interval spelling
    (k // 4 <= q // 4, k < (q // 4 + 1) * 4),
    (k // 4 <= q // 4, k <= 4 * (q // 4) + 3),
    (k // 3 == q // 3, (k >= q // 3 * 3) & (k < q // 3 * 3 + 3)),
    (k // 3 != q // 3, (k < q // 3 * 3) | (k >= q // 3 * 3 + 3)),
    (k // 4 < q // 4, k < q // 4 * 4),
    (k // 4 >= q // 4 - 1, k >= (q // 4 - 1) * 4),
    ((k // 2) // 3 <= q // 6, k < (q // 6 + 1) * 6),
    ((k + 1) // 4 <= q // 4, k < (q // 4 + 1) * 4 - 1),
    (2 * (k // 3) < q, k < 3 * (0 - ((0 - q) // 2))),
    ((k // C == q // C) & (k <= q), (k >= q // C * C) & (k <= q)),
    (k // C >= A, k >= A * C),
    (k // maximum(A, 1) < 2, k < 2 * maximum(A, 1)),
    (k // A < 2, k < 2 * maximum(A, 1)),       # a divisor <= 0 acts as 1
    (minimum(k, q) >= 2, (k >= 2) & (q >= 2)),  # min / max with k inside split
    (maximum(k, A) < 5, (k < 5) & (A < 5)),
    (~(minimum(k, q + 1) >= A), (k < A) | (q + 1 < A)),
]


@pytest.mark.parametrize("natural,intervals", SPELLINGS, ids=[str(s[0]) for s in SPELLINGS])
def test_floor_division_atoms_lower_exactly(natural, intervals):
    a, b = _cm(natural), _cm(intervals)
    assert not a.residual_regions and not b.residual_regions, a.explain()
    assert a.num_intervals == b.num_intervals
    assert a.has_column_view == b.has_column_view
    rng = np.random.default_rng(0)
    for n in (13, 16):
        md = _md(a.spec, rng, 3, n)
        np.testing.assert_array_equal(_dense(a, md, n), _dense(b, md, n))


def test_block_causal_bound_reads_as_written():
    lo, hi = solve_k(k // 64 <= q // 64, None)[1], None
    assert str(lo) == "64 * (q // 64) + 64"
    cm = _cm(k // 64 <= q // 64)
    assert cm.num_intervals == 1 and cm.has_column_view
    iv = cm.regions[0].intervals[0]
    assert str(iv) == "[0, 64 * (q // 64) + 64)"
    # k <= 64*(q//64) + 63 is the same bound
    np.testing.assert_array_equal(_dense(cm, None, 200, ((64, 64), (64, 128))),
                                  _dense(_cm(k <= 64 * (q // 64) + 63), None, 200,
                                         ((64, 64), (64, 128))))


def test_modulo_atoms_are_hull_plus_residual():
    cm = _cm((k % 4 == 1) & (k <= q) & (k >= q - 9))
    (iv,) = cm.regions[0].intervals
    assert str(iv.lo) == "q - 9" and str(iv.hi) == "q + 1"
    assert str(iv.residual) == "k % 4 == 1"        # kept whole, not split into <= / >=
    assert cm.residual_regions == (0,) and cm.has_column_view


def test_no_hull_gets_the_full_row():
    cm = _cm(k * k <= q)
    (iv,) = cm.regions[0].intervals
    assert str(iv.lo) == "0" and str(iv.hi) == "kv_len" and str(iv.residual) == "k * k <= q"
    _dense(cm, None, 13)


def test_too_wide_dnf_is_one_residual_interval():
    rule = TRUE
    for c in range(7):                    # 2**7 conjuncts
        rule = rule & ((k <= q - c) | (k % (c + 2) == 0))
    cm = _cm(rule)
    assert cm.num_intervals == 1 and cm.residual_regions == (0,)
    assert "more than" in cm.regions[0].residual_reason
    _dense(cm, None, 12)


def test_exact_interval_absorbs_its_residual_copy():
    cm = _cm((k <= q) | ((k <= q) & (k % 2 == 0)))
    assert not cm.residual_regions and cm.num_intervals == 1


# =======================================================================================
# Shared slots: K = most runs per row
# =======================================================================================
def _max_runs(dense):
    d = np.asarray(dense).astype(np.int8)
    starts = d[..., :1] + (np.diff(d, axis=-1) == 1).sum(-1, keepdims=True)
    return int(starts.max())


def test_hstu_one_region_packs_into_two_slots():
    spec = hstu_one_region()
    cm = jcm.compile(spec)
    assert len(cm.regions[0].intervals) == 4         # four conjuncts, as before
    assert cm.num_intervals == 2                     # ... in two slots (was K = 4)
    assert cm.shares_slots and cm.has_column_view and not cm.residual_regions
    assert "slot 0 holds intervals" in cm.explain()
    rng = np.random.default_rng(1)
    runs, n = 0, 16
    for ordered in (True, False, True, False):
        a, b = rng.integers(0, n + 1, (2, 4)).astype(np.int32)
        if ordered:                                    # the built-in's layout: a <= b
            a, b = np.minimum(a, b), np.maximum(a, b)
        md = {"a": a, "b": b, "g": rng.integers(1, 5, 4).astype(np.int32)}
        dense = _dense(cm, md, n, ((4, 4), (2, 4)))
        runs = max(runs, _max_runs(dense))
        if ordered:   # then it is the built-in HSTU (three regions, K = 2)
            np.testing.assert_array_equal(dense, np.asarray(jcm.masks.hstu().as_dense(
                {"context_len": a, "history_end": b, "group_size": md["g"]}, n, n)))
    assert runs == cm.num_intervals == 2


def test_slots_need_a_proof():
    # Two conditions that may both hold (a, b unordered) and intervals that need not
    # touch: two slots, K = 2 (never merged on sampling).
    rule = ((q < A) & (k < 2)) | ((q >= B) & (k >= q))
    cm = _cm(rule)
    assert cm.num_intervals == 2 and not cm.shares_slots
    # excluded by a row bound: one slot
    cm = _cm(((q < A) & (k < 2)) | ((q >= A) & (k >= q)))
    assert cm.num_intervals == 1 and cm.shares_slots
    # excluded by q-free conditions on one metadata value (A < 3 vs A >= 3)
    flags = _cm(((A < 3) & (k < 2)) | ((A >= 3) & (k >= q)))
    assert flags.num_intervals == 1
    _dense(flags, {"a": np.array([0, 2, 3, 9], np.int32)}, 11)
    rng = np.random.default_rng(2)
    for n in (9, 13):
        _dense(cm, _md(cm.spec, rng, 3, n), n)


def test_slots_with_residuals_keep_each_members_residual():
    rule = (((q < A) & (k <= q) & (k % 2 == 0)) | ((q >= A) & (k >= q - 3) & (k <= q)
                                                 & ((q - k) % 3 != 1)))
    cm = _cm(rule)
    assert cm.num_intervals == 1 and cm.residual_regions == (0,)
    res = str(cm.residual(0, 0))
    assert "k % 2 == 0" in res and "(q - k) % 3 != 1" in res
    rng = np.random.default_rng(3)
    for n in (13, 16):
        _dense(cm, _md(cm.spec, rng, 3, n), n)


# =======================================================================================
# Random specs with residual atoms, descriptor level
# =======================================================================================
RESIDUAL_ATOMS = [
    lambda c: (q - k) % 2 == 0,
    lambda c: k % (c + 2) != 0,
    lambda c: (k + q) % 3 < 2,
    lambda c: k % C == c % 2,
    lambda c: k * k <= q + c,
    lambda c: SEG.id(k) == SEG.id(q),
    lambda c: minimum(k, q) >= c,
]
FLOOR_ATOMS = [
    lambda c: k // (c + 1) <= q // (c + 1),
    lambda c: k // (c + 2) == q // (c + 2),
    lambda c: k // C >= q // C - 1,
    lambda c: (k + c) // 3 < A,
]


@st.composite
def residual_rules(draw, depth=2):
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        pool = draw(st.sampled_from([K_ATOMS, FLOOR_ATOMS, ROW_ATOMS, RESIDUAL_ATOMS,
                                     RESIDUAL_ATOMS]))
        return draw(st.sampled_from(pool))(draw(st.integers(0, 3)))
    kind = draw(st.sampled_from(["&", "&", "|", "|", "~"]))
    a = draw(residual_rules(depth - 1))
    if kind == "~":
        return ~a
    b = draw(residual_rules(depth - 1))
    return a & b if kind == "&" else a | b


@st.composite
def residual_specs(draw):
    regions = []
    try:
        for i in range(draw(st.integers(1, 2))):
            lo, hi = draw(st.sampled_from(BOUNDS)), draw(st.sampled_from(BOUNDS))
            regions.append(Region((lo, hi), draw(residual_rules()), name=f"r{i}"))
        spec = MaskSpec(regions)
    except ValueError as e:
        assert "provably overlap" in str(e) or "are empty for every" in str(e)
        assume(False)
    return spec


@settings(deadline=None)
@given(spec=residual_specs(), data=st.data())
def test_random_residual_specs_descriptor(spec, data):
    (nq, nk), tiles = data.draw(st.sampled_from(LAYOUTS))
    md = random_metadata(data.draw, spec, nq, nk, 2)
    cm = jcm.compile(spec, warn=False)
    desc = cm.instantiate(md, nq, nk, **_tile_kwargs(tiles), row_classes=False)
    check_descriptor(desc, spec.as_dense(md, nq, nk), nq, nk)


# =======================================================================================
# Random specs with residual atoms, attention (xla backend) forward and gradients
# =======================================================================================
ATT_N = 24
ATT_TILES = dict(block_q=8, block_kv=8, bwd_block_q=4, bwd_block_kv=8)


@functools.lru_cache(maxsize=None)
def _attention_fn(cm):
    def f(md, qx, kx, vx, do):
        # the residual lowering itself (a spec with residue classes would run those:
        # tests/test_row_classes.py)
        desc = cm.instantiate(md, ATT_N, ATT_N, **ATT_TILES, row_classes=False)
        (out, lse), vjp = jax.vjp(lambda a, b_, c: jcm.mask_attention(
            a, b_, c, desc, implementation="xla", return_residuals=True), qx, kx, vx)
        return out, lse, vjp((do, jnp.zeros_like(lse)))
    return jax.jit(f)


def _check_attention(spec, md, seed):
    cm = jcm.compile(spec, warn=False)
    ks = jax.random.split(jax.random.key(seed), 4)
    b = 2
    qx = jax.random.normal(ks[0], (b, ATT_N, 2, 8), jnp.float32)
    kx = jax.random.normal(ks[1], (b, ATT_N, 1, 8), jnp.float32)
    vx = jax.random.normal(ks[2], (b, ATT_N, 1, 8), jnp.float32)
    do = jax.random.normal(ks[3], (b, ATT_N, 2, 8), jnp.float32)
    out, lse, grads = _attention_fn(cm)(md, qx, kx, vx, do)
    mask = spec.as_dense(md, ATT_N, ATT_N)
    ho, hl = reference_attention(qx, kx, vx, mask, precision="high")
    lo, ll = reference_attention(qx, kx, vx, mask, precision="input")
    assert_within_policy(out, ho, lo, "out")
    assert_within_policy(lse, hl, ll, "lse")
    high, low = reference_gradients(qx, kx, vx, do, mask)
    for name, g, h, l_ in zip(("dq", "dk", "dv"), grads, high, low):
        assert_within_policy(g, h, l_, name)


@settings(deadline=None, max_examples=max(4, settings().max_examples // 4))
@given(spec=residual_specs(), data=st.data())
def test_random_residual_specs_attention(spec, data):
    md = random_metadata(data.draw, spec, ATT_N, ATT_N, 2)
    _check_attention(spec, md, data.draw(st.integers(0, 2 ** 16)))


@pytest.mark.parametrize("rule", [
    (k <= q) & (k >= q - 8) & ((q - k) % 2 == 0),            # dilated sliding window
    (k < 4) | ((k <= q) & (k >= q - 6)),                      # global tokens + window
    (k // 4 == q // 4) | ((k % 5 == 0) & (k <= q)),           # blocks + strided keys
    k * k <= q,                                               # no hull
], ids=["dilated", "global+window", "blocks+strided", "no-hull"])
def test_residual_masks_attention(rule):
    _check_attention(MaskSpec([Region((0, q_len), rule)]), None, 7)


# =======================================================================================
# Reporting and backend choice
# =======================================================================================
def test_explain_reports_intervals_residuals_and_backend():
    spec = MaskSpec([Region((0, A), k <= q, name="causal"),
                     Region((A, q_len), (k <= q) & (k >= q - 8) & ((q - k) % 2 == 0),
                            name="dilated")])
    text = jcm.compile(spec, warn=False).explain()
    assert "region 0 'causal': rows [0, a): 1 interval(s) in 1 slot(s)" in text
    assert "region 1 'dilated': rows [a, q_len): 1 interval(s) in 1 slot(s)" in text
    assert "residual predicate: (q - k) % 2 == 0" in text
    assert ("backend: cute on an SM90 GPU (hull intervals, the residual predicate emitted "
            "into partial tiles of the forward and backward), else xla") in text
    assert "backend: cute on an SM90 GPU (interval tables only), else xla" in text
    exact = jcm.compile(jcm.masks.causal()).explain()
    assert "residual" not in exact and "backend: cute on an SM90 GPU" in exact


def test_backends_explain_names_the_residual():
    spec = MaskSpec([Region((0, q_len), (k <= q) & (k % 3 == 0), name="strided")])
    text = backends.explain(mask=spec)
    assert "region 0 'strided': 1 interval(s), residual predicate: k % 3 == 0" in text
    if backends.get("cute").available() is None:
        assert "chosen: cute" in text
        assert "runs on: cute (hull intervals, the residual predicate emitted" in text
    else:
        assert "chosen: xla" in text
        assert ("runs on: xla (the hull intervals and the residual predicate serve it; xla "
                "is the backend this call takes)") in text
    ok = backends.explain(mask=jcm.masks.causal())
    assert "region 0: 1 interval(s)" in ok and "residual" not in ok.split("preprocess")[0]


def test_cute_takes_residual_masks_it_can_emit():
    """A residual mask runs on the CuTe kernels (its residual emitted as kernel code; H200:
    tests/gpu/test_cute_residual.py); one whose residual reads per-token segment ids does
    not, and the call says why."""
    cute = backends.get("cute")
    cm = _cm((k <= q) & ((q - k) % 2 == 0))
    call = backends.Call(dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=8,
                         num_kv_heads=8, softcap=False, has_fallback=bool(cm.fallback_regions),
                         num_intervals=cm.num_intervals,
                         residual_reason=backends.residual_reason_of(cm))
    assert cm.fallback_regions and cute.supports(call) is None
    refused = dataclasses.replace(call, residual_reason="the residual reads segment ids 'seg'")
    assert "residual predicate: the residual reads segment ids 'seg'" in cute.supports(refused)
    with pytest.raises(backends.BackendUnavailable, match="cannot run this call"):
        backends.select("cute", refused)


def test_cute_kernels_never_take_a_residual_they_cannot_emit():
    """Even through a hand-built call, the cute entry points refuse a residual mask whose
    residual cannot become kernel code (before touching the kernels, so this runs without
    a GPU)."""
    seg = SegmentIds("seg")
    cm = _cm((k <= q) & (seg.id(k) % 2 == seg.id(q) % 2))
    desc = cm.instantiate({"seg": np.zeros((1, 8), np.int32)}, 8, 8, block_q=4, block_kv=4,
                          bwd_block_q=4, bwd_block_kv=4)
    x = jnp.zeros((1, 8, 1, 64), jnp.bfloat16)
    cute = backends.get("cute")
    with pytest.raises(backends.BackendUnavailable, match="segment ids"):
        cute.forward(x, x, x, desc, 1.0, None)
    with pytest.raises(backends.BackendUnavailable, match="segment ids"):
        cute.backward(x, x, x, desc, 1.0, None, x, None, x)


def test_registry_and_explain_on_residual_masks():
    """The registry accepts a residual mask on cute by default, never one that reads
    per-token segment ids; explain says which and why."""
    from jcompilemask.lower.compiled import region_backend
    cute = backends.get("cute")
    cm = _cm((k <= q) & ((q - k) % 2 == 0))
    seg = SegmentIds("seg")
    cm_seg = _cm((k <= q) & (seg.id(k) % 2 == seg.id(q) % 2))
    mk = lambda c: backends.Call(  # noqa: E731
        dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=8, num_kv_heads=8,
        softcap=False, has_fallback=bool(c.residual_regions), num_intervals=c.num_intervals,
        residual_reason=backends.residual_reason_of(c))
    assert cute.supports(mk(cm)) is None
    assert region_backend(cm, 0).startswith("cute on an SM90 GPU (hull intervals")
    assert "segment ids 'seg'" in cute.supports(mk(cm_seg))
    assert "segment ids 'seg'" in region_backend(cm_seg, 0)


def test_tilelang_refuses_residuals_and_takes_shared_slots():
    tl = backends.get_preprocess("tilelang")
    assert "residual" in tl.supports(_cm((k <= q) & (k % 2 == 0)))
    # Shared slots (one run per slot group) are generated since session 7: the mock
    # interpreter matches the jnp preprocess bit for bit (tests/test_tilelang_codegen.py).
    assert tl.supports(jcm.compile(hstu_one_region())) is None
    assert tl.supports(jcm.compile(jcm.masks.hstu())) is None


def test_residual_tree_and_evaluator():
    cm = _cm((k <= q) & ((q - k) % 2 == 0))
    res = cm.residual(0, 0)
    assert isinstance(res, Pred) and str(res) == "(q - k) % 2 == 0"
    desc = cm.instantiate(None, 8, 8, block_q=4, block_kv=4, bwd_block_q=4, bwd_block_kv=4,
                          row_classes=False)
    rows = jnp.arange(8, dtype=jnp.int32)
    got = np.asarray(cm.residual_visibility(res, desc, rows, rows))[0, 0]
    want = (np.arange(8)[:, None] - np.arange(8)[None, :]) % 2 == 0
    np.testing.assert_array_equal(got, want)
    assert cm.slot_residuals(desc, rows, rows, "fwd").shape == (1, 1, 8, 8, 1)
    assert _cm(k <= q).slot_residuals(desc, rows, rows) is None


def test_cute_takes_any_k():
    """K > 8 (global tokens + a window lower to many runs per row): the CuTe kernels loop
    over the intervals past 8 (validated on the H200, tests/gpu/test_cute_any_k.py), so the
    registry sends such masks to them; explain() says so."""
    from jcompilemask.lower.compiled import region_backend
    cute = backends.get("cute")
    call = backends.Call(dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=8,
                         num_kv_heads=8, softcap=False, has_fallback=False, num_intervals=25)
    assert cute.supports(call) is None
    rule = functools.reduce(lambda a, b: a | b, [(k >= 8 * i) & (k < 8 * i + 2) for i in range(12)])
    many = _cm(rule & (k <= q))
    assert many.num_intervals > 8
    assert region_backend(many, 0).startswith("cute")
    assert backends.cute_backward_plan(128, 128, None, (64, 128), 17) is None
