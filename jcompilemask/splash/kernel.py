"""``make_splash_mha`` / ``make_splash_mqa``: SplashAttention's API on jcompilemask.

Call shapes and numerics follow ``jax.experimental.pallas.ops.tpu.splash_attention``:

* the kernel runs on one example: ``kernel(q, k, v, segment_ids=None, sinks=None)`` with
  q [heads, q_seq_len, head_dim]; MHA k/v [kv_heads, kv_seq_len, head_dim(_v)] (query
  head ``h`` reads kv head ``h // (heads // kv_heads)``); MQA k/v [kv_seq_len, head_dim].
  Batch with ``jax.vmap(kernel)``.
* logits are the raw ``q . k`` (no ``1/sqrt(head_dim)``; scale q yourself, as with splash),
  soft-capped as ``cap * tanh(logits / cap)``, then masked.
* ``save_residuals=True`` returns ``(out, (logsumexp,))``, logsumexp float32
  [heads, q_seq_len] (natural log).
* ``sinks`` (float [heads]) add ``exp(sink)`` to each row's softmax denominator.

Differences, all deliberate:

* A row that sees no key returns 0 (logsumexp -inf; with sinks, logsumexp = sink).
  Splash leaves such rows undefined (its docs say to avoid them).
* Masked logits are excluded exactly, so ``mask_value`` is accepted but only checked
  (it must be very negative, as splash's default is).
* ``block_sizes`` (splash's ``BlockSizes`` or JAX's) is accepted and ignored: the tile
  shapes are those of the jcompilemask backend that runs (``jcompilemask.backends``),
  and a descriptor built at other tiles would push the GPU kernels off their fast path.
  Likewise ``downcast_smem_data``, ``interpret``, ``head_shards`` and ``q_seq_shards``.
* Segment ids: splash lets query i see key j iff ``segment_ids.q[i] ==
  segment_ids.kv[j]`` (id equality, not runs). The kernel computes, per query row, the
  first and one-past-last key position holding that id and passes them as MaskSpec
  metadata tables; the rule ``static & (k >= lo(q)) & (k < hi(q))`` lowers to intervals
  (fast path) and is exact when every id's keys form one contiguous stretch -- which
  packing produces. Otherwise:

  - with concrete segment ids (outside ``jit``) the kernel detects it and uses the exact
    rule ``static & (id_q(q) == id_kv(k))`` (a per-element predicate: correct, slower,
    served by the ``xla`` backend);
  - inside ``jit`` the check runs on device and rows whose id is split into several
    stretches return NaN -- never a silently wrong value. Pass
    ``exact_segment_ids=True`` to the factory to use the exact rule always.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..attention.api import mask_attention
from ..lower.compiled import compile as _compile
from ..lower.dense import _runs
from ..spec.expr import Or, k, q
from ..spec.metadata import SegmentIds as _SegDecl
from .convert import head_groups, spec_from_groups, to_jcm

__all__ = ["SegmentIds", "BlockSizes", "QKVLayout", "SplashAttentionKernel",
           "make_splash_mha", "make_splash_mqa", "make_splash_mha_single_device",
           "make_splash_mqa_single_device", "DEFAULT_MASK_VALUE"]

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.dtype("float32")).max)


class SegmentIds(NamedTuple):
    """Segment ids of one example: ``q`` int [q_seq_len], ``kv`` int [kv_seq_len].

    Query i sees key j only if ``q[i] == kv[j]`` (and the static mask allows it).
    """

    q: Any
    kv: Any


class QKVLayout:
    """Accepted for compatibility; jcompilemask always takes head_dim last."""

    HEAD_DIM_MINOR = 1
    SEQ_MINOR = 2


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Splash's tile sizes. Accepted and ignored: jcompilemask's backends choose their own
    tiles (see the module docstring)."""

    block_q: int
    block_kv: int
    block_kv_compute: Optional[int] = None
    block_q_dkv: Optional[int] = None
    block_kv_dkv: Optional[int] = None
    block_kv_dkv_compute: Optional[int] = None
    block_q_dq: Optional[int] = None
    block_kv_dq: Optional[int] = None
    use_fused_bwd_kernel: bool = False
    q_layout: Any = QKVLayout.HEAD_DIM_MINOR
    k_layout: Any = QKVLayout.HEAD_DIM_MINOR
    v_layout: Any = QKVLayout.HEAD_DIM_MINOR

    @classmethod
    def get_default(cls):
        return cls(128, 128, 128, 128, 128, 128, 128, 128)


