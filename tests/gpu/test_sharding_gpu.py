"""The CuTe path under JAX sharding on the GPU(s): inside ``jax.shard_map`` over a
one-device mesh, under ``jax.jit`` with a ``NamedSharding`` annotation, and with two or
more GPUs batch x head sharded with no collective in the compiled HLO (the partitioning
rules of jcompilemask.attention.partition, exercised on the CPU with the xla backend by
tests/test_sharding.py). Forward and gradients equal the unsharded CuTe call.

Runs on an SM90 GPU with the CUDA extras; skips elsewhere with the reason.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jcompilemask as jcm
from jcompilemask import backends
from gpu_cases import SPECS, metadata  # tests/gpu is on sys.path under pytest

_why = backends.get("cute").available()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")

B, N, HQ, HKV, D = 2, 1000, 4, 2, 128
COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|all-reduce|reduce-scatter|"
                        r"collective-permute)\b")


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    qx = jax.random.normal(ks[0], (B, N, HQ, D), jnp.float32).astype(jnp.bfloat16)
    kx = jax.random.normal(ks[1], (B, N, HKV, D), jnp.float32).astype(jnp.bfloat16)
    vx = jax.random.normal(ks[2], (B, N, HKV, D), jnp.float32).astype(jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, N, HQ, D), jnp.float32).astype(jnp.bfloat16)
    return qx, kx, vx, do


def _fn(desc):
    def attend_and_grad(q, k, v, do):
        out, vjp = jax.vjp(lambda a, b, c: jcm.mask_attention(a, b, c, desc,
                                                              implementation="cute"), q, k, v)
        return (out, *vjp(do))
    return attend_and_grad


def _desc(name):
    md = metadata(name, B, N, np.random.default_rng(3))
    return jcm.compile(SPECS[name]).instantiate(md, N, N)


def _same(got, want):
    # Same kernels on the same data; the backward's dQ accumulation order may differ.
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)


def _dspec(desc):
    return P("data") if desc.batch == B else P()


@pytest.mark.parametrize("name", ["causal", "document"])
def test_one_device_mesh_jit_and_shard_map(name):
    desc = _desc(name)
    args = _inputs()
    want = jax.jit(_fn(desc))(*args)
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))  # noqa: E731
    _same(jax.jit(_fn(desc))(*map(put, args)), want)

    def local(q, k, v, do, d):
        return _fn(d)(q, k, v, do)
    spec = P("data", None, "model")
    sm = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4 + (_dspec(desc),),
                       out_specs=(spec,) * 4)
    _same(jax.jit(sm)(*args, desc), want)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two or more GPUs")
@pytest.mark.parametrize("name", ["causal", "document"])
def test_batch_and_head_sharded_jit_is_local(name):
    n = len(jax.devices())
    mb = 2 if n >= 4 else 1
    mesh = jax.make_mesh((mb, min(HKV, n // mb)), ("data", "model"),
                         axis_types=(AxisType.Auto,) * 2)
    desc = _desc(name)
    args = _inputs()
    want = jax.jit(_fn(desc))(*args)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))  # noqa: E731
    dput = jax.device_put(desc, NamedSharding(mesh, _dspec(desc)))
    compiled = jax.jit(lambda q, k, v, do, d: _fn(d)(q, k, v, do)).lower(
        *map(put, args), dput).compile()
    assert not COLLECTIVE.findall(compiled.as_text())
    _same(compiled(*map(put, args), dput), want)
