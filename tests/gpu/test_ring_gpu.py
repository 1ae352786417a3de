"""Context parallelism on the GPU: each ring step of ``ring_attention`` runs the CuTe
forward and backward kernels (the registry's choice on an H200), over a one-device mesh.

One device is one ring step, over the whole sequence in one chunk (layout None) or over
four chunks in a permuted layout: a cut sub-descriptor that is not the global one (K x 4
interval slots per row, Kc x 4 per column, the tile maps permuted). A recording wrapper
around the registered cute backend checks that the steps reach the CuTe kernels (not the
xla fallbacks) at the CuTe tiles. Forward (out, lse) and gradients against the dense
reference under the tolerance policy, and against the single-device CuTe call. The
multi-step merge (several devices) runs on the CPU with a fake backend
(tests/test_ring_backends.py) and on a multi-GPU kind through benchmarks/multi_gpu.py.

Runs on an SM90 GPU with the CUDA extras; skips elsewhere with the reason.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask import parallel as par
from jcompilemask.testing import assert_within_policy, reference_attention, reference_gradients
from gpu_cases import SPECS, gradient_problems, metadata  # tests/gpu is on sys.path under pytest

_why = backends.get("cute").available()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")

B, N, HQ, HKV, D = 2, 1024, 4, 2, 128
DTYPE = jnp.bfloat16
LAYOUT = (0, 3, 1, 2)        # 4 chunks of 256 rows on the one device


def _desc(name, md):
    """The descriptor of the whole sequence at the CuTe tiles (128 x 128, 64 x 128)."""
    tiles = dataclasses.asdict(backends.get("cute").tiles(None))
    return jcm.compile(SPECS[name]).instantiate(md, N, N, preprocess="jnp", **tiles)


@pytest.fixture
def recorded():
    """The cute backend, wrapped to record each call's sub-descriptor (and whether the
    CuTe backward kernel serves it: None) at trace time."""
    real = backends.get("cute")
    seen = []

    def forward(q, k, v, desc, scale, softcap):
        seen.append(("fwd", desc.tiles, desc.num_intervals, desc.q_len, None))
        return real.forward(q, k, v, desc, scale, softcap)

    def backward(q, k, v, desc, scale, softcap, out, lse, do, dlse=None, **kw):
        seen.append(("bwd", desc.tiles, desc.num_intervals, desc.q_len,
                     backends.cute_backward_reason(q, v, desc, softcap)))
        return real.backward(q, k, v, desc, scale, softcap, out, lse, do, dlse, **kw)

    backends._REGISTRY["cute"] = dataclasses.replace(real, forward=forward, backward=backward)
    try:
        yield seen
    finally:
        backends._REGISTRY["cute"] = real


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    mk = lambda kk, h: jax.random.normal(kk, (B, N, h, D), jnp.float32).astype(DTYPE)  # noqa: E731
    return mk(ks[0], HQ), mk(ks[1], HKV), mk(ks[2], HKV), mk(ks[3], HQ)


def _with_grads(f, do):
    def g(a, b_, c):
        (out, lse), pull = jax.vjp(f, a, b_, c)
        return out, lse, pull((do, jnp.zeros_like(lse)))
    return jax.jit(g)


def _ring(mask, layout, md=None, **kw):
    """out, lse [B, N, H], grads of mask_attention(context_axis=...) over a one-device
    mesh, inputs permuted into ``layout`` and the results back."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    chunks = layout or (0,)
    attend = jax.shard_map(
        lambda a, b_, c: jcm.mask_attention(a, b_, c, mask, metadata=md, context_axis="cp",
                                            context_layout=layout, return_residual=True, **kw),
        mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))

    def f(a, b_, c):
        perm = lambda x: par.permute_sequence(x, chunks)   # noqa: E731
        out, lse = attend(perm(a), perm(b_), perm(c))
        return par.unpermute_sequence(out, chunks), par.unpermute_sequence(lse, chunks)
    return f


def _check(name, got, dense, args):
    qx, kx, vx, do = args
    out, lse, grads = got
    hi = reference_attention(qx, kx, vx, dense, precision="high")
    lo = reference_attention(qx, kx, vx, dense, precision="input")
    assert out.dtype == DTYPE
    assert_within_policy(out, hi[0], lo[0], f"{name} out")
    assert_within_policy(jnp.swapaxes(lse, 1, 2), hi[1], lo[1], f"{name} lse")
    g_hi, g_lo = reference_gradients(qx, kx, vx, do, dense)
    problems = gradient_problems(grads, g_hi, g_lo, DTYPE)
    assert not problems, f"{name}: " + "; ".join(problems)


