"""Markdown tables and SVG plots of everything in ``benchmarks/results/`` (no GPU needed).

    python3 benchmarks/report.py [--results benchmarks/results]

Reads the JSON records the benchmark scripts write (docs/workloads.md naming: ``mask``, ``n``,
``impl`` and ``fwd_ms`` / ``fwd_tflops`` or ``ms``) and writes, beside them:

- ``REPORT.md``: forward TF/s per workload and N with every implementation measured, and
  the ratio of jcompilemask to each peer and to the best peer; preprocess times with the
  ratio of FlexAttention's ``create_block_mask`` to the TileLang kernel; CPU lowering.
- ``forward.svg`` (TF/s against N, one panel per mask) and ``preprocess.svg`` (ms against
  N, log scale).

Peers may come from separate runs on the same machine and day (docs/workloads.md); the
report says which file each figure came from, and where a peer was measured twice it
keeps the figure from the run that also measured jcompilemask (``dedupe``).
Only the Python standard library is used, so the report can be rebuilt anywhere.
"""
from __future__ import annotations

import argparse
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
MASKS = ("causal", "hstu", "shared_prompt", "clear")
OURS_FWD = "jcm-cute"
OURS_PRE = "jcm-tilelang"
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf",
          "#7f7f7f"]


def _records(path):
    """Records of a results file: a list, or a dict holding ``records`` / ``results``."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):
        return data
    return data.get("records", data.get("results", []))


def load(results_dir):
    """(forward, preprocess, lowering, total, variants, head_dims) records, each tagged
    with the file it came from (``source``)."""
    fwd, pre, low, total, variants, hdims = [], [], [], [], [], []
    for name in sorted(os.listdir(results_dir)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(results_dir, name)) as f:
            head = json.load(f)
        if isinstance(head, dict) and head.get("smoke"):
            continue                    # CPU smoke runs of the scripts are not results
        for r in _records(os.path.join(results_dir, name)):
            if "error" in r:
                continue
            r = dict(r, source=name)
            if "total_tflops" in r:
                total.append(r)
            elif "head_dim" in r and "bwd_ms" in r:
                hdims.append(r)            # bench_head_dims: fwd / bwd ms per head-dim config
            elif "head_dim" in r and "fwd_tflops" in r:
                variants.append(r)         # bench_cute_variants: other head dims / cap
            elif "fwd_tflops" in r:
                fwd.append(r)
            elif "instantiate_ms_median" in r:
                low.append(r)
            elif "ms" in r:
                pre.append(r)
    return fwd, pre, low, total, variants, hdims


def load_train(results_dir):
    """Records of the end-to-end training files (``*train-e2e*.json``, train_e2e.py), the
    out-of-memory and skipped ones included, each tagged with its ``source``."""
    out = []
    for name in sorted(os.listdir(results_dir)):
        if not (name.endswith(".json") and "train-e2e" in name):
            continue
        with open(os.path.join(results_dir, name)) as f:
            head = json.load(f)
        if isinstance(head, dict) and head.get("smoke"):
            continue
        out += [dict(r, source=name) for r in _records(os.path.join(results_dir, name))]
    return out


def train_table(train):
    """Tokens/s per (run, model, N, workload): jcm against every comparison of the same
    run (cuDNN causal is the right mask only on ``causal``: elsewhere a speed-of-light
    reference, marked), the attention share of jcm's step, the compiled step's memory."""
    by = {}
    for r in train:
        by.setdefault((r.get("run", "?"), r["model"], r["n"], r["workload"]), {})[r["impl"]] = r
    rest = {(k[0], k[1], k[2]): v["no-attention"] for k, v in by.items() if "no-attention" in v}
    rows = ["| run | model | N | workload | jcm tok/s (attention ms) | cuDNN causal tok/s | "
            "jcm / cuDNN | dense-mask XLA | peak GiB (jcm) |",
            "|---|---|---|---|---|---|---|---|---|"]

    def tok(r):
        if r is None:
            return "-"
        if r.get("status") != "ok":
            return r.get("status", "error")
        return f"{r['tokens_per_s']:,.0f}"
    for (run, model, n, wl), impls in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                            WORKLOAD_ORDER.get(kv[0][3], 9))):
        if set(impls) == {"no-attention"}:
            continue
        j, c, d = impls.get("jcm"), impls.get("cudnn-causal"), impls.get("xla-dense")
        att = f" ({j['attention_ms']:.0f})" if j and j.get("attention_ms") is not None else ""
        ratio = (f"{j['tokens_per_s'] / c['tokens_per_s']:.2f}x" if j and c and
                 j.get("status") == c.get("status") == "ok" else "-")
        cud = tok(c) + (" [wrong mask]" if c and c.get("status") == "ok" and wl != "causal" else "")
        dense = tok(d)
        if j and d and j.get("status") == d.get("status") == "ok":
            dense += f" ({j['tokens_per_s'] / d['tokens_per_s']:.2f}x)"
        peak = f"{j['peak_gib']:.1f}" if j and j.get("peak_gib") is not None else "-"
        rows.append(f"| {run} | {model} | {_label(n)} | {wl} | {tok(j)}{att} | {cud} | {ratio} | "
                    f"{dense} | {peak} |")
    notes = [f"rest of the step without attention, {model} {_label(n)} (run {run}): "
             f"{r['step_ms']:.0f} ms" for (run, model, n), r in sorted(rest.items())
             if r.get("status") == "ok"]
    return "\n".join(rows) + ("\n\n" + "; ".join(notes) + "." if notes else "")


WORKLOAD_ORDER = {"document": 0, "hstu": 1, "shared_prompt": 2, "causal": 3}


def _by_run_config(hdims):
    """{(run, config, n): {impl: record}} of bench_head_dims records."""
    by = {}
    for r in hdims:
        by.setdefault((r.get("run") or r["source"], r["config"], r["n"]), {})[r["impl"]] = r
    return by


def _newest_first(by):
    return sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2]), reverse=True)


def head_dims_table(hdims, ours="jcm-cute"):
    """Backward ms per head-dim configuration beside the peers of the same run, newest run
    first; speed = the fastest peer's bwd ms / ours (>= 0.9 is issue 15's line), and the soft
    cap's cost over the same run's no-cap D 128."""
    head = ["run", "config (D/Dv, cap)", "N", f"{ours} fwd / bwd ms (MHz)", "peers bwd ms",
            "speed vs fastest peer", "cap cost (bwd)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = _by_run_config(hdims)
    for (run, cfg, n), recs in _newest_first(by):
        o = recs.get(ours)
        if o is None:
            continue
        peers = {i: r for i, r in recs.items()
                 if i not in (ours, "jcm-xla") and r.get("bwd_ms")}     # xla: its own table
        fast = [r["bwd_ms"] for i, r in peers.items() if not i.startswith("jcm")]
        cap = ""
        base = by.get((run, "d128", n), {}).get(ours)
        if o.get("softcap") and base is not None and o["head_dim"] == 128:
            cap = f"+{100 * (o['bwd_ms'] / base['bwd_ms'] - 1):.0f}%"
        mhz = f" ({o['sm_clock_mhz']:.0f})" if o.get("sm_clock_mhz") else ""
        dims = f"{o['head_dim']}/{o['head_dim_v']}"
        if o.get("softcap"):
            dims += f", cap {o['softcap']:g}"
        named = ", ".join(f"{i} {r['bwd_ms']:.2f}" for i, r in sorted(peers.items())) or "-"
        speed = f"{min(fast) / o['bwd_ms']:.2f}x" if fast else "-"
        lines.append(f"| {run} | {cfg} ({dims}) | {_label(n)} | {o['fwd_ms']:.2f} / "
                     f"{o['bwd_ms']:.2f}{mhz} | {named} | {speed} | {cap} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def xla_backward_table(hdims):
    """The ``xla`` backward on the GPU per head-dim configuration beside the fastest peer and
    ``jcm-cute`` of the same run (issue 15: what a configuration on the fallback path pays),
    newest run first; "x peer" = xla bwd ms / the fastest peer's."""
    head = ["run", "config (D/Dv, cap)", "N", "xla fwd / bwd ms", "jcm-cute bwd ms",
            "fastest peer bwd ms", "x peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (run, cfg, n), recs in _newest_first(_by_run_config(hdims)):
        x = recs.get("jcm-xla")
        if x is None or not x.get("bwd_ms"):
            continue
        peers = {i: r["bwd_ms"] for i, r in recs.items() if not i.startswith("jcm") and r.get("bwd_ms")}
        ours = recs.get("jcm-cute", {}).get("bwd_ms")
        dims = f"{x['head_dim']}/{x['head_dim_v']}"
        if x.get("softcap"):
            dims += f", cap {x['softcap']:g}"
        ours_s = f"{ours:.2f}" if ours else "-"
        if peers:
            name = min(peers, key=peers.get)
            peer_s, ratio = f"{name} {peers[name]:.2f}", f"{x['bwd_ms'] / peers[name]:.1f}x"
        else:
            peer_s = ratio = "-"
        lines.append(f"| {run} | {cfg} ({dims}) | {_label(n)} | {x['fwd_ms']:.2f} / "
                     f"{x['bwd_ms']:.2f} | {ours_s} | {peer_s} | {ratio} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def variants_table(variants):
    ns = sorted({r["n"] for r in variants})
    labels = sorted({r["impl"] for r in variants}, key=lambda i: (
        next(r["head_dim"] for r in variants if r["impl"] == i), i))
    cell = {(r["impl"], r["n"]): r["fwd_tflops"] for r in variants}
    head = ["variant (causal)"] + [f"{_label(n)} TF/s" for n in ns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i in labels:
        lines.append("| " + " | ".join([i] + [f"{cell[i, n]:.0f}" if (i, n) in cell else ""
                                             for n in ns]) + " |")
    return "\n".join(lines)


def same_run_backward_table(total, ours="jcm-cute"):
    """Backward ms of ours beside every peer measured in the same device call (same
    ``run``), newest run first: the only comparison the notes quote."""
    runs = {}
    for r in total:
        if r.get("run") and r.get("bwd_ms") is not None:
            runs.setdefault(r["run"], []).append(r)
    head = ["run", "mask", "N", f"{ours} bwd ms (MHz)", "peer", "peer bwd ms (MHz)", "ratio",
            f"{ours} total TF/s", "peer total TF/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mhz = lambda r: f" ({r['sm_clock_mhz']:.0f})" if r.get("sm_clock_mhz") else ""  # noqa: E731
    for run in sorted(runs, reverse=True):
        recs = runs[run]
        for o in (r for r in recs if r["impl"] == ours):
            for p in (r for r in recs if r["impl"] != ours and not r["impl"].startswith("jcm")
                      and (r["mask"], r["n"]) == (o["mask"], o["n"])):
                row = (f"| {run} | {o['mask']} | {_label(o['n'])} | {o['bwd_ms']:.2f}{mhz(o)} | "
                             f"{p['impl']} | {p['bwd_ms']:.2f}{mhz(p)} | {o['bwd_ms'] / p['bwd_ms']:.3f} | "
                             f"{o['total_tflops']:.0f} | {p['total_tflops']:.0f} |")
                if row not in lines:           # a record kept in two files counts once
                    lines.append(row)
    return "\n".join(lines) if len(lines) > 2 else ""


def dedupe(records, ours):
    """One record per (mask, n, impl). A figure measured twice (a peer in the same run as
    ours and again in a peers-only run) keeps the one of the same run as ours for that
    (mask, n) — the same ``run`` id (``clocks.py``; several scripts of one device call
    share it) or, for records without one, the same file — so the ratio is the fairest
    (the card's clock moves between runs); otherwise the newest run (records taken in
    ``run`` order, those without a timestamp first: the result files list the newest run
    first)."""
    stamp = lambda r: r["run"] if str(r.get("run") or "")[:1].isdigit() else ""   # noqa: E731
    records = sorted(records, key=stamp)
    our = {(r["mask"], r["n"]): r for r in records if r["impl"] == ours}
    pick = {}
    for r in records:
        key = (r["mask"], r["n"], r["impl"])
        old = pick.get(key)
        ref = our.get(key[:2])
        if old is None or ref is None or not _same_run(old, ref):
            pick[key] = r
    return list(pick.values())


def _same_run(a, b):
    """Same device call: the same ``run`` id; records without one (older files) count as
    one run per file, and never as the run of a record that has an id."""
    if a.get("run") or b.get("run"):
        return a.get("run") == b.get("run")
    return a["source"] == b["source"]


def _impl_order(impls, ours):
    return [ours] * (ours in impls) + sorted(i for i in impls if i != ours)


def _label(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def forward_table(fwd, value="fwd_tflops", ours=OURS_FWD):
    """Markdown: TF/s per (mask, n) and impl, then ours / peer ratios."""
    cell = {(r["mask"], r["n"], r["impl"]): r for r in fwd}
    impls = _impl_order({r["impl"] for r in fwd}, ours)
    peers = [i for i in impls if i != ours]
    head = ["mask", "N"] + impls + [f"{ours} / {p}" for p in peers] + ["vs best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in MASKS:
        for n in sorted({r["n"] for r in fwd if r["mask"] == m}):
            row = [m, _label(n)]
            vals = {i: cell[m, n, i][value] for i in impls if (m, n, i) in cell}
            row += [f"{vals[i]:.0f}" if i in vals else "" for i in impls]
            mine = vals.get(ours)
            row += [f"{mine / vals[p]:.2f}" if mine and p in vals else "" for p in peers]
            best = max((vals[p] for p in peers if p in vals), default=None)
            row.append(f"{mine / best:.2f}" if mine and best else "")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def preprocess_table(pre):
    cell = {(r["mask"], r["n"], r["impl"]): r["ms"] for r in pre}
    impls = _impl_order({r["impl"] for r in pre}, OURS_PRE)
    others = [i for i in impls if i != OURS_PRE]
    head = ["mask", "N"] + [f"{i} (ms)" for i in impls] + [f"{i} / {OURS_PRE}" for i in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in MASKS:
        for n in sorted({r["n"] for r in pre if r["mask"] == m}):
            vals = {i: cell[m, n, i] for i in impls if (m, n, i) in cell}
            row = [m, _label(n)] + [f"{vals[i]:.4g}" if i in vals else "" for i in impls]
            ours = vals.get(OURS_PRE)
            row += [f"{vals[o] / ours:.1f}x" if ours and o in vals else "" for o in others]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def lowering_table(low):
    head = ["mask", "N", "K", "Kc", "compile (s)", "instantiate, median (ms)", "within budget"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in low:
        lines.append("| " + " | ".join(str(x) for x in (
            r["mask"], _label(r["n"]), r.get("K", ""), r.get("Kc", ""), r.get("compile_s", ""),
            r["instantiate_ms_median"], r.get("within_budget", ""))) + " |")
    return "\n".join(lines)


# -- SVG --------------------------------------------------------------------------------
def _esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def svg_panels(records, value, title, ylabel, *, log_y=False, ours=None):
    """One panel per mask: ``value(record)`` against N (log2 axis), a line per impl."""
    masks = [m for m in MASKS if any(r["mask"] == m for r in records)]
    if not masks:
        return None
    impls = _impl_order({r["impl"] for r in records}, ours) if ours else sorted(
        {r["impl"] for r in records})
    color = {i: COLORS[k % len(COLORS)] for k, i in enumerate(impls)}
    pw, ph, ml, mt, mb = 300, 220, 55, 40, 45
    width = ml + len(masks) * (pw + 20) + 170
    height = mt + ph + mb
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{ml}" y="16" font-size="14">{_esc(title)}</text>']
    ys = [value(r) for r in records if value(r) > 0]
    if log_y:
        lo, hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
        hi = hi if hi > lo else lo + 1
        ticks = [10.0 ** e for e in range(lo, hi + 1)]
        ymap = lambda v: mt + ph - (math.log10(v) - lo) / (hi - lo) * ph  # noqa: E731
    else:
        top = max(ys) * 1.1
        step = 10 ** math.floor(math.log10(top / 4))
        step *= 5 if top / step > 20 else (2 if top / step > 8 else 1)
        ticks = [step * j for j in range(int(top / step) + 1)]
        top = max(top, ticks[-1])
        ymap = lambda v: mt + ph - v / top * ph  # noqa: E731
    for p, m in enumerate(masks):
        x0 = ml + p * (pw + 20)
        rs = [r for r in records if r["mask"] == m and value(r) > 0]
        ns = sorted({r["n"] for r in rs})
        lx = [math.log2(n) for n in ns]
        span = (max(lx) - min(lx)) or 1.0
        xmap = lambda n: x0 + 15 + (math.log2(n) - min(lx)) / span * (pw - 30)  # noqa: E731
        out.append(f'<rect x="{x0}" y="{mt}" width="{pw}" height="{ph}" fill="none" '
                   f'stroke="#888"/>')
        out.append(f'<text x="{x0 + pw / 2}" y="{mt - 6}" text-anchor="middle">{_esc(m)}</text>')
        for t in ticks:
            y = ymap(t)
            out.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{y:.1f}" y2="{y:.1f}" '
                       f'stroke="#eee"/>')
            if p == 0:
                out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>')
        for n in ns:
            out.append(f'<text x="{xmap(n):.1f}" y="{mt + ph + 14}" '
                       f'text-anchor="middle">{_label(n)}</text>')
        for i in impls:
            pts = sorted((r["n"], value(r)) for r in rs if r["impl"] == i)
            if not pts:
                continue
            xy = " ".join(f"{xmap(n):.1f},{ymap(v):.1f}" for n, v in pts)
            w = 2.5 if i == ours else 1.5
            if len(pts) > 1:
                out.append(f'<polyline points="{xy}" fill="none" stroke="{color[i]}" '
                           f'stroke-width="{w}"/>')
            for n, v in pts:
                out.append(f'<circle cx="{xmap(n):.1f}" cy="{ymap(v):.1f}" r="3" '
                           f'fill="{color[i]}"><title>{_esc(i)} {m} {_label(n)}: '
                           f'{v:.4g}</title></circle>')
    out.append(f'<text x="14" y="{mt + ph / 2}" transform="rotate(-90 14 {mt + ph / 2})" '
               f'text-anchor="middle">{_esc(ylabel)}</text>')
    out.append(f'<text x="{ml + len(masks) * (pw + 20) / 2}" y="{height - 8}" '
               f'text-anchor="middle">N (tokens per sequence)</text>')
    lx0 = ml + len(masks) * (pw + 20) + 5
    for k, i in enumerate(impls):
        y = mt + 10 + 16 * k
        out.append(f'<line x1="{lx0}" x2="{lx0 + 18}" y1="{y}" y2="{y}" stroke="{color[i]}" '
                   f'stroke-width="2.5"/>')
        out.append(f'<text x="{lx0 + 24}" y="{y + 4}">{_esc(i)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def build(results_dir):
    """Write REPORT.md, forward.svg and preprocess.svg; returns the paths written."""
    fwd, pre, low, total, variants, hdims = load(results_dir)
    fwd, pre = dedupe(fwd, OURS_FWD), dedupe(pre, OURS_PRE)
    # jcm-cute when present (kernel variants such as jcm-cute-st-dqb are extra columns)
    ours_total = ("jcm-cute" if any(r["impl"] == "jcm-cute" for r in total) else
                  next((r["impl"] for r in total if r["impl"].startswith("jcm-")), None))
    same_run = same_run_backward_table(total) if total else ""   # before dedupe: every run
    total = dedupe(total, ours_total)
    written = []
    parts = ["# Benchmark report",
             "",
             "Generated by `python3 benchmarks/report.py` from the JSON files in this folder "
             "(docs/workloads.md: bf16, 8 heads, head dim 128, 131072 tokens per batch; forward "
             "FLOPs = 4 * head_dim * heads * visible pairs). Do not edit by hand.", ""]
    if fwd:
        srcs = sorted({(r["impl"], r["source"]) for r in fwd})
        parts += ["## Forward TF/s", "", forward_table(fwd), "",
                  "Sources: " + "; ".join(f"`{i}` from {s}" for i, s in srcs) + ".", "",
                  "![forward](forward.svg)", ""]
        path = os.path.join(results_dir, "forward.svg")
        with open(path, "w") as f:
            f.write(svg_panels(fwd, lambda r: r["fwd_tflops"], "Forward, bf16, D = 128",
                               "TF/s", ours=OURS_FWD))
        written.append(path)
    if variants:
        parts += ["## CuTe forward variants (head dim, dtype, soft cap, stages)", "",
                  variants_table(variants), ""]
    if total:
        if same_run:
            parts += ["## Backward beside the peers of the same device call", "", same_run, ""]
        parts += ["## Training step: total TF/s = 3.5 x forward FLOPs / (preprocess + "
                  "forward + backward)", "", forward_table(total, "total_tflops", ours_total),
                  "", "Per-pass times (ms): " + "; ".join(
                      f"{r['impl']} {r['mask']} {_label(r['n'])}: pre {r['pre_ms']}, fwd "
                      f"{r['fwd_ms']}, bwd {r['bwd_ms']}" for r in total) + ".", ""]
    if hdims:
        parts += ["## Backward per head-dim configuration (causal; bench_head_dims.py)", "",
                  head_dims_table(hdims), ""]
        xla = xla_backward_table(hdims)
        if xla:
            parts += ["### The `xla` backward on the GPU (the fallback path), same runs", "", xla, ""]
    if pre:
        parts += ["## Preprocess (both descriptors), ms", "", preprocess_table(pre), ""]
        notes = sorted({f"{r['impl']}: {r['note']}" for r in pre if r.get("note")})
        parts += [f"Note — {n}" for n in notes] + ([""] if notes else [])
        parts += ["![preprocess](preprocess.svg)", ""]
        path = os.path.join(results_dir, "preprocess.svg")
        with open(path, "w") as f:
            f.write(svg_panels(pre, lambda r: r["ms"], "Mask preprocess, both descriptors",
                               "ms (log)", log_y=True, ours=OURS_PRE))
        written.append(path)
    if low:
        parts += ["## Lowering and jnp instantiate on the CPU", "", lowering_table(low), ""]
    train = load_train(results_dir)
    if train:
        parts += ["## End-to-end training (train_e2e.py: Qwen3-style decoder, AdamW, remat, "
                  "32768 tokens a step)", "", train_table(train), ""]
        parts += [f"![training]({os.path.splitext(n)[0]}.png)" for n in
                  sorted({r["source"] for r in train})
                  if os.path.exists(os.path.join(results_dir, os.path.splitext(n)[0] + ".png"))]
        parts += [""]
    path = os.path.join(results_dir, "REPORT.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return [path] + written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    for p in build(args.results):
        print("wrote", p)


if __name__ == "__main__":
    main()
