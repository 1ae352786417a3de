"""Where one training step's GPU time goes, kernel by kernel, for jcompilemask and its peers.

    PYTHONPATH=. python3 benchmarks/kernel_times.py --mask dilated_window --n 8192 \\
        [--impls jcm,flex-fa4] [--steps 10] [--out kernels.json]
    python3 benchmarks/kernel_times.py --smoke      # CPU: tiny causal step, jcm only

One step is the benchmarks' step (``bench_total.py``): forward + backward of the workload
(bf16, 8 heads, head dim 128, 131072 tokens per batch), gradients of q, k, v for a fixed
output cotangent, built by ``bench_total.py``'s own functions (``jcm_workload``,
``flex_parts``, ``fa4_native_causal``, ``torch_step``). Each implementation runs it
``--steps`` times under a CUPTI trace after warm-up, and every GPU activity of the trace is listed with its calls and time per step:

- jcompilemask (``jcm``): ``jax.profiler.trace``, read back with
  ``jax.profiler.ProfileData`` (the ``/device:GPU:*`` planes' stream lines: the CuTe
  kernels of the custom calls and XLA's own fusions, copies and memsets; on a machine
  without a GPU, the host plane's XLA ops, so the tool runs anywhere);
- FlexAttention with the FA4 backend (``flex-fa4``) and FA4 native (``fa4-native``, causal
  only): ``torch.profiler`` with CUDA activities (the device-side events of
  ``prof.events()``). The block mask is built once, outside the trace, as a training loop
  over a fixed mask would.

It answers what Nsight Compute could not (ncu segfaults on our kernels with residual
predicates or metadata masks, so the backward of the dilated window never had a profile):
how much of ``bwd_ms`` is the backward kernel and how much the pieces around it (the row
statistic ``delta``, the zeroed dQ accumulator, dQ's conversion), beside the same pieces of
the peer. Kernel time summed per step is not the step's wall time (gaps, launch latency
and overlap are not in it); ``gpu_ms`` is that sum, ``wall_ms`` the traced steps' wall
time per step from the host.

``--jcm-variants`` (``bench_total.py``'s syntax and naming) runs jcm once per
``tag=NAME=value`` entry under that environment; the peers run once. With more than one
impl or variant, each runs in a child process of its own (``--in-process`` keeps them in
one): CUPTI serves one profiler per process, and ``jax.profiler`` traced after
``torch.profiler`` in the same process saw no GPU activity (H100, 2026-12-06).

Records (``--out``, merged by (mask, n, impl)): ``mask``, ``n``, ``impl`` (``jcm-<backend>[-tag]``
as ``bench_total.py`` names it, or the peer), ``env`` (a jcm record's ``JCOMPILEMASK_*``
variables, when any is set), ``run``, ``steps``, ``gpu_ms``, ``wall_ms``, ``sm_clock_mhz`` /
``power_w`` (benchmarks/clocks.py: the sample nearest the traced loop, which is shorter than
the 100 ms sampling period; None without a sampler),
``kernels`` (a list of ``{"name", "calls", "us"}`` per step, longest first; names cut to 400
characters), ``lines`` (the trace lines the events came from); ``smoke: true`` under
``--smoke``; an impl that fails gives ``error`` instead.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bench_total as B  # noqa: E402  (the step of each impl, built as it is timed)
import clocks  # noqa: E402  (run id shared with the other scripts of a device call)
import workloads as W  # noqa: E402
from bench_forward import _merge  # noqa: E402  (one merge)

NAME_CHARS = 400
EAGER_BLOCK_MASK = "clear@8192"   # fwdtable's default: CLEAR's compiled 8K build never ends


def summarize(events, steps: int, name_chars: int = NAME_CHARS) -> list[dict]:
    """Per-step kernel rows from ``(name, duration_us)`` pairs over ``steps`` steps, longest
    first: ``{"name", "calls", "us"}`` (calls and microseconds per step).

    >>> summarize([("k_bwd", 30.0), ("fill", 2.0), ("k_bwd", 34.0), ("fill", 2.0)], steps=2)
    [{'name': 'k_bwd', 'calls': 1.0, 'us': 32.0}, {'name': 'fill', 'calls': 1.0, 'us': 2.0}]
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    us, calls = collections.defaultdict(float), collections.Counter()
    for name, d in events:
        key = name[:name_chars]
        us[key] += float(d)
        calls[key] += 1
    rows = [dict(name=k, calls=calls[k] / steps, us=round(us[k] / steps, 3)) for k in us]
    return sorted(rows, key=lambda r: -r["us"])


