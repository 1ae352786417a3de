"""Hypothesis strategies shared by the tests: built-in masks with random metadata.

Metadata is drawn over the whole declared range, not only the "sensible" part, so the
edge cases the issues name come up: history_end before context_len, a partial last
image row, text + image longer than the sequence, segments of length 1, padding ids,
empty responses (equal consecutive starts), starts before the prompt end or out of order,
q_len != kv_len.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import jcompilemask as jcm

# A few (q_len, kv_len) pairs: a small set keeps the number of XLA compilations bounded.
SIZES = [(8, 8), (13, 13), (16, 16), (7, 11), (12, 5)]
SQUARE_SIZES = [s for s in SIZES if s[0] == s[1]]

BUILTINS = ["causal", "full", "sliding_window", "chunked_causal", "prefix_lm",
            "document", "document_bidir", "hstu", "shared_prompt", "clear"]


def hstu_one_region():
    """HSTU written as one region with row conditions: four conjuncts that share two
    forward-table slots (K 2, as the three-region built-in)."""
    from jcompilemask.spec import MaskSpec, Region, Scalar, k, q, q_len
    a = Scalar("a", max=q_len)
    b = Scalar("b", max=q_len)
    g = Scalar("g", min=1, max=q_len)
    rule = (((q < a) & (k < a)) | ((q >= a) & (q < b) & (k <= q))
            | ((q >= b) & ((k < b) | ((k >= b + (q - b) // g * g) & (k <= q)))))
    return MaskSpec([Region((0, q_len), rule)], name="hstu_one_region")


def _ints(draw, lo, hi, n):
    return np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), np.int32)


@st.composite
def segment_ids(draw, batch, n):
    """Ids from a small alphabet with -1 (padding): runs of every length, including 1,
    and the same id reappearing after another (a new run)."""
    rows = []
    for _ in range(batch):
        mode = draw(st.sampled_from(["random", "runs"]))
        if mode == "random":
            rows.append(draw(st.lists(st.sampled_from([-1, 0, 1, 2, 3]), min_size=n,
                                      max_size=n)))
        else:
            ids, cur = [], 0
            while len(ids) < n:
                run = draw(st.integers(1, max(1, n // 2)))
                v = draw(st.sampled_from([cur, cur + 1, -1, -2]))
                ids += [v] * run
                cur += 1
            rows.append(ids[:n])
    return np.array(rows, np.int32)


@st.composite
def builtin_case(draw, names=None, sizes=None, params=None, batch=(1, 3)):
    """(name, params, spec, metadata, q_len, kv_len) for a random built-in mask.

    ``params`` fixes the constructor arguments (one spec: one compilation under jit).
    """
    name = draw(st.sampled_from(names or BUILTINS))
    nq, nk = draw(st.sampled_from(sizes or SIZES))
    n = max(nq, nk)
    b = draw(st.integers(*batch))
    fixed = params
    params = {}
    md = None
    if name == "causal":
        spec = jcm.masks.causal()
    elif name == "full":
        spec = jcm.masks.full()
    elif name == "sliding_window":
        params = fixed or dict(left=draw(st.integers(0, 5)), right=draw(st.integers(0, 3)),
                               sinks=draw(st.sampled_from([0, 0, 1, 3])))
        spec = jcm.masks.sliding_window(**params)
    elif name == "chunked_causal":
        params = fixed or dict(chunk=draw(st.integers(1, 6)))
        spec = jcm.masks.chunked_causal(**params)
    elif name == "prefix_lm":
        spec = jcm.masks.prefix_lm()
        md = {"prefix_len": _ints(draw, 0, nk, b)}
    elif name in ("document", "document_bidir"):
        spec = jcm.masks.document(causal=(name == "document"))
        md = {"segment_ids": draw(segment_ids(b, n))}
    elif name == "hstu":
        spec = jcm.masks.hstu()
        md = {"context_len": _ints(draw, 0, nq, b), "history_end": _ints(draw, 0, nq, b),
              "group_size": _ints(draw, 1, nq, b)}
        if draw(st.booleans()):   # the paper's layout: a <= b, b = N - g * G
            g = _ints(draw, 1, min(3, nq), b)   # declared [1, q_len]
            cnt = _ints(draw, 0, 3, b)
            md["group_size"] = g
            md["history_end"] = np.maximum(nq - g * cnt, 0).astype(np.int32)
            md["context_len"] = np.minimum(md["context_len"], md["history_end"])
    elif name == "shared_prompt":
        params = fixed or dict(num_responses=draw(st.integers(1, 4)))
        r = params["num_responses"]
        spec = jcm.masks.shared_prompt(r)
        p = _ints(draw, 0, nq, b)
        starts = np.stack([_ints(draw, 0, nq, r) for _ in range(b)])
        mode = draw(st.sampled_from(["sorted", "after_prompt", "raw"]))
        if mode != "raw":
            starts = np.sort(starts, axis=1)
        if mode == "after_prompt":
            starts = np.maximum(starts, p[:, None])
        md = {"prompt_len": p, "response_starts": starts.astype(np.int32)}
    elif name == "clear":
        params = fixed or dict(width=draw(st.integers(1, 5)), radius=draw(st.integers(0, 2)))
        spec = jcm.masks.clear(**params)
        t = _ints(draw, 0, nq, b)
        if draw(st.booleans()):
            img = _ints(draw, 0, nq, b)                      # t + n may pass the end
        else:
            img = np.array([draw(st.integers(0, nq - int(x))) for x in t], np.int32)
        md = {"text_len": t, "image_len": img}
    else:  # pragma: no cover
        raise AssertionError(name)
    return name, params, spec, md, nq, nk
