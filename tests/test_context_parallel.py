"""Context parallelism: ring attention over a mesh axis, layouts, plans and the cost report.

The multi-device equality checks (every built-in mask and random lowered specs, forward
and gradients against the single-device call under the tolerance policy) run in a
subprocess with 8 host devices (tests/scripts/context_parallel_check.py); the rest runs
here on one device.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jcompilemask as jcm
from jcompilemask import parallel as par

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T8 = dict(block_q=8, block_kv=8, bwd_block_q=8, bwd_block_kv=8)


def _desc(name, n=64, b=2, seed=0, tiles=T8):
    rng = np.random.default_rng(seed)
    if name == "causal":
        return jcm.compile(jcm.masks.causal()).instantiate(None, n, **tiles)
    if name == "full":
        return jcm.compile(jcm.masks.full()).instantiate(None, n, **tiles)
    if name == "hstu":
        g = rng.integers(2, 4, b)
        md = {"context_len": rng.integers(n // 4, n // 2, b).astype(np.int32),
              "history_end": (n - g * 3).astype(np.int32), "group_size": g.astype(np.int32)}
        return jcm.compile(jcm.masks.hstu()).instantiate(md, n, **tiles)
    if name == "shared_prompt":
        lens = rng.integers(n // 16, n // 8, (b, 4))
        p = n - lens.sum(1)
        starts = p[:, None] + np.concatenate([np.zeros((b, 1), int), np.cumsum(lens, 1)[:, :-1]], 1)
        md = {"prompt_len": p.astype(np.int32), "response_starts": starts.astype(np.int32)}
        return jcm.compile(jcm.masks.shared_prompt(4)).instantiate(md, n, **tiles)
    raise AssertionError(name)


def test_multi_device_equals_single_device():
    """Every built-in mask and two random lowered specs over 2 devices, hstu and shared
    prompt over 4 (balanced layouts), causal over 8 (zigzag), a descriptor built inside
    shard_map (traced: full ring), and bfloat16: forward and gradients within policy."""
    script = os.path.join(ROOT, "tests", "scripts", "context_parallel_check.py")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, script], capture_output=True, text=True,
                         timeout=1800, env=env)
    assert res.returncode == 0 and "OK 21 8" in res.stdout, (res.stdout[-2000:],
                                                             res.stderr[-4000:])


@pytest.mark.parametrize("name", ["causal", "hstu", "shared_prompt", "full"])
@pytest.mark.parametrize("p", [2, 4])
def test_balance_permutation_round_trips_and_balances(name, p):
    desc = _desc(name)
    lay = par.balance_permutation(desc, p, 2)
    assert sorted(lay) == list(range(2 * p))
    x = np.arange(2 * 64 * 3).reshape(2, 64, 3)
    for arr in (x, jnp.asarray(x)):
        y = par.permute_sequence(arr, lay)
        assert not np.array_equal(np.asarray(y), x) or lay == tuple(range(2 * p))
        np.testing.assert_array_equal(np.asarray(par.unpermute_sequence(y, lay)), x)
    # lse layout: the sequence is axis 2
    z = np.arange(2 * 3 * 64).reshape(2, 3, 64)
    np.testing.assert_array_equal(par.unpermute_sequence(par.permute_sequence(z, lay, 2),
                                                         lay, 2), z)
    bal = par.cost_report(desc, par.ring_plan(desc, p, lay), kv_bytes_per_token=1)
    ident = par.cost_report(desc, par.ring_plan(desc, p, tuple(range(2 * p))),
                            kv_bytes_per_token=1)
    assert bal["work_max_min"] <= ident["work_max_min"] + 1e-9
    if name == "causal":
        assert lay == par.zigzag_permutation(p)
        assert bal["work_max_min"] < 1.1


def test_row_work_and_chunk_visibility_match_the_dense_mask():
    for name in ("causal", "hstu", "shared_prompt"):
        desc = _desc(name)
        dense = np.asarray(desc.as_dense())                          # [B, 1, N, N]
        np.testing.assert_array_equal(par.row_work(desc), dense.sum((0, 1, 3)))
        vis = par.chunk_visibility(desc, 8)
        want = dense.any((0, 1)).reshape(8, 8, 8, 8).any((1, 3))
        np.testing.assert_array_equal(vis, want)


def test_plan_sends_only_what_later_devices_see():
    desc = _desc("shared_prompt")
    lay = par.balance_permutation(desc, 4, 2)
    plan = par.ring_plan(desc, 4, lay)
    vis = par.chunk_visibility(desc, 8)
    cpd = 2
    for t in range(4):
        for j in range(cpd):
            kc = lay[t * cpd + j]
            readers = [s for s in range(4)
                       if vis[[lay[((t + s) % 4) * cpd + i] for i in range(cpd)], kc].any()]
            assert plan.last_step[t][j] == (max(readers) if readers else -1)
    assert plan.forward_sends() < plan.full_ring_forward_sends()
    full = par.ring_plan(_desc("full"), 4)
    assert full == par.full_ring_plan(4)
    assert full.forward_sends() == full.full_ring_forward_sends() == 12
    assert full.backward_sends() == full.full_ring_backward_sends() == (12, 16)


def test_cost_script_small_and_consistent(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "cp_cost", os.path.join(ROOT, "benchmarks", "cp_cost.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--n", "2048", "--devices", "2", "4", "--block", "32",
                     "--json", str(tmp_path / "cost.json")])
    text = capsys.readouterr().out
    assert "work max/min" in text and len(rows) == 6
    for r in rows:
        assert r["fwd_bytes"] <= r["fwd_bytes_full_ring"]
        assert r["bwd_bytes"] <= r["bwd_bytes_full_ring"]
        assert r["work_max_min"] >= 1.0 and r["tiles_max_min"] >= 1.0
        assert r["work_max_min"] == pytest.approx(max(r["work_per_device"]) /
                                                  min(r["work_per_device"]))
        assert r["chunks"] * r["chunk_rows"] == r["n"]
        assert sorted(r["layout"]) == list(range(r["chunks"]))
        # every visible pair lands on exactly one device
        assert sum(r["work_per_device"]) > 0
        p, c = r["devices"], r["chunks"]
        full_fwd = (p - 1) * c * r["chunk_rows"]
        assert r["fwd_bytes_full_ring"] % full_fwd == 0
    causal = [r for r in rows if r["mask"] == "causal"]
    assert all(r["work_max_min"] < 1.1 for r in causal)


def test_errors_are_clear():
    desc = _desc("causal", n=32)
    q = jnp.zeros((1, 32, 2, 8))
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        par.ring_attention(q, q, q, desc, axis_name="cp")
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))

    def call(mask, x, **kw):
        f = jax.shard_map(lambda a: jcm.mask_attention(a, a, a, mask, context_axis="cp", **kw),
                          mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
        return f(x)

    with pytest.raises(ValueError, match="whole sequence"):
        call(desc, jnp.zeros((1, 16, 2, 8)))
    with pytest.raises(ValueError, match="permutation"):
        call(desc, q, context_layout=(0, 0))
    with pytest.raises(ValueError, match="multiple of the descriptor's"):
        call(desc, q, context_layout=tuple(range(8)))           # chunks of 4 rows
    fb = jcm.MaskSpec([jcm.Region((0, jcm.spec.q_len), jcm.spec.k % 3 != 1)])
    fdesc = jcm.compile(fb).instantiate(None, 32, **T8)
    with pytest.raises(ValueError, match="fall back"):
        call(fdesc, q)
    if jcm.backends.get("cute").available() is not None:    # named and unavailable: raises
        with pytest.raises(jcm.backends.BackendUnavailable, match="implementation='cute'"):
            call(desc, q, implementation="cute")
    with pytest.raises(ValueError, match="only used together"):
        jcm.mask_attention(q, q, q, desc, context_layout=(0,))
    with pytest.raises(TypeError, match="concrete descriptor"):
        jax.jit(lambda d: par.balance_permutation(d, 2))(desc)


def test_spec_with_metadata_on_one_device():
    """A MaskSpec + metadata is instantiated at the whole length; one device = no ring."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    q = jax.random.normal(jax.random.key(3), (2, 64, 2, 8))
    md = {"prefix_len": np.array([5, 40], np.int32)}
    spec = jcm.masks.prefix_lm()
    f = jax.shard_map(lambda a: jcm.mask_attention(a, a, a, spec, metadata=md,
                                                   context_axis="cp"),
                      mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
    ref = jax.jit(lambda a: jcm.mask_attention(a, a, a, spec, metadata=md))(q)
    np.testing.assert_allclose(np.asarray(f(q)), np.asarray(ref), atol=1e-5)


_EAGER = r'''
import os
# XLA's CPU backend at optimization level 0 (as in the suite): op by op, each op is its own
# compiled program.
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=2 "
                           "--xla_backend_optimization_level=0")
import jax, jax.numpy as jnp, numpy as np, jcompilemask as jcm
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
x = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
for spec, md in ((jcm.masks.prefix_lm(), {"prefix_len": np.array([20], np.int32)}),
                 (jcm.masks.dilated_window(9, dilation=2), None)):
    # the single-device values to compare with, jitted (one program each)
    want_out = jax.jit(lambda a: jcm.mask_attention(a, a, a, spec, metadata=md))(x)
    want = jax.jit(jax.grad(lambda a: jcm.mask_attention(a, a, a, spec, metadata=md).sum()))(x)
    f = jax.shard_map(lambda a: jcm.mask_attention(a, a, a, spec, metadata=md,
                                                   context_axis="cp"),
                      mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
    err = float(jnp.abs(f(x) - want_out).max())
    assert err < 1e-5, err
    # gradients of the unjitted shard_map: jax.grad's JVP trace sits above the shard_map's
    # and passes the preprocess's ops down to it one by one (the same crash without the fix)
    for axis in ("cp", None):
        g = jax.shard_map(lambda a: jcm.mask_attention(a, a, a, spec, metadata=md,
                                                       context_axis=axis),
                          mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
        xs = jax.device_put(x, jax.NamedSharding(mesh, P(None, "cp")))
        with jax.set_mesh(mesh):
            got = jax.grad(lambda a: g(a).sum())(xs)
        if axis:
            err = float(jnp.abs(got - want).max())
            assert err < 1e-4, err
print("EAGER OK")
'''


def test_a_spec_in_an_eager_shard_map_builds_its_descriptor():
    """Unjitted shard_map, the descriptor built inside from a spec: op by op, jaxlib's
    Shardy canonicalizer segfaults on one of the preprocess's ops, so the preprocess runs
    as one jitted program there (lower/preprocess.py), also below jax.grad's traces."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _EAGER], capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0 and "EAGER OK" in res.stdout, (res.returncode,
                                                             res.stderr[-3000:])