# GPU-plane lines that repeat the stream lines' kernels under other names (derived views).
DERIVED_LINES = ("XLA Ops", "XLA Modules", "XLA TraceMe", "Async XLA Ops", "Steps",
                 "Launch Stats", "Source code", "Framework Ops", "Framework Name Scope",
                 "TensorFlow Ops", "TensorFlow Name Scope")


def jax_events(xplane_path: str, gpu_only: bool = False,
               lines_used: list | None = None) -> list[tuple[str, float]]:
    """``(name, duration_us)`` of every GPU activity in a ``jax.profiler`` trace file: the
    events of the ``/device:GPU:*`` planes' stream lines (``Stream #...``; the derived
    ``XLA Ops`` / ``XLA Modules`` lines would count each kernel twice). A trace without a
    GPU plane (a CPU run) gives its host XLA ops instead: the events that carry an
    ``hlo_op`` stat (there a loop's body runs inside the loop's own event, so the sum
    counts it twice: the CPU listing checks the tool, it is no measurement).
    ``gpu_only``: a trace without GPU activity raises instead (a GPU process whose
    profiler could not load CUPTI must not report host ops as kernels). A GPU plane whose
    lines are not named ``Stream ...`` gives every line but the derived ones
    (``DERIVED_LINES``). ``lines_used`` (a list) receives the names of the lines read."""
    import jax
    pd = jax.profiler.ProfileData.from_file(xplane_path)
    gpu, host, host_lines = [], [], []
    with warnings.catch_warnings():   # reading event stats warns on some jaxlib builds
        warnings.filterwarnings("ignore", message="builtin type event_stats",
                                category=DeprecationWarning)
        for plane in pd.planes:
            if plane.name.startswith("/device:GPU"):
                lines = list(plane.lines)
                streams = [ln for ln in lines if ln.name.startswith("Stream")]
                for line in streams or [ln for ln in lines if ln.name not in DERIVED_LINES]:
                    gpu += [(e.name, e.duration_ns / 1e3) for e in line.events]
                    if lines_used is not None:
                        lines_used.append(f"{plane.name} {line.name}")
            elif plane.name.startswith("/host:CPU"):
                for line in plane.lines:
                    ops = [(e.name, e.duration_ns / 1e3) for e in line.events
                           if any(st[0] == "hlo_op" for st in e.stats)]
                    host += ops
                    if ops:
                        host_lines.append(f"{plane.name} {line.name}")
    if not gpu and gpu_only:
        raise RuntimeError(f"no GPU activity in {xplane_path} (is CUPTI loadable? "
                           "jax.profiler needs it for device traces)")
    if not gpu and lines_used is not None:
        lines_used += host_lines
    return gpu if gpu else host


def trace_jax(step, steps: int):
    """Run ``step()`` (returns a JAX value) ``steps`` times under ``jax.profiler.trace``
    after one untraced warm-up call; ``(events, wall_ms per step, trace lines read, (start,
    end) of the timed loop in ``time.time()`` seconds)``."""
    import jax
    jax.block_until_ready(step())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            t, t_abs = time.perf_counter(), time.time()
            for _ in range(steps):
                out = step()
            jax.block_until_ready(out)
            wall = (time.perf_counter() - t) * 1e3 / steps
            window = (t_abs, time.time())
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {d}")
        used = []
        events = jax_events(paths[0], gpu_only=jax.default_backend() == "gpu", lines_used=used)
        return events, wall, sorted(set(used)), window


def torch_events(prof) -> list[tuple[str, float]]:
    """``(name, duration_us)`` of the device-side events (kernels, memcpy, memset) of a
    finished ``torch.profiler.profile``."""
    out = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            out.append((e.name, e.time_range.elapsed_us()))
    return out


