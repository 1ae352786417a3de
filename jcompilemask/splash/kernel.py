"""``make_splash_mha`` / ``make_splash_mqa``: SplashAttention's API on jcompilemask.

Call shapes and numerics follow ``jax.experimental.pallas.ops.tpu.splash_attention``:

* the kernel runs on one example: ``kernel(q, k, v, segment_ids=None, sinks=None)`` with
  q [heads, q_seq_len, head_dim]; MHA k/v [kv_heads, kv_seq_len, head_dim(_v)] (query
  head ``h`` reads kv head ``h // (heads // kv_heads)``); MQA k/v [kv_seq_len, head_dim].
  Batch with ``jax.vmap(kernel)``. A call is jitted (compiled once per kernel, input
  shapes and options), so calling it eagerly in a loop does not recompile.
* logits are the raw ``q . k`` (no ``1/sqrt(head_dim)``; scale q yourself, as with splash),
  soft-capped as ``cap * tanh(logits / cap)``, then masked.
* ``save_residuals=True`` returns ``(out, (logsumexp,))``, logsumexp float32
  [heads, q_seq_len] (natural log).
* ``sinks`` (float [heads]) add ``exp(sink)`` to each row's softmax denominator.
* The float32 references splash's tests use (``attention_reference``,
  ``make_masked_mha_reference``, ...) are in :mod:`jcompilemask.splash.reference`.

Options, and what each does here:

=============================  ========================================================
``block_sizes``                validated (this module's :class:`BlockSizes` or JAX's)
                               and otherwise without effect: the tiles are those of the
                               jcompilemask backend that runs (``jcompilemask.backends``);
                               a descriptor built at other tiles would push the GPU
                               kernels off their fast path. The backward needs no
                               backward blocks (``has_backward_blocks`` may be False).
``BlockSizes.*_layout``        no effect, as in splash, where a layout only changes the
                               physical layout inside the kernel (the logical interface
                               always takes head_dim minor-most); here XLA picks layouts.
``downcast_smem_data``         no effect (there are no scalar-memory block tables).
``interpret``                  no effect (no Pallas kernel: the same compiled code runs
                               on every platform).
``head_shards``,               validated (they must divide the heads / q_seq_len, as in
``q_seq_shards``               splash) and otherwise without effect: a kernel runs on
                               one device. To spread attention over devices, shard the
                               inputs with JAX (``jax.jit`` with ``NamedSharding`` inputs
                               partitions the batch and heads of a vmapped kernel), or
                               call a kernel built for the local heads inside
                               ``shard_map``.
``mask_value``                 checked (it must be very negative, as splash's default
                               is); masked logits are excluded exactly.
=============================  ========================================================

Differences, all deliberate:

* A row that sees no key returns 0 (logsumexp -inf; with sinks, logsumexp = sink).
  Splash leaves such rows undefined (its docs say to avoid them).
* Masks: structured splash masks (causal, local, chunked, full, and/or of them) become
  MaskSpecs that lower to intervals (every backend, GPU kernels included); a dense mask
  (``NumpyMask``, an array, an unknown class) becomes :func:`jcompilemask.from_dense`
  -- interval tables up to 8 runs per row (32 where the GPU kernels run), a packed bitmap
  past that, whose cost does not depend on the number of runs.
* Segment ids: splash lets query i see key j iff ``segment_ids.q[i] ==
  segment_ids.kv[j]`` (id equality, not runs).

  - With a structured mask, the kernel computes, per query row, the first and
    one-past-last key position holding that id and passes them as MaskSpec metadata;
    the rule ``static & (k >= lo(q)) & (k < hi(q))`` lowers to intervals (fast path) and
    is exact when every id's keys form one contiguous stretch -- which packing produces.
    Otherwise, with concrete segment ids (outside ``jit``) the kernel detects it and uses
    the exact rule ``static & (id_q(q) == id_kv(k))`` (a per-element predicate: correct,
    slower, served by the ``xla`` backend); inside ``jit`` rows whose id is split into
    several stretches return NaN -- never a silently wrong value. Pass
    ``exact_segment_ids=True`` to the factory to use the exact rule always.
  - A dense mask kept as interval tables takes the same fast path: its runs clipped per
    row to that row's id's keys (:class:`jcompilemask.lower.dense.SegmentRunsDenseMask`,
    every backend), with the same contiguity check and fallback. The exact form (and
    the only one for a dense mask kept as a bitmap) intersects the bitmap with the id
    equality per tile at run time (:class:`jcompilemask.lower.dense.SegmentedDenseMask`,
    ``xla``): exact for any ids.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..attention.api import mask_attention
from ..lower.compiled import compile as _compile
from ..lower.dense import SegmentedDenseMask, SegmentRunsDenseMask, segment_runs
from ..spec.expr import k, q
from ..spec.maskspec import MaskSpec
from ..spec.metadata import SegmentIds as _SegDecl
from .convert import _dense_all, head_groups, spec_from_groups, to_jcm
from .reference import DEFAULT_MASK_VALUE

__all__ = ["SegmentIds", "BlockSizes", "QKVLayout", "SplashAttentionKernel",
           "make_splash_mha", "make_splash_mqa", "make_splash_mha_single_device",
           "make_splash_mqa_single_device", "DEFAULT_MASK_VALUE"]


class SegmentIds(NamedTuple):
    """Segment ids of one example: ``q`` int [q_seq_len], ``kv`` int [kv_seq_len].

    Query i sees key j only if ``q[i] == kv[j]`` (and the static mask allows it).
    """

    q: Any
    kv: Any


class QKVLayout(enum.IntEnum):
    """Splash's physical layouts of q/k/v inside its kernel: ``HEAD_DIM_MINOR``
    ([..., seq_len, head_dim]) or ``SEQ_MINOR`` ([..., head_dim, seq_len]). The logical
    interface takes head_dim minor-most either way; here they have no effect."""

    HEAD_DIM_MINOR = enum.auto()
    SEQ_MINOR = enum.auto()


def _positive_int(name, v, optional=True):
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {v!r}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Splash's tile sizes, with splash's defaults and derived fields.

    ``block_kv_compute`` defaults to ``block_kv`` and ``block_kv_dkv_compute`` to
    ``block_kv_dkv``; with ``use_fused_bwd_kernel`` the dq blocks must be None. Accepted
    by the factories and without effect on the computation (see the module docstring).

    >>> BlockSizes(256, 512).block_kv_compute
    512
    >>> BlockSizes(128, 128).has_backward_blocks, BlockSizes.get_default().has_backward_blocks
    (False, True)
    """

    block_q: int
    block_kv: int
    block_kv_compute: Optional[int] = None
    block_q_dkv: Optional[int] = None
    block_kv_dkv: Optional[int] = None
    block_kv_dkv_compute: Optional[int] = None
    block_q_dq: Optional[int] = None
    block_kv_dq: Optional[int] = None
    use_fused_bwd_kernel: bool = False
    q_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR
    k_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR
    v_layout: QKVLayout = QKVLayout.HEAD_DIM_MINOR

    def __post_init__(self):
        _positive_int("block_q", self.block_q, optional=False)
        _positive_int("block_kv", self.block_kv, optional=False)
        if self.block_kv_compute is None:
            object.__setattr__(self, "block_kv_compute", self.block_kv)
        if self.block_kv_dkv_compute is None:
            object.__setattr__(self, "block_kv_dkv_compute", self.block_kv_dkv)
        for f in ("block_kv_compute", "block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
                  "block_q_dq", "block_kv_dq"):
            _positive_int(f, getattr(self, f))
        if self.use_fused_bwd_kernel and (self.block_q_dq is not None
                                          or self.block_kv_dq is not None):
            raise ValueError("Block sizes for dq kernel are not needed with a fused kernel "
                             "(use_fused_bwd_kernel=True): leave block_q_dq and block_kv_dq "
                             "None")
        for f in ("q_layout", "k_layout", "v_layout"):
            v = getattr(self, f)
            try:
                object.__setattr__(self, f, QKVLayout(int(v)))
            except (TypeError, ValueError):
                raise ValueError(f"BlockSizes.{f} must be a QKVLayout, got {v!r}") from None

    @property
    def has_backward_blocks(self) -> bool:
        """Whether the backward tiles are all set (splash needs them for gradients;
        jcompilemask does not)."""
        need = [self.block_q_dkv, self.block_kv_dkv, self.block_kv_dkv_compute]
        if not self.use_fused_bwd_kernel:
            need += [self.block_q_dq, self.block_kv_dq]
        return all(b is not None for b in need)

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


