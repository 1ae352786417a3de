"""TileLang preprocess on the GPU: bit-for-bit equal to the jnp preprocess.

Runs on an SM90 GPU with the GPU extras (tilelang, apache-tvm-ffi, jax-tvm-ffi); skips
elsewhere with the reason. One command on the H200::

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_tilelang_preprocess.py

Programs are compiled up front in parallel processes (TileLang takes 30 s - 3 min per
program); ``JCOMPILEMASK_CACHE_DIR`` points the disk cache at prebuilt ones.
"""
from __future__ import annotations

import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask import ffi
from jcompilemask.kernels.tilelang.testing import (builtin_masks, descriptors_equal,
                                                  random_specs, sample_metadata)
from jcompilemask.lower.descriptor import TileConfig


def _skip_reason():
    try:
        ffi.require_gpu_extras(("tilelang", "tvm_ffi", "jax_tvm_ffi"))
        ffi.require_sm90()
    except (ffi.GpuExtrasMissing, ffi.UnsupportedGpu) as e:
        return str(e)
    return None


_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs an SM90 GPU: {_REASON}")

TILES = TileConfig(64, 64, 32, 64)
SHAPES = ((300, 300), (257, 515), (700, 190))
BUILTINS = builtin_masks()
RANDOM = {s.name: s for s in random_specs(20)}


@pytest.fixture(scope="module", autouse=True)
def _warm():
    from jcompilemask.kernels.tilelang.testing import warm_all
    errs = [(n, e) for n, _, e in warm_all() if e]
    assert not errs, errs


def _check(spec, seed):
    import jax
    from jcompilemask.kernels.tilelang import tilelang_preprocess
    from jcompilemask.lower.preprocess import build_descriptor
    cm = jcm.compile(spec)
    rng = np.random.default_rng(seed)
    for i, (ql, kl) in enumerate(SHAPES):
        meta = sample_metadata(spec, 3, ql, kl, rng, ordered=(i != 2))
        ref = jax.jit(lambda m: build_descriptor(cm, m, ql, kl, TILES))(meta)
        got = jax.jit(lambda m: tilelang_preprocess(cm, m, ql, kl, TILES, strict=True))(meta)
        bad = descriptors_equal(ref, got)
        assert not bad, f"{spec.name} q_len={ql} kv_len={kl}: {bad}"


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_bit_exact(name):
    _check(BUILTINS[name], 0)


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_spec_bit_exact(name):
    _check(RANDOM[name], 1)


def test_new_lengths_and_metadata_do_not_recompile():
    import jax
    from jcompilemask.kernels.tilelang import tilelang_preprocess
    from jcompilemask.kernels.tilelang.api import compiled_function
    spec = BUILTINS["hstu"]
    cm = jcm.compile(spec)
    key0, _ = compiled_function(cm, TILES)
    n0 = len(ffi.default_cache()._mem)
    rng = np.random.default_rng(3)
    for ql in (128, 333, 1000):
        meta = sample_metadata(spec, 2, ql, ql, rng)
        d = tilelang_preprocess(cm, meta, ql, ql, TILES, strict=True)
        jax.block_until_ready(d.fwd_tiles)
        assert compiled_function(cm, TILES)[0] == key0
    assert len(ffi.default_cache()._mem) == n0


def test_fallback_mask_keeps_jnp():
    from jcompilemask.kernels.tilelang import tilelang_preprocess
    from jcompilemask.spec import MaskSpec, Region
    from jcompilemask.spec.expr import k, q, q_len
    # k // 4 <= q // 4 lowers exactly since issue 16; k % 4 <= q % 4 keeps a residual
    spec = MaskSpec([Region((0, q_len), (k % 4) <= (q % 4))], name="fallback")
    cm = jcm.compile(spec, warn=False)
    assert cm.fallback_regions
    with pytest.warns(UserWarning, match="jnp preprocess"):
        tilelang_preprocess(cm, None, 64, 64, TILES)
    with pytest.raises(ValueError, match="residual"):
        tilelang_preprocess(cm, None, 64, 64, TILES, strict=True)