def trace_torch(step, steps: int):
    """``step()`` ``steps`` times under ``torch.profiler`` (CPU + CUDA activities) after
    one warm-up call; ``(events, wall_ms per step, ["torch.profiler CUDA"], (start, end)
    of the timed loop in ``time.time()`` seconds)``."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t, t_abs = time.perf_counter(), time.time()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3 / steps
        window = (t_abs, time.time())
    return torch_events(prof), wall, ["torch.profiler CUDA"], window


def peer_step(mask: str, n: int, impl: str):
    """The peer's step (``flex-fa4`` or ``fa4-native``), built as ``bench_total.py`` builds
    it, the block mask once: a callable."""
    import torch
    if impl == "fa4-native":
        if mask != "causal":
            raise ValueError(f"fa4-native runs the causal mask only, not {mask!r}")
        fwd, shape = B.fa4_native_causal, (W.batch_for(n), n, W.HEADS, W.HEAD_DIM)
    elif impl == "flex-fa4":
        build, attention, shape = B.flex_parts(mask, n, W.metadata_for(mask, n), "fa4",
                                               W.eager_block_mask(EAGER_BLOCK_MASK, mask, n))
        fwd = attention(build())
    else:
        raise ValueError(f"unknown peer impl {impl!r} (flex-fa4, fa4-native)")
    return B.torch_step(torch, fwd, *B._torch_inputs(torch, "cuda", shape, n))


def measure(mask: str, n: int, impl: str, steps: int, smoke: bool = False) -> dict:
    """One record (see the module docstring); ``impl`` ``jcm`` is ``bench_total``'s
    ``jcm_workload`` step under the environment in effect."""
    clocks.start()          # SM clock / power over the traced loop (None without a sampler)
    if impl == "jcm":
        w = B.jcm_workload(mask, n, smoke)
        impl = f"jcm-{w['impl']}"
        events, wall, lines, window = trace_jax(w["step"], steps)
    else:
        events, wall, lines, window = trace_torch(peer_step(mask, n, impl), steps)
    rows = summarize(events, steps)
    rec = dict(mask=mask, n=n, impl=impl, run=clocks.run_id(), steps=steps,
               gpu_ms=round(sum(r["us"] for r in rows) / 1e3, 4), wall_ms=round(wall, 4),
               **clocks.summary([window]), kernels=rows, lines=lines)
    if smoke:
        rec["smoke"] = True
    return rec


def merge(path: str, records: list[dict]) -> None:
    """Add ``records`` to the JSON file at ``path`` (``{"records": [...]}``), replacing any
    of the same (mask, n, impl) (``bench_forward._merge``); the file's other keys (a
    ``note``) are kept."""
    merged = _merge(path, records)
    head = {}
    if os.path.exists(path):
        with open(path) as f:
            head = {k: v for k, v in json.load(f).items() if k != "records"}
    with open(path, "w") as f:
        json.dump({**head, "records": merged}, f, indent=1)
        f.write("\n")


def table(rec: dict, top: int = 12) -> str:
    """A text table of one record's ``top`` longest kernels."""
    lines = [f"{rec['impl']} {rec['mask']} n={rec['n']}: gpu {rec['gpu_ms']:.4f} ms / step "
             f"(wall {rec['wall_ms']:.4f} ms, {rec['steps']} steps)"]
    for r in rec["kernels"][:top]:
        lines.append(f"  {r['us']:10.1f} us  x{r['calls']:<5g} {r['name'][:110]}")
    return "\n".join(lines)


def variant_entry(tag: str, env: dict) -> str:
    """The ``--jcm-variants`` entry of one parsed ``(tag, env)`` (``bench_total.parse_variants``'s
    inverse).

    >>> variant_entry("hi", {"JCOMPILEMASK_CUTE_BWD_CONFIG": "heads_inner=1"})
    'hi=JCOMPILEMASK_CUTE_BWD_CONFIG=heads_inner=1'
    >>> variant_entry("base", {})
    'base='
    """
    return f"{tag}=" + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())