# ---------------------------------------------------------------------------------------
# Segment-id masks
# ---------------------------------------------------------------------------------------
_SEG_LO, _SEG_HI = _SegDecl("seg_lo"), _SegDecl("seg_hi")
_SEG_Q, _SEG_KV = _SegDecl("seg_q"), _SegDecl("seg_kv")
_RUN_RULE = (k >= _SEG_LO.id(q)) & (k < _SEG_HI.id(q))
_EXACT_RULE = _SEG_Q.id(q) == _SEG_KV.id(k)


def _dense_tables(groups):
    """Rules for dense head groups read per-row run tables (metadata ``d{g}_{s|e}{r}``)."""
    tables, rules = {}, {}
    for gi, g in enumerate(groups):
        if g.rule is not None:
            continue
        starts, lens = _runs(g.dense)                      # [Nq, R]
        parts = []
        for r in range(starts.shape[-1]):
            s, e = _SegDecl(f"d{gi}_s{r}"), _SegDecl(f"d{gi}_e{r}")
            tables[s.name] = starts[:, r]
            tables[e.name] = starts[:, r] + lens[:, r]
            parts.append((k >= s.id(q)) & (k < e.id(q)))
        rules[gi] = Or.of(*parts)
    return tables, rules


def _segment_tables(q_ids, kv_ids):
    """Per query row: first / one-past-last key position with the same id, and whether
    those keys are contiguous (the fast rule is exact for that row)."""
    nk = kv_ids.shape[0]
    order = jnp.argsort(kv_ids, stable=True).astype(jnp.int32)
    sorted_ids = kv_ids[order]
    left = jnp.searchsorted(sorted_ids, q_ids, side="left").astype(jnp.int32)
    right = jnp.searchsorted(sorted_ids, q_ids, side="right").astype(jnp.int32)
    count = right - left
    first = order[jnp.clip(left, 0, nk - 1)]
    last = order[jnp.clip(right - 1, 0, nk - 1)]
    lo = jnp.where(count > 0, first, 0)
    hi = jnp.where(count > 0, last + 1, 0)
    return lo, hi, (count == 0) | (hi - lo == count)


def _pad_row(x, n):
    x = jnp.asarray(x, jnp.int32)
    return jnp.pad(x, (0, n - x.shape[0]))[None]


class _Masks:
    """The static conversions of one splash mask (built once per kernel)."""

    def __init__(self, mask):
        self.groups, self.n_heads, self.shape = head_groups(mask)
        self.static = to_jcm(mask)
        self.dense_tables, dense_rules = _dense_tables(self.groups)
        self.fast = spec_from_groups(self.groups, self.n_heads, _RUN_RULE, "splash+segments",
                                     dense_rule=dense_rules.get)
        self.exact = spec_from_groups(self.groups, self.n_heads, _EXACT_RULE,
                                      "splash+segments(exact)", dense_rule=dense_rules.get)
        _compile(self.fast, warn=False)
        _compile(self.exact, warn=False)

    @property
    def mask_heads(self):
        return max(self.n_heads, 1)

    def metadata(self, spec, extra, n):
        meta = {name: _pad_row(v, n) for name, v in self.dense_tables.items()}
        meta.update({name: _pad_row(v, n) for name, v in extra.items()})
        return {name: v for name, v in meta.items() if name in spec.metadata}


