"""Head dims without a CuTe kernel of their own (96, 80, 32, 160 / 128, 128 / 64, ...) run
the CuTe kernels zero-padded to a built pair (``backends.cute_head_dims``).

The CPU twin of ``tests/gpu/test_cute_head_dims.py``'s padded cases: the real cute backend
object (its supports / tiles / forward / backward, padding included) with the two kernel
entry points replaced by a float32 reference over the same interval tables, which also
refuses any head dims the kernels are not built for. So what is tested here is the
padding and slicing around the kernels, the tiles the descriptor is built at and what
``explain()`` says; the kernels themselves are tested on the GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.kernels.cute import api as cute_api
from jcompilemask.kernels.cute.testing import reference_attention as kernel_reference
from jcompilemask.testing import assert_within_policy, reference_attention, reference_gradients

BUILT = {(d, d) for d in cute_api.HEAD_DIMS} | set(cute_api.HEAD_DIM_PAIRS)
# The forward also has kernels of these (backends.cute_forward_head_dims)
BUILT_FWD = BUILT | {(d, d) for d in cute_api.FWD_NATIVE_HEAD_DIMS}
BUILT_BWD = BUILT | {(d, d) for d in cute_api.BWD_NATIVE_HEAD_DIMS}


@contextlib.contextmanager
def fake_cute_kernels(monkeypatch):
    """The cute backend made available here, its kernels replaced by the reference; yields
    the list of (kind, D, Dv, tiles) the kernels were called with."""
    seen = []

    def kernel_dims(q, v, kernel_head_dims, kind):
        """The kernel's head dims; with ``kernel_head_dims`` (TMA in place), the checks
        ``cute_forward`` / ``cute_backward`` make, and the padding their TMA boxes do."""
        d, dv = q.shape[-1], v.shape[-1]
        dims = (d, dv) if kernel_head_dims is None else tuple(kernel_head_dims)
        assert dims in (BUILT_FWD if kind == "fwd" else BUILT_BWD), (kind, q.shape, v.shape,
                                                                     kernel_head_dims)
        if kernel_head_dims is not None:
            assert dims[0] >= d and dims[1] >= dv and d % 8 == 0 and dv % 8 == 0, (d, dv, dims)
        seen.append((kind, *dims, "tma" if dims != (d, dv) else "as is"))
        return dims

    def pad(x, n):   # what a TMA box wider than the array reads: zeros past its columns
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])

    def fwd(q, k, v, fwd_intervals, fwd_tiles, *, scale=None, softcap=None, block_q=128,
            block_kv=128, kernel_head_dims=None, **_):
        kd, kdv = kernel_dims(q, v, kernel_head_dims, "fwd")
        seen[-1] = seen[-1] + ((block_q, block_kv),)
        o, lse = kernel_reference(pad(q, kd), pad(k, kd), pad(v, kdv), fwd_intervals,
                                  scale, softcap)
        return o[..., :v.shape[-1]].astype(q.dtype), lse

    def bwd(q, k, v, out, lse, do, bwd_intervals, bwd_tiles, fwd_intervals, bwd_exact, *,
            scale=None, dlse=None, block_q=None, block_kv=None, softcap=None,
            kernel_head_dims=None, **_):
        assert out.shape[-1] == do.shape[-1] == v.shape[-1]
        kd, kdv = kernel_dims(q, v, kernel_head_dims, "bwd")
        seen[-1] = seen[-1] + ((block_q, block_kv),)
        f = lambda a, b, c: kernel_reference(a, b, c, fwd_intervals, scale, softcap)  # noqa: E731
        (o, l), vjp = jax.vjp(f, *(pad(x, n).astype(jnp.float32)
                                   for x, n in ((q, kd), (k, kd), (v, kdv))))
        ct_l = jnp.zeros_like(l) if dlse is None else jnp.where(jnp.isfinite(l), dlse, 0.0)
        dq, dk, dv = vjp((pad(do, kdv).astype(jnp.float32), ct_l))
        d, dvv = q.shape[-1], v.shape[-1]
        return (dq[..., :d].astype(q.dtype), dk[..., :d].astype(k.dtype),
                dv[..., :dvv].astype(v.dtype))

    import jcompilemask.kernels.cute as cute_pkg
    monkeypatch.setattr(cute_pkg, "cute_forward", fwd)
    monkeypatch.setattr(cute_api, "cute_backward", bwd)
    backends._ensure_builtin()
    real = backends._REGISTRY["cute"]
    backends.register(dataclasses.replace(real, available=lambda: None))
    try:
        yield seen
    finally:
        backends.register(real)


def _qkv(d, dv, *, b=2, n=192, h=4, hkv=2, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, n, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (b, n, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (b, n, hkv, dv), jnp.float32)
    do = jax.random.normal(ks[3], (b, n, h, dv), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), do.astype(dtype)


def test_cute_head_dims_picks_the_cheapest_built_pair():
    assert backends.cute_head_dims(64, 64) == (64, 64)
    assert backends.cute_head_dims(1, 1) == (64, 64)
    assert backends.cute_head_dims(65, 65) == (128, 128)
    assert backends.cute_head_dims(96, 64) == (128, 128)
    assert backends.cute_head_dims(129, 128) == (192, 128)
    assert backends.cute_head_dims(192, 129) == (256, 256)
    assert backends.cute_head_dims(256, 256) == (256, 256)
    assert backends.cute_head_dims(257, 64) is None
    assert backends.cute_head_dims(0, 64) is None
    for d in range(1, 257, 7):
        for dv in range(1, 257, 11):
            got = backends.cute_head_dims(d, dv)
            assert got in BUILT and got[0] >= d and got[1] >= dv
            assert all(a + c >= sum(got) for a, c in BUILT if a >= d and c >= dv)


@pytest.mark.parametrize("mode", ["copy", "tma"])
@pytest.mark.parametrize("d,dv,mask,softcap,dtype", [
    (96, 96, "causal", None, jnp.bfloat16),
    (80, 80, "sliding_window", None, jnp.float16),
    (32, 32, "causal", 20.0, jnp.bfloat16),
    (160, 128, "causal", None, jnp.bfloat16),
    (128, 64, "prefix_lm", None, jnp.float16),
    (192, 192, "causal", None, jnp.bfloat16),
    (100, 100, "causal", None, jnp.bfloat16),    # not a multiple of 8: copies in either mode
])
def test_padded_head_dims_match_the_oracle(monkeypatch, mode, d, dv, mask, softcap, dtype):
    """The padding around a built pair's kernels (the native D 80 / 96 kernels off, so that
    D 96 / 80 take D 128's too, as under $JCOMPILEMASK_CUTE_FWD_NATIVE=0 / _BWD_NATIVE=0)."""
    _natives(monkeypatch, "0")
    monkeypatch.setenv(backends.CUTE_HEAD_DIM_PAD_ENV, mode)
    spec = {"causal": jcm.masks.causal(), "sliding_window": jcm.masks.sliding_window(48),
            "prefix_lm": jcm.masks.prefix_lm()}[mask]
    md = {"prefix_len": np.array([30, 150], np.int32)} if mask == "prefix_lm" else None
    q, k, v, do = _qkv(d, dv, dtype=dtype)
    with fake_cute_kernels(monkeypatch) as seen:
        def f(q, k, v):
            return jcm.mask_attention(q, k, v, spec, metadata=md, implementation="cute",
                                      logits_soft_cap=softcap)
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        grads = vjp(do)
    want_dims = backends.cute_head_dims(d, dv)
    assert {s[1:3] for s in seen} == {want_dims}, seen
    assert {s[0] for s in seen} == {"fwd", "bwd"}
    in_place = mode == "tma" and d % 8 == 0 and dv % 8 == 0
    assert {s[3] for s in seen} == {"tma" if in_place else "as is"}, seen
    assert out.shape == q.shape[:3] + (dv,) and out.dtype == dtype
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    _check_oracle(spec, md, softcap, q, k, v, do, out, grads)


