"""The jnp preprocess on the GPU builds the same descriptor as on the CPU, at the
benchmarks' sizes (``benchmarks/workloads.py``: 8K, 16 sequences, their metadata).

Its scatters behave differently there (atomic adds, dropped out-of-bounds updates), and the
CPU suite checks the jnp preprocess against the dense oracle only at small sizes. Skips
without a JAX GPU device, with the reason; its CPU side is ``tests/test_lower.py``
(``test_count_le_sorted_matches_a_count`` and the descriptor-vs-oracle tests).
"""
from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask.kernels.tilelang.testing import descriptors_equal

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import workloads as W  # noqa: E402

_GPU = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
pytestmark = pytest.mark.skipif(not _GPU, reason=f"no JAX GPU device (backend "
                                f"{jax.default_backend()!r})")


@pytest.mark.parametrize("mask", W.MASKS)
def test_jnp_preprocess_on_gpu_equals_cpu(mask):
    n = 8192
    b, length = W.batch_for(n), W.seq_len(mask, n)
    md = W.metadata_for(mask, n, b)
    cm = jcm.compile(W.spec_for(mask, n))
    build = jax.jit(lambda m: cm.instantiate(m, length, length, preprocess="jnp"))
    descs = []
    for dev in (_GPU[0], jax.devices("cpu")[0]):
        with jax.default_device(dev):
            m = None if md is None else {key: jax.device_put(np.asarray(v), dev) for key, v in md.items()}
            descs.append(jax.block_until_ready(build(m)))
    assert descriptors_equal(descs[1], descs[0]) == []
