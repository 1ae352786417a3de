"""Splash masks -> jcompilemask masks.

Both this package's mask classes and JAX's own
(``jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask``) are accepted
unchanged. The conversion keeps structure where it can, so the mask lowers to intervals:

=====================================  ==================================================
splash mask                            jcompilemask rule (``q`` row, ``k`` key)
=====================================  ==================================================
``FullMask``                           ``True``
``CausalMask(offset=o)``               ``k <= q + o``
``LocalMask((l, r), offset=o)``        ``(k >= q + o - l) & (k <= q + o + r)`` (a None
                                       side is dropped)
``ChunkedCausalMask(c)``               ``(k >= q // c * c) & (k <= q)``
``LogicalAnd`` / ``LogicalOr``         ``&`` / ``|`` of the two rules
``NumpyMask``, other ``Mask`` classes  no rule: the dense array goes to
                                       :func:`jcompilemask.from_dense`
``MultiHeadMask``                      heads with equal rules are grouped; groups are
                                       selected by contiguous ranges of ``h``
                                       (``MaskSpec(num_heads=H)``); one group -> a
                                       1-head spec that broadcasts
=====================================  ==================================================

A And/Or with an unstructured side, a MultiHeadMask with an unstructured head, or a spec
that would not lower to intervals (too wide a DNF) becomes dense (``from_dense`` of
``mask[:, :, :]``; heads that are all equal give one mask head). Exactness is the rule:
every conversion's dense view equals the splash mask's ``mask[...]``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ..lower.compiled import compile as _compile
from ..lower.dense import DenseMask, from_dense
from ..spec.expr import TRUE, And, Or, Pred, h, k, q, q_len
from ..spec.maskspec import MaskSpec, Region
from . import masks as _ours

__all__ = ["to_jcm", "rule_of", "head_groups", "HeadGroup", "jax_mask_module"]

_KINDS = ("FullMask", "CausalMask", "LocalMask", "ChunkedCausalMask", "NumpyMask",
          "MultiHeadMask", "LogicalAnd", "LogicalOr")


def jax_mask_module():
    """JAX's splash mask module, or None where it does not import."""
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: PLC0415
            splash_attention_mask as m)
    except Exception:   # noqa: BLE001 - any import problem means "not available"
        return None
    return m


def _kind(mask) -> Optional[str]:
    """The class name when ``mask`` is exactly one of the known splash classes (ours or
    JAX's; subclasses may override the mask function, so they count as unknown)."""
    name = type(mask).__name__
    if name not in _KINDS:
        return None
    if type(mask) is getattr(_ours, name):
        return name
    jm = jax_mask_module()
    if jm is not None and type(mask) is getattr(jm, name, None):
        return name
    return None


def _plain_q_sequence(mask) -> bool:
    # JAX's computable masks carry the q indices they evaluate; only arange is structural.
    qs = getattr(mask, "q_sequence", None)
    return qs is None or np.array_equal(np.asarray(qs), np.arange(mask.shape[0]))


