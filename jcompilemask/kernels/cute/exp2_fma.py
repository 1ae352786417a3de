"""exp2 on the FMA pipe: the PTX of ``common.exp2_fma`` and its constants (no cutlass
import: the CPU test ``tests/test_exp2_emulation.py`` models the same arithmetic).

2^x = 2^j * 2^f, j = floor(x), f = x - j in [0, 1):

1. clamp x to [-127, 128] with ``max.NaN`` / ``min.NaN`` (NaN stays NaN);
2. t = x + 1.5 * 2^23 rounded toward -inf (``add.rm``): t = floor(x) + 1.5 * 2^23 exactly,
   floor(x) in its low mantissa bits; j = t - 1.5 * 2^23 and f = x - j, both exact;
3. p = c0 + f (c1 + f (c2 + f c3)) ~ 2^f (3 FFMA), c0 = 1 exactly, c1..c3 the cubic of
   least maximum relative error on [0, 1) (8.56e-5), rounded to float32;
4. s = 2^j from t's bits: (t << 23) + (127 << 23) = (j + 127) << 23 mod 2^32, so j = -127
   (x < -126, -inf) gives s = +0.0 and j = 128 (x >= 128, +inf) gives s = +inf;
5. 2^x = p * s (an FMUL, not an integer add on p's exponent: a NaN p stays NaN, and
   p >= 1, s >= 2^-126 or 0 leave no denormal).

Relative error <= 8.6e-5 over x in [-126, 128) (float32 arithmetic throughout); results
below 2^-126 are exactly 0, as ``ex2.approx.ftz`` flushes them. 10 instructions on the FMA
and ALU pipes (2 FMNMX, 3 FADD, 3 FFMA, LEA, FMUL) instead of one MUFU.EX2.
"""

# c0..c3 of p(f): 1, 0.69511729, 0.22764353, 0.07706803 (float32 bit patterns)
EXP2_POLY_BITS = (0x3F800000, 0x3F31F335, 0x3E691B63, 0x3D9DD5D8)
EXP2_ROUND_BITS = 0x4B400000        # 1.5 * 2^23
EXP2_CLAMP_BITS = (0xC2FE0000, 0x43000000)      # -127, 128


def emulated_column(c: int, per_8: int) -> bool:
    """Whether column `c` of a thread's S^T fragment computes P^T's exp2 here rather than on
    the MUFU (``BackwardConfig.exp2_emu`` = `per_8`): `per_8` of every 8 consecutive columns,
    evenly spaced (2: columns 3, 7, 11, 15; 4: the odd ones; 8: all)."""
    return (c + 1) * per_8 // 8 != c * per_8 // 8


def _f(bits: int) -> str:
    return f"0f{bits:08X}"


EXP2_FMA_PTX = (
    "{\n"
    ".reg .f32 xc, t, j, f, p, s;\n"
    ".reg .b32 e;\n"
    f"max.NaN.f32 xc, $1, {_f(EXP2_CLAMP_BITS[0])};\n"
    f"min.NaN.f32 xc, xc, {_f(EXP2_CLAMP_BITS[1])};\n"
    f"add.rm.f32 t, xc, {_f(EXP2_ROUND_BITS)};\n"
    f"sub.rn.f32 j, t, {_f(EXP2_ROUND_BITS)};\n"
    "sub.rn.f32 f, xc, j;\n"
    f"fma.rn.f32 p, f, {_f(EXP2_POLY_BITS[3])}, {_f(EXP2_POLY_BITS[2])};\n"
    f"fma.rn.f32 p, p, f, {_f(EXP2_POLY_BITS[1])};\n"
    f"fma.rn.f32 p, p, f, {_f(EXP2_POLY_BITS[0])};\n"
    "mov.b32 e, t;\n"
    "shl.b32 e, e, 23;\n"
    "add.s32 e, e, 0x3F800000;\n"
    "mov.b32 s, e;\n"
    "mul.rn.f32 $0, p, s;\n"
    "}"
)


# --------------------------------------------------------------------------- 1 / y
# ``common.rcp_fma`` (``BackwardConfig.rcp_emu``): the soft cap's tanh takes 1 / (e + 1),
# e = 2^(2 scale s / cap log2 e) >= 0, on the MUFU (``rcp.approx``); this computes it on the
# FMA pipe for y in [1, +inf] (and NaN):
#
# 1. clamp y to at most 2^125 with ``min.NaN`` (NaN stays NaN; +inf -> 2^125, whose
#    reciprocal is still a normal float, so t = 1 - 2 / y rounds to 1 as tanh saturates);
# 2. r0 = float(RCP_SEED - bits(y)): the exponent negated and the mantissa linearly
#    approximated, relative error <= 5.1% over y in [1, 2^125];
# 3. three Newton steps r <- r + r (1 - y r) (a negation and 2 FFMA each: e = fma(-y, r,
#    1); r = fma(r, e, r)); the error squares each step: 2.6e-3, 6.6e-6, then float32
#    rounding.
#
# Within 1 ulp of the correctly rounded 1 / y (relative error <= 6e-8; the numpy model in
# tests/test_exp2_emulation.py), as ``rcp.approx.f32`` is. ~8 instructions on the FMA / ALU
# pipes (FMNMX, IADD, 6 FFMA; ptxas folds the negations) instead of one MUFU.RCP.
RCP_SEED = 0x7EF311C3
RCP_CLAMP_BITS = 0x7E000000         # 2^125
RCP_STEPS = 3

RCP_FMA_PTX = (
    "{\n"
    ".reg .f32 yc, r, e;\n"
    ".reg .b32 b;\n"
    f"min.NaN.f32 yc, $1, {_f(RCP_CLAMP_BITS)};\n"
    "mov.b32 b, yc;\n"
    f"sub.s32 b, {RCP_SEED}, b;\n"
    "mov.b32 r, b;\n"
    + "".join("neg.f32 e, yc;\n"
              "fma.rn.f32 e, e, r, 0f3F800000;\n"
              "fma.rn.f32 r, r, e, r;\n" for _ in range(RCP_STEPS))
    + "mov.b32 $0, r;\n"
    "}"
)
