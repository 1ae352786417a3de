"""The paper's workloads (docs/workloads.md), shared by every benchmark script.

N = sequence length; batch = 131072 // N sequences; 8 heads; head dim 128; bf16.
Metadata is sampled per sequence with a fixed seed, so every implementation in a run (and
across runs) sees the same masks.
"""
from __future__ import annotations

import functools
import math

import numpy as np

import jcompilemask as jcm

MASKS = ("causal", "hstu", "shared_prompt", "clear")
# Issue 16's masks (benchmarks/results/h200-masks.json): one block-causal mask in its natural
# spelling (k // 64 <= q // 64) and its interval spelling, a dilated causal window (128
# wide, dilation 2: a residual predicate), 16 global tokens + a 256-wide causal window.
MASKS_16 = ("block_causal", "block_causal_intervals", "dilated_window", "global_window")
# A probe, not a workload: the dilated window in residue-class coordinates. Rows and keys
# of one class (q % DILATION == k % DILATION) see each other through a plain causal window
# WINDOW // DILATION wide, so at N // DILATION (and DILATION times the batch, the same
# work) it times what the dilated window at N would cost with its classes as heads.
PROBES = ("dilated_classes",)
# Residue classes with per-class metadata: packed documents (sorted segment ids, DOCS_MIN to
# DOCS_MAX documents a sequence, no padding) under the dilated window; each class of q % 2
# reads its own segment ids (lower/classes.py).
MASKS_CLASSES = ("dilated_documents",)
DOCS_MIN, DOCS_MAX = 2, 8
# Fixed masks given as dense arrays (jcm.from_dense), as a user porting a numpy mask would
# write them: causal, a GLOBAL_WINDOW-wide window and DENSE_GLOBALS scattered global keys
# (up to DENSE_GLOBALS + 1 runs per row, 1 per column). "dense_globals" takes from_dense's
# default layout (interval tables where the CuTe kernels run), "dense_globals_bitmap" the
# bitmap (the xla backend's form, which every mask of more than 8 runs per row got before).
MASKS_DENSE = ("dense_globals", "dense_globals_bitmap")
DENSE_GLOBALS = 24
# Packed causal documents (dilated_documents' segment ids) two ways: "documents" as the
# MaskSpec jcm.masks.document() with the ids as metadata, "documents_traced" as the boolean
# array a jax.nn user builds inside the step (ids equal & causal), whose runs
# mask_attention finds at run time (jcm.runtime_dense). Their difference is the price of
# passing a dense mask.
MASKS_RUNTIME = ("documents", "documents_traced")
BLOCK, WINDOW, DILATION, GLOBALS, GLOBAL_WINDOW = 64, 128, 2, 16, 256
HEADS, HEAD_DIM, TOKENS = 8, 128, 131072
CLEAR_PAD = 384
NUM_RESPONSES = 6


