"""mask_attention as a jax.nn.dot_product_attention user calls it: jax's keywords and
layouts against jax itself, the messages for common mistakes, the fallback warning of
compile(), the registry's notice when a faster backend is passed over, progress logging,
and the README's claims."""
import dataclasses
import logging
import pathlib
import re
import time
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jcompilemask as jcm
from jcompilemask import _progress, backends
from jcompilemask.spec import MaskSpec, Region, k, q, q_len

B, N, H, D = 2, 20, 4, 8
LENS = jnp.array([15, 9], jnp.int32)
QLENS = jnp.array([20, 11], jnp.int32)


def _qkv(seed=0, b=B, n=N, h=H, hkv=H):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (b, n, h, D)), jax.random.normal(ks[1], (b, n, hkv, D)),
            jax.random.normal(ks[2], (b, n, hkv, D)))


def _close(a, b, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=2e-5)


# -- jax's keywords, checked against jax ------------------------------------------------
@pytest.mark.parametrize("kw", [
    dict(is_causal=True),
    dict(key_value_seq_lengths=LENS),
    dict(query_seq_lengths=QLENS, key_value_seq_lengths=LENS, is_causal=True),
    dict(local_window_size=(3, 2)),
    dict(local_window_size=2, is_causal=True),
], ids=["causal", "kv_lengths", "lengths_causal", "window", "window_int_causal"])
def test_jax_masking_keywords_match_jax(kw):
    q_, k_, v_ = _qkv()
    f = lambda q_, k_, v_: jnp.sum(jnp.sin(jcm.mask_attention(q_, k_, v_, **kw)))  # noqa: E731
    g = lambda q_, k_, v_: jnp.sum(jnp.sin(jax.nn.dot_product_attention(q_, k_, v_, **kw)))  # noqa: E731
    _close(jcm.mask_attention(q_, k_, v_, **kw), jax.nn.dot_product_attention(q_, k_, v_, **kw))
    for a, b in zip(jax.grad(f, (0, 1, 2))(q_, k_, v_), jax.grad(g, (0, 1, 2))(q_, k_, v_)):
        _close(a, b, atol=5e-5)


def test_lengths_combine_with_a_maskspec_and_do_not_recompile():
    q_, k_, v_ = _qkv(1)
    doc = jcm.masks.document()
    seg = jnp.array([[0] * 12 + [1] * 8, [0] * 20])
    traces = []

    @jax.jit
    def f(q_, k_, v_, seg, lens):
        traces.append(1)
        return jcm.mask_attention(q_, k_, v_, doc, metadata={"segment_ids": seg},
                                  key_value_seq_lengths=lens, is_causal=True)

    for lens in (LENS, jnp.array([20, 3], jnp.int32)):
        dense = (doc.as_dense({"segment_ids": seg}, N, N)
                 & (jnp.arange(N)[None, :] < lens[:, None])[:, None, None, :])
        _close(f(q_, k_, v_, seg, lens), jax.nn.dot_product_attention(q_, k_, v_, mask=dense))
    assert len(traces) == 1


@pytest.mark.parametrize("shape", [(B, H, N, N), (1, H, N, N), (B, 1, 1, N), (1, 1, N, 1),
                                   (N, N)])
def test_bias_forward_and_gradients_match_jax(shape):
    q_, k_, v_ = _qkv(2)
    bias = jax.random.normal(jax.random.key(3), shape)
    jbias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    f = lambda *a: jnp.sum(jnp.sin(jcm.mask_attention(*a[:3], bias=a[3], is_causal=True)))  # noqa: E731
    g = lambda *a: jnp.sum(jnp.sin(jax.nn.dot_product_attention(*a, is_causal=True)))  # noqa: E731
    _close(jcm.mask_attention(q_, k_, v_, bias=bias, is_causal=True),
           jax.nn.dot_product_attention(q_, k_, v_, jbias, is_causal=True))
    ga = jax.grad(f, (0, 1, 2, 3))(q_, k_, v_, bias)
    gb = jax.grad(g, (0, 1, 2, 3))(q_, k_, v_, jbias)
    for a, b in zip(ga, gb):
        _close(a, jnp.reshape(b, a.shape), atol=5e-5)


def test_bias_with_a_structured_mask_and_gqa_under_jit():
    q_, k_, v_ = _qkv(4, hkv=2)
    bias = jax.random.normal(jax.random.key(5), (1, H, N, N))
    m = jcm.masks.sliding_window(5)
    out = jax.jit(lambda *a: jcm.mask_attention(*a[:3], m, bias=a[3]))(q_, k_, v_, bias)
    _close(out, jax.nn.dot_product_attention(q_, k_, v_, bias, m.as_dense(None, N)))


