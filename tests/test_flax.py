"""Flax integration: the attention_fn contract, the NNX and linen modules under jit and
grad, and the example decoder training on document-packed batches."""
import importlib.util
import pathlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx

import jcompilemask as jcm
import jcompilemask.flax as jf

N, D_MODEL = 16, 32
SEG = jnp.array([[0] * 10 + [1] * 6, [0] * 4 + [1] * 5 + [2] * 7])
DOC = jcm.compile(jcm.masks.document())


def _desc():
    return DOC.instantiate({"segment_ids": SEG}, N, N)


def _x(seed=1, b=2):
    return jax.random.normal(jax.random.key(seed), (b, N, D_MODEL))


def _close(a, b, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=2e-5)


def test_attention_fn_in_flax_multihead_attention():
    """Flax's own module with our attention_fn == Flax's module with the dense mask."""
    desc = _desc()
    ours = nnx.MultiHeadAttention(4, D_MODEL, decode=False, attention_fn=jf.attention_fn,
                                  rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(4, D_MODEL, decode=False, rngs=nnx.Rngs(0))
    x = _x()
    jitted = nnx.jit(lambda m, x, d: m(x, mask=d))
    _close(jitted(ours, x, desc), theirs(x, mask=desc.as_dense()))
    # Bound mask (make_attention_fn) for a mask without metadata.
    causal = nnx.MultiHeadAttention(4, D_MODEL, decode=False, rngs=nnx.Rngs(0),
                                    attention_fn=jf.make_attention_fn(jcm.masks.causal()))
    _close(nnx.jit(lambda m, x: m(x))(causal, x),
           theirs(x, mask=nnx.make_causal_mask(x[..., 0])))


def test_attention_fn_keywords_and_errors():
    q = k = v = jax.random.normal(jax.random.key(2), (2, 3, N, 2, 8))   # two batch dims
    desc = jcm.compile(jcm.masks.causal()).instantiate(None, N, N)
    out = jax.jit(lambda q, k, v, d: jf.attention_fn(
        q, k, v, mask=d, broadcast_dropout=False, dropout_rng=None, dropout_rate=0.1,
        deterministic=True, dtype=jnp.float32, precision=jax.lax.Precision.HIGHEST,
        module=None, is_causal=False, force_fp32_for_softmax=False,
        qk_attn_weights_einsum=None))(q, k, v, desc)
    want = jax.nn.dot_product_attention(q.reshape(6, N, 2, 8), k.reshape(6, N, 2, 8),
                                        v.reshape(6, N, 2, 8), is_causal=True)
    _close(out, want.reshape(q.shape))
    assert jax.eval_shape(lambda: jf.attention_fn(q, k, v, mask=desc, dtype=jnp.bfloat16)
                          ).dtype == jnp.bfloat16
    bad = [
        (dict(dropout_rate=0.1, deterministic=False), NotImplementedError, "dropout"),
        (dict(module=object()), NotImplementedError, "sow_weights"),
        (dict(input_positions=jnp.arange(N)), NotImplementedError, "RoPE"),
        (dict(some_new_flag=True), TypeError, "some_new_flag"),
    ]
    for kw, err, match in bad:
        with pytest.raises(err, match=match):
            jf.attention_fn(q, k, v, **{"mask": desc, **kw})
    with pytest.raises(TypeError, match="or a mask array"):
        jf.attention_fn(q, k, v, mask="causal")
    with pytest.raises(ValueError, match="needs its mask"):
        jf.attention_fn(q, k, v)


def test_attention_fn_takes_bias_is_causal_and_dense_masks():
    """What Flax passes (dense float masks with batch dims, bias, is_causal) as jax does."""
    q, k, v = (jax.random.normal(kk, (2, 3, N, 2, 8)) for kk in
               jax.random.split(jax.random.key(4), 3))
    flat = lambda x: x.reshape((6,) + x.shape[2:])  # noqa: E731
    bias = jax.random.normal(jax.random.key(5), (2, 3, 2, N, N))
    dense = jnp.tril(jnp.ones((N, N), jnp.float32))[None, None, None]   # nnx-style float
    want = jax.nn.dot_product_attention(flat(q), flat(k), flat(v), flat(bias),
                                        is_causal=True)
    bool_dense = jnp.broadcast_to(dense != 0, (2, 3, 1, N, N))
    for kw in (dict(bias=bias, is_causal=True), dict(bias=bias, mask=dense),
               dict(bias=bias, mask=jcm.masks.causal()),
               dict(bias=bias, mask=jcm.runtime_dense(bool_dense, tiers=(2,)))):
        got = jax.jit(lambda q, k, v: jf.attention_fn(q, k, v, deterministic=True, **kw))(
            q, k, v)
        _close(got, want.reshape(q.shape))


def test_flax_make_attention_mask_inside_jit_runs_its_runs():
    """A Flax model's usual mask, ``nn.make_attention_mask`` of segment ids inside the
    jitted step AND causal, through Flax's own module with our attention_fn: the same
    output as Flax's module with the same mask, and it runs at the first tier (one run
    per row)."""
    from jcompilemask.attention.api import runtime_dense_plan
    ours = nnx.MultiHeadAttention(4, D_MODEL, decode=False, attention_fn=jf.attention_fn,
                                  rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(4, D_MODEL, decode=False, rngs=nnx.Rngs(0))
    x = _x(7)

    def mask_of(seg):
        return nnx.combine_masks(nnx.make_attention_mask(seg, seg, jnp.equal),
                                 nnx.make_causal_mask(seg))
    got = nnx.jit(lambda m, x, seg: m(x, mask=mask_of(seg)))(ours, x, SEG)
    _close(got, theirs(x, mask=mask_of(SEG)))
    q = jnp.zeros((2, N, 4, 8))
    index = jax.jit(lambda seg: runtime_dense_plan(
        q, q, jcm.runtime_dense(mask_of(seg).astype(bool)))[2])(SEG)
    assert int(index) == 0


def _decode_all(layer, x, mask, prefill):
    step = nnx.jit(lambda m, x, d: m(x, d))
    outs = [step(layer, x[:, :prefill], mask)]
    outs += [step(layer, x[:, t:t + 1], mask) for t in range(prefill, x.shape[1])]
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("which", ["causal", "window", "document"])
def test_nnx_decode_matches_the_full_forward(which):
    """Decoding (a prefilled chunk, then one token at a time) against the cache gives the
    rows of the full forward pass: the mask is evaluated at the cache positions."""
    layer = jf.MultiHeadAttention(4, D_MODEL, num_kv_heads=2, rngs=nnx.Rngs(0))
    x = _x(3)
    if which == "document":
        desc = _desc()
    else:
        spec = jcm.masks.causal() if which == "causal" else jcm.masks.sliding_window(3)
        desc = jcm.compile(spec).instantiate(None, N, N)
    full = layer(x, desc)
    layer.decode = True
    layer.init_cache(x.shape)
    got = _decode_all(layer, x, None if which == "causal" else desc, prefill=5)
    _close(got, full)
    assert int(layer.cache_index[...]) == N
    with pytest.raises(ValueError, match="cache is full"):
        layer(x[:, :1], None)                                   # eager: the index is known
    assert np.isnan(np.asarray(nnx.jit(lambda m, x: m(x, None))(layer, x[:, :1]))).all()
    if which == "window":        # the mask matters: decoding it as causal differs
        layer.init_cache(x.shape)
        assert not np.allclose(_decode_all(layer, x, None, prefill=5), full, atol=1e-3)


def test_flax_decode_with_our_attention_fn():
    """Flax's own decode works with mask=None; a structured mask gets a message saying
    what to do instead of an AttributeError from deep inside Flax."""
    ours = nnx.MultiHeadAttention(4, D_MODEL, decode=True, attention_fn=jf.attention_fn,
                                  rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(4, D_MODEL, decode=True, rngs=nnx.Rngs(0))
    x = _x(4)
    ours.init_cache(x.shape)
    theirs.init_cache(x.shape)
    for t in range(N):
        _close(ours(x[:, t:t + 1]), theirs(x[:, t:t + 1]))
    ours.init_cache(x.shape)
    with pytest.raises(AttributeError, match=r"jcompilemask\.flax\.MultiHeadAttention\(\.\.\., "
                       r"decode=True\)"):
        ours(x[:, :1], mask=_desc())
    with pytest.raises(ValueError, match="init_cache"):
        jf.MultiHeadAttention(4, D_MODEL, decode=True, rngs=nnx.Rngs(0))(x[:, :1])


def _reference(layer, x, dense):
    """The module's math with a dense mask and jax.nn.dot_product_attention."""
    b = x.shape[0]
    q = layer.query(x).reshape(b, N, layer.num_heads, layer.head_dim)
    k = layer.key(x).reshape(b, N, layer.num_kv_heads, layer.head_dim)
    v = layer.value(x).reshape(b, N, layer.num_kv_heads, layer.head_dim)
    o = jax.nn.dot_product_attention(q, k, v, mask=dense)
    return layer.out(o.reshape(b, N, -1))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_nnx_module_jit_and_grad(kv_heads):
    layer = jf.MultiHeadAttention(4, D_MODEL, num_kv_heads=kv_heads, rngs=nnx.Rngs(0))
    x = _x()
    w = jax.random.normal(jax.random.key(3), x.shape)

    @nnx.jit
    def loss(layer, x, seg):
        desc = DOC.instantiate({"segment_ids": seg}, N, N)   # built inside the step
        return jnp.sum(layer(x, desc) * w)

    def ref_loss(layer, x):
        return jnp.sum(_reference(layer, x, _desc().as_dense()) * w)

    _close(loss(layer, x, SEG), ref_loss(layer, x), atol=1e-4)
    g = nnx.jit(nnx.grad(loss))(layer, x, SEG)
    g_ref = nnx.grad(ref_loss)(layer, x)
    for a, b in zip(jax.tree.leaves(nnx.state(g)), jax.tree.leaves(nnx.state(g_ref))):
        _close(a, b, atol=1e-4)
    gx = nnx.jit(nnx.grad(loss, argnums=1))(layer, x, SEG)
    _close(gx, nnx.grad(ref_loss, argnums=1)(layer, x), atol=1e-4)


def test_linen_module_and_linen_attention_fn():
    desc = _desc()
    x = _x()
    layer = jf.linen.MultiHeadAttention(num_heads=4)
    params = layer.init(jax.random.key(0), x, desc)
    out = jax.jit(layer.apply)(params, x, desc)
    # Same parameters through Flax's linen module with the dense mask.
    ref = nn.MultiHeadDotProductAttention(num_heads=4, use_bias=False)
    _close(out, ref.apply(params, x, x, mask=desc.as_dense()), atol=1e-5)
    g = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply(p, x, desc) ** 2)))(params)
    g_ref = jax.grad(lambda p: jnp.sum(ref.apply(p, x, x, mask=desc.as_dense()) ** 2))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        _close(a, b, atol=1e-4)
    # Linen's module with our attention_fn (linen filters keywords by signature).
    theirs = nn.MultiHeadDotProductAttention(num_heads=4, use_bias=False,
                                             attention_fn=jf.attention_fn)
    _close(theirs.apply(params, x, x, mask=desc), out, atol=1e-5)
    bound = nn.MultiHeadDotProductAttention(num_heads=4, use_bias=False,
                                            attention_fn=jf.make_attention_fn(desc))
    _close(bound.apply(params, x, x), out, atol=1e-5)


def _load_example(name):
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_decoder_trains():
    losses = _load_example("flax_decoder").main(steps=25, verbose=False)
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses


def test_linen_decode_with_our_attention_fn():
    """Linen's decode cache (mask=None: Flax's occupancy mask runs as a dense mask)."""
    x = _x(5)[:, :6]
    ours = nn.MultiHeadDotProductAttention(num_heads=4, decode=True,
                                           attention_fn=jf.attention_fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=4, decode=True)
    variables = theirs.init(jax.random.key(1), x, x)
    params, c_ours, c_theirs = variables["params"], variables["cache"], variables["cache"]
    for t in range(x.shape[1]):
        tok = x[:, t:t + 1]
        a, m_ours = ours.apply({"params": params, "cache": c_ours}, tok, tok, mutable=["cache"])
        b, m_theirs = theirs.apply({"params": params, "cache": c_theirs}, tok, tok,
                                   mutable=["cache"])
        c_ours, c_theirs = m_ours["cache"], m_theirs["cache"]
        _close(a, b)
