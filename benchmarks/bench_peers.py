"""Forward TF/s of the peers (docs/workloads.md) on the paper workloads, on the H200.

    PYTHONPATH=. python3 benchmarks/bench_peers.py --budget-s 300 --out benchmarks/results/h200-forward-peers.json

Peers: FlexAttention with its Triton and FA4 (``BACKEND="FLASH"``) backends for causal,
hstu, shared_prompt and clear; FA4 native causal (``flash_attn.cute``); cuDNN causal
through ``jax.nn.dot_product_attention``. Metadata comes from ``workloads.py`` (the same
seeds jcompilemask's benchmarks use); FLOPs count visible pairs of jcompilemask's own
descriptor, so all figures compare. Every impl is timed the same way
(``timing.sustained``: N back-to-back calls synchronised once, N chosen so one loop lasts
>= 0.5 s, median of repeats after warm-up); every record carries ``run``,
``sm_clock_mhz`` and ``power_w`` (``clocks.py``).
Configurations run largest N first and stop when ``--budget-s`` is spent; records are
written after each one, merged into ``--out`` (a record of the same mask, n and impl is
replaced, others are kept).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clocks  # noqa: E402  (run id, SM clock / power medians of every record)
import timing  # noqa: E402  (one timing method for every impl)
import workloads as W  # noqa: E402


def jcm_pairs(mask, n, md):
    import jax
    import jcompilemask as jcm
    L = W.seq_len(mask, n)
    cm = jcm.compile(W.spec_for(mask, n))
    desc = jax.jit(lambda m: cm.instantiate(m, L, L))(md)
    pairs = W.descriptor_pairs(desc)
    if desc.batch == 1:
        pairs *= W.batch_for(n)
    return pairs


def bench_flex(mask, n, md, backend, torch, dev, pairs, windows, eager_block_mask=False):
    """FlexAttention's forward ms. ``eager_block_mask``: ``create_block_mask`` runs
    uncompiled (the same block mask; CLEAR at 8K, whose compiled build outlasts a call)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    L, b = W.seq_len(mask, n), W.batch_for(n)
    # CLEAR's block mask reads its width from a tensor (torch_mask_mods: the constant's
    # Triton build outlasted device calls); the attention keeps the constant: flex_attention
    # runs the block mask's mask_mod, and FA4's CuTe DSL rejects the tensor form ("Expected
    # TensorSSA", session 35), so it gets the attention's own, as in bench_total.
    mm, mb = W.torch_mask_mods(mask, n, md, torch, dev)
    bm = create_block_mask(mb, b if mask != "causal" else None, None, L, L, device=dev,
                           _compile=not eager_block_mask)
    bm.mask_mod = mm
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, W.HEADS, L, W.HEAD_DIM, device=dev, dtype=torch.bfloat16,
                           generator=g) for _ in range(3))
    opts = {"BACKEND": "FLASH"} if backend == "fa4" else {"BACKEND": "TRITON"}
    fn = W.torch_compile_fresh(torch, flex_attention)
    with torch.no_grad():
        return 1e3 * timing.torch_time(lambda: fn(q, k, v, block_mask=bm, kernel_options=opts),
                                       windows=windows)


def bench_fa4_native(n, torch, dev, pairs, windows):
    from flash_attn.cute import flash_attn_func
    b = W.batch_for(n)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, n, W.HEADS, W.HEAD_DIM, device=dev, dtype=torch.bfloat16,
                           generator=g) for _ in range(3))
    with torch.no_grad():
        return 1e3 * timing.torch_time(lambda: flash_attn_func(q, k, v, causal=True),
                                       windows=windows)


def bench_cudnn(n, windows):
    import jax
    import jax.numpy as jnp
    b = W.batch_for(n)
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, n, W.HEADS, W.HEAD_DIM), jnp.bfloat16) for kk in ks)
    fwd = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"))
    return 1e3 * timing.jax_time(lambda: fwd(q, k, v), windows=windows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--ns", default="32768,8192,2048")
    ap.add_argument("--masks", default=",".join(W.MASKS))
    ap.add_argument("--impls", default="fa4-native,jax-cudnn,flex-fa4,flex-triton")
    ap.add_argument("--out", default="benchmarks/results/h200-forward-peers.json")
    ap.add_argument("--flex-eager-block-mask", default="",
                    help="comma-separated masks (MASK, or MASK@N for one length) whose "
                         "FlexAttention block mask is built uncompiled (record field "
                         "block_mask: eager), e.g. clear@8192: its compiled build outlasted "
                         "every device call at 8K (sessions 25, 26, 29, 35)")
    args = ap.parse_args()
    import torch
    dev = "cuda"
    t_start = time.time()
    records = []
    old = []
    if os.path.exists(args.out):         # merge: a run at other N keeps earlier records
        with open(args.out) as f:
            old = json.load(f).get("records", [])

    def merged():
        key = lambda r: (r["mask"], r["n"], r["impl"])  # noqa: E731
        new = {key(r) for r in records}
        return [r for r in old if key(r) not in new] + records
    impls = args.impls.split(",")
    for n in (int(x) for x in args.ns.split(",")):
        for mask in args.masks.split(","):
            md = W.metadata_for(mask, n)
            pairs = jcm_pairs(mask, n, md)
            for impl in impls:
                if time.time() - t_start > args.budget_s:
                    print(f"budget spent; stopping before {impl} {mask} {n}", flush=True)
                    break
                if impl in ("fa4-native", "jax-cudnn") and mask != "causal":
                    continue
                clocks.start()
                win = []
                eager = impl.startswith("flex") and W.eager_block_mask(args.flex_eager_block_mask, mask, n)
                try:
                    if impl == "fa4-native":
                        ms = bench_fa4_native(n, torch, dev, pairs, win)
                    elif impl == "jax-cudnn":
                        ms = bench_cudnn(n, win)
                    else:
                        ms = bench_flex(mask, n, md, impl.split("-")[1], torch, dev, pairs, win,
                                        eager_block_mask=eager)
                except Exception as e:  # a peer that fails is recorded, not fatal
                    print(f"{impl} {mask} {n}: FAILED {type(e).__name__}: {e}", flush=True)
                    records.append({"mask": mask, "n": n, "impl": impl, "error": str(e)[:300],
                                    **clocks.fields([])})
                    continue
                rec = {"mask": mask, "n": n, "impl": impl, "fwd_ms": round(ms, 4),
                       "fwd_tflops": round(W.tflops(pairs, ms), 1), "pairs": pairs,
                       **clocks.fields(win)}
                if eager:
                    rec["block_mask"] = "eager"
                records.append(rec)
                print(json.dumps(rec), flush=True)
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "run": clocks.run_id(),
                               "records": merged()}, f, indent=1)
    print("\n| mask | n | impl | fwd ms | TF/s | sm_clock_mhz |\n|---|---|---|---|---|---|")
    for r in records:
        if "fwd_ms" in r:
            print(f"| {r['mask']} | {r['n']} | {r['impl']} | {r['fwd_ms']} | {r['fwd_tflops']} | "
                  f"{r['sm_clock_mhz']} |")


if __name__ == "__main__":
    main()
