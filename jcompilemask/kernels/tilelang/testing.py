"""Cases shared by the TileLang preprocess tests (CPU codegen and GPU): built-in masks, random lowered
MaskSpecs, and a metadata sampler driven by the spec's declarations."""
from __future__ import annotations

import numpy as np

import jcompilemask as jcm
from jcompilemask.spec import MaskSpec, Region
from jcompilemask.spec.expr import TRUE, And, Or, h, k, maximum, minimum, q, q_len
from jcompilemask.spec.metadata import Scalar, SegmentIds, Vector
from jcompilemask.spec.maskspec import _eval_static

FIELDS = ("fwd_intervals", "bwd_intervals", "fwd_tiles", "bwd_tiles", "row_region",
          "bwd_exact")


def builtin_masks():
    m = jcm.masks
    return {
        "causal": m.causal(), "full": m.full(), "sliding_window": m.sliding_window(5, 2),
        "chunked_causal": m.chunked_causal(7), "prefix_lm": m.prefix_lm(),
        "document": m.document(), "document_bidir": m.document(causal=False),
        "hstu": m.hstu(), "shared_prompt": m.shared_prompt(3), "clear": m.clear(6, 2),
    }


def sample_metadata(spec, batch, q_len, kv_len, rng, *, ordered=True):
    """Random metadata inside the declared ranges (scalars, sorted vectors, segment ids).

    ``ordered`` sorts the scalars of a spec into a plausible layout for the built-ins
    (hstu's context <= history end, clear's text + image <= length); the rest stays
    random, so run-time overlaps and nested regions still occur.
    """
    if not spec.metadata:
        return None
    lens = {"q_len": q_len, "kv_len": kv_len}
    out = {}
    for name, d in spec.metadata.items():
        if d.kind == "tokens":
            n = max(q_len, kv_len)
            ids = np.cumsum(rng.random((batch, n)) < 0.15, axis=1).astype(np.int32)
            if d.contiguous:            # each id one run: padding only at the end
                ids[np.arange(n)[None, :] >= rng.integers(n // 2, n + 1, (batch, 1))] = -1
            else:
                ids[rng.random((batch, n)) < 0.05] = -1
            out[name] = ids
            continue
        lo = _eval_static(d.min, lens) if d.min is not None else 0
        hi = _eval_static(d.max, lens) if d.max is not None else max(q_len, kv_len)
        shape = (batch,) if d.kind == "scalar" else (batch, d.size)
        v = rng.integers(lo, hi + 1, shape).astype(np.int32)
        if d.kind == "vector" and ordered:
            v = np.sort(v, axis=1)
        out[name] = v
    if ordered and spec.name == "hstu":
        a = rng.integers(0, q_len // 2 + 1, batch)
        g = rng.integers(1, 5, batch)
        b = np.maximum(a, q_len - g * rng.integers(1, 4, batch))
        out.update(context_len=a.astype(np.int32), history_end=b.astype(np.int32),
                   group_size=g.astype(np.int32))
    if ordered and spec.name and spec.name.startswith("clear"):
        t = rng.integers(0, q_len // 3 + 1, batch)
        out.update(text_len=t.astype(np.int32),
                   image_len=rng.integers(0, q_len - t + 1).astype(np.int32))
    if ordered and spec.name and spec.name.startswith("shared_prompt"):
        p = rng.integers(0, q_len // 2 + 1, batch)
        r = out["response_starts"]
        out["response_starts"] = np.sort(np.clip(r, p[:, None], q_len), axis=1).astype(np.int32)
        out["prompt_len"] = p.astype(np.int32)
    return out


# -- random lowered MaskSpecs -------------------------------------------------------------
def _rand_bound(rng, a, b, g):
    """A lower or upper key bound, non-decreasing in q (so the column view exists)."""
    c = int(rng.integers(-4, 5))
    if rng.random() < 0.04:
        return q % 4 + a      # not monotone: the spec gets no column view (Kc = 0)
    choice = rng.integers(0, 7)
    if choice == 0:
        return q + c
    if choice == 1:
        return a + c
    if choice == 2:
        return (q // 3) * 3 + c
    if choice == 3:
        return b + (q - b) // g * g
    if choice == 4:
        return maximum(q - 5, a)
    if choice == 5:
        return minimum(q + 2, b + 3)
    return 2 * q - a


def random_spec(seed: int) -> MaskSpec:
    rng = np.random.default_rng(seed)
    a = Scalar("a", max=q_len)
    b = Scalar("b", max=q_len)
    g = Scalar("g", min=1, max=q_len)
    vec = Vector("v", 2, max=q_len)
    heads = bool(rng.random() < 0.25)
    nreg = int(rng.integers(1, 4))
    cuts = [0, a, b, vec[1]][:nreg] + [q_len]
    regions = []
    for r in range(nreg):
        terms = []
        for _ in range(int(rng.integers(1, 4))):
            lo, hi = _rand_bound(rng, a, b, g), _rand_bound(rng, a, b, g)
            conj = [k >= lo, k <= hi]
            if rng.random() < 0.3:
                conj.append(k < vec[0] + q_len // 2)
            if rng.random() < 0.2:
                conj.append(q >= a)           # a q-linear row condition
            if rng.random() < 0.2:
                conj.append(b >= 2)           # a q-free row condition
            if heads and rng.random() < 0.5:
                conj.append(k >= h * 2)
            terms.append(And.of(*conj))
        regions.append(Region((cuts[r], cuts[r + 1]), Or.of(*terms)))
    return MaskSpec(regions, num_heads=2 if heads else None, name=f"random{seed}",
                    metadata=[a, b, g, vec])


def random_specs(n=20, start=0):
    out, seed = [], start
    while len(out) < n:
        spec = random_spec(seed)
        seed += 1
        cm = jcm.compile(spec)
        from .codegen import unsupported_reason
        if unsupported_reason(cm):        # residual predicates
            continue
        out.append(spec)
    return out


def descriptors_equal(ref, got):
    """[] when every field is equal (shape, dtype, bits), else the differing fields."""
    bad = []
    for f in FIELDS:
        x, y = np.asarray(getattr(ref, f)), np.asarray(getattr(got, f))
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
            bad.append(f"{f}: ref {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
                       + ("" if x.shape != y.shape else
                          f", {int(np.sum(x != y))} differ"))
    return bad


def warm_all(workers=None):
    """Compile every test program (GPU test tiles) into the disk cache."""
    from ...lower.descriptor import TileConfig
    from .api import warm_cache
    tiles = TileConfig(64, 64, 32, 64)
    cms = [jcm.compile(s) for s in list(builtin_masks().values()) + random_specs(20)]
    return warm_cache([(cm, tiles) for cm in cms], workers=workers)
