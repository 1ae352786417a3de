"""Custom-call results inside ``jax.shard_map`` are typed as varying over the mesh axes
their operands vary over (``jcompilemask.ffi.match_varying``).

Found on the H200: ``jax.vjp`` of ``mask_attention(..., implementation="cute")`` inside a
``shard_map`` over a one-device mesh raised "unexpected JAX type ... for argument to VJP
function", because ``jax.ffi.ffi_call`` types its results as invariant across the mesh
while the cotangent is per-device. Checked here at trace level (no kernel runs, no GPU):
the CuTe calls' results carry their operands' varying axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jcompilemask as jcm
from jcompilemask.ffi import match_varying
from jcompilemask.ffi.registry import _varying_axes
from jcompilemask.kernels.cute import api as cute_api


def _mesh():
    return jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def test_match_varying_marks_missing_axes_only():
    seen = {}

    def f(x, y):
        z = jnp.zeros(x.shape, x.dtype)                     # invariant, as an ffi result
        seen["before"] = _varying_axes(z)
        z2, y2 = match_varying((z, y), x)
        seen["after"] = (_varying_axes(z2), _varying_axes(y2))
        return x + z2 + y2

    spec = P("data", None, "model")
    sm = jax.shard_map(f, mesh=_mesh(), in_specs=(spec, spec), out_specs=spec)
    x = jnp.ones((2, 4, 2))
    assert sm(x, x).shape == x.shape
    assert seen["before"] == frozenset()
    assert seen["after"] == (frozenset({"data", "model"}),) * 2
    # Outside shard_map: unchanged objects.
    a = jnp.ones(3)
    assert match_varying(a, a) is a


def test_cute_calls_are_varying_inside_shard_map(monkeypatch):
    # Trace only: the FFI target need not exist (nothing is lowered or run).
    monkeypatch.setattr(cute_api, "_ensure_registered", lambda key: "jcm_test_unregistered")
    n, h, d = 256, 2, 128
    desc = jcm.compile(jcm.masks.causal()).instantiate(
        None, n, block_q=128, block_kv=128, bwd_block_q=64, bwd_block_kv=128)
    got = {}

    def f(q, k, v, do):
        o, lse = cute_api.cute_forward(q, k, v, desc.fwd_intervals, desc.fwd_tiles)
        dq, dk, dv = cute_api.cute_backward(q, k, v, o, lse, do, desc.bwd_intervals,
                                            desc.bwd_tiles, desc.fwd_intervals, desc.bwd_exact)
        got.update(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
        return o + dq
    spec = P("data", None, "model")
    sm = jax.shard_map(f, mesh=_mesh(), in_specs=(spec,) * 4, out_specs=spec)
    x = jax.ShapeDtypeStruct((1, n, h, d), jnp.bfloat16)
    jax.jit(sm).trace(x, x, x, x)
    for name, val in got.items():
        assert _varying_axes(val) == {"data", "model"}, name


def test_cute_forward_under_vjp_inside_shard_map(monkeypatch):
    """The failing H200 pattern at trace level: jax.vjp of a custom_vjp whose forward is
    the CuTe custom call, the cotangent per-device."""
    monkeypatch.setattr(cute_api, "_ensure_registered", lambda key: "jcm_test_unregistered")
    n, h, d = 256, 2, 128
    desc = jcm.compile(jcm.masks.causal()).instantiate(
        None, n, block_q=128, block_kv=128, bwd_block_q=64, bwd_block_kv=128)

    @jax.custom_vjp
    def attend(q, k, v):
        return cute_api.cute_forward(q, k, v, desc.fwd_intervals, desc.fwd_tiles)[0]

    def fwd(q, k, v):
        o, lse = cute_api.cute_forward(q, k, v, desc.fwd_intervals, desc.fwd_tiles)
        return o, (q, k, v, o, lse)

    def bwd(res, do):
        q, k, v, o, lse = res
        return cute_api.cute_backward(q, k, v, o, lse, do, desc.bwd_intervals, desc.bwd_tiles,
                                      desc.fwd_intervals, desc.bwd_exact)
    attend.defvjp(fwd, bwd)

    def local(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(do))
    spec = P("data", None, "model")
    sm = jax.shard_map(local, mesh=_mesh(), in_specs=(spec,) * 4, out_specs=(spec,) * 4)
    x = jax.ShapeDtypeStruct((1, n, h, d), jnp.bfloat16)
    jax.jit(sm).trace(x, x, x, x)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
