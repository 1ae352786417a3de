"""Context parallelism through the backend registry: each ring step dispatches to the
backend ``mask_attention`` would pick (or ``implementation=``), on a sub-descriptor cut at
that backend's tiles.

A fake backend (tests/ring_fake_backend.py: the xla arithmetic, its own tiles, outputs
rounded to bfloat16 like the CuTe kernels') records the per-step calls. Here, on one
device, the ring is one step over several chunks (a permuted layout: a non-trivial
sub-descriptor); the multi-step ring over 4 host devices (8 are set before JAX starts)
runs in a subprocess, tests/scripts/ring_backends_check.py.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask import parallel as par
from jcompilemask.lower.descriptor import COMPUTE, MASKED, TileConfig
from jcompilemask.parallel.ring import _Cutter

import ring_fake_backend as fake   # tests/ is on sys.path under pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, N, HQ, HKV, D = 2, 64, 4, 2, 16
LAYOUT = (0, 3, 1, 2)               # 4 chunks of 16 rows on the one device
FAKE = dict(block_q=fake.TILES.block_q, block_kv=fake.TILES.block_kv,
            bwd_block_q=fake.TILES.bwd_block_q, bwd_block_kv=fake.TILES.bwd_block_kv)


def _hstu(n=N, b=B, tiles=FAKE, seed=0):
    rng = np.random.default_rng(seed)
    g = rng.integers(2, 4, b)
    md = {"context_len": rng.integers(n // 4, n // 2, b).astype(np.int32),
          "history_end": (n - g * 3).astype(np.int32), "group_size": g.astype(np.int32)}
    return jcm.compile(jcm.masks.hstu()).instantiate(md, n, **tiles), md


def _inputs(dtype=jnp.float32, seed=1):
    ks = jax.random.split(jax.random.key(seed), 4)
    mk = lambda kk, h: jax.random.normal(kk, (B, N, h, D), jnp.float32).astype(dtype)  # noqa: E731
    return mk(ks[0], HQ), mk(ks[1], HKV), mk(ks[2], HKV), mk(ks[3], HQ)


def _ring(mask, layout=LAYOUT, **kw):
    """out, lse, (dq, dk, dv) of mask_attention(context_axis=...) on a one-device mesh,
    in the original order."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    chunks = layout or (0,)
    attend = jax.shard_map(
        lambda a, b_, c: jcm.mask_attention(a, b_, c, mask, context_axis="cp",
                                            context_layout=layout, return_residual=True,
                                            **kw),
        mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))

    def f(a, b_, c):
        perm = lambda x: par.permute_sequence(x, chunks)   # noqa: E731
        out, lse = attend(perm(a), perm(b_), perm(c))
        return par.unpermute_sequence(out, chunks), par.unpermute_sequence(lse, chunks)
    return _with_grads(f)


def _with_grads(f):
    def g(a, b_, c, do):
        (out, lse), pull = jax.vjp(f, a, b_, c)
        return out, lse, pull((do.astype(out.dtype), jnp.zeros_like(lse)))
    return jax.jit(g)


def _single(desc, **kw):
    return _with_grads(lambda a, b_, c: jcm.mask_attention(a, b_, c, desc, return_residual=True,
                                                           **kw))


def _flat(res):
    out, lse, grads = res
    return [np.asarray(x, np.float64) for x in (out, lse, *grads)]


def _close(got, want, atol):
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), _flat(got), _flat(want)):
        assert np.array_equal(np.isneginf(a), np.isneginf(w)), name
        fin = ~np.isneginf(w)
        np.testing.assert_allclose(a[fin], w[fin], rtol=0,
                                   atol=atol * max(1.0, np.abs(w[fin]).max()), err_msg=name)


def test_xla_explicit_equals_default_and_the_single_device_call():
    """On the CPU the registry's choice is xla: implementation=None and 'xla' trace to one
    program, equal to the single-device call as before."""
    desc, _ = _hstu(tiles=dict(block_q=8, block_kv=8, bwd_block_q=8, bwd_block_kv=8))
    args = _inputs()
    auto, named = _ring(desc), _ring(desc, implementation="xla")
    assert str(jax.make_jaxpr(auto)(*args)) == str(jax.make_jaxpr(named)(*args))
    _close(named(*args), _single(desc, implementation="xla")(*args), 2e-5)