def _same(got, want):
    # The same kernels on the same rows (a permuted problem); dQ's atomic order may differ.
    out, lse, grads = got
    w_out, w_lse, w_grads = want
    for a, b_ in zip((out, *grads), (w_out, *w_grads)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b_, np.float32),
                                   rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(w_lse), rtol=1e-4, atol=1e-4)


def _seen_cute(seen, desc, cpd):
    cute_tiles = backends.get("cute").tiles(None)
    assert {s[0] for s in seen} == {"fwd", "bwd"}, seen
    for kind, tiles, k, q_len, bwd_why in seen:
        assert tiles == cute_tiles and q_len == N, seen
        assert k == cpd * desc.num_intervals, seen
        assert bwd_why is None, f"the ring step's gradients left the CuTe backward: {bwd_why}"


@pytest.mark.parametrize("layout", [None, LAYOUT], ids=["one-chunk", "four-chunks"])
@pytest.mark.parametrize("name", ["causal", "hstu"])
def test_ring_steps_run_the_cute_kernels(name, layout, recorded):
    md = metadata(name, B, N, np.random.default_rng(3))
    desc = _desc(name, md)
    args = _inputs()
    got = _with_grads(_ring(desc, layout), args[3])(*args[:3])
    _seen_cute(recorded, desc, 1 if layout is None else len(layout))
    _check(name, got, desc.as_dense(), args)
    single = _with_grads(lambda a, b_, c: jcm.mask_attention(
        a, b_, c, desc, implementation="cute", return_residual=True), args[3])(*args[:3])
    _same(got, single)


def test_ring_with_a_spec_instantiates_at_the_cute_tiles(recorded):
    """A MaskSpec + metadata and implementation=None: the ring builds the descriptor at the
    CuTe tiles (chunks of 256 rows are whole tiles) and its steps run the kernels."""
    name = "hstu"
    md = {key: np.asarray(val, np.int32) for key, val in
          metadata(name, B, N, np.random.default_rng(4)).items()}
    args = _inputs(1)
    got = _with_grads(_ring(SPECS[name], LAYOUT, md), args[3])(*args[:3])
    desc = _desc(name, md)
    _seen_cute(recorded, desc, len(LAYOUT))
    _check(name, got, desc.as_dense(), args)


@pytest.mark.parametrize("documents", [False, True], ids=["window", "documents"])
@pytest.mark.parametrize("arg", ["descriptor", "spec"])
def test_ring_runs_residue_classes_on_the_cute_kernels(arg, documents, recorded):
    """A dilated window (issue 16's: window 128, dilation 2) as residue classes: the shard
    viewed as [B, N / 2, 2 H, D] is its chunks of the class sequence, so every step runs
    the class mask (N / 2 rows, chunks of 128 class rows: whole CuTe tiles) on the
    kernels, with no residual predicate. Over packed documents each class has its own
    descriptor (per-head tables to the kernels)."""
    spec = jcm.masks.dilated_window(127, 0, dilation=2, documents=documents)
    md = None
    if documents:
        md = {key: np.asarray(val, np.int32) for key, val in
              metadata("document", B, N, np.random.default_rng(5)).items()}
    tiles = dataclasses.asdict(backends.get("cute").tiles(None))
    desc = jcm.compile(spec).instantiate(md, N, N, preprocess="jnp", **tiles)
    assert isinstance(desc, jcm.ClassDescriptor) and desc.classes == 2
    assert desc.per_class == documents
    args = _inputs(2)
    got = _with_grads(_ring(desc, LAYOUT) if arg == "descriptor" else _ring(spec, LAYOUT, md),
                      args[3])(*args[:3])
    cute_tiles = backends.get("cute").tiles(None)
    assert {s[0] for s in recorded} == {"fwd", "bwd"}, recorded
    for kind, t, k, q_len, bwd_why in recorded:
        assert t == cute_tiles and q_len == N // 2, recorded
        assert k == len(LAYOUT) * desc.inner.num_intervals, recorded
        assert bwd_why is None, f"the ring step's gradients left the CuTe backward: {bwd_why}"
    _check("dilated_window", got, desc.as_dense(), args)
