"""CuTe DSL SM90 forward kernel: compiles without a GPU, matches the reference on one.

The compile tests need only nvidia-cutlass-dsl (they set CUTE_DSL_ARCH=sm_90a before
cutlass is imported, so they run on CPU-only CI machines that have it installed).
The run tests need an SM90 GPU and jax-tvm-ffi; elsewhere they skip, saying why.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")


def _sm90_gpu_reason():
    if not HAS_CUTLASS:
        return "nvidia-cutlass-dsl is not installed"
    if importlib.util.find_spec("jax_tvm_ffi") is None:
        return "jax-tvm-ffi is not installed"
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return "no GPU visible to JAX"
    cc = getattr(gpus[0], "compute_capability", None)
    if cc is not None and not str(cc).startswith("9"):
        return f"the kernel needs SM90 (Hopper), found compute capability {cc}"
    return None


def test_import_needs_no_gpu():
    from jcompilemask.kernels.cute import api

    assert api.ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1).target_name


def test_key_rejects_unsupported():
    from jcompilemask.kernels.cute.api import ForwardKey

    with pytest.raises(ValueError, match="head dim"):
        ForwardKey("bfloat16", 64, 64, 1, 128, 128, True, True, 0.1)
    with pytest.raises(ValueError, match="preferred_forward_tiles"):
        ForwardKey("bfloat16", 128, 128, 1, 64, 128, True, True, 0.1)


def test_tile_states_of_causal():
    from jcompilemask.kernels.cute.testing import causal_intervals, tiles_from_intervals

    t = tiles_from_intervals(causal_intervals(300), 300, 128, 128)  # Tq = Tk = 3
    states = [[(int(t[0, 0, i, 0]) >> (2 * j)) & 3 for j in range(3)] for i in range(3)]
    # diagonal partial (3), below full (1), above empty (2); the ragged corner tile
    # (rows 256..299, keys 256..299) is still partial: only in-range elements count.
    assert states == [[3, 2, 2], [1, 3, 2], [1, 1, 3]]


@needs_cutlass
@pytest.mark.parametrize(
    "num_intervals,broadcast_batch,broadcast_head", [(1, True, True), (2, False, True), (3, False, False)]
)
def test_compiles_for_sm90(num_intervals, broadcast_batch, broadcast_head):
    from jcompilemask.kernels.cute.api import ForwardKey, compile_forward

    key = ForwardKey("bfloat16", 128, 128, num_intervals, 128, 128, broadcast_batch, broadcast_head, 128**-0.5)
    assert compile_forward(key) is not None


@pytest.mark.parametrize("case", ["causal", "document", "prefix_window", "random3"])
def test_matches_reference_on_gpu(case):
    reason = _sm90_gpu_reason()
    if reason:
        pytest.skip(reason)
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute.api import cute_forward
    from jcompilemask.kernels.cute.testing import check_case_intervals, reference_attention, tiles_from_intervals

    B, Nq, Nk, H = 2, 700, 900, 4
    if case != "random3":
        Nk = Nq
    iv, _ = check_case_intervals(case, np.random.default_rng(1), B, Nq, Nk, H)
    tiles = tiles_from_intervals(iv, Nk, 128, 128)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(7), 3)
    q = jax.random.normal(kq, (B, Nq, H, 128)).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (B, Nk, H, 128)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (B, Nk, H, 128)).astype(jnp.bfloat16)
    scale = 1 / math.sqrt(128)
    o, lse = jax.jit(lambda *a: cute_forward(*a, scale=scale))(q, k, v, jnp.asarray(iv), jnp.asarray(tiles))
    o_ref, lse_ref = reference_attention(q, k, v, iv, scale)
    o, o_ref = np.asarray(o.astype(jnp.float32)), np.asarray(o_ref)
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) < 1e-2
    empty = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], atol=2e-2)
    assert np.all(np.transpose(o, (0, 2, 1, 3))[empty] == 0)
