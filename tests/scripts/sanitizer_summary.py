"""Summarise a compute-sanitizer log: error kinds, and per (kind, kernel, pc) the warps and
blocks that hit it, so a log with thousands of repeated reports reads in a few lines.

    python3 tests/scripts/sanitizer_summary.py sanitize.log
"""
import collections
import re
import sys


def summarise(lines):
    groups = collections.defaultdict(lambda: (set(), set(), [0]))
    kind = kernel = pc = None
    for line in lines:
        line = line.rstrip("\n")
        m = re.match(r"=+ (?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE)(\S.*(?:detected|error|Error|hazard).*)", line)
        if m and "Host Frame" not in line:
            kind, kernel, pc = m.group(1).strip(), None, None
            continue
        m = re.match(r"=+\s+at (\S+)\+(0x[0-9a-f]+)", line)
        if m and kind:
            name = m.group(1)
            kernel = ("backward" if "Backward" in name else "forward" if "Forward" in name
                      else name[:60])
            pc = m.group(2)
            continue
        m = re.match(r"=+\s+by thread \((\d+),(\d+),(\d+)\) in block \((\d+),(\d+),(\d+)\)", line)
        if m and kind:
            t = int(m.group(1))
            warps, blocks, count = groups[(kind, kernel, pc)]
            warps.add(t // 32)
            blocks.add(tuple(int(g) for g in m.group(4, 5, 6)))
            count[0] += 1
    return groups


def main(path):
    with open(path, errors="replace") as f:
        lines = f.readlines()
    for line in lines:
        if "SUMMARY" in line:
            print(line.strip())
    for (kind, kernel, pc), (warps, blocks, count) in sorted(summarise(lines).items(),
                                                              key=lambda kv: -kv[1][2][0]):
        print(f"{count[0]:6d} x {kind} | {kernel} +{pc} | warps {sorted(warps)} | "
              f"{len(blocks)} blocks, e.g. {sorted(blocks)[:4]}")


if __name__ == "__main__":
    main(sys.argv[1])