def _natives(monkeypatch, value):
    """Both native-head-dim switches set to ``value`` ("0" / "1")."""
    monkeypatch.setenv(backends.CUTE_FWD_NATIVE_ENV, value)
    monkeypatch.setenv(backends.CUTE_BWD_NATIVE_ENV, value)


def _check_oracle(spec, md, softcap, q, k, v, do, out, grads):
    """out / grads against the oracle at the call's own head dims, under the project's
    tolerance policy (out None: the gradients only)."""
    vis = np.asarray(spec.as_dense(md, q.shape[1], k.shape[1]), bool)
    if out is not None:
        high, low = reference_attention(q, k, v, vis, softcap=softcap), \
            reference_attention(q, k, v, vis, softcap=softcap, precision="input")
        assert_within_policy(out, high[0], low[0], "out")
    ghigh, glow = reference_gradients(q, k, v, do, vis, softcap=softcap)
    for name, g, h, lo in zip(("dq", "dk", "dv"), grads, ghigh, glow):
        assert_within_policy(g, h, lo, name)


def test_padded_head_dims_build_the_descriptor_at_the_padded_tiles(monkeypatch):
    """D 192 / Dv 192 runs as 256 / 256: the descriptor is built at D 256's tiles."""
    q, k, v, _ = _qkv(192, 192, n=160)
    with fake_cute_kernels(monkeypatch) as seen:
        jcm.mask_attention(q, k, v, jcm.masks.causal(), implementation="cute")
    call = backends.call_for(jcm.compile(jcm.masks.causal()), dtype="bfloat16",
                             head_dim=256, head_dim_v=256, num_heads=4, num_kv_heads=2)
    t = backends.get("cute").tiles(call)
    assert seen == [("fwd", 256, 256, "tma", (t.block_q, t.block_kv))]