@functools.partial(jax.jit, static_argnums=1)
def _cut(desc, plan, d, src):
    """(sub-descriptor, live, its dense views and tile maps) of device d's rows x device
    src's chunks (d, src traced: one compile per descriptor)."""
    sub, live = _Cutter(desc, plan, d).step(src)
    return sub, live, [(sub.as_dense(v), sub.tile_states(v)) for v in ("fwd", "bwd")]


def test_cut_sub_descriptor_keeps_the_contract():
    """A step's descriptor (device d's rows x the chunks of device src, P = 2, two chunks
    each) is exactly that block of the global mask, in both views and both tile maps,
    at the global descriptor's tiles."""
    for desc in (_hstu()[0], jcm.compile(jcm.masks.causal()).instantiate(None, N, **FAKE)):
        plan = par.ring_plan(desc, 2, LAYOUT)
        cs = N // 4
        rows_of = lambda dev: np.concatenate(   # noqa: E731
            [np.arange(c * cs, (c + 1) * cs) for c in LAYOUT[2 * dev:2 * dev + 2]])
        dense = {v: np.asarray(desc.as_dense(v)) for v in ("fwd", "bwd")}
        for d in range(2):
            for src in range(2):
                sub, live, views = _cut(desc, plan, jnp.int32(d), jnp.int32(src))
                assert sub.tiles == desc.tiles and sub.q_len == sub.kv_len == 2 * cs
                assert sub.num_intervals == 2 * desc.num_intervals
                np.testing.assert_array_equal(np.asarray(sub.row_region),
                                              np.asarray(desc.row_region)[:, rows_of(d)])
                for view, (got, states) in zip(("fwd", "bwd"), views):
                    want = dense[view][:, :, rows_of(d)][..., rows_of(src)]
                    np.testing.assert_array_equal(np.asarray(got), want)
                    bq, bk = sub._blocks(view)
                    tiles = want.reshape(want.shape[:2] + (2 * cs // bq, bq, 2 * cs // bk, bk))
                    np.testing.assert_array_equal(
                        np.asarray(states), np.where(tiles.any((3, 5)), COMPUTE, 0)
                        | np.where((~tiles).any((3, 5)), MASKED, 0))
                assert bool(live) == bool(want.any())


def test_registered_backend_runs_each_step_on_its_tiles():
    """The registry's choice (here the fake backend, above xla) runs the step, forward and
    backward, on a sub-descriptor at its tiles with K x 4 interval slots (4 held chunks);
    its bfloat16-rounded partials are cast up: the float32 result is within bfloat16
    rounding of the single-device call, and not bit-equal to the xla ring's."""
    desc, _ = _hstu()
    args = _inputs()
    with fake.registered("fake_one") as seen:
        got = _ring(desc)(*args)
    fake.check_seen(seen, batch=B, rows=N, k_slots=4 * desc.num_intervals,
                    kc_slots=4 * desc.num_bwd_intervals, q_heads=HQ)
    assert got[0].dtype == jnp.float32 and got[2][0].dtype == jnp.float32
    assert not any(s.deterministic for s in seen)
    want = _single(desc, implementation="xla")(*args)
    _close(got, want, 2 ** -7)
    assert not np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    with fake.registered("fake_one") as seen:          # deterministic= reaches the steps
        jax.make_jaxpr(_ring(desc, deterministic=True))(*args)
    bwd = [s.deterministic for s in seen if s.kind == "bwd"]
    assert bwd and all(bwd), seen


def test_refused_step_falls_back_to_xla_with_a_notice(caplog):
    """A backend that takes the call (K intervals) but refuses a step's (K x 4 slots) is
    replaced by xla for the steps, and says so once."""
    desc, _ = _hstu()
    args = _inputs()
    xla_ring = _ring(desc, implementation="xla")(*args)
    with fake.registered("fake_small_k", max_intervals=desc.num_intervals) as seen:
        with caplog.at_level(logging.WARNING, logger="jcompilemask"):
            got = _ring(desc, implementation="fake_small_k")(*args)
    assert not seen
    notes = [r.getMessage() for r in caplog.records if "fake_small_k" in r.getMessage()]
    assert len(notes) == 1 and "runs the xla backend per ring step" in notes[0], notes
    assert "4 held key chunk(s)" in notes[0]
    for a, b_ in zip(_flat(got), _flat(xla_ring)):
        np.testing.assert_array_equal(a, b_)


def test_chunks_that_are_not_whole_tiles_of_the_backend(caplog):
    """8 chunks of 8 rows: not whole 16-row tiles of the fake backend. Named: a clear
    error (the argument, the tiles, the fix); automatic: xla with a notice; a prebuilt
    descriptor at other tiles: the registry's tile refusal."""
    layout = tuple(range(8))
    q = _inputs()[0]
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))

    def call(mask, **kw):
        f = jax.shard_map(lambda a: jcm.mask_attention(a, a, a, mask, context_axis="cp",
                                                       context_layout=layout, **kw),
                          mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
        return jax.jit(f)(q)

    spec = jcm.masks.causal()
    with fake.registered("fake_tiles"):
        with pytest.raises(ValueError) as err:
            call(spec, implementation="fake_tiles")
        msg = str(err.value)
        for part in ("a chunk has 8 rows", "8 chunks", "fake_tiles backend's tiles",
                     "block_q=16", "context_layout=", "implementation='xla'"):
            assert part in msg, (part, msg)
        with caplog.at_level(logging.WARNING, logger="jcompilemask"):
            auto = call(spec)
        notes = [r.getMessage() for r in caplog.records if "fake_tiles" in r.getMessage()]
        assert len(notes) == 1 and "runs the xla backend" in notes[0], notes
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(call(spec,
                                                                        implementation="xla")))
        desc = jcm.compile(spec).instantiate(None, N, **FAKE)
        with pytest.raises(ValueError, match="multiple of the descriptor's block_q=16.*"
                                             "fake_tiles backend runs only these tiles"):
            call(desc, implementation="fake_tiles")
        other = jcm.compile(spec).instantiate(None, N, block_q=8, block_kv=8, bwd_block_q=8,
                                              bwd_block_kv=8)
        with pytest.raises(backends.BackendUnavailable, match="instantiate with those tiles"):
            call(other, implementation="fake_tiles")


