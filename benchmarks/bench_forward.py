"""Forward attention on the H200: correctness of the CuTe kernel, then its speed.

    python benchmarks/bench_forward.py --check --bench [--fa4] [--out FILE]

--check compares `cute_forward` with a float32 reference built from the same interval
tables (causal, GQA + ragged lengths, packed documents, prefix + per-head sliding
window (K = 2), random 3-interval rows with fully masked rows), on fresh random data.
--bench times causal attention at N = 2K / 8K / 32K with batch 131072 / N, 8 heads,
head dim 128, bf16: FLOPs = 4 * D * heads * (visible pairs); time = ``timing.sustained``
(median over repeats of a host-clocked loop of N back-to-back calls synchronised once,
N chosen so a loop lasts >= 0.5 s, after warm-up), the same method for every impl.
--fa4 adds FlashAttention-4's native CuTe kernel (torch) as impl "fa4-native". Records
{mask, n, impl, fwd_ms, fwd_tflops, run, sm_clock_mhz, power_w} (``clocks.py``; the
masks' jcm records add ``env``, the JCOMPILEMASK_* switches in effect, when any) go to
--out (default benchmarks/results/h200-forward.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clocks  # noqa: E402  (run id, SM clock / power medians of every record)
import compile_only  # noqa: E402  (--compile-only: the kernels into the disk cache, no timing)
import timing  # noqa: E402  (one timing method for every impl)

BLOCK = 128


def _rand(key, shape, dtype):
    import jax

    return jax.random.normal(key, shape, dtype="float32").astype(dtype)


def run_checks(seed: int) -> bool:
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute.api import cute_forward
    from jcompilemask.kernels.cute.testing import check_case_intervals, reference_attention, tiles_from_intervals

    rng = np.random.default_rng(seed)
    cases = [
        # name, B, Nq, Nk, Hq, Hkv
        ("causal", 2, 1024, 1024, 4, 4),
        ("causal", 1, 1000, 1000, 8, 2),
        ("document", 2, 1536, 1536, 4, 4),
        ("prefix_window", 1, 1280, 1280, 4, 4),
        ("random3", 2, 900, 1100, 2, 2),
    ]
    ok_all = True
    key = jax.random.PRNGKey(seed)
    for name, B, Nq, Nk, Hq, Hkv in cases:
        iv, desc = check_case_intervals(name, rng, B, Nq, Nk, Hq)
        tiles = tiles_from_intervals(iv, Nk, BLOCK, BLOCK)
        key, kq, kk, kv = jax.random.split(key, 4)
        q = _rand(kq, (B, Nq, Hq, 128), jnp.bfloat16)
        k = _rand(kk, (B, Nk, Hkv, 128), jnp.bfloat16)
        v = _rand(kv, (B, Nk, Hkv, 128), jnp.bfloat16)
        scale = 1.0 / math.sqrt(128)
        fwd = jax.jit(lambda q, k, v, iv, t: cute_forward(q, k, v, iv, t, scale=scale))
        o, lse = fwd(q, k, v, jnp.asarray(iv), jnp.asarray(tiles))
        o_ref, lse_ref = reference_attention(q, k, v, iv, scale)
        o32 = np.asarray(o.astype(jnp.float32))
        o_ref = np.asarray(o_ref)
        lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
        empty = np.isneginf(lse_ref)  # [B, Hq, Nq]
        rel = np.linalg.norm(o32 - o_ref) / max(np.linalg.norm(o_ref), 1e-30)
        fin = ~empty
        lse_err = float(np.max(np.abs(lse[fin] - lse_ref[fin]))) if fin.any() else 0.0
        empty_o = np.transpose(o32, (0, 2, 1, 3))[empty]
        nan = bool(np.isnan(o32).any() or np.isnan(lse).any())
        empty_ok = bool(np.all(empty_o == 0) and np.all(np.isneginf(lse[empty])))
        ok = (rel < 1e-2) and (lse_err < 2e-2) and not nan and empty_ok
        ok_all &= ok
        print(
            f"check {name:14s} B={B} Nq={Nq} Nk={Nk} H={Hq}/{Hkv} K={iv.shape[3]} Bm={iv.shape[0]} Hm={iv.shape[1]}: "
            f"rel_err={rel:.2e} lse_max_err={lse_err:.2e} empty_rows={int(empty.sum())} "
            f"empty_ok={empty_ok} nan={nan} -> {'OK' if ok else 'FAIL'}  ({desc})",
            flush=True,
        )
    return ok_all


def _median_time(fn, warmup: int = 3, iters: int | None = None, repeats: int = 5,
                 windows: list | None = None, min_repeat_s: float = timing.MIN_REPEAT_S) -> float:
    """Seconds per call of a JAX ``fn``: ``timing.sustained`` (``iters`` None: N calibrated
    so one loop lasts ``min_repeat_s``; a number fixes N, for CPU smoke runs)."""
    return timing.jax_time(fn, warmup=warmup, iters=iters, repeats=repeats, windows=windows,
                           min_repeat_s=min_repeat_s)


def bench_jcm(ns, heads=8, dim=128) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute.api import cute_forward
    from jcompilemask.kernels.cute.testing import causal_intervals, causal_visible_pairs, tiles_from_intervals

    records = []
    for n in ns:
        B = 131072 // n
        iv = causal_intervals(n)
        tiles = tiles_from_intervals(iv, n, BLOCK, BLOCK)
        key = jax.random.PRNGKey(n)
        kq, kk, kv = jax.random.split(key, 3)
        q = _rand(kq, (B, n, heads, dim), jnp.bfloat16)
        k = _rand(kk, (B, n, heads, dim), jnp.bfloat16)
        v = _rand(kv, (B, n, heads, dim), jnp.bfloat16)
        iv_d, tiles_d = jnp.asarray(iv), jnp.asarray(tiles)
        fwd = jax.jit(lambda q, k, v, iv, t: cute_forward(q, k, v, iv, t))
        clocks.start()
        win = []
        sec = _median_time(lambda: fwd(q, k, v, iv_d, tiles_d), warmup=3, repeats=5, windows=win)
        flops = 4 * dim * heads * B * causal_visible_pairs(n)
        rec = {"mask": "causal", "n": n, "impl": "jcm-cute", "fwd_ms": sec * 1e3,
               "fwd_tflops": flops / sec / 1e12, **clocks.fields(win)}
        print(f"bench jcm-cute causal n={n} B={B}: {rec['fwd_ms']:.3f} ms {rec['fwd_tflops']:.1f} TF/s", flush=True)
        records.append(rec)
    return records


def bench_masks(ns, masks, variants=(("", {}),), save=None) -> list[dict]:
    """jcm-cute forward through the public API on the paper workloads (docs/workloads.md):
    descriptors from the real preprocess (built once, outside the timed region). Each
    ``variants`` entry (tag, {ENV: value}) is timed with its environment set while tracing
    (bench_total.parse_variants: ``--jcm-variants``); impl ``jcm-cute-<tag>``. ``save``, if
    given, is called with the records so far after each one (a run cut short keeps them)."""
    import jax
    import jax.numpy as jnp

    import jcompilemask as jcm
    import workloads as W
    from bench_total import environment, jcm_env, variant_name

    records = []
    for n in ns:
        for mask in masks:
            L, B = W.seq_len(mask, n), W.batch_for(n)
            md = W.metadata_for(mask, n)
            cm = jcm.compile(W.spec_for(mask, n))
            t = jcm.backends.get("cute").tiles(None)
            desc = jax.jit(lambda m: cm.instantiate(
                m, L, L, block_q=t.block_q, block_kv=t.block_kv, bwd_block_q=t.bwd_block_q,
                bwd_block_kv=t.bwd_block_kv))(md)
            pairs = W.descriptor_pairs(desc) * (B if desc.batch == 1 else 1)
            kq, kk, kv = jax.random.split(jax.random.PRNGKey(n), 3)
            q = _rand(kq, (B, L, W.HEADS, W.HEAD_DIM), jnp.bfloat16)
            k = _rand(kk, (B, L, W.HEADS, W.HEAD_DIM), jnp.bfloat16)
            v = _rand(kv, (B, L, W.HEADS, W.HEAD_DIM), jnp.bfloat16)
            for tag, env in variants:
                with environment(env):
                    jax.clear_caches()            # every variant traces afresh
                    fwd = jax.jit(lambda q, k, v, d: jcm.mask_attention(q, k, v, d, implementation="cute"))
                    jax.block_until_ready(fwd(q, k, v, desc))
                    switches = jcm_env()
                clocks.start()
                win = []
                sec = _median_time(lambda: fwd(q, k, v, desc), warmup=3, repeats=5, windows=win)
                rec = {"mask": mask, "n": n, "impl": variant_name("jcm-cute", tag), "fwd_ms": sec * 1e3,
                       "fwd_tflops": W.tflops(pairs, sec * 1e3), "pairs": pairs,
                       **clocks.fields(win), **({"env": switches} if switches else {})}
                print(f"bench {rec['impl']} {mask} n={n} B={B}: {rec['fwd_ms']:.3f} ms "
                      f"{rec['fwd_tflops']:.1f} TF/s sm {rec.get('sm_clock_mhz')} MHz", flush=True)
                print(json.dumps(rec), flush=True)  # the record survives a killed run
                records.append(rec)
                if save is not None:
                    save(records)
            del q, k, v
    return records


def _merge(path, records):
    """Replace records of the same (mask, n, impl) in an existing results file."""
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("records", [])
    key = lambda r: (r["mask"], r["n"], r["impl"])  # noqa: E731
    new = {key(r) for r in records}
    return [r for r in old if key(r) not in new] + records


def bench_fa4(ns, heads=8, dim=128) -> list[dict]:
    import torch
    from flash_attn.cute import flash_attn_func

    records = []
    for n in ns:
        B = 131072 // n
        q, k, v = (torch.randn(B, n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        clocks.start()
        win = []
        with torch.no_grad():
            sec = timing.torch_time(lambda: flash_attn_func(q, k, v, causal=True), warmup=3,
                                    repeats=5, windows=win)
        flops = 4 * dim * heads * B * (n * (n + 1) // 2)
        rec = {"mask": "causal", "n": n, "impl": "fa4-native", "fwd_ms": sec * 1e3,
               "fwd_tflops": flops / sec / 1e12, **clocks.fields(win)}
        print(f"bench fa4-native causal n={n} B={B}: {rec['fwd_ms']:.3f} ms {rec['fwd_tflops']:.1f} TF/s "
              f"sm {rec.get('sm_clock_mhz')} MHz", flush=True)
        print(json.dumps(rec), flush=True)
        records.append(rec)
        del q, k, v
        torch.cuda.empty_cache()
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--fa4", action="store_true")
    ap.add_argument("--ns", default="2048,8192,32768")
    ap.add_argument("--masks", default="", help="also time these paper masks through "
                    "mask_attention, e.g. causal,hstu,shared_prompt,clear")
    ap.add_argument("--jcm-variants", default=None, help="with --masks: time jcm once per "
                    "tag=ENV entry (bench_total.py's syntax), e.g. 'base=;ls=JCOMPILEMASK_CUTE_FWD_SCHEDULE=1'")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the CuTe kernels --bench / --masks would run into the disk "
                         "cache and time nothing (compile_only.py; no GPU, CUTE_DSL_ARCH=sm_90a); "
                         "--check and --fa4 are skipped, nothing is written")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200-forward.json"))
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    ok = True
    if args.compile_only:
        compile_only.activate()
        args.check = args.fa4 = False
    if args.check:
        ok = run_checks(args.seed)
        print("checks:", "ALL OK" if ok else "FAILURES", flush=True)
    records = []
    if args.fa4:   # the peer first: a run cut short by its time limit still has it
        try:
            records += bench_fa4(ns)
        except Exception as err:  # the peer is optional; say why it is missing
            print(f"fa4-native not measured: {type(err).__name__}: {err}", flush=True)
    if args.bench:
        records += bench_jcm(ns)
    def save(recs):
        import jax

        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        merged = _merge(args.out, recs)
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "run": clocks.run_id(),
                       "records": merged}, f, indent=1)

    if args.masks:
        from bench_total import parse_variants
        done = list(records)
        records += bench_masks(ns, args.masks.split(","), parse_variants(args.jcm_variants),
                               save=None if args.compile_only else lambda recs: save(done + recs))
    if args.compile_only:
        print(compile_only.summary(), flush=True)
        sys.exit(0)
    if records:
        save(records)
        print(f"{'impl':12s} {'mask':8s} {'n':>6s} {'fwd_ms':>9s} {'TF/s':>7s}")
        for r in records:
            print(f"{r['impl']:12s} {r['mask']:8s} {r['n']:6d} {r['fwd_ms']:9.3f} {r['fwd_tflops']:7.1f}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