def rule_of(mask) -> Optional[Pred]:
    """The visibility rule of a 2-D splash mask over ``q`` and ``k``, or None when it has
    no structure we can express (dense masks, unknown classes).

    >>> from jcompilemask.splash import CausalMask, LocalMask
    >>> print(rule_of(CausalMask((8, 8), offset=2) & LocalMask((8, 8), (3, None), 0)))
    (k <= q + 2) & (k >= q - 3)
    """
    kind = _kind(mask)
    if kind in ("LogicalAnd", "LogicalOr"):
        a, b = rule_of(mask.left), rule_of(mask.right)
        if a is None or b is None:
            return None
        return (a & b) if kind == "LogicalAnd" else (a | b)
    if kind in ("CausalMask", "LocalMask", "ChunkedCausalMask") and \
            not _plain_q_sequence(mask):
        return None
    if kind == "FullMask":
        return TRUE
    if kind == "CausalMask":
        return k <= q + int(mask.offset)
    if kind == "LocalMask":
        left, right = mask.window_size
        o = int(mask.offset)
        parts = []
        if left is not None:
            parts.append(k >= q + (o - int(left)))
        if right is not None:
            parts.append(k <= q + (o + int(right)))
        return And.of(*parts)
    if kind == "ChunkedCausalMask":
        c = int(mask.chunk_size)
        return (k >= q // c * c) & (k <= q)
    return None


@dataclasses.dataclass(frozen=True)
class HeadGroup:
    """Heads ``heads`` share one 2-D mask: its ``rule`` (or None) and its dense array."""

    heads: tuple[int, ...]
    rule: Optional[Pred]
    dense: np.ndarray      # bool [q_seq_len, kv_seq_len]


def _dense2(mask) -> np.ndarray:
    arr = np.asarray(mask[:, :])
    if arr.dtype != np.bool_:
        arr = arr.astype(np.bool_)
    return arr


def _heads_of(mask) -> tuple[list, int]:
    """(per-head 2-D masks or arrays, H); H = 0 for a plain 2-D mask."""
    if isinstance(mask, np.ndarray) or _is_concrete_jax_array(mask):
        arr = np.asarray(mask)
        if arr.dtype != np.bool_:
            raise ValueError(f"a dense splash mask must be boolean, got {arr.dtype}")
        if arr.ndim == 2:
            return [arr], 0
        if arr.ndim == 3:
            return list(arr), arr.shape[0]
        raise ValueError(f"a dense splash mask is [heads, q_seq_len, kv_seq_len], got shape "
                         f"{arr.shape}")
    if _is_tracer(mask):
        raise NotImplementedError(
            "a traced (dynamic) mask array is not supported: jcompilemask compiles the mask "
            "before the call. Pass a static numpy mask or splash Mask objects; per-example "
            "structure (packing) goes in segment_ids")
    if _kind(mask) == "MultiHeadMask" or (isinstance(getattr(mask, "masks", None),
                                                     (tuple, list))
                                         and len(getattr(mask, "shape", ())) == 3):
        return list(mask.masks), len(mask.masks)
    shape = tuple(getattr(mask, "shape", ()))
    if len(shape) == 2 and hasattr(mask, "__getitem__"):
        return [mask], 0
    if len(shape) == 3 and hasattr(mask, "__getitem__"):
        return [np.asarray(mask[i, :, :]) for i in range(shape[0])], shape[0]
    raise TypeError(f"not a splash mask: {type(mask).__name__} (expected a splash Mask, a "
                    "MultiHeadMask, or a boolean numpy array [heads, q_seq_len, kv_seq_len])")


def _is_tracer(x) -> bool:
    import jax
    return isinstance(x, jax.core.Tracer)


def _is_concrete_jax_array(x) -> bool:
    import jax
    return isinstance(x, jax.Array) and not _is_tracer(x)


def head_groups(mask) -> tuple[list[HeadGroup], int, tuple[int, int]]:
    """Group the heads of a splash mask by equal masks: (groups, H, (Nq, Nk)).

    ``H`` is 0 for a 2-D mask (one group that applies to every head).
    """
    per_head, n_heads = _heads_of(mask)
    groups: list[list] = []        # [heads, rule, dense]
    for i, m in enumerate(per_head):
        rule = None if isinstance(m, np.ndarray) else rule_of(m)
        dense = m if isinstance(m, np.ndarray) else _dense2(m)
        for g in groups:
            same = (g[1].key() == rule.key()) if (rule is not None and g[1] is not None) \
                else np.array_equal(g[2], dense)
            if same:
                g[0].append(i)
                break
        else:
            groups.append([[i], rule, dense])
    shape = tuple(int(n) for n in per_head[0].shape)
    return [HeadGroup(tuple(g[0]), g[1], g[2]) for g in groups], n_heads, shape


def head_condition(heads: tuple[int, ...]) -> Pred:
    """``h`` in ``heads``, as a union of contiguous ranges ``(h >= a) & (h < b)``."""
    parts, start, prev = [], heads[0], heads[0]
    for x in list(heads[1:]) + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append((h >= start) & (h < prev + 1) if prev > start else h == start)
        if x is not None:
            start = prev = x
    return Or.of(*parts)


def spec_from_groups(groups: list[HeadGroup], n_heads: int, extra: Pred = TRUE,
                     name: str = "splash", dense_rule=None) -> Optional[MaskSpec]:
    """One MaskSpec from head groups (each rule AND ``extra``); None if a group has no rule
    and ``dense_rule`` (group index -> Pred) does not supply one."""
    rules = []
    for i, g in enumerate(groups):
        r = g.rule if g.rule is not None else (dense_rule(i) if dense_rule else None)
        if r is None:
            return None
        rules.append(r & extra)
    if len(groups) == 1:
        return MaskSpec([Region((0, q_len), rules[0])], name=name)
    rule = Or.of(*[head_condition(g.heads) & r for g, r in zip(groups, rules)])
    return MaskSpec([Region((0, q_len), rule)], num_heads=n_heads, name=name)


def _dense_all(groups, n_heads, shape):
    if len(groups) == 1:
        return groups[0].dense[None]
    out = np.zeros((n_heads,) + shape, np.bool_)
    for g in groups:
        out[list(g.heads)] = g.dense
    return out


def to_jcm(mask, name: str = "splash"):
    """A splash mask (ours or JAX's, 2-D or multi-head, or a boolean numpy array) as a
    :class:`~jcompilemask.MaskSpec` when its structure allows, else a
    :func:`~jcompilemask.from_dense` mask. Either is accepted by
    :func:`jcompilemask.mask_attention` and :func:`jcompilemask.compile`.

    >>> import jcompilemask as jcm
    >>> from jcompilemask.splash import CausalMask, MultiHeadMask, LocalMask
    >>> m = MultiHeadMask([CausalMask((8, 8)), CausalMask((8, 8)), LocalMask((8, 8), (2, 2), 0)])
    >>> spec = to_jcm(m)
    >>> spec.mask_heads, jcm.compile(spec).fallback_regions
    (3, ())
    """
    groups, n_heads, shape = head_groups(mask)
    spec = spec_from_groups(groups, n_heads, name=name)
    if spec is not None and not _compile(spec, warn=False).fallback_regions:
        return spec
    return from_dense(_dense_all(groups, n_heads, shape), name=name)


def dense_view(converted, shape) -> np.ndarray:
    """bool [Hm, Nq, Nk] of a converted mask (MaskSpec oracle or the DenseMask array)."""
    if isinstance(converted, DenseMask):
        return np.asarray(converted.array)
    return np.asarray(converted.as_dense(None, shape[0], shape[1])[0])