def test_explain_says_the_head_dims_run_padded(monkeypatch):
    cm = jcm.compile(jcm.masks.causal())
    call = backends.call_for(cm, dtype="bfloat16", head_dim=96, head_dim_v=96, num_heads=8,
                             num_kv_heads=8)
    with fake_cute_kernels(monkeypatch):
        text = backends.explain(call)
    assert "chosen: cute (kernels of head dims 96/96 of their own in both passes)" in text
    _natives(monkeypatch, "0")
    with fake_cute_kernels(monkeypatch):
        text = backends.explain(call)
    assert "chosen: cute (head dims 96/96 run zero-padded to 128/128: exact, 1.33x" in text
    assert "1.33x the matmul work of kernels of their own; read in place by TMA boxes" in text
    assert "backward: the CuTe backward kernel" in text
    monkeypatch.setenv(backends.CUTE_HEAD_DIM_PAD_ENV, "copy")
    with fake_cute_kernels(monkeypatch):
        text = backends.explain(call)
    assert "padded copies of the operands" in text
    monkeypatch.setenv(backends.CUTE_HEAD_DIM_PAD_ENV, "zeros")
    with pytest.raises(ValueError, match="JCOMPILEMASK_CUTE_HEAD_DIM_PAD='zeros': use 'copy' or 'tma'"):
        backends.cute_head_dim_padding(96, 96)
    monkeypatch.delenv(backends.CUTE_HEAD_DIM_PAD_ENV)
    wide = backends.call_for(cm, dtype="bfloat16", head_dim=320, head_dim_v=320,
                             num_heads=8, num_kv_heads=8)
    with fake_cute_kernels(monkeypatch):
        text = backends.explain(wide)
    assert "cute: skipped: head dims 320/320" in text and "wider ones have no kernel" in text
    assert "chosen: xla" in text


def test_kernel_keys_take_the_callers_head_dims():
    """``io_head_dims``: the kernels' keys (and names) for arrays narrower than the kernel."""
    base = dict(dtype="bfloat16", head_dim=128, head_dim_v=128, num_intervals=1, block_q=128,
                block_kv=128, broadcast_batch=True, broadcast_head=True, scale=0.1)
    key = cute_api.ForwardKey(**base, io_head_dims=(96, 96))
    assert key.target_name.endswith("_io96x96")
    assert "_io" not in cute_api.ForwardKey(**base).target_name
    for bad in ((128, 128), (136, 128), (100, 100), (0, 96)):
        with pytest.raises(ValueError, match=r"io_head_dims=.*multiples of 8"):
            cute_api.ForwardKey(**base, io_head_dims=bad)
    config = cute_api.preferred_backward_config(128)
    bkey = cute_api.BackwardKey("bfloat16", 128, 1, 1, True, True, 0.1, config=config,
                                io_head_dims=(80, 80))
    assert bkey.target_name.endswith("_io80x80")
    with pytest.raises(ValueError, match="needs config.dkv_tma_store"):
        cute_api.BackwardKey("bfloat16", 128, 1, 1, True, True, 0.1,
                             config=cute_api.BackwardConfig(), io_head_dims=(80, 80))