def test_bias_routes_around_backends_without_bias_with_a_reason():
    """A backend that takes no bias (the CuTe kernels) is skipped, saying why."""
    assert not backends.get("cute").takes_bias and backends.get("xla").takes_bias
    fake = backends.Backend(
        name="nobias_test", priority=100, tiles=lambda call: backends.DEFAULT_TILES,
        available=lambda: None, supports=lambda call: None, forward=None, backward=None)
    backends.register(fake)
    try:
        call = backends.Call(dtype="bfloat16", head_dim=128, head_dim_v=128, num_heads=8,
                             num_kv_heads=8, softcap=False, has_fallback=False, bias=True)
        line = backends.explain(call).split("nobias_test:")[1].splitlines()[0]
        assert "skipped" in line and "bias" in line
        assert backends.select(None, call).name == "xla"
        assert backends.select(None, dataclasses.replace(call, bias=False)).name == "nobias_test"
    finally:
        backends._REGISTRY.pop("nobias_test")


def test_dense_boolean_masks_concrete_and_traced():
    q_, k_, v_ = _qkv(6)
    m = np.array(jax.random.bernoulli(jax.random.key(7), 0.6, (N, N)))
    m[:, 0] = True
    ref = jax.nn.dot_product_attention(q_, k_, v_, mask=m[None, None])
    _close(jcm.mask_attention(q_, k_, v_, m), ref)                        # via from_dense
    _close(jcm.mask_attention(q_, k_, v_, mask=jnp.asarray(m), is_causal=True),
           jax.nn.dot_product_attention(q_, k_, v_, mask=m[None, None], is_causal=True))
    traced = jax.jit(lambda *a: jcm.mask_attention(*a))(q_, k_, v_, m[None, None])
    _close(traced, ref)
    batched = np.stack([m, np.tril(np.ones((N, N), bool))])[:, None]      # per-sequence
    _close(jcm.mask_attention(q_, k_, v_, batched, key_value_seq_lengths=LENS),
           jax.nn.dot_product_attention(q_, k_, v_, mask=batched, key_value_seq_lengths=LENS))


def test_traced_batched_mask_with_bias_gradients_match_jax():
    q_, k_, v_ = _qkv(15)
    m = (jax.random.bernoulli(jax.random.key(16), 0.6, (B, 1, N, N))
         | jnp.eye(N, dtype=bool)[None, None])
    bias = jax.random.normal(jax.random.key(17), (1, H, N, N))
    f = lambda q_, bias, m: jnp.sum(jnp.sin(jcm.mask_attention(q_, k_, v_, m, bias=bias)))  # noqa: E731
    g = lambda q_, bias, m: jnp.sum(jnp.sin(jax.nn.dot_product_attention(q_, k_, v_, bias, m)))  # noqa: E731
    for a, b in zip(jax.jit(jax.grad(f, (0, 1)))(q_, bias, m), jax.grad(g, (0, 1))(q_, bias, m)):
        _close(a, b, atol=5e-5)


def test_scale_takes_any_real_scalar():
    q_, k_, v_ = _qkv(8)
    ref = jax.nn.dot_product_attention(q_, k_, v_, is_causal=True, scale=0.25)
    for s in (0.25, np.float32(0.25), np.float64(0.25), jnp.float32(0.25), np.array(0.25)):
        _close(jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), scale=s), ref)
    _close(jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), scale=1),
           jax.nn.dot_product_attention(q_, k_, v_, is_causal=True, scale=1.0))
    for bad, err in ((True, TypeError), (float("nan"), ValueError), ("0.5", TypeError),
                     (np.ones(2), TypeError)):
        with pytest.raises(err, match="scale"):
            jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), scale=bad)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda s: jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), scale=s))(0.5)


def test_soft_cap_rejects_bools_and_takes_numpy_scalars():
    q_, k_, v_ = _qkv(9)
    for bad in (True, False, np.bool_(True)):
        with pytest.raises(TypeError, match="logits_soft_cap.*bool"):
            jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), logits_soft_cap=bad)
    a = jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), logits_soft_cap=np.float32(3.0))
    b = jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), logits_soft_cap=3.0)
    _close(a, b)


def test_unbatched_inputs_and_jax_residual_layout():
    q_, k_, v_ = _qkv(10)
    out, res = jcm.mask_attention(q_[0], k_[0], v_[0], is_causal=True, return_residual=True)
    ref, ref_res = jax.nn.dot_product_attention(q_[0], k_[0], v_[0], is_causal=True,
                                                return_residual=True)
    assert out.shape == ref.shape and res.shape == ref_res.shape == (N, H)
    _close(out, ref)
    _close(res, ref_res)
    out, res = jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), return_residual=True)
    _, ref_res = jax.nn.dot_product_attention(q_, k_, v_, is_causal=True,
                                              return_residual=True)
    assert res.shape == (B, N, H)
    _close(res, ref_res)


