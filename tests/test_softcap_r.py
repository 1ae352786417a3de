"""The soft cap's backward arithmetic with ``BackwardConfig.softcap_r`` (``FlashBackwardSm90.
softcap_probs_r``) against the default form (``softcap_probs``): a float32 numpy model of
both, checked against float64 over a sweep of scores that reaches saturation, the masked
case and non-finite scores. CPU only (no cutlass).

Per score s (scaled logit x = scale s / cap), r = 1 / (exp2(2 log2 e x) + 1), t = 1 - 2 r:
- default: P = exp2(t cap log2 e - lse2), S = P (1 - t * t) (0 where P is 0);
- softcap_r: P = exp2(r (-2 cap log2 e) + (cap log2 e - lse2)), S = P r (1 - r), the factor
  4 applied to dQ / dK at the end (``api.backward_grad_scale``).
"""
from __future__ import annotations

import numpy as np

from jcompilemask.kernels.cute.api import BackwardConfig, backward_grad_scale

LOG2_E = np.log2(np.e)
F = np.float32


def _fma(a, b, c):
    """float32 fma with one rounding (float64 holds a * b exactly; the sum's double
    rounding is below what these checks resolve)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(F)


def _r(x):
    with np.errstate(over="ignore"):
        e = np.exp2(F(2 * LOG2_E) * x.astype(F)).astype(F)
        return (F(1) / (e + F(1))).astype(F)


def default_form(x, cap, lse2, masked=None):
    r = _r(x)
    t = (F(1) - F(2) * r).astype(F)
    if masked is not None:
        t = np.where(masked, F(-np.inf), t)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp2(_fma(t, F(cap * LOG2_E), -lse2)).astype(F)
        s = np.where(p == 0, F(0), (p * _fma(-t, t, F(1))).astype(F))
    return p, s


def r_form(x, cap, lse2, masked=None):
    r = _r(x)
    if masked is not None:
        r = np.where(masked, F(np.inf), r)
    base = (F(cap * LOG2_E) - lse2).astype(F)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp2(_fma(r, F(-2 * cap * LOG2_E), base)).astype(F)
        quarter = _fma(-r, r, r)
        s = (p * quarter).astype(F)
        if masked is not None:                  # the guard, in masked tiles only
            s = np.where(p == 0, F(0), s)
    return p, s


def exact(x, cap, lse2):
    t = np.tanh(np.float64(x))
    p = np.exp2(t * cap * LOG2_E - np.float64(lse2))
    return p, p * (1 - t * t)


def test_matches_float64_at_least_as_well_as_the_default():
    cap = 30.0
    x = np.linspace(-12, 12, 200001).astype(F)            # tanh saturates in float32 near |x| 9
    lse2 = F(cap * LOG2_E * 0.7)
    p_ref, s_ref = exact(x, cap, lse2)
    p_d, s_d = default_form(x, cap, lse2)
    p_r, s_r = r_form(x, cap, lse2)
    grad_r = s_r.astype(np.float64) * 4                   # backward_grad_scale's factor
    scale_p = np.abs(p_ref).max()
    # P: the same to float32 rounding of the exponent (a few ulps of ~40)
    assert np.abs(p_r - p_ref).max() <= 2e-5 * scale_p
    assert np.abs(p_d - p_ref).max() <= 2e-5 * scale_p
    # The gradient factor: absolute error against the largest value, r-form no worse
    top = np.abs(s_ref).max()
    err_r = np.abs(grad_r - s_ref).max() / top
    err_d = np.abs(s_d - s_ref).max() / top
    assert err_r <= 2e-6 and err_r <= err_d * 1.01
    # Near saturation (t -> 1) the default's 1 - t * t loses its digits, r (1 - r) does not
    hi = (x > 4) & (x < 8)
    rel = lambda a: np.abs(a[hi] - s_ref[hi]) / s_ref[hi]   # noqa: E731
    assert rel(grad_r).max() < 1e-5 < rel(s_d).max()


def test_masked_gives_exact_zeros_and_nonfinite_scores_propagate():
    cap, lse2 = 20.0, F(3.0)
    x = np.array([0.5, -2.0, 0.0, np.inf, -np.inf, np.nan], F)
    masked = np.array([True, True, False, False, False, False])
    p, s = r_form(x, cap, lse2, masked)
    assert p[0] == 0 and s[0] == 0 and p[1] == 0 and s[1] == 0
    # +-inf scores saturate (t = +-1): a finite P and a zero gradient factor, as tanh's
    p_ref, _ = exact(np.array([np.inf, -np.inf]), cap, lse2)
    np.testing.assert_allclose(p[3:5], p_ref, rtol=1e-5)
    assert s[3] == 0 and s[4] == 0
    assert np.isnan(p[5]) and np.isnan(s[5])
    # Unmasked tiles carry no guard: a finite r never turns 0 * r (1 - r) into NaN
    p, s = r_form(np.array([60.0, -60.0], F), cap, F(1e4))
    assert (p == 0).all() and (s == 0).all()


def test_grad_scale_factor():
    cfg = BackwardConfig(softcap_r=True)
    assert backward_grad_scale(0.125, 30.0, cfg) == 0.5
    assert backward_grad_scale(0.125, None, cfg) == 0.125
    assert backward_grad_scale(0.125, 30.0, BackwardConfig()) == 0.125
    assert BackwardConfig(softcap_r=True).tag.endswith("_scr")