def _contiguous_np(q_ids, kv_ids) -> bool:
    """Whether every query id's keys form one contiguous stretch (numpy, eager)."""
    kv_ids = np.asarray(kv_ids)
    present = np.unique(np.asarray(q_ids))
    for i in present:
        pos = np.flatnonzero(kv_ids == i)
        if pos.size and pos[-1] - pos[0] + 1 != pos.size:
            return False
    return True


def _pad_row(x, n):
    x = jnp.asarray(x, jnp.int32)
    return jnp.pad(x, (0, n - x.shape[0]))[None]


class _Masks:
    """The conversions of one splash mask, built once per kernel (segment-id variants on
    first use)."""

    def __init__(self, mask):
        self.groups, self.n_heads, self.shape = head_groups(mask)
        self.static = to_jcm(mask)
        _compile(self.static, warn=False)
        self.structured = isinstance(self.static, MaskSpec)

    @functools.cached_property
    def fast(self):
        return _compile(spec_from_groups(self.groups, self.n_heads, _RUN_RULE,
                                         "splash+segments"), warn=False)

    @functools.cached_property
    def exact(self):
        return _compile(spec_from_groups(self.groups, self.n_heads, _EXACT_RULE,
                                         "splash+segments(exact)"), warn=False)

    @functools.cached_property
    def dense_segmented(self):
        return SegmentedDenseMask(np.ascontiguousarray(
            _dense_all(self.groups, self.n_heads, self.shape)), name="splash+segments")

    @property
    def dense_tables(self) -> bool:
        """A dense mask kept as interval tables (not a bitmap): its segment-id form can
        be interval tables too (``dense_runs``)."""
        return not self.structured and self.static.layout == "intervals"

    @functools.cached_property
    def dense_runs(self):
        return SegmentRunsDenseMask(np.ascontiguousarray(
            _dense_all(self.groups, self.n_heads, self.shape)), name="splash+segments",
            layout="intervals")


