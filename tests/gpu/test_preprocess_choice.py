"""The backend registry's choice of preprocess on the GPU: on an SM90 GPU with the
``tilelang`` extra, ``instantiate(preprocess=None)`` runs TileLang (bit-exact with jnp);
masks with fallback regions keep jnp. Skips elsewhere with the reason.
"""
from __future__ import annotations

import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.lower.descriptor import TileConfig

_REASON = backends._tilelang_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"TileLang preprocess: {_REASON}")

TILES = dict(block_q=64, block_kv=64, bwd_block_q=32, bwd_block_kv=64)


def test_registry_picks_tilelang_and_it_matches_jnp(monkeypatch):
    import jax
    from jcompilemask.kernels.tilelang.testing import descriptors_equal, sample_metadata
    monkeypatch.delenv(backends.PREPROCESS_ENV, raising=False)
    assert "tilelang: available" in backends.explain()
    spec = jcm.masks.hstu()
    cm = jcm.compile(spec)
    assert cm.default_preprocess() == "tilelang"
    meta = sample_metadata(spec, 2, 300, 300, np.random.default_rng(0))
    got = jax.jit(lambda m: cm.instantiate(m, 300, 300, **TILES))(meta)
    ref = jax.jit(lambda m: cm.instantiate(m, 300, 300, preprocess="jnp", **TILES))(meta)
    assert got.tiles == TileConfig(**TILES)
    assert not descriptors_equal(ref, got)


def test_fallback_mask_keeps_jnp(monkeypatch):
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    monkeypatch.delenv(backends.PREPROCESS_ENV, raising=False)
    cm = jcm.compile(MaskSpec([Region((0, q_len), k * k <= q)]))
    assert cm.default_preprocess() == "jnp"
    assert cm.instantiate(None, 64, **TILES).q_len == 64