def run_child(args, impl: str, tag: str, env: dict) -> dict:
    """One impl / variant measured in a child process (``--in-process`` there), its table on
    this process's stdout and its record merged into ``--out``; a child that fails or prints
    no record gives an ``error`` record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rec.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--mask", args.mask, "--n", str(args.n),
               "--impls", impl, "--steps", str(args.steps), "--out", out, "--in-process"]
        if impl == "jcm" and (tag or env):
            cmd += ["--jcm-variants", variant_entry(tag or "base", env)]
        if args.smoke:
            cmd.append("--smoke")
        # One run id for every child (each would otherwise take its own start time); the
        # child writes to this process's standard output, after what is printed so far.
        sys.stdout.flush()
        rc = subprocess.call(cmd, env=dict(os.environ, JCM_RUN_ID=clocks.run_id()))
        try:
            with open(out) as f:
                rec = json.load(f)["records"][0]
        except (OSError, ValueError, IndexError, KeyError):
            rec = error_record(args.mask, args.n, impl, tag,
                               f"child process exited {rc} without a record")
    if args.out:
        merge(args.out, [rec])
    return rec


def error_record(mask: str, n: int, impl: str, tag: str, error: str) -> dict:
    """The record of an impl / variant that failed (printed as JSON)."""
    rec = dict(mask=mask, n=n, impl=B.variant_name(impl, tag), run=clocks.run_id(), error=error)
    print(json.dumps(rec), flush=True)
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mask", default="dilated_window")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--impls", default="jcm,flex-fa4",
                    help="comma-separated: jcm, flex-fa4, fa4-native (causal only)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON file the records are merged into")
    ap.add_argument("--jcm-variants", default=None,
                    help="';'-separated tag=NAME=value entries, as bench_total.py's: jcm runs "
                         "once per entry under that environment (impl jcm-<backend>-<tag>, "
                         "with its env), e.g. 'base=;hi=JCOMPILEMASK_CUTE_BWD_CONFIG=heads_inner=1'")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny causal step, jcm only (any machine, CPU included)")
    ap.add_argument("--in-process", action="store_true",
                    help="run every impl / variant in this process (default: one child process "
                         "each when there are several: CUPTI takes one profiler per process, so "
                         "jax.profiler after torch.profiler finds no GPU activity)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    try:
        variants = B.parse_variants(args.jcm_variants)
    except ValueError as e:
        ap.error(str(e))
    impls = ["jcm"] if args.smoke else [x.strip() for x in args.impls.split(",") if x.strip()]
    bad = [i for i in impls if i not in ("jcm", "flex-fa4", "fa4-native")]
    if bad:
        ap.error(f"--impls: unknown {bad} (jcm, flex-fa4, fa4-native)")
    mask = "causal" if args.smoke else args.mask
    n = B.SMOKE["ns"][0] if args.smoke else args.n
    known = W.MASKS + W.MASKS_16 + W.PROBES + W.MASKS_CLASSES
    if mask not in known:
        ap.error(f"--mask: unknown {mask!r} (one of {', '.join(known)})")
    runs = [(impl, tag, env) for impl in impls
            for tag, env in (variants if impl == "jcm" else [("", {})])]
    if len(runs) > 1 and not args.in_process:
        return [run_child(args, impl, tag, env) for impl, tag, env in runs]
    records = []
    for impl, tag, env in runs:
        with B.environment(env):
            try:
                if len(variants) > 1 and impl == "jcm":
                    import jax
                    jax.clear_caches()     # every variant traces afresh
                rec = measure(mask, n, impl, args.steps, smoke=args.smoke)
                rec["impl"] = B.variant_name(rec["impl"], tag)
                if impl == "jcm" and B.jcm_env():
                    rec["env"] = B.jcm_env()
            except Exception as e:  # noqa: BLE001 - one failed impl must not lose the others
                rec = error_record(mask, n, impl, tag,
                                   f"{type(e).__name__}: " + " ".join(str(e).split())[:400])
            else:
                print(table(rec), flush=True)
        records.append(rec)
        if args.out:
            merge(args.out, [rec])
    return records


if __name__ == "__main__":
    main()
