"""Dense reference attention and the tolerance policy every backend is tested with.

Tolerance policy (written once, used by CPU and GPU tests alike): against a float32
dense reference computed from the same inputs upcast (``precision="high"``, whose
output stays float32: rounding it to the input dtype would make the comparison count
whole ulps of the output dtype, so that one rounding flip on a large element decides
the test), a backend's
maximum absolute error is at most **twice** the maximum absolute error of the same
computation done densely in the input dtype (``precision="input"``: logits accumulated
in float32, softmax in float32, probabilities cast to the input dtype before the value
product, output cast to the input dtype), **plus 1e-5**. NaN never passes; a reference
``-inf`` (lse of a row that sees nothing) must be matched exactly.

Gradients follow the same rule: the "high" gradients are taken with respect to float32
copies of the inputs (``jax.grad`` at input-dtype arguments would round them).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["reference_attention", "assert_within_policy", "policy_error"]


def reference_attention(q, k, v, mask, *, scale=None, softcap=None, precision="high"):
    """Dense attention under a boolean mask broadcastable to [B, Hq, Nq, Nk].

    Returns ``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq] float32)``; rows that see nothing get
    out 0 and lse -inf. ``precision``: "high" (float32 throughout, ``out`` float32 or
    float64) or "input" (see the module doc; ``out`` in the input dtype).
    Differentiable (used for reference gradients).
    """
    dtype = q.dtype
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = q.shape[2] // k.shape[2]
    if precision == "high":
        hi = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        q, k, v = (x.astype(hi) for x in (q, k, v))
    elif precision != "input":
        raise ValueError("precision must be 'high' or 'input'")
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    # HIGHEST: on GPUs XLA's default float32 dot may use TF32 (10-bit mantissa), which
    # would make the "high" reference about as coarse as float16 itself.
    hp = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=acc, precision=hp) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask = jnp.asarray(mask, bool)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    seen = m > -jnp.inf
    m = jnp.where(seen, m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(seen, l, 1.0)
    if precision == "input":
        p = p.astype(dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=acc, precision=hp)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)[..., 0]
    if precision == "input":
        out = out.astype(dtype)
    return out, lse.astype(jnp.float32)


def policy_error(actual, high, low):
    """(error, allowed) of ``actual`` under the policy; raises on NaN or -inf mismatch."""
    a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    h = np.asarray(jnp.asarray(high, jnp.float32), np.float64)
    lo = np.asarray(jnp.asarray(low, jnp.float32), np.float64)
    if np.isnan(a).any():
        raise AssertionError(f"NaN in result ({int(np.isnan(a).sum())} elements)")
    inf_h, inf_a = np.isneginf(h), np.isneginf(a)
    if (inf_h != inf_a).any():
        raise AssertionError(f"-inf pattern differs from the reference at "
                             f"{int((inf_h != inf_a).sum())} elements")
    fin = ~inf_h
    h0 = np.where(fin, h, 0.0)
    err = float(np.max(np.abs(np.where(fin, a, 0.0) - h0), initial=0.0))
    lo0 = np.where(fin & ~np.isneginf(lo), lo, h0)
    base = float(np.max(np.abs(lo0 - h0), initial=0.0))
    return err, 2.0 * base + 1e-5


def assert_within_policy(actual, high, low, name="result"):
    """Assert the tolerance policy (module doc) for one tensor."""
    err, allowed = policy_error(actual, high, low)
    if not err <= allowed:
        raise AssertionError(f"{name}: max abs error {err:.3g} exceeds the policy bound "
                             f"{allowed:.3g} (2 x input-dtype dense error + 1e-5)")
