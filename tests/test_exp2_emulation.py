"""exp2 on the FMA pipe (``BackwardConfig.exp2_emu``, ``kernels/cute/exp2_fma.py``): a
numpy model of the kernel's arithmetic, float32 throughout, with the kernel's own constants,
checked over a dense sweep of x and the non-finite inputs. CPU only (no cutlass).

Error bound (this model, x in [-126, 128), float32 Horner with fused multiply-adds): max
relative error 8.57e-5 (the cubic's own 8.56e-5 plus float32 rounding), below bf16's 2^-8
and fp16's 2^-11 = 4.9e-4 half-ulp of the P and dS operands it feeds. x < -126 and -inf
give exactly 0.0 (as ``ex2.approx.ftz`` does: no denormal), x >= 128 and +inf give +inf,
NaN gives NaN.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from jcompilemask.kernels.cute import exp2_fma as e2

_C = np.array(e2.EXP2_POLY_BITS, np.uint32).view(np.float32)
_ROUND = np.array(e2.EXP2_ROUND_BITS, np.uint32).view(np.float32)
_LO, _HI = np.array(e2.EXP2_CLAMP_BITS, np.uint32).view(np.float32)
BOUND = 8.6e-5          # max relative error over [-126, 128) (measured 8.57e-5)


def _fma32(a, b, c):
    """float32 fma(a, b, c) with one rounding, as FFMA: a * b is exact in float64 (24 + 24
    bits), the float64 sum s is corrected where it sits exactly on a float32 rounding
    midpoint with a nonzero remainder (the only case where rounding it twice differs)."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        prod = a * b
        s = prod + c
        bb = s - prod                                   # TwoSum: s + err == prod + c exactly
        err = (prod - (s - bb)) + (c - bb)
        r = s.astype(np.float32)
        r64 = r.astype(np.float64)
        other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)))
        mid = (r64 + other.astype(np.float64)) / 2
        tie = np.isfinite(s) & (s != r64) & (s == mid) & (err != 0)
        # On a midpoint the exact value lies on err's side of it.
        toward_other = np.sign(other.astype(np.float64) - r64) == np.sign(err)
        return np.where(tie & toward_other, other, r).astype(np.float32)