# ---------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------
@jax.tree_util.register_pytree_node_class
class SplashAttentionKernel:
    """The callable returned by the ``make_splash_*`` factories (a leafless pytree, so it
    can be closed over or passed through ``jit``)."""

    def __init__(self, masks: _Masks, *, is_mqa: bool, save_residuals: bool,
                 attn_logits_soft_cap: Optional[float], residual_checkpoint_name,
                 exact_segment_ids: bool, implementation: Optional[str]):
        self.masks = masks
        self.is_mqa = is_mqa
        self.save_residuals = save_residuals
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.residual_checkpoint_name = residual_checkpoint_name
        self.exact_segment_ids = exact_segment_ids
        self.implementation = implementation

    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, aux, children):
        return aux

    def manual_sharding_spec(self, sharding):
        raise NotImplementedError(
            "jcompilemask's splash layer has no mask-info arrays to shard: close over the "
            "kernel inside shard_map instead (its mask must then match the local heads and "
            "sequence)")

    def __repr__(self):
        return (f"<jcompilemask SplashAttentionKernel {'mqa' if self.is_mqa else 'mha'} "
                f"mask {self.masks.static!r}>")

    # -- call ---------------------------------------------------------------------------
    def __call__(self, q, k, v, segment_ids: Optional[SegmentIds] = None, sinks=None):
        hq, nq, d = self._check(q, k, v)
        if self.is_mqa:
            k4, v4 = k[None, :, None, :], v[None, :, None, :]
        else:
            k4, v4 = jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None]
        q4 = jnp.swapaxes(q, 0, 1)[None]
        nk = k4.shape[1]
        bad_rows = None
        if segment_ids is None:
            mask, metadata = self.masks.static, None
        else:
            mask, metadata, bad_rows = self._segments(segment_ids, nq, nk)
        out, lse = mask_attention(q4, k4, v4, mask, metadata=metadata, scale=1.0,
                                  logits_soft_cap=self.attn_logits_soft_cap,
                                  return_residual=True, implementation=self.implementation)
        out = jnp.swapaxes(out[0], 0, 1)                # [H, Nq, Dv]
        lse = jnp.swapaxes(lse[0], 0, 1)                # [H, Nq]
        if sinks is not None:
            sinks = jnp.asarray(sinks, jnp.float32)
            if sinks.shape != (hq,):
                raise ValueError(f"sinks must have shape [heads] = ({hq},), got {sinks.shape}")
            keep = jax.nn.sigmoid(lse - sinks[:, None])          # exp(lse) / (exp(lse)+exp(s))
            out = (out.astype(jnp.float32) * keep[..., None]).astype(q.dtype)
            lse = jnp.logaddexp(lse, sinks[:, None])
        if bad_rows is not None:
            out = jnp.where(bad_rows[None, :, None], jnp.nan, out).astype(q.dtype)
        if self.residual_checkpoint_name is not None:
            from jax.ad_checkpoint import checkpoint_name
            out = checkpoint_name(out, self.residual_checkpoint_name)
            lse = checkpoint_name(lse, self.residual_checkpoint_name)
        return (out, (lse,)) if self.save_residuals else out

    def _check(self, q, k, v):
        if getattr(q, "ndim", None) != 3:
            raise ValueError(f"q must be [heads, q_seq_len, head_dim] (one example; vmap over "
                             f"the batch), got shape {getattr(q, 'shape', None)}")
        hq, nq, d = q.shape
        want = 2 if self.is_mqa else 3
        what = "[kv_seq_len, head_dim]" if self.is_mqa else "[kv_heads, kv_seq_len, head_dim]"
        for name, x in (("k", k), ("v", v)):
            if getattr(x, "ndim", None) != want:
                raise ValueError(f"{'MQA' if self.is_mqa else 'MHA'}: {name} must be {what}, "
                                 f"got shape {getattr(x, 'shape', None)}")
        if k.shape[-1] != d:
            raise ValueError(f"Expected 'key' head dimension to be: {d}. Instead got: "
                             f"{k.shape[-1]}.")
        if k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"Expected 'key' {k.shape} and 'value' {v.shape} to have the "
                             "same leading dimensions.")
        if not self.is_mqa and hq % k.shape[0]:
            raise ValueError(f"In MHA, the number of query heads ({hq}) must be a multiple of "
                             f"the number of key heads ({k.shape[0]})")
        nk = k.shape[-2]
        if (nq, nk) != self.masks.shape:
            raise ValueError(f"the mask is {self.masks.shape} (q_seq_len, kv_seq_len); q/k "
                             f"have {nq}/{nk}")
        if self.masks.n_heads not in (0, hq):
            raise ValueError(f"the mask has {self.masks.n_heads} heads, q has {hq}")
        return hq, nq, d

    def _segments(self, seg, nq, nk):
        sq, skv = seg
        sq, skv = jnp.asarray(sq), jnp.asarray(skv)
        if sq.shape != (nq,) or skv.shape != (nk,):
            raise ValueError(f"segment_ids.q must be [{nq}] and segment_ids.kv [{nk}], got "
                             f"{sq.shape} and {skv.shape}")
        n = max(nq, nk)
        m = self.masks
        concrete = not isinstance(seg[0], jax.core.Tracer) and \
            not isinstance(seg[1], jax.core.Tracer)
        if self.exact_segment_ids:
            exact = True
        elif concrete:
            _, _, ok = _segment_tables(sq.astype(jnp.int32), skv.astype(jnp.int32))
            exact = not bool(np.all(np.asarray(ok)))
        else:
            exact = False
        if exact:
            meta = m.metadata(m.exact, {"seg_q": sq, "seg_kv": skv}, n)
            return m.exact, meta, None
        lo, hi, ok = _segment_tables(sq.astype(jnp.int32), skv.astype(jnp.int32))
        meta = m.metadata(m.fast, {"seg_lo": lo, "seg_hi": hi}, n)
        return m.fast, meta, (None if concrete else ~ok)


