"""Issue 15's timings: causal forward and backward per head-dim configuration, jcompilemask
(CuTe, the registry's default for each; and the xla backward) beside FA4
native and cuDNN, all in one process so the records share one ``run``.

    PYTHONPATH=. python3 benchmarks/bench_head_dims.py --ns 8192,32768 \\
        --out benchmarks/results/h200-head-dims.json

Configurations (``--configs``): ``d64``, ``d128`` (the no-cap baseline of ``d128cap``),
``d128cap`` (soft cap 30 at D 128: the issue's <= 15% cost), ``d256`` and ``d192``
(D 192 / Dv 128); ``d96``, ``d80`` and ``d160`` (160 / 128): head dims without kernels of
their own, which the CuTe kernels run zero-padded (``backends.cute_head_dims``: to 128 and
192 / 128). Workload: causal, bf16, 8 heads, 131072 // N sequences of N tokens.

Records (``mask``, ``n``, ``impl``, ``head_dim``, ``head_dim_v``, ``softcap``,
``fwd_ms``, ``bwd_ms`` = step - forward, ``step_ms``, ``run``, ``sm_clock_mhz``,
``power_w``; jcm records also ``backward``: which backward the registry ran and why). A
peer that cannot run a configuration (FA4 without that head dim, cuDNN with a soft cap)
gives a record with ``error`` instead of times. Timing: ``timing.sustained`` (median of
loops of >= ``--min-repeat-s`` seconds); the xla backward is slow (about a second per step
at 32K) and runs only at ``--xla-ns``. Configurations run in the order given and stop when
``--budget-s`` is spent (records so far are saved after each one).

``--impls`` also takes ``fa4-native-tMxN`` (e.g. ``fa4-native-t64x64``): FA4's backward
with its SM90 tile forced to M queries x N keys (its other choices kept, its forward
unchanged), to measure how much of a gap is the tile: at D 192 FA4 runs 64 x 96 and ours
64 x 64.

``--smoke``: tiny shapes on any machine (CPU: the xla path only), for the tests.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import clocks  # noqa: E402
from bench_total import environment  # noqa: E402  (a variant's env, restored after it)
from bench_total import parse_variants as parse_env_variants  # noqa: E402
import timing  # noqa: E402
from jcompilemask.kernels.cute.api import BWD_CONFIG_ENV  # noqa: E402  (no cutlass import)

CONFIGS = {   # name: (D, Dv, soft cap)
    "d64": (64, 64, None), "d128": (128, 128, None), "d128cap": (128, 128, 30.0),
    "d256": (256, 256, None), "d192": (192, 128, None),
    "d96": (96, 96, None), "d80": (80, 80, None), "d160": (160, 128, None),   # padded
}
HEADS, TOKENS = 8, 131072
IMPLS = ("jcm-cute", "fa4-native", "jax-cudnn", "jcm-xla")


def _inputs(b, n, h, d, dv, seed):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = ((b, n, h, d), (b, n, h, d), (b, n, h, dv), (b, n, h, dv))
    return [jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16) for kk, s in zip(ks, shapes)]


def _jax_times(fwd, loss, args, kw):
    import jax
    f = jax.jit(fwd)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    t_f = timing.jax_time(lambda: f(*args), **kw)
    t_s = timing.jax_time(lambda: step(*args), **kw)
    return t_f * 1e3, t_s * 1e3


def bench_jcm(impl, n, b, d, dv, cap, kw):
    """(fwd ms, step ms, note): the registry's choice of backward is the note."""
    import jax.numpy as jnp

    import jcompilemask as jcm
    name = impl.split("-", 1)[1]
    call = jcm.backends.Call(dtype="bfloat16", head_dim=d, head_dim_v=dv, num_heads=HEADS,
                             num_kv_heads=HEADS, softcap=cap is not None, has_fallback=False)
    tiles = jcm.backends.get(name).tiles(call)
    desc = jcm.compile(jcm.masks.causal()).instantiate(
        None, n, n, block_q=tiles.block_q, block_kv=tiles.block_kv,
        bwd_block_q=tiles.bwd_block_q, bwd_block_kv=tiles.bwd_block_kv)
    note = (jcm.backends.explain_backward(dataclasses.replace(call, tiles=tiles))
            if name == "cute" else "xla")
    q, k, v, do = _inputs(b, n, HEADS, d, dv, n)

    def fwd(q, k, v):
        return jcm.mask_attention(q, k, v, desc, implementation=name, logits_soft_cap=cap)

    def loss(q, k, v):
        return jnp.sum(fwd(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
    f, s = _jax_times(fwd, loss, (q, k, v), kw)
    return f, s, note


def fa4_tile(impl):
    """(M, N) of a ``fa4-native-tMxN`` impl name, None for ``fa4-native``.

    >>> fa4_tile("fa4-native-t64x64"), fa4_tile("fa4-native")
    ((64, 64), None)
    """
    if impl == "fa4-native":
        return None
    m = re.fullmatch(r"fa4-native-t(\d+)x(\d+)", impl)
    if not m:
        raise ValueError(f"unknown impl {impl!r} (fa4-native or fa4-native-tMxN)")
    return int(m.group(1)), int(m.group(2))


@contextlib.contextmanager
def fa4_bwd_tile(tile):
    """FA4's SM90 backward config with its tile replaced by ``tile`` (M, N) while inside."""
    if tile is None:
        yield
        return
    from flash_attn.cute import interface
    orig = interface._tile_size_bwd_sm90

    def forced(*a, **k):
        return dataclasses.replace(orig(*a, **k), m_block_size=tile[0], n_block_size=tile[1])
    interface._tile_size_bwd_sm90 = forced
    try:
        yield
    finally:
        interface._tile_size_bwd_sm90 = orig


def bench_fa4(n, b, d, dv, cap, kw, tile=None):
    import torch
    from flash_attn.cute import flash_attn_func
    g = torch.Generator(device="cuda").manual_seed(n)
    mk = lambda dim: torch.randn(b, n, HEADS, dim, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                 generator=g)
    q, k, v, do = mk(d), mk(d), mk(dv), mk(dv)
    for x in (q, k, v):
        x.requires_grad_(True)
    extra = {} if cap is None else {"softcap": cap}

    def fwd():
        o = flash_attn_func(q, k, v, causal=True, **extra)
        return o[0] if isinstance(o, tuple) else o
    with torch.no_grad():
        f = timing.torch_time(fwd, **kw)
    with fa4_bwd_tile(tile):
        s = timing.torch_time(lambda: torch.autograd.grad(fwd(), (q, k, v), do), **kw)
    return f * 1e3, s * 1e3, "" if tile is None else f"backward tile forced to {tile[0]}x{tile[1]}"


def bench_cudnn(n, b, d, dv, cap, kw):
    import jax
    import jax.numpy as jnp
    if cap is not None:
        raise NotImplementedError("jax.nn.dot_product_attention has no soft cap")
    if dv != d:
        raise NotImplementedError(f"jax.nn.dot_product_attention needs Dv == D (got {d}/{dv})")
    q, k, v, do = _inputs(b, n, HEADS, d, dv, n)
    attn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, implementation="cudnn")
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))  # noqa: E731
    f, s = _jax_times(attn, loss, (q, k, v), kw)
    return f, s, ""


