"""The CuTe kernels' disk cache: a new process loads a compiled kernel instead of compiling.

The key / export / load tests need only nvidia-cutlass-dsl (CUTE_DSL_ARCH=sm_90a, no GPU);
the end-to-end test runs two processes on an SM90 GPU (the second must compile nothing and
give the first one's results) and skips elsewhere, saying why.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from gpu_cases import sm90_gpu_reason  # noqa: E402  (tests/gpu is on sys.path under pytest)

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")


def _fwd_key(**kw):
    from jcompilemask.kernels.cute import api
    return api.ForwardKey("bfloat16", 64, 64, 1, 128, 128, True, True, 64 ** -0.5, **kw)


def test_disk_key_follows_the_kernel_key_and_the_switches(monkeypatch):
    from jcompilemask.kernels.cute import api
    for env in (api.DISK_CACHE_ENV, "JCOMPILEMASK_CUTE_DUMP_DIR", "JCOMPILEMASK_CUTE_PTXAS_REMARKS"):
        monkeypatch.delenv(env, raising=False)
    a, b = api.disk_cache_key(_fwd_key()), api.disk_cache_key(_fwd_key(num_stages=1))
    assert a.kind == "cute-forward" and a.shape_class == (_fwd_key().target_name,)
    assert a.digest() != b.digest() and a.digest() == api.disk_cache_key(_fwd_key()).digest()
    assert dict(a.versions)["CUTE_DSL_ARCH"] == os.environ["CUTE_DSL_ARCH"]
    bk = api.BackwardKey("bfloat16", 128, 1, 1, True, True, 128 ** -0.5,
                         api.preferred_backward_config(128))
    assert api.disk_cache_key(bk).kind == "cute-backward"
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90")
    assert api.disk_cache_key(_fwd_key()).digest() != a.digest()
    monkeypatch.setenv(api.DISK_CACHE_ENV, "0")
    assert api.disk_cache_key(_fwd_key()) is None
    monkeypatch.setenv(api.DISK_CACHE_ENV, "1")
    monkeypatch.setenv("JCOMPILEMASK_CUTE_PTXAS_REMARKS", "1")     # a real compile's output
    assert api.disk_cache_key(_fwd_key()) is None


def test_package_fingerprint_covers_the_kernel_sources():
    from jcompilemask.kernels.cute import api
    fp = api._package_fingerprint()
    assert len(fp) == 24 and fp == api._package_fingerprint()


@needs_cutlass
def test_export_then_load_in_a_fresh_cache(tmp_path, monkeypatch):
    """Build once: saved as an object file, this process keeps its build; a new cache (a
    new process) loads the file and never compiles; an unloadable file is rebuilt."""
    from jcompilemask import ffi
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.DISK_CACHE_ENV, raising=False)
    monkeypatch.delenv("JCOMPILEMASK_CUTE_DUMP_DIR", raising=False)
    monkeypatch.delenv("JCOMPILEMASK_CUTE_PTXAS_REMARKS", raising=False)
    monkeypatch.setattr(ffi.cache, "_DEFAULT", ffi.CompileCache(tmp_path))
    key = _fwd_key()
    built = api.kernel_function(key)
    path = ffi.default_cache().path_for(api.disk_cache_key(key), "kernel.o")
    assert path.is_file() and path.stat().st_size > 0
    assert json.loads((path.parent / "key.json").read_text())["kind"] == "cute-forward"
    assert api.kernel_function(key) is built                   # memory hit

    def no_compile(k):
        raise AssertionError("compiled although the disk cache holds the kernel")

    monkeypatch.setattr(ffi.cache, "_DEFAULT", ffi.CompileCache(tmp_path))
    monkeypatch.setattr(api, "compile_forward", no_compile)
    import tvm_ffi
    loaded = api.kernel_function(key)
    assert isinstance(loaded, tvm_ffi.Function) and loaded is not built

    path.write_bytes(b"not an object file")                  # corrupt: rebuilt, loudly
    monkeypatch.setattr(ffi.cache, "_DEFAULT", ffi.CompileCache(tmp_path))
    monkeypatch.setattr(api, "compile_forward", lambda k: built)
    with pytest.warns(RuntimeWarning, match="did not load"):
        assert api.kernel_function(key) is built


_CHILD = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp
    import jcompilemask as jcm
    from jcompilemask.kernels.cute import api
    compiled = []
    for name in ("compile_forward", "compile_backward"):
        real = getattr(api, name)
        setattr(api, name, lambda key, real=real: compiled.append(key) or real(key))
    b, n, h = 2, 700, 4
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, n, h, 128)), jnp.bfloat16) for _ in range(4))
    md = {"context_len": np.array([100, 200]), "history_end": np.array([600, 650]),
          "group_size": np.array([4, 5])}
    spec = jcm.masks.hstu()
    def loss(q, k, v):
        o = jcm.mask_attention(q, k, v, spec, metadata=md, implementation="cute")
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o
    (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.savez(sys.argv[1], o=np.asarray(o.astype(jnp.float32)),
             **{n_: np.asarray(x.astype(jnp.float32)) for n_, x in zip("qkv", g)})
    print("COMPILED", len(compiled))
""")


def test_second_process_loads_and_matches_on_gpu(tmp_path):
    reason = sm90_gpu_reason()
    if reason:
        pytest.skip(reason)
    import numpy as np
    env = dict(os.environ, JCOMPILEMASK_CACHE_DIR=str(tmp_path / "cache"),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JCOMPILEMASK_CUTE_DUMP_DIR", None)
    env.pop("JCOMPILEMASK_CUTE_DISK_CACHE", None)
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}.npz"
        r = subprocess.run([sys.executable, "-c", _CHILD, str(out)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append((r.stdout, np.load(out)))
    assert "COMPILED 0" not in outs[0][0]          # the first process built the kernels
    assert "COMPILED 0" in outs[1][0]              # the second loaded every one of them
    (_, a), (_, b) = outs
    np.testing.assert_array_equal(a["o"], b["o"])  # same kernel, same inputs: same bits
    np.testing.assert_array_equal(a["k"], b["k"])
    np.testing.assert_array_equal(a["v"], b["v"])
    np.testing.assert_allclose(a["q"], b["q"], rtol=1e-2, atol=1e-2)  # dQ: atomics' order
