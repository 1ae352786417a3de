"""Preprocess benchmark (both descriptors): TileLang kernel vs the jnp twin (JAX, GPU) vs
FlexAttention's create_block_mask (torch.compile'd), docs/workloads.md.

    PYTHONPATH=. python3 benchmarks/bench_preprocess.py [--ns 1024,...,32768]
        [--impls jcm-tilelang,jcm-jnp,flex-create-block-mask] [--out PATH]

N = 1K ... 32K, batch = 131072 / N sequences, metadata sampled per sequence as §8 says
(causal has no metadata: its descriptor has B = 1 and broadcasts). Tiles: forward
128x128, backward 64x128. JAX times: many iterations inside one jitted loop (each
iteration's operands depend on the loop carry, so nothing is hoisted, and a dynamic read
of every output keeps all of it live), after warm-up, median of repeats. torch times:
CUDA events around each call after warm-up, median. Writes records
``{mask, n, impl, ms}`` to benchmarks/results/h200-preprocess.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads as W  # noqa: E402  (docs/workloads.md samplers shared by every benchmark)

MASKS = W.MASKS
NS = (1024, 2048, 4096, 8192, 16384, 32768)


def workload(mask: str, n: int, rng=None):
    """(spec, numpy metadata or None, seq_len, batch) per docs/workloads.md."""
    return W.spec_for(mask, n), W.metadata_for(mask, n), W.seq_len(mask, n), W.batch_for(n)


def tiles():
    from jcompilemask.lower.descriptor import TileConfig
    return TileConfig(128, 128, 64, 128)


def bench_masks(ns=NS):
    import jcompilemask as jcm
    rng = np.random.default_rng(0)
    seen = {}
    for m in MASKS:
        for n in ns:
            spec = workload(m, n, rng)[0]
            seen[spec.key()] = jcm.compile(spec)
    return list(seen.values())


# -- JAX ------------------------------------------------------------------------------------
def time_jax(fn, meta, iters=50, repeats=7):
    """ms per call of ``fn(meta) -> descriptor``, in a jitted fori_loop."""
    import jax
    import jax.numpy as jnp

    def body(i, c):
        m = None if meta is None else {k: v + jnp.minimum(c, 0) for k, v in meta.items()}
        leaves = jax.tree_util.tree_leaves(fn(m))
        for x in leaves:
            flat = x.reshape(-1)
            if flat.size:
                idx = jnp.abs(c + i) % flat.size
                c = c + flat[idx].astype(jnp.int32) % 7
        return c & 0x3FFFFFFF

    @jax.jit
    def loop(c0):
        return jax.lax.fori_loop(0, iters, body, c0)

    loop(jnp.int32(1)).block_until_ready()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        loop(jnp.int32(1)).block_until_ready()
        out.append((time.perf_counter() - t) * 1e3 / iters)
    return float(np.median(out))


def _dump(records, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)


def run_jax(impls, ns, records, log, out):
    import jax.numpy as jnp
    import jcompilemask as jcm
    from jcompilemask.kernels.tilelang import tilelang_preprocess
    from jcompilemask.lower.preprocess import build_descriptor
    rng = np.random.default_rng(0)
    tl = tiles()
    for m in MASKS:
        for n in ns:
            spec, meta, L, b = workload(m, n, rng)
            cm = jcm.compile(spec)
            jm = None if meta is None else {k: jnp.asarray(v) for k, v in meta.items()}
            for impl in impls:
                if impl == "jcm-tilelang":
                    fn = lambda mm, cm=cm, L=L: tilelang_preprocess(cm, mm, L, L, tl, strict=True)  # noqa: E731
                elif impl == "jcm-jnp":
                    fn = lambda mm, cm=cm, L=L: build_descriptor(cm, mm, L, L, tl)  # noqa: E731
                else:
                    continue
                try:
                    ms = time_jax(fn, jm)
                except Exception as e:  # noqa: BLE001 - report and go on
                    log(f"{m} {n} {impl}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                records.append({"mask": m, "n": n, "impl": impl, "ms": round(ms, 4)})
                _dump(records, out)
                log(f"{m:14s} n={n:6d} B={b:4d} {impl:24s} {ms:9.4f} ms")


# -- torch FlexAttention create_block_mask --------------------------------------------------
def flex_mask_mod(mask, n, meta, L, b):
    import torch
    # The block-mask form (CLEAR's width from a tensor; torch_mask_mods says why).
    return W.torch_mask_mods(mask, n, meta, torch, "cuda")[1], (None if mask == "causal" else b)


def run_flex(ns, records, log, out, repeats=10):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    cbm = W.torch_compile_fresh(torch, create_block_mask)
    rng = np.random.default_rng(0)
    for m in MASKS:
        for n in ns:
            _, meta, L, b = workload(m, n, rng)
            try:
                mm, bb = flex_mask_mod(m, n, meta, L, b)
                for _ in range(3):
                    cbm(mm, bb, None, L, L, device="cuda")
                torch.cuda.synchronize()
                ts = []
                for _ in range(repeats):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    cbm(mm, bb, None, L, L, device="cuda")
                    e1.record()
                    torch.cuda.synchronize()
                    ts.append(e0.elapsed_time(e1))
                ms = float(np.median(ts))
            except Exception as e:  # noqa: BLE001
                log(f"{m} {n} flex: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            records.append({"mask": m, "n": n, "impl": "flex-create-block-mask",
                            "ms": round(ms, 4)})
            _dump(records, out)
            log(f"{m:14s} n={n:6d} B={b:4d} {'flex-create-block-mask':24s} {ms:9.4f} ms")


def table(records):
    impls = sorted({r["impl"] for r in records})
    rows = [f"{'mask':14s} {'n':>6s} " + " ".join(f"{i:>24s}" for i in impls)]
    for m in MASKS:
        for n in sorted({r["n"] for r in records}):
            vals = {r["impl"]: r["ms"] for r in records if r["mask"] == m and r["n"] == n}
            if vals:
                rows.append(f"{m:14s} {n:6d} " + " ".join(
                    f"{vals.get(i, float('nan')):24.4f}" for i in impls))
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--flex-ns", default=None, help="N values for create_block_mask "
                    "(default: --ns)")
    ap.add_argument("--impls", default="jcm-tilelang,jcm-jnp,flex-create-block-mask")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "h200-preprocess.json"))
    ap.add_argument("--warm-only", action="store_true",
                    help="compile the TileLang programs into the cache and exit")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.ns.split(",")]
    impls = args.impls.split(",")
    log = lambda s: print(s, flush=True)  # noqa: E731
    if "jcm-tilelang" in impls or args.warm_only:
        from jcompilemask.kernels.tilelang import warm_cache
        t = time.time()
        for name, sec, err in warm_cache(bench_masks(ns), tiles()):
            log(f"compiled {name}: {sec:.1f}s {err or ''}")
        log(f"warm cache: {time.time() - t:.1f}s")
        if args.warm_only:
            return
    records = []
    try:
        run_jax([i for i in impls if i.startswith("jcm")], ns, records, log, args.out)
        if "flex-create-block-mask" in impls:
            fns = [int(x) for x in args.flex_ns.split(",")] if args.flex_ns else ns
            run_flex(fns, records, log, args.out)
    finally:
        _dump(records, args.out)
        print(table(records))


if __name__ == "__main__":
    main()
