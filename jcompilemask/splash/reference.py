"""Dense float32 references with SplashAttention's numerics, under splash's names.

They are what a port's tests compare against, so they follow splash's definitions, not
jcompilemask's: logits are the raw ``q . k`` (no scaling), soft-capped as
``cap * tanh(logits / cap)``, and masked logits are *replaced* by ``mask_value`` (a row
that sees nothing then averages every value row, where the kernel returns 0). ``sinks``
(one logit per head) add ``exp(sink)`` to the softmax denominator.

* :func:`attention_reference` -- one head: ``mask`` [Nq, Nk], ``q`` [Nq, D],
  ``k`` [Nk, D], ``v`` [Nk, Dv]; plain autodiff.
* :func:`attention_reference_custom` -- the same forward with a hand-written backward
  (``custom_type="flash"``: ``delta = rowsum(o * do)``, as the kernels compute it;
  ``"vanilla"``: ``delta = rowsum(p * dp)``). :func:`_attention_reference_custom_bwd` is
  that backward on its own (residuals in, ``(None, dq, dk, dv, None, dsinks)`` out).
* :func:`make_masked_mha_reference` / :func:`make_masked_mqa_reference` -- all heads at
  once, with a kernel's call shapes (GQA: query head ``h`` reads kv head
  ``h // (heads // kv_heads)``), jitted.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jcompilemask import splash
>>> mask = np.tril(np.ones((8, 8), bool))
>>> q = k = v = jax.random.normal(jax.random.key(0), (8, 4))
>>> out = attention_reference(mask, q, k, v, None)
>>> x = q[None, :, None, :]                                  # [batch, seq, heads, dim]
>>> ref = jax.nn.dot_product_attention(x, x, x, scale=1.0, is_causal=True)
>>> bool(jnp.allclose(out, ref[0, :, 0], atol=1e-5))
True
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DEFAULT_MASK_VALUE", "attention_reference", "attention_reference_custom",
           "make_attention_reference", "make_masked_mha_reference",
           "make_masked_mqa_reference"]

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)
F32 = jnp.float32


def _visible(mask, segment_ids):
    mask = jnp.asarray(mask, bool)
    if segment_ids is None:
        return mask
    same = jnp.asarray(segment_ids.q)[:, None] == jnp.asarray(segment_ids.kv)[None, :]
    return mask & same


def _capped(raw, cap):
    return raw if cap is None else cap * jnp.tanh(raw / cap)


def _forward(mask, q, k, v, segment_ids, sinks, mask_value, cap):
    """(out [Nq, Dv] f32, lse [Nq] f32) of one head."""
    raw = jnp.einsum("qd,kd->qk", q.astype(F32), k.astype(F32))
    logits = jnp.where(_visible(mask, segment_ids), _capped(raw, cap), mask_value)
    m = jnp.max(logits, axis=-1)
    if sinks is not None:
        sinks = jnp.asarray(sinks, F32)
        m = jnp.maximum(m, sinks)
    p = jnp.exp(logits - m[:, None])
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sinks - m)
    out = jnp.einsum("qk,kd->qd", p / denom[:, None], v.astype(F32))
    return out, m + jnp.log(denom)


def attention_reference(mask, q, k, v, segment_ids, sinks=None, *,
                        mask_value: float = DEFAULT_MASK_VALUE, save_residuals: bool = False,
                        custom_type: str = "flash",
                        attn_logits_soft_cap: Optional[float] = None):
    """One head of splash attention, densely, in float32 (see the module doc).

    Returns ``out`` [Nq, Dv], or ``(out, (logsumexp,))`` with ``save_residuals``.
    ``custom_type`` is accepted for signature parity with
    :func:`attention_reference_custom` and has no effect here.
    """
    del custom_type
    out, lse = _forward(mask, q, k, v, segment_ids, sinks, mask_value, attn_logits_soft_cap)
    return (out, (lse,)) if save_residuals else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _custom(mask, q, k, v, segment_ids, sinks, mask_value, save_residuals, custom_type,
            cap):
    out, lse = _forward(mask, q, k, v, segment_ids, sinks, mask_value, cap)
    return (out, (lse,)) if save_residuals else out


def _custom_fwd(mask, q, k, v, segment_ids, sinks, mask_value, save_residuals, custom_type,
                cap):
    if save_residuals:
        raise NotImplementedError("the custom reference differentiates the output only "
                                  "(save_residuals=False)")
    out, lse = _forward(mask, q, k, v, segment_ids, sinks, mask_value, cap)
    return out, (mask, q, k, v, segment_ids, sinks, out, lse)


def _attention_reference_custom_bwd(mask_value: float, save_residuals: bool,
                                    custom_type: str, attn_logits_soft_cap: Optional[float],
                                    res, do):
    """The hand-written backward of one head from its residuals
    ``(mask, q, k, v, segment_ids, sinks, out, logsumexp)``.

    Returns ``(None, dq, dk, dv, None, dsinks)`` (the Nones stand for ``mask`` and
    ``segment_ids``; ``dsinks`` is None without sinks). ``custom_type`` picks how
    ``delta`` is formed: ``"flash"`` from ``rowsum(out * do)``, ``"vanilla"`` from
    ``rowsum(p * dp)``; they agree up to rounding.
    """
    del save_residuals
    mask, q, k, v, segment_ids, sinks, out, lse = res
    if custom_type not in ("flash", "vanilla"):
        raise ValueError(f"custom_type must be 'flash' or 'vanilla', got {custom_type!r}")
    cap = attn_logits_soft_cap
    raw = jnp.einsum("qd,kd->qk", q.astype(F32), k.astype(F32))
    logits = jnp.where(_visible(mask, segment_ids), _capped(raw, cap), mask_value)
    p = jnp.exp(logits - lse[:, None])
    do = do.astype(F32)
    dv = jnp.einsum("qk,qd->kd", p, do)
    dp = jnp.einsum("qd,kd->qk", do, v.astype(F32))
    if custom_type == "flash":
        delta = jnp.sum(out.astype(F32) * do, axis=-1)
    else:
        delta = jnp.sum(p * dp, axis=-1)
    ds = p * (dp - delta[:, None])
    if cap is not None:
        t = jnp.tanh(raw / cap)
        ds = ds * (1.0 - t * t)
    dq = jnp.einsum("qk,kd->qd", ds, k.astype(F32))
    dk = jnp.einsum("qk,qd->kd", ds, q.astype(F32))
    dsinks = None
    if sinks is not None:
        # d lse / d sink = exp(sink - lse); out depends on the sink only through lse.
        w = jnp.exp(jnp.asarray(sinks, F32) - lse)                       # [Nq]
        dsinks = -jnp.sum(w[:, None] * out.astype(F32) * do).astype(jnp.asarray(sinks).dtype)
    return None, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, dsinks


_custom.defvjp(_custom_fwd, _attention_reference_custom_bwd)


def attention_reference_custom(mask, q, k, v, segment_ids, sinks=None, *,
                               mask_value: float = DEFAULT_MASK_VALUE,
                               save_residuals: bool = False, custom_type: str = "flash",
                               attn_logits_soft_cap: Optional[float] = None):
    """:func:`attention_reference` with the hand-written backward (see the module doc)."""
    return _custom(mask, q, k, v, segment_ids, sinks, mask_value, save_residuals,
                   custom_type, attn_logits_soft_cap)


def _one_head(backward_impl: str) -> Callable:
    if backward_impl == "vanilla":
        return attention_reference
    if backward_impl == "custom":
        return functools.partial(attention_reference_custom, custom_type="flash")
    if backward_impl == "custom_vanilla":
        return functools.partial(attention_reference_custom, custom_type="vanilla")
    raise ValueError(f"backward_impl must be 'vanilla', 'custom' or 'custom_vanilla', got "
                     f"{backward_impl!r}")


def make_attention_reference(mask, is_mqa: bool, backward_impl: str = "vanilla",
                             **params: Any) -> Callable:
    """A jitted all-heads reference for ``mask`` [heads, Nq, Nk] (a splash mask or array).

    The result is called like a kernel, ``ref(q, k, v, segment_ids=None, sinks=None, *,
    mask_value=..., save_residuals=False, attn_logits_soft_cap=None)``, with q
    [heads, Nq, D] and k/v [kv_heads, Nk, D] (MHA/GQA) or [Nk, D] (MQA).
    ``backward_impl``: ``"vanilla"`` (autodiff), ``"custom"`` or ``"custom_vanilla"``.
    ``params`` are passed to every head's reference call.
    """
    one = _one_head(backward_impl)
    dense = jnp.asarray(np.asarray(mask[:, :, :]), bool)

    @functools.partial(jax.jit, static_argnames=("mask_value", "save_residuals",
                                                 "attn_logits_soft_cap"))
    def ref(mask3, q, k, v, segment_ids=None, sinks=None, *,
            mask_value: float = DEFAULT_MASK_VALUE, save_residuals: bool = False,
            attn_logits_soft_cap: Optional[float] = None):
        head = functools.partial(one, mask_value=mask_value, save_residuals=save_residuals,
                                 attn_logits_soft_cap=attn_logits_soft_cap, **params)
        hq = q.shape[0]
        sink_axis = None if sinks is None else 0
        if is_mqa:
            return jax.vmap(head, in_axes=(0, 0, None, None, None, sink_axis))(
                mask3, q, k, v, segment_ids, sinks)
        hkv = k.shape[0]
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
        g = hq // hkv
        # Group the query heads by the kv head they read: [kv_heads, group, ...].
        grouped = lambda x: x.reshape((hkv, g) + x.shape[1:])   # noqa: E731
        mask_g = grouped(jnp.broadcast_to(mask3, (hq,) + mask3.shape[1:]))
        sinks_g = None if sinks is None else grouped(sinks)
        inner = jax.vmap(head, in_axes=(0, 0, None, None, None, sink_axis))
        out = jax.vmap(inner, in_axes=(0, 0, 0, 0, None, sink_axis))(
            mask_g, grouped(q), k, v, segment_ids, sinks_g)
        flat = lambda x: x.reshape((hq,) + x.shape[2:])           # noqa: E731
        if save_residuals:
            o, (lse,) = out
            return flat(o), (flat(lse),)
        return flat(out)

    return functools.partial(ref, dense)


make_masked_mha_reference = functools.partial(make_attention_reference, is_mqa=False)
make_masked_mha_reference.__doc__ = "All-heads MHA/GQA reference (see make_attention_reference)."
make_masked_mqa_reference = functools.partial(make_attention_reference, is_mqa=True)
make_masked_mqa_reference.__doc__ = "All-heads MQA reference (see make_attention_reference)."
