"""Built-in masks, each a MaskSpec (with the exact metadata names listed per function).

>>> import jcompilemask as jcm
>>> m = jcm.masks.sliding_window(1, 0)
>>> m.as_dense(None, 4)[0, 0].astype(int).tolist()
[[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
"""
from __future__ import annotations

import math

from .spec.expr import Or, TRUE, k, q, q_len, kv_len
from .spec.maskspec import MaskSpec, Region
from .spec.metadata import Scalar, SegmentIds, Vector

__all__ = ["causal", "full", "sliding_window", "dilated_window", "chunked_causal", "prefix_lm",
           "document", "hstu", "shared_prompt", "clear"]


def _nonneg_int(v, what):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what} must be a non-negative int, got {v!r}")
    return v


def causal() -> MaskSpec:
    """Row q sees keys k <= q. No metadata."""
    return MaskSpec([Region((0, q_len), k <= q)], name="causal")


def full() -> MaskSpec:
    """Every row sees every key. No metadata."""
    return MaskSpec([Region((0, q_len), TRUE)], name="full")


def sliding_window(left: int, right: int = 0, sinks: int = 0) -> MaskSpec:
    """Row q sees q - left <= k <= q + right, and the first ``sinks`` keys (attention
    sinks, as in StreamingLLM) as long as k <= q + right. No metadata.

    >>> import jcompilemask as jcm
    >>> jcm.compile(sliding_window(4, sinks=2)).num_intervals   # window + sinks
    2
    >>> sliding_window(1, sinks=1).as_dense(None, 4)[0, 0].astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]]
    """
    left, right = _nonneg_int(left, "left"), _nonneg_int(right, "right")
    sinks = _nonneg_int(sinks, "sinks")
    window = (k >= q - left) & (k <= q + right)
    if sinks == 0:
        return MaskSpec([Region((0, q_len), window)], name=f"sliding_window({left}, {right})")
    return MaskSpec([Region((0, q_len), window | ((k < sinks) & (k <= q + right)))],
                    name=f"sliding_window({left}, {right}, sinks={sinks})")


def dilated_window(left: int, right: int = 0, dilation: int = 2, *,
                   documents: bool = False) -> MaskSpec:
    """Row q sees every ``dilation``-th key of its window: q - left <= k <= q + right and
    (q - k) % dilation == 0 (a dilated sliding window, as in Longformer's dilated heads).
    No metadata, or with ``documents=True`` packed documents: k also in q's run of equal
    ``segment_ids`` (int [B, N]; negative ids are padding and see nothing), as in
    :func:`document`. It runs as ``dilation`` residue classes
    (``jcompilemask.lower.classes``): where the lengths are multiples of ``dilation``, each
    class of ``q % dilation`` runs a plain window ``left // dilation`` keys back and
    ``right // dilation`` ahead (within its documents), the classes as heads, with no
    per-element predicate.

    >>> import jcompilemask as jcm
    >>> dilated_window(4, dilation=2).as_dense(None, 5)[0, 0].astype(int).tolist()
    [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    >>> cm = jcm.compile(dilated_window(128, dilation=2))
    >>> cm.row_classes.factor, str(cm.row_classes.spec.regions[0].visible)
    (2, '(k - q >= -64) & (k - q <= 0)')
    >>> import numpy as np
    >>> ids = np.array([[0, 0, 0, 0, 1, 1, 1, 1]], np.int32)
    >>> d = jcm.compile(dilated_window(4, documents=True)).instantiate({"segment_ids": ids}, 8)
    >>> d.classes, d.per_class        # each class of q % 2 reads its own segment ids
    (2, True)
    >>> d.as_dense()[0, 0, 6].astype(int).tolist()
    [0, 0, 0, 0, 1, 0, 1, 0]
    """
    left, right = _nonneg_int(left, "left"), _nonneg_int(right, "right")
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"dilation must be a positive int, got {dilation!r}")
    if not isinstance(documents, bool):
        raise TypeError(f"documents must be True or False, got {documents!r}")
    rule = (k >= q - left) & (k <= q + right)
    if documents:
        seg = SegmentIds("segment_ids")
        rule = (k >= seg.start(q)) & (k < seg.end(q)) & rule
    if dilation > 1:
        rule = rule & ((q - k) % dilation == 0)
    docs = ", documents=True" if documents else ""
    return MaskSpec([Region((0, q_len), rule)],
                    name=f"dilated_window({left}, {right}, dilation={dilation}{docs})")