def test_cute_entry_points_check_kernel_head_dims():
    """Before anything is built: kernel head dims narrower than the arrays, or arrays whose
    head dims TMA cannot stride (not multiples of 8), are refused with the fix."""
    q = jnp.zeros((1, 64, 1, 96), jnp.bfloat16)
    iv = jnp.zeros((1, 1, 64, 1, 2), jnp.int32)
    tiles = jnp.zeros((1, 1, 1, 1), jnp.uint32)
    with pytest.raises(ValueError, match=r"cute_forward: kernel_head_dims=\(64, 64\) must be at least"):
        cute_api.cute_forward(q, q, q, iv, tiles, kernel_head_dims=(64, 64))
    odd = jnp.zeros((1, 64, 1, 100), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiples of 8.*pad the arrays otherwise"):
        cute_api.cute_forward(odd, odd, odd, iv, tiles, kernel_head_dims=(128, 128))
    lse = jnp.zeros((1, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"cute_backward: kernel_head_dims=\(64, 64\)"):
        cute_api.cute_backward(q, q, q, q, lse, q, iv, tiles, iv, True,
                               kernel_head_dims=(64, 64))


@pytest.mark.parametrize("d,mask,softcap,dtype", [
    (96, "causal", None, jnp.bfloat16),
    (80, "sliding_window", 20.0, jnp.float16),
])
def test_native_forward_head_dims(monkeypatch, d, mask, softcap, dtype):
    """The native forward (the default): D 80 / 96 kernels on the arrays as they are; with
    $JCOMPILEMASK_CUTE_BWD_NATIVE=0 the backward runs D 128's in place on them (and on that
    forward's out / lse)."""
    monkeypatch.setenv(backends.CUTE_BWD_NATIVE_ENV, "0")
    spec = {"causal": jcm.masks.causal(), "sliding_window": jcm.masks.sliding_window(48)}[mask]
    q, k, v, do = _qkv(d, d, dtype=dtype)
    with fake_cute_kernels(monkeypatch) as seen:
        def f(q, k, v):
            return jcm.mask_attention(q, k, v, spec, implementation="cute",
                                      logits_soft_cap=softcap)
        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        grads = vjp(do)
    call = backends.call_for(jcm.compile(spec), dtype=str(q.dtype), head_dim=d, head_dim_v=d,
                             num_heads=4, num_kv_heads=2)
    t = backends.get("cute").tiles(call)
    assert set(seen) == {("fwd", d, d, "as is", (t.block_q, t.block_kv)),
                         ("bwd", 128, 128, "tma", (t.bwd_block_q, t.bwd_block_kv))}, seen
    _check_oracle(spec, None, softcap, q, k, v, do, out, grads)


def test_native_forward_head_dims_switch(monkeypatch):
    """On by default (=0 runs D 128's in place); only D 80 / 96 with Dv == D have native
    forwards; a bad value is refused with the variable's name; explain() says which pass
    runs what."""
    assert backends.cute_forward_head_dims(96, 96) == (96, 96)
    monkeypatch.setenv(backends.CUTE_FWD_NATIVE_ENV, "0")
    assert backends.cute_forward_head_dims(96, 96) == (128, 128)
    assert backends.cute_forward_head_dims(72, 72) == (128, 128)
    monkeypatch.setenv(backends.CUTE_FWD_NATIVE_ENV, "1")
    assert backends.cute_forward_head_dims(96, 96) == (96, 96)
    assert backends.cute_forward_head_dims(80, 80) == (80, 80)
    assert backends.cute_forward_head_dims(96, 64) == (128, 128)
    assert backends.cute_forward_head_dims(112, 112) == (128, 128)
    assert backends.cute_forward_head_dims(64, 64) == (64, 64)
    # Narrower dims take the narrowest native kernel that fits where it beats the built pair.
    assert backends.cute_forward_head_dims(72, 72) == (80, 80)
    assert backends.cute_forward_head_dims(88, 88) == (96, 96)
    assert backends.cute_forward_head_dims(56, 56) == (64, 64)
    assert backends.cute_forward_head_dims(72, 64) == (128, 128)
    assert backends.cute_forward_head_dims(320, 320) is None
    cm = jcm.compile(jcm.masks.causal())
    call = backends.call_for(cm, dtype="bfloat16", head_dim=96, head_dim_v=96, num_heads=8,
                             num_kv_heads=8)
    monkeypatch.setenv(backends.CUTE_BWD_NATIVE_ENV, "0")
    with fake_cute_kernels(monkeypatch):
        text = backends.explain(call)
    assert ("chosen: cute (the forward has kernels of head dims 96/96; the backward runs them "
            "zero-padded to 128/128: exact, 1.33x the matmul work, read in place") in text, text
    monkeypatch.setenv(backends.CUTE_FWD_NATIVE_ENV, "yes")
    with pytest.raises(ValueError, match="JCOMPILEMASK_CUTE_FWD_NATIVE must be 0 or 1"):
        backends.cute_forward_head_dims(96, 96)


def test_native_forward_keys():
    """ForwardKey takes D 80 / 96 with Dv == D (D 128's switches) and refuses other widths."""
    base = dict(dtype="bfloat16", num_intervals=1, block_q=128, block_kv=128,
                broadcast_batch=True, broadcast_head=True, scale=0.1)
    for d in cute_api.FWD_NATIVE_HEAD_DIMS:
        sw = cute_api.forward_switches(d, d, 128, 128, 2)
        assert sw == cute_api.forward_switches(128, 128, 128, 128, 2)
        key = cute_api.ForwardKey(head_dim=d, head_dim_v=d, **base, **sw)
        assert f"_d{d}x{d}_" in key.target_name
    for d, dv in ((96, 64), (112, 112), (48, 48)):
        with pytest.raises(ValueError, match="cute forward is built for head dims"):
            cute_api.ForwardKey(head_dim=d, head_dim_v=dv, **base)


@pytest.mark.parametrize("fwd,bwd", [("1", "1"), ("0", "1")])
def test_native_backward_head_dims(monkeypatch, fwd, bwd):
    """$JCOMPILEMASK_CUTE_BWD_NATIVE=1: D 96's backward runs its own kernels on the arrays as
    they are, after either forward; D 80 and 72 run it in place, zero-padded to 96 (not
    128); the forward runs D 80 as is, D 72 in place on the 80 kernel."""
    monkeypatch.setenv(backends.CUTE_FWD_NATIVE_ENV, fwd)
    monkeypatch.setenv(backends.CUTE_BWD_NATIVE_ENV, bwd)
    spec = jcm.masks.causal()
    assert backends.cute_backward_head_dims(80, 80) == (96, 96)
    assert backends.cute_backward_head_dims(64, 64) == (64, 64)
    assert backends.cute_backward_head_dims(104, 104) == (128, 128)
    for d, want_bwd in ((96, (96, 96, "as is")), (80, (96, 96, "tma")), (72, (96, 96, "tma"))):
        q, k, v, do = _qkv(d, d)
        with fake_cute_kernels(monkeypatch) as seen:
            out, vjp = jax.vjp(jax.jit(lambda q, k, v: jcm.mask_attention(
                q, k, v, spec, implementation="cute")), q, k, v)
            grads = vjp(do)
        native_fwd = {96: (96, 96, "as is"), 80: (80, 80, "as is"), 72: (80, 80, "tma")}[d]
        want_fwd = native_fwd if fwd == "1" else (128, 128, "tma")
        assert {s[:4] for s in seen} == {("fwd",) + want_fwd, ("bwd",) + want_bwd}, seen
        _check_oracle(spec, None, None, q, k, v, do, None, grads)
    for d, want in ((80, "the forward has kernels of head dims 80/80; the backward runs them "
                         "zero-padded to 96/96: exact, 1.20x the matmul work, read in place")
                    if fwd == "1" else
                    (80, "head dims 80/80 run zero-padded: the forward to 128/128 (1.60x the "
                         "matmul work), the backward to 96/96 (1.20x); exact, read in place"),
                    (72, "head dims 72/72 run zero-padded: the forward to 80/80 (1.11x the "
                         "matmul work), the backward to 96/96 (1.33x); exact, read in place")
                    if fwd == "1" else
                    (72, "head dims 72/72 run zero-padded: the forward to 128/128 (1.78x the "
                         "matmul work), the backward to 96/96 (1.33x); exact, read in place")):
        call = backends.call_for(jcm.compile(spec), dtype="bfloat16", head_dim=d, head_dim_v=d,
                                 num_heads=8, num_kv_heads=8)
        with fake_cute_kernels(monkeypatch):
            text = backends.explain(call)
        assert want in text, text
    cm = jcm.compile(spec)
    call = backends.call_for(cm, dtype="bfloat16", head_dim=96, head_dim_v=96, num_heads=8,
                             num_kv_heads=8)
    with fake_cute_kernels(monkeypatch):
        text = backends.explain(call)
    if fwd == "1":
        assert "chosen: cute (kernels of head dims 96/96 of their own in both passes)" in text
    else:
        assert ("chosen: cute (the backward has kernels of head dims 96/96; the forward runs "
                "them zero-padded to 128/128") in text, text
    assert "backward: the CuTe backward kernel" in text
