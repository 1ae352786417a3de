"""Residue classes (``jcompilemask.lower.classes``): a mask whose regions pair each query
only with keys of its own class mod ``c`` runs one class's mask with the classes as heads.

* Detection: the spellings of the class atom, what the rest of a rule may hold (functions
  of ``q - k`` and the lengths), and what keeps a spec out (other atoms, metadata, ``h``,
  region bounds, mixed factors).
* The class spec is exact: its dense view, put back on the classes, is the spec's (random
  windows, dilations, offsets and lengths: hypothesis).
* Descriptors: :class:`ClassDescriptor` at lengths that are multiples of ``c`` (dense
  views in the sequence's coordinates, jit / pytree), the sequence-coordinate descriptor
  otherwise or with ``row_classes=False`` / ``$JCOMPILEMASK_ROW_CLASSES=0``.
* ``mask_attention`` (xla backend) against the dense reference, forward, lse and
  gradients: GQA, bias, unbatched inputs, ``return_residual``, a prebuilt descriptor
  inside ``jit``; the classes and the residual lowering agree.
* Reporting; ring attention (context parallelism) over the class sequence.
* Per-class metadata: segment ids read as run bounds (packed documents with a dilated
  window), each class its own descriptor, exact for any ids (hypothesis), through
  attention, a bias, jit with traced metadata and the ring.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jcompilemask as jcm
from jcompilemask.lower.classes import ENV, find_row_classes
from jcompilemask.spec import MaskSpec, Region, Scalar, SegmentIds, k, kv_len, q, q_len
from jcompilemask.spec.expr import h
from jcompilemask.testing import (assert_within_policy, reference_attention,
                                  reference_gradients)

DILATED = (k <= q) & (k > q - 8) & ((q - k) % 2 == 0)


def _spec(rule, rows=(0, q_len), **kw):
    return MaskSpec([Region(rows, rule)], **kw)


def _reassembled(rc, nq, nk):
    """The class spec's dense view put back on the classes: [nq, nk]."""
    c = rc.factor
    cls = np.asarray(rc.spec.as_dense(None, nq // c, nk // c))[0, 0]
    out = np.zeros((nq, nk), bool)
    for r in range(c):
        out[r::c, r::c] = cls
    return out


# =======================================================================================
# Detection
# =======================================================================================
@pytest.mark.parametrize("rule, factor", [
    (DILATED, 2),
    ((q - k) % 3 == 0, 3),
    ((k - q) % 4 == 0, 4),
    ((q - k + 6) % 3 == 0, 3),
    (0 == (q - k) % 2, 2),
    ((q % 5 == k % 5) & (k <= q), 5),
    ((k % 2 == q % 2) & (q - k < 9) & (k - q < 9), 2),
    ((k <= q) & ((q - k) % 2 == 0) & ((q - k) % 3 == 0), 6),
    ((k <= q) & (k >= q - kv_len + 3) & ((q - k) % 2 == 0), 2),
    ((k <= q) & ((q - k) % 2 == 0) & (q - k != 4), 2),
    (((k <= q) | (k >= q + 10)) & ((q - k) % 2 == 0), 2),
], ids=["dilated", "plain3", "k-q", "offset", "zero-left", "q%c==k%c", "two-sided",
        "lcm", "kv_len", "not-equal", "or-of-differences"])
def test_factorizations_are_found_and_exact(rule, factor):
    spec = _spec(rule)
    rc = find_row_classes(spec)
    assert rc is not None and rc.factor == factor
    for n in (factor * 5, factor * 8):
        want = np.asarray(spec.as_dense(None, n, n))[0, 0]
        assert (_reassembled(rc, n, n) == want).all()
    # the class mask has no residual: intervals only
    assert not jcm.compile(rc.spec).residual_regions


@pytest.mark.parametrize("spec", [
    _spec((k <= q) & (k > q - 8)),                                   # no class atom
    _spec((k < 4) | DILATED),                                        # not a conjunct
    _spec((k < 16) & ((q - k) % 2 == 0)),                            # k alone
    _spec((q < 16) & ((q - k) % 2 == 0)),                            # q alone
    _spec((k // 4 <= q // 4) & ((q - k) % 2 == 0)),                  # floor of k
    _spec(((q - k) // 2 < 3) & ((q - k) % 2 == 0)),                  # hidden q - k
    _spec((k <= q) & ((2 * q - k) % 2 == 0)),                        # 2q - k: k even
    _spec((k <= q) & ((q - k) % 2 == 1)),                            # the other class
    _spec((k <= q) & (q - k < Scalar("w", max=q_len)) & ((q - k) % 2 == 0)),   # metadata
    _spec((h == 0) & ((q - k) % 2 == 0), num_heads=2),              # per head
    MaskSpec([Region((0, 3), (q - k) % 2 == 0),                      # bound not a multiple
              Region((3, q_len), k <= q)]),
    MaskSpec([Region((0, 4), (q - k) % 2 == 0),                      # mixed factors
              Region((4, q_len), (q - k) % 4 == 0)]),
    MaskSpec([Region((0, 4), (q - k) % 2 == 0),                      # a region without
              Region((4, q_len), k <= q)]),
], ids=["none", "or", "k-alone", "q-alone", "floor", "hidden", "2q-k", "odd-class",
        "metadata", "per-head", "bound", "mixed", "region-without"])
def test_specs_that_do_not_factor(spec):
    assert find_row_classes(spec) is None
    assert jcm.compile(spec, warn=False).classes_for(8, 8) == 1


def test_regions_with_constant_bounds_and_a_region_that_sees_nothing():
    spec = MaskSpec([Region((0, 4), ((q - k) % 2 == 0) & (k <= q)),
                     Region((4, 10), False),
                     Region((10, q_len), ((q - k) % 2 == 0) & (k >= q - 4))])
    rc = find_row_classes(spec)
    assert rc.factor == 2
    assert [tuple(str(b) for b in r.rows) for r in rc.spec.regions] == \
        [("0", "2"), ("2", "5"), ("5", "q_len")]
    for n in (12, 16, 20):
        assert (_reassembled(rc, n, n) == np.asarray(spec.as_dense(None, n, n))[0, 0]).all()


@settings(deadline=None, max_examples=40)
@given(window=st.integers(1, 40), dilation=st.integers(2, 5), shift=st.integers(-6, 6),
       causal=st.booleans(), mult=st.integers(1, 6), extra=st.integers(1, 3))
def test_random_dilated_windows_are_exact(window, dilation, shift, causal, mult, extra):
    """Windows of any width, offset and dilation: the class spec put back on the classes
    equals the spec, at every length that is a multiple of the dilation."""
    rule = (k > q - window + shift) & ((q - k) % dilation == 0)
    rule = rule & (k <= q + shift) if causal else rule & (k < q + window + shift)
    spec = _spec(rule)
    rc = find_row_classes(spec)
    assert rc is not None and rc.factor == dilation
    nq, nk = dilation * mult, dilation * (mult + extra)
    want = np.asarray(spec.as_dense(None, nq, nk))[0, 0]
    assert (_reassembled(rc, nq, nk) == want).all()


# =======================================================================================
# Descriptors
# =======================================================================================
def test_class_descriptor_dense_views_and_pytree():
    spec = _spec(DILATED)
    cm = jcm.compile(spec)
    d = cm.instantiate(None, 24, 24, block_q=4, block_kv=4, bwd_block_q=4, bwd_block_kv=4)
    assert isinstance(d, jcm.ClassDescriptor)
    assert (d.classes, d.q_len, d.kv_len, d.inner.q_len) == (2, 24, 24, 12)
    want = np.asarray(spec.as_dense(None, 24, 24))
    for view in ("fwd", "bwd"):
        assert (np.asarray(d.as_dense(view)) == want).all()
    assert d.inner.mask is cm.class_mask and d.mask is cm
    assert d.num_intervals == 1 and d.tiles == d.inner.tiles
    assert "2 residue classes" in d.to_string()
    leaves, tree = jax.tree_util.tree_flatten(d)
    d2 = jax.tree_util.tree_unflatten(tree, leaves)
    assert isinstance(d2, jcm.ClassDescriptor) and d2.classes == 2
    built = jax.jit(lambda: cm.instantiate(None, 24, 24))()
    assert isinstance(built, jcm.ClassDescriptor)
    with pytest.raises(AttributeError, match="not an array"):
        d.ndim  # noqa: B018


def test_lengths_that_are_not_multiples_and_the_switches(monkeypatch):
    from jcompilemask.lower import compiled
    monkeypatch.setattr(compiled, "_odd_lengths", set())     # each is reported once
    cm = jcm.compile(_spec(DILATED))
    with pytest.warns(jcm.MaskFallbackWarning, match="q_len=23, kv_len=23"):
        assert isinstance(cm.instantiate(None, 23, 23), jcm.ExecutionDescriptor)
    with pytest.warns(jcm.MaskFallbackWarning, match="pad the sequences"):
        assert isinstance(cm.instantiate(None, 24, 23), jcm.ExecutionDescriptor)
    assert isinstance(cm.instantiate(None, 24, 24, row_classes=False), jcm.ExecutionDescriptor)
    with pytest.raises(ValueError, match="multiples of 2"):
        cm.instantiate(None, 23, 23, row_classes=True)
    with pytest.raises(ValueError, match="cannot run as residue classes"):
        jcm.compile(jcm.masks.causal()).instantiate(None, 8, 8, row_classes=True)
    with pytest.raises(TypeError, match="row_classes must be"):
        cm.instantiate(None, 24, 24, row_classes="yes")
    monkeypatch.setenv(ENV, "0")
    assert isinstance(cm.instantiate(None, 24, 24), jcm.ExecutionDescriptor)
    assert isinstance(cm.instantiate(None, 24, 24, row_classes=True), jcm.ClassDescriptor)
    monkeypatch.setenv(ENV, "2")
    with pytest.raises(ValueError, match=ENV):
        cm.instantiate(None, 24, 24)


# =======================================================================================
# mask_attention against the dense reference (xla backend)
# =======================================================================================
def _inputs(seed, b, n, hq, hk, d=8, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    mk = lambda kk, hh: jax.random.normal(kk, (b, n, hh, d), jnp.float32).astype(dtype)  # noqa
    return mk(ks[0], hq), mk(ks[1], hk), mk(ks[2], hk), mk(ks[3], hq)


@jax.jit
def _references(qx, kx, vx, do, mask):
    """The dense reference's forward at both precisions and its two reference gradients
    (jcompilemask.testing), as one program: the mask is an argument, so calls at one shape
    share the compilation."""
    return (reference_attention(qx, kx, vx, mask, precision="high"),
            reference_attention(qx, kx, vx, mask, precision="input"),
            reference_gradients(qx, kx, vx, do, mask))


def _check(spec, qx, kx, vx, do, mask_arg=None, md=None, **kw):
    n = qx.shape[1]
    mask = spec.as_dense(md, n, n)
    arg = spec if mask_arg is None else mask_arg
    if md is not None and mask_arg is None:
        kw["metadata"] = md

    def loss(a, b_, c):
        out, lse = jcm.mask_attention(a, b_, c, arg, implementation="xla",
                                      return_residual=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), (out, lse)
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(qx, kx, vx)
    bias = kw.get("bias")
    if bias is None:
        (ho, hl), (lo, ll), (high, low) = _references(qx, kx, vx, do, mask)
    else:
        ho, hl = lo, ll = jax.jit(_biased)(qx, kx, vx, mask, bias)
    assert_within_policy(out, ho, lo, "out")
    assert_within_policy(jnp.swapaxes(lse, 1, 2), hl, ll, "lse")
    if bias is None:
        for name, g, hi, lw in zip(("dq", "dk", "dv"), grads, high, low):
            assert_within_policy(g, hi, lw, name)
    return out, lse, grads


def _biased(qx, kx, vx, mask, bias):
    g = qx.shape[2] // kx.shape[2]
    kr, vr = jnp.repeat(kx, g, 2), jnp.repeat(vx, g, 2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qx, kr) / np.sqrt(qx.shape[-1]) + bias
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, -1)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vr), lse


@pytest.mark.parametrize("hq, hk", [(2, 2), (4, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rule", [
    DILATED,
    (q % 3 == k % 3) & (q - k < 10) & (k - q < 7),
    (k <= q) & ((q - k) % 4 == 0),
], ids=["dilated", "bidirectional3", "causal4"])
def test_attention_matches_the_dense_reference(rule, hq, hk):
    spec = _spec(rule)
    rc = find_row_classes(spec)
    n = 12 * rc.factor
    _check(spec, *_inputs(3, 2, n, hq, hk))


def test_classes_and_the_residual_lowering_agree(monkeypatch):
    spec = _spec(DILATED)
    args = _inputs(5, 2, 32, 4, 2)
    out_c, lse_c, g_c = _check(spec, *args)
    monkeypatch.setenv(ENV, "0")
    out_r, lse_r, g_r = _check(spec, *args)
    np.testing.assert_allclose(out_c, out_r, atol=2e-6)
    np.testing.assert_allclose(lse_c, lse_r, atol=2e-6)
    for a, b_ in zip(g_c, g_r):
        np.testing.assert_allclose(a, b_, atol=2e-6)


def test_bias_is_gathered_per_class():
    spec = _spec(DILATED)
    qx, kx, vx, do = _inputs(7, 2, 16, 4, 2)
    bias = jax.random.normal(jax.random.key(9), (2, 4, 16, 16))
    _check(spec, qx, kx, vx, do, bias=bias)
    # a broadcast bias (one head, one batch) and its gradient
    b1 = bias[:1, :1]
    ref = jax.jit(jax.grad(lambda bb: jnp.sum(
        _biased(qx, kx, vx, spec.as_dense(None, 16, 16), bb)[0] * do)))(b1)
    got = jax.jit(jax.grad(lambda bb: jnp.sum(jcm.mask_attention(
        qx, kx, vx, spec, bias=bb, implementation="xla") * do)))(b1)
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_prebuilt_descriptor_inside_jit_and_unbatched_inputs():
    spec = _spec(DILATED)
    qx, kx, vx, do = _inputs(11, 2, 20, 2, 2)
    d = jcm.compile(spec).instantiate(None, 20, 20)
    _check(spec, qx, kx, vx, do, mask_arg=d)
    out = jcm.mask_attention(qx[0], kx[0], vx[0], spec, implementation="xla")
    ref, _ = reference_attention(qx[:1], kx[:1], vx[:1], spec.as_dense(None, 20, 20))
    np.testing.assert_allclose(out, ref[0], atol=1e-5)


def test_is_causal_and_window_arguments_keep_the_classes():
    """jax.nn's is_causal / local_window_size become rules of q - k: still classes."""
    spec = _spec((q - k) % 2 == 0)
    qx, kx, vx, do = _inputs(13, 1, 16, 2, 2)
    got = jcm.mask_attention(qx, kx, vx, spec, is_causal=True, local_window_size=(5, 0),
                             implementation="xla")
    rows, cols = np.arange(16)[:, None], np.arange(16)[None, :]
    dense = ((rows - cols) % 2 == 0) & (cols <= rows) & (cols >= rows - 5)
    ref, _ = reference_attention(qx, kx, vx, dense)
    np.testing.assert_allclose(got, ref, atol=1e-5)


# =======================================================================================
# Reporting and the paths without classes
# =======================================================================================
def test_explain_reports_the_classes():
    cm = jcm.compile(_spec(DILATED))
    text = cm.explain()
    assert "residue classes: each query sees only keys of its class mod 2" in text
    assert "class region 0: rows [0, q_len): (k - q <= 0) & (k - q > -4)" in text
    report = jcm.backends.explain(mask=cm)
    assert "residue classes mod 2" in report and "no residual" in report


def test_no_fallback_warning_for_a_spec_that_runs_as_classes():
    import warnings
    rule = (k <= q) & (k > q - 12) & ((k - q) % 2 == 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jcm.MaskFallbackWarning)
        jcm.compile(_spec(rule))


def _ring(mask, layout=None):
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    return jax.jit(jax.shard_map(
        lambda a, b_, c: jcm.mask_attention(a, b_, c, mask, context_axis="cp",
                                            context_layout=layout, return_residual=True),
        mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp")))


@pytest.mark.parametrize("arg", ["descriptor", "spec"])
def test_ring_attention_runs_the_classes(arg):
    """The ring takes a ClassDescriptor (or builds one from the spec): each shard viewed
    with the classes as heads is its chunks of the class sequence. On one device with two
    chunks it must equal mask_attention (the multi-device cases run in
    tests/scripts/context_parallel_check.py)."""
    spec = _spec(DILATED)
    t = dict(block_q=4, block_kv=4, bwd_block_q=4, bwd_block_kv=4)
    d = jcm.compile(spec).instantiate(None, 16, 16, **t)
    assert isinstance(d, jcm.ClassDescriptor)
    qx, kx, vx, do = _inputs(3, 2, 16, 4, 2)
    if arg == "spec":        # built inside the ring at the xla tiles of a chunk
        f = _ring(spec, layout=(1, 0))
        perm = lambda x: jnp.concatenate([x[:, 8:], x[:, :8]], 1)   # noqa: E731
    else:
        f = _ring(d)
        perm = lambda x: x   # noqa: E731

    def loss(a, b_, c):
        out, lse = f(perm(a), perm(b_), perm(c))
        return out, lse
    (out, lse), pull = jax.vjp(loss, qx, kx, vx)
    (r_out, r_lse), r_pull = jax.vjp(
        lambda a, b_, c: jcm.mask_attention(a, b_, c, d, return_residual=True), qx, kx, vx)
    np.testing.assert_allclose(perm(r_out), out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(perm(r_lse), lse, rtol=1e-5, atol=1e-5)
    for g, r in zip(pull((perm(do), jnp.zeros_like(lse))), r_pull((do, jnp.zeros_like(r_lse)))):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_ring_attention_names_the_fix_where_a_chunk_splits_a_class_row():
    spec = _spec(DILATED)
    d = jcm.compile(spec).instantiate(None, 18, 18)
    qx, _, _, _ = _inputs(1, 1, 18, 2, 2)
    # 18 rows in 2 chunks of 9: a chunk would start inside a class row
    with pytest.raises(ValueError, match="a chunk must start at a multiple of 2"):
        _ring(d, layout=(0, 1))(qx, qx, qx)
    # the spec takes its residual lowering there, which the ring refuses, naming both fixes
    with pytest.raises(ValueError, match="fall back to an element predicate.*residue classes"):
        _ring(spec, layout=(0, 1))(qx, qx, qx)


def test_ring_attention_residual_lowering_when_classes_are_off(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    qx, _, _, _ = _inputs(1, 1, 16, 2, 2)
    with pytest.raises(ValueError, match=f"{ENV}=0 turns them off"):
        _ring(_spec(DILATED))(qx, qx, qx)


def test_ring_plans_read_a_class_descriptor_as_its_class_sequence():
    from jcompilemask import parallel as par
    from jcompilemask.parallel.plan import chunk_size
    t = dict(block_q=4, block_kv=4, bwd_block_q=4, bwd_block_kv=4)
    spec = _spec((k <= q) & (k > q - 24) & ((q - k) % 3 == 0))
    d = jcm.compile(spec).instantiate(None, 96, 96, **t)
    assert d.classes == 3
    inner = d.inner
    assert chunk_size(d, 4) == 24 and chunk_size(inner, 4) == 8
    np.testing.assert_array_equal(par.chunk_visibility(d, 4), par.chunk_visibility(inner, 4))
    # a row's work is its visible keys: the dense view's row sums
    dense = np.asarray(d.as_dense()).sum((0, 1)).sum(-1)
    np.testing.assert_array_equal(par.row_work(d), dense)
    lay = par.balance_permutation(d, 2, 2)
    assert lay == par.balance_permutation(inner, 2, 2)
    rep = par.cost_report(d, par.ring_plan(d, 2, lay), kv_bytes_per_token=1)
    assert rep["chunk_rows"] == 24 and sum(rep["work_per_device"]) == dense.sum()
    with pytest.raises(ValueError, match="multiple of 5 chunks x 3"):
        chunk_size(d, 5)
    with pytest.raises(ValueError, match="runs as 3 residue classes"):
        chunk_size(d, 16)              # 6 rows a chunk, 2 of each class: not 4-row tiles


def test_builtin_dilated_window():
    m = jcm.masks.dilated_window(6, 2, dilation=3)
    rows, cols = np.arange(12)[:, None], np.arange(12)[None, :]
    want = (cols >= rows - 6) & (cols <= rows + 2) & ((rows - cols) % 3 == 0)
    assert (np.asarray(m.as_dense(None, 12))[0, 0] == want).all()
    cm = jcm.compile(m)
    assert cm.row_classes.factor == 3 and isinstance(cm.instantiate(None, 12, 12),
                                                     jcm.ClassDescriptor)
    assert jcm.compile(jcm.masks.dilated_window(6, dilation=1)).row_classes is None
    qx, kx, vx, do = _inputs(17, 2, 24, 2, 1)
    _check(jcm.masks.dilated_window(8, 3, dilation=2), qx, kx, vx, do)
    for bad in (dict(dilation=0), dict(dilation=True), dict(dilation=2.0)):
        with pytest.raises(ValueError, match="dilation must be a positive int"):
            jcm.masks.dilated_window(4, **bad)
    with pytest.raises(ValueError, match="left must be"):
        jcm.masks.dilated_window(-1)


def test_vmap_over_a_leading_axis():
    spec = _spec(DILATED)
    qx, kx, vx, _ = _inputs(19, 2, 16, 2, 2)
    stack = lambda x: jnp.stack([x, 2 * x])  # noqa: E731
    got = jax.vmap(lambda a, b_, c: jcm.mask_attention(a, b_, c, spec, implementation="xla"))(
        stack(qx), stack(kx), stack(vx))
    for i, s in enumerate((1, 2)):
        ref, _ = reference_attention(s * qx, s * kx, s * vx, spec.as_dense(None, 16, 16))
        np.testing.assert_allclose(got[i], ref, atol=1e-5)


def test_lengths_that_miss_the_classes_are_reported_once(monkeypatch):
    from jcompilemask.lower import compiled
    monkeypatch.setattr(compiled, "_odd_lengths", set())
    cm = jcm.compile(_spec((k <= q) & (k > q - 10) & ((q - k) % 2 == 0)))
    with pytest.warns(jcm.MaskFallbackWarning, match="multiples of 2"):
        cm.instantiate(None, 21, 21)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", jcm.MaskFallbackWarning)
        cm.instantiate(None, 21, 21)                   # once per lengths
        cm.instantiate(None, 21, 21, row_classes=False)


@settings(deadline=None, max_examples=60)
@given(alpha=st.sampled_from([-3, -2, -1, 1, 2, 3]), beta=st.integers(-1, 1),
       gamma=st.integers(-1, 1), d=st.integers(-20, 20),
       op=st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), c=st.integers(2, 4),
       mq=st.integers(1, 5), mk=st.integers(1, 5))
def test_random_class_atoms_are_exact(alpha, beta, gamma, d, op, c, mq, mk):
    """Any comparison alpha (q - k) + beta q_len + gamma kv_len + d OP 0, with the class
    atom: its class form (divided by c, the constant rounded per OP) gives the same mask at
    unequal lengths."""
    from jcompilemask.spec.expr import Cmp, Const
    lhs = alpha * (q - k) + beta * q_len + gamma * kv_len + d
    spec = _spec(Cmp(op, lhs, Const(0)) & ((q - k) % c == 0))
    rc = find_row_classes(spec)
    assert rc is not None and rc.factor == c
    nq, nk = c * mq, c * mk
    want = np.asarray(spec.as_dense(None, nq, nk))[0, 0]
    assert (_reassembled(rc, nq, nk) == want).all()


# =======================================================================================
# Per-class metadata: packed documents with a dilated window
# =======================================================================================
SEG = SegmentIds("segment_ids")
CSEG = SegmentIds("segment_ids", contiguous=True)
DOC = (k >= SEG.start(q)) & (k < SEG.end(q))


def _ids(rng, b, n, contiguous=False):
    ids = rng.integers(-1, 4, (b, n))
    if contiguous:
        ids = np.sort(ids, axis=1)
    return {"segment_ids": ids.astype(np.int32)}


@pytest.mark.parametrize("rule, factor", [
    (DOC & DILATED, 2),
    ((k >= SEG.run_start(q)) & (SEG.run_end(q) > k) & ((q - k) % 3 == 0), 3),
    ((q >= SEG.start(k)) & (q < SEG.end(k)) & (k <= q) & (q % 2 == k % 2), 2),
    ((CSEG.id(k) == CSEG.id(q)) & DILATED, 2),           # ids declared contiguous: one run
])
def test_segment_run_bounds_factor_with_per_class_metadata(rule, factor):
    rc = find_row_classes(_spec(rule))
    assert rc is not None and rc.factor == factor and rc.segments == ("segment_ids",)


@pytest.mark.parametrize("rule", [
    (SEG.id(k) == SEG.id(q)) & DILATED,                       # ids, not run bounds
    (k > SEG.start(q)) & DILATED,                             # strict: not one class bound
    (k >= SEG.start(q) + 1) & DILATED,
    (k >= SEG.start(q - 1)) & DILATED,                        # read at q - 1
    DOC & DILATED & (k < Scalar("s", max=q_len)),             # a scalar
])
def test_segment_reads_that_do_not_factor(rule):
    assert find_row_classes(_spec(rule)) is None


@jax.jit
def _dense_views(d):
    """Both dense views of a descriptor as one program (evaluated eagerly, each op of a new
    shape compiles on its own; the eager views are checked in the tests above and below)."""
    return {view: d.as_dense(view) for view in ("fwd", "bwd")}


# 20 examples (each a new mask and lengths: one compiled preprocess); fixed per-class cases
# run below (contiguous ids, the built-in, runs split by one token, attention, the ring)
# and in tests/scripts/sharding_check.py and context_parallel_check.py.
@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 4), st.integers(1, 20),
       st.booleans(), st.booleans(), st.integers(1, 3))
def test_per_class_descriptors_are_exact(seed, c, window, causal, contiguous, b):
    """Random ids (runs of one id split by short runs, padding, contiguous or not) and
    lengths (q_len != kv_len too): every view of the class descriptor equals the spec's
    dense view."""
    rng = np.random.default_rng(seed)
    rule = DOC & (k > q - window) & ((q - k) % c == 0)
    rule = rule & (k <= q) if causal else rule & (k < q + window)
    spec = _spec(rule)
    nq, nk = (c * int(x) for x in rng.integers(3, 12, 2))      # unequal lengths too
    md = _ids(rng, b, max(nq, nk), contiguous)
    d = jcm.compile(spec).instantiate(md, nq, nk, block_q=4, block_kv=4, bwd_block_q=4,
                                      bwd_block_kv=4)
    assert isinstance(d, jcm.ClassDescriptor) and d.per_class and d.mask_heads == 1
    assert d.inner.mask_heads == c and d.batch == b
    want = np.asarray(spec.as_dense(md, nq, nk))
    for view, got in _dense_views(d).items():
        assert (np.asarray(got) == want).all(), view


def test_class_segment_ids_keep_runs_apart():
    from jcompilemask.lower.classes import class_segment_ids
    # id 0 in two runs around a one-token run of 1: class 0 must not join them
    ids = np.array([[0, 0, 1, 0, 0, 0, -1, -1]], np.int32)
    out = np.asarray(class_segment_ids(ids, 2))
    assert out.tolist() == [[0, 1, 2, -4], [0, 2, 2, -4]]
    spec = _spec(DOC & (k <= q) & ((q - k) % 2 == 0))
    d = jcm.compile(spec).instantiate({"segment_ids": ids}, 8, 8)
    assert (np.asarray(d.as_dense()) == np.asarray(spec.as_dense({"segment_ids": ids}, 8))).all()


@pytest.mark.parametrize("hq, hk", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_packed_documents_with_a_dilated_window_attend_exactly(hq, hk):
    rng = np.random.default_rng(5)
    spec = _spec(DOC & DILATED)
    md = _ids(rng, 2, 32)
    assert isinstance(jcm.compile(spec).instantiate(md, 32, 32), jcm.ClassDescriptor)
    _check(spec, *_inputs(7, 2, 32, hq, hk), md=md)


def test_per_class_bias_jit_and_traced_metadata():
    rng = np.random.default_rng(6)
    spec = _spec(DOC & DILATED)
    md = _ids(rng, 2, 24)
    qx, kx, vx, do = _inputs(8, 2, 24, 4, 2)
    bias = jax.random.normal(jax.random.key(9), (2, 4, 24, 24), jnp.float32)
    _check(spec, qx, kx, vx, do, md=md, bias=bias)
    cm = jcm.compile(spec)

    @jax.jit
    def f(a, b_, c, ids):
        d = cm.instantiate({"segment_ids": ids}, 24, 24)
        assert isinstance(d, jcm.ClassDescriptor) and d.per_class
        return jcm.mask_attention(a, b_, c, d, implementation="xla")
    out = f(qx, kx, vx, md["segment_ids"])
    ref, _ = reference_attention(qx, kx, vx, spec.as_dense(md, 24, 24), precision="high")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


def test_per_class_ring_on_one_device():
    rng = np.random.default_rng(10)
    spec = _spec(DOC & DILATED)
    md = _ids(rng, 2, 16)
    t = dict(block_q=4, block_kv=4, bwd_block_q=4, bwd_block_kv=4)
    d = jcm.compile(spec).instantiate(md, 16, 16, **t)
    qx, kx, vx, _ = _inputs(11, 2, 16, 4, 2)
    out, lse = _ring(d, layout=(1, 0))(*(jnp.concatenate([x[:, 8:], x[:, :8]], 1)
                                         for x in (qx, kx, vx)))
    out = jnp.concatenate([out[:, 8:], out[:, :8]], 1)
    ref, _ = reference_attention(qx, kx, vx, spec.as_dense(md, 16, 16), precision="high")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    from jcompilemask import parallel as par
    w = par.row_work(d)
    np.testing.assert_array_equal(w, np.asarray(d.as_dense()).sum((0, 1, 3)))


def test_builtin_dilated_window_over_packed_documents():
    m = jcm.masks.dilated_window(10, 2, dilation=2, documents=True)
    ids = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, -1, -1]], np.int32)
    d = jcm.compile(m).instantiate({"segment_ids": ids}, 12, 12)
    assert isinstance(d, jcm.ClassDescriptor) and d.per_class
    want = np.asarray(m.as_dense({"segment_ids": ids}, 12))
    assert (np.asarray(d.as_dense()) == want).all()
    assert not want[0, 0, 3, :3].any() and not want[0, 0, 10:].any()   # documents, padding
    with pytest.raises(TypeError, match="documents must be True or False"):
        jcm.masks.dilated_window(4, documents=1)


def test_contiguous_id_spelling_runs_as_per_class_classes():
    """``docs.id(k) == docs.id(q)`` with ids declared contiguous (sorted, padding first or
    last): per-class classes, exact against the dense view and through attention."""
    spec = _spec((CSEG.id(k) == CSEG.id(q)) & DILATED)
    rng = np.random.default_rng(12)
    md = _ids(rng, 2, 32, contiguous=True)
    d = jcm.compile(spec).instantiate(md, 32, 32, block_q=4, block_kv=4, bwd_block_q=4,
                                      bwd_block_kv=4)
    assert isinstance(d, jcm.ClassDescriptor) and d.per_class
    want = np.asarray(spec.as_dense(md, 32, 32))
    for view in ("fwd", "bwd"):
        assert (np.asarray(d.as_dense(view)) == want).all(), view
    _check(spec, *_inputs(13, 2, 32, 4, 2), md=md)


def test_per_class_under_vmap_with_batched_metadata():
    """vmap over stacked inputs and stacked segment ids: each slice builds its own per-class
    descriptor inside the trace."""
    spec = _spec(DOC & DILATED)
    rng = np.random.default_rng(14)
    qx, kx, vx, _ = _inputs(15, 2, 16, 2, 2)
    ids = np.stack([_ids(rng, 2, 16)["segment_ids"] for _ in range(2)])
    stack = lambda x: jnp.stack([x, 2 * x])  # noqa: E731
    got = jax.vmap(lambda a, b_, c, s: jcm.mask_attention(
        a, b_, c, spec, metadata={"segment_ids": s}, implementation="xla"))(
        stack(qx), stack(kx), stack(vx), jnp.asarray(ids))
    for i, s in enumerate((1, 2)):
        md = {"segment_ids": ids[i]}
        ref, _ = reference_attention(s * qx, s * kx, s * vx, spec.as_dense(md, 16, 16))
        np.testing.assert_allclose(got[i], ref, atol=1e-5)


@pytest.mark.parametrize("spec, why", [
    (_spec(DILATED & (k < Scalar("s", max=q_len))), "reads metadata 's' (a Scalar)"),
    (_spec(DILATED & (k < 16)), "atom `k < 16` of region 0 is neither"),
    (MaskSpec([Region((0, q_len), DILATED & (k <= q + h))], num_heads=2), "per-head mask"),
    (MaskSpec([Region((0, 5), DILATED), Region((5, q_len), DILATED)]),
     "region 0's rows [0, 5) are not bounded by multiples of 2"),
    (MaskSpec([Region((0, 4), DILATED), Region((4, q_len), k <= q)]),
     "region 1 has no class atom"),
    (MaskSpec([Region((0, 6), DILATED), Region((6, q_len), (q - k) % 3 == 0)]),
     "different factors [2, 3]"),
])
def test_why_a_spec_with_a_class_atom_does_not_factor(spec, why):
    """The reason reaches the fallback warning and row_classes=True's error."""
    import warnings
    from jcompilemask.lower.classes import why_no_row_classes
    assert why in why_no_row_classes(spec)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cm = jcm.compile(spec)
    msgs = [str(x.message) for x in seen if issubclass(x.category, jcm.MaskFallbackWarning)]
    assert msgs and all(why in m for m in msgs), msgs
    with pytest.raises(ValueError, match="cannot run as residue classes"):
        cm.classes_for(12, 12, True)


def test_no_class_reason_without_a_class_atom_or_when_it_factors():
    from jcompilemask.lower.classes import why_no_row_classes
    assert why_no_row_classes(_spec((k <= q) & (k % 4 != 1))) is None
    assert why_no_row_classes(_spec(DILATED)) is None
