"""Residual predicates in the CuTe forward (issue 16, item 2), against the dense oracle.

The tables of a residual mask hold interval hulls; the forward's partial tiles evaluate
each slot's residual predicate, emitted as kernel code from its expression tree
(lower/residual_program.py, kernels/cute/residual_ops.py), reading the rows' regions and
a per-batch parameter table; the CuTe backward does the same in its partial tiles (column
view, or the forward program per query column without one). The registry runs residual
masks on the CuTe kernels by default since these tests passed on the H200 (2026-12-03).
Without the cute backend they skip with its reason; the emission
logic is checked on CI by tests/test_residual_program.py (numpy twin vs the jnp
evaluator), the compile by test_cute_forward.py::test_residual_forward_compiles_for_sm90.

    python3 -m pytest -q tests/gpu/test_cute_residual.py        # on the H200
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.lower.compiled import region_backend
from jcompilemask.spec import MaskSpec, Region, Scalar, Vector, h, k, q, q_len
from gpu_cases import check_attention, random_residual_case, registry_names_cute  # noqa: E402  (tests/gpu is on sys.path under pytest)

IMPL = os.environ.get("JCM_RESIDUAL_IMPL", "cute")    # "xla": the same checks on CPU
_why = None if IMPL == "xla" else backends.get("cute").available()
needs_gpu = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")



@pytest.fixture(autouse=True)
def _residual_lowering(monkeypatch):
    """These cases test the residual kernels: the dilated window would otherwise run as
    residue classes (no residual; tests/gpu/test_cute_classes.py)."""
    monkeypatch.setenv("JCOMPILEMASK_ROW_CLASSES", "0")


D = Scalar("d", min=1, max=9)
V = Vector("v", 3, min=1, max=5)
A = Scalar("a", max=q_len)

CASES = {
    # a dilated causal window: window 128, dilation 2
    "dilated_window": (MaskSpec([Region((0, q_len), (k <= q) & (k > q - 128) & ((q - k) % 2 == 0))]), None),
    # a metadata dilation (the parameter table), 1 in batch 0, 3 in batch 1
    "metadata_dilation": (MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % D == 0))]),
                          {"d": np.array([1, 3], np.int32)}),
    # a per-query stride read from a vector
    "vector_stride": (MaskSpec([Region((0, q_len), (k <= q) & (k % V[q % 3] == 0))]),
                      {"v": np.array([[1, 2, 5], [3, 1, 4]], np.int32)}),
    # two regions with different residuals (the rows' regions pick them)
    "two_regions": (MaskSpec([Region((0, A), (k <= q) & (k % 2 == 0), name="even"),
                              Region((A, q_len), (k <= q) & ((q - k) % 3 != 1), name="thirds")]),
                    {"a": np.array([300, 777], np.int32)}),
    # a per-head residual
    "per_head": (MaskSpec([Region((0, q_len), (k <= q) & ((q + h) % 2 == k % 2))], num_heads=4), None),
    # a quadratic atom (k * k <= q: no interval): the full-row hull, residual everywhere
    "quadratic": (MaskSpec([Region((0, q_len), (k * k <= q) | ((k <= q) & (k > q - 64)))]), None),
}


@pytest.fixture
def residual_on(monkeypatch):
    monkeypatch.setenv(backends.CUTE_BACKWARD_ENV, "1")


def _inputs(b, n, hq, hkv, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    mk = lambda kk, hh: jax.random.normal(kk, (b, n, hh, d), jnp.float32).astype(dtype)  # noqa: E731
    return mk(ks[0], hq), mk(ks[1], hkv), mk(ks[2], hkv), mk(ks[3], hq)


@needs_gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_residual_forward_and_gradients(name, residual_on):
    spec, md = CASES[name]
    cm = jcm.compile(spec, warn=False)
    assert cm.residual_regions, name
    assert all(region_backend(cm, g).startswith("cute on an SM90 GPU (hull") for g in cm.residual_regions)
    # ragged: not a multiple of 128
    check_attention(spec, md, 2, 1100, 4, 2, 128, jnp.bfloat16, IMPL)


@pytest.mark.parametrize("name", sorted(CASES) + [f"random{i}" for i in range(6)])
def test_registry_names_cute_for_residual_masks(name, monkeypatch):
    """CPU twin of the GPU cases' registry check (gpu_cases.registry_names_cute, run by
    check_attention with the cute backend really there): with cute marked available,
    explain() chooses cute, the CuTe backward and cute for every region of each residual
    mask above and of the random residual specs the GPU tests draw (the draws that lower
    exactly included)."""
    monkeypatch.delenv(backends.CUTE_BACKWARD_ENV, raising=False)
    if name.startswith("random"):
        spec, _ = random_residual_case(np.random.default_rng(700 + int(name[6:])), 700, 2)
    else:
        spec, _ = CASES[name]
    heads = 4 if name == "per_head" else 8
    registry_names_cute(spec, hq=heads, hkv=heads, mark_available=True)


@needs_gpu
def test_block_causal_spellings_agree(residual_on):
    """k // 64 <= q // 64 lowers exactly (no residual) and matches its interval spelling."""
    natural = MaskSpec([Region((0, q_len), k // 64 <= q // 64)])
    assert not jcm.compile(natural).residual_regions
    n = 1000
    qx, kx, vx, _ = _inputs(1, n, 2, 2, 128, jnp.bfloat16, seed=1)
    a = jcm.mask_attention(qx, kx, vx, natural, implementation=IMPL)
    b = jcm.mask_attention(qx, kx, vx, MaskSpec([Region((0, q_len), k < (q // 64 + 1) * 64)]),
                           implementation=IMPL)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@needs_gpu
@pytest.mark.parametrize("seed", range(6))
def test_random_residual_specs(seed, residual_on):
    """Random two-region specs mixing interval atoms with residual ones (a modulus, a
    metadata divisor, a quadratic): forward and gradients vs the dense oracle."""
    rng = np.random.default_rng(700 + seed)
    spec, md = random_residual_case(rng, 700, 2)
    if not jcm.compile(spec, warn=False).residual_regions:
        pytest.skip("this draw lowered exactly")
    check_attention(spec, md, 2, 700, 2, 2, 128, jnp.bfloat16, IMPL, seed=seed, lse=False)


def _switch_outputs(monkeypatch, name, seed, env, flags=("0", "1"), fixed=()):
    """mask_attention's o on CASES[name] (ragged N 700, GQA 4 / 2, bf16) once per value of the
    CuTe forward switch ``env`` in ``flags``, with the ``fixed`` (NAME, VALUE) variables set."""
    spec, md = CASES[name]
    n = 700
    if md is not None and "a" in md:    # two_regions' split row (at most q_len = n)
        md = {**md, "a": np.minimum(md["a"], n - 50).astype(np.int32)}
    q_, k_, v_, _ = _inputs(2, n, 4, 2, 128, jnp.bfloat16, seed=seed)   # per_head: 4 heads
    for var, value in fixed:
        monkeypatch.setenv(var, value)
    outs = []
    for flag in flags:
        monkeypatch.setenv(env, flag)
        f = jax.jit(lambda a, b_, c: jcm.mask_attention(a, b_, c, spec, metadata=md,  # noqa: B023
                                                        implementation="cute"))
        outs.append(np.asarray(f(q_, k_, v_)))
    return outs


@needs_gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_residual_words_forward_is_bit_identical(name, monkeypatch):
    """residual_words ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_WORDS=1) changes how a masked tile
    of a residual mask finds its visible keys (interval runs as column-group words, then the
    word bit and the slot's predicate per element), not which: o equals the default
    residual_bits path bit for bit (ragged N 700, GQA, metadata, regions, per-head)."""
    if IMPL != "cute":
        pytest.skip("a switch of the CuTe forward")
    from jcompilemask.kernels.cute import api
    outs = _switch_outputs(monkeypatch, name, 3, api.FWD_RESIDUAL_WORDS_ENV)
    assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))


@needs_gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_residual_regs_forward_is_bit_identical(name, monkeypatch):
    """residual_regs ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_REGS=1) reads a residual mask's row
    intervals and regions once per tile row into registers instead of per masked tile: the
    same table entries, so o equals the default's bit for bit (K <= 2 masks; the others
    compile the default path and are compared with themselves)."""
    if IMPL != "cute":
        pytest.skip("a switch of the CuTe forward")
    from jcompilemask.kernels.cute import api
    outs = _switch_outputs(monkeypatch, name, 9, api.FWD_RESIDUAL_REGS_ENV)
    assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))


@needs_gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_residual_periodic_forward_is_bit_identical(name, monkeypatch):
    """residual_periodic ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_PERIODIC=1) evaluates a slot's
    predicate once per row and column class where column_periodic proves it 8-periodic in
    k (dilated_window, per_head, two_regions' even region), per element elsewhere: o
    equals residual_words' bit for bit."""
    if IMPL != "cute":
        pytest.skip("a switch of the CuTe forward")
    from jcompilemask.kernels.cute import api
    outs = _switch_outputs(monkeypatch, name, 5, api.FWD_RESIDUAL_PERIODIC_ENV,
                           fixed=((api.FWD_RESIDUAL_WORDS_ENV, "1"),))
    assert np.array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