def test_chunks_take_the_backends_other_tiles_that_fit():
    """A backend that also runs other tiles (``Backend.tile_options``; cute at D 192: 64 x 96
    and 64 x 64 backward tiles) runs the ring on the first of them a chunk is a whole number
    of, instead of handing the ring to xla."""
    layout = tuple(range(8))                 # 8 chunks of 8 rows: TILES (16-row) misfit
    q = _inputs()[0]
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    eights = TileConfig(8, 8, 8, 8)

    def call(**kw):
        f = jax.shard_map(lambda a: jcm.mask_attention(a, a, a, jcm.masks.causal(),
                                                       context_axis="cp", context_layout=layout,
                                                       **kw),
                          mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
        return jax.jit(f)(q)

    with fake.registered("fake_more", other_tiles=(TileConfig(16, 16, 16, 16), eights)) as seen:
        got = call(implementation="fake_more")
    assert seen and all(s.tiles == eights for s in seen), seen
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(call(implementation="xla"), np.float32), atol=2e-2)
    # the CuTe backend's options at D 192 / 128: 64 x 96 first, then 64 x 64
    cute = backends.get("cute")
    c = backends.Call(dtype="bfloat16", head_dim=192, head_dim_v=128, num_heads=4,
                      num_kv_heads=2, softcap=False, has_fallback=False)
    assert [(t.bwd_block_q, t.bwd_block_kv) for t in cute.tile_options(c)] == [(64, 96), (64, 64)]
    assert {t.block_q for t in cute.tile_options(c)} == {cute.tiles(c).block_q}
    c128 = dataclasses.replace(c, head_dim=128, head_dim_v=128)
    assert cute.tile_options(c128) == (cute.tiles(c128),)


def test_multi_device_ring_through_the_registry():
    """4 host devices: the fake backend per step (a static plan, and the looped full ring
    of a traced descriptor), bfloat16 and float32, against the single-device call and the
    dense reference."""
    script = os.path.join(ROOT, "tests", "scripts", "ring_backends_check.py")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, script], capture_output=True, text=True,
                         timeout=900, env=env)
    assert res.returncode == 0 and "OK 2 8" in res.stdout, (res.stdout[-2000:],
                                                            res.stderr[-4000:])