def exp2_fma_reference(x):
    """The kernel's ``exp2_fma`` (``EXP2_FMA_PTX``) step for step, in float32."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        # max.NaN / min.NaN: clamp to [-127, 128], NaN kept
        xc = np.where(np.isnan(x), x, np.minimum(np.maximum(x, _LO), _HI)).astype(np.float32)
        # add.rm: xc + 1.5 * 2^23 rounded toward -inf is floor(xc) + 1.5 * 2^23 exactly
        t = (np.floor(xc.astype(np.float64)) + np.float64(_ROUND)).astype(np.float32)
        j = (t - _ROUND).astype(np.float32)             # exact
        f = (xc - j).astype(np.float32)                 # exact, [0, 1)
        p = _fma32(f, _C[3], _C[2])
        p = _fma32(p, f, _C[1])
        p = _fma32(p, f, _C[0])
        e = (t.view(np.uint32) << np.uint32(23)) + np.uint32(0x3F800000)     # mod 2^32
        s = e.view(np.float32)
        return (p * s).astype(np.float32)               # p in [1, 2): a float32 product


def test_constants_are_the_kernels():
    """The PTX carries these constants (the model reads the same module)."""
    ptx = e2.EXP2_FMA_PTX
    for bits in e2.EXP2_POLY_BITS + (e2.EXP2_ROUND_BITS,) + e2.EXP2_CLAMP_BITS:
        assert f"0f{bits:08X}" in ptx
    assert _C[0] == 1.0 and _ROUND == 1.5 * 2 ** 23 and (_LO, _HI) == (-127.0, 128.0)
    ops = re.findall(r"^(\w+(?:\.\w+)*)", ptx, re.M)
    assert ops == ["max.NaN.f32", "min.NaN.f32", "add.rm.f32", "sub.rn.f32", "sub.rn.f32",
                   "fma.rn.f32", "fma.rn.f32", "fma.rn.f32", "mov.b32", "shl.b32", "add.s32",
                   "mov.b32", "mul.rn.f32"]


def test_fma_model_rounds_once():
    """_fma32 against exact rational arithmetic on random float32 operands, ties included."""
    from fractions import Fraction
    rng = np.random.default_rng(0)
    a = rng.standard_normal(2000).astype(np.float32)
    b = rng.standard_normal(2000).astype(np.float32)
    c = rng.standard_normal(2000).astype(np.float32) * np.float32(1e-3)
    # a * b + c on a float32 midpoint: c = m - a * b rounded, plus tiny nudges
    # exact float32 midpoints: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24, nudged by +-2^-60 or not
    h = np.float32(1 + 2.0 ** -12)
    a = np.concatenate([a, [h, h, h, -h]]).astype(np.float32)
    b = np.concatenate([b, [h, h, h, h]]).astype(np.float32)
    c = np.concatenate([c, [0.0, 2.0 ** -60, -(2.0 ** -60), 2.0 ** -60]]).astype(np.float32)
    got = _fma32(a, b, c)
    lo, hi = np.float32(1 + 2.0 ** -11), np.float32(1 + 2.0 ** -11 + 2.0 ** -23)
    assert (got[-4], got[-3], got[-2], got[-1]) == (lo, hi, lo, -lo)     # even, up, down, to 0
    for i in list(range(0, 2000, 7)) + [2000, 2001, 2002, 2003]:
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))
        cands = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),
                                         int(np.array(v).view(np.uint32)) & 1))
        assert got[i] == best, (a[i], b[i], c[i])


def test_relative_error_dense_sweep():
    """Max relative error over x in [-126, 128): a dense linear sweep of [-130, 1], every
    389th float32 of [-1, -0] (2.7 M, by bit pattern) and a sweep of [1, 128); below -126
    exactly 0."""
    x = np.concatenate([np.linspace(-130.0, 1.0, 4_000_001).astype(np.float32),
                        np.arange(0x80000000, 0xBF800001, 389).astype(np.uint32).view(np.float32),
                        np.linspace(1.0, 128.0, 200_001, endpoint=False).astype(np.float32)])
    r = exp2_fma_reference(x)
    ref = np.exp2(x.astype(np.float64))
    live = x >= -126
    rel = np.abs(r[live].astype(np.float64) - ref[live]) / ref[live]
    assert rel.max() <= BOUND, (rel.max(), x[live][rel.argmax()])
    assert rel.max() > 8.0e-5                       # the documented bound is tight
    assert np.all(r[~live] == 0) and not np.signbit(r[~live]).any()
    assert np.all(r[live] >= np.float32(2.0 ** -126))                  # no denormal
    # exact at integers (p(0) = 1): exp2(0) = 1, the largest P of a row
    ints = np.arange(-126, 128, dtype=np.float32)
    np.testing.assert_array_equal(exp2_fma_reference(ints),
                                  np.exp2(ints.astype(np.float64)).astype(np.float32))


def test_monotone_within_reason():
    """P ordered as the scores are, up to the error bound (no jump at integer boundaries
    larger than the polynomial's error)."""
    x = np.linspace(-20.0, 0.5, 2_000_001).astype(np.float32)
    r = exp2_fma_reference(x).astype(np.float64)
    assert np.all(np.diff(r) >= -2 * BOUND * r[1:])


@pytest.mark.parametrize("x,want", [(-np.inf, 0.0), (np.inf, np.inf), (np.nan, np.nan),
                                    (-127.0, 0.0), (-126.5, 0.0), (-126.0, 2.0 ** -126),
                                    (-1e30, 0.0), (128.0, np.inf), (1e30, np.inf), (0.0, 1.0),
                                    (-0.0, 1.0), (1e-7, 1.0), (-3.0, 0.125), (127.0, 2.0 ** 127)])
def test_special_inputs(x, want):
    got = exp2_fma_reference(np.float32(x))
    if np.isnan(want):
        assert np.isnan(got)
    elif want in (0.0, np.inf) or want == 2.0 ** -126 or float(x).is_integer():
        assert got == np.float32(want) and not np.signbit(got)
    else:
        assert abs(float(got) - want) <= BOUND * want


def test_masked_score_gives_zero_p():
    """Masked scores reach exp2 as -inf (soft cap) or below any live lse: P is exactly 0,
    which ``softcap_probs`` / ``softmax_grad`` test for."""
    lse = np.float32([-5.0, 0.0, 3.0, 80.0, -80.0])
    x = (np.float32(-np.inf) * np.float32(30.0 * 1.4426950408889634) - lse).astype(np.float32)
    assert np.all(exp2_fma_reference(x) == 0.0)


def test_exp2_emu_columns():
    """exp2_emu = N emulates N of every 8 columns, evenly spaced (the kernel's rule)."""
    from jcompilemask.kernels.cute.api import BackwardConfig

    def cols(n, width=16):
        return [c for c in range(width) if e2.emulated_column(c, n)]
    assert cols(0) == [] and cols(8) == list(range(16))
    assert cols(2) == [3, 7, 11, 15] and cols(4) == list(range(1, 16, 2)) and cols(1) == [7, 15]
    for n in range(9):
        assert len(cols(n)) == 2 * n and len(cols(n, 8)) == n
    assert BackwardConfig().exp2_emu == 0 and "_e2e" not in BackwardConfig().tag
    assert BackwardConfig(exp2_emu=2).tag.endswith("_e2e2")
    with pytest.raises(ValueError, match="exp2_emu=9 must be 0..8"):
        BackwardConfig(exp2_emu=9)
    with pytest.raises(ValueError, match="exp2_emu=-1 must be 0..8"):
        BackwardConfig(exp2_emu=-1)


def test_exp2_emu_from_env(monkeypatch):
    from jcompilemask.kernels.cute import api
    monkeypatch.setenv(api.BWD_CONFIG_ENV, "exp2_emu=4")
    cfg = api._config_from_env(api.preferred_backward_config(128))
    assert cfg.exp2_emu == 4 and "_lp_e2e4" in cfg.tag
    key = api.BackwardKey("bfloat16", 128, 1, 1, True, True, 0.125, cfg)
    plain = api.BackwardKey("bfloat16", 128, 1, 1, True, True, 0.125, api.preferred_backward_config(128))
    assert key.target_name != plain.target_name and "_e2e4_" in key.target_name


# ------------------------------------------------------------------------------ 1 / y
_RCP_CLAMP = np.array(e2.RCP_CLAMP_BITS, np.uint32).view(np.float32)


def rcp_fma_reference(y):
    """The kernel's ``rcp_fma`` (``RCP_FMA_PTX``) step for step, in float32."""
    y = np.asarray(y, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        yc = np.where(np.isnan(y), y, np.minimum(y, _RCP_CLAMP)).astype(np.float32)
        r = (np.uint32(e2.RCP_SEED) - yc.view(np.uint32)).astype(np.uint32).view(np.float32)
        for _ in range(e2.RCP_STEPS):
            e = _fma32(-yc, r, np.float32(1.0))
            r = _fma32(r, e, r)
    return r


def test_rcp_constants_are_the_kernels():
    ptx = e2.RCP_FMA_PTX
    assert f"0f{e2.RCP_CLAMP_BITS:08X}" in ptx and str(e2.RCP_SEED) in ptx
    assert _RCP_CLAMP == 2.0 ** 125
    ops = re.findall(r"^(\w+(?:\.\w+)*)", ptx, re.M)
    assert ops == (["min.NaN.f32", "mov.b32", "sub.s32", "mov.b32"]
                   + ["neg.f32", "fma.rn.f32", "fma.rn.f32"] * e2.RCP_STEPS + ["mov.b32"])


def test_rcp_within_one_ulp():
    """Over y in [1, 2^125] (a dense sweep of [1, 2] where the seed's error peaks, and a
    geometric sweep of the rest): within 1 ulp of the correctly rounded reciprocal, as
    ``rcp.approx.f32``; the seed alone within 5.1%."""
    y = np.concatenate([np.linspace(1.0, 2.0, 2_000_001, dtype=np.float32),
                        np.exp2(np.linspace(0.0, 125.0, 2_000_001)).astype(np.float32)])
    got = rcp_fma_reference(y)
    exact = (1.0 / y.astype(np.float64)).astype(np.float32)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - exact.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1
    seed = (np.uint32(e2.RCP_SEED) - y.view(np.uint32)).view(np.float32).astype(np.float64)
    assert np.abs(seed * y - 1).max() <= 0.051


@pytest.mark.parametrize("y,want", [(np.inf, 2.0 ** -125), (np.nan, np.nan), (1.0, 1.0),
                                    (2.0, 0.5), (2.0 ** 125, 2.0 ** -125), (1e38, 2.0 ** -125)])
def test_rcp_special_inputs(y, want):
    """+inf and anything past 2^125 read as 2^125 (the soft cap's t = 1 - 2 r rounds to 1
    there, as tanh saturates); NaN stays NaN."""
    got = rcp_fma_reference(np.float32(y))
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert got == np.float32(want)


def test_softcap_tanh_with_the_emulated_reciprocal():
    """The backward's t = 1 - 2 / (2^(2 x log2 e) + 1) with ``rcp_fma`` against tanh(x):
    the same error as with an exact reciprocal (what the forward's default tanh computes
    with ``rcp.approx``), saturating to +-1 without NaN."""
    x = np.linspace(-60.0, 60.0, 400_001).astype(np.float32)
    e = np.exp2(np.float32(2 * np.log2(np.e)) * x).astype(np.float32)
    ep1 = (e + np.float32(1)).astype(np.float32)
    t_emu = (np.float32(1) - np.float32(2) * rcp_fma_reference(ep1)).astype(np.float32)
    t_ref = (np.float32(1) - np.float32(2) * (1.0 / ep1.astype(np.float64)).astype(np.float32))
    assert np.all(np.isfinite(t_emu)) and np.abs(t_emu).max() <= 1.0
    assert np.abs(t_emu.astype(np.float64) - t_ref).max() <= 2.4e-7
    assert np.abs(t_emu.astype(np.float64) - np.tanh(x.astype(np.float64))).max() <= 1e-6
