"""Host-side helpers shared by the CuTe kernel tests and benchmarks.

Builds forward descriptors (interval tables + packed tile states) straight from
interval tables with numpy, and a float32 reference attention that reads the same
intervals. They exist so that kernel checks do not depend on the MaskSpec pipeline;
the packing matches `jcompilemask.lower.descriptor` (2 bits per tile, 16 tiles per
uint32 word, bit 0 = compute, bit 1 = masked, in-range elements only).
"""

from __future__ import annotations

import numpy as np

TILES_PER_WORD = 16


def visible_rows(intervals_rows: np.ndarray, nk: int) -> np.ndarray:
    """int32 [R, K, 2] (start, length) -> bool [R, nk]: key j visible from row r."""
    j = np.arange(nk, dtype=np.int64)[None, None, :]
    start = intervals_rows[:, :, 0:1].astype(np.int64)
    length = intervals_rows[:, :, 1:2].astype(np.int64)
    # The kernel's check, uint32(j - start) < uint32(length), spelled in int64.
    d = (j - start) & 0xFFFFFFFF
    return np.any(d < (length & 0xFFFFFFFF), axis=1)


def tiles_from_intervals(intervals: np.ndarray, nk: int, block_q: int, block_kv: int) -> np.ndarray:
    """int32 [Bm, Hm, Nq, K, 2] -> uint32 [Bm, Hm, Tq, W] packed forward tile states."""
    bm, hm, nq = intervals.shape[:3]
    tq, tk = -(-nq // block_q), -(-nk // block_kv)
    words = np.zeros((bm, hm, tq, -(-tk // TILES_PER_WORD)), np.uint32)
    pad = tk * block_kv - nk
    for b in range(bm):
        for h in range(hm):
            for ti in range(tq):
                vis = visible_rows(intervals[b, h, ti * block_q:(ti + 1) * block_q], nk)
                vis = np.pad(vis, ((0, 0), (0, pad))).reshape(vis.shape[0], tk, block_kv)
                in_range = np.pad(np.ones((1, nk), bool), ((0, 0), (0, pad))).reshape(1, tk, block_kv)
                compute = vis.any(axis=(0, 2))
                masked = (in_range & ~vis).any(axis=(0, 2))
                state = compute.astype(np.uint32) | (masked.astype(np.uint32) << 1)
                for tj in range(tk):
                    words[b, h, ti, tj // TILES_PER_WORD] |= state[tj] << (2 * (tj % TILES_PER_WORD))
    return words


def causal_intervals(nq: int) -> np.ndarray:
    """[1, 1, nq, 1, 2]: row i sees keys [0, i]."""
    i = np.arange(nq, dtype=np.int32)
    return np.stack([np.zeros_like(i), i + 1], axis=-1)[None, None, :, None, :]


def causal_visible_pairs(n: int) -> int:
    return n * (n + 1) // 2


def check_case_intervals(name, rng, B, Nq, Nk, H):
    """(intervals [Bm, Hm, Nq, K, 2], description) for one named check case."""
    i = np.arange(Nq, dtype=np.int64)
    if name == "causal":
        return causal_intervals(Nq), "row i sees [0, i]"
    if name == "document":
        iv = np.zeros((B, 1, Nq, 1, 2), np.int32)
        for b in range(B):
            cuts = np.sort(rng.choice(np.arange(1, Nq), size=5, replace=False))
            bounds = np.concatenate([[0], cuts, [Nq]])
            doc = np.searchsorted(bounds, i, side="right") - 1
            s = bounds[doc]
            iv[b, 0, :, 0, 0] = s
            iv[b, 0, :, 0, 1] = i - s + 1
        return iv, "packed documents, causal inside each (per-batch intervals)"
    if name == "prefix_window":
        P = 100
        iv = np.zeros((1, H, Nq, 2, 2), np.int32)
        for h in range(H):
            W = 64 * (h + 1) + 7
            iv[0, h, :, 0, 0] = 0
            iv[0, h, :, 0, 1] = np.minimum(P, i + 1)
            lo = np.maximum(P, i - W + 1)
            iv[0, h, :, 1, 0] = lo
            iv[0, h, :, 1, 1] = np.maximum(i + 1 - lo, 0)
        return iv, "prefix 100 + per-head sliding window (K=2, Hm=H)"
    if name.startswith("random"):
        # random3, random6, ...: K random intervals per row.
        K = int(name[len("random"):])
        iv = np.zeros((B, H, Nq, K, 2), np.int32)
        iv[..., 0] = rng.integers(-50, Nk + 10, size=(B, H, Nq, K))
        iv[..., 1] = rng.integers(0, 400, size=(B, H, Nq, K)) * (rng.random((B, H, Nq, K)) < 0.8)
        empty = rng.random((B, H, Nq)) < 0.1
        iv[..., 1] *= ~empty[..., None]
        iv[0, 0, :37, :, 1] = 0  # a whole run of empty rows
        return iv, f"{K} random intervals per row, ragged Nq/Nk, ~10% fully masked rows"
    raise ValueError(name)


def dense_mask(intervals: np.ndarray, nk: int) -> np.ndarray:
    """int32 [Bm, Hm, Nq, K, 2] -> bool [Bm, Hm, Nq, nk], the kernel's visibility test."""
    bm, hm, nq = intervals.shape[:3]
    vis = visible_rows(intervals.reshape(bm * hm * nq, *intervals.shape[3:]), nk)
    return vis.reshape(bm, hm, nq, nk)


def reference_attention(q, k, v, intervals, scale, softcap=None):
    """float32 attention with the mask read from the interval table (jax.numpy).

    Returns o [B, Nq, Hq, Dv] and lse [B, Hq, Nq]; a row with no visible key gives
    o = 0 and lse = -inf. `softcap`: logits = cap * tanh(scale * q.k / cap), before the mask.
    """
    import jax
    import jax.numpy as jnp

    B, Nq, Hq, _ = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    iv = jnp.asarray(intervals)
    j = jnp.arange(Nk, dtype=jnp.int32)
    d = (j[None, None, None, None, :] - iv[..., 0:1]).astype(jnp.uint32)
    vis = jnp.any(d < iv[..., 1:2].astype(jnp.uint32), axis=3)  # [Bm, Hm, Nq, Nk]
    vis = jnp.broadcast_to(vis, (B, Hq, Nq, Nk))
    kr = jnp.repeat(k.astype(jnp.float32), Hq // Hkv, axis=2)
    vr = jnp.repeat(v.astype(jnp.float32), Hq // Hkv, axis=2)
    hp = jax.lax.Precision.HIGHEST      # not TF32: XLA's default f32 dot on a GPU may be
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr, precision=hp) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)     # a NaN / +inf max propagates
    p = jnp.exp(s - m_safe)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l == 0, 1.0, l), vr, precision=hp)
    lse = jnp.where(l[..., 0] == 0, -jnp.inf, jnp.log(jnp.where(l[..., 0] == 0, 1.0, l[..., 0])) + m_safe[..., 0])
    return o, lse
