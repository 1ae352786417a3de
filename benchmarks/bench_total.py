"""Training-step benchmark (DESIGN.md §7 "total"): mask preprocess + forward + backward.

    PYTHONPATH=. python3 benchmarks/bench_total.py [--ns 32768,8192,2048] [--masks ...]
        [--impls jcm,flex-fa4,flex-triton,fa4-native,jax-cudnn] [--budget-s 400]
        [--out benchmarks/results/h200-total.json]
    python3 benchmarks/bench_total.py --smoke        # CPU: tiny shapes, jcm only

For each workload of DESIGN.md §8 (bf16, 8 heads, head dim 128, batch 131072 / N):

- ``pre_ms``: building the mask for a new batch (jcompilemask: ``instantiate`` with the
  default preprocess — TileLang on an SM90 GPU with tilelang installed, else jnp; the
  record's ``preprocess`` says which; FlexAttention: ``create_block_mask``,
  compiled; 0 for the causal-only kernels, which need no mask);
- ``fwd_ms``: the forward pass; ``step_ms``: forward + backward (gradients of q, k, v
  for a fixed output cotangent); ``bwd_ms`` = step - fwd;
- ``total_tflops`` = 3.5 * forward FLOPs / (pre + step), forward FLOPs = 4 * head_dim *
  heads * visible pairs (pairs from jcompilemask's own descriptor, so all impls compare).

jcompilemask runs the backend the registry picks (``jcm.backends.explain()``; the impl
name records it, e.g. ``jcm-cute`` — CuTe forward and CuTe backward;
``--xla-backward`` turns the CuTe backward kernel off, recorded as ``jcm-cute-xlabwd``).
JAX times: many back-to-back calls synchronised once, median of repeats
(``bench_forward._median_time``); torch times: ``triton.testing.do_bench`` (CUDA events,
median). Configurations run largest N first and stop when ``--budget-s``
is spent; records are merged into ``--out`` after each one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import workloads as W  # noqa: E402
from bench_forward import _median_time, _merge  # noqa: E402  (one timing method, one merge)

SMOKE = dict(ns=(256,), heads=2, head_dim=32, tokens=512)


def _shape(mask, n, smoke):
    L = W.seq_len(mask, n) if not smoke else n + (32 if mask == "clear" else 0)
    b = max(1, (SMOKE["tokens"] if smoke else W.TOKENS) // n)
    h, d = (SMOKE["heads"], SMOKE["head_dim"]) if smoke else (W.HEADS, W.HEAD_DIM)
    return L, b, h, d


def _metadata(mask, n, b, smoke):
    md = W.metadata_for(mask, n, batch=b)
    if smoke and mask == "clear" and md is not None:
        md = dict(md, text_len=np.minimum(md["text_len"], 32).astype(np.int32))
    return md


def _iters(n):
    return max(3, min(30, int(200 * 2048 / n)))


# -- jcompilemask -----------------------------------------------------------------------
def bench_jcm(mask, n, smoke=False, implementation=None):
    import jax
    import jax.numpy as jnp

    import jcompilemask as jcm

    L, b, h, d = _shape(mask, n, smoke)
    spec = W.spec_for(mask, n) if not smoke else (
        jcm.masks.clear(16, 2) if mask == "clear" else W.spec_for(mask, n))
    md = _metadata(mask, n, b, smoke)
    md = None if md is None else {k: jnp.asarray(v) for k, v in md.items()}
    cm = jcm.compile(spec)
    call = jcm.backends.Call(dtype="bfloat16", head_dim=d, head_dim_v=d, num_heads=h,
                             num_kv_heads=h, softcap=False,
                             has_fallback=bool(cm.fallback_regions),
                             num_intervals=cm.num_intervals)
    impl = jcm.backends.select(implementation, call).name     # the registry's pick
    preprocess = cm.default_preprocess()
    instantiate = jax.jit(lambda m: cm.instantiate(m, L, L, preprocess=preprocess))
    desc = instantiate(md)
    pairs = W.visible_pairs(desc.fwd_intervals) * (b if desc.batch == 1 else 1)
    ks = jax.random.split(jax.random.key(n), 4)
    q, k, v, do = (jax.random.normal(kk, (b, L, h, d), jnp.float32).astype(jnp.bfloat16)
                   for kk in ks)
    fwd = jax.jit(lambda q, k, v, dd: jcm.mask_attention(q, k, v, dd, implementation=impl))

    def loss(q, k, v, dd):
        o = jcm.mask_attention(q, k, v, dd, implementation=impl)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    it = 3 if smoke else _iters(n)
    reps = 3 if smoke else 5
    pre = _median_time(lambda: instantiate(md), warmup=2, iters=it, repeats=reps)
    f = _median_time(lambda: fwd(q, k, v, desc), warmup=2, iters=it, repeats=reps)
    s = _median_time(lambda: step(q, k, v, desc), warmup=2, iters=it, repeats=reps)
    return f"jcm-{impl}", pairs, pre * 1e3, f * 1e3, s * 1e3, (h, d), preprocess


# -- peers ------------------------------------------------------------------------------
def _torch_inputs(torch, dev, shape, n):
    g = torch.Generator(device=dev).manual_seed(n)
    return [torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)
            for _ in range(4)]


def _torch_times(torch, fwd, q, k, v, do):
    import triton
    for x in (q, k, v):
        x.requires_grad_(True)

    def step():
        o = fwd(q, k, v)
        o.backward(do)

    with torch.no_grad():
        f = triton.testing.do_bench(lambda: fwd(q, k, v), warmup=50, rep=300,
                                    return_mode="median")
    s = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median",
                                grad_to_none=[q, k, v])
    return f, s


def bench_flex(mask, n, md, backend):
    import torch
    import triton
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    dev = "cuda"
    L, b = W.seq_len(mask, n), W.batch_for(n)
    mm = W.torch_mask_mod(mask, n, md, torch, dev)
    bsz = b if mask != "causal" else None
    cbm = W.torch_compile_fresh(torch, create_block_mask)
    pre = triton.testing.do_bench(lambda: cbm(mm, bsz, None, L, L, device=dev),
                                  warmup=3, rep=100, return_mode="median")
    bm = cbm(mm, bsz, None, L, L, device=dev)
    q, k, v, do = _torch_inputs(torch, dev, (b, W.HEADS, L, W.HEAD_DIM), n)
    opts = {"BACKEND": "FLASH"} if backend == "fa4" else {"BACKEND": "TRITON"}
    fn = W.torch_compile_fresh(torch, flex_attention)
    f, s = _torch_times(torch, lambda q, k, v: fn(q, k, v, block_mask=bm, kernel_options=opts),
                        q, k, v, do)
    return pre, f, s


def bench_fa4_native(n):
    import torch
    from flash_attn.cute import flash_attn_func
    b = W.batch_for(n)
    q, k, v, do = _torch_inputs(torch, "cuda", (b, n, W.HEADS, W.HEAD_DIM), n)

    def fwd(q, k, v):
        o = flash_attn_func(q, k, v, causal=True)
        return o[0] if isinstance(o, tuple) else o
    f, s = _torch_times(torch, fwd, q, k, v, do)
    return 0.0, f, s


def bench_cudnn(n):
    import jax
    import jax.numpy as jnp
    b = W.batch_for(n)
    ks = jax.random.split(jax.random.key(n), 4)
    q, k, v, do = (jax.random.normal(kk, (b, n, W.HEADS, W.HEAD_DIM), jnp.float32)
                   .astype(jnp.bfloat16) for kk in ks)
    attn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, implementation="cudnn")
    fwd = jax.jit(attn)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)
                                                     * do.astype(jnp.float32)),
                            argnums=(0, 1, 2)))
    it = _iters(n)
    f = _median_time(lambda: fwd(q, k, v), warmup=2, iters=it, repeats=5)
    s = _median_time(lambda: step(q, k, v), warmup=2, iters=it, repeats=5)
    return 0.0, f * 1e3, s * 1e3


# -- driver -----------------------------------------------------------------------------
def record(mask, n, impl, pairs, pre, fwd, step, heads=W.HEADS, head_dim=W.HEAD_DIM):
    flops = 4 * head_dim * heads * pairs
    return {"mask": mask, "n": n, "impl": impl, "pre_ms": round(pre, 4),
            "fwd_ms": round(fwd, 4), "bwd_ms": round(step - fwd, 4),
            "step_ms": round(step, 4),
            "total_tflops": float(f"{3.5 * flops / ((pre + step) * 1e-3) / 1e12:.4g}"),
            "fwd_tflops": float(f"{flops / (fwd * 1e-3) / 1e12:.4g}"), "pairs": int(pairs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="32768,8192,2048")
    ap.add_argument("--masks", default=",".join(W.MASKS))
    ap.add_argument("--impls", default="jcm,flex-fa4,flex-triton,fa4-native,jax-cudnn")
    ap.add_argument("--jcm-implementation", default=None,
                    help="force a jcompilemask backend (cute, xla); default: the registry's")
    ap.add_argument("--xla-backward", action="store_true",
                    help="gradients from the xla backward instead of the CuTe backward kernel "
                         "(sets JCOMPILEMASK_CUTE_BACKWARD=0; impl name jcm-cute-xlabwd)")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "h200-total.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, jcompilemask only (any machine, CPU included)")
    args = ap.parse_args(argv)
    if args.xla_backward:
        os.environ["JCOMPILEMASK_CUTE_BACKWARD"] = "0"
    ns = SMOKE["ns"] if args.smoke else [int(x) for x in args.ns.split(",")]
    impls = ["jcm"] if args.smoke else args.impls.split(",")
    records, t0 = [], time.time()
    device = "cpu"
    for n in ns:
        for mask in args.masks.split(","):
            pairs = None
            for impl in impls:
                if time.time() - t0 > args.budget_s:
                    print(f"budget spent; stopping before {impl} {mask} {n}", flush=True)
                    break
                if impl in ("fa4-native", "jax-cudnn") and mask != "causal":
                    continue
                try:
                    if impl == "jcm":
                        name, pairs, pre, f, s, (h, d), prep = bench_jcm(
                            mask, n, args.smoke, args.jcm_implementation)
                        if args.xla_backward and name == "jcm-cute":
                            name = "jcm-cute-xlabwd"
                        elif name == "jcm-cute":     # backward kernel variants under trial
                            from jcompilemask.kernels.cute import api as cute_api
                            for env, tag in ((cute_api.BWD_STATS_TMA_ENV, "st"),
                                             (cute_api.BWD_DQ_BULK_ENV, "dqb")):
                                if cute_api._bwd_variant(env):
                                    name += "-" + tag
                        rec = dict(record(mask, n, name, pairs, pre, f, s, h, d), preprocess=prep)
                    else:
                        if pairs is None:
                            raise RuntimeError("run with impl jcm first (it counts the pairs)")
                        md = W.metadata_for(mask, n)
                        if impl == "fa4-native":
                            pre, f, s = bench_fa4_native(n)
                        elif impl == "jax-cudnn":
                            pre, f, s = bench_cudnn(n)
                        else:
                            pre, f, s = bench_flex(mask, n, md, impl.split("-")[1])
                        rec = record(mask, n, impl, pairs, pre, f, s)
                except Exception as e:  # noqa: BLE001 - a failing impl is recorded
                    print(f"{impl} {mask} {n}: FAILED {type(e).__name__}: {str(e)[:300]}",
                          flush=True)
                    rec = {"mask": mask, "n": n, "impl": impl, "error": str(e)[:300]}
                records.append(rec)
                print(json.dumps(rec), flush=True)
                try:
                    import jax
                    device = jax.devices()[0].device_kind
                except Exception:  # noqa: BLE001
                    pass
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                merged = _merge(args.out, records)
                with open(args.out, "w") as f_:
                    json.dump({"device": device, "smoke": args.smoke, "records": merged},
                              f_, indent=1)
    print("\n| mask | n | impl | pre ms | fwd ms | bwd ms | total TF/s |\n|---|---|---|---|---|---|---|")
    for r in records:
        if "error" not in r:
            print(f"| {r['mask']} | {r['n']} | {r['impl']} | {r['pre_ms']} | {r['fwd_ms']} | "
                  f"{r['bwd_ms']} | {r['total_tflops']} |")
    return records


if __name__ == "__main__":
    main()
