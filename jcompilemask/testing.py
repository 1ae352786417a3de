"""Dense reference attention and the tolerance policy every backend is tested with.

Tolerance policy (written once, used by CPU and GPU tests alike): against a float32
dense reference computed from the same inputs upcast (``precision="high"``, whose
output stays float32: rounding it to the input dtype would make the comparison count
whole ulps of the output dtype, so that one rounding flip on a large element decides
the test), a backend's maximum absolute error is at most **twice** the maximum absolute
error of the same computation done densely in the input dtype (``precision="input"``: logits accumulated
in float32, softmax in float32, probabilities cast to the input dtype before the value
product, output cast to the input dtype), **plus 1e-5**. NaN never passes; a reference
``-inf`` (lse of a row that sees nothing) must be matched exactly.

Gradients follow the same rule: the "high" gradients are taken with respect to float32
copies of the inputs (``jax.grad`` at input-dtype arguments would round them); the
"input" gradients are those of a tensor-core backward done densely — dV = P^T dO,
dP = dO V^T, dS = P (dP - delta), dQ = dS K, dK = dS^T Q with input-dtype operands
(P and dS rounded) and float32 accumulation, delta = rowsum(dO * O) from the rounded
output — rather than autodiff through the rounded forward (whose dS stays float32, an
accuracy no kernel with input-dtype tensor-core products can match: the 2x bound then
failed for bfloat16 dQ on about one mask draw in 40).

The bound never falls below two units in the last place (of the result's dtype) of the
largest reference magnitude: a result stored in bfloat16 / float16 carries up to half
an ulp from its final rounding alone, plus the roundings of its input-dtype
intermediates (P and dS are rounded before their products, as a tensor-core backward
does), and on small tensors the maximum of two such rounding realisations is a noisy
statistic. The fuzz stage found bfloat16 dK at 1.06x and float16 dQ at 1.02x of
"2 x dense error" on 13-key problems, and float16 dQ at 1.28x on a 10-key one
(``JCM_FUZZ_SEED=283758360 JCM_FUZZ_CASE=8 JCM_FUZZ_LOWP=1``): there the same backend in
float32 is within 6e-7 of the reference, the dense float16 computation lands 0.46 ulp
from it and ours 1.53 ulp — two neighbouring roundings of one correct sum. A wrong mask
element or a wrong product gives errors of the order of the values themselves, far above
this floor.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["reference_attention", "reference_gradients", "assert_within_policy", "policy_error"]


def reference_attention(q, k, v, mask, *, scale=None, softcap=None, precision="high"):
    """Dense attention under a boolean mask broadcastable to [B, Hq, Nq, Nk].

    Returns ``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq] float32)``; rows that see nothing get
    out 0 and lse -inf. ``precision``: "high" (float32 throughout, ``out`` float32 or
    float64; gradients by autodiff) or "input" (see the module doc; ``out`` in the input
    dtype; gradients computed densely with the input-dtype rounding points of the module
    doc). Differentiable (used for reference gradients).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if precision == "high":
        hi = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
        q, k, v = (x.astype(hi) for x in (q, k, v))
        return _dense_forward(q, k, v, mask, scale, softcap, round_to=None)[:2]
    if precision != "input":
        raise ValueError("precision must be 'high' or 'input'")
    return _input_precision(q, k, v, jnp.asarray(mask, bool), scale, softcap)


_HIGHEST = jax.lax.Precision.HIGHEST   # not TF32: XLA's default f32 dot on a GPU may be


def _dense_forward(q, k, v, mask, scale, softcap, round_to):
    """(out, lse, p, t): the dense forward; ``round_to`` rounds p and out (input mode)."""
    g = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=acc, precision=_HIGHEST) * scale
    t = None
    if softcap is not None:
        t = jnp.tanh(s / softcap)
        s = softcap * t
    mask = jnp.asarray(mask, bool)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    # Empty iff the sum is exactly 0; not ``m > -inf``: XLA's max reduction may drop a
    # NaN, and a NaN logit must reach out and lse, as in jax.nn.
    seen = l != 0
    p = p / jnp.where(seen, l, 1.0)
    pv = p if round_to is None else p.astype(round_to)
    out = jnp.einsum("bhqk,bkhd->bqhd", pv, v, preferred_element_type=acc, precision=_HIGHEST)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)[..., 0]
    if round_to is not None:
        out = out.astype(round_to)
    return out, lse.astype(jnp.float32), p, t


