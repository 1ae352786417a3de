"""The CPU instruction-set flags a kernel pack's host launchers need (scripts/kernel_cache.sh).

The DSL compiles each kernel's host launcher for LLVM's native target, i.e. the packing
machine's CPU, and takes no other host CPU when the kernel is exported for tvm-ffi. A pack
made on one machine must therefore only be loaded where the CPU runs every instruction the
launchers hold. Requiring every flag of the packing CPU is too strict: session 34 packed on
an AMD EPYC with ``avx512_vp2intersect`` and the device's Intel CPU, which lacks it, refused
the pack, although no launcher held a single VP2INTERSECT (LLVM never emits one on its own).

This script disassembles the packed objects (``objdump -d``) and prints the flags the device
must have: the packing CPU's base vector / bit-manipulation flags (always kept: the
launchers use AVX-512F/BW/DQ/VL moves, masks and ``vpmullq``, and BMI's ``bzhi`` / ``mulx``),
plus each optional extension only where an instruction that needs it occurs. An optional
flag that this table does not know stays required (never too permissive).

    python3 scripts/host_flags.py CPU_FLAGS_FILE KERNEL.o ...   # prints the flags, one line
    python3 scripts/host_flags.py CPU_FLAGS_FILE - < LIST        # the objects' paths, a line each
    python3 scripts/host_flags.py --self-test
"""
from __future__ import annotations

import re
import subprocess
import sys

# Flags kept whenever the packing CPU has them (the launchers' ordinary code).
BASE = ("avx", "avx2", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
        "bmi1", "bmi2", "fma", "f16c", "movbe", "popcnt")

# Optional extensions: the mnemonics (regular expressions over objdump's AT&T mnemonic)
# that need them. Anything else of the packing CPU's vector flags is kept as required.
OPTIONAL = {
    "avx512_vp2intersect": r"vp2intersect[dq]",
    "avx512_vnni": r"vpdp(busd|busds|wssd|wssds)",
    "avx_vnni": r"\{vex\}|vpdp(busd|busds|wssd|wssds)",
    "avx512_bf16": r"vcvtne2ps2bf16|vcvtneps2bf16[xy]?|vdpbf16ps",
    "avx512_bitalg": r"vpopcnt[bw]|vpshufbitqmb",
    "avx512_vbmi2": r"vp(compress|expand)[bw]|vpsh[lr]dv?[wdq]",
    "avx512ifma": r"vpmadd52[lh]uq",
    "avx_ifma": r"vpmadd52[lh]uq",
    "avx512vbmi": r"vperm[it]?2?b|vpermb|vpmultishiftqb",
    "avx512_vpopcntdq": r"vpopcnt[dq]",
    "avx512_fp16": r"v\w*ph\b|v\w*sh\b|vmovw",
    "gfni": r"v?gf2p8\w+",
    "vaes": r"vaes\w+",
    "vpclmulqdq": r"vpclmul\w*",
    "sha_ni": r"sha(1|256)\w+",
    "adx": r"ad[co]x\w*",
}
# F16C's conversions end in "ph" / "ps" too; they are not AVX512-FP16.
NOT_FP16 = re.compile(r"vcvtph2ps[xy]?|vcvtps2ph[xy]?")


def mnemonics(objects: list[str]) -> set[str]:
    """Every instruction mnemonic in the objects' code sections (objdump -d)."""
    seen: set[str] = set()
    for path in objects:
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], check=True,
                              capture_output=True, text=True).stdout
        for line in text.splitlines():
            parts = line.split("\t")
            if len(parts) >= 2 and parts[1].strip():
                seen.add(parts[1].split()[0])
    return seen


def needed(cpu_flags: set[str], used: set[str]) -> list[str]:
    """The packing CPU's flags a loading CPU must have, given the mnemonics `used`."""
    out = []
    for flag in sorted(cpu_flags):
        if flag in BASE:
            out.append(flag)
        elif flag in OPTIONAL:
            pat = re.compile(rf"(?:{OPTIONAL[flag]})$")
            hits = [m for m in used if pat.match(m)]
            if flag == "avx512_fp16":
                hits = [m for m in hits if not NOT_FP16.fullmatch(m)]
            if hits:
                out.append(flag)
        elif re.match(r"(avx|bmi|fma$|f16c$|movbe$|popcnt$|adx$|sha_ni$|gfni$|vaes$|vpclmulqdq$)",
                      flag):
            out.append(flag)   # a vector flag this table does not know: stays required
    return out


def self_test() -> None:
    cpu = {"avx", "avx2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "bmi1",
           "bmi2", "avx512_vp2intersect", "avx512_vnni", "avx512_fp16", "avx512vbmi", "gfni",
           "avx10_1", "sse4_2"}
    used = {"mov", "vmovups", "vpmullq", "bzhi", "vcvtph2ps", "vpermt2q"}
    got = needed(cpu, used)
    assert "avx512_vp2intersect" not in got and "avx512_vnni" not in got, got
    assert "avx512_fp16" not in got, got          # vcvtph2ps is F16C
    assert "avx512vbmi" not in got, got           # vpermt2q is AVX-512F
    assert "avx10_1" in got, got                  # unknown vector flag: kept
    assert "sse4_2" not in got and "avx512dq" in got, got
    assert "avx512vbmi" in needed(cpu, used | {"vpermt2b"})
    assert "avx512_vp2intersect" in needed(cpu, used | {"vp2intersectd"})
    assert "avx512_fp16" in needed(cpu, used | {"vaddph"})
    print("host_flags self-test passed")


def main(argv: list[str]) -> int:
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    cpu_flags = set(open(argv[1]).read().split())
    objects = [l.strip() for l in sys.stdin if l.strip()] if argv[2:] == ["-"] else argv[2:]
    print(" ".join(needed(cpu_flags, mnemonics(objects))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
