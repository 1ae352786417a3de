"""The decisions of one ``scripts/h200.sh quick`` call, read from its result files.

``quick`` times the open candidates of issues 14-16 beside their peers in one short device
call; this prints, per part, the ratio each decision rests on (every figure from the same
run):

- ``fwd``: forward speed against FA4 native, ``fa4 ms / ours ms`` (>= 1.0 passes issue 14's
  causal line), per jcompilemask variant;
- ``cap``: the soft cap's cost at D 128, ``capped ms / uncapped ms`` of our default
  (<= 1.15 passes issue 15's line), per capped variant, with FA4's capped backward beside;
- ``d192``: D 192 / 128 backward, ``fa4 ms / ours ms`` for FA4 at its own tile and forced to
  64 x 64 (if the forced FA4 is about as slow as ours, the tile width is the gap);
- ``masks``: issue 16's masks, each variant's backward and step against the default.

    python benchmarks/quick_summary.py DIR     # DIR: the call's $OUT (files_at)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import _records  # noqa: E402  (the results-file reader every report shares)


def _ms(r, key):
    v = r.get(key)
    return v if isinstance(v, (int, float)) and v > 0 else None


def _ratio(a, b):
    return f"{a / b:.3f}" if a is not None and b is not None else "-"


def forward_lines(recs):
    """``fa4 / ours`` forward ms per (mask, n, variant)."""
    out = []
    keys = sorted({(r["mask"], r["n"]) for r in recs})
    for mask, n in keys:
        here = [r for r in recs if (r["mask"], r["n"]) == (mask, n)]
        fa4 = next((_ms(r, "fwd_ms") for r in here if r["impl"] == "fa4-native"), None)
        for r in here:
            if r["impl"].startswith("jcm"):
                out.append(f"fwd {mask} {n}: {r['impl']} {_ms(r, 'fwd_ms')} ms, "
                           f"FA4 / ours {_ratio(fa4, _ms(r, 'fwd_ms'))}")
    return out


def cap_lines(recs):
    """Capped / uncapped backward ms at D 128 (our default uncapped as the base); an
    uncapped variant (``h200.sh dkl``'s ``dkln``) against the uncapped default, and a capped
    variant also against its own uncapped twin where the run has one (the twin's name: the
    capped variant's name + ``n``), for a switch that would apply with and without a cap."""
    out = []
    for n in sorted({r["n"] for r in recs}):
        here = [r for r in recs if r["n"] == n and r.get("mask", "causal") == "causal"]
        uncapped = {r["impl"]: _ms(r, "bwd_ms") for r in here if r.get("config") == "d128"}
        base = uncapped.get("jcm-cute")
        fa4_cap = next((_ms(r, "bwd_ms") for r in here
                        if r.get("config") == "d128cap" and r["impl"] == "fa4-native"), None)
        for r in here:
            if r.get("config") == "d128cap" and r["impl"].startswith("jcm"):
                twin = uncapped.get(r["impl"] + "n") if r["impl"] != "jcm-cute" else None
                out.append(f"cap {n}: {r['impl']} {_ms(r, 'bwd_ms')} ms, cost "
                           f"{_ratio(_ms(r, 'bwd_ms'), base)} (line 1.15), "
                           f"FA4 capped / ours {_ratio(fa4_cap, _ms(r, 'bwd_ms'))}"
                           + (f", cost against {r['impl']}n {_ratio(_ms(r, 'bwd_ms'), twin)}"
                              if twin else ""))
        for impl, ms in sorted(uncapped.items()):
            if impl.startswith("jcm") and impl != "jcm-cute":
                out.append(f"cap {n}: uncapped {impl} {ms} ms, {_ratio(ms, base)} of the default")
    return out


def d192_lines(recs):
    """D 192 / 128: each FA4 tile's backward ms against ours."""
    out = []
    for n in sorted({r["n"] for r in recs}):
        here = {r["impl"]: _ms(r, "bwd_ms") for r in recs
                if r["n"] == n and r.get("config") == "d192"}
        ours = here.get("jcm-cute")
        for impl, ms in sorted(here.items()):
            if impl.startswith("fa4"):
                out.append(f"d192 {n}: {impl} {ms} ms, {impl} / ours {_ratio(ms, ours)} "
                           f"(ours {ours} ms; line 0.9)")
    return out


def mask_lines(recs):
    """Each variant's backward and step ms against the default on the same mask and n."""
    out = []
    for mask, n in sorted({(r["mask"], r["n"]) for r in recs}):
        here = [r for r in recs if (r["mask"], r["n"]) == (mask, n)]
        base = next((r for r in here if r["impl"] == "jcm-cute"), None) or {}
        for r in here:
            if r["impl"] != "jcm-cute":
                out.append(f"masks {mask} {n}: {r['impl']} bwd {_ms(r, 'bwd_ms')} ms "
                           f"({_ratio(_ms(r, 'bwd_ms'), _ms(base, 'bwd_ms'))} of the default), "
                           f"step {_ratio(_ms(r, 'step_ms'), _ms(base, 'step_ms'))}")
    return out


def summary(out_dir):
    """The summary lines of one call's directory (parts whose file is missing say so)."""
    parts = [
        ("fwd", "h200-fwd-quick.json", forward_lines),
        ("cap", "h200-head-dims-cap.json", cap_lines),
        ("d192", "h200-head-dims-d192.json", d192_lines),
        ("masks", "h200-quick-masks.json", mask_lines),
    ]
    lines = []
    for name, fname, fn in parts:
        path = os.path.join(out_dir, fname)
        recs = _records(path) if os.path.exists(path) else []
        lines += fn(recs) if recs else [f"{name}: no records ({fname} missing or empty)"]
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print("\n".join(summary(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