@jax.custom_vjp
def _input_precision(q, k, v, mask, scale, softcap):
    return _dense_forward(q, k, v, mask, scale, softcap, round_to=q.dtype)[:2]


def _input_precision_fwd(q, k, v, mask, scale, softcap):
    out, lse, p, t = _dense_forward(q, k, v, mask, scale, softcap, round_to=q.dtype)
    return (out, lse), (q, k, v, mask, out, lse, p, t, scale, softcap)


def _input_precision_bwd(res, cts):
    """The backward of a tensor-core kernel, densely: dP = dO V^T and the dV, dK, dQ
    products take input-dtype operands with float32 accumulation (P and dS rounded to the
    input dtype), delta = rowsum(dO * O) from the rounded output O."""
    q, k, v, mask, out, lse, p, t, scale, softcap = res
    dout, dlse = cts
    dt, f32 = q.dtype, jnp.float32
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    do = dout.astype(dt)
    dvr = jnp.einsum("bhqk,bqhd->bkhd", p.astype(dt), do, preferred_element_type=f32,
                     precision=_HIGHEST)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, vr, preferred_element_type=f32, precision=_HIGHEST)
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(f32), do.astype(f32))
    if dlse is not None:
        delta = delta - jnp.where(jnp.isneginf(lse), 0.0, dlse.astype(f32))
    ds = p * (dp - delta[..., None])
    if t is not None:
        ds = ds * (1.0 - t * t)
    ds = ds.astype(dt)
    dq = scale * jnp.einsum("bhqk,bkhd->bqhd", ds, kr, preferred_element_type=f32,
                            precision=_HIGHEST)
    dkr = scale * jnp.einsum("bhqk,bqhd->bkhd", ds, q, preferred_element_type=f32,
                             precision=_HIGHEST)
    group = lambda x: x.reshape(b, x.shape[1], hkv, g, -1).sum(3)   # noqa: E731
    return (dq.astype(dt), group(dkr).astype(k.dtype), group(dvr).astype(v.dtype), None,
            None, None)


_input_precision.defvjp(_input_precision_fwd, _input_precision_bwd)


def reference_gradients(q, k, v, do, mask, *, scale=None, softcap=None):
    """The policy's two reference gradients of ``sum(out * do)`` with respect to (q, k, v):
    ``(high, input)``, each a (dq, dk, dv) tuple — "high" at float32 copies of the inputs,
    "input" the dense tensor-core backward of the module doc. ``mask`` as for
    :func:`reference_attention`."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def loss(precision):
        return lambda a, b, c: jnp.sum(f32(reference_attention(
            a, b, c, mask, scale=scale, softcap=softcap, precision=precision)[0]) * f32(do))
    high = jax.jit(jax.grad(loss("high"), argnums=(0, 1, 2)))(f32(q), f32(k), f32(v))
    low = jax.jit(jax.grad(loss("input"), argnums=(0, 1, 2)))(q, k, v)
    return high, low


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
    return err, max(2.0 * base, 2.0 * _ulp_of_max(actual, h0)) + 1e-5


def _ulp_of_max(actual, ref) -> float:
    """One ulp, in ``actual``'s dtype, of the largest |ref| (0 for float32 and wider)."""
    dtype = jnp.dtype(getattr(actual, "dtype", jnp.float32))
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return 0.0
    m = float(np.max(np.abs(ref), initial=0.0))
    if not m > 0 or not math.isfinite(m):
        return 0.0
    return float(jnp.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(m))


def assert_within_policy(actual, high, low, name="result"):
    """Assert the tolerance policy (module doc) for one tensor."""
    err, allowed = policy_error(actual, high, low)
    if not err <= allowed:
        raise AssertionError(f"{name}: max abs error {err:.3g} exceeds the policy bound "
                             f"{allowed:.3g} (2 x input-dtype dense error, at least two ulps of the largest "
                             "reference value, + 1e-5)")