# ---------------------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------------------
def _check_block_sizes(block_sizes):
    if block_sizes is None:
        return
    if not all(hasattr(block_sizes, f) for f in ("block_q", "block_kv")):
        raise TypeError(f"block_sizes must be a splash BlockSizes, got "
                        f"{type(block_sizes).__name__}")


def _make(mask, *, is_mqa: bool, block_sizes=None, save_residuals: bool = False,
          mask_value: float = DEFAULT_MASK_VALUE, attn_logits_soft_cap: Optional[float] = None,
          downcast_smem_data: bool = True, head_shards: int = 1, q_seq_shards: int = 1,
          residual_checkpoint_name: Optional[str] = None, interpret: bool = False,
          exact_segment_ids: bool = False, implementation: Optional[str] = None):
    del downcast_smem_data, interpret, head_shards, q_seq_shards   # see module docstring
    _check_block_sizes(block_sizes)
    if mask_value is not None and not mask_value <= -1e30:
        raise ValueError(f"mask_value={mask_value!r}: jcompilemask excludes masked keys "
                         "exactly (as -inf); a mask_value that is not very negative would "
                         "change splash's result and is not supported")
    if attn_logits_soft_cap is not None:
        if not isinstance(attn_logits_soft_cap, (int, float)) or attn_logits_soft_cap <= 0:
            raise ValueError(f"attn_logits_soft_cap must be a positive float, got "
                             f"{attn_logits_soft_cap!r}")
        attn_logits_soft_cap = float(attn_logits_soft_cap)
    shape = getattr(mask, "shape", None)
    if shape is None or len(shape) != 3:
        raise ValueError(f"Unexpected mask shape: {shape} (splash kernels take a "
                         "[heads, q_seq_len, kv_seq_len] mask: a MultiHeadMask or a 3-D "
                         "boolean array)")
    return SplashAttentionKernel(
        _Masks(mask), is_mqa=is_mqa, save_residuals=bool(save_residuals),
        attn_logits_soft_cap=attn_logits_soft_cap,
        residual_checkpoint_name=residual_checkpoint_name,
        exact_segment_ids=bool(exact_segment_ids), implementation=implementation)


def make_splash_mha(mask, *, head_shards: int, q_seq_shards: int, **kwargs):
    """Multi-head (and grouped-query) splash attention over ``mask``.

    ``mask``: a :class:`MultiHeadMask` (ours or JAX's) or a boolean numpy array
    [heads, q_seq_len, kv_seq_len]. Keywords as JAX's ``make_splash_mha``
    (``block_sizes``, ``save_residuals``, ``mask_value``, ``attn_logits_soft_cap``,
    ``downcast_smem_data``, ``residual_checkpoint_name``, ``interpret``), plus
    ``exact_segment_ids`` and ``implementation`` (see the module docstring).

    >>> import jax, jax.numpy as jnp
    >>> from jcompilemask import splash
    >>> mask = splash.MultiHeadMask([splash.CausalMask((16, 16))] * 2)
    >>> kernel = splash.make_splash_mha_single_device(mask)
    >>> x = jax.random.normal(jax.random.key(0), (3, 2, 16, 8))   # [batch, H, N, D]
    >>> jax.vmap(kernel)(x, x, x).shape
    (3, 2, 16, 8)
    """
    return _make(mask, is_mqa=False, head_shards=head_shards, q_seq_shards=q_seq_shards,
                 **kwargs)


def make_splash_mqa(mask, *, head_shards: int, q_seq_shards: int, **kwargs):
    """Multi-query splash attention: k/v are [kv_seq_len, head_dim], shared by the heads."""
    return _make(mask, is_mqa=True, head_shards=head_shards, q_seq_shards=q_seq_shards,
                 **kwargs)


make_splash_mha_single_device = functools.partial(make_splash_mha, head_shards=1,
                                                  q_seq_shards=1)
make_splash_mqa_single_device = functools.partial(make_splash_mqa, head_shards=1,
                                                  q_seq_shards=1)