def record(config, n, impl, d, dv, cap, fwd=None, step=None, windows=(), note=None, error=None):
    rec = {"mask": "causal", "n": n, "impl": impl, "config": config, "head_dim": d,
           "head_dim_v": dv, "softcap": cap, "heads": HEADS,
           "fwd_ms": None if fwd is None else round(fwd, 4),
           "bwd_ms": None if step is None else round(step - fwd, 4),
           "step_ms": None if step is None else round(step, 4), **clocks.fields(list(windows))}
    if note:
        rec["backward"] = note
    if error:
        rec["error"] = error
    return rec


def parse_variants(text):
    """'NAME@CONFIG=CFG;...' -> {NAME: (CONFIG, CFG)} (CFG: FIELD=V,... of BackwardConfig,
    set as $JCOMPILEMASK_CUTE_BWD_CONFIG); 'NAME@CONFIG:ENV=V ENV2=V2' -> {NAME: (CONFIG,
    {ENV: V, ...})}: ``JCOMPILEMASK_*`` variables instead, e.g. a forward switch.

    >>> parse_variants("sdp@d192=split_sdp=1; rse@d256:JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY=1")
    {'sdp': ('d192', 'split_sdp=1'), 'rse': ('d256', {'JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY': '1'})}
    """
    out = {}
    for item in (x.strip() for x in text.split(";")):
        if not item:
            continue
        name, at, rest = item.partition("@")
        head = rest.split("=", 1)[0]
        if ":" in head:
            config, _, assigns = rest.partition(":")
            try:       # bench_total's NAME=value parser
                env = parse_env_variants(f"v={assigns}")[0][1]
            except ValueError:
                env = {}
            if (not (at and name) or config not in CONFIGS or not env
                    or not all(k.startswith("JCOMPILEMASK_") for k in env)):
                raise ValueError(f"--jcm-variants takes NAME@CONFIG:JCOMPILEMASK_...=V ... with "
                                 f"CONFIG in {sorted(CONFIGS)}, got {item!r}")
            out[name] = (config, env)
            continue
        config, sep, cfg = rest.partition("=")
        if not (sep and at and name and cfg) or config not in CONFIGS:
            raise ValueError(f"--jcm-variants takes NAME@CONFIG=FIELD=V,... with CONFIG in "
                             f"{sorted(CONFIGS)}, got {item!r}")
        out[name] = (config, cfg)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", default="8192,32768")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--xla-ns", default="8192", help="N at which the (slow) xla backward runs")
    p.add_argument("--min-repeat-s", type=float, default=0.3)
    p.add_argument("--budget-s", type=float, default=1e9)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--prewarm", type=int, default=0, metavar="P",
                   help="first run every (N, config) untimed in P parallel worker processes "
                        "(prewarm.py): the timed pass then loads the kernels from the disk "
                        "caches")
    p.add_argument("--prewarm-s", type=float, default=200,
                   help="wall-clock limit of the prewarm phase")
    p.add_argument("--compile-only", action="store_true",
                   help="compile the CuTe kernels the run would need into the disk cache and "
                        "time nothing (compile_only.py; a machine without a GPU, "
                        "CUTE_DSL_ARCH=sm_90a); jcm-cute and its variants only")
    p.add_argument("--jcm-variants", default="",
                   help="backward configs timed beside the default: 'NAME@CONFIG=FIELD=V,...;...' "
                        "adds impl jcm-cute-NAME at CONFIG with $JCOMPILEMASK_CUTE_BWD_CONFIG set "
                        "to FIELD=V,... while it runs, e.g. 'sdp@d192=split_sdp=1,ds_stages=1'; "
                        "'NAME@CONFIG:ENV=V ...' sets JCOMPILEMASK_* variables instead, e.g. "
                        "'rse@d256:JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY=1'")
    args = p.parse_args(argv)
    try:
        variants = parse_variants(args.jcm_variants)
    except ValueError as e:
        p.error(str(e))
    ns = [int(x) for x in args.ns.split(",")] if not args.smoke else [256]
    xla_ns = {int(x) for x in args.xla_ns.split(",") if x} if not args.smoke else set(ns)
    impls = args.impls.split(",") if not args.smoke else ["jcm-xla"]
    configs = args.configs.split(",")
    if args.compile_only:
        import compile_only
        compile_only.activate()
        impls = [i for i in impls if i == "jcm-cute"]
        args.prewarm, args.out, args.budget_s = 0, None, float("inf")
    prewarmed = None
    if args.prewarm > 0:
        import prewarm as P
        argv_ = argv if argv is not None else sys.argv[1:]
        base = P.without(argv_, ("--ns", "--configs", "--out", "--min-repeat-s", "--prewarm",
                                 "--prewarm-s", "--budget-s"))
        jobs = [((n, c), ["--ns", str(n), "--configs", c, "--min-repeat-s", "0.001",
                          "--out", "{out}"]) for n in ns for c in configs]
        prewarmed = P.run(os.path.abspath(__file__), base, jobs, args.prewarm, args.prewarm_s)
    t0, records = time.time(), []
    kw = dict(min_repeat_s=args.min_repeat_s if not args.smoke else 0.01,
              repeats=5 if not args.smoke else 1, warmup=2 if not args.smoke else 1)

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"smoke": args.smoke, "run": clocks.run_id(), "records": records}, f,
                          indent=1)

    for n in ns:
        b = TOKENS // n if not args.smoke else 1
        for config in configs:
            d, dv, cap = CONFIGS[config]
            if args.smoke:
                d, dv = (d // 4, dv // 4)
            extra = [f"jcm-cute-{name}" for name, (c, _) in variants.items() if c == config]
            for impl in impls + (extra if "jcm-cute" in impls else []):
                if time.time() - t0 > args.budget_s:
                    print(f"budget spent: stopping before {config} {impl} n={n}", flush=True)
                    save()
                    return records
                if impl == "jcm-xla" and n not in xla_ns:
                    continue
                win = []
                ikw = dict(kw, windows=win)
                if impl == "jcm-xla" and not args.smoke:
                    ikw.update(repeats=3, warmup=1, min_repeat_s=0.0, iters=1)
                name = impl[len("jcm-cute-"):] if impl.startswith("jcm-cute-") else None
                try:
                    if name is not None:
                        what = variants[name][1]
                        env = what if isinstance(what, dict) else {BWD_CONFIG_ENV: what}
                        with environment(env):
                            f, s, note = bench_jcm("jcm-cute", n, b, d, dv, cap, ikw)
                        note = f"{note}; " + " ".join(f"{k}={v}" for k, v in env.items())
                    elif impl.startswith("jcm-"):
                        f, s, note = bench_jcm(impl, n, b, d, dv, cap, ikw)
                    elif impl.startswith("fa4-native"):
                        f, s, note = bench_fa4(n, b, d, dv, cap, ikw, fa4_tile(impl))
                    elif impl == "jax-cudnn":
                        f, s, note = bench_cudnn(n, b, d, dv, cap, ikw)
                    else:
                        raise ValueError(f"unknown impl {impl}")
                    rec = record(config, n, impl, d, dv, cap, f, s, win, note)
                except Exception as e:  # noqa: BLE001 - a peer without this config: say so
                    rec = record(config, n, impl, d, dv, cap,
                                 error=f"{type(e).__name__}: " + " ".join(str(e).split())[:300])
                if prewarmed is not None:
                    rec["prewarmed"] = prewarmed.get((n, config), False)
                records.append(rec)
                print(json.dumps(rec), flush=True)
                save()
    if args.compile_only:
        import compile_only
        print(compile_only.summary(), flush=True)
    return records


if __name__ == "__main__":
    main()