def chunked_causal(chunk: int) -> MaskSpec:
    """Causal within consecutive chunks of ``chunk`` tokens. No metadata."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    return MaskSpec([Region((0, q_len), (k >= q // chunk * chunk) & (k <= q))],
                    name=f"chunked_causal({chunk})")


def prefix_lm() -> MaskSpec:
    """Prefix-LM: k < prefix_len (bidirectional prefix) or k <= q.

    Metadata: ``prefix_len`` int [B] in [0, kv_len].
    """
    p = Scalar("prefix_len", max=kv_len)
    return MaskSpec([Region((0, q_len), (k < p) | (k <= q))], name="prefix_lm")


def document(causal: bool = True) -> MaskSpec:
    """Packed documents: q and k in the same run of equal ``segment_ids`` (and k <= q
    when ``causal``); tokens with a negative id are padding and see nothing.

    Metadata: ``segment_ids`` int [B, N], N = max(q_len, kv_len).
    """
    seg = SegmentIds("segment_ids")
    rule = (k >= seg.start(q)) & (k < seg.end(q))
    if causal:
        rule = rule & (k <= q)
    return MaskSpec([Region((0, q_len), rule)], name="document" if causal else "document_bidir")


def hstu() -> MaskSpec:
    """HSTU generative recommendation: context, history, grouped targets (the benchmark
    workload of docs/workloads.md).

    Metadata (int [B] each): ``context_len`` a, ``history_end`` b, ``group_size`` g >= 1.
    Rows < a see k < a; rows in [a, b) see k <= q; rows >= b see k < b or
    b + (q - b) // g * g <= k <= q.
    """
    a = Scalar("context_len", max=q_len)
    b = Scalar("history_end", max=q_len)
    g = Scalar("group_size", min=1, max=q_len)
    return MaskSpec([
        Region((0, a), k < a, name="context"),
        Region((a, b), k <= q, name="history"),
        Region((b, q_len), (k < b) | ((k >= b + (q - b) // g * g) & (k <= q)),
               name="targets"),
    ], name="hstu")


def shared_prompt(num_responses: int) -> MaskSpec:
    """One prompt, several responses (reward models).

    Metadata: ``prompt_len`` int [B]; ``response_starts`` int [B, num_responses].
    Prompt rows [0, prompt_len) are causal; response r spans [starts[r], starts[r + 1])
    (the last one to the sequence end) and sees the prompt and itself causally.
    """
    if isinstance(num_responses, bool) or not isinstance(num_responses, int) or num_responses < 1:
        raise ValueError(f"num_responses must be a positive int, got {num_responses!r}")
    p = Scalar("prompt_len", max=q_len)
    starts = Vector("response_starts", num_responses, max=q_len)
    regions = [Region((0, p), k <= q, name="prompt")]
    for r in range(num_responses):
        end = starts[r + 1] if r + 1 < num_responses else q_len
        regions.append(Region((starts[r], end), (k < p) | ((k >= starts[r]) & (k <= q)),
                              name=f"response{r}"))
    return MaskSpec(regions, name=f"shared_prompt({num_responses})")


def clear(width: int, radius: int = 2) -> MaskSpec:
    """Text followed by a row-major image with a 2-D local window (CLEAR).

    Metadata (int [B] each): ``text_len`` t, ``image_len`` n. Image token p (row q = t + p)
    sits at (y, x) = divmod(p, width); the last image row may be partial; no wrap-around.
    Text rows see every text and image token; image rows see all text and the image
    tokens with dy^2 + dx^2 <= radius^2; rows from t + n on see nothing.

    Written as a union over dy of one key interval per image row, with bounds that are
    non-decreasing in q (so the column view is derived): the row y + dy of query (y, x)
    spans keys [max(q + dy*w - hw, t + (y+dy)*w, t), min(q + dy*w + hw + 1,
    t + (y+dy+1)*w, t + n)) with hw = floor(sqrt(radius^2 - dy^2)).
    """
    w = _nonneg_int(width, "width")
    if w < 1:
        raise ValueError("width must be at least 1")
    r = _nonneg_int(radius, "radius")
    t = Scalar("text_len", max=q_len)
    n = Scalar("image_len", max=q_len)
    y = (q - t) // w
    local = []
    for dy in range(-r, r + 1):
        hw = math.isqrt(r * r - dy * dy)
        local.append((k >= q + dy * w - hw) & (k >= t + (y + dy) * w) & (k >= t)
                     & (k <= q + dy * w + hw) & (k < t + (y + dy + 1) * w) & (k < t + n))
    return MaskSpec([
        Region((0, t), k < t + n, name="text"),
        Region((t, t + n), Or.of(k < t, *local), name="image"),
    ], name=f"clear({w}, {r})")