def test_deprecated_return_residuals_keeps_its_layout():
    q_, k_, v_ = _qkv(11)
    with pytest.warns(DeprecationWarning, match="return_residual"):
        out, lse = jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), return_residuals=True)
    _, res = jcm.mask_attention(q_, k_, v_, jcm.masks.causal(), return_residual=True)
    assert lse.shape == (B, H, N)
    _close(lse, jnp.swapaxes(res, 1, 2))


def test_positional_signature_and_descriptor_still_work():
    q_, k_, v_ = _qkv(12)
    desc = jcm.compile(jcm.masks.causal()).instantiate(None, N, N)
    ref = jax.nn.dot_product_attention(q_, k_, v_, is_causal=True)
    _close(jcm.mask_attention(q_, k_, v_, desc), ref)
    _close(jcm.mask_attention(q_, k_, v_, jcm.masks.causal()), ref)
    with pytest.raises(ValueError, match="prebuilt ExecutionDescriptor"):
        jcm.mask_attention(q_, k_, v_, desc, is_causal=True)


def test_implementation_names_of_jax():
    q_, k_, v_ = _qkv(13)
    ref = jax.nn.dot_product_attention(q_, k_, v_, is_causal=True)
    _close(jcm.mask_attention(q_, k_, v_, is_causal=True, implementation="xla"), ref)
    if backends.get("cute").available() is not None:     # no SM90 GPU here
        with pytest.raises(backends.BackendUnavailable, match="'cudnn'.*'cute'"):
            jcm.mask_attention(q_, k_, v_, is_causal=True, implementation="cudnn")
    with pytest.raises(ValueError, match="unknown implementation 'flash'"):
        jcm.mask_attention(q_, k_, v_, is_causal=True, implementation="flash")


# -- messages ---------------------------------------------------------------------------
def test_messages_name_the_argument_and_the_fix():
    q_, k_, v_ = _qkv(14)
    seg = jnp.zeros((B, N), jnp.int32)
    cases = [
        (dict(mask=jcm.masks.document(), metadata=[seg]), r"metadata must be a dict.*"
         r"'segment_ids'"),
        (dict(mask=jcm.masks.causal), r"mask is the function jcompilemask\.masks\.causal.*"
         r"mask=jcm\.masks\.causal\(\)"),
        (dict(mask=jcm.masks.sliding_window), r"call it, e\.g\. mask=jcm\.masks\."
         r"sliding_window\(\.\.\.\)"),
        (dict(mask=jnp.ones((N, N))), r"mask is a float32 array.*bias="),
        (dict(mask=[[True] * N] * N), r"mask is a Python list.*jnp\.asarray"),
        (dict(bias=jnp.ones((N, N), bool)), r"bias must be a float array"),
        (dict(bias=jnp.ones((3, N, N))), r"bias has shape"),
    ]
    for kw, match in cases:
        with pytest.raises((TypeError, ValueError), match=match):
            jcm.mask_attention(q_, k_, v_, **kw)
    from jcompilemask.splash import CausalMask
    with pytest.raises(TypeError, match=r"splash\.to_jcm\(mask\)"):
        jcm.mask_attention(q_, k_, v_, CausalMask((N, N)))
    with pytest.raises(TypeError, match=r"query is a Python list.*jnp\.asarray\(query\)"):
        jcm.mask_attention(np.asarray(q_).tolist(), k_, v_, jcm.masks.causal())
    with pytest.raises(jcm.spec.MetadataError, match="metadata must be a dict"):
        jcm.compile(jcm.masks.document()).instantiate([seg], N, N)


