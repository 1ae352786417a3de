"""NaN / Inf propagation cases shared by the CPU and GPU tests (``test_nonfinite*.py``).

The contract checked, against ``jax.nn.dot_product_attention`` on the same dense mask:

* every output, lse and gradient element that a non-finite input reaches through a
  visible (query, key) pair is non-finite, as jax's is ("required" below);
* nothing is non-finite where jax's result is finite;
* jax's dense products also spread NaN through masked pairs (0 * NaN in ``P @ V``,
  ``dS @ K``, ``dS^T @ Q``): there a flash kernel, which never touches most masked
  pairs, may stay finite, and must then equal the result computed from the inputs with
  the non-finite value replaced by 0 ("clean"): the value cannot have reached it;
* a row whose mask is empty gives out 0, lse -inf and contributes no gradient.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jcompilemask as jcm

B, N, HQ, HKV, D = 2, 40, 2, 1, 8      # the CPU shapes (GQA); the GPU tests pass theirs
ROW, COL = 13, 1              # where the non-finite value goes (batch 0, head 0)
CASES = [(where, value) for where in ("query", "key", "value")
         for value in (float("nan"), float("inf"))]


def case_id(where, value):
    return f"{where}-{'nan' if np.isnan(value) else 'inf'}"


def inputs(dtype=jnp.float32, n=N, hq=HQ, hkv=HKV, d=D, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, n, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, n, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, n, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, n, hq, d), jnp.float32).astype(dtype)
    return q, k, v, do


def document_ids(n=N, padding=0):
    """Two packed-document layouts (batch 0 splits at 9/40 and 22/40 of n, batch 1 at
    30/40; ROW falls in batch 0's second document); ``padding`` trailing tokens with id
    -1 (their rows see nothing)."""
    ids = np.zeros((B, n), np.int32)
    ids[0, 9 * n // 40:], ids[0, 22 * n // 40:] = 1, 2
    ids[1, 30 * n // 40:] = 1
    if padding:
        ids[:, n - padding:] = -1
    return ids


def inject(args, where, value):
    """(q, k, v) with ``value`` at [0, ROW, 0, COL] of ``where``."""
    i = ("query", "key", "value").index(where)
    args = list(args)
    args[i] = args[i].at[0, ROW, 0, COL].set(value)
    return tuple(args)


def jax_reference(q, k, v, do, dense):
    """jax.nn.dot_product_attention's (out, dq, dk, dv) under the bool mask
    [B|1, Hq|1, Nq, Nk] (float32 math)."""
    up = lambda x: x.astype(jnp.float32)                # noqa: E731
    mask = jnp.broadcast_to(dense, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask)  # noqa: E731
    out, vjp = jax.vjp(f, up(q), up(k), up(v))
    return (out, *vjp(up(do)))


def bhq_lse(res):
    """(out, lse) of ``return_residual=True`` with lse as [B, Hq, Nq] (the references')."""
    return res[0], jnp.swapaxes(res[1], 1, 2)


def ours(q, k, v, do, mask, implementation, metadata=None):
    f = jax.jit(lambda q, k, v: bhq_lse(jcm.mask_attention(           # noqa: E731
        q, k, v, mask, metadata=metadata, return_residual=True,
        implementation=implementation)))
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse, *vjp((do, jnp.zeros_like(lse))))


def required(where, dense, jax_out, g):
    """bool masks (out [B, Nq, Hq, D], dq, dk [B, Nk, Hkv, D], dv) of the elements the
    injected value reaches through visible pairs."""
    b, nq, hq, d = jax_out.shape
    vis = np.broadcast_to(np.asarray(dense), (b, hq, nq, dense.shape[-1]))
    rows = np.zeros((b, hq, nq), bool)                                # [B, Hq, Nq]
    if where == "value":
        rows[0, :g] = vis[0, :g, :, ROW]
    else:   # query / key: the forward is exact in jax too: read its non-finite rows
        bad = ~np.isfinite(np.asarray(jax_out)).all(-1)               # [B, Nq, Hq]
        rows = np.swapaxes(bad, 1, 2) & vis.any(-1)
    cols = np.einsum("bhqk,bhq->bhk", vis, rows) > 0                  # keys seen by rows
    cols_kv = cols.reshape(b, hq // g, g, -1).any(2)                  # [B, Hkv, Nk]
    dq = np.repeat(np.swapaxes(rows, 1, 2)[..., None], d, -1)
    dk = np.repeat(np.swapaxes(cols_kv, 1, 2)[..., None], d, -1)
    # v enters only through P @ V: P (and so dV) stays finite when v is the bad input,
    # and only the bad component of out is reached (delta = rowsum(dO * O) then spreads
    # it over dq and dk).
    out = dq & (np.arange(d) == COL) if where == "value" else dq
    dv = np.zeros_like(dk) if where == "value" else dk
    return out, dq, dk, dv


def check(name, got, ref, clean, need, atol=2e-5, rtol=2e-5):
    """The contract of the module doc for one array; ``need``: the required elements."""
    got, ref, clean = (np.asarray(x, np.float64) for x in (got, ref, clean))
    bad_got, bad_ref = ~np.isfinite(got), ~np.isfinite(ref)
    extra = bad_got & ~bad_ref
    assert not extra.any(), (f"{name}: non-finite where jax is finite at "
                             f"{np.argwhere(extra)[:5].tolist()}")
    missing = need & ~bad_got
    assert not missing.any(), (f"{name}: finite where the non-finite input reaches "
                               f"(jax: non-finite) at {np.argwhere(missing)[:5].tolist()}")
    fin = ~bad_got
    expect = np.where(bad_ref, clean, ref)
    np.testing.assert_allclose(got[fin], expect[fin], atol=atol, rtol=rtol, err_msg=name)


def check_case(where, value, mask, implementation, metadata=None, dtype=jnp.float32,
               atol=2e-5, n=N, hq=HQ, hkv=HKV, d=D):
    """Inject ``value`` into ``where`` and check out / lse / dq / dk / dv against jax.
    ``mask``: an ExecutionDescriptor, or a MaskSpec with its ``metadata``."""
    if isinstance(mask, jcm.ExecutionDescriptor):
        dense = mask.as_dense()
    else:
        dense = mask.as_dense(metadata, n, n)
    q, k, v, do = inputs(dtype, n, hq, hkv, d)
    bad = inject((q, k, v), where, value)
    clean = inject((q, k, v), where, 0.0)
    ref = jax_reference(*bad, do, dense)
    ref_clean = jax_reference(*clean, do, dense)
    out, lse, dq, dk, dv = ours(*bad, do, mask, implementation, metadata)
    need = required(where, dense, ref[0], hq // hkv)
    assert need[0].any(), "the case must reach some row (pick ROW / COL that it does)"
    if where != "value":
        # Forward with q / k non-finite: jax computes it exactly (masked logits are
        # replaced before the softmax), so the non-finite pattern and kind must match.
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref[0]), err_msg="out NaN")
        np.testing.assert_array_equal(np.isposinf(out), np.isposinf(ref[0]))
    for name, got, r, c, n in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref,
                                  ref_clean, need):
        check(name, got, r, c, n, atol=atol, rtol=atol)
    # lse depends on q and k only; rows that see nothing keep -inf.
    rows = np.swapaxes(need[1].any(-1), 1, 2) & (where != "value")   # [B, Hq, Nq]
    lse, seen = np.asarray(lse), np.broadcast_to(np.asarray(dense).any(-1), rows.shape)
    assert not np.isfinite(lse[rows]).any(), "lse of a reached row must be non-finite"
    assert np.isfinite(lse[~rows & seen]).all(), "lse non-finite in a row not reached"
    assert np.isneginf(lse[~seen]).all()
