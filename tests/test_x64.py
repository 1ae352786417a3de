"""The library with ``jax_enable_x64`` on (integer metadata and Python scalars then default
to 64 bits), under JAX's strict test configuration (rank promotion 'raise', dtype
promotion 'strict').

x64 must be set before JAX creates its first array, so the paths run in a fresh
interpreter; each prints its largest error against the dense oracle.
"""
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent('''
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    import jax.numpy as jnp
    import numpy as np
    import jcompilemask as jcm
    from jcompilemask import splash
    from jcompilemask.lower.dense import SegmentedDenseMask

    assert jnp.arange(2).dtype == jnp.int64
    N, H, D = 40, 2, 8
    TILES = dict(block_q=16, block_kv=8, bwd_block_q=8, bwd_block_kv=16)
    rng = np.random.default_rng(0)
    q, k, v = (jax.random.normal(jax.random.key(i), (2, N, H, D), jnp.float32)
               for i in range(3))

    def dense_attention(q, k, v, vis):           # vis bool [B|1, H|1, N, N]
        out = jax.nn.dot_product_attention(q, k, v, mask=vis)
        seen = jnp.swapaxes(jnp.any(vis, -1), 1, 2)[..., None]
        return jnp.where(seen, out, 0.0)

    def check(name, mask, vis, metadata=None, grad=True):
        desc = jcm.compile(mask).instantiate(metadata, N, N, **TILES)
        for view in ("fwd", "bwd"):
            assert (np.asarray(desc.as_dense(view)) == np.asarray(vis)).all(), (name, view)
        f = lambda q: jcm.mask_attention(q, k, v, desc).sum()
        g = lambda q: dense_attention(q, k, v, jnp.asarray(vis)).sum()
        err = float(jnp.abs(jcm.mask_attention(q, k, v, desc)
                            - dense_attention(q, k, v, jnp.asarray(vis))).max())
        if grad:
            err = max(err, float(jnp.abs(jax.grad(f)(q) - jax.grad(g)(q)).max()))
        assert err < 1e-4, (name, err)
        print(name, "ok", err)

    spec = jcm.masks.causal()
    check("causal", spec, spec.as_dense(None, N, N), grad=False)
    spec = jcm.masks.hstu()
    md = {"context_len": np.array([5, 0]), "history_end": np.array([20, 31]),
          "group_size": np.array([3, 1])}
    check("hstu", spec, spec.as_dense(md, N, N), md)
    arr = rng.random((H, N, N)) < 0.5
    for layout in ("intervals", "bitmap"):
        check("dense-" + layout, jcm.from_dense(arr, layout=layout), arr[None],
              grad=layout == "bitmap")
    ids = jnp.asarray(rng.integers(0, 3, (2, N)))           # int64 ids, scattered
    seg = SegmentedDenseMask(arr)
    vis = arr[None] & (np.asarray(ids)[:, None, :, None] == np.asarray(ids)[:, None, None, :])
    check("dense+segments", seg, vis, {"q_segment_ids": ids, "kv_segment_ids": ids})

    # The splash layer: structured and dense masks, with packed segment ids and sinks.
    qh = jnp.swapaxes(q[0], 0, 1)                            # [H, N, D]
    packed = jnp.asarray(np.repeat(np.arange(4), N // 4))
    for m in (splash.MultiHeadMask([splash.CausalMask((N, N))] * H),
              splash.MultiHeadMask([splash.NumpyMask(a | np.eye(N, dtype=bool))
                                    for a in arr])):
        kern = splash.make_splash_mha_single_device(m, save_residuals=True)
        ref = splash.make_masked_mha_reference(m)
        sids, sinks = splash.SegmentIds(packed, packed), jnp.ones(H, jnp.float32)
        (o, (lse,)), (o_r, (lse_r,)) = kern(qh, qh, qh, sids, sinks), ref(
            qh, qh, qh, sids, sinks, save_residuals=True)
        err = float(jnp.maximum(jnp.abs(o - o_r).max(), jnp.abs(lse - lse_r).max()))
        if isinstance(m.masks[0], splash.NumpyMask):
            gk = jax.grad(lambda x: kern(x, x, x, sids, sinks)[0].sum())(qh)
            gr = jax.grad(lambda x: ref(x, x, x, sids, sinks).sum())(qh)
            err = max(err, float(jnp.abs(gk - gr).max()))
        else:
            jax.jit(kern)(qh, qh, qh, sids, sinks)      # traced ids: the checked fast path
        assert err < 1e-4, err
        print("splash", type(kern.masks.static).__name__, "ok", err)
    print("ALL OK")
''')


def test_key_paths_with_x64():
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS=os.environ.get(
        "JAX_PLATFORMS", "cpu"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in
                                                  [os.environ.get("PYTHONPATH")] if p])
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=1200)
    assert res.returncode == 0 and "ALL OK" in res.stdout, (
        f"stdout:\n{res.stdout}\nstderr:\n{res.stderr[-4000:]}")