# -- masks that lose the fast path ------------------------------------------------------
def test_compile_warns_once_on_residual_predicates():
    # k // 64 <= q // 64 is solved exactly (issue 16): no warning, one interval
    blocks = MaskSpec([Region((0, q_len), k // 64 <= q // 64, name="blocks")],
                      name="block_causal_test")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm = jcm.compile(blocks)
        jcm.compile(jcm.masks.hstu())                         # lowers: no warning
    assert not cm.fallback_regions and cm.num_intervals == 1
    assert str(cm.regions[0].intervals[0]) == "[0, 64 * (q // 64) + 64)"
    modulo = MaskSpec([Region((0, q_len), (k % 4 == 0) & (k <= q), name="stride")],
                      name="mod_test")
    with pytest.warns(jcm.MaskFallbackWarning) as rec:
        jcm.compile(modulo)
    text = str(rec[0].message)
    assert "region 0 'stride'" in text and "`k % 4 == 0`" in text
    assert "residual predicate" in text and "k alone (or k // c)" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jcm.compile(modulo)                                   # cached: no second warning
    quiet = MaskSpec([Region((0, q_len), k % 16 <= q % 16)], name="quiet_test")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jcm.compile(quiet, warn=False).fallback_regions    # the caller handles it
        jcm.compile(quiet)


def test_registry_says_once_when_a_faster_backend_is_passed_over(caplog):
    fake = backends.Backend(
        name="fast_test", priority=100, tiles=lambda call: backends.DEFAULT_TILES,
        available=lambda: None, supports=lambda call: "only for the test's dtype",
        forward=None, backward=None)
    backends._ensure_builtin()
    backends.register(fake)
    try:
        call = backends.Call(dtype="float32", head_dim=8, head_dim_v=8, num_heads=1,
                             num_kv_heads=1, softcap=False, has_fallback=False)
        with caplog.at_level(logging.WARNING, logger="jcompilemask"):
            for _ in range(3):
                assert backends.select(None, call).name == "xla"
        lines = [r.getMessage() for r in caplog.records if "fast_test" in r.getMessage()]
        assert lines == ["jcompilemask: mask_attention runs the xla backend, not fast_test: "
                         "only for the test's dtype"]
    finally:
        backends._REGISTRY.pop("fast_test")


def test_slow_compile_logs_one_progress_line(caplog, monkeypatch):
    import jcompilemask.lower.compiled as compiled
    real = compiled.lower_region

    def slow(region, spec):
        time.sleep(0.3)
        return real(region, spec)

    monkeypatch.setattr(compiled, "lower_region", slow)
    monkeypatch.setattr(_progress, "SLOW_AFTER_S", 0.05)
    # The compile cache is keyed by structure: a test that ran earlier in this process
    # (the order depends on how pytest-xdist deals files) may have lowered it already.
    compiled._compile_cached.cache_clear()
    spec = MaskSpec([Region((0, q_len), k <= q - 3)], name="slow_test")
    with caplog.at_level(logging.WARNING, logger="jcompilemask"):
        jcm.compile(spec)
        jcm.compile(spec)
    lines = [r.getMessage() for r in caplog.records if "slow_test" in r.getMessage()]
    assert len(lines) == 1 and "lowering mask slow_test" in lines[0]
    assert "cached after" in lines[0]
    with caplog.at_level(logging.WARNING, logger="jcompilemask"):
        with _progress.slow_step("quick_test", after=5.0):
            pass
    assert not [r for r in caplog.records if "quick_test" in r.getMessage()]


# -- README claims ----------------------------------------------------------------------
_README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_snippet_spec_equals_the_builtin():
    text = _README.read_text()
    block = re.search(r"## Use\n\n```python\n(.*?)```", text, re.S).group(1)
    assert "# == jcm.masks.hstu()" in block
    ns = {}
    exec(compile(block, "README.md", "exec"), ns)  # noqa: S102 - our own README
    assert ns["spec"] == jcm.masks.hstu()


def test_readme_states_what_recompiles():
    text = " ".join(_README.read_text().split())
    assert "never recompiles when lengths change" not in text
    assert "new values in every batch recompile nothing" in text
    assert "retraces" in text


def test_explain_says_what_k_kc_and_the_column_view_are():
    text = jcm.compile(jcm.masks.hstu()).explain()
    assert "K: at most this many ranges of keys are visible from one query row" in text
    assert "Kc: at most this many ranges of query rows see one key: the column view" in text


def test_deterministic_gradients_on_the_xla_backend():
    """mask_attention(deterministic=True) (and the Flax modules' deterministic_grads)
    give the same gradients as the default and the same bits on a rerun; a non-bool is
    refused. (The CuTe backward's ordered dQ adds are checked on the H200:
    tests/gpu/test_cute_backward.py::test_repeated_gradients_are_identical.)"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest
    import jcompilemask as jcm
    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(kk, (1, 40, 2, 8)) for kk in ks)

    def grads(det):
        f = lambda a, b, c: jnp.sum(jcm.mask_attention(  # noqa: E731
            a, b, c, jcm.masks.causal(), implementation="xla", deterministic=det) ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    a, b, c = grads(True), grads(True), grads(False)
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_allclose(np.asarray(x), np.asarray(z), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        jcm.mask_attention(q, k, v, jcm.masks.causal(), deterministic="yes")
    from flax import nnx
    m = jcm.flax.MultiHeadAttention(2, 16, deterministic_grads=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(ks[0], (1, 40, 16))
    assert m(x, jcm.masks.causal()).shape == (1, 40, 16)
