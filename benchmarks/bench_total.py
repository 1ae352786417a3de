"""Training-step benchmark ("total" in docs/workloads.md): mask preprocess + forward + backward.

    PYTHONPATH=. python3 benchmarks/bench_total.py [--ns 32768,8192,2048] [--masks ...]
        [--impls jcm,flex-fa4,flex-triton,fa4-native,jax-cudnn] [--budget-s 400]
        [--jcm-variants "base=;ds1=JCOMPILEMASK_CUTE_BWD_CONFIG=ds_stages=1"] [--check]
        [--out benchmarks/results/h200-total.json]
    python3 benchmarks/bench_total.py --smoke        # CPU: tiny shapes, jcm only

For each workload of docs/workloads.md (bf16, 8 heads, head dim 128, batch 131072 / N):

- ``pre_ms``: building the mask for a new batch (jcompilemask: ``instantiate`` with the
  default preprocess — TileLang on an SM90 GPU with tilelang installed, else jnp; the
  record's ``preprocess`` says which; FlexAttention: ``create_block_mask``,
  compiled; 0 for the causal-only kernels, which need no mask);
- ``fwd_ms``: the forward pass; ``step_ms``: forward + backward (gradients of q, k, v
  for a fixed output cotangent; torch through ``torch.autograd.grad``, so nothing
  accumulates between steps); ``bwd_ms`` = step - fwd;
- ``total_tflops`` = 3.5 * forward FLOPs / (pre + step), forward FLOPs = 4 * head_dim *
  heads * visible pairs (pairs from jcompilemask's own descriptor, so all impls compare);
- ``run``, ``sm_clock_mhz``, ``power_w`` (``clocks.py``): the run id shared by all
  records of one process (or ``$JCM_RUN_ID``) and the median SM clock / board power over
  the record's timed loops (null where no GPU can be sampled);
- ``env`` (jcm records, when any is set): the ``JCOMPILEMASK_*`` variables the record was
  timed under, the process's and its ``--jcm-variants`` entry's (``jcm_env``).

Every impl is timed the same way (``timing.sustained``): after warm-up, N back-to-back
calls synchronised once (JAX: ``block_until_ready`` on the last result; torch:
``torch.cuda.synchronize()``), N chosen so one loop lasts >= ``--min-repeat-s``, median
of 5 loops. Figures of different runs are compared only through ratios to a peer of the
same run (the printed table's ``bwd / best peer``: bwd_ms over the smallest peer bwd_ms
of the same mask and N).

jcompilemask runs the backend the registry picks (``jcm.backends.explain()``; the impl
name records it, e.g. ``jcm-cute`` — CuTe forward and CuTe backward;
``--xla-backward`` turns the CuTe backward kernel off, recorded as ``jcm-cute-xlabwd``).
``--jcm-variants`` times jcompilemask once per ``tag=ENV`` entry (``;``-separated; ENV
is zero or more space-separated ``NAME=value`` assignments): the environment is set
before tracing (fresh jitted functions, JAX's caches cleared) and restored after; the
record's impl is ``jcm-<backend>-<tag>`` (plain ``jcm-<backend>`` for the tag ``base`` or an
empty tag). ``--check`` adds to each jcompilemask record ``check``: ``"ok"`` or ``"FAIL:
..."``, dq / dk / dv of the same mask at N = 2048, batch 1, 2 heads against the dense
reference under the tolerance policy (``jcompilemask.testing``).

Configurations run largest N first and stop when ``--budget-s`` is spent; records are
merged into ``--out`` after each one, each with ``elapsed_s`` (seconds since the start: where
a device call's budget went). ``--prewarm P`` first runs every (N, mask) configuration
untimed in P parallel worker processes (``prewarm.py``), so the timed pass loads compiled
kernels from the disk caches instead of compiling them (records then carry ``prewarmed``:
whether their configuration's worker finished); issue 12's 8K + 32K table fits one device
call only this way.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import shlex
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import clocks  # noqa: E402  (run id, SM clock / power medians of every record)
import prewarm as P  # noqa: E402  (--prewarm: configurations compiled in parallel first)
import timing  # noqa: E402  (one timing method for every impl)
import workloads as W  # noqa: E402
from bench_forward import _merge  # noqa: E402  (one merge)

SMOKE = dict(ns=(256,), heads=2, head_dim=32, tokens=512)
CHECK = dict(n=2048, batch=1, heads=2)


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


def _spec(mask, n, smoke):
    import jcompilemask as jcm
    if smoke and mask == "clear":
        return jcm.masks.clear(16, 2)
    return W.spec_for(mask, n)


def _timing_kw(smoke, min_repeat_s):
    # CPU smoke runs fix N (a calibrated 0.5 s loop of the xla backend takes minutes).
    return dict(iters=3, repeats=3) if smoke else dict(repeats=5, min_repeat_s=min_repeat_s)


# -- variants ---------------------------------------------------------------------------
def parse_variants(text):
    """``[(tag, {NAME: value})]`` of a ``--jcm-variants`` string (module doc).

    >>> parse_variants("base=;ds1=JCOMPILEMASK_CUTE_BWD_CONFIG=ds_stages=1")
    [('base', {}), ('ds1', {'JCOMPILEMASK_CUTE_BWD_CONFIG': 'ds_stages=1'})]
    >>> parse_variants(None)
    [('', {})]
    """
    if not text:
        return [("", {})]
    out, seen = [], set()
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        tag, _, env = entry.partition("=")
        tag = tag.strip()
        if any(c.isspace() or c == "/" for c in tag):
            raise ValueError(f"--jcm-variants entry {entry!r}: expected tag=NAME=value with "
                             f"a tag without spaces or '/' (e.g. ds1=VAR=1, base=)")
        assignments = {}
        for item in shlex.split(env):
            name, eq2, value = item.partition("=")
            if not eq2 or not name:
                raise ValueError(f"--jcm-variants entry {entry!r}: {item!r} is not NAME=value")
            assignments[name] = value
        if tag in seen:
            raise ValueError(f"--jcm-variants: tag {tag!r} given twice")
        seen.add(tag)
        out.append((tag, assignments))
    return out or [("", {})]


def variant_name(base, tag):
    return base if tag in ("", "base") else f"{base}-{tag}"


def jcm_env():
    """The ``JCOMPILEMASK_*`` variables in effect (call it inside ``environment``): a jcm
    record's ``env`` field, so a record timed under a switch says so without a hand edit.

    >>> with environment({"JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY": "1"}):
    ...     jcm_env()["JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY"]
    '1'
    """
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("JCOMPILEMASK_")}


@contextlib.contextmanager
def environment(assignments):
    """``os.environ`` updated by ``assignments`` inside, restored on exit."""
    old = {k: os.environ.get(k) for k in assignments}
    os.environ.update(assignments)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- jcompilemask -----------------------------------------------------------------------
def jcm_workload(mask, n, smoke=False, implementation=None):
    """jcompilemask's step of one workload, built and not timed (``bench_jcm`` times it,
    ``kernel_times.py`` traces it): a dict with ``impl`` (the registry's backend), ``pairs``,
    ``heads``, ``head_dim``, ``preprocess``, and the callables ``instantiate()`` (the
    descriptor of the workload's metadata), ``fwd()`` and ``step()`` (forward; forward +
    backward: gradients of q, k, v for a fixed output cotangent) on fixed inputs and the
    descriptor. The jitted functions are made here, so the environment at call time is
    the one traced."""
    import jax
    import jax.numpy as jnp

    import jcompilemask as jcm

    L, b, h, d = _shape(mask, n, smoke)
    if mask == "documents_traced":
        return _traced_workload(mask, n, smoke, implementation)
    spec = _spec(mask, n, smoke)
    md = _metadata(mask, n, b, smoke)
    md = None if md is None else {k: jnp.asarray(v) for k, v in md.items()}
    cm = jcm.compile(spec)
    # the Call mask_attention makes of this mask (a bitmap dense mask: the xla backend)
    call = jcm.backends.call_for(cm, dtype="bfloat16", head_dim=d, head_dim_v=d,
                                 num_heads=h, num_kv_heads=h, softcap=False)
    impl = jcm.backends.select(implementation, call).name     # the registry's pick
    preprocess = cm.default_preprocess()
    instantiate = jax.jit(lambda m: cm.instantiate(m, L, L, preprocess=preprocess))
    desc = instantiate(md)
    count = desc
    if (cm.row_classes is not None and L % cm.row_classes.factor == 0
            and not isinstance(desc, jcm.ClassDescriptor)):
        # residue classes count the visible pairs exactly (a residual lowering counts its
        # hulls): every variant and peer of such a mask gets the exact count
        count = jax.jit(lambda m: cm.instantiate(m, L, L, preprocess="jnp",
                                                 row_classes=True))(md)
    from jcompilemask.lower.dense import DenseMask
    if isinstance(cm, DenseMask):
        # (a bitmap's interval tables are empty: count its array's pairs)
        pairs = int(np.asarray(cm.batch_array).sum()) * (b if cm.batch == 1 else 1)
    else:
        pairs = W.descriptor_pairs(count) * (b if count.batch == 1 else 1)
    q, k, v, do = _inputs(n, b, L, h, d)
    fwd, step = _fwd_and_step(do, impl)
    return dict(impl=impl, pairs=pairs, heads=h, head_dim=d, preprocess=preprocess,
                instantiate=lambda: instantiate(md), fwd=lambda: fwd(q, k, v, desc),
                step=lambda: step(q, k, v, desc))


def _inputs(n, b, L, h, d):
    """q, k, v and the output cotangent of a workload: bf16 [b, L, h, d] normals."""
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.key(n), 4)
    return tuple(jax.random.normal(kk, (b, L, h, d), jnp.float32).astype(jnp.bfloat16)
                 for kk in ks)


def _fwd_and_step(do, impl):
    """Jitted ``fwd(q, k, v, mask)`` and ``step(q, k, v, mask)`` (gradients of q, k, v for
    the cotangent ``do``) of ``mask_attention`` on the backend ``impl``."""
    import jax
    import jax.numpy as jnp

    import jcompilemask as jcm
    fwd = jax.jit(lambda q, k, v, dd: jcm.mask_attention(q, k, v, dd, implementation=impl))

    def loss(q, k, v, dd):
        o = jcm.mask_attention(q, k, v, dd, implementation=impl)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    return fwd, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _traced_workload(mask, n, smoke, implementation):
    """``jcm_workload`` of a boolean mask computed in the step (``documents_traced``): the
    bool [B, 1, L, L] array is the step's input, its runs found at every call;
    ``instantiate()`` times that part alone (the tier descriptors and the index)."""
    import jax
    import jax.numpy as jnp

    import jcompilemask as jcm
    from jcompilemask.attention.api import runtime_dense_plan

    L, b, h, d = _shape(mask, n, smoke)
    ids = jnp.asarray(_metadata(mask, n, b, smoke)["segment_ids"])
    arr = jax.jit(lambda s: ((s[:, :, None] == s[:, None, :])
                             & jnp.tril(jnp.ones((L, L), bool))[None])[:, None])(ids)
    q, k, v, do = _inputs(n, b, L, h, d)
    seen = {}

    def plan(m):
        descs, seen["names"], index = runtime_dense_plan(q, k, jcm.runtime_dense(m),
                                                         implementation=implementation)
        return descs, index
    instantiate = jax.jit(plan)
    index = int(instantiate(arr)[1])
    impl = seen["names"][index]
    fwd, step = _fwd_and_step(do, impl)
    pairs = int(np.asarray(jnp.sum(arr, axis=-1, dtype=jnp.int32)).sum(dtype=np.int64))
    return dict(impl=impl, pairs=pairs, heads=h, head_dim=d, preprocess="runtime_dense",
                instantiate=lambda: instantiate(arr), fwd=lambda: fwd(q, k, v, arr),
                step=lambda: step(q, k, v, arr))


def bench_jcm(mask, n, smoke=False, implementation=None, min_repeat_s=timing.MIN_REPEAT_S,
              windows=None):
    """jcompilemask's preprocess / forward / step times (ms) of one workload
    (``jcm_workload``)."""
    w = jcm_workload(mask, n, smoke, implementation)
    kw = dict(_timing_kw(smoke, min_repeat_s), windows=windows)
    pre = timing.jax_time(w["instantiate"], **kw)
    f = timing.jax_time(w["fwd"], **kw)
    s = timing.jax_time(w["step"], **kw)
    return dict(impl=w["impl"], pairs=w["pairs"], pre=pre * 1e3, fwd=f * 1e3, step=s * 1e3,
                heads=w["heads"], head_dim=w["head_dim"], preprocess=w["preprocess"])


def check_jcm(mask, smoke=False, implementation=None):
    """``"ok"`` when dq / dk / dv of ``mask`` (N = 2048, batch 1, 2 heads; the smoke
    shape under ``smoke``) meet the tolerance policy against the dense reference, else
    ``"FAIL: ..."`` naming each failing gradient (never raises)."""
    try:
        import jax
        import jax.numpy as jnp

        import jcompilemask as jcm
        from jcompilemask.testing import assert_within_policy, reference_gradients

        n = SMOKE["ns"][0] if smoke else CHECK["n"]
        L, _, _, d = _shape(mask, n, smoke)
        h = CHECK["heads"]
        spec = _spec(mask, n, smoke)
        md = _metadata(mask, n, CHECK["batch"], smoke)  # numpy: validated when traced
        ks = jax.random.split(jax.random.key(1), 4)
        q, k, v, do = (jax.random.normal(kk, (CHECK["batch"], L, h, d), jnp.float32)
                       .astype(jnp.bfloat16) for kk in ks)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

        def loss_ours(a, b_, c):
            o = jcm.mask_attention(a, b_, c, spec, metadata=md, implementation=implementation)
            return jnp.sum(f32(o) * f32(do))

        g = jax.jit(jax.grad(loss_ours, argnums=(0, 1, 2)))(q, k, v)
        from jcompilemask.lower.dense import DenseMask
        dense = spec.as_dense() if isinstance(spec, DenseMask) else spec.as_dense(md, L, L)
        g_hi, g_lo = reference_gradients(q, k, v, do, dense)
        problems = []
        for name, a, hi, lo in zip(("dq", "dk", "dv"), g, g_hi, g_lo):
            try:
                assert_within_policy(a, hi, lo, name)
            except AssertionError as err:
                problems.append(str(err))
        return "ok" if not problems else "FAIL: " + "; ".join(problems)[:500]
    except Exception as e:  # noqa: BLE001 - a check that cannot run is a failed check
        return f"FAIL: {type(e).__name__}: " + " ".join(str(e).split())[:400]


# -- peers ------------------------------------------------------------------------------
def _torch_inputs(torch, dev, shape, n):
    g = torch.Generator(device=dev).manual_seed(n)
    return [torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)
            for _ in range(4)]


def torch_step(torch, fwd, q, k, v, do):
    """The peers' step: gradients of q, k, v through ``fwd`` for the cotangent ``do``
    (``torch.autograd.grad``: fresh gradients each step, nothing accumulates in .grad)."""
    for x in (q, k, v):
        x.requires_grad_(True)
    return lambda: torch.autograd.grad(fwd(q, k, v), (q, k, v), do)


def _torch_times(torch, fwd, q, k, v, do, windows, min_repeat_s):
    step = torch_step(torch, fwd, q, k, v, do)
    with torch.no_grad():
        f = timing.torch_time(lambda: fwd(q, k, v), windows=windows, min_repeat_s=min_repeat_s)
    s = timing.torch_time(step, windows=windows, min_repeat_s=min_repeat_s)
    return f * 1e3, s * 1e3


def flex_parts(mask, n, md, backend, eager_block_mask=False):
    """FlexAttention on one workload: ``(build, attention, shape)``. ``build()`` makes the
    block mask (compiled ``create_block_mask``, or uncompiled under ``eager_block_mask``: it
    evaluates the mask_mod densely, more memory and a slower build, the same block mask),
    with the attention kernel's own mask_mod set; ``attention(bm)`` is the compiled
    ``flex_attention`` over it as ``fwd(q, k, v)``; ``shape`` the [B, H, L, D] inputs'."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    dev = "cuda"
    L, b = W.seq_len(mask, n), W.batch_for(n)
    mm, mb = W.torch_mask_mods(mask, n, md, torch, dev)
    bsz = None if md is None else b            # metadata-free masks: one block mask for all
    cbm = create_block_mask if eager_block_mask else W.torch_compile_fresh(torch, create_block_mask)

    def build():
        bm = cbm(mb, bsz, None, L, L, device=dev)
        bm.mask_mod = mm                       # the attention kernel's own (same mask)
        return bm
    opts = {"BACKEND": "FLASH"} if backend == "fa4" else {"BACKEND": "TRITON"}
    fn = W.torch_compile_fresh(torch, flex_attention)

    def attention(bm):
        return lambda q, k, v: fn(q, k, v, block_mask=bm, kernel_options=opts)
    return build, attention, (b, W.HEADS, L, W.HEAD_DIM)


def bench_flex(mask, n, md, backend, windows, min_repeat_s, eager_block_mask=False):
    """FlexAttention's (pre, fwd, step) ms (``flex_parts``; pre: the block mask's build)."""
    import torch
    build, attention, shape = flex_parts(mask, n, md, backend, eager_block_mask)
    pre = 1e3 * timing.torch_time(build, warmup=3, windows=windows, min_repeat_s=min_repeat_s)
    q, k, v, do = _torch_inputs(torch, "cuda", shape, n)
    f, s = _torch_times(torch, attention(build()), q, k, v, do, windows, min_repeat_s)
    return pre, f, s


def fa4_native_causal(q, k, v):
    """FA4 native's causal attention ([B, N, H, D]), its output alone."""
    from flash_attn.cute import flash_attn_func
    o = flash_attn_func(q, k, v, causal=True)
    return o[0] if isinstance(o, tuple) else o


def bench_fa4_native(n, windows, min_repeat_s):
    import torch
    b = W.batch_for(n)
    q, k, v, do = _torch_inputs(torch, "cuda", (b, n, W.HEADS, W.HEAD_DIM), n)
    f, s = _torch_times(torch, fa4_native_causal, q, k, v, do, windows, min_repeat_s)
    return 0.0, f, s


def bench_cudnn(n, windows, min_repeat_s):
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
    kw = dict(windows=windows, min_repeat_s=min_repeat_s)
    f = timing.jax_time(lambda: fwd(q, k, v), **kw)
    s = timing.jax_time(lambda: step(q, k, v), **kw)
    return 0.0, f * 1e3, s * 1e3


# -- driver -----------------------------------------------------------------------------
def record(mask, n, impl, pairs, pre, fwd, step, heads=W.HEADS, head_dim=W.HEAD_DIM,
           windows=()):
    flops = 4 * head_dim * heads * pairs
    return {"mask": mask, "n": n, "impl": impl, "pre_ms": round(pre, 4),
            "fwd_ms": round(fwd, 4), "bwd_ms": round(step - fwd, 4),
            "step_ms": round(step, 4),
            "total_tflops": float(f"{3.5 * flops / ((pre + step) * 1e-3) / 1e12:.4g}"),
            "fwd_tflops": float(f"{flops / (fwd * 1e-3) / 1e12:.4g}"), "pairs": int(pairs),
            **clocks.fields(list(windows))}


def bwd_ratios(records):
    """bwd_ms of each record over the smallest bwd_ms of a peer (an impl not ``jcm-*``)
    of the same mask and N among ``records`` (None without such a peer)."""
    best = {}
    for r in records:
        if "bwd_ms" in r and not r["impl"].startswith("jcm"):
            key = (r["mask"], r["n"])
            best[key] = min(best.get(key, float("inf")), r["bwd_ms"])
    return [None if "bwd_ms" not in r or (r["mask"], r["n"]) not in best
            or best[(r["mask"], r["n"])] <= 0
            else round(r["bwd_ms"] / best[(r["mask"], r["n"])], 3) for r in records]


def table(records):
    """The markdown table printed at the end of a run."""
    checked = any("check" in r and r["check"] is not None for r in records)
    head = ["mask", "n", "impl", "pre ms", "fwd ms", "bwd ms", "total TF/s", "sm_clock_mhz",
            "bwd / best peer"] + (["check"] if checked else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, ratio in zip(records, bwd_ratios(records)):
        if "error" in r:
            continue
        cells = [r["mask"], r["n"], r["impl"], r["pre_ms"], r["fwd_ms"], r["bwd_ms"],
                 r["total_tflops"], "" if r["sm_clock_mhz"] is None else r["sm_clock_mhz"],
                 "" if ratio is None else f"{ratio:.2f}"]
        if checked:
            cells.append(r.get("check") or "")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def prewarm(argv, ns, masks, workers, limit_s):
    """Each (n, mask) configuration of this run once in a worker process (this script on
    one N and one mask, shortest loops, records thrown away; ``prewarm.run``), so the timed
    pass loads what they compiled. Returns {(n, mask): finished in time}."""
    base = P.without(argv, ("--ns", "--masks", "--out", "--min-repeat-s", "--prewarm",
                            "--prewarm-s", "--budget-s"), ("--check",))
    jobs = [((n, m), ["--ns", str(n), "--masks", m, "--min-repeat-s", "0.001",
                      "--budget-s", "100000", "--out", "{out}"]) for n in ns for m in masks]
    return P.run(os.path.abspath(__file__), base, jobs, workers, limit_s)


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
    ap.add_argument("--jcm-variants", default=None,
                    help="';'-separated tag=NAME=value entries: jcompilemask is timed once per "
                         "entry with that environment (impl jcm-<backend>-<tag>; tag base or "
                         "empty: jcm-<backend>), e.g. "
                         "'base=;ds1=JCOMPILEMASK_CUTE_BWD_CONFIG=ds_stages=1'")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile the CuTe kernels the run would need into the disk cache and "
                         "time nothing (compile_only.py; a machine without a GPU, "
                         "CUTE_DSL_ARCH=sm_90a): jcm (and its variants) only, no records")
    ap.add_argument("--check", action="store_true",
                    help="record check: ok | FAIL: ... for each jcompilemask record (dq, dk, dv "
                         "of the mask at N=2048, batch 1, 2 heads against the dense reference)")
    ap.add_argument("--min-repeat-s", type=float, default=timing.MIN_REPEAT_S,
                    help="shortest timed loop (s): N back-to-back calls are chosen to last it")
    ap.add_argument("--skip", default="",
                    help="IMPL:MASK pairs not to run, comma-separated (e.g. flex-fa4:causal, "
                         "where FA4 native is the peer that counts; a variant's record name, "
                         "e.g. jcm-rm:causal), so a table fits one call")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "h200-total.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, jcompilemask only (any machine, CPU included)")
    ap.add_argument("--prewarm", type=int, default=0, metavar="P",
                    help="before timing, compile every (N, mask) configuration in P parallel "
                         "worker processes (same arguments, untimed) so the timed pass loads "
                         "kernels from the disk caches (jcompilemask's CuTe cache, inductor's, "
                         "FA4's with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1): a table of "
                         "several N then fits one device call")
    ap.add_argument("--flex-eager-block-mask", default="",
                    help="comma-separated masks (MASK, or MASK@N for one length) whose "
                         "FlexAttention block mask is built uncompiled (record field "
                         "block_mask: eager; its pre_ms is the eager build), e.g. clear@8192: "
                         "its compiled build sat in ptxas past every device call at 8K, and "
                         "the eager build runs out of memory at 32K")
    ap.add_argument("--stack-after-s", type=float, default=0,
                    help="a peer record still running after this many seconds prints every "
                         "thread's Python stack (again each period) to stderr: where a "
                         "compile stalls (0: never)")
    ap.add_argument("--prewarm-s", type=float, default=240,
                    help="wall-clock limit of the prewarm phase (workers still running are "
                         "stopped; their configurations compile in the timed pass)")
    args = ap.parse_args(argv)
    try:
        variants = parse_variants(args.jcm_variants)
    except ValueError as e:
        ap.error(str(e))
    if args.xla_backward:
        os.environ["JCOMPILEMASK_CUTE_BACKWARD"] = "0"
    ns = SMOKE["ns"] if args.smoke else [int(x) for x in args.ns.split(",")]
    impls = ["jcm"] if args.smoke else args.impls.split(",")
    if args.compile_only:
        import compile_only
        compile_only.activate()
        impls, args.prewarm, args.check = [i for i in impls if i == "jcm"], 0, False
        args.budget_s = float("inf")     # a slower CPU than the device's: every record
    prewarmed = None
    if args.prewarm > 0:
        prewarmed = prewarm(argv if argv is not None else sys.argv[1:], ns,
                            args.masks.split(","), args.prewarm, args.prewarm_s)
    clocks.start()                       # sampling runs before the first timed loop
    records, t0 = [], time.time()
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    for x in skip:
        if x.count(":") != 1:
            raise SystemExit(f"--skip takes IMPL:MASK pairs (e.g. flex-fa4:causal), got {x!r}")
    device = "cpu"

    def save(rec):
        nonlocal device
        rec["elapsed_s"] = round(time.time() - t0, 1)   # where a call's budget goes
        if prewarmed is not None:
            rec["prewarmed"] = prewarmed.get((rec["n"], rec["mask"]), False)
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if args.compile_only:
            return
        try:
            import jax
            device = jax.devices()[0].device_kind
        except Exception:  # noqa: BLE001
            pass
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        merged = _merge(args.out, records)
        with open(args.out, "w") as f_:
            json.dump({"device": device, "smoke": args.smoke, "run": clocks.run_id(),
                       "records": merged}, f_, indent=1)

    def failed(impl, mask, n, e):
        print(f"{impl} {mask} {n}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"mask": mask, "n": n, "impl": impl, "error": str(e)[:300],
                **clocks.fields([])}

    for n in ns:
        for mask in args.masks.split(","):
            pairs = None
            for impl in impls:
                if impl in ("fa4-native", "jax-cudnn") and mask != "causal":
                    continue
                if f"{impl}:{mask}" in skip:
                    continue
                if impl == "jcm":
                    for tag, env in variants:
                        if f"{variant_name('jcm', tag)}:{mask}" in skip:
                            continue             # e.g. --skip jcm-rm:causal
                        if time.time() - t0 > args.budget_s:
                            print(f"budget spent; stopping before jcm {tag} {mask} {n}",
                                  flush=True)
                            break
                        with environment(env):
                            if len(variants) > 1:
                                import jax
                                jax.clear_caches()     # every variant traces afresh
                            win = []
                            try:
                                r = bench_jcm(mask, n, args.smoke, args.jcm_implementation,
                                              args.min_repeat_s, win)
                            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                                save(failed(variant_name("jcm", tag), mask, n, e))
                                continue
                            pairs = r["pairs"]
                            name = f"jcm-{r['impl']}"
                            if args.xla_backward and name == "jcm-cute":
                                name = "jcm-cute-xlabwd"
                            rec = dict(record(mask, n, variant_name(name, tag), pairs,
                                              r["pre"], r["fwd"], r["step"], r["heads"],
                                              r["head_dim"], win),
                                       preprocess=r["preprocess"])
                            switches = jcm_env()
                            if switches:
                                rec["env"] = switches
                            rec["check"] = (check_jcm(mask, args.smoke, r["impl"])
                                            if args.check else None)
                        save(rec)
                    continue
                if time.time() - t0 > args.budget_s:
                    print(f"budget spent; stopping before {impl} {mask} {n}", flush=True)
                    break
                win = []
                if args.stack_after_s > 0:        # where a peer's record hangs, if it does
                    faulthandler.dump_traceback_later(args.stack_after_s, repeat=True)
                try:
                    if pairs is None:
                        raise RuntimeError("run with impl jcm first (it counts the pairs)")
                    md = W.metadata_for(mask, n)
                    eager = W.eager_block_mask(args.flex_eager_block_mask, mask, n)
                    if impl == "fa4-native":
                        pre, f, s = bench_fa4_native(n, win, args.min_repeat_s)
                    elif impl == "jax-cudnn":
                        pre, f, s = bench_cudnn(n, win, args.min_repeat_s)
                    else:
                        pre, f, s = bench_flex(mask, n, md, impl.split("-")[1], win,
                                               args.min_repeat_s,
                                               eager_block_mask=eager)
                    rec = record(mask, n, impl, pairs, pre, f, s, windows=win)
                    if impl.startswith("flex") and eager:
                        rec["block_mask"] = "eager"
                except Exception as e:  # noqa: BLE001 - a failing impl is recorded
                    rec = failed(impl, mask, n, e)
                faulthandler.cancel_dump_traceback_later()
                save(rec)
    if args.compile_only:
        import compile_only
        print(compile_only.summary(), flush=True)
        return records
    print("\n" + table(records))
    return records


if __name__ == "__main__":
    main()