# ---------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------
def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


@jax.tree_util.register_pytree_node_class
class SplashAttentionKernel:
    """The callable returned by the ``make_splash_*`` factories (a leafless pytree, so it
    can be closed over or passed through ``jit``). Calls are jitted and cached per
    kernel."""

    def __init__(self, masks: _Masks, *, is_mqa: bool, save_residuals: bool,
                 attn_logits_soft_cap: Optional[float], residual_checkpoint_name,
                 exact_segment_ids: bool, implementation: Optional[str], block_sizes=None):
        self.masks = masks
        self.is_mqa = is_mqa
        self.save_residuals = save_residuals
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.residual_checkpoint_name = residual_checkpoint_name
        self.exact_segment_ids = exact_segment_ids
        self.implementation = implementation
        self.block_sizes = block_sizes
        self._call = jax.jit(self._impl, static_argnames=("mode",))

    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, aux, children):
        return aux

    def manual_sharding_spec(self, sharding):
        raise NotImplementedError(
            "jcompilemask's splash layer has no mask-info arrays to shard: shard the "
            "inputs with JAX instead (jit with NamedSharding inputs over a vmapped kernel), "
            "or call a kernel built for the local heads and sequence inside shard_map")

    def __repr__(self):
        return (f"<jcompilemask SplashAttentionKernel {'mqa' if self.is_mqa else 'mha'} "
                f"mask {self.masks.static!r}>")

    # -- call ---------------------------------------------------------------------------
    def __call__(self, q, k, v, segment_ids: Optional[SegmentIds] = None, sinks=None):
        hq, nq, _ = self._check(q, k, v)
        nk = k.shape[-2]
        sq = skv = None
        mode = None
        if segment_ids is not None:
            sq, skv, mode = self._segment_mode(segment_ids, nq, nk)
        if sinks is not None and jnp.shape(sinks) != (hq,):
            raise ValueError(f"sinks must have shape [heads] = ({hq},), got "
                             f"{jnp.shape(sinks)}")
        return self._call(q, k, v, sq, skv, sinks, mode=mode)

    def _segment_mode(self, seg, nq, nk):
        if not (isinstance(seg, tuple) and len(seg) == 2):
            raise TypeError(f"segment_ids must be a SegmentIds(q, kv), got "
                            f"{type(seg).__name__}")
        sq, skv = seg
        if jnp.shape(sq) != (nq,) or jnp.shape(skv) != (nk,):
            raise ValueError(f"segment_ids.q must be [{nq}] and segment_ids.kv [{nk}], got "
                             f"{jnp.shape(sq)} and {jnp.shape(skv)}")
        for name, x in (("segment_ids.q", sq), ("segment_ids.kv", skv)):
            if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
                raise TypeError(f"{name} must be integer, got {jnp.result_type(x)}")
        if not self.masks.structured and (self.exact_segment_ids
                                          or not self.masks.dense_tables):
            return sq, skv, "dense"
        exact, fast = ("dense", "dense_runs") if not self.masks.structured else ("exact", "fast")
        if self.exact_segment_ids:
            return sq, skv, exact
        if _is_tracer(sq) or _is_tracer(skv):
            return sq, skv, fast + "_checked"
        return sq, skv, (fast if _contiguous_np(sq, skv) else exact)

    def _impl(self, q, k, v, sq, skv, sinks, *, mode):
        hq = q.shape[0]
        if self.is_mqa:
            k4, v4 = k[None, :, None, :], v[None, :, None, :]
        else:
            k4, v4 = jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None]
        q4 = jnp.swapaxes(q, 0, 1)[None]
        nq, nk = q4.shape[1], k4.shape[1]
        n = max(nq, nk)
        m = self.masks
        bad_rows = None
        if mode is None:
            mask, metadata = m.static, None
        elif mode == "dense":
            mask = m.dense_segmented
            metadata = {"q_segment_ids": sq[None], "kv_segment_ids": skv[None]}
        elif mode == "exact":
            mask = m.exact
            metadata = {"seg_q": _pad_row(sq, n), "seg_kv": _pad_row(skv, n)}
        elif mode in ("dense_runs", "dense_runs_checked"):
            mask = m.dense_runs
            metadata = {"q_segment_ids": sq[None], "kv_segment_ids": skv[None]}
            if mode == "dense_runs_checked":
                bad_rows = ~segment_runs(jnp.asarray(sq, jnp.int32)[None],
                                         jnp.asarray(skv, jnp.int32)[None])[2][0]
        else:
            lo, hi, ok = (x[0] for x in segment_runs(jnp.asarray(sq, jnp.int32)[None],
                                                     jnp.asarray(skv, jnp.int32)[None]))
            mask = m.fast
            metadata = {"seg_lo": _pad_row(lo, n), "seg_hi": _pad_row(hi, n)}
            if mode == "fast_checked":
                bad_rows = ~ok
        out, lse = mask_attention(q4, k4, v4, mask, metadata=metadata, scale=1.0,
                                  logits_soft_cap=self.attn_logits_soft_cap,
                                  return_residual=True, implementation=self.implementation)
        out = jnp.swapaxes(out[0], 0, 1)                # [H, Nq, Dv]
        lse = jnp.swapaxes(lse[0], 0, 1)                # [H, Nq]
        if sinks is not None:
            s32 = jnp.asarray(sinks).astype(jnp.float32)
            keep = jax.nn.sigmoid(lse - s32[:, None])          # exp(lse) / (exp(lse)+exp(s))
            out = (out.astype(jnp.float32) * keep[..., None]).astype(q.dtype)
            lse = jnp.logaddexp(lse, s32[:, None])
        if bad_rows is not None:
            out = jnp.where(bad_rows[None, :, None], jnp.nan, out).astype(q.dtype)
        assert out.shape[0] == hq
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


