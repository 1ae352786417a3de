"""Any K on the CuTe kernels (issue 16, item 1): masks with more than 8 row intervals (and
more than 16 column intervals) through the CuTe forward and backward, against the dense
oracle under the tolerance policy.

Past 8 row intervals the forward's masked tile loops over the row's intervals from the
table (not unrolled) and skips those that miss the tile; past 16 re-read column intervals
the backward does the same. The registry runs such masks on the CuTe kernels by default
since these tests passed on the H200 (2026-12-03). On a machine without the cute backend they skip with its reason; the
compile-only twins are in test_cute_forward.py / test_cute_backward.py (CI), the registry's
gate in tests/test_residual_lowering.py.

    python3 -m pytest -q tests/gpu/test_cute_any_k.py        # on the H200
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jcompilemask as jcm
from jcompilemask import backends
from jcompilemask.lower.compiled import region_backend
from jcompilemask.spec import MaskSpec, Region, Scalar, k, q, q_len
from gpu_cases import (check_attention, gradient_problems, random_many_intervals_case,  # noqa: E402  (tests/gpu is on sys.path under pytest)
                       random_many_runs_dense,
                       registry_names_cute)

import os

IMPL = os.environ.get("JCM_ANY_K_IMPL", "cute")    # "xla": the same checks on CPU (test logic)
_why = None if IMPL == "xla" else backends.get("cute").available()
needs_gpu = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")


def _any(rules):
    return functools.reduce(lambda a, b: a | b, rules)


def striped(bands: int, every: int = 40, width: int = 3):
    """`bands` key stripes of `width` keys every `every` keys, causal: K = bands."""
    return MaskSpec([Region((0, q_len), _any([(k >= every * i) & (k < every * i + width)
                                               for i in range(bands)]) & (k <= q))])


def global_tokens_window(tokens=(0, 37, 90, 151, 260, 333, 480, 512, 600, 777, 801, 950,
                                 1001, 1100, 1201, 1299), window=64):
    """16 scattered global keys + a causal window: K up to 17 per row."""
    return MaskSpec([Region((0, q_len), (_any([k == t for t in tokens]) & (k <= q))
                            | ((k <= q) & (k > q - window)))])


def per_batch_stripes():
    """Stripes whose period is metadata (per batch): K from the declared range."""
    p = Scalar("period", min=16, max=64)
    return MaskSpec([Region((0, q_len), _any([(k >= p * i) & (k < p * i + 5) for i in range(20)])
                            & (k <= q))])


CASES = {
    "stripes12": (striped(12), None),
    "stripes30": (striped(30, every=35), None),
    "global16+window": (global_tokens_window(), None),
    "stripes20-metadata": (per_batch_stripes(), {"period": np.array([16, 51], np.int32)}),
}


@pytest.fixture
def any_k_on(monkeypatch):
    monkeypatch.setenv(backends.CUTE_BACKWARD_ENV, "1")


@needs_gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_any_k_forward_and_gradients(name, any_k_on):
    spec, md = CASES[name]
    cm = jcm.compile(spec)
    assert cm.num_intervals > 8, (name, cm.num_intervals)
    assert region_backend(cm, 0).startswith("cute"), region_backend(cm, 0)
    # ragged: not a multiple of 64 / 128
    check_attention(spec, md, 2, 1300, 4, 2, 128, jnp.bfloat16, IMPL)


@needs_gpu
def test_any_k_head_dim_64_fp16(any_k_on):
    spec, _ = CASES["global16+window"]
    check_attention(spec, None, 1, 1100, 2, 1, 64, jnp.float16, IMPL, seed=3, forward=False)


@needs_gpu
@pytest.mark.parametrize("seed", range(6))
def test_random_many_interval_specs(seed, any_k_on):
    """K from 9 to 32 (random stripe unions, some with a per-batch period)."""
    rng = np.random.default_rng(900 + seed)
    spec, md = random_many_intervals_case(rng, 700, 2)
    assert jcm.compile(spec).num_intervals > 8
    check_attention(spec, md, 2, 700, 2, 1, 128, jnp.bfloat16, IMPL, seed=seed, forward=False)


@pytest.mark.parametrize("name", sorted(CASES) + [f"random{i}" for i in range(6)])
def test_registry_names_cute_for_any_k(name, monkeypatch):
    """CPU twin of the GPU cases' registry check (gpu_cases.registry_names_cute): with cute
    marked available, explain() chooses cute, the CuTe backward and cute for the region of
    every any-K mask above and of the random K 9-32 specs the GPU tests draw."""
    monkeypatch.delenv(backends.CUTE_BACKWARD_ENV, raising=False)
    if name.startswith("random"):
        spec, _ = random_many_intervals_case(np.random.default_rng(900 + int(name[6:])), 700, 2)
    else:
        spec, _ = CASES[name]
    assert jcm.compile(spec, warn=False).num_intervals > 8
    registry_names_cute(spec, hq=8, hkv=8, mark_available=True)


# ---------------------------------------------------------------------------------------
# Fixed masks of 9-32 runs per row (from_dense): interval tables where the kernels run
# ---------------------------------------------------------------------------------------
def _dense_runs(m):
    from jcompilemask.lower.dense import _max_runs
    return _max_runs(m), _max_runs(np.swapaxes(m, -1, -2))


@needs_gpu
@pytest.mark.parametrize("seed", range(3))
def test_dense_many_runs_on_cute(seed, any_k_on):
    """A fixed mask of 9-32 runs per row and per column, as a user's dense array: on the
    GPU ``from_dense``'s "auto" layout keeps its interval tables, so the registry runs it
    on the CuTe kernels (a bitmap would leave it to xla), and it matches the oracle. Seed 0
    has more than 16 runs in a column (the backward's looped column intervals)."""
    arr = random_many_runs_dense(np.random.default_rng(1600 + seed), 700, heads=2)
    kr, kc = _dense_runs(arr)
    assert 8 < kr <= 32 and kc <= 32, (kr, kc)
    cm = jcm.from_dense(arr)
    if IMPL == "cute":
        assert cm.layout == "intervals", cm.explain()
    check_attention(cm, None, 2, 700, 2, 1, 128, jnp.bfloat16, IMPL, seed=seed,
                    forward=seed == 0)


def test_dense_many_runs_layout_rule(monkeypatch):
    """CPU twin of ``test_dense_many_runs_on_cute``: with the CuTe kernels usable, "auto"
    keeps tables for 9-32 runs (row and column) and the registry names cute for them;
    without, a bitmap (the xla backend's form) with the same dense view; past 32 a bitmap
    either way; ``layout=`` overrides."""
    from jcompilemask.lower import dense
    arr = random_many_runs_dense(np.random.default_rng(1600), 700, heads=2)
    kr, kc = _dense_runs(arr)
    assert 8 < kr <= 32 and 16 < kc <= 32, (kr, kc)
    monkeypatch.setattr(dense, "_kernel_tables_usable", lambda: False)
    cpu = jcm.from_dense(arr)
    assert cpu.layout == "bitmap" and "layout='intervals' runs it" in cpu.explain()
    monkeypatch.setattr(dense, "_kernel_tables_usable", lambda: True)
    gpu = jcm.from_dense(arr)
    assert gpu.layout == "intervals"
    assert (gpu.num_intervals, gpu.num_bwd_intervals) == (kr, kc)
    assert gpu.key() != cpu.key()
    for m in (cpu, gpu):
        d = m.instantiate(None, 700, 700, block_q=128, block_kv=128, bwd_block_q=64,
                          bwd_block_kv=128)
        for view in ("fwd", "bwd"):
            np.testing.assert_array_equal(np.asarray(d.as_dense(view)[0]), arr)
    monkeypatch.delenv(backends.CUTE_BACKWARD_ENV, raising=False)
    registry_names_cute(gpu, hq=2, hkv=1, mark_available=True)
    # K <= 8 keeps tables anywhere; past 32 a bitmap even where the kernels run.
    assert dense.auto_layout(8, 100) == "intervals"
    assert dense.auto_layout(33, 4) == "bitmap" and dense.auto_layout(12, 33) == "bitmap"
    assert jcm.from_dense(arr, layout="bitmap").layout == "bitmap"
    monkeypatch.setattr(dense, "_kernel_tables_usable", lambda: False)
    assert dense.auto_layout(12, 12) == "bitmap"
    assert jcm.from_dense(arr, layout="intervals").layout == "intervals"


def test_dense_many_runs_same_attention_either_layout():
    """The two layouts of one 9-32-run mask give the same attention and gradients on the
    xla backend (the bitmap is what a CPU gets, the tables what the GPU kernels read)."""
    arr = random_many_runs_dense(np.random.default_rng(1601), 200, heads=1)
    q_, k_, v_ = (jax.random.normal(jax.random.key(i), (1, 200, 2, 32)) for i in range(3))

    def loss(layout, a, b, c):
        o = jcm.mask_attention(a, b, c, jcm.from_dense(arr, layout=layout),
                               implementation="xla")
        return jnp.sum(o * jnp.arange(32.0)[None, None, None]), o

    outs = [jax.value_and_grad(functools.partial(loss, lay), argnums=(0, 1, 2), has_aux=True)(
        q_, k_, v_) for lay in ("intervals", "bitmap")]
    (_, o1), g1 = outs[0]
    (_, o2), g2 = outs[1]
    np.testing.assert_allclose(o1, o2, atol=1e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _splash_dense_case(seed, n=700):
    """A splash port call as ported TPU code makes it: a NumpyMask per head (9-32 runs per
    row: interval tables where the kernels run) with packed (contiguous) segment ids."""
    from jcompilemask.splash import splash_attention_kernel as sk
    from jcompilemask.splash import splash_attention_mask as sm
    arr = random_many_runs_dense(np.random.default_rng(1700 + seed), n, heads=2)
    masks = sm.MultiHeadMask([sm.NumpyMask(a) for a in arr])
    ids = np.repeat(np.arange(3, dtype=np.int32), [n // 3, n // 2, n - n // 3 - n // 2])
    return arr, masks, sk.SegmentIds(ids, ids), ids, sk


@needs_gpu
def test_splash_dense_mask_with_segments_on_cute(any_k_on, monkeypatch):
    """The splash port's dense mask with segment ids on the GPU kernels: the segment-id
    form is interval tables (SegmentRunsDenseMask), the registry runs it on cute, and the
    jitted kernel (traced ids: the checked fast path) matches the oracle in value and
    gradients."""
    from jcompilemask.testing import assert_within_policy, reference_attention, reference_gradients
    if IMPL == "xla":       # the test logic on a CPU: the tables the GPU would keep
        from jcompilemask.lower import dense as dense_mod
        monkeypatch.setattr(dense_mod, "_kernel_tables_usable", lambda: True)
    n = 700
    arr, masks, seg, ids, sk = _splash_dense_case(0, n)
    kernel = sk.make_splash_mha_single_device(masks, implementation=IMPL)
    assert kernel._segment_mode(seg, n, n)[2] == "dense_runs"
    if IMPL == "cute":
        registry_names_cute(kernel.masks.dense_runs, hq=2, hkv=2)
    ks = jax.random.split(jax.random.key(5), 4)
    q, k, v, do = (jax.random.normal(kk, (2, n, 128), jnp.float32).astype(jnp.bfloat16)
                   for kk in ks)
    dense = (arr & (ids[:, None] == ids[None, :])[None])[None]          # [1, 2, n, n]
    to4 = lambda x: jnp.swapaxes(x, 0, 1)[None]                         # noqa: E731
    out = jax.jit(kernel)(q, k, v, seg)
    # (splash does not scale the logits: scale 1)
    hi = reference_attention(to4(q), to4(k), to4(v), dense, scale=1.0, precision="high")
    lo = reference_attention(to4(q), to4(k), to4(v), dense, scale=1.0, precision="input")
    assert_within_policy(to4(out), hi[0], lo[0], "out")

    def loss(a, b_, c):
        return jnp.sum(kernel(a, b_, c, seg).astype(jnp.float32) * do.astype(jnp.float32))

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    g_hi, g_lo = reference_gradients(to4(q), to4(k), to4(v), to4(do), dense, scale=1.0)
    problems = gradient_problems(tuple(to4(x) for x in g), g_hi, g_lo, jnp.bfloat16)
    assert not problems, "; ".join(problems)


def test_splash_dense_segments_registry_names_cute(monkeypatch):
    """CPU twin: with the kernels marked usable, the case's mask keeps tables, its
    segment-id form is SegmentRunsDenseMask, and explain() names cute for it."""
    from jcompilemask.lower import dense
    monkeypatch.setattr(dense, "_kernel_tables_usable", lambda: True)
    monkeypatch.delenv(backends.CUTE_BACKWARD_ENV, raising=False)
    _, masks, seg, _, sk = _splash_dense_case(0)
    kernel = sk.make_splash_mha_single_device(masks)
    assert kernel._segment_mode(seg, 700, 700)[2] == "dense_runs"
    registry_names_cute(kernel.masks.dense_runs, hq=2, hkv=2, mark_available=True)


@needs_gpu
@pytest.mark.skipif(IMPL != "cute", reason="a kernel switch: the cute backend only")
@pytest.mark.parametrize("case", ["dense", "stripes30"])
def test_interval_unroll_gives_identical_forward(case, any_k_on, monkeypatch):
    """ForwardKey.interval_unroll (the K > 8 mask loop unrolled by 4): out and lse bit for
    bit with the loop as it was, on a 9-32-run dense mask and a K 30 striped spec."""
    from jcompilemask.kernels.cute import api
    if case == "dense":
        arr = random_many_runs_dense(np.random.default_rng(1600), 700, heads=2)
        cases = [(jcm.from_dense(arr), None, 2)]
    else:
        cases = [(CASES["stripes30"][0], None, 1)]
    ks = jax.random.split(jax.random.key(11), 3)
    for mask, md, hq in cases:
        q_, k_, v_ = (jax.random.normal(kk, (2, 700, hq, 128), jnp.float32).astype(jnp.bfloat16)
                      for kk in ks)
        outs = []
        for unroll in ("1", "4"):
            monkeypatch.setenv(api.FWD_INTERVAL_UNROLL_ENV, unroll)
            outs.append(jax.jit(lambda a, b_, c: jcm.mask_attention(
                a, b_, c, mask, metadata=md, implementation="cute", return_residual=True))(
                    q_, k_, v_))
        for a, b_ in zip(*outs):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