def batch_for(n: int) -> int:
    return max(1, TOKENS // n)


def seq_len(mask: str, n: int) -> int:
    """Tensor length of one sequence (clear pads the image of n tokens by the text)."""
    return n + CLEAR_PAD if mask == "clear" else n


def clear_width(n: int) -> int:
    return 2 ** math.ceil(math.log2(math.sqrt(n)))


@functools.lru_cache(maxsize=4)
def dense_globals_array(n: int) -> np.ndarray:
    """bool [n, n] of the dense_globals workload (fixed global positions, seed 16)."""
    glob = np.zeros(n, bool)
    glob[np.random.default_rng(16).choice(n, min(DENSE_GLOBALS, n), replace=False)] = True
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    return (ki <= qi) & ((ki > qi - GLOBAL_WINDOW) | glob[None, :])


@functools.lru_cache(maxsize=4)
def _dense_mask(mask: str, n: int):
    layout = "bitmap" if mask.endswith("_bitmap") else "auto"
    return jcm.from_dense(dense_globals_array(n), name=mask, layout=layout)


def spec_for(mask: str, n: int):
    if mask in MASKS_DENSE:
        return _dense_mask(mask, n)
    if mask == "causal":
        return jcm.masks.causal()
    if mask == "hstu":
        return jcm.masks.hstu()
    if mask == "shared_prompt":
        return jcm.masks.shared_prompt(NUM_RESPONSES)
    if mask == "clear":
        return jcm.masks.clear(clear_width(n), 2)
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    if mask == "block_causal":
        return MaskSpec([Region((0, q_len), k // BLOCK <= q // BLOCK)], name=mask)
    if mask == "block_causal_intervals":
        return MaskSpec([Region((0, q_len), k < (q // BLOCK + 1) * BLOCK)], name=mask)
    if mask == "dilated_window":
        return MaskSpec([Region((0, q_len), (k <= q) & (k > q - WINDOW) & ((q - k) % DILATION == 0))],
                        name=mask)
    if mask == "global_window":
        return MaskSpec([Region((0, q_len), (k <= q) & ((k < GLOBALS) | (k > q - GLOBAL_WINDOW)))],
                        name=mask)
    if mask == "dilated_classes":
        return MaskSpec([Region((0, q_len), (k <= q) & (k > q - WINDOW // DILATION))], name=mask)
    if mask == "dilated_documents":
        return jcm.masks.dilated_window(WINDOW - 1, 0, DILATION, documents=True)
    if mask in MASKS_RUNTIME:
        return jcm.masks.document()
    raise ValueError(mask)


def metadata_for(mask: str, n: int, batch: int | None = None, seed: int = 0):
    """numpy metadata of docs/workloads.md (None for causal)."""
    b = batch_for(n) if batch is None else batch
    rng = np.random.default_rng(seed + n)
    if mask == "causal" or mask in MASKS_16 or mask in PROBES or mask in MASKS_DENSE:
        return None
    if mask == "hstu":
        a = rng.integers(n // 4, n // 2 + 1, b)
        g = rng.integers(3, 9, b)
        groups = rng.integers(3, 9, b)
        return {"context_len": a.astype(np.int32), "history_end": (n - g * groups).astype(np.int32),
                "group_size": g.astype(np.int32)}
    if mask == "shared_prompt":
        lens = rng.integers(n // 16, n // 11 + 1, (b, NUM_RESPONSES))
        prompt = n - lens.sum(1)
        starts = prompt[:, None] + np.concatenate(
            [np.zeros((b, 1), np.int64), np.cumsum(lens, 1)[:, :-1]], 1)
        return {"prompt_len": prompt.astype(np.int32), "response_starts": starts.astype(np.int32)}
    if mask == "clear":
        t = rng.integers(128, 385, b)
        return {"text_len": t.astype(np.int32), "image_len": np.full(b, n, np.int32)}
    if mask == "dilated_documents" or mask in MASKS_RUNTIME:
        ids = np.zeros((b, n), np.int32)
        for i in range(b):
            cuts = np.sort(rng.choice(np.arange(1, n), rng.integers(DOCS_MIN, DOCS_MAX + 1) - 1,
                                      replace=False))
            ids[i] = np.searchsorted(cuts, np.arange(n), side="right")
        return {"segment_ids": ids}
    raise ValueError(mask)


def descriptor_pairs(desc) -> int:
    """Visible pairs of one descriptor's batch (a residue-class descriptor: its classes'
    pairs, each class running the inner descriptor's mask, or with per-class metadata its
    own: the inner descriptor's mask heads)."""
    classes = getattr(desc, "classes", 1)
    inner = getattr(desc, "inner", desc)
    if getattr(desc, "per_class", False):
        iv = inner.fwd_intervals
        return sum(visible_pairs(iv[:, r:r + 1]) for r in range(classes))
    return visible_pairs(inner.fwd_intervals) * classes


def visible_pairs(fwd_intervals) -> int:
    """Visible (query, key) pairs summed over the batch, from a descriptor's forward table
    [B, Hm, Nq, K, 2] (the union per row: intervals may overlap)."""
    iv = np.asarray(fwd_intervals)[:, 0].reshape(-1, fwd_intervals.shape[3], 2).astype(np.int64)
    lo = np.where(iv[..., 1] > 0, iv[..., 0], np.iinfo(np.int64).max)
    hi = np.where(iv[..., 1] > 0, iv[..., 0] + iv[..., 1], np.iinfo(np.int64).max)
    order = np.argsort(lo, axis=1)
    lo = np.take_along_axis(lo, order, 1)
    hi = np.take_along_axis(hi, order, 1)
    total = 0
    cur_lo = lo[:, 0].copy()
    cur_hi = hi[:, 0].copy()
    for m in range(1, lo.shape[1]):
        new = lo[:, m] > cur_hi
        done = new & (cur_lo < np.iinfo(np.int64).max)
        total += int(np.sum(np.where(done, cur_hi - cur_lo, 0)))
        cur_lo = np.where(new, lo[:, m], cur_lo)
        cur_hi = np.where(new, hi[:, m], np.maximum(cur_hi, hi[:, m]))
    live = cur_lo < np.iinfo(np.int64).max
    total += int(np.sum(np.where(live, cur_hi - cur_lo, 0)))
    return total


def tflops(pairs: int, ms: float, passes: float = 1.0) -> float:
    """docs/workloads.md: forward FLOPs = 4 * head_dim * heads * pairs (backward = 2.5x)."""
    return passes * 4 * HEAD_DIM * HEADS * pairs / (ms * 1e-3) / 1e12


def torch_compile_fresh(torch, fn):
    """``torch.compile(fn)`` for one benchmark configuration, with dynamo's caches reset.

    Each (mask, N) configuration is new to dynamo (other batch, length, metadata tensors);
    past its recompile limit (8) dynamo silently runs the function *eagerly* — FlexAttention
    then materialises the dense scores and a 2K run reads ~65 ms instead of ~1 ms. The
    limits are lifted and the caches dropped so every configuration gets its compiled
    kernel, and a hit limit raises instead of timing the eager path."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 4096)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    torch._dynamo.reset()
    return torch.compile(fn)


def eager_block_mask(choice: str, mask: str, n: int) -> bool:
    """Whether ``--flex-eager-block-mask``'s ``choice`` (comma-separated ``MASK`` or
    ``MASK@N``) names this workload: its FlexAttention block mask is then built by an
    uncompiled ``create_block_mask`` (CLEAR at 8K: the compiled build outlasts a device call).

    >>> eager_block_mask("clear@8192", "clear", 8192), eager_block_mask("clear@8192", "clear", 2048)
    (True, False)
    """
    names = {x.strip() for x in choice.split(",") if x.strip()}
    return mask in names or f"{mask}@{n}" in names


def torch_mask_mods(mask, n, md, torch, dev):
    """(the attention's mask_mod, ``create_block_mask``'s): one function, except CLEAR's
    block-mask one, which reads its width from a tensor (``torch_mask_mod``)."""
    mm = torch_mask_mod(mask, n, md, torch, dev)
    return mm, (torch_mask_mod(mask, n, md, torch, dev, block_mask=True)
                if mask == "clear" else mm)


def torch_mask_mod(mask, n, md, torch, dev, block_mask=False):
    """FlexAttention mask_mod of a workload (per-sequence metadata as device tensors).
    Every length is read from a tensor, never closed over as a Python int: torch.compile
    turns such ints into symbols once it sees a second N, which breaks vmap'd adds.
    CLEAR's image width is a constant in the attention kernel's mask_mod (a power of two:
    its // and % become shifts, as a user would write it); ``block_mask=True`` gives the
    same mask with the width read from a tensor, for ``create_block_mask``: with the
    constant 128 (N = 8192), ptxas ran > 150 s on its Triton kernel and never finished
    in a device call (H200, 2026-12-02)."""
    if mask == "causal":
        return lambda b, h, q, k: q >= k
    if mask in ("block_causal", "block_causal_intervals"):
        return lambda b, h, q, k: k // BLOCK <= q // BLOCK
    if mask == "dilated_window":
        return lambda b, h, q, k: (k <= q) & (k > q - WINDOW) & ((q - k) % DILATION == 0)
    if mask == "global_window":
        return lambda b, h, q, k: (k <= q) & ((k < GLOBALS) | (k > q - GLOBAL_WINDOW))
    if mask == "dilated_classes":
        return lambda b, h, q, k: (k <= q) & (k > q - WINDOW // DILATION)
    t = {k_: torch.as_tensor(v, device=dev) for k_, v in md.items()}
    if mask == "dilated_documents":
        doc = t["segment_ids"]
        return lambda b, h, q, k: ((k <= q) & (k > q - WINDOW) & ((q - k) % DILATION == 0)
                                   & (doc[b, q] == doc[b, k]))
    if mask == "hstu":
        a, e, g = t["context_len"], t["history_end"], t["group_size"]

        def mm(b, h, q, k):
            s = e[b] + (q - e[b]) // g[b] * g[b]
            tgt = (k < e[b]) | ((k >= s) & (k <= q))
            return torch.where(q < a[b], k < a[b], torch.where(q < e[b], k <= q, tgt))
        return mm
    if mask == "shared_prompt":
        p = t["prompt_len"]
        starts = md["response_starts"]
        bsz = starts.shape[0]
        start_of = np.zeros((bsz, n), np.int32)
        for i in range(bsz):
            for r in range(starts.shape[1]):
                start_of[i, starts[i, r]:] = starts[i, r]
        so = torch.as_tensor(start_of, device=dev)

        def mm(b, h, q, k):
            resp = (k < p[b]) | ((k >= so[b, q]) & (k <= q))
            return torch.where(q < p[b], k <= q, resp)
        return mm
    if mask == "clear":
        tl, il = t["text_len"], t["image_len"]
        w = torch.as_tensor(clear_width(n), device=dev) if block_mask else clear_width(n)

        def mm(b, h, q, k):
            tt, nn = tl[b], il[b]
            pq, pk = q - tt, k - tt
            dy, dx = pq // w - pk // w, pq % w - pk % w
            local = (k >= tt) & (k < tt + nn) & (dy * dy + dx * dx <= 4)
            img = (k < tt) | local
            # padding rows see only themselves: the torch kernels cannot take empty rows
            return torch.where(q < tt, k < tt + nn,
                               torch.where(q < tt + nn, img, k == q))
        return mm
    raise ValueError(mask)
