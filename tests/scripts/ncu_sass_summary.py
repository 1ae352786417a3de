"""Digest ncu's per-instruction SASS page (``ncu -i R.ncu-rep --page source --csv
--print-source sass``) of one or two kernels: per opcode, executed instructions and stall
samples; stall samples per reason; the opcode mix of the loop body that runs the most
(its sites per visited tile); the hottest instructions. Two files side by side (ours
and FA4's backward, ``h200.sh prof8``) show where the sample counts differ.

    python3 tests/scripts/ncu_sass_summary.py ours.csv [peer.csv] [--top 25] [--reason barrier]

``--reason R`` adds, per file, the sites with the most samples of stall reason R, each
with the instruction before it: ncu charges a wait to the instruction that cannot issue,
so a barrier's samples sit on the instruction after its ``BAR.SYNC`` and a scoreboard
wait's after the ``DEPBAR`` / on the first use of a load (session 39's reading of the
dilated window's backward: which barrier the consumers wait at, and for whom).

Columns are found by name fragments (ncu versions differ): the SASS text ("Source"), the
executed-instruction count ("Instructions Executed"), all stall samples ("Warp Stall
Sampling (All"), and per-reason sample columns (a header containing "stall").
"""
import collections
import csv
import gzip
import re
import sys


def _open(path):
    return gzip.open(path, "rt", errors="replace") if path.endswith(".gz") else open(path, errors="replace")


def _num(text):
    text = (text or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def load(path):
    """[(sass, executed, samples, {reason: samples})] of one CSV page."""
    with _open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    rows = list(csv.reader(lines))
    # ncu writes a "Kernel Name" line before the header: the header is the first row
    # that names the SASS column.
    start = next((i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r)), None)
    if start is None:
        raise SystemExit(f"{path}: no CSV header with a 'Source' column")
    head, rows = rows[start], rows[start:]

    def col(*frags):
        for i, h in enumerate(head):
            if all(fr.lower() in h.lower() for fr in frags):
                return i
        return None

    src = col("source")
    ex = col("instructions executed")
    allc = col("warp stall sampling (all")
    reasons = {i: re.sub(r".*stall(ed)?_?", "", h, flags=re.I).strip(" ()") or h
               for i, h in enumerate(head) if "stall" in h.lower() and "sampling" not in h.lower()}
    out = []
    for r in rows[1:]:
        if src is None or src >= len(r):
            continue
        out.append((r[src].strip(), _num(r[ex]) if ex is not None else 0.0,
                    _num(r[allc]) if allc is not None else 0.0,
                    {name: _num(r[i]) for i, name in reasons.items() if i < len(r) and _num(r[i])}))
    return out


def opcode(sass):
    s = re.sub(r"^@!?U?P\w+\s+", "", sass)
    return s.split(" ")[0] if s else "?"


def summarise(rows):
    by_op = collections.defaultdict(lambda: [0.0, 0.0])
    by_reason = collections.Counter()
    for sass, ex, samples, reasons in rows:
        op = opcode(sass)
        by_op[op][0] += ex
        by_op[op][1] += samples
        by_reason.update(reasons)
    return by_op, by_reason


def tile_body(rows):
    """(count, {opcode: sites}) of the loop body that runs the most: the instruction sites
    sharing the execution count with the largest count x sites (in a kernel with one
    steady-state loop, its sites per visited tile and warp)."""
    by_count = collections.defaultdict(list)
    for sass, ex, _, _ in rows:
        if ex:
            by_count[ex].append(opcode(sass))
    count, ops = max(by_count.items(), key=lambda kv: kv[0] * len(kv[1]))
    return count, collections.Counter(ops)


def reason_sites(rows, reason, top):
    """The ``top`` sites with the most samples of stall ``reason``: (index, samples, share
    of all samples, executed, the SASS, the SASS of the instruction before it)."""
    total = sum(r[2] for r in rows) or 1.0
    hot = sorted(range(len(rows)), key=lambda i: -rows[i][3].get(reason, 0.0))[:top]
    return [(i, rows[i][3].get(reason, 0.0), rows[i][3].get(reason, 0.0) / total, rows[i][1],
             rows[i][0], rows[i - 1][0] if i else "")
            for i in hot if rows[i][3].get(reason, 0.0) > 0]


def _option(argv, name, default):
    if name in argv:
        i = argv.index(name)
        return argv[i + 1], argv[:i] + argv[i + 2:]
    return default, argv


def main(argv):
    top, argv = _option(argv, "--top", 25)
    top = int(top)
    reason, argv = _option(argv, "--reason", None)
    files = argv[:2]
    data = [load(p) for p in files]
    sums = [summarise(rows) for rows in data]
    ops = sorted({op for by_op, _ in sums for op in by_op},
                 key=lambda op: -max(s[0].get(op, [0, 0])[1] for s in sums))
    tot = [sum(v[1] for v in s[0].values()) or 1.0 for s in sums]
    print("opcode".ljust(28) + "".join(f"| {p[-28:]:>28} exec / % samples " for p in files))
    for op in ops[:top]:
        cells = []
        for s, t in zip(sums, tot):
            ex, sm = s[0].get(op, [0.0, 0.0])
            cells.append(f"| {ex:>16,.0f} {100 * sm / t:>6.1f}%          ")
        print(op.ljust(28) + "".join(cells))
    print()
    reasons = sorted({r for _, br in sums for r in br}, key=lambda r: -max(s[1].get(r, 0) for s in sums))
    print("stall reason".ljust(28) + "".join(f"| {p[-28:]:>28} % samples " for p in files))
    for r in reasons[:top]:
        print(r[:28].ljust(28) + "".join(f"| {100 * s[1].get(r, 0) / t:>37.1f}% " for s, t in zip(sums, tot)))
    bodies = [tile_body(rows) for rows in data]
    print("\nloop body (sites executed the most-weighted count, per tile and warp): "
          + ", ".join(f"{p[-28:]}: {sum(b.values())} sites x {c:,.0f}"
                      for p, (c, b) in zip(files, bodies)))
    body_ops = sorted({op for _, b in bodies for op in b}, key=lambda op: -max(b[op] for _, b in bodies))
    for op in body_ops:
        counts = [b[op] for _, b in bodies]
        if len(set(counts)) > 1 or len(files) == 1:
            print(op.ljust(28) + "".join(f"| {c:>8} " for c in counts))
    for p, rows in zip(files, data):
        print(f"\nhottest instructions of {p}:")
        for sass, ex, samples, reasons in sorted(rows, key=lambda r: -r[2])[:top]:
            why = " ".join(f"{k}={v:.0f}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:2])
            print(f"  {samples:>9.0f} ex={ex:>12,.0f} {sass[:60]:<60} {why}")
    if reason:
        for p, rows in zip(files, data):
            print(f"\nsites of stall reason {reason!r} in {p} (samples, % of all, executed, the "
                  "instruction, the one before it):")
            for i, n, share, ex, sass, before in reason_sites(rows, reason, top):
                print(f"  #{i:<5} {n:>8.0f} {100 * share:>5.1f}% ex={ex:>11,.0f} {sass[:44]:<44} after {before[:44]}")


if __name__ == "__main__":
    main(sys.argv[1:])