# ---------------------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------------------
def _check_block_sizes(block_sizes):
    if block_sizes is None:
        return
    if not all(hasattr(block_sizes, f) for f in ("block_q", "block_kv")):
        raise TypeError(f"block_sizes must be a splash BlockSizes, got "
                        f"{type(block_sizes).__name__}")


def _check_shards(mask_shape, head_shards, q_seq_shards):
    for name, v in (("head_shards", head_shards), ("q_seq_shards", q_seq_shards)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    heads, q_len = mask_shape[0], mask_shape[1]
    if heads % head_shards:
        raise ValueError(f"head_shards={head_shards} must divide the mask's {heads} heads")
    if q_len % q_seq_shards:
        raise ValueError(f"q_seq_shards={q_seq_shards} must divide q_seq_len={q_len}")


def _make(mask, *, is_mqa: bool, block_sizes=None, save_residuals: bool = False,
          mask_value: float = DEFAULT_MASK_VALUE, attn_logits_soft_cap: Optional[float] = None,
          downcast_smem_data: bool = True, head_shards: int = 1, q_seq_shards: int = 1,
          residual_checkpoint_name: Optional[str] = None, interpret: bool = False,
          exact_segment_ids: bool = False, implementation: Optional[str] = None):
    del downcast_smem_data, interpret   # no effect here: see the module docstring
    _check_block_sizes(block_sizes)
    if mask_value is not None and not mask_value <= -1e30:
        raise ValueError(f"mask_value={mask_value!r}: jcompilemask excludes masked keys "
                         "exactly (as -inf); a mask_value that is not very negative would "
                         "change splash's result and is not supported")
    if attn_logits_soft_cap is not None:
        if isinstance(attn_logits_soft_cap, bool) or \
                not isinstance(attn_logits_soft_cap, (int, float, np.integer, np.floating)) \
                or not attn_logits_soft_cap > 0:
            raise ValueError(f"attn_logits_soft_cap must be a positive float, got "
                             f"{attn_logits_soft_cap!r}")
        attn_logits_soft_cap = float(attn_logits_soft_cap)
    shape = getattr(mask, "shape", None)
    if shape is None or len(shape) != 3:
        raise ValueError(f"Unexpected mask shape: {shape} (splash kernels take a "
                         "[heads, q_seq_len, kv_seq_len] mask: a MultiHeadMask or a 3-D "
                         "boolean array)")
    _check_shards(shape, head_shards, q_seq_shards)
    return SplashAttentionKernel(
        _Masks(mask), is_mqa=is_mqa, save_residuals=bool(save_residuals),
        attn_logits_soft_cap=attn_logits_soft_cap,
        residual_checkpoint_name=residual_checkpoint_name,
        exact_segment_ids=bool(exact_segment_ids), implementation=implementation,
        block_sizes=block_sizes)


def make_splash_mha(mask, *, head_shards: int, q_seq_shards: int, **kwargs):
    """Multi-head (and grouped-query) splash attention over ``mask``.

    ``mask``: a :class:`MultiHeadMask` (ours or JAX's) or a boolean array
    [heads, q_seq_len, kv_seq_len] (numpy, or a concrete jax array). Keywords as JAX's
    ``make_splash_mha`` (``block_sizes``, ``save_residuals``, ``mask_value``,
    ``attn_logits_soft_cap``, ``downcast_smem_data``, ``residual_checkpoint_name``,
    ``interpret``), plus ``exact_segment_ids`` and ``implementation``; the module
    docstring says what each does here.

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
